"""MoE in Triton: grouped relu2-expert GEMMs over tokens sorted by expert, and the ordered combine.

Grouped GEMM (one kernel, two launches per MoE):

* assignments ``r = t*K + k`` are sorted by ``(expert, t, k)`` (a unique key:
  one permutation for given ids) and each expert's run is padded to a
  multiple of ``BLOCK_M``, so every ``BLOCK_M``-row tile belongs to ONE expert
  (``tile_expert``); padding rows carry the sentinel ``R`` and are masked;
* each program computes one ``[BLOCK_M, BLOCK_N]`` output tile over the FULL
  reduction dim in fixed ``BLOCK_K`` steps: no split-K, no atomics, no
  autotuning, tiles fixed per weight shape ``(N, K)`` (:func:`gemm_tiles`),
  never by the number of tokens. A row's result is the same whichever tile or
  rows it shares (DESIGN.md rules 1, 2); the number of tiles (the grid) is the
  only thing that follows the batch. On GPU the grid is an upper bound
  (``cdiv(R, BLOCK_M) + min(E, R)`` tiles, no host sync; extra programs exit);
* launch 1 (up): A rows gathered from ``x[r // K]``; epilogue ``relu(acc)^2``
  in fp32, rounded once to the activation dtype into ``h`` (padded layout);
* launch 2 (down): A = ``h``; fp32 output scattered to row ``r`` of
  ``y [R, D]``;
* NVFP4 weights (uint8 codes ``[E, N, K/2]``, e4m3 block scales
  ``[E, N, K/16]``, fp32 ``weight_scale_2 [E]``) are dequantized inside the K
  loop to bf16 tiles by ModelOpt's rule, ``bf16(e2m1 * fp32(fp32(scale) *
  ws2))`` (e4m3 and e2m1 decoded exactly with integer arithmetic), then fed
  to the same ``tl.dot``: the H200 has no FP4 tensor cores (W4A16);
* block-FP8 weights (:class:`~unified_models.ops.fp8_block.FP8BlockExperts`: e4m3
  ``[E, N, K]``, one power-of-two scale per 128x128 block; DeepSeek-V4) likewise:
  each byte decoded exactly, times its block's scale (exact), one rounding to the
  activation dtype: the values of ``FP8BlockExperts.dequantize``, so the same dot
  inputs as dequantizing the stack first (:func:`fp8_dequantize_rows_per_expert`).

Combine: per ``[BLOCK_T, BLOCK_D]`` tile, ``acc = acc + w_k * y_k`` for
``k = 0..K-1`` in fp32 (slot order), then ``+ shared``, then one rounding.

Under the interpreter (CPU) the dots are exact fp64 products summed in
numpy's fixed order (:func:`interpreter_dot`) and rounded once, so the kernel
equals the CPU torch implementation (``ops.moe.moe_expert_outputs_torch``,
``moe_combine_torch``) bit for bit and does not depend on the host's BLAS.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..fp8_block.common import BLOCK as FP8_BLOCK
from ..fp8_block.experts import FP8BlockExperts
from ..nvfp4 import NVFP4Weight
from .common import expert_counts
from ..triton._common import _INTERP, INTERPRET, check_device, e4m3_bits_to_f32, interpreter_dot, round_f64_to, round_to

if INTERPRET:
    # Few, big programs (the interpreter pays per program); BLOCK_M stays small
    # because every expert's run is padded to it. [16, 64, 128] fp64 products
    # per interpreter_dot stay within Triton's 2**20-element limit.
    BLOCK_M, BLOCK_N, BLOCK_K = 16, 128, 64
    NUM_WARPS, NUM_STAGES = 4, 1
    COMBINE_T, COMBINE_D = 64, 512
else:
    # Hopper: bf16 wgmma tiles, fp32 accumulation. One fixed config for every
    # expert shape (not tuned on the H200 yet; a per-(N, K) table may replace it,
    # never a per-batch choice).
    BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64
    NUM_WARPS, NUM_STAGES = 4, 3
    COMBINE_T, COMBINE_D = 16, 256

_DTYPES = (torch.bfloat16, torch.float32)

NVFP4_DEQUANTIZE_ROWS_PER_EXPERT = BLOCK_M
"""At ``T * top_k >= this * E`` assignments (one row tile per expert on average) the NVFP4 experts
are dequantized once per call (:func:`nvfp4_dequantize_experts_triton`) instead of in every row
tile's K loop. Below it most experts have one row tile, whose K loop dequantizes each weight tile
exactly once; above it the second and later row tiles of an expert repeat that work. Measured on
the H200 (Nano widths, 128 experts, top-6, ``benchmarks/moe_kernels.py``; session 24,
``benchmarks/results/h200_session24/moe_kernels.json``), in-loop vs once: T = 256 (12 rows per
expert) 1.92 vs 2.15 ms; T = 2,048 (96) 3.68 vs 2.47 ms; T = 16,384 (768) 21.0 vs 6.9 ms. Routed
decode batches (T <= 512 with top-6 of 128: <= 24 rows per expert) stay below the threshold and
allocate nothing. The tests check that both paths give the same bits (the batch size picks the
path)."""


FP8_DEQUANTIZE_ROWS_PER_EXPERT = 8 * BLOCK_M
"""At ``T * top_k >= this * E`` assignments the block-FP8 experts are dequantized once per call
(:func:`unified_models.ops.fp8_block.triton.fp8_block_dequantize_triton`) instead of in every row
tile's K loop (:func:`_w_tile`), on GPUs that convert e4m3 themselves (:func:`_gpu_converts_e4m3`).
Below it each weight is read as 1 byte and converted in the tile instead of dequantizing the whole
stack (read 1, write 2, read 2 bytes per weight) on every forward. Measured on the H100 (session 38,
``benchmarks/results/h100_session38/deepseek_experts_hw_cvt``; 32 experts, top-6): in-loop 0.21 /
0.54 / 0.64 ms at T = 1 / 8 / 256 against 1.25 / 1.65 / 1.80 ms once, and still 2.92 against 3.21 ms at
T = 2,048 (384 rows per expert). Both paths give the GEMM the same bf16/fp32 values with the same
launch (tiles, warps), so a row's bits do not depend on the path
(``tests/ops/test_fp8_block_experts.py``, natively on the H100 too)."""

FP8_DEQUANTIZE_ROWS_PER_EXPERT_BYTE_DECODE = BLOCK_M
"""The same threshold where the tiles decode bytes with integer ops (the interpreter; GPUs before
sm_89): that decode is slower than one dequantization from 384 rows per expert on (7.6 against
3.2 ms at T = 2,048 on the H100, session 38, before the GPU conversion), the NVFP4 rule
(:data:`NVFP4_DEQUANTIZE_ROWS_PER_EXPERT`)."""


def fp8_dequantize_rows_per_expert(weight: torch.Tensor) -> int:
    """The rows per expert from which block-FP8 experts stored in ``weight`` (e4m3 ``[E, N, K]``) are
    dequantized once per call instead of in the K loop: :data:`FP8_DEQUANTIZE_ROWS_PER_EXPERT` where the
    GPU converts e4m3, :data:`FP8_DEQUANTIZE_ROWS_PER_EXPERT_BYTE_DECODE` elsewhere."""
    return FP8_DEQUANTIZE_ROWS_PER_EXPERT if _gpu_converts_e4m3(weight) else FP8_DEQUANTIZE_ROWS_PER_EXPERT_BYTE_DECODE


class MoeTiles(NamedTuple):
    """One launch configuration of the grouped expert GEMM (rows, columns, reduction step, warps,
    pipeline stages). Tiles change which program computes an output element, never the order of
    its fp32 sum (full K in ``block_k`` steps)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


