"""Build a vLLM engine for our model with every numerics-relevant setting pinned.

* :func:`make_llm` -> ``vllm.LLM`` (in-process engine, V1 model runner, our model
  class through ``hf_overrides``, ``logprobs_mode="raw_logits"``, bf16, block size
  a multiple of the attention tile, no FlashInfer sampler).
* :func:`shutdown_llm` frees an engine and vLLM's distributed state.
* :func:`load_weights_inplace` copies new weights into the existing parameters
  and resets the prefix cache.

The settings a spec decides (KV-cache dtype, hybrid prefix caching, CUDA graphs) are in
:mod:`.settings`; sampling and recording what was sampled in :mod:`.sampling`; reaching
the live model and runner (:func:`.live.get_model`, :func:`.live.get_runner`) in :mod:`.live`.

Why each pin (integration manual sections in brackets):

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine core in this process, so the model
  object is reachable and both engines can be compared in one process [1, 6].
* ``VLLM_USE_V2_MODEL_RUNNER=0``: 0.26 and 0.32 pick the runner differently, and V1
  vs V2 differ in logprob kernels and RNG [5, 7]. Our row mapping assumes V1.
* ``logprobs_mode="raw_logits"``: vLLM returns ``compute_logits`` output (our fp32
  log-probabilities) gathered, with no re-derivation [5]; prompt logprobs too.
* ``VLLM_USE_FLASHINFER_SAMPLER=0``: keep the PyTorch sampling path [7].
* ``VLLM_CPU_KVCACHE_SPACE=1`` (CPU): 1 GiB of KV cache; start in seconds [7].
* ``dtype`` = the spec's dtype (the checkpoint config's; bf16 by default), so
  the trainer, built from the same spec, computes in the same dtype; ``block_size`` multiple of 16, ``model_impl="vllm"`` (no
  silent Transformers fallback).
* CUDA graphs (:func:`.settings.cuda_graph_settings`): decode steps on GPU, no
  torch.compile; the CPU and rollout expert parallelism (EP > 1) run eagerly.
* Rollout data / expert parallelism (:func:`.settings.data_parallel_settings`):
  ``data_parallel_size`` > 1 only under ``torchrun`` (one DP rank per process, vLLM's
  ``external_launcher``); ``enable_expert_parallel`` shards the routed experts over the DP
  ranks (EP = DP) and our MoE layers exchange tokens over vLLM's EP group.
* Chunked prefill is off by default on CPU: V1 rewinds a seeded request's
  ``torch.Generator`` after a partial prefill, which the CPU generator does not
  support ("CPU Generator does not use offset") [4, error 1]. With it off a prompt
  is never split (``max_num_batched_tokens`` must be >= ``max_model_len``, which the
  default guarantees). Our kernels give the same bits either way, so on GPU vLLM's
  default (on) is kept.
* ``kv_cache_dtype`` follows the spec (:func:`.settings.kv_cache_dtype_setting`).
* Models with Mamba-2 layers load as the hybrid architecture
  (``plugin.model_architecture``: vLLM's ``IsHybrid`` flags, a second KV-cache
  group for the state); prefix caching runs in vLLM's "align" mode and needs
  chunked prefill (:func:`.settings.hybrid_engine_settings`); vLLM may raise the block
  size so that one attention page holds one state slot.
"""

from __future__ import annotations

import functools
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from ...dsl import CheckpointError
from . import compat
from .live import get_model, get_runner
from .sampling import RowTemperatures
from .settings import (check_spec_supported, cuda_graph_settings, data_parallel_settings, hybrid_engine_settings,
                       kv_cache_dtype_setting)

DEFAULT_BLOCK_SIZE = 64
"""KV-cache block size: a multiple of the CPU KV tile (16) and the GPU tile (64)."""

PINNED_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
}


def _spec(model_dir: str | os.PathLike):
    from ...converters.hf_safetensors import load_hf_config
    from ...models import spec_from_hf_config

    return spec_from_hf_config(load_hf_config(model_dir))


