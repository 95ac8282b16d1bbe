"""Our grouped MoE expert kernel against vLLM's native ``fused_experts``, per row count, on the GPU.

Not a test: a measurement for issue 18 item 3 (MoE router/experts/combine at tensor-core speed,
bf16 and NVFP4 dequantized into bf16 tiles in-kernel). At a preset's MoE widths (default
``nemotron_3_nano_reduced``: 128 experts, hidden 2688, expert width 1856, top-6, relu2) and each
token count ``T`` (decode- to prefill-sized), it times

* **ours**: ``ops.moe.triton.moe_expert_outputs_triton`` (up and down grouped GEMMs) followed by
  ``moe_combine_triton`` (the weighted top-k sum), with bf16 and with NVFP4 expert weights (the row
  says which NVFP4 path the batch size picks, and times both forced: dequantized in the K loop and
  once per call, each compared bit for bit with the default), for
  the current launch configuration and every candidate in ``CANDIDATES``; each candidate's output
  is compared bit for bit with the current configuration's (a configuration may only replace the
  current one, or be chosen by ``T``, if it gives the same bits: every row's sum runs over the full
  reduction dim in ``block_k`` steps, so only ``block_k`` may change bits);
* **native**: vLLM's ``fused_experts`` (the Triton fused MoE its ``NemotronHForCausalLM`` runs in
  bf16) on the same weights, routing and activation, as the baseline measured in the same run.
  Native's NVFP4 path on the H200 is Marlin W4A16 inside its quantization method, not a free
  function; it is not timed here (the rollout benchmark compares whole engines).

Times are CUDA-graph replays of repeated calls (``kernel_bench.graph_time_ms``: no host overhead,
as in captured decode steps). Routing is uniform random top-k (distinct experts per token).

    python benchmarks/moe_kernels.py --json benchmarks/results/moe_kernels_h200.json
"""

from __future__ import annotations

import argparse

from kernel_bench import finish, forced_paths, graph_time_ms

# (block_m, block_n, block_k, num_warps, num_stages); block_m is shared by the up and down launches
CANDIDATES = {
    "64x128x64_w4_s3": (64, 128, 64, 4, 3),
    "64x64x64_w4_s4": (64, 64, 64, 4, 4),
    "64x128x64_w8_s3": (64, 128, 64, 8, 3),
    "128x128x64_w8_s3": (128, 128, 64, 8, 3),
    "128x128x64_w4_s3": (128, 128, 64, 4, 3),
    "128x256x64_w8_s3": (128, 256, 64, 8, 3),
    "16x128x64_w4_s4": (16, 128, 64, 4, 4),
    "32x128x64_w4_s4": (32, 128, 64, 4, 4),
    "64x128x128_w8_s3": (64, 128, 128, 8, 3),
}


def moe_widths(preset: str) -> dict:
    """``{"E", "D", "I", "top_k"}`` of a preset's routed experts (from its YAML's ``hf_config``).

    Raises:
        ValueError: the preset has no routed experts.
    """
    from unified_models.presets import load_preset

    spec = load_preset(preset)
    while "hf_config" not in spec and spec.get("quantize", {}).get("base"):  # a quantized export's base
        spec = load_preset(spec["quantize"]["base"])
    c = spec.get("hf_config", {})
    if not c.get("n_routed_experts"):
        raise ValueError(f"preset {preset!r} has no routed experts")
    return {"E": c["n_routed_experts"], "D": c["hidden_size"], "I": c["moe_intermediate_size"],
            "top_k": c["num_experts_per_tok"]}


