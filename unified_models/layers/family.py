"""The layer-family protocol: everything an engine needs to know about one kind of sublayer.

A family is one :class:`LayerFamily` registered for its spec type
(:func:`register_family`; the package's own are registered in
``layers/__init__.py``, one line each). Every consumer iterates over these
declarations instead of switching on spec types:

* :func:`unified_models.forward.forward_hidden` calls ``forward``;
* the reference model (:mod:`unified_models.backends.reference.model`) is the
  same loop over ``oracle``;
* both state stores and the vLLM cache modules build from ``caches``
  (:func:`model_caches`);
* the Megatron module takes its ``TransformerConfig`` fields from
  ``megatron_fields`` and its init from ``init_rules``;
* parameter allocation stacks the groups of ``stacked_parameters`` into one buffer;
* the quantization converters call ``quantization`` (:mod:`.quantization`); a
  linear's weight format is the model's table, computed by :mod:`.weight_formats`.

A new family = a spec dataclass (``dsl/``), a module with these functions
(``layers/``), and one :func:`register_family` call; a family may also be
registered from outside the package (``tests/test_family_protocol.py``).

Shapes: T tokens, D hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from ..dsl import SpecError
from .common import LayerFn

if TYPE_CHECKING:  # pragma: no cover
    from ..caches import CacheDecl
    from ..dsl import ModelSpec
    from .quantization import QuantizationRules

OracleFn = Callable[[Any, Mapping[str, torch.Tensor], torch.Tensor], torch.Tensor]
"""``(spec, params, x_TD) -> y_TD``: the sublayer's math in plain PyTorch for ONE sequence
from position 0, in the dtype of ``x_TD`` (fp32 or fp64; ``params`` in the same dtype),
differentiable; quantized weights are used by the same rule as the kernels
(dequantized), with straight-through gradients to the masters."""

InitRule = Callable[[torch.Tensor], Any]
"""In-place initialisation of one parameter (``p.fill_(1.0)``, ...)."""


def _no_caches(spec: Any, model_dtype: torch.dtype) -> dict[str, "CacheDecl"]:
    return {}


def _no_rules(spec: Any) -> dict[str, InitRule]:
    return {}


def _no_fields(spec: Any) -> dict[str, Any]:
    return {}


def _no_stacks(spec: Any) -> tuple[tuple[str, ...], ...]:
    return ()


def _no_views(spec: Any, model: Any, params: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True, kw_only=True)
class LayerFamily:
    """The declarations of one layer family.

    Attributes:
        spec_type: the spec dataclass this family computes (subclasses match too).
        forward: ``(spec, layer_index, params, x_TD, batch, store, ctx) -> y_TD`` over
            :mod:`unified_models.ops` (:data:`~.common.LayerFn`).
        oracle: :data:`OracleFn`, the fp32/fp64 reference of the same math.
        oracle_takes_input_ids: the oracle also takes the sequence's token ids as
            ``input_ids_T=`` (int ``[T]``; hash-routed MoE chooses its experts by token id).
        oracle_near_ties: ``(spec, params, x_TD, engine_dtype) -> bool [T]``, or None for a family
            whose oracle makes no discrete choice: the rows whose oracle output rests on a top-k
            selection decided by scores closer than the engine's rounding of those scores
            (:func:`~.oracle.near_tie_margin` of the dtype the engine computes them in, relative:
            :func:`~.oracle.topk_near_ties`), where the engine may select otherwise and its output
            legitimately jump. ``bisect --against reference`` reports those rows instead of
            comparing them (:mod:`unified_models.porting`).
        caches: ``(spec, model_dtype) -> {cache name: declaration}``
            (:mod:`unified_models.caches`); stateless families declare none.
            The forward reads each with ``store.state(layer_index, name)``.
        init_rules: ``spec -> {HF name: rule}`` for parameters whose init is
            not the generic one (weights normal, norms and scales 1, biases 0).
        megatron_fields: ``spec -> {TransformerConfig field: value}`` describing
            the family's sizes (Megatron reads them; the first sublayer of each
            family contributes, earlier-registered families win a shared field;
            ``add_bias_linear`` is OR-ed).
        stacked_parameters: ``spec -> groups of linear module names`` of equal shape
            and weight format whose tensors are allocated, field by field, as views
            of one ``[len(group), ...]`` buffer (routed experts: the kernels take the
            whole stack without a copy).
        frozen_views: ``(spec, model, params) -> {key: value}``: values the forward derives
            from the parameters and may take ready-made under ``key`` (routed-expert stacks),
            each a view sharing the parameters' storage (so in-place weight updates are
            seen). An engine whose parameter tensors stay fixed (vLLM) builds them once per
            parameter-table rebuild, with grad off, instead of at every forward.
        quantization: the family's part of quantization
            (:class:`~.quantization.QuantizationRules`: which linears may carry a
            weight format, KV-cache quantization, calibration), or None for a
            family that is never quantized (:mod:`unified_models.converters.modelopt`).
    """

    spec_type: type
    forward: LayerFn
    oracle: OracleFn
    caches: Callable[[Any, torch.dtype], dict[str, "CacheDecl"]] = _no_caches
    init_rules: Callable[[Any], dict[str, InitRule]] = _no_rules
    megatron_fields: Callable[[Any], dict[str, Any]] = _no_fields
    stacked_parameters: Callable[[Any], tuple[tuple[str, ...], ...]] = _no_stacks
    frozen_views: Callable[[Any, Any, Mapping[str, torch.Tensor]], dict[str, Any]] = _no_views
    oracle_takes_input_ids: bool = False
    oracle_near_ties: Callable[[Any, Mapping[str, torch.Tensor], torch.Tensor, torch.dtype], torch.Tensor] | None = None
    quantization: "QuantizationRules | None" = None


FAMILIES: dict[type, LayerFamily] = {}
"""Spec type -> its family, in registration order."""


def register_family(family: LayerFamily) -> LayerFamily:
    """Register (or replace) the family of ``family.spec_type``; returns it."""
    FAMILIES[family.spec_type] = family
    return family


def family_of(spec: Any, layer_index: int | None = None) -> LayerFamily:
    """The family of a sublayer's mixer spec (looked up by its type, then its base classes).

    Raises:
        SpecError: no family is registered for this spec type; names the type,
            the layer index and the known types.
    """
    for cls in type(spec).__mro__:
        fam = FAMILIES.get(cls)
        if fam is not None:
            return fam
    known = ", ".join(sorted(c.__name__ for c in FAMILIES))
    where = f"layer {layer_index}: " if layer_index is not None else ""
    raise SpecError(f"{where}no layer family for spec type {type(spec).__name__} (known: {known})")


def model_caches(spec: "ModelSpec", model_dtype: torch.dtype | None = None) -> dict[tuple[int, str], "CacheDecl"]:
    """Every cache of the model: ``(layer index, cache name) -> declaration``, in forward order.

    Raises:
        SpecError: a sublayer has no family, or two sublayers of one layer declare
            the same cache name.
    """
    dtype = model_dtype or spec.dtype
    out: dict[tuple[int, str], CacheDecl] = {}
    for sub in spec.sublayers:
        for name, decl in family_of(sub.mixer, sub.index).caches(sub.mixer, dtype).items():
            key = (sub.index, name)
            if key in out:
                raise SpecError(f"layer {sub.index}: two sublayers declare the cache {name!r}")
            out[key] = decl
    return out


def families_in_order(spec: "ModelSpec") -> list[tuple[LayerFamily, Any]]:
    """``(family, first sublayer spec of that family)`` for each family present, in
    registration order (the order :func:`megatron_fields` merges them)."""
    first: dict[type, Any] = {}
    for sub in spec.sublayers:
        fam = family_of(sub.mixer, sub.index)
        first.setdefault(fam.spec_type, sub.mixer)
    return [(FAMILIES[t], first[t]) for t in FAMILIES if t in first]


def megatron_fields(spec: "ModelSpec") -> dict[str, Any]:
    """The families' ``TransformerConfig`` fields merged (see :attr:`LayerFamily.megatron_fields`)."""
    out: dict[str, Any] = {}
    for fam, first in families_in_order(spec):
        for k, v in fam.megatron_fields(first).items():
            if k == "add_bias_linear":
                out[k] = bool(out.get(k, False) or v)
            else:
                out.setdefault(k, v)
    return out


def declares_slot_state(spec: "ModelSpec") -> bool:
    """Whether any sublayer declares a slot-state cache (Mamba-2): the model then runs on
    vLLM's hybrid path (``IsHybrid``; a Mamba/state KV-cache group)."""
    from ..caches import SlotStateCache

    return any(isinstance(d, SlotStateCache) for d in model_caches(spec).values())
