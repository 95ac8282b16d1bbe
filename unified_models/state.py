"""What the forward reads besides the parameters: the flat token batch and the state store.

Shapes: T tokens (flat, all sequences packed, THD), B sequences (block-table
rows), N cache blocks, S block size, G kv heads, E head dim.

State store and KV-cache groups
-------------------------------
Every layer that keeps state between steps asks the store for **its own
views, by layer index**; the forward never sees a model-wide block table.
vLLM puts layers whose caches have equal specs into one *KV-cache group*
(full attention, sliding-window attention, compressed KV, indexer keys, Mamba
state, ...); each group has its own block table (one row per request, row =
``FlatBatch.seq_idx``), its own slot mapping (one slot per token) and its own
block size, and all groups share one pool of pages. The store maps a layer
index to its group and returns the layer's cache tensors together with that
group's tables:

* ``store.attention_state(layer_index) -> AttentionState | None`` for paged
  attention layers (``None`` in vLLM's profiling/dummy runs: no cache bound).

Both implementations (:class:`PrivateKVStore` here, the trainer's; and
``VllmStateStore`` in :mod:`unified_models.backends.vllm.model`) hold a table
``layer index -> group`` and one :class:`PagedGroup` per group, so a model
with several groups needs no change in :mod:`unified_models.forward` or in
the layers. Attention models have one group (full attention); hybrids add the Mamba group.

Mamba-2 state group (issue 7): a Mamba layer keeps per *request* state
slots, not per-token blocks:

* ``store.mamba_state(layer_index) -> MambaState | None`` with the layer's
  :class:`~unified_models.ops.Mamba2State` views (``conv [slots, W-1, C]``,
  ``ssm [slots, H, P, N]`` fp32, the pending chunk rows ``x``/``dt``/``B``;
  leading dim = slot), ``slots_B`` int32 ``[B]`` (slot of each sequence, row
  = ``FlatBatch.seq_idx``; ``< 0`` = padding sequence) and ``start_B`` int64
  ``[B]`` (tokens already folded into the slot = position of the sequence's
  first token in this batch; 0 = fresh slot, nothing of it is read).
  ``None`` = profiling run: the layer runs stateless.

vLLM: the Mamba cache module gets its own group; ``slots_B`` is the group's
block-table column (``mamba_get_block_table_tensor``), ``start_B`` the
request's computed tokens. The trainer (:class:`PrivateKVStore`): one slot per
packed sequence (``slots_B = arange(B)``), ``start_B`` = the sequence's start
position in the bound batch. The Mamba layer function reads and writes its
slot with the same kernels on both sides; the per-batch
:class:`~unified_models.ops.Mamba2Metadata` is built once per forward from the
first Mamba layer's ``slots_B``/``start_B`` (every Mamba layer of a model
shares them) and kept in the layer context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Mapping, Protocol

import torch

from .dsl import AttentionSpec, Mamba2Spec, ModelSpec
from .ops.mamba2 import Mamba2State, start_positions


@dataclass(frozen=True)
class FlatBatch:
    """Tokens of several sequences packed into one row.

    Attributes:
        input_ids: int ``[T]``.
        positions: int ``[T]``, position of each token inside its own sequence.
        seq_idx: int32 ``[T]``, block-table row of each token's sequence (the
            same row in every KV-cache group).
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


@dataclass(frozen=True)
class PagedGroup:
    """One paged KV-cache group for one step, shared by every layer of the group.

    Attributes:
        block_table: int32 ``[B, max_blocks]`` physical blocks of each sequence.
        slot_mapping: int64 ``[T]`` ``block * S + offset`` of each token; -1 = padding.
        block_size: S.
    """

    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int


@dataclass(frozen=True)
class AttentionState:
    """What one paged attention layer reads and writes this step.

    Attributes:
        k_cache, v_cache: the layer's own ``[N, S, G, E]`` cache views.
        group: its KV-cache group's tables.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    group: PagedGroup

    @property
    def block_table(self) -> torch.Tensor:
        """int32 ``[B, max_blocks]`` of the layer's group."""
        return self.group.block_table

    @property
    def slot_mapping(self) -> torch.Tensor:
        """int64 ``[T]`` of the layer's group (-1 = padding)."""
        return self.group.slot_mapping


