"""Differentiable softmax top-k router (Qwen3-MoE): forward :func:`.softmax.softmax_route`,
backward by recomputation (:class:`.backward.RouteFn` with the row softmax as the score:
``w = p[ids] / (sum p[ids] + eps)``, ``p = softmax(x W^T)``, differentiated w.r.t. ``x`` and the gate
weight; the ids are constants; the forward's rounding of the logits passes gradients straight
through). DESIGN.md rule 11; correct, not batch-invariant."""

from __future__ import annotations

import torch

from ..grad.helpers import needs_grad
from . import softmax
from .backward import RouteFn


def _row_softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits, dim=-1)


def softmax_route(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor, *, top_k: int, norm_topk_prob: bool = False,
                  logits_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.softmax.softmax_route`, differentiable w.r.t. ``x_TD`` and ``gate_weight_ED`` through the
    fp32 weights; ids int32 constants (ties: lower expert index)."""
    if needs_grad(x_TD, gate_weight_ED):
        def route(x, w, norm_topk_prob, routed_scaling_factor):
            return softmax.softmax_route(x, w, top_k=top_k, norm_topk_prob=norm_topk_prob, logits_dtype=logits_dtype)

        cfg = dict(norm_topk_prob=norm_topk_prob, routed_scaling_factor=1.0)
        return RouteFn.apply(x_TD, gate_weight_ED, route, (), cfg, _row_softmax, "softmax_route")
    return softmax.softmax_route(x_TD, gate_weight_ED, top_k=top_k, norm_topk_prob=norm_topk_prob,
                                 logits_dtype=logits_dtype)
