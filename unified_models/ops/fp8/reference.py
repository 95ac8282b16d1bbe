"""fp64 oracle of the FP8 linear."""

from __future__ import annotations

import torch

from .common import FP8Weight, _scale, fp8_quantize_weight, fp8_weight_scale
from .cpu import fp8_quantize_activation_torch


def fp8_linear_reference(x_TK: torch.Tensor, weight: FP8Weight | torch.Tensor,
                         input_scale: torch.Tensor | float | None = None, bias_N: torch.Tensor | None = None,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Oracle in fp64: ``(e4m3(x_q) * input_scale) @ (e4m3(w) * weight_scale)^T + b`` with every
    product and sum exact or fp64 (the scales are NOT multiplied in fp32 first), then ``.to``."""
    if isinstance(weight, FP8Weight):
        wq, s_w, s_x = weight.weight, weight.weight_scale, weight.input_scale
    else:
        s_w = fp8_weight_scale(weight)
        wq, s_x = fp8_quantize_weight(weight, s_w), _scale(input_scale, x_TK.device, "input_scale")
    xdq = fp8_quantize_activation_torch(x_TK, s_x).double() * s_x.double()
    y = xdq @ (wq.double() * s_w.double()).t()
    if bias_N is not None:
        y = y + bias_N.double()
    return y.to(out_dtype or x_TK.dtype)
