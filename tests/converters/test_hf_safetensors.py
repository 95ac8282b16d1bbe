import json
import os
import shutil
import stat

import pytest
import torch
from safetensors.torch import load_file, save_file

from unified_models.converters.hf_safetensors import load_state_dict, save_state_dict, spec_and_state_dict
from unified_models.dsl import CheckpointError


@pytest.fixture
def ckpt_copy(tiny_checkpoint, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, d)
    return d


def _rewrite(d, fn):
    sd = load_file(str(d / "model.safetensors"))
    fn(sd)
    save_file(sd, str(d / "model.safetensors"))


def test_loads_every_spec_tensor_bitwise(tiny_checkpoint, tiny_model):
    _, spec, sd = tiny_model
    raw = load_file(str(tiny_checkpoint / "model.safetensors"))
    assert list(sd) == list(spec.parameter_shapes())
    for name, t in sd.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, raw[name])


def test_missing_extra_misshaped_are_all_named(ckpt_copy, tiny_model):
    _, spec, _ = tiny_model

    def damage(sd):
        del sd["backbone.layers.0.mixer.q_proj.weight"]
        sd["backbone.layers.0.mixer.extra.weight"] = torch.zeros(2)
        sd["lm_head.weight"] = sd["lm_head.weight"][:, :8].contiguous()

    _rewrite(ckpt_copy, damage)
    with pytest.raises(CheckpointError) as e:
        load_state_dict(ckpt_copy, spec)
    msg = str(e.value)
    assert "missing tensors: ['backbone.layers.0.mixer.q_proj.weight']" in msg
    assert "unexpected tensors: ['backbone.layers.0.mixer.extra.weight']" in msg
    assert "lm_head.weight: expected (32064, 256), got (32064, 8)" in msg


def test_nan_is_refused(ckpt_copy, tiny_model):
    _, spec, _ = tiny_model
    _rewrite(ckpt_copy, lambda sd: sd["backbone.norm_f.weight"].__setitem__(3, float("nan")))
    with pytest.raises(CheckpointError, match="backbone.norm_f.weight holds NaN or Inf"):
        load_state_dict(ckpt_copy, spec)


