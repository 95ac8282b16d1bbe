"""The DeepSeek-V4 declaration (``models/deepseek_v4.py``): names and shapes are exactly what
transformers' ``save_pretrained`` writes, every config field it cannot honour is refused by name,
and ``check`` runs end to end on transformers-written checkpoints (peer: our fp32 reference vs
transformers' fp32 ``DeepseekV4ForCausalLM``; rollout through vLLM and the trainer's recompute
with diff = 0 on every field)."""

from __future__ import annotations

import json

import pytest
import torch

from unified_models.dsl import SpecError, UnsupportedLayerError
from unified_models.models import spec_from_hf_config

S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def _config(**over):
    from transformers import DeepseekV4Config

    kw = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=2,
              head_dim=16, partial_rotary_factor=0.25, q_lora_rank=8, o_groups=2, o_lora_rank=4, sliding_window=4,
              n_routed_experts=4, num_experts_per_tok=2, layer_types=[S, C, H],
              mlp_layer_types=["hash_moe", "moe", "moe"], compress_rates={C: 4, H: 8}, hc_mult=2, index_n_heads=2,
              index_head_dim=8, index_topk=2, max_position_embeddings=128,
              rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64})
    kw.update(over)
    return DeepseekV4Config(**kw)


def test_names_shapes_and_dtypes_are_what_transformers_saves(tmp_path):
    from safetensors.torch import load_file
    from transformers import DeepseekV4ForCausalLM

    cfg = _config()
    torch.manual_seed(0)
    DeepseekV4ForCausalLM(cfg).save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    spec = spec_from_hf_config(cfg)
    assert spec.parameter_shapes() == {k: tuple(v.shape) for k, v in saved.items()}
    dtypes = spec.parameter_dtypes()
    assert dtypes["model.layers.0.ffn.gate.tid2eid"] == torch.int64 == saved["model.layers.0.ffn.gate.tid2eid"].dtype
    assert dtypes["model.layers.1.hc_attn_fn"] == dtypes["model.hc_head.hc_fn"] == torch.float32
    assert dtypes["model.layers.2.attn.attn_sink"] == torch.float32
    assert spec.extra == {"pattern": "S#CH", "mtp_layers": 0} and spec.inert_parameters == ()
    a1, a2 = spec.blocks[1].sublayers[0].mixer, spec.blocks[2].sublayers[0].mixer
    assert (a1.compress_ratio, a1.index_topk, a1.rope_type, a1.rope_theta) == (4, 2, "yarn", 160000.0)
    assert (a2.compress_ratio, a2.yarn.factor, a2.yarn.original_max_position_embeddings) == (8, 2.0, 64)
    a0 = spec.blocks[0].sublayers[0].mixer
    assert (a0.rope_type, a0.rope_theta, a0.compress_ratio) == ("default", 10000.0, 0)
    assert spec.blocks[0].sublayers[1].mixer.hash_routing and not spec.blocks[1].sublayers[1].mixer.hash_routing
    assert spec.residual.hc_mult == 2 and spec.residual.sinkhorn_iters == 20


@pytest.mark.parametrize("field,value,match", [
    ("scoring_func", "sigmoid", "scoring_func='sigmoid'"),
    ("num_key_value_heads", 2, "num_key_value_heads=2"),
    ("mlp_bias", True, "mlp_bias=True"),
    ("attention_dropout", 0.1, "attention_dropout=0.1"),
    ("router_jitter_noise", 0.5, "router_jitter_noise=0.5"),
    ("n_shared_experts", 2, "n_shared_experts=2"),
    ("norm_topk_prob", False, "norm_topk_prob=False"),
    ("topk_method", "greedy", "topk_method='greedy'"),
    ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
    ("some_new_field", 3, r"\['some_new_field'\]"),
    ("layer_types", [S, "full_attention", H], r"layer_types\[1\]='full_attention'"),
    ("mlp_layer_types", ["sparse", "dense", "moe"], r"mlp_layer_types\[0\]='sparse'"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor"),
    ("num_nextn_predict_layers", -1, "num_nextn_predict_layers=-1"),
])
def test_config_refusals_name_the_field(field, value, match):
    cfg = _config()
    object.__setattr__(cfg, field, value)  # past transformers' own validation, as a hand-edited config would be
    with pytest.raises((SpecError, UnsupportedLayerError), match=match):
        spec_from_hf_config(cfg)


def test_yarn_on_sliding_layers_is_refused():
    cfg = _config()
    cfg.rope_parameters["main"] = {**cfg.rope_parameters["compress"]}
    with pytest.raises(SpecError, match=r"rope_parameters\['main'\] is YaRN"):
        spec_from_hf_config(cfg)


def _check(model_dir, tmp_path, n_prompts=2, new=24):
    from unified_models.check import CheckOptions, run_check

    out = tmp_path / "report.json"
    rc = run_check(CheckOptions(model=str(model_dir), num_prompts=n_prompts, max_new_tokens=new, device="cpu",
                                json_out=str(out)))
    return rc, json.loads(out.read_text())


def _assert_passed(rc, report):
    assert report["tokens_compared"] > 0
    diff = {k: report[k] for k in ("max_abs_diff", "mean_abs_diff", "std_abs_diff", "k3_kl", "num_mismatched")}
    assert all(v == 0 for v in diff.values()), diff
    assert report["full_vocab_rows"] > 0 and report["full_vocab_max_abs_diff"] == 0.0
    assert report["peer"]["within_tolerance"], report["peer"]
    assert report["peer"]["max_rel_logit_diff"] < 1e-5, report["peer"]  # fp32 rounding, not a loose pass
    assert rc == 0 and report["passed"]


def _transformers_checkpoint(d, layer_types, mlp_layer_types):
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from unified_models.models.deepseek_v4 import preset_weights
    from unified_models.presets import load_preset, tokenizer_dir

    hf = dict(load_preset("deepseek_v4_tiny")["hf_config"])
    hf.update(layer_types=layer_types, mlp_layer_types=mlp_layer_types, num_hidden_layers=len(layer_types))
    cfg = AutoConfig.for_model("deepseek_v4", **hf)
    cfg.architectures = ["DeepseekV4ForCausalLM"]
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    preset_weights(model, 1)
    model.to(torch.bfloat16).save_pretrained(d)
    for f in tokenizer_dir().iterdir():
        shutil.copy(f, d / f.name)
    return d


def test_check_on_a_transformers_written_checkpoint(tmp_path):
    """Sliding and HCA layers (ratio 16 < the prompts), a hash-MoE layer, mHC, through ``check``."""
    d = _transformers_checkpoint(tmp_path / "ckpt", [S, H, S], ["hash_moe", "moe", "moe"])
    _assert_passed(*_check(d, tmp_path))


def test_check_on_the_tiny_preset(tmp_path, monkeypatch):
    """``unified-models check --preset deepseek_v4_tiny``: all three layer types."""
    from unified_models.check import CheckOptions, run_check

    monkeypatch.setenv("UNIFIED_MODELS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "report.json"
    rc = run_check(CheckOptions(preset="deepseek_v4_tiny", num_prompts=2, max_new_tokens=24, device="cpu",
                                json_out=str(out)))
    _assert_passed(rc, json.loads(out.read_text()))