def _native(x, up, down, weights, ids):
    """vLLM's fused_experts with relu2 (no gate), or None when this vLLM lacks it."""
    from vllm.model_executor.layers.fused_moe import fused_experts

    try:
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation

        act = MoEActivation.from_str("relu2_no_mul")
    except ImportError:  # older vLLM: the activation is a string
        act = "relu2_no_mul"
    return lambda: fused_experts(x, up, down, weights, ids, activation=act)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from unified_models.presets import preset_name
    ap.add_argument("--preset", type=preset_name, default="nemotron_3_nano_reduced")
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 2048, 16384], help="tokens T per call")
    ap.add_argument("--iters", type=int, default=10, help="calls per captured graph")
    ap.add_argument("--formats", nargs="+", choices=["bf16", "nvfp4"], default=["bf16", "nvfp4"])
    ap.add_argument("--only", nargs="*", default=None, help="candidate names to time (default: all)")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)

    import torch

    from unified_models.ops.moe import triton as moe
    from unified_models.ops.nvfp4 import nvfp4_quantize

    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    w = moe_widths(args.preset)
    E, D, I, K = w["E"], w["D"], w["I"], w["top_k"]
    g = torch.Generator(device="cuda").manual_seed(0)
    up = (torch.randn(E, I, D, device="cuda", generator=g) * D ** -0.5).bfloat16()
    down = (torch.randn(E, D, I, device="cuda", generator=g) * I ** -0.5).bfloat16()
    weights_by_format = {"bf16": (up, down)}
    if "nvfp4" in args.formats:
        weights_by_format["nvfp4"] = (nvfp4_quantize(up), nvfp4_quantize(down))
    current = moe.gemm_tiles(I, D)
    results = []
    for T in args.rows:
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        ids = torch.rand(T, E, device="cuda", generator=g).topk(K, dim=1).indices.to(torch.int32)
        tw = torch.rand(T, K, device="cuda", generator=g).float()
        row = {"preset": args.preset, **w, "T": T, "current": current._asdict(),
               "current_nvfp4_in_loop": moe.NVFP4_IN_LOOP_TILES._asdict(),
               "current_large_batch": moe.LARGE_BATCH_TILES._asdict(),
               "large_batch_tier": T * K >= moe.LARGE_BATCH_ROWS_PER_EXPERT * E, "native": {}, "ours": {}}
        try:
            row["native"]["bf16_ms"] = graph_time_ms(_native(x, up, down, tw, ids), args.iters)
        except Exception as e:  # native's exact error is a result
            row["native"]["error"] = f"{type(e).__name__}: {e}"[:300]
        for fmt in args.formats:
            wu, wd = weights_by_format[fmt]

            def ours(tiles=None, wu=wu, wd=wd):
                y = moe.moe_expert_outputs_triton(x, ids, wu, wd, tiles=tiles)
                return moe.moe_combine_triton(y, tw, None, torch.bfloat16)

            ref = ours()
            once = fmt == "nvfp4" and T * K >= moe.NVFP4_DEQUANTIZE_ROWS_PER_EXPERT * E
            path = {"ours_path": ("dequantize once + bf16 GEMM" if once else "dequantize in the K loop")
                    if fmt == "nvfp4" else "bf16 GEMM"}
            if fmt == "nvfp4":  # both NVFP4 paths, forced, timed and compared bit for bit
                path.update(forced_paths(moe, "NVFP4_DEQUANTIZE_ROWS_PER_EXPERT", ours, ref, args.iters))
            cells = {}
            for name, cfg in CANDIDATES.items():
                if args.only and name not in args.only:
                    continue
                t = moe.MoeTiles(*cfg)
                try:
                    out = ours((t, t))
                    cells[name] = {"ms": graph_time_ms(lambda t=t: ours((t, t)), args.iters),
                                   "bitwise_equal_to_current": bool(torch.equal(out, ref))}
                except Exception as e:  # a config that does not compile is a result too
                    cells[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            row["ours"][fmt] = {"current_ms": graph_time_ms(ours, args.iters), **path, "configs": cells}
            timed = [(n, c["ms"]) for n, c in cells.items() if "ms" in c and c["bitwise_equal_to_current"]]
            best = min(timed, key=lambda c: c[1]) if timed else (None, None)
            row["ours"][fmt]["best_same_bits"] = best[0]
            nat = row["native"].get("bf16_ms")
            ratio = (nat / row["ours"][fmt]["current_ms"]) if nat else None
            print(f"T={T:6d} {fmt:5s} [{path['ours_path']}"
                  + (f"; in loop {path['in_loop_ms']:.3f} ms, once {path['once_ms']:.3f} ms, bits equal "
                     f"{path['in_loop_bitwise_equal_to_default'] and path['once_bitwise_equal_to_default']}"
                     if fmt == "nvfp4" else "") + "] "
                  f"ours {row['ours'][fmt]['current_ms']:.3f} ms (best same-bits {best[0]} "
                  f"{best[1] if best[1] is None else round(best[1], 3)} ms) native bf16 "
                  f"{nat if nat is None else round(nat, 3)} ms  native/ours {ratio if ratio is None else round(ratio, 3)} | "
                  + " ".join(f"{n}={c['ms']:.3f}{'' if c['bitwise_equal_to_current'] else '*'}"
                             for n, c in cells.items() if "ms" in c), flush=True)
        results.append(row)
    return finish(results, args.json_out, "(* = bits differ from the current config's; native/ours > 1: ours faster)")


if __name__ == "__main__":
    raise SystemExit(main())
