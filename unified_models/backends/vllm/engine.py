"""Build a vLLM engine for our model with every numerics-relevant setting pinned.

* :func:`make_llm` -> ``vllm.LLM`` (in-process engine, V1 model runner, our model
  class through ``hf_overrides``, ``logprobs_mode="raw_logits"``, bf16, block size
  a multiple of the attention tile, no FlashInfer sampler).
* :func:`get_model` / :func:`get_runner` reach the live model and runner;
  :func:`shutdown_llm` frees an engine and vLLM's distributed state.
* :func:`load_weights_inplace` copies new weights into the existing parameters
  and resets the prefix cache.
* :class:`SampleRecorder` records, for every sampled token, the full fp32 row of
  log-probabilities our ``compute_logits`` returned and which request/position it
  belongs to.

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
* CUDA graphs (:func:`cuda_graph_settings`): on GPU, attention-only models run
  ``cudagraph_mode="FULL_DECODE_ONLY"`` with compilation mode NONE: vLLM captures
  whole decode steps of our (uncompiled) forward and replays them; prefill and
  mixed steps run eagerly. No torch.compile: Inductor would re-fuse our elementwise
  torch ops and could change their bits. Graph replay runs the same kernels as
  eager, so the bits are the same (``tests/gpu``). Hybrid models (Mamba-2 state
  group) and the CPU run eagerly.
* Chunked prefill is off by default on CPU: V1 rewinds a seeded request's
  ``torch.Generator`` after a partial prefill, which the CPU generator does not
  support ("CPU Generator does not use offset") [4, error 1]. With it off a prompt
  is never split (``max_num_batched_tokens`` must be >= ``max_model_len``, which the
  default guarantees). Our kernels give the same bits either way, so on GPU vLLM's
  default (on) is kept.
* ``kv_cache_dtype`` follows the spec (:func:`kv_cache_dtype_setting`): ``"fp8_e4m3"``
  when the checkpoint's ModelOpt config has ``kv_cache_quant_algo`` FP8 (the
  attention layers then write/read e4m3 pages with the checkpoint's
  ``k_scale``/``v_scale``, as the trainer does), else ``"auto"``; a
  conflicting user value is refused.
* Models with Mamba-2 layers load as the hybrid architecture
  (``plugin.model_architecture``: vLLM's ``IsHybrid`` flags, a second KV-cache
  group for the state); prefix caching runs in vLLM's "align" mode and needs
  chunked prefill (:func:`hybrid_engine_settings`); vLLM may raise the block
  size so that one attention page holds one state slot.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from ...dsl import CheckpointError
from ...layers import declares_slot_state
from . import compat

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


def check_spec_supported(spec) -> None:
    """Refuse specs this vLLM backend cannot serve, before vLLM starts.

    Raises:
        SpecError: the model has no attention layer. Hybrid models (Mamba-2 +
            attention) run with two KV-cache groups; a pattern without any
            attention layer would make vLLM treat the model as attention-free
            (no paged KV pool to size the state pages against), which this
            backend does not implement.
    """
    from ...dsl import SpecError

    if not _paged_kv(spec):
        raise SpecError(f"{spec.family} pattern {spec.extra.get('pattern', '?')!r} has no attention layer; "
                        "the vLLM backend needs at least one ('*'): attention-free (pure Mamba) models are "
                        "not supported")


def _paged_kv(spec) -> list:
    """The model's paged KV cache declarations (:func:`unified_models.layers.model_caches`)."""
    from ...caches import PagedKVCache
    from ...layers import model_caches

    return [d for d in model_caches(spec).values() if isinstance(d, PagedKVCache)]



