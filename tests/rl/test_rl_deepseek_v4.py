"""`unified-models rl` on the DeepSeek-V4 tiny preset (every attention layer type, hash and regular MoE,
mHC) on the CPU: diff = 0 at every step, the update moves the policy, and a run resumed from a
checkpoint samples the same tokens with the same logprob bits as the uninterrupted one (the
resumed step's rows equal, final weights bitwise equal)."""

from __future__ import annotations

import json

import pytest
import torch

from unified_models.cli import main
from unified_models.rl.metrics import read_metrics

from test_rl_cli import _diff_zero, _trained_state

SMALL = ["--preset", "deepseek_v4_tiny", "--reward", "token-set", "--num-prompts-per-step", "2", "--group-size", "4",
         "--max-new-tokens", "6", "--full-vocab-rows", "8", "--seed", "3"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl_dsv4")
    status = main(["rl", *SMALL, "--steps", "3", "--metrics", str(d / "m.jsonl"), "--save", str(d / "ckpt"),
                   "--save-every", "1", "--no-plot"])
    return status, d


def test_every_step_has_diff_zero_and_the_policy_moves(uninterrupted):
    status, d = uninterrupted
    assert status == 0
    rows = read_metrics(d / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert _diff_zero(r), r
        assert r["tokens"] == r["tokens_compared"] == 8 * 6
        assert r["sync_tensors_copied"] > 0
    assert len({r["rollout_sha256"] for r in rows}) == 3


def test_resume_equals_the_uninterrupted_run_bitwise(uninterrupted, tmp_path):
    from unified_models.converters.hf_safetensors import spec_and_state_dict
    from unified_models.presets import build_preset_checkpoint

    status, d = uninterrupted
    assert status == 0
    metrics = tmp_path / "resumed.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in read_metrics(d / "m.jsonl")))
    assert main(["rl", *SMALL, "--steps", "3", "--metrics", str(metrics), "--resume", str(d / "ckpt" / "iter_0000001"),
                 "--save", str(tmp_path / "ckpt"), "--no-plot"]) == 0
    a, b = read_metrics(d / "m.jsonl"), read_metrics(metrics)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a[1:], b[1:]):
        assert _diff_zero(rb), rb
        for k in ("rollout_sha256", "reward_mean", "reward_std", "prompt_rows", "entropy", "grad_norm", "loss"):
            assert ra[k] == rb[k], k
    _, spec, _ = spec_and_state_dict(build_preset_checkpoint("deepseek_v4_tiny"))
    it_a, state_a = _trained_state(d / "ckpt", spec)
    it_b, state_b = _trained_state(tmp_path / "ckpt", spec)
    assert it_a == it_b == 3 and state_a.keys() == state_b.keys()
    for k in state_a:
        assert torch.equal(state_a[k], state_b[k]), k
