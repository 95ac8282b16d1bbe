"""``unified-models check --ep 2`` under ``torchrun --standalone --nproc-per-node 2`` (issue 19, CPU, gloo):
the rollout (vLLM, EP = 1) on rank 0, the trainer at EP = 2 over both processes (Megatron's EP group,
each rank its experts and its prompts), one merged report with diff = 0 on every token and full row.
Starts a vLLM engine: marked ``slow``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


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
    assert [r["experts"] for r in layout["ranks"]] == experts
    assert [r["sequences"] for r in layout["ranks"]] == [[0, 0], [1, 1]]


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
