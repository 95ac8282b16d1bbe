"""A family's part of NVIDIA ModelOpt quantization (:attr:`~.family.LayerFamily.quantization`).

The ModelOpt converters (:mod:`unified_models.converters.modelopt`,
:mod:`unified_models.converters.quantized`) loop over the sublayers and call
these rules of each sublayer's family; a family without rules (``None``) is
never quantized. The per-family tensor code lives in the family modules
(NVFP4 experts in :mod:`.moe`, FP8 Mamba in/out projections in :mod:`.mamba2`,
FP8 KV-cache scales in :mod:`.attention`); every default below leaves the
spec and the tensors as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch


@dataclass(frozen=True, kw_only=True)
class QuantizationOptions:
    """The recipes of a ModelOpt export (:func:`~unified_models.converters.modelopt.export_modelopt`):
    ``experts`` ``"nvfp4"`` or None, ``mamba_proj`` ``"fp8"`` or None, ``kv_cache`` ``"fp8"`` or None."""

    experts: str | None = None
    mamba_proj: str | None = None
    kv_cache: str | None = None


Track = Callable[[str, torch.Tensor], None]
"""``(scale name, tensor)``: calibration records the tensor's ``amax`` under that name."""


def scalar_problems(name: str, t: torch.Tensor | None) -> list[str]:
    """Problems of a required fp32 ``[]`` scale (missing, zero, negative, NaN, Inf)."""
    from ..ops.scales import scalar_scale_problems

    return scalar_scale_problems(name, t, required=True)


def _same(spec: Any, *_: Any) -> Any:
    return spec


def _nothing(*_: Any) -> None:
    return None


def _no_derived(*_: Any) -> set[str]:
    return set()


def _no_layers(spec: Any) -> dict[str, dict]:
    return {}


def _no_hooks(*_: Any) -> list:
    return []


def _no_problems(*_: Any) -> list[str]:
    return []


@dataclass(frozen=True, kw_only=True)
class QuantizationRules:
    """The callables of one family's ModelOpt quantization (each defaults to "nothing to do").

    Attributes:
        to_master: ``spec -> spec``: the model-dtype master form of a stored
            (``checkpoint_format "modelopt"``) spec, recipes kept.
        dequantized: ``spec -> spec``: the plain model-dtype spec (no weight,
            activation or KV quantization).
        quantized: ``(spec, QuantizationOptions) -> spec``: the ModelOpt stored
            form an export writes.
        dequantize_tensors: ``(spec, state, out, dtype) -> None``: rewrites
            ``out`` (a copy of the stored ``state``) into the masters.
        quantize_tensors: ``(spec, masters, wanted, out) -> derived``: writes
            into ``out`` the stored tensors derived from the ``wanted`` master
            names; returns every master name it derives from (wanted or not).
        quantized_layers: ``spec -> {module name: {"quant_algo": ...}}``, the
            ``quantized_layers`` entries of ``hf_quant_config.json``.
        calibration_hooks: ``(spec, module, options, track) -> hook handles``
            on transformers' ``module`` of this sublayer, calling ``track``
            (:data:`Track`) with each tensor whose amax gives a static scale.
        validate: ``(spec, layer_index, state) -> problems``: one message per
            bad quantized tensor.
    """

    to_master: Callable[[Any], Any] = _same
    dequantized: Callable[[Any], Any] = _same
    quantized: Callable[[Any, QuantizationOptions], Any] = _same
    dequantize_tensors: Callable[[Any, Mapping[str, torch.Tensor], dict[str, torch.Tensor], torch.dtype], None] = _nothing
    quantize_tensors: Callable[[Any, Mapping[str, torch.Tensor], set[str], dict[str, torch.Tensor]], set[str]] = _no_derived
    quantized_layers: Callable[[Any], dict[str, dict]] = _no_layers
    calibration_hooks: Callable[[Any, Any, QuantizationOptions, Track], list] = _no_hooks
    validate: Callable[[Any, int, Mapping[str, torch.Tensor]], list[str]] = _no_problems
