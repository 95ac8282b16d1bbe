"""The command line sees families and models registered outside the package: ``--plugin MODULE``
and the ``unified_models.plugins`` entry-point group (``unified_models/plugins.py``)."""

from __future__ import annotations

import importlib.metadata
import json
import sys

import pytest
import torch

from unified_models import plugins
from unified_models.cli import main
from toy_models import write_toy_checkpoint

PLUGIN = "plugin_toy_family"  # tests/plugin_toy_family.py (tests/ is on sys.path under pytest)
MODEL_TYPE = "toy_negated_mlp_lm"


def _unregister() -> None:
    """Forget everything the toy plugin registered, so each test starts from a process without it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from unified_models import models
    from unified_models.layers import FAMILIES

    mod = sys.modules.pop(PLUGIN, None)
    if mod is not None:
        FAMILIES.pop(mod.NegatedMLPSpec, None)
    models._FAMILIES.pop(MODEL_TYPE, None)
    models._ARCHITECTURES.pop(MODEL_TYPE, None)
    CONFIG_MAPPING._extra_content.pop(MODEL_TYPE, None)
    plugins._loaded.clear()


@pytest.fixture(autouse=True)
def clean():
    _unregister()
    yield
    _unregister()


@pytest.fixture
def toy_config_dir(tmp_path):
    """A directory holding only the toy model's config.json (enough for ``inspect``)."""
    cfg = {"model_type": MODEL_TYPE, "architectures": ["ToyNegatedMLPForCausalLM"], "vocab_size": 32064,
           "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 96, "rms_norm_eps": 1e-5, "max_position_embeddings": 512, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_inspect_without_the_plugin_does_not_know_the_model_type(toy_config_dir, capsys):
    assert main(["inspect", str(toy_config_dir)]) == 2
    assert MODEL_TYPE in capsys.readouterr().err


def test_plugin_flag_registers_the_toy_family_for_the_cli(toy_config_dir, capsys):
    assert main(["inspect", str(toy_config_dir), "--plugin", PLUGIN]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("toy_negated_mlp (UnifiedToyNegatedMLPForCausalLM)")
    assert "model.layers.1.neg.mlp.up_proj.weight" in out and "(96, 64)" in out
    assert "model.layers.0.self_attn.q_proj.weight" in out


def test_entry_point_plugins_are_loaded_at_cli_start(toy_config_dir, capsys, monkeypatch):
    ep = importlib.metadata.EntryPoint(name="toy", value=PLUGIN, group=plugins.ENTRY_POINT_GROUP)
    seen = []

    def entry_points(*, group):
        seen.append(group)
        return [ep] if group == plugins.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert main(["inspect", str(toy_config_dir)]) == 0
    assert seen == [plugins.ENTRY_POINT_GROUP]
    assert capsys.readouterr().out.startswith("toy_negated_mlp (")


def test_entry_point_callable_is_called(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "fake_um_plugin", type(sys)("fake_um_plugin"))
    sys.modules["fake_um_plugin"].register = lambda: calls.append("register")
    ep = importlib.metadata.EntryPoint(name="fake", value="fake_um_plugin:register", group=plugins.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda *, group: [ep])
    assert plugins.load_entry_point_plugins() == ["fake = fake_um_plugin:register"]
    assert plugins.load_entry_point_plugins() == []  # once per process
    assert calls == ["register"]


def test_broken_plugins_are_clear_errors(toy_config_dir, capsys, monkeypatch):
    assert main(["inspect", str(toy_config_dir), "--plugin", "no_such_module_h2"]) == 2
    assert "--plugin no_such_module_h2: no module named 'no_such_module_h2'" in capsys.readouterr().err
    ep = importlib.metadata.EntryPoint(name="bad", value="no_such_module_h2", group=plugins.ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda *, group: [ep])
    assert main(["inspect", str(toy_config_dir)]) == 2
    err = capsys.readouterr().err
    assert "plugin entry point 'bad' = 'no_such_module_h2'" in err and "ModuleNotFoundError" in err


@pytest.mark.slow
def test_rl_runs_a_plugin_model_through_both_engines(tmp_path, capsys):
    """``rl --plugin``: vLLM samples and Megatron trains the toy family, diff = 0."""
    from unified_models.rl.metrics import read_metrics

    mod = __import__(PLUGIN)
    config = mod.ToyNegatedMLPConfig(architectures=["ToyNegatedMLPForCausalLM"], torch_dtype="bfloat16")
    spec = mod.spec_from_config(config)
    g = torch.Generator().manual_seed(0)
    sd = {n: ((1.0 + 0.1 * torch.randn(s, generator=g)) if n.endswith("norm.weight")
              else torch.randn(s, generator=g) * (1.0 if n.startswith(("model.embed", "lm_head")) else 0.1)
              ).to(torch.bfloat16) for n, s in spec.parameter_shapes().items()}
    d = tmp_path / "toy"
    write_toy_checkpoint(d, config, sd)
    _unregister()  # the CLI must register it itself
    metrics = tmp_path / "m.jsonl"
    status = main(["rl", "--model", str(d), "--plugin", PLUGIN, "--steps", "2", "--num-prompts-per-step", "2",
                   "--group-size", "2", "--max-new-tokens", "4", "--lr", "1e-3", "--metrics", str(metrics),
                   "--no-plot", "--device", "cpu"])
    assert status == 0, capsys.readouterr().err[-2000:]
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["max_abs_diff"] == 0.0 and r["num_mismatched"] == 0 and r["full_vocab_max_abs_diff"] == 0.0
               and r["tokens"] == 16 for r in rows)
