"""One Mamba-2 layer's prefill, ours vs vLLM's native, and launch candidates of our SSD kernels.

Not a test: a measurement for issue 18 (the prefill-bound workload 128 x 2048/128). For the Mamba-2
widths of a preset (default ``nemotron_3_nano_reduced``: 64 heads x 64, 8 groups, state 128, conv 4,
chunk 128) and each prefill batch ``SxL`` (S fresh sequences of L tokens each in one THD batch; default
``8x2048``, one 16,384-token step of that workload, and ``64x256``), it times, from random inputs in the
model dtype (no checkpoint):

* ours, what ``layers/mamba2.py::mamba2_forward`` runs between in_proj and the gated norm on a prefill
  step: ``conv`` = ``ops.causal_conv1d``, ``ssm`` = ``ops.mamba2_dt`` + ``ops.ssd_chunk_scan`` (chunk
  cumulative decay, chunk states, scan, the slots' state commit) over the general metadata
  (``ops.mamba2_metadata``, built once per forward on the host and not timed);
* native (vLLM's mixer2 prefill branch): ``causal_conv1d_fn`` (``conv``) and
  ``mamba_chunk_scan_combined_varlen`` with ``dt_softplus`` (``ssm``) on the same inputs.

Candidates: ``--scan-candidates BL:WARPS:STAGES`` (``ops/mamba2/triton.SCAN_LAUNCH``, the scan's row
block and launch) and ``--state-candidates BP:WARPS:STAGES`` (``STATE_LAUNCH``, the chunk-state
kernel's head-dim block and launch) each rerun ours; every run's scan output, chunk states and
committed slot states are compared bit for bit with the current launch's (a candidate may only
replace the current launch if they are equal at every batch).

Times are medians of CUDA-event timings of ``--iters`` back-to-back calls (the prefill steps of our
engine run eagerly; launch overhead overlaps as there). CPU: a smoke run through the Triton
interpreter at tiny widths, native skipped (vLLM's CPU build has no Triton). Default JSON
``benchmarks/results/mamba_prefill_{h200,cpu}.json``.

    python benchmarks/mamba_prefill.py --scan-candidates 64:4:2 32:4:2 --state-candidates 32:4:2
    python benchmarks/mamba_prefill.py --preset nemotron_h_hybrid_tiny --batches 2x40 --iters 1   # CPU
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from decode_chunk_position import preset_mamba_spec  # noqa: E402
from kernel_bench import finish  # noqa: E402


def parse_batch(text: str) -> tuple[int, int]:
    """``"SxL"`` -> ``(S, L)`` (positive ints).

    Raises:
        ValueError: not two positive integers joined by ``x``.
    """
    try:
        s, l_ = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"batch {text!r} is not SxL (sequences x tokens, e.g. 8x2048)") from None
    if s < 1 or l_ < 1:
        raise ValueError(f"batch {text!r}: sequences and tokens must be >= 1")
    return s, l_


def parse_launch(text: str, first: str) -> dict:
    """``"A:WARPS:STAGES"`` -> ``{first: A, "num_warps": .., "num_stages": ..}``.

    Raises:
        ValueError: not three integers, ``A`` not a power of two, warps not in 1/2/4/8/16, stages < 1.
    """
    try:
        a, warps, stages = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"launch {text!r} is not {first.upper()}:WARPS:STAGES (three integers)") from None
    if a < 1 or a & (a - 1) or warps not in (1, 2, 4, 8, 16) or stages < 1:
        raise ValueError(f"launch {text!r}: {first} must be a power of two, warps 1/2/4/8/16, stages >= 1")
    return {first: a, "num_warps": warps, "num_stages": stages}


def time_ms(fn, iters: int, cuda: bool, reps: int = 3) -> float:
    """Median over ``reps`` of the mean ms of ``iters`` back-to-back calls (CUDA events on the GPU,
    wall clock on the CPU), after one warm-up call."""
    import torch

    fn()
    out = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b) / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t) * 1e3 / iters)
    return statistics.median(out)


def _native_ops():
    """vLLM's prefill kernels, or the reason they cannot run here."""
    try:
        from vllm.triton_utils import HAS_TRITON

        if not HAS_TRITON:
            return None, "vLLM disabled Triton on this host (vllm.triton_utils.HAS_TRITON is False)"
        from vllm.model_executor.layers.mamba.ops.causal_conv1d import causal_conv1d_fn
        from vllm.model_executor.layers.mamba.ops.ssd_combined import mamba_chunk_scan_combined_varlen
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"[:300]
    return (causal_conv1d_fn, mamba_chunk_scan_combined_varlen), None