NVFP4_IN_LOOP_TILES = (MoeTiles(BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES) if INTERPRET
                       else MoeTiles(64, 64, 64, 4, 4))
"""Launch of the GEMM that dequantizes NVFP4 weight tiles in its K loop (small batches: decode).
Half-width column tiles halve the dequantization each program repeats before its first dot; the
row tile and the K step (so the plan and every sum's order) are the bf16 GEMM's. Measured on the
H200 (session 24, ``benchmarks/results/h200_session24/moe_kernels.json``, Nano widths): T = 64:
1.50 vs 1.84 ms, T = 256: 1.56 vs 1.92 ms, the same bits as the default launch."""


LARGE_BATCH_TILES = (MoeTiles(BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES) if INTERPRET
                     else MoeTiles(128, 256, 64, 8, 3))
"""Launch of the bf16 GEMM (bf16 experts, or NVFP4 experts dequantized once per call) on large
batches: at least :data:`LARGE_BATCH_ROWS_PER_EXPERT` rows per expert on average (prefill, the
trainer's micro-batches). 128-row tiles pad each expert's run to 128 rows, which only pays when
most experts have more than one 64-row tile. The K step (64) and so the order of every row's fp32
sum are the default launch's; the H200 gave the default launch's bits at every T measured (session
24, ``benchmarks/results/h200_session24/moe_kernels.json``, Nano widths: candidate
``128x256x64_w8_s3``, bf16 and NVFP4 at T = 64 ... 16,384), and
``tests/gpu/test_hybrid_ops_gpu.py::test_moe_large_batch_tiles_same_bits`` checks it. Times there,
default vs this launch: bf16 T = 2,048 (96 rows per expert) 1.043 vs 0.950 ms, T = 16,384 5.554 vs
4.448 ms; NVFP4 dequantized once, T = 16,384: 6.861 vs 6.204 ms."""

