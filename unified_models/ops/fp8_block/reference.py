"""fp64 oracle of the block-FP8 linear: the dequantized operands multiplied exactly in fp64."""

from __future__ import annotations

import torch

from .common import fp8_block_dequantize, fp8_block_quantize_activation_torch, BLOCK


def fp8_block_linear_reference(x_TK: torch.Tensor, weight_q: torch.Tensor, weight_scale_inv: torch.Tensor,
                               bias_N: torch.Tensor | None = None) -> torch.Tensor:
    """fp64 ``[T, N]``: ``x_dq W_dq^T + b`` with ``x_dq`` the activation codes times their tile
    scales and ``W_dq`` :func:`~.common.fp8_block_dequantize` (no fp32 rounding anywhere)."""
    xq, sx = fp8_block_quantize_activation_torch(x_TK)
    x_dq = xq.double() * sx.double().repeat_interleave(BLOCK, 1)
    y = x_dq @ fp8_block_dequantize(weight_q, weight_scale_inv, torch.float64).t()
    return y + bias_N.double() if bias_N is not None else y
