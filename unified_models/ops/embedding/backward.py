"""Backward of the embedding lookup: the autograd function (``index_add`` of the row
gradients, weight-version guard) and the differentiable ``embedding`` that
:mod:`unified_models.ops` exports."""

from __future__ import annotations

import torch

from ..grad.helpers import acc, index_add_rows, needs_grad
from ..grad.weights import check_stamps, stamp
from . import dispatch


class EmbeddingFn(torch.autograd.Function):
    """``out[t] = W[ids[t]]``: ``dW = index_add(ids, dOut)`` (repeated ids accumulate, in a fixed order:
    :func:`~unified_models.ops.grad.helpers.index_add_rows`)."""

    @staticmethod
    def forward(ctx, input_ids_T, weight_VD):
        out = dispatch.embedding(input_ids_T, weight_VD)
        ctx.save_for_backward(input_ids_T)
        ctx.weight = weight_VD
        ctx.stamps = stamp(weight=weight_VD)
        return out

    @staticmethod
    def backward(ctx, g_TD):
        check_stamps("embedding", ctx.stamps)
        (ids,) = ctx.saved_tensors
        w = ctx.weight
        g = acc(g_TD)
        dw = index_add_rows(torch.zeros(w.shape, dtype=g.dtype, device=g.device), ids.long(), g)
        return None, dw.to(w.dtype)


def embedding(input_ids_T: torch.Tensor, weight_VD: torch.Tensor) -> torch.Tensor:
    """:func:`ops.embedding.embedding`, differentiable w.r.t. ``weight_VD``.

    ``[T]`` int ids, ``[V, D]`` -> ``[T, D]`` in the weight's dtype. Raises as the op.
    """
    if needs_grad(weight_VD):
        return EmbeddingFn.apply(input_ids_T, weight_VD)
    return dispatch.embedding(input_ids_T, weight_VD)
