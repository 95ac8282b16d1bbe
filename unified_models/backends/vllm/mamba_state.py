"""Mamba-2 state as vLLM's Mamba/state KV-cache group: cache modules, backend, metadata.

vLLM allocates the state, one *slot* (page) per request, in the same page
pool as the attention KV blocks, and hands the slot of every request to a
metadata builder per step; the Mamba-2 layer function
(:mod:`unified_models.layers.mamba2`) reads and writes the slots through the
ops of :mod:`unified_models.ops.mamba2`, via
``VllmStateStore.state(layer_index, "state_cache")``
(:class:`~unified_models.state.SlotState`).

Pieces (the same protocol as vLLM's own ``MambaMixer2`` /
``Mamba2AttentionBackend``, integration manual section 8):

* :class:`UnifiedSlotStateCache`: one per slot-state cache declaration
  (:class:`~unified_models.caches.SlotStateCache`; Mamba-2: ``backbone.layers.{i}.mixer.state_cache``),
  an ``nn.Module`` + vLLM ``MambaBase``. It declares the layer's state tensors
  (the declaration's layout, :func:`unified_models.layers.mamba2.state_layout`) with
  ``get_state_shape()`` / ``get_state_dtype()``; vLLM's default
  ``MambaBase.get_kv_cache_spec`` turns them into a ``MambaSpec``
  (``mamba_type = CUSTOM``; Mamba layers form KV-cache groups of their own,
  as many as needed to keep groups of equal size, each with its own block
  table) and binds the allocated pages to
  ``self.kv_cache`` (one ``[num_blocks, *shape]`` view per state, page
  stride). :meth:`UnifiedSlotStateCache.state_views` returns them as the
  declaration's state object (an :class:`~unified_models.ops.Mamba2State`).
* :class:`UnifiedMambaBackend` + :class:`UnifiedMambaMetadataBuilder`: per
  step, per group, the slot of each request (``state_indices`` = the group's
  block-table column through vLLM's ``mamba_get_block_table_tensor``, which
  also handles prefix caching's "align" mode) and the tokens already folded
  into it (``seq_len - query_len``, derived in the forward). No batch reordering
  (vLLM's Mamba builders put decodes first; ours keeps the runner's order,
  which the model's logits-row mapping relies on); decode steps may be captured in
  CUDA graphs (persistent slot buffer, device-built decode metadata).
* :func:`state_copy_funcs`: for prefix caching in "align" mode vLLM copies a
  request's running state into a new block with one copy function per state;
  ours copy the whole slot of every state (the state is complete at any
  position: boundary SSM state + pending chunk rows + conv tail).

State layout declared to vLLM (:func:`unified_models.layers.mamba2.state_layout`): the five tensors of
``ops.Mamba2State`` for one slot, fp32 ones first so that every state's byte
offset inside the page is aligned to its element size (both versions pack the
states back to back in the order declared)::

    ssm  [H, P, N]     fp32
    dt   [Q-1, H]      fp32
    conv [W-1, C]      model dtype
    x    [Q-1, H, P]   model dtype
    B    [Q-1, G, N]   model dtype

The ``mamba_ssm_cache_dtype`` / ``mamba_cache_dtype`` settings of vLLM are not
used: the op contract fixes these dtypes (``engine.make_llm`` refuses other values).

Shapes: R requests of the step, T tokens, N state slots (vLLM blocks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from ...caches import SlotStateCache
from ...dsl import ModelSpec, SpecError
from ...layers import model_caches
from ...layers.mamba2 import STATE_ORDER
from ...state import SlotState
from . import compat
from .attention_backend import notify_step

MAMBA_BACKEND_NAME = "UNIFIED_MODELS_MAMBA2"


def model_state_layout(spec: ModelSpec, model_dtype: torch.dtype
                       ) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """The slot layout shared by every slot-state cache of ``spec`` (from the families'
    declarations, :func:`unified_models.layers.model_caches`).

    vLLM sizes the state page once per model (``get_mamba_state_shape_from_config``),
    so all slot-state caches must have the same layout.

    Raises:
        SpecError: no slot-state cache, or two with different layouts.
    """
    slots = [(key, decl) for key, decl in model_caches(spec, model_dtype).items() if isinstance(decl, SlotStateCache)]
    if not slots:
        raise SpecError(f"{spec.family} pattern {spec.extra.get('pattern', '?')!r} has no Mamba-2 layer")
    (k0, first), rest = slots[0], slots[1:]
    for key, decl in rest:
        if decl.layout != first.layout:
            raise SpecError(f"Mamba-2 layers {k0[0]} and {key[0]} have different state shapes "
                            f"({first.layout} vs {decl.layout}); vLLM sizes one state page per model")
    return first.layout


# --------------------------------------------------------------------------- metadata


@dataclass
class UnifiedMambaMetadata(AttentionMetadata):
    """One step's state slots of a Mamba KV-cache group (shared by its layers).

    Shapes: R requests (padded requests have query length 0 and slot -1).

    Attributes:
        query_start_loc: int32 ``[R+1]``, start of each request's tokens in the flat batch.
        seq_lens: int32 ``[R]``, context length including this step's tokens.
        state_indices: int32 ``[R]``, the state slot (vLLM block id) of each
            request this step; -1 for requests with no token this step. A view of
            the builder's persistent buffer (same data pointer at every step of
            ``R`` requests: what a CUDA graph replays).
        num_actual_tokens: real tokens of the step.
        num_reqs: R.
        block_size: the group's block size (``max_model_len`` without prefix
            caching; the attention block size in "align" mode).
        mamba_cache_mode: vLLM's ``cache_config.mamba_cache_mode``.
        uniform_decode: every request has at most one token (``max_query_len <= 1``).

    The tokens already folded into each slot (= position of the request's first token) are
    ``seq_lens - query lengths``, derived on the device in the forward
    (:meth:`UnifiedSlotStateCache.step_group`) from vLLM's persistent buffers.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    state_indices: torch.Tensor
    num_actual_tokens: int
    num_reqs: int
    block_size: int
    mamba_cache_mode: str = "none"
    uniform_decode: bool = False
    host_layout: tuple | None = None


def host_layout(m, r: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``(query_start_loc [R+1], tokens already in each slot [R])`` as host int64 arrays, from the
    runner's host copies (``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound``: exact without
    speculative decoding, which Mamba groups refuse; set by vLLM 0.26's and 0.32's runners), or None
    where a runner lacks them (the forward then reads the device tensors once per step)."""
    q_cpu, s_cpu = getattr(m, "query_start_loc_cpu", None), getattr(m, "seq_lens_cpu_upper_bound", None)
    if q_cpu is None or s_cpu is None or q_cpu.device.type != "cpu" or s_cpu.device.type != "cpu":
        return None
    q = q_cpu[: r + 1].numpy().astype(np.int64)
    return q, s_cpu[:r].numpy().astype(np.int64) - (q[1:] - q[:-1])


class UnifiedMambaMetadataBuilder(AttentionMetadataBuilder[UnifiedMambaMetadata]):
    """Per-step slots of one Mamba KV-cache group (one builder per group).

    ``reorder_batch_threshold = None``: the batch keeps the runner's request
    order (the model maps ``compute_logits`` rows by it).

    CUDA graphs: ``UNIFORM_SINGLE_TOKEN_DECODE`` (vLLM may capture and replay whole
    decode steps, ``cudagraph_mode=FULL_DECODE_ONLY``, as for the attention groups).
    The slots are computed here, outside any graph, and copied into a persistent
    buffer; the metadata holds that buffer and vLLM's own persistent
    ``query_start_loc`` / ``seq_lens``; the forward derives the rest on the device
    (:func:`unified_models.ops.mamba2_decode_metadata` for a decode step: no host
    read, grids fixed by the padded batch). Padded requests (query length 0) get
    slot -1 and write nothing.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: int | None = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = int(kv_cache_spec.block_size)
        self.vllm_config = vllm_config
        self.mamba_cache_mode = str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none") or "none")
        num_spec = int(getattr(kv_cache_spec, "num_speculative_blocks", 0) or 0)
        if num_spec:
            raise NotImplementedError("unified_models: speculative decoding with Mamba state is not supported")
        max_reqs = int(vllm_config.scheduler_config.max_num_seqs)
        self._slots = torch.full((max_reqs,), -1, dtype=torch.int32, device=device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False, **kwargs: Any) -> UnifiedMambaMetadata:
        m = common_attn_metadata
        notify_step(self.vllm_config, m)
        r = int(m.num_reqs)
        qsl = m.query_start_loc[: r + 1]
        seq_lens = m.seq_lens[:r]
        query_lens = qsl[1:] - qsl[:-1]
        slots = compat.mamba_state_indices(m.block_table_tensor[:r], seq_lens, self.kv_cache_spec,
                                           self.mamba_cache_mode)
        slots = torch.where(query_lens > 0, slots.to(torch.int32), torch.full_like(slots, -1, dtype=torch.int32))
        if r <= self._slots.shape[0]:
            self._slots[:r].copy_(slots)
            slots = self._slots[:r]
        return UnifiedMambaMetadata(
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            state_indices=slots,
            num_actual_tokens=int(m.num_actual_tokens),
            num_reqs=r,
            block_size=self.block_size,
            mamba_cache_mode=self.mamba_cache_mode,
            uniform_decode=int(m.max_query_len) <= 1,
            host_layout=host_layout(m, r),
        )


class UnifiedMambaBackend(AttentionBackend):
    """Backend of :class:`UnifiedSlotStateCache` layers: metadata only, never an impl."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return MAMBA_BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("unified_models Mamba-2 layers compute in the model's forward; there is no impl")

    @staticmethod
    def get_builder_cls():
        return UnifiedMambaMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        return [MultipleOf(1)]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        # Abstract in vLLM 0.26 and only asked for attention specs there (the
        # runner views a MambaSpec page per state from get_state_shape()); a
        # blocks-first answer keeps any layout probe (block dim 0) a no-op.
        return (num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def is_ssm(cls) -> bool:
        return True

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False


# --------------------------------------------------------------------------- cache module


@dataclass(frozen=True)
class SlotGroup:
    """One step's slots of a slot-state KV-cache group (shared by the group's layers).

    Attributes:
        slots_B: int32 ``[B]``, state slot of each request row (-1: no token this step).
        start_B: int64 ``[B]``, tokens already folded into each slot.
        cu_seqlens_B1: int32 ``[B+1]``, vLLM's ``query_start_loc`` (token rows of
            each request; rows past ``cu_seqlens_B1[B]`` are padding).
        uniform_decode: every request has at most one token this step.
        host_layout: host copies of ``cu_seqlens_B1`` and ``start_B`` (:func:`host_layout`) or None.
    """

    slots_B: torch.Tensor
    start_B: torch.Tensor
    cu_seqlens_B1: torch.Tensor
    uniform_decode: bool = False
    host_layout: tuple | None = None


class UnifiedSlotStateCache(nn.Module, MambaBase):
    """The state slots of one slot-state cache (vLLM ``MambaBase``; no parameters, no compute).

    Built from a :class:`~unified_models.caches.SlotStateCache` declaration: its
    ``layout`` is what vLLM allocates per slot, its ``view`` what the layer gets.
    vLLM binds the pages to ``self.kv_cache`` (0.26: a list of per-state views set
    by the runner; 0.32: ``MambaBase.bind_kv_cache`` slices the raw page into the
    same views); :meth:`state_views` names them.
    """

    metadata_type = UnifiedMambaMetadata

    def __init__(self, decl: SlotStateCache, layer_name: str, vllm_config) -> None:
        nn.Module.__init__(self)
        self.decl = decl
        self.layer_name = layer_name
        self.layout = decl.layout
        self.kv_cache = ()  # type: ignore[assignment]
        ctx = vllm_config.compilation_config.static_forward_context
        if layer_name in ctx:
            raise ValueError(f"duplicate cache layer name {layer_name!r} in vLLM's forward context")
        ctx[layer_name] = self

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return tuple(shape for _, shape, _ in self.layout)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return tuple(dtype for _, _, dtype in self.layout)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.CUSTOM

    def get_attn_backend(self) -> type[UnifiedMambaBackend]:
        return UnifiedMambaBackend

    def get_kv_cache_spec(self, vllm_config):
        spec = super().get_kv_cache_spec(vllm_config)
        page = getattr(spec, "page_size_bytes", None)
        if page is not None and page % 4:
            raise ValueError(f"unified_models: Mamba state page of {page} bytes is not a multiple of 4; "
                             "the fp32 states could not be viewed at aligned offsets")
        return spec

    def state_views(self) -> Any:
        """The bound pages as the declaration's state object (Mamba-2: ``ops.Mamba2State`` of
        ``[N, ...]`` views sharing vLLM's storage), or ``None`` before binding (profiling)."""
        views = compat.mamba_state_tensors(self.kv_cache, self.layout)
        if views is None:
            return None
        return self.decl.view(**views)

    @staticmethod
    def step_group(md: UnifiedMambaMetadata, num_tokens: int, real_T: torch.Tensor) -> SlotGroup:
        """The group's slot and computed tokens of every request row, and ``query_start_loc``
        (device ops on the metadata's persistent buffers: captured in a CUDA graph, they
        replay with the step's values)."""
        dev, r = real_T.device, int(md.num_reqs)
        cu = md.query_start_loc[: r + 1].to(device=dev, dtype=torch.int32)
        start = md.seq_lens[:r].to(device=dev, dtype=torch.int64) - (cu[1:] - cu[:-1]).to(torch.int64)
        return SlotGroup(slots_B=md.state_indices[:r].to(device=dev, dtype=torch.int32), start_B=start,
                         cu_seqlens_B1=cu, uniform_decode=bool(md.uniform_decode), host_layout=md.host_layout)

    def view(self, group: SlotGroup) -> SlotState | None:
        """The layer's slot state with its group's slots (``None`` before binding)."""
        state = self.state_views()
        if state is None:
            return None
        return SlotState(state=state, slots_B=group.slots_B, start_B=group.start_B, cu_seqlens_B1=group.cu_seqlens_B1,
                         uniform_decode=group.uniform_decode, host_layout=group.host_layout)

    def forward(self) -> None:  # pragma: no cover - never called; vLLM needs an nn.Module
        return None


# --------------------------------------------------------------------------- prefix caching


def _copy_whole_slot(state: torch.Tensor, block_ids: list[int], cur_block_idx: int, num_accepted_tokens: int):
    """vLLM ``MambaStateCopyFunc``: copy the whole slot ``block_ids[cur_block_idx]`` of one state.

    Our slot is complete at every position (SSM state at the last chunk
    boundary, the pending rows of the current chunk, the conv tail), so the
    copy is always the entire per-slot tensor (contiguous inside its page).
    """
    if num_accepted_tokens != 1:
        raise NotImplementedError("unified_models: speculative decoding with Mamba state is not supported")
    src = state[block_ids[cur_block_idx]]
    return compat.mamba_copy_spec(src.data_ptr(), src.numel())


def state_copy_funcs() -> tuple:
    """One copy function per state of :data:`STATE_ORDER` (vLLM ``get_mamba_state_copy_func``)."""
    return tuple(_copy_whole_slot for _ in STATE_ORDER)
