"""`unified-models bisect`: no divergent op on unmodified code; a one-ulp change injected into one
op on one side (test-only hook) is named exactly, with its element and position; the written
reproduction fails on its own; --against peer and --against reference compare module by module."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from unified_models.cli import main
from unified_models.porting import taps
from unified_models.porting.bisect import PERTURB_ENV, trainer_side
from unified_models.porting.compare import bits, first_divergence
from unified_models.porting.repro import recompute, write_repro

ARGS = ["--num-prompts", "2", "--max-new-tokens", "3"]


def test_taps_are_off_by_default_and_cost_one_check():
    assert taps.SINK is None
    rec = taps.TapRecorder()
    with taps.recording(rec):
        assert taps.SINK is rec
        with pytest.raises(RuntimeError, match="already active"):
            taps.recording(taps.TapRecorder()).__enter__()
    assert taps.SINK is None
    assert taps.tap_name("backbone.layers.3.mixer.in_proj") == "layers.3.mixer.in_proj"
    assert taps.Perturbation.parse("layers.1.mixer.attn@1:7:3") == taps.Perturbation("layers.1.mixer.attn", 1, 7, 3)
    with pytest.raises(ValueError, match="NAME"):
        taps.Perturbation.parse("x@1")


@pytest.fixture(scope="module")
def clean(tiny_checkpoint, tmp_path_factory):
    d = tmp_path_factory.mktemp("bisect")
    status = main(["bisect", "--model", str(tiny_checkpoint), *ARGS, "--json", str(d / "b.json"),
                   "--repro-dir", str(d / "repro")])
    return status, json.loads((d / "b.json").read_text()), d


def test_no_divergent_op_on_unmodified_code(clean):
    status, r, d = clean
    assert status == 0 and r["passed"] and r["divergence"] is None
    names = r["op_names"]
    for want in ("embedding", "layers.0.norm", "layers.0.mixer.q_proj", "layers.0.mixer.attn",
                 "layers.0.mixer.o_proj", "layers.1.mixer.up_proj", "layers.1.mixer.act", "layers.5.mixer.residual",
                 "final_norm", "logits", "logprobs"):
        assert want in names, want
    assert names.index("embedding") < names.index("layers.0.norm") < names.index("layers.0.mixer.q_proj")
    assert r["rows_compared"] > len(names) * r["sequences"]
    assert not (d / "repro").exists()
    fps = r["fingerprints"]  # both live engines' contracts, equal
    assert fps["rollout"]["engine"] == "vllm" and fps["trainer"]["engine"] == "megatron"
    assert fps["contract"] == fps["rollout"]["digest"] == fps["trainer"]["digest"]


def test_a_different_trainer_contract_is_refused_before_recompute(tiny_model, monkeypatch):
    """The trainer side compares its fingerprint with the rollout's first: a trainer reading another
    torch version is refused naming the component, and nothing is recorded."""
    from unified_models.backends.megatron.trainer import Trainer
    from unified_models.consistency import fingerprint as F
    from unified_models.consistency.fingerprint import FingerprintMismatchError

    _, spec, sd = tiny_model
    with Trainer(spec, sd, device="cpu") as t:
        ours = t.contract_fingerprint()
    real = F.library_version
    monkeypatch.setattr(F, "library_version", lambda mod: "2.0.0+other" if mod == "torch" else real(mod))
    rec = taps.TapRecorder()
    with pytest.raises(FingerprintMismatchError, match="library.torch"):
        trainer_side(spec, sd, [[1, 2, 3]], device="cpu", recorder=rec, fingerprints={"rollout": ours})
    assert not rec.records.order


def test_injected_ulp_on_the_rollout_side_is_named_and_reproduced(tiny_checkpoint, tmp_path, monkeypatch):
    """End to end through the CLI: vLLM's attention output of layer 2, one element one ulp up."""
    monkeypatch.setenv(PERTURB_ENV, "rollout=layers.2.mixer.attn@1:9:5")
    status = main(["bisect", "--model", str(tiny_checkpoint), *ARGS, "--json", str(tmp_path / "b.json"),
                   "--repro-dir", str(tmp_path / "repro")])
    r = json.loads((tmp_path / "b.json").read_text())
    d = r["divergence"]
    assert status == 1 and not r["passed"] and "never hit" not in r["perturbed"]
    assert (d["name"], d["layer"], d["op"]) == ("layers.2.mixer.attn", 2, "mixer.attn")
    assert (d["sequence"], d["position"], d["rows_differing"]) == (1, 9, 1)
    shape = json.loads(d["shapes"][0])[1:]
    assert np.ravel_multi_index(d["element"], shape) == 5
    assert d["max_abs_diff"] > 0 and d["value_a"] != d["value_b"] and d["token_id"] is not None
    run = subprocess.run([sys.executable, r["repro"]], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "REPRODUCED (rollout)" in run.stdout


@pytest.fixture(scope="module")
def hybrid():
    from unified_models.converters.hf_safetensors import spec_and_state_dict
    from unified_models.presets import build_preset_checkpoint

    d = build_preset_checkpoint("nemotron_h_hybrid_tiny")
    _, spec, sd = spec_and_state_dict(d)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 32000, (n,), generator=g).tolist() for n in (19, 34)]
    clean = taps.TapRecorder()
    trainer_side(spec, sd, seqs, device="cpu", recorder=clean)
    return d, spec, sd, seqs, clean


