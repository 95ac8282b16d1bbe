"""Built-in model presets (``unified_models/configs/*.yaml``) and the bundled data.

A preset is turned into a real checkpoint with transformers' own model class
(deterministically, from its seed) and cached, so the default ``check`` needs
no download.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

import yaml

from .dsl import SpecError

DEFAULT_PRESET = "nemotron_h_tiny"


TOKENIZER_LAYOUT = "padded-to-vocab-1"
"""Part of every preset's cache digest: checkpoints built before their tokenizers were padded to the
model's vocabulary (:func:`unified_models.serving.vocabulary.pad_tokenizer_dir`) are not reused."""

TENSOR_LAYOUT = "spec-stored-dtypes-1"
"""Part of every preset's cache digest: checkpoints built before each tensor was stored in its spec's
stored dtype (:func:`_store_spec_dtypes`: fp32 router bias, mHC weights, attention sinks; bf16 before,
the same values) are not reused."""


def data_path(name: str) -> Path:
    """Path of a bundled data file (prompts, tokenizer) inside the package."""
    return Path(str(resources.files("unified_models") / "data" / name))


def tokenizer_dir() -> Path:
    """The bundled Phi-3-mini tokenizer (tokenizer.json + chat template)."""
    return data_path("tokenizer")


def default_prompts_path() -> Path:
    """The bundled GSM8K questions (first 200 rows of the public test set)."""
    return data_path("gsm8k_test_200.jsonl")


def load_preset(name: str) -> dict:
    """Read a preset YAML by name.

    Raises:
        SpecError: unknown preset name (the message lists the known ones).
    """
    root = resources.files("unified_models") / "configs"
    known = sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))
    if name not in known:
        raise SpecError(f"unknown preset {name!r}; known presets: {known}")
    return yaml.safe_load((root / f"{name}.yaml").read_text())


def preset_name(name: str) -> str:
    """An argparse ``type=`` for a ``--preset`` flag: ``name`` when it is a built-in preset.

    Raises:
        argparse.ArgumentTypeError: an unknown name (the message lists the known ones), which argparse
            reports as a usage error (exit status 2) instead of a traceback.
    """
    import argparse

    try:
        load_preset(name)
    except SpecError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def cache_root() -> Path:
    """``$UNIFIED_MODELS_CACHE`` or ``~/.cache/unified_models``."""
    return Path(os.environ.get("UNIFIED_MODELS_CACHE", Path.home() / ".cache" / "unified_models"))


def build_preset_checkpoint(name: str = DEFAULT_PRESET, *, out_dir: str | os.PathLike | None = None,
                            progress=None) -> Path:
    """Write (once) the preset's checkpoint with transformers and return its directory.

    The directory holds ``config.json``, ``model.safetensors`` and the bundled
    tokenizer, padded with placeholder tokens (``<|pad_32011|>``, ...) to the model's vocabulary so
    that every id the model can sample detokenizes (:mod:`unified_models.serving.vocabulary`). Built in a temporary directory and renamed, so an interrupted
    build leaves nothing behind. Deterministic: the same preset gives the same bytes.

    A preset with a ``quantize`` block (``base``: the bf16 preset it starts
    from; ``experts`` / ``mamba_proj`` / ``kv_cache``; ``calibration_prompts``:
    how many bundled GSM8K prompts calibrate the static FP8 scales) is the
    base checkpoint exported in ModelOpt's format by
    :func:`unified_models.converters.modelopt.export_modelopt`. A ``quantize`` block with
    ``format: fp8_block`` (and ``layout``: ``official`` / ``hf``) is this preset's own bf16 model
    (its ``hf_config``), written as DeepSeek's block-FP8 checkpoint by
    :func:`unified_models.converters.deepseek_fp8.export_deepseek_fp8`.
    """
    preset = load_preset(name)
    if "quantize" in preset and preset["quantize"].get("format") == "fp8_block":
        return _build_block_fp8(name, preset, out_dir)
    if "quantize" in preset:
        return _build_quantized(name, preset, out_dir)
    return _build_plain(name, preset, out_dir)


def _preset_target(name: str, preset: dict, out_dir) -> Path:
    return Path(out_dir) if out_dir is not None else cache_root() / f"{name}-{_digest(preset)}"


def _digest(preset: dict) -> str:
    """12 hex digits naming a preset's cache directory (its content, :data:`TOKENIZER_LAYOUT` and
    :data:`TENSOR_LAYOUT`)."""
    return hashlib.sha256(json.dumps({**preset, "_tokenizer": TOKENIZER_LAYOUT, "_tensors": TENSOR_LAYOUT},
                                     sort_keys=True).encode()).hexdigest()[:12]


