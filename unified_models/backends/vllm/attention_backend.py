"""Our attention backend for vLLM: a metadata pass-through and the cache shape.

The backend never computes attention: our model's forward calls
:func:`unified_models.forward.forward_hidden`, whose attention layer function
(:mod:`unified_models.layers.attention`) reads and writes vLLM's paged cache
through the :class:`~unified_models.state.StateStore` (its
``state(layer_index, "attn")``: the layer's K/V pages and its KV-cache
group's block table and slot mapping).
vLLM only needs the backend to (a) say which cache shape/dtypes/block sizes it
accepts and (b) build per-step metadata, which here is a plain pass-through of
vLLM's ``CommonAttentionMetadata`` fields. ``get_impl_cls`` is never called for a
layer that implements ``AttentionLayerBase`` itself (integration manual, section 3,
route A), so it raises.

FP8 KV cache: a spec layer with ``kv_cache_dtype="fp8_e4m3"`` runs with vLLM's
``kv_cache_dtype`` ``"fp8"``/``"fp8_e4m3"`` (:func:`vllm_kv_cache_dtypes`); vLLM
allocates such pages as uint8 (both versions), which the model views as
float8_e4m3fn (:func:`.compat.split_kv_cache`) and writes/reads with the
layer's ``k_scale``/``v_scale`` through the same ops as the trainer.

Version differences (0.26 needs ``get_kv_cache_shape``) go through
:mod:`.compat`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadata,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)

from . import compat

BACKEND_NAME = "UNIFIED_MODELS"

KV_BLOCK_MULTIPLE = 16
"""Cache block sizes must be a multiple of this.

The CPU attention op walks KV in 16-position tiles inside a block
(``ops.attention.KV_TILE_CPU``); the Triton kernel looks up each position's
block on its own, so it accepts any block size. 16 satisfies both; the
engine default (64) is a multiple of every tile in use."""


FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
"""vLLM ``kv_cache_dtype`` values meaning our FP8 cache (e4m3, per-tensor scales; ``"fp8"`` is an alias)."""


def vllm_kv_cache_dtypes(kv_cache_dtype: str, model_dtype: torch.dtype) -> tuple[str, ...]:
    """The vLLM ``kv_cache_dtype`` values that agree with a spec's ``AttentionSpec.kv_cache_dtype``
    (the first is what ``engine.make_llm`` passes).

    ``"fp8_e4m3"`` -> ``("fp8_e4m3", "fp8")``; ``"auto"`` -> ``("auto", <model dtype name>)``.
    """
    if kv_cache_dtype == "fp8_e4m3":
        return ("fp8_e4m3", "fp8")
    return ("auto", str(model_dtype).removeprefix("torch."))


_STEP_LISTENERS: dict[int, Callable[[CommonAttentionMetadata], None]] = {}


def register_step_listener(vllm_config, listener: Callable[[CommonAttentionMetadata], None]) -> None:
    """Call ``listener(common_attn_metadata)`` whenever one of our metadata builders
    of this engine (``vllm_config``) builds a step, before the model's forward.

    The model needs per-step host bookkeeping (which ``compute_logits`` call samples,
    the positions of the sampling rows) that its ``forward`` cannot do under CUDA
    graphs: a replayed graph runs no Python. Builders run every step, graph or not.
    The listener is held through a weak reference (a bound method of the model).
    """
    ref = weakref.WeakMethod(listener) if hasattr(listener, "__self__") else (lambda: listener)
    _STEP_LISTENERS[id(vllm_config)] = ref  # type: ignore[assignment]


def notify_step(vllm_config, common_attn_metadata: CommonAttentionMetadata) -> None:
    """Run the listener registered for ``vllm_config`` (if any, and still alive)."""
    ref = _STEP_LISTENERS.get(id(vllm_config))
    fn = ref() if ref is not None else None  # type: ignore[operator]
    if fn is not None:
        fn(common_attn_metadata)


@dataclass
class UnifiedAttentionMetadata(AttentionMetadata):
    """One step's batch layout, shared by all our attention layers of a KV-cache group.

    vLLM builds one per group (one builder per group); ``block_table``,
    ``slot_mapping`` and ``block_size`` belong to the group, the other fields
    are the same in every group. The model turns each distinct object into
    one :class:`~unified_models.state.PagedGroup`.

    Shapes: R requests (possibly padded: padded requests have query length 0 and
    seq_len 0), T tokens (possibly padded beyond ``num_actual_tokens``).

    Attributes:
        query_start_loc: int32 ``[R+1]`` start of each request's tokens in the flat batch.
        seq_lens: int32 ``[R]`` context length including this step's tokens.
        block_table: int32 ``[R, max_blocks]`` physical blocks of each request.
        slot_mapping: int64 ``[>= num_actual_tokens]`` ``block * S + offset``; -1 = padding.
        num_actual_tokens: real tokens (the rest of the batch is padding).
        num_reqs: R.
        max_query_len: longest query of the step.
        block_size: S of the cache group.
        positions: int64 ``[num_actual_tokens]`` or ``None`` (vLLM fills it only sometimes;
            the model uses the ``positions`` argument of ``forward``).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    block_size: int
    positions: torch.Tensor | None = None


