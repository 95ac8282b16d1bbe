"""The MoE ops without autograd: the router (one fp32-output GEMM, then the total-order
top-k in torch on every device) and the experts and combine (the Triton kernels of
:mod:`.triton` on GPU, the CPU path of :mod:`.cpu` otherwise)."""

from __future__ import annotations

import torch

from .._dispatch import map_row_tiles, use_triton
from ..linear import linear
from .common import NORM_EPS, ExpertWeight, check_expert_args, quantizes_activations, stack_expert
from .cpu import moe_combine_torch, moe_expert_outputs_torch


_SIGMOID_COLS = 64


def _check_route_args(E: int, top_k: int, n_group: int, topk_group: int) -> None:
    if not 1 <= top_k <= E:
        raise ValueError(f"moe_route: top_k = {top_k} must be in [1, {E}] (n_routed_experts)")
    if n_group < 1 or E % n_group:
        raise ValueError(f"moe_route: n_group = {n_group} must divide n_routed_experts = {E}")
    if n_group > 1:
        if E // n_group < 2:
            raise ValueError(f"moe_route: group scores sum the top 2 experts of a group; {E} experts in "
                             f"{n_group} groups leave {E // n_group} per group")
        if not 1 <= topk_group <= n_group or topk_group * (E // n_group) < top_k:
            raise ValueError(f"moe_route: topk_group = {topk_group} of {n_group} groups cannot hold "
                             f"top_k = {top_k} experts")


def total_order_keys(score_TE: torch.Tensor) -> torch.Tensor:
    """int64 keys ranking fp32 ``score_TE`` descending, ties to the LOWER column index.

    High 32 bits: the order-preserving int32 image of the fp32 value (negative
    floats have their 31 low bits flipped; ``-0.0`` is first made ``+0.0``);
    low 32 bits: ``C - 1 - column``. All keys of a row are distinct.
    """
    s = (score_TE.float() + 0.0).contiguous()
    bits = s.view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    c = s.shape[-1]
    col = torch.arange(c - 1, -1, -1, device=s.device, dtype=torch.long)
    return (ordered << 32) + col


def topk_total_order(score_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the ``k`` largest scores per row, best first, ties to the lower column (int64 ``[T, k]``)."""
    return torch.topk(total_order_keys(score_TE), k, dim=-1, largest=True, sorted=True).indices


def moe_select(logits_TE: torch.Tensor, e_score_correction_bias_E: torch.Tensor | None, *, top_k: int,
               n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
               routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Router steps 2-7 (see the package doc) from fp32 logits.

    Returns:
        ``(weights_TK fp32, ids_TK int32)``, slots best first.

    Raises:
        ValueError: inconsistent ``top_k``/``n_group``/``topk_group``, bias shape.
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"moe_select: logits must be [T, E], got {tuple(logits_TE.shape)}")
    T, E = logits_TE.shape
    _check_route_args(E, top_k, n_group, topk_group)
    if e_score_correction_bias_E is not None and e_score_correction_bias_E.shape != (E,):
        raise ValueError(f"moe_select: e_score_correction_bias must be [{E}], "
                         f"got {tuple(e_score_correction_bias_E.shape)}")
    logits = logits_TE.float()
    bias = e_score_correction_bias_E.float() if e_score_correction_bias_E is not None else None
    if logits.device.type == "cpu":
        ecols = -(-E // _SIGMOID_COLS) * _SIGMOID_COLS

        def tile(lg):
            padded = torch.nn.functional.pad(lg, (0, ecols - E))
            return torch.sigmoid(padded)[:, :E]

        scores = map_row_tiles(tile, logits)
    else:  # CUDA: every element goes through the same scalar functor
        scores = torch.sigmoid(logits)
    choice = scores + bias if bias is not None else scores
    if n_group > 1:
        per = E // n_group
        grouped = choice.view(T, n_group, per)
        top2 = grouped.topk(2, dim=-1, sorted=True).values  # values only: tie order is irrelevant
        group_score = top2[..., 0] + top2[..., 1]
        keep = topk_total_order(group_score, topk_group)
        mask = torch.zeros(T, n_group, dtype=torch.bool, device=logits.device).scatter_(1, keep, True)
        choice = choice.masked_fill(~mask.repeat_interleave(per, dim=1), float("-inf"))
    ids = topk_total_order(choice, top_k)
    w = scores.gather(1, ids)
    if norm_topk_prob:
        den = w[:, 0]
        for k in range(1, top_k):  # fixed slot order, elementwise
            den = den + w[:, k]
        w = w / (den + NORM_EPS)[:, None]
    w = w * float(routed_scaling_factor)
    return w, ids.to(torch.int32)


def router_logits(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor) -> torch.Tensor:
    """``[T, E]`` fp32 router logits from one batch-invariant GEMM (fp32 output)."""
    if x_TD.dtype != gate_weight_ED.dtype or x_TD.dtype not in (torch.bfloat16, torch.float32):
        x_TD, gate_weight_ED = x_TD.float(), gate_weight_ED.float()
    return linear(x_TD, gate_weight_ED, None, torch.float32)


def moe_route(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor, e_score_correction_bias_E: torch.Tensor | None,
              *, top_k: int, n_group: int = 1, topk_group: int = 1, norm_topk_prob: bool = True,
              routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k router (package doc, steps 1-7).

    Args:
        x_TD: ``[T, D]`` activations (the full hidden state, also for a latent MoE).
        gate_weight_ED: ``[E, D]`` router weight (``mixer.gate.weight``).
        e_score_correction_bias_E: ``[E]`` selection bias (``mixer.gate.e_score_correction_bias``) or None.
        top_k: ``num_experts_per_tok``.
        n_group, topk_group: group-limited routing (``n_group = 1``: plain top-k).
        norm_topk_prob: renormalise the selected weights to sum to 1.
        routed_scaling_factor: multiplies the weights.

    Returns:
        ``(weights_TK fp32, ids_TK int32)``; row ``t`` depends only on ``x_TD[t]``.

    Raises:
        ValueError: shapes or routing arguments inconsistent.
    """
    if x_TD.dim() != 2 or gate_weight_ED.dim() != 2 or x_TD.shape[1] != gate_weight_ED.shape[1]:
        raise ValueError(f"moe_route: x {tuple(x_TD.shape)} and gate weight {tuple(gate_weight_ED.shape)} "
                         "do not match")
    return moe_select(router_logits(x_TD, gate_weight_ED), e_score_correction_bias_E, top_k=top_k,
                      n_group=n_group, topk_group=topk_group, norm_topk_prob=norm_topk_prob,
                      routed_scaling_factor=routed_scaling_factor)


def moe_expert_outputs(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, up: ExpertWeight,
                       down: ExpertWeight) -> torch.Tensor:
    """fp32 ``[T*K, D]``: row ``t*K + k`` = expert ``ids[t, k]`` applied to ``x_TD[t]``
    (``fp32(round_x(relu(fp32(x up^T))^2) down^T)``). Raises as :func:`check_expert_args`, and
    ``ValueError`` for MXFP4 weights (W4A8 DeepSeek-V4 SwiGLU experts only: ``swiglu_experts``)."""
    if quantizes_activations(up) or quantizes_activations(down):
        raise ValueError("moe_experts: MXFP4 weights are DeepSeek-V4's W4A8 SwiGLU experts (swiglu_experts); "
                         "the relu2 experts take model-dtype or NVFP4 weights")
    check_expert_args(x_TD, topk_ids_TK, up, down)
    if use_triton(x_TD):
        from .triton import moe_expert_outputs_triton

        return moe_expert_outputs_triton(x_TD, topk_ids_TK, up, down)
    return moe_expert_outputs_torch(x_TD, topk_ids_TK, up, down)


def moe_combine(expert_out_RD: torch.Tensor, topk_weights_TK: torch.Tensor, shared_TD: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``round(((0 + w_0 y_0) + ... + w_{K-1} y_{K-1}) + shared)`` per token, fp32, slot order, one rounding.

    Args:
        expert_out_RD: fp32 ``[T*K, D]`` (:func:`moe_expert_outputs`).
        topk_weights_TK: fp32 ``[T, K]``.
        shared_TD: optional ``[T, D]`` (fp32 from :func:`moe_shared_expert`, or any float dtype).
        out_dtype: result dtype.

    Raises:
        ValueError: shapes do not match.
    """
    if topk_weights_TK.dim() != 2:
        raise ValueError(f"moe_combine: weights must be [T, K], got {tuple(topk_weights_TK.shape)}")
    T, K = topk_weights_TK.shape
    if expert_out_RD.dim() != 2 or expert_out_RD.shape[0] != T * K:
        raise ValueError(f"moe_combine: expert outputs {tuple(expert_out_RD.shape)} do not match [T*K = {T * K}, D]")
    D = expert_out_RD.shape[1]
    if shared_TD is not None and shared_TD.shape != (T, D):
        raise ValueError(f"moe_combine: shared {tuple(shared_TD.shape)} is not [{T}, {D}]")
    if use_triton(expert_out_RD):
        from .triton import moe_combine_triton

        return moe_combine_triton(expert_out_RD, topk_weights_TK, shared_TD, out_dtype)
    return moe_combine_torch(expert_out_RD, topk_weights_TK, shared_TD, out_dtype)


def moe_experts(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, up: ExpertWeight,
                down: ExpertWeight, shared_TD: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Routed relu2 experts and the ordered combine (package doc).

    Args:
        x_TD: ``[T, D]`` bf16 expert input.
        topk_ids_TK, topk_weights_TK: from :func:`moe_route`.
        up: ``[E, I, D]`` (``experts.up_proj``), bf16 or :class:`NVFP4Weight`.
        down: ``[E, D, I]`` (``experts.down_proj``), bf16 or :class:`NVFP4Weight`.
        shared_TD: optional shared-expert output added before the rounding.
        out_dtype: default ``x_TD.dtype``.

    Returns:
        ``[T, D]``; row ``t`` depends only on ``x_TD[t]``, its ids and weights.
    """
    y = moe_expert_outputs(x_TD, topk_ids_TK, up, down)
    return moe_combine(y, topk_weights_TK, shared_TD, out_dtype or x_TD.dtype)


def moe_shared_expert(x_TD: torch.Tensor, up_ID: ExpertWeight, down_DI: ExpertWeight) -> torch.Tensor:
    """The shared expert ``down(relu(up x)^2)`` as fp32 ``[T, D]`` for :func:`moe_combine`'s ``shared``:
    the same grouped kernel and roundings as a routed expert (one expert, every token, weight 1;
    the combine's ``0 + 1 * y`` is ``y`` exactly, with ``-0`` made ``+0``)."""
    T = x_TD.shape[0]
    ids = torch.zeros(T, 1, dtype=torch.int32, device=x_TD.device)
    ones = torch.ones(T, 1, dtype=torch.float32, device=x_TD.device)
    return moe_experts(x_TD, ids, ones, stack_expert(up_ID), stack_expert(down_DI), None, torch.float32)
