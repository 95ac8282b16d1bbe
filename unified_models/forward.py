"""The single forward program: runs a :class:`ModelSpec` over a flat token batch.

Both engines call :func:`forward_hidden` and :func:`forward_logprobs` with the
same ops; they differ only in the :class:`StateStore` (vLLM's paged KV cache vs
the trainer's private cache) and in how they build the :class:`FlatBatch`.

Shapes: T tokens (flat, all sequences packed, THD), B sequences, D hidden,
H/G query/kv heads, E head dim, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Protocol

import torch

from . import ops
from .dsl import AttentionSpec, MLPSpec, ModelSpec, SpecError


@dataclass(frozen=True)
class FlatBatch:
    """Tokens of several sequences packed into one row.

    Attributes:
        input_ids: int ``[T]``.
        positions: int ``[T]``, position of each token inside its own sequence.
        seq_idx: int32 ``[T]``, block-table row of each token's sequence.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    seq_idx: torch.Tensor

    @staticmethod
    def from_cu_seqlens(input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                        start_positions: torch.Tensor | None = None) -> "FlatBatch":
        """Build from sequence boundaries ``cu_seqlens [B+1]`` (THD packing).

        ``start_positions [B]`` is the position of each sequence's first token
        in this batch (0 for a full sequence; the cached length for a chunk).
        """
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        b = lens.shape[0]
        seq_idx = torch.repeat_interleave(torch.arange(b, device=input_ids.device), lens)
        starts = cu_seqlens[:-1].long().repeat_interleave(lens)
        pos = torch.arange(input_ids.shape[0], device=input_ids.device) - starts
        if start_positions is not None:
            pos = pos + start_positions.long().repeat_interleave(lens)
        return FlatBatch(input_ids=input_ids, positions=pos, seq_idx=seq_idx.to(torch.int32))


