"""DeepSeek-V4 MoE ops without autograd: sqrt-softplus router, hash router, clamped-SwiGLU experts.

Formulas: transformers 5.19 ``models/deepseek_v4/modeling_deepseek_v4.py``. Shapes: T tokens,
D hidden, E routed experts, K top-k, R = T*K assignments, I expert width, V vocabulary.

**Router** (:func:`sqrtsoftplus_route`; ``DeepseekV4TopKRouter``):

1. ``logits = x W^T`` from ONE fp32-output GEMM (:func:`.dispatch.router_logits`, the
   batch-invariant linear);
2. ``s = sqrt(softplus(logits))`` in fp32 (CPU: fixed ``[16, E padded to 64]`` tiles;
   CUDA: torch's elementwise functors, the same for every element);
3. selection ``c = s + bias`` (fp32; the bias is used ONLY for selection), top-k of ``c`` as a
   total order (:func:`.dispatch.topk_total_order`: ``(c, index)`` packed into one int64 key,
   **among equal scores the lower expert index wins**, ``-0.0 == +0.0``); slots best first,
   which is the combine's accumulation order (transformers' ``topk(sorted=False)`` leaves its
   slot order unspecified and sums per expert);
4. weights ``s`` (not ``c``) at the selected experts; with ``norm_topk_prob`` divided by
   ``(w_0 + ... + w_{K-1}) + 1e-20`` (the sum in slot order); then times ``routed_scaling_factor``.

**Hash router** (:func:`hash_route`; ``DeepseekV4HashRouter``): the ids are
``tid2eid[input_ids]`` (``[V, K]`` table, slot order = the table's column order); the
weights are step 4 on the same scores ``s`` (the router GEMM still runs; no bias).

**Experts** (:func:`swiglu_experts`; ``DeepseekV4Experts``): per assignment ``(t, k)`` of
expert ``e`` with weight ``w``: ``g = fp32(x w1_e^T)``, ``u = fp32(x w3_e^T)``,
``h = round_x((silu(min(g, L)) * clamp(u, -L, L)) * w)`` (fp32 epilogue, ONE rounding;
the clamp is ``DeepseekV4Experts._apply_gate``), ``y = fp32(h w2_e^T)``. The routing weight
is applied BEFORE the down projection, in fp32, as DeepSeek's inference code does
(transformers multiplies the down projection's output instead: the same in exact
arithmetic). **Combine**: ``out_t = round((0 + y_t0) + ... + y_t,K-1 + shared_t)`` in fp32 in
slot order (:func:`.dispatch.moe_combine` with unit weights: ``1 * y`` is ``y`` exactly),
``shared_t`` the shared expert's fp32 output (:func:`swiglu_shared_expert`: the same kernel,
one expert, weight 1) added before the single rounding.

**MXFP4 experts** (DeepSeek-V4-Flash, :mod:`unified_models.ops.mxfp4`): W4A8. The weight is
dequantized exactly (``e2m1 * 2^e``); the GEMM's activation (``x`` for ``w1``/``w3``, the rounded
``h`` for ``w2``) is quantized per token to FP8 with 1x128 ue8m0 tiles and dequantized exactly
(DeepSeek's ``act_quant`` before its ``fp4_gemm``); then the same exact dot product rounded once
to fp32. A token's codes depend on its own row only, so its output never depends on the batch.

GPU (CUDA tensors, or ``UM_OPS_BACKEND=triton``): the router GEMM is the Triton linear, steps 2-4
(and the hash router's gather and weights) one Triton kernel per tile of tokens, the experts the
grouped gate+up / down GEMMs, and the combine the Triton combine (:mod:`.deepseek_triton`: same
formulas and rounding points, GPU arithmetic; tolerances in ``tests/ops/test_deepseek_moe.py``).
MXFP4 (W4A8) experts have no Triton kernel yet and raise ``NotImplementedError`` there (never
another rule).
"""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from ..fp8_block.experts import FP8BlockExperts
from .common import (NORM_EPS, ExpertWeight, check_expert_args, expert_weight, quantizes_activations, resolve_expert,
                     stack_expert)
