"""NVIDIA ModelOpt checkpoint format: validate, dequantize to masters, quantize masters, export.

A ModelOpt-format Nemotron-H checkpoint (published NVFP4 hybrids; what
:func:`export_modelopt` writes) stores, next to the model-dtype tensors:

* routed experts, NVFP4 (``ops.nvfp4``): ``experts.{e}.{up,down}_proj.weight``
  uint8 ``[N, K/2]``, ``weight_scale`` float8_e4m3fn ``[N, K/16]``,
  ``weight_scale_2`` fp32 ``[]`` (+ ``input_scale`` fp32 ``[]`` for a W4A4
  ``NVFP4`` export; our kernels are W4A16 and only validate it);
* Mamba ``in_proj``/``out_proj``, FP8 W8A8 (``ops.fp8``): ``weight``
  float8_e4m3fn ``[N, K]``, ``weight_scale`` fp32 ``[]``, ``input_scale`` fp32 ``[]``;
* FP8 KV cache: ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale`` fp32 ``[]``;
* ``hf_quant_config.json`` and ``config.json``'s ``quantization_config``
  (``quant_method: modelopt``, ``quant_algo: MIXED_PRECISION`` with a
  ``quantized_layers`` table, ``kv_cache_quant_algo``).

Masters vs stored format. Rollout and the trainer's recompute use the stored
tensors as they are (both engines hold the same codes). A trainer that trains
keeps model-dtype masters (:func:`master_spec` / :func:`dequantize_state_dict`)
and quantizes them on every forward by the same rule that
:func:`quantize_state_dict` uses to write the engine's (or an exported
checkpoint's) codes, so after a weight sync both sides hold the same codes
again. Dequantize-then-requantize is NOT the identity (the per-tensor scales
are recomputed from the rounded masters): training from a ModelOpt checkpoint
must sync the masters into the engine before its first rollout.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import torch

from ..dsl import CheckpointError, ModelSpec, SpecError
from ..layers import family_of
from ..dsl.weights import FORMAT_LAYOUTS, LinearFormat
from ..layers.quantization import QuantizationOptions, check_weight_formats, quantizable_linears
from ..layers.weight_formats import format_rules, linear_fields
from ..paths import check_destination
from .hf_safetensors import save_state_dict, spec_and_state_dict
from .megatron_dist_ckpt import atomic_output_dir
from .quantize_support import check_export_reads_back, check_model_dtype_source
from .quantized import validate_quantized

PRODUCER = {"name": "modelopt", "version": "0.47.0"}
"""What :func:`export_modelopt` writes as ``producer`` (the ModelOpt release whose rules ops/ transcribe)."""


# ----------------------------------------------------------------------------- masters <-> stored format

def _map_quantized_mixers(spec: ModelSpec, fn) -> ModelSpec:
    """``spec`` with every mixer whose family has quantization rules replaced by ``fn(rules, mixer)``."""
    def one(m):
        rules = family_of(m).quantization
        return m if rules is None else fn(rules, m)

    return spec.map_mixers(one)


def master_spec(spec: ModelSpec) -> ModelSpec:
    """The same model with model-dtype master weights (what a trainer trains): every stored
    weight format becomes its master form (:meth:`~unified_models.dsl.weights.LinearFormat.master`);
    the quantization recipes (NVFP4 experts, FP8 projections, FP8 KV) are kept."""
    return spec.replace(weight_formats=tuple((n, f.master()) for n, f in spec.weight_formats))


def dequantized_spec(spec: ModelSpec) -> ModelSpec:
    """The plain model-dtype model a quantized checkpoint stands for: every weight
    dequantized, no activation or KV quantization (what transformers runs when
    handed the dequantized weights; the peer check's common ground)."""
    return _map_quantized_mixers(spec.replace(weight_formats=()), lambda rules, m: rules.dequantized(m))


def write_dequantized_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the :func:`dequantized_spec` model of a ModelOpt checkpoint as a plain
    model-dtype HF checkpoint (config without ``quantization_config``), e.g. for
    transformers, which has no kernels for the stored codes.

    Raises:
        CheckpointError / SpecError: as :func:`~.hf_safetensors.spec_and_state_dict`.
    """
    _, spec, state = spec_and_state_dict(model_dir)
    plain = dequantized_spec(spec)
    masters = dequantize_state_dict(state, spec)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg.pop("quantization_config", None)
    return save_state_dict({n: masters[n] for n in plain.parameter_shapes()}, out_dir, config_json=cfg).parent


def dequantize_state_dict(state: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Stored tensors -> the master state dict of :func:`master_spec` (model dtype).

    Each stored linear is dequantized by its format's rule (NVFP4 by ModelOpt's
    ``NVFP4QTensor.dequantize``, FP8 as ``dtype(fp32(e4m3) * weight_scale)``);
    its scales are dropped except an ``input_scale`` the master form keeps
    (FP8: static, calibrated); KV scales are kept.
    """
    out = dict(state)
    for name, fmt in spec.weight_formats:
        if not fmt.stored:
            continue
        fields = linear_fields(fmt)
        stored = {f: state[f"{name}.{f}"] for f in fields}
        for f in fields:
            out.pop(f"{name}.{f}")
        out[f"{name}.weight"] = format_rules(fmt).dequantize(stored, spec.dtype)
        if fmt.master().input_scale:
            out[f"{name}.input_scale"] = stored["input_scale"]
    return out


def quantize_state_dict(masters: Mapping[str, torch.Tensor], spec: ModelSpec,
                        only: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Master tensors -> the stored tensors of ``spec`` (its stored weight formats), by the shared rules.

    The same functions the trainer's forward applies to its masters:
    ``ops.nvfp4_quantize`` per expert (each expert its own ``weight_scale_2``:
    Nemotron-H experts are not gated) and ``ops.fp8_quantize_weight`` with
    ``ops.fp8_weight_scale``. Non-quantized tensors and static input scales pass
    through. The calibrated ``input_scale`` of an NVFP4 W4A4 export has no master
    and is not written.

    Args:
        masters: HF name -> model-dtype tensor (names of :func:`master_spec`).
        spec: the stored-format spec.
        only: restrict the output to the stored tensors derived from these master names.

    Returns:
        HF name -> tensor in the stored dtype of ``spec``.
    """
    wanted = set(only) if only is not None else set(masters)
    out: dict[str, torch.Tensor] = {}
    derived: set[str] = set()
    for name, fmt in spec.weight_formats:
        if not fmt.stored:
            continue
        w = f"{name}.weight"
        derived.add(w)
        if w in wanted:
            out.update({f"{name}.{f}": t for f, t in format_rules(fmt).quantize(masters[w]).items()})
    for n, t in masters.items():
        if n in wanted and n not in derived:
            out[n] = t
    return out


# ----------------------------------------------------------------------------- export

def quant_config_dict(spec: ModelSpec, *, kv_cache_fp8: bool) -> dict:
    """ModelOpt's ``quantization`` block for a spec: ``MIXED_PRECISION`` with a
    ``quantized_layers`` table (one entry per formatted linear: its format's
    ``quant_algo`` and extra fields, e.g. NVFP4 ``group_size`` 16),
    ``kv_cache_quant_algo`` FP8 or None.

    Raises:
        SpecError: a format ModelOpt does not write (block-FP8)."""
    layers: dict[str, dict] = {}
    for name, fmt in spec.weight_formats:
        rules = format_rules(fmt)
        if rules.modelopt_algo is None:
            raise SpecError(f"{name}: weight format {fmt.format!r} has no ModelOpt quant_algo; a ModelOpt "
                            "export cannot write it")
        layers[name] = {"quant_algo": rules.modelopt_algo(fmt), **dict(rules.modelopt_entry)}
    return {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8" if kv_cache_fp8 else None,
            "quantized_layers": layers}


def export_config_json(src_config: Mapping, qspec: ModelSpec, *, kv_cache_fp8: bool) -> dict:
    """The ``config.json`` an export of ``qspec`` writes: the source's with ModelOpt's
    ``quantization_config`` (``quant_method: modelopt`` and :func:`quant_config_dict`).

    Raises:
        SpecError: as :func:`quant_config_dict`."""
    return {**src_config, "quantization_config": {"quant_method": "modelopt",
                                                  **quant_config_dict(qspec, kv_cache_fp8=kv_cache_fp8)}}


def quantized_spec(spec: ModelSpec, options: QuantizationOptions) -> ModelSpec:
    """The stored-format spec an export with ``options`` writes: each quantizable linear whose
    export role (:func:`~unified_models.layers.quantization.quantizable_linears`) is set in
    ``options`` gets that format (FP8 with its static input scale), and each family's
    non-weight rules apply (FP8 KV cache).

    Raises:
        SpecError: a combination the families refuse.
    """
    formats: dict[str, LinearFormat] = {}
    for name, role in quantizable_linears(spec).items():
        fmt = getattr(options, role, None)
        if fmt:
            formats[name] = LinearFormat(fmt, stored=True, input_scale=FORMAT_LAYOUTS[fmt].input_scale_required)
    qspec = _map_quantized_mixers(spec.with_weight_formats(formats), lambda rules, m: rules.quantized(m, options))
    check_weight_formats(qspec)
    return qspec


def options_without_effect(spec: ModelSpec, options: QuantizationOptions) -> list[str]:
    """The fields of ``options`` (``experts``, ``mamba_proj``, ``kv_cache``) that are set but
    change nothing in ``spec`` (e.g. ``experts="nvfp4"`` on a model without routed experts).

    Each set field is tried alone: it has an effect when :func:`quantized_spec` with only
    that field differs from ``spec``.

    Raises:
        SpecError: as :func:`quantized_spec`.
    """
    idle = []
    for name in ("experts", "mamba_proj", "kv_cache"):
        value = getattr(options, name)
        if value is not None and quantized_spec(spec, QuantizationOptions(**{name: value})) == spec:
            idle.append(name)
    return idle


def _calibrate(model_dir: Path, spec: ModelSpec, token_ids: list[list[int]], options: QuantizationOptions
               ) -> dict[str, torch.Tensor]:
    """ModelOpt "max" calibration on transformers' model: fp32 ``amax / 448`` of every Mamba
    in/out projection input (``input_scale``) and of every attention k/v projection output
    (``k_scale`` / ``v_scale``, as ModelOpt's ``k_bmm_quantizer``/``v_bmm_quantizer``; Nemotron-H
    attention has no RoPE, so the cached K is ``k_proj``'s output)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=spec.dtype)
    model.eval()
    amax: dict[str, torch.Tensor] = {}

    def track(name: str, t: torch.Tensor) -> None:
        a = t.detach().abs().amax().float()
        amax[name] = torch.maximum(amax[name], a) if name in amax else a

    hooks = []
    for blk in spec.sublayers:
        m = blk.mixer
        mod = model.get_submodule(m.name.replace("backbone.", "model.", 1)) if not hasattr(model, "backbone") \
            else model.get_submodule(m.name)
        rules = family_of(m, blk.index).quantization
        if rules is not None:
            hooks += rules.calibration_hooks(m, mod, options, track)
    try:
        with torch.no_grad():
            for ids in token_ids:
                model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    scales = {}
    for n, a in amax.items():
        if not bool(torch.isfinite(a)) or float(a) <= 0:
            raise CheckpointError(f"calibration gave amax {float(a)} for {n}; cannot derive an FP8 scale")
        scales[n] = (a / 448.0).reshape(())
    return scales


def export_modelopt(src_dir: str | os.PathLike, out_dir: str | os.PathLike, *, experts: str | None = "nvfp4",
                    mamba_proj: str | None = "fp8", kv_cache: str | None = "fp8",
                    calibration_token_ids: list[list[int]] | None = None, overwrite: bool = False) -> Path:
    """Write a bf16 Nemotron-H checkpoint in ModelOpt's quantized format (what NVIDIA publishes).

    Args:
        src_dir: HF checkpoint with model-dtype weights (no quantization_config).
        out_dir: the new checkpoint directory (config.json, hf_quant_config.json,
            model.safetensors, tokenizer files copied).
        experts: ``"nvfp4"`` (W4A16_NVFP4 routed experts) or None.
        mamba_proj: ``"fp8"`` (W8A8 Mamba in/out projections; needs calibration) or None.
        kv_cache: ``"fp8"`` (FP8 KV cache scales; needs calibration) or None.
        calibration_token_ids: prompts (token ids) for ModelOpt's "max"
            calibration of the static input and KV scales, run on transformers'
            model; required when ``mamba_proj`` or ``kv_cache`` is set.
        overwrite: replace an existing ``out_dir``.

    Returns:
        ``out_dir``. Written in a temporary directory and renamed into place (an
        existing ``out_dir`` is renamed aside first and removed only after): an error
        leaves nothing behind and no half-deleted destination.

    Raises:
        CheckpointError: source already quantized, bad source, ``out_dir``
            exists without ``overwrite``, calibration missing or degenerate.
        SpecError: widths not divisible by the NVFP4 block (16); a family whose declaration
            refuses (or misreads) the quantized ``config.json`` (e.g. Qwen3: the project could
            not run the export; :func:`~.quantize_support.check_export_reads_back`), before
            calibration.
        UnifiedModelsError: ``out_dir`` is ``src_dir``, holds it or lies inside it.
    """
    check_destination(src_dir, out_dir, src_name="the source checkpoint", dst_name="the output")
    src, dst = Path(src_dir), Path(out_dir)
    for what, v, ok in (("experts", experts, ("nvfp4", None)), ("mamba_proj", mamba_proj, ("fp8", None)),
                        ("kv_cache", kv_cache, ("fp8", None))):
        if v not in ok:
            raise SpecError(f"export_modelopt: {what}={v!r}; choose from {ok}")
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst} exists; pass overwrite=True (CLI --overwrite) to replace it")
    config, spec, masters = spec_and_state_dict(src)
    check_model_dtype_source(config, spec, source=str(src))
    if (mamba_proj or kv_cache) and not calibration_token_ids:
        raise CheckpointError("export_modelopt: FP8 input/KV scales need calibration_token_ids (static scales, "
                              "ModelOpt 'max' calibration)")
    options = QuantizationOptions(experts=experts, mamba_proj=mamba_proj, kv_cache=kv_cache)
    qspec = quantized_spec(spec, options)
    cfg = export_config_json(json.loads((src / "config.json").read_text()), qspec, kv_cache_fp8=bool(kv_cache))
    check_export_reads_back(cfg, qspec, source=str(src))
    scales = _calibrate(src, qspec, calibration_token_ids or [], options) if (mamba_proj or kv_cache) else {}
    stored = quantize_state_dict({**masters, **scales}, qspec)
    missing = [n for n in qspec.parameter_shapes() if n not in stored]
    if missing:
        raise CheckpointError(f"export_modelopt: calibration did not reach {missing[:5]} (no calibration "
                              "token reached these layers?)")
    stored = {n: stored[n] for n in qspec.parameter_shapes()}
    validate_quantized(stored, qspec, source=str(dst))
    qc = quant_config_dict(qspec, kv_cache_fp8=bool(kv_cache))
    with atomic_output_dir(dst, overwrite) as tmp:
        for f in src.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                    "config.json", "model.safetensors.index.json", "hf_quant_config.json"):
                shutil.copy(f, tmp / f.name)
        save_state_dict(stored, tmp, config_json=cfg)
        (tmp / "hf_quant_config.json").write_text(json.dumps({"producer": PRODUCER, "quantization": qc}, indent=2))
    return dst
