"""`unified-models gates` on the tiny Qwen3 and Qwen3-MoE presets (the porting record of issue 20 in CI):
the reduced set of ``test_gates.py`` (C0, C2-C4, C6, C7; C5/C8/C9 run the engines and are measured by
the full command, see docs/porting.md), each record's values asserted."""

import json

import pytest

from unified_models.cli import main

ONLY = ["C0", "C2", "C3", "C4", "C6", "C7"]


@pytest.mark.parametrize("preset,sublayers", [
    ("qwen3_tiny", {"AttentionSpec": 4, "MLPSpec": 4}),
    ("qwen3_moe_tiny", {"AttentionSpec": 4, "MLPSpec": 1, "Qwen3MoESpec": 3}),
])
def test_gates_pass(preset, sublayers, tmp_path, monkeypatch):
    monkeypatch.setenv("UNIFIED_MODELS_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "gates.json"
    status = main(["gates", "--preset", preset, *sum((["--only", g] for g in ONLY), []), "--json", str(out)])
    recs = {r["gate"]: r for r in json.loads(out.read_text())["gates"]}
    assert status == 0
    for g in ONLY:
        assert recs[g]["status"] == "pass", recs[g]
    assert recs["C1"]["status"] == "not-run"
    assert recs["C0"]["values"]["sublayers_by_type"] == sublayers
    for g in ("C2", "C3", "C4"):
        v = recs[g]["values"]
        assert v["elements"] > 0 and v["differing_elements"] == 0 and v["max_abs_diff"] == 0.0
    assert 0 < recs["C6"]["values"]["max_abs_logprob_diff"] < 1e-4
    assert recs["C7"]["values"]["parameters_checked"] > 0 and recs["C7"]["values"]["worst_relative_error"] < 1e-4
