"""Block-FP8 GEMM in Triton (rules: :mod:`unified_models.ops.fp8_block`).

One kernel over ``[BLOCK_M, 128]`` output tiles (``BLOCK_N = BLOCK_K = 128``: one weight
block per program and K step, so its ue8m0 scale is one scalar), a full K loop per program
(no split-K, no atomics, no autotune, ``T`` not specialized): every output element is the
same sequence of operations whatever the batch. Per K block: GPU ``tl.dot`` on e4m3 tiles
(Hopper fp8 wgmma, fp32 accumulate, promoted once per block: ``max_num_imprecise_acc =
128``); interpreter (CPU): the e4m3 bytes decoded exactly and the block dot formed in fp64
(:func:`~unified_models.ops.triton._common.interpreter_dot`, exact) and rounded once to fp32,
so the kernel equals :func:`~.cpu.fp8_block_linear_torch` bit for bit. Then
``acc = acc + (part * sx[t, kb]) * sw[n // 128, kb]`` in fp32, bias in fp32, one RNE
rounding. The 1x128 activation quantization runs before the launch in plain torch
(:func:`fp8_block_quantize_activation_triton`: elementwise and exact maxima, the same
bits on every device).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import (_INTERP, INTERPRET, check_device, e4m3_bits_to_f32, f32_to_e4m3_bits, grouped_tile,
                              interpreter_dot, round_to)
from .common import AMAX_FLOOR, BLOCK, E4M3_MAX

BLOCK_M = 64
NUM_WARPS, NUM_STAGES = (4, 1) if INTERPRET else (4, 3)
GROUP_M = 8


@triton.jit(do_not_specialize=["M"])
def _fp8_block_gemm_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, out_ptr, M, N, KB,
                           stride_xm, stride_xk, stride_sxm, stride_sxk, stride_wn, stride_wk,
                           stride_swn, stride_swk, stride_om, stride_on,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)[:, None]  # [BM, 1]
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)[None, :]  # [1, BN]
    kr = tl.arange(0, BLOCK_K)[None, :]
    kc = tl.arange(0, BLOCK_K)[:, None]
    mask_m = rm < M
    mask_n = rn < N
    x_ptrs = x_ptr + rm * stride_xm + kr * stride_xk
    w_ptrs = w_ptr + rn * stride_wn + kc * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, KB):
        sx = tl.load(sx_ptr + rm * stride_sxm + kb * stride_sxk, mask=mask_m, other=1.0)  # [BM, 1]
        sw = tl.load(sw_ptr + pid_n * stride_swn + kb * stride_swk)
        if _INTERP:
            a = tl.load(x_ptrs, mask=mask_m, other=0).to(tl.int32)
            b = tl.load(w_ptrs, mask=mask_n, other=0).to(tl.int32)
            part = interpreter_dot(e4m3_bits_to_f32(a), e4m3_bits_to_f32(b)).to(tl.float32)
        else:
            a = tl.load(x_ptrs, mask=mask_m, other=0.0)
            b = tl.load(w_ptrs, mask=mask_n, other=0.0)
            part = tl.dot(a, b, max_num_imprecise_acc=BLOCK_K)
        acc = acc + (part * sx) * sw
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + rm * stride_om + rn * stride_on, round_to(acc, out_ptr.dtype.element_ty),
             mask=mask_m & mask_n)


def fp8_block_linear_triton(x_TK: torch.Tensor, weight_q: torch.Tensor, weight_scale_inv: torch.Tensor,
                            bias_N: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The block-FP8 linear in Triton; arguments as :func:`~.dispatch.fp8_block_linear_forward`
    (checked there). Raises ``ValueError`` for tensors on different devices."""
    check_device("fp8_block_linear_triton", x_TK, weight_q, weight_scale_inv, bias_N)
    T, K = x_TK.shape
    N = weight_q.shape[0]
    out = torch.empty((T, N), dtype=out_dtype, device=x_TK.device)
    if T == 0 or N == 0:
        return out
    xq, sx = fp8_block_quantize_activation_triton(x_TK)
    sw = weight_scale_inv.float().contiguous()
    wq = weight_q
    if INTERPRET:  # bytes: the kernel decodes e4m3 itself (the interpreter's fp8 casts are unreliable)
        xq, wq = xq.view(torch.uint8), weight_q.view(torch.uint8)
    bias = bias_N.contiguous() if bias_N is not None else out
    grid = (triton.cdiv(T, BLOCK_M) * triton.cdiv(N, BLOCK),)
    _fp8_block_gemm_kernel[grid](
        xq, sx, wq, sw, bias, out, T, N, K // BLOCK,
        xq.stride(0), xq.stride(1), sx.stride(0), sx.stride(1), wq.stride(0), wq.stride(1),
        sw.stride(0), sw.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias_N is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK, BLOCK_K=BLOCK, GROUP_M=GROUP_M,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


@triton.jit
def _fp8_block_dequantize_kernel(w_ptr, s_ptr, out_ptr, N, K,
                                 stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                                 stride_oe, stride_on, stride_ok, BLOCK: tl.constexpr):
    """One ``128 x 128`` weight block of one expert: its e4m3 bytes decoded exactly
    (:func:`~unified_models.ops.triton._common.e4m3_bits_to_f32`, integer ops on every device), times
    the block's fp32 scale (a power of two: exact), one rounding to the output dtype."""
    e64 = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1).to(tl.int64)
    kb = tl.program_id(2).to(tl.int64)
    rn = nb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)[:, None]  # [B, 1]
    rk = kb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)[None, :]  # [1, B]
    mask = (rn < N) & (rk < K)
    b = tl.load(w_ptr + e64 * stride_we + rn * stride_wn + rk * stride_wk, mask=mask, other=0).to(tl.int32)
    s = tl.load(s_ptr + e64 * stride_se + nb * stride_sn + kb * stride_sk)
    w = e4m3_bits_to_f32(b) * s
    tl.store(out_ptr + e64 * stride_oe + rn * stride_on + rk * stride_ok, round_to(w, out_ptr.dtype.element_ty),
             mask=mask)  # round_to: RNE also below 2^-126 (the interpreter's cast is not)


