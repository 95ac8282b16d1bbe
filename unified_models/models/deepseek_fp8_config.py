"""Weight formats per linear from DeepSeek's block-FP8 ``quantization_config`` (DeepSeek-V3.1+/V4).

DeepSeek's checkpoints say how they are quantized in ``config.json``::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"}

(DeepSeek-V4-Flash / -Flash-Base ``config.json``; ``../shared/reference/architectures.md`` 2.1).
That is W8A8 block-FP8: each quantized linear ``[N, K]`` stores float8_e4m3fn codes and one
power-of-two (ue8m0) scale per 128 x 128 block, activations are quantized per token in 1 x 128
tiles at run time: the ``fp8_block`` weight format (:mod:`unified_models.dsl.weights`,
:mod:`unified_models.ops.fp8_block`). Which linears carry it is not in the config: it is the
published model's rule (DeepSeek's ``inference/model.py``: every ``Linear`` without an explicit
``dtype`` takes the FP8 default; vLLM 0.32 ``vllm/models/deepseek_v4/quant_config.py``
``DeepseekV4FP8Config`` quantizes every linear built with ``quant_config``), minus the modules a
skip list names (``modules_to_not_convert``, transformers' ``FineGrainedFP8Config`` and vLLM's
``Fp8Config``; ``ignored_layers``, vLLM's alias). What the families can run in that format is
their check (:func:`unified_models.layers.quantization.check_weight_formats`), not this module's.

Declarations only: no kernels, no engine imports.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..dsl import SpecError
from .modelopt_config import QUANT_CONFIG_ATTR

FORMAT = "fp8_block"
"""The weight format a DeepSeek block-FP8 linear has (:data:`unified_models.dsl.weights.FORMAT_LAYOUTS`)."""

REQUIRED: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
"""The published ``quantization_config`` (every key required, every value exactly this)."""

SKIP_KEYS = ("modules_to_not_convert", "ignored_layers")
"""Skip lists: module names (or ``fnmatch`` patterns, or prefixes of them) stored unquantized."""

NEUTRAL: dict[str, Any] = {"dequantize": False, "modules_to_convert": None, "moe_quant_algo": None}
"""Keys transformers' ``FineGrainedFP8Config.to_dict`` / vLLM may write, accepted only with these
values (``dequantize`` True, ``modules_to_convert`` (FP8 embeddings) or an NVFP4 ``moe_quant_algo``
would change what the tensors mean)."""

EXPERT_DTYPES = {"fp8": "block-FP8 routed experts, float32 scale containers (DeepSeek-V4-Flash-Base)",
                 "fp4": "MXFP4 routed experts (e2m1 codes, e8m0 scale per 32; W4A8), e8m0 scale containers "
                        "(DeepSeek-V4-Flash)"}
"""``expert_dtype`` values of a quantized config this declaration reads."""

WRITTEN_EXPERT_DTYPE = "fp8"
"""The ``expert_dtype`` :func:`quantization_config_dict`'s checkpoints carry (vLLM then reads float32
``.scale`` containers, as for the Flash-Base checkpoints)."""


@dataclass(frozen=True)
class DeepseekFP8Quantization:
    """A checkpoint's block-FP8 quantization, as read by :func:`deepseek_fp8_quantization`.

    Attributes:
        skip: the skip-list entries (as written; matched by :meth:`skipped`).
        expert_dtype: the config's ``expert_dtype`` (``"fp8"``: block-FP8 routed experts; ``"fp4"``:
            MXFP4 routed experts).
    """

    skip: tuple[str, ...] = ()
    expert_dtype: str = WRITTEN_EXPERT_DTYPE

    def skipped(self, module: str) -> bool:
        """True when ``module`` (a canonical linear name, e.g. ``model.layers.0.attn.wo_a``, or an
        MTP name ``mtp.0.e_proj``) is named by the skip list: the entry itself, a prefix of it
        (``model.layers.0.ffn.experts``), or an ``fnmatch`` pattern; an entry may use DeepSeek's
        published names (``layers.0.attn.wo_a``, with or without ``model.``)."""
        for raw in self.skip:
            for entry in _canonical_entries(raw):
                if (module == entry or module.startswith(entry + ".") or fnmatch.fnmatchcase(module, entry)
                        or fnmatch.fnmatchcase(module, entry + ".*")):
                    return True
        return False


def _canonical_entries(entry: str) -> tuple[str, ...]:
    """A skip entry in canonical form(s): published ``layers.{i}.`` gets the ``model.`` prefix."""
    e = entry[:-len(".weight")] if entry.endswith(".weight") else entry
    if e.startswith("layers.") or e.startswith("*layers."):
        return (e, "model." + e)
    return (e,)


def raw_quantization_config(config: Any) -> dict | None:
    """The ``quantization_config`` dict of ``config`` (or the one an engine moved to
    :data:`~unified_models.models.modelopt_config.QUANT_CONFIG_ATTR`), or None.

    Raises:
        SpecError: a value that is not a mapping.
    """
    qc = getattr(config, "quantization_config", None) or getattr(config, QUANT_CONFIG_ATTR, None)
    if qc is None:
        return None
    if hasattr(qc, "to_dict") and not isinstance(qc, Mapping):
        qc = qc.to_dict()
    if not isinstance(qc, Mapping):
        raise SpecError(f"DeepseekV4 config: quantization_config of type {type(qc).__name__} is not a mapping")
    return dict(qc)


def deepseek_fp8_quantization(config: Any) -> DeepseekFP8Quantization | None:
    """Read a DeepSeek-V4 config's block-FP8 ``quantization_config`` (None: an unquantized checkpoint).

    Args:
        config: a ``DeepseekV4Config`` (either layout; its ``quantization_config`` or
            ``unified_models_quantization_config`` attribute and its ``expert_dtype``).

    Returns:
        The skip list and expert dtype, or None when the config has no quantization_config.

    Raises:
        SpecError: naming the key: another ``quant_method`` (only DeepSeek's ``fp8``), ``fmt``
            (only ``e4m3``), ``scale_fmt`` (only ``ue8m0``; float scales are DeepSeek-V3's),
            ``weight_block_size`` (only ``[128, 128]``), ``activation_scheme`` (only ``dynamic``:
            a static activation scale has no tensor here), a missing one of those, an unknown
            key, ``dequantize`` / ``modules_to_convert`` / ``moe_quant_algo`` set, a skip list that
            is not a list of strings, or ``expert_dtype`` other than ``fp8`` / ``fp4`` (missing: vLLM
            would read MXFP4 experts, DeepSeek's reference FP8 ones).
    """
    qc = raw_quantization_config(config)
    if qc is None:
        return None
    for key, want in REQUIRED.items():
        if key not in qc:
            raise SpecError(f"DeepseekV4 config: quantization_config has no {key!r}; DeepSeek's block-FP8 "
                            f"checkpoints say {key}={want!r}")
        got = list(qc[key]) if key == "weight_block_size" and isinstance(qc[key], (list, tuple)) else qc[key]
        if isinstance(got, str) and isinstance(want, str):
            ok = got.lower() == want
        else:
            ok = got == want
        if not ok:
            raise SpecError(f"DeepseekV4 config: quantization_config {key}={qc[key]!r} is not supported; only "
                            f"{want!r} (DeepSeek's block-FP8 W8A8: e4m3 codes, ue8m0 scales per 128x128 block, "
                            "dynamic 1x128 activation tiles)")
    for key, want in NEUTRAL.items():
        if key in qc and qc[key] not in (None, want, ""):
            raise SpecError(f"DeepseekV4 config: quantization_config {key}={qc[key]!r} is not supported; only "
                            f"{want!r} (or absent)")
    unknown = sorted(set(qc) - set(REQUIRED) - set(NEUTRAL) - set(SKIP_KEYS))
    if unknown:
        raise SpecError(f"DeepseekV4 config: quantization_config key(s) {unknown} are not understood; refusing "
                        "rather than ignoring them")
    skip: list[str] = []
    for key in SKIP_KEYS:
        v = qc.get(key)
        if v is None:
            continue
        if isinstance(v, str) or not isinstance(v, Iterable) or not all(isinstance(e, str) for e in v):
            raise SpecError(f"DeepseekV4 config: quantization_config {key}={v!r} must be a list of module names")
        skip += list(v)
    ed = getattr(config, "expert_dtype", None)
    if ed not in EXPERT_DTYPES:
        raise SpecError(f"DeepseekV4 config: expert_dtype={ed!r} with a block-FP8 quantization_config; supported: "
                        f"{sorted(EXPERT_DTYPES)} (a missing expert_dtype is read as 'fp4' by vLLM, as FP8 by "
                        "DeepSeek's reference: say which)")
    return DeepseekFP8Quantization(skip=tuple(skip), expert_dtype=ed)


def quantization_config_dict(skip: Iterable[str] = ()) -> dict:
    """The ``quantization_config`` a block-FP8 checkpoint written here carries: :data:`REQUIRED`, plus
    ``modules_to_not_convert`` (sorted) when some published-FP8 linears are stored unquantized."""
    out = dict(REQUIRED)
    out["weight_block_size"] = list(REQUIRED["weight_block_size"])
    skip = sorted(set(skip))
    if skip:
        out["modules_to_not_convert"] = skip
    return out
