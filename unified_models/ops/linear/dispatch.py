"""The linear's public op: the Triton GEMM (:mod:`.triton`) on GPU, the CPU path (:mod:`.cpu`) otherwise."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .cpu import linear_torch


def linear(x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Batch-invariant linear.

    Args:
        x_TK: ``[T, K]`` activations (bf16 or fp32).
        weight_NK: ``[N, K]`` weight (HF ``nn.Linear`` layout).
        bias_N: optional ``[N]``.
        out_dtype: result dtype (default ``x_TK.dtype``).

    Returns:
        ``[T, N]``; row ``t`` depends only on ``x_TK[t]``.

    Raises:
        ValueError: inner dimensions differ.
    """
    if x_TK.dim() != 2 or weight_NK.dim() != 2 or x_TK.shape[1] != weight_NK.shape[1]:
        raise ValueError(f"linear: x {tuple(x_TK.shape)} @ W^T {tuple(weight_NK.shape)} do not match")
    out_dtype = out_dtype or x_TK.dtype
    if use_triton(x_TK):
        from .triton import linear_triton

        return linear_triton(x_TK, weight_NK, bias_N, out_dtype)
    return linear_torch(x_TK, weight_NK, bias_N, out_dtype)
