"""``unified-models check --ep 2`` under ``torchrun --standalone --nproc-per-node 2`` (issue 19, CPU, gloo):
the rollout (vLLM, EP = 1) on rank 0, the trainer at EP = 2 over both processes (Megatron's EP group,
each rank its experts and its prompts), one merged report with diff = 0 on every token and full row.
With ``--rollout-dp 2 --rollout-ep 2``: one vLLM engine per process (data and expert parallel), each
rank its prompt; the merged rollout (tokens and logprob bits) is the single-process check's.
Starts vLLM engines: marked ``slow``; the layout refusals are not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FLAGS = ["--num-prompts", "2", "--max-new-tokens", "8", "--peer-prompts", "1"]
DIFF_FIELDS = ("max_abs_diff", "mean_abs_diff", "std_abs_diff", "k3_kl", "num_mismatched", "full_vocab_max_abs_diff")


def _check(model: Path, cwd: Path, out: Path, *args: str, procs: int = 1) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs), "-m"]
                if procs > 1 else [sys.executable, "-m"])
    cmd = [*launcher, "unified_models.cli", "check", "--model", str(model), *FLAGS, *args, "--json", str(out)]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("ep,experts", [(2, [[0, 3], [4, 7]]), (1, [[0, 7], [0, 7]])], ids=["ep2", "dp2"])
def test_check_rollout_ep1_trainer_ep2_diff_zero(tmp_path, ep, experts):
    """``--ep 2``: each rank its experts and its prompt; ``--ep 1`` on two processes: trainer data
    parallelism (each rank every expert and its prompt)."""
    from unified_models.presets import build_preset_checkpoint

    model = build_preset_checkpoint("nemotron_h_hybrid_tiny", out_dir=tmp_path / "hybrid")
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "unified_models.cli", "check", "--model", str(model), "--ep", str(ep), "--num-prompts", "2",
           "--max-new-tokens", "8", "--peer-prompts", "1", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    rep = json.loads(out.read_text())
    d = rep
    assert rep["passed"]
    assert d["tokens_compared"] == 16 and d["num_mismatched"] == 0
    assert d["max_abs_diff"] == 0.0 and d["mean_abs_diff"] == 0.0 and d["std_abs_diff"] == 0.0 and d["k3_kl"] == 0.0
    assert rep["full_vocab_rows"] == 16 and rep["full_vocab_max_abs_diff"] == 0.0
    layout = rep["engine"]["trainer_layout"]
    assert layout["processes"] == 2 and layout["trainer_ep"] == ep and layout["rollout_ep"] == 1
    assert layout["rollout_dp"] == 1 and layout["trainer_dp"] == 2
    assert [r["experts"] for r in layout["ranks"]] == experts
    assert [r["sequences"] for r in layout["ranks"]] == [[0, 0], [1, 1]]
    assert [r["rollout_prompts"] for r in layout["ranks"]] == [[0, 1], []]  # rank 0 rolled out alone


@pytest.mark.slow
def test_check_rollout_dp2_ep2_equals_one_process(tmp_path):
    """``--rollout-dp 2 --rollout-ep 2 --ep 2``: each process its own engine (its experts, its prompt,
    the request seed of the prompt's global index), then the trainer at EP = 2: diff = 0, and the
    merged rollout's sha256 (tokens + logprob bits) equals a single-process check's; 5 whole rows
    selected over both ranks' positions by the single-process rule (3 of prompt 0, 2 of prompt 1)."""
    from unified_models.presets import build_preset_checkpoint

    model = build_preset_checkpoint("nemotron_h_hybrid_tiny", out_dir=tmp_path / "hybrid")
    rows = ["--full-vocab-rows", "5"]
    rep = _check(model, tmp_path, tmp_path / "dp2.json", "--rollout-dp", "2", "--rollout-ep", "2", "--ep", "2",
                 "--dp", "2", *rows, procs=2)
    assert rep["passed"] and rep["tokens_compared"] == 16
    assert all(rep[f] == 0 for f in DIFF_FIELDS), {f: rep[f] for f in DIFF_FIELDS}
    assert rep["full_vocab_rows"] == 5
    layout = rep["engine"]["trainer_layout"]
    assert {k: layout[k] for k in ("processes", "trainer_ep", "trainer_dp", "rollout_dp", "rollout_ep")} == {
        "processes": 2, "trainer_ep": 2, "trainer_dp": 2, "rollout_dp": 2, "rollout_ep": 2}
    assert [r["rollout_prompts"] for r in layout["ranks"]] == [[0, 0], [1, 1]]
    assert [r["sequences"] for r in layout["ranks"]] == [[0, 0], [1, 1]]
    assert [r["experts"] for r in layout["ranks"]] == [[0, 3], [4, 7]]
    assert rep["engine"]["data_parallel_size"] == 2 and rep["engine"]["expert_parallel_size"] == 2

    one = _check(model, tmp_path, tmp_path / "one.json", *rows)
    assert one["passed"] and "trainer_layout" not in one["engine"]
    assert rep["rollout_sha256"] == one["rollout_sha256"]  # the same tokens and logprob bits at any layout
    assert one["full_vocab_rows"] == 5 and one["fingerprints"]["contract"] == rep["fingerprints"]["contract"]


def test_check_refuses_a_layout_before_any_work(tmp_path, monkeypatch):
    from unified_models.check import CheckOptions, _launch_layout
    from unified_models.dsl import ParallelismError

    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ParallelismError, match="run under torchrun --nproc-per-node 2"):
        _launch_layout(CheckOptions(ep=2))
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ParallelismError, match="4 processes for 2 prompts"):
        _launch_layout(CheckOptions(ep=2, num_prompts=2))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert _launch_layout(CheckOptions(ep=2, num_prompts=2)) == (1, 2)
    assert _launch_layout(CheckOptions(ep=2, dp=2, rollout_dp=2, rollout_ep=2, num_prompts=2)) == (1, 2)
    assert _launch_layout(CheckOptions(rollout_dp=1, num_prompts=2)) == (1, 2)  # the default: rank 0 rolls out


