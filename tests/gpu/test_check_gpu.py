"""Full `check` on the H200: wide Nemotron-H, native Triton kernels, vLLM 0.26 eager."""

import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_check_wide_model_diff_is_zero(tmp_path):
    from unified_models.check import CheckOptions, run_check

    out = os.environ.get("UM_GPU_OUT", str(tmp_path))
    report = os.path.join(out, "check_wide.json")
    status = run_check(CheckOptions(preset="nemotron_h_wide", num_prompts=64, max_new_tokens=128, seed=0,
                                    device="cuda", peer_tolerance=1e-3, json_out=report))
    r = json.load(open(report))
    assert r["tokens_compared"] >= 64 * 128
    for k in ("max_abs_diff", "mean_abs_diff", "std_abs_diff", "k3_kl", "full_vocab_max_abs_diff"):
        assert r[k] == 0.0, (k, r[k])
    assert r["peer"]["within_tolerance"], r["peer"]
    assert status == 0