@pytest.mark.parametrize("op", ["layers.1.mixer.attn", "layers.0.mixer.ssm_scan", "layers.3.mixer.experts",
                                "layers.4.mixer.in_proj", "logprobs"])
def test_injected_ulp_in_each_op_class_is_named_exactly(hybrid, op, tmp_path):
    """Trainer vs trainer with one side perturbed (no engine start): attention, Mamba-2 scan, MoE combine,
    a linear and the logprob op, each named with its layer, row and element; the repro fails alone."""
    d, spec, sd, seqs, clean = hybrid
    bad = taps.TapRecorder(perturb=taps.Perturbation(op, 1, 21, 3))
    trainer_side(spec, sd, seqs, device="cpu", recorder=bad)
    assert bad.perturbed
    cmp = first_divergence(bad.records, clean.records, sides=("trainer", "rollout"), tokens=dict(enumerate(seqs)))
    div = cmp.divergence
    assert div is not None and div.name == op and (div.sequence, div.position) == (1, 21)
    assert div.layer == (None if op == "logprobs" else int(op.split(".")[1]))
    assert np.ravel_multi_index(div.element, json.loads(div.shapes[0])[1:]) == 3 and div.token_id == seqs[1][21]
    assert div.rows_differing == 1
    path = write_repro(tmp_path / "repro", spec, d, sd, div, bad.records, clean.records, seqs, mode="trainer")
    got = recompute(path.parent)  # the op recomputed alone from the saved inputs: the clean side's bits
    assert torch.equal(bits(got), bits(clean.records.rows(op)[(1, 21)]))
    assert not torch.equal(bits(got), bits(bad.records.rows(op)[(1, 21)]))
    if op == "layers.0.mixer.ssm_scan":  # one subprocess run (the CLI test runs another): the script alone exits 1
        run = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 1 and "REPRODUCED (trainer)" in run.stdout, run.stdout + run.stderr


def test_against_peer_runs_module_by_module(tiny_checkpoint, tmp_path):
    status = main(["bisect", "--model", str(tiny_checkpoint), "--against", "peer", "--num-prompts", "1",
                   "--json", str(tmp_path / "p.json")])
    r = json.loads((tmp_path / "p.json").read_text())
    assert status == 0 and r["passed"], r["divergence"]
    assert r["sides"] == ["reference", "transformers"]
    for want in ("embedding", "layers.0.norm", "layers.0.mixer", "layers.5.mixer.residual", "final_norm", "logits"):
        assert want in r["op_names"], want


