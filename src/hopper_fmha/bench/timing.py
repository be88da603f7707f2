"""Timing: eager calls and CUDA-graph replays, CUDA events, medians over raw samples.

Eager: each sample is `calls` back-to-back calls from Python between two events, divided by
`calls`. Nothing synchronizes between samples, so a sample measures steady-state throughput:
the kernel time when the host keeps ahead of the GPU, the host time when it does not (short
problems, heavy Python paths). `calls` is chosen so a sample lasts at least `min_sample_ms`,
which keeps event resolution and launch jitter out of short kernels.

Graph: one CUDA graph captures one call per input set (so replays rotate inputs exactly as the
eager loop does); a sample is `replays` back-to-back replays divided by the calls they hold.
That is kernel time without host overhead.

Consecutive calls cycle over several input sets whose total size exceeds twice the L2 cache,
so no call finds its inputs left in L2 by the previous one.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

L2_FALLBACK_BYTES = 50 * 2**20  # H100 / H200


@dataclass(frozen=True)
class TimingSettings:
    warmup: int = 5
    iters: int = 30
    graph: bool = True
    min_sample_ms: float = 0.5
    max_calls_per_sample: int = 64
    max_sets: int = 32

    @classmethod
    def quick(cls) -> TimingSettings:
        return cls(warmup=1, iters=3, min_sample_ms=0.1, max_calls_per_sample=4)


class CudaTimer:
    """Marks are CUDA events recorded on the current stream."""

    def __init__(self):
        import torch

        self._torch = torch

    def mark(self):
        e = self._torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def elapsed_ms(self, a, b) -> float:
        return a.elapsed_time(b)

    def synchronize(self) -> None:
        self._torch.cuda.synchronize()


class CpuTimer:
    """Wall-clock marks, for runs (and tests) without a GPU."""

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed_ms(self, a: float, b: float) -> float:
        return (b - a) * 1e3

    def synchronize(self) -> None:
        pass


def num_input_sets(
    set_bytes: int, l2_bytes: int, max_sets: int = 32, memory_budget: int | None = None
) -> int:
    """Input sets to rotate: enough that they total more than 2x L2, at least 2, capped."""
    n = max(2, math.ceil(2 * l2_bytes / max(set_bytes, 1)) + 1)
    if memory_budget is not None:
        n = min(n, max(2, memory_budget // max(set_bytes, 1)))
    return min(n, max_sets)


def summarize(samples_ms: Sequence[float], calls_per_sample: int) -> dict:
    return {
        "median_ms": statistics.median(samples_ms),
        "min_ms": min(samples_ms),
        "max_ms": max(samples_ms),
        "samples_ms": list(samples_ms),
        "calls_per_sample": calls_per_sample,
    }


def _calls_for(call_ms: float, s: TimingSettings) -> int:
    if call_ms <= 0:
        return s.max_calls_per_sample
    return max(1, min(s.max_calls_per_sample, math.ceil(s.min_sample_ms / call_ms)))


def time_eager(fns: Sequence[Callable[[], object]], timer, s: TimingSettings) -> dict:
    """Warm up, size the samples from a pilot pass, then `s.iters` samples of back-to-back calls."""
    n = len(fns)
    for i in range(max(s.warmup, 1)):
        fns[i % n]()
    timer.synchronize()
    a = timer.mark()
    for f in fns:
        f()
    b = timer.mark()
    timer.synchronize()
    calls = _calls_for(timer.elapsed_ms(a, b) / n, s)
    marks = []
    c = 0
    for _ in range(s.iters):
        a = timer.mark()
        for _ in range(calls):
            fns[c % n]()
            c += 1
        marks.append((a, timer.mark()))
    timer.synchronize()
    return summarize([timer.elapsed_ms(a, b) / calls for a, b in marks], calls)


def capture_graph(fns: Sequence[Callable[[], object]]):
    """A CUDA graph holding one call of each callable (warmed up on a side stream first)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [f() for f in fns]
    return graph, outs


def time_graph(fns: Sequence[Callable[[], object]], timer, s: TimingSettings) -> dict:
    """Capture, replay to warm up, then `s.iters` samples of back-to-back replays."""
    graph, outs = capture_graph(fns)
    try:
        n = len(fns)
        for _ in range(max(s.warmup, 1)):
            graph.replay()
        timer.synchronize()
        a = timer.mark()
        graph.replay()
        b = timer.mark()
        timer.synchronize()
        # A replay holds n calls: size samples in replays, capped at max_calls_per_sample calls.
        replays = min(_calls_for(timer.elapsed_ms(a, b), s), math.ceil(s.max_calls_per_sample / n))
        marks = []
        for _ in range(s.iters):
            a = timer.mark()
            for _ in range(replays):
                graph.replay()
            marks.append((a, timer.mark()))
        timer.synchronize()
        return summarize([timer.elapsed_ms(a, b) / (replays * n) for a, b in marks], replays * n)
    finally:
        del graph, outs


def time_first_call(fn: Callable[[], object], timer) -> float:
    """Wall seconds of one call until its work is done (compile or cache load included)."""
    timer.synchronize()
    t0 = time.perf_counter()
    fn()
    timer.synchronize()
    return time.perf_counter() - t0


def launch_us(fns: Sequence[Callable[[], object]], timer, calls: int = 10) -> float:
    """Host microseconds per call: wall time to issue `calls` calls right after a sync, while
    the launch queue is short, so the host never waits on the GPU."""
    timer.synchronize()
    t0 = time.perf_counter()
    for i in range(calls):
        fns[i % len(fns)]()
    t1 = time.perf_counter()
    timer.synchronize()
    return (t1 - t0) / calls * 1e6


def measure_matmul(device, timer, s: TimingSettings, n: int = 8192) -> dict:
    """cuBLAS fp16 n^3 matmul (the practical tensor-core roofline), timed like the attention."""
    import torch

    from hopper_fmha.bench.flops import matmul_flops, tflops

    a = torch.randn(n, n, device=device, dtype=torch.float16)
    b = torch.randn(n, n, device=device, dtype=torch.float16)
    c = torch.empty(n, n, device=device, dtype=torch.float16)
    t = time_eager([lambda: torch.matmul(a, b, out=c)], timer, s)
    flops = matmul_flops(n, n, n)
    return {
        "shape": [n, n, n],
        "dtype": "float16",
        "flops": flops,
        "tflops": tflops(flops, t["median_ms"]),
        **t,
    }
