"""Shared pieces of the kernel benchmarks (``gemm_configs.py``, ``attention_decode.py``, ``moe_kernels.py``,
``deepseek_experts.py``)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def graph_time_ms(fn, iters: int, replays: int = 5) -> float:
    """Median GPU time of one ``fn()`` in ms: ``iters`` calls captured in one CUDA graph
    (no host launch overhead, as in vLLM's captured decode steps), median of ``replays``
    replays. ``fn`` runs once on a side stream first (allocator, Triton compilation)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / iters)
    return statistics.median(times)


def forced_paths(module, thresholds: str | tuple[str, ...], fn, ref, iters: int) -> dict:
    """Time ``fn`` with the batch-size thresholds ``module.<name>`` (rows per expert above which a
    quantized expert stack is dequantized once per call; every name given, e.g. one per decode path)
    forced to each side: ``in_loop`` (never reached: tiles decoded in the GEMMs' K loop) and ``once``
    (always reached), each output compared bit for bit with ``ref`` (the default path's). Returns
    ``{"in_loop_ms", "in_loop_bitwise_equal_to_default", "once_ms", "once_bitwise_equal_to_default"}``;
    the thresholds are restored."""
    import torch

    names = (thresholds,) if isinstance(thresholds, str) else tuple(thresholds)
    out: dict = {}
    saved = {n: getattr(module, n) for n in names}
    try:
        for name, value in (("in_loop", 1 << 40), ("once", 0)):
            for n in names:
                setattr(module, n, value)
            got = fn()
            out[f"{name}_ms"] = graph_time_ms(fn, iters)
            out[f"{name}_bitwise_equal_to_default"] = bool(torch.equal(got, ref))
    finally:
        for n, v in saved.items():
            setattr(module, n, v)
    return out


def finish(results: list, json_out: str | None, legend: str) -> int:
    """Print the legend of the ``*`` marks, write ``results`` as JSON to ``json_out`` (if
    given, creating its folder) and return the exit status 0."""
    print(legend)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(results, indent=1))
    return 0
