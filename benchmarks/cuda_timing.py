"""GPU time of one call, measured from CUDA-graph replays (shared by the kernel benchmarks)."""

from __future__ import annotations

import statistics


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
