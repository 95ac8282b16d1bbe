"""RMSNorm in Triton: ``y = x * rsqrt(mean(x^2) + eps) * w`` in fp32, rounded once.

One program per row; the whole row is one ``BLOCK_D = next_pow2(D)`` block,
reduced by one ``tl.sum`` whose order depends only on ``D`` (and the fixed
``num_warps`` derived from it), never on the number of rows.

The same kernel, specialized with ``HAS_UPDATE``, is the fused residual add +
RMSNorm (:func:`add_rms_norm_triton`): it first forms ``s = x + u`` rounded to
the stream's dtype, stores it, and normalizes ``s`` with the very code of the
plain norm (same block, same warps, the same ``tl.sum``), so its outputs are the
bits of ``x + u`` followed by :func:`rms_norm_triton` (``tests/test_sm90_lowering.py``
checks the two reductions lower to one layout; ``tests/gpu/test_ops_gpu.py`` the bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import FLOAT_DTYPES, check_device, next_pow2, round_to

MAX_D = 65536
"""Largest hidden size one program reduces (the row must fit one block)."""


@triton.jit
def _rms_norm_kernel(x_ptr, u_ptr, s_ptr, w_ptr, out_ptr, D, eps, stride_xt, stride_xd, stride_ut, stride_ud,
                     stride_st, stride_sd, stride_ot, stride_od, BLOCK_D: tl.constexpr, HAS_UPDATE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x = tl.load(x_ptr + t * stride_xt + d * stride_xd, mask=mask, other=0.0).to(tl.float32)
    if HAS_UPDATE:  # the residual add: one rounding of the exact sum to the stream's dtype
        u = tl.load(u_ptr + t * stride_ut + d * stride_ud, mask=mask, other=0.0).to(tl.float32)
        s = round_to(x + u, s_ptr.dtype.element_ty)
        tl.store(s_ptr + t * stride_st + d * stride_sd, s, mask=mask)
        x = s.to(tl.float32)
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


def _check(x_TD: torch.Tensor, weight_D: torch.Tensor, out_dtype: torch.dtype, op: str) -> None:
    if x_TD.dim() != 2 or x_TD.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: x must be [T, D] bf16/fp16/fp32, got {tuple(x_TD.shape)} {x_TD.dtype}")
    D = x_TD.shape[1]
    if weight_D.shape != (D,) or weight_D.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: weight must be [{D}] float, got {tuple(weight_D.shape)} {weight_D.dtype}")
    if out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be bf16/fp16/fp32, got {out_dtype}")
    if D > MAX_D:
        raise ValueError(f"{op}: D={D} exceeds MAX_D={MAX_D}")


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
    out_dtype = out_dtype or weight_D.dtype
    _check(x_TD, weight_D, out_dtype, "rms_norm_triton")
    check_device("rms_norm_triton", x_TD, weight_D)
    D = x_TD.shape[1]
    T = x_TD.shape[0]
    out = torch.empty((T, D), dtype=out_dtype, device=x_TD.device)
    if T == 0 or D == 0:
        return out
    w = weight_D.contiguous()
    block_d = next_pow2(D)
    _rms_norm_kernel[(T,)](x_TD, x_TD, x_TD, w, out, D, float(eps), x_TD.stride(0), x_TD.stride(1), 0, 0, 0, 0,
                           out.stride(0), out.stride(1), BLOCK_D=block_d, HAS_UPDATE=False,
                           num_warps=_num_warps(block_d))
    return out


def add_rms_norm_triton(residual_TD: torch.Tensor, update_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
                        out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: ``s = residual + update`` (one rounding to the stream's dtype),
    ``y = rms_norm(s)``; one read of each input, one write of each output.

    Args:
        residual_TD: ``[T, D]`` bf16/fp16/fp32 stream (any strides).
        update_TD: ``[T, D]`` the sublayer's output, same dtype as ``residual_TD``.
        weight_D: ``[D]`` gain (bf16/fp16/fp32).
        eps: added to the mean square.
        out_dtype: bf16/fp16/fp32 dtype of ``y`` (default ``weight_D.dtype``).

    Returns:
        ``(s_TD, y_TD)``: the new stream (``residual_TD.dtype``, contiguous) and its norm
        (``out_dtype``); bitwise ``residual_TD + update_TD`` and
        ``rms_norm_triton(s_TD, weight_D, eps, out_dtype)``. Row ``t`` depends only on row ``t``.

    Raises:
        ValueError: as :func:`rms_norm_triton`, or ``update_TD`` not of the residual's shape and dtype.
    """
    if update_TD.shape != residual_TD.shape or update_TD.dtype != residual_TD.dtype:
        raise ValueError(f"add_rms_norm_triton: update {tuple(update_TD.shape)} {update_TD.dtype} must match the "
                         f"residual {tuple(residual_TD.shape)} {residual_TD.dtype}")
    _check(residual_TD, weight_D, out_dtype or weight_D.dtype, "add_rms_norm_triton")
    check_device("add_rms_norm_triton", residual_TD, update_TD, weight_D)
    T, D = residual_TD.shape
    out_dtype = out_dtype or weight_D.dtype
    s = torch.empty((T, D), dtype=residual_TD.dtype, device=residual_TD.device)
    out = torch.empty((T, D), dtype=out_dtype, device=residual_TD.device)
    if T == 0 or D == 0:
        return s, out
    block_d = next_pow2(D)
    _rms_norm_kernel[(T,)](residual_TD, update_TD, s, weight_D.contiguous(), out, D, float(eps),
                           residual_TD.stride(0), residual_TD.stride(1), update_TD.stride(0), update_TD.stride(1),
                           s.stride(0), s.stride(1), out.stride(0), out.stride(1), BLOCK_D=block_d, HAS_UPDATE=True,
                           num_warps=_num_warps(block_d))
    return s, out
