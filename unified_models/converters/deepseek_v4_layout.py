"""DeepSeek-V4's two checkpoint layouts: transformers-written (canonical) <-> DeepSeek's published one.

The canonical layout is what transformers 5.19's ``DeepseekV4ForCausalLM.save_pretrained``
writes and what :mod:`unified_models.models.deepseek_v4` declares. The published layout is
what DeepSeek releases and vLLM 0.32's loader reads (``vllm/models/deepseek_v4/cpu/model.py``
``_make_deepseek_v4_weights_mapper`` and ``DeepseekV4MoE``; transformers' own
``conversion_mapping.py`` ``"deepseek_v4"`` maps the same names). The differences:

================================  ==================================  =============================
what                              canonical (transformers)            published (DeepSeek / vLLM)
================================  ==================================  =============================
prefix                            ``model.layers.{i}.``               ``layers.{i}.`` (``model.`` optional on read)
embedding / final norm            ``model.embed_tokens.weight``,      ``embed.weight``, ``norm.weight``
                                  ``model.norm.weight``
LM head                           ``head.weight``                     ``head.weight``
mHC head                          ``model.hc_head.hc_{fn,base,scale}`` ``hc_head_{fn,base,scale}``
attention KV norm                 ``attn.norm.weight``                ``attn.kv_norm.weight``
hash table ``ffn.gate.tid2eid``   int64                               int32
MTP blocks                        (none: transformers drops them)     ``mtp.{k}.*`` (kept as they are)
block-FP8 scale of a linear       ``<linear>.weight_scale_inv``       ``<linear>.scale``, float32
                                  float8_e8m0fnu                      (``expert_dtype: fp8``, as
                                                                      Flash-Base) or float8_e8m0fnu
MXFP4 routed expert (``fp4``)     ``<e>.weight`` uint8 ``[N, K/2]``,  ``<e>.weight`` int8 (the same bytes),
                                  ``<e>.weight_scale`` float8_e8m0fnu ``<e>.scale`` float8_e8m0fnu ``[N, K/32]``
config: attention schedule        ``layer_types`` + ``compress_rates`` ``compress_ratios`` (one int per
                                                                      layer, then one per MTP block)
config: hash layers               ``mlp_layer_types``                 ``num_hash_layers`` (the first n),
                                                                      ``topk_method: noaux_tc``
config: RoPE                      ``rope_parameters`` {main, compress} ``rope_theta``, ``compress_rope_theta``,
                                                                      ``rope_scaling`` (YaRN), ``qk_rope_head_dim``
================================  ==================================  =============================

Every other tensor keeps its name, dtype and bits (block-FP8 codes included). :func:`official_to_canonical`
and :func:`canonical_to_official` are inverse bit for bit on tensors (the int32 <-> int64 hash table
is exact: expert ids are < 2^31; so is a power-of-two scale between a float32 container and
float8_e8m0fnu, whose byte is the float32 exponent field: vLLM 0.32's ``DeepseekV4FP8Config`` reads
float32 ``.scale`` containers for ``expert_dtype: fp8`` checkpoints and e8m0 ones for ``fp4``,
transformers' ``FineGrainedFP8Config`` renames ``.scale`` to ``.weight_scale_inv`` and casts float32
containers to e8m0); ``quantization_config`` passes through both configs as it is. The configs
convert field by field and refuse what has no
counterpart (a hash schedule that is not a prefix, an MTP block that is not sliding, a compress
ratio a layer type has two of).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from ..dsl import CheckpointError, SpecError

_RATIO_TYPE = {4: "compressed_sparse_attention"}
"""The published ratio of CSA; any other ratio > 0 is HCA (128 published, smaller in tiny models)."""

_LAYER = re.compile(r"^layers\.(\d+)\.(.*)$")


def is_official_config(raw: Mapping) -> bool:
    """True for a published-layout ``config.json`` dict (``compress_ratios`` or ``num_hash_layers``
    and no ``layer_types``)."""
    return raw.get("model_type") == "deepseek_v4" and "layer_types" not in raw and (
        "compress_ratios" in raw or "num_hash_layers" in raw)


def check_both_layouts_agree(raw: Mapping) -> None:
    """A transformers-layout config (``layer_types``) that also holds the published layout's fields
    (``compress_ratios`` / ``num_hash_layers``): transformers' ``DeepseekV4Config`` drops those, so
    they must say what ``layer_types`` / ``compress_rates`` / ``mlp_layer_types`` say, or the model
    would silently not be the one the published fields describe.

    Raises:
        SpecError: naming the field and both values, where they disagree.
    """
    if "layer_types" not in raw or not ("compress_ratios" in raw or "num_hash_layers" in raw):
        return
    published = {k: v for k, v in raw.items() if k not in ("layer_types", "compress_rates", "mlp_layer_types")}
    derived = official_config_to_hf(published)
    for key, source in (("layer_types", "compress_ratios"), ("compress_rates", "compress_ratios"),
                        ("mlp_layer_types", "num_hash_layers")):
        if source not in raw or key not in raw:
            continue
        if key == "compress_rates":  # only the rates of the attention types the layers use are read
            used = set(raw["layer_types"])
            mine = {t: r for t, r in dict(raw[key]).items() if t in used}
            want = {t: r for t, r in derived[key].items() if t in used}
        else:
            mine, want = list(raw[key]), list(derived[key])
        if mine != want:
            raise SpecError(f"DeepSeek-V4 config: {key}={raw[key]!r} disagrees with {source}={raw[source]!r} "
                            f"(which gives {key}={derived[key]!r}); transformers would silently drop {source}: "
                            f"remove it or make the two agree")


def is_official_tensor_names(names) -> bool:
    """True when the tensor names are the published layout's (``embed.weight`` or ``layers.{i}.`` without
    ``model.``, or ``hc_head_fn``, or ``attn.kv_norm``)."""
    for n in names:
        bare = n[len("model."):] if n.startswith("model.") else n
        if bare in ("embed.weight", "hc_head_fn") or n.startswith("layers.") or (
                ".attn.kv_norm." in n and not n.startswith("mtp.")):
            return True
    return False


# ----------------------------------------------------------------------------- configs

_SKIP_KEYS = ("modules_to_not_convert", "ignored_layers")
"""Block-FP8 skip lists in ``quantization_config`` (module names, converted with the tensor names)."""


def _map_skip(cfg: dict, rename) -> None:
    """Rename the module names of ``cfg["quantization_config"]``'s skip lists in place (patterns and
    names that are no tensor's module pass through unchanged)."""
    qc = cfg.get("quantization_config")
    if not isinstance(qc, Mapping):
        return
    qc = dict(qc)
    for key in _SKIP_KEYS:
        if isinstance(qc.get(key), list):
            qc[key] = [rename(e + ".weight")[: -len(".weight")] if isinstance(e, str) else e for e in qc[key]]
    cfg["quantization_config"] = qc


