"""Training checkpoints of a quantized model's masters (what ``rl --save`` writes for a ModelOpt NVFP4
checkpoint) convert back to Hugging Face: the bf16 masters under the masters' config, or with
``--requantize`` the checkpoint quantized again under the recorded recipe; they still resume.

One trainer on the ``nemotron_h_hybrid_tiny_nvfp4`` preset (NVFP4 experts, FP8 Mamba projections,
FP8 KV cache) takes one optimizer step, so the masters differ from the dequantized checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from unified_models.cli import main
from unified_models.converters.hf_safetensors import read_tensors, spec_and_state_dict
from unified_models.converters.modelopt import dequantize_state_dict, master_spec, quantize_state_dict
from unified_models.dsl import CheckpointError

STATIC_SCALES = {
    "backbone.layers.0.mixer.in_proj.input_scale", "backbone.layers.0.mixer.out_proj.input_scale",
    "backbone.layers.4.mixer.in_proj.input_scale", "backbone.layers.4.mixer.out_proj.input_scale",
    "backbone.layers.1.mixer.k_proj.k_scale", "backbone.layers.1.mixer.v_proj.v_scale",
}
"""The recipe's calibrated scales the masters keep (preset pattern ``M*-EM-E``): no place in a plain model."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@pytest.fixture(scope="module")
def nvfp4():
    from unified_models.presets import build_preset_checkpoint

    d = build_preset_checkpoint("nemotron_h_hybrid_tiny_nvfp4")
    _, spec, state = spec_and_state_dict(d)
    return d, spec, state


@pytest.fixture(scope="module")
def trained(nvfp4, tmp_path_factory):
    """``(trainer, iter dir)``: one update of the masters, saved as ``rl --save`` saves it."""
    from unified_models.backends.megatron.optimizer import OptimizerConfig
    from unified_models.backends.megatron.trainer import Trainer, TrainerOptions

    d, spec, state = nvfp4
    trainer = Trainer(spec, state, options=TrainerOptions(optimizer=OptimizerConfig(lr=1e-3)))
    assert trainer.trains_masters
    trainer.step([[1, 2, 3, 4], [7, 8]], [[5, 6, 7], [9, 10, 11]], lambda b: -b.logprobs.sum())
    root = tmp_path_factory.mktemp("masters") / "ck"
    it = trainer.save(root, iteration=1, hf_config=(d / "config.json").read_text(),
                      hf_quant_config=(d / "hf_quant_config.json").read_text())
    yield trainer, it
    trainer.close()


