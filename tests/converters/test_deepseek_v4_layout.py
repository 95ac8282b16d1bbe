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


def _tiny_dsv4(d, **widths):
    """Save a tiny transformers-written bf16 DeepseekV4ForCausalLM (one layer of each type, hash + regular MoE)
    with the given widths into ``d``; returns ``d``."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from unified_models.models.deepseek_v4 import preset_weights

    cfg = DeepseekV4Config(
        vocab_size=64, num_hidden_layers=3, num_attention_heads=2, o_groups=2, sliding_window=4,
        n_routed_experts=4, num_experts_per_tok=2, layer_types=[S, C, H], mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={C: 4, H: 8}, hc_mult=2, index_n_heads=2, index_topk=2, max_position_embeddings=128,
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}, **widths)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg)
    preset_weights(model, 0)
    model.to(torch.bfloat16).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny transformers-written DeepseekV4ForCausalLM (one layer of each type, hash + regular MoE)."""
    return _tiny_dsv4(tmp_path_factory.mktemp("dsv4_hf"), hidden_size=32, moe_intermediate_size=16, head_dim=16,
                      partial_rotary_factor=0.25, q_lora_rank=8, o_lora_rank=4, index_head_dim=8)


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


# ----------------------------------------------------------------------------- through Megatron

def _same_files(a, b) -> None:
    """config.json and the tensors of two checkpoint directories equal: names, dtypes and bits."""
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    ta, tb = read_tensors(a), read_tensors(b)
    assert sorted(ta) == sorted(tb)
    for n in ta:
        assert ta[n].dtype == tb[n].dtype and ta[n].shape == tb[n].shape, n
        assert torch.equal(_bits(ta[n]), _bits(tb[n])), n


