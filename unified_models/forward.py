"""The single forward program: runs a :class:`ModelSpec` over a flat token batch.

Both engines call :func:`forward_hidden` and :func:`forward_logprobs` with the
same ops; they differ only in the :class:`~unified_models.state.StateStore`
(vLLM's paged caches vs the trainer's private ones) and in how they build the
:class:`~unified_models.state.FlatBatch`. Each sublayer's mixer is computed by
the forward of its layer family (:func:`unified_models.layers.family_of`);
stateful sublayers get their caches' views from the store by ``(layer index,
cache name)``; the model's residual policy (:mod:`unified_models.layers.residual`)
owns the stream between sublayers.

Shapes: T tokens (flat, all sequences packed, THD), R selected rows, D hidden,
V vocabulary.
"""

from __future__ import annotations

from typing import Mapping

import torch

from . import ops
from .dsl import ModelSpec
from .layers import LayerContext, family_of, residual_policy
from .layers.expert_parallel import LOCAL_EXPERTS, ExpertDispatcher, ShardPlan
from .state import FlatBatch, StateStore

__all__ = ["forward_hidden", "forward_logprobs", "logits_fp32"]


def forward_hidden(spec: ModelSpec, params: Mapping[str, torch.Tensor], batch: FlatBatch,
                   store: StateStore, *, shard_plan: ShardPlan | None = None,
                   dispatcher: ExpertDispatcher | None = None) -> torch.Tensor:
    """Embedding -> blocks of sublayers (through the residual policy) -> final norm.

    Args:
        spec: the model.
        params: HF parameter name -> tensor (``spec.dtype``).
        batch: the flat token batch.
        store: per-layer state; its slot mappings must match ``batch``.
        shard_plan, dispatcher: expert parallelism (:mod:`unified_models.layers.expert_parallel`);
            default EP = 1, every expert on this process.

    Returns:
        ``[T, D]`` final hidden states in ``spec.dtype``.

    Raises:
        SpecError: a sublayer's mixer has no layer family, or the residual spec no
            policy (names type and layer).
    """
    ctx = LayerContext(model=spec, shard_plan=shard_plan or ShardPlan(), dispatcher=dispatcher or LOCAL_EXPERTS)
    sublayers = [(sub, family_of(sub.mixer, sub.index).forward) for sub in spec.sublayers]  # refuse first
    policy, rspec = residual_policy(spec.residual), spec.residual
    r = policy.expand(rspec, params, ops.embedding(batch.input_ids, params[spec.embedding.name + ".weight"]))
    for sub, forward in sublayers:
        x_TD = ops.rms_norm(policy.sublayer_input(rspec, params, r, sub), params[sub.norm.name + ".weight"],
                            sub.norm.eps, out_dtype=spec.dtype)
        r = policy.add(rspec, params, r, sub, forward(sub.mixer, sub.index, params, x_TD, batch, store, ctx))
    h_TD = policy.contract(rspec, params, r)
    return ops.rms_norm(h_TD, params[spec.final_norm.name + ".weight"], spec.final_norm.eps, out_dtype=spec.dtype)


def logits_fp32(spec: ModelSpec, params: Mapping[str, torch.Tensor], hidden_RD: torch.Tensor) -> torch.Tensor:
    """LM head with fp32 output (no bf16 rounding of logits): ``[R, D] -> [R, V]``."""
    return ops.linear(hidden_RD, params[spec.lm_head.weight_name], out_dtype=torch.float32)


def forward_logprobs(spec: ModelSpec, params: Mapping[str, torch.Tensor], hidden_RD: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """Full-vocabulary log-probabilities of the selected rows: fp32 ``[R, V]``."""
    return ops.logprobs(logits_fp32(spec, params, hidden_RD), temperature)
