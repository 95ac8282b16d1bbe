"""The vLLM engine's execution-contract fingerprint, from what the engine really loaded.

:func:`engine_fingerprint` reads the live :class:`~.model.UnifiedForCausalLM` inside an
in-process ``vllm.LLM`` (its spec, its parameters, their device) and the settings vLLM
resolved, and builds :func:`unified_models.consistency.fingerprint.contract_fingerprint`
with the vLLM-own components ``vllm.version`` and ``vllm.settings``.
"""

from __future__ import annotations

import os

from ...consistency.fingerprint import Fingerprint, contract_fingerprint, library_version
from . import live

__all__ = ["engine_fingerprint", "model_fingerprint"]

NUMERIC_SETTINGS = ("model_class", "dtype", "logprobs_mode", "mamba_ssm_cache_dtype")
"""``live.engine_settings`` fields that change what the rollout computes or reports."""


def engine_fingerprint(llm) -> Fingerprint:
    """The contract fingerprint of the vLLM engine ``llm`` (in process; see :func:`.live.get_model`).

    ``vllm.settings`` holds :data:`NUMERIC_SETTINGS` and the pinned model-runner variables
    (``VLLM_USE_V2_MODEL_RUNNER``, ``VLLM_USE_FLASHINFER_SAMPLER``) as the process has them.

    Raises:
        RuntimeError: the engine runs out of process or not our model class.
    """
    from .engine import PINNED_ENV

    return model_fingerprint(live.get_model(llm), live.engine_settings(llm))


def model_fingerprint(model, st: dict) -> Fingerprint:
    """The contract fingerprint of our live model ``model`` in an engine whose resolved settings
    are ``st`` (:func:`.live.config_settings`); in process or inside a worker. At rollout EP > 1
    the experts other ranks hold count with their stored dtype (the fingerprint is EP's own: equal
    at every EP, as the trainer's)."""
    from .engine import PINNED_ENV

    params = model.params()
    device = next(iter(params.values())).device
    if model.shard_plan.ep_size > 1:  # experts other EP ranks hold: their stored dtype, as at EP = 1
        from ...layers.expert_shards import with_absent_experts

        params = with_absent_experts(model.spec, params)
    settings = {k: str(st.get(k)) for k in NUMERIC_SETTINGS}
    settings.update({k: os.environ.get(k, "<unset>") for k in PINNED_ENV if k != "VLLM_ENABLE_V1_MULTIPROCESSING"})
    return contract_fingerprint("vllm", model.spec, params, device,
                                engine_components={"version": library_version("vllm"), "settings": settings})
