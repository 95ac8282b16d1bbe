"""What the forward reads besides the parameters: the flat token batch and the state store.

Shapes: T tokens (flat, all sequences packed, THD), B sequences (block-table
rows), N cache blocks, S block size, G kv heads, E head dim.

State store and KV-cache groups
-------------------------------
Every sublayer that keeps state between steps declares its caches (kind and
shape, :mod:`unified_models.caches`) through its layer family, keyed by
``(layer index, cache name)``, and asks the store for **its own views** by the
same key: ``store.state(layer_index, name)``. The forward never sees a
model-wide block table. vLLM puts layers whose caches have equal specs into one
*KV-cache group* (full attention, sliding-window attention, compressed KV,
indexer keys, slot state, ...); each group has its own block table (one row per
request, row = ``FlatBatch.seq_idx``), its own slot mapping (one slot per token)
and its own block size, and all groups share one pool of pages. The store maps a
cache key to its group and returns the cache's tensors together with that
group's tables:

* a :class:`~unified_models.caches.PagedKVCache` gives an :class:`AttentionState`
  (K/V page views + the group's :class:`PagedGroup`);
* a :class:`~unified_models.caches.SlotStateCache` gives a :class:`SlotState`
  (the declaration's state object over the slots, e.g.
  :class:`~unified_models.ops.Mamba2State` with ``conv [slots, W-1, C]``,
  ``ssm [slots, H, P, N]`` fp32 and the pending chunk rows; leading dim = slot),
  ``slots_B`` int32 ``[B]`` (slot of each sequence, row = ``FlatBatch.seq_idx``;
  ``< 0`` = padding sequence) and ``start_B`` int64 ``[B]`` (tokens already
  folded into the slot = position of the sequence's first token in this batch;
  0 = fresh slot, nothing of it is read);
* ``None`` in vLLM's profiling/dummy runs (no cache bound): the layer runs
  stateless.

Both implementations (:class:`~unified_models.private_state.PrivateStateStore`,
the trainer's; and
``VllmStateStore`` in :mod:`unified_models.backends.vllm.caches`) build from the
same declarations, so a model with several groups, or a sublayer with several
caches, needs no change in :mod:`unified_models.forward` or in the layers.

vLLM: a slot-state cache gets a group of its own; ``slots_B`` is the group's
block-table column (``mamba_get_block_table_tensor``), ``start_B`` the
request's computed tokens. The trainer (``PrivateStateStore``): one slot
per packed sequence (``slots_B = arange(B)``), ``start_B`` = the sequence's
start position in the bound batch. The layer reads and writes its slot with the
same kernels on both sides; Mamba-2 builds its per-batch
:class:`~unified_models.ops.Mamba2Metadata` once per forward from the first
Mamba layer's ``slots_B``/``start_B`` (every slot-state layer of a group shares
them) and keeps it in the layer context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch



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


def entry_slots(block_table_BN: torch.Tensor, seq_idx_T: torch.Tensor, positions_T: torch.Tensor, ratio: int,
                block_size: int) -> torch.Tensor:
    """Cache slot of the compressed entry each token completes, or -1 (the
    :class:`~unified_models.caches.CompressedKVCache` rule, both stores).

    Token at position p completes entry ``j = p // r`` when ``(p + 1) % r == 0``; the
    entry lives in block ``block_table[b, j*r // S]`` at offset ``(j*r % S) // r``, so
    slot = ``block * (S // r) + offset`` in the ``[N, S // r, G, E]`` pages.

    Args:
        block_table_BN: int ``[B, max_blocks]`` of the cache's group.
        seq_idx_T, positions_T: int ``[T]`` (positions < 0: padding, -1).
        ratio: r; block_size: S (a multiple of r).

    Returns:
        int64 ``[T]``.
    """
    pos = positions_T.long()
    first = (pos // ratio) * ratio  # first token of the entry
    done = (pos >= 0) & ((pos + 1) % ratio == 0)
    col = (first.clamp(min=0) // block_size).view(-1, 1)
    blk = block_table_BN[seq_idx_T.long().clamp(min=0)].long().gather(1, col).view(-1)
    slot = blk * (block_size // ratio) + (first.clamp(min=0) % block_size) // ratio
    return torch.where(done, slot, torch.full_like(slot, -1))


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
class SlotState:
    """What one slot-state cache (:class:`~unified_models.caches.SlotStateCache`) gives its layer this step.

    Attributes:
        state: the declaration's state object over the layer's own slots (Mamba-2:
            :class:`~unified_models.ops.Mamba2State` views; leading dim = slot; any strides).
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
        uniform_decode: every sequence has at most one token this step (a decode step,
            possibly padded: vLLM's ``max_query_len <= 1``). Mamba-2 then describes the batch
            on the device with fixed shapes (``ops.mamba2_decode_metadata``), so that the step
            can be captured in a CUDA graph; the bits are those of the general description.
        host_layout: optional ``(cu_seqlens_B1, start_B)`` as host int64 numpy arrays equal to the
            two tensors, given by a caller that has them on the host (vLLM's runner), with
            ``slots_B >= 0`` exactly for the sequences with rows: the Mamba-2 metadata of a
            prefill or mixed step is then built without reading the device (no wait for the stream;
            ``ops.mamba2_metadata(host_layout=...)``).

    Every layer of one slot-state group gets the same ``slots_B``/``start_B``/
    ``cu_seqlens_B1`` objects; Mamba-2 builds the batch's
    :class:`~unified_models.ops.Mamba2Metadata` once from them.
    """

    state: Mamba2State
    slots_B: torch.Tensor
    start_B: torch.Tensor
    cu_seqlens_B1: torch.Tensor | None = None
    uniform_decode: bool = False
    host_layout: tuple | None = None


class StateStore(Protocol):
    """Where stateful sublayers keep their state between steps, per KV-cache group.

    See the module docstring for groups, cache keys and slot state.
    """

    def state(self, layer_index: int, name: str) -> AttentionState | SlotState | None:
        """The views of cache ``name`` of layer ``layer_index`` (its kind decides the
        type) with its group's tables, or ``None`` in profiling runs."""
