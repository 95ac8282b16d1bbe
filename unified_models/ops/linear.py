"""Linear layer ``y = x @ W^T + b``: bf16 in, fp32 accumulate, one rounding.

No split-K, no batch-size-dependent kernel choice: on GPU a Triton GEMM with
fixed tiles; on CPU exact fp64 dot products of the bf16 operands (order- and
thread-independent), rounded once, over fixed 16-row tiles.
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


def round_f64(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp64 ``y`` to ``dtype`` ONCE, to nearest, ties to even.

    fp64 -> fp32 is one IEEE rounding. fp64 -> bf16/fp16 goes through fp32 with
    round-to-odd (Boldo & Melquiond 2008, "Emulation of FMA and correctly
    rounded sums: proved algorithms using rounding to odd"): the fp32
    intermediate keeps a sticky bit, so the final RNE rounding equals a direct
    rounding of ``y`` (fp32 has > 2 more significand bits than bf16/fp16).
    """
    if dtype == torch.float64:
        return y
    r = y.float()
    if dtype == torch.float32:
        return r
    bits = r.view(torch.int32)
    inexact = r.double() != y
    even = (bits & 1) == 0
    toward_zero = r.double().abs() > y.abs()
    step = torch.where(toward_zero, -1, 1).to(torch.int32)
    odd = torch.where(inexact & even & torch.isfinite(r), bits + step, bits).view(torch.float32)
    return odd.to(dtype)


def linear_torch(x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """CPU implementation: exact fp64 dot products, rounded once.

    bf16/fp16 operands have 8/11-bit significands, so each product is exact in
    fp64 (<= 22 bits) and the fp64 sum of K products is exact while the
    products span fewer than ``53 - 22 - log2(K)`` binary orders of magnitude,
    which holds for any realistic activation/weight pair. An exact sum does not
    depend on the order of accumulation, so the result is independent of
    BLAS's kernel choice, blocking and thread count (a row-tiled fp32 GEMM was
    not: MKL at 16 threads gave different bits for a row depending on its
    place in the batch). fp32 operands (not used by the models) fall back to
    fp64 accumulation without that guarantee. Calls still go over fixed
    16-row tiles so the BLAS call shape never depends on the batch.
    """
    # Converted on every call on purpose: a cached copy could go stale after an
    # in-place weight update through ``param.data`` (which bumps no version).
    w = weight_NK.double()
    b = bias_N.double() if bias_N is not None else None

    def tile(x):
        y = x.double() @ w.t()
        if b is not None:
            y = y + b
        return round_f64(y, out_dtype)

    return map_row_tiles(tile, x_TK)


def linear_reference(x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Oracle in fp64."""
    y = x_TK.double() @ weight_NK.double().t()
    if bias_N is not None:
        y = y + bias_N.double()
    return y.to(out_dtype or x_TK.dtype)
