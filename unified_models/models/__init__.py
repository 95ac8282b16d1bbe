"""Model declarations: each family's spec from its Hugging Face config.

One registry line per model family (:func:`register_model`): the HF
``model_type``, the function that builds the spec from a transformers config,
and the architecture name our vLLM plugin serves it under. A family may also
be registered from outside the package (``tests/test_family_protocol.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..dsl import ModelSpec, SpecError
from . import nemotron_h

_FAMILIES: dict[str, Any] = {}
_ARCHITECTURES: dict[str, str] = {}


def register_model(model_type: str, spec_from_config: Any, architecture: str) -> None:
    """Register (or replace) a family: ``spec_from_config(config, *, dtype, **kwargs) -> ModelSpec``
    for HF configs of ``model_type``, served by vLLM as ``architecture``."""
    _FAMILIES[model_type] = spec_from_config
    _ARCHITECTURES[model_type] = architecture


register_model("nemotron_h", nemotron_h.spec_from_hf_config, nemotron_h.ARCHITECTURE)


def spec_from_hf_config(config: Any, *, dtype: torch.dtype | None = None, **kwargs: Any) -> ModelSpec:
    """Dispatch on ``config.model_type`` to the family's declaration (``kwargs``, e.g.
    Nemotron-H's ``quant_config``, go to it).

    Raises:
        SpecError: the model type has no declaration here.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in _FAMILIES:
        raise SpecError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(_FAMILIES))}"
        )
    return _FAMILIES[model_type](config, dtype=dtype, **kwargs)


def architectures() -> dict[str, str]:
    """Our registered architecture name per family."""
    return dict(_ARCHITECTURES)
