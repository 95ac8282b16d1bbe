"""Shared pieces of the kernel benchmarks (``gemm_configs.py``, ``attention_decode.py``)."""

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


def finish(results: list, json_out: str | None, legend: str) -> int:
    """Print the legend of the ``*`` marks, write ``results`` as JSON to ``json_out`` (if
    given, creating its folder) and return the exit status 0."""
    print(legend)
    if json_out:
        Path(json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(json_out).write_text(json.dumps(results, indent=1))
    return 0
