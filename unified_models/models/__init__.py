"""Model declarations: each family's spec from its Hugging Face config.

One registry line per model family (:func:`register_model`): the HF
``model_type``, the function that builds the spec from a transformers config,
and the architecture name our vLLM plugin serves it under. A family may also
be registered from outside the package (``tests/test_family_protocol.py``).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Mapping

import torch

from ..dsl import CheckpointError, ModelSpec, SpecError
from . import deepseek_v4, nemotron_h, qwen3

_FAMILIES: dict[str, Any] = {}
_ARCHITECTURES: dict[str, str] = {}
_TRANSFORMERS_MODULE_NAMES: dict[str, Callable[[str], str]] = {}


def register_model(model_type: str, spec_from_config: Any, architecture: str, *,
                   transformers_module_name: Callable[[str], str] | None = None) -> None:
    """Register (or replace) a family: ``spec_from_config(config, *, dtype, **kwargs) -> ModelSpec``
    for HF configs of ``model_type``, served by vLLM as ``architecture``.

    ``transformers_module_name(name) -> name``: where the family's spec names (its checkpoint
    names) differ from the module names of transformers' class in memory (transformers renames at
    load time), the module that holds the spec's component ``name`` there; default: the same name."""
    _FAMILIES[model_type] = spec_from_config
    _ARCHITECTURES[model_type] = architecture
    if transformers_module_name is None:
        _TRANSFORMERS_MODULE_NAMES.pop(model_type, None)
    else:
        _TRANSFORMERS_MODULE_NAMES[model_type] = transformers_module_name


def transformers_module_name(spec: ModelSpec, name: str) -> str:
    """The name of the module of transformers' class of ``spec``'s family (as loaded in memory) that
    computes the spec's component ``name`` (a norm, a mixer, a block, the embedding, the LM head):
    the family's ``transformers_module_name`` (:func:`register_model`), else ``name`` itself."""
    fn = _TRANSFORMERS_MODULE_NAMES.get(spec.family)
    return name if fn is None else fn(name)


register_model("nemotron_h", nemotron_h.spec_from_hf_config, nemotron_h.ARCHITECTURE)
register_model("deepseek_v4", deepseek_v4.spec_from_hf_config, deepseek_v4.ARCHITECTURE,
               transformers_module_name=deepseek_v4.transformers_module_name)
register_model("qwen3", qwen3.spec_from_hf_config, qwen3.ARCHITECTURE)
register_model("qwen3_moe", qwen3.spec_from_hf_config, qwen3.MOE_ARCHITECTURE)


def spec_from_hf_config(config: Any, *, dtype: torch.dtype | None = None, **kwargs: Any) -> ModelSpec:
    """Dispatch on ``config.model_type`` to the family's declaration (``kwargs``, e.g.
    Nemotron-H's ``quant_config``, go to it).

    Raises:
        SpecError: the model type has no declaration here, or a size field of :data:`SIZE_FIELDS`
            that is not an integer >= 1 (named, before any shape is derived from it).
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        raise SpecError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(_FAMILIES))}"
        )
    for name in SIZE_FIELDS:
        v = getattr(config, name, None)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise SpecError(f"{model_type} config: {name}={v!r} must be an integer >= 1")
    return _FAMILIES[model_type](config, dtype=dtype, **kwargs)


SIZE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "moe_intermediate_size", "vocab_size", "num_hidden_layers", "n_routed_experts",
               "num_experts_per_tok", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
               "conv_kernel", "chunk_size")
"""Config fields that are sizes in every family that has them: refused unless an integer >= 1, so a
negative or zero size is named as the field, not as the tensor shapes derived from it."""


def architectures() -> dict[str, str]:
    """Our registered architecture name per family."""
    return dict(_ARCHITECTURES)


def check_declared_layer_count(config: Any, config_json: Mapping, *, source: str) -> None:
    """Refuse a ``config.json`` whose ``num_hidden_layers`` disagrees with its layer pattern.

    transformers derives some configs' layer count from their layer pattern and drops a
    conflicting ``num_hidden_layers`` with a log line (NemotronH: ``layers_block_type`` /
    ``hybrid_override_pattern``). ``config`` is the parsed config, ``config_json`` the raw
    JSON it was parsed from; nothing happens when the JSON has no ``num_hidden_layers``.

    Raises:
        SpecError: ``num_hidden_layers`` is not an integer, or differs from the parsed
            config's layer count; the message names both numbers and the pattern.
    """
    declared = config_json.get("num_hidden_layers")
    derived = getattr(config, "num_hidden_layers", None)
    if declared is None or derived is None:
        return
    if isinstance(declared, bool) or not isinstance(declared, int):
        raise SpecError(f"{source}: num_hidden_layers must be an integer, got {declared!r}")
    if declared != derived:
        pattern = getattr(config, "hybrid_override_pattern", None)
        what = f"the layer pattern {pattern!r} (layers_block_type / hybrid_override_pattern)" if pattern else \
            "the layer types transformers read from it"
        raise SpecError(f"{source}: num_hidden_layers is {declared} but {what} has {derived} layers; "
                        "make the two agree")


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
"""The layer index in a parameter name (``backbone.layers.3.mixer.A_log`` -> 3)."""


def check_tensor_layer_count(spec: ModelSpec, tensor_names: Iterable[str], *, source: str) -> None:
    """Refuse a checkpoint whose tensors cover another number of layers than ``spec``.

    Layers are counted as 1 + the largest ``layers.<i>.`` index among the names, on both
    sides (the spec's :meth:`~ModelSpec.parameter_shapes` and ``tensor_names``); a spec
    without such names is not checked.

    Raises:
        CheckpointError: the counts differ; the message names both numbers.
    """
    def count(names: Iterable[str]) -> int | None:
        idx = [int(m.group(1)) for n in names if (m := _LAYER_INDEX.search(n))]
        return max(idx) + 1 if idx else None

    want = count(spec.parameter_shapes())
    have = count(tensor_names)
    if want is not None and have is not None and have != want:
        pattern = spec.extra.get("pattern")
        raise CheckpointError(
            f"checkpoint {source} holds tensors of {have} layers (layer indices 0..{have - 1}) but its config "
            f"declares {want} layers" + (f" (layer pattern {pattern!r})" if pattern else ""))