def official_config_to_hf(raw: Mapping) -> dict:
    """A published ``config.json`` dict -> the transformers ``DeepseekV4Config`` dict of the same model.

    ``compress_ratios[:num_hidden_layers]`` -> ``layer_types`` (0 sliding, 4 CSA, any other
    ratio HCA) and ``compress_rates``; ``num_hash_layers`` -> ``mlp_layer_types`` (first n
    ``hash_moe``); ``rope_theta`` / ``compress_rope_theta`` / ``rope_scaling`` / ``qk_rope_head_dim``
    -> ``rope_parameters`` {main, compress} and ``partial_rotary_factor``, as transformers'
    ``DeepseekV4Config.__post_init__`` folds them; the module names of a block-FP8 skip list
    (``quantization_config.modules_to_not_convert`` / ``ignored_layers``) renamed as the tensors
    are. ``topk_method`` and every other key are kept
    (``topk_method`` marks the checkpoint as one that stores its MTP blocks:
    :func:`unified_models.models.deepseek_v4.has_mtp_tensors`).

    Raises:
        SpecError: a missing ``num_hidden_layers`` / ``head_dim``, ``compress_ratios`` shorter than
            the layers, two ratios for one layer type, or an MTP entry that is not 0 (sliding).
    """
    out = dict(raw)
    n = out.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        raise SpecError(f"published DeepSeek-V4 config: num_hidden_layers={n!r} must be an int >= 1")
    ratios = out.pop("compress_ratios", None)
    if ratios is not None:
        ratios = list(ratios)
        if len(ratios) < n:
            raise SpecError(f"published DeepSeek-V4 config: compress_ratios has {len(ratios)} entries for {n} layers")
        mtp = ratios[n:]
        if any(r != 0 for r in mtp):
            raise SpecError(f"published DeepSeek-V4 config: compress_ratios of the MTP block(s) {mtp} are not 0; "
                            "only sliding MTP blocks are declared (the published checkpoints have 0)")
        types, rates = [], {}
        for i, r in enumerate(ratios[:n]):
            if isinstance(r, bool) or not isinstance(r, int) or r < 0 or r == 1:
                raise SpecError(f"published DeepSeek-V4 config: compress_ratios[{i}]={r!r} must be 0 or an int >= 2")
            t = "sliding_attention" if r == 0 else _RATIO_TYPE.get(r, "heavily_compressed_attention")
            if t != "sliding_attention":
                if rates.setdefault(t, r) != r:
                    raise SpecError(f"published DeepSeek-V4 config: compress_ratios has two ratios ({rates[t]} and "
                                    f"{r}) for {t}; transformers has one rate per layer type")
            types.append(t)
        out["layer_types"] = types
        out["compress_rates"] = {"compressed_sparse_attention": rates.get("compressed_sparse_attention", 4),
                                 "heavily_compressed_attention": rates.get("heavily_compressed_attention", 128)}
    n_hash = out.pop("num_hash_layers", None)
    if n_hash is not None:
        if isinstance(n_hash, bool) or not isinstance(n_hash, int) or n_hash < 0:
            raise SpecError(f"published DeepSeek-V4 config: num_hash_layers={n_hash!r} must be an int >= 0")
        out["mlp_layer_types"] = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
    head_dim = out.get("head_dim", 512)
    rot = out.pop("qk_rope_head_dim", None)
    prf = out.get("partial_rotary_factor") or (rot / head_dim if rot is not None else 64 / 512)
    out["partial_rotary_factor"] = prf
    scaling = out.pop("rope_scaling", None) or {}
    if "rope_parameters" not in out:
        main = {"rope_type": "default", "rope_theta": out.get("rope_theta", 10000.0), "partial_rotary_factor": prf}
        compress = {k: v for k, v in dict(scaling).items() if k != "type"}
        compress["rope_type"] = dict(scaling).get("rope_type", dict(scaling).get("type", "default"))
        compress.update(rope_theta=out.get("compress_rope_theta", 160000.0), partial_rotary_factor=prf)
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
        out["rope_parameters"] = {"main": main, "compress": compress}
    _map_skip(out, _canonical_name)
    return out


