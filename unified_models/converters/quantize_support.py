"""What a quantized export may be written from and whether it would run, decided before it is written.

Exports must run in both engines (vLLM and the trainer), and both read a checkpoint
through one declaration: :func:`~.hf_safetensors.load_hf_config`, then the family's
:func:`unified_models.models.spec_from_hf_config`. Whether a family's quantized
checkpoints are supported is therefore asked of that declaration, not of a list kept
here: :func:`check_export_reads_back` reads the ``config.json`` an export would write
through it (a family that refuses quantized checkpoints, as Qwen3's does, refuses it
here) and compares the model read with the one the export meant to write.
:func:`check_model_dtype_source` refuses a source that is already quantized, and
:func:`layers_of_kind` lists the layers an export option addresses whether or not its
recipe covers them, so a note can give the real reason an option changed nothing.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Mapping

from ..caches import PagedKVCache
from ..dsl import CheckpointError, Mamba2Spec, ModelSpec, SpecError
from ..layers import family_of

__all__ = ["check_export_reads_back", "check_model_dtype_source", "layers_of_kind"]


def check_model_dtype_source(config: Any, spec: ModelSpec, *, source: str) -> None:
    """Refuse a source checkpoint that is already quantized (an export quantizes model-dtype masters).

    Args:
        config: the source's transformers config.
        spec: its spec (:func:`unified_models.models.spec_from_hf_config`).
        source: how messages name the source.

    Raises:
        CheckpointError: stored quantized weights or a ``quantization_config``; the message says
            so, with the stored formats and the quantization method.
    """
    qc = getattr(config, "quantization_config", None)
    formats = sorted({f.format for _, f in spec.weight_formats if f.stored})
    if not formats and not qc:
        return
    method = qc.get("quant_method") if isinstance(qc, Mapping) else getattr(qc, "quant_method", None)
    what = [f"weights stored as {', '.join(formats)}"] if formats else []
    what += [f"config.json quantization_config (quant_method {method!r})"] if qc else []
    raise CheckpointError(f"{source} is already quantized ({'; '.join(what)}); quantize takes a model-dtype "
                          "checkpoint: quantize the model-dtype checkpoint it was made from")


def check_export_reads_back(config_json: Mapping, qspec: ModelSpec, *, source: str) -> None:
    """Refuse an export the project could not run: read the ``config.json`` it would write
    (``config_json``) through the loaders' declaration and compare the model with ``qspec``.

    The config is written to a temporary directory (never the destination) and read with
    :func:`~.hf_safetensors.load_hf_config` and :func:`unified_models.models.spec_from_hf_config`,
    as ``check``, ``rl`` and ``convert`` read a checkpoint.

    Raises:
        SpecError: the declaration refuses the config (names the family, ``source`` and the
            declaration's reason, e.g. "quantized Qwen3 checkpoints are not supported"), or it
            reads back other layers or weight formats than ``qspec`` (the first difference named).
    """
    from ..models import spec_from_hf_config
    from .hf_safetensors import load_hf_config

    family = config_json.get("model_type")
    with tempfile.TemporaryDirectory(prefix="unified_models_export_") as d:
        (Path(d) / "config.json").write_text(json.dumps(dict(config_json)))
        try:
            back = spec_from_hf_config(load_hf_config(d))
        except (SpecError, CheckpointError) as e:
            why = str(e).replace(f"{d}/config.json", "its config.json")
            raise SpecError(f"{source}: quantized {family} checkpoints cannot be run by check or rl (the "
                            f"{family} declaration refuses the quantized config.json: {why})") from None
    differs = _first_difference(back, qspec)
    if differs:
        raise SpecError(f"{source}: the {family} declaration reads a quantized config.json back as another "
                        f"model ({differs}); check and rl would not run what was quantized")


def _first_difference(back: ModelSpec, want: ModelSpec) -> str | None:
    """The first layer or linear whose spec or weight format differs, or None."""
    got, wanted = dict(back.weight_formats), dict(want.weight_formats)
    for name in sorted(set(got) | set(wanted)):
        if got.get(name) != wanted.get(name):
            return f"{name}: weight format {got.get(name)} read, {wanted.get(name)} written"
    if len(back.blocks) != len(want.blocks):
        return f"{len(back.blocks)} layers read, {len(want.blocks)} written"
    for b, w in zip(back.blocks, want.blocks):
        if b != w:
            return f"layer {w.index} differs"
    return None


def _has_paged_kv(m: Any, dtype: Any) -> bool:
    return any(isinstance(c, PagedKVCache) for c in family_of(m).caches(m, dtype).values())


_KINDS = {
    "experts": lambda m, dtype: hasattr(m, "n_routed_experts"),
    "mamba_proj": lambda m, dtype: isinstance(m, Mamba2Spec),
    "kv_cache": _has_paged_kv,
}
"""Export option -> whether a mixer is of the kind it addresses (routed experts, Mamba-2
mixers, attention with a paged KV cache), whatever its family's quantization rules."""


def layers_of_kind(spec: ModelSpec, option: str) -> list[tuple[int, Any]]:
    """``(layer index, mixer spec)`` of every sublayer of the kind that the export option
    ``option`` (a :class:`~unified_models.layers.quantization.QuantizationOptions` field)
    addresses, covered by its recipe or not: routed experts of any MoE spec, Mamba-2 mixers,
    attention layers with a paged KV cache.

    Raises:
        KeyError: an unknown option.
    """
    kind = _KINDS[option]
    return [(sub.index, sub.mixer) for sub in spec.sublayers if kind(sub.mixer, spec.dtype)]
