"""Batch-invariant linear in Triton: ``y = x @ W^T + b``, fp32 accumulate, one rounding.

A full K loop in each program (no split-K, no atomics, no autotune), K visited
in fixed ``BLOCK_K`` steps from 0 upwards, and ``T`` marked
``do_not_specialize`` (Triton otherwise specializes integer arguments equal to
1 or divisible by 16), so within one config every output element is the same
sequence of ``tl.dot`` steps whatever ``T`` is and whichever other rows share
its tile.

The tile config (``BLOCK_M/BLOCK_N``, ``num_warps``, ``num_stages``, TMA or
pointer loads, persistent or not) on the GPU DOES depend on ``T``:
:func:`gemm_config` picks one of a few tiers (:data:`GPU_TIERS`) by the number
of rows. This is a deliberate deviation from "one config per weight shape",
taken for speed: decode-sized GEMMs need narrow tiles to fill the H200's SMs,
prefill-sized ones a persistent 128x256 tile (CUDA-graph timings, T = 256, the
4 GEMMs of an 8B-width layer pair: 0.26 ms vs 0.43 ms with 128x128; T = 16384:
10.4 ms, cuBLAS 10.6 ms). Batch invariance then rests on a measured and tested
fact, not on the config being fixed: every tier has the same ``BLOCK_K``
(:data:`BIT_COMPATIBLE_BLOCK_K`) and ``BLOCK_M >= 64`` (Hopper wgmma), no
split-K, so each output element is accumulated in fp32 by the same wgmma k16
MMA steps in the same K order and its bits depend neither on the tile shape
nor on how the operands reach shared memory (TMA or pointer loads) nor on
which program computes the tile. ``benchmarks/gemm_configs.py`` measured this
on the H200 (Triton 3.6, bf16, 21 configs, bench shapes, T = 64..16384: all
bitwise identical), and
``tests/gpu/test_ops_gpu.py::test_linear_tiers_give_identical_bits`` guards it:
any new or changed tier must pass that test (and a new Triton version or GPU
must re-run it) before it goes into :data:`GPU_TIERS`. fp32 operands (router
GEMM, IEEE ``tl.dot``, no wgmma) use :data:`FP32_OPERAND_TIERS` (pointer
loads), checked across their tiers by the same test file.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..triton._common import _INTERP, INTERPRET, check_device, grouped_tile, interpreter_dot, round_f64_to, round_to

class GemmConfig(NamedTuple):
    """One kernel configuration: tile shape, warps, pipeline stages and the kernel variant.

    ``tma``: operands and output move through TMA tensor descriptors (Hopper's
    bulk copies, :func:`_linear_tma_kernel`) instead of masked pointer loads;
    ``persistent``: with ``tma``, one program per SM walks the output tiles in a
    fixed stride (prefetching the next tile's operands during the current
    epilogue). Neither changes the arithmetic of a tile: the same ``tl.dot``
    steps over the same K order (measured bitwise equal, see the module docstring).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = False
    persistent: bool = False


BIT_COMPATIBLE_BLOCK_K = 64
"""The ``BLOCK_K`` shared by every GPU tier: the K order of the accumulation, hence the bits."""

GPU_TIERS: tuple[tuple[int | None, GemmConfig], ...] = (
    # (max rows T, config); the first tier with T <= max rows is used, None = no limit.
    # bf16 operands. Measured on an H200 (Triton 3.6, benchmarks/gemm_configs.py, CUDA-graph
    # timing, results/h200_perf2/gemm_tma_graph.log): the fastest config per row range summed
    # over the layer shapes of the 8B widths.
    (64, GemmConfig(64, 32, 64, 4, 5, tma=True)),          # decode: narrow tiles fill 132 SMs
    (128, GemmConfig(64, 64, 64, 4, 4, tma=True)),
    (256, GemmConfig(64, 128, 64, 4, 4, tma=True)),
    (1024, GemmConfig(128, 128, 64, 4, 4, tma=True)),
    (None, GemmConfig(128, 256, 64, 8, 3, tma=True, persistent=True)),  # prefill/training (>= cuBLAS at 16k rows)
)
FP32_OUT_LAST_TIER = GemmConfig(128, 128, 64, 8, 4, tma=True, persistent=True)
"""The last tier for fp32 outputs (LM head): a 128x256 fp32 output tile does not fit in shared memory."""