def hf_config_to_official(cfg: Mapping) -> dict:
    """A transformers ``DeepseekV4Config`` dict -> a published ``config.json`` dict (inverse of
    :func:`official_config_to_hf` on the fields it converts, block-FP8 skip lists included).

    Raises:
        SpecError: ``mlp_layer_types`` whose ``hash_moe`` layers are not a prefix (the published
            ``num_hash_layers`` can only say "the first n"), or RoPE parameters with no published
            counterpart (a YaRN ``main``, different partial rotary factors).
    """
    out = dict(cfg)
    n = int(out["num_hidden_layers"])
    types = list(out.pop("layer_types"))
    rates = dict(out.pop("compress_rates"))
    ratios = [0 if t == "sliding_attention" else int(rates[t]) for t in types]
    mtp = int(out.get("num_nextn_predict_layers", 0) or 0)
    out["compress_ratios"] = ratios + [0] * mtp
    mlp = list(out.pop("mlp_layer_types"))
    n_hash = sum(1 for t in mlp if t == "hash_moe")
    if mlp != ["hash_moe"] * n_hash + ["moe"] * (n - n_hash):
        raise SpecError(f"DeepSeek-V4 mlp_layer_types {mlp} cannot be written in the published layout: "
                        "num_hash_layers means the first n layers are hash_moe")
    out["num_hash_layers"] = n_hash
    out.setdefault("topk_method", "noaux_tc")
    rp = out.pop("rope_parameters")
    main, comp = dict(rp["main"]), dict(rp["compress"])
    if main.get("rope_type", "default") != "default":
        raise SpecError("DeepSeek-V4 rope_parameters['main'] is not plain RoPE: no published counterpart")
    prf = out.pop("partial_rotary_factor", main.get("partial_rotary_factor"))
    if main.get("partial_rotary_factor", prf) != prf or comp.get("partial_rotary_factor", prf) != prf:
        raise SpecError("DeepSeek-V4 rope_parameters have different partial_rotary_factor values: no published "
                        "counterpart (one qk_rope_head_dim)")
    out["qk_rope_head_dim"] = int(int(out["head_dim"]) * prf)
    out["rope_theta"] = main["rope_theta"]
    out["compress_rope_theta"] = comp.pop("rope_theta")
    comp.pop("partial_rotary_factor", None)
    rtype = comp.pop("rope_type", "default")
    if rtype == "yarn":
        out["rope_scaling"] = {"type": "yarn", **comp}
    elif comp:
        raise SpecError(f"DeepSeek-V4 rope_parameters['compress'] of type {rtype!r} has keys {sorted(comp)}: no "
                        "published counterpart")
    _map_skip(out, _official_name)
    return out


