"""Batch-invariant linear in Triton: ``y = x @ W^T + b``, fp32 accumulate, one rounding.

A full K loop in each program (no split-K, no atomics, no autotune), K visited
in fixed ``BLOCK_K`` steps from 0 upwards, and ``T`` marked
``do_not_specialize`` (Triton otherwise specializes integer arguments equal to
1 or divisible by 16), so within one config every output element is the same
sequence of ``tl.dot`` steps whatever ``T`` is and whichever other rows share
its tile.

The tile config (``BLOCK_M/BLOCK_N``, ``num_warps``, ``num_stages``) on the GPU
DOES depend on ``T``: :func:`gemm_config` picks one of a few tiers
(:data:`GPU_TIERS`) by the number of rows. This is a deliberate deviation from
"one config per weight shape", taken for speed: decode-sized GEMMs need narrow
tiles to fill the H200's SMs (down_proj 4096x21504 at T=64: 0.119 ms with
64x32x64 vs 0.259 ms with 128x128x64, 2.2x), prefill-sized ones need 128x128
(T=16384: 6.07 ms vs 7.6 ms with 128x64). Batch invariance then rests on a
measured and tested fact, not on the config being fixed: every tier has the
same ``BLOCK_K`` (:data:`BIT_COMPATIBLE_BLOCK_K`) and ``BLOCK_M >= 64`` (Hopper
wgmma), no split-K, so each output element is accumulated in fp32 by the same
wgmma k16 MMA steps in the same K order and its bits do not depend on the tile
shape. ``benchmarks/gemm_configs.py`` measured this on the H200 (Triton 3.6,
bf16, 7 configs, bench shapes, T = 64..16384: all bitwise identical), and
``tests/gpu/test_ops_gpu.py::test_linear_tiers_give_identical_bits`` guards it:
any new or changed tier must pass that test (and a new Triton version or GPU
must re-run it) before it goes into :data:`GPU_TIERS`. fp32 operands (router
GEMM, IEEE ``tl.dot``, no wgmma) were not part of that measurement; the test
checks them across the tiers too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._common import _INTERP, INTERPRET, check_device, interpreter_dot, round_f64_to, round_to

class GemmConfig(NamedTuple):
    """One kernel configuration: tile shape, warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


BIT_COMPATIBLE_BLOCK_K = 64
"""The ``BLOCK_K`` shared by every GPU tier: the K order of the accumulation, hence the bits."""

GPU_TIERS: tuple[tuple[int | None, GemmConfig], ...] = (
    # (max rows T, config); the first tier with T <= max rows is used, None = no limit.
    # Measured on an H200 (Triton 3.6, bf16, benchmarks/gemm_configs.py).
    (64, GemmConfig(64, 32, 64, 4, 5)),       # decode: narrow tiles, enough programs for 132 SMs
    (512, GemmConfig(128, 64, 64, 4, 4)),
    (None, GemmConfig(128, 128, 64, 8, 3)),   # prefill/training: wgmma 128x128 tile
)
for _max_rows, _cfg in GPU_TIERS:
    # The family the tier-independence of the bits rests on (module docstring):
    # same K step, wgmma-sized row tiles. Anything else must not be a tier.
    assert _cfg.block_k == BIT_COMPATIBLE_BLOCK_K and _cfg.block_m >= 64, (_max_rows, _cfg)
assert GPU_TIERS[-1][0] is None, "the last GPU tier must take any number of rows"
del _max_rows, _cfg

# The interpreter pays per program instance: big tiles (DESIGN.md, "Known facts");
# BLOCK_K = 64 keeps the [M, K, N] fp64 product of interpreter_dot within
# Triton's 2**20-element tensor limit. One config for every T (the CPU bits are
# exact fp64 sums anyway, so they do not depend on the tiles).
INTERPRETER_CONFIG = GemmConfig(64, 256, 64, 4, 1)

DEFAULT_CONFIG = INTERPRETER_CONFIG if INTERPRET else GPU_TIERS[-1][1]
"""The config for large ``T`` (the last tier on GPU; the only one in the interpreter)."""

BLOCK_M, BLOCK_N, BLOCK_K = DEFAULT_CONFIG.block_m, DEFAULT_CONFIG.block_n, DEFAULT_CONFIG.block_k
NUM_WARPS, NUM_STAGES = DEFAULT_CONFIG.num_warps, DEFAULT_CONFIG.num_stages


def gemm_config(N: int, K: int, T: int) -> GemmConfig:
    """The kernel configuration for ``T`` rows times a weight of shape ``[N, K]``.

    Under the interpreter: :data:`INTERPRETER_CONFIG` for every shape and ``T``.
    On the GPU: the first tier of :data:`GPU_TIERS` whose max rows is ``>= T``
    (``T <= 64``: 64x32x64 w4 s5; ``T <= 512``: 128x64x64 w4 s4; larger:
    128x128x64 w8 s3). ``N`` and ``K`` do not enter today.

    The config depends on ``T``, but a row's bits do not: every tier uses
    ``BLOCK_K`` = :data:`BIT_COMPATIBLE_BLOCK_K`, ``BLOCK_M >= 64`` (Hopper
    wgmma) and a full K loop without split-K, so each output element is the
    same wgmma k16 steps in the same K order in every tier. That is a measured
    property of the compiled kernels (``benchmarks/gemm_configs.py``) guarded
    by ``tests/gpu/test_ops_gpu.py::test_linear_tiers_give_identical_bits``;
    a new tier must pass that test.
    """
    if INTERPRET:
        return INTERPRETER_CONFIG
    for max_rows, cfg in GPU_TIERS:
        if max_rows is None or T <= max_rows:
            return cfg
    raise AssertionError("unreachable: the last GPU tier has no row limit")


