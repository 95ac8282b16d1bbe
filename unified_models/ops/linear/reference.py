"""fp64 oracle of the linear."""

from __future__ import annotations

import torch


def linear_reference(x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Oracle in fp64."""
    y = x_TK.double() @ weight_NK.double().t()
    if bias_N is not None:
        y = y + bias_N.double()
    return y.to(out_dtype or x_TK.dtype)
