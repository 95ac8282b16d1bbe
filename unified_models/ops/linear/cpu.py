"""CPU path of the linear: exact fp64 dot products of the operands, rounded once
(:func:`round_f64`, also used by the FP8 linear and the MoE experts), over fixed
16-row tiles."""

from __future__ import annotations

import torch

from .._dispatch import map_row_tiles


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
