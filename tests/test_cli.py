"""CLI: bad input fails cleanly (exit 2, one `error:` line naming the problem)."""

import json

import pytest

from unified_models.cli import main


def test_check_on_garbage_model_dir(tmp_path, capsys):
    d = tmp_path / "garbage"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "nemotron_h", "layers_block_type": ["full_attention"]}))
    (d / "model.safetensors").write_bytes(b"not a safetensors file at all")
    out = tmp_path / "out.json"
    assert main(["check", "--model", str(d), "--json", str(out)]) == 2
    err = capsys.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("error:"))
    assert "model.safetensors" in line and "not a readable safetensors file" in line
    assert not out.exists()  # nothing half-written


def test_check_on_missing_dir_and_empty_prompts(tmp_path, capsys, tiny_checkpoint):
    assert main(["check", "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err
    p = tmp_path / "empty.jsonl"
    p.write_text("")
    assert main(["check", "--model", str(tiny_checkpoint), "--prompts", str(p)]) == 2
    assert "holds no prompts" in capsys.readouterr().err


def _with_layer_type(tiny_checkpoint, d, index, layer_type):
    """Copy of the tiny checkpoint whose config says layer ``index`` is ``layer_type``."""
    import shutil

    shutil.copytree(tiny_checkpoint, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["layers_block_type"][index] = layer_type
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_config_and_tensors_that_disagree_are_named(tmp_path, capsys, tiny_checkpoint):
    """Layer 1 declared MoE while the file holds its MLP weights: exit 2 naming both sides."""
    d = _with_layer_type(tiny_checkpoint, tmp_path / "m", 1, "moe")
    assert main(["check", "--model", str(d)]) == 2
    err = capsys.readouterr().err
    assert "does not match the nemotron_h spec" in err
    assert "missing tensors" in err and "backbone.layers.1.mixer.gate.weight" in err
    assert "unexpected tensors" in err and "backbone.layers.1.mixer.up_proj.weight" in err


@pytest.mark.parametrize("argv", [["check", "--num-prompts", "0"], ["check", "--max-new-tokens", "x"],
                                  ["check", "--device", "tpu"], ["convert", "--from", "hf", "--to", "onnx", "a", "b"]])
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


def test_inspect_prints_spec(tiny_checkpoint, capsys):
    assert main(["inspect", str(tiny_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert "pattern *-*-*-" in out and "backbone.layers.0.mixer.q_proj.weight" in out


def test_tokenizer_outside_vocab_names_the_tokenizer(tmp_path, capsys):
    """A checkpoint without a tokenizer whose vocabulary is smaller than the
    bundled tokenizer's: the error names the tokenizer used and the way out."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(hybrid_override_pattern="*-", hidden_size=64, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=1000)
    NemotronHForCausalLM(cfg).save_pretrained(tmp_path / "m")
    assert main(["check", "--model", str(tmp_path / "m"), "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "outside the model vocabulary (1000)" in err and "--tokenizer" in err


def test_more_bad_input_is_one_line(tmp_path, capsys, tiny_checkpoint):
    # a config transformers itself rejects (unknown layer type string)
    d = _with_layer_type(tiny_checkpoint, tmp_path / "bogus", 0, "bogus")
    assert main(["check", "--model", str(d)]) == 2
    assert "not a valid transformers config" in capsys.readouterr().err
    # no attention layer: refused before any engine starts
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(hybrid_override_pattern="--", hidden_size=64, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=32064)
    NemotronHForCausalLM(cfg).save_pretrained(tmp_path / "mlp_only")
    assert main(["check", "--model", str(tmp_path / "mlp_only")]) == 2
    assert "has no attention layer" in capsys.readouterr().err
    # --json inside a file, a too long generation, and mutually exclusive flags
    f = tmp_path / "file.txt"
    f.write_text("x")
    assert main(["check", "--model", str(tiny_checkpoint), "--json", str(f / "out.json")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert main(["check", "--model", str(tiny_checkpoint), "--max-new-tokens", "5000"]) == 2
    assert "leaves no room for a prompt" in capsys.readouterr().err
    assert main(["check", "--model", str(tiny_checkpoint), "--preset", "nemotron_h_tiny"]) == 2
    assert "mutually exclusive" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["check", "--seed", "-5"], ["check", "--seed", str(2**32)],
                                  ["check", "--full-vocab-rows", "-7"]])
def test_out_of_range_flags(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0"])
def test_temperature_must_be_finite_and_positive(value, capsys):
    """A NaN temperature used to pass the flag check and fail late with a traceback; an
    infinite one sampled uniformly and wrote ``Infinity`` into the JSON report."""
    with pytest.raises(SystemExit) as e:
        main(["check", f"--temperature={value}"])
    assert e.value.code == 2
    assert "--temperature: must be a finite number > 0" in capsys.readouterr().err


def test_paths_of_the_wrong_kind_are_named(tmp_path, capsys, tiny_checkpoint):
    f = tmp_path / "a_file"
    f.write_text("x")
    assert main(["check", "--model", str(f)]) == 2
    assert f"model directory {f} is not a directory" in capsys.readouterr().err
    assert main(["check", "--model", str(tiny_checkpoint), "--prompts", str(tmp_path)]) == 2
    assert f"prompt file {tmp_path} is not a file" in capsys.readouterr().err
    assert main(["check", "--model", str(tiny_checkpoint), "--tokenizer", str(tmp_path / "nope")]) == 2
    assert f"tokenizer directory {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