@pytest.mark.parametrize("world, kw, message", [
    (1, {"rollout_dp": 2}, "--rollout-dp 2: one vLLM engine runs in every process .* so --rollout-dp is the number "
                           "of processes \\(run under torchrun"),
    (2, {"rollout_dp": 4}, "--rollout-dp 4: one vLLM engine runs in every process .* \\(this job has 2 processes\\); "
                           "pass --rollout-dp 2"),
    (2, {"dp": 4}, "--dp 4: the trainer's data-parallel size is the number of processes"),
    (1, {"dp": 2}, "--dp 2: .*run under torchrun"),
    (2, {"rollout_ep": 2}, "--rollout-ep 2: vLLM shards experts over all of its data-parallel ranks or none; use "
                           "--rollout-ep 1 or --rollout-ep 1 \\(with --rollout-dp N"),
    (4, {"rollout_dp": 4, "rollout_ep": 2, "num_prompts": 4}, "--rollout-ep 2: .* use --rollout-ep 1 or --rollout-ep 4"),
    (2, {"rollout_dp": 0}, "--rollout-dp 0 must be >= 1"),
    (4, {"rollout_dp": 4}, "4 processes for 2 prompts"),
])
def test_check_refuses_a_rollout_layout_before_any_engine(world, kw, message, monkeypatch):
    from unified_models.check import CheckOptions, _launch_layout
    from unified_models.dsl import ParallelismError

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ParallelismError, match=message):
        _launch_layout(CheckOptions(**({"num_prompts": 2} | kw)))


def test_check_cli_refuses_rollout_dp_without_torchrun_and_rollout_ep_on_a_dense_model(tmp_path, capsys, monkeypatch):
    from unified_models.cli import main

    out = tmp_path / "r.json"
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["check", "--preset", "nemotron_h_tiny", "--rollout-dp", "2", "--json", str(out)]) == 2
    assert "--rollout-dp 2: one vLLM engine runs in every process" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")  # the layout is fine; the dense model has no experts to shard
    monkeypatch.setenv("RANK", "0")
    assert main(["check", "--preset", "nemotron_h_tiny", "--rollout-dp", "2", "--rollout-ep", "2", "--num-prompts", "2",
                 "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert "check --rollout-ep 2" in err and "has no routed experts" in err
    assert not out.exists()
