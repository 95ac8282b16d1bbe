"""Forward of :class:`~unified_models.dsl.AttentionSpec`: causal GQA over a paged KV cache.

Shapes: T tokens, D hidden, H query heads, G kv heads, E head dim,
N cache blocks, S block size.
"""

from __future__ import annotations

from typing import Mapping

import torch

from .. import ops
from ..dsl import AttentionSpec
from ..state import FlatBatch, StateStore
from .common import LayerContext, bias_getter


def attention_forward(spec: AttentionSpec, layer_index: int, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
                      batch: FlatBatch, store: StateStore, ctx: LayerContext) -> torch.Tensor:
    """q/k/v projections, RoPE (if any), K/V written into the layer's cache
    group at ``slot_mapping``, paged attention read through the group's
    ``block_table``, o projection: ``[T, D] -> [T, D]``.

    In profiling runs (``store.attention_state`` gives ``None``) the attention
    output is zeros and no cache is touched.
    """
    t = x_TD.shape[0]
    p = spec.name
    bias = bias_getter(p, params, spec.bias)
    q_THE = ops.linear(x_TD, params[f"{p}.q_proj.weight"], bias("q_proj")).view(t, spec.num_heads, spec.head_dim)
    k_TGE = ops.linear(x_TD, params[f"{p}.k_proj.weight"], bias("k_proj")).view(t, spec.num_kv_heads, spec.head_dim)
    v_TGE = ops.linear(x_TD, params[f"{p}.v_proj.weight"], bias("v_proj")).view(t, spec.num_kv_heads, spec.head_dim)
    if spec.rope is not None:
        cos, sin = ops.rope_cos_sin(ctx.max_positions, spec.rope.rotary_dim, spec.rope.theta, x_TD.device)
        q_THE = ops.apply_rope(q_THE, batch.positions, cos, sin)
        k_TGE = ops.apply_rope(k_TGE, batch.positions, cos, sin)
    state = store.attention_state(layer_index)
    if state is None:  # profiling / dummy run: no cache bound yet
        o_THE = torch.zeros_like(q_THE)
    else:
        ops.write_kv_cache(k_TGE, v_TGE, state.k_cache, state.v_cache, state.slot_mapping)
        o_THE = ops.paged_attention(q_THE, state.k_cache, state.v_cache, state.block_table, batch.seq_idx,
                                    batch.positions, spec.scale)
    return ops.linear(o_THE.reshape(t, spec.num_heads * spec.head_dim), params[f"{p}.o_proj.weight"], bias("o_proj"))
