"""Cache declarations: what state a sublayer keeps between steps, by kind.

A layer family declares, for each of its sublayers, a dict ``cache name ->
declaration`` (:attr:`unified_models.layers.LayerFamily.caches`); the model's
caches are keyed by ``(layer index, cache name)``
(:func:`unified_models.layers.model_caches`). Both state stores build from the
same declarations: the trainer's private store (:mod:`unified_models.state`)
allocates each kind itself, and the vLLM model creates one cache module per
declaration, chosen by its kind (:mod:`unified_models.backends.vllm.caches`),
which maps it to the KV-cache spec vLLM has for it. KV-cache groups come from
:meth:`group_key` (equal keys share one block table), never from a family name.

Kinds:

* :class:`PagedKVCache`: paged K/V blocks ``[N, S, G, E]``; full attention or a
  sliding window; separate K and V, or one shared K = V tensor; model dtype, FP8
  (e4m3, static per-tensor scales) or a dtype of its own (``dtype``: DeepSeek-V4's fp32
  compressor rows). vLLM specs (both 0.26 and 0.32):
  ``FullAttentionSpec`` / ``SlidingWindowSpec``, and for shared K = V the
  one-vector ``MLAAttentionSpec`` / ``SlidingWindowMLASpec`` (what vLLM's own
  DeepSeek-V4 uses for its SWA cache).
* :class:`CompressedKVCache`: paged compressed KV, one entry per ``ratio``
  tokens (DeepSeek-V4 CSA ratio 4 / HCA ratio 128): pages ``[N, S // ratio, G, E]``,
  one vector per entry. vLLM: ``MLAAttentionSpec`` with ``tokens_per_state=ratio``
  (0.32) / ``compress_ratio=ratio`` (0.26), as vLLM's DeepSeek-V4 declares it.
* :class:`IndexerKeyCache`: paged lightning-indexer keys, one per ``ratio``
  tokens; the same layout and vLLM spec as a compressed KV cache, its own group.
* :class:`SlotStateCache`: one state *slot* per request (Mamba-2 conv/SSM
  state and pending chunk rows; a compressor's unfinished block): named
  tensors of fixed per-slot shapes.

Shapes: N cache blocks (pages), S block size, G kv heads, E head dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch

from .ops.attention import KV_FP8_DTYPE


@dataclass(frozen=True, kw_only=True)
class PagedKVCache:
    """Paged KV blocks of one attention sublayer.

    Attributes:
        num_kv_heads: G.
        head_dim: E.
        fp8: e4m3 pages with the layer's static ``k_scale``/``v_scale``; else the model dtype.
        sliding_window: ``None`` = full attention; else the window W in tokens, the
            token's own included (vLLM ``SlidingWindowSpec``: blocks wholly behind
            ``num_computed - W + 1`` are swapped for the null block; the attention op
            never reads them). The trainer's store keeps every block (same bits).
        shared_kv: one tensor holds K = V (MLA-style shared-KV attention; vLLM's
            one-vector MLA specs, half the page of separate K/V): both stores hand
            the same view as ``k_cache`` and ``v_cache``.
        dtype: element type of the pages; ``None`` = the model dtype. DeepSeek-V4's
            compressor rows caches are ``torch.float32`` (per-token kv | score rows, as
            vLLM's own DeepSeek-V4 keeps its compressor state in fp32
            ``SlidingWindowMLASpec`` pages). Not with ``fp8``.

    Raises:
        ValueError: a sliding window that is not an int >= 1, G/E < 1, a ``dtype`` that is
            not a floating torch dtype, or ``dtype`` with ``fp8``.
    """

    num_kv_heads: int
    head_dim: int
    fp8: bool = False
    sliding_window: int | None = None
    shared_kv: bool = False
    dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ValueError(f"PagedKVCache: sliding_window={w!r} must be None or an int >= 1")
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError(f"PagedKVCache: num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim} must be >= 1")
        if self.dtype is not None:
            if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
                raise ValueError(f"PagedKVCache: dtype={self.dtype!r} must be None or a floating torch dtype")
            if self.fp8:
                raise ValueError(f"PagedKVCache: dtype={self.dtype} and fp8=True are exclusive (an FP8 cache is "
                                 f"{KV_FP8_DTYPE})")

    def group_key(self) -> Hashable:
        """Layers with equal keys share one KV-cache group (one block table), as vLLM
        groups layers by equal cache spec."""
        if not self.fp8 and self.sliding_window is None and not self.shared_kv and self.dtype is None:
            return "full_attention"
        key = ("paged_kv", self.fp8, self.sliding_window, self.shared_kv)
        return key if self.dtype is None else (*key, str(self.dtype))

    def element_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """Element type of the pages: :data:`KV_FP8_DTYPE` for an FP8 cache, else ``dtype``
        or (``None``) ``model_dtype``."""
        return KV_FP8_DTYPE if self.fp8 else (self.dtype or model_dtype)

    def rows_per_block(self, block_size: int) -> int:
        """Rows of one page: one per token, ``S``."""
        return block_size


@dataclass(frozen=True, kw_only=True)
class SlotStateCache:
    """Per-request state slots of one sublayer.

    Attributes:
        layout: ``(name, per-slot shape, dtype)`` of each state tensor, in the
            order vLLM packs them into one page (fp32 first keeps every offset aligned).
        view: builds the layer's state object from ``{name: [slots, *shape] tensor}``
            (e.g. ``ops.Mamba2State(**tensors)``).
    """

    layout: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    view: Callable[..., Any]

    def group_key(self) -> Hashable:
        """Slot-state layers of one layout share one group (the trainer: one slot per sequence)."""
        return ("slot_state", self.layout)

    def allocate(self, num_slots: int, device: torch.device | str) -> Any:
        """``view`` of uninitialised ``[num_slots, *shape]`` tensors (the ops never read
        a slot before writing it)."""
        return self.view(**{name: torch.empty((num_slots, *shape), dtype=dtype, device=device)
                            for name, shape, dtype in self.layout})


@dataclass(frozen=True, kw_only=True)
class CompressedKVCache:
    """Paged compressed KV of one sublayer: entry ``j`` summarises tokens ``j*r .. j*r+r-1``.

    Entry ``j`` of a sequence lives in the block of its first token (block-table
    column ``j*r // S``) at offset ``(j*r % S) // r``: pages hold ``S // r`` entries
    (:func:`unified_models.state.entry_slots`). Written when the entry's last token
    (``(p+1) % r == 0``) is computed, from the block table (vLLM's compressed caches
    take no per-token slot mapping either).

    Attributes:
        ratio: r >= 1 tokens per entry; the cache block size S must be a multiple of it.
        num_kv_heads: G (1 for DeepSeek-V4's shared latent).
        head_dim: E (elements per entry and head).

    Raises:
        ValueError: a field < 1.
    """

    ratio: int
    head_dim: int
    num_kv_heads: int = 1

    def __post_init__(self) -> None:
        for name in ("ratio", "head_dim", "num_kv_heads"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{type(self).__name__}: {name}={v!r} must be an int >= 1")

    shared_kv = True
    """One tensor per entry (handed as both ``k_cache`` and ``v_cache``)."""

    def group_key(self) -> Hashable:
        """One group per kind, ratio and entry shape (vLLM: one per distinct spec)."""
        return (type(self).__name__, self.ratio, self.num_kv_heads, self.head_dim)

    def element_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The model dtype (no FP8 compressed cache yet)."""
        return model_dtype

    def rows_per_block(self, block_size: int) -> int:
        """Rows of one page: one per entry, ``S // r`` (:meth:`entries_per_block`)."""
        return self.entries_per_block(block_size)

    def entries_per_block(self, block_size: int) -> int:
        """``S // r``.

        Raises:
            ValueError: ``S`` is not a multiple of ``r``.
        """
        if block_size % self.ratio:
            raise ValueError(f"{type(self).__name__}: block size {block_size} is not a multiple of the "
                             f"compression ratio {self.ratio}")
        return block_size // self.ratio


@dataclass(frozen=True, kw_only=True)
class IndexerKeyCache(CompressedKVCache):
    """Paged lightning-indexer keys (one key per ``ratio`` tokens); layout as
    :class:`CompressedKVCache`, a group of its own."""


PAGED_KINDS = (PagedKVCache, CompressedKVCache)
"""Kinds allocated as pages of a block table (the rest are per-request slots)."""

CacheDecl = PagedKVCache | CompressedKVCache | SlotStateCache
"""Any cache declaration."""
