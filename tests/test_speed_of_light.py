"""``benchmarks/speed_of_light.py``: the bytes a decode step must read, counted by hand on the tiny hybrid
(``M*-EM-E``: 2 Mamba layers, 1 attention layer, 2 MoE layers of 8 experts top-2, bf16)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec_ = importlib.util.spec_from_file_location("speed_of_light", ROOT / "benchmarks" / "speed_of_light.py")
sol = importlib.util.module_from_spec(spec_)
spec_.loader.exec_module(sol)

D, V, E, I = 128, 32064, 8, 64  # hidden, vocabulary, routed experts, expert width (the preset's config)
EXPERT_BYTES = 2 * E * (2 * D * I) * 2  # 2 MoE layers, up + down per expert, bf16
MAMBA_SLOT = 8 * 16 * 16 * 4 + 3 * (2 * D + 2 * 2 * 16) * 2  # fp32 SSM state + bf16 conv state of one sequence


def test_step_bytes_counts_experts_touched_kv_and_state():
    spec, config = sol._spec_of_preset("nemotron_h_hybrid_tiny")
    one = sol.step_bytes(spec, config, batch=1, context=100)
    many = sol.step_bytes(spec, config, batch=4096, context=100)
    assert one["experts"] == pytest.approx(EXPERT_BYTES * 2 / E)  # one token reads its top-2 of 8
    assert many["experts"] == pytest.approx(EXPERT_BYTES, rel=1e-9)  # 4096 tokens touch every expert
    assert one["kv"] == 1 * 2 * 100 * 2 * 32 * 2  # 1 attention layer: K and V, 2 kv heads x 32, bf16
    assert one["mamba_state"] == 2 * 2 * MAMBA_SLOT  # 2 Mamba layers, read + written
    # dense: every other tensor once, the LM head in full, the embedding's B rows only
    assert one["dense"] - many["dense"] == pytest.approx(-(4096 - 1) * D * 2)
    assert one["dense"] > V * D * 2  # at least the LM head
    assert one["total"] == pytest.approx(sum(one[k] for k in ("dense", "experts", "kv", "mamba_state")))


def test_quantized_preset_counts_stored_formats():
    """``nemotron_h_hybrid_tiny_nvfp4``: experts NVFP4 (4.5 bits), Mamba projections FP8, FP8 KV cache."""
    spec, config = sol._spec_of_preset("nemotron_h_hybrid_tiny_nvfp4")
    formats = sol.quantization_of_preset("nemotron_h_hybrid_tiny_nvfp4")
    assert formats == {"experts": "nvfp4", "mamba_proj": "fp8", "kv_cache": "fp8"}
    assert sol.quantization_of_preset("nemotron_h_hybrid_tiny") == {}
    bf16 = sol.step_bytes(spec, config, batch=4096, context=100)
    q = sol.step_bytes(spec, config, batch=4096, context=100, kv_bytes=1, formats=formats)
    assert q["experts"] == pytest.approx(EXPERT_BYTES / 2 * (0.5 + 1 / 16), rel=1e-9)
    proj = 2 * (328 * 128 + 128 * 128)  # in_proj + out_proj of the 2 Mamba layers, 2 -> 1 byte each
    assert bf16["dense"] - q["dense"] == pytest.approx(proj)
    assert q["kv"] * 2 == bf16["kv"] and q["mamba_state"] == bf16["mamba_state"]


def test_table_from_a_result_file(tmp_path, capsys):
    run = {"preset": "nemotron_h_hybrid_tiny", "device": "test", "settings": {"max_num_seqs": 4},
           "workloads": [{"name": "8x10/20", "num_requests": 8, "input_len": 10, "output_len": 20,
                          "ours_tok_s": 100.0, "native_tok_s": 50.0}]}
    src, out = tmp_path / "r.json", tmp_path / "sol.json"
    src.write_text(json.dumps(run))
    assert sol.main(["--results", str(src), "--json", str(out)]) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert (row["batch"], row["mean_context"]) == (4, 20)  # min(requests, max_num_seqs); prompt + half
    spec, config = sol._spec_of_preset("nemotron_h_hybrid_tiny")
    expect = 4 / (sol.step_bytes(spec, config, 4, 20)["total"] / 4.8e12)
    assert row["sol_tok_s"] == pytest.approx(expect, abs=0.1)
    assert row["ours_of_sol"] == pytest.approx(100.0 / row["sol_tok_s"], rel=1e-3)
    with pytest.raises(SystemExit, match="not a rollout_throughput.py result"):
        sol.main(["--results", str(out), "--json", str(tmp_path / "x.json")])


def test_output_paths(tmp_path):
    """A directory as ``--json`` is refused by name (nothing written); a results file inside the repo is
    recorded by its repo-relative path (the committed output does not change with the checkout's place)."""
    with pytest.raises(SystemExit, match="is a directory"):
        sol.main(["--json", str(tmp_path)])
    assert list(tmp_path.iterdir()) == [] and not (tmp_path.parent / (tmp_path.name + ".tmp")).exists()
    out = tmp_path / "sol.json"
    assert sol.main(["--json", str(out)]) == 0
    assert json.loads(out.read_text())["results"] == "benchmarks/results/rollout_throughput.json"
