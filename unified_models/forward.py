"""The single forward program: runs a :class:`ModelSpec` over a flat token batch.

Both engines call :func:`forward_hidden` and :func:`forward_logprobs` with the
same ops; they differ only in the :class:`~unified_models.state.StateStore`
(vLLM's paged caches vs the trainer's private ones) and in how they build the
:class:`~unified_models.state.FlatBatch`. Each sublayer's mixer is computed by
the forward of its layer family (:func:`unified_models.layers.family_of`);
stateful sublayers get their caches' views from the store by ``(layer index,
cache name)``; the model's residual policy (:mod:`unified_models.layers.residual`)
owns the stream between sublayers (for one plain stream, each sublayer's residual add
and the next norm are one fused kernel, ``ops.add_rms_norm``).

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
from .porting import taps
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
    if taps.SINK is not None: taps.SINK.begin(batch)
    h_TD = ops.embedding(batch.input_ids, params[spec.embedding.name + ".weight"])
    if taps.SINK is not None: h_TD = taps.SINK("embedding", h_TD)
    r = policy.expand(rspec, params, h_TD)
    first, norm = (sublayers[0][0], sublayers[0][0].norm) if sublayers else (None, spec.final_norm)
    x_TD = policy.sublayer_input(rspec, params, r, first) if sublayers else policy.contract(rspec, params, r)
    x_TD = ops.rms_norm(x_TD, params[norm.name + ".weight"], norm.eps, out_dtype=spec.dtype)
    for i, (sub, forward) in enumerate(sublayers):
        if taps.SINK is not None: x_TD = taps.SINK(sub.norm.name, x_TD)
        y_TD = forward(sub.mixer, sub.index, params, x_TD, batch, store, ctx)
        if taps.SINK is not None: y_TD = taps.SINK(sub.mixer.name, y_TD)
        next_sub = sublayers[i + 1][0] if i + 1 < len(sublayers) else None
        r, x_TD = _add_and_norm(spec, params, policy, r, sub, y_TD, next_sub)
    if taps.SINK is not None: x_TD = taps.SINK("final_norm", x_TD)
    return x_TD


def _add_and_norm(spec: ModelSpec, params: Mapping[str, torch.Tensor], policy, r, sub, y_TD: torch.Tensor,
                  next_sub) -> tuple[object, torch.Tensor]:
    """The residual add of ``sub`` and the normed input of ``next_sub`` (the final norm of the
    contracted stream when it is None): the policy's fused ``add_and_norm`` with taps off (unless it
    returns None), else the policy's steps one at a time with the ``<mixer>.residual`` tap between
    them (the same bits)."""
    norm = spec.final_norm if next_sub is None else next_sub.norm
    weight_D, rspec = params[norm.name + ".weight"], spec.residual
    fused = getattr(policy, "add_and_norm", None)
    if fused is not None and taps.SINK is None:
        out = fused(rspec, params, r, sub, y_TD, next_sub, weight_D, norm.eps, spec.dtype)
        if out is not None:
            return out
    r = policy.add(rspec, params, r, sub, y_TD)
    if taps.SINK is not None: r = taps.SINK(sub.mixer.name + ".residual", r)
    x = policy.contract(rspec, params, r) if next_sub is None else policy.sublayer_input(rspec, params, r, next_sub)
    return r, ops.rms_norm(x, weight_D, norm.eps, out_dtype=spec.dtype)


def logits_fp32(spec: ModelSpec, params: Mapping[str, torch.Tensor], hidden_RD: torch.Tensor) -> torch.Tensor:
    """LM head with fp32 output (no bf16 rounding of logits): ``[R, D] -> [R, V]``."""
    z_RV = ops.linear(hidden_RD, params[spec.lm_head.weight_name], out_dtype=torch.float32)
    if taps.SINK is not None: z_RV = taps.SINK("logits", z_RV)
    return z_RV


def forward_logprobs(spec: ModelSpec, params: Mapping[str, torch.Tensor], hidden_RD: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """Full-vocabulary log-probabilities of the selected rows: fp32 ``[R, V]``."""
    lp_RV = ops.logprobs(logits_fp32(spec, params, hidden_RD), temperature)
    if taps.SINK is not None: lp_RV = taps.SINK("logprobs", lp_RV)
    return lp_RV


def forward_token_logprobs(spec: ModelSpec, params: Mapping[str, torch.Tensor], hidden_RD: torch.Tensor,
                           targets_R: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The log-probability of ``targets_R[r]`` in row ``r``: fp32 ``[R]``, the bits of
    ``gather(forward_logprobs(...), targets_R)``, formed in row chunks of about 1 GiB of logits, forward
    and backward (:func:`unified_models.ops.lm_head_token_logprobs`): no fp32 ``[R, V]`` tensor of the
    whole batch. Under a tap (porting tools) the full rows are formed so that the taps see them."""
    if taps.SINK is not None:
        return ops.gather_token_logprobs(forward_logprobs(spec, params, hidden_RD, temperature), targets_R)
    return ops.lm_head_token_logprobs(hidden_RD, params[spec.lm_head.weight_name], targets_R, temperature)
