"""The Mamba-2 mixer's backward: the written-out gradients (this code's path) against autograd of the
plain-torch recomputation (the path before session 34), in the same run.

For the scan (``ssd_chunk_scan``) and the conv (``causal_conv1d``) of one Mamba-2 layer over a trainer
batch (``--sequences`` x ``--seq-len`` tokens, every sequence from position 0, as THD packing gives the
trainer), each path's backward is timed (median of ``--repeats`` after a warm-up; CUDA: synchronized
wall time) and counted: ATen ops that write memory and the bytes they write (their outputs' sizes; views
excluded: a device-independent measure of the memory traffic an elementwise-bound backward is made of; a Triton
kernel's writes count as the sizes of the buffers it fills). The paths' gradients are compared (max relative
difference: both differentiate the same formula). On CUDA in a bf16 model the scan's written-out backward runs
its intra-chunk part fused (``ops/mamba2/ssd_intra_grads.py``); a third row, ``written_torch_intra``, times the
same backward with that part in torch ops (session 34's form).

    python benchmarks/mamba_backward.py [--device cuda] [--heads 64 --head-dim 64 --groups 8 --state 128]
        [--sequences 16 --seq-len 1024] [--json F]

Defaults are the Nano-30B widths (``nemotron_3_nano_reduced``: 64 heads x 64, 8 groups, state 128, chunk
128, conv width 4) over 16 x 1,024 tokens (the trainer-cost micro-batch); on the CPU use fewer
(``--heads 16 --sequences 2``). Default JSON: none (printed table only); ``scripts/gpu-run.sh
mamba-backward`` writes ``$OUT/mamba_backward.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def _counted(fn):
    """``(result, ops, bytes written)`` of ``fn()``: every ATen op dispatched that writes memory (views and
    other aliases of an input are neither ops nor bytes here) and its outputs' bytes."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        ops = 0
        bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                   if isinstance(t, torch.Tensor)}
            mutates = func._schema.is_mutable
            written = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                       and (mutates or t.untyped_storage().data_ptr() not in ins)]
            if written:
                Count.ops += 1
                Count.bytes += sum(t.numel() * t.element_size() for t in written)
            return out

    with Count():
        res = fn()
    return res, Count.ops, Count.bytes


def _time(fn, repeats: int, device: str) -> float:
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the model's dtype")
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--state", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--conv-width", type=int, default=4)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if min(args.heads, args.head_dim, args.groups, args.state, args.chunk, args.conv_width, args.sequences,
           args.seq_len, args.repeats) < 1 or args.heads % args.groups:
        ap.error("sizes must be >= 1 and --groups must divide --heads")

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device")
    from unified_models.ops import mamba2_metadata
    from unified_models.ops.grad.helpers import acc
    from unified_models.ops.mamba2 import ssd_backward
    from unified_models.ops.mamba2.backward import _Conv, _Recompute, _Ssd

    dev, dtype = args.device, getattr(torch, args.dtype)
    H, P, G, N, Q, W = args.heads, args.head_dim, args.groups, args.state, args.chunk, args.conv_width
    T = args.sequences * args.seq_len
    gen = torch.Generator().manual_seed(0)
    cu = torch.arange(args.sequences + 1) * args.seq_len
    meta = mamba2_metadata(cu.to(dev), torch.zeros(args.sequences, dtype=torch.long, device=dev), Q)
    CD = H * P + 2 * G * N

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev)

    ssd_in = [rnd(T, H, P).to(dtype), (torch.rand(T, H, generator=gen) * 0.3 + 0.01).to(dev),
              torch.log(torch.arange(1, H + 1, dtype=torch.float32)).to(dev), rnd(T, G, N, scale=0.5).to(dtype),
              rnd(T, G, N, scale=0.5).to(dtype), (1 + 0.1 * rnd(H)).float()]
    conv_in = [rnd(T, CD).to(dtype), rnd(CD, W, scale=0.4).to(dtype), rnd(CD, scale=0.1).to(dtype)]
    cases = [("ssd_chunk_scan", _Ssd(*ssd_in, meta, None, torch.float32), ssd_in, rnd(T, H, P)),
             ("causal_conv1d", _Conv(*conv_in, meta, None), conv_in, rnd(T, CD))]
    rows = []
    print(f"{'op':<16} {'path':<12} {'s':>9} {'ATen ops':>9} {'GB written':>11}")
    for name, spec, ins, g in cases:
        need = (True,) * len(ins)
        g = acc(g)

        def written():
            return spec.grads([acc(t).detach() for t in ins], need, g)

        def autograd():
            return _Recompute.grads(spec, [acc(t).detach() for t in ins], need, g)

        def written_torch_intra():  # session 34's form: the intra-chunk part in torch ops on every device
            real = ssd_backward.use_triton
            ssd_backward.use_triton = lambda x: False
            try:
                return written()
            finally:
                ssd_backward.use_triton = real

        row = {"op": name}
        outs = {}
        paths = [("written_out", written), ("autograd", autograd)]
        if name == "ssd_chunk_scan" and dev == "cuda" and dtype != torch.float32:
            paths.insert(1, ("written_torch_intra", written_torch_intra))
        for label, fn in paths:
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            outs[label], ops_n, nbytes = _counted(fn)
            row[label] = {"seconds": _time(fn, args.repeats, dev), "aten_ops": ops_n, "bytes_written": nbytes,
                          "peak_bytes": torch.cuda.max_memory_allocated() if dev == "cuda" else None}
            print(f"{name:<16} {label:<12} {row[label]['seconds']:9.4f} {ops_n:9d} {nbytes / 1e9:11.3f}")
        row["time_ratio_written_over_autograd"] = row["written_out"]["seconds"] / row["autograd"]["seconds"]
        if "written_torch_intra" in row:
            row["time_ratio_fused_over_torch_intra"] = (row["written_out"]["seconds"]
                                                        / row["written_torch_intra"]["seconds"])
            print(f"{name:<16} fused intra-chunk / torch intra-chunk time {row['time_ratio_fused_over_torch_intra']:.3f}")
        row["max_rel_diff"] = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                                  for a, b in zip(outs["written_out"], outs["autograd"]) if a is not None)
        print(f"{name:<16} written / autograd time {row['time_ratio_written_over_autograd']:.3f}, "
              f"max rel. gradient difference {row['max_rel_diff']:.2e}")
        rows.append(row)
    result = {"benchmark": "mamba_backward", "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "torch": torch.__version__, "threads": torch.get_num_threads(), "settings": vars(args), "rows": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
