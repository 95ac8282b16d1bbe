"""``benchmarks/decode_chunk_position.py`` on the CPU at tiny widths: the decode step at two in-chunk
positions (one mid-chunk, one completing the chunk: the state kernel's COMMIT) runs through the
Triton interpreter (the GPU's decode metadata and kernels), its JSON rows exist with positive times,
and the correctness guard (decode step == general chunked scan, bit for bit) held. No timing
assertions."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec_ = importlib.util.spec_from_file_location("decode_chunk_position",
                                               ROOT / "benchmarks" / "decode_chunk_position.py")
dcp = importlib.util.module_from_spec(spec_)
spec_.loader.exec_module(dcp)


def test_two_positions_rows_and_guard(tmp_path, capsys):
    out = tmp_path / "dcp.json"
    # the tiny hybrid's first Mamba layer (8 heads x 16, 2 groups, state 16, chunk 16), narrowed to 2 heads
    rc = dcp.main(["--preset", "nemotron_h_hybrid_tiny", "--heads", "2", "--batch", "2",
                   "--positions", "5", "15", "--wall-iters", "1", "--no-native", "--json", str(out)])
    assert rc == 0, capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["p"], r["position"], r["Q"]) for r in rows] == [(2, 5, 21, 16), (2, 15, 31, 16)]
    for r in rows:
        assert r["path"].startswith("decode metadata + Triton kernels"), r["path"]
        assert r["timing"] in ("wall_clock", "cuda_graph")
        for part in ("conv", "ssm", "step"):
            assert r[f"ours_{part}_ms"] > 0 and r[f"growth_{part}"] > 0
        assert r["meta_ms"] > 0
        assert r["guard_bitwise"] is True and r["guard"] and all(r["guard"].values()), r["guard"]
        assert "scan_out_vs_chunk_prefix" in r["guard"] and "state_ssm_vs_chunk_prefix" in r["guard"]
        assert r["native_unavailable"] == "--no-native"
        assert r["work"]["programs"]["scan"] == 2 * 2  # one program per (sequence, head) on a decode step
    # p = 15 completes the chunk: every program of the state kernel folds it once; p = 5 folds nothing
    assert rows[1]["work"]["state_commit_chunk_passes"] == rows[1]["work"]["programs"]["state_commit"] > 0
    assert rows[0]["work"]["state_commit_chunk_passes"] == 0
