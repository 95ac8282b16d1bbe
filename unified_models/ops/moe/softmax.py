"""Softmax top-k router (Qwen3-MoE) without autograd.

Formulas: transformers 5.19 ``models/qwen3_moe/modeling_qwen3_moe.py`` (``Qwen3MoeTopKRouter``);
vLLM's ``Qwen3MoeSparseMoeBlock`` (``GateLinear`` in the model dtype, ``FusedMoE`` with
``scoring_func="softmax"``, ``renormalize=norm_topk_prob``) computes the same. Shapes: T tokens,
D hidden, E routed experts, K top-k.

**Router** (:func:`softmax_route`):

1. ``logits = x W^T`` from ONE fp32-output GEMM (:func:`.dispatch.router_logits`, the
   batch-invariant linear), then rounded once to ``logits_dtype`` (the model dtype in the
   engines: transformers' ``F.linear`` and vLLM's gate both return model-dtype logits) and
   widened back to fp32;
2. ``p = softmax(logits)`` in fp32: ``e = exp(l - max_row(l))`` (the max is exact), ``p = e / sum_row(e)``
   (IEEE division). CPU: fixed ``[16, E padded to 64]`` tiles (padding ``-inf``); Triton: one
   program per fixed tile of tokens with every expert in registers (the row sum's order is a
   function of ``E`` only);
3. top-k of ``p`` as a **total order** (DESIGN.md rule 4; :func:`.dispatch.topk_total_order`):
   ``(p, index)`` packed into one int64 key, **among equal scores the lower expert index wins**;
   slots best first, which is the combine's accumulation order (transformers'
   ``topk(sorted=True)`` breaks ties its own way; vLLM's fused top-k too);
4. weights ``p`` at the selected experts; with ``norm_topk_prob`` divided by
   ``(w_0 + ... + w_{K-1}) + 1e-20`` (the sum in slot order; :func:`.deepseek.topk_slot_weights`:
   transformers divides by the bare sum, and since the top-k probabilities sum to at least
   ``K / E`` the ``1e-20`` changes no fp32 bit).

There is no correction bias and no scaling factor.
"""

from __future__ import annotations

import torch

from .._dispatch import use_triton
from .deepseek import topk_slot_weights
from .dispatch import router_logits, topk_total_order
from .softmax_cpu import softmax_scores_torch

__all__ = ["softmax_scores", "softmax_select", "softmax_route"]


def softmax_scores(logits_TE: torch.Tensor) -> torch.Tensor:
    """``softmax(logits)`` per row, fp32 ``[T, E]`` (step 2); row-invariant."""
    if logits_TE.device.type == "cpu":
        return softmax_scores_torch(logits_TE)
    return torch.softmax(logits_TE.float(), dim=-1)


def _round_logits(logits_TE: torch.Tensor, logits_dtype: torch.dtype | None) -> torch.Tensor:
    if logits_dtype is None or logits_dtype == torch.float32:
        return logits_TE.float()
    return logits_TE.to(logits_dtype).float()


def softmax_select(logits_TE: torch.Tensor, *, top_k: int, norm_topk_prob: bool = False,
                   logits_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router steps 2-4 (package doc) from fp32 logits ``[T, E]`` (rounded to ``logits_dtype`` first).

    Returns:
        ``(weights_TK fp32, ids_TK int32)``, slots best first (ties: lower expert index).

    Raises:
        ValueError: logits not ``[T, E]``, ``top_k`` outside ``[1, E]``.
    """
    if logits_TE.dim() != 2:
        raise ValueError(f"softmax_select: logits must be [T, E], got {tuple(logits_TE.shape)}")
    E = logits_TE.shape[1]
    if not 1 <= top_k <= E:
        raise ValueError(f"softmax_select: top_k = {top_k} must be in [1, {E}] (num_experts)")
    logits = _round_logits(logits_TE, logits_dtype)
    if use_triton(logits):
        from .softmax_triton import softmax_select_triton

        return softmax_select_triton(logits, top_k=top_k, norm_topk_prob=norm_topk_prob)
    scores = softmax_scores(logits)
    ids = topk_total_order(scores, top_k)
    w = topk_slot_weights(scores, ids, norm_topk_prob=norm_topk_prob, routed_scaling_factor=1.0)
    return w, ids.to(torch.int32)


def softmax_route(x_TD: torch.Tensor, gate_weight_ED: torch.Tensor, *, top_k: int, norm_topk_prob: bool = False,
                  logits_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE top-k router (package doc, steps 1-4; ``Qwen3MoeTopKRouter``).

    Args:
        x_TD: ``[T, D]`` activations (bf16 or fp32).
        gate_weight_ED: ``[E, D]`` router weight (``mlp.gate.weight``).
        top_k: ``num_experts_per_tok``.
        norm_topk_prob: renormalise the selected probabilities to sum to 1.
        logits_dtype: the dtype the logits are rounded to before the softmax (None: fp32, no rounding).

    Returns:
        ``(weights_TK fp32, ids_TK int32)``; row ``t`` depends only on ``x_TD[t]``.

    Raises:
        ValueError: shapes or ``top_k`` inconsistent.
    """
    if x_TD.dim() != 2 or gate_weight_ED.dim() != 2 or x_TD.shape[1] != gate_weight_ED.shape[1]:
        raise ValueError(f"softmax_route: x {tuple(x_TD.shape)} and gate weight {tuple(gate_weight_ED.shape)} "
                         "do not match")
    return softmax_select(router_logits(x_TD, gate_weight_ED), top_k=top_k, norm_topk_prob=norm_topk_prob,
                          logits_dtype=logits_dtype)
