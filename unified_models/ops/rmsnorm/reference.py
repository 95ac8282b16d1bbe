"""fp64 oracle of RMSNorm."""

from __future__ import annotations

import torch


def rms_norm_reference(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Oracle in fp64."""
    x = x_TD.double()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight_D.double()
    return y.to(out_dtype or weight_D.dtype)
