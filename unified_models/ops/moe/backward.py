"""Differentiable MoE: router and experts (forward from the shared kernels, backward by recomputation).

DESIGN.md rule 11. The forwards call the dispatching ops of
:mod:`.dispatch` with grad mode off, so the values are the
kernels' bits with or without a graph. The backwards recompute the math in
fp32 (fp64 for fp64 inputs) in plain torch:

* **router** (:class:`RouteFn`): ``w = rsf * s[ids] / (sum s[ids] + eps)``,
  ``s = sigmoid(x W^T)``, differentiated w.r.t. ``x`` and the gate weight
  through the selected scores; the selected ids are constants (no gradient
  through the discrete choice; the correction bias only selects, so it gets
  none);
* **experts** (:class:`ExpertsFn`): per expert, over its assignments,
  ``u = x up^T``, ``h = relu(u)^2``, ``y = h down^T``, ``out += w y``:
  ``dw = <g, y> = <g down, h>``, ``d down = (w g)^T h = g^T (w h)``, ``du = 2 relu(u) w (g down)``,
  ``d up = du^T x``, ``dx += du up``, ``d shared = g`` (the routing weight a row scaling, so the GEMMs
  take ``g`` itself: exact in bf16 for a bf16 model, one tensor-core term; ``g down`` serves ``dw`` too). The forward's roundings
  (``h`` to bf16, the output) pass gradients straight through. Experts whose
  assignment counts round up to the same padded size (:func:`expert_groups_by_count`)
  run as one batched GEMM per product (zero rows pad them, their products masked
  to zero: exact zeros in every sum, also beside a non-finite weight), so a step
  launches a few dozen kernels per layer, not a few dozen per expert; ``dx`` is
  summed over each token's ``k`` slots in slot order (deterministic: no atomics);
* **NVFP4** (``nvfp4=True`` with bf16 master tensors): the forward quantizes
  the masters by ModelOpt's rule on every call and computes with the
  dequantized weights ``W_q``; the backward uses ``W_q`` for the input
  gradients and hands ``dL/dW_q`` to the masters unchanged (straight-through
  estimator).

Every backward checks the weight-version stamps of the gate/expert weights
(:mod:`unified_models.ops.grad.weights`). Backwards are correct, not batch-invariant.
"""

from __future__ import annotations

import torch

from .._dispatch import host_to_device
from ..grad import helpers as grad_helpers
from ..grad.helpers import acc, grad_matmul, index_add_rows
from ..grad.weights import check_stamps, stamp
from ..nvfp4 import NVFP4Weight, nvfp4_dequantize, nvfp4_quantize
from . import dispatch
from .common import NORM_EPS, ExpertWeight, expert_weight, group_by_expert, stack_expert