class UnifiedAttentionMetadataBuilder(AttentionMetadataBuilder[UnifiedAttentionMetadata]):
    """Pass-through builder (one per KV-cache group).

    No batch reordering (``reorder_batch_threshold = None``), so the rows of the
    batch are in the runner's ``input_batch`` order.

    CUDA graphs: ``UNIFORM_SINGLE_TOKEN_DECODE``, i.e. vLLM may capture and replay
    whole decode steps (``cudagraph_mode=FULL_DECODE_ONLY``, which
    ``engine.make_llm`` sets). The metadata holds only vLLM's persistent
    buffers (query_start_loc, seq_lens, block table, slot mapping: same data
    pointers at every replay), the model derives everything else from them on
    the device (``UnifiedForCausalLM._flat_batch``), and our kernels take their
    grid from tensor shapes only; padded requests (query length 0, slot -1)
    write nothing. Each token's bits are those of the eager kernels (the same
    kernels, launched from a graph).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    reorder_batch_threshold: int | None = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = int(kv_cache_spec.block_size)
        self.vllm_config = vllm_config

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> UnifiedAttentionMetadata:
        m = common_attn_metadata
        notify_step(self.vllm_config, m)
        return UnifiedAttentionMetadata(
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            num_actual_tokens=int(m.num_actual_tokens),
            num_reqs=int(m.num_reqs),
            max_query_len=int(m.max_query_len),
            block_size=self.block_size,
            positions=getattr(m, "positions", None),
        )


class UnifiedAttentionBackend(AttentionBackend):
    """Backend of :class:`~unified_models.backends.vllm.model.UnifiedAttentionCache` layers."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "bfloat16", "float16", "float32", *FP8_KV_CACHE_DTYPES]
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError(
            "unified_models attention layers compute attention in the model's forward; "
            "there is no AttentionImpl"
        )

    @staticmethod
    def get_builder_cls():
        return UnifiedAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list:
        # 0.32 passes the spec, 0.26 calls it without arguments (and takes any size where its
        # DeepSeek-V4 grouping gives caches their own block sizes: compat.kernel_block_multiple).
        return [MultipleOf(compat.kernel_block_multiple(KV_BLOCK_MULTIPLE))]

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        # Required (abstract) in vLLM 0.26, unused by 0.32.
        return compat.kv_cache_shape_026(num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False

    @classmethod
    def is_ssm(cls) -> bool:
        return False


class UnifiedSharedKVBackend(UnifiedAttentionBackend):
    """Backend of one-vector caches (shared K = V: vLLM's MLA specs). The same metadata;
    only vLLM 0.26's cache shape differs (``[N, 1, S, G, E]``, one vector per token)."""

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME + "_SHARED_KV"

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return compat.kv_cache_shape_026_shared(num_blocks, block_size, num_kv_heads, head_size)
