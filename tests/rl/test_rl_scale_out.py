"""``unified-models rl`` under ``torchrun --standalone --nproc-per-node 2`` (issue 19, CPU, gloo).

Each process holds a vLLM engine (vLLM data parallel, external launcher) and a share of the
trainer (Megatron EP = 2, DP = 2). Asserted: diff = 0 on every token and recorded row at every
step; the step-1 rollout equals a one-process run's (the layout does not change a token or a
logprob bit); a checkpoint saved at EP = 2 resumes in one process (EP = 1) and in two, and both
resumed runs sample the same next step bit for bit. Starts vLLM engines: marked ``slow``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from unified_models.cli import main
from unified_models.dsl import ParallelismError
from unified_models.rl.distributed import launch_layout
from unified_models.rl.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--reward", "token-set", "--num-prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "8",
         "--no-plot"]
DIFF_FIELDS = ("max_abs_diff", "mean_abs_diff", "std_abs_diff", "k3_kl", "num_mismatched", "full_vocab_max_abs_diff")


def _rl(model: Path, cwd: Path, *args: str, procs: int = 1) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs), "-m"]
                if procs > 1 else [sys.executable, "-m"])
    cmd = [*launcher, "unified_models.cli", "rl", "--model", str(model), *FLAGS, *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


@pytest.mark.slow
def test_rl_trainer_ep2_rollout_dp2_diff_zero_and_resume_at_another_layout(tmp_path):
    from unified_models.presets import build_preset_checkpoint

    model = build_preset_checkpoint("nemotron_h_hybrid_tiny", out_dir=tmp_path / "hybrid")  # MoE layers, 8 experts
    ck = tmp_path / "ck"
    _rl(model, tmp_path, "--steps", "3", "--ep", "2", "--save", str(ck), "--metrics", str(tmp_path / "ep2.jsonl"),
        procs=2)
    rows = read_metrics(tmp_path / "ep2.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(r[f] == 0 for f in DIFF_FIELDS), r
        assert r["tokens"] == r["tokens_compared"] == 64 and r["full_vocab_rows"] == 64
        assert r["importance_ratio_max"] == 1.0 and r["importance_ratio_min"] == 1.0
        assert r["layout"] == {"world": 2, "trainer_ep": 2, "trainer_dp": 2, "rollout_dp": 2, "rollout_ep": 1}

    # the rollout at EP = 2 too (each engine its block of experts, vLLM's EP group): the same trajectory
    _rl(model, tmp_path, "--steps", "2", "--ep", "2", "--rollout-ep", "2", "--metrics", str(tmp_path / "rep2.jsonl"),
        procs=2)
    rep2 = read_metrics(tmp_path / "rep2.jsonl")
    assert [r["rollout_sha256"] for r in rep2] == [r["rollout_sha256"] for r in rows[:2]]
    assert all(all(r[f] == 0 for f in DIFF_FIELDS) and r["layout"]["rollout_ep"] == 2 for r in rep2)
    # each engine fingerprinted only what it holds: fewer tensors than two full copies
    assert rep2[0]["weight_fingerprint_tensors"] < rows[0]["weight_fingerprint_tensors"]

    _rl(model, tmp_path, "--steps", "1", "--metrics", str(tmp_path / "one.jsonl"))
    one = read_metrics(tmp_path / "one.jsonl")
    assert one[0]["rollout_sha256"] == rows[0]["rollout_sha256"]  # same tokens and logprob bits at any layout
    assert one[0]["reward_mean"] == rows[0]["reward_mean"]
    assert one[0]["grad_norm"] == pytest.approx(rows[0]["grad_norm"], rel=1e-4)  # rule 11: sums in another order
    # each engine verified every tensor it holds: both hold all of them at rollout EP = 1
    assert all(r["weight_fingerprint_tensors"] == 2 * one[0]["weight_fingerprint_tensors"] > 0 for r in rows)

    # resume the EP = 2 checkpoint at EP = 1 (one process) and at EP = 2: the same step 4
    _rl(model, tmp_path, "--steps", "4", "--resume", str(ck), "--metrics", str(tmp_path / "r1.jsonl"))
    _rl(model, tmp_path, "--steps", "4", "--resume", str(ck), "--ep", "2", "--metrics", str(tmp_path / "r2.jsonl"),
        procs=2)
    r1, r2 = read_metrics(tmp_path / "r1.jsonl"), read_metrics(tmp_path / "r2.jsonl")
    assert r1[-1]["step"] == r2[-1]["step"] == 4
    assert r1[-1]["rollout_sha256"] == r2[-1]["rollout_sha256"]
    assert all(r1[-1][f] == 0 and r2[-1][f] == 0 for f in DIFF_FIELDS)


@pytest.mark.slow
@pytest.mark.parametrize("rollout_ep", [2])
def test_rl_deepseek_v4_trainer_ep2_diff_zero(tmp_path, rollout_ep):
    """DeepSeek-V4's SwiGLU experts (the routing weight applied before the down projection travels with
    its row) through the trainer's all-to-alls and, at rollout EP = 2, through vLLM's too. Rollout
    EP = 1 beside trainer EP = 2 (the layout change alone) is the hybrid test's above; one DeepSeek-V4
    run of about 70 s covers both all-to-alls."""
    from unified_models.presets import build_preset_checkpoint

    model = build_preset_checkpoint("deepseek_v4_tiny", out_dir=tmp_path / "dsv4")
    _rl(model, tmp_path, "--steps", "2", "--ep", "2", "--rollout-ep", str(rollout_ep),
        "--metrics", str(tmp_path / "m.jsonl"), procs=2)
    rows = read_metrics(tmp_path / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(all(r[f] == 0 for f in DIFF_FIELDS) for r in rows)
    assert all(r["tokens_compared"] == r["full_vocab_rows"] == 64 for r in rows)
    assert rows[0]["layout"]["rollout_ep"] == rollout_ep


@pytest.mark.parametrize("world, kw, message", [
    (1, {"ep": 2}, "--ep 2: 1 process(es) do not split"),
    (2, {"ep": 2, "dp": 4}, "--dp 4: the trainer's data-parallel size is the number of processes"),
    (2, {"rollout_dp": 1}, "--rollout-dp 1: one vLLM engine runs in every process"),
    (4, {"ep": 3}, "--ep 3: 4 process(es) do not split"),
    (4, {"rollout_ep": 2}, "--rollout-ep 2: vLLM shards experts over all of its data-parallel ranks or none"),
    (4, {"num_prompts_per_step": 3}, "4 processes for 3 prompts per step"),
    (2, {"use_rollout_logprobs": True}, "--use-rollout-logprobs is not supported under torchrun"),
    (2, {"ep": 2, "kl_coef": 0.1}, "--kl-coef > 0 with --ep > 1"),
    (2, {"tp": 2}, "rl --tp 2: tensor_model_parallel_size=2 is refused: tensor parallelism sums partial products"),
    (1, {"rollout_ep": 2}, "with one process there is one engine: run under torchrun --nproc-per-node 2"),
])
def test_bad_layouts_are_refused_before_any_engine(world, kw, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    args = dict(ep=1, dp=None, rollout_dp=None, rollout_ep=1, num_prompts_per_step=4, use_rollout_logprobs=False,
                kl_coef=0.0) | kw
    with pytest.raises(ParallelismError, match=message.replace("(", r"\(").replace(")", r"\)")):
        launch_layout(**args)


def test_layout_defaults_follow_the_number_of_processes(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    lay = launch_layout(ep=2, dp=None, rollout_dp=None, rollout_ep=4, num_prompts_per_step=6,
                        use_rollout_logprobs=False, kl_coef=0.0)
    assert (lay.trainer_dp, lay.rollout_dp, lay.rollout_ep, lay.rank) == (4, 4, 4, 3)
    assert [list(lay.__class__(world=4, rank=r).groups(6)) for r in range(4)] == [[0], [1, 2], [3], [4, 5]]


def test_cli_refuses_ep_without_torchrun_and_an_ep_the_model_cannot_shard(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    metrics = tmp_path / "m.jsonl"
    assert main(["rl", "--preset", "nemotron_h_hybrid_tiny", "--ep", "2", "--metrics", str(metrics)]) == 2
    assert "--ep 2: 1 process(es) do not split" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")  # the layout is fine; the dense model has no experts to shard
    assert main(["rl", "--preset", "nemotron_h_tiny", "--ep", "2", "--metrics", str(metrics)]) == 2
    assert "has no routed experts" in capsys.readouterr().err
    assert not metrics.exists()