LARGE_BATCH_ROWS_PER_EXPERT = 64
"""At ``T * top_k >= this * E`` assignments the bf16 GEMMs take :data:`LARGE_BATCH_TILES`
(the same threshold as :data:`NVFP4_DEQUANTIZE_ROWS_PER_EXPERT`: one 64-row tile per expert on
average). Below it (decode batches) the default 64-row tiles waste less padding."""


def gemm_tiles(n: int, k: int, nvfp4_in_loop: bool = False, large_batch: bool = False) -> MoeTiles:
    """The launch configuration for a ``[N, K]`` expert weight: a function of the weight shape,
    its format (NVFP4 dequantized in the K loop: :data:`NVFP4_IN_LOOP_TILES`), the batch tier
    (``large_batch``: :data:`LARGE_BATCH_TILES`) and the device kind. Every configuration has the
    same ``block_k``, so the order of each row's sum, and its bits, do not depend on the tier
    (checked on the GPU by the tests named in :data:`LARGE_BATCH_TILES`)."""
    del n, k
    if nvfp4_in_loop:
        return NVFP4_IN_LOOP_TILES
    if large_batch:
        return LARGE_BATCH_TILES
    return MoeTiles(BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES)


@triton.jit
def _e2m1_to_f32(c):
    """E2M1 codes (int32 0..15) -> fp32 {0, ±0.5, ..., ±6}; code 8 -> +0 (ModelOpt's table)."""
    mi = c & 7
    ex = mi >> 1
    bits = ((ex + 126) << 23) | ((mi & 1) << 22)
    mag = tl.where(ex == 0, mi.to(tl.float32) * 0.5, bits.to(tl.float32, bitcast=True))
    return tl.where(((c & 8) != 0) & (mi != 0), -mag, mag)


FMT_DENSE = tl.constexpr(0)
"""Weight format of :func:`_w_tile`: a tensor in the activations' dtype."""
FMT_NVFP4 = tl.constexpr(1)
"""Weight format of :func:`_w_tile`: NVFP4 codes ``[E, N, K/2]`` (ModelOpt)."""
FMT_FP8_BLOCK = tl.constexpr(2)
"""Weight format of :func:`_w_tile`: block-FP8 bytes ``[E, N, K]`` with fp32 block scales ``[E, N/128, K/128]``."""


