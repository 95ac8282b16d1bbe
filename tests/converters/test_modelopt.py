"""ModelOpt-format checkpoints: export from bf16, load, validation errors, masters, Megatron round trip."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from unified_models import ops
from unified_models.converters.hf_safetensors import spec_and_state_dict
from unified_models.converters.modelopt import (
    dequantize_state_dict,
    export_modelopt,
    master_spec,
    quantize_state_dict,
)
from unified_models.dsl import CheckpointError, MoESpec
from unified_models.dsl.weights import LinearFormat


@pytest.fixture(scope="module")
def hybrid_bf16_dir(tmp_path_factory):
    from unified_models.presets import build_preset_checkpoint

    return build_preset_checkpoint("nemotron_h_hybrid_tiny", out_dir=tmp_path_factory.mktemp("hy") / "bf16")


@pytest.fixture(scope="module")
def nvfp4_dir(hybrid_bf16_dir, tmp_path_factory):
    """Routed experts only (no calibration needed)."""
    return export_modelopt(hybrid_bf16_dir, tmp_path_factory.mktemp("hy") / "nvfp4", experts="nvfp4",
                           mamba_proj=None, kv_cache=None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_export_writes_modelopt_layout_and_codes_equal_the_quantizer(hybrid_bf16_dir, nvfp4_dir):
    _, bf16_spec, masters = spec_and_state_dict(hybrid_bf16_dir)
    qc = json.loads((nvfp4_dir / "hf_quant_config.json").read_text())
    assert qc["producer"]["name"] == "modelopt"
    assert qc["quantization"]["quant_algo"] == "MIXED_PRECISION"
    table = qc["quantization"]["quantized_layers"]
    assert table["backbone.layers.3.mixer.experts.7.down_proj"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    assert not any("in_proj" in k or "shared_experts" in k for k in table)
    assert json.loads((nvfp4_dir / "config.json").read_text())["quantization_config"]["quant_method"] == "modelopt"

    _, spec, stored = spec_and_state_dict(nvfp4_dir)
    moe = [b.mixer for b in spec.sublayers_of(MoESpec)]
    assert moe and all(spec.weight_format(m.expert_linear(e, p)) == LinearFormat("nvfp4", stored=True)
                       for m in moe for e in range(m.n_routed_experts) for p in ("up_proj", "down_proj"))
    m = moe[0]
    for e in (0, 5):
        for proj in ("up_proj", "down_proj"):
            names = {f: f"{m.expert_linear(e, proj)}.{f}" for f in ("weight", "weight_scale", "weight_scale_2")}
            q = ops.nvfp4_quantize(masters[names["weight"]])  # ModelOpt's rule (tests/ops: bitwise == ModelOpt)
            assert stored[names["weight"]].dtype == torch.uint8
            assert torch.equal(stored[names["weight"]], q.weight)
            assert torch.equal(_bits(stored[names["weight_scale"]]), _bits(q.weight_scale))
            assert torch.equal(stored[names["weight_scale_2"]], q.weight_scale_2.reshape(()))
    # everything that is not an expert is the bf16 checkpoint's tensor, bit for bit
    for n, t in masters.items():
        if ".experts." not in n:
            assert torch.equal(stored[n].to(t.dtype), t), n
    assert stored[f"{m.name}.gate.e_score_correction_bias"].dtype == torch.float32


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_bad_scales_name_layer_and_expert(nvfp4_dir, tmp_path):
    def zero_ws2(t):
        t["backbone.layers.3.mixer.experts.5.up_proj.weight_scale_2"] = torch.zeros((), dtype=torch.float32)

    with pytest.raises(CheckpointError, match=r"layers\.3\.mixer\.experts\.5\.up_proj: weight_scale_2 is zero"):
        spec_and_state_dict(_rewrite(nvfp4_dir, tmp_path / "a", zero_ws2))

    def nan_block(t):
        s = t["backbone.layers.6.mixer.experts.2.down_proj.weight_scale"].view(torch.uint8).clone()
        s[0, 0] = 0x7F
        t["backbone.layers.6.mixer.experts.2.down_proj.weight_scale"] = s.view(torch.float8_e4m3fn)

    with pytest.raises(CheckpointError, match=r"layers\.6\.mixer\.experts\.2\.down_proj: weight_scale has 1 NaN block scale"):
        spec_and_state_dict(_rewrite(nvfp4_dir, tmp_path / "b", nan_block))

    def missing(t):
        del t["backbone.layers.3.mixer.experts.1.down_proj.weight_scale"]

    with pytest.raises(CheckpointError, match="missing tensors.*experts.1.down_proj.weight_scale"):
        spec_and_state_dict(_rewrite(nvfp4_dir, tmp_path / "c", missing))

    def as_bf16(t):
        n = "backbone.layers.3.mixer.experts.0.up_proj.weight"
        t[n] = t[n].to(torch.bfloat16)

    with pytest.raises(CheckpointError, match="experts.0.up_proj.weight: stored torch.bfloat16, expected torch.uint8"):
        spec_and_state_dict(_rewrite(nvfp4_dir, tmp_path / "d", as_bf16))


def test_export_refuses_bad_requests(hybrid_bf16_dir, nvfp4_dir, tmp_path):
    with pytest.raises(CheckpointError, match="exists; pass overwrite"):
        export_modelopt(hybrid_bf16_dir, nvfp4_dir, mamba_proj=None, kv_cache=None)
    with pytest.raises(CheckpointError, match="already quantized"):
        export_modelopt(nvfp4_dir, tmp_path / "x", mamba_proj=None, kv_cache=None)
    with pytest.raises(CheckpointError, match="calibration_token_ids"):
        export_modelopt(hybrid_bf16_dir, tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_masters_requantize_to_the_trainer_forward_codes(nvfp4_dir):
    """A trainer holding bf16 masters quantizes them in its forward (ops.moe_experts, nvfp4=True) to
    exactly the codes the weight sync writes into the engine (quantize_state_dict): same outputs, bitwise."""
    _, spec, stored = spec_and_state_dict(nvfp4_dir)
    mspec = master_spec(spec)
    masters = dequantize_state_dict(stored, spec)
    assert set(masters) == set(mspec.parameter_shapes())
    requant = quantize_state_dict(masters, spec)
    m = spec.sublayers_of(MoESpec)[0].mixer
    up_m = torch.stack([masters[m.expert_weight_name(e, "up_proj")] for e in range(m.n_routed_experts)])
    down_m = torch.stack([masters[m.expert_weight_name(e, "down_proj")] for e in range(m.n_routed_experts)])

    def stack(proj):
        f = {k: torch.stack([requant[f"{m.expert_linear(e, proj)}.{k}"] for e in range(m.n_routed_experts)])
             for k in ("weight", "weight_scale", "weight_scale_2")}
        return ops.NVFP4Weight(f["weight"], f["weight_scale"], f["weight_scale_2"])

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, m.hidden_size, generator=g) * 0.5).to(torch.bfloat16)
    w, ids = ops.moe_route(x, masters[f"{m.name}.gate.weight"], masters[f"{m.name}.gate.e_score_correction_bias"],
                           **m.route_kwargs())
    trainer = ops.moe_experts(x, ids, w, up_m, down_m, None, nvfp4=True, out_dtype=torch.bfloat16)
    engine = ops.moe_experts(x, ids, w, stack("up_proj"), stack("down_proj"), None, out_dtype=torch.bfloat16)
    assert torch.equal(trainer.view(torch.int16), engine.view(torch.int16))
    # dequantize -> requantize is close to, but not, the identity: the engine is re-synced before rollouts
    n = f"{m.expert_linear(0, 'up_proj')}.weight_scale_2"
    assert torch.allclose(requant[n], stored[n], rtol=2 ** -7)


def test_hf_nvfp4_megatron_round_trip_is_bitwise(nvfp4_dir, tmp_path):
    from unified_models.backends.megatron.dist_ckpt import hf_to_megatron, megatron_to_hf

    mg = hf_to_megatron(nvfp4_dir, tmp_path / "mg", writer="torch_dcp")
    back = megatron_to_hf(mg, tmp_path / "hf")
    a, b = load_file(str(nvfp4_dir / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(a) == set(b) and any(t.dtype == torch.uint8 for t in a.values())
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(_bits(a[n]), _bits(b[n])), n
    assert json.loads((back / "hf_quant_config.json").read_text()) == json.loads(
        (nvfp4_dir / "hf_quant_config.json").read_text())
    assert json.loads((back / "config.json").read_text())["quantization_config"] == json.loads(
        (nvfp4_dir / "config.json").read_text())["quantization_config"]


def test_trainer_holds_the_stored_codes_frozen_and_refuses_bad_scales(nvfp4_dir):
    """The Megatron module loads a ModelOpt checkpoint as stored (codes and scales frozen, bit for bit)
    and validates scales like the checkpoint loader does."""
    from unified_models.backends.megatron import (UnifiedMegatronModel, init_parallel_state,
                                                  transformer_config_from_spec)
    from unified_models.dsl import SpecError

    _, spec, stored = spec_and_state_dict(nvfp4_dir)
    init_parallel_state()
    with pytest.raises(SpecError, match="cannot be randomly initialised.*master_spec"):
        UnifiedMegatronModel(spec, device="cpu")
    m = UnifiedMegatronModel(spec, transformer_config_from_spec(spec, perform_initialization=False), device="cpu")
    m.load_hf_state_dict(stored)
    params = dict(m.named_parameters())
    n = "backbone.layers.3.mixer.experts.4.down_proj.weight"
    assert params[n].dtype == torch.uint8 and torch.equal(params[n], stored[n]) and not params[n].requires_grad
    assert not params["backbone.layers.3.mixer.gate.e_score_correction_bias"].requires_grad
    assert params["backbone.layers.3.mixer.gate.weight"].requires_grad
    bad = dict(stored)
    bad["backbone.layers.6.mixer.experts.3.up_proj.weight_scale_2"] = torch.tensor(0.0)
    with pytest.raises(CheckpointError, match=r"layers\.6\.mixer\.experts\.3\.up_proj: weight_scale_2 is zero"):
        m.load_hf_state_dict(bad)


def test_export_refuses_what_the_loaders_would_not_run(hybrid_bf16_dir, tmp_path, monkeypatch):
    """Before any calibration or write, the export's config.json is read back through the family's
    declaration (what check, rl and convert load): Qwen3 refuses quantized checkpoints, and a
    declaration that reads the quantized config as another model (here: one that ignores it) is
    refused by the first difference."""
    from unified_models import models
    from unified_models.dsl import SpecError
    from unified_models.models import nemotron_h
    from unified_models.presets import build_preset_checkpoint

    qwen3 = build_preset_checkpoint("qwen3_tiny", out_dir=tmp_path / "src" / "qwen3")
    with pytest.raises(SpecError, match=r"quantized qwen3 checkpoints cannot be run by check or rl \(the qwen3 "
                                        r"declaration refuses the quantized config.json: Qwen3 config: "
                                        r"quantization_config is set; quantized Qwen3 checkpoints are not supported"):
        export_modelopt(qwen3, tmp_path / "q", experts=None, mamba_proj=None, kv_cache="fp8",
                        calibration_token_ids=[[1, 2, 3]])
    monkeypatch.setitem(models._FAMILIES, "nemotron_h",
                        lambda config, dtype=None, **kw: nemotron_h.spec_from_hf_config(config, dtype=dtype,
                                                                                         quant_config={}))
    with pytest.raises(SpecError, match=r"reads a quantized config.json back as another model \(backbone\.layers"
                                        r"\.3\.mixer\.experts\.0\.down_proj: weight format None read, "):
        export_modelopt(hybrid_bf16_dir, tmp_path / "h", experts="nvfp4", mamba_proj=None, kv_cache=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