@dataclass(frozen=True)
class MambaState:
    """What one Mamba-2 layer reads and writes this step.

    Attributes:
        state: the layer's own :class:`~unified_models.ops.Mamba2State` views
            (leading dim = slot; any strides).
        slots_B: int32 ``[B]``, the state slot of each sequence (row ``b`` =
            ``FlatBatch.seq_idx == b``); ``< 0`` = padding sequence (nothing
            read or written, zero output).
        start_B: int64 ``[B]``, tokens already folded into the slot before this
            batch = position of the sequence's first token in this batch
            (0 = fresh slot; nothing of the slot is read).
        cu_seqlens_B1: optional int ``[B+1]``, token rows of each sequence
            (vLLM's ``query_start_loc``); rows past ``cu_seqlens_B1[B]`` are
            padding. ``None``: derived from ``FlatBatch.seq_idx`` (each
            sequence's tokens contiguous, in row order, no padding rows), as
            the trainer packs.

    Every Mamba layer of one step gets the same ``slots_B``/``start_B``/
    ``cu_seqlens_B1`` objects (one group); the forward builds the batch's
    :class:`~unified_models.ops.Mamba2Metadata` once from them.
    """

    state: Mamba2State
    slots_B: torch.Tensor
    start_B: torch.Tensor
    cu_seqlens_B1: torch.Tensor | None = None


class StateStore(Protocol):
    """Where stateful layers keep their state between steps, per KV-cache group.

    Each stateful layer family has one accessor taking the layer index; the
    store resolves the layer's group. See the module docstring for groups and
    for how Mamba state slots plug in.
    """

    def attention_state(self, layer_index: int) -> AttentionState | None:
        """K/V cache views of attention layer ``layer_index`` and its group's
        block table and slot mapping, or ``None`` in profiling runs."""

    def mamba_state(self, layer_index: int) -> MambaState | None:
        """State slots of Mamba-2 layer ``layer_index`` with its group's slot of
        each sequence and tokens already in each slot, or ``None`` in profiling
        runs (the layer then runs stateless over whole sequences from 0)."""


def attention_group_key(spec: AttentionSpec) -> Hashable:
    """The KV-cache group of an attention layer: layers with equal keys share one.

    Mirrors vLLM's grouping by equal cache spec. Every :class:`AttentionSpec`
    today is full attention (one ``FullAttentionSpec``), hence one group per
    cache dtype (a model-dtype and an FP8 cache have different specs);
    sliding-window or compressed caches will return their own keys.
    """
    return "full_attention" if not spec.kv_fp8 else ("full_attention", spec.kv_cache_dtype)


def attention_cache_dtype(spec: AttentionSpec, model_dtype: torch.dtype) -> torch.dtype:
    """Element type of the layer's K/V cache: float8_e4m3fn for an FP8 cache, else ``model_dtype``."""
    from .ops.attention import KV_FP8_DTYPE

    return KV_FP8_DTYPE if spec.kv_fp8 else model_dtype