def kv_cache_dtype_setting(spec, requested: str | None) -> str:
    """vLLM's ``kv_cache_dtype`` for ``spec``: ``"fp8_e4m3"`` when its attention layers declare
    an FP8 KV cache, else ``"auto"``; a ``requested`` value must agree.

    Raises:
        SpecError: attention layers declare different KV-cache dtypes.
        ValueError: ``requested`` conflicts with the spec (e.g. ``"auto"`` for a
            checkpoint with ModelOpt ``kv_cache_quant_algo`` FP8, or ``"fp8"``
            for one without): both engines must use the checkpoint's cache.
    """
    from ...dsl import SpecError
    from .attention_backend import vllm_kv_cache_dtypes

    declared = sorted({"fp8_e4m3" if decl.fp8 else "auto" for decl in _paged_kv(spec)})
    if len(declared) > 1:
        raise SpecError(f"{spec.family}: attention layers declare different KV-cache dtypes {declared}; vLLM runs "
                        "one kv_cache_dtype per engine")
    allowed = vllm_kv_cache_dtypes(declared[0] if declared else "auto", spec.dtype)
    if requested is not None and requested not in allowed:
        raise ValueError(f"make_llm: kv_cache_dtype={requested!r} conflicts with the checkpoint, whose attention "
                         f"layers declare kv_cache_dtype={declared[0] if declared else 'auto'!r}; allowed: "
                         f"{list(allowed)} (both engines must quantize the KV cache the same way)")
    return requested or allowed[0]


MAMBA_DTYPE_ARGS = {"mamba_cache_dtype": ("auto",), "mamba_ssm_cache_dtype": ("auto", "float32")}
"""vLLM engine args that would change Mamba state dtypes: the op contract fixes them
(conv / pending rows in the model dtype, SSM state and dt in fp32), so only these values are accepted."""


def hybrid_engine_settings(spec, *, gpu: bool, enable_prefix_caching: bool | None,
                           enable_chunked_prefill: bool | None, engine_kwargs: Mapping[str, Any]
                           ) -> tuple[bool, bool | None]:
    """``(enable_prefix_caching, enable_chunked_prefill)`` for ``spec``; checks hybrid-only rules.

    Attention-only models: prefix caching defaults to on (bitwise safe: KV
    tiles are aligned at absolute positions).

    Models with Mamba-2 layers: prefix caching runs in vLLM's "align" mode
    (states are cached at block boundaries; the scheduler ends prefill steps
    there and the runner copies a request's running state into each new block
    with our whole-slot copy functions). It is bitwise equal to a cold run
    because our state slot is complete at *any* position (SSM state at the
    last chunk boundary + the pending rows of the current chunk + the conv
    tail) and is only ever read at the position it was written for; the
    tests cover a shared prefix whose second request continues with fewer
    tokens than the conv width. "align" needs chunked prefill, so for these
    models prefix caching defaults to the chunked-prefill setting (GPU: on;
    CPU: off, because of the seeded-generator limitation in the module doc).

    Raises:
        ValueError: a Mamba state dtype or cache-mode setting we do not
            implement, or prefix caching with chunked prefill explicitly off.
    """
    if not declares_slot_state(spec):
        return (True if enable_prefix_caching is None else bool(enable_prefix_caching)), enable_chunked_prefill
    for name, allowed in MAMBA_DTYPE_ARGS.items():
        if name in engine_kwargs and engine_kwargs[name] not in allowed:
            raise ValueError(f"make_llm: {name}={engine_kwargs[name]!r} is not supported for unified_models' "
                             f"Mamba-2 state (the op contract fixes its dtypes; allowed: {list(allowed)})")
    mode = engine_kwargs.get("mamba_cache_mode")
    if mode not in (None, "none", "align"):
        raise ValueError(f"make_llm: mamba_cache_mode={mode!r} is not supported (prefix caching of Mamba-2 state "
                         "runs in 'align' mode; 'none' without prefix caching)")
    if enable_prefix_caching is None:
        enable_prefix_caching = (enable_chunked_prefill is not False) if gpu else bool(enable_chunked_prefill)
    if enable_prefix_caching and enable_chunked_prefill is False:
        raise ValueError(
            f"make_llm: prefix caching for a model with Mamba-2 layers (pattern {spec.extra.get('pattern', '?')!r}) "
            "runs in vLLM's 'align' mode, which needs chunked prefill; pass enable_chunked_prefill=True "
            "(on the CPU without per-request seeds) or enable_prefix_caching=False")
    if enable_prefix_caching:
        enable_chunked_prefill = True
    return bool(enable_prefix_caching), enable_chunked_prefill