def expert_groups_by_count(counts: list[int]) -> list[tuple[int, list[int]]]:
    """Experts with assignments, grouped for batched GEMMs: ``[(P, experts), ...]``, ``P`` the padded
    row count of the group, ascending; experts ascending within a group.

    An expert with ``c`` assignments pads to ``c`` rounded up to a multiple of
    ``2^max(0, floor(log2 c) - 2)``: less than a quarter of ``c`` of zero rows (none below 8), at most
    four sizes per power of two, so a few groups for near-uniform routing and at most
    ``4 log2(max c) + 4`` for any.

    Args:
        counts: assignments per expert (host ints, :func:`group_by_expert`'s counts).
    """
    groups: dict[int, list[int]] = {}
    for e, c in enumerate(counts):
        if c > 0:
            step = 1 << max(0, c.bit_length() - 3)
            groups.setdefault(-(-c // step) * step, []).append(e)
    return sorted(groups.items())


def grouped_assignments(ids_TK: torch.Tensor, num_experts: int):
    """Yield ``(experts, experts_t, rows, tok)`` per group of :func:`expert_groups_by_count`: the group's
    experts (host list and int64 tensor ``[G]``), its assignments ``rows`` ``[G, P]`` (flat ``t*K + k``, expert
    ``experts[i]``'s in row ``i`` in :func:`group_by_expert`'s order; ``T*K`` for a padding slot) and their tokens
    ``tok`` ``[G, P]`` (``T`` for padding). One host sync (the counts) and one host-to-device copy per call."""
    T, K = ids_TK.shape
    R = T * K
    order, counts = group_by_expert(ids_TK, num_experts)
    counts_h = counts.tolist()
    starts = [0]
    for n in counts_h[:-1]:
        starts.append(starts[-1] + n)
    groups = expert_groups_by_count(counts_h)
    if not groups:
        return
    # every group's (experts, counts, first rows) in one host-to-device copy (no sync per group)
    meta = host_to_device(torch.tensor([v for _, es in groups for v in (*es, *(counts_h[e] for e in es),
                                                                      *(starts[e] for e in es))]), ids_TK.device)
    at = 0
    for P, es in groups:
        G = len(es)
        es_t, cnt, first = meta[at:at + G], meta[at + G:at + 2 * G], meta[at + 2 * G:at + 3 * G]
        at += 3 * G
        j = torch.arange(P, device=ids_TK.device)
        valid = j[None, :] < cnt[:, None]  # [G, P]
        rows = torch.where(valid, order[(first[:, None] + j[None, :]).clamp_max(R - 1)], R)
        yield es, es_t, rows, torch.where(valid, rows // K, T)


def put_rows(dst_X: torch.Tensor, rows_GP: torch.Tensor, val_GP: torch.Tensor) -> None:
    """``dst[rows[i, j]] = val[i, j]`` into a zero-initialised ``dst`` whose real rows ``rows`` lists at most
    once (the padding slots all name the sink row ``R``, whose value is dropped): an accumulating scatter
    (:func:`~unified_models.ops.grad.helpers.index_add_rows`), so even the sink's many writes land in a fixed
    order on CUDA and no op of the backward races (``tests/ops/test_backward_determinism.py``).

    Args:
        dst_X: ``[R + 1, ...]`` zeros (fp32 / fp64), written in place; rows_GP: ``[G, P]`` int64 rows;
        val_GP: ``[G, P, ...]`` values (``dst``'s dtype and trailing shape)."""
    index_add_rows(dst_X, rows_GP.reshape(-1), val_GP.reshape(-1, *val_GP.shape[2:]))


def group_weight(w: ExpertWeight, experts: list[int], experts_t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[G, N, K]``: the listed experts' weights as the kernels compute with them (:func:`expert_weight`);
    a tensor stack is indexed (not copied when the group is every expert in order), an NVFP4 stack
    dequantized for the group at once (elementwise: the same values as one expert at a time)."""
    every = experts == list(range(w.shape[0]))
    if isinstance(w, torch.Tensor):
        return w if every else w.index_select(0, experts_t)
    if isinstance(w, NVFP4Weight):
        sub = w if every else NVFP4Weight(*(t.index_select(0, experts_t)
                                            for t in (w.weight, w.weight_scale, w.weight_scale_2)))
        return nvfp4_dequantize(sub, dtype)
    return torch.stack([expert_weight(w, e, dtype) for e in experts])


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts)


def _route_weights(x, w, ids, norm_topk_prob, routed_scaling_factor, score=torch.sigmoid):
    scores = score(x @ w.t())
    if grad_helpers.sorted_accumulate(scores):  # gather's CUDA backward (scatter_add) adds a row's repeated ids with atomics
        sel = scores[torch.arange(ids.shape[0], device=ids.device)[:, None], ids.long()]
    else:
        sel = scores.gather(1, ids.long())
    if norm_topk_prob:
        sel = sel / (sel.sum(-1, keepdim=True) + NORM_EPS)
    return sel * routed_scaling_factor


class RouteFn(torch.autograd.Function):
    """``(weights_TK, ids_TK) = route(x, W, *args, **cfg)`` for a router whose weights are
    ``score(x W^T)`` gathered at the selected ids (normalised, scaled); gradients of the weights
    to ``x`` and ``W`` by recomputing that formula in fp32 (fp64 for fp64 inputs), the ids
    constant. ``score`` is the elementwise scoring function (``torch.sigmoid`` for Nemotron-H;
    DeepSeek-V4's ``sqrt(softplus)`` in :mod:`.deepseek_backward`); ``name`` names the op in a
    stale-weight error."""

    @staticmethod
    def forward(ctx, x_TD, gate_ED, route, args, cfg, score, name):
        weights, ids = route(x_TD, gate_ED, *args, **cfg)
        ctx.mark_non_differentiable(ids)
        ctx.save_for_backward(x_TD, ids)
        ctx.gate, ctx.cfg, ctx.score, ctx.name = gate_ED, cfg, score, name
        ctx.stamps = stamp(gate_weight=gate_ED)
        return weights, ids

    @staticmethod
    def backward(ctx, g_TK, _g_ids):
        check_stamps(ctx.name, ctx.stamps)
        x_in, ids = ctx.saved_tensors
        w_in = ctx.gate
        nx, nw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_TK is None or not (nx or nw):
            return None, None, None, None, None, None, None
        dt = torch.float64 if torch.float64 in (x_in.dtype, w_in.dtype) else torch.float32
        with torch.enable_grad():
            x = x_in.detach().to(dt).requires_grad_(nx)
            w = w_in.detach().to(dt).requires_grad_(nw)
            out = _route_weights(x, w, ids, ctx.cfg["norm_topk_prob"], ctx.cfg["routed_scaling_factor"], ctx.score)
            want = [t for t, need in ((x, nx), (w, nw)) if need]
            grads = list(torch.autograd.grad(out, want, g_TK.to(dt)))
        dx = grads.pop(0).to(x_in.dtype) if nx else None
        dw = grads.pop(0).to(w_in.dtype) if nw else None
        return dx, dw, None, None, None, None, None


class ExpertsFn(torch.autograd.Function):
    """``out = combine(experts(x), weights) + shared``; ``up``/``down`` are master tensors
    (quantized here when ``nvfp4``) or fixed :class:`NVFP4Weight` (no gradient)."""

    @staticmethod
    def forward(ctx, x_TD, weights_TK, shared_TD, up, down, ids_TK, nvfp4, out_dtype):
        ctx.flat = tuple(isinstance(w, torch.Tensor) and w.dim() == 2 for w in (up, down))  # one expert [N, K]
        up_q, down_q = (stack_expert(w) for w in (up, down))
        up_q = nvfp4_quantize(up_q) if nvfp4 and isinstance(up_q, torch.Tensor) else up_q
        down_q = nvfp4_quantize(down_q) if nvfp4 and isinstance(down_q, torch.Tensor) else down_q
        out = dispatch.moe_experts(x_TD, ids_TK, weights_TK, up_q, down_q, shared_TD, out_dtype)
        ctx.save_for_backward(x_TD, weights_TK, ids_TK)
        ctx.up, ctx.down = up_q, down_q
        ctx.up_dtype = up.dtype if isinstance(up, torch.Tensor) else None
        ctx.down_dtype = down.dtype if isinstance(down, torch.Tensor) else None
        ctx.shared_dtype = shared_TD.dtype if shared_TD is not None else None
        ctx.stamps = stamp(up_proj=up if isinstance(up, torch.Tensor) else None,
                           down_proj=down if isinstance(down, torch.Tensor) else None)
        return out

    @staticmethod
    def backward(ctx, g_TD):
        check_stamps("moe_experts", ctx.stamps)
        x_in, w_in, ids = ctx.saved_tensors
        nx, nw, ns, nu, nd = ctx.needs_input_grad[:5]
        g = acc(g_TD)
        dt = g.dtype if x_in.dtype != torch.float64 else torch.float64
        g = g.to(dt)
        up, down = ctx.up, ctx.down
        wts = w_in.to(dt)
        E, I, D = up.shape
        T, K = ids.shape
        half = x_in.dtype in (torch.bfloat16, torch.float16)  # a bf16 model: its fp32 intermediates split too
        # weight gradients go straight into buffers of the masters' dtype; dx and dw per assignment
        # (row R: the padding rows' sink), summed over each token's slots at the end
        R = T * K
        dx_rows = torch.zeros((R + 1, D), dtype=dt, device=x_in.device) if nx else None
        dw_rows = torch.zeros(R + 1, dtype=dt, device=x_in.device) if nw else None
        dup = torch.zeros((E, I, D), dtype=ctx.up_dtype, device=x_in.device) if nu else None
        ddown = torch.zeros((E, D, I), dtype=ctx.down_dtype, device=x_in.device) if nd else None
        if nx or nw or nu or nd:
            x_pad = torch.cat([x_in, x_in.new_zeros(1, D)])  # token T: the padding rows' zero input
            # the upstream gradient as a GEMM operand: in its own dtype where that holds it exactly (a bf16
            # model's bf16 gradient: one tensor-core term, not an fp32 hi + lo pair)
            g_op = g_TD if half and g_TD.dtype == x_in.dtype else g
            g_pad = torch.cat([g_op, g_op.new_zeros(1, D)])
            w_pad = torch.cat([wts.reshape(-1), wts.new_zeros(1)])
            for es, es_t, rows, tok in grouped_assignments(ids, E):
                # GEMM operands in their stored dtype (bf16 on tensor cores, fp32 accumulation: grad_matmul)
                wu = group_weight(up, es, es_t, x_in.dtype)  # [G, I, D]
                wd = group_weight(down, es, es_t, x_in.dtype)  # [G, D, I]
                xe, ge = x_pad[tok], g_pad[tok]  # [G, P, D]
                keep = (rows < R)[..., None]  # padding rows stay exact zeros even beside a non-finite weight
                u = torch.where(keep, grad_matmul(xe, wu.transpose(1, 2)).to(dt), 0.0)
                r = torch.relu(u)
                h = r * r
                wr = w_pad[rows][..., None]  # [G, P, 1]: each assignment's routing weight (0 on padding)
                # dy = w g is a row scaling, so dy down = w (g down) and dy^T h = g^T (w h): the GEMMs take g
                # itself; and dw = <g, h down^T> = <g down, h> reuses g down (no GEMM of its own)
                gd = torch.where(keep, grad_matmul(ge, wd).to(dt), 0.0) if nw or nx or nu else None  # [G, P, I]
                if nw:
                    put_rows(dw_rows, rows, (gd * h).sum(-1))
                if nd:
                    ddown[es_t] = grad_matmul(ge.transpose(1, 2), h * wr, split_fp32=half).to(ddown.dtype)
                if nx or nu:
                    du = gd * wr * (2.0 * r)
                    if nu:
                        dup[es_t] = grad_matmul(du.transpose(1, 2), xe).to(dup.dtype)
                    if nx:
                        put_rows(dx_rows, rows, grad_matmul(du, wu).to(dt))
        dx = dx_rows[:R].view(T, K, D).sum(1) if nx else None
        dw = dw_rows[:R].view(T, K) if nw else None
        return (dx.to(x_in.dtype) if nx else None,
                dw.to(w_in.dtype) if nw else None,
                g_TD.to(ctx.shared_dtype) if ns else None,
                (dup[0] if ctx.flat[0] else dup) if nu else None,
                (ddown[0] if ctx.flat[1] else ddown) if nd else None,
                None, None, None)


def moe_route(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor, e_score_correction_bias_E: torch.Tensor | None = None,
              *, top_k: int, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
              routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ops.moe.moe_route` (sigmoid top-k router), differentiable w.r.t. ``x_TD`` and
    ``gate_weight_ED`` through the returned fp32 weights; ids are int32 constants.

    Returns:
        ``(weights_TK fp32, ids_TK int32)``, slots best first (ties: lower expert index).
    """
    cfg = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
               routed_scaling_factor=routed_scaling_factor)
    if _needs_grad(x_TD, gate_weight_ED):
        return RouteFn.apply(x_TD, gate_weight_ED, dispatch.moe_route, (e_score_correction_bias_E,), cfg,
                             torch.sigmoid, "moe_route")
    return dispatch.moe_route(x_TD, gate_weight_ED, e_score_correction_bias_E, **cfg)


def moe_experts(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                up: ExpertWeight, down: ExpertWeight, shared_TD: torch.Tensor | None = None, *,
                nvfp4: bool = False, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`ops.moe.moe_experts` (relu2 experts + ordered fp32 combine), differentiable w.r.t.
    ``x_TD``, ``topk_weights_TK``, ``shared_TD`` and master expert weights.

    Args:
        up, down: ``[E, I, D]`` / ``[E, D, I]`` tensors (bf16 masters), or
            :class:`NVFP4Weight` (e.g. loaded from a ModelOpt checkpoint; no gradient).
        nvfp4: quantize tensor masters to NVFP4 by ModelOpt's rule on every call
            (the trainer's W4A16 path; straight-through gradient to the masters).
        out_dtype: default ``x_TD.dtype``.
    """
    out_dtype = out_dtype or x_TD.dtype
    if _needs_grad(x_TD, topk_weights_TK, shared_TD, up, down):
        if any(isinstance(w, torch.Tensor) and w.dim() != 3 for w in (up, down)):
            raise ValueError(f"moe_experts: expert weights must be [E, N, K], got {list(up.shape)}, "
                             f"{list(down.shape)}")
        return ExpertsFn.apply(x_TD, topk_weights_TK, shared_TD, up, down, topk_ids_TK, nvfp4, out_dtype)
    if nvfp4:
        up = nvfp4_quantize(up) if isinstance(up, torch.Tensor) else up
        down = nvfp4_quantize(down) if isinstance(down, torch.Tensor) else down
    return dispatch.moe_experts(x_TD, topk_ids_TK, topk_weights_TK, up, down, shared_TD, out_dtype)


def moe_shared_expert(x_TD: torch.Tensor, up_ID: ExpertWeight, down_DI: ExpertWeight, *,
                      nvfp4: bool = False) -> torch.Tensor:
    """:func:`ops.moe.moe_shared_expert` (fp32 ``[T, D]``), differentiable w.r.t. ``x_TD`` and master
    weights (``nvfp4`` as in :func:`moe_experts`)."""
    T = x_TD.shape[0]
    ids = torch.zeros(T, 1, dtype=torch.int32, device=x_TD.device)
    ones = torch.ones(T, 1, dtype=torch.float32, device=x_TD.device)
    if _needs_grad(x_TD, up_ID, down_DI):  # 2-D masters go in as they are (their stamps, their grads)
        return ExpertsFn.apply(x_TD, ones, None, up_ID, down_DI, ids, nvfp4, torch.float32)
    return moe_experts(x_TD, ids, ones, stack_expert(up_ID), stack_expert(down_DI), None,
                       nvfp4=nvfp4, out_dtype=torch.float32)
