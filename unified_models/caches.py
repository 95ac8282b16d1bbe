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
  sliding window; separate K and V, or one shared K = V tensor; model dtype or
  FP8 (e4m3, static per-tensor scales).
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
        sliding_window: ``None`` = full attention; else the window in tokens
            (vLLM ``SlidingWindowSpec``; pages behind the window may be freed).
        shared_kv: one tensor holds K = V (MLA-style shared-KV attention): the
            store hands the same view as ``k_cache`` and ``v_cache``.
    """

    num_kv_heads: int
    head_dim: int
    fp8: bool = False
    sliding_window: int | None = None
    shared_kv: bool = False

    def group_key(self) -> Hashable:
        """Layers with equal keys share one KV-cache group (one block table), as vLLM
        groups layers by equal cache spec."""
        if not self.fp8 and self.sliding_window is None and not self.shared_kv:
            return "full_attention"
        return ("paged_kv", self.fp8, self.sliding_window, self.shared_kv)

    def element_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """Element type of the pages: :data:`KV_FP8_DTYPE` for an FP8 cache, else ``model_dtype``."""
        return KV_FP8_DTYPE if self.fp8 else model_dtype


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


CacheDecl = PagedKVCache | SlotStateCache
"""Any cache declaration."""
