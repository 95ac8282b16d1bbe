"""``check``'s peer bound is relative to the logits' scale (``check.peer_check``): a correct model
passes at any logit scale, a perturbed reference fails, and the report names the scale and bound."""

from __future__ import annotations

import math

import pytest
import torch

from unified_models.backends.reference import ReferenceModel
from unified_models.check import PEER_TOLERANCE, peer_check, row_logit_diffs
from unified_models.converters.hf_safetensors import spec_and_state_dict

PROMPTS = [[1, 15043, 29892, 920, 526, 366, 29973, 306, 626, 263, 1243, 29889], [1, 450, 4996, 17354, 1701, 29916]]


def test_row_logit_diffs_are_per_row_max_and_scale():
    theirs = torch.tensor([[1.0, -4.0, 2.0], [0.5, 0.25, -0.125], [1.0, 2.0, 3.0]])
    ours = torch.tensor([[1.5, -4.0, 2.0], [0.5, 0.0, -0.125], [1.0, float("nan"), 3.0]])
    diff, scale = row_logit_diffs(theirs, ours)
    assert diff.dtype == torch.float64 and diff.tolist() == [0.5, 0.25, math.inf]
    assert scale.tolist() == [4.0, 0.5, 3.0]


def test_default_tolerance_is_1024_fp32_ulps():
    assert PEER_TOLERANCE == 1024 * 2.0 ** -23


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    cfg, spec, sd = spec_and_state_dict(tiny_checkpoint)
    return tiny_checkpoint, cfg, spec, sd


def test_report_names_the_scale_and_the_bound(tiny):
    d, cfg, spec, sd = tiny
    r = peer_check(spec, sd, d, PROMPTS, hf_config=cfg)
    assert r["within_tolerance"] and r["tolerance"] == PEER_TOLERANCE and r["tokens"] == 18
    assert 0 < r["max_rel_logit_diff"] < 1e-5  # measured 8e-7 (7 fp32 ulps)
    assert 0 < r["max_abs_logit_diff"] < 1e-5
    assert 0.5 < r["logit_scale"] < 10 and r["bound"] == PEER_TOLERANCE * r["logit_scale"]


def test_a_correct_model_with_large_logits_passes(tiny):
    """LM head x 1024 (exact in bf16 and fp32): every logit and every difference scales by 1024,
    so the absolute difference exceeds the former absolute bound 1e-4 while the relative one is
    unchanged, bit for bit."""
    d, cfg, spec, sd = tiny
    base = peer_check(spec, sd, d, PROMPTS, hf_config=cfg)
    big = peer_check(spec, {**sd, "lm_head.weight": sd["lm_head.weight"] * 1024}, d, PROMPTS, hf_config=cfg)
    assert big["logit_scale"] == base["logit_scale"] * 1024
    assert big["max_abs_logit_diff"] == base["max_abs_logit_diff"] * 1024 and big["max_abs_logit_diff"] > 1e-4
    assert big["max_rel_logit_diff"] == base["max_rel_logit_diff"] and big["within_tolerance"]


@pytest.mark.parametrize("change", ["one element +0.01", "tensor x 1.01"])
def test_a_perturbed_reference_fails(tiny, monkeypatch, change):
    """One weight of our side only (layer 0's q_proj) changed: transformers keeps the checkpoint's."""
    d, cfg, spec, sd = tiny
    name = "backbone.layers.0.mixer.q_proj.weight"
    load = ReferenceModel.load_state_dict_hf

    def perturbed(self, weights):
        w = dict(weights)
        t = w[name].clone()
        if change == "tensor x 1.01":
            t = t * 1.01
        else:
            t.view(-1)[0] += 0.01
        w[name] = t
        return load(self, w)

    monkeypatch.setattr(ReferenceModel, "load_state_dict_hf", perturbed)
    r = peer_check(spec, sd, d, PROMPTS, hf_config=cfg)
    assert not r["within_tolerance"]
    assert r["max_rel_logit_diff"] > 1.5 * PEER_TOLERANCE  # measured 2.3e-4 (+0.01) and 8.8e-4 (x 1.01)
