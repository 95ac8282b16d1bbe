"""A family's part of quantization (:attr:`~.family.LayerFamily.quantization`).

Weights: which of a family's linears may carry a weight format (``linears``,
with the export role that :class:`QuantizationOptions` addresses) and which
combinations it accepts (``check_formats``); the formats themselves are the
model's per-linear table (``ModelSpec.weight_formats``) computed by
:mod:`.weight_formats`, so quantizing, dequantizing, validating and exporting
weights is generic (:mod:`unified_models.converters.modelopt`). The rest is
what is not a weight format: the FP8 KV cache of :mod:`.attention` (its
spec change, its calibrated scales and their validation). A family without
rules (``None``) is never quantized; every default below does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ..dsl import SpecError


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


def _no_linears(spec: Any) -> dict[str, str]:
    return {}


def _any_formats(spec: Any, weight_format: Any) -> None:
    return None


def _no_hooks(*_: Any) -> list:
    return []


def _no_problems(*_: Any) -> list[str]:
    return []


@dataclass(frozen=True, kw_only=True)
class QuantizationRules:
    """The callables of one family's quantization (each defaults to "nothing to do").

    Attributes:
        linears: ``spec -> {linear module name: export role}``: the linears that may
            carry a weight format; the role (``"experts"``, ``"mamba_proj"``) is the
            :class:`QuantizationOptions` field an export reads for them.
        check_formats: ``(spec, weight_format) -> None``: raises ``SpecError`` for a
            combination of its linears' formats the family cannot run
            (``weight_format(name) -> LinearFormat | None``).
        dequantized: ``spec -> spec``: no activation or KV quantization (weights
            are the table's business).
        quantized: ``(spec, QuantizationOptions) -> spec``: the spec an export writes
            (e.g. an FP8 KV cache).
        calibration_hooks: ``(spec, module, options, track) -> hook handles``
            on transformers' ``module`` of this sublayer, calling ``track``
            (:data:`Track`) with each tensor whose amax gives a static scale.
        validate: ``(spec, layer_index, state) -> problems``: one message per bad
            non-weight quantization tensor (KV scales).
    """

    linears: Callable[[Any], dict[str, str]] = _no_linears
    check_formats: Callable[[Any, Callable[[str], Any]], None] = _any_formats
    dequantized: Callable[[Any], Any] = _same
    quantized: Callable[[Any, QuantizationOptions], Any] = _same
    calibration_hooks: Callable[[Any, Any, QuantizationOptions, Track], list] = _no_hooks
    validate: Callable[[Any, int, Mapping[str, torch.Tensor]], list[str]] = _no_problems


def quantizable_linears(spec: Any) -> dict[str, str]:
    """Every linear of the model that its family lets carry a weight format -> its export role."""
    from .family import family_of

    out: dict[str, str] = {}
    for sub in spec.sublayers:
        rules = family_of(sub.mixer, sub.index).quantization
        if rules is not None:
            out.update(rules.linears(sub.mixer))
    return out


def check_weight_formats(spec: Any) -> None:
    """Refuse a weight-format table the model's families cannot run.

    Raises:
        SpecError: a formatted linear that its family does not list as quantizable (names
            it, its format and what may be quantized), or a family's own
            ``check_formats`` refusal (e.g. experts of one layer in different formats).
    """
    from .family import family_of

    for sub in spec.sublayers:
        rules = family_of(sub.mixer, sub.index).quantization
        if rules is not None:
            rules.check_formats(sub.mixer, spec.weight_format)
    allowed = quantizable_linears(spec)
    for name, fmt in spec.weight_formats:
        if name not in allowed:
            kinds = sorted(set(allowed.values()))
            raise SpecError(f"{name} is quantized ({fmt.format}), but its layer family runs it in the model dtype "
                            f"only; quantizable here: {', '.join(kinds) if kinds else 'nothing'}")
