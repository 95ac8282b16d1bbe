"""RMSNorm in Triton: ``y = x * rsqrt(mean(x^2) + eps) * w`` in fp32, rounded once.

One program per row; the whole row is one ``BLOCK_D = next_pow2(D)`` block,
reduced by one ``tl.sum`` whose order depends only on ``D`` (and the fixed
``num_warps`` derived from it), never on the number of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import FLOAT_DTYPES, check_device, next_pow2, round_to

MAX_D = 65536
"""Largest hidden size one program reduces (the row must fit one block)."""


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, stride_xt, stride_xd, stride_ot, stride_od,
                     BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x = tl.load(x_ptr + t * stride_xt + d * stride_xd, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / D
    inv = tl.rsqrt(mean_sq + eps)
    y = x * inv * w
    tl.store(out_ptr + t * stride_ot + d * stride_od, round_to(y, out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block_d: int) -> int:
    # A function of D only (fixed per layer), never of the number of rows.
    if block_d <= 1024:
        return 4
    if block_d <= 8192:
        return 8
    return 16


def rms_norm_triton(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Row-wise RMSNorm, fp32 math, one rounding to ``out_dtype``.

    Args:
        x_TD: ``[T, D]`` bf16/fp16/fp32 activations (any strides).
        weight_D: ``[D]`` gain (bf16/fp16/fp32).
        eps: added to the mean square.
        out_dtype: bf16/fp16/fp32 result dtype (default ``weight_D.dtype``).

    Returns:
        ``[T, D]`` in ``out_dtype``; row ``t`` depends only on ``x_TD[t]``.

    Raises:
        ValueError: wrong ranks/shapes/dtypes, ``D > MAX_D``, or tensors on
            different devices.
    """
    if x_TD.dim() != 2 or x_TD.dtype not in FLOAT_DTYPES:
        raise ValueError(f"rms_norm_triton: x must be [T, D] bf16/fp16/fp32, got {tuple(x_TD.shape)} {x_TD.dtype}")
    D = x_TD.shape[1]
    if weight_D.shape != (D,) or weight_D.dtype not in FLOAT_DTYPES:
        raise ValueError(f"rms_norm_triton: weight must be [{D}] float, got {tuple(weight_D.shape)} {weight_D.dtype}")
    out_dtype = out_dtype or weight_D.dtype
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"rms_norm_triton: out_dtype must be bf16/fp16/fp32, got {out_dtype}")
    if D > MAX_D:
        raise ValueError(f"rms_norm_triton: D={D} exceeds MAX_D={MAX_D}")
    check_device("rms_norm_triton", x_TD, weight_D)
    T = x_TD.shape[0]
    out = torch.empty((T, D), dtype=out_dtype, device=x_TD.device)
    if T == 0 or D == 0:
        return out
    w = weight_D.contiguous()
    block_d = next_pow2(D)
    _rms_norm_kernel[(T,)](x_TD, w, out, D, float(eps), x_TD.stride(0), x_TD.stride(1),
                           out.stride(0), out.stride(1), BLOCK_D=block_d, num_warps=_num_warps(block_d))
    return out