from .deepseek_cpu import ACT_TILE, SCORE_COLS, fp8_activation_f64, sqrtsoftplus_torch, swiglu_expert_outputs_torch
from .dispatch import moe_combine, router_logits, topk_total_order

__all__ = ["sqrtsoftplus_scores", "topk_slot_weights", "sqrtsoftplus_select", "sqrtsoftplus_route", "hash_select",
           "hash_route", "swiglu_expert_outputs", "swiglu_experts", "swiglu_shared_expert", "SCORE_COLS"]


def sqrtsoftplus_scores(logits_TE: torch.Tensor) -> torch.Tensor:
    """``sqrt(softplus(logits))``, fp32 ``[T, E]`` (transformers ``SqrtSoftplusActivation``); row-invariant."""
    if logits_TE.device.type == "cpu":
        return sqrtsoftplus_torch(logits_TE)
    return torch.sqrt(torch.nn.functional.softplus(logits_TE.float()))


def topk_slot_weights(scores_TE: torch.Tensor, ids_TK: torch.Tensor, *, norm_topk_prob: bool,
                      routed_scaling_factor: float) -> torch.Tensor:
    """Router step 4: ``s`` gathered at ``ids`` (fp32 ``[T, K]``), divided by their slot-order sum + 1e-20
    when ``norm_topk_prob``, times ``routed_scaling_factor`` (elementwise, fixed order)."""
    w = scores_TE.gather(1, ids_TK.long())
    if norm_topk_prob:
        den = w[:, 0]
        for k in range(1, w.shape[1]):
            den = den + w[:, k]
        w = w / (den + NORM_EPS)[:, None]
    return w * float(routed_scaling_factor)


def _check_logits(logits_TE: torch.Tensor, what: str) -> tuple[int, int]:
    if logits_TE.dim() != 2:
        raise ValueError(f"{what}: logits must be [T, E], got {tuple(logits_TE.shape)}")
    return tuple(logits_TE.shape)


