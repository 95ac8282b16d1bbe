"""vLLM plugin entry point (``vllm.general_plugins`` -> ``register``).

vLLM calls :func:`register` in every process it starts (engine core, workers),
filtered by ``VLLM_PLUGINS``. It must be idempotent and cheap: this module
imports nothing heavy at import time, and the model class is registered as a
``"module:Class"`` string so vLLM imports it only when it is selected.
"""

from __future__ import annotations

MODEL_CLASS = "unified_models.backends.vllm.model:UnifiedForCausalLM"

_registered = False


def architectures() -> list[str]:
    """Every architecture name our model class serves (one per model family)."""
    from ...models import architectures as family_archs

    return sorted(set(family_archs().values()))


def register() -> None:
    """Register our model class under each family's architecture name (idempotent)."""
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    for arch in architectures():
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, MODEL_CLASS)
    _registered = True
