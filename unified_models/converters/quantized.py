"""Load-time validation of a checkpoint's quantized tensors in NVIDIA ModelOpt's format
(NVFP4 experts, FP8 Mamba projections, FP8 KV-cache scales; the format:
:mod:`unified_models.converters.modelopt`). Used by the safetensors reader
(:func:`~unified_models.converters.hf_safetensors.validate_state_dict`), the ModelOpt
exporter and the engines' loaders. Each family checks its own tensors
(:attr:`~unified_models.layers.quantization.QuantizationRules.validate`).
"""

from __future__ import annotations

from typing import Mapping

import torch

from ..dsl import CheckpointError, ModelSpec
from ..layers import family_of


def validate_quantized(state: Mapping[str, torch.Tensor], spec: ModelSpec, *, source: str) -> None:
    """Check every quantized tensor of ``state`` against ``spec``: NVFP4 experts, FP8 Mamba projections,
    FP8 KV scales.

    Raises:
        CheckpointError: one message listing every bad tensor: missing, zero,
            negative, NaN or Inf scales (the NVFP4 part names the layer and the
            expert ids, e.g. ``layer 3: bad expert ids [5]: expert 5 up_proj:
            weight_scale_2 is zero``), NaN e4m3 codes.
    """
    problems: list[str] = []
    for blk in spec.sublayers:
        rules = family_of(blk.mixer, blk.index).quantization
        if rules is not None:
            problems += rules.validate(blk.mixer, blk.index, state)
    if problems:
        raise CheckpointError(f"checkpoint {source}: bad quantized tensors: " + "; ".join(problems))
