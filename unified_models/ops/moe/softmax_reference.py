"""fp64 oracle of the softmax top-k router (Qwen3-MoE; transformers 5.19 ``Qwen3MoeTopKRouter``)."""

from __future__ import annotations

import torch

from .deepseek_reference import _weights_reference
from .reference import _rank_rows


def softmax_route_reference(x_TD, gate_weight_ED, *, top_k, norm_topk_prob=False, logits_dtype=None,
                            dtype=torch.float64):
    """Oracle of :func:`.softmax.softmax_route` in ``dtype``: ``p = softmax(x W^T)`` (logits first
    rounded to ``logits_dtype`` when given, as the op does), top-k of ``p`` (ties to the lower index,
    slots best first), weights ``p`` at the ids, divided by their sum when ``norm_topk_prob``.
    Returns ``(weights_TK dtype, ids_TK int32)``."""
    logits = x_TD.to(dtype) @ gate_weight_ED.to(dtype).t()
    if logits_dtype is not None:
        logits = (x_TD.double() @ gate_weight_ED.double().t()).to(torch.float32).to(logits_dtype).to(dtype)
    p = torch.softmax(logits, dim=-1)
    ids = _rank_rows(p, top_k)
    return _weights_reference(p, ids, norm_topk_prob, 1.0), ids.to(torch.int32)
