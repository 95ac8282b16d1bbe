"""Weight formats per linear from an NVIDIA ModelOpt quantization config.

A ModelOpt checkpoint says how it is quantized in ``hf_quant_config.json``
(``{"producer": ..., "quantization": {"quant_algo": ..., "exclude_modules": [...],
"kv_cache_quant_algo": ...}}``) or in ``config.json``'s ``quantization_config``
(``{"quant_method": "modelopt", "quant_algo": ..., "ignore": [...]}``); a
``MIXED_PRECISION`` algorithm lists each quantized module in its
``quantized_layers`` table (as the published NVFP4 Nemotron-H hybrids do). This
module turns that into the model's per-linear table (``ModelSpec.weight_formats``,
:mod:`unified_models.dsl.weights`); which linears a layer family can run in
which format is the family's check (:func:`unified_models.layers.quantization.check_weight_formats`).
Declarations only: no kernels.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable, Iterable, Mapping

from ..dsl import SpecError
from ..dsl.weights import LinearFormat

MODELOPT_ALGOS: dict[str, LinearFormat] = {
    "FP8": LinearFormat("fp8", input_scale=True),
    "NVFP4": LinearFormat("nvfp4", input_scale=True),
    "W4A16_NVFP4": LinearFormat("nvfp4"),
}
"""ModelOpt ``quant_algo`` of a module -> its stored weight format (``NVFP4`` is W4A4:
its ``input_scale`` is validated, the W4A16 kernels do not use it)."""

QUANT_CONFIG_ATTR = "unified_models_quantization_config"
"""Config attribute holding the ModelOpt config when an engine hides ``quantization_config``
from its own quantization methods (see ``backends.vllm.engine.quantization_overrides``)."""


def _as_dict(qc: Any, family: str) -> dict | None:
    if qc is None:
        return None
    if isinstance(qc, Mapping):
        return dict(qc)
    if hasattr(qc, "to_dict"):
        return qc.to_dict()
    raise SpecError(f"{family} quantization_config of type {type(qc).__name__} is not a mapping")


def modelopt_quantization(config: Any, quant_config: Mapping | None, family: str) -> dict | None:
    """The ModelOpt ``quantization`` dict of a checkpoint, or None for an unquantized one.

    Args:
        config: the transformers config (its ``quantization_config`` is read when
            ``quant_config`` is None).
        quant_config: the ``hf_quant_config.json`` dict or a ``quantization_config`` dict.
        family: the model family's name for messages.

    Raises:
        SpecError: a quantization method other than ModelOpt's.
    """
    if quant_config is None:
        quant_config = getattr(config, "quantization_config", None) or getattr(config, QUANT_CONFIG_ATTR, None)
    qc = _as_dict(quant_config, family)
    if not qc:
        return None
    if isinstance(qc.get("quantization"), Mapping):  # hf_quant_config.json
        return dict(qc["quantization"])
    method = str(qc.get("quant_method", "")).lower()
    if not method.startswith("modelopt"):
        raise SpecError(f"{family} quantization_config quant_method={qc.get('quant_method')!r} is not "
                        "supported; only ModelOpt checkpoints (quant_method 'modelopt') are")
    return qc


def linear_formats(inner: Mapping | None, linears: Iterable[str], *, family: str,
                   canonical: Callable[[str], str] = lambda m: m,
                   never_quantized: tuple[str, ...] = ()) -> dict[str, LinearFormat]:
    """The stored weight format of every quantized linear.

    Args:
        inner: :func:`modelopt_quantization`'s dict (None: nothing quantized).
        linears: the model's linear module names (HF names without ``.weight``).
        family: the model family's name for messages.
        canonical: maps a module name as the config writes it (e.g. transformers'
            in-memory ``model.`` prefix) to the checkpoint's name.
        never_quantized: substrings of modules an engine never quantizes
            (LM head, router), whatever the config says.

    Returns:
        linear name -> :class:`LinearFormat` (``stored=True``), quantized linears only.

    Raises:
        SpecError: an algorithm we have no format for (names it and the module).
    """
    if inner is None:
        return {}
    algo = str(inner.get("quant_algo") or "").upper()
    exclude = list(inner.get("exclude_modules") or inner.get("ignore") or [])
    table = inner.get("quantized_layers") or {}

    def matches(module: str, pattern: str) -> bool:
        pattern = canonical(pattern)
        return (module == pattern or module.startswith(pattern + ".") or fnmatch.fnmatchcase(module, pattern)
                or fnmatch.fnmatchcase(module, pattern + ".*"))

    def algo_of(module: str) -> str | None:
        if any(k in module for k in never_quantized):
            return None
        if algo == "MIXED_PRECISION":
            hits = [str(v.get("quant_algo", "")).upper() for k, v in table.items() if matches(module, k)]
            return hits[-1] if hits else None
        if any(matches(module, p) for p in exclude):
            return None
        return algo

    if algo != "MIXED_PRECISION" and algo not in MODELOPT_ALGOS:
        raise SpecError(f"{family} ModelOpt quant_algo={algo or None!r} is not supported; supported: "
                        f"{sorted(MODELOPT_ALGOS)} or MIXED_PRECISION with a quantized_layers table of those")
    out: dict[str, LinearFormat] = {}
    for module in linears:
        a = algo_of(module)
        if a is None:
            continue
        fmt = MODELOPT_ALGOS.get(a)
        if fmt is None:
            raise SpecError(f"{family} checkpoint quantizes {module} with {a}; supported algorithms: "
                            f"{sorted(MODELOPT_ALGOS)}")
        out[module] = fmt
    return out


def kv_cache_algo(inner: Mapping | None) -> str | None:
    """``kv_cache_quant_algo`` of :func:`modelopt_quantization`'s dict, upper-case, or None."""
    kv = (inner or {}).get("kv_cache_quant_algo")
    return str(kv).upper() if kv else None
