"""`unified-models rl` on the DeepSeek-V4 tiny preset (every attention layer type, hash and regular MoE,
mHC) on the CPU: diff = 0 at every step, the update moves the policy, and a run resumed from a
checkpoint samples the same tokens with the same logprob bits as the uninterrupted one."""

from __future__ import annotations

import json

import pytest

from unified_models.cli import main
from unified_models.rl.metrics import read_metrics

from test_rl_cli import _diff_zero

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
    """Resume from the step-1 checkpoint: steps 2 and 3 sample the same tokens with the same logprob
    bits and the same loss and gradient norm (step 3's rollout runs on the weights step 2's update
    wrote, so one whole update after the resume is covered)."""
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
