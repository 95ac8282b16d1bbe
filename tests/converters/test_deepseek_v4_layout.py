"""DeepSeek-V4's two checkpoint layouts (``converters/deepseek_v4_layout.py``): a transformers-written
checkpoint and its published-layout conversion read into the same spec and state dict, the round
trips are bitwise, MTP tensors of a published checkpoint load as inert parameters, and a checkpoint
whose config and tensor names disagree is refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from unified_models.converters import deepseek_v4_layout as layout
from unified_models.converters.hf_safetensors import read_tensors, spec_and_state_dict
from unified_models.dsl import CheckpointError

S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny transformers-written DeepseekV4ForCausalLM (one layer of each type, hash + regular MoE)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from unified_models.models.deepseek_v4 import preset_weights

    cfg = DeepseekV4Config(
        vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
        head_dim=16, partial_rotary_factor=0.25, q_lora_rank=8, o_groups=2, o_lora_rank=4, sliding_window=4,
        n_routed_experts=4, num_experts_per_tok=2, layer_types=[S, C, H], mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={C: 4, H: 8}, hc_mult=2, index_n_heads=2, index_head_dim=8, index_topk=2,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg)
    preset_weights(model, 0)
    d = tmp_path_factory.mktemp("dsv4_hf")
    model.to(torch.bfloat16).save_pretrained(d)
    return d


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.is_floating_point() else t


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                        and torch.equal(_bits(a[k]), _bits(b[k])) for k in a)


def test_official_layout_names_and_round_trip_bitwise(hf_dir, tmp_path):
    off, back = tmp_path / "official", tmp_path / "back"
    layout.convert_checkpoint(hf_dir, off, to="official")
    cfg = json.loads((off / "config.json").read_text())
    assert cfg["compress_ratios"] == [0, 4, 8] and cfg["num_hash_layers"] == 1 and cfg["topk_method"] == "noaux_tc"
    assert "layer_types" not in cfg and "mlp_layer_types" not in cfg and cfg["rope_scaling"]["type"] == "yarn"
    t = read_tensors(off)
    for name in ("embed.weight", "norm.weight", "head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale",
                 "layers.0.attn.kv_norm.weight", "layers.1.attn.compressor.norm.weight",
                 "layers.1.attn.indexer.compressor.ape", "layers.2.hc_ffn_fn"):
        assert name in t, name
    assert not any(n.startswith("model.") for n in t) and "layers.0.attn.norm.weight" not in t
    assert t["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    # both directories give one spec and one state dict
    _, spec_hf, sd_hf = spec_and_state_dict(hf_dir)
    _, spec_off, sd_off = spec_and_state_dict(off)
    assert spec_off == spec_hf and _same(sd_hf, sd_off)
    assert sd_off["model.layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    layout.convert_checkpoint(off, back, to="hf")
    assert _same(read_tensors(hf_dir), read_tensors(back))
    assert spec_and_state_dict(back)[1] == spec_hf


def test_mtp_tensors_load_as_inert_parameters_and_round_trip(hf_dir, tmp_path):
    off, back, again = tmp_path / "official", tmp_path / "back", tmp_path / "again"
    layout.convert_checkpoint(hf_dir, off, to="official")
    cfg = json.loads((off / "config.json").read_text())
    cfg.update(num_nextn_predict_layers=1, compress_ratios=cfg["compress_ratios"] + [0])
    (off / "config.json").write_text(json.dumps(cfg))
    from unified_models.converters.hf_safetensors import load_hf_config
    from unified_models.models import spec_from_hf_config

    spec = spec_from_hf_config(load_hf_config(off))
    assert spec.extra["mtp_layers"] == 1
    g = torch.Generator().manual_seed(1)
    t = read_tensors(off)
    for name, shape, dtype in spec.inert_parameters:
        t[name] = torch.randn(shape, generator=g).to(dtype)
    assert {"mtp.0.e_proj.weight", "mtp.0.attn.kv_norm.weight", "mtp.0.hc_head_fn", "mtp.0.ffn.gate.bias"} <= set(t)
    save_file(t, str(off / "model.safetensors"))
    _, spec2, sd = spec_and_state_dict(off)
    assert spec2 == spec and all(torch.equal(_bits(sd[n]), _bits(t[n])) for n, _, _ in spec.inert_parameters)
    assert {n for n, _, _ in spec.inert_parameters} <= spec.untrained_parameter_names()
    layout.convert_checkpoint(off, back, to="hf")
    assert spec_and_state_dict(back)[1] == spec  # topk_method kept: the MTP block is still declared
    layout.convert_checkpoint(back, again, to="official")
    assert _same(read_tensors(off), read_tensors(again))
    # the same published config without its MTP tensors is refused, naming them
    save_file({k: v for k, v in t.items() if not k.startswith("mtp.")}, str(off / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors.*mtp.0"):
        spec_and_state_dict(off)


def test_mixed_layouts_are_refused(hf_dir, tmp_path):
    d = tmp_path / "mixed"
    layout.convert_checkpoint(hf_dir, d, to="official")
    save_file(load_file(str(hf_dir / "model.safetensors")), str(d / "model.safetensors"))  # transformers' names
    with pytest.raises(CheckpointError, match="config.json is in DeepSeek's published layout but the tensor names"):
        spec_and_state_dict(d)
    with pytest.raises(CheckpointError, match="already in the transformers layout"):
        layout.convert_checkpoint(hf_dir, tmp_path / "x", to="hf")