def validate_checkpoint(model_dir: str | os.PathLike) -> None:
    """Check config, tensor names and shapes of a checkpoint without loading data.

    Reads only the safetensors headers, so a bad checkpoint fails in milliseconds
    with an error naming the file and tensors, before vLLM starts.

    Raises:
        CheckpointError / SpecError: unreadable config or file; missing,
            unexpected or mis-shaped tensors (all listed).
    """
    from safetensors import SafetensorError, safe_open

    from ...converters.hf_safetensors import load_hf_config, safetensors_files, validate_state_dict
    from ...models import spec_from_hf_config

    spec = spec_from_hf_config(load_hf_config(model_dir))
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
    validate_state_dict(meta, spec, source=str(model_dir), check_finite=False)


def quantization_overrides(model_dir: str | os.PathLike) -> dict[str, Any]:
    """``hf_overrides`` that keep vLLM's own quantization methods away from a ModelOpt checkpoint.

    vLLM reads ``quantization_config`` (or ``hf_quant_config.json``) and would
    swap in its ModelOpt linear/MoE methods (Marlin / CUTLASS kernels). Our
    model class runs the stored NVFP4/FP8 tensors on our kernels instead, so
    the config is moved to ``unified_models_quantization_config`` (read by
    ``models.nemotron_h``) and vLLM sees an unquantized model.
    """
    from ...models.nemotron_h import QUANT_CONFIG_ATTR

    d = Path(model_dir)
    qc = json.loads((d / "config.json").read_text()).get("quantization_config")
    if qc is None and (d / "hf_quant_config.json").is_file():
        qc = json.loads((d / "hf_quant_config.json").read_text())
    return {} if qc is None else {"quantization_config": None, QUANT_CONFIG_ATTR: qc}


def make_llm(model_dir: str | os.PathLike, *, seed: int = 0, max_model_len: int = 2048,
             max_num_seqs: int = 16, gpu: bool = False, cuda_graphs: bool | None = None,
             block_size: int = DEFAULT_BLOCK_SIZE, max_num_batched_tokens: int | None = None,
             enable_chunked_prefill: bool | None = None, enable_prefix_caching: bool | None = None,
             max_logprobs: int = 20, gpu_memory_utilization: float = 0.5,
             kv_cache_space_gib: int = 1, skip_tokenizer_init: bool = False,
             validate: bool = True, **engine_kwargs: Any):
    """A ``vllm.LLM`` running our model class on ``model_dir`` with numerics pinned.

    Args:
        model_dir: HF checkpoint directory (``config.json`` + safetensors).
        seed: engine seed (global RNG; per-request ``SamplingParams.seed`` is
            what makes sampling independent of the batch).
        max_model_len, max_num_seqs: scheduler limits.
        gpu: False = CPU build of vLLM (sets ``VLLM_CPU_KVCACHE_SPACE``).
        cuda_graphs: capture decode steps in CUDA graphs (:func:`cuda_graph_settings`);
            ``None`` = on where supported (GPU, no Mamba-2 layers).
        block_size: KV-cache block size, a multiple of 16.
        max_num_batched_tokens: default ``max(max_model_len, max_num_seqs * 128)``.
        enable_chunked_prefill: default False on CPU (see module doc), vLLM's
            default on GPU.
        enable_prefix_caching: reuse cached KV of shared prefixes (bitwise safe:
            attention tiles are aligned at absolute positions). Default: on for
            attention-only models; see :func:`hybrid_engine_settings` for
            models with Mamba-2 layers.
        max_logprobs: largest ``SamplingParams.logprobs`` allowed (-1 = whole vocab).
        gpu_memory_utilization: GPU only.
        kv_cache_space_gib: CPU only, ``VLLM_CPU_KVCACHE_SPACE``.
        skip_tokenizer_init: token-id prompts only (then pass ``detokenize=False``).
        validate: check the checkpoint's names/shapes before starting vLLM.
        **engine_kwargs: passed to ``vllm.LLM`` (may not override the pins above).

    Raises:
        CheckpointError / SpecError: bad checkpoint or config (``validate=True``).
        ValueError: a block size that is not a multiple of 16, an engine
            kwarg that would undo a pin, a ``kv_cache_dtype`` that conflicts
            with the spec's (:func:`kv_cache_dtype_setting`), or
            ``cuda_graphs=True`` where they are not supported.
    """
    from .attention_backend import KV_BLOCK_MULTIPLE

    if block_size % KV_BLOCK_MULTIPLE:
        raise ValueError(f"block_size={block_size} must be a multiple of {KV_BLOCK_MULTIPLE}")
    pinned_args = {"logprobs_mode", "hf_overrides", "dtype", "model_impl", "tensor_parallel_size",
                   "pipeline_parallel_size", "enforce_eager", "compilation_config"}
    clash = sorted(pinned_args & set(engine_kwargs))
    if clash:
        raise ValueError(f"make_llm pins {clash}; do not pass them")
    model_dir = str(Path(model_dir))
    if validate:
        validate_checkpoint(model_dir)
    spec = _spec(model_dir)
    check_spec_supported(spec)
    graph_kwargs = cuda_graph_settings(spec, gpu=gpu, cuda_graphs=cuda_graphs)
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
        hf_overrides={"architectures": [architecture], **quantization_overrides(model_dir)},
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