def test_published_checkpoint_round_trips_through_megatron_in_its_layout(hf_dir, tmp_path):
    """`convert --from hf --to megatron` takes a published-layout checkpoint (stored under the spec's
    canonical names, as the engines load it) and `convert --from megatron --to hf` writes it back in
    the published layout: the same config.json bytes, tensor names, dtypes (int32 tid2eid) and bits,
    which `check`'s loader accepts. A transformers-layout checkpoint still comes back as it was."""
    from unified_models.backends.megatron.dist_ckpt import check_dist_checkpoint
    from unified_models.cli import main

    off = tmp_path / "official"
    layout.convert_checkpoint(hf_dir, off, to="official")
    (off / "generation_config.json").write_text('{"bos_token_id": 0, "eos_token_id": 1}\n')
    meg, back = tmp_path / "meg", tmp_path / "back"
    assert main(["convert", "--from", "hf", "--to", "megatron", str(off), str(meg)]) == 0
    info = check_dist_checkpoint(meg)
    assert info.config_text == (off / "config.json").read_text()
    assert set(info.tensors_metadata) == set(info.spec.parameter_shapes())  # canonical names inside
    assert "model.embed_tokens.weight" in info.tensors_metadata and "embed.weight" not in info.tensors_metadata
    assert main(["convert", "--from", "megatron", "--to", "hf", str(meg), str(back)]) == 0
    _same_files(off, back)
    t = read_tensors(back)
    assert "embed.weight" in t and "layers.0.attn.kv_norm.weight" in t
    assert t["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert (back / "generation_config.json").read_bytes() == (off / "generation_config.json").read_bytes()
    _, spec_hf, sd_hf = spec_and_state_dict(hf_dir)
    _, spec_back, sd_back = spec_and_state_dict(back)
    assert spec_back == spec_hf and _same(sd_hf, sd_back)
    # the transformers layout is untouched
    assert main(["convert", "--from", "hf", "--to", "megatron", str(hf_dir), str(tmp_path / "meg2")]) == 0
    assert main(["convert", "--from", "megatron", "--to", "hf", str(tmp_path / "meg2"), str(tmp_path / "hf2")]) == 0
    _same_files(hf_dir, tmp_path / "hf2")


def test_training_checkpoint_of_a_published_checkpoint_converts_back_in_its_layout(hf_dir, tmp_path):
    """What `rl --model <published checkpoint> --save` writes (the published config.json, the trainer's
    canonical tensors) converts to the published layout: every trained parameter under its published
    name, bit for bit, loading into the same spec."""
    from unified_models.backends.megatron.dist_ckpt import megatron_to_hf
    from unified_models.backends.megatron.optimizer import OptimizerConfig
    from unified_models.backends.megatron.trainer import Trainer, TrainerOptions

    off = tmp_path / "official"
    layout.convert_checkpoint(hf_dir, off, to="official")
    _, spec, state = spec_and_state_dict(off)
    with Trainer(spec, state, options=TrainerOptions(optimizer=OptimizerConfig(lr=1e-3))) as trainer:
        trainer.step([[1, 2, 3, 4], [7, 8]], [[5, 6, 7], [9, 10, 11]], lambda b: -b.logprobs.sum())
        trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        it = trainer.save(tmp_path / "ck", iteration=1, hf_config=(off / "config.json").read_text(), assets_from=off)
    moved = "model.layers.1.attn.wq_a.weight"
    assert not torch.equal(trained[moved], state[moved])  # trained values are compared below
    back = megatron_to_hf(it, tmp_path / "back")
    assert (back / "config.json").read_bytes() == (off / "config.json").read_bytes()
    t = read_tensors(back)
    assert sorted(t) == sorted(read_tensors(off))
    assert _same(t, layout.canonical_to_official(trained))
    _, spec_back, sd_back = spec_and_state_dict(back)
    assert spec_back == spec and _same(sd_back, trained)


@pytest.fixture(scope="module")
def fp8_base(tmp_path_factory):
    """A bf16 DeepSeek-V4 whose linears all take 128x128 blocks (K a multiple of 128), for block-FP8 exports."""
    return _tiny_dsv4(tmp_path_factory.mktemp("dsv4_fp8_base"), hidden_size=128, moe_intermediate_size=128,
                      head_dim=80, partial_rotary_factor=0.2, q_lora_rank=128, o_lora_rank=64, index_head_dim=16)


@pytest.mark.parametrize("expert_dtype, scale_dtype, expert_code_dtype", [
    ("fp8", torch.float32, torch.float8_e4m3fn),  # Flash-Base: float32 .scale containers
    ("fp4", torch.float8_e8m0fnu, torch.int8),  # Flash: e8m0 .scale, MXFP4 experts as int8 bytes
])
def test_published_block_fp8_checkpoint_round_trips_through_megatron(fp8_base, expert_dtype, scale_dtype,
                                                                     expert_code_dtype, tmp_path):
    """A published block-FP8 checkpoint through Megatron and back: the same `.scale` containers, codes and
    names; the training checkpoint of its masters converts to the published layout too: the masters
    under the config without quantization_config, and with requantize the published quantized layout
    (the rule every weight sync applies to the masters)."""
    from unified_models.backends.megatron.dist_ckpt import hf_to_megatron, megatron_to_hf
    from unified_models.backends.megatron.optimizer import OptimizerConfig
    from unified_models.backends.megatron.trainer import Trainer, TrainerOptions
    from unified_models.converters.deepseek_fp8 import export_deepseek_fp8
    from unified_models.converters.modelopt import quantize_state_dict

    off = export_deepseek_fp8(fp8_base, tmp_path / "official", layout="official", expert_dtype=expert_dtype)
    t = read_tensors(off)
    assert {v.dtype for n, v in t.items() if n.endswith(".scale")} == {scale_dtype}
    assert t["layers.1.ffn.experts.0.w1.weight"].dtype == expert_code_dtype
    back = megatron_to_hf(hf_to_megatron(off, tmp_path / "meg"), tmp_path / "back")
    _same_files(off, back)
    _, qspec, state = spec_and_state_dict(off)
    with Trainer(qspec, state, options=TrainerOptions(optimizer=OptimizerConfig(lr=1e-3))) as trainer:
        assert trainer.trains_masters
        masters = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        it = trainer.save(tmp_path / "ck", iteration=1, hf_config=(off / "config.json").read_text(), assets_from=off)
    plain = megatron_to_hf(it, tmp_path / "masters")
    cfg = json.loads((plain / "config.json").read_text())
    assert "quantization_config" not in cfg and layout.is_official_config(cfg)
    tp = read_tensors(plain)
    assert "embed.weight" in tp and not any(n.endswith(".scale") for n in tp)
    _, pspec, psd = spec_and_state_dict(plain)
    assert not pspec.stores_quantized_weights and _same(psd, {n: masters[n] for n in psd})
    req = megatron_to_hf(it, tmp_path / "requantized", requantize=True)
    assert (req / "config.json").read_bytes() == (off / "config.json").read_bytes()
    tr = read_tensors(req)
    assert sorted(tr) == sorted(t) and all(tr[n].dtype == t[n].dtype for n in t)
    published_cfg = json.loads((off / "config.json").read_text())
    assert _same(tr, layout.canonical_to_stored(quantize_state_dict(masters, qspec), published_cfg))
    _, rspec, _ = spec_and_state_dict(req)
    assert rspec == qspec


@pytest.mark.parametrize("extra,named", [
    ({"compress_ratios": [0, 4, 16, 16]}, r"layer_types=.*disagrees with compress_ratios=\[0, 4, 16, 16\]"),
    ({"compress_ratios": [0, 4, 32, 4]}, r"compress_rates=.*disagrees with compress_ratios=\[0, 4, 32, 4\]"),
    ({"num_hash_layers": 2}, r"mlp_layer_types=.*disagrees with num_hash_layers=2"),
])
def test_a_transformers_config_whose_published_fields_say_another_model_is_refused(tmp_path, extra, named):
    """transformers' ``DeepseekV4Config`` drops ``compress_ratios`` / ``num_hash_layers`` beside
    ``layer_types``: a config where they disagree would run another model than the published fields
    describe, silently (a break test found it accepted). Agreeing fields are accepted."""
    import json
    import shutil

    from unified_models.converters.hf_safetensors import load_hf_config
    from unified_models.dsl import SpecError
    from unified_models.presets import build_preset_checkpoint

    d = tmp_path / "m"
    shutil.copytree(build_preset_checkpoint("deepseek_v4_tiny"), d)  # layers S C H C, first layer hash-routed
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "compress_ratios": [0, 4, 16, 4], "num_hash_layers": 1}))
    assert load_hf_config(d).layer_types == raw["layer_types"]  # the same model said twice: accepted
    (d / "config.json").write_text(json.dumps({**raw, **extra}))
    with pytest.raises(SpecError, match=named):
        load_hf_config(d)