# ----------------------------------------------------------------------------- tensors

def _official_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "embed.weight"
    if name == "model.norm.weight":
        return "norm.weight"
    if name.startswith("model.hc_head.hc_"):
        return "hc_head_" + name[len("model.hc_head.hc_"):]
    if name.startswith("model.layers."):
        rest = name[len("model."):]
        m = _LAYER.match(rest)
        if m and m.group(2) == "attn.norm.weight":
            return f"layers.{m.group(1)}.attn.kv_norm.weight"
        return rest
    return name  # head.weight, mtp.*


def _canonical_name(name: str) -> str:
    """Published name (with or without a ``model.`` prefix) -> canonical name."""
    if name.startswith("mtp.") or name == "head.weight":
        return name
    bare = name[len("model."):] if name.startswith("model.") else name
    if bare in ("embed.weight", "embed_tokens.weight"):
        return "model.embed_tokens.weight"
    if bare == "norm.weight":
        return "model.norm.weight"
    if bare.startswith("hc_head_"):
        return "model.hc_head.hc_" + bare[len("hc_head_"):]
    if bare.startswith("hc_head.hc_"):
        return "model." + bare
    m = _LAYER.match(bare)
    if m:
        rest = "attn.norm.weight" if m.group(2) == "attn.kv_norm.weight" else m.group(2)
        return f"model.layers.{m.group(1)}.{rest}"
    return name


def transformers_module_name(name: str) -> str:
    """A canonical module name (a spec component's ``name``: ``model.layers.{i}.attn``,
    ``model.layers.{i}.ffn_norm``, ``head``, ``model.norm`` ...) -> the name of that module in transformers'
    ``DeepseekV4ForCausalLM`` as loaded in memory (``model.layers.{i}.self_attn``,
    ``model.layers.{i}.post_attention_layernorm``, ``lm_head``, ``model.norm`` ...).

    transformers renames at load time, with the renames of its ``conversion_mapping.py``
    ``"deepseek_v4"`` (``attn`` -> ``self_attn``, ``ffn`` -> ``mlp``, ``attn_norm`` -> ``input_layernorm``,
    ``ffn_norm`` -> ``post_attention_layernorm``, ``head`` -> ``lm_head``, ...), which are written for the
    published names. So the name goes to its published form (:func:`_official_name`, this module's
    table), then through transformers' own renames (no second table here); the root ``model.`` the
    published layout drops is put back (transformers' ``base_model_prefix``).
    """
    published = _official_name(name + ".weight")  # a probe leaf: the renames match ``.attn.``, ``.ffn_norm.`` ...
    renamed = _transformers_load_renames(published)
    out = renamed[: -len(".weight")] if renamed.endswith(".weight") else renamed
    if name.startswith("model.") and not out.startswith("model."):
        out = "model." + out
    return out


def _transformers_load_renames(key: str) -> str:
    """``key`` (a published tensor name) after the ``WeightRenaming`` rules of transformers'
    ``conversion_mapping.py`` ``"deepseek_v4"`` (the tensor converters, which merge experts, are not applied)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renames = [t for t in get_checkpoint_conversion_mapping("deepseek_v4") or () if isinstance(t, WeightRenaming)]
    return rename_source_key(key, renames, [])[0]


_EXPERT_LINEAR = re.compile(r"\.experts\.\d+\.w[123]$")
"""A routed expert's linear (the only linears DeepSeek-V4-Flash stores in MXFP4)."""
_PACKED_FP4 = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d is not None)
"""Containers of packed e2m1 pairs (one byte = two codes): a routed expert whose weight has one is MXFP4."""
PUBLISHED_FP4_WEIGHT = torch.int8
"""The container the published layout writes MXFP4 codes in (canonical: uint8, the same bytes)."""
MXFP4_SCALE = ".weight_scale"
"""An MXFP4 expert's scale suffix in the canonical layout (``weight_scale``; published ``.scale``)."""