def validate_checkpoint(model_dir: str | os.PathLike, spec=None) -> None:
    """Check config, tensor names and shapes of a checkpoint without loading data.

    Reads only the safetensors headers, so a bad checkpoint fails in milliseconds
    with an error naming the file and tensors, before vLLM starts. A checkpoint in a
    family's other layout (DeepSeek's published DeepSeek-V4 layout) is checked under the
    canonical names its tensors load as (:func:`~unified_models.converters.hf_safetensors.tensor_layout`,
    the layout module's ``official_names_to_canonical``: the names the loader gives them; an
    MXFP4 routed expert's ``.scale`` is told by the spec declaring ``<linear>.weight_scale``).

    Args:
        model_dir: HF checkpoint directory.
        spec: the checkpoint's spec when the caller has built it (default: built from
            ``model_dir``'s config).

    Raises:
        CheckpointError / SpecError: unreadable config or file; a config and tensor names in
            different layouts; missing, unexpected or mis-shaped tensors (all listed, under
            their canonical names).
    """
    from safetensors import SafetensorError, safe_open

    from ...converters.hf_safetensors import safetensors_files, tensor_layout, validate_state_dict

    spec = spec if spec is not None else _spec(model_dir)
    meta: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        try:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    if name in meta:
                        raise CheckpointError(f"{f} repeats tensor {name}")
                    meta[name] = torch.empty(h.get_slice(name).get_shape(), device="meta")
        except (SafetensorError, OSError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
    layout = tensor_layout(model_dir, meta)
    if layout is not None:
        expected = spec.parameter_shapes()
        names = layout.official_names_to_canonical(meta, lambda lin: f"{lin}{layout.MXFP4_SCALE}" in expected)
        meta = {names[n]: t for n, t in meta.items()}
    validate_state_dict(meta, spec, source=str(model_dir), check_finite=False)


def quantization_overrides(model_dir: str | os.PathLike) -> dict[str, Any]:
    """``hf_overrides`` that keep vLLM's own quantization methods away from a ModelOpt checkpoint.

    vLLM reads ``quantization_config`` (or ``hf_quant_config.json``) and would
    swap in its ModelOpt linear/MoE methods (Marlin / CUTLASS kernels). Our
    model class runs the stored NVFP4/FP8 tensors on our kernels instead, so
    the config is moved to ``unified_models_quantization_config`` (read by
    ``models.nemotron_h``) and vLLM sees an unquantized model.
    """
    from ...models.modelopt_config import QUANT_CONFIG_ATTR

    d = Path(model_dir)
    qc = json.loads((d / "config.json").read_text()).get("quantization_config")
    if qc is None and (d / "hf_quant_config.json").is_file():
        qc = json.loads((d / "hf_quant_config.json").read_text())
    return {} if qc is None else {"quantization_config": None, QUANT_CONFIG_ATTR: qc}


def engine_hf_overrides(overrides: dict[str, Any], hf_config):
    """``make_llm``'s ``hf_overrides`` (bound with :func:`functools.partial`: picklable): set
    ``overrides`` (architecture, :func:`quantization_overrides`) on vLLM's config, then hand vLLM
    :func:`.config_classes.transformers_config` of it. For a DeepSeek-V4 checkpoint in DeepSeek's
    published layout that is transformers' config of the same model, so vLLM derives the same engine
    settings from either layout (from its own pass-through class it would treat the model as MLA:
    on the CPU that forces prefix caching and chunked prefill off and replaces the token budget);
    any other config comes back as it is, the overrides set."""
    from .config_classes import transformers_config

    for k, v in overrides.items():
        setattr(hf_config, k, v)
    return transformers_config(hf_config)


def default_block_size(spec) -> int:
    """The engine's KV-cache block size for ``spec``: :data:`DEFAULT_BLOCK_SIZE`, raised to the
    least common multiple with every compression ratio of its compressed caches (a page holds whole
    entries: DeepSeek-V4's HCA ratio 128 gives 128). Addressing only: no bit depends on it."""
    from ...layers import model_caches

    s = DEFAULT_BLOCK_SIZE
    for decl in model_caches(spec, spec.dtype).values():
        s = math.lcm(s, int(getattr(decl, "ratio", 1)))
    return s


def make_llm(model_dir: str | os.PathLike, *, seed: int = 0, max_model_len: int = 2048,
             max_num_seqs: int = 16, gpu: bool = False, cuda_graphs: bool | None = None,
             block_size: int | None = None, max_num_batched_tokens: int | None = None,
             enable_chunked_prefill: bool | None = None, enable_prefix_caching: bool | None = None,
             max_logprobs: int = 20, gpu_memory_utilization: float = 0.5,
             kv_cache_space_gib: int = 1, skip_tokenizer_init: bool = False,
             validate: bool = True, spec=None, data_parallel_size: int = 1, enable_expert_parallel: bool = False,
             **engine_kwargs: Any):
    """A ``vllm.LLM`` running our model class on ``model_dir`` with numerics pinned.

    Args:
        model_dir: HF checkpoint directory (``config.json`` + safetensors).
        seed: engine seed (global RNG; per-request ``SamplingParams.seed`` is
            what makes sampling independent of the batch).
        max_model_len, max_num_seqs: scheduler limits.
        gpu: False = CPU build of vLLM (sets ``VLLM_CPU_KVCACHE_SPACE``).
        cuda_graphs: capture decode steps in CUDA graphs (:func:`.settings.cuda_graph_settings`);
            ``None`` = on where supported (GPU, rollout EP = 1; hybrids included).
        block_size: KV-cache block size, a multiple of 16 (and of every compression ratio of the
            spec's compressed caches); ``None``: :func:`default_block_size`.
        max_num_batched_tokens: default ``max(max_model_len, max_num_seqs * 128)``.
        enable_chunked_prefill: default False on CPU (see module doc), vLLM's
            default on GPU.
        enable_prefix_caching: reuse cached KV of shared prefixes (bitwise safe:
            attention tiles are aligned at absolute positions). Default: on for
            attention-only models; see :func:`.settings.hybrid_engine_settings` for
            models with Mamba-2 layers.
        max_logprobs: largest ``SamplingParams.logprobs`` allowed (-1 = whole vocab).
        gpu_memory_utilization: GPU only.
        kv_cache_space_gib: CPU only, ``VLLM_CPU_KVCACHE_SPACE``.
        skip_tokenizer_init: token-id prompts only (then pass ``detokenize=False``).
        validate: check the checkpoint's names/shapes before starting vLLM.
        spec: the checkpoint's :class:`~unified_models.dsl.ModelSpec` when the caller has
            built it (``spec_and_state_dict``); default: built here from ``model_dir``'s
            config. vLLM's model class builds its own from vLLM's copy of the config
            (:func:`.model.spec_of_config`, once per process per config).
        data_parallel_size: rollout DP ranks (vLLM's name). > 1: call this in every process of
            ``torchrun --nproc-per-node data_parallel_size`` (``WORLD_SIZE`` must equal it); each
            process is one DP rank (vLLM's ``distributed_executor_backend="external_launcher"``,
            set here) with its own requests, and every rank must call ``generate`` as often as the
            others (vLLM runs dummy batches on a rank whose requests are done, so the ranks' MoE
            collectives pair up).
        enable_expert_parallel: (vLLM's name) shard the routed experts over the DP ranks:
            EP = ``data_parallel_size``; rank ``r`` holds experts ``[r E / EP, (r + 1) E / EP)`` of
            every MoE layer and the tokens travel to them by all-to-all (data only, bitwise EP = 1's
            logprobs). Refused at ``data_parallel_size=1`` (EP would be 1). Turns CUDA graphs off.
        **engine_kwargs: passed to ``vllm.LLM`` (may not override the pins above;
            ``distributed_executor_backend`` only as ``"external_launcher"`` with DP > 1).

    Raises:
        CheckpointError / SpecError: bad checkpoint or config (``validate=True``).
        ValueError: a block size that is not a multiple of 16, an engine
            kwarg that would undo a pin, a ``speculative_config``, a ``kv_cache_dtype`` that conflicts
            with the spec's (:func:`.settings.kv_cache_dtype_setting`), or
            ``cuda_graphs=True`` where they are not supported (CPU, rollout EP > 1).
        ParallelismError (a ValueError): ``data_parallel_size`` > 1 not under ``torchrun`` with
            ``WORLD_SIZE == data_parallel_size``; ``enable_expert_parallel`` at DP = 1; an EP that
            does not divide a MoE layer's routed-expert count (the numbers named);
            :func:`.settings.data_parallel_settings`. Tensor parallelism stays pinned to 1.
    """
    from .attention_backend import KV_BLOCK_MULTIPLE

    if block_size is not None and block_size % KV_BLOCK_MULTIPLE:
        raise ValueError(f"block_size={block_size} must be a multiple of {KV_BLOCK_MULTIPLE}")
    pinned_args = {"logprobs_mode", "hf_overrides", "dtype", "model_impl", "tensor_parallel_size",
                   "pipeline_parallel_size", "enforce_eager", "compilation_config"}
    clash = sorted(pinned_args & set(engine_kwargs))
    if clash:
        raise ValueError(f"make_llm pins {clash}; do not pass them")
    if engine_kwargs.get("speculative_config"):
        raise ValueError("make_llm: speculative decoding (speculative_config) is not supported: the trainer "
                         "recomputes the sampled tokens' logprobs with the main model only, and a draft model "
                         "(DeepSeek-V4's MTP layer included, whose weights load but are never run) would "
                         "change which tokens are sampled by a computation the trainer does not repeat")
    model_dir = str(Path(model_dir))
    spec = spec if spec is not None else _spec(model_dir)
    if validate:
        validate_checkpoint(model_dir, spec)
    check_spec_supported(spec)
    if block_size is None:
        block_size = default_block_size(spec)
    executor = engine_kwargs.pop("distributed_executor_backend", None)
    dp_kwargs = data_parallel_settings(spec, data_parallel_size=data_parallel_size,
                                       enable_expert_parallel=enable_expert_parallel)
    if executor is not None and executor != dp_kwargs.get("distributed_executor_backend"):
        raise ValueError(f"make_llm: distributed_executor_backend={executor!r}: the engine runs in this process "
                         "(data_parallel_size=1) or as one torchrun DP rank ('external_launcher', set by "
                         "data_parallel_size > 1); do not pass another")
    ep = data_parallel_size if enable_expert_parallel else 1
    graph_kwargs = cuda_graph_settings(spec, gpu=gpu, cuda_graphs=cuda_graphs, expert_parallel_size=ep)
    kv_cache_dtype = kv_cache_dtype_setting(spec, engine_kwargs.pop("kv_cache_dtype", None))
    enable_prefix_caching, enable_chunked_prefill = hybrid_engine_settings(
        spec, gpu=gpu, enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill, engine_kwargs=engine_kwargs)

    for k, v in PINNED_ENV.items():
        os.environ[k] = v
    if not gpu:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(kv_cache_space_gib))
    compat.reset_envs_cache()

    from . import plugin

    plugin.register()
    architecture = plugin.model_architecture(spec)

    if max_num_batched_tokens is None:
        # on GPU at least 8192: a hybrid's attention block grows until one page holds a Mamba
        # state slot (6784 tokens at the Nano-30B widths with an FP8 KV cache), and vLLM's
        # prefix caching (align mode) needs block_size <= max_num_batched_tokens
        max_num_batched_tokens = max(max_model_len, max_num_seqs * 128, 8192 if gpu else 0)
    if enable_chunked_prefill is None and not gpu:
        enable_chunked_prefill = False
    kwargs: dict[str, Any] = dict(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=skip_tokenizer_init,
        trust_remote_code=False,
        hf_overrides=functools.partial(engine_hf_overrides,
                                       {"architectures": [architecture], **quantization_overrides(model_dir)}),
        model_impl="vllm",
        # The spec decides the dtype (from the checkpoint config), and the trainer
        # builds from the same spec: both engines always compute in one dtype.
        dtype=str(spec.dtype).removeprefix("torch."),
        seed=seed,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        **graph_kwargs,
        enable_prefix_caching=enable_prefix_caching,
        logprobs_mode="raw_logits",
        max_logprobs=max_logprobs,
        tensor_parallel_size=1,
        pipeline_parallel_size=1,
        kv_cache_dtype=kv_cache_dtype,
        **dp_kwargs,
    )
    if enable_chunked_prefill is not None:
        kwargs["enable_chunked_prefill"] = enable_chunked_prefill
    if gpu:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    kwargs.update(engine_kwargs)

    from vllm import LLM

    llm = LLM(**kwargs)
    get_model(llm).row_temperatures = RowTemperatures(get_runner(llm))
    return llm


