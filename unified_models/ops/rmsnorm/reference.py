"""fp64 oracle of RMSNorm."""

from __future__ import annotations

import torch


def rms_norm_reference(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Oracle in fp64."""
    x = x_TD.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight_D.double()
    return y.to(out_dtype or weight_D.dtype)


def add_rms_norm_reference(residual_TD: torch.Tensor, update_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
                           out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Oracle of the fused residual add + RMSNorm: the exact sum rounded once to the stream's dtype,
    then :func:`rms_norm_reference` of that rounded stream."""
    s_TD = (residual_TD.double() + update_TD.double()).to(residual_TD.dtype)
    return s_TD, rms_norm_reference(s_TD, weight_D, eps, out_dtype)
