"""vLLM plugin entry point (``vllm.general_plugins`` -> ``register``).

vLLM calls :func:`register` in every process it starts (engine core, workers),
filtered by ``VLLM_PLUGINS``. It must be idempotent and cheap: this module
imports nothing heavy at import time, and the model class is registered as a
``"module:Class"`` string so vLLM imports it only when it is selected.
"""

from __future__ import annotations

MODEL_CLASS = "unified_models.backends.vllm.model:UnifiedForCausalLM"
HYBRID_MODEL_CLASS = "unified_models.backends.vllm.model:UnifiedHybridForCausalLM"
"""Models with Mamba-2 layers: the same class plus vLLM's hybrid flags (see ``model.py``)."""

def hybrid_architecture(architecture: str) -> str:
    """``UnifiedNemotronHForCausalLM`` -> ``UnifiedNemotronHHybridForCausalLM`` (as ``model.hybrid_architecture``)."""
    return f"{architecture.removesuffix('ForCausalLM')}HybridForCausalLM"


def model_architecture(spec) -> str:
    """The architecture name vLLM must load ``spec`` with: the hybrid variant iff it declares
    slot-state caches (Mamba-2 layers; vLLM's ``IsHybrid`` path)."""
    from ...layers import declares_slot_state

    return hybrid_architecture(spec.architecture) if declares_slot_state(spec) else spec.architecture


def model_classes() -> dict[str, str]:
    """Architecture name -> ``"module:Class"`` of every name we register
    (per family: the plain name and its hybrid variant)."""
    from ...models import architectures as family_archs

    out = {}
    for arch in sorted(set(family_archs().values())):
        out[arch] = MODEL_CLASS
        out[hybrid_architecture(arch)] = HYBRID_MODEL_CLASS
    return out


def architectures() -> list[str]:
    """Every architecture name our model classes serve (per family: plain and hybrid)."""
    return sorted(model_classes())


def register() -> None:
    """Register our model classes under each family's architecture names (idempotent: names
    already registered are skipped, so a family registered later in the process is added
    by the next call; ``engine.make_llm`` calls it)."""
    from vllm import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for arch, cls in model_classes().items():
        if arch not in supported:
            ModelRegistry.register_model(arch, cls)