FP32_OPERAND_TIERS: tuple[tuple[int | None, GemmConfig], ...] = (
    # fp32 operands (router GEMM, IEEE dot, masked pointer loads): twice the bytes per tile.
    (64, GemmConfig(64, 32, 64, 4, 5)),
    (512, GemmConfig(128, 64, 64, 4, 4)),
    (None, GemmConfig(128, 128, 64, 8, 3)),
)
for _tiers in (GPU_TIERS, FP32_OPERAND_TIERS):
    for _max_rows, _cfg in _tiers + ((None, FP32_OUT_LAST_TIER),):
        # The family the tier-independence of the bits rests on (module docstring):
        # same K step, wgmma-sized row tiles. Anything else must not be a tier.
        assert _cfg.block_k == BIT_COMPATIBLE_BLOCK_K and _cfg.block_m >= 64, (_max_rows, _cfg)
    assert _tiers[-1][0] is None, "the last GPU tier must take any number of rows"
del _tiers, _max_rows, _cfg

# The interpreter pays per program instance: big tiles (DESIGN.md, "Known facts");
# BLOCK_K = 64 keeps the [M, K, N] fp64 product of interpreter_dot within
# Triton's 2**20-element tensor limit. One config for every T (the CPU bits are
# exact fp64 sums anyway, so they do not depend on the tiles).
INTERPRETER_CONFIG = GemmConfig(64, 256, 64, 4, 1)

DEFAULT_CONFIG = INTERPRETER_CONFIG if INTERPRET else GPU_TIERS[-1][1]
"""The config for large ``T`` (the last tier on GPU; the only one in the interpreter)."""

BLOCK_M, BLOCK_N, BLOCK_K = DEFAULT_CONFIG.block_m, DEFAULT_CONFIG.block_n, DEFAULT_CONFIG.block_k
NUM_WARPS, NUM_STAGES = DEFAULT_CONFIG.num_warps, DEFAULT_CONFIG.num_stages


def gemm_config(N: int, K: int, T: int, operand_dtype: torch.dtype = torch.bfloat16,
                out_dtype: torch.dtype = torch.bfloat16) -> GemmConfig:
    """The kernel configuration for ``T`` rows times a weight of shape ``[N, K]``.

    Under the interpreter: :data:`INTERPRETER_CONFIG` for every shape and ``T``.
    On the GPU: the first tier whose max rows is ``>= T`` of :data:`GPU_TIERS`
    (bf16 operands; TMA loads; the last tier persistent, or
    :data:`FP32_OUT_LAST_TIER` for fp32 outputs) or of
    :data:`FP32_OPERAND_TIERS` (fp32 operands). ``N`` and ``K`` do not enter today.

    The config depends on ``T``, but a row's bits do not: every tier uses
    ``BLOCK_K`` = :data:`BIT_COMPATIBLE_BLOCK_K`, ``BLOCK_M >= 64`` (Hopper
    wgmma) and a full K loop without split-K, so each output element is the
    same wgmma k16 steps in the same K order in every tier, whatever the tile
    shape, the loads (TMA or pointers) or the program order (persistent or
    not). That is a measured property of the compiled kernels
    (``benchmarks/gemm_configs.py``: every candidate bitwise equal) guarded
    by ``tests/gpu/test_ops_gpu.py::test_linear_tiers_give_identical_bits``;
    a new tier must pass that test.
    """
    if INTERPRET:
        return INTERPRETER_CONFIG
    tiers = FP32_OPERAND_TIERS if operand_dtype == torch.float32 else GPU_TIERS
    for max_rows, cfg in tiers:
        if max_rows is None or T <= max_rows:
            if max_rows is None and tiers is GPU_TIERS and out_dtype == torch.float32:
                return FP32_OUT_LAST_TIER
            return cfg
    raise AssertionError("unreachable: the last GPU tier has no row limit")