def _is_mxfp4_expert(base: str, tensors: Mapping[str, torch.Tensor]) -> bool:
    """``base`` (a linear's name without suffix) is a routed expert stored as packed e2m1 codes."""
    w = tensors.get(base + ".weight")
    return bool(_EXPERT_LINEAR.search(base)) and w is not None and w.dtype in _PACKED_FP4


PUBLISHED_SCALE = ".scale"
"""Suffix of a block-FP8 linear's scale in DeepSeek's published files (``<linear>.scale``)."""
CANONICAL_SCALE = ".weight_scale_inv"
"""The same tensor's suffix in the canonical layout (the ``fp8_block`` format's field)."""
SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)
"""Containers a published ``.scale`` may have (vLLM 0.32: float32 for ``expert_dtype: fp8``, e8m0 for ``fp4``)."""


def _e8m0_from_float32(name: str, t: torch.Tensor) -> torch.Tensor:
    """A float32 container of powers of two -> float8_e8m0fnu, exactly.

    Raises:
        CheckpointError: a value that is not a finite positive power of two within e8m0's range
            (2^-127 .. 2^127): it has no exact e8m0 byte (names the tensor and the value).
    """
    if t.dtype == torch.float8_e8m0fnu:
        return t
    if t.dtype != torch.float32:
        raise CheckpointError(f"{name}: block-FP8 scale stored as {t.dtype}; expected float32 (a power-of-two "
                              "container) or float8_e8m0fnu")
    mant, exp = torch.frexp(t)
    bad = ~(torch.isfinite(t) & (mant == 0.5) & (exp >= -126) & (exp <= 128))
    if bool(bad.any()):
        v = float(t[bad].flatten()[0])
        raise CheckpointError(f"{name}: block-FP8 scale {v!r} is not a power of two in 2^-127..2^127 (ue8m0 "
                              "scales are); the checkpoint is not DeepSeek's block-FP8 format")
    return t.to(torch.float8_e8m0fnu)


def official_name_to_canonical(name: str, *, mxfp4_expert: bool = False) -> str:
    """One published-layout tensor name -> its canonical name (names only: no tensor is read); a
    canonical name passes unchanged.

    Args:
        name: the name as stored (with or without a ``model.`` prefix; ``mtp.*`` keep their names).
        mxfp4_expert: ``name`` is the ``.scale`` of a routed expert stored in MXFP4 (``expert_dtype:
            fp4``): renamed ``.weight_scale``; any other ``.scale`` is a block-FP8 ``.weight_scale_inv``.
            The name alone cannot tell the two apart: the caller knows from the weight's dtype
            (:func:`official_to_canonical`) or from the spec (:func:`official_names_to_canonical`).
    """
    if name.endswith(PUBLISHED_SCALE):
        base = _canonical_name(name[: -len(PUBLISHED_SCALE)] + ".weight")[: -len(".weight")]
        return base + (MXFP4_SCALE if mxfp4_expert else CANONICAL_SCALE)
    return _canonical_name(name)


def routed_expert_of_scale(name: str) -> str | None:
    """The canonical linear name (``model.layers.{i}.ffn.experts.{e}.w{1,2,3}``) of a published
    routed expert's ``.scale``, else None: the only scales that may be MXFP4 ones."""
    if not name.endswith(PUBLISHED_SCALE):
        return None
    base = _canonical_name(name[: -len(PUBLISHED_SCALE)] + ".weight")[: -len(".weight")]
    return base if _EXPERT_LINEAR.search(base) else None


def official_tensor_to_canonical(name: str, t: torch.Tensor, *, mxfp4_expert: bool = False) -> tuple[str, torch.Tensor]:
    """One published-layout tensor -> ``(canonical name, tensor)``; a canonical name passes unchanged.

    Args:
        name, t: the tensor as stored.
        mxfp4_expert: a ``.scale`` of a routed expert stored in MXFP4 (``expert_dtype: fp4``): renamed
            ``.weight_scale`` (else a block-FP8 ``.weight_scale_inv``): :func:`official_name_to_canonical`.

    Returns:
        The canonical name and the tensor: the int32 ``tid2eid`` widened to int64, a float32 scale
        container cast to float8_e8m0fnu exactly, a routed expert's packed int8 / float4 codes viewed
        as uint8, anything else the same object.

    Raises:
        CheckpointError: a ``.scale`` that is not a power-of-two float32 or float8_e8m0fnu tensor.
    """
    new = official_name_to_canonical(name, mxfp4_expert=mxfp4_expert)
    if name.endswith(PUBLISHED_SCALE):
        return new, _e8m0_from_float32(name, t)
    if new.endswith(".ffn.gate.tid2eid") and t.dtype == torch.int32:
        t = t.to(torch.int64)
    if name.endswith(".weight") and t.dtype in _PACKED_FP4 and _EXPERT_LINEAR.search(name[: -len(".weight")]):
        t = t.view(torch.uint8)
    return new, t