def _build_block_fp8(name: str, preset: dict, out_dir) -> Path:
    """The bf16 model of ``preset`` (cached under ``<name>-bf16-<digest>``), then its block-FP8 export."""
    target = _preset_target(name, preset, out_dir)
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    q = dict(preset["quantize"])
    q.pop("format")
    layout = q.pop("layout", "official")
    expert_dtype = q.pop("expert_dtype", "fp8")
    if q:
        raise SpecError(f"preset {name!r}: quantize keys {sorted(q)} are not understood (fp8_block takes layout, "
                        "expert_dtype)")
    plain = {k: v for k, v in preset.items() if k != "quantize"}
    base = _build_plain(f"{name}-bf16", plain, None)
    from .converters.deepseek_fp8 import export_deepseek_fp8

    return export_deepseek_fp8(base, target, layout=layout, expert_dtype=expert_dtype, overwrite=True)


def _build_plain(name: str, preset: dict, out_dir) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    target = _preset_target(name, preset, out_dir)
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        config = AutoConfig.for_model(preset["family"], **preset["hf_config"])
        # transformers' causal-LM class of the family, as its declaration names it (ModelSpec.hf_architecture)
        from .models import spec_from_hf_config

        config.architectures = [spec_from_hf_config(config).hf_architecture]
        dtype = getattr(torch, preset.get("dtype", "bfloat16"))
        torch.manual_seed(int(preset.get("seed", 0)))
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if preset["family"] == "deepseek_v4":  # tensors transformers' init leaves degenerate (zeros)
            from .models.deepseek_v4 import preset_weights

            preset_weights(model, int(preset.get("seed", 0)))
        model = model.to(dtype)
        model.save_pretrained(str(tmp), safe_serialization=True)
        _store_spec_dtypes(tmp)
        if preset.get("tokenizer") == "bundled":
            from .serving.vocabulary import pad_tokenizer_dir

            for f in tokenizer_dir().iterdir():
                shutil.copy(f, tmp / f.name)
            pad_tokenizer_dir(tmp, int(config.vocab_size))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _store_spec_dtypes(model_dir: Path) -> None:
    """Rewrite ``model_dir/model.safetensors`` (one file, as transformers writes a preset) with every
    tensor in its spec's stored dtype (:meth:`unified_models.dsl.ModelSpec.parameter_dtypes`), as the
    published checkpoints store them: ``model.to(bf16)`` above also rounds the tensors transformers
    keeps in fp32 (``_keep_in_fp32_modules_strict``: the router's correction bias, DeepSeek-V4's mHC
    weights, attention sinks and compressor ``ape``), and they are written back in fp32 holding those
    rounded values, so every number the engines compute is unchanged. Names and the other tensors'
    bytes are kept.

    Raises:
        CheckpointError / SpecError: the checkpoint transformers wrote does not read back into a spec.
    """
    from .converters.hf_safetensors import (cast_to_stored_dtypes, canonical_tensors, load_hf_config,
                                            read_tensors, save_state_dict, stored_tensors)
    from .models import spec_from_hf_config

    if not (model_dir / "model.safetensors").is_file():
        raise SpecError(f"{model_dir}: transformers wrote the preset in shards; expected one model.safetensors")
    written = read_tensors(model_dir)
    spec = spec_from_hf_config(load_hf_config(model_dir))
    canonical = cast_to_stored_dtypes(canonical_tensors(model_dir, written), spec, source=str(model_dir))
    stored = stored_tensors((model_dir / "config.json").read_text(), canonical, source=str(model_dir))
    if set(stored) != set(written):
        raise SpecError(f"{model_dir}: the preset's tensor names do not survive its layout's round trip: "
                        f"{sorted(set(stored) ^ set(written))[:5]}")
    if any(stored[n].dtype != t.dtype for n, t in written.items()):
        save_state_dict(stored, model_dir)


def _build_quantized(name: str, preset: dict, out_dir) -> Path:
    from .converters.hf_safetensors import load_hf_config
    from .models import spec_from_hf_config
    from .prompts import load_prompt_texts, tokenize_prompts

    q = dict(preset["quantize"])
    base = build_preset_checkpoint(q.pop("base"))
    target = Path(out_dir) if out_dir is not None else cache_root() / f"{name}-{_digest(preset)}"
    if (target / "model.safetensors").is_file() and (target / "config.json").is_file():
        return target
    from .converters.modelopt import export_modelopt

    n = int(q.pop("calibration_prompts", 16))
    spec = spec_from_hf_config(load_hf_config(base))
    ids = tokenize_prompts(load_prompt_texts(default_prompts_path(), n), base, vocab_size=spec.vocab_size)
    return export_modelopt(base, target, calibration_token_ids=ids, overwrite=True, **q)
