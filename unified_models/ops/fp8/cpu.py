"""CPU path of the FP8 ops: the activation quantizer in plain torch, and the linear as
exact fp64 dot products of the e4m3 values rounded once (over fixed 16-row tiles)."""

from __future__ import annotations

import torch

from .._dispatch import map_row_tiles
from ..linear import round_f64
from .common import _OUT_DTYPES, _X_DTYPES, FP8_E4M3_MAX, _scale


def fp8_quantize_activation_torch(x: torch.Tensor, input_scale: torch.Tensor | float) -> torch.Tensor:
    """Plain-torch :func:`fp8_quantize_activation` (any shape; elementwise)."""
    s = _scale(input_scale, x.device, "input_scale")
    inv = torch.reciprocal(s)  # IEEE fp32 1/s (CPU and CUDA)
    v = x.float() * inv
    v = torch.where(v > FP8_E4M3_MAX, FP8_E4M3_MAX, v)
    v = torch.where(v < -FP8_E4M3_MAX, -FP8_E4M3_MAX, v)
    v = torch.where(torch.isnan(v), float("nan"), v)  # canonical +NaN -> 0x7F
    return v.to(torch.float8_e4m3fn)


def _check_linear(name, x_TK, weight_q, weight_scale, input_scale, bias_N, out_dtype):
    if x_TK.dim() != 2 or weight_q.dim() != 2 or x_TK.shape[1] != weight_q.shape[1]:
        raise ValueError(f"{name}: x {list(x_TK.shape)} @ W^T {list(weight_q.shape)} do not match")
    if x_TK.dtype not in _X_DTYPES:
        raise ValueError(f"{name}: x must be bf16/fp16/fp32, got {x_TK.dtype}")
    if weight_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: weight must be float8_e4m3fn, got {weight_q.dtype}")
    for what, s in (("weight_scale", weight_scale), ("input_scale", input_scale)):
        if s.dtype != torch.float32 or s.numel() != 1:
            raise ValueError(f"{name}: {what} must be one fp32 element, got {s.dtype} {list(s.shape)}")
    n = weight_q.shape[0]
    if bias_N is not None and (tuple(bias_N.shape) != (n,) or bias_N.dtype not in _X_DTYPES):
        raise ValueError(f"{name}: bias must be [{n}] bf16/fp16/fp32, got {list(bias_N.shape)} {bias_N.dtype}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{name}: out_dtype must be bf16/fp16/fp32, got {out_dtype}")


def fp8_linear_torch(x_TK: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                     input_scale: torch.Tensor, bias_N: torch.Tensor | None = None,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """CPU implementation: exact fp64 dot products of the e4m3 values, ``* s + bias`` in fp64,
    rounded once (package doc). Independent of BLAS kernels, blocking and threads (every partial
    sum is exact for K <= 2^17); still called over fixed 16-row tiles.

    Raises:
        ValueError: wrong ranks/dtypes, mismatched K, bias of the wrong shape, scales not one
            fp32 element, unsupported ``out_dtype``.
    """
    out_dtype = out_dtype or x_TK.dtype
    _check_linear("fp8_linear_torch", x_TK, weight_q, weight_scale, input_scale, bias_N, out_dtype)
    # Converted on every call on purpose (a cached copy could go stale after an in-place update).
    w64 = weight_q.double()
    s64 = (input_scale.float().reshape(()) * weight_scale.float().reshape(())).double()  # one fp32 rounding
    b64 = bias_N.double() if bias_N is not None else None

    def tile(x):
        y = fp8_quantize_activation_torch(x, input_scale).double() @ w64.t()
        y = y * s64
        if b64 is not None:
            y = y + b64
        return round_f64(y, out_dtype)

    return map_row_tiles(tile, x_TK)
