"""Helpers shared by the Triton kernels.

``INTERPRET`` is read once at import: it selects the per-device constants
(tile sizes) and, under the interpreter, fp32 operands for ``tl.dot`` (the
Triton 3.9 interpreter computes ``tl.dot`` on bf16 operands wrongly; DESIGN.md,
"Known facts"). The constants never depend on the batch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when kernels run through the Triton interpreter (CPU)."""

_INTERP = tl.constexpr(INTERPRET)

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_TL_DTYPE = {
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float32: tl.float32,
}


def tl_dtype(dtype: torch.dtype):
    """The ``tl`` dtype for a torch float dtype (ValueError if unsupported)."""
    try:
        return _TL_DTYPE[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; expected one of {list(_TL_DTYPE)}") from None


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """Raise ValueError unless all tensors are on one device (CUDA, or CPU under the interpreter)."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors on different devices {sorted(map(str, devices))}")
    dev = next(iter(devices))
    if dev.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"{name}: tensors on {dev} need TRITON_INTERPRET=1 set before triton is imported "
            "(the Triton kernels run natively only on CUDA)")


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (>= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Round fp32 ``x`` to ``dtype`` to nearest, ties to even (DESIGN.md rule 5).

    On GPU this is the plain ``.to(dtype)`` (``cvt.rn``). The Triton 3.9
    interpreter's fp32->bf16 cast truncates instead, so under the interpreter
    bf16 is rounded here with integer arithmetic on the bits (NaN stays NaN).
    """
    if _INTERP and dtype == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = u + 0x7FFF + ((u >> 16) & 1)
        u = tl.where(x != x, 0x7FC00000, u)
        return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def interpreter_dot(a, b):
    """``a [M, K] @ b [K, N]`` in fp64 without BLAS (Triton interpreter only).

    Under ``TRITON_INTERPRET=1`` a ``tl.dot`` is a numpy ``matmul`` on the
    host's BLAS, whose result for a row depends on the row's place in the tile
    and on the BLAS kernel family (OpenBLAS Haswell/Zen micro-kernels treat
    edge rows differently from Prescott/Sandybridge ones), so the same kernel
    source gave different bits on different hosts (issue 5). Here the products
    are formed elementwise in fp64 (exact for bf16/fp16 operands: <= 22
    significand bits; exact for fp32 operands: 48 bits) and summed over K by
    one ``tl.sum`` (numpy's own ``add.reduce``: a fixed order that depends
    only on K and the tile layout, never on BLAS, threads or the row). For
    bf16/fp16 operands the fp64 sum is moreover exact while the nonzero
    products span fewer than ``53 - 22 - ceil(log2 K)`` binary orders, so it
    equals the exact dot product. Returns ``[M, N]`` fp64; the caller rounds.
    """
    return tl.sum(a.to(tl.float64)[:, :, None] * b.to(tl.float64)[None, :, :], axis=1)


@triton.jit
def dot_fp32(a, b):
    """``a [M, K] @ b [K, N]`` of half-precision tiles with fp32 accumulation: ``tl.dot`` on tensor cores; under
    the interpreter :func:`interpreter_dot` (fp64, no BLAS), rounded to fp32 once. The backward kernels' dot."""
    if _INTERP:
        return interpreter_dot(a, b).to(tl.float32)
    else:
        return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def round_f64_to(x, dtype: tl.constexpr):
    """Round fp64 ``x`` to ``dtype`` ONCE, to nearest, ties to even (interpreter only).

    fp32: one IEEE rounding. bf16/fp16: round to fp32 with round-to-odd (the
    sticky bit is kept in the last fp32 bit), then RNE to ``dtype``, which
    equals a direct rounding (Boldo & Melquiond 2008); the same rule as
    :func:`unified_models.ops.linear.round_f64`.
    """
    r = x.to(tl.float32)
    if dtype != tl.float32:
        bits = r.to(tl.int32, bitcast=True)
        r64 = r.to(tl.float64)
        inexact = r64 != x
        even = (bits & 1) == 0
        finite = tl.abs(r) < float("inf")
        step = tl.where(tl.abs(r64) > tl.abs(x), -1, 1)
        bits = tl.where(inexact & even & finite, bits + step, bits)
        r = bits.to(tl.float32, bitcast=True)
    return round_to(r, dtype)


@triton.jit
def e4m3_bits_to_f32(b):
    """Shared by the NVFP4 block scales, the FP8 linear and the FP8 KV cache: float8_e4m3fn bit patterns (int32 0..255) -> fp32, exactly (0x7F/0xFF -> NaN)."""
    e = (b >> 3) & 15
    m = b & 7
    bits = ((e + 120) << 23) | (m << 20)
    bits = tl.where((b & 0x7F) == 0x7F, 0x7FC00000, bits)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, bits.to(tl.float32, bitcast=True))
    # The sign as a bit: Triton lowers unary minus to ``0 - v`` on GPU, which
    # turns 0x80 (-0.0) into +0.0.
    vb = v.to(tl.int32, bitcast=True)
    return tl.where(b >= 128, vb | -2147483648, vb).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_e4m3_bits(v):
    """fp32 -> float8_e4m3fn bit patterns (int32 0..255), round to nearest even, as torch's
    ``.to(torch.float8_e4m3fn)`` for ``|v| <= 448`` (larger values are the caller's to clamp) and NaN
    (0x7F with the sign). Integer ops on the bits (the interpreter's fp8 casts are not reliable):
    normal results (``|v| >= 2^-6``) drop 20 mantissa bits with RNE on the fp32 pattern (a carry moves
    into the exponent); subnormal ones are ``RNE(|v| * 2^9)`` by the ``2^23`` add-and-subtract (exact
    up to that rounding: ``|v| * 2^9 < 8``); the sign is copied as a bit (-0.0 -> 0x80)."""
    vb = v.to(tl.int32, bitcast=True)
    sign = (vb >> 24) & 0x80
    ab = vb & 0x7FFFFFFF
    a = ab.to(tl.float32, bitcast=True)
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(ab < 0x3C800000, sub, normal)  # 0x3C800000 = 2^-6, the smallest normal e4m3
    code = tl.where(ab > 0x7F800000, 0x7F, code)  # NaN
    return code | sign


@triton.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Output tile ``tile_id`` of a GEMM -> (row tile, column tile), ordered in groups of
    ``GROUP_M`` row tiles (L2 reuse). Changes which program computes a tile, never how."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n
