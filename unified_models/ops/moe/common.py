"""What the MoE implementations share: the expert-weight type (bf16 tensor, NVFP4, MXFP4 or block FP8),
shape checks, the per-expert weight as the kernels compute with it, and the
expert grouping of the assignments (sort by ``(expert, token, slot)``)."""

from __future__ import annotations

import torch

from ..fp8_block.experts import FP8BlockExperts, FP8BlockMaster
from ..mxfp4 import MXFP4Master, MXFP4Weight, mxfp4_dequantize
from ..nvfp4 import NVFP4Weight, nvfp4_dequantize


ExpertWeight = torch.Tensor | NVFP4Weight | MXFP4Weight | MXFP4Master | FP8BlockExperts | FP8BlockMaster
"""``[E, N, K]`` bf16/fp32 tensor, NVFP4 (``NVFP4Weight`` with ``[E, N, K/2]`` codes), MXFP4
(``MXFP4Weight`` codes, or an ``MXFP4Master`` quantized by the op) or block FP8
(``ops.fp8_block.FP8BlockExperts`` codes, or an ``FP8BlockMaster`` quantized by the op); the last
two are DeepSeek-V4's SwiGLU experts only (W4A8 / W8A8: :func:`quantizes_activations`)."""

MASTERS = (MXFP4Master, FP8BlockMaster)
"""Expert-weight types holding model-dtype masters that the experts op quantizes on every call."""

NORM_EPS = 1e-20
"""Added to the top-k weight sum before the division (transformers ``NemotronHTopkRouter``)."""


def _expert_shape(w: ExpertWeight) -> tuple[int, int, int]:
    shape = w.shape
    if len(shape) != 3:
        raise ValueError(f"moe_experts: expert weights must be [E, N, K], got {tuple(shape)}")
    return tuple(shape)


def check_expert_args(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, up: ExpertWeight,
                      down: ExpertWeight) -> tuple[int, int, int]:
    """Validate shapes; returns ``(E, I, D)``.

    Raises:
        ValueError: mismatched shapes/dtypes, ids out of range (checked on CPU).
    """
    if x_TD.dim() != 2:
        raise ValueError(f"moe_experts: x must be [T, D], got {tuple(x_TD.shape)}")
    E, I, D = _expert_shape(up)
    Ed, Dd, Id = _expert_shape(down)
    if (Ed, Dd, Id) != (E, D, I) or x_TD.shape[1] != D:
        raise ValueError(f"moe_experts: x {tuple(x_TD.shape)}, up {list(up.shape)} [E, I, D] and down "
                         f"{list(down.shape)} [E, D, I] do not match")
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != x_TD.shape[0] or topk_ids_TK.dtype.is_floating_point:
        raise ValueError(f"moe_experts: topk ids must be integer [T, K] with T = {x_TD.shape[0]}, "
                         f"got {tuple(topk_ids_TK.shape)} {topk_ids_TK.dtype}")
    for name, w in (("up", up), ("down", down)):
        if isinstance(w, torch.Tensor) and w.dtype != x_TD.dtype:
            raise ValueError(f"moe_experts: {name} weight dtype {w.dtype} differs from x dtype {x_TD.dtype}")
    if topk_ids_TK.device.type == "cpu" and topk_ids_TK.numel():
        lo, hi = int(topk_ids_TK.min()), int(topk_ids_TK.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"moe_experts: expert ids must be in [0, {E}), got [{lo}, {hi}]")
    return E, I, D


def expert_weight(w: ExpertWeight, e: int, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s ``[N, K]`` weight as the kernels compute with it (NVFP4 dequantized by ModelOpt's rule,
    MXFP4 and block FP8 dequantized exactly; a master must have been quantized first: :func:`resolve_expert`)."""
    if isinstance(w, NVFP4Weight):
        return nvfp4_dequantize(w.expert(e), dtype)
    if isinstance(w, MXFP4Weight):
        return mxfp4_dequantize(w.expert(e), dtype)
    if isinstance(w, FP8BlockExperts):
        return w.expert(e).dequantize(dtype)
    if isinstance(w, MASTERS):
        raise TypeError(f"expert_weight: an {type(w).__name__} is quantized by the op first (resolve_expert)")
    return w[e]


def resolve_expert(w: ExpertWeight) -> ExpertWeight:
    """The weight the kernels take: a master (:data:`MASTERS`) quantized by its format's rule
    (``MXFP4Master`` -> ``MXFP4Weight``, ``FP8BlockMaster`` -> ``FP8BlockExperts``), anything else as it is."""
    return w.quantize() if isinstance(w, MASTERS) else w


def quantizes_activations(w: ExpertWeight) -> bool:
    """True for MXFP4 (W4A8) and block-FP8 (W8A8) expert weights, whose activations the kernels
    quantize per token to FP8 (1x128 ue8m0 tiles, ``ops.fp8_block.fp8_block_quantize_activation``)
    before the product."""
    return isinstance(w, (MXFP4Weight, MXFP4Master, FP8BlockExperts, FP8BlockMaster))


def group_by_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments ``r = t*K + k`` sorted by ``(expert, t, k)`` and the per-expert counts.

    The sort key ``expert * R + r`` is unique, so the permutation is fully
    determined by the ids (stable and batch-independent in its rule; where a
    row lands changes with the batch, never how it is computed).
    """
    flat = topk_ids_TK.reshape(-1).long()
    R = flat.shape[0]
    order = torch.argsort(flat * R + torch.arange(R, device=flat.device))
    return order, expert_counts(flat[order], num_experts)


def expert_rows(topk_ids_TK: torch.Tensor, num_experts: int):
    """Yield ``(expert, rows)`` for every expert with assignments, in expert order;
    ``rows`` are the flat assignments ``t*K + k`` of :func:`group_by_expert`'s order."""
    order, counts = group_by_expert(topk_ids_TK, num_experts)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            yield e, order[start:start + n]
            start += n


def expert_counts(sorted_experts_R: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert from the sorted expert ids (``searchsorted``: deterministic, and
    allowed under ``torch.use_deterministic_algorithms``, unlike CUDA ``bincount``)."""
    edges = torch.arange(num_experts, device=sorted_experts_R.device, dtype=sorted_experts_R.dtype)
    cum = torch.searchsorted(sorted_experts_R, edges, right=True)
    return torch.diff(cum, prepend=cum.new_zeros(1))


def stack_expert(w: ExpertWeight) -> ExpertWeight:
    """A single ``[N, K]`` weight as a one-expert stack ``[1, N, K]`` (tensor view, NVFP4, MXFP4 or block FP8)."""
    if isinstance(w, (FP8BlockExperts, FP8BlockMaster)):
        return w.stacked()
    if isinstance(w, MXFP4Weight):
        return w if w.weight.dim() == 3 else MXFP4Weight(w.weight[None], w.weight_scale[None])
    if isinstance(w, MXFP4Master):
        return w if w.weight.dim() == 3 else MXFP4Master(w.weight[None])
    if isinstance(w, NVFP4Weight):
        if w.weight.dim() == 3:
            return w
        return NVFP4Weight(w.weight[None], w.weight_scale[None], w.weight_scale_2.reshape(1),
                           None if w.input_scale is None else w.input_scale.reshape(1))
    return w if w.dim() == 3 else w[None]
