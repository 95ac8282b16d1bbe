"""Issue 21: command-line messages that named the wrong thing, and inputs refused late.

Each case is one ``error:`` line (exit 2) naming the file, field or flag and the value,
given before any engine starts."""

from __future__ import annotations

import json
import shutil

import pytest

from unified_models.cli import main


def _error_lines(err: str) -> list[str]:
    return [x for x in err.splitlines() if x.startswith("error:")]


@pytest.mark.parametrize("argv, flag", [(["check", "--num-prompts", "0"], "--num-prompts"),
                                        (["check", "--max-new-tokens", "-3"], "--max-new-tokens"),
                                        (["rl", "--steps", "0"], "--steps"),
                                        (["rl", "--save-every", "1.5"], "--save-every")])
def test_integer_options_say_integer(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and "integer" in err and "finite number" not in err


def _nemotron(tmp_path, name, pattern, **overrides):
    """A small transformers-written Nemotron-H checkpoint; ``overrides`` are then written into
    its config.json (values transformers itself would not have to accept)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(hybrid_override_pattern=pattern, hidden_size=64, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=1000,
                          mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4,
                          chunk_size=16)
    d = tmp_path / name
    NemotronHForCausalLM(cfg).save_pretrained(d)
    if overrides:
        c = json.loads((d / "config.json").read_text())
        c.update(overrides)
        (d / "config.json").write_text(json.dumps(c))
    return d


@pytest.fixture(scope="module")
def chunk1(tmp_path_factory):
    return _nemotron(tmp_path_factory.mktemp("chunk1"), "m", "M*", chunk_size=1)


@pytest.mark.parametrize("command", ["check", "inspect", "convert", "rl", "quantize"])
def test_chunk_size_1_is_refused_before_any_engine(chunk1, command, tmp_path, capsys):
    """The Mamba-2 decode state holds ``chunk_size - 1`` pending rows: 1 used to crash inside vLLM."""
    argv = {"check": ["check", "--model", str(chunk1)], "inspect": ["inspect", str(chunk1)],
            "convert": ["convert", "--from", "hf", "--to", "megatron", str(chunk1), str(tmp_path / "mg")],
            "rl": ["rl", "--model", str(chunk1), "--metrics", str(tmp_path / "m.jsonl")],
            "quantize": ["quantize", str(chunk1), str(tmp_path / "q")]}[command]
    assert main(argv) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"{chunk1}/config.json" in line and "chunk_size=1 must be >= 2" in line
    assert not any(tmp_path.iterdir())  # nothing written


def test_quantize_attention_free_is_one_line(tmp_path, capsys):
    """``MMM``: calibration used to print a transformers traceback (``get_seq_length``)."""
    d = _nemotron(tmp_path, "mmm", "MMM")
    capsys.readouterr()  # transformers' save progress bar
    for extra in ([], ["--kv-cache", "none", "--experts", "none"]):
        assert main(["quantize", str(d), str(tmp_path / "q"), *extra]) == 2
        err = capsys.readouterr().err
        (line,) = _error_lines(err)
        assert line.startswith("error: quantize ") and "Traceback" not in err
        assert "'MMM' has no attention layer" in line
    assert not (tmp_path / "q").exists()


def test_quantize_options_that_match_nothing(tiny_checkpoint, tmp_path, capsys):
    """The tiny preset (``*-*-*-``) has no experts and no Mamba layers."""
    assert main(["quantize", str(tiny_checkpoint), str(tmp_path / "q"), "--experts", "nvfp4"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert "--experts nvfp4 matches nothing" in line and "routed experts" in line and "'*-*-*-'" in line
    assert main(["quantize", str(tiny_checkpoint), str(tmp_path / "q"), "--mamba-proj", "fp8"]) == 2
    assert "--mamba-proj fp8 matches nothing" in capsys.readouterr().err
    assert main(["quantize", str(tiny_checkpoint), str(tmp_path / "q"), "--experts", "none", "--mamba-proj",
                 "none", "--kv-cache", "none"]) == 2
    assert "nothing to quantize" in capsys.readouterr().err
    assert main(["quantize", str(tiny_checkpoint), str(tmp_path / "q"), "--kv-cache", "none"]) == 2
    assert "nothing to quantize" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
    # defaults: what matches (the FP8 KV cache) is written, the rest is noted
    assert main(["quantize", str(tiny_checkpoint), str(tmp_path / "q"), "--num-calibration-prompts", "2"]) == 0
    err = capsys.readouterr().err
    assert "note: --experts nvfp4 (default) not applied" in err and "note: --mamba-proj fp8 (default)" in err
    qc = json.loads((tmp_path / "q" / "hf_quant_config.json").read_text())["quantization"]
    assert qc["kv_cache_quant_algo"] == "FP8" and qc["quantized_layers"] == {}


@pytest.fixture(scope="module")
def preset_dir(tmp_path_factory):
    """``name -> directory`` of a built-in preset, each built once per module."""
    from unified_models.presets import build_preset_checkpoint

    root, built = tmp_path_factory.mktemp("presets"), {}

    def get(name: str):
        if name not in built:
            built[name] = build_preset_checkpoint(name, out_dir=root / name)
        return built[name]

    return get


@pytest.mark.parametrize("preset, family, extra", [("qwen3_tiny", "qwen3", []),
                                                   ("qwen3_moe_tiny", "qwen3_moe", []),
                                                   ("qwen3_moe_tiny", "qwen3_moe", ["--experts", "nvfp4"])])
def test_quantize_refuses_a_family_whose_quantized_checkpoints_do_not_load(preset_dir, preset, family, extra,
                                                                           tmp_path, capsys):
    """Qwen3 / Qwen3-MoE: the export used to be written (an FP8-KV ModelOpt config) that ``check`` and
    ``convert`` then refused; the refusal is now the loaders' own, before anything is written, and
    no note claims that the MoE layers have no routed experts."""
    src = preset_dir(preset)
    capsys.readouterr()
    assert main(["quantize", str(src), str(tmp_path / "q"), *extra]) == 2
    err = capsys.readouterr().err
    (line,) = _error_lines(err)
    assert line.startswith(f"error: quantize {src}: quantized {family} checkpoints cannot be run by check or rl")
    assert "quantized Qwen3 checkpoints are not supported" in line  # the declaration's own reason
    assert "supported by quantize: Nemotron-H in NVIDIA ModelOpt's format" in line and "DeepSeek-V4" in line
    assert "note:" not in err and "has no routed experts" not in err
    assert not any(tmp_path.iterdir())  # nothing written


def test_quantize_refuses_an_already_quantized_source(preset_dir, tiny_checkpoint, tmp_path, capsys):
    """The NVFP4 hybrid used to be told it has no experts, Mamba or attention layers; an FP8-KV-only
    export (no stored weight format) is refused by its quantization_config."""
    src = preset_dir("nemotron_h_hybrid_tiny_nvfp4")
    capsys.readouterr()
    assert main(["quantize", str(src), str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err
    (line,) = _error_lines(err)
    assert line.startswith(f"error: quantize: {src} is already quantized (weights stored as fp8, nvfp4; ")
    assert "quant_method 'modelopt'" in line and "takes a model-dtype checkpoint" in line
    assert "note:" not in err and "has no" not in err
    kv = tmp_path / "kv"
    assert main(["quantize", str(tiny_checkpoint), str(kv), "--num-calibration-prompts", "2"]) == 0
    capsys.readouterr()
    assert main(["quantize", str(kv), str(tmp_path / "q"), "--experts", "none", "--mamba-proj", "none"]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"{kv} is already quantized (config.json quantization_config (quant_method 'modelopt'))" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv"]


def test_quantize_notes_name_layers_the_recipe_does_not_cover(preset_dir):
    """A layer kind that is present but outside a recipe (Qwen3-MoE's SwiGLU experts vs the NVFP4
    relu2-expert recipe) is named as such, never as absent."""
    from unified_models.converters.hf_safetensors import load_hf_config
    from unified_models.converters.quantize_support import layers_of_kind
    from unified_models.models import spec_from_hf_config
    from unified_models.quantize_options import _idle_reason

    spec = spec_from_hf_config(load_hf_config(preset_dir("qwen3_moe_tiny")))
    assert [i for i, _ in layers_of_kind(spec, "experts")] == [1, 2, 3]
    assert layers_of_kind(spec, "mamba_proj") == [] and len(layers_of_kind(spec, "kv_cache")) == 4
    why = _idle_reason("src", spec, "experts")
    assert why.startswith("src (pattern 'AEEE'): its routed experts (layers 1, 2, 3: Qwen3MoESpec, silu activation) "
                          "are not covered by the NVFP4 recipe, which quantizes only the non-gated relu2 experts")
    assert "has no" not in why
    assert _idle_reason("src", spec, "mamba_proj") == "src (pattern 'AEEE') has no Mamba-2 layers ('M')"


def test_megatron_checkpoint_without_common_pt_is_named(tiny_checkpoint, tmp_path, capsys):
    """megatron-core 0.16 used to fail with ``AttributeError: 'str' object has no attribute 'iterdir'``."""
    mg = tmp_path / "mg"
    assert main(["convert", "--from", "hf", "--to", "megatron", str(tiny_checkpoint), str(mg)]) == 0
    (mg / "common.pt").unlink()
    capsys.readouterr()
    assert main(["convert", "--from", "megatron", "--to", "hf", str(mg), str(tmp_path / "hf")]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"Megatron checkpoint {mg} is incomplete: common.pt" in line and "is missing" in line
    assert "iterdir" not in line and not (tmp_path / "hf").exists()


def test_gsm8k_answer_without_marker_names_file_and_line(tiny_checkpoint, tmp_path, capsys):
    """Refused while the prompts are read (before any engine), naming ``file:line``."""
    p = tmp_path / "prompts.jsonl"
    p.write_text(json.dumps({"question": "2+2?", "answer": "4 #### 4"}) + "\n\n"
                 + json.dumps({"question": "3+3?", "answer": "it is six"}) + "\n")
    assert main(["rl", "--model", str(tiny_checkpoint), "--reward", "gsm8k", "--prompts", str(p),
                 "--num-prompts-per-step", "1", "--metrics", str(tmp_path / "m.jsonl")]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"{p}:3: GSM8K answer has no '####' marker: 'it is six'" in line
    assert not (tmp_path / "m.jsonl").exists()


def test_gsm8k_check_references_unit(tmp_path):
    from unified_models.dsl import PromptError
    from unified_models.rl.data import PromptRow
    from unified_models.rl.rewards import check_references, reward_info

    rows = [PromptRow(text="a", answer="x #### 7", line=1), PromptRow(text="b", answer="#### seven", line=4)]
    with pytest.raises(PromptError, match=r"^f.jsonl:4: GSM8K answer has no number after '####'"):
        check_references(reward_info("gsm8k"), rows, "f.jsonl")
    check_references(reward_info("target-token"), rows, "f.jsonl")  # no reference check: accepted
    shutil.rmtree(tmp_path)