class Inputs:
    """Random prefill inputs of one ``SxL`` batch at the spec's widths (one generator seed)."""

    def __init__(self, spec, S: int, L: int, dtype, dev: str, seed: int = 0):
        import torch

        from unified_models import ops

        H, P, G, N, Q, W = (spec.num_heads, spec.head_dim, spec.n_groups, spec.ssm_state_size, spec.chunk_size,
                            spec.conv_kernel)
        self.H, self.P, self.G, self.N, self.Q, self.W = H, P, G, N, Q, W
        self.C = H * P + 2 * G * N
        self.S, self.L, self.T = S, L, S * L
        self.dtype, self.dev = dtype, dev
        gen = torch.Generator(device=dev).manual_seed(seed)

        def rn(*shape, scale=1.0, dt_=dtype):
            return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dt_)

        lo, hi = math.log(1e-3), math.log(0.1)  # dt_bias as mamba_ssm initialises it
        dt0 = torch.exp(torch.rand(H, generator=gen, device=dev) * (hi - lo) + lo)
        self.conv_w, self.conv_b = rn(self.C, W, scale=0.4), rn(self.C, scale=0.1)
        self.dt_bias = (dt0 + torch.log(-torch.expm1(-dt0))).to(dtype)
        self.A_log = torch.log(torch.arange(1, H + 1, dtype=torch.float32, device=dev)).to(dtype)
        self.D = (1.0 + 0.1 * torch.randn(H, generator=gen, device=dev)).to(dtype)
        self.xin = rn(self.T, self.C)
        self.dt_raw = rn(self.T, H, scale=0.5)
        # slot 0 is vLLM's null block: never a live sequence's slot
        self.slots = (1 + torch.randperm(S, generator=gen, device=dev)).to(torch.int32)
        self.cu = torch.arange(S + 1, device=dev, dtype=torch.int32) * L
        self.meta = ops.mamba2_metadata(self.cu, torch.zeros(S, dtype=torch.int64, device=dev), Q,
                                        num_tokens=self.T, state_idx_B=self.slots)

    def fresh_state(self):
        from unified_models.ops import Mamba2State

        return Mamba2State.allocate(self.S + 1, num_heads=self.H, head_dim=self.P, n_groups=self.G,
                                    state_size=self.N, conv_width=self.W, chunk_size=self.Q, dtype=self.dtype,
                                    device=self.dev, fill=0.0)


def ours(inp: Inputs, st):
    """``(xBC, dt, y)`` of our conv + SSD on a prefill batch (``st`` updated in place)."""
    import torch

    from unified_models import ops

    H, P, G, N, T = inp.H, inp.P, inp.G, inp.N, inp.T
    xbc = ops.causal_conv1d(inp.xin, inp.conv_w, inp.conv_b, inp.meta, st)
    x, Bm, Cm = xbc.split([H * P, G * N, G * N], dim=-1)
    dt = ops.mamba2_dt(inp.dt_raw, inp.dt_bias, (0.0, math.inf))
    y = ops.ssd_chunk_scan(x.reshape(T, H, P), dt, inp.A_log, Bm.reshape(T, G, N), Cm.reshape(T, G, N), inp.D,
                           inp.meta, st, out_dtype=torch.float32)
    return xbc, dt, y


