"""Linear layer ``y = x @ W^T + b``: bf16 in, fp32 accumulate, one rounding.

No split-K, no batch-size-dependent kernel choice: on GPU a Triton GEMM with
fixed tiles; on CPU fp32 GEMMs over fixed 16-row tiles, so every BLAS call
has the same shape whatever the batch.
"""

from __future__ import annotations

import torch

from ._dispatch import map_row_tiles, use_triton


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
        from .triton.linear import linear_triton

        return linear_triton(x_TK, weight_NK, bias_N, out_dtype)
    return linear_torch(x_TK, weight_NK, bias_N, out_dtype)


def linear_torch(x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """CPU implementation: fp32 GEMM per fixed 16-row tile, one rounding."""
    w_KN = weight_NK.float().t()
    b = bias_N.float() if bias_N is not None else None

    def tile(x):
        y = x.float() @ w_KN
        if b is not None:
            y = y + b
        return y.to(out_dtype)

    return map_row_tiles(tile, x_TK)


def linear_reference(x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Oracle in fp64."""
    y = x_TK.double() @ weight_NK.double().t()
    if bias_N is not None:
        y = y + bias_N.double()
    return y.to(out_dtype or x_TK.dtype)