class StateStore(Protocol):
    """Where attention layers keep K/V between steps.

    ``block_table`` int32 ``[B, max_blocks]`` (row = ``FlatBatch.seq_idx``),
    ``slot_mapping`` int ``[T]`` (``block*S + offset``; ``-1`` = padding), and
    per attention layer a pair of ``[N, S, G, E]`` cache views.
    """

    block_table: torch.Tensor
    slot_mapping: torch.Tensor

    def kv_cache(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """K and V cache views of a layer, or ``None`` in profiling runs."""


class PrivateKVStore:
    """The trainer's state store: a private paged cache for the packed sequences.

    Sequences get consecutive blocks; the cache is written and read with the
    same kernels and tile alignment as vLLM's, so the block size does not
    change any bit of the result (tiles are aligned at absolute positions).
    """

    def __init__(self, spec: ModelSpec, seq_lens: list[int], *, block_size: int = 64,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
        self.block_size = block_size
        nblocks = [max(1, math.ceil(n / block_size)) for n in seq_lens]
        width = max(nblocks) if nblocks else 1
        table = torch.zeros((len(seq_lens), width), dtype=torch.int32)
        start = 0
        for b, n in enumerate(nblocks):
            table[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
            start += n
        self.block_table = table.to(device)
        self._num_blocks = start
        self._caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for blk in spec.attention_blocks:
            a = blk.mixer
            shape = (start, block_size, a.num_kv_heads, a.head_dim)
            self._caches[blk.index] = (
                torch.zeros(shape, dtype=dtype or spec.dtype, device=device),
                torch.zeros(shape, dtype=dtype or spec.dtype, device=device),
            )
        self.slot_mapping = torch.empty(0, dtype=torch.int64, device=device)

    def bind(self, batch: FlatBatch) -> None:
        """Compute the slot of every token of ``batch`` in this cache."""
        rows = self.block_table[batch.seq_idx.long()].long()
        col = (batch.positions // self.block_size).long().view(-1, 1)
        self.slot_mapping = rows.gather(1, col).view(-1) * self.block_size + batch.positions % self.block_size

    def kv_cache(self, layer_index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._caches[layer_index]


def _attention(spec: AttentionSpec, layer_index: int, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor,
               batch: FlatBatch, store: StateStore, max_positions: int) -> torch.Tensor:
    t = x_TD.shape[0]
    p = spec.name
    bias = (lambda n: params[f"{p}.{n}.bias"]) if spec.bias else (lambda n: None)
    q = ops.linear(x_TD, params[f"{p}.q_proj.weight"], bias("q_proj")).view(t, spec.num_heads, spec.head_dim)
    k = ops.linear(x_TD, params[f"{p}.k_proj.weight"], bias("k_proj")).view(t, spec.num_kv_heads, spec.head_dim)
    v = ops.linear(x_TD, params[f"{p}.v_proj.weight"], bias("v_proj")).view(t, spec.num_kv_heads, spec.head_dim)
    if spec.rope is not None:
        cos, sin = ops.rope_cos_sin(max_positions, spec.rope.rotary_dim, spec.rope.theta, x_TD.device)
        q = ops.apply_rope(q, batch.positions, cos, sin)
        k = ops.apply_rope(k, batch.positions, cos, sin)
    cache = store.kv_cache(layer_index)
    if cache is None:  # profiling / dummy run: no cache bound yet
        o = torch.zeros_like(q)
    else:
        k_cache, v_cache = cache
        ops.write_kv_cache(k, v, k_cache, v_cache, store.slot_mapping)
        o = ops.paged_attention(q, k_cache, v_cache, store.block_table, batch.seq_idx, batch.positions, spec.scale)
    return ops.linear(o.reshape(t, spec.num_heads * spec.head_dim), params[f"{p}.o_proj.weight"], bias("o_proj"))


def _mlp(spec: MLPSpec, params: Mapping[str, torch.Tensor], x_TD: torch.Tensor) -> torch.Tensor:
    p = spec.name
    bias = (lambda n: params[f"{p}.{n}.bias"]) if spec.bias else (lambda n: None)
    up = ops.linear(x_TD, params[f"{p}.up_proj.weight"], bias("up_proj"))
    if spec.activation == "relu2":
        act = ops.relu2(up)
    else:
        act = ops.swiglu(ops.linear(x_TD, params[f"{p}.gate_proj.weight"], bias("gate_proj")), up)
    return ops.linear(act, params[f"{p}.down_proj.weight"], bias("down_proj"))


def forward_hidden(spec: ModelSpec, params: Mapping[str, torch.Tensor], batch: FlatBatch,
                   store: StateStore) -> torch.Tensor:
    """Embedding -> residual blocks -> final norm.

    Args:
        spec: the model.
        params: HF parameter name -> tensor (``spec.dtype``).
        batch: the flat token batch.
        store: K/V state; ``store.slot_mapping`` must match ``batch``.

    Returns:
        ``[T, D]`` final hidden states in ``spec.dtype``.
    """
    h = ops.embedding(batch.input_ids, params[spec.embedding.name + ".weight"])
    for blk in spec.blocks:
        x = ops.rms_norm(h, params[blk.norm.name + ".weight"], blk.norm.eps, out_dtype=spec.dtype)
        if isinstance(blk.mixer, AttentionSpec):
            y = _attention(blk.mixer, blk.index, params, x, batch, store, spec.max_position_embeddings)
        elif isinstance(blk.mixer, MLPSpec):
            y = _mlp(blk.mixer, params, x)
        else:  # pragma: no cover - the spec constructor refuses other mixers
            raise SpecError(f"block {blk.index}: unknown mixer {type(blk.mixer).__name__}")
        h = h + y  # one IEEE rounding of the exact sum (bf16 residual stream, as NemotronHBlock)
    return ops.rms_norm(h, params[spec.final_norm.name + ".weight"], spec.final_norm.eps, out_dtype=spec.dtype)


def logits_fp32(spec: ModelSpec, params: Mapping[str, torch.Tensor], hidden_RD: torch.Tensor) -> torch.Tensor:
    """LM head with fp32 output (no bf16 rounding of logits): ``[R, D] -> [R, V]``."""
    return ops.linear(hidden_RD, params[spec.lm_head.weight_name], out_dtype=torch.float32)


def forward_logprobs(spec: ModelSpec, params: Mapping[str, torch.Tensor], hidden_RD: torch.Tensor,
                     temperature: float = 1.0) -> torch.Tensor:
    """Full-vocabulary log-probabilities of the selected rows: fp32 ``[R, V]``."""
    return ops.logprobs(logits_fp32(spec, params, hidden_RD), temperature)
