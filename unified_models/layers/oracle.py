"""Plain-PyTorch pieces shared by the families' oracles (the reference model's math).

Everything here computes in the dtype of its inputs (fp32 or fp64), differentiable.
Shapes: T tokens, D hidden, K input features, N output features.
"""

from __future__ import annotations

from typing import Mapping

import torch


def rms_norm_oracle(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * w`` (Zhang & Sennrich 2019; transformers ``NemotronHRMSNorm``)."""
    return x_TD * torch.rsqrt(x_TD.pow(2).mean(-1, keepdim=True) + eps) * weight_D


def linear_oracle(x_TK: torch.Tensor, params: Mapping[str, torch.Tensor], name: str, bias: bool) -> torch.Tensor:
    """``x @ params[name.weight]^T (+ params[name.bias])``: ``[T, K] -> [T, N]``."""
    y = x_TK @ params[name + ".weight"].t()
    return y + params[name + ".bias"] if bias else y


NEAR_TIE_ROUNDINGS = 2
"""A near tie's margin in units of ``eps`` of the dtype the engine computes the deciding scores in
(:func:`near_tie_margin`): closer than that, relative to the row's largest score, the engine's rounding
may order them otherwise."""


def near_tie_margin(score_dtype: torch.dtype) -> float:
    """:data:`NEAR_TIE_ROUNDINGS` ``* eps`` of ``score_dtype`` (bf16: ``2^-6``; fp32: ``2^-22``)."""
    return NEAR_TIE_ROUNDINGS * torch.finfo(score_dtype).eps


def topk_near_ties(scores_TN: torch.Tensor, k: int, margin: float) -> torch.Tensor:
    """bool ``[T]``: rows whose top-``k`` set is decided by scores closer than ``margin`` relative to the
    row's largest finite ``|score|`` (the ``k``-th and ``k+1``-th largest; ``-inf`` marks an entry that
    cannot be chosen). A reduced-precision engine that computes the scores with a rounding near
    ``margin`` may choose the other set there; a row with at most ``k`` choosable entries has no tie.
    Used by the families' ``oracle_near_ties`` (:class:`~.family.LayerFamily`)."""
    t, n = scores_TN.shape
    if k <= 0 or n <= k:
        return torch.zeros(t, dtype=torch.bool, device=scores_TN.device)
    finite = torch.isfinite(scores_TN)
    top = torch.sort(scores_TN.masked_fill(~finite, float("-inf")), dim=-1, descending=True).values
    scale = scores_TN.abs().masked_fill(~finite, 0.0).amax(-1)
    gap = top[:, k - 1] - top[:, k]
    return (finite.sum(-1) > k) & (gap <= margin * scale)