def measure_ours(inp: Inputs, iters: int, cuda: bool) -> tuple[dict, dict]:
    """Times of our conv / ssm / whole step, and the result tensors the bit comparisons use."""
    import torch

    from unified_models import ops

    H, P, G, N, T = inp.H, inp.P, inp.G, inp.N, inp.T
    with torch.inference_mode():
        st = inp.fresh_state()
        xbc, dt, y = ours(inp, st)
        result = {"y": y.clone(), "ssm": st.ssm.clone(), "x": st.x.clone(), "dt": st.dt.clone(), "B": st.B.clone(),
                  "conv": st.conv.clone()}
        x, Bm, Cm = xbc.split([H * P, G * N, G * N], dim=-1)
        args = (x.reshape(T, H, P), dt, inp.A_log, Bm.reshape(T, G, N), Cm.reshape(T, G, N), inp.D, inp.meta)
        times = {"ours_conv_ms": time_ms(lambda: ops.causal_conv1d(inp.xin, inp.conv_w, inp.conv_b, inp.meta, st),
                                         iters, cuda),
                 "ours_ssm_ms": time_ms(lambda: (ops.mamba2_dt(inp.dt_raw, inp.dt_bias, (0.0, math.inf)),
                                                 ops.ssd_chunk_scan(*args, st, out_dtype=torch.float32)), iters, cuda),
                 "ours_step_ms": time_ms(lambda: ours(inp, st), iters, cuda)}
    return times, result


def measure_native(inp: Inputs, nat, iters: int) -> dict:
    """Times of vLLM's ``causal_conv1d_fn`` / ``mamba_chunk_scan_combined_varlen`` on the same batch."""
    import torch

    conv_fn, ssd_fn = nat
    H, P, G, N, Q, T, S, L = inp.H, inp.P, inp.G, inp.N, inp.Q, inp.T, inp.S, inp.L
    dev = inp.dev
    per_seq = math.ceil(L / Q)
    starts = [s * L + min(c * Q, L) for s in range(S) for c in range(per_seq)]
    cu_chunk = torch.tensor(starts + [T], device=dev, dtype=torch.int32)
    seq_idx = torch.arange(S, device=dev, dtype=torch.int32).repeat_interleave(per_seq)
    last_chunk = (torch.arange(1, S + 1, device=dev, dtype=torch.int32) * per_seq - 1)
    conv_states = torch.zeros(S + 1, inp.C, inp.W - 1, dtype=inp.dtype, device=dev)  # vLLM's [S, C, W-1] view
    has_init = torch.zeros(S, dtype=torch.bool, device=dev)
    A = -torch.exp(inp.A_log.float())
    out = torch.empty(T, H, P, dtype=inp.dtype, device=dev)
    with torch.inference_mode():
        def conv():
            return conv_fn(inp.xin.transpose(0, 1), inp.conv_w, inp.conv_b, conv_states=conv_states,
                           query_start_loc=inp.cu, cache_indices=inp.slots, has_initial_state=has_init,
                           activation="silu").transpose(0, 1)

        def ssm(xbc):
            x, Bm, Cm = xbc.split([H * P, G * N, G * N], dim=-1)
            return ssd_fn(x.reshape(T, H, P), inp.dt_raw, A, Bm.reshape(T, G, N), Cm.reshape(T, G, N), Q,
                          cu_seqlens=inp.cu, cu_chunk_seqlens=cu_chunk, last_chunk_indices=last_chunk,
                          seq_idx=seq_idx, out=out, D=inp.D, dt_bias=inp.dt_bias, dt_softplus=True,
                          state_dtype=torch.float32)

        xbc = conv().contiguous()
        return {"native_conv_ms": time_ms(conv, iters, True),
                "native_ssm_ms": time_ms(lambda: ssm(xbc), iters, True),
                "native_step_ms": time_ms(lambda: ssm(conv()), iters, True)}