def official_stream_to_canonical(weights, is_mxfp4_expert) -> Any:
    """A stream of ``(name, tensor)`` pairs (vLLM's loader) in either layout -> canonical pairs, one at a
    time (:func:`official_tensor_to_canonical`). ``is_mxfp4_expert(canonical linear name) -> bool`` says
    which ``.scale`` tensors are MXFP4 experts' (the spec knows: their ``weight_scale`` field)."""
    for name, t in weights:
        lin = routed_expert_of_scale(name)
        yield official_tensor_to_canonical(name, t, mxfp4_expert=lin is not None and bool(is_mxfp4_expert(lin)))


def official_names_to_canonical(names, is_mxfp4_expert) -> dict[str, str]:
    """Published-layout tensor names -> ``{stored name: canonical name}`` without reading a tensor (a
    checkpoint's safetensors headers): the names :func:`official_stream_to_canonical` gives the tensors,
    ``is_mxfp4_expert`` as there.

    Raises:
        CheckpointError: two stored names that map to one canonical name (both named).
    """
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for name in names:
        lin = routed_expert_of_scale(name)
        new = official_name_to_canonical(name, mxfp4_expert=lin is not None and bool(is_mxfp4_expert(lin)))
        if new in seen:
            raise CheckpointError(f"published DeepSeek-V4 checkpoint: {seen[new]} and {name} both map to {new}")
        seen[new] = name
        out[name] = new
    return out


