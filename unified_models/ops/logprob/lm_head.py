"""The trainer's token logprobs straight from the hidden rows: LM head, logprob op and gather in row
chunks, so no fp32 ``[R, V]`` tensor of the whole micro-batch is ever alive.

``tok[r] = log_softmax(fp32(h_r W^T) / T)[ids[r]]`` with the rollout's ops: the batch-invariant
linear (:func:`unified_models.ops.linear.dispatch.linear`, fp32 output) and the logprob op
(:func:`.dispatch.logprobs`), both row-local, so a chunk's rows hold the bits the whole batch would
(the contract's side: these are the values the rollout engine reports). Chunks are
:func:`chunk_rows` rows (about 1 GiB of fp32 logits each).

Backward, per chunk: the logits and log-probabilities recomputed (the same bits), the gradient
written over them (:func:`.backward.token_logprobs_backward_`), then the linear's two GEMMs
(:func:`unified_models.ops.grad.helpers.grad_matmul`, as :class:`~unified_models.ops.linear.backward.LinearFn`):
``dX`` rows of the chunk, ``dW`` summed over the chunks in fp32 in chunk order. One chunk (``R <=
chunk_rows``): the log-probabilities kept from the forward, no recompute, and the same gradient bits
as ``linear`` -> ``logprobs`` -> ``gather_token_logprobs``; several chunks: ``dW`` is a sum of
per-chunk GEMMs (other bits than one GEMM over all rows, deterministic; DESIGN.md rule 11: gradients
are not batch-invariant). Peak memory: one chunk's logits and gradient (+ the GEMMs' bf16 splits of
it) instead of three fp32 ``[R, V]`` tensors and the splits of the whole one.
"""

from __future__ import annotations

import torch

from ..grad.helpers import acc, grad_matmul, needs_grad
from ..grad.weights import check_stamps, stamp
from ..linear import dispatch as linear_dispatch
from . import dispatch
from .backward import refuse_double_backward, token_logprobs_backward_

CHUNK_ELEMENTS = 1 << 28
"""fp32 logits per chunk (1 GiB): :func:`chunk_rows` is ``max(1, CHUNK_ELEMENTS // V)``."""


