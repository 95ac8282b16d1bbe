"""`check` on a ModelOpt-format hybrid Nemotron-H (every layer type, NVFP4 experts, FP8 Mamba projections,
FP8 KV cache) through the CLI, on CPU: rollout (vLLM) == trainer (Megatron module) bitwise."""

from __future__ import annotations

import json

import pytest
import torch

from unified_models.cli import main


@pytest.fixture(scope="module")
def quantized_hybrid(tmp_path_factory):
    """``unified-models quantize`` of the tiny hybrid: NVFP4 experts, FP8 Mamba in/out_proj, FP8 KV."""
    from unified_models.presets import build_preset_checkpoint

    bf16 = build_preset_checkpoint("nemotron_h_hybrid_tiny", out_dir=tmp_path_factory.mktemp("hy") / "bf16")
    out = tmp_path_factory.mktemp("hy") / "modelopt"
    assert main(["quantize", str(bf16), str(out), "--num-calibration-prompts", "8"]) == 0
    return bf16, out


def test_quantized_checkpoint_declares_every_format(quantized_hybrid):
    from unified_models.converters.hf_safetensors import spec_and_state_dict
    from unified_models.dsl import AttentionSpec, Mamba2Spec, MoESpec

    _, out = quantized_hybrid
    qc = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert qc["kv_cache_quant_algo"] == "FP8"
    algos = {v["quant_algo"] for v in qc["quantized_layers"].values()}
    assert algos == {"W4A16_NVFP4", "FP8"}
    _, spec, sd = spec_and_state_dict(out)
    kinds = {type(b.mixer) for b in spec.sublayers}
    assert kinds >= {AttentionSpec, Mamba2Spec, MoESpec}
    for b in spec.sublayers:
        m = b.mixer
        if isinstance(m, Mamba2Spec):
            assert spec.weight_format(f"{m.name}.in_proj").format == "fp8"
            assert sd[f"{m.name}.in_proj.weight"].dtype == torch.float8_e4m3fn
            assert 0 < float(sd[f"{m.name}.in_proj.input_scale"]) < 1  # calibrated amax / 448
        elif isinstance(m, MoESpec):
            assert spec.weight_format(m.expert_linear(0, "up_proj")).format == "nvfp4"
            assert sd[f"{m.name}.experts.0.up_proj.weight"].dtype == torch.uint8
        elif isinstance(m, AttentionSpec):
            assert m.kv_cache_dtype == "fp8_e4m3"
            assert 0 < float(sd[f"{m.name}.k_proj.k_scale"]) < 1 and 0 < float(sd[f"{m.name}.v_proj.v_scale"]) < 1


def test_check_on_the_quantized_hybrid_is_diff_zero(quantized_hybrid, tmp_path):
    """16 GSM8K prompts x 128 sampled tokens = 2048 compared tokens. Chunk size 16: every prompt crosses
    several Mamba chunks in prefill and the decode crosses 8 more; 2 sequences at a time so requests
    join and leave running batches."""
    bf16, out = quantized_hybrid
    report = tmp_path / "q.json"
    status = main(["check", "--model", str(out), "--num-prompts", "16", "--max-new-tokens", "128",
                   "--max-num-seqs", "6", "--json", str(report)])
    r = json.loads(report.read_text())
    assert status == 0 and r["passed"] is True
    assert r["tokens_compared"] == 2048
    for k in ("max_abs_diff", "mean_abs_diff", "std_abs_diff", "k3_kl", "full_vocab_max_abs_diff"):
        assert r[k] == 0.0, k
    assert r["num_mismatched"] == 0
    assert r["peer"]["within_tolerance"] and 0 < r["peer"]["max_abs_logit_diff"] < 1e-4
    assert "dequantized" in r["peer"]["against"]
    # the quantized model really runs quantized: same prompts and seeds, other logprob bits than its source
    shas = []
    for model in (bf16, out):
        small = tmp_path / f"{model.name}.json"
        assert main(["check", "--model", str(model), "--num-prompts", "2", "--max-new-tokens", "16",
                     "--json", str(small)]) == 0
        shas.append(json.loads(small.read_text())["rollout_sha256"])
    assert shas[0] != shas[1]


def test_quantized_preset_equals_the_cli_export(quantized_hybrid, tmp_path):
    """The preset ``nemotron_h_hybrid_tiny_nvfp4`` is the bf16 preset through the same export (16
    calibration prompts instead of 8: the static FP8 scales may differ, the NVFP4 codes may not)."""
    from safetensors.torch import load_file

    from unified_models.presets import build_preset_checkpoint

    _, cli = quantized_hybrid
    preset = build_preset_checkpoint("nemotron_h_hybrid_tiny_nvfp4", out_dir=tmp_path / "p")
    assert json.loads((preset / "hf_quant_config.json").read_text()) == json.loads(
        (cli / "hf_quant_config.json").read_text())
    a, b = load_file(str(preset / "model.safetensors")), load_file(str(cli / "model.safetensors"))
    assert set(a) == set(b)
    experts = [n for n in a if ".experts." in n]
    assert experts and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in experts
                           if a[n].dtype in (torch.uint8, torch.float8_e4m3fn))
    assert all(torch.equal(a[n], b[n]) for n in experts if a[n].dtype == torch.float32)
    # a second call reuses the directory
    assert build_preset_checkpoint("nemotron_h_hybrid_tiny_nvfp4", out_dir=tmp_path / "p") == preset


def test_an_overflowing_scale_is_a_clear_error_not_a_pass(quantized_hybrid, tmp_path, capsys):
    """A finite but absurd scale passes the load checks; the NaN logits it causes must fail the peer
    (never count as a perfect match) and stop the rollout with a clear error (exit 2)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from unified_models.check import peer_check
    from unified_models.converters.hf_safetensors import spec_and_state_dict

    _, out = quantized_hybrid
    bad = tmp_path / "huge"
    shutil.copytree(out, bad)
    t = load_file(str(bad / "model.safetensors"))
    t["backbone.layers.3.mixer.experts.5.up_proj.weight_scale_2"] = torch.tensor(1e30)
    save_file(t, str(bad / "model.safetensors"), metadata={"format": "pt"})
    _, spec, sd = spec_and_state_dict(bad)
    peer = peer_check(spec, sd, bad, [list(range(1, 40))], 1e-4)
    assert peer["max_abs_logit_diff"] == float("inf") and not peer["within_tolerance"]
    capsys.readouterr()
    assert main(["check", "--model", str(bad), "--num-prompts", "2", "--max-new-tokens", "8"]) == 2
    assert "logprob is NaN at prompt" in capsys.readouterr().err


def test_rl_on_the_quantized_hybrid_syncs_requantized_masters(quantized_hybrid, tmp_path):
    """`rl` on a ModelOpt checkpoint trains bf16 masters and re-quantizes them into vLLM at every
    sync, NVFP4 expert codes (uint8 tensors) included: two steps, diff = 0, every sync verified."""
    _, out = quantized_hybrid
    metrics = tmp_path / "m.jsonl"
    assert main(["rl", "--model", str(out), "--reward", "token-set", "--steps", "2", "--num-prompts-per-step", "2",
                 "--group-size", "2", "--max-new-tokens", "4", "--metrics", str(metrics), "--no-plot"]) == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["max_abs_diff"] == 0.0 and r["k3_kl"] == 0.0 and r["full_vocab_max_abs_diff"] == 0.0
        assert r["weight_fingerprint_tensors"] > 0