def official_to_canonical(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Published-layout tensors -> canonical names (:func:`official_tensor_to_canonical`; an MXFP4 routed
    expert is told by its packed int8 / uint8 / float4_e2m1fn_x2 codes; ``mtp.*`` keep their names,
    their scales renamed the same way).

    Raises:
        CheckpointError: two tensors that map to one name, or a ``.scale`` that is not a power-of-two
            float32 or float8_e8m0fnu tensor (named).
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        mx = name.endswith(PUBLISHED_SCALE) and _is_mxfp4_expert(name[: -len(PUBLISHED_SCALE)], tensors)
        new, t = official_tensor_to_canonical(name, t, mxfp4_expert=mx)
        if new in out:
            raise CheckpointError(f"published DeepSeek-V4 checkpoint: {name} and another tensor both map to {new}")
        out[new] = t
    return out


def canonical_to_official(tensors: Mapping[str, torch.Tensor], *,
                          scale_dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Canonical tensors -> the published layout (``tid2eid`` narrowed to int32, exactly; a block-FP8
    ``<linear>.weight_scale_inv`` renamed ``<linear>.scale`` in ``scale_dtype``: float32 (exact,
    what vLLM reads for ``expert_dtype: fp8``) or float8_e8m0fnu (as it is); an MXFP4 routed expert's
    ``weight_scale`` renamed ``.scale`` (e8m0 as it is) and its uint8 codes viewed as int8).

    Raises:
        CheckpointError: a hash table with ids outside int32.
        SpecError: a ``scale_dtype`` other than float32 / float8_e8m0fnu.
    """
    if scale_dtype not in SCALE_DTYPES:
        raise SpecError(f"canonical_to_official: scale_dtype={scale_dtype} must be one of {SCALE_DTYPES}")
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(CANONICAL_SCALE):
            base = _official_name(name[: -len(CANONICAL_SCALE)] + ".weight")[: -len(".weight")]
            out[base + PUBLISHED_SCALE] = t.to(scale_dtype) if t.dtype != scale_dtype else t
            continue
        if name.endswith(MXFP4_SCALE) and _is_mxfp4_expert(name[: -len(MXFP4_SCALE)], tensors):
            base = _official_name(name[: -len(MXFP4_SCALE)] + ".weight")[: -len(".weight")]
            out[base + PUBLISHED_SCALE] = t  # float8_e8m0fnu as it is (vLLM reads e8m0 for fp4 experts)
            continue
        new = _official_name(name)
        if name.endswith(".weight") and t.dtype == torch.uint8 and _EXPERT_LINEAR.search(name[: -len(".weight")]):
            t = t.view(PUBLISHED_FP4_WEIGHT)
        if new.endswith(".ffn.gate.tid2eid") and t.dtype == torch.int64:
            if t.numel() and (int(t.min()) < -2**31 or int(t.max()) >= 2**31):
                raise CheckpointError(f"{name}: expert ids outside int32 cannot be written in the published layout")
            t = t.to(torch.int32)
        out[new] = t
    return out


# ----------------------------------------------------------------------------- directories

def official_scale_dtype(cfg: Mapping) -> torch.dtype:
    """The container of the published ``.scale`` tensors for a config: float8_e8m0fnu when
    ``expert_dtype`` is ``fp4`` (DeepSeek-V4-Flash), else float32 (``fp8``, Flash-Base: vLLM 0.32's
    ``DeepseekV4FP8Config.is_scale_e8m0``)."""
    return torch.float8_e8m0fnu if cfg.get("expert_dtype") == "fp4" else torch.float32


def canonical_to_stored(tensors: Mapping[str, torch.Tensor], raw_config: Mapping) -> dict[str, torch.Tensor]:
    """Canonical tensors -> the tensors a checkpoint whose ``config.json`` is ``raw_config`` (the published
    layout) stores: :func:`canonical_to_official` with the ``.scale`` container of that config
    (:func:`official_scale_dtype`). The inverse of :func:`official_to_canonical` bit for bit on what
    this module writes (a float32 ``.scale`` of an ``expert_dtype: fp4`` checkpoint, or an e8m0 one of
    any other, comes back in the container vLLM reads for that config, with the same value).

    Raises:
        CheckpointError: a hash table with ids outside int32.
    """
    return canonical_to_official(tensors, scale_dtype=official_scale_dtype(raw_config))


def read_config_dict(model_dir: str | os.PathLike) -> dict:
    """The directory's ``config.json`` as a dict, in transformers' form (converted when published)."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    return official_config_to_hf(raw) if is_official_config(raw) else raw


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, to: str, overwrite: bool = False) -> Path:
    """Rewrite a DeepSeek-V4 checkpoint directory in the other layout (``to`` = ``"official"`` or
    ``"hf"``): config.json and one ``model.safetensors``, every tensor bit for bit (except the
    hash table's integer width); tokenizer files are copied.

    Raises:
        CheckpointError: ``src`` is already in layout ``to``, ``dst`` exists and is not empty
            (without ``overwrite``), or the tensors do not match the spec of the config.
        SpecError: a config with no counterpart in the other layout.
    """
    import shutil

    from safetensors.torch import load_file

    from .safetensors_io import save_safetensors

    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text())
    official = is_official_config(raw)
    if to not in ("official", "hf"):
        raise SpecError(f"convert_checkpoint: to={to!r} must be 'official' or 'hf'")
    if (to == "official") == official:
        raise CheckpointError(f"{src} is already in the {'published' if official else 'transformers'} layout")
    if dst.exists() and any(dst.iterdir()) and not overwrite:
        raise CheckpointError(f"{dst} exists and is not empty (pass overwrite=True)")
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):  # this module may not import hf_safetensors (it imports us)
        part = load_file(str(f))
        dup = set(part) & set(tensors)
        if dup:
            raise CheckpointError(f"{f} repeats tensors: {sorted(dup)[:5]}")
        tensors.update(part)
    if official:
        cfg, out = official_config_to_hf(raw), official_to_canonical(tensors)
    else:
        # transformers never writes the MTP block: a published config without MTP tensors says 0 blocks
        # (else readers would expect num_nextn_predict_layers blocks of mtp.* tensors)
        if not any(n.startswith("mtp.") for n in tensors):
            raw = {**raw, "num_nextn_predict_layers": 0}
        cfg = hf_config_to_official(raw)
        out = canonical_to_official(tensors, scale_dtype=official_scale_dtype(cfg))
    dst.mkdir(parents=True, exist_ok=True)
    tmp = dst / "model.safetensors.tmp"
    save_safetensors({k: v.contiguous() for k, v in out.items()}, tmp, metadata={"format": "pt"})
    os.replace(tmp, dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors", "model.safetensors.index.json") \
                and not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    return dst
