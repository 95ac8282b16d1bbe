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

    from .sampling import install_engine_hooks

    use_transformers_configs()
    supported = set(ModelRegistry.get_supported_archs())
    for arch, cls in model_classes().items():
        if arch not in supported:
            ModelRegistry.register_model(arch, cls)
    install_engine_hooks(lambda arch: arch in model_classes())  # request temperature -> our logprob op
    from ...plugins import override_native_enabled

    if override_native_enabled():
        install_native_override()


def native_architectures() -> dict[str, str]:
    """transformers' architecture name -> ours, per family (``NemotronHForCausalLM`` ->
    ``UnifiedNemotronHForCausalLM``): the names :func:`native_hf_overrides` replaces."""
    from ...models import architectures as family_archs

    return {a.removeprefix("Unified"): a for a in set(family_archs().values()) if a.startswith("Unified")}


def native_hf_overrides(hf_config):
    """vLLM ``hf_overrides`` callable: a checkpoint of a family we serve loads with our class.

    A config whose ``architectures`` names a family's native class (:func:`native_architectures`)
    gets :func:`model_architecture` of its spec (hybrid variant iff it has Mamba-2 layers; the spec
    of :func:`.config_classes.transformers_config`, so vLLM's own config of a published DeepSeek-V4
    checkpoint is read too) and a
    ModelOpt ``quantization_config`` moved out of vLLM's way, exactly what
    ``engine.make_llm`` passes as ``hf_overrides``. Any other config is returned unchanged.
    """
    from ...models import spec_from_hf_config
    from ...models.modelopt_config import QUANT_CONFIG_ATTR

    native = native_architectures()
    archs = list(getattr(hf_config, "architectures", None) or [])
    if not any(a in native for a in archs):
        return hf_config
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        import json
        from pathlib import Path

        f = Path(str(getattr(hf_config, "_name_or_path", "") or "")) / "hf_quant_config.json"
        qc = json.loads(f.read_text()) if f.is_file() else None
    if qc is not None:
        hf_config.quantization_config = None
        setattr(hf_config, QUANT_CONFIG_ATTR, qc)
    from .config_classes import transformers_config

    hf_config = transformers_config(hf_config)  # as make_llm's overrides: one form for either layout
    hf_config.architectures = [model_architecture(spec_from_hf_config(hf_config))]
    return hf_config


def install_native_override() -> None:
    """``UNIFIED_MODELS_OVERRIDE_NATIVE=1``: engines built from ``EngineArgs`` (``vllm serve``, the OpenAI
    server, ``AsyncLLM``, ``vllm.LLM``) without ``hf_overrides`` use :func:`native_hf_overrides`, so
    checkpoints of our families load with our class under their native architecture names.
    Idempotent."""
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_model_config
    if getattr(create, "_unified_models_override", False):
        return

    def create_model_config(self):
        if not self.hf_overrides:
            self.hf_overrides = native_hf_overrides
        return create(self)

    create_model_config._unified_models_override = True  # type: ignore[attr-defined]
    EngineArgs.create_model_config = create_model_config


LAYOUT_CONFIG_CLASSES = {"deepseek_v4": ("unified_models.backends.vllm.config_classes", "DeepseekV4ConfigByLayout")}
"""Model types whose ``config.json`` vLLM must parse by layout: model type -> (module, class) of a
factory class that keeps the class vLLM registered (its ``published_class``) for the checkpoint
layout vLLM's own model reads and uses transformers' class for the transformers layout."""


def use_transformers_configs() -> None:
    """Let vLLM parse a transformers-written ``config.json`` of the model types of
    :data:`LAYOUT_CONFIG_CLASSES` with transformers' config class, and DeepSeek's published layout
    with the class vLLM registered for it, as vLLM does without our package.

    vLLM registers its own ``DeepseekV4Config`` for ``deepseek_v4`` (``_CONFIG_REGISTRY``,
    ``vllm/transformers_utils/configs/deepseek_v4.py``, 0.26 and 0.32): a pass-through
    ``PreTrainedConfig`` that keeps DeepSeek's published keys (``compress_ratios``,
    ``num_hash_layers``, ``rope_scaling``, ...) as attributes, which vLLM's native
    ``DeepseekV4ForCausalLM`` reads, and whose inherited validation accepts only
    ``("sparse", "dense")`` ``mlp_layer_types``, so a transformers-written config (``hash_moe`` /
    ``moe``) fails to load. This plugin runs in every vLLM process (a user's native run too), so
    the registry entry becomes
    :class:`~unified_models.backends.vllm.config_classes.DeepseekV4ConfigByLayout` (also registered
    into ``AutoConfig``, as vLLM itself does with its registry classes): a published ``config.json``
    is parsed by the class vLLM had registered, exactly as native vLLM does, a transformers-written
    one by transformers' class. Our model class reads either through
    :func:`~unified_models.backends.vllm.config_classes.transformers_config`.

    vLLM's generic RoPE readers also learn transformers' two rope labels (``"main"`` /
    ``"compress"``, added to ``ALLOWED_LAYER_TYPES``; a published config's flat ``rope_scaling`` has
    neither key, so what vLLM reads from it is unchanged).

    Idempotent (an entry that is already ours keeps the class it wraps); a vLLM without such a
    registry, or without an entry for the model type, is left alone.
    """
    import importlib

    try:
        from vllm.transformers_utils import config as vllm_config
    except ImportError:  # pragma: no cover - another vLLM layout
        return
    registry = getattr(vllm_config, "_CONFIG_REGISTRY", None)
    if registry is None:
        return
    # transformers' DeepseekV4Config nests rope_parameters by rope *label* ("main" / "compress"),
    # not by layer type; vLLM's generic readers (max_model_len, M-RoPE) only see nesting by
    # layer type, so they must know the two labels (else they read {"main", "compress"} as one
    # flat rope dict and fail on its missing "rope_type")
    allowed = getattr(vllm_config, "ALLOWED_LAYER_TYPES", None)
    if isinstance(allowed, tuple) and "compress" not in allowed:
        vllm_config.ALLOWED_LAYER_TYPES = allowed + ("main", "compress")
    for model_type, (module, name) in LAYOUT_CONFIG_CLASSES.items():
        if model_type not in registry:
            continue
        cls = getattr(importlib.import_module(module), name)
        current = registry[model_type]  # vLLM's LazyConfigDict imports its class here
        if current is not cls:
            cls.published_class = current
            registry[model_type] = cls
        from transformers import AutoConfig

        AutoConfig.register(model_type, cls, exist_ok=True)
