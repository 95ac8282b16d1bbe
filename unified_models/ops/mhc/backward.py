"""Differentiable mHC ops: the dispatching op's values, gradients from a recomputation.

Each entry point calls :mod:`.dispatch` directly when no input requires grad (the
inference path). Otherwise :class:`HCRecomputeFn` returns the op's outputs unchanged (the
*visible* values, bitwise) and its backward differentiates the plain-torch formulas of
:mod:`.reference` (``hc_pre_math`` / ``hc_post_math`` / ``hc_head_math``) at fp32 (fp64 for
fp64 inputs), built lazily in the backward: DESIGN.md rule 11's
``visible + (graph - graph.detach())``. The forward's roundings to the model dtype pass
gradients straight through. ``fn`` / ``base`` / ``scale`` are guarded by the weight-version
stamps (:mod:`unified_models.ops.grad.weights`).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..grad.helpers import acc, needs_grad
from ..grad.weights import check_stamps, stamp
from . import dispatch
from .reference import hc_head_math, hc_post_math, hc_pre_math

__all__ = ["hc_pre", "hc_post", "hc_head", "HCRecomputeFn"]


class HCRecomputeFn(torch.autograd.Function):
    """Inputs ``(run, graph, name, stamps, *tensors)``: the outputs are ``run(*tensors)`` (a
    tensor or a tuple); each tensor's gradient is that of ``graph`` at the upcast inputs."""

    @staticmethod
    def forward(ctx, run: Callable, graph: Callable, name: str, stamps, *inputs):
        outs = run(*inputs)
        ctx.graph, ctx.name, ctx.stamps = graph, name, stamps
        ctx.save_for_backward(*inputs)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        check_stamps(ctx.name, ctx.stamps)
        ins = ctx.saved_tensors
        need = ctx.needs_input_grad[4:]
        leaves = [acc(t).detach().requires_grad_(bool(need[i])) for i, t in enumerate(ins)]
        with torch.enable_grad():
            outs = ctx.graph(*leaves)
        outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
        want = [i for i in range(len(ins)) if need[i]]
        got = torch.autograd.grad(outs, [leaves[i] for i in want], [acc(g) for g in grads], allow_unused=True)
        res: list[torch.Tensor | None] = [None] * len(ins)
        for i, d in zip(want, got):
            res[i] = torch.zeros_like(ins[i]) if d is None else d.to(ins[i].dtype)
        return (None, None, None, None, *res)


def hc_pre(streams_TND: torch.Tensor, fn_MK: torch.Tensor, base_M: torch.Tensor, scale_3: torch.Tensor, *,
           norm_eps: float, hc_eps: float, sinkhorn_iters: int):
    """:func:`ops.mhc.hc_pre`, differentiable w.r.t. the streams, ``fn``, ``base`` and ``scale``.

    Shapes, dtypes and errors as the op.
    """
    kw = dict(norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)
    if not needs_grad(streams_TND, fn_MK, base_M, scale_3):
        return dispatch.hc_pre(streams_TND, fn_MK, base_M, scale_3, **kw)
    return HCRecomputeFn.apply(
        lambda *t: dispatch.hc_pre(*t, **kw), lambda *t: hc_pre_math(*t, norm_eps, hc_eps, sinkhorn_iters),
        "hc_pre", stamp(fn=fn_MK, base=base_M, scale=scale_3), streams_TND, fn_MK, base_M, scale_3)


def hc_post(streams_TND: torch.Tensor, y_TD: torch.Tensor, post_TN: torch.Tensor,
            comb_TNN: torch.Tensor) -> torch.Tensor:
    """:func:`ops.mhc.hc_post`, differentiable w.r.t. all four inputs. Shapes and errors as the op."""
    if not needs_grad(streams_TND, y_TD, post_TN, comb_TNN):
        return dispatch.hc_post(streams_TND, y_TD, post_TN, comb_TNN)
    return HCRecomputeFn.apply(dispatch.hc_post, hc_post_math, "hc_post", (), streams_TND, y_TD, post_TN, comb_TNN)


def hc_head(streams_TND: torch.Tensor, fn_NK: torch.Tensor, base_N: torch.Tensor, scale_1: torch.Tensor, *,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """:func:`ops.mhc.hc_head`, differentiable w.r.t. the streams, ``hc_fn``, ``hc_base`` and ``hc_scale``.

    Shapes, dtypes and errors as the op.
    """
    kw = dict(norm_eps=norm_eps, hc_eps=hc_eps)
    if not needs_grad(streams_TND, fn_NK, base_N, scale_1):
        return dispatch.hc_head(streams_TND, fn_NK, base_N, scale_1, **kw)
    return HCRecomputeFn.apply(
        lambda *t: dispatch.hc_head(*t, **kw), lambda *t: hc_head_math(*t, norm_eps, hc_eps),
        "hc_head", stamp(hc_fn=fn_NK, hc_base=base_N, hc_scale=scale_1), streams_TND, fn_NK, base_N, scale_1)
