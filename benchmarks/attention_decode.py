"""Decode-step paged attention on the GPU: our kernel's launch variants vs vLLM's FlashAttention-3.

Not a test: a measurement that picks the attention launch constants of
``ops.triton.attention``. For each (requests, context) it builds a paged KV
cache of random bf16 values (block size 64 as our engine uses, blocks
scattered), one decode token per request at the last position, and times
(CUDA-graph replays, no host overhead):

* our ``paged_attention_triton`` with each launch variant (rows per program,
  warps, stages, TMA or pointer-gathered K/V tiles) and whether its output is bitwise equal to the default
  launch's (a variant may only become the default if it is, for every shape);
* vLLM's ``flash_attn_varlen_func`` (FA3) on the same cache, the baseline
  measured in the same run (skipped when vLLM's FA3 is not importable).

    python benchmarks/attention_decode.py --json benchmarks/results/attention_decode.json
"""

from __future__ import annotations

import argparse

from kernel_bench import finish, graph_time_ms

VARIANTS = {  # name -> AttentionLaunch fields (rows, num_warps, num_stages, kv_tma); {} = the module default
    "default": {},  # TMA K/V tiles (block size 64), 4 warps, 2 stages
    "pointer": dict(kv_tma=False),  # per-position pointer gathers, the default before session 15
    "w4_s3": dict(num_warps=4, num_stages=3),
    "w4_s4": dict(num_warps=4, num_stages=4),
    "w8_s3": dict(num_warps=8, num_stages=3),
    "rows16_w4_s3": dict(rows=16, num_warps=4, num_stages=3),
    "rows32_w4_s3": dict(rows=32, num_warps=4, num_stages=3),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=["256x640", "64x2304", "256x2304", "8x2048", "8x2047"],
                    help="REQUESTSxCONTEXT decode cases (a context not a multiple of 64 ends in a partial KV tile)")
    ap.add_argument("--heads", default="32/8/128", help="H/G/E (default: the dense-bench widths)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", nargs="*", default=None, help="variant names to time (default: all)")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)

    import torch

    from unified_models.ops.attention import triton as att

    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    H, G, E = (int(v) for v in args.heads.split("/"))
    S = 64
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:  # the baseline is optional; say why it is missing
        flash_attn_varlen_func = None
        print(f"FA3 baseline unavailable: {type(e).__name__}: {e}")
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in args.cases:
        B, ctx = (int(v) for v in case.split("x"))
        nb = -(-ctx // S)
        num_blocks = B * nb + 7
        k_cache = torch.randn(num_blocks, S, G, E, device="cuda", generator=gen).bfloat16()
        v_cache = torch.randn(num_blocks, S, G, E, device="cuda", generator=gen).bfloat16()
        perm = torch.randperm(num_blocks, device="cuda", generator=gen)[: B * nb]
        block_table = perm.view(B, nb).to(torch.int32).contiguous()
        q = torch.randn(B, H, E, device="cuda", generator=gen).bfloat16()
        seq = torch.arange(B, device="cuda", dtype=torch.int32)
        pos = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int64)
        scale = E ** -0.5
        row = {"requests": B, "context": ctx, "H": H, "G": G, "E": E, "variants": {}}
        ref = att.paged_attention_triton(q, k_cache, v_cache, block_table, seq, pos, scale)
        for name, fields in VARIANTS.items():
            if args.only and name not in args.only and name != "default":
                continue
            launch = att.AttentionLaunch(**fields)
            fn = lambda launch=launch: att.paged_attention_triton(q, k_cache, v_cache, block_table, seq, pos, scale,
                                                                  launch=launch)
            try:
                y = fn()
                row["variants"][name] = {"ms": graph_time_ms(fn, args.iters), "bitwise_equal_to_default":
                                         bool(torch.equal(y, ref))}
            except Exception as e:  # a variant that does not compile is a result too
                row["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:200]}
        if flash_attn_varlen_func is not None:
            cu_q = torch.arange(B + 1, device="cuda", dtype=torch.int32)
            seqused = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
            out = torch.empty_like(q)
            fa = lambda: flash_attn_varlen_func(q, k_cache, v_cache, max_seqlen_q=1, cu_seqlens_q=cu_q,
                                                max_seqlen_k=ctx, seqused_k=seqused, softmax_scale=scale,
                                                causal=True, block_table=block_table, out=out, fa_version=3)
            try:
                fa()
                row["fa3_ms"] = graph_time_ms(fa, args.iters)
                row["fa3_max_abs_diff"] = float((out.float() - ref.float()).abs().max())
            except Exception as e:
                row["fa3_error"] = f"{type(e).__name__}: {e}"[:200]
        kv_bytes = 2 * B * ctx * G * E * 2
        row["kv_gb_per_s_default"] = kv_bytes / (row["variants"]["default"]["ms"] * 1e-3) / 1e9
        results.append(row)
        cells = " ".join(f"{n}={v['ms']:.4f}{'' if v['bitwise_equal_to_default'] else '*'}"
                         for n, v in row["variants"].items() if "ms" in v)
        errs = {n: v["error"] for n, v in row["variants"].items() if "error" in v}
        print(f"B={B:4d} ctx={ctx:5d} fa3={row.get('fa3_ms', float('nan')):.4f} ms | {cells} | "
              f"default {row['kv_gb_per_s_default']:.0f} GB/s {errs if errs else ''} {row.get('fa3_error', '')}",
              flush=True)
    return finish(results, args.json_out, "(* = bits differ from the default launch's)")


if __name__ == "__main__":
    raise SystemExit(main())