def test_against_peer_finds_a_perturbed_module(tiny_checkpoint, tmp_path, monkeypatch):
    """A 1e-2 relative change would be a real bug: one ulp of fp32 is below the tolerance, so perturb more."""
    from unified_models.porting import reference_taps

    real = reference_taps._reference_forward

    def broken(ref, ids, rec):
        w = ref.p("backbone.layers.2.mixer.o_proj.weight")
        with torch.no_grad():
            w[0, 0] += 0.5
        real(ref, ids, rec)

    monkeypatch.setattr(reference_taps, "_reference_forward", broken)
    status = main(["bisect", "--model", str(tiny_checkpoint), "--against", "peer", "--num-prompts", "1",
                   "--json", str(tmp_path / "p.json"), "--repro-dir", str(tmp_path / "repro")])
    r = json.loads((tmp_path / "p.json").read_text())
    assert status == 1 and r["divergence"]["name"] == "layers.2.mixer"


def test_against_reference_within_tolerance(tiny_checkpoint, tmp_path):
    status = main(["bisect", "--model", str(tiny_checkpoint), "--against", "reference", "--num-prompts", "2",
                   "--json", str(tmp_path / "r.json")])
    r = json.loads((tmp_path / "r.json").read_text())
    assert status == 0 and r["passed"], r["divergence"]
    assert "layers.0.mixer" in r["op_names"] and "logits" in r["op_names"]


def test_bad_flags_fail_cleanly(tiny_checkpoint, capsys, monkeypatch):
    assert main(["bisect", "--model", str(tiny_checkpoint), "--tolerance", "0.1"]) == 2
    assert "bitwise" in capsys.readouterr().err
    monkeypatch.setenv(PERTURB_ENV, "nonsense")
    assert main(["bisect", "--model", str(tiny_checkpoint)]) == 2
    assert PERTURB_ENV in capsys.readouterr().err


@pytest.mark.parametrize("op", ["layers.1.mlp.down_proj", "layers.1.self_attn.attn"])
def test_repro_of_an_op_in_a_blocks_second_sublayer_recomputes_that_sublayer(op, tmp_path):
    """Qwen3 blocks hold two sublayers (attention, then the MLP) under one layer index: the written
    reproduction of an op in the block's second sublayer recomputes that sublayer, not the first."""
    from unified_models.converters.hf_safetensors import spec_and_state_dict
    from unified_models.presets import build_preset_checkpoint

    d = build_preset_checkpoint("qwen3_tiny")
    _, spec, sd = spec_and_state_dict(d)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 32000, (n,), generator=g).tolist() for n in (11, 17)]
    clean, bad = taps.TapRecorder(), taps.TapRecorder(perturb=taps.Perturbation(op, 1, 9, 2))
    trainer_side(spec, sd, seqs, device="cpu", recorder=clean)
    trainer_side(spec, sd, seqs, device="cpu", recorder=bad)
    div = first_divergence(bad.records, clean.records, sides=("trainer", "rollout"),
                           tokens=dict(enumerate(seqs))).divergence
    assert div is not None and div.name == op
    path = write_repro(tmp_path / "repro", spec, d, sd, div, bad.records, clean.records, seqs, mode="trainer")
    got = recompute(path.parent)
    assert torch.equal(bits(got), bits(clean.records.rows(op)[(1, 9)]))