def _same(a: dict, b: dict) -> dict:
    import torch

    return {k: bool(a[k].shape == b[k].shape and torch.equal(a[k], b[k])) for k in a}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from unified_models.presets import preset_name
    ap.add_argument("--preset", type=preset_name, default="nemotron_3_nano_reduced",
                   help="widths of its first Mamba-2 layer")
    ap.add_argument("--batches", nargs="+", default=["8x2048", "64x256"], metavar="SxL",
                    help="prefill batches: S fresh sequences of L tokens")
    ap.add_argument("--iters", type=int, default=10, help="back-to-back calls per timing")
    ap.add_argument("--no-native", action="store_true", help="skip vLLM's kernels")
    ap.add_argument("--scan-candidates", nargs="+", default=[], metavar="BL:WARPS:STAGES",
                    help="scan launches (ops/mamba2/triton.SCAN_LAUNCH) to time and compare with the current one")
    ap.add_argument("--state-candidates", nargs="+", default=[], metavar="BP:WARPS:STAGES",
                    help="chunk-state launches (ops/mamba2/triton.STATE_LAUNCH) to time and compare")
    ap.add_argument("--json", dest="json_out", default=None,
                    help="default benchmarks/results/mamba_prefill_{h200,cpu}.json")
    args = ap.parse_args(argv)
    try:
        batches = [parse_batch(b) for b in args.batches]
        cands = ([("scan", parse_launch(c, "block_l")) for c in args.scan_candidates]
                 + [("state", parse_launch(c, "block_p")) for c in args.state_candidates])
    except ValueError as e:
        ap.error(str(e))
    if args.iters < 1:
        ap.error("--iters must be >= 1")

    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined (first import)
        os.environ.setdefault("UM_OPS_BACKEND", "triton")
    from unified_models.ops.mamba2 import triton as mt

    model, spec = preset_mamba_spec(args.preset)
    dev = "cuda" if cuda else "cpu"
    dtype = model.dtype
    nat, why = ((None, "--no-native") if args.no_native else (None, "no CUDA device") if not cuda
                else _native_ops())
    if why:
        print(f"native baseline unavailable: {why}", flush=True)
    launches = {"scan": mt.SCAN_LAUNCH, "state": mt.STATE_LAUNCH}
    current = {k: dict(v) for k, v in launches.items()}
    rows = []
    for S, L in batches:
        inp = Inputs(spec, S, L, dtype, dev)
        base_t, base = measure_ours(inp, args.iters, cuda)
        row = {"device": torch.cuda.get_device_name() if cuda else "cpu", "preset": args.preset,
               "H": inp.H, "P": inp.P, "G": inp.G, "N": inp.N, "Q": inp.Q, "W": inp.W,
               "dtype": str(dtype).split(".")[-1], "batch": f"{S}x{L}", "tokens": inp.T,
               "launch": {k: dict(v) for k, v in current.items()}, **base_t}
        if nat is not None:
            row.update(measure_native(inp, nat, args.iters))
            for part in ("conv", "ssm", "step"):
                row[f"ours_over_native_{part}"] = row[f"ours_{part}_ms"] / row[f"native_{part}_ms"]
        elif why:
            row["native_unavailable"] = why
        print(f"{S}x{L} ({inp.T} tokens): ours conv {row['ours_conv_ms']:.3f} ssm {row['ours_ssm_ms']:.3f} step "
              f"{row['ours_step_ms']:.3f} ms" + (f" | native conv {row['native_conv_ms']:.3f} ssm "
                                                 f"{row['native_ssm_ms']:.3f} step {row['native_step_ms']:.3f} ms | "
                                                 f"ours/native ssm {row['ours_over_native_ssm']:.2f} step "
                                                 f"{row['ours_over_native_step']:.2f}" if nat else ""), flush=True)
        row["candidates"] = []
        for kind, cand in cands:
            try:
                launches[kind].update(cand)
                t, res = measure_ours(inp, args.iters, cuda)
            except Exception as e:  # e.g. out of shared memory: a finding, not a failed run
                row["candidates"].append({"kind": kind, "launch": cand, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"  {kind} {cand}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            finally:
                launches[kind].clear()
                launches[kind].update(current[kind])
            same = _same(base, res)
            row["candidates"].append({"kind": kind, "launch": cand, **t, "bitwise_equal_to_current": same,
                                      "all_equal": all(same.values())})
            print(f"  {kind} {cand}: ssm {t['ours_ssm_ms']:.3f} ms (current {row['ours_ssm_ms']:.3f}) "
                  f"bits {'same' if all(same.values()) else 'DIFFERENT ' + str([k for k, v in same.items() if not v])}",
                  flush=True)
        rows.append(row)
        del inp
    json_out = args.json_out or str(HERE / "results" / f"mamba_prefill_{'h200' if cuda else 'cpu'}.json")
    finish(rows, json_out, "(ms per prefill step of one Mamba-2 layer; candidates' bits vs the current launch)")
    print(f"wrote {json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
