"""Backward of the MLP activations: autograd functions (analytic, fp32) and the
differentiable ``relu2`` / ``swiglu`` that :mod:`unified_models.ops` exports."""

from __future__ import annotations

import torch

from ..grad.helpers import _cast, acc, needs_grad
from . import dispatch


class Relu2Fn(torch.autograd.Function):
    """``y = relu(x)^2``: ``dx = 2 relu(x) dy``."""

    @staticmethod
    def forward(ctx, x_TF):
        ctx.save_for_backward(x_TF)
        return dispatch.relu2(x_TF)

    @staticmethod
    def backward(ctx, g_TF):
        (x,) = ctx.saved_tensors
        return (2.0 * torch.relu(acc(x)) * acc(g_TF)).to(x.dtype)


class SwigluFn(torch.autograd.Function):
    """``y = silu(g) u`` with ``s = sigmoid(g)``: ``du = dy g s``, ``dg = dy u s (1 + g (1 - s))``."""

    @staticmethod
    def forward(ctx, gate_TF, up_TF):
        out = dispatch.swiglu(gate_TF, up_TF)
        ctx.save_for_backward(gate_TF, up_TF)
        return out

    @staticmethod
    def backward(ctx, g_TF):
        gate_in, up_in = ctx.saved_tensors
        gate, up, g = acc(gate_in), acc(up_in), acc(g_TF)
        s = torch.sigmoid(gate)
        dgate = g * up * s * (1.0 + gate * (1.0 - s)) if ctx.needs_input_grad[0] else None
        dup = g * gate * s if ctx.needs_input_grad[1] else None
        return _cast(dgate, gate_in), _cast(dup, up_in)


def relu2(x_TF: torch.Tensor) -> torch.Tensor:
    """:func:`ops.activations.relu2`, differentiable: ``[T, F]`` -> ``[T, F]``."""
    if needs_grad(x_TF):
        return Relu2Fn.apply(x_TF)
    return dispatch.relu2(x_TF)


def swiglu(gate_TF: torch.Tensor, up_TF: torch.Tensor) -> torch.Tensor:
    """:func:`ops.activations.swiglu`, differentiable w.r.t. both inputs (``[T, F]`` each).

    Raises:
        ValueError: shapes differ (checked before any graph is built).
    """
    if needs_grad(gate_TF, up_TF):
        if gate_TF.shape != up_TF.shape:
            raise ValueError(f"swiglu: gate {tuple(gate_TF.shape)} and up {tuple(up_TF.shape)} differ")
        return SwigluFn.apply(gate_TF, up_TF)
    return dispatch.swiglu(gate_TF, up_TF)