def sqrtsoftplus_select(logits_TE: torch.Tensor, bias_E: torch.Tensor | None, *, top_k: int,
                        norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router steps 2-4 (package doc) from fp32 logits ``[T, E]``.

    Returns:
        ``(weights_TK fp32, ids_TK int32)``, slots best first (ties: lower expert index).

    Raises:
        ValueError: ``top_k`` outside ``[1, E]``, bias not ``[E]``.
    """
    T, E = _check_logits(logits_TE, "sqrtsoftplus_select")
    if not 1 <= top_k <= E:
        raise ValueError(f"sqrtsoftplus_select: top_k = {top_k} must be in [1, {E}] (n_routed_experts)")
    if bias_E is not None and tuple(bias_E.shape) != (E,):
        raise ValueError(f"sqrtsoftplus_select: bias must be [{E}], got {tuple(bias_E.shape)}")
    if use_triton(logits_TE):
        from .deepseek_triton import sqrtsoftplus_select_triton

        return sqrtsoftplus_select_triton(logits_TE.float(), bias_E, top_k=top_k, norm_topk_prob=norm_topk_prob,
                                          routed_scaling_factor=routed_scaling_factor)
    scores = sqrtsoftplus_scores(logits_TE)
    choice = scores + bias_E.float() if bias_E is not None else scores
    ids = topk_total_order(choice, top_k)
    w = topk_slot_weights(scores, ids, norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)
    return w, ids.to(torch.int32)


def _check_x_gate(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor, what: str) -> None:
    if x_TD.dim() != 2 or gate_weight_ED.dim() != 2 or x_TD.shape[1] != gate_weight_ED.shape[1]:
        raise ValueError(f"{what}: x {tuple(x_TD.shape)} and gate weight {tuple(gate_weight_ED.shape)} do not match")


def sqrtsoftplus_route(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor, bias_E: torch.Tensor | None, *,
                       top_k: int, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 top-k router (package doc, steps 1-4; ``DeepseekV4TopKRouter``).

    Args:
        x_TD: ``[T, D]`` activations (bf16 or fp32).
        gate_weight_ED: ``[E, D]`` router weight (``ffn.gate.weight``).
        bias_E: fp32 ``[E]`` selection bias (``ffn.gate.bias``) or None.
        top_k: ``num_experts_per_tok``.
        norm_topk_prob, routed_scaling_factor: step 4.

    Returns:
        ``(weights_TK fp32, ids_TK int32)``; row ``t`` depends only on ``x_TD[t]``.

    Raises:
        ValueError: shapes or ``top_k`` inconsistent.
    """
    _check_x_gate(x_TD, gate_weight_ED, "sqrtsoftplus_route")
    return sqrtsoftplus_select(router_logits(x_TD, gate_weight_ED), bias_E, top_k=top_k,
                               norm_topk_prob=norm_topk_prob, routed_scaling_factor=routed_scaling_factor)


def hash_select(logits_TE: torch.Tensor, tid2eid_VK: torch.Tensor, input_ids_T: torch.Tensor, *,
                norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash routing from fp32 logits: ``ids = tid2eid[input_ids]`` (int32 ``[T, K]``, the table's
    column order), weights = step 4 on ``sqrt(softplus(logits))`` (``DeepseekV4HashRouter``).

    Raises:
        ValueError: table not integer ``[V, K]``, ids not ``[T]``, token ids outside ``[0, V)`` or
            table entries outside ``[0, E)`` (range checks on CPU tensors).
    """
    T, E = _check_logits(logits_TE, "hash_select")
    if tid2eid_VK.dim() != 2 or tid2eid_VK.dtype.is_floating_point:
        raise ValueError(f"hash_select: tid2eid must be an integer [V, K] table, got {tuple(tid2eid_VK.shape)} "
                         f"{tid2eid_VK.dtype}")
    if input_ids_T.dim() != 1 or input_ids_T.shape[0] != T or input_ids_T.dtype.is_floating_point:
        raise ValueError(f"hash_select: input_ids must be integer [T = {T}], got {tuple(input_ids_T.shape)} "
                         f"{input_ids_T.dtype}")
    V = tid2eid_VK.shape[0]
    if input_ids_T.device.type == "cpu" and T:
        lo, hi = int(input_ids_T.min()), int(input_ids_T.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"hash_select: token ids must be in [0, {V}) (rows of tid2eid), got [{lo}, {hi}]")
    ids = tid2eid_VK[input_ids_T.long()].to(torch.int32)
    if ids.device.type == "cpu" and ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"hash_select: tid2eid entries must be expert ids in [0, {E}), got [{lo}, {hi}]")
    if use_triton(logits_TE):
        from .deepseek_triton import hash_select_triton

        return hash_select_triton(logits_TE.float(), tid2eid_VK, input_ids_T, norm_topk_prob=norm_topk_prob,
                                  routed_scaling_factor=routed_scaling_factor)
    w = topk_slot_weights(sqrtsoftplus_scores(logits_TE), ids, norm_topk_prob=norm_topk_prob,
                          routed_scaling_factor=routed_scaling_factor)
    return w, ids


def hash_route(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor, tid2eid_VK: torch.Tensor, input_ids_T: torch.Tensor,
               *, norm_topk_prob: bool = True, routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4 hash router: the router GEMM (one fp32-output GEMM), then :func:`hash_select`.

    Args:
        x_TD: ``[T, D]``; gate_weight_ED: ``[E, D]`` (``ffn.gate.weight``);
        tid2eid_VK: integer ``[V, K]`` (``ffn.gate.tid2eid``); input_ids_T: the tokens' ids ``[T]``.

    Returns:
        ``(weights_TK fp32, ids_TK int32)``; row ``t`` depends only on ``x_TD[t]`` and its token id.
    """
    _check_x_gate(x_TD, gate_weight_ED, "hash_route")
    return hash_select(router_logits(x_TD, gate_weight_ED), tid2eid_VK, input_ids_T, norm_topk_prob=norm_topk_prob,
                       routed_scaling_factor=routed_scaling_factor)


def swiglu_expert_outputs(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                          gate: ExpertWeight, up: ExpertWeight, down: ExpertWeight, *,
                          swiglu_limit: float) -> torch.Tensor:
    """fp32 ``[T*K, D]``: row ``t*K + k`` = expert ``ids[t, k]`` on ``x_TD[t]`` with its routing weight
    applied before the down projection (package doc). Batch-invariant per row (the EP seam's unit).

    Args:
        gate, up: ``[E, I, D]`` (``experts.{e}.w1`` / ``w3`` stacked); down: ``[E, D, I]`` (``w2``);
            tensors in ``x_TD``'s dtype, or MXFP4 (``ops.mxfp4.MXFP4Weight`` codes, or an
            ``MXFP4Master`` quantized here): W4A8, the activation of each MXFP4 GEMM quantized per
            token to FP8 1x128 tiles (:func:`.deepseek_cpu.fp8_activation_f64`).
        swiglu_limit: ``L`` > 0.

    Raises:
        ValueError: shapes/dtypes/ids as :func:`.common.check_expert_args`, weights not ``[T, K]``, an
            MXFP4 GEMM whose K is not a multiple of 128; on the Triton path (CUDA, or
            ``UM_OPS_BACKEND=triton``) x not bf16/fp32 or tensors on different devices.
        NotImplementedError: MXFP4 weights on the Triton path (no W4A8 kernel yet).
    """
    gate, up, down = (resolve_expert(w) for w in (gate, up, down))  # MXFP4 masters -> codes (no gradient)
    E, I, D = check_expert_args(x_TD, topk_ids_TK, up, down)
    if tuple(gate.shape) != (E, I, D) or (isinstance(gate, torch.Tensor) and gate.dtype != x_TD.dtype):
        raise ValueError(f"swiglu_expert_outputs: gate {list(gate.shape)} must match up [E, I, D] = {[E, I, D]} "
                         f"in x's dtype {x_TD.dtype}")
    if tuple(topk_weights_TK.shape) != tuple(topk_ids_TK.shape):
        raise ValueError(f"swiglu_expert_outputs: weights {tuple(topk_weights_TK.shape)} must match ids "
                         f"{tuple(topk_ids_TK.shape)}")
    if not swiglu_limit > 0:
        raise ValueError(f"swiglu_expert_outputs: swiglu_limit = {swiglu_limit} must be > 0")
    for name, w, k in (("w1", gate, D), ("w3", up, D), ("w2", down, I)):
        if quantizes_activations(w) and k % ACT_TILE:
            raise ValueError(f"swiglu_expert_outputs: {type(w).__name__} {name} computes with 1x{ACT_TILE} FP8 "
                             f"activation tiles; its K = {k} is not a multiple of {ACT_TILE}")
    if use_triton(x_TD):
        from .deepseek_triton import swiglu_expert_outputs_triton

        if any(quantizes_activations(w) for w in (gate, up, down)):
            return _quantized_experts_triton(x_TD, topk_ids_TK, topk_weights_TK, gate, up, down, float(swiglu_limit))
        return swiglu_expert_outputs_triton(x_TD, topk_ids_TK, topk_weights_TK, gate, up, down, float(swiglu_limit))
    return swiglu_expert_outputs_torch(x_TD, topk_ids_TK, topk_weights_TK, gate, up, down, float(swiglu_limit))


def _quantized_experts_triton(x_TD, topk_ids_TK, topk_weights_TK, gate, up, down, limit):
    """GPU W4A8 / W8A8 experts from the model-dtype kernels: the gate/up activation quantized per token
    to FP8 1x128 tiles and dequantized into ``x``'s dtype (exact: a 4-bit significand times a power of
    two; one kernel, :func:`unified_models.ops.fp8_block.triton.fp8_block_activation_qdq_triton`), then
    the same two grouped GEMMs, the down projection's activation (the rounded ``h``)
    through the same tile rule between them. Row-local, so batch-invariant.

    The weights: block FP8 on small batches (below
    :func:`.triton.fp8_dequantize_rows_per_expert` rows per expert: decode and short prefills) goes to the GEMMs as
    stored and is dequantized tile by tile in their K loop (1 byte read per weight); on larger
    batches the stack is dequantized once per call in one kernel
    (:meth:`~unified_models.ops.fp8_block.experts.FP8BlockExperts.dequantize`). Both give the
    GEMMs the same values with the same launch, so the bits do not depend on the path. MXFP4 is
    dequantized expert by expert on every call (no in-loop tile yet)."""
    from ..fp8_block.triton import fp8_block_activation_qdq_triton
    from .deepseek_triton import swiglu_down_triton, swiglu_hidden_triton
    from .triton import fp8_dequantize_rows_per_expert

    dt = x_TD.dtype

    def dense(w):
        if not quantizes_activations(w):
            return w
        if isinstance(w, FP8BlockExperts):  # each stack by its own threshold and device
            in_loop = topk_ids_TK.numel() < fp8_dequantize_rows_per_expert(w.weight) * w.shape[0]
            return w.stacked() if in_loop else w.dequantize(dt)  # the same values either way
        return torch.stack([expert_weight(w, e, dt) for e in range(w.shape[0])]) if w.shape[0] else \
            torch.zeros(w.shape, dtype=dt, device=w.device)

    def qdq(a):  # one kernel: the bits of fp8_activation_f64(a).to(dt)
        return fp8_block_activation_qdq_triton(a, dt) if a.shape[0] else a

    g, u, d = (dense(w) for w in (gate, up, down))
    a = qdq(x_TD) if quantizes_activations(gate) or quantizes_activations(up) else x_TD
    h, plan = swiglu_hidden_triton(a, topk_ids_TK, topk_weights_TK, g, u, limit)
    if h is not None and quantizes_activations(down):  # None: no rows (T = 0, e.g. an EP rank without tokens)
        h = qdq(h)
    return swiglu_down_triton(h, plan, d, topk_ids_TK)


def swiglu_experts(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                   gate: ExpertWeight, up: ExpertWeight, down: ExpertWeight, shared_TD: torch.Tensor | None = None,
                   *, swiglu_limit: float, out_dtype: torch.dtype | None = None,
                   weight_before_down: bool = True) -> torch.Tensor:
    """Routed clamped-SwiGLU experts and the ordered combine (package doc): ``[T, D]`` in ``out_dtype``
    (default ``x_TD.dtype``), ``round(sum_k y_tk + shared_t)`` in fp32 slot order.

    ``weight_before_down=False`` (Qwen3-MoE, transformers ``Qwen3MoeExperts``, vLLM's fused MoE): the
    routing weight multiplies the down projection's fp32 output in the combine instead,
    ``round(sum_k w_tk y_tk + shared_t)`` (the experts run with weight 1: ``h * 1`` is exact), as the
    relu2 experts' :func:`.dispatch.moe_experts`. ``swiglu_limit=math.inf`` is plain SwiGLU
    (``silu(g) * u``: the clamps are the identity).

    Raises:
        As :func:`swiglu_expert_outputs` and :func:`.dispatch.moe_combine`.
    """
    ones = torch.ones(topk_ids_TK.shape, dtype=torch.float32, device=x_TD.device)
    if weight_before_down:
        y = swiglu_expert_outputs(x_TD, topk_ids_TK, topk_weights_TK, gate, up, down, swiglu_limit=swiglu_limit)
        return moe_combine(y, ones, shared_TD, out_dtype or x_TD.dtype)
    y = swiglu_expert_outputs(x_TD, topk_ids_TK, ones, gate, up, down, swiglu_limit=swiglu_limit)
    return moe_combine(y, topk_weights_TK.float(), shared_TD, out_dtype or x_TD.dtype)


def swiglu_shared_expert(x_TD: torch.Tensor, gate_ID: ExpertWeight, up_ID: ExpertWeight, down_DI: ExpertWeight, *,
                         swiglu_limit: float) -> torch.Tensor:
    """The shared expert ``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))`` (transformers ``DeepseekV4MLP``)
    as fp32 ``[T, D]`` for the combine's ``shared``: the routed experts' kernel and roundings with one
    expert, every token, weight 1 (``h * 1`` and ``0 + y`` are exact)."""
    T = x_TD.shape[0]
    ids = torch.zeros(T, 1, dtype=torch.int32, device=x_TD.device)
    ones = torch.ones(T, 1, dtype=torch.float32, device=x_TD.device)
    return swiglu_experts(x_TD, ids, ones, stack_expert(gate_ID), stack_expert(up_ID), stack_expert(down_DI), None,
                          swiglu_limit=swiglu_limit, out_dtype=torch.float32)