@triton.jit
def _w_tile(w_ptr, ws_ptr, ws2, e64, offs_n, mask_n, k0, K, stride_we, stride_wn, stride_wk,
            stride_se, stride_sn, stride_sk, FMT: tl.constexpr, dtype: tl.constexpr, BLOCK_K: tl.constexpr):
    """The ``[BLOCK_K, BLOCK_N]`` tile ``W[e, n, k0:k0+BLOCK_K]^T`` in ``dtype`` (quantized formats dequantized).

    NVFP4 (``FMT_NVFP4``): each code byte is loaded once and both its nibbles decoded (low nibble
    = even ``k``), each e4m3 block scale once per 16 values and broadcast; the values are
    ModelOpt's ``bf16(e2m1 * fp32(fp32(scale) * ws2))`` exactly as one scale per element
    would give them (same fp32 products, one rounding). ``K`` is a multiple of 16 there.

    Block FP8 (``FMT_FP8_BLOCK``): the e4m3 values decoded exactly, times the fp32 scale of the
    128x128 block (a power of two: exact), one rounding: DeepSeek's ``weight_dequant``, the values
    of :func:`~unified_models.ops.fp8_block.triton.fp8_block_dequantize_triton`. ``BLOCK_K`` divides
    128, so a tile's K range lies in one scale block. The decode: with an e4m3 pointer
    (:func:`_weight_args` on sm_89+) the GPU's conversion instruction (e4m3 widens to fp32
    without rounding); with a byte pointer the integer decode
    (:func:`~unified_models.ops.triton._common.e4m3_bits_to_f32`), ~15 integer ops per value on an
    int32 tile (the H100 run of session 38 read the experts at 0.10-0.17 of HBM bandwidth that way).
    The same values for every non-NaN code (the NaN codes, which no quantizer writes, may differ
    in payload).
    """
    if FMT == FMT_NVFP4:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte = tl.load(w_ptr + e64 * stride_we + offs_n[:, None] * stride_wn + kb[None, :] * stride_wk,
                       mask=mask_n[:, None] & (kb < K // 2)[None, :], other=0).to(tl.int32)  # [BN, BK/2]
        ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        sb = tl.load(ws_ptr + e64 * stride_se + offs_n[:, None] * stride_sn + ks[None, :] * stride_sk,
                     mask=mask_n[:, None] & (ks < K // 16)[None, :], other=0).to(tl.int32)  # [BN, BK/16]
        blk = e4m3_bits_to_f32(sb) * ws2
        vals = tl.join(_e2m1_to_f32(byte & 15), _e2m1_to_f32(byte >> 4))  # [BN, BK/2, 2]: k = 2*kb + j
        vals = tl.reshape(vals, (offs_n.shape[0], BLOCK_K // 16, 16))
        w = tl.reshape(vals * blk[:, :, None], (offs_n.shape[0], BLOCK_K))
        w = tl.trans(round_to(w, dtype))
    elif FMT == FMT_FP8_BLOCK:
        kk = k0 + tl.arange(0, BLOCK_K)
        live = (kk < K)[:, None] & mask_n[None, :]
        ptrs = w_ptr + e64 * stride_we + offs_n[None, :] * stride_wn + kk[:, None] * stride_wk  # [BK, BN]
        sc = tl.load(ws_ptr + e64 * stride_se + (offs_n // 128)[None, :] * stride_sn + (k0 // 128) * stride_sk,
                     mask=mask_n[None, :], other=0.0)  # [1, BN] fp32
        if w_ptr.dtype.element_ty == tl.float8e4nv:  # the GPU's own e4m3 -> fp32 conversion (exact)
            v = tl.where(live, tl.load(ptrs, mask=live).to(tl.float32), 0.0)
        else:  # bytes: the integer decode (the interpreter, GPUs without e4m3 conversions)
            v = e4m3_bits_to_f32(tl.load(ptrs, mask=live, other=0).to(tl.int32))
        w = round_to(v * sc, dtype)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + e64 * stride_we + offs_n[None, :] * stride_wn + kk[:, None] * stride_wk,
                    mask=(kk < K)[:, None] & mask_n[None, :], other=0.0)
    return w


@triton.jit
def _nvfp4_dequantize_kernel(w_ptr, ws_ptr, ws2_ptr, out_ptr, N, K,
                             stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                             stride_oe, stride_on, stride_ok,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``[BLOCK_N, BLOCK_K]`` tile of one expert's weight, dequantized by :func:`_w_tile` (the
    grouped GEMM's own NVFP4 tile: the same values, element for element)."""
    e64 = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k0 = tl.program_id(2) * BLOCK_K
    ws2 = tl.load(ws2_ptr + e64)
    w = _w_tile(w_ptr, ws_ptr, ws2, e64, offs_n, mask_n, k0, K, stride_we, stride_wn, stride_wk,
                stride_se, stride_sn, stride_sk, FMT_NVFP4, out_ptr.dtype.element_ty, BLOCK_K)  # [BK, BN]
    kk = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + e64 * stride_oe + offs_n[None, :] * stride_on + kk[:, None] * stride_ok, w,
             mask=(kk < K)[:, None] & mask_n[None, :])


def nvfp4_dequantize_experts_triton(w: NVFP4Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Stacked NVFP4 experts ``[E, N, K/2]`` -> ``[E, N, K]`` in ``dtype``, the values the grouped GEMM
    dequantizes in its K loop (ModelOpt's ``dtype(e2m1 * fp32(fp32(scale) * weight_scale_2))``, equal
    to :func:`unified_models.ops.nvfp4.nvfp4_dequantize` bit for bit).

    Raises:
        ValueError: not a stacked ``[E, N, K/2]`` NVFP4 weight, or ``dtype`` not bf16/fp32.
    """
    if not isinstance(w, NVFP4Weight):
        raise ValueError(f"nvfp4_dequantize_experts_triton: expected an NVFP4Weight, got {type(w).__name__}")
    if dtype not in _DTYPES:
        raise ValueError(f"nvfp4_dequantize_experts_triton: dtype {dtype} must be bf16 or fp32")
    w_ptr, ws_ptr, ws2_ptr, (swe, swn, swk), (sse, ssn, ssk), _ = _weight_args(w, "experts", dtype)  # NVFP4
    E, N, K = w.shape
    out = torch.empty(E, N, K, dtype=dtype, device=w.weight.device)
    if out.numel() == 0:
        return out
    bn, bk = (16, 64) if INTERPRET else (64, 128)
    _nvfp4_dequantize_kernel[(E, triton.cdiv(N, bn), triton.cdiv(K, bk))](
        w_ptr, ws_ptr, ws2_ptr, out, N, K, swe, swn, swk, sse, ssn, ssk, *out.stride(),
        BLOCK_N=bn, BLOCK_K=bk, num_warps=4)
    return out


@triton.jit(do_not_specialize=["R"])
def _moe_gemm_kernel(a_ptr, w_ptr, ws_ptr, ws2_ptr, out_ptr, ids_ptr, tile_expert_ptr,
                     R, N, K, E,
                     stride_am, stride_ak, stride_we, stride_wn, stride_wk,
                     stride_se, stride_sn, stride_sk, stride_om, stride_on,
                     TOPK: tl.constexpr, GATHER_A: tl.constexpr, SCATTER_OUT: tl.constexpr,
                     RELU2: tl.constexpr, FMT: tl.constexpr, FP32_DOT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    e = tl.load(tile_expert_ptr + pid_m)
    if e < E:
        e64 = e.to(tl.int64)
        offs_p = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rid = tl.load(ids_ptr + offs_p).to(tl.int64)
        valid = rid < R
        if GATHER_A:
            arow = rid // TOPK
        else:
            arow = offs_p
        if SCATTER_OUT:
            orow = rid
        else:
            orow = offs_p
        offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        if FMT == FMT_NVFP4:
            ws2 = tl.load(ws2_ptr + e64)
        else:
            ws2 = 0.0
        a_ptrs = a_ptr + arow[:, None] * stride_am + offs_k[None, :] * stride_ak
        wdt = a_ptr.dtype.element_ty
        if _INTERP:
            # exact fp64 products summed in numpy's fixed order, one rounding (== the CPU torch path)
            acc64 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                mask_k = kk < K
                a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
                w = _w_tile(w_ptr, ws_ptr, ws2, e64, offs_n, mask_n, k0, K,
                            stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, FMT, wdt, BLOCK_K)
                acc64 += interpreter_dot(a, w)
                a_ptrs += BLOCK_K * stride_ak
            acc = round_f64_to(acc64, tl.float32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                mask_k = kk < K
                a = tl.load(a_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
                w = _w_tile(w_ptr, ws_ptr, ws2, e64, offs_n, mask_n, k0, K,
                            stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, FMT, wdt, BLOCK_K)
                if FP32_DOT:
                    acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, w, acc)
                a_ptrs += BLOCK_K * stride_ak
        if RELU2:
            r = tl.maximum(acc, 0.0)
            acc = r * r
        out_ptrs = out_ptr + orow[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out_ptrs, round_to(acc, out_ptr.dtype.element_ty), mask=valid[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["T"])
def _moe_combine_kernel(y_ptr, w_ptr, s_ptr, out_ptr, T, D, stride_yr, stride_wt, stride_st, stride_ot,
                        TOPK: tl.constexpr, HAS_SHARED: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_t = offs_t < T
    mask = mask_t[:, None] & (offs_d < D)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        w = tl.load(w_ptr + offs_t * stride_wt + k, mask=mask_t, other=0.0)
        y = tl.load(y_ptr + (offs_t * TOPK + k)[:, None] * stride_yr + offs_d[None, :], mask=mask, other=0.0)
        acc = acc + w[:, None] * y
    if HAS_SHARED:
        acc = acc + tl.load(s_ptr + offs_t[:, None] * stride_st + offs_d[None, :], mask=mask,
                            other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_t[:, None] * stride_ot + offs_d[None, :], round_to(acc, out_ptr.dtype.element_ty),
             mask=mask)


def moe_plan(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int, exact: bool):
    """Padded expert-sorted layout of the assignments.

    Returns:
        ``(sorted_ids [n_tiles * block_m] int32, tile_expert [n_tiles] int32, n_tiles)``:
        ``sorted_ids`` holds assignment ids ``r = t*K + k`` sorted by
        ``(expert, t, k)``, each expert's run padded to ``block_m`` with the
        sentinel ``R``; ``tile_expert[j]`` is tile j's expert (``E`` past the
        end). ``exact``: the exact tile count (host sync; CPU); else the upper
        bound ``cdiv(R, block_m) + min(E, R)`` (no sync; GPU, CUDA graphs).
    """
    if num_experts == 1:  # one expert (a shared expert: every token, row order): the same layout, no sort
        return _one_expert_plan(topk_ids_TK.numel(), block_m, exact, topk_ids_TK.device)
    return _sorted_plan(topk_ids_TK, num_experts, block_m, exact)


def _sorted_plan(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int, exact: bool):
    """:func:`moe_plan` for any expert count: a stable sort of the assignments by expert (on a GPU
    without the host sync, :func:`_sorted_plan_triton`: the same tensors in 2 launches)."""
    if not exact and topk_ids_TK.is_cuda and topk_ids_TK.numel() > 0 and block_m & (block_m - 1) == 0:
        return _sorted_plan_triton(topk_ids_TK, num_experts, block_m)
    dev = topk_ids_TK.device
    flat = topk_ids_TK.reshape(-1).long()
    R = flat.shape[0]
    E = num_experts
    ar = torch.arange(R, device=dev)
    order = torch.argsort(flat * R + ar)
    se = flat[order]
    counts = expert_counts(se, E)
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    pstart = pend - padded
    start = torch.cumsum(counts, 0) - counts
    pos = pstart[se] + (ar - start[se])
    n_tiles = int(pend[-1]) // block_m if exact else triton.cdiv(R, block_m) + min(E, R)
    sorted_ids = torch.full((n_tiles * block_m,), R, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    tiles = torch.arange(n_tiles, device=dev, dtype=torch.long) * block_m
    tile_expert = torch.searchsorted(pend, tiles, right=True).to(torch.int32)
    return sorted_ids, tile_expert, n_tiles


PLAN_BLOCK_R = 1024
"""Assignments each program of the plan kernels reads per step."""


@triton.jit(do_not_specialize=["R"])
def _plan_counts_kernel(ids_ptr, counts_ptr, R, BLOCK_R: tl.constexpr):
    """Program ``e``: ``counts[e]`` = the assignments to expert ``e`` (integer sums: no order to fix)."""
    e = tl.program_id(0)
    n = tl.zeros((BLOCK_R,), dtype=tl.int32)
    for r0 in range(0, R, BLOCK_R):
        offs = r0 + tl.arange(0, BLOCK_R)
        ids = tl.load(ids_ptr + offs, mask=offs < R, other=-1)
        n += (ids == e).to(tl.int32)
    tl.store(counts_ptr + e, tl.sum(n, axis=0))


@triton.jit(do_not_specialize=["R", "E", "NUM_TILES"])
def _plan_scatter_kernel(ids_ptr, counts_ptr, sorted_ids_ptr, tile_expert_ptr, R, E, NUM_TILES,
                         BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program ``e`` writes expert ``e``'s run of :func:`moe_plan`'s layout: its assignments in
    increasing ``r`` (a running rank over the blocks of ``ids``), then the sentinel ``R`` up to the
    next multiple of ``BLOCK_M``, and ``tile_expert = e`` over its tiles. The last program also
    writes the tail past every run (sentinels, ``tile_expert = E``)."""
    e = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    c = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(offs_e < e, padded, 0), axis=0)
    mine = tl.sum(tl.where(offs_e == e, c, 0), axis=0)
    my_end = start + tl.sum(tl.where(offs_e == e, padded, 0), axis=0)
    run = start
    for r0 in range(0, R, BLOCK_R):
        offs = r0 + tl.arange(0, BLOCK_R)
        hit = (tl.load(ids_ptr + offs, mask=offs < R, other=-1) == e).to(tl.int32)
        tl.store(sorted_ids_ptr + run + tl.cumsum(hit, axis=0) - 1, offs, mask=hit != 0)
        run += tl.sum(hit, axis=0)
    pad = start + mine + tl.arange(0, BLOCK_M)
    tl.store(sorted_ids_ptr + pad, R + tl.zeros((BLOCK_M,), dtype=tl.int32), mask=pad < my_end)
    for j0 in range(start // BLOCK_M, my_end // BLOCK_M, BLOCK_R):
        j = j0 + tl.arange(0, BLOCK_R)
        tl.store(tile_expert_ptr + j, e + tl.zeros((BLOCK_R,), dtype=tl.int32), mask=j < my_end // BLOCK_M)
    if e == E - 1:  # the tail: my_end is the end of every run here
        for p0 in range(my_end, NUM_TILES * BLOCK_M, BLOCK_R):
            p = p0 + tl.arange(0, BLOCK_R)
            tl.store(sorted_ids_ptr + p, R + tl.zeros((BLOCK_R,), dtype=tl.int32), mask=p < NUM_TILES * BLOCK_M)
        for j0 in range(my_end // BLOCK_M, NUM_TILES, BLOCK_R):
            j = j0 + tl.arange(0, BLOCK_R)
            tl.store(tile_expert_ptr + j, E + tl.zeros((BLOCK_R,), dtype=tl.int32), mask=j < NUM_TILES)


def _sorted_plan_triton(topk_ids_TK: torch.Tensor, num_experts: int, block_m: int):
    """:func:`moe_plan` (``exact=False``: ``cdiv(R, block_m) + min(E, R)`` tiles) in two kernels, no sort
    and no host sync: per-expert counts, then each expert's run written by one program. The same tensors
    as the sort (:func:`_sorted_plan`; ``tests/ops/test_moe.py::test_triton_plan_equals_the_sorted_one``);
    on the GPU the sort was ~20 launches per MoE layer and step, a radix sort inside every decode graph.

    Args:
        topk_ids_TK: ``[T, K]`` integer expert ids in ``[0, num_experts)`` (any strides), ``T * K > 0``. An id
            outside that range is not checked (that would wait for the device) and its assignment is dropped:
            the router never produces one.
        num_experts: ``E``.
        block_m: the GEMM's row tile, a power of two (:func:`_sorted_plan` sorts otherwise).

    Returns:
        ``(sorted_ids [n_tiles * block_m] int32, tile_expert [n_tiles] int32, n_tiles)``.
    """
    ids = topk_ids_TK.reshape(-1).contiguous()  # the kernels read it densely (a strided view reshapes to one)
    if ids.dtype not in (torch.int32, torch.int64):
        ids = ids.long()
    R, E = ids.shape[0], num_experts
    n_tiles = triton.cdiv(R, block_m) + min(E, R)
    counts = torch.empty(E, dtype=torch.int32, device=ids.device)
    sorted_ids = torch.empty(n_tiles * block_m, dtype=torch.int32, device=ids.device)
    tile_expert = torch.empty(n_tiles, dtype=torch.int32, device=ids.device)
    _plan_counts_kernel[(E,)](ids, counts, R, BLOCK_R=PLAN_BLOCK_R)
    _plan_scatter_kernel[(E,)](ids, counts, sorted_ids, tile_expert, R, E, n_tiles, BLOCK_M=block_m,
                               BLOCK_R=PLAN_BLOCK_R, BLOCK_E=triton.next_power_of_2(E))
    return sorted_ids, tile_expert, n_tiles


def _one_expert_plan(R: int, block_m: int, exact: bool, dev: torch.device):
    """:func:`moe_plan` of ``R`` assignments to one expert, built directly (3 kernels instead of the
    argsort, counts, cumsums, scatter and searchsorted): the assignments in order, then the sentinel
    ``R``; tile ``j`` is expert 0's while ``j < cdiv(R, block_m)``, else past the end (1). The same
    tensors as the general form (``tests/ops/test_moe.py::test_one_expert_plan_equals_the_sorted_one``)."""
    used = triton.cdiv(R, block_m)
    n_tiles = used if exact else used + min(1, R)
    sorted_ids = torch.full((n_tiles * block_m,), R, dtype=torch.int32, device=dev)
    sorted_ids[:R] = torch.arange(R, dtype=torch.int32, device=dev)
    tile_expert = (torch.arange(n_tiles, device=dev) >= used).to(torch.int32)
    return sorted_ids, tile_expert, n_tiles


def _gpu_converts_e4m3(w: torch.Tensor) -> bool:
    """True for a CUDA tensor on an NVIDIA GPU with e4m3 conversion instructions (compute capability
    >= 8.9: Ada, Hopper and later); the interpreter, older GPUs and ROCm (whose capability numbers
    mean something else, and whose FP8 is another format) take the integer decode."""
    return (w.is_cuda and not INTERPRET and torch.version.hip is None
            and torch.cuda.get_device_capability(w.device) >= (8, 9))


def _weight_args(w, what: str, dtype: torch.dtype):
    """(w_ptr, ws_ptr, ws2_ptr, strides (we, wn, wk), scale strides (se, sn, sk), format) for :func:`_w_tile`;
    format ``FMT_DENSE`` / ``FMT_NVFP4`` / ``FMT_FP8_BLOCK`` as an int."""
    if isinstance(w, NVFP4Weight):
        if w.weight.dim() != 3:
            raise ValueError(f"moe_triton: {what} NVFP4 weight must be stacked [E, N, K/2]")
        s = w.weight_scale.view(torch.uint8)
        s2 = w.weight_scale_2.contiguous()
        return w.weight, s, s2, w.weight.stride(), s.stride(), FMT_NVFP4.value
    if isinstance(w, FP8BlockExperts):
        if w.weight.dim() != 3:
            raise ValueError(f"moe_triton: {what} block-FP8 weight must be stacked [E, N, K]")
        # e4m3 values where the GPU converts them (sm_89+), else bytes the kernel decodes (_w_tile)
        b = w.weight if _gpu_converts_e4m3(w.weight) else w.weight.view(torch.uint8)
        s = w.weight_scale_inv.float()  # ue8m0 -> fp32 powers of two (exact; [E, N/128, K/128], small)
        return b, s, s, b.stride(), s.stride(), FMT_FP8_BLOCK.value
    if w.dtype != dtype:
        raise ValueError(f"moe_triton: {what} weight dtype {w.dtype} differs from the activations' {dtype}")
    return w, w, w, w.stride(), (0, 0, 0), FMT_DENSE.value


def _launch(a, w, out, sorted_ids, tile_expert, n_tiles, R, E, topk, gather, scatter, relu2, what,
            tiles: MoeTiles | None = None):
    N, K = w.shape[1], w.shape[2]
    t = tiles or gemm_tiles(N, K)
    w_ptr, ws_ptr, ws2_ptr, (swe, swn, swk), (sse, ssn, ssk), fmt = _weight_args(w, what, a.dtype)
    if fmt == FMT_FP8_BLOCK.value and FP8_BLOCK % t.block_k:
        raise ValueError(f"moe_triton: {what} block-FP8 weight needs block_k dividing {FP8_BLOCK}, got {t.block_k}")
    grid = (n_tiles * triton.cdiv(N, t.block_n),)
    _moe_gemm_kernel[grid](
        a, w_ptr, ws_ptr, ws2_ptr, out, sorted_ids, tile_expert, R, N, K, E,
        a.stride(0), a.stride(1), swe, swn, swk, sse, ssn, ssk, out.stride(0), out.stride(1),
        TOPK=topk, GATHER_A=gather, SCATTER_OUT=scatter, RELU2=relu2, FMT=fmt,
        FP32_DOT=INTERPRET or a.dtype == torch.float32,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages)


def moe_expert_outputs_triton(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, up, down,
                              tiles: tuple[MoeTiles, MoeTiles] | None = None) -> torch.Tensor:
    """fp32 ``[T*K, D]``: row ``t*K + k`` = ``fp32(round_x(relu(fp32(x_t up_e^T))^2) down_e^T)``,
    ``e = ids[t, k]``.

    Args:
        x_TD: ``[T, D]`` bf16 (or fp32) activations.
        topk_ids_TK: ``[T, K]`` integer expert ids.
        up: ``[E, I, D]`` tensor in ``x``'s dtype or stacked :class:`NVFP4Weight`.
        down: ``[E, D, I]`` likewise.
        tiles: ``(up, down)`` launch configurations with one ``block_m`` (benchmarks; default
            :func:`gemm_tiles` of each weight shape).

    Raises:
        ValueError: dtypes, shapes or devices do not match; ``tiles`` with two ``block_m``.
    """
    if x_TD.dtype not in _DTYPES:
        raise ValueError(f"moe_triton: x must be bf16 or fp32, got {x_TD.dtype}")
    E, I, D = up.shape
    if tuple(down.shape) != (E, D, I) or x_TD.shape[1] != D:
        raise ValueError(f"moe_triton: x {tuple(x_TD.shape)}, up {list(up.shape)}, down {list(down.shape)} "
                         "do not match")
    tensors = [x_TD, topk_ids_TK] + [t for w in (up, down) for t in
                                    ((w.weight, w.weight_scale, w.weight_scale_2) if isinstance(w, NVFP4Weight)
                                     else (w,))]
    check_device("moe_triton", *tensors)
    T, K = topk_ids_TK.shape
    R = T * K
    y = torch.empty(R, D, dtype=torch.float32, device=x_TD.device)
    if R == 0 or D == 0:
        return y
    if I == 0:
        return y.zero_()
    # Large batches (prefill, the trainer's micro-batches): each NVFP4 weight is dequantized once
    # instead of once per row tile, one at a time (one bf16 copy alive); the GEMM then reads the
    # very bf16 tiles its K loop would have made (same values, same dot): a row's bits do not
    # depend on the path.
    once = R >= NVFP4_DEQUANTIZE_ROWS_PER_EXPERT * E
    in_loop = [isinstance(w, NVFP4Weight) and not once for w in (up, down)]
    large = R >= LARGE_BATCH_ROWS_PER_EXPERT * E and not any(in_loop)
    up_tiles, down_tiles = tiles or (gemm_tiles(I, D, in_loop[0], large), gemm_tiles(D, I, in_loop[1], large))
    if up_tiles.block_m != down_tiles.block_m:
        raise ValueError(f"moe_triton: up and down tiles need one block_m, got {up_tiles.block_m} and "
                         f"{down_tiles.block_m}")
    bm = up_tiles.block_m
    sorted_ids, tile_expert, n_tiles = moe_plan(topk_ids_TK, E, bm, exact=INTERPRET)
    if n_tiles == 0:
        return y

    def weight(w):
        return nvfp4_dequantize_experts_triton(w, x_TD.dtype) if once and isinstance(w, NVFP4Weight) else w

    h = torch.empty(n_tiles * bm, I, dtype=x_TD.dtype, device=x_TD.device)
    _launch(x_TD, weight(up), h, sorted_ids, tile_expert, n_tiles, R, E, K, True, False, True, "up", up_tiles)
    _launch(h, weight(down), y, sorted_ids, tile_expert, n_tiles, R, E, K, False, True, False, "down", down_tiles)
    return y


def moe_combine_triton(expert_out_RD: torch.Tensor, topk_weights_TK: torch.Tensor, shared_TD: torch.Tensor | None,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """``[T, D]`` in ``out_dtype``: ``round(sum_k w_k y_k (+ shared))``, fp32, slot order.

    Raises:
        ValueError: dtypes/devices do not match.
    """
    if expert_out_RD.dtype != torch.float32:
        raise ValueError(f"moe_combine_triton: expert outputs must be fp32, got {expert_out_RD.dtype}")
    check_device("moe_combine_triton", expert_out_RD, topk_weights_TK, shared_TD)
    T, K = topk_weights_TK.shape
    D = expert_out_RD.shape[1]
    y = expert_out_RD.contiguous()
    w = topk_weights_TK.float().contiguous()
    out = torch.empty(T, D, dtype=out_dtype, device=y.device)
    if T == 0 or D == 0:
        return out
    s = shared_TD.contiguous() if shared_TD is not None else out
    grid = (triton.cdiv(T, COMBINE_T), triton.cdiv(D, COMBINE_D))
    _moe_combine_kernel[grid](y, w, s, out, T, D, y.stride(0), w.stride(0), s.stride(0), out.stride(0),
                              TOPK=K, HAS_SHARED=shared_TD is not None, BLOCK_T=COMBINE_T, BLOCK_D=COMBINE_D,
                              num_warps=4)
    return out
