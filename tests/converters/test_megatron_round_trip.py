"""HF safetensors <-> Megatron torch_dist checkpoint: bitwise round trip, Megatron load, bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megatron.core  # noqa: E402,F401  (required: a missing install must fail, not skip)

from megatron.core import dist_checkpointing  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from unified_models.backends.megatron import UnifiedMegatronModel, init_parallel_state  # noqa: E402
from unified_models.converters import megatron_dist_ckpt as mdc  # noqa: E402
from unified_models.converters.hf_safetensors import load_hf_config, spec_and_state_dict  # noqa: E402
from unified_models.backends.megatron.dist_ckpt import (  # noqa: E402
    hf_to_megatron,
    load_dist_checkpoint,
    megatron_to_hf,
    save_dist_checkpoint,
)
from unified_models.dsl import CheckpointError  # noqa: E402


@pytest.fixture(scope="module")
def hf_dir(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def mg_dir(hf_dir, tmp_path_factory):
    # The layout written without CUDA (common.pt, read by megatron-core 0.16 and 0.19); on CUDA the
    # default writer is Megatron's own save, exercised by test_default_writer_round_trip.
    return hf_to_megatron(hf_dir, tmp_path_factory.mktemp("mg") / "ckpt", writer="torch_dcp")


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def _corrupt_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_hf_megatron_hf_is_bitwise(hf_dir, mg_dir, tmp_path):
    assert {".metadata", "common.pt", "metadata.json"} <= {p.name for p in mg_dir.iterdir()}
    assert json.loads((mg_dir / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    back = megatron_to_hf(mg_dir, tmp_path / "hf")
    a, b = load_file(str(hf_dir / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert list(a) and set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name
    assert json.loads((back / "config.json").read_text()) == json.loads((hf_dir / "config.json").read_text())
    assert (back / "config.json").read_bytes() == (hf_dir / "config.json").read_bytes()
    parsed = [{k: v for k, v in load_hf_config(d).to_dict().items() if k != "_name_or_path"} for d in (back, hf_dir)]
    assert parsed[0] == parsed[1]
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (hf_dir / f).exists():
            assert (back / f).read_bytes() == (hf_dir / f).read_bytes(), f
    assert _leftovers(tmp_path) == []


def test_default_writer_round_trip(hf_dir, tmp_path):
    """writer='auto': Megatron's own dist_checkpointing.save on CUDA, the DCP writer on CPU."""
    ckpt = hf_to_megatron(hf_dir, tmp_path / "mg")
    back = megatron_to_hf(ckpt, tmp_path / "hf")
    a, b = load_file(str(hf_dir / "model.safetensors")), load_file(str(back / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) and a[n].dtype == b[n].dtype for n in a)
    assert (back / "config.json").read_bytes() == (hf_dir / "config.json").read_bytes()


def test_load_dist_checkpoint(hf_dir, mg_dir):
    config, state = load_dist_checkpoint(mg_dir)
    assert config == json.loads((hf_dir / "config.json").read_text())
    ref = load_file(str(hf_dir / "model.safetensors"))
    assert set(state) == set(ref)
    assert all(torch.equal(state[n], ref[n]) and state[n].dtype == ref[n].dtype for n in ref)


def test_megatron_load_into_module_sharded_state_dict(hf_dir, mg_dir):
    init_parallel_state()
    _, spec, ref = spec_and_state_dict(hf_dir)
    model = UnifiedMegatronModel(spec, device="cpu")  # random init, replaced by the load
    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(mg_dir))
    for name, _ in model.named_parameters():
        assert torch.equal(loaded[name], ref[name]), name
    assert loaded[mdc.COMMON_KEY]["format"] == mdc.FORMAT_NAME  # the common state comes back too

    fresh = UnifiedMegatronModel(spec, device="cpu")
    fresh.load_dist_checkpoint(mg_dir)
    for name, p in fresh.named_parameters():
        assert torch.equal(p, ref[name]), name
    direct = UnifiedMegatronModel.from_pretrained(hf_dir, device="cpu")
    ids, cu = torch.arange(3, 40), torch.tensor([0, 12, 37], dtype=torch.int32)
    with torch.no_grad():
        fresh.requires_grad_(False)
        direct.requires_grad_(False)
        assert torch.equal(fresh.token_logprobs(ids, cu), direct.token_logprobs(ids, cu))


