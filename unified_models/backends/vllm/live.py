"""Reaching the live objects of an in-process engine, and what it resolved.

:func:`get_runner` / :func:`get_model` return the V1 model runner and our model inside a
``vllm.LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which :func:`.engine.make_llm` pins);
:func:`engine_settings` / :func:`cuda_graphs_ran` / :func:`engine_model_class` report what
vLLM resolved (for reports and tests).
"""

from __future__ import annotations

from typing import Any

from . import compat


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


def cuda_graphs_ran(llm) -> bool:
    """True when ``llm`` captured CUDA graphs (not eager and a cudagraph mode other than NONE)."""
    st = engine_settings(llm)
    mode = str(st.get("cudagraph_mode") or "NONE").rsplit(".", 1)[-1]
    return not st.get("enforce_eager") and mode not in ("NONE", "0")


def engine_model_class(llm) -> str:
    """``module.Class`` of the model an engine really runs (CUDA-graph / compile wrappers stripped)."""
    return runner_model_class(compat.model_runner(llm))


def runner_model_class(runner) -> str:
    """``module.Class`` of the model a V1 model runner holds (wrappers stripped)."""
    m = runner.get_model()
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
    return config_settings(llm.llm_engine.vllm_config, lambda: engine_model_class(llm))


def config_settings(cfg, model_class) -> dict:
    """:func:`engine_settings` from a ``VllmConfig`` and a callable returning the model class
    (inside a worker process, where there is no ``LLM``: see :mod:`.worker_extension`)."""

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
        "kv_cache_dtype": get(cfg.cache_config, "cache_dtype"),
        "num_gpu_blocks": get(cfg.cache_config, "num_gpu_blocks"),
        "enable_chunked_prefill": get(cfg.scheduler_config, "enable_chunked_prefill", "chunked_prefill_enabled"),
        "max_num_batched_tokens": get(cfg.scheduler_config, "max_num_batched_tokens"),
        "max_num_seqs": get(cfg.scheduler_config, "max_num_seqs"),
        "async_scheduling": get(cfg.scheduler_config, "async_scheduling"),
    }
    try:
        out["model_class"] = model_class()
    except Exception as e:  # noqa: BLE001 - informative field; callers that need the class check it
        out["model_class"] = f"unknown ({type(e).__name__}: {e})"
    return out
