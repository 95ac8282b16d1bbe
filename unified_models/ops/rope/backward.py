"""Backward of RoPE: the autograd function (the inverse rotation; the tables are
constants) and the differentiable ``apply_rope`` that :mod:`unified_models.ops` exports."""

from __future__ import annotations

import torch

from ..grad.helpers import acc, needs_grad
from . import dispatch


class RopeFn(torch.autograd.Function):
    """Rotation by the position's angles; the backward rotates by the opposite angles:
    ``dx1 = dy1 cos + dy2 sin``, ``dx2 = dy2 cos - dy1 sin``, other dims pass through.
    The cos/sin tables are constants (no gradient)."""

    @staticmethod
    def forward(ctx, x_THE, positions_T, cos_PR, sin_PR):
        out = dispatch.apply_rope(x_THE, positions_T, cos_PR, sin_PR)
        ctx.save_for_backward(positions_T, cos_PR, sin_PR)
        ctx.x_dtype = x_THE.dtype
        return out

    @staticmethod
    def backward(ctx, g_THE):
        pos, cos, sin = ctx.saved_tensors
        half = cos.shape[1]
        g = acc(g_THE)
        c = acc(cos).index_select(0, pos.long())[:, None, :]
        s = acc(sin).index_select(0, pos.long())[:, None, :]
        g1, g2 = g[..., :half], g[..., half:2 * half]
        dx = torch.cat([g1 * c + g2 * s, g2 * c - g1 * s, g[..., 2 * half:]], dim=-1)
        return dx.to(ctx.x_dtype), None, None, None


def apply_rope(x_THE: torch.Tensor, positions_T: torch.Tensor, cos_PR: torch.Tensor,
               sin_PR: torch.Tensor) -> torch.Tensor:
    """:func:`ops.rope.apply_rope`, differentiable w.r.t. ``x_THE`` (``[T, H, E]``);
    the cos/sin tables get no gradient. Raises as the op."""
    if needs_grad(x_THE):
        return RopeFn.apply(x_THE, positions_T, cos_PR, sin_PR)
    return dispatch.apply_rope(x_THE, positions_T, cos_PR, sin_PR)
