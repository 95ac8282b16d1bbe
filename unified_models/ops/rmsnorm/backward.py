"""Backward of RMSNorm: the autograd functions (analytic, fp32; weight-version guard)
and the differentiable ``rms_norm`` / ``add_rms_norm`` that :mod:`unified_models.ops` exports."""

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
        dx, dw = _rms_norm_grads(x_in, ctx.weight, ctx.eps, g_TD, *ctx.needs_input_grad[:2])
        return dx, dw, None, None


def _rms_norm_grads(x_in: torch.Tensor, w: torch.Tensor, eps: float, g_TD: torch.Tensor, want_dx: bool,
                    want_dw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    x, g = acc(x_in), acc(g_TD)
    r = torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    xhat = x * r
    gw = g * acc(w)
    dx = r * (gw - xhat * (gw * xhat).mean(-1, keepdim=True)) if want_dx else None
    dw = (g * xhat).sum(0) if want_dw else None
    return _cast(dx, x_in), _cast(dw, w)


class AddRMSNormFn(torch.autograd.Function):
    """``s = a + b``, ``y = rms_norm(s)``: ``ds_total = ds + dx_norm`` (the norm's gradient cast to the
    stream's dtype first, then the sum, as autograd accumulates the two ops' gradients), ``da = db =
    ds_total``; ``dw`` as :class:`RMSNormFn`. The gradients are those of the unfused ops."""

    @staticmethod
    def forward(ctx, residual_TD, update_TD, weight_D, eps, out_dtype):
        s, y = dispatch.add_rms_norm(residual_TD, update_TD, weight_D, eps, out_dtype)
        if not (residual_TD.requires_grad or update_TD.requires_grad):
            ctx.mark_non_differentiable(s)  # as ``residual + update`` would be
        ctx.save_for_backward(s)
        ctx.weight, ctx.eps = weight_D, eps
        ctx.stamps = stamp(weight=weight_D)
        ctx.set_materialize_grads(False)
        return s, y

    @staticmethod
    def backward(ctx, g_s, g_y):
        check_stamps("add_rms_norm", ctx.stamps)
        (s,) = ctx.saved_tensors
        want_stream = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dx = dw = None
        if g_y is not None:
            dx, dw = _rms_norm_grads(s, ctx.weight, ctx.eps, g_y, want_stream, ctx.needs_input_grad[2])
        if not want_stream:
            ds = None
        elif dx is None:
            ds = g_s
        else:
            ds = dx if g_s is None else g_s + dx
        if ds is None and want_stream:
            ds = torch.zeros_like(s)
        return (ds if ctx.needs_input_grad[0] else None, ds if ctx.needs_input_grad[1] else None, dw, None, None)


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
             out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`ops.rmsnorm.rms_norm`, differentiable w.r.t. ``x_TD`` and ``weight_D``.

    ``[T, D]``, ``[D]`` -> ``[T, D]`` in ``out_dtype`` (default the weight's). Raises as the op.
    """
    if needs_grad(x_TD, weight_D):
        return RMSNormFn.apply(x_TD, weight_D, eps, out_dtype or weight_D.dtype)
    return dispatch.rms_norm(x_TD, weight_D, eps, out_dtype)


def add_rms_norm(residual_TD: torch.Tensor, update_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ops.rmsnorm.add_rms_norm` (fused residual add + RMSNorm), differentiable w.r.t. both
    inputs and ``weight_D``.

    ``[T, D]``, ``[T, D]``, ``[D]`` -> ``(s_TD, y_TD)``. Raises as the op.
    """
    if needs_grad(residual_TD, update_TD, weight_D):
        return AddRMSNormFn.apply(residual_TD, update_TD, weight_D, eps, out_dtype or weight_D.dtype)
    return dispatch.add_rms_norm(residual_TD, update_TD, weight_D, eps, out_dtype)
