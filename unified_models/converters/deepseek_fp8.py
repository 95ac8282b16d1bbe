"""Write a block-FP8 DeepSeek-V4 checkpoint from a bf16 one (``unified-models quantize`` on a DeepSeek-V4 source).

The output is DeepSeek's published block-FP8 checkpoint format (W8A8: e4m3 codes and one ue8m0
scale per 128 x 128 block, dynamic 1 x 128 activation tiles; ``quantization_config {quant_method:
fp8, fmt: e4m3, scale_fmt: ue8m0, weight_block_size: [128, 128], activation_scheme: dynamic}``,
``expert_dtype: fp8``), in either layout:

* ``layout="official"`` (default): DeepSeek's published names, ``<linear>.weight`` float8_e4m3fn
  and ``<linear>.scale`` float32 power-of-two containers (as DeepSeek-V4-Flash-Base; vLLM 0.32's
  ``DeepseekV4FP8Config`` reads float32 scales for ``expert_dtype: fp8``);
* ``layout="hf"``: transformers' names, ``<linear>.weight_scale_inv`` float8_e8m0fnu.

Which linears: the published block-FP8 set (:func:`unified_models.models.deepseek_v4.published_fp8_linears`)
restricted to those the layer families run in ``fp8_block`` today
(:func:`unified_models.layers.quantization.quantizable_linears`); the others of the set are written
in the model dtype and named in ``quantization_config.modules_to_not_convert`` (read by vLLM's
``Fp8Config`` and transformers' ``FineGrainedFP8Config`` alike), so the checkpoint says exactly
what it stores. MTP blocks (inert parameters) are quantized by the published rule wherever K is a
multiple of 128. Codes are ``ops.fp8_block_quantize_weight``'s: ``cast_e4m3(w / s)`` with the
stored ue8m0 ``s`` (bitwise), the same function the trainer applies to its bf16 masters on every
forward (``converters.modelopt.master_spec``: ``fp8_block`` masters, straight-through gradient).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from ..dsl import CheckpointError, SpecError
from ..paths import check_destination

LAYOUTS = ("official", "hf")
"""Output layouts: DeepSeek's published one, transformers'."""

_MTP_FP8 = re.compile(r"^mtp\.\d+\.(e_proj|h_proj|attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|"
                      r"ffn\.shared_experts\.w[123]|ffn\.experts\.\d+\.w[123])\.weight$")
"""An MTP block's linears that DeepSeek's published checkpoints store in FP8."""


def _compact_skip(names: list[str], spec) -> list[str]:
    """Skip entries, one per linear except a layer's whole routed-expert set or whole shared expert
    (written as the ``...ffn.experts`` / ``...ffn.shared_experts`` prefix)."""
    skip = set(names)
    out: list[str] = []
    covered: set[str] = set()
    for block in spec.blocks:
        ffn = block.sublayers[1].mixer
        experts = {ffn.expert_linear(e, j) for e in range(ffn.n_routed_experts) for j in ("w1", "w2", "w3")}
        shared = {ffn.shared_linear(j) for j in ("w1", "w2", "w3")}
        for group, prefix in ((experts, f"{ffn.name}.experts"), (shared, f"{ffn.name}.shared_experts")):
            if group <= skip:
                out.append(prefix)
                covered |= group
    out += [n for n in names if n not in covered]
    return sorted(out)


def _group(name: str) -> str:
    """The linears that take one format together: a layer's routed experts (every expert and projection:
    the grouped kernel takes one format per layer), a layer's shared expert, else the linear itself."""
    m = re.match(r"^(.*\.experts)\.\d+\.w[123]$", name)
    if m:
        return m.group(1)
    m = re.match(r"^(.*\.shared_experts)\.w[123]$", name)
    return m.group(1) if m else name


