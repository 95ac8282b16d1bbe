"""FP8 W8A8 linear in Triton: static per-tensor activation quantization and an e4m3 GEMM.

Two kernels (the rules are in :mod:`unified_models.ops.fp8`):

* ``_fp8_quant_act_kernel`` (elementwise over ``[BLOCK_M, BLOCK_K]`` tiles):
  ``inv = div_rn(1, input_scale)`` (IEEE fp32), ``v = fp32(x) * inv``, clamp to
  +-448 with selects (NaN stays NaN), RNE cast to e4m3, NaN -> 0x7F. On GPU the
  cast is the hardware ``cvt.rn.satfinite.e4m3x2.f32``; under the interpreter
  (whose fp8 casts do not round to nearest even) the code is formed with
  integer arithmetic on the fp32 bits (:func:`_e4m3_code`).
* ``_fp8_gemm_kernel``: fixed ``BLOCK_M/BLOCK_N/BLOCK_K``, ``num_warps``,
  ``num_stages`` per device kind, a full K loop per program (no split-K, no
  atomics, no autotune, ``T`` not specialized), so every output element is the
  same sequence of operations whatever the batch. GPU: ``tl.dot`` on e4m3
  tiles (Hopper fp8 wgmma, fp32 accumulate) with ``max_num_imprecise_acc =
  BLOCK_K``: the tensor cores' reduced-precision partial sums are promoted to
  the fp32 accumulator once per K tile (Triton's default on sm90 never
  promotes). Epilogue ``acc * fp32(input_scale * weight_scale) + bias`` in
  fp32, one RNE rounding. Interpreter (CPU): no ``tl.dot``; e4m3 bytes are
  decoded exactly, products formed in fp64 and summed by
  :func:`interpreter_dot` (exact for K <= 2^17: see ``ops.fp8``), the
  epilogue is fp64 and rounded once, so the kernel equals
  :func:`unified_models.ops.fp8.fp8_linear_torch` bit for bit.

Every per-row quantity is a ``[BLOCK, 1]`` column and every per-column one a
``[1, BLOCK]`` row (no 1-D tensor broadcast into two tile layouts: Triton 3.6's
layout pass crashed on that form on the H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton._common import (_INTERP, INTERPRET, check_device, e4m3_bits_to_f32, grouped_tile, interpreter_dot,
                      round_f64_to, round_to)

if INTERPRET:
    # Few, big programs (the interpreter pays per program). [64, 64, 256] fp64 products per
    # interpreter_dot stay within Triton's 2**20-element tensor limit.
    BLOCK_M, BLOCK_N, BLOCK_K = 64, 256, 64
    NUM_WARPS, NUM_STAGES = 4, 1
    QUANT_M, QUANT_K = 64, 256
else:
    # Hopper (H100/H200) fp8 wgmma tile; not yet tuned on the H200 (one fixed config; a table
    # keyed by the weight shape (N, K) may replace it, never a per-batch choice).
    BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 128
    NUM_WARPS, NUM_STAGES = 8, 3
    QUANT_M, QUANT_K = 16, 256

MAX_IMPRECISE_ACC = BLOCK_K
"""fp8 ``tl.dot`` partial sums are promoted to the fp32 accumulator every BLOCK_K products."""

GROUP_M = 8
"""Programs are ordered in groups of GROUP_M row tiles (L2 reuse); this only changes which
program computes a tile, never how a tile is computed."""

_E4M3_MAX = tl.constexpr(448.0)

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _e4m3_code(v):
    """fp32 ``v`` (already clamped to [-448, 448]; NaN allowed) -> e4m3fn code (int32 0..255),
    round to nearest, ties to even, by integer arithmetic (the interpreter's casts do not).

    Normal range (``|v| >= 2^-6``): RNE of the fp32 significand to 3 bits
    (``u + 0x7FFFF + lsb``), re-biased (127 -> 7). Subnormal range: the code is
    ``RNE(|v| * 2^9)`` (exact scaling; ``(y + 2^23) - 2^23`` rounds to an integer,
    ties to even), which also gives 8 = the smallest normal when it rounds up.
    Sign from the fp32 sign bit (-0.0 -> 0x80); NaN -> 0x7F.
    """
    u = v.to(tl.int32, bitcast=True)
    nan = v != v
    sign = (u >> 31) & 1
    a_bits = tl.where(nan, 0, u & 0x7FFFFFFF)
    a = a_bits.to(tl.float32, bitcast=True)
    normal = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - (120 << 3)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal) | (sign << 7)
    return tl.where(nan, 0x7F, code)


@triton.jit(do_not_specialize=["M"])
def _fp8_quant_act_kernel(x_ptr, s_ptr, out_ptr, M, K, stride_xm, stride_xk, stride_om, stride_ok,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)[:, None]
    rk = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K).to(tl.int64)[None, :]
    mask = (rm < M) & (rk < K)
    x = tl.load(x_ptr + rm * stride_xm + rk * stride_xk, mask=mask, other=0.0).to(tl.float32)
    inv = tl.math.div_rn(1.0, tl.load(s_ptr))
    v = x * inv
    v = tl.where(v > _E4M3_MAX, _E4M3_MAX, v)
    v = tl.where(v < -_E4M3_MAX, -_E4M3_MAX, v)
    if _INTERP:
        code = _e4m3_code(v)
    else:
        code = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
        code = tl.where(v != v, 0x7F, code)
    tl.store(out_ptr + rm * stride_om + rk * stride_ok, code.to(tl.uint8), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(x_ptr, w_ptr, sx_ptr, sw_ptr, b_ptr, out_ptr, M, N, K,
                     stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, MAX_IMPRECISE: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    rm = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)[:, None]  # [BM, 1]
    rn = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)[None, :]  # [1, BN]
    kr = tl.arange(0, BLOCK_K)[None, :]  # [1, BK]: K along the x tile's columns
    kc = tl.arange(0, BLOCK_K)[:, None]  # [BK, 1]: K along the w tile's rows
    mask_m = rm < M
    mask_n = rn < N
    x_ptrs = x_ptr + rm * stride_xm + kr * stride_xk
    w_ptrs = w_ptr + rn * stride_wn + kc * stride_wk
    s = tl.load(sx_ptr) * tl.load(sw_ptr)  # one fp32 rounding
    out_ptrs = out_ptr + rm * stride_om + rn * stride_on
    out_mask = mask_m & mask_n
    if _INTERP:
        # CPU: e4m3 bytes decoded exactly, exact fp64 products and sums, fp64 epilogue, ONE
        # rounding: the value of ops.fp8.fp8_linear_torch.
        acc64 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float64)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(x_ptrs, mask=mask_m & ((k0 + kr) < K), other=0).to(tl.int32)
            b = tl.load(w_ptrs, mask=((k0 + kc) < K) & mask_n, other=0).to(tl.int32)
            acc64 += interpreter_dot(e4m3_bits_to_f32(a), e4m3_bits_to_f32(b))
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        y64 = acc64 * s.to(tl.float64)
        if HAS_BIAS:
            y64 += tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float64)
        tl.store(out_ptrs, round_f64_to(y64, out_ptr.dtype.element_ty), mask=out_mask)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = tl.load(x_ptrs, mask=mask_m & ((k0 + kr) < K), other=0.0)
            b = tl.load(w_ptrs, mask=((k0 + kc) < K) & mask_n, other=0.0)
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=MAX_IMPRECISE)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        y = acc * s
        if HAS_BIAS:
            y = y + tl.load(b_ptr + rn, mask=mask_n, other=0.0).to(tl.float32)
        tl.store(out_ptrs, round_to(y, out_ptr.dtype.element_ty), mask=out_mask)


def _check_scale(name: str, what: str, s: torch.Tensor) -> None:
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or s.numel() != 1:
        raise ValueError(f"{name}: {what} must be a one-element fp32 tensor, got "
                         f"{getattr(s, 'dtype', type(s).__name__)} {list(getattr(s, 'shape', []))}")


def fp8_quantize_activation_triton(x_TK: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Static per-tensor FP8 quantization of ``x_TK`` (rule: :mod:`unified_models.ops.fp8`).

    Args:
        x_TK: ``[T, K]`` bf16/fp16/fp32, any strides.
        input_scale: one-element fp32 tensor on ``x_TK``'s device.

    Returns:
        float8_e4m3fn ``[T, K]`` (contiguous).

    Raises:
        ValueError: wrong rank/dtype, bad scale, tensors on different devices.
    """
    name = "fp8_quantize_activation_triton"
    if x_TK.dim() != 2 or x_TK.dtype not in _X_DTYPES:
        raise ValueError(f"{name}: x must be [T, K] bf16/fp16/fp32, got {list(x_TK.shape)} {x_TK.dtype}")
    _check_scale(name, "input_scale", input_scale)
    check_device(name, x_TK, input_scale)
    T, K = x_TK.shape
    out = torch.empty((T, K), dtype=torch.float8_e4m3fn, device=x_TK.device)
    if T == 0 or K == 0:
        return out
    o8 = out.view(torch.uint8)
    grid = (triton.cdiv(T, QUANT_M), triton.cdiv(K, QUANT_K))
    _fp8_quant_act_kernel[grid](x_TK, input_scale.reshape(()), o8, T, K, x_TK.stride(0), x_TK.stride(1),
                                o8.stride(0), o8.stride(1), BLOCK_M=QUANT_M, BLOCK_K=QUANT_K,
                                num_warps=4, num_stages=1)
    return out


def fp8_linear_triton(x_TK: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                      input_scale: torch.Tensor, bias_N: torch.Tensor | None = None,
                      out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``round(acc * fp32(input_scale * weight_scale) + b)`` with ``acc = x_q @ w^T`` over e4m3.

    Args:
        x_TK: ``[T, K]`` bf16/fp16/fp32 activations, any strides (quantized here by
            :func:`fp8_quantize_activation_triton`).
        weight_q: float8_e4m3fn ``[N, K]`` (HF ``nn.Linear`` layout), any strides.
        weight_scale, input_scale: one-element fp32 tensors.
        bias_N: optional ``[N]`` bf16/fp16/fp32, added in fp32 (fp64 under the interpreter).
        out_dtype: bf16/fp16/fp32 (default ``x_TK.dtype``).

    Returns:
        ``[T, N]`` in ``out_dtype``; row ``t`` bitwise independent of ``T`` and the other rows.

    Raises:
        ValueError: wrong ranks/dtypes, mismatched K, bias of the wrong shape, bad scales,
            unsupported ``out_dtype``, tensors on different devices, K > 2^17 under the
            interpreter (its fp64 sums would no longer be exact).
    """
    name = "fp8_linear_triton"
    if x_TK.dim() != 2 or weight_q.dim() != 2 or x_TK.shape[1] != weight_q.shape[1]:
        raise ValueError(f"{name}: x {list(x_TK.shape)} @ W^T {list(weight_q.shape)} do not match")
    if x_TK.dtype not in _X_DTYPES:
        raise ValueError(f"{name}: x must be bf16/fp16/fp32, got {x_TK.dtype}")
    if weight_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: weight must be float8_e4m3fn, got {weight_q.dtype}")
    _check_scale(name, "weight_scale", weight_scale)
    _check_scale(name, "input_scale", input_scale)
    T, K = x_TK.shape
    N = weight_q.shape[0]
    if bias_N is not None and (tuple(bias_N.shape) != (N,) or bias_N.dtype not in _X_DTYPES):
        raise ValueError(f"{name}: bias must be [{N}] bf16/fp16/fp32, got {list(bias_N.shape)} {bias_N.dtype}")
    out_dtype = out_dtype or x_TK.dtype
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{name}: out_dtype must be bf16/fp16/fp32, got {out_dtype}")
    if INTERPRET and K > 2 ** 17:
        raise ValueError(f"{name}: K = {K} > 2^17: the interpreter's fp64 sums would not be exact")
    check_device(name, x_TK, weight_q, weight_scale, input_scale, bias_N)
    out = torch.empty((T, N), dtype=out_dtype, device=x_TK.device)
    if T == 0 or N == 0:
        return out
    s_x, s_w = input_scale.reshape(()), weight_scale.reshape(())
    if K == 0:
        y = torch.zeros((T, N), dtype=torch.float32, device=out.device)
        return out.copy_(y + bias_N.float() if bias_N is not None else y)
    xq = fp8_quantize_activation_triton(x_TK, s_x)
    if INTERPRET:  # bytes: the kernel decodes e4m3 itself (the interpreter's fp8 casts are unreliable)
        xq, wq = xq.view(torch.uint8), weight_q.view(torch.uint8)
    else:
        wq = weight_q
    bias = bias_N.contiguous() if bias_N is not None else out  # dummy pointer when HAS_BIAS=False
    grid = (triton.cdiv(T, BLOCK_M) * triton.cdiv(N, BLOCK_N),)
    _fp8_gemm_kernel[grid](
        xq, wq, s_x, s_w, bias, out, T, N, K,
        xq.stride(0), xq.stride(1), wq.stride(0), wq.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias_N is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
        MAX_IMPRECISE=MAX_IMPRECISE_ACC, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
