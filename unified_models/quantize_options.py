"""``unified-models quantize``: the ModelOpt flags (``--experts``, ``--mamba-proj``, ``--kv-cache``) filled
in, and what cannot be written refused before anything is calibrated or written.

The rule is that of every export: it must run in both engines (vLLM and the trainer). Whether a
family's quantized checkpoint does is asked of the loaders' own declaration
(:func:`~unified_models.converters.quantize_support.check_export_reads_back`), not of a list here.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .dsl import UnifiedModelsError

if TYPE_CHECKING:  # pragma: no cover
    from .dsl import ModelSpec

QUANTIZE_WRITES = ("Nemotron-H in NVIDIA ModelOpt's format (NVFP4 experts, FP8 Mamba projections, FP8 KV "
                   "cache); DeepSeek-V4 as DeepSeek's block-FP8 checkpoint (W8A8, 128x128 ue8m0 blocks)")
"""What ``quantize`` writes (its help, and the refusal of a family whose quantized checkpoints do not load)."""

FLAGS = {
    "experts": ("--experts", "nvfp4", "routed experts (MoE layers, 'E')",
                "the NVFP4 recipe, which quantizes only the non-gated relu2 experts of Nemotron-H MoE layers "
                "(MoESpec); gated (SwiGLU) experts stay in the model dtype"),
    "mamba_proj": ("--mamba-proj", "fp8", "Mamba-2 layers ('M')",
                   "the FP8 recipe of Mamba-2 in_proj/out_proj (Mamba2Spec)"),
    "kv_cache": ("--kv-cache", "fp8", "attention layers ('*')",
                 "the FP8 KV-cache recipe of attention layers (AttentionSpec)")}
"""``QuantizationOptions`` field -> (flag, default, what it needs in the model, the recipe that covers it)."""


def modelopt_options(args) -> "ModelSpec":
    """Fill the Nemotron-H ``quantize`` flags and refuse what cannot be written; returns the spec.

    Refused first, before anything is calibrated or written: an attention-free pattern (as
    ``check`` refuses it), a source that is already quantized, and a family whose quantized
    checkpoint the project could not run in both engines: the ``config.json`` the export would
    write is read back through the loaders' own declaration
    (:func:`~.converters.quantize_support.check_export_reads_back`; Qwen3 and Qwen3-MoE refuse
    it). Then a flag given explicitly that matches nothing in the model is refused, and a
    default that matches nothing is dropped (set to ``"none"``) with a note giving the reason
    (no such layers, or layers its recipe does not cover).

    Raises:
        CheckpointError: the source is already quantized (named as the reason).
        SpecError: the config does not build a spec (named with its file); no attention layer;
            the family's declaration refuses the quantized config (names the family and what
            ``quantize`` writes).
        UnifiedModelsError: a given flag matches nothing (named, with the reason); nothing
            would be quantized.
    """
    import json
    from pathlib import Path

    from .backends.vllm.settings import check_spec_supported
    from .converters.hf_safetensors import load_hf_config
    from .converters.modelopt import export_config_json, options_without_effect, quantized_spec
    from .converters.quantize_support import check_export_reads_back, check_model_dtype_source
    from .dsl import SpecError
    from .layers.quantization import QuantizationOptions
    from .models import spec_from_hf_config

    try:
        config = load_hf_config(args.src)
        spec = spec_from_hf_config(config)
    except SpecError as e:
        raise type(e)(f"{args.src}/config.json: {e}") from None
    try:
        check_spec_supported(spec)
    except SpecError as e:
        raise SpecError(f"quantize {args.src}: {e}; a quantized copy could not be run by check or rl") from None
    check_model_dtype_source(config, spec, source=f"quantize: {args.src}")
    given = {k for k in FLAGS if getattr(args, k) is not None}
    for k, (_, default, _, _) in FLAGS.items():
        if getattr(args, k) is None:
            setattr(args, k, default)
    chosen = {k: getattr(args, k) for k in FLAGS if getattr(args, k) != "none"}
    idle = options_without_effect(spec, QuantizationOptions(**chosen))
    applied = QuantizationOptions(**{k: v for k, v in chosen.items() if k not in idle})
    qspec = quantized_spec(spec, applied)
    src_config = json.loads((Path(args.src) / "config.json").read_text())
    try:
        check_export_reads_back(export_config_json(src_config, qspec, kv_cache_fp8=bool(applied.kv_cache)), qspec,
                                source=str(args.src))
    except SpecError as e:
        raise SpecError(f"quantize {e}; supported by quantize: {QUANTIZE_WRITES}") from None
    explicit = [k for k in idle if k in given]
    if explicit:
        k = explicit[0]
        flag = FLAGS[k][0]
        raise UnifiedModelsError(f"quantize: {flag} {getattr(args, k)} matches nothing: "
                                 f"{_idle_reason(args.src, spec, k)}; pass {flag} none or leave it out")
    for k in idle:
        flag, default, _, _ = FLAGS[k]
        print(f"note: {flag} {default} (default) not applied: {_idle_reason(args.src, spec, k)}", file=sys.stderr)
        setattr(args, k, "none")
    pattern = spec.extra.get("pattern", "?")
    if all(getattr(args, k) == "none" for k in FLAGS):
        raise UnifiedModelsError(f"quantize: nothing to quantize in {args.src} (pattern {pattern!r}) with "
                                 + ", ".join(f"{f} {getattr(args, k)}" for k, (f, _, _, _) in FLAGS.items())
                                 + "; the output would be a copy of the source")
    return spec


def _idle_reason(src: str, spec: "ModelSpec", option: str) -> str:
    """Why the export option ``option`` changes nothing in ``spec``: the model has no layers of its
    kind, or it has some (named: layer indices and spec types) that its recipe does not cover."""
    from .converters.quantize_support import layers_of_kind

    _, _, needs, recipe = FLAGS[option]
    head = f"{src} (pattern {spec.extra.get('pattern', '?')!r})"
    present = layers_of_kind(spec, option)
    if not present:
        return f"{head} has no {needs}"
    kinds = sorted({type(m).__name__ + (f", {act} activation" if (act := getattr(m, "activation", None)
                                                                  or getattr(m, "hidden_act", None)) else "")
                    for _, m in present})
    layers = ", ".join(str(i) for i in sorted({i for i, _ in present}))
    return f"{head}: its {needs.split(' (')[0]} (layers {layers}: {'; '.join(kinds)}) are not covered by {recipe}"