def chunk_rows(vocab_size: int) -> int:
    """Rows per chunk for a vocabulary of ``vocab_size``: ``max(1, CHUNK_ELEMENTS // V)`` (2,048 at V = 131,072)."""
    return max(1, CHUNK_ELEMENTS // max(1, int(vocab_size)))


def _chunk_logprobs(h_RD, weight_VD, temperature):
    return dispatch.logprobs(linear_dispatch.linear(h_RD, weight_VD, None, torch.float32), temperature)


def _token_logprobs_in_chunks(h_RD, weight_VD, ids_R, temperature, rows):
    """The forward: fp32 ``[R]`` and the last chunk's log-probabilities (None when R = 0)."""
    R = h_RD.shape[0]
    out = torch.empty(R, dtype=torch.float32, device=h_RD.device)
    y = None
    for r0 in range(0, R, rows):
        y = _chunk_logprobs(h_RD[r0:r0 + rows], weight_VD, temperature)
        out[r0:r0 + rows] = dispatch.gather_token_logprobs(y, ids_R[r0:r0 + rows])
    return out, y


class LmHeadTokenLogprobsFn(torch.autograd.Function):
    """Module doc. Inputs ``(hidden [R, D], weight [V, D], ids [R], temperature, rows per chunk)``."""

    @staticmethod
    def forward(ctx, h_RD, weight_VD, ids_R, temperature, rows):
        out, y = _token_logprobs_in_chunks(h_RD, weight_VD, ids_R, temperature, rows)
        ctx.save_for_backward(h_RD, ids_R)
        ctx.y = y if h_RD.shape[0] <= rows else None  # one chunk: kept (no recompute); several: recomputed per chunk
        ctx.weight, ctx.temperature, ctx.rows, ctx.done = weight_VD, temperature, rows, False
        ctx.stamps = stamp(weight=weight_VD)
        return out

    @staticmethod
    def backward(ctx, g_R):
        refuse_double_backward("lm_head_token_logprobs")
        check_stamps("lm_head_token_logprobs", ctx.stamps)
        h, ids = ctx.saved_tensors
        w, temp, rows = ctx.weight, ctx.temperature, ctx.rows
        if ctx.done:
            raise RuntimeError("lm_head_token_logprobs: backward ran twice through the same graph (its saved "
                               "log-probabilities hold the first backward's gradient); recompute the forward")
        ctx.done = True
        kept, ctx.y = ctx.y, None
        R = h.shape[0]
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        parts_x = []
        dw = None
        for r0 in range(0, R, rows):
            hc = h[r0:r0 + rows]
            y = kept if kept is not None else _chunk_logprobs(hc, w, temp)
            dz = token_logprobs_backward_(y, ids[r0:r0 + rows], acc(g_R[r0:r0 + rows]), temp)
            if want_x:
                parts_x.append(grad_matmul(dz, w).to(h.dtype))  # LinearFn's dX, rounded per row as there
            if want_w:
                part = grad_matmul(dz.t(), hc)
                dw = part if dw is None else dw.add_(part)
            del y, dz
        if want_w and dw is None:
            dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        dx = None
        if want_x:
            dx = torch.cat(parts_x) if parts_x else torch.zeros(h.shape, dtype=h.dtype, device=h.device)
        return dx, dw.to(w.dtype) if want_w else None, None, None, None


def lm_head_token_logprobs(hidden_RD: torch.Tensor, weight_VD: torch.Tensor, token_ids_R: torch.Tensor,
                           temperature: float = 1.0, rows_per_chunk: int | None = None) -> torch.Tensor:
    """``gather_token_logprobs(logprobs(linear(hidden, weight, out fp32), T), ids)`` in row chunks (module doc).

    Args:
        hidden_RD: ``[R, D]`` final hidden rows (model dtype). weight_VD: ``[V, D]`` LM head.
        token_ids_R: int ``[R]`` in ``[0, V)``. temperature: > 0.
        rows_per_chunk: rows per chunk (default :func:`chunk_rows` of V; tests pass small ones).

    Returns:
        fp32 ``[R]``: the bits of the unchunked ops; differentiable w.r.t. ``hidden_RD`` and ``weight_VD``
        (backward once per graph, no ``create_graph``; the ids may not change in place before it).

    Raises:
        ValueError: ``rows_per_chunk`` not an int >= 1; ``token_ids_R`` not one integer id per row; as
            :func:`.dispatch.logprobs` and the linear.
    """
    if rows_per_chunk is not None and (isinstance(rows_per_chunk, bool) or not isinstance(rows_per_chunk, int)
                                       or rows_per_chunk < 1):
        raise ValueError(f"lm_head_token_logprobs: rows_per_chunk must be an int >= 1, got {rows_per_chunk!r}")
    rows = chunk_rows(weight_VD.shape[0]) if rows_per_chunk is None else rows_per_chunk
    if token_ids_R.is_floating_point() or token_ids_R.numel() != hidden_RD.shape[0] or token_ids_R.dim() > 2:
        raise ValueError(f"lm_head_token_logprobs: token_ids_R must hold one integer id per hidden row "
                         f"([R] = [{hidden_RD.shape[0]}]), got {token_ids_R.dtype} {list(token_ids_R.shape)}")
    ids = token_ids_R.reshape(-1)
    if needs_grad(hidden_RD, weight_VD):
        return LmHeadTokenLogprobsFn.apply(hidden_RD, weight_VD, ids, temperature, rows)
    with torch.no_grad():
        return _token_logprobs_in_chunks(hidden_RD, weight_VD, ids, temperature, rows)[0]
