"""DeepSeek-V4 checkpoints in DeepSeek's published layout through our vLLM backend, on the CPU.

* ``engine.validate_checkpoint`` (the pre-flight of ``make_llm``, safetensors headers only) checks a
  published checkpoint under the canonical names its tensors load as (the tiny bf16, block-FP8 and
  MXFP4-expert presets), lists a corrupted one's missing / unexpected / mis-shaped tensors by
  canonical name, and refuses a config and tensor names in different layouts.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from unified_models.converters import deepseek_v4_layout as layout
from unified_models.dsl import CheckpointError

PRESETS = ("deepseek_v4_tiny", "deepseek_v4_tiny_fp8", "deepseek_v4_tiny_fp4")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``preset -> (transformers-layout dir, published-layout dir)``, built on first use in a private cache."""
    from unified_models.presets import build_preset_checkpoint

    root = tmp_path_factory.mktemp("um_cache")
    built: dict[str, tuple] = {}

    def get(preset: str):
        if preset not in built:
            old = os.environ.get("UNIFIED_MODELS_CACHE")
            os.environ["UNIFIED_MODELS_CACHE"] = str(root)
            try:
                hf = build_preset_checkpoint(preset)
            finally:
                if old is None:
                    os.environ.pop("UNIFIED_MODELS_CACHE")
                else:
                    os.environ["UNIFIED_MODELS_CACHE"] = old
            built[preset] = hf, layout.convert_checkpoint(hf, root / f"{preset}-published", to="official")
        return built[preset]

    return get


def _names(d) -> list[str]:
    with safe_open(str(d / "model.safetensors"), framework="pt") as h:
        return list(h.keys())


def test_official_name_to_canonical():
    f = layout.official_name_to_canonical
    assert f("embed.weight") == "model.embed_tokens.weight" and f("model.norm.weight") == "model.norm.weight"
    assert f("layers.3.attn.kv_norm.weight") == "model.layers.3.attn.norm.weight"
    assert f("hc_head_fn") == "model.hc_head.hc_fn" and f("head.weight") == "head.weight"
    assert f("layers.1.attn.wq_a.scale") == "model.layers.1.attn.wq_a.weight_scale_inv"
    assert f("layers.2.ffn.experts.5.w2.scale") == "model.layers.2.ffn.experts.5.w2.weight_scale_inv"
    assert f("layers.2.ffn.experts.5.w2.scale", mxfp4_expert=True) == "model.layers.2.ffn.experts.5.w2.weight_scale"
    assert f("mtp.0.attn.kv_norm.weight") == "mtp.0.attn.kv_norm.weight"
    assert f("model.layers.0.ffn.gate.tid2eid") == "model.layers.0.ffn.gate.tid2eid"  # canonical: unchanged
    assert layout.routed_expert_of_scale("layers.2.ffn.experts.5.w2.scale") == "model.layers.2.ffn.experts.5.w2"
    assert layout.routed_expert_of_scale("layers.2.ffn.shared_experts.w2.scale") is None
    # the tensor-level conversion names tensors the same way
    assert layout.official_tensor_to_canonical("layers.0.ffn.gate.tid2eid", torch.zeros(2, 2, dtype=torch.int32))[0] \
        == "model.layers.0.ffn.gate.tid2eid"
    with pytest.raises(CheckpointError, match="embed.weight and model.embed_tokens.weight both map to "
                                              "model.embed_tokens.weight"):
        layout.official_names_to_canonical(["embed.weight", "model.embed_tokens.weight"], lambda lin: False)


@pytest.mark.parametrize("preset", PRESETS)
def test_validate_checkpoint_passes_on_a_published_checkpoint(checkpoints, preset):
    from unified_models.backends.vllm.engine import _spec, validate_checkpoint

    hf, pub = checkpoints(preset)
    names = _names(pub)
    assert "embed.weight" in names and "layers.0.attn.kv_norm.weight" in names
    assert not any(n.startswith("model.") for n in names)
    spec = _spec(pub)
    assert spec == _spec(hf)
    validate_checkpoint(pub)
    validate_checkpoint(pub, spec)
    validate_checkpoint(hf)
    # the names validate_checkpoint checks are the spec's, bit for bit the loader's (official_to_canonical)
    expected = spec.parameter_shapes()
    mapped = layout.official_names_to_canonical(names, lambda lin: f"{lin}{layout.MXFP4_SCALE}" in expected)
    assert sorted(mapped.values()) == sorted(layout.official_to_canonical(load_file(str(pub / "model.safetensors"))))
    assert set(mapped.values()) == set(expected)
    scales = {n: mapped[n] for n in names if n.endswith(".experts.0.w1.scale")}
    if preset == "deepseek_v4_tiny":
        assert not scales
    else:  # fp8 experts: block-FP8 scales; fp4 (MXFP4) experts: weight_scale
        want = ".weight_scale" if preset.endswith("fp4") else ".weight_scale_inv"
        assert scales and all(v.endswith(want) for v in scales.values()), scales


def test_validate_checkpoint_lists_the_bad_tensors_of_a_published_checkpoint(checkpoints, tmp_path):
    from unified_models.backends.vllm.engine import validate_checkpoint

    _, pub = checkpoints("deepseek_v4_tiny")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((pub / "config.json").read_text())
    t = load_file(str(pub / "model.safetensors"))
    del t["layers.1.attn.kv_norm.weight"], t["embed.weight"]
    t["layers.1.attn.bogus.weight"] = torch.zeros(3)
    t["norm.weight"] = torch.zeros(7, dtype=torch.bfloat16)
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        validate_checkpoint(bad)
    msg = str(e.value)
    assert f"checkpoint {bad} does not match the deepseek_v4 spec" in msg
    assert "missing tensors: ['model.embed_tokens.weight', 'model.layers.1.attn.norm.weight']" in msg
    assert "unexpected tensors: ['model.layers.1.attn.bogus.weight']" in msg
    assert "mis-shaped tensors: ['model.norm.weight: expected (64,), got (7,)']" in msg


def test_validate_checkpoint_refuses_a_config_and_tensors_in_different_layouts(checkpoints, tmp_path):
    from unified_models.backends.vllm.engine import validate_checkpoint

    hf, pub = checkpoints("deepseek_v4_tiny")
    for config_from, tensors_from, said in ((pub, hf, "DeepSeek's published layout but the tensor names are in "
                                                      "the transformers layout"),
                                            (hf, pub, "the transformers layout but the tensor names are in "
                                                      "DeepSeek's published layout")):
        d = tmp_path / f"mixed_{config_from.name}"
        d.mkdir()
        (d / "config.json").write_text((config_from / "config.json").read_text())
        (d / "model.safetensors").symlink_to(tensors_from / "model.safetensors")
        assert json.loads((d / "config.json").read_text())["model_type"] == "deepseek_v4"
        with pytest.raises(CheckpointError, match=re.escape(f"checkpoint {d}: config.json is in {said}; convert one")):
            validate_checkpoint(d)