def test_save_dist_checkpoint_from_state_dict(hf_dir, tmp_path):
    config, spec, state = spec_and_state_dict(hf_dir)
    out = save_dist_checkpoint(state, config, tmp_path / "a", spec=spec)
    cfg, back = load_dist_checkpoint(out)
    assert cfg["model_type"] == "nemotron_h"
    assert all(torch.equal(back[n], state[n]) for n in state)
    with pytest.raises(CheckpointError, match="not empty"):
        save_dist_checkpoint(state, config, out)
    save_dist_checkpoint(state, config, out, overwrite=True)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("damage", ["missing", "extra", "extra_layer", "shape", "nan"])
def test_save_refuses_mismatched_tensors_and_writes_nothing(hf_dir, tmp_path, damage):
    config, spec, state = spec_and_state_dict(hf_dir)
    state = dict(state)
    victim = "backbone.layers.1.mixer.up_proj.weight"
    if damage == "missing":
        del state[victim]
    elif damage == "extra":
        state["backbone.layers.1.mixer.extra_proj.weight"] = state[victim]
    elif damage == "extra_layer":
        state["backbone.layers.9.mixer.up_proj.weight"] = state[victim]
    elif damage == "shape":
        state[victim] = state[victim][:-1]
    else:
        state[victim] = state[victim].clone()
        state[victim][0, 0] = float("nan")
    match = {"missing": "missing tensors", "extra": "unexpected tensors",
             "extra_layer": r"holds tensors of 10 layers .* declares 6 layers", "shape": "mis-shaped",
             "nan": "NaN"}[damage]
    with pytest.raises(CheckpointError, match=match):
        save_dist_checkpoint(state, config, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path) == []


def test_failed_write_leaves_nothing(hf_dir, tmp_path, monkeypatch):
    def broken(ckpt_dir, tensors, common):
        (ckpt_dir / "__0_0.distcp").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(mdc, "write_torch_dcp", broken)
    with pytest.raises(CheckpointError, match="disk full"):
        hf_to_megatron(hf_dir, tmp_path / "out", writer="torch_dcp")
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path) == []