def test_corrupt_and_missing_files(ckpt_copy, tmp_path):
    data = (ckpt_copy / "model.safetensors").read_bytes()
    (ckpt_copy / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        spec_and_state_dict(ckpt_copy)
    (ckpt_copy / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        spec_and_state_dict(ckpt_copy)
    (ckpt_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors file"):
        spec_and_state_dict(ckpt_copy)
    with pytest.raises(CheckpointError, match="does not exist"):
        spec_and_state_dict(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        spec_and_state_dict(empty)
    (empty / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        spec_and_state_dict(empty)


def test_unknown_layer_type_in_checkpoint_config(ckpt_copy):
    """transformers validates ``layers_block_type`` itself; the error names the file."""
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    cfg["layers_block_type"][2] = "bogus_mixer"
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    from unified_models.dsl import CheckpointError

    with pytest.raises(CheckpointError, match=r"config\.json is not a valid transformers config") as e:
        spec_and_state_dict(ckpt_copy)
    assert "bogus_mixer" in str(e.value), str(e.value)  # the reason, not only transformers' heading line


def test_config_field_of_the_wrong_type_or_a_config_that_is_not_an_object(ckpt_copy):
    from unified_models.dsl import CheckpointError

    cfg = json.loads((ckpt_copy / "config.json").read_text())
    (ckpt_copy / "config.json").write_text(json.dumps({**cfg, "hidden_size": str(cfg["hidden_size"])}))
    with pytest.raises(CheckpointError, match="hidden_size") as e:
        spec_and_state_dict(ckpt_copy)
    assert "\n" not in str(e.value) and "expected int" in str(e.value), str(e.value)
    (ckpt_copy / "config.json").write_text(json.dumps([cfg]))
    with pytest.raises(CheckpointError, match="must hold a JSON object, not a list"):
        spec_and_state_dict(ckpt_copy)


@pytest.mark.parametrize("field, value", [("num_attention_heads", -4), ("hidden_size", 0)])
def test_a_size_field_below_one_is_named(ckpt_copy, field, value):
    """Named as the config field, not as the tensor shapes derived from it."""
    from unified_models.dsl import CheckpointError, SpecError

    cfg = json.loads((ckpt_copy / "config.json").read_text())
    (ckpt_copy / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises((SpecError, CheckpointError), match=rf"{field}={value} must be an integer >= 1"):
        spec_and_state_dict(ckpt_copy)


def test_integer_tensor_for_a_float_weight_is_refused(ckpt_copy):
    """A float parameter stored as integers is corruption, not a cast (both loaders name it)."""
    from safetensors.torch import load_file as load, save_file

    from unified_models.dsl import CheckpointError

    f = ckpt_copy / "model.safetensors"
    sd = load(str(f))
    name = next(n for n, t in sd.items() if n.endswith("norm.weight"))
    save_file({**sd, name: sd[name].to(torch.int32)}, str(f))
    with pytest.raises(CheckpointError, match=rf"{name}: stored torch.int32, expected a floating-point dtype"):
        spec_and_state_dict(ckpt_copy)


def test_save_is_atomic_and_round_trips(tmp_path, tiny_model):
    _, _, sd = tiny_model
    out = save_state_dict(sd, tmp_path / "out")
    back = load_file(str(out))
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    assert not list((tmp_path / "out").glob("*.tmp"))
    mask = os.umask(0o027)  # a team-readable setting: the file takes it, as every file this process writes
    try:
        again = save_state_dict(sd, tmp_path / "team")
    finally:
        os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~mask  # not safetensors' own 0o600
    assert stat.S_IMODE(again.stat().st_mode) == 0o640


def test_another_models_table_is_counted_not_dumped():
    """Another model's checkpoint differs in hundreds of tensors: each kind lists its first
    ``LISTED_TENSORS`` names and counts the rest (a newcomer's resume of a DeepSeek-V4 checkpoint into a
    Nemotron-H run printed a 9.4 KB line); a short list is given whole."""
    from unified_models.converters.hf_safetensors import LISTED_TENSORS, tensor_table_problems

    expected = {f"a.{i}": (2,) for i in range(40)}
    got = {f"b.{i}": (2,) for i in range(300)} | {"a.0": (3,)}
    missing, extra, shaped = tensor_table_problems(expected, got)
    assert missing.startswith("missing tensors: ['a.1', 'a.2'")
    assert missing.endswith(f"and {39 - LISTED_TENSORS} more (39 in all)")
    assert extra.endswith(f"and {300 - LISTED_TENSORS} more (300 in all)") and len(extra) < 400
    assert shaped == "mis-shaped tensors: ['a.0: expected (2,), got (3,)']"


@pytest.mark.parametrize("value", [8, -1, 99])
def test_a_hash_table_entry_past_the_experts_is_refused_at_load(tmp_path, value):
    """DeepSeek-V4's hash layer routes token t to experts tid2eid[t]: an entry outside [0, E) is a
    corrupt checkpoint, refused when it is read (check, convert) naming the tensor, not an IndexError
    in transformers' forward or a dead vLLM engine at the first request."""
    from unified_models.backends.megatron.dist_ckpt import hf_to_megatron
    from unified_models.presets import build_preset_checkpoint

    d = tmp_path / "dsv4"
    shutil.copytree(build_preset_checkpoint("deepseek_v4_tiny"), d)
    name = "model.layers.0.ffn.gate.tid2eid"

    def corrupt(sd):
        sd[name] = sd[name].clone()
        sd[name][5, 1] = value
    _rewrite(d, corrupt)
    want = rf"{name.replace('.', '[.]')} holds expert ids in \[{min(value, 0)}, {max(value, 7)}\]; its layer has 8"
    with pytest.raises(CheckpointError, match=want):
        spec_and_state_dict(d)
    with pytest.raises(CheckpointError, match=want):
        hf_to_megatron(d, tmp_path / "mg")
    assert not (tmp_path / "mg").exists()
