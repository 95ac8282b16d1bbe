"""Model declarations: each family's spec from its Hugging Face config."""

from __future__ import annotations

from typing import Any

import torch

from ..dsl import ModelSpec, SpecError
from . import nemotron_h

_FAMILIES = {"nemotron_h": nemotron_h.spec_from_hf_config}


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
    return {"nemotron_h": nemotron_h.ARCHITECTURE}
