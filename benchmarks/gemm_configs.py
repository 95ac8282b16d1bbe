"""Candidate tile configurations of our batch-invariant linear, per weight shape, on the GPU.

Not a test: a measurement that picks ``ops.triton.linear.GPU_TIERS``. For each
weight shape ``[N, K]`` of a model (default: the issue-8 dense bench widths) and
each row count ``T`` (decode- to prefill-sized), it times every candidate config
(CUDA-graph replays of repeated launches: no host overhead, as in captured decode), and cuBLAS (``torch.mm``)
as the baseline measured in the same run; it also reports whether a candidate's
output equals the current config's bit for bit (the tiers of ``gemm_config``
depend on ``T``; they are only allowed because all of them give the same bits,
which ``tests/gpu/test_ops_gpu.py::test_linear_tiers_give_identical_bits`` guards).

    python benchmarks/gemm_configs.py --json benchmarks/results/gemm_configs.json
"""

from __future__ import annotations

import argparse

from kernel_bench import finish, graph_time_ms

CANDIDATES = {
    # masked pointer loads (the pre-TMA tiers)
    "128x128x64_w8_s3": (128, 128, 64, 8, 3),
    "128x64x64_w4_s4": (128, 64, 64, 4, 4),
    "64x32x64_w4_s5": (64, 32, 64, 4, 5),
}
for _bm, _bn, _w, _s in [(64, 16, 4, 6), (64, 32, 4, 5), (64, 32, 4, 6), (64, 32, 4, 8), (64, 64, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 64, 4, 4),
                         (128, 128, 4, 3), (128, 128, 4, 4), (128, 128, 8, 4), (128, 256, 8, 3)]:
    for _p in (False, True):
        CANDIDATES[f"tma{'_p' if _p else ''}_{_bm}x{_bn}x64_w{_w}_s{_s}"] = (_bm, _bn, 64, _w, _s, True, _p)
DENSE_BENCH_SHAPES = {"q_proj/o_proj": (4096, 4096), "k_proj/v_proj": (1024, 4096), "up_proj": (21504, 4096),
                      "down_proj": (4096, 21504), "lm_head": (32064, 4096)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 2048, 16384])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", dest="json_out", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="candidate names to time (default: all)")
    args = ap.parse_args(argv)

    import torch

    from unified_models.ops.linear import triton as lin

    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    results = []
    torch.manual_seed(0)
    for name, (N, K) in DENSE_BENCH_SHAPES.items():
        w = (torch.randn(N, K, device="cuda") * K ** -0.5).bfloat16()
        out_dtype = torch.float32 if name == "lm_head" else torch.bfloat16
        for T in args.rows:
            x = torch.randn(T, K, device="cuda").bfloat16()
            ref = lin.linear_triton(x, w, out_dtype=out_dtype)
            row = {"shape": name, "N": N, "K": K, "T": T, "current": lin.gemm_config(N, K, T)._asdict(),
                   "cublas_ms": graph_time_ms(lambda: torch.mm(x, w.t()), args.iters), "configs": {}}
            for cname, cfg in CANDIDATES.items():
                if args.only and cname not in args.only:
                    continue
                gc = lin.GemmConfig(*cfg)
                try:
                    y = lin.linear_triton(x, w, out_dtype=out_dtype, config=gc)
                    ms = graph_time_ms(lambda gc=gc: lin.linear_triton(x, w, out_dtype=out_dtype, config=gc), args.iters)
                    row["configs"][cname] = {"ms": ms, "bitwise_equal_to_current": bool(torch.equal(y, ref))}
                except Exception as e:  # a config that does not compile is a result too
                    row["configs"][cname] = {"error": f"{type(e).__name__}: {e}"[:200]}
            best = min((c for c in row["configs"].items() if "ms" in c[1]), key=lambda c: c[1]["ms"])
            row["best"] = best[0]
            results.append(row)
            cells = " ".join(f"{c}={v['ms']:.3f}{'' if v.get('bitwise_equal_to_current') else '*'}"
                             for c, v in row["configs"].items() if "ms" in v)
            print(f"{name:14s} N={N:6d} K={K:6d} T={T:6d} cublas={row['cublas_ms']:.3f} ms | {cells} | best {best[0]}",
                  flush=True)
    return finish(results, args.json_out, "(* = bits differ from the current config's)")


if __name__ == "__main__":
    raise SystemExit(main())
