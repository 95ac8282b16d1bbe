"""vLLM cache modules by cache kind, and the state store over them.

The model's caches are declared by its layer families
(:func:`unified_models.layers.model_caches`: ``(layer index, cache name) ->
declaration``); :data:`CACHE_MODULES` maps each declaration's kind to the
``nn.Module`` vLLM binds pages to (its forward-context name is
``<mixer name>.<cache name>``, exactly one integer in it, the layer index):

* :class:`~unified_models.caches.PagedKVCache` -> :class:`UnifiedAttentionCache`
  (vLLM ``FullAttentionSpec``, ``SlidingWindowSpec`` with a window, and for a
  shared K = V cache the one-vector ``MLAAttentionSpec`` /
  ``SlidingWindowMLASpec``, as vLLM's own DeepSeek-V4 declares its SWA cache;
  our attention backend's metadata, a :class:`~unified_models.state.PagedGroup`
  per KV-cache group and step);
* :class:`~unified_models.caches.CompressedKVCache` and
  :class:`~unified_models.caches.IndexerKeyCache` -> :class:`UnifiedCompressedCache`
  (vLLM ``MLAAttentionSpec`` with one entry per ``ratio`` tokens);
* :class:`~unified_models.caches.SlotStateCache` ->
  :class:`~.mamba_state.UnifiedSlotStateCache` (vLLM ``MambaSpec``, one slot per
  request; our slot-state backend's metadata, a :class:`~.mamba_state.SlotGroup`
  per group and step).

Each module class offers ``metadata_type`` (what its backend's builder gives),
``step_group(md, num_tokens, real_T)`` (the group object of one step, shared
by every layer of the group) and ``view(group)`` (what the layer function gets
from ``store.state(layer, name)``). :class:`VllmStateStore` only looks them up,
so a new kind is one module class and one table entry.

Shapes: T tokens of the step, B requests, N cache blocks, S block size, G kv
heads, E head dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.kv_cache_interface import AttentionSpec

from ...caches import CompressedKVCache, IndexerKeyCache, PagedKVCache, SlotStateCache
from ...dsl import SpecError
from ...state import AttentionState, PagedGroup, SlotState  # noqa: F401 (SlotState: store type)
from . import compat
from .attention_backend import (KV_BLOCK_MULTIPLE, UnifiedAttentionBackend, UnifiedAttentionMetadata,
                                UnifiedSharedKVBackend, vllm_kv_cache_dtypes)
from .mamba_state import UnifiedSlotStateCache


def cache_layer_name(mixer_name: str, cache_name: str, prefix: str = "") -> str:
    """Forward-context name of a sublayer's cache module: ``[prefix.]<mixer name>.<cache name>``."""
    name = f"{mixer_name}.{cache_name}"
    return f"{prefix}.{name}" if prefix else name


def _register(module: nn.Module, layer_name: str, vllm_config) -> None:
    ctx = vllm_config.compilation_config.static_forward_context
    if layer_name in ctx:
        raise ValueError(f"duplicate cache layer name {layer_name!r} in vLLM's forward context")
    ctx[layer_name] = module


