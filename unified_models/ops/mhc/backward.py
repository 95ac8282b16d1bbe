"""Differentiable mHC ops: the dispatching op's values, gradients of the formulas.

Each entry point calls :mod:`.dispatch` directly when no input requires grad (the
inference path). Otherwise the autograd function returns the op's outputs unchanged (the
*visible* values, bitwise; DESIGN.md rule 11) and its backward computes the gradients of the
plain formulas of :mod:`.reference` at fp32 (fp64 for fp64 inputs):

* ``hc_pre`` and ``hc_head`` (:class:`HCPreFn`): analytically, a fixed 110 ATen ops (views included)
  whatever ``sinkhorn_iters`` (autograd of the formulas: 386 at 20 iterations): the RMS norm,
  the projection (two GEMMs for ``fn``'s and the streams' gradients), the sigmoids, and
  ``comb``'s softmax + Sinkhorn chain in one pass (:func:`.sinkhorn_grads.sinkhorn_grad`: a
  Triton kernel on CUDA);
* ``hc_post`` (:class:`HCRecomputeFn`): autograd of ``hc_post_math`` (no loop: a few ops).

The forward's roundings to the model dtype pass gradients straight through. ``fn`` / ``base`` /
``scale`` are guarded by the weight-version stamps (:mod:`unified_models.ops.grad.weights`).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..grad.helpers import acc, needs_grad
from ..grad.weights import check_stamps, stamp
from . import dispatch
from .reference import hc_post_math
from .sinkhorn_grads import sinkhorn_grad

__all__ = ["hc_pre", "hc_post", "hc_head", "HCPreFn", "HCRecomputeFn"]


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


class HCPreFn(torch.autograd.Function):
    """Inputs ``(run, name, stamps, cfg, streams, fn, base, scale)``: the outputs are ``run(*tensors)``,
    ``hc_pre``'s ``(x, post, comb)`` or (``cfg["head"]``) ``hc_head``'s ``x``; the backward is the
    analytic gradient of ``hc_pre_math`` / ``hc_head_math`` (``cfg``: ``norm_eps``, ``hc_eps``,
    ``sinkhorn_iters``, ``head``)."""

    @staticmethod
    def forward(ctx, run: Callable, name: str, stamps, cfg: dict, streams, fn, base, scale):
        outs = run(streams, fn, base, scale)
        ctx.name, ctx.stamps, ctx.cfg = name, stamps, cfg
        ctx.save_for_backward(streams, fn, base, scale)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        check_stamps(ctx.name, ctx.stamps)
        ins = ctx.saved_tensors
        dt = torch.float64 if any(t.dtype == torch.float64 for t in ins) else torch.float32
        h, fn, base, scale = (t.detach().to(dt) for t in ins)
        cfg = ctx.cfg
        t, n, d = h.shape
        flat = h.reshape(t, n * d)
        r = torch.rsqrt(flat.square().mean(-1, keepdim=True) + cfg["norm_eps"])
        nf = flat * r  # rms(flatten(h))
        mix = nf @ fn.t()  # [T, M]
        gx = grads[0].to(dt) if grads[0] is not None else h.new_zeros((t, d))
        sa = torch.sigmoid(mix[:, :n] * scale[0] + base[:n])
        dh = (sa + cfg["hc_eps"]).unsqueeze(-1) * gx.unsqueeze(1)  # x = sum_j pre_j h_j: the direct path
        dz = [torch.bmm(h, gx.unsqueeze(-1)).squeeze(-1) * sa * (1 - sa)]  # d(logit) of pre, [T, n]
        scales = [scale[0].expand(n)]
        if not cfg["head"]:
            g_post, g_comb = grads[1], grads[2]
            sb = torch.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
            dz.append(g_post.to(dt) * 2 * sb * (1 - sb) if g_post is not None else sb.new_zeros((t, n)))
            if g_comb is not None:
                logits = (mix[:, 2 * n:] * scale[2] + base[2 * n:]).view(t, n, n)
                dz.append(sinkhorn_grad(logits, g_comb.to(dt), hc_eps=cfg["hc_eps"],
                                        sinkhorn_iters=cfg["sinkhorn_iters"]).reshape(t, n * n))
            else:
                dz.append(mix.new_zeros((t, n * n)))
            scales += [scale[1].expand(n), scale[2].expand(n * n)]
        dz_TM = torch.cat(dz, dim=-1)  # d of (mix * scale + base), per logit
        dmix = dz_TM * torch.cat(scales)
        dnf = dmix @ fn
        dh = dh + (r * (dnf - nf * (dnf * nf).mean(-1, keepdim=True))).view(t, n, d)  # through the RMS norm
        dscale = torch.stack([p.sum() for p in torch.split(dz_TM * mix, [len(x) for x in scales], dim=-1)])
        outs = (dh, dmix.t() @ nf, dz_TM.sum(0), dscale)
        need = ctx.needs_input_grad[4:]
        return (None, None, None, None, *(o.to(i.dtype) if nd else None for o, i, nd in zip(outs, ins, need)))


def hc_pre(streams_TND: torch.Tensor, fn_MK: torch.Tensor, base_M: torch.Tensor, scale_3: torch.Tensor, *,
           norm_eps: float, hc_eps: float, sinkhorn_iters: int):
    """:func:`ops.mhc.hc_pre`, differentiable w.r.t. the streams, ``fn``, ``base`` and ``scale``.

    Shapes, dtypes and errors as the op.
    """
    kw = dict(norm_eps=norm_eps, hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)
    if not needs_grad(streams_TND, fn_MK, base_M, scale_3):
        return dispatch.hc_pre(streams_TND, fn_MK, base_M, scale_3, **kw)
    return HCPreFn.apply(lambda *t: dispatch.hc_pre(*t, **kw), "hc_pre", stamp(fn=fn_MK, base=base_M, scale=scale_3),
                         dict(kw, head=False), streams_TND, fn_MK, base_M, scale_3)


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
    return HCPreFn.apply(lambda *t: dispatch.hc_head(*t, **kw), "hc_head",
                         stamp(hc_fn=fn_NK, hc_base=base_N, hc_scale=scale_1), dict(kw, head=True, sinkhorn_iters=0),
                         streams_TND, fn_NK, base_N, scale_1)
