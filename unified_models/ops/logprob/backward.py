"""Backward of the logprob ops: autograd functions (analytic: softmax form with the
temperature; scatter) and the differentiable ``logprobs`` /
``gather_token_logprobs`` that :mod:`unified_models.ops` exports."""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from ..grad.helpers import acc, needs_grad
from . import dispatch


class LogprobsFn(torch.autograd.Function):
    """``y = log_softmax(z / T)``: ``dz = (dy - softmax * sum(dy)) / T`` (softmax = exp(y))."""

    @staticmethod
    def forward(ctx, logits_TV, temperature):
        y = dispatch.logprobs(logits_TV, temperature)
        ctx.save_for_backward(y)
        ctx.temperature, ctx.z_dtype = temperature, logits_TV.dtype
        return y

    @staticmethod
    def backward(ctx, g_TV):
        (y,) = ctx.saved_tensors
        g = acc(g_TV)
        if use_triton(y) and y.dtype == torch.float32:  # one kernel: a [T, V] tensor read or written 3 times
            from .triton import logprobs_backward_triton

            dz = logprobs_backward_triton(y, g.contiguous(), ctx.temperature)
        else:
            dz = (g - torch.exp(acc(y)) * g.sum(-1, keepdim=True)) / ctx.temperature
        return dz.to(ctx.z_dtype), None


class GatherTokenFn(torch.autograd.Function):
    """``y[t] = lp[t, ids[t]]``: ``dlp`` is ``dy`` scattered to column ``ids[t]`` of row t."""

    @staticmethod
    def forward(ctx, logprobs_TV, token_ids_T):
        ctx.save_for_backward(token_ids_T)
        ctx.shape, ctx.lp_dtype = logprobs_TV.shape, logprobs_TV.dtype
        return dispatch.gather_token_logprobs(logprobs_TV, token_ids_T)

    @staticmethod
    def backward(ctx, g_T):
        (ids,) = ctx.saved_tensors
        d = torch.zeros(ctx.shape, dtype=ctx.lp_dtype, device=g_T.device)
        return d.scatter_(1, ids.long().view(-1, 1), g_T.to(ctx.lp_dtype).view(-1, 1)), None


def logprobs(logits_TV: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """:func:`ops.logprob.logprobs`, differentiable: ``[T, V]`` -> fp32 ``[T, V]``. Raises as the op."""
    if needs_grad(logits_TV):
        return LogprobsFn.apply(logits_TV, temperature)
    return dispatch.logprobs(logits_TV, temperature)


def gather_token_logprobs(logprobs_TV: torch.Tensor, token_ids_T: torch.Tensor) -> torch.Tensor:
    """:func:`ops.logprob.gather_token_logprobs`, differentiable: ``[T, V]``, ``[T]`` -> ``[T]``."""
    if needs_grad(logprobs_TV):
        return GatherTokenFn.apply(logprobs_TV, token_ids_T)
    return dispatch.gather_token_logprobs(logprobs_TV, token_ids_T)
