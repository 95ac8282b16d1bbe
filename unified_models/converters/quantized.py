"""Load-time validation of a checkpoint's quantized tensors in NVIDIA ModelOpt's format
(NVFP4 experts, FP8 Mamba projections, FP8 KV-cache scales; the format:
:mod:`unified_models.converters.modelopt`). Used by the safetensors reader
(:func:`~unified_models.converters.hf_safetensors.validate_state_dict`), the ModelOpt
exporter and the engines' loaders. Each family checks its own tensors
(:attr:`~unified_models.layers.quantization.QuantizationRules.validate`).
"""

from __future__ import annotations

from typing import Collection, Mapping

import torch

from ..dsl import CheckpointError, ModelSpec
from ..layers import family_of
from ..layers.weight_formats import weight_problems


def validate_quantized(state: Mapping[str, torch.Tensor], spec: ModelSpec, *, source: str,
                       absent: Collection[str] = ()) -> None:
    """Check every quantized tensor of ``state`` against ``spec``: each linear's stored format
    (NVFP4 experts, FP8 Mamba projections; :func:`~unified_models.layers.weight_formats.weight_problems`)
    and the families' other quantization tensors (FP8 KV scales).

    ``absent``: tensor names this process does not hold (routed experts other expert-parallel
    ranks hold); linears whose ``weight`` is among them are not checked.

    Raises:
        CheckpointError: one message listing every bad tensor, each named: missing, zero,
            negative, NaN or Inf scales (e.g. ``backbone.layers.3.mixer.experts.5.up_proj:
            weight_scale_2 is zero``), NaN codes or block scales, wrong dtypes or shapes.
    """
    problems: list[str] = []
    shapes = None
    for name, _ in spec.weight_formats:
        if f"{name}.weight" in absent:
            continue
        if shapes is None:
            shapes = spec.replace(weight_formats=()).parameter_shapes()
        problems += weight_problems(spec, name, state, shapes[f"{name}.weight"])
    for blk in spec.sublayers:
        rules = family_of(blk.mixer, blk.index).quantization
        if rules is not None:
            problems += rules.validate(blk.mixer, blk.index, state)
    if problems:
        raise CheckpointError(f"checkpoint {source}: bad quantized tensors: " + "; ".join(problems))
