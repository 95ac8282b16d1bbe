"""Backward of RMSNorm: the autograd function (analytic, fp32; weight-version guard)
and the differentiable ``rms_norm`` that :mod:`unified_models.ops` exports."""

from __future__ import annotations

import torch

from ..grad.helpers import _cast, acc, needs_grad
from ..grad.weights import check_stamps, stamp
from . import dispatch


class RMSNormFn(torch.autograd.Function):
    """``y = x r w`` with ``r = (mean(x^2) + eps)^-1/2``, ``x^ = x r``:
    ``dw = sum_t dy x^``, ``dx = r (dy w - x^ mean(dy w x^))``."""

    @staticmethod
    def forward(ctx, x_TD, weight_D, eps, out_dtype):
        y = dispatch.rms_norm(x_TD, weight_D, eps, out_dtype)
        ctx.save_for_backward(x_TD)
        ctx.weight, ctx.eps = weight_D, eps
        ctx.stamps = stamp(weight=weight_D)
        return y

    @staticmethod
    def backward(ctx, g_TD):
        check_stamps("rms_norm", ctx.stamps)
        (x_in,) = ctx.saved_tensors
        w = ctx.weight
        x, g = acc(x_in), acc(g_TD)
        r = torch.rsqrt(x.square().mean(-1, keepdim=True) + ctx.eps)
        xhat = x * r
        gw = g * acc(w)
        dx = r * (gw - xhat * (gw * xhat).mean(-1, keepdim=True)) if ctx.needs_input_grad[0] else None
        dw = (g * xhat).sum(0) if ctx.needs_input_grad[1] else None
        return _cast(dx, x_in), _cast(dw, w), None, None


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`ops.rmsnorm.rms_norm`, differentiable w.r.t. ``x_TD`` and ``weight_D``.

    ``[T, D]``, ``[D]`` -> ``[T, D]`` in ``out_dtype`` (default the weight's). Raises as the op.
    """
    if needs_grad(x_TD, weight_D):
        return RMSNormFn.apply(x_TD, weight_D, eps, out_dtype or weight_D.dtype)
    return dispatch.rms_norm(x_TD, weight_D, eps, out_dtype)