def shutdown_llm(llm) -> None:
    """Stop an in-process engine and free what it holds in this process.

    Shuts the engine core down (its executor, KV cache, model), then tears down
    vLLM's distributed state (``cleanup_dist_env_and_memory``), so that another
    engine, or code that initialises ``torch.distributed`` itself (Megatron), can
    start afterwards in the same process. Call it only when no other vLLM engine is
    alive in this process. The caller should drop its reference to ``llm`` after.
    """
    import gc

    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    gc.collect()
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def load_weights_inplace(llm, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> set[str]:
    """Copy ``state_dict`` into the engine's existing parameters, then reset the prefix cache.

    Every tensor is validated once before anything is written (names and shapes, then
    NaN/Inf after its one cast to the parameter's dtype and device: one host sync for all
    tensors, :meth:`~.model.UnifiedForCausalLM.prepare_weights`), so a bad update changes
    nothing. Copies go through each parameter's ``weight_loader``
    (``param.data.copy_``): storage and ``data_ptr`` are unchanged, so anything
    holding the tensors (CUDA graphs) sees the new values. The cast rounds to nearest
    even; pass tensors of the parameters' dtypes to avoid any rounding here.

    Args:
        llm: an engine from :func:`make_llm`.
        state_dict: HF name -> tensor (any device). At rollout EP > 1 (``enable_expert_parallel``):
            a full HF state dict (the experts other ranks hold are shape-checked and skipped) or
            only this rank's experts (a trainer at the same EP layout holds exactly those).
        strict: require every parameter this engine holds (the spec's, less the experts other
            expert-parallel ranks hold).

    Returns:
        The set of updated names (held here).

    Raises:
        CheckpointError: missing (strict), unexpected or mis-shaped tensors, NaN/Inf.
        RuntimeError: the prefix cache could not be reset (requests in flight).
    """
    model = get_model(llm)
    problems = model.weight_table_problems(model.held_shapes(), {n: tuple(t.shape) for n, t in state_dict.items()},
                                           require_all=strict)
    if problems:
        raise CheckpointError("in-place weight update rejected; " + "; ".join(problems))
    prepared, _ = model.prepare_weights(state_dict.items())
    loaded = model.copy_weights(prepared)
    reset_prefix_cache(llm)
    return loaded


def reset_prefix_cache(llm) -> None:
    """Drop every cached KV block of ``llm`` (after its weights changed).

    Raises:
        RuntimeError: vLLM refused (requests still running): cached KV from the old
            weights could be reused.
    """
    if not llm.reset_prefix_cache():
        raise RuntimeError("weights were updated but vLLM could not reset its prefix cache "
                           "(requests still running?); cached KV from the old weights may be reused")
