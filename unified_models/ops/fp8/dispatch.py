"""The FP8 ops without autograd: activation quantization and the linear on quantized
weights, each the Triton kernel (:mod:`.triton`) on GPU or the CPU path (:mod:`.cpu`).
The differentiable :func:`~unified_models.ops.fp8.fp8_linear` is in :mod:`.backward`."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .common import _X_DTYPES, _scale
from .cpu import fp8_linear_torch, fp8_quantize_activation_torch


def fp8_quantize_activation(x_TK: torch.Tensor, input_scale: torch.Tensor | float) -> torch.Tensor:
    """vLLM's static per-tensor FP8 activation quantization (the package doc's exact rule).

    Args:
        x_TK: ``[T, K]`` bf16/fp16/fp32.
        input_scale: one-element fp32 scale (> 0).

    Returns:
        float8_e4m3fn ``[T, K]``; element-wise, so row ``t`` depends only on ``x_TK[t]``.

    Raises:
        ValueError: wrong rank/dtype, scale not one element.

    Source: ``vllm/_custom_ops.py`` ``scaled_fp8_quant(x, scale)`` ->
    ``csrc/quantization/w8a8/fp8/common.cu`` (``inv_scale = 1.0f / *scale``,
    ``scaled_fp8_conversion<true>``), ``QuantFP8.forward_native``. Triton kernel on GPU
    (or with ``UM_OPS_BACKEND=triton``), plain torch on CPU; the same bits.
    """
    if x_TK.dim() != 2 or x_TK.dtype not in _X_DTYPES:
        raise ValueError(f"fp8_quantize_activation: x must be [T, K] bf16/fp16/fp32, got "
                         f"{list(x_TK.shape)} {x_TK.dtype}")
    if use_triton(x_TK):
        from .triton import fp8_quantize_activation_triton

        return fp8_quantize_activation_triton(x_TK, _scale(input_scale, x_TK.device, "input_scale"))
    return fp8_quantize_activation_torch(x_TK, input_scale)


def fp8_linear_forward(x_TK: torch.Tensor, weight_q: torch.Tensor, weight_scale: torch.Tensor,
                       input_scale: torch.Tensor, bias_N: torch.Tensor | None = None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The FP8 linear on already-quantized weights, no autograd: Triton on GPU (or with
    ``UM_OPS_BACKEND=triton``), :func:`fp8_linear_torch` on CPU.

    Args:
        x_TK: ``[T, K]`` bf16/fp16/fp32. weight_q: float8_e4m3fn ``[N, K]``.
        weight_scale, input_scale: one-element fp32 tensors. bias_N: optional ``[N]``.
        out_dtype: bf16/fp16/fp32 (default ``x_TK.dtype``).

    Raises:
        ValueError: as :func:`fp8_linear_torch`.
    """
    out_dtype = out_dtype or x_TK.dtype
    if use_triton(x_TK):
        from .triton import fp8_linear_triton

        return fp8_linear_triton(x_TK, weight_q, weight_scale, input_scale, bias_N, out_dtype)
    return fp8_linear_torch(x_TK, weight_q, weight_scale, input_scale, bias_N, out_dtype)
