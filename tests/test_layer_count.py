"""A checkpoint whose layer count disagrees with its layer pattern is refused, naming both numbers:
``num_hidden_layers`` vs the NemotronH pattern, and safetensors holding layers beyond (or short of) it."""

from __future__ import annotations

import json
import shutil

import pytest

from unified_models.cli import main
from unified_models.converters.hf_safetensors import read_tensors, save_state_dict, spec_and_state_dict
from unified_models.dsl import CheckpointError, SpecError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _set_config(d, **fields):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_num_hidden_layers_disagreeing_with_the_pattern_is_refused(tiny_checkpoint, tmp_path, capsys):
    d = _copy(tiny_checkpoint, tmp_path / "m")
    pattern = "".join({"full_attention": "*", "mlp": "-"}[t]
                      for t in json.loads((d / "config.json").read_text())["layers_block_type"])
    assert pattern == "*-*-*-"
    _set_config(d, num_hidden_layers=8)
    with pytest.raises(SpecError, match=r"config\.json: num_hidden_layers is 8 but the layer pattern '\*-\*-\*-' "
                                        r"\(layers_block_type / hybrid_override_pattern\) has 6 layers"):
        spec_and_state_dict(d)
    assert main(["inspect", str(d)]) == 2  # every command reads the config through the same check
    assert "num_hidden_layers is 8" in capsys.readouterr().err


def test_legacy_hybrid_override_pattern_is_checked_too(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("layers_block_type")
    cfg.update(hybrid_override_pattern="*-*-", num_hidden_layers=6)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match=r"num_hidden_layers is 6 but the layer pattern '\*-\*-'.* has 4 layers"):
        spec_and_state_dict(d)


def test_agreeing_num_hidden_layers_is_accepted(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint, tmp_path / "m")
    _set_config(d, num_hidden_layers=6)
    _, spec, sd = spec_and_state_dict(d)
    assert len(spec.blocks) == 6 and sd.keys() == spec.parameter_shapes().keys()


def test_safetensors_with_layers_beyond_the_pattern_are_refused(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint, tmp_path / "m")
    tensors = read_tensors(d)
    extra = {n.replace(".layers.5.", ".layers.7."): t.clone() for n, t in tensors.items() if ".layers.5." in n}
    assert extra
    for f in d.glob("*.safetensors"):
        f.unlink()
    save_state_dict({**tensors, **extra}, d)
    with pytest.raises(CheckpointError, match=r"holds tensors of 8 layers \(layer indices 0\.\.7\) but its config "
                                              r"declares 6 layers \(layer pattern '\*-\*-\*-'\)"):
        spec_and_state_dict(d)


def test_safetensors_short_of_the_pattern_are_refused(tiny_checkpoint, tmp_path):
    d = _copy(tiny_checkpoint, tmp_path / "m")
    tensors = {n: t for n, t in read_tensors(d).items() if ".layers.4." not in n and ".layers.5." not in n}
    for f in d.glob("*.safetensors"):
        f.unlink()
    save_state_dict(tensors, d)
    with pytest.raises(CheckpointError, match=r"holds tensors of 4 layers .* declares 6 layers"):
        spec_and_state_dict(d)