def tier_probe_rows() -> list[int]:
    """Row counts that, launched once each, compile every GPU tier of :func:`gemm_config`.

    The smallest row count of each tier and the same rounded up to a multiple of 16
    (Triton specializes integer arguments divisible by 16). ``[1]`` under the interpreter.
    """
    if INTERPRET:
        return [1]
    rows, lo = [], 1
    for max_rows, _ in GPU_TIERS:
        rows += sorted({lo, -(-lo // 16) * 16})
        if max_rows is None:
            break
        lo = max_rows + 1
    return rows


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
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

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


@triton.jit(do_not_specialize=["M", "NUM_PROGRAMS"])
def _linear_tma_kernel(x_desc, w_desc, b_ptr, out_desc, M, N, K, NUM_PROGRAMS,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr):
    """GPU only: the tile math of :func:`_linear_kernel` (fp32 accumulate of bf16
    ``tl.dot`` steps over K from 0 upwards, bias in fp32, one rounding) with TMA
    loads/stores (out-of-bounds rows/columns/K read as zero and are never stored).
    ``PERSISTENT``: ``NUM_PROGRAMS`` programs walk the tiles ``pid, pid + NUM_PROGRAMS, ...``."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    out_ty: tl.constexpr = out_desc.dtype
    # One loop for both launch modes: persistent programs stride over the tiles; otherwise
    # NUM_PROGRAMS = the number of tiles, so each program runs exactly one iteration.
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=PERSISTENT):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, ki * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        if HAS_BIAS:
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = acc + tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], round_to(acc, out_ty))


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA needs a unit last stride and 16-byte aligned base address and row stride."""
    es = t.element_size()
    return t.stride(-1) == 1 and (t.data_ptr() % 16 == 0) and (t.stride(0) * es) % 16 == 0


def _launch_tma(x_TK, weight_NK, bias, out, cfg: GemmConfig, has_bias: bool) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    T, K = x_TK.shape
    N = weight_NK.shape[0]
    x_desc = TensorDescriptor(x_TK, [T, K], [x_TK.stride(0), 1], [cfg.block_m, cfg.block_k])
    w_desc = TensorDescriptor(weight_NK, [N, K], [weight_NK.stride(0), 1], [cfg.block_n, cfg.block_k])
    o_desc = TensorDescriptor(out, [T, N], [out.stride(0), 1], [cfg.block_m, cfg.block_n])
    tiles = triton.cdiv(T, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    programs = min(tiles, _num_sms(x_TK.device)) if cfg.persistent else tiles
    _linear_tma_kernel[(programs,)](
        x_desc, w_desc, bias, o_desc, T, N, K, programs,
        HAS_BIAS=has_bias, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=GROUP_M,
        PERSISTENT=cfg.persistent,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


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
    cfg = config if config is not None else gemm_config(N, K, T, x_TK.dtype, out_dtype)
    if cfg.tma and not fp32_dot and _tma_ok(x_TK) and _tma_ok(weight_NK) and _tma_ok(out):
        _launch_tma(x_TK, weight_NK, bias, out, cfg, bias_N is not None)
        return out
    grid = (triton.cdiv(T, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _linear_kernel[grid](
        x_TK, weight_NK, bias, out, T, N, K,
        x_TK.stride(0), x_TK.stride(1), weight_NK.stride(0), weight_NK.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias_N is not None, FP32_DOT=fp32_dot,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=GROUP_M,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out