def _masters(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_step_without_gradients_is_refused_and_changes_nothing(trained):
    trainer, _ = trained
    before = _masters(trainer)
    iteration = trainer.optimizer.iteration
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx(), pytest.raises(RuntimeError, match="Trainer.step needs gradients"):
            trainer.step([[1, 2, 3]], [[4, 5]], lambda b: -b.logprobs.sum())
    after = _masters(trainer)
    assert all(_same(before[n], after[n]) for n in before)
    assert trainer.optimizer.iteration == iteration


def test_checkpoint_records_the_masters_config_and_the_recipe(nvfp4, trained):
    from unified_models.backends.megatron.dist_ckpt import check_dist_checkpoint

    d, spec, _ = nvfp4
    _, it = trained
    entry = torch.load(it / "common.pt", weights_only=True)["unified_models"]
    cfg = json.loads(entry["hf_config_json"])
    original = json.loads((d / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    assert cfg == {k: v for k, v in original.items() if k != "quantization_config"}  # nothing else changed
    recipe = entry["quantization_recipe"]
    assert recipe["config_json"] == (d / "config.json").read_text()
    assert recipe["hf_quant_config_json"] == (d / "hf_quant_config.json").read_text()
    info = check_dist_checkpoint(it)
    assert info.spec == master_spec(spec) and info.recipe.quantized_spec("x") == spec
    assert info.recipe.describe() == "modelopt MIXED_PRECISION: 4 fp8 linears, 32 nvfp4 linears; FP8 KV cache"


def test_convert_gives_the_bf16_masters_that_load_and_run(nvfp4, trained, tmp_path, capsys):
    """``convert --from megatron``: every tensor the plain config lists equals the trained master bit
    for bit; the static scales are the only tensors left out; transformers and our loader accept it."""
    from transformers import AutoModelForCausalLM

    from unified_models.backends.megatron.dist_ckpt import load_dist_checkpoint
    from unified_models.backends.megatron.trainer import Trainer

    _, spec, state = nvfp4
    trainer, it = trained
    masters = _masters(trainer)
    assert main(["convert", "--from", "megatron", "--to", "hf", str(it), str(tmp_path / "hf")]) == 0
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert f"wrote {tmp_path / 'hf'}" in captured.out
    assert "trained bfloat16 masters" in err and "--requantize" in err and "32 nvfp4 linears" in err
    out = tmp_path / "hf"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no hf_quant_config.json
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["dtype"] == "bfloat16"
    back = read_tensors(out)
    assert set(masters) - set(back) == STATIC_SCALES
    for n, t in back.items():
        assert t.dtype == torch.bfloat16 or n.endswith("e_score_correction_bias"), n
        assert _same(t, masters[n]), n
    # the update moved the masters off the dequantized checkpoint: trained values are compared
    start = dequantize_state_dict(state, spec)
    for n in ("backbone.layers.3.mixer.experts.2.up_proj.weight", "backbone.layers.0.mixer.in_proj.weight",
              "backbone.layers.1.mixer.q_proj.weight"):
        assert not torch.equal(back[n], start[n]), n
    cfg2, sd = load_dist_checkpoint(it)
    assert cfg2 == cfg and set(sd) == set(back) and all(_same(sd[n], back[n]) for n in sd)
    # `check`'s loading: our loader (names, shapes, dtypes, values) builds a plain bf16 model ...
    _, plain, loaded = spec_and_state_dict(out)
    assert not plain.stores_quantized_weights and not plain.weight_formats
    with Trainer(plain, loaded) as recompute:
        lp = recompute.logprobs([[1, 2, 3]], [[4, 5]]).logprobs[0]
    assert lp.shape == (2,) and bool(torch.isfinite(lp).all()) and bool((lp <= 0).all())
    # ... and transformers' own class (the peer check) loads every tensor, none missing or left over
    hf, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    stacked = hf.state_dict()["model.layers.3.mixer.experts.down_proj"]  # transformers stacks the experts
    assert torch.equal(stacked[2], masters["backbone.layers.3.mixer.experts.2.down_proj.weight"])


def test_requantize_gives_the_engines_codes_under_the_recorded_recipe(nvfp4, trained, tmp_path, capsys):
    """``--requantize``: the masters quantized by the weight sync's rule, with the calibrated scales
    of the source, under its config.json and hf_quant_config.json verbatim."""
    d, spec, state = nvfp4
    trainer, it = trained
    masters = _masters(trainer)
    out = tmp_path / "nvfp4"
    assert main(["convert", "--from", "megatron", "--to", "hf", "--requantize", str(it), str(out)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "quantized again under the recipe" in err and "32 nvfp4 linears" in err
    assert (out / "config.json").read_text() == (d / "config.json").read_text()
    assert (out / "hf_quant_config.json").read_text() == (d / "hf_quant_config.json").read_text()
    back = read_tensors(out)
    want = quantize_state_dict(masters, spec)
    assert set(back) == set(state) == set(want)
    assert all(_same(back[n], want[n]) for n in back)
    for n in STATIC_SCALES:  # the recipe's calibrated scales, unchanged
        assert _same(back[n], state[n]), n
    up = "backbone.layers.3.mixer.experts.2.up_proj"
    assert back[f"{up}.weight"].dtype == torch.uint8 and back[f"{up}.weight_scale"].dtype == torch.float8_e4m3fn
    assert not torch.equal(back[f"{up}.weight"], state[f"{up}.weight"])  # the trained codes, not the source's
    _, spec2, _ = spec_and_state_dict(out)  # loads and validates as a ModelOpt checkpoint
    assert spec2 == spec


def test_the_checkpoint_carries_the_models_tokenizer_files_both_ways_back(nvfp4, trained, tmp_path):
    """Saved with ``assets_from`` (as ``rl --save`` saves): ``hf_assets/`` holds the source's tokenizer and
    generation files but not its hf_quant_config.json (the recipe holds that); the masters convert with
    those files byte for byte and without hf_quant_config.json, the re-quantized checkpoint with all of
    them, hf_quant_config.json the source's."""
    d, _, _ = nvfp4
    trainer, _ = trained
    files = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    it = trainer.save(tmp_path / "ck", iteration=1, hf_config=(d / "config.json").read_text(),
                      hf_quant_config=(d / "hf_quant_config.json").read_text(), assets_from=d)
    assert sorted(p.name for p in (it / "hf_assets").iterdir()) == files
    cases = [((), tmp_path / "masters", files),
             (("--requantize",), tmp_path / "nvfp4", [*files, "hf_quant_config.json"])]
    for argv, out, want in cases:
        assert main(["convert", "--from", "megatron", "--to", "hf", *argv, str(it), str(out)]) == 0
        assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", *want])
        for name in want:
            assert (out / name).read_bytes() == (d / name).read_bytes(), (out.name, name)


def test_the_masters_checkpoint_still_resumes(nvfp4, trained):
    from unified_models.backends.megatron.checkpoint import check_training_checkpoint
    from unified_models.backends.megatron.optimizer import OptimizerConfig
    from unified_models.backends.megatron.trainer import Trainer, TrainerOptions

    _, spec, state = nvfp4
    trainer, it = trained
    assert check_training_checkpoint(it.parent, master_spec(spec)) == 1
    with Trainer(spec, state, options=TrainerOptions(optimizer=OptimizerConfig(lr=1e-3))) as fresh:
        ck = fresh.resume(it.parent)
        assert ck.iteration == 1
        got, want = _masters(fresh), _masters(trainer)
        assert all(_same(got[n], want[n]) for n in want)
        # a module of the masters' spec loads it as a model checkpoint; one of the plain config is
        # told what the checkpoint holds instead
        from unified_models.backends.megatron import UnifiedMegatronModel
        from unified_models.backends.megatron.dist_ckpt import check_dist_checkpoint
        from unified_models.converters.megatron_dist_ckpt import spec_from_config_text

        m = UnifiedMegatronModel(master_spec(spec), device="cpu")
        m.load_dist_checkpoint(it)
        assert all(_same(p.detach(), want[n]) for n, p in m.named_parameters())
        plain = spec_from_config_text(check_dist_checkpoint(it).config_text, source="test")
        with pytest.raises(CheckpointError, match=r"holds the masters of a quantized model .trained under modelopt "
                                                  r".*missing tensors.*input_scale.*convert --from megatron"):
            UnifiedMegatronModel(plain, device="cpu").load_dist_checkpoint(it)


def test_bad_conversions_and_saves_are_refused_by_name(nvfp4, trained, tmp_path, capsys):
    from unified_models.backends.megatron.dist_ckpt import megatron_to_hf

    d, _, _ = nvfp4
    trainer, it = trained
    # --requantize from hf; a checkpoint root instead of its iter_* directory
    assert main(["convert", "--from", "hf", "--to", "megatron", "--requantize", str(d), str(tmp_path / "x")]) == 2
    assert "--requantize applies to --from megatron" in capsys.readouterr().err
    assert main(["convert", "--from", "megatron", "--to", "hf", str(it.parent), str(tmp_path / "x")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "training checkpoint root" in err and "iter_0000001" in err
    # a checkpoint saved without a config (as rl --save wrote for NVFP4 before): resumes, does not convert
    old = trainer.save(tmp_path / "old", iteration=1)
    with pytest.raises(CheckpointError, match="saved without a Hugging Face config.*still resumes"):
        megatron_to_hf(old, tmp_path / "y")
    # hf_quant_config without a quantized hf_config; a quantized config whose masters are another model
    with pytest.raises(ValueError, match="hf_quant_config applies to the masters of a quantized model"):
        trainer.save(tmp_path / "z", iteration=1, hf_quant_config="{}")
    cfg = json.loads((d / "config.json").read_text())
    layers = cfg["quantization_config"]["quantized_layers"]
    cfg["quantization_config"]["quantized_layers"] = {k: v for k, v in layers.items() if "layers.4." not in k}
    names = r"masters are not the model trained.*unexpected tensors.*layers\.4\.mixer\.in_proj\.input_scale"
    with pytest.raises(CheckpointError, match=names):
        trainer.save(tmp_path / "z", iteration=1, hf_config=cfg)
    assert not (tmp_path / "z" / "iter_0000001").exists()
    # an NVFP4 W4A4 recipe: its calibrated expert input_scale has no master, so it cannot be re-quantized
    cfg = json.loads((d / "config.json").read_text())
    for v in cfg["quantization_config"]["quantized_layers"].values():
        if v["quant_algo"] == "W4A16_NVFP4":
            v["quant_algo"] = "NVFP4"
    w4a4 = trainer.save(tmp_path / "w4a4", iteration=1, hf_config=cfg)
    with pytest.raises(CheckpointError, match=r"cannot re-quantize.*stores.*experts\.\d+\.(up|down)_proj\.input_scale"):
        megatron_to_hf(w4a4, tmp_path / "w", requantize=True)
    assert not (tmp_path / "w").exists()
    megatron_to_hf(w4a4, tmp_path / "w")  # its masters convert
    # a checkpoint without a recipe has nothing to re-quantize
    from unified_models.backends.megatron.dist_ckpt import hf_to_megatron

    mg = hf_to_megatron(d, tmp_path / "mg", writer="torch_dcp")
    with pytest.raises(CheckpointError, match="records no quantization recipe .its tensors are stored quantized"):
        megatron_to_hf(mg, tmp_path / "v", requantize=True)


def test_a_malformed_recipe_is_named(trained, tmp_path):
    import shutil

    from unified_models.backends.megatron.dist_ckpt import megatron_to_hf

    _, it = trained
    bad = tmp_path / "bad"
    shutil.copytree(it, bad)
    common = torch.load(bad / "common.pt", weights_only=True)
    common["unified_models"]["quantization_recipe"]["config_json"] = "{not json"
    torch.save(common, bad / "common.pt")
    with pytest.raises(CheckpointError, match="quantization recipe's config.json is not valid JSON"):
        megatron_to_hf(bad, tmp_path / "out")
    common["unified_models"]["quantization_recipe"] = {"config_json": 3}
    torch.save(common, bad / "common.pt")
    with pytest.raises(CheckpointError, match="stored quantization recipe is malformed"):
        megatron_to_hf(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists()
