"""The fused residual add + RMSNorm (``ops.add_rms_norm``) against the two kernels it replaces and
against vLLM's own ``fused_add_rms_norm`` (its CUDA op, what native Nemotron-H runs between sublayers).

For each hidden size ``D`` and token count ``T`` (decode batches and a prefill chunk), the GPU time of
one call inside a captured CUDA graph (:func:`kernel_bench.graph_time_ms`, no launch overhead), the
achieved HBM bandwidth (bytes: read stream + update + weight, write stream + normed; bf16), and
whether our fused outputs are bitwise ``r + u`` then ``rms_norm`` (they must be: the product's bits
do not move). vLLM's op is timed for reference only; its bits are not ours (different reduction).

    python benchmarks/residual_norm.py [--hidden 2688 4096] [--tokens 1 64 256 8192] [--json F]

Needs a CUDA device. Default JSON: none (printed table only); ``scripts/gpu-run.sh norm-kernels`` writes
``$OUT/residual_norm.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernel_bench import finish, graph_time_ms  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[2688, 4096, 7168], help="hidden sizes D")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 8192], help="rows T per call")
    ap.add_argument("--iters", type=int, default=50, help="calls captured per graph")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    if min(args.hidden + args.tokens) < 1 or args.iters < 1:
        ap.error("--hidden, --tokens and --iters must be >= 1")

    import torch

    if not torch.cuda.is_available():
        ap.error("needs a CUDA device (the CPU path has no fused kernel to time)")
    from unified_models.ops.rmsnorm.triton import add_rms_norm_triton, rms_norm_triton

    try:
        from vllm import _custom_ops as vllm_ops
    except Exception as e:  # noqa: BLE001 - timed where it imports; the JSON records why not
        vllm_ops, vllm_missing = None, f"{type(e).__name__}: {e}"
    bf16, eps = torch.bfloat16, 1e-5
    results = []
    print(f"{'D':>6} {'T':>6} {'fused us':>9} {'add+norm us':>12} {'vllm us':>8} {'fused GB/s':>10} {'bitwise':>8}")
    for d in args.hidden:
        for t in args.tokens:
            gen = torch.Generator(device="cuda").manual_seed(d * 100003 + t)
            r = (torch.randn(t, d, device="cuda", generator=gen) * 20).to(bf16)
            u = torch.randn(t, d, device="cuda", generator=gen).to(bf16)
            w = (1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).to(bf16)
            s, y = add_rms_norm_triton(r, u, w, eps, bf16)
            same = bool(torch.equal(s.view(torch.int16), (r + u).view(torch.int16))
                        and torch.equal(y.view(torch.int16), rms_norm_triton(r + u, w, eps, bf16).view(torch.int16)))
            fused = graph_time_ms(lambda: add_rms_norm_triton(r, u, w, eps, bf16), args.iters) * 1e3
            unfused = graph_time_ms(lambda: rms_norm_triton(r + u, w, eps, bf16), args.iters) * 1e3
            row = dict(hidden=d, tokens=t, fused_us=fused, add_then_norm_us=unfused, bitwise_equal=same,
                       fused_gb_s=(5 * t * d + d) * 2 / (fused * 1e-6) / 1e9)
            if vllm_ops is not None:
                xi, ri = u.clone(), r.clone()
                row["vllm_fused_add_rms_norm_us"] = graph_time_ms(
                    lambda: vllm_ops.fused_add_rms_norm(xi, ri, w, eps), args.iters) * 1e3
            else:
                row["vllm_fused_add_rms_norm_us"] = None
                row["vllm_missing"] = vllm_missing
            results.append(row)
            v = row["vllm_fused_add_rms_norm_us"]
            print(f"{d:>6} {t:>6} {fused:>9.2f} {unfused:>12.2f} {'-' if v is None else f'{v:.2f}':>8} "
                  f"{row['fused_gb_s']:>10.0f} {str(same):>8}")
    bad = [r for r in results if not r["bitwise_equal"]]
    finish(results, args.json, "fused: ops.add_rms_norm; add+norm: torch add then ops.rms_norm; vllm: "
           "_custom_ops.fused_add_rms_norm (in place; its bits differ from ours by design)")
    if bad:
        print(f"FAIL: fused != add then norm at {[(r['hidden'], r['tokens']) for r in bad]}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
