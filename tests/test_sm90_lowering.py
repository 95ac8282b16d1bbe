"""Our GPU kernels lower for the H200 (sm_90), checked on a CPU machine.

``tests/sm90_lowering.py`` compiles every GEMM tier and the attention kernels (pointer-gathered
and TMA K/V tiles, the 8B and Nano head widths) for an sm_90 target with Triton's NVIDIA backend
and the wheel's ``ptxas``, nothing executed. This catches a kernel edit that no longer compiles for
the GPU, needs more shared memory than an H200 block has, or lowers its dots to other instructions
(the bits of a ``tl.dot`` depend on the instruction: the invariance contract rests on 64-row
``wgmma`` tiles) before any GPU time is spent. Bits themselves are tested on the GPU
(``tests/gpu/test_ops_gpu.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

H200_MAX_SHARED_BYTES = 232448
"""Largest dynamic shared memory one block may opt into on sm_90 (227 KiB)."""


@pytest.fixture(scope="module")
def lowered():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # FP fusion on: the only behaviour of the H200 image's Triton 3.6
    script = Path(__file__).with_name("sm90_lowering.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"sm90_lowering.py failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert records, f"no kernel compiled:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return records


def _by_kernel(records, name):
    found = [r for r in records if r["kernel"] == name]
    assert found, f"{name} was never compiled"
    return found


def test_every_kernel_fits_an_h200_block(lowered):
    too_big = [(r["case"], r["kernel"], r["shared"]) for r in lowered if r["shared"] > H200_MAX_SHARED_BYTES]
    assert not too_big, f"shared memory above {H200_MAX_SHARED_BYTES} bytes: {too_big}"


def test_bf16_gemm_tiers_lower_to_wgmma_with_tma(lowered):
    from unified_models.ops.linear.triton import FP32_OUT_LAST_TIER, GPU_TIERS

    bf16 = [r for r in lowered if r["case"].startswith("linear") and "bf16->" in r["case"]]
    for r in bf16:
        assert r["kernel"] == "_linear_tma_kernel", r
        assert r["wgmma_m64"] > 0 and r["mma_sync"] == 0, f"{r['case']}: dots must be 64-row wgmma: {r}"
        assert r["tma_copies"] > 0, f"{r['case']}: TMA tier without bulk tensor copies: {r}"
        assert r["constexprs"]["BLOCK_K"] == 64, r  # the K step the bits rest on

    def configs(out):
        return {(r["constexprs"]["BLOCK_M"], r["constexprs"]["BLOCK_N"], r["num_warps"], r["num_stages"],
                 r["constexprs"]["PERSISTENT"]) for r in bf16 if r["case"].endswith(out)}

    tiers = {(c.block_m, c.block_n, c.num_warps, c.num_stages, c.persistent) for _, c in GPU_TIERS}
    assert configs("bfloat16") == tiers  # every GPU tier compiled
    last = GPU_TIERS[-1][1]
    f = FP32_OUT_LAST_TIER
    assert configs("float32") == tiers - {(last.block_m, last.block_n, last.num_warps, last.num_stages,
                                           last.persistent)} | {(f.block_m, f.block_n, f.num_warps, f.num_stages,
                                                                 f.persistent)}


def test_attention_tile_dots_lower_to_wgmma(lowered):
    partial = [r for r in _by_kernel(lowered, "_attention_partial_kernel") if not r["case"].endswith("fp8 cache")]
    cases = {r["case"] for r in partial}
    assert cases == {f"attention {w} S={S} kv_tma={t}" for w in ("8b", "nano")
                     for S, t in ((16, False), (64, False), (64, True))}, cases
    for r in partial:
        assert r["constexprs"]["ROWS"] == 64, r
        assert r["wgmma_m64"] > 0 and r["mma_sync"] == 0, f"{r['case']}: the tile's dots must be wgmma: {r}"
        if r["constexprs"]["KV_TMA"]:
            assert r["tma_copies"] > 0, f"{r['case']}: KV_TMA without bulk tensor copies: {r}"
        else:
            assert r["tma_copies"] == 0, r
    for width in ("8b", "nano"):  # TMA or pointer loads feed the same wgmma instructions
        shapes = {r["constexprs"]["KV_TMA"]: r["wgmma_shapes"] for r in partial if r["case"].startswith(
            f"attention {width} S=64")}
        assert shapes[True] == shapes[False] and shapes[True], (width, shapes)
    _by_kernel(lowered, "_attention_merge_kernel")
    _by_kernel(lowered, "_tile_schedule_kernel")


def test_elementwise_norm_and_fp8_kernels_lower(lowered):
    names = {r["kernel"] for r in lowered}
    for kernel in ("_write_kv_kernel", "_rms_norm_kernel", "_relu2_kernel", "_swiglu_kernel", "_logprobs_kernel",
                   "_embedding_kernel", "_rope_kernel", "_fp8_quant_act_kernel", "_fp8_gemm_kernel"):
        assert kernel in names, f"{kernel} was never compiled (got {sorted(names)})"
    fp8_gemm = _by_kernel(lowered, "_fp8_gemm_kernel")
    assert all(r["wgmma_m64"] > 0 and r["mma_sync"] == 0 for r in fp8_gemm), fp8_gemm
    fp8_attention = [r for r in lowered if r["case"] == "attention 8b S=64 fp8 cache"
                     and r["kernel"] == "_attention_partial_kernel"]
    assert fp8_attention and fp8_attention[0]["constexprs"]["FP8"] and fp8_attention[0]["wgmma_m64"] > 0


def test_fused_add_rms_norm_reduces_like_the_norm(lowered):
    """The fused residual add + RMSNorm (``HAS_UPDATE``) sums the squares in the same layout as the
    plain norm at the Nano-30B, 8B and Flash widths, bf16 and fp32 streams: the same reduction tree, so
    the same bits for the same stream (the H200 test ``test_add_rms_norm_is_add_then_norm`` checks them)."""
    by_case = {r["case"]: r for r in _by_kernel(lowered, "_rms_norm_kernel")}
    for d in (2688, 4096, 7168):
        for stream in ("bfloat16", "float32"):
            plain, fused = by_case[f"rms_norm D={d} {stream}"], by_case[f"add_rms_norm D={d} {stream}"]
            assert fused["constexprs"]["HAS_UPDATE"] and not plain["constexprs"]["HAS_UPDATE"]
            assert len(plain["reduce_operands"]) == 1 and "blocked" in plain["reduce_operands"][0], plain
            assert fused["reduce_operands"] == plain["reduce_operands"], (d, stream, plain, fused)
            assert fused["num_warps"] == plain["num_warps"]


def test_causal_attention_grads_lower_to_wgmma(lowered):
    """The trainer's fused attention backward (``ops/attention/causal_grads.py``): every dot of its
    three kernels a 64-row ``wgmma`` on sm_90, for head dims 64 and 128, within one block's shared memory."""
    for kernel in ("_stats_kernel", "_dkdv_kernel", "_dq_kernel"):
        recs = [r for r in _by_kernel(lowered, kernel) if r["case"].startswith("causal attention grads")]
        assert {r["case"] for r in recs} == {"causal attention grads E=64", "causal attention grads E=128"}, recs
        for r in recs:
            assert r["wgmma_m64"] > 0 and r["mma_sync"] == 0, f"{r['case']} {kernel}: dots must be wgmma: {r}"