def test_against_reference_runs_under_the_mhc_residual(tmp_path, monkeypatch):
    """DeepSeek-V4's mHC streams are not the recorded tensors: --against reference compares each mixer's
    oracle on the engine's input (it died with "AttributeError: 'Tensor' object has no attribute
    'streams'"). At the default tolerance, the CSA layers' indexer top-k is decided by scores closer than
    bf16's rounding at some tokens (sequence 0, position 53 of layer 1: 4th and 5th scores 0.05584 and
    0.05569 in fp64): the bf16 engine may pick the other entry and its output jump there (0.024 relative,
    above 1/64). Those rows are excused as near ties, reported, and nothing else is: without the
    excusal the same run names layers.1.attn."""
    import dataclasses

    from unified_models.layers import family_of
    from unified_models.layers.family import FAMILIES
    from unified_models.presets import build_preset_checkpoint

    d = build_preset_checkpoint("deepseek_v4_tiny")  # layers S#CHC: CSA in layers 1 and 3

    def bisect(tag):
        out = tmp_path / f"{tag}.json"
        status = main(["bisect", "--model", str(d), "--against", "reference", "--json", str(out),
                       "--repro-dir", str(tmp_path / f"repro_{tag}")])
        return status, json.loads(out.read_text())

    status, r = bisect("excused")
    assert status == 0 and r["divergence"] is None and r["complete"] and r["rows_compared"] > 0, r["verdict"]
    assert "layers.1.attn" in r["op_names"] and "layers.0.ffn" in r["op_names"]
    assert set(r["excused"]) == {"layers.1.attn", "layers.3.attn"}, r["excused"]  # CSA only: no router tie
    assert all(e["rows"] > 0 and e["why"].startswith("near tie") for e in r["excused"].values())
    csa = next(sub.mixer for sub in _dsv4_spec(d).sublayers if sub.mixer.name.endswith("layers.1.attn"))
    fam = family_of(csa)
    monkeypatch.setitem(FAMILIES, fam.spec_type, dataclasses.replace(fam, oracle_near_ties=None))
    status, r = bisect("compared")
    assert status == 1 and r["divergence"]["name"] == "layers.1.attn", r["verdict"]
    assert (r["divergence"]["sequence"], r["divergence"]["position"]) == (0, 53)


def _dsv4_spec(d):
    from unified_models.converters.hf_safetensors import load_hf_config
    from unified_models.models import spec_from_hf_config

    return spec_from_hf_config(load_hf_config(d))


def test_topk_near_ties():
    """A row is a near tie when its k-th and (k+1)-th scores are closer than the margin relative to its
    largest |score|; -inf entries cannot be chosen (a row with at most k choosable entries has no tie)."""
    from unified_models.layers.oracle import near_tie_margin, topk_near_ties

    inf = float("-inf")
    s = torch.tensor([[4.0, 3.0, 1.0, 0.0],  # k = 2: gap 2.0 of 4: clear
                      [4.0, 3.0, 2.99, 0.0],  # gap 0.01 of 4 = 0.0025 < 0.01: near
                      [4.0, 3.0, inf, inf],  # two choosable entries for k = 2: no choice
                      [-4.0, 1.0, 1.0, 1.0]], dtype=torch.float64)  # an exact tie at the boundary
    assert topk_near_ties(s, 2, 0.01).tolist() == [False, True, False, True]
    assert topk_near_ties(s, 2, 0.001).tolist() == [False, False, False, True]
    assert topk_near_ties(s, 0, 0.5).tolist() == [False] * 4 and topk_near_ties(s, 4, 0.5).tolist() == [False] * 4
    assert near_tie_margin(torch.bfloat16) == 2 ** -6 and near_tie_margin(torch.float32) == 2 ** -22


# ----------------------------------------------------------------------------- peer coverage

DSV4_LAYERS = 4  # deepseek_v4_tiny


@pytest.fixture(scope="module")
def dsv4_tiny():
    from unified_models.presets import build_preset_checkpoint

    return build_preset_checkpoint("deepseek_v4_tiny")