def test_bad_inputs(hf_dir, mg_dir, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        hf_to_megatron(tmp_path / "nope", tmp_path / "x")
    with pytest.raises(CheckpointError, match="does not exist"):
        megatron_to_hf(tmp_path / "nope", tmp_path / "x")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_dist_checkpoint(tmp_path / "nope")
    # An HF directory is not a Megatron checkpoint.
    with pytest.raises(CheckpointError, match="not a Megatron distributed checkpoint"):
        megatron_to_hf(hf_dir, tmp_path / "x")
    # An HF directory without weights.
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(hf_dir / "config.json", no_weights / "config.json")
    with pytest.raises(CheckpointError, match="safetensors"):
        hf_to_megatron(no_weights, tmp_path / "x")
    # An HF directory whose weights do not match its config.
    wrong = tmp_path / "wrong"
    shutil.copytree(hf_dir, wrong)
    sd = load_file(str(wrong / "model.safetensors"))
    sd["backbone.norm_f.weight"] = sd["backbone.norm_f.weight"][:7].clone()
    del sd["lm_head.weight"]
    save_file(sd, str(wrong / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensors: \['lm_head.weight'\].*backbone.norm_f.weight"):
        hf_to_megatron(wrong, tmp_path / "x")
    # An existing non-empty output directory is not overwritten.
    with pytest.raises(CheckpointError, match="not empty"):
        hf_to_megatron(hf_dir, mg_dir)
    assert not (tmp_path / "x").exists()
    assert _leftovers(tmp_path) == []


def test_corrupt_megatron_checkpoints(mg_dir, tiny_model, tmp_path):
    # Truncated data file.
    c = _corrupt_copy(mg_dir, tmp_path / "truncated")
    data = c / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="could not be read|corrupt"):
        load_dist_checkpoint(c)
    # Flipped bytes inside a tensor: caught by the stored digests.
    c = _corrupt_copy(mg_dir, tmp_path / "flipped")
    data = c / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 64] = bytes(b ^ 0x5A for b in raw[mid:mid + 64])
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="corrupt"):
        megatron_to_hf(c, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # Garbage index.
    c = _corrupt_copy(mg_dir, tmp_path / "bad_index")
    (c / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        load_dist_checkpoint(c)
    # Missing index.
    c = _corrupt_copy(mg_dir, tmp_path / "no_index")
    (c / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"\.metadata is missing"):
        load_dist_checkpoint(c)
    # Broken metadata.json.
    c = _corrupt_copy(mg_dir, tmp_path / "bad_meta")
    (c / "metadata.json").write_text("{")
    with pytest.raises(CheckpointError, match="metadata.json"):
        load_dist_checkpoint(c)
    # A torch_dist checkpoint not written by unified_models.
    c = _corrupt_copy(mg_dir, tmp_path / "foreign")
    torch.save({"iteration": 3}, c / "common.pt")
    with pytest.raises(CheckpointError, match="not written by unified_models"):
        load_dist_checkpoint(c)
    # Stored config disagrees with the stored tensors.
    c = _corrupt_copy(mg_dir, tmp_path / "mismatch")
    common = torch.load(c / "common.pt", weights_only=True)
    cfg = json.loads(common[mdc.COMMON_KEY]["hf_config_json"])
    cfg["intermediate_size"] = 512
    common[mdc.COMMON_KEY]["hf_config_json"] = json.dumps(cfg)
    torch.save(common, c / "common.pt")
    with pytest.raises(CheckpointError, match=r"mis-shaped tensors: \['backbone.layers.1.mixer.up_proj.weight"):
        load_dist_checkpoint(c)
    init_parallel_state()
    _, spec, _ = tiny_model
    with pytest.raises(CheckpointError, match="different model"):
        UnifiedMegatronModel(spec, device="cpu").load_dist_checkpoint(c)
    assert _leftovers(tmp_path) == []


_MCORE_019_SCRIPT = r"""
import json, sys, torch
import megatron.core as mc
from megatron.core import dist_checkpointing
from unified_models.backends.megatron import UnifiedMegatronModel, init_parallel_state
from unified_models.backends.megatron.dist_ckpt import load_dist_checkpoint
from unified_models.converters.hf_safetensors import spec_and_state_dict
hf_dir, mg_dir = sys.argv[1:3]
assert mc.__version__.startswith("0.19"), mc.__version__
_, spec, ref = spec_and_state_dict(hf_dir)
_, state = load_dist_checkpoint(mg_dir)
assert all(torch.equal(state[n], ref[n]) for n in ref)
init_parallel_state()
m = UnifiedMegatronModel(spec, device="cpu")
loaded = dist_checkpointing.load(m.sharded_state_dict(), mg_dir)
assert all(torch.equal(loaded[n], ref[n]) for n in ref)
print("OK", mc.__version__)
"""


@pytest.mark.skipif(not os.environ.get("UM_MCORE019_SITE"),
                    reason="set UM_MCORE019_SITE to an unpacked megatron-core 0.19 wheel to cross-check the reader")
def test_megatron_core_019_reads_cpu_checkpoint(hf_dir, mg_dir):
    """megatron-core 0.19's pure-Python dist_checkpointing (run on CPU) reads the CPU-written checkpoint."""
    env = dict(os.environ, PYTHONPATH=os.environ["UM_MCORE019_SITE"] + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _MCORE_019_SCRIPT, str(hf_dir), str(mg_dir)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK 0.19" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
