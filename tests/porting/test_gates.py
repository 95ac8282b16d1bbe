"""`unified-models gates`: each gate's JSON record carries its pass condition and measured values;
C1 is never a pass on the CPU; a reduced set runs here (C5 = check and C8/C9 = rl are covered by
their own tests), the command runs all of them by default."""

import json

from unified_models.cli import main
from unified_models.porting.gates import GATES, cut_model


def test_cut_model_keeps_every_operator_class(tiny_model):
    _, spec, sd = tiny_model
    cut, params, k = cut_model(spec, sd)
    assert {type(s.mixer) for s in cut.sublayers} == {type(s.mixer) for s in spec.sublayers}
    assert k == len(cut.blocks) < len(spec.blocks) and set(params) == set(cut.parameter_shapes())


def test_gates_records(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "gates.json"
    only = ["C0", "C1", "C2", "C3", "C4", "C6", "C7"]
    status = main(["gates", "--model", str(tiny_checkpoint), *sum((["--only", g] for g in only), []),
                   "--json", str(out)])
    recs = {r["gate"]: r for r in json.loads(out.read_text())["gates"]}
    assert status == 0
    assert list(recs) == [g[0] for g in GATES]
    for g, r in recs.items():
        assert r["pass_condition"] and r["command"] and r["status"] in ("pass", "fail", "not-run")
    assert recs["C1"]["status"] == "not-run" and "GPU" in recs["C1"]["reason"]
    for g in ("C0", "C2", "C3", "C4", "C6", "C7"):
        assert recs[g]["status"] == "pass", recs[g]
    assert recs["C0"]["values"]["sublayers_by_type"] == {"AttentionSpec": 3, "MLPSpec": 3}
    for g in ("C2", "C3", "C4"):
        v = recs[g]["values"]
        assert v["elements"] > 0 and v["differing_elements"] == 0 and v["max_abs_diff"] == 0.0
    assert 0 < recs["C6"]["values"]["max_abs_logprob_diff"] < 1e-4
    assert recs["C7"]["values"]["parameters_checked"] > 0 and recs["C7"]["values"]["worst_relative_error"] < 1e-4
    for g in ("C5", "C8", "C9"):
        assert recs[g]["status"] == "not-run" and "not selected" in recs[g]["reason"]


def test_cut_model_of_deepseek_v4_keeps_every_attention_type_and_its_mhc_sites(tmp_path, capsys):
    """DeepSeek-V4 runs three attention operators (sliding, CSA, HCA) and two routers (hash, top-k) under
    one spec type each, inside the mHC residual whose sites name every sublayer: the cut keeps each
    variant and only its own sites, and the cut-model gates run on it (they died with "SpecError:
    HyperConnectionSpec sites do not match the sublayers")."""
    from unified_models.converters.hf_safetensors import spec_and_state_dict
    from unified_models.presets import build_preset_checkpoint

    d = build_preset_checkpoint("deepseek_v4_tiny")  # layers S#CHC
    _, spec, sd = spec_and_state_dict(d)
    cut, params, k = cut_model(spec, sd)
    assert k == 3 and [s.mixer.layer_type for s in cut.sublayers[::2]] == [
        "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    assert {s.mixer.hash_routing for s in cut.sublayers[1::2]} == {True, False}
    assert [site[0] for site in cut.residual.sites] == [s.norm.name for s in cut.sublayers]
    assert set(params) == set(cut.parameter_shapes())
    out = tmp_path / "gates.json"
    assert main(["gates", "--model", str(d), "--only", "C2", "--only", "C6", "--json", str(out)]) == 0
    got = {r["gate"]: r["status"] for r in json.loads(out.read_text())["gates"]}
    assert (got["C2"], got["C6"]) == ("pass", "pass")
