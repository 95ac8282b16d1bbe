"""The vLLM model class: the spec's parameters + the single forward program.

:class:`UnifiedForCausalLM` owns no math. Its ``forward`` turns vLLM's flat batch
and attention metadata into a :class:`~unified_models.state.FlatBatch` and a
:class:`VllmStateStore`, and calls :func:`~unified_models.forward.forward_hidden`;
``compute_logits`` returns :func:`~unified_models.forward.forward_logprobs`
(fp32 log-probabilities, temperature 1). The engine runs with
``logprobs_mode="raw_logits"``, so the logprobs vLLM reports are exactly these
values, gathered; sampling from log-probabilities is the same distribution as
sampling from logits.

How ``compute_logits`` rows map to requests (vLLM V1 model runner, both 0.26 and
0.32; the engine pins V1 and no speculative decoding):

* The first ``compute_logits`` call after a ``forward`` (``logits_call_index ==
  0``) is the sampling call. Row ``i`` is the hidden state of the **last
  scheduled token** of request ``runner.input_batch.req_ids[i]``
  (``logits_indices = query_start_loc[1:] - 1``, ``gpu_model_runner.py``), i.e. it
  predicts the token at position ``last_sample_positions[i] + 1``. Requests in a
  partial (chunked) prefill also get a row; vLLM discards their sample. There are
  exactly ``num_reqs`` rows (padded requests, which have query length 0, get none).
  Our builder never reorders the batch (``reorder_batch_threshold=None``).
* Further calls in the same step (``logits_call_index >= 1``) come from prompt
  logprobs (``_get_prompt_logprobs_dict``), one call per request that asked for
  them, in the order of the runner's ``num_prompt_logprobs`` dict: rows are that
  request's consecutive scheduled tokens starting at its first one.
* ``runner = unified_models.backends.vllm.engine.get_runner(llm)``; read
  ``runner.input_batch.req_ids`` inside the tap (it is valid during the step).
  Those are vLLM's internal ids: 0.26 and 0.32 append ``-<8 random chars>`` to the
  user request id (``RequestOutput.request_id``);
  ``engine.external_request_id(req_id)`` strips it.
  :class:`~unified_models.backends.vllm.engine.SampleRecorder` does all of this.

KV-cache groups. vLLM puts layers whose cache specs are equal into one group
and runs one metadata builder per group, so all layers of a group share one
:class:`UnifiedAttentionMetadata` object (their group's ``block_table``,
``slot_mapping`` and ``block_size``) while ``query_start_loc`` and
``num_actual_tokens`` are common to every group. Each step the model reads
every stateful layer's metadata from the forward context, makes one
:class:`~unified_models.state.PagedGroup` per distinct metadata object and
hands :class:`VllmStateStore` the table ``layer index -> group``; each layer
asks the store for its own views. Several groups (sliding window, compressed
KV, ...) therefore need no change here beyond their cache modules.

Mamba-2 state (hybrid models, :mod:`.mamba_state`): each Mamba layer has a
``MambaBase`` cache module (``backbone.layers.{i}.mixer.state_cache``, vLLM
``MambaSpec``: one state slot per request, pages in the same pool as the
attention blocks). vLLM puts the Mamba layers in KV-cache groups of their own
(groups hold equal numbers of layers, so a model with more Mamba than
attention layers gets several Mamba groups, each with its own block table,
hence its own slot per request). Each group's
:class:`~.mamba_state.UnifiedMambaMetadata` gives the slot and the computed
tokens of every request; ``VllmStateStore.mamba_state(layer_index)`` returns
the layer's :class:`~unified_models.ops.Mamba2State` views with its group's
slots, the computed tokens and ``query_start_loc`` as ``cu_seqlens_B1``
(:class:`~unified_models.state.MambaState`; one shared object per group, so
the layer builds its batch metadata once per group). vLLM decides "hybrid"
from class flags (``IsHybrid``, ``HasInnerState``) and then sizes pages and block sizes
from the class methods ``get_mamba_state_shape_from_config`` /
``get_mamba_state_dtype_from_config``; an attention-only model must not carry
those flags (vLLM 0.32 would then look for Mamba groups), so models with
Mamba layers are served by the subclass :class:`UnifiedHybridForCausalLM`,
registered under :func:`hybrid_architecture` of the family's name
(``engine.make_llm`` picks the right one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ...dsl import AttentionSpec, CheckpointError, ModelSpec, ParallelismError, SpecError
from ...forward import forward_hidden, forward_logprobs
from ...parameters import allocate_parameters
from ...state import AttentionState, FlatBatch, MambaState, PagedGroup
from . import compat
from .attention_backend import (KV_BLOCK_MULTIPLE, UnifiedAttentionBackend, UnifiedAttentionMetadata,
                                register_step_listener, vllm_kv_cache_dtypes)
from .mamba_state import (UnifiedMambaCache, UnifiedMambaMetadata, mamba_cache_prefix, model_state_layout,
                          state_copy_funcs)


def hybrid_architecture(architecture: str) -> str:
    """The registered name of the hybrid (Mamba) variant of a family's architecture.

    ``UnifiedNemotronHForCausalLM`` -> ``UnifiedNemotronHHybridForCausalLM`` (the
    ``ForCausalLM`` suffix keeps vLLM's runner-type inference).
    """
    from .plugin import hybrid_architecture as name

    return name(architecture)


def model_architecture(spec: ModelSpec) -> str:
    """The architecture name vLLM must load ``spec`` with: hybrid iff it has Mamba layers."""
    from .plugin import model_architecture as name

    return name(spec)


def attention_cache_prefix(block_index: int, prefix: str = "") -> str:
    """Forward-context name of block ``block_index``'s cache layer (exactly one integer)."""
    name = f"backbone.layers.{block_index}.mixer.attn"
    return f"{prefix}.{name}" if prefix else name


class UnifiedAttentionCache(nn.Module, AttentionLayerBase):
    """The paged KV cache of one attention block (integration manual, route A).

    Holds no parameters and computes nothing: vLLM binds the cache tensor to
    ``self.kv_cache`` and the model's forward reads it through :func:`kv_views`.

    FP8 KV cache (``spec.kv_cache_dtype == "fp8_e4m3"``): the engine must run
    with ``kv_cache_dtype`` ``"fp8_e4m3"``/``"fp8"`` (``engine.make_llm`` sets
    it); the pages are declared uint8 as vLLM's own layers declare them and
    viewed as float8_e4m3fn. The scales are the model's ``k_proj.k_scale`` /
    ``v_proj.v_scale`` parameters (loaded by name like every other tensor).

    Raises:
        SpecError: vLLM's ``cache_config.cache_dtype`` disagrees with the spec
            (names the layer and both settings).
    """

    def __init__(self, spec: AttentionSpec, layer_name: str, vllm_config) -> None:
        nn.Module.__init__(self)
        self.spec = spec
        self.layer_name = layer_name
        self.dtype = vllm_config.model_config.dtype
        self.kv_cache_dtype = str(vllm_config.cache_config.cache_dtype)
        allowed = vllm_kv_cache_dtypes(spec.kv_cache_dtype, self.dtype)
        if self.kv_cache_dtype not in allowed:
            raise SpecError(
                f"{spec.name}: the checkpoint declares kv_cache_dtype={spec.kv_cache_dtype!r} but vLLM runs with "
                f"kv_cache_dtype={self.kv_cache_dtype!r}; both engines must use the spec's cache "
                f"(allowed: {list(allowed)}; unified_models.backends.vllm.engine.make_llm sets it)")
        self.kv_cache: torch.Tensor = torch.tensor([])
        ctx = vllm_config.compilation_config.static_forward_context
        if layer_name in ctx:
            raise ValueError(f"duplicate attention layer name {layer_name!r} in vLLM's forward context")
        ctx[layer_name] = self

    def get_attn_backend(self) -> type[UnifiedAttentionBackend]:
        return UnifiedAttentionBackend

    def get_kv_cache_spec(self, vllm_config) -> FullAttentionSpec:
        block_size = int(vllm_config.cache_config.block_size)
        if block_size % KV_BLOCK_MULTIPLE:
            raise ValueError(
                f"unified_models: KV-cache block_size={block_size} must be a multiple of {KV_BLOCK_MULTIPLE} "
                "(the attention op's KV tile)"
            )
        fp8 = self.spec.kv_fp8
        return FullAttentionSpec(block_size=block_size, num_kv_heads=self.spec.num_kv_heads,
                                 head_size=self.spec.head_dim, dtype=torch.uint8 if fp8 else self.dtype,
                                 **compat.attention_spec_kwargs(fp8))

    def kv_views(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(k_cache, v_cache)`` ``[N, S, G, E]`` views of the bound cache, or ``None``."""
        return compat.split_kv_cache(self.kv_cache, self.spec.num_kv_heads, self.spec.head_dim)

    def forward(self) -> None:  # pragma: no cover - never called; vLLM needs an nn.Module
        return None


@dataclass(frozen=True)
class MambaSlots:
    """One step's slots of a Mamba KV-cache group (shared by the group's layers).

    Attributes:
        slots_B: int32 ``[B]``, state slot of each request row (-1: no token this step).
        start_B: int64 ``[B]``, tokens already folded into each slot.
        cu_seqlens_B1: int32 ``[B+1]``, vLLM's ``query_start_loc`` (token rows of
            each request; rows past ``cu_seqlens_B1[B]`` are padding).
    """

    slots_B: torch.Tensor
    start_B: torch.Tensor
    cu_seqlens_B1: torch.Tensor


class VllmStateStore:
    """:class:`~unified_models.state.StateStore` over vLLM's caches for one step.

    Args:
        attention: layer index -> the layer's cache module (holds the bound K/V pages).
        groups: layer index -> the :class:`PagedGroup` of the layer's KV-cache
            group this step (one shared object per group), or ``None`` in
            profiling/dummy runs (no cache bound: every accessor gives ``None``).
        mamba: layer index -> the Mamba layer's state module.
        mamba_groups: layer index -> its group's :class:`MambaSlots` this step,
            or ``None`` in profiling/dummy runs.
    """

    def __init__(self, attention: dict[int, UnifiedAttentionCache], groups: dict[int, PagedGroup] | None,
                 mamba: dict[int, UnifiedMambaCache] | None = None,
                 mamba_groups: dict[int, MambaSlots] | None = None):
        self._attention = attention
        self._groups = groups
        self._mamba = mamba or {}
        self._mamba_groups = mamba_groups

    def attention_state(self, layer_index: int) -> AttentionState | None:
        if self._groups is None:
            return None
        views = self._attention[layer_index].kv_views()
        if views is None:
            return None
        return AttentionState(views[0], views[1], self._groups[layer_index])

    def mamba_state(self, layer_index: int) -> MambaState | None:
        """The layer's ``Mamba2State`` views with its group's slot and computed tokens
        of each request row, or ``None`` in profiling/dummy runs."""
        if self._mamba_groups is None:
            return None
        views = self._mamba[layer_index].state_views()
        if views is None:
            return None
        g = self._mamba_groups[layer_index]
        return MambaState(state=views, slots_B=g.slots_B, start_B=g.start_B, cu_seqlens_B1=g.cu_seqlens_B1)


class _Node(nn.Module):
    """A plain container so parameters sit under their Hugging Face names."""


def _submodule(root: nn.Module, path: list[str]) -> nn.Module:
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = _Node()
            mod.add_module(part, child)
        mod = child
    return mod


class UnifiedForCausalLM(nn.Module):
    """vLLM model class for any :class:`ModelSpec` (registered as ``spec.architecture``).

    Attributes:
        spec: the model spec (from ``vllm_config.model_config.hf_config``).
        logprob_tap: ``None`` or a callable ``tap(rows_RV)`` called by
            :meth:`compute_logits` with a copy of the fp32 ``[R, V]`` rows it returns.
        logits_call_index: 0 during the first ``compute_logits`` after a forward
            (the sampling rows), 1, 2, ... for later calls of the same step.
        last_sample_positions: int64 ``[R]`` (CPU) position of the token whose
            hidden row is sampling row ``i`` of the last forward, recorded when
            ``logprob_tap`` is set or ``record_sample_positions`` is True.
        row_temperatures: ``None`` or a callable ``f(R) -> list[float]`` giving the
            sampling temperature of each sampling row (set by ``engine.make_llm``
            from each request's ``SamplingParams.extra_args``). The rows are then
            ``log_softmax(logits / T)`` from the logprob op, and vLLM, asked to
            sample at temperature 1, samples exactly that distribution and reports
            exactly these values (DESIGN rule 9: temperature applied the same way
            on both sides, by the same op).
    """

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        from ...models import spec_from_hf_config

        parallel = vllm_config.parallel_config
        tp = int(getattr(parallel, "tensor_parallel_size", 1))
        pp = int(getattr(parallel, "pipeline_parallel_size", 1))
        if tp != 1 or pp != 1:
            raise ParallelismError(
                f"unified_models runs with tensor_parallel_size=1 and pipeline_parallel_size=1 "
                f"(got {tp} and {pp}): cross-GPU reductions would break bitwise equality (docs/consistency.md, row 12)"
            )
        dtype = vllm_config.model_config.dtype
        self.spec: ModelSpec = spec_from_hf_config(vllm_config.model_config.hf_config, dtype=dtype)
        self.vllm_config = vllm_config
        self.prefix = prefix

        self._shapes = self.spec.parameter_shapes()
        self._dtypes = self.spec.parameter_dtypes()
        # (HF name, owning module's parameter table, leaf name): params() reads these each step
        self._param_slots: list[tuple[str, dict, str]] = []
        for name, tensor in allocate_parameters(self.spec).items():  # routed experts: views of one stack
            *path, leaf = name.split(".")
            param = nn.Parameter(tensor, requires_grad=False)
            param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
            owner = _submodule(self, path)
            owner.register_parameter(leaf, param)
            self._param_slots.append((name, owner._parameters, leaf))

        has_mamba = bool(self.spec.mamba_blocks)
        if has_mamba != bool(getattr(type(self), "is_hybrid", False)):
            want = model_architecture(self.spec)
            raise SpecError(
                f"{self.spec.family} pattern {self.spec.extra.get('pattern', '?')!r} "
                f"{'has' if has_mamba else 'has no'} Mamba-2 layers, but vLLM selected {type(self).__name__}; "
                f"load it with architecture {want!r} (hf_overrides={{'architectures': [{want!r}]}}; "
                "unified_models.backends.vllm.engine.make_llm does this)")

        self._attn: dict[int, UnifiedAttentionCache] = {}
        for blk in self.spec.attention_blocks:
            name = attention_cache_prefix(blk.index, prefix)
            layer = UnifiedAttentionCache(blk.mixer, name, vllm_config)
            local = attention_cache_prefix(blk.index)
            *path, leaf = local.split(".")
            _submodule(self, path).add_module(leaf, layer)
            self._attn[blk.index] = layer
        self._mamba: dict[int, UnifiedMambaCache] = {}
        if has_mamba:
            model_state_layout(self.spec, dtype)  # one state layout for all Mamba layers (vLLM sizes one page)
        for blk in self.spec.mamba_blocks:
            name = mamba_cache_prefix(blk.index, prefix)
            layer = UnifiedMambaCache(blk.mixer, name, vllm_config)
            *path, leaf = mamba_cache_prefix(blk.index).split(".")
            _submodule(self, path).add_module(leaf, layer)
            self._mamba[blk.index] = layer

        self.logprob_tap: Callable[[torch.Tensor], None] | None = None
        self.record_sample_positions = False
        self.last_sample_positions: torch.Tensor | None = None
        self.logits_call_index = 0
        self.row_temperatures: Callable[[int], list[float]] | None = None
        self._initial_load_done = False
        register_step_listener(vllm_config, self._begin_step)

    def _begin_step(self, m) -> None:
        """Host bookkeeping of one step, called by our metadata builders before the forward
        (:func:`.attention_backend.register_step_listener`): a CUDA-graph replay runs no
        Python of :meth:`forward`, so nothing per step may live there.

        Marks the next ``compute_logits`` call as the sampling call and, when a tap or
        ``record_sample_positions`` asks for it, records the position of each sampling
        row from vLLM's host copies (``query_start_loc_cpu``, ``seq_lens_cpu_upper_bound``,
        exact without speculative decoding; both set by 0.26's and 0.32's runners): no
        device sync.
        """
        self.logits_call_index = -1
        if self.logprob_tap is None and not self.record_sample_positions:
            return
        r = int(m.num_reqs)
        q = m.query_start_loc_cpu[: r + 1].long()
        real = q[1:] > q[:-1]  # padded requests have query length 0
        self.last_sample_positions = (m.seq_lens_cpu_upper_bound[:r].long() - 1)[real].cpu()

    # ------------------------------------------------------------------ params
    def params(self) -> dict[str, torch.Tensor]:
        """HF name -> parameter tensor (the live tensors vLLM's cache graph uses).

        Called at every step (``compute_logits`` runs outside the CUDA graph), so it reads
        each parameter from its owning module's ``_parameters`` table, recorded when the
        parameter was registered, instead of walking the module tree: a parameter
        re-registered under the same name is still seen.
        """
        return {name: table[leaf] for name, table, leaf in self._param_slots}

    # ----------------------------------------------------------------- forward
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        from ... import ops

        return ops.embedding(input_ids, self.params()[self.spec.embedding.name + ".weight"])

    def _cache_layer_names(self) -> dict[int, str]:
        """Layer index -> forward-context name of every stateful layer (attention and Mamba)."""
        names = {i: layer.layer_name for i, layer in self._attn.items()}
        names.update({i: layer.layer_name for i, layer in self._mamba.items()})
        return dict(sorted(names.items()))

    def _metadata(self) -> dict[int, UnifiedAttentionMetadata | UnifiedMambaMetadata] | None:
        """This step's metadata of every stateful layer (layer index -> its group's
        object), or ``None`` in profiling/dummy runs."""
        names = self._cache_layer_names()
        if not names:
            return None
        mds = {i: compat.layer_metadata(name) for i, name in names.items()}
        present = [i for i, md in mds.items() if md is not None]
        if not present:
            return None
        if len(present) != len(mds):
            missing = [names[i] for i in mds if mds[i] is None]
            raise RuntimeError(f"unified_models: vLLM gave no metadata for {missing} this step "
                               f"but did for {names[present[0]]}")
        return mds  # type: ignore[return-value]

    def _flat_batch(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    mds: dict[int, UnifiedAttentionMetadata | UnifiedMambaMetadata] | None
                    ) -> tuple[FlatBatch, VllmStateStore]:
        t = input_ids.shape[0]
        dev = input_ids.device
        if mds is None:  # profiling / dummy run: no cache, nothing written
            batch = FlatBatch(input_ids=input_ids, positions=positions.long(),
                              seq_idx=torch.zeros(t, dtype=torch.int32, device=dev))
            return batch, VllmStateStore(self._attn, None, self._mamba, None)
        names = self._cache_layer_names()
        md = next(iter(mds.values()))  # the step's layout is common to every group
        tok = torch.arange(t, device=dev)
        # Everything below is computed on the device from vLLM's persistent buffers, never
        # from Python ints of this step: under CUDA graphs this code runs once, at capture,
        # and replays with other batches of the same padded size. The real tokens are those
        # before the last query_start_loc entry (padded requests repeat it: query length 0).
        qsl = md.query_start_loc[: md.num_reqs + 1].to(device=dev, dtype=torch.int64)
        real = tok < qsl[-1]
        # request row of each token: the number of request ends at or before it
        seq_idx = torch.searchsorted(qsl[1:].contiguous(), tok, right=True)
        seq_idx = torch.where(real, seq_idx, torch.zeros_like(seq_idx)).to(torch.int32)
        pos = torch.where(real, positions[:t].long(), torch.zeros_like(tok))
        batch = FlatBatch(input_ids=input_ids, positions=pos, seq_idx=seq_idx)
        by_md: dict[int, PagedGroup | MambaSlots] = {}  # one object per KV-cache group (= metadata object)
        groups: dict[int, PagedGroup] = {}
        mamba_groups: dict[int, MambaSlots] = {}
        for i, g_md in mds.items():
            group = by_md.get(id(g_md))
            if group is None:
                if int(g_md.num_actual_tokens) != int(md.num_actual_tokens) or int(g_md.num_reqs) != int(md.num_reqs):
                    raise RuntimeError(
                        f"unified_models: KV-cache groups disagree on the step layout ({names[i]}: "
                        f"{int(g_md.num_reqs)} requests / {int(g_md.num_actual_tokens)} tokens, expected "
                        f"{int(md.num_reqs)} / {int(md.num_actual_tokens)})")
                if isinstance(g_md, UnifiedMambaMetadata):
                    r = int(g_md.num_reqs)
                    group = MambaSlots(slots_B=g_md.state_indices[:r].to(device=dev, dtype=torch.int32),
                                       start_B=g_md.num_computed[:r].to(device=dev, dtype=torch.int64),
                                       cu_seqlens_B1=g_md.query_start_loc[: r + 1].to(device=dev, dtype=torch.int32))
                else:
                    slot = torch.full((t,), -1, dtype=torch.int64, device=dev)
                    m_slots = min(t, int(g_md.slot_mapping.shape[0]))
                    slot[:m_slots] = g_md.slot_mapping[:m_slots].to(torch.int64)
                    slot = torch.where(real, slot, torch.full_like(slot, -1))  # padding writes nothing
                    group = PagedGroup(g_md.block_table, slot, int(g_md.block_size))
                by_md[id(g_md)] = group
            if i in self._mamba:
                if not isinstance(group, MambaSlots):
                    raise RuntimeError(f"unified_models: Mamba layer {names[i]} got {type(g_md).__name__} metadata")
                mamba_groups[i] = group
            else:
                if not isinstance(group, PagedGroup):
                    raise RuntimeError(f"unified_models: attention layer {names[i]} got {type(g_md).__name__} metadata")
                groups[i] = group
        return batch, VllmStateStore(self._attn, groups, self._mamba, mamba_groups)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        """Run the spec over vLLM's flat batch: ``[T] -> [T, D]`` final hidden states."""
        if intermediate_tensors is not None:
            raise ParallelismError("unified_models does not support pipeline parallelism")
        if inputs_embeds is not None or input_ids is None:
            raise NotImplementedError("unified_models: prompt embeddings (inputs_embeds) are not supported")
        mds = self._metadata()
        batch, store = self._flat_batch(input_ids, positions, mds)
        self.logits_call_index = -1  # also set by _begin_step (a graph replay runs no Python here)
        return forward_hidden(self.spec, self.params(), batch, store)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 ``[R, V]`` log-probabilities of the rows vLLM samples from.

        Sampling rows use each request's temperature (``row_temperatures``);
        prompt-logprob rows and requests without one use temperature 1. Each row
        depends only on its own hidden state and temperature, so computing rows
        grouped by temperature changes no bit.
        """
        temps = None
        sampling_call = self.logits_call_index == -1  # first call after forward (see module doc)
        if self.row_temperatures is not None and sampling_call:
            temps = self.row_temperatures(hidden_states.shape[0])
        if temps is None or all(t == 1.0 for t in temps):
            rows = forward_logprobs(self.spec, self.params(), hidden_states, temperature=1.0)
        else:
            rows = torch.empty((hidden_states.shape[0], self.spec.vocab_size), dtype=torch.float32,
                               device=hidden_states.device)
            for t in sorted(set(temps)):
                idx = torch.tensor([i for i, ti in enumerate(temps) if ti == t], device=hidden_states.device)
                rows[idx] = forward_logprobs(self.spec, self.params(), hidden_states[idx], temperature=t)
        self.logits_call_index += 1
        if self.logprob_tap is not None:
            self.logprob_tap(rows.clone())
        return rows

    # ------------------------------------------------------------------ weights
    @property
    def _source(self) -> str:
        return str(getattr(self.vllm_config.model_config, "model", "?"))

    def _compile_logits_kernels(self) -> None:
        """Compile (Triton JIT) every GEMM tier of the LM head (fp32 out) and of a bf16-out
        linear, and the logprob kernel, once at load (CUDA only).

        vLLM's start-up runs the forward at its largest token batch and captures the
        decode sizes, but ``compute_logits`` only at its largest sampling batch, so a
        rollout with fewer requests (another tier) would otherwise pay a compilation
        of a second or more inside a timed step. Zeros in, nothing kept: no state or
        bit changes.
        """
        from ...ops.triton.linear import linear_triton, tier_probe_rows

        params = self.params()
        w = params[self.spec.lm_head.weight_name]
        if not w.is_cuda or not w.is_floating_point():
            return
        for t in tier_probe_rows():
            h = torch.zeros((t, w.shape[1]), dtype=w.dtype, device=w.device)
            forward_logprobs(self.spec, params, h)
            linear_triton(h, w, None, w.dtype)
        torch.cuda.synchronize(w.device)
        torch.cuda.empty_cache()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``(HF name, tensor)`` pairs through each parameter's ``weight_loader``.

        The first call (vLLM's initial load) must cover every parameter; later
        calls (vLLM's ``reload_weights``, weight-transfer engines) may load a subset.

        Returns:
            The set of loaded parameter names.

        Raises:
            CheckpointError: unknown name, wrong shape, NaN/Inf values, or (first
                call) missing tensors; every offending name is listed.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        unknown: list[str] = []
        for name, tensor in weights:
            if name not in self._shapes:
                unknown.append(name)
                continue
            expected = self._shapes[name]
            if tuple(tensor.shape) != expected:
                raise CheckpointError(
                    f"checkpoint {self._source}: tensor {name} has shape {tuple(tensor.shape)}, "
                    f"the spec expects {expected}")
            want = self._dtypes[name]
            codes = (torch.uint8, torch.float8_e4m3fn)
            if (want in codes or tensor.dtype in codes) and tensor.dtype != want:
                raise CheckpointError(f"checkpoint {self._source}: tensor {name} has dtype {tensor.dtype}, "
                                      f"the spec stores {want}")
            if tensor.dtype not in codes and tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise CheckpointError(f"checkpoint {self._source}: tensor {name} holds NaN or Inf")
            param = params[name]
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor)
            loaded.add(name)
        if unknown:
            raise CheckpointError(
                f"checkpoint {self._source} has tensors the {self.spec.family} spec does not declare: "
                f"{sorted(unknown)}")
        if not self._initial_load_done:
            missing = [n for n in self._shapes if n not in loaded]
            if missing:
                raise CheckpointError(
                    f"checkpoint {self._source} is missing tensors of the {self.spec.family} spec: {missing}")
            self._initial_load_done = True
            self._compile_logits_kernels()
        if any(d != self.spec.dtype for d in self._dtypes.values()):
            from ...converters.modelopt import validate_quantized

            validate_quantized(self.params(), self.spec, source=str(self._source))
        return loaded


class UnifiedHybridForCausalLM(UnifiedForCausalLM, IsHybrid, HasInnerState):
    """:class:`UnifiedForCausalLM` for specs with Mamba-2 layers (registered as
    :func:`hybrid_architecture` of the family's name).

    Carries vLLM's hybrid flags (``IsHybrid``, ``HasInnerState``) and the class
    methods vLLM calls before the model exists: the per-slot state shapes and
    dtypes (:func:`~.mamba_state.model_state_layout`: used to raise the
    attention block size until one attention page holds one state slot, and to
    pad the state page to the attention page) and the prefix-caching copy
    functions (whole slots).
    """

    @classmethod
    def _layout(cls, vllm_config):
        from ...models import spec_from_hf_config

        dtype = vllm_config.model_config.dtype
        spec = spec_from_hf_config(vllm_config.model_config.hf_config, dtype=dtype)
        return model_state_layout(spec, dtype)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config) -> tuple[tuple[int, ...], ...]:
        return tuple(shape for _, shape, _ in cls._layout(vllm_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config) -> tuple[torch.dtype, ...]:
        return tuple(dtype for _, _, dtype in cls._layout(vllm_config))

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        return state_copy_funcs()
