"""Backward of the linear: the autograd function (``dX = dY W``, ``dW = dY^T X``,
``db``; weight-version guard) and the differentiable ``linear`` that
:mod:`unified_models.ops` exports."""

from __future__ import annotations

import torch

from ..grad.helpers import acc, grad_matmul, needs_grad
from ..grad.weights import check_stamps, stamp
from . import dispatch


class LinearFn(torch.autograd.Function):
    """``y = x W^T + b``: ``dX = dY W``, ``dW = dY^T X``, ``db = sum_t dY``."""

    @staticmethod
    def forward(ctx, x_TK, weight_NK, bias_N, out_dtype):
        y = dispatch.linear(x_TK, weight_NK, bias_N, out_dtype)
        ctx.save_for_backward(x_TK if ctx.needs_input_grad[1] else None)
        ctx.x_dtype, ctx.weight, ctx.bias = x_TK.dtype, weight_NK, bias_N
        ctx.stamps = stamp(weight=weight_NK, bias=bias_N)
        return y

    @staticmethod
    def backward(ctx, g_TN):
        check_stamps("linear", ctx.stamps)
        (x,) = ctx.saved_tensors
        w, b = ctx.weight, ctx.bias
        dx = grad_matmul(g_TN, w).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = grad_matmul(g_TN.t(), x).to(w.dtype) if ctx.needs_input_grad[1] else None
        db = acc(g_TN).sum(0).to(b.dtype) if b is not None and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def linear(x_TK: torch.Tensor, weight_NK: torch.Tensor, bias_N: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`ops.linear.linear`, differentiable w.r.t. ``x_TK``, ``weight_NK``, ``bias_N``.

    ``[T, K] @ [N, K]^T (+ [N])`` -> ``[T, N]`` in ``out_dtype`` (default x's). Raises as the op.
    """
    if needs_grad(x_TK, weight_NK, bias_N):
        return LinearFn.apply(x_TK, weight_NK, bias_N, out_dtype or x_TK.dtype)
    return dispatch.linear(x_TK, weight_NK, bias_N, out_dtype)