def cuda_graph_settings(spec, *, gpu: bool, cuda_graphs: bool | None) -> dict[str, Any]:
    """The ``vllm.LLM`` kwargs for CUDA graphs: ``enforce_eager`` and ``compilation_config``.

    With graphs: ``enforce_eager=False``, ``compilation_config={"mode": 0 (NONE),
    "cudagraph_mode": "FULL_DECODE_ONLY"}``: decode steps (every request one token) are
    captured whole for vLLM's capture sizes and replayed; other steps run eagerly.
    Without: ``enforce_eager=True``.

    Args:
        spec: the model.
        gpu: CUDA engine (vllm-cpu has no CUDA graphs).
        cuda_graphs: True / False, or None = on where supported.

    Raises:
        SpecError (a ValueError): ``cuda_graphs=True`` on the CPU or for a model with
            Mamba-2 layers (their per-step state slots are not persistent buffers a
            graph could replay).
    """
    from ...dsl import SpecError

    supported, why = True, ""
    if not gpu:
        supported, why = False, "the CPU build of vLLM has no CUDA graphs"
    elif declares_slot_state(spec):
        supported, why = False, ("models with Mamba-2 layers run eagerly (their state-slot metadata is "
                                 "rebuilt each step, not kept in persistent buffers a graph replays)")
    if cuda_graphs and not supported:
        raise SpecError(f"CUDA graphs were asked for (cuda_graphs=True / --cuda-graphs on) but {why}")
    if cuda_graphs is None:
        cuda_graphs = supported
    if not cuda_graphs:
        return {"enforce_eager": True}
    return {"enforce_eager": False, "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}


def cuda_graphs_ran(llm) -> bool:
    """True when ``llm`` captured CUDA graphs (not eager and a cudagraph mode other than NONE)."""
    st = engine_settings(llm)
    mode = str(st.get("cudagraph_mode") or "NONE").rsplit(".", 1)[-1]
    return not st.get("enforce_eager") and mode not in ("NONE", "0")


TEMPERATURE_ARG = "unified_models_temperature"
"""``SamplingParams.extra_args`` key holding a request's sampling temperature."""


def sampling_params(*, temperature: float = 1.0, **kwargs):
    """``vllm.SamplingParams`` that sample at ``temperature`` through our logprob op.

    vLLM itself samples at temperature 1 from the rows our ``compute_logits``
    returns, which are ``log_softmax(logits / temperature)``: the same
    distribution, and the reported logprob is the op's value, which the trainer
    recomputes with ``ops.logprobs(..., temperature)``.

    Raises:
        ValueError: ``temperature <= 0`` (use ``temperature=1`` with vLLM's
            greedy settings for argmax decoding), or ``kwargs`` sets vLLM's own
            ``temperature`` / ``extra_args``.
    """
    from vllm import SamplingParams

    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if "temperature" in kwargs or "extra_args" in kwargs:
        raise ValueError("sampling_params sets vLLM's temperature and extra_args itself")
    return SamplingParams(temperature=1.0, extra_args={TEMPERATURE_ARG: float(temperature)}, **kwargs)


class RowTemperatures:
    """``f(R) -> [T_i]``: the temperature of each sampling row of the current step.

    Row ``i`` belongs to ``runner.input_batch.req_ids[i]`` (see ``model.py``); its
    temperature is ``extra_args[TEMPERATURE_ARG]`` (default 1).

    Raises:
        ValueError: a request asks vLLM itself for a temperature other than 0 or
            1, which would apply a second temperature on top of our rows.
    """

    def __init__(self, runner):
        self.runner = runner
        self._by_request: dict[str, float] = {}  # vLLM request id -> temperature (ids are unique)

    def _temperature(self, rid: str) -> float:
        t = self._by_request.get(rid)
        if t is not None:
            return t
        state = self.runner.requests.get(rid)
        sp = getattr(state, "sampling_params", None)
        if sp is None:
            return 1.0  # not cached: the request's state may not exist yet
        if sp.temperature not in (0.0, 1.0):
            raise ValueError(
                f"request {rid}: vLLM temperature {sp.temperature} would be applied on top of unified_models' "
                "logprobs; build the request with unified_models.backends.vllm.engine.sampling_params"
                "(temperature=...) instead")
        t = float((sp.extra_args or {}).get(TEMPERATURE_ARG, 1.0))
        if len(self._by_request) >= 1 << 16:  # finished requests are never asked again
            self._by_request.clear()
        self._by_request[rid] = t
        return t

    def __call__(self, n: int) -> list[float]:
        return [self._temperature(rid) for rid in list(self.runner.input_batch.req_ids)[:n]]


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


def get_runner(llm) -> Any:
    """The in-process V1 model runner of ``llm`` (``runner.input_batch.req_ids`` etc.)."""
    return compat.model_runner(llm)


def get_model(llm):
    """Our live :class:`~unified_models.backends.vllm.model.UnifiedForCausalLM` inside ``llm``.

    Raises:
        RuntimeError: the engine runs out of process, or the model is not ours.
    """
    from .model import UnifiedForCausalLM

    model = compat.unwrap_model(get_runner(llm).get_model())
    if not isinstance(model, UnifiedForCausalLM):
        raise RuntimeError(f"the engine runs {type(model).__name__}, not unified_models' UnifiedForCausalLM")
    return model


def external_request_id(internal_id: str) -> str:
    """The user-visible request id of a runner request id.

    vLLM 0.26/0.32 append ``-<8 random chars>`` to each request id
    (``InputProcessor.assign_request_id``) unless
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set; ``RequestOutput.request_id``
    is the user id.
    """
    if os.environ.get("VLLM_DISABLE_REQUEST_ID_RANDOMIZATION", "0") not in ("", "0"):
        return internal_id
    return internal_id.rsplit("-", 1)[0]


def load_weights_inplace(llm, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> set[str]:
    """Copy ``state_dict`` into the engine's existing parameters, then reset the prefix cache.

    Every tensor is validated first (names, shapes, finite values), so a bad
    update changes nothing. Copies go through each parameter's ``weight_loader``
    (``param.data.copy_``): storage and ``data_ptr`` are unchanged, so anything
    holding the tensors (CUDA graphs) sees the new values. Values are cast to the
    parameter dtype by ``copy_`` (round to nearest even); pass bf16 tensors to
    avoid any rounding here.

    Args:
        llm: an engine from :func:`make_llm`.
        state_dict: HF name -> tensor (any device).
        strict: require every parameter of the spec.

    Returns:
        The set of updated names.

    Raises:
        CheckpointError: missing (strict), unexpected or mis-shaped tensors, NaN/Inf.
        RuntimeError: the prefix cache could not be reset (requests in flight).
    """
    model = get_model(llm)
    from ...converters.hf_safetensors import tensor_table_problems

    problems = tensor_table_problems(model.spec.parameter_shapes(),
                                     {n: tuple(t.shape) for n, t in state_dict.items()}, require_all=strict)
    if problems:
        raise CheckpointError("in-place weight update rejected; " + "; ".join(problems))
    dtype = model.spec.dtype
    for n, t in state_dict.items():
        if t.is_floating_point() and not bool(torch.isfinite(t.to(dtype)).all()):
            raise CheckpointError(f"in-place weight update rejected: tensor {n} holds NaN or Inf "
                                  f"(after the cast to the engine's {dtype})")
    with torch.no_grad():
        loaded = model.load_weights(state_dict.items())
    if not llm.reset_prefix_cache():
        raise RuntimeError("weights were updated but vLLM could not reset its prefix cache "
                           "(requests still running?); cached KV from the old weights may be reused")
    return loaded


class SampleRecorder:
    """Record what vLLM sampled from: one entry per sampling row of ``compute_logits``.

    Use as a context manager around ``llm.generate``. Each entry is
    ``(request_id, position, row)``: the user-visible request id, the position of
    the token whose hidden state produced the row (the sampled token sits at
    ``position + 1``), and the fp32 ``[V]`` log-probabilities when that row is
    kept (else ``None``). Rows of partial prefills are recorded too (vLLM discards
    their sample); prompt-logprob calls (``logits_call_index >= 1``) are recorded in
    ``prompt_rows`` as ``(request_ids_in_batch, rows)`` per call, without further mapping.

    Args:
        llm: an in-process engine from :func:`make_llm`.
        keep_rows: copy sampling rows to the host at all (False: positions only).
        keep_rows_of: with ``keep_rows``, a predicate on the user-visible request id,
            asked once per sampling row in row order: only rows for which it is true
            leave the device (one gather + one copy per step), the others are recorded
            with ``None``. ``None`` keeps every row. :meth:`first_requests` builds the
            common one.
    """

    def __init__(self, llm, *, keep_rows: bool = True, keep_rows_of=None):
        self.model = get_model(llm)
        self.runner = get_runner(llm)
        self.keep_rows = keep_rows
        self.keep_rows_of = keep_rows_of
        self.entries: list[tuple[str, int, torch.Tensor | None]] = []
        self.prompt_rows: list[tuple[list[str], torch.Tensor]] = []
        self._prev = None

    @staticmethod
    def first_requests(n: int):
        """A ``keep_rows_of`` predicate: the first ``n`` distinct request ids it is asked about
        (-1: all, 0: none). vLLM admits requests in submission order, so with every request
        admitted at once these are the first ``n`` submitted."""
        kept: set[str] = set()
        limit = float("inf") if n < 0 else n

        def keep(request_id: str) -> bool:
            if request_id not in kept and len(kept) < limit:
                kept.add(request_id)
            return request_id in kept

        return keep

    def __enter__(self) -> "SampleRecorder":
        self._prev = self.model.logprob_tap
        self.model.logprob_tap = self._tap
        return self

    def __exit__(self, *exc) -> None:
        self.model.logprob_tap = self._prev

    def _tap(self, rows: torch.Tensor) -> None:
        req_ids = [external_request_id(r) for r in list(self.runner.input_batch.req_ids)]
        if self.model.logits_call_index != 0:
            self.prompt_rows.append((req_ids, rows.cpu()))
            return
        pos = self.model.last_sample_positions
        n = rows.shape[0]
        if pos is None or pos.shape[0] != n or len(req_ids) < n:
            raise RuntimeError(
                f"SampleRecorder: {n} sampling rows but {len(req_ids)} requests / "
                f"{None if pos is None else pos.shape[0]} recorded positions")
        kept: list[torch.Tensor | None] = [None] * n
        if self.keep_rows and self.keep_rows_of is None:
            kept = list(rows.cpu())
        elif self.keep_rows:
            idx = [i for i in range(n) if self.keep_rows_of(req_ids[i])]
            if idx:
                host = rows[torch.tensor(idx, device=rows.device)].cpu()
                for r, i in enumerate(idx):
                    kept[i] = host[r]
        for i in range(n):
            self.entries.append((req_ids[i], int(pos[i]), kept[i]))

    def rows_for(self, request_id: str) -> dict[int, torch.Tensor]:
        """``position -> row`` of one request's kept rows (later entries win, e.g. after a recompute)."""
        return {p: r for rid, p, r in self.entries if rid == request_id and r is not None}


def generate_token_ids(llm, prompts: Iterable[list[int]], sampling_params, *, use_tqdm: bool = False):
    """``llm.generate`` on token-id prompts (``TokensPrompt``), outputs in prompt order."""
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sampling_params,
                        use_tqdm=use_tqdm)


def engine_model_class(llm) -> str:
    """``module.Class`` of the model an engine really runs (CUDA-graph / compile wrappers stripped)."""
    m = compat.model_runner(llm).get_model()
    for _ in range(4):
        if type(m).__name__.endswith("ForCausalLM"):
            break
        inner = getattr(m, "unwrap", None)
        if callable(inner):
            m = inner()
        elif hasattr(m, "runnable"):
            m = m.runnable
        else:
            break
    return f"{type(m).__module__}.{type(m).__name__}"


def engine_settings(llm) -> dict:
    """The model class and the settings vLLM resolved for ``llm`` (for reports; each field best
    effort across vLLM versions, None where a version lacks it)."""
    cfg = llm.llm_engine.vllm_config

    def get(obj, *names):
        for n in names:
            if hasattr(obj, n):
                v = getattr(obj, n)
                return v if isinstance(v, (bool, int, float, str, type(None))) else str(v)
        return None

    out = {
        "model_class": None,
        "enforce_eager": get(cfg.model_config, "enforce_eager"),
        "dtype": get(cfg.model_config, "dtype"),
        "max_model_len": get(cfg.model_config, "max_model_len"),
        "logprobs_mode": get(cfg.model_config, "logprobs_mode"),
        "compilation_mode": get(cfg.compilation_config, "mode", "level"),
        "cudagraph_mode": get(cfg.compilation_config, "cudagraph_mode"),
        "enable_prefix_caching": get(cfg.cache_config, "enable_prefix_caching"),
        "mamba_cache_mode": get(cfg.cache_config, "mamba_cache_mode"),
        "mamba_ssm_cache_dtype": get(cfg.cache_config, "mamba_ssm_cache_dtype"),
        "block_size": get(cfg.cache_config, "block_size"),
        "num_gpu_blocks": get(cfg.cache_config, "num_gpu_blocks"),
        "enable_chunked_prefill": get(cfg.scheduler_config, "enable_chunked_prefill", "chunked_prefill_enabled"),
        "max_num_batched_tokens": get(cfg.scheduler_config, "max_num_batched_tokens"),
        "max_num_seqs": get(cfg.scheduler_config, "max_num_seqs"),
    }
    try:
        out["model_class"] = engine_model_class(llm)
    except Exception as e:  # noqa: BLE001 - informative field; callers that need the class check it
        out["model_class"] = f"unknown ({type(e).__name__}: {e})"
    return out