def fp8_block_dequantize_triton(weight: torch.Tensor, weight_scale_inv: torch.Tensor,
                                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Block-FP8 weights ``[N, K]`` or a stack ``[E, N, K]`` -> the same shape in ``dtype``, one kernel
    (``weight * scale`` of each 128x128 block, DeepSeek's ``weight_dequant``): equal bit for bit to
    :meth:`unified_models.ops.fp8_block.experts.FP8BlockExperts.dequantize`'s torch form
    (``(w.float() * scale).to(dtype)``: the products are exact, one RNE rounding), except that a NaN
    code (0x7F / 0xFF, which no quantizer writes) gives the canonical NaN. Reads 1 byte and writes
    2 (bf16) per weight, where the torch form makes ~5 fp32 passes.

    Args:
        weight: float8_e4m3fn ``[..., N, K]`` (2-D or 3-D), K a multiple of 128.
        weight_scale_inv: float8_e8m0fnu or fp32 ``[..., ceil(N/128), K/128]``.
        dtype: bf16 or fp32.

    Raises:
        ValueError: dtypes or shapes other than these; tensors on different devices.
    """
    if weight.dtype != torch.float8_e4m3fn or weight.dim() not in (2, 3) or weight_scale_inv.dim() != weight.dim():
        raise ValueError(f"fp8_block_dequantize_triton: weight {weight.dtype} {list(weight.shape)} and scales "
                         f"{list(weight_scale_inv.shape)} must be float8_e4m3fn [N, K] / [E, N, K] with scales of "
                         "the same rank")
    n, k = weight.shape[-2:]
    if k % BLOCK or tuple(weight_scale_inv.shape) != (*weight.shape[:-2], -(-n // BLOCK), k // BLOCK):
        raise ValueError(f"fp8_block_dequantize_triton: weight {list(weight.shape)} needs K a multiple of {BLOCK} "
                         f"and scales [..., ceil(N/{BLOCK}), K/{BLOCK}], got {list(weight_scale_inv.shape)}")
    if weight_scale_inv.dtype not in (torch.float8_e8m0fnu, torch.float32):
        raise ValueError(f"fp8_block_dequantize_triton: scales have dtype {weight_scale_inv.dtype}, expected "
                         "float8_e8m0fnu or fp32")
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_block_dequantize_triton: dtype {dtype} must be bf16 or fp32")
    check_device("fp8_block_dequantize_triton", weight, weight_scale_inv)
    w3 = weight if weight.dim() == 3 else weight[None]
    s3 = (weight_scale_inv if weight.dim() == 3 else weight_scale_inv[None]).float()
    out = torch.empty(w3.shape, dtype=dtype, device=weight.device)
    if out.numel():
        wb = w3.view(torch.uint8)  # bytes: the kernel decodes e4m3 itself (exact; the interpreter's fp8 casts are not)
        _fp8_block_dequantize_kernel[(w3.shape[0], triton.cdiv(n, BLOCK), k // BLOCK)](
            wb, s3, out, n, k, *wb.stride(), *s3.stride(), *out.stride(), BLOCK=BLOCK, num_warps=4)
    return out if weight.dim() == 3 else out[0]


ACT_ROWS = 16
"""Rows per program of the activation quantizer (a function of nothing: row ``t``'s codes never depend
on the batch; every op is elementwise or an exact maximum)."""

assert AMAX_FLOOR == 1e-4 and E4M3_MAX == 448.0, "the activation kernel writes these literals"


@triton.jit(do_not_specialize=["T"])
def _fp8_block_act_kernel(x_ptr, q_ptr, s_ptr, out_ptr, T, stride_xt, stride_qt, stride_st, stride_ot,
                          QDQ: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """One ``[ROWS, 128]`` tile column of ``x``: per row the tile's amax (exact), its ue8m0 scale
    ``2^ceil(log2(max(amax, 1e-4) / 448))`` (IEEE division, the exponent rounded up on the bits, as
    :func:`~.common.ue8m0_scale`), the codes ``e4m3_rne(clamp(x / s, +-448))`` (IEEE division); stores
    the codes and scales, or (``QDQ``) ``code * s`` rounded to the output dtype (exact: 4 significant bits)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    kb = tl.program_id(1).to(tl.int64)
    cols = kb * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = (rows < T)[:, None]
    x = tl.load(x_ptr + rows[:, None] * stride_xt + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    amax = tl.where(has_nan, float("nan"), amax)  # torch's amax propagates NaN
    sc = tl.math.div_rn(tl.maximum(amax, 1e-4, propagate_nan=tl.PropagateNan.ALL), 448.0)
    bits = sc.to(tl.int32, bitcast=True)
    ex, mant = bits & 0x7F800000, bits & 0x007FFFFF
    up = tl.where(mant != 0, ex + 0x00800000, ex).to(tl.float32, bitcast=True)
    sc = tl.where(tl.abs(sc) < float("inf"), up, sc)  # inf / NaN stay (torch.isfinite)
    v = tl.math.div_rn(x, sc[:, None])
    v = tl.minimum(tl.maximum(v, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0, propagate_nan=tl.PropagateNan.ALL)
    code = f32_to_e4m3_bits(v)
    if QDQ:
        tl.store(out_ptr + rows[:, None] * stride_ot + cols[None, :],
                 round_to(e4m3_bits_to_f32(code) * sc[:, None], out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(q_ptr + rows[:, None] * stride_qt + cols[None, :], code.to(tl.uint8), mask=mask)
        tl.store(s_ptr + rows * stride_st + kb, sc, mask=rows < T)


def _act_args(x_TK: torch.Tensor, what: str) -> tuple[int, int]:
    if x_TK.dim() != 2 or x_TK.shape[1] % BLOCK or x_TK.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: x must be bf16/fp16/fp32 [T, K] with K a multiple of {BLOCK}, got {x_TK.dtype} "
                         f"{list(x_TK.shape)}")
    check_device(what, x_TK)
    return x_TK.shape


def fp8_block_quantize_activation_triton(x_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~.common.fp8_block_quantize_activation_torch` in one kernel: the same codes and scales bit for bit
    (``tests/ops/test_fp8_block.py``), where the torch form runs about ten elementwise kernels.

    Args:
        x_TK: bf16/fp16/fp32 ``[T, K]``, K a multiple of 128 (any row stride, unit stride along K is made).

    Returns:
        ``(codes float8_e4m3fn [T, K], scales fp32 [T, K/128])``.

    Raises:
        ValueError: other dtypes or shapes; a CPU tensor without the interpreter.
    """
    T, K = _act_args(x_TK, "fp8_block_quantize_activation_triton")
    x = x_TK if x_TK.stride(1) == 1 or K <= 1 else x_TK.contiguous()
    q = torch.empty(T, K, dtype=torch.uint8, device=x.device)
    s = torch.empty(T, K // BLOCK, dtype=torch.float32, device=x.device)
    if T and K:
        _fp8_block_act_kernel[(triton.cdiv(T, ACT_ROWS), K // BLOCK)](
            x, q, s, q, T, x.stride(0), q.stride(0), s.stride(0), 0, QDQ=False, ROWS=ACT_ROWS, BLOCK=BLOCK, num_warps=4)
    return q.view(torch.float8_e4m3fn), s


def fp8_block_activation_qdq_triton(x_TK: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The activation as the W8A8 / W4A8 GEMMs see it: quantized per token to FP8 1x128 ue8m0 tiles and
    dequantized (``code * scale``, exact), in ``dtype`` (default ``x``'s), one kernel; equal bit for bit to
    ``unified_models.ops.moe.deepseek_cpu.fp8_activation_f64(x).to(dtype)`` for finite inputs (a tile with an
    inf or NaN is NaN in both, not always the same NaN bit pattern).

    Raises:
        ValueError: as :func:`fp8_block_quantize_activation_triton`, or ``dtype`` not bf16/fp16/fp32.
    """
    T, K = _act_args(x_TK, "fp8_block_activation_qdq_triton")
    dtype = dtype or x_TK.dtype
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fp8_block_activation_qdq_triton: dtype {dtype} must be bf16/fp16/fp32")
    x = x_TK if x_TK.stride(1) == 1 or K <= 1 else x_TK.contiguous()
    out = torch.empty(T, K, dtype=dtype, device=x.device)
    if T and K:
        _fp8_block_act_kernel[(triton.cdiv(T, ACT_ROWS), K // BLOCK)](
            x, out, out, out, T, x.stride(0), 0, 0, out.stride(0), QDQ=True, ROWS=ACT_ROWS, BLOCK=BLOCK, num_warps=4)
    return out
