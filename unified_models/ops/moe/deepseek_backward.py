"""Differentiable DeepSeek-V4 MoE: routers and clamped-SwiGLU experts (forward from the ops of
:mod:`.deepseek`, backward by recomputation in plain torch, DESIGN.md rule 11).

* **routers** (:class:`~.backward.RouteFn` with the sqrt-softplus score): ``w = rsf * s[ids] / (sum s[ids] + eps)``,
  ``s = sqrt(softplus(x W^T))``, differentiated w.r.t. ``x`` and the gate weight through the
  selected scores; ids (top-k or ``tid2eid``) are constants, the bias only selects (no gradient);
* **experts** (:class:`SwigluExpertsFn`): per expert over its assignments (experts of one padded
  assignment count batched: :func:`.backward.grouped_assignments`), the forward's math
  ``y = w2(s w)``, ``s = silu(min(x w1^T, L)) * clamp(x w3^T, -L, L)``, differentiated by hand in fp32
  (fp64 for fp64 inputs; the elementwise ``s`` by autograd): the routing weight is a row scaling, so
  ``dh = g w2`` and ``d w2 = g^T (s w)`` take ``g`` itself (exact in bf16 for a bf16 model: one tensor-core
  term), ``dw = <g w2, s>``, and ``ds = w dh`` goes back through the clamps and the two input GEMMs;
  every GEMM through ``grad_matmul`` (tensor cores on CUDA in a bf16 model); the output ``y`` is never
  recomputed. Gradients to ``x``, the routing weights, ``shared`` (identity) and the three weight
  stacks; the roundings (``h``, the output) pass gradients straight through; the clamps pass no
  gradient where they clip (torch's ``clamp`` rule);
* **MXFP4 (W4A8) and block-FP8 (W8A8) experts**: ``ops.mxfp4.MXFP4Master`` /
  ``ops.fp8_block.FP8BlockMaster`` stacks are quantized by their format's rule on every forward and
  the recomputation uses the dequantized weights, handing ``dL/dW_q`` to the masters unchanged
  (straight-through estimator); the per-token FP8 activation quantization of each such GEMM is
  recomputed with a straight-through gradient (``a + (qdq(a) - a).detach()``), so the weight
  gradients see the quantized activations, as the forward did. Stored codes (``MXFP4Weight``,
  ``FP8BlockExperts``) take no gradient.

Every backward checks the weight-version stamps (:mod:`unified_models.ops.grad.weights`).
Backwards are correct, not batch-invariant.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..grad import helpers as grad_helpers
from ..grad.helpers import acc, needs_grad
from ..grad.weights import check_stamps, stamp
from . import deepseek
from .backward import RouteFn, group_weight, grouped_assignments, put_rows
from .common import MASTERS, ExpertWeight, quantizes_activations, stack_expert
from .deepseek_cpu import fp8_activation_f64
from .deepseek_reference import swiglu


def _sqrt_softplus(logits: torch.Tensor) -> torch.Tensor:
    return torch.sqrt(F.softplus(logits))


def _fp8_values(a: torch.Tensor) -> torch.Tensor:
    """``a`` (``[..., K]``) through the W4A8 / W8A8 activation rule per row, as fp64 values (exact in bf16)."""
    return fp8_activation_f64(a.reshape(-1, a.shape[-1])).view(a.shape)


def _mm(a: torch.Tensor, b: torch.Tensor, half: bool) -> torch.Tensor:
    """A backward GEMM through ``grad_matmul`` (looked up on its module, so tests can emulate the CUDA path):
    in a half-precision model (``half``) bf16 operands as one tensor-core term and fp32 ones split (``split_fp32``),
    else the plain product. Result in the accumulation dtype (fp32; fp64 for fp64 operands)."""
    return grad_helpers.grad_matmul(a, b, split_fp32=half)


class SwigluExpertsFn(torch.autograd.Function):
    """``out = round(sum_k experts(x, w) + shared)``; ``gate``/``up``/``down`` are ``[E, N, K]`` (or one
    expert's ``[N, K]``) master tensors (wrapped in the master type ``masters`` names, e.g.
    ``FP8BlockMaster``, and so quantized on every call; None: used as they are) or stored codes
    (no gradient)."""

    @staticmethod
    def forward(ctx, x_TD, weights_TK, shared_TD, gate, up, down, ids_TK, limit, out_dtype, masters,
                weight_before_down=True):
        ws = (gate, up, down)
        ctx.flat = tuple(isinstance(w, torch.Tensor) and w.dim() == 2 for w in ws)
        ctx.w_dtypes = tuple(w.dtype if isinstance(w, torch.Tensor) else None for w in ws)
        stacks = tuple(stack_expert(cls(w)).quantize() if cls is not None else stack_expert(w)
                       for w, cls in zip(ws, masters))
        out = deepseek.swiglu_experts(x_TD, ids_TK, weights_TK, *stacks, shared_TD, swiglu_limit=limit,
                                      out_dtype=out_dtype, weight_before_down=weight_before_down)
        ctx.save_for_backward(x_TD, weights_TK, ids_TK)
        ctx.stacks, ctx.limit = stacks, limit
        ctx.shared_dtype = shared_TD.dtype if shared_TD is not None else None
        ctx.stamps = stamp(**{n: w if isinstance(w, torch.Tensor) else None for n, w in zip(("w1", "w3", "w2"), ws)})
        return out

    @staticmethod
    def backward(ctx, g_TD):
        check_stamps("swiglu_experts", ctx.stamps)
        x_in, w_in, ids = ctx.saved_tensors
        nx, nw, ns, ng, nu, nd = ctx.needs_input_grad[:6]
        qg, qu, qd = (quantizes_activations(s) for s in ctx.stacks)
        g = acc(g_TD)
        dt = g.dtype if x_in.dtype != torch.float64 else torch.float64
        g, wts = g.to(dt), w_in.to(dt)
        E = ctx.stacks[0].shape[0]
        K = ids.shape[1]
        need = (ng, nu, nd)
        half = torch.bfloat16 if x_in.dtype == torch.bfloat16 else None  # tensor-core GEMMs on CUDA (grad_matmul)
        R, T, D = ids.numel(), ids.shape[0], x_in.shape[1]
        # per assignment (row R: the padding rows' sink), summed over each token's slots at the end
        dx_rows = torch.zeros((R + 1, D), dtype=dt, device=x_in.device) if nx else None
        dw_rows = torch.zeros(R + 1, dtype=dt, device=x_in.device) if nw else None
        dstacks = [torch.zeros(s.shape, dtype=wdt, device=x_in.device) if n else None
                   for s, n, wdt in zip(ctx.stacks, need, ctx.w_dtypes)]
        if nx or nw or any(need):
            mdt = x_in.dtype  # the GEMMs' operands: the input, FP8 activations and weights hold its values exactly
            hm = half is not None
            x_pad = torch.cat([x_in, x_in.new_zeros(1, D)])  # token T: zero input, zero gradient
            # the upstream gradient as a GEMM operand in its own dtype where that holds it exactly (a bf16
            # model's bf16 gradient: one tensor-core term); the routing weight enters as a row scaling
            g_op = g_TD if half is not None and g_TD.dtype == mdt else g
            g_pad = torch.cat([g_op, g_op.new_zeros(1, D)])
            w_pad = torch.cat([wts.reshape(-1), wts.new_zeros(1)])
            for es, es_t, rows, tok in grouped_assignments(ids, E):
                wg, wu, wd = (group_weight(st, es, es_t, mdt) for st in ctx.stacks)  # [G, I, D], [G, I, D], [G, D, I]
                xe, ge = x_pad[tok], g_pad[tok]  # [G, P, D]
                we = w_pad[rows][..., None]  # [G, P, 1]
                keep = (rows < R)[..., None]  # padding rows: exact zeros even beside a non-finite weight
                xq = _fp8_values(xe).to(mdt) if qg or qu else None  # the W4A8 / W8A8 activation (STE)
                pre = [torch.where(keep, _mm(xq if q else xe, m.transpose(1, 2), hm), 0.0)
                       for q, m in ((qg, wg), (qu, wu))]  # [G, P, I] fp32 (fp64)
                with torch.enable_grad():  # the elementwise epilogue only: torch's clamp rule, exact
                    pre = [p.requires_grad_() for p in pre]
                    sw = swiglu(pre[0], pre[1], ctx.limit)
                h = sw.detach() * we  # the down GEMM's input (its bf16 rounding and FP8 rule: straight through)
                # y = h down^T: dh = g down (the row scaling applied after), d down = g^T h
                gd = torch.where(keep, _mm(ge, wd, hm), 0.0) if nx or nw or ng or nu else None  # [G, P, I]
                if nd:
                    hq = _fp8_values(h.to(mdt)).to(mdt) if qd else h  # FP8 values are exact in the model dtype
                    dstacks[2][es_t] = _mm(ge.transpose(1, 2), hq, hm).to(dstacks[2].dtype)
                if nw:
                    put_rows(dw_rows, rows, (gd * sw.detach()).sum(-1))
                if nx or ng or nu:
                    dpre = torch.autograd.grad(sw, pre, gd * we)  # [G, P, I] each
                    if nx:
                        put_rows(dx_rows, rows, _mm(dpre[0], wg, hm) + _mm(dpre[1], wu, hm))
                    for j, q, dp in ((0, qg, dpre[0]), (1, qu, dpre[1])):
                        if need[j]:
                            dstacks[j][es_t] = _mm(dp.transpose(1, 2), xq if q else xe, hm).to(dstacks[j].dtype)
        dx = dx_rows[:R].view(T, K, D).sum(1) if nx else None
        dw = dw_rows[:R].view(T, K) if nw else None
        outs = [(d[0] if flat else d) if d is not None else None for d, flat in zip(dstacks, ctx.flat)]
        return (dx.to(x_in.dtype) if nx else None, dw.to(w_in.dtype) if nw else None,
                g_TD.to(ctx.shared_dtype) if ns else None, *outs, None, None, None, None, None)


def sqrtsoftplus_route(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor, bias_E: torch.Tensor | None = None, *,
                       top_k: int, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.deepseek.sqrtsoftplus_route` (DeepSeek-V4 top-k router), differentiable w.r.t. ``x_TD``
    and ``gate_weight_ED`` through the fp32 weights; ids int32 constants (ties: lower expert index)."""
    cfg = dict(norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
    if needs_grad(x_TD, gate_weight_ED):
        route = lambda x, w, b, **c: deepseek.sqrtsoftplus_route(x, w, b, top_k=top_k, **c)  # noqa: E731
        return RouteFn.apply(x_TD, gate_weight_ED, route, (bias_E,), cfg, _sqrt_softplus, "sqrtsoftplus_route")
    return deepseek.sqrtsoftplus_route(x_TD, gate_weight_ED, bias_E, top_k=top_k, **cfg)


def hash_route(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor, tid2eid_VK: torch.Tensor, input_ids_T: torch.Tensor,
               *, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.deepseek.hash_route` (ids ``tid2eid[input_ids]``), differentiable like :func:`sqrtsoftplus_route`."""
    cfg = dict(norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
    if needs_grad(x_TD, gate_weight_ED):
        return RouteFn.apply(x_TD, gate_weight_ED, deepseek.hash_route, (tid2eid_VK, input_ids_T), cfg,
                             _sqrt_softplus, "hash_route")
    return deepseek.hash_route(x_TD, gate_weight_ED, tid2eid_VK, input_ids_T, **cfg)


def swiglu_experts(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, gate: ExpertWeight,
                   up: ExpertWeight, down: ExpertWeight, shared_TD: torch.Tensor | None = None, *, swiglu_limit: float,
                   out_dtype: torch.dtype | None = None, weight_before_down: bool = True) -> torch.Tensor:
    """:func:`.deepseek.swiglu_experts` (clamped-SwiGLU experts + ordered fp32 combine), differentiable
    w.r.t. ``x_TD``, ``topk_weights_TK``, ``shared_TD`` and the ``[E, N, K]`` weight stacks (tensors,
    or masters, ``ops.mxfp4.MXFP4Master`` / ``ops.fp8_block.FP8BlockMaster``: straight-through to their
    ``weight``; stored codes take no gradient). ``weight_before_down``: where the routing weight
    multiplies (the backward's recomputation is the same for both: the expert is linear in it)."""
    out_dtype = out_dtype or x_TD.dtype
    masters = tuple(type(w) if isinstance(w, MASTERS) else None for w in (gate, up, down))
    raw = tuple(w.weight if m is not None else w for w, m in zip((gate, up, down), masters))
    if needs_grad(x_TD, topk_weights_TK, shared_TD, *(w for w in raw if isinstance(w, torch.Tensor))):
        return SwigluExpertsFn.apply(x_TD, topk_weights_TK, shared_TD, *raw, topk_ids_TK,
                                     float(swiglu_limit), out_dtype, masters, bool(weight_before_down))
    return deepseek.swiglu_experts(x_TD, topk_ids_TK, topk_weights_TK, gate, up, down, shared_TD,
                                   swiglu_limit=swiglu_limit, out_dtype=out_dtype,
                                   weight_before_down=weight_before_down)


def swiglu_shared_expert(x_TD: torch.Tensor, gate_ID: ExpertWeight, up_ID: ExpertWeight, down_DI: ExpertWeight, *,
                         swiglu_limit: float) -> torch.Tensor:
    """:func:`.deepseek.swiglu_shared_expert` (fp32 ``[T, D]``), differentiable w.r.t. ``x_TD`` and the
    three ``[N, K]`` weights (tensors, or block-FP8 / MXFP4 masters: straight-through)."""
    ws = (gate_ID, up_ID, down_DI)
    masters = tuple(type(w) if isinstance(w, MASTERS) else None for w in ws)
    raw = tuple(w.weight if m is not None else w for w, m in zip(ws, masters))
    if needs_grad(x_TD, *(w for w in raw if isinstance(w, torch.Tensor))):
        T = x_TD.shape[0]
        ids = torch.zeros(T, 1, dtype=torch.int32, device=x_TD.device)
        ones = torch.ones(T, 1, dtype=torch.float32, device=x_TD.device)
        return SwigluExpertsFn.apply(x_TD, ones, None, *raw, ids, float(swiglu_limit), torch.float32, masters)
    return deepseek.swiglu_shared_expert(x_TD, gate_ID, up_ID, down_DI, swiglu_limit=swiglu_limit)