def _runnable_fp8(spec, candidates) -> set[str]:
    """The ``candidates`` the layer families run in ``fp8_block``: each group (:func:`_group`) is
    tried alone against :func:`~unified_models.layers.quantization.check_weight_formats`."""
    from ..dsl.weights import LinearFormat
    from ..layers.quantization import check_weight_formats, quantizable_linears

    allowed = quantizable_linears(spec)
    groups: dict[str, list[str]] = {}
    for n in candidates:
        groups.setdefault(_group(n), []).append(n)
    out: set[str] = set()
    for members in groups.values():
        if any(n not in allowed for n in members):
            continue
        try:
            check_weight_formats(spec.with_weight_formats({n: LinearFormat("fp8_block") for n in members}))
        except SpecError:
            continue
        out.update(members)
    return out


EXPERT_DTYPES = ("fp8", "fp4")
"""``expert_dtype`` an export may write: block-FP8 routed experts (Flash-Base) or MXFP4 ones (Flash)."""


def quantize_deepseek_fp8(src_dir: str | os.PathLike, *, expert_dtype: str = "fp8"):
    """The block-FP8 spec, stored tensors (canonical names) and ``config.json`` dict (transformers'
    form) of the bf16 DeepSeek-V4 checkpoint ``src_dir``, as :func:`export_deepseek_fp8` writes them.

    Args:
        src_dir: a model-dtype DeepSeek-V4 checkpoint.
        expert_dtype: ``"fp8"`` (routed experts block FP8, as DeepSeek-V4-Flash-Base) or ``"fp4"``
            (routed experts MXFP4, as DeepSeek-V4-Flash; their K must divide by 128, the W4A8
            activation tile, else they are refused).

    Returns:
        ``(qspec, stored, config_dict)``.

    Raises:
        CheckpointError: the source is not a model-dtype DeepSeek-V4 checkpoint.
        SpecError: an unknown ``expert_dtype``; MXFP4 experts whose K is not a multiple of 128.
    """
    from ..models import spec_from_hf_config
    from ..models.deepseek_fp8_config import quantization_config_dict
    from ..models.deepseek_v4 import published_fp8_linears

    if expert_dtype not in EXPERT_DTYPES:
        raise SpecError(f"block-FP8 export: expert_dtype={expert_dtype!r}; choose from {EXPERT_DTYPES}")
    from ..ops.fp8_block import fp8_block_quantize_weight
    from .deepseek_v4_layout import read_config_dict
    from .hf_safetensors import load_hf_config, spec_and_state_dict
    from .modelopt import quantize_state_dict
    from .quantized import validate_quantized

    src = Path(src_dir)
    config, spec, masters = spec_and_state_dict(src)
    if spec.family != "deepseek_v4":
        raise CheckpointError(f"{src}: block-FP8 export is DeepSeek-V4's (model_type deepseek_v4), got {spec.family!r}")
    if spec.stores_quantized_weights or getattr(config, "quantization_config", None):
        raise CheckpointError(f"{src} is already quantized; the block-FP8 export takes a model-dtype checkpoint")
    from ..models.deepseek_fp8_config import DeepseekFP8Quantization

    candidates = published_fp8_linears(spec, DeepseekFP8Quantization(expert_dtype=expert_dtype))
    runnable = _runnable_fp8(spec, candidates)
    skip = [n for n in candidates if n not in runnable]
    for name, shape, _ in spec.inert_parameters:
        if _MTP_FP8.match(name) and (len(shape) != 2 or shape[1] % 128):
            skip.append(name[: -len(".weight")])
    cfg = read_config_dict(src)
    cfg["quantization_config"] = quantization_config_dict(_compact_skip(skip, spec))
    cfg["expert_dtype"] = expert_dtype
    with tempfile.TemporaryDirectory(prefix="um-fp8-cfg-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg))
        qspec = spec_from_hf_config(load_hf_config(tmp), dtype=spec.dtype)
    stored = quantize_state_dict(masters, qspec)
    qshapes = dict(qspec.parameter_dtypes())
    for name, _, dtype in qspec.inert_parameters:
        if dtype == torch.float8_e4m3fn:
            q, s = fp8_block_quantize_weight(masters[name])
            stored[name] = q
            stored[name[: -len(".weight")] + ".weight_scale_inv"] = s
        elif dtype == torch.uint8:  # an MXFP4 routed expert of an MTP block (expert_dtype fp4)
            from ..ops.mxfp4 import mxfp4_quantize

            q = mxfp4_quantize(masters[name])
            stored[name] = q.weight
            stored[name[: -len(".weight")] + ".weight_scale"] = q.weight_scale
    missing = [n for n in qspec.parameter_shapes() if n not in stored]
    if missing:  # pragma: no cover - every stored tensor derives from a master
        raise CheckpointError(f"block-FP8 export: no tensor for {missing[:5]}")
    stored = {n: stored[n] for n in qspec.parameter_shapes()}
    bad = [n for n, t in stored.items() if t.dtype != qshapes[n]]
    if bad:  # pragma: no cover - the quantizers' dtypes are the format's
        raise CheckpointError(f"block-FP8 export: wrong dtypes for {bad[:5]}")
    validate_quantized(stored, qspec, source=f"block-FP8 export of {src}")
    return qspec, stored, cfg


def export_deepseek_fp8(src_dir: str | os.PathLike, out_dir: str | os.PathLike, *, layout: str = "official",
                        expert_dtype: str = "fp8", overwrite: bool = False) -> Path:
    """Write the bf16 DeepSeek-V4 checkpoint ``src_dir`` as a block-FP8 checkpoint in ``out_dir``.

    Args:
        src_dir: a model-dtype DeepSeek-V4 checkpoint, either layout (no ``quantization_config``).
        out_dir: the new checkpoint directory (``config.json``, ``model.safetensors``, tokenizer
            files copied).
        layout: ``"official"`` (DeepSeek's published names, float32 ``.scale``) or ``"hf"``
            (transformers' names, float8_e8m0fnu ``.weight_scale_inv``).
        expert_dtype: the routed experts' format, ``"fp8"`` or ``"fp4"`` (:func:`quantize_deepseek_fp8`).
        overwrite: replace an existing ``out_dir``.

    Returns:
        ``out_dir``, written in a temporary sibling and renamed into place (nothing half written).

    Raises:
        CheckpointError: a quantized or non-DeepSeek-V4 source, ``out_dir`` exists without ``overwrite``.
        SpecError: an unknown ``layout``; a quantizable linear whose K is not a multiple of 128.
        UnifiedModelsError: ``out_dir`` is ``src_dir``, holds it or lies inside it.
    """
    from .deepseek_v4_layout import convert_checkpoint
    from .hf_safetensors import save_state_dict
    from .megatron_dist_ckpt import atomic_output_dir

    if layout not in LAYOUTS:
        raise SpecError(f"export_deepseek_fp8: layout={layout!r}; choose from {LAYOUTS}")
    check_destination(src_dir, out_dir, src_name="the source checkpoint", dst_name="the output")
    src, dst = Path(src_dir), Path(out_dir)
    if dst.exists() and not overwrite:
        raise CheckpointError(f"{dst} exists; pass overwrite=True (CLI --overwrite) to replace it")
    _, stored, cfg = quantize_deepseek_fp8(src, expert_dtype=expert_dtype)
    with atomic_output_dir(dst, overwrite) as tmp:
        with tempfile.TemporaryDirectory(prefix="um-fp8-") as scratch:
            hf_dir = Path(scratch) if layout == "official" else tmp
            save_state_dict(stored, hf_dir, config_json=cfg)
            for f in src.iterdir():
                if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                        "config.json", "model.safetensors.index.json"):
                    shutil.copy(f, hf_dir / f.name)
            if layout == "official":
                convert_checkpoint(hf_dir, tmp, to="official", overwrite=True)
    return dst
