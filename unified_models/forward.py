"""The single forward program: runs a :class:`ModelSpec` over a flat token batch.

Both engines call :func:`forward_hidden` and :func:`forward_logprobs` with the
same ops; they differ only in the :class:`~unified_models.state.StateStore`
(vLLM's paged caches vs the trainer's private ones) and in how they build the
:class:`~unified_models.state.FlatBatch`. Each block's mixer is computed by
the layer function that :data:`unified_models.layers.LAYERS` maps its spec
type to; stateful layers get their KV-cache group's views from the store by
layer index.

Shapes: T tokens (flat, all sequences packed, THD), R selected rows, D hidden,
V vocabulary.
"""

from __future__ import annotations

from typing import Mapping

import torch

from . import ops
from .dsl import ModelSpec
from .layers import LayerContext, layer_function
from .state import AttentionState, FlatBatch, PagedGroup, PrivateKVStore, StateStore

__all__ = ["AttentionState", "FlatBatch", "PagedGroup", "PrivateKVStore", "StateStore", "forward_hidden",
           "forward_logprobs", "logits_fp32"]


def forward_hidden(spec: ModelSpec, params: Mapping[str, torch.Tensor], batch: FlatBatch,
                   store: StateStore) -> torch.Tensor:
    """Embedding -> residual blocks -> final norm.

    Args:
        spec: the model.
        params: HF parameter name -> tensor (``spec.dtype``).
        batch: the flat token batch.
        store: per-layer state; its slot mappings must match ``batch``.

    Returns:
        ``[T, D]`` final hidden states in ``spec.dtype``.

    Raises:
        SpecError: a block's mixer has no layer function (names type and layer).
    """
    ctx = LayerContext(model=spec)
    layers = [layer_function(blk.mixer, blk.index) for blk in spec.blocks]  # refuse before computing
    h_TD = ops.embedding(batch.input_ids, params[spec.embedding.name + ".weight"])
    for blk, layer in zip(spec.blocks, layers):
        x_TD = ops.rms_norm(h_TD, params[blk.norm.name + ".weight"], blk.norm.eps, out_dtype=spec.dtype)
        y_TD = layer(blk.mixer, blk.index, params, x_TD, batch, store, ctx)
        h_TD = h_TD + y_TD  # one IEEE rounding of the exact sum (bf16 residual stream, as NemotronHBlock)
    return ops.rms_norm(h_TD, params[spec.final_norm.name + ".weight"], spec.final_norm.eps, out_dtype=spec.dtype)


def logits_fp32(spec: ModelSpec, params: Mapping[str, torch.Tensor], hidden_RD: torch.Tensor) -> torch.Tensor:
    """LM head with fp32 output (no bf16 rounding of logits): ``[R, D] -> [R, V]``."""
    return ops.linear(hidden_RD, params[spec.lm_head.weight_name], out_dtype=torch.float32)


def forward_logprobs(spec: ModelSpec, params: Mapping[str, torch.Tensor], hidden_RD: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """Full-vocabulary log-probabilities of the selected rows: fp32 ``[R, V]``."""
    return ops.logprobs(logits_fp32(spec, params, hidden_RD), temperature)