class UnifiedAttentionCache(nn.Module, AttentionLayerBase):
    """The paged KV cache of one attention sublayer (integration manual, route A).

    Holds no parameters and computes nothing: vLLM binds the cache tensor to
    ``self.kv_cache`` and the model's forward reads it through :meth:`kv_views`.

    FP8 KV cache (``decl.fp8``): the engine must run with ``kv_cache_dtype``
    ``"fp8_e4m3"``/``"fp8"`` (``engine.make_llm`` sets it); the pages are declared
    uint8 as vLLM's own layers declare them and viewed as float8_e4m3fn. The
    scales are the layer's ``k_proj.k_scale`` / ``v_proj.v_scale`` parameters.

    Sliding window (``decl.sliding_window`` W): vLLM's ``SlidingWindowSpec``
    (``SlidingWindowMLASpec`` when shared); its manager swaps blocks wholly
    behind ``num_computed - W + 1`` for the null block, which the attention op
    never reads (it reads ``p-W+1..p`` only). Shared K = V (``decl.shared_kv``):
    one vector per token (the MLA specs, :class:`UnifiedSharedKVBackend`), the
    same view handed as ``k_cache`` and ``v_cache``. A declared ``decl.dtype`` (DeepSeek-V4's
    fp32 compressor rows) is the spec's dtype whatever the model dtype (vLLM allocates and
    binds the pages in it; its page-size unification scales block sizes around it).

    Raises:
        SpecError: vLLM's ``cache_config.cache_dtype`` disagrees with the
            declaration (names the layer and both settings).
    """

    metadata_type = UnifiedAttentionMetadata

    def __init__(self, decl: PagedKVCache, layer_name: str, vllm_config) -> None:
        nn.Module.__init__(self)
        self.decl = decl
        self.layer_name = layer_name
        self.dtype = vllm_config.model_config.dtype
        self.kv_cache_dtype = str(vllm_config.cache_config.cache_dtype)
        declared = "fp8_e4m3" if decl.fp8 else "auto"
        allowed = vllm_kv_cache_dtypes(declared, self.dtype)
        if self.kv_cache_dtype not in allowed:
            raise SpecError(
                f"{layer_name}: the checkpoint declares kv_cache_dtype={declared!r} but vLLM "
                f"runs with kv_cache_dtype={self.kv_cache_dtype!r}; both engines must use the spec's cache "
                f"(allowed: {list(allowed)}; unified_models.backends.vllm.engine.make_llm sets it)")
        self.kv_cache: torch.Tensor = torch.tensor([])
        _register(self, layer_name, vllm_config)

    def get_attn_backend(self) -> type[UnifiedAttentionBackend]:
        return UnifiedSharedKVBackend if self.decl.shared_kv else UnifiedAttentionBackend

    block_size: int | None = None
    """This cache's own block size (vLLM 0.26's DeepSeek-V4 grouping, :func:`plan_block_sizes`);
    ``None``: the engine's ``cache_config.block_size``."""

    def plan_info(self) -> dict:
        """What :func:`.compat.plan_kv_block_sizes` needs to know of this cache."""
        d = self.decl
        row = d.num_kv_heads * d.head_dim * (1 if d.fp8 else d.element_dtype(self.dtype).itemsize)
        kind = "sliding_mla" if d.shared_kv and d.sliding_window is not None else "other"
        return {"kind": kind, "bytes_per_row": row, "window": d.sliding_window}

    def get_kv_cache_spec(self, vllm_config) -> AttentionSpec:
        block_size = int(vllm_config.cache_config.block_size)
        if self.block_size is not None:
            block_size = self.block_size  # planned (0.26, GPU): any size, the Triton kernels take it
        elif block_size % KV_BLOCK_MULTIPLE:
            raise ValueError(
                f"unified_models: KV-cache block_size={block_size} must be a multiple of {KV_BLOCK_MULTIPLE} "
                "(the attention op's KV tile)"
            )
        d = self.decl
        return compat.attention_kv_cache_spec(block_size=block_size, num_kv_heads=d.num_kv_heads,
                                              head_size=d.head_dim,
                                              dtype=torch.uint8 if d.fp8 else d.element_dtype(self.dtype),
                                              sliding_window=d.sliding_window, one_vector=d.shared_kv, fp8=d.fp8)

    def kv_views(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(k_cache, v_cache)`` ``[N, S, G, E]`` views of the bound cache (one object twice
        for a shared K = V cache), or ``None``."""
        if self.decl.shared_kv:
            kv = compat.shared_kv_cache_view(self.kv_cache, self.decl.num_kv_heads, self.decl.head_dim)
            return None if kv is None else (kv, kv)
        return compat.split_kv_cache(self.kv_cache, self.decl.num_kv_heads, self.decl.head_dim)

    @staticmethod
    def step_group(md: UnifiedAttentionMetadata, num_tokens: int, real_T: torch.Tensor) -> PagedGroup:
        """The group's block table, block size and slot of every token (-1 for padding rows:
        nothing written). Device-side from vLLM's persistent buffers (CUDA-graph safe)."""
        dev = real_T.device
        slot = torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)
        m_slots = min(num_tokens, int(md.slot_mapping.shape[0]))
        slot[:m_slots] = md.slot_mapping[:m_slots].to(torch.int64)
        slot = torch.where(real_T, slot, torch.full_like(slot, -1))
        return PagedGroup(md.block_table, slot, int(md.block_size))

    def view(self, group: PagedGroup) -> AttentionState | None:
        """The layer's K/V views with its group's tables (``None`` before binding)."""
        views = self.kv_views()
        return None if views is None else AttentionState(views[0], views[1], group)

    def forward(self) -> None:  # pragma: no cover - never called; vLLM needs an nn.Module
        return None


