"""The block-FP8 linear without autograd: argument checks, then the Triton kernel on GPU
(:mod:`.triton`, or with ``UM_OPS_BACKEND=triton``) or the CPU path (:mod:`.cpu`)."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .common import BLOCK, fp8_block_quantize_activation_torch
from .cpu import fp8_block_linear_torch

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def fp8_block_quantize_activation(x_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic 1x128 activation quantization (DeepSeek ``act_quant``, ue8m0 scales): on the Triton path
    (CUDA, or ``UM_OPS_BACKEND=triton``) one kernel (:func:`.triton.fp8_block_quantize_activation_triton`),
    else the torch form (:func:`.common.fp8_block_quantize_activation_torch`); the same bits.

    Args:
        x_TK: ``[T, K]`` bf16/fp16/fp32, K a multiple of 128.

    Returns:
        ``(codes e4m3 [T, K], scales fp32 [T, K/128])``; row ``t`` depends only on ``x_TK[t]``.

    Raises:
        ValueError: not 2-D, K not a multiple of 128, another dtype on the Triton path.
    """
    if use_triton(x_TK) and x_TK.dim() == 2:
        from .triton import fp8_block_quantize_activation_triton

        return fp8_block_quantize_activation_triton(x_TK)
    return fp8_block_quantize_activation_torch(x_TK)


def fp8_block_linear_forward(x_TK: torch.Tensor, weight_q: torch.Tensor, weight_scale_inv: torch.Tensor,
                             bias_N: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y = x W^T + b`` with block-FP8 weights and dynamic 1x128 activation quantization.

    Args:
        x_TK: ``[T, K]`` bf16/fp16/fp32, K a multiple of 128.
        weight_q: float8_e4m3fn ``[N, K]``.
        weight_scale_inv: ``[ceil(N/128), K/128]`` float8_e8m0fnu or fp32 powers of two.
        bias_N: optional ``[N]``.
        out_dtype: bf16/fp16/fp32, default ``x_TK.dtype``.

    Returns:
        ``[T, N]``; row ``t`` depends only on ``x_TK[t]`` (bitwise).

    Raises:
        ValueError: shapes or dtypes do not match.
    """
    out_dtype = out_dtype or x_TK.dtype
    if x_TK.dim() != 2 or weight_q.dim() != 2 or x_TK.shape[1] != weight_q.shape[1]:
        raise ValueError(f"fp8_block_linear: x {list(x_TK.shape)} @ W^T {list(weight_q.shape)} do not match")
    if x_TK.dtype not in _X_DTYPES or out_dtype not in _X_DTYPES:
        raise ValueError(f"fp8_block_linear: x / out dtypes must be bf16/fp16/fp32, got {x_TK.dtype} / {out_dtype}")
    if weight_q.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_block_linear: weight must be float8_e4m3fn, got {weight_q.dtype}")
    n, k = weight_q.shape
    want = (-(-n // BLOCK), k // BLOCK)
    if k % BLOCK or tuple(weight_scale_inv.shape) != want:
        raise ValueError(f"fp8_block_linear: K = {k} must be a multiple of {BLOCK} and weight_scale_inv "
                         f"{list(weight_scale_inv.shape)} must be {list(want)}")
    if bias_N is not None and tuple(bias_N.shape) != (n,):
        raise ValueError(f"fp8_block_linear: bias must be [{n}], got {list(bias_N.shape)}")
    if use_triton(x_TK):
        from .triton import fp8_block_linear_triton

        return fp8_block_linear_triton(x_TK, weight_q, weight_scale_inv, bias_N, out_dtype)
    return fp8_block_linear_torch(x_TK, weight_q, weight_scale_inv, bias_N, out_dtype)
