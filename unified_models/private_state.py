"""The trainer's state store: private caches for packed sequences, from the cache declarations.

:class:`PrivateStateStore` mirrors what vLLM allocates for the same model (see
:mod:`unified_models.state` for groups, cache keys and slot state): the
families' declarations (:func:`unified_models.layers.model_caches`) say which
caches exist; each kind of :mod:`unified_models.caches` is allocated here.

Shapes: T tokens, B packed sequences, N cache blocks, S block size, G kv heads, E head dim.
"""

from __future__ import annotations

import math
from typing import Hashable, Mapping

import torch

from .caches import PAGED_KINDS, SlotStateCache
from .dsl import ModelSpec
from .layers import model_caches
from .ops.mamba2 import start_positions
from .state import AttentionState, FlatBatch, PagedGroup, SlotState

__all__ = ["PrivateStateStore", "StateBuffers"]


def _consecutive_table(nblocks: list[int], width: int) -> torch.Tensor:
    table = torch.zeros((len(nblocks), width), dtype=torch.int32)
    start = 0
    for b, n in enumerate(nblocks):
        table[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    return table


class StateBuffers:
    """Backing storage that successive :class:`PrivateStateStore` s reuse (one per model).

    :meth:`take` returns the first ``shape[0]`` rows of a buffer kept per key, growing it
    (a fresh allocation) only when a batch needs more rows or another shape/dtype/device.
    The rows handed out hold what the previous store left there. That is bitwise safe for
    every kind the store allocates today: the paged-attention ops read only the positions
    of the batch's own sequences, each written by the same forward before it is read
    (masked positions are replaced by zeros, never multiplied: the same kernels read
    vLLM's pool, whose blocks hold other requests' old values), and the slot-state ops
    never read a slot before writing it (allocated uninitialised anyway). A view has the
    shape and strides a fresh tensor would have.

    Reuse only without autograd: a graph may save cache tensors for its backward
    (:class:`~unified_models.backends.megatron.module.UnifiedMegatronModel` passes its
    buffers only under ``torch.no_grad()``).
    """

    def __init__(self) -> None:
        self._bufs: dict[Hashable, torch.Tensor] = {}

    def take(self, key: Hashable, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
             *, zero: bool) -> torch.Tensor:
        """``[shape]`` rows of the buffer kept under ``key`` (contiguous, any old contents).

        Args:
            key: names the buffer (e.g. ``((layer, cache name), "k")``).
            shape: ``(rows, *row shape)``; rows may vary between calls.
            dtype, device: of the buffer.
            zero: a new allocation is zero-filled (else uninitialised); reused rows are never refilled.
        """
        buf = self._bufs.get(key)
        dev = torch.device(device)
        if (buf is None or buf.shape[1:] != tuple(shape[1:]) or buf.dtype != dtype or buf.device != dev
                or buf.shape[0] < shape[0]):
            buf = (torch.zeros if zero else torch.empty)(tuple(shape), dtype=dtype, device=dev)
            self._bufs[key] = buf
        return buf[: shape[0]]

    def clear(self) -> None:
        """Free every buffer."""
        self._bufs.clear()


class PrivateStateStore:
    """The trainer's state store: private caches for the packed sequences, from the
    model's cache declarations (:func:`unified_models.layers.model_caches`).

    Paged KV caches mirror vLLM's KV-cache groups (equal
    :meth:`~unified_models.caches.PagedKVCache.group_key`): one
    :class:`PagedGroup` per group, each with its own block table and block
    size; sequences get consecutive blocks. A shared K = V cache is one
    tensor handed as both ``k_cache`` and ``v_cache``; a sliding-window cache
    keeps every block (vLLM frees those behind the window, which the attention
    op never reads, so the bits are the same). The caches are written and read
    with the same kernels and tile alignment as vLLM's, so neither the block
    size nor the grouping changes any bit of the result (tiles are aligned at
    absolute positions).

    Slot-state caches get one slot per packed sequence (``slots_B = arange(B)``,
    allocated uninitialised: the ops never read a slot before writing it);
    :meth:`bind` sets ``start_B`` to each sequence's first position in the
    batch, so a store reused over a prefix and its continuation chunks
    continues each sequence's state.

    Args:
        spec: the model.
        seq_lens: length of each packed sequence (row ``b`` of every block table).
        block_size: S of every group not in ``group_block_sizes`` (a compressed cache whose ratio r
            does not divide it gets ``lcm(S, r)``: its pages hold whole entries; no bit depends on S).
        group_block_sizes: group key -> S of that group.
        device, dtype: of the caches (``dtype`` defaults to ``spec.dtype``; FP8-KV
            layers always get float8_e4m3fn caches, written and read with their scales, and
            a declaration with a ``dtype`` of its own (DeepSeek-V4's fp32 compressor rows,
            :class:`~unified_models.caches.PagedKVCache`) gets that dtype, as vLLM allocates it).
        buffers: :class:`StateBuffers` to take the caches from (reused across stores;
            no-grad use only); ``None``: fresh caches (paged KV zero-filled).
    """

    def __init__(self, spec: ModelSpec, seq_lens: list[int], *, block_size: int = 64,
                 group_block_sizes: Mapping[Hashable, int] | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                 buffers: StateBuffers | None = None):
        self.block_size = block_size
        sizes = dict(group_block_sizes or {})
        dtype = dtype or spec.dtype
        self._num_seqs = len(seq_lens)
        self._group_of: dict[tuple[int, str], Hashable] = {}
        self._groups: dict[Hashable, PagedGroup] = {}
        self._paged: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._slots: dict[tuple[int, str], object] = {}
        empty = torch.empty(0, dtype=torch.int64, device=device)
        for key, decl in model_caches(spec, dtype).items():
            if isinstance(decl, SlotStateCache):
                if buffers is None:
                    self._slots[key] = decl.allocate(len(seq_lens), device)
                else:  # decl.allocate's tensors, taken from the reused buffers
                    self._slots[key] = decl.view(**{
                        name: buffers.take((key, name), (len(seq_lens), *shape), sdtype, device, zero=False)
                        for name, shape, sdtype in decl.layout})
                continue
            if not isinstance(decl, PAGED_KINDS):
                raise TypeError(f"PrivateStateStore: cache {key} has an unknown kind {type(decl).__name__}")
            gkey = decl.group_key()
            self._group_of[key] = gkey
            s = sizes.get(gkey, block_size)
            ratio = getattr(decl, "ratio", 1)
            if gkey not in sizes and s % ratio:  # a compressed cache's page holds whole entries
                s = math.lcm(s, ratio)
            nblocks = [max(1, math.ceil(n / s)) for n in seq_lens]
            if gkey not in self._groups:
                table = _consecutive_table(nblocks, max(nblocks) if nblocks else 1)
                self._groups[gkey] = PagedGroup(table.to(device), empty, s)
            shape = (sum(nblocks), decl.rows_per_block(s), decl.num_kv_heads, decl.head_dim)
            if buffers is None:
                k = torch.zeros(shape, dtype=decl.element_dtype(dtype), device=device)
                v = k if decl.shared_kv else torch.zeros_like(k)
            else:
                k = buffers.take((key, "k"), shape, decl.element_dtype(dtype), device, zero=True)
                v = k if decl.shared_kv else buffers.take((key, "v"), shape, decl.element_dtype(dtype), device,
                                                           zero=True)
            self._paged[key] = (k, v)
        self._slot_ids = torch.arange(len(seq_lens), dtype=torch.int32, device=device)
        self._slot_start = torch.zeros(len(seq_lens), dtype=torch.int64, device=device)
        self._slot_cu: torch.Tensor | None = None

    @property
    def groups(self) -> dict[Hashable, PagedGroup]:
        """Group key -> this step's :class:`PagedGroup`."""
        return dict(self._groups)

    def bind(self, batch: FlatBatch) -> None:
        """Compute the slot of every token of ``batch`` in every group's cache, and
        (slot state) each sequence's token rows and start position.

        Raises:
            ValueError: (slot-state models) ``batch.seq_idx`` is not grouped by
                sequence in row order or names a row >= B.
        """
        if self._slots:
            self._bind_slots(batch)
        for key, g in list(self._groups.items()):
            s = g.block_size
            rows = g.block_table[batch.seq_idx.long()].long()
            col = (batch.positions // s).long().view(-1, 1)
            self._groups[key] = PagedGroup(g.block_table, rows.gather(1, col).view(-1) * s + batch.positions % s, s)

    def _bind_slots(self, batch: FlatBatch) -> None:
        b = self._num_seqs
        seq = batch.seq_idx.long()
        t = seq.shape[0]
        if t and (int(seq.min()) < 0 or int(seq.max()) >= b or bool((seq[1:] < seq[:-1]).any())):
            raise ValueError(f"PrivateStateStore.bind: seq_idx must be grouped by sequence in row order with rows "
                             f"in [0, {b}) for the slot state")
        counts = torch.bincount(seq, minlength=b) if t else torch.zeros(b, dtype=torch.int64, device=seq.device)
        cu = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        self._slot_cu = cu
        self._slot_start = start_positions(cu, batch.positions).to(torch.int64)

    def state(self, layer_index: int, name: str) -> AttentionState | SlotState | None:
        """Paged caches: the K/V views and their group's tables; slot state: the slots
        (slot b = packed sequence b) and this batch's start positions.

        Raises:
            KeyError: no cache ``name`` is declared for layer ``layer_index``.
            RuntimeError: slot state asked for before :meth:`bind`.
        """
        key = (layer_index, name)
        if key in self._paged:
            k, v = self._paged[key]
            return AttentionState(k, v, self._groups[self._group_of[key]])
        if key not in self._slots:
            raise KeyError(f"PrivateStateStore: no cache {name!r} declared for layer {layer_index}")
        if self._slot_cu is None:
            raise RuntimeError("PrivateStateStore.state: call bind(batch) first")
        return SlotState(self._slots[key], self._slot_ids, self._slot_start, self._slot_cu)
