"""Backward of the logprob ops: autograd functions (analytic: softmax form with the
temperature; scatter; the two fused for a gathered token) and the differentiable ``logprobs`` /
``gather_token_logprobs`` / ``token_logprobs`` that :mod:`unified_models.ops` exports."""

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


def token_logprobs_backward_(logprobs_TV: torch.Tensor, token_ids_T: torch.Tensor, grad_T: torch.Tensor,
                             temperature: float) -> torch.Tensor:
    """In place: the logits' gradient of ``logprobs_TV[t, ids[t]]`` (``logprobs_TV = log_softmax(z / T)``)
    written over ``logprobs_TV`` (fp32 or fp64 ``[T, V]``) and returned; bit for bit what
    :class:`LogprobsFn` gives for :class:`GatherTokenFn`'s scattered gradient
    (``(g - exp(y) * sum(g)) / T`` with ``g`` one-hot: ``sum(g) = g_t + 0``, ``0 - P = -P + 0``
    exactly, zeros' signs included), with no other ``[T, V]`` tensor. Triton on the Triton path
    (:func:`.triton.token_logprobs_backward_triton_`), torch ops in place otherwise.

    Raises:
        ValueError: as :func:`.triton.token_logprobs_backward_triton_` on the Triton path.
    """
    y, ids = logprobs_TV, token_ids_T.long().view(-1, 1)
    if use_triton(y) and y.dtype == torch.float32:
        from .triton import token_logprobs_backward_triton_

        return token_logprobs_backward_triton_(y, token_ids_T, grad_T, temperature)
    g = grad_T.to(y.dtype).view(-1, 1)
    s = g + 0.0  # the unfused backward's sum over a row with one nonzero
    p = y.exp_().mul_(s)  # exp(y) * sum(g), as LogprobsFn's expression
    p_tok = p.gather(1, ids)
    d = p.mul_(-1).add_(0.0)  # 0 - p for every column (exact; -0.0 + 0 = +0 as 0 - +0)
    d.scatter_(1, ids, g - p_tok)  # the token's column: g_t - p
    return d.div_(temperature)


def refuse_double_backward(op: str) -> None:
    """Raise when a backward runs with ``create_graph=True`` (grad mode on inside it): the fused logprob
    backwards form no graph of their own, so second-order terms would be silently zero.

    Raises:
        RuntimeError: naming ``op`` and the unfused ops that do support it.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(f"{op}: double backward (create_graph=True) is not supported; compose "
                           "ops.logprobs and ops.gather_token_logprobs for second-order gradients")


class TokenLogprobsFn(torch.autograd.Function):
    """``tok[t] = log_softmax(z[t] / T)[ids[t]]``: :class:`LogprobsFn` then :class:`GatherTokenFn` with
    one ``[T, V]`` tensor kept (the log-probabilities) and the gradient written over it
    (:func:`token_logprobs_backward_`): the same bits forward and backward, a third of the memory.
    Backward runs once (its saved tensor is overwritten), without ``create_graph``; the ids are saved
    through autograd (changing them in place after the forward is refused, as for the unfused ops)."""

    @staticmethod
    def forward(ctx, logits_TV, token_ids_T, temperature):
        y = dispatch.logprobs(logits_TV, temperature)
        ids = token_ids_T.reshape(-1)
        ctx.save_for_backward(ids)
        ctx.y, ctx.temperature, ctx.z_dtype = y, temperature, logits_TV.dtype
        return dispatch.gather_token_logprobs(y, ids)

    @staticmethod
    def backward(ctx, g_T):
        refuse_double_backward("token_logprobs")
        (ids,) = ctx.saved_tensors
        y, ctx.y = ctx.y, None
        if y is None:
            raise RuntimeError("token_logprobs: backward ran twice through the same graph (its saved log-probabilities "
                               "hold the first backward's gradient); recompute the forward")
        dz = token_logprobs_backward_(y, ids, acc(g_T), ctx.temperature)
        return dz.to(ctx.z_dtype), None, None


def token_logprobs(logits_TV: torch.Tensor, token_ids_T: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``gather_token_logprobs(logprobs(logits_TV, temperature), token_ids_T)``, differentiable with one
    fp32 ``[T, V]`` tensor alive in the backward instead of three (:class:`TokenLogprobsFn`); the same
    bits forward and backward as the two ops composed. ``[T, V]``, ``[T]`` -> fp32 ``[T]``.

    Raises:
        ValueError: as :func:`.dispatch.logprobs`.
    """
    if needs_grad(logits_TV):
        return TokenLogprobsFn.apply(logits_TV, token_ids_T, temperature)
    return dispatch.gather_token_logprobs(dispatch.logprobs(logits_TV, temperature), token_ids_T)