GROUP_M = 8
"""Programs are ordered in groups of GROUP_M row tiles (L2 reuse); this only
changes which program computes a tile, never how a tile is computed."""

_IN_DTYPES = (torch.bfloat16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
                   stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                   HAS_BIAS: tl.constexpr, FP32_DOT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk

    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    out_mask = mask_m[:, None] & mask_n[None, :]
    if _INTERP:
        # CPU (interpreter): exact fp64 products, fp64 sum, ONE rounding, the
        # same value as the CPU torch implementation (ops.linear.linear_torch).
        acc64 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
        for k0 in range(0, K, BLOCK_K):
            mask_k = (k0 + offs_k) < K
            a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc64 += interpreter_dot(a, b)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            acc64 += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float64)[None, :]
        tl.store(out_ptrs, round_f64_to(acc64, out_ptr.dtype.element_ty), mask=out_mask)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = (k0 + offs_k) < K
            a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            if FP32_DOT:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            bias = tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        tl.store(out_ptrs, round_to(acc, out_ptr.dtype.element_ty), mask=out_mask)


def linear_triton(x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None, *, config: GemmConfig | None = None) -> torch.Tensor:
    """``x @ W^T (+ b)`` with fp32 accumulation and one rounding to ``out_dtype``.

    Row ``t`` of the result is bitwise independent of ``T`` and of the other
    rows: full K loop per program, no split-K, and the tile config chosen by
    ``T`` (:func:`gemm_config`) is one of the GPU tiers whose bits are
    identical (tested, see the module docstring).

    Args:
        x_TK: ``[T, K]`` bf16 (or fp32) activations, any strides.
        weight_NK: ``[N, K]`` weight in ``x_TK``'s dtype (HF ``nn.Linear`` layout), any strides.
        bias_N: optional ``[N]`` bias (bf16/fp32), added in fp32 before the rounding.
        out_dtype: bf16/fp16/fp32 (default ``x_TK.dtype``).
        config: force this tile config instead of :func:`gemm_config`'s (tests,
            benchmarks). Only :data:`GPU_TIERS` configs are known to give the
            model's bits on GPU.

    Returns:
        ``[T, N]`` in ``out_dtype``.

    Raises:
        ValueError: wrong ranks, mismatched K, unsupported or mismatched
            dtypes, bias of the wrong shape, tensors on different devices.

    bf16 operands go to ``tl.dot`` as bf16 on GPU (fp32 accumulate); fp32
    operands use IEEE fp32 (no TF32). Under the interpreter (CPU) no
    ``tl.dot`` runs: products are exact in fp64, summed over all of K in fp64
    in numpy's fixed order and rounded once (:func:`interpreter_dot`), so the
    result does not depend on the host's BLAS kernels or threads and equals
    :func:`unified_models.ops.linear.linear_torch` bit for bit for bf16/fp16
    operands (while their fp64 sum is exact; see docs/consistency.md).
    """
    if x_TK.dim() != 2 or weight_NK.dim() != 2 or x_TK.shape[1] != weight_NK.shape[1]:
        raise ValueError(f"linear_triton: x {tuple(x_TK.shape)} @ W^T {tuple(weight_NK.shape)} do not match")
    if x_TK.dtype not in _IN_DTYPES or weight_NK.dtype != x_TK.dtype:
        raise ValueError(f"linear_triton: x and weight must both be bf16 (or both fp32), got "
                         f"{x_TK.dtype} and {weight_NK.dtype}")
    T, K = x_TK.shape
    N = weight_NK.shape[0]
    if bias_N is not None and (bias_N.shape != (N,) or bias_N.dtype not in _IN_DTYPES):
        raise ValueError(f"linear_triton: bias must be [{N}] bf16/fp32, got {tuple(bias_N.shape)} {bias_N.dtype}")
    out_dtype = out_dtype or x_TK.dtype
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"linear_triton: out_dtype must be bf16/fp16/fp32, got {out_dtype}")
    check_device("linear_triton", x_TK, weight_NK, bias_N)
    out = torch.empty((T, N), dtype=out_dtype, device=x_TK.device)
    if T == 0 or N == 0:
        return out
    if K == 0:
        return out.copy_((bias_N.float() if bias_N is not None else torch.zeros(N, device=out.device)).expand(T, N))
    bias = bias_N.contiguous() if bias_N is not None else out  # dummy pointer when HAS_BIAS=False
    fp32_dot = INTERPRET or x_TK.dtype == torch.float32
    cfg = config if config is not None else gemm_config(N, K, T)
    grid = (triton.cdiv(T, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _linear_kernel[grid](
        x_TK, weight_NK, bias, out, T, N, K,
        x_TK.stride(0), x_TK.stride(1), weight_NK.stride(0), weight_NK.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias_N is not None, FP32_DOT=fp32_dot,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=GROUP_M,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
