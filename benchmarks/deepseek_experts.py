"""DeepSeek-V4's block-FP8 routed experts on the GPU: the weight tiles decoded in the GEMMs' K loop
against the stack dequantized once per call, per token count, with their bits compared.

Not a test: a measurement for issue 18 item 4 (DeepSeek-V4 at the published widths measured). At a
preset's MoE widths (default ``deepseek_v4_flash_reduced_fp8``: 32 experts, hidden 4096, expert width
2048, top-6, clamped SwiGLU, W8A8 block FP8) and each token count ``T`` it times
``ops.moe.swiglu_expert_outputs`` + ``moe_combine`` (what a MoE layer runs) on stored block-FP8 weights:

* **default**: the path the batch size picks (:func:`unified_models.ops.moe.triton.fp8_dequantize_rows_per_expert`);
* **in_loop** and **once**, each forced: the e4m3 tiles decoded inside the GEMMs' K loop, or the whole
  stack dequantized first (one kernel) and the GEMMs on bf16; each output compared bit for bit with
  the default's (the two must agree: the same values reach the same dot);
* **bf16_resident**: the same GEMMs on bf16 weights kept dequantized in memory (what a model with
  twice the weight memory would run; the floor of the dequantizing paths);
* **native**: vLLM's ``fused_experts`` with its block-FP8 W8A8 config on the same codes and scales
  (SiLU-and-mul, no clamp: the same GEMM work, not the same function), as the baseline measured in
  the same run; its exact error where it cannot run.

Also the bytes of weights the experts touched (distinct experts x 3 x I x D x 1 byte) over the time,
as GB/s against the card's HBM bandwidth. Times are CUDA-graph replays (``kernel_bench.graph_time_ms``).

    python benchmarks/deepseek_experts.py --json benchmarks/results/deepseek_experts_h100.json
"""

from __future__ import annotations

import argparse

from kernel_bench import finish, forced_paths, graph_time_ms
from moe_kernels import moe_widths


def _native(x, w13, w2, tw, ids):
    """vLLM's fused_experts with block-FP8 W8A8 (128x128 weight blocks, 1x128 activation tiles)."""
    from vllm.model_executor.layers.fused_moe import fused_experts
    from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

    cfg = fp8_w8a8_moe_quant_config(w1_scale=w13.weight_scale_inv.float(), w2_scale=w2.weight_scale_inv.float(),
                                    block_shape=[128, 128])
    return lambda: fused_experts(x, w13.weight, w2.weight, tw, ids, quant_config=cfg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from unified_models.presets import preset_name
    ap.add_argument("--preset", type=preset_name, default="deepseek_v4_flash_reduced_fp8")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 2048], help="tokens T per call")
    ap.add_argument("--iters", type=int, default=10, help="calls per captured graph")
    ap.add_argument("--hbm-tb-s", type=float, default=None,
                    help="the card's HBM bandwidth in TB/s for the GB/s column's fraction "
                         "(default: H100 3.35, H200 4.8)")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)

    import torch

    from unified_models.ops.fp8_block import FP8BlockExperts, FP8BlockMaster
    from unified_models.ops.moe import moe_combine, swiglu_expert_outputs
    from unified_models.ops.moe import triton as moe

    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    name = torch.cuda.get_device_name()
    hbm = args.hbm_tb_s or (4.8 if "H200" in name else 3.35)
    w = moe_widths(args.preset)
    E, D, I, K = w["E"], w["D"], w["I"], w["top_k"]
    g = torch.Generator(device="cuda").manual_seed(0)
    mk = lambda *s: (torch.randn(*s, device="cuda", generator=g) * s[-1] ** -0.5).bfloat16()  # noqa: E731
    gate, up, down = (FP8BlockMaster(m).quantize() for m in (mk(E, I, D), mk(E, I, D), mk(E, D, I)))
    resident = [q.dequantize(torch.bfloat16) for q in (gate, up, down)]
    w13 = FP8BlockExperts(torch.cat([gate.weight, up.weight], 1), torch.cat([gate.weight_scale_inv,
                                                                             up.weight_scale_inv], 1))
    limit = 10.0
    results = []
    for T in args.rows:
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        ids = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices.to(torch.int32)
        tw = torch.rand(T, K, device="cuda", generator=g).float()
        touched = int(torch.unique(ids).numel())
        gbytes = touched * 3 * I * D / 1e9

        def ours(weights=(gate, up, down)):
            y = swiglu_expert_outputs(x, ids, tw, *weights, swiglu_limit=limit)
            return moe_combine(y, torch.ones_like(tw), None, torch.bfloat16)

        default_in_loop = T * K < moe.fp8_dequantize_rows_per_expert(gate.weight) * E
        ref = ours()
        row = {"preset": args.preset, **w, "T": T, "gpu": name, "experts_touched": touched,
               "fp8_weight_gb_touched": gbytes, "default_path": "in_loop" if default_in_loop else "once"}
        row.update(forced_paths(moe, ("FP8_DEQUANTIZE_ROWS_PER_EXPERT", "FP8_DEQUANTIZE_ROWS_PER_EXPERT_BYTE_DECODE"),
                                ours, ref, args.iters))  # both decode paths' thresholds: whichever this GPU takes
        row["default_ms"] = graph_time_ms(ours, args.iters)
        row["bf16_resident_ms"] = graph_time_ms(lambda: ours(resident), args.iters)
        row["default_fp8_gb_s"] = gbytes / (row["default_ms"] / 1e3)
        row["default_fraction_of_hbm"] = row["default_fp8_gb_s"] / (hbm * 1e3)
        try:
            row["native_fp8_ms"] = graph_time_ms(_native(x, w13, down, tw, ids.to(torch.int32)), args.iters)
        except Exception as e:  # native's exact error is a result
            row["native_error"] = f"{type(e).__name__}: {e}"[:300]
        nat = row.get("native_fp8_ms")
        print(f"T={T:5d} default={row['default_path']:7s} {row['default_ms']:.3f} ms "
              f"({row['default_fp8_gb_s']:.0f} GB/s, {row['default_fraction_of_hbm']:.2f} of HBM) | in loop "
              f"{row['in_loop_ms']:.3f}{'' if row['in_loop_bitwise_equal_to_default'] else '*'} once "
              f"{row['once_ms']:.3f}{'' if row['once_bitwise_equal_to_default'] else '*'} bf16 resident "
              f"{row['bf16_resident_ms']:.3f} | native fp8 "
              + (f"{nat:.3f} ms" if nat else row.get("native_error", "-")),
              flush=True)
        results.append(row)
    return finish(results, args.json_out, "(* = bits differ from the default path's: a defect)")


if __name__ == "__main__":
    raise SystemExit(main())