class UnifiedCompressedCache(UnifiedAttentionCache):
    """A paged compressed-KV or indexer-key cache (one vector per ``decl.ratio`` tokens).

    vLLM spec: ``MLAAttentionSpec`` with ``tokens_per_state=r`` (0.32) /
    ``compress_ratio=r`` (0.26), as vLLM's DeepSeek-V4 declares its compressed KV
    and indexer keys; pages ``[N, S // r, G, E]`` (:meth:`kv_views`, one view as
    ``k_cache`` and ``v_cache``). Entries are addressed from the block table
    (:func:`unified_models.state.entry_slots`), not the per-token slot mapping.

    Raises:
        ValueError: (spec) a block size that is not a multiple of 16 and of ``r``.
    """

    def __init__(self, decl: CompressedKVCache, layer_name: str, vllm_config) -> None:
        nn.Module.__init__(self)
        self.decl = decl
        self.layer_name = layer_name
        self.dtype = vllm_config.model_config.dtype
        self.kv_cache: torch.Tensor = torch.tensor([])
        _register(self, layer_name, vllm_config)

    def get_attn_backend(self) -> type[UnifiedAttentionBackend]:
        return UnifiedSharedKVBackend

    def plan_info(self) -> dict:
        d = self.decl
        return {"kind": "compressed", "ratio": d.ratio,
                "bytes_per_row": d.num_kv_heads * d.head_dim * d.element_dtype(self.dtype).itemsize}

    def get_kv_cache_spec(self, vllm_config) -> AttentionSpec:
        block_size = int(vllm_config.cache_config.block_size)
        if block_size % KV_BLOCK_MULTIPLE or block_size % self.decl.ratio:
            raise ValueError(f"{self.layer_name}: KV-cache block_size={block_size} must be a multiple of "
                             f"{KV_BLOCK_MULTIPLE} and of the compression ratio {self.decl.ratio}")
        d = self.decl
        return compat.attention_kv_cache_spec(block_size=block_size, num_kv_heads=d.num_kv_heads, head_size=d.head_dim,
                                              dtype=self.dtype, one_vector=True, tokens_per_entry=d.ratio)

    def kv_views(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The ``[N, S // r, G, E]`` entry pages twice (one tensor), or ``None`` before binding."""
        kv = compat.shared_kv_cache_view(self.kv_cache, self.decl.num_kv_heads, self.decl.head_dim)
        return None if kv is None else (kv, kv)


CACHE_MODULES: dict[type, type[nn.Module]] = {PagedKVCache: UnifiedAttentionCache, SlotStateCache: UnifiedSlotStateCache,
                                              CompressedKVCache: UnifiedCompressedCache,
                                              IndexerKeyCache: UnifiedCompressedCache}
"""Cache declaration kind -> the vLLM cache module class that holds it."""


def plan_block_sizes(modules: list[nn.Module], vllm_config) -> dict[str, int]:
    """Give the caches their own block sizes where this vLLM's grouping needs them
    (:func:`.compat.plan_kv_block_sizes`: vLLM 0.26 with one-vector sliding and compressed caches,
    i.e. DeepSeek-V4's compressed layers); sets ``module.block_size`` and returns
    ``layer name -> block size`` (empty elsewhere: every cache keeps ``cache_config.block_size``).

    Raises:
        ValueError: no block size satisfies the grouping (names the cache).
    """
    infos = [(m.layer_name, m.plan_info() if hasattr(m, "plan_info") else {"kind": "other"}) for m in modules]
    plan = compat.plan_kv_block_sizes(infos, int(vllm_config.cache_config.block_size))
    for m in modules:
        if m.layer_name in plan:
            m.block_size = plan[m.layer_name]
    return plan


def cache_module(decl: Any, layer_name: str, vllm_config) -> nn.Module:
    """The cache module of one declaration.

    Raises:
        SpecError: a kind without a vLLM cache module (names the layer and the kind).
    """
    cls = CACHE_MODULES.get(type(decl))
    if cls is None:
        raise SpecError(f"{layer_name}: cache kind {type(decl).__name__} has no vLLM cache module "
                        f"(known: {', '.join(c.__name__ for c in CACHE_MODULES)})")
    return cls(decl, layer_name, vllm_config)


class VllmStateStore:
    """:class:`~unified_models.state.StateStore` over vLLM's caches for one step.

    Args:
        modules: ``(layer index, cache name)`` -> the cache module (holds the bound pages).
        groups: ``(layer index, cache name)`` -> this step's group object of the
            cache's KV-cache group (one shared object per group), or ``None`` in
            profiling/dummy runs (no cache bound: every lookup gives ``None``).
    """

    def __init__(self, modules: dict[tuple[int, str], nn.Module], groups: dict[tuple[int, str], Any] | None):
        self._modules = modules
        self._groups = groups

    def state(self, layer_index: int, name: str) -> AttentionState | SlotState | None:
        if self._groups is None:
            return None
        key = (layer_index, name)
        return self._modules[key].view(self._groups[key])
