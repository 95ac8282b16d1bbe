"""Backward of the block-FP8 linear (straight-through estimator, DESIGN.md rule 11) and the
differentiable entry point :func:`fp8_block_linear`.

The forward is :func:`~.dispatch.fp8_block_linear_forward` (the kernels' bits); a master weight
is quantized on every call by :func:`~.common.fp8_block_quantize_weight`. The backward
differentiates ``y = x_dq W_dq^T + b`` with the quantizers taken as the identity (the scales
come from each tile's own amax, so nothing is clamped): ``dx = dY W_dq``, ``dW = dY^T x_dq``
(handed to the master), ``db = sum_t dY``; fp32 math (fp64 for an fp64 ``dY``), each gradient
cast once. Master and bias are stamped: a backward after an in-place update raises
:class:`~unified_models.ops.grad.weights.StaleWeightError`.
"""

from __future__ import annotations

import torch

from ..grad.helpers import acc, grad_matmul
from ..grad.weights import check_stamps, stamp
from .common import BLOCK, FP8BlockWeight, fp8_block_dequantize, fp8_block_quantize_weight
from .dispatch import fp8_block_linear_forward, fp8_block_quantize_activation


class Fp8BlockLinearFn(torch.autograd.Function):
    """Inputs ``(x_TK, master_NK | None, bias_N | None, w_q | None, scale_inv | None, out_dtype)``."""

    @staticmethod
    def forward(ctx, x_TK, master_NK, bias_N, w_q, scale_inv, out_dtype):
        if master_NK is not None:
            w_q, scale_inv = fp8_block_quantize_weight(master_NK)
        y = fp8_block_linear_forward(x_TK, w_q, scale_inv, bias_N, out_dtype)
        ctx.save_for_backward(x_TK, w_q, scale_inv)
        ctx.master_dtype = master_NK.dtype if master_NK is not None else None
        ctx.bias_dtype = bias_N.dtype if bias_N is not None else None
        ctx.stamps = stamp(weight=master_NK, bias=bias_N)
        return y

    @staticmethod
    def backward(ctx, g_TN):
        check_stamps("fp8_block_linear", ctx.stamps)
        x, w_q, s = ctx.saved_tensors
        nx, nw, nb = ctx.needs_input_grad[:3]
        g = acc(g_TN)
        dx = dw = db = None
        if nx:
            dx = grad_matmul(g_TN, fp8_block_dequantize(w_q, s, g.dtype)).to(x.dtype)
        if nw and ctx.master_dtype is not None:
            xq, sx = fp8_block_quantize_activation(x.detach())
            x_dq = xq.to(g.dtype) * sx.to(g.dtype).repeat_interleave(BLOCK, 1)
            dw = grad_matmul(g_TN.t(), x_dq).to(ctx.master_dtype)
        if nb and ctx.bias_dtype is not None:
            db = g.sum(0).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None


def fp8_block_linear(x_TK: torch.Tensor, weight: FP8BlockWeight | torch.Tensor, bias_N: torch.Tensor | None = None,
                     *, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Block-FP8 W8A8 linear ``y = x W^T + b``, differentiable (STE).

    Args:
        x_TK: ``[T, K]`` bf16/fp16/fp32 (K a multiple of 128).
        weight: an :class:`FP8BlockWeight` (stored codes; no gradient) or a ``[N, K]`` master
            tensor quantized on every call (the trainer; straight-through gradient).
        bias_N: optional ``[N]``.
        out_dtype: default ``x_TK.dtype``.

    Returns:
        ``[T, N]`` in ``out_dtype`` (the package doc's rule); row ``t`` depends only on ``x_TK[t]``.

    Raises:
        ValueError: shapes or dtypes do not match; TypeError: another weight type.
    """
    out_dtype = out_dtype or x_TK.dtype
    if isinstance(weight, FP8BlockWeight):
        master, w_q, s = None, weight.weight, weight.weight_scale_inv
    elif isinstance(weight, torch.Tensor):
        master, w_q, s = weight, None, None
    else:
        raise TypeError(f"fp8_block_linear: weight must be an FP8BlockWeight or a master tensor, got "
                        f"{type(weight).__name__}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x_TK, master, bias_N)):
        return Fp8BlockLinearFn.apply(x_TK, master, bias_N, w_q, s, out_dtype)
    if master is not None:
        w_q, s = fp8_block_quantize_weight(master)
    return fp8_block_linear_forward(x_TK, w_q, s, bias_N, out_dtype)