class PrivateKVStore:
    """The trainer's state store: private paged caches for the packed sequences.

    Mirrors vLLM's KV-cache groups (:func:`attention_group_key`): one
    :class:`PagedGroup` per group, each with its own block table and block
    size; sequences get consecutive blocks. The caches are written and read
    with the same kernels and tile alignment as vLLM's, so neither the block
    size nor the grouping changes any bit of the result (tiles are aligned at
    absolute positions).

    Mamba-2 layers get one :class:`~unified_models.ops.Mamba2State` slot per
    packed sequence (``slots_B = arange(B)``, allocated uninitialised: the ops
    never read a slot before writing it); :meth:`bind` sets ``start_B`` to
    each sequence's first position in the batch, so a store reused over a
    prefix and its continuation chunks continues each sequence's state.

    Args:
        spec: the model.
        seq_lens: length of each packed sequence (row ``b`` of every block table).
        block_size: S of every group not in ``group_block_sizes``.
        group_block_sizes: group key -> S of that group.
        device, dtype: of the caches (``dtype`` defaults to ``spec.dtype``; FP8-KV
            layers always get float8_e4m3fn caches, written and read with their scales).
    """

    def __init__(self, spec: ModelSpec, seq_lens: list[int], *, block_size: int = 64,
                 group_block_sizes: Mapping[Hashable, int] | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
        self.block_size = block_size
        sizes = dict(group_block_sizes or {})
        self._group_of: dict[int, Hashable] = {}
        self._groups: dict[Hashable, PagedGroup] = {}
        self._caches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        empty = torch.empty(0, dtype=torch.int64, device=device)
        self._num_seqs = len(seq_lens)
        self._mamba: dict[int, Mamba2State] = {}
        for blk in spec.blocks_of(Mamba2Spec):
            self._mamba[blk.index] = Mamba2State.allocate(
                len(seq_lens), **blk.mixer.state_kwargs(), dtype=dtype or spec.dtype, device=device)
        self._mamba_slots = torch.arange(len(seq_lens), dtype=torch.int32, device=device)
        self._mamba_start = torch.zeros(len(seq_lens), dtype=torch.int64, device=device)
        self._mamba_cu: torch.Tensor | None = None
        for blk in spec.blocks_of(AttentionSpec):
            a = blk.mixer
            key = attention_group_key(a)
            self._group_of[blk.index] = key
            s = sizes.get(key, block_size)
            nblocks = [max(1, math.ceil(n / s)) for n in seq_lens]
            if key not in self._groups:
                table = self._consecutive_table(nblocks, max(nblocks) if nblocks else 1)
                self._groups[key] = PagedGroup(table.to(device), empty, s)
            shape = (sum(nblocks), s, a.num_kv_heads, a.head_dim)
            cache_dtype = attention_cache_dtype(a, dtype or spec.dtype)
            self._caches[blk.index] = (
                torch.zeros(shape, dtype=cache_dtype, device=device),
                torch.zeros(shape, dtype=cache_dtype, device=device),
            )

    @staticmethod
    def _consecutive_table(nblocks: list[int], width: int) -> torch.Tensor:
        table = torch.zeros((len(nblocks), width), dtype=torch.int32)
        start = 0
        for b, n in enumerate(nblocks):
            table[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
            start += n
        return table

    @property
    def groups(self) -> dict[Hashable, PagedGroup]:
        """Group key -> this step's :class:`PagedGroup`."""
        return dict(self._groups)

    def bind(self, batch: FlatBatch) -> None:
        """Compute the slot of every token of ``batch`` in every group's cache, and
        (Mamba) each sequence's token rows and start position.

        Raises:
            ValueError: (hybrid models) ``batch.seq_idx`` is not grouped by
                sequence in row order or names a row >= B.
        """
        if self._mamba:
            self._bind_mamba(batch)
        for key, g in list(self._groups.items()):
            s = g.block_size
            rows = g.block_table[batch.seq_idx.long()].long()
            col = (batch.positions // s).long().view(-1, 1)
            self._groups[key] = PagedGroup(g.block_table, rows.gather(1, col).view(-1) * s + batch.positions % s, s)

    def _bind_mamba(self, batch: FlatBatch) -> None:
        b = self._num_seqs
        seq = batch.seq_idx.long()
        t = seq.shape[0]
        if t and (int(seq.min()) < 0 or int(seq.max()) >= b or bool((seq[1:] < seq[:-1]).any())):
            raise ValueError(f"PrivateKVStore.bind: seq_idx must be grouped by sequence in row order with rows "
                             f"in [0, {b}) for the Mamba state")
        counts = torch.bincount(seq, minlength=b) if t else torch.zeros(b, dtype=torch.int64, device=seq.device)
        cu = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        self._mamba_cu = cu
        self._mamba_start = start_positions(cu, batch.positions).to(torch.int64)

    def attention_state(self, layer_index: int) -> AttentionState | None:
        k, v = self._caches[layer_index]
        return AttentionState(k, v, self._groups[self._group_of[layer_index]])

    def mamba_state(self, layer_index: int) -> MambaState | None:
        """The layer's state slots (slot b = packed sequence b) and this batch's start positions."""
        if self._mamba_cu is None:
            raise RuntimeError("PrivateKVStore.mamba_state: call bind(batch) first")
        return MambaState(self._mamba[layer_index], self._mamba_slots, self._mamba_start, self._mamba_cu)