def test_deepseek_v4_names_map_to_transformers_modules_in_memory(dsv4_tiny):
    """transformers renames DeepSeek-V4's modules at load time (attn -> self_attn, ...): the family maps
    every spec component the peer taps to a module that exists in the loaded DeepseekV4ForCausalLM."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from unified_models.converters.deepseek_v4_layout import transformers_module_name
    from unified_models.converters.hf_safetensors import spec_and_state_dict
    from unified_models.porting.reference_taps import peer_module_names

    assert transformers_module_name("model.layers.3.attn") == "model.layers.3.self_attn"
    assert transformers_module_name("model.layers.0.ffn") == "model.layers.0.mlp"
    assert transformers_module_name("model.layers.1.attn_norm") == "model.layers.1.input_layernorm"
    assert transformers_module_name("model.layers.2.ffn_norm") == "model.layers.2.post_attention_layernorm"
    assert transformers_module_name("head") == "lm_head"
    assert transformers_module_name("model.norm") == "model.norm"
    assert transformers_module_name("model.embed_tokens") == "model.embed_tokens"
    _, spec, _ = spec_and_state_dict(dsv4_tiny)
    names = peer_module_names(spec)
    assert names["model.layers.0.self_attn"] == "layers.0.attn" and names["model.layers.3.mlp"] == "layers.3.ffn"
    assert names["lm_head"] == "logits" and names["model.embed_tokens"] == "embedding"
    assert not any(v.endswith(".residual") for v in names.values())  # mHC streams: declared not comparable
    cfg = AutoConfig.from_pretrained(dsv4_tiny)
    with torch.device("meta"):
        hf = MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)](cfg)
    modules = dict(hf.named_modules())
    assert sorted(set(names) - set(modules)) == []
    assert len(names) == 2 + 4 * DSV4_LAYERS + 1  # embedding, 2 norms + 2 mixers per layer, final norm, head


def test_deepseek_v4_peer_compares_every_layer(dsv4_tiny, tmp_path):
    """It compared 2 ops (embedding, final_norm) and said "no divergent op": every mixer, norm and the
    logits had no transformers module under their names."""
    out = tmp_path / "p.json"
    status = main(["bisect", "--model", str(dsv4_tiny), "--against", "peer", "--num-prompts", "1",
                   "--json", str(out), "--repro-dir", str(tmp_path / "repro")])
    r = json.loads(out.read_text())
    assert status == 0 and r["passed"] and r["verdict"] == "no divergent op", r["verdict"]
    want = ["embedding"] + [f"layers.{i}.{op}" for i in range(DSV4_LAYERS)
                            for op in ("attn_norm", "attn", "ffn_norm", "ffn")] + ["final_norm", "logits"]
    assert r["op_names"] == want and r["ops_compared"] == 19
    assert r["only_in"] == {"reference": [], "transformers": []} and r["missing"] == {}
    residuals = [f"layers.{i}.{m}.residual" for i in range(DSV4_LAYERS) for m in ("attn", "ffn")]
    assert sorted(r["not_comparable"]) == sorted(residuals)
    assert all("HyperConnectionSpec" in why for why in r["not_comparable"].values())


def test_peer_with_thin_coverage_is_incomplete_not_passed(dsv4_tiny, tmp_path, monkeypatch, capsys):
    """Without the family's name map (the defect), the required ops have no counterpart: the verdict names
    them, the exit status is 3, and "no divergent op" is not printed."""
    from unified_models import models
    from unified_models.porting.bisect import EXIT_INCOMPLETE

    monkeypatch.delitem(models._TRANSFORMERS_MODULE_NAMES, "deepseek_v4")
    out = tmp_path / "p.json"
    status = main(["bisect", "--model", str(dsv4_tiny), "--against", "peer", "--num-prompts", "1",
                   "--json", str(out), "--repro-dir", str(tmp_path / "repro")])
    r = json.loads(out.read_text())
    required = [f"layers.{i}.{m}" for i in range(DSV4_LAYERS) for m in ("attn", "ffn")] + ["logits"]
    assert status == EXIT_INCOMPLETE == 3
    assert not r["passed"] and not r["complete"] and r["divergence"] is None
    assert r["missing"] == {"transformers": required}
    assert r["verdict"] == f"incomplete: 9 ops had no counterpart on the transformers: {required}"
    assert r["ops_compared"] == 2  # embedding and final_norm, as before the fix
    printed = capsys.readouterr().out
    assert "incomplete: 9 ops had no counterpart on the transformers" in printed
    assert "no divergent op" not in printed


def test_coverage_verdicts_of_first_divergence():
    """required ops missing on a side make the comparison incomplete unless declared not comparable; a
    divergence is still named first."""
    def rec(values: dict[str, float]):
        r = taps.TapRecorder()
        r.begin(type("B", (), {"seq_idx": torch.zeros(3, dtype=torch.int32), "positions": torch.arange(3)})())
        for name, v in values.items():
            r(name, torch.full((3, 2), v))
        return r.records

    a = rec({"embedding": 1.0, "layers.0.mixer": 2.0, "logits": 3.0})
    b = rec({"embedding": 1.0, "logits": 3.0})
    req = ["layers.0.mixer", "logits"]
    cmp = first_divergence(a, b, sides=("ours", "peer"), tolerance=1e-6, required=req)
    assert cmp.divergence is None and not cmp.complete and cmp.missing == {"peer": ["layers.0.mixer"]}
    assert cmp.verdict == "incomplete: 1 ops had no counterpart on the peer: ['layers.0.mixer']"
    assert cmp.as_dict()["ops_compared"] == 2 and cmp.as_dict()["complete"] is False
    cmp = first_divergence(a, b, sides=("ours", "peer"), tolerance=1e-6, required=req,
                           not_comparable={"layers.0.mixer": "no module"})
    assert cmp.complete and cmp.verdict == "no divergent op" and cmp.not_comparable == {"layers.0.mixer": "no module"}
    c = rec({"embedding": 1.0, "logits": 4.0})
    cmp = first_divergence(a, c, sides=("ours", "peer"), tolerance=1e-6, required=req)
    assert cmp.verdict == "divergent op: logits" and cmp.missing == {"peer": ["layers.0.mixer"]}
    assert first_divergence(b, a, sides=("peer", "ours"), required=req).missing == {"peer": ["layers.0.mixer"]}


def test_qwen3_peer_taps_the_head_not_the_tied_embedding(tmp_path):
    """qwen3_tiny ties its LM head to the embedding: the peer hooked model.embed_tokens as "logits" (the
    head's weight name), so "logits" compared [T, V] with [T, D] and bisect reported a divergence there."""
    from unified_models.presets import build_preset_checkpoint

    d = build_preset_checkpoint("qwen3_tiny")
    out = tmp_path / "p.json"
    status = main(["bisect", "--model", str(d), "--against", "peer", "--num-prompts", "1", "--json", str(out),
                   "--repro-dir", str(tmp_path / "repro")])
    r = json.loads(out.read_text())
    assert status == 0 and r["passed"] and r["divergence"] is None, r["verdict"]
    assert r["op_names"][0] == "embedding" and r["op_names"][-1] == "logits" and r["ops_compared"] == 23
    assert sorted(r["not_comparable"]) == [f"layers.{i}.self_attn.residual" for i in range(4)]


def test_qwen3_moe_router_near_ties_use_the_rounded_logits(tmp_path):
    """Qwen3-MoE rounds its router logits to the model dtype (as transformers does): at sequence 0,
    position 57 of ``qwen3_moe_tiny``'s layer 3 the 2nd and 3rd logits (0.457230, 0.456589 in fp64) are
    both 0.45703125 in bf16, and the engine picks the other expert. The near-tie margin is bf16's, so
    that row is excused, not a divergence (it was, with an fp32 margin: a final check found it)."""
    from unified_models.presets import build_preset_checkpoint

    out = tmp_path / "q.json"
    status = main(["bisect", "--model", str(build_preset_checkpoint("qwen3_moe_tiny")), "--against", "reference",
                   "--json", str(out), "--repro-dir", str(tmp_path / "repro")])
    r = json.loads(out.read_text())
    assert status == 0 and r["divergence"] is None and r["complete"], r["verdict"]
    assert "layers.3.mlp" in r["excused"] and all(n.endswith(".mlp") for n in r["excused"]), r["excused"]
