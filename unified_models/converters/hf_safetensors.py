"""Hugging Face checkpoints: config + safetensors <-> canonical state dict.

The canonical state dict is ``{HF name: tensor}`` exactly as the spec's
:meth:`ModelSpec.parameter_shapes` lists it, so no mapping table exists.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..dsl import CheckpointError, ModelSpec, SpecError
from .quantized import validate_quantized
from .safetensors_io import save_safetensors


def load_hf_config(model_dir: str | os.PathLike) -> Any:
    """Read ``config.json`` with transformers' ``AutoConfig`` (no remote code).

    Raises:
        CheckpointError: directory or config missing, or unreadable/unknown config.
        SpecError: ``num_hidden_layers`` disagrees with the layer pattern
            (:func:`unified_models.models.check_declared_layer_count`).
    """
    from transformers import AutoConfig

    d = Path(model_dir)
    if not d.exists():
        raise CheckpointError(f"model directory {d} does not exist")
    if not d.is_dir():
        raise CheckpointError(f"model directory {d} is not a directory")
    if not (d / "config.json").is_file():
        raise CheckpointError(f"{d}/config.json is missing")
    raw = json_object((d / "config.json").read_text(), f"{d}/config.json")
    try:
        layout = checkpoint_layout(raw)
        if layout is not None:  # a family's other layout (DeepSeek-V4's published one): its config, translated
            fields = layout.read_config_dict(d)
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        else:
            config = AutoConfig.from_pretrained(str(d), trust_remote_code=False)
    except SpecError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers/huggingface_hub raise many (validation) types
        # transformers' validation errors span lines ("Validation error for field 'x':" then the reason)
        why = " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__
        raise CheckpointError(f"{d}/config.json is not a valid transformers config: {why[:600]}") from None
    from ..models import check_declared_layer_count

    check_declared_layer_count(config, raw, source=f"{d}/config.json")
    return config


def json_object(text: str, what: str) -> dict:
    """``text`` parsed as a JSON object (a config file's).

    Raises:
        CheckpointError: not valid JSON, or not an object (``what`` names the file).
    """
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{what} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{what} must hold a JSON object, not a {type(raw).__name__}")
    return raw


def checkpoint_layout(raw_config: dict) -> Any:
    """The layout module of a checkpoint written in a family's non-canonical layout, or None.

    Today one: DeepSeek-V4's published layout (:mod:`.deepseek_v4_layout`, detected from
    ``config.json``: ``compress_ratios`` / ``num_hash_layers`` instead of ``layer_types``).
    The module gives ``read_config_dict(dir)`` (the transformers config dict),
    ``official_to_canonical(tensors)`` (the canonical names of :meth:`ModelSpec.parameter_shapes`) and
    ``canonical_to_stored(tensors, raw_config)`` (back to the layout's names and dtypes).

    Raises:
        SpecError: a DeepSeek-V4 config in transformers' layout whose published-layout fields say
            another model (:func:`.deepseek_v4_layout.check_both_layouts_agree`).
    """
    if raw_config.get("model_type") == "deepseek_v4":
        from . import deepseek_v4_layout

        if deepseek_v4_layout.is_official_config(raw_config):
            return deepseek_v4_layout
        deepseek_v4_layout.check_both_layouts_agree(raw_config)
    return None


def tensor_layout(model_dir: str | os.PathLike, names) -> Any:
    """The layout module of the checkpoint in ``model_dir`` whose tensors are ``names`` (an iterable of
    stored names, or a dict keyed by them): :func:`checkpoint_layout` of its ``config.json``, after
    checking that the tensor names are in the same layout; None for a canonical checkpoint (or no
    readable ``config.json``: the config's own reader reports that).

    Raises:
        CheckpointError: the config and the tensor names disagree on the layout (a published
            config with transformers' tensor names or the reverse).
    """
    d = Path(model_dir)
    try:
        raw = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if raw.get("model_type") != "deepseek_v4":
        return None
    from . import deepseek_v4_layout

    layout = checkpoint_layout(raw)
    by_config, by_names = layout is not None, deepseek_v4_layout.is_official_tensor_names(names)
    if by_config != by_names:
        say = {True: "DeepSeek's published layout", False: "the transformers layout"}
        raise CheckpointError(f"checkpoint {d}: config.json is in {say[by_config]} but the tensor names are in "
                              f"{say[by_names]}; convert one of them (unified_models.converters.deepseek_v4_layout)")
    return layout


def canonical_tensors(model_dir: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` of ``model_dir`` under the spec's (canonical) names: unchanged for a canonical
    checkpoint, converted by its layout module (:func:`tensor_layout`) otherwise.

    Raises:
        CheckpointError: the config and the tensor names disagree on the layout (a published
            config with transformers' tensor names or the reverse), or the layout's own errors.
    """
    layout = tensor_layout(model_dir, tensors)
    return layout.official_to_canonical(tensors) if layout is not None else tensors


def stored_tensors(config_text: str, tensors: dict[str, torch.Tensor], *, source: str) -> dict[str, torch.Tensor]:
    """Canonical ``tensors`` under the names and dtypes a checkpoint whose ``config.json`` is ``config_text``
    stores them: unchanged for a canonical config, converted by its layout module otherwise (DeepSeek-V4's
    published layout: :func:`.deepseek_v4_layout.canonical_to_stored`). The inverse of
    :func:`canonical_tensors`: a checkpoint written with this config text and these tensors reads back
    into the same spec and state dict.

    Raises:
        CheckpointError: ``config_text`` is not a JSON object (``source`` named), or the layout's own errors.
    """
    raw = json_object(config_text, f"{source}: config.json")
    layout = checkpoint_layout(raw)
    return layout.canonical_to_stored(tensors, raw) if layout is not None else tensors


def safetensors_files(model_dir: str | os.PathLike) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files (from the index if there is one).

    Raises:
        CheckpointError: no safetensors file, or the index names missing files.
    """
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is malformed: {e}") from None
        files = [d / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names missing files: {missing}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {d}")
    return files


def read_tensors(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, in its stored dtype (no cast).

    Raises:
        CheckpointError: no file, a corrupt file, or a tensor stored twice.
    """
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{f} is not a readable safetensors file: {e}") from None
        dup = set(part) & set(tensors)
        if dup:
            raise CheckpointError(f"{f} repeats tensors already loaded: {sorted(dup)[:5]}")
        tensors.update(part)
    return tensors


def load_state_dict(model_dir: str | os.PathLike, spec: ModelSpec, *, check_finite: bool = True) -> dict[str, torch.Tensor]:
    """Load and validate the canonical state dict of ``spec`` from safetensors.

    Tensors are cast to their stored dtype (:meth:`ModelSpec.parameter_dtypes`:
    ``spec.dtype`` for weights, fp32 for scales and the router bias); quantized
    codes (uint8 / float8_e4m3fn) must already have that dtype. Quantized
    tensors are checked by :func:`unified_models.converters.quantized.validate_quantized`
    (zero / NaN / Inf scales name the layer and expert). Nothing is returned
    unless every check passes.

    Raises:
        CheckpointError: corrupt file; missing, unexpected or mis-shaped tensors
            (all named); a code tensor of the wrong dtype; NaN/Inf values; bad
            quantization scales.
    """
    tensors = canonical_tensors(model_dir, read_tensors(model_dir))
    validate_state_dict(tensors, spec, source=str(model_dir), check_finite=check_finite)
    return cast_to_stored_dtypes(tensors, spec, source=str(model_dir))


_CODE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


def cast_to_stored_dtypes(tensors: dict[str, torch.Tensor], spec: ModelSpec, *, source: str) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of every spec parameter in its stored dtype (floats cast; codes must match).

    Raises:
        CheckpointError: a quantized code tensor (uint8 / float8_e4m3fn) stored
            in another dtype, a float tensor stored as codes, or a floating-point
            parameter stored as integers or booleans (every such tensor listed).
    """
    dtypes = spec.parameter_dtypes()
    out = {}
    bad = []
    for name, want in dtypes.items():
        t = tensors[name]
        if want.is_floating_point and want not in _CODE_DTYPES and not t.is_floating_point():  # int/bool: corrupt
            bad.append(f"{name}: stored {t.dtype}, expected a floating-point dtype ({want})")
            continue
        if (want in _CODE_DTYPES or t.dtype in _CODE_DTYPES) and t.dtype != want:
            bad.append(f"{name}: stored {t.dtype}, expected {want}")
            continue
        problem = e8m0_cast_problem(name, t) if want == torch.float8_e8m0fnu else None
        if problem is not None:
            bad.append(problem)
            continue
        out[name] = t if t.dtype == want else t.to(want)
    if bad:
        raise CheckpointError(f"checkpoint {source}: tensors of the wrong dtype: {bad}")
    if spec.stores_quantized_weights or any(d != spec.dtype for d in dtypes.values()):
        validate_quantized(out, spec, source=source)
    return out


def e8m0_cast_problem(name: str, t: torch.Tensor) -> str | None:
    """What is wrong with ``t`` stored in another float dtype for a float8_e8m0fnu parameter (a
    block-FP8 / MXFP4 scale): a value the cast would change (not a power of two in e8m0's range,
    which the cast would round to one); None when the cast is exact (or ``t`` is e8m0 already)."""
    if t.dtype == torch.float8_e8m0fnu or t.numel() == 0:
        return None
    back = t.to(torch.float8_e8m0fnu).to(t.dtype)
    exact = (back == t) | (torch.isnan(t) & torch.isnan(back))  # NaN: named by the quantized-tensor checks
    if bool(exact.all()):
        return None
    v = float(t[~exact].flatten()[0])
    return (f"{name}: stored {t.dtype} holding {v!r}, not a power of two in 2^-127..2^127; a ue8m0 scale "
            f"(float8_e8m0fnu) is one (the cast would round it to {float(back[~exact].flatten()[0])!r})")


def tensor_table_problems(expected: dict[str, tuple[int, ...]], got: dict[str, tuple[int, ...]], *,
                          require_all: bool = True, verb: str = "got") -> list[str]:
    """Describe how a table of tensor shapes differs from the expected one.

    Returns:
        Human-readable problems (``missing tensors: [...]``, ``unexpected
        tensors: [...]``, ``mis-shaped tensors: [...]``, each listing its first
        :data:`LISTED_TENSORS` and the count of the rest); empty when they match.
    """
    missing = [n for n in expected if n not in got] if require_all else []
    extra = [n for n in got if n not in expected]
    shaped = [f"{n}: expected {expected[n]}, {verb} {tuple(got[n])}"
              for n in expected if n in got and tuple(got[n]) != tuple(expected[n])]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_listed(missing)}")
    if extra:
        problems.append(f"unexpected tensors: {_listed(extra)}")
    if shaped:
        problems.append(f"mis-shaped tensors: {_listed(shaped)}")
    return problems


LISTED_TENSORS = 12
"""Names an error lists per kind before it counts the rest (another model's checkpoint differs in hundreds)."""


def _listed(names: list[str]) -> str:
    if len(names) <= LISTED_TENSORS:
        return str(names)
    return f"{names[:LISTED_TENSORS]} and {len(names) - LISTED_TENSORS} more ({len(names)} in all)"


def validate_state_dict(tensors: dict[str, torch.Tensor], spec: ModelSpec, *, source: str,
                        check_finite: bool = True) -> None:
    """Check names, shapes and values of a state dict against ``spec``.

    Raises:
        CheckpointError: the tensors cover another number of layers than the spec
            (both named), or listing every missing, unexpected or mis-shaped tensor,
            or the first tensor holding NaN/Inf.
    """
    from ..models import check_tensor_layer_count

    check_tensor_layer_count(spec, tensors, source=source)
    expected = spec.parameter_shapes()
    problems = tensor_table_problems(expected, {n: tuple(t.shape) for n, t in tensors.items()})
    if problems:
        raise CheckpointError(f"checkpoint {source} does not match the {spec.family} spec; " + "; ".join(problems))
    if check_finite:
        for n in expected:
            t = tensors[n]
            if t.dtype in _CODE_DTYPES:  # codes: checked with their scales by validate_quantized
                continue
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise CheckpointError(f"checkpoint {source}: tensor {n} holds NaN or Inf")
        for n, experts in expert_id_tables(spec).items():
            problem = expert_id_problem(n, tensors[n], experts)
            if problem is not None:
                raise CheckpointError(f"checkpoint {source}: {problem}")


def expert_id_tables(spec: ModelSpec) -> dict[str, int]:
    """``{name: E}`` of every tensor whose entries are routed-expert ids (DeepSeek-V4's hash layers'
    ``gate.tid2eid``), each entry to be in ``[0, E)``."""
    return {sub.mixer.selection_name: sub.mixer.n_routed_experts for sub in spec.sublayers
            if getattr(sub.mixer, "hash_routing", False)}


def expert_id_problem(name: str, t: torch.Tensor, experts: int) -> str | None:
    """What is wrong with ``t`` as a table of expert ids in ``[0, experts)`` (a non-integer entry, or
    one out of range: the hash router would index past its experts), or None."""
    if t.numel() == 0:
        return None
    if t.is_floating_point() and not bool((torch.isfinite(t) & (t == t.round())).all()):
        return f"tensor {name} holds expert ids that are not integers"
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= experts:
        return (f"tensor {name} holds expert ids in [{lo}, {hi}]; its layer has {experts} routed experts "
                f"(ids 0..{experts - 1})")
    return None


def save_state_dict(state_dict: dict[str, torch.Tensor], out_dir: str | os.PathLike, *,
                    config_json: dict | None = None, filename: str = "model.safetensors") -> Path:
    """Write ``state_dict`` (and optionally ``config.json``) atomically.

    Files are written under a temporary name and renamed, so a failure leaves
    nothing half-written.
    """
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / (filename + ".tmp")
    save_safetensors({k: v.contiguous() for k, v in state_dict.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, d / filename)
    if config_json is not None:
        tmpc = d / "config.json.tmp"
        tmpc.write_text(json.dumps(config_json, indent=2, sort_keys=True))
        os.replace(tmpc, d / "config.json")
    return d / filename


def spec_and_state_dict(model_dir: str | os.PathLike, *, dtype: torch.dtype | None = None):
    """Config -> spec -> validated state dict, in one call.

    Returns:
        ``(hf_config, spec, state_dict)``.

    Raises:
        CheckpointError / SpecError: see :func:`load_hf_config` and the family declaration.
    """
    from ..models import spec_from_hf_config

    config = load_hf_config(model_dir)
    try:
        spec = spec_from_hf_config(config, dtype=dtype)
    except SpecError as e:
        raise type(e)(f"{model_dir}/config.json: {e}") from None
    return config, spec, load_state_dict(model_dir, spec)
