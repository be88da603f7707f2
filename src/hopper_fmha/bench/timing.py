"""Timing: eager calls and CUDA-graph replays, CUDA events, interleaved rounds, medians.

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

Rounds: under sustained load a Hopper card's clock drifts down (power and temperature), and
whatever runs first after an idle gap gets the boost. So the samplers are prepared (warm-up,
sample sizing, graph capture) once per backend, the GPU is pre-heated with back-to-back fp16
matmuls, and then every backend gets one eager and one graph block per round, round-robin
(`round_schedule`): the first backend rotates and eager/graph swap places from round to round.
The first `settle_rounds` rounds are run the same way and thrown away: whatever runs right after
the matmul load runs slow (the clock is still at the matmul's power-capped level). The median is
taken over the samples of the timed rounds; the per-round medians show the drift.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

L2_FALLBACK_BYTES = 50 * 2**20  # H100 / H200
MODES = ("eager", "graph")


@dataclass(frozen=True)
class TimingSettings:
    warmup: int = 5
    iters: int = 30  # samples per mode in all, split over the rounds
    graph: bool = True
    min_sample_ms: float = 0.5
    max_calls_per_sample: int = 64
    max_sets: int = 32
    rounds: int = 3
    preheat_ms: float = 300.0  # sustained load before the first round of every problem
    # Untimed rounds between the pre-heat and the timed ones. In a paper run on the power-capped
    # H200 the block right after the matmul load ran 10-25% slow on every problem while the clock
    # climbed back (~20 ms); without this round that block is always the first backend's.
    settle_rounds: int = 1
    # Untimed GPU time at the start of every block: under a power cap the clock follows the
    # running kernel's draw with a lag of tens of ms, so short blocks are timed partly at the
    # clock the previous backend left. 0 keeps blocks short (the default). After a switch to a
    # kernel with a different draw per cycle the clock swings for longer (NOTES.md v14: at
    # N <= 1024, 300 ms left a 2.5-3% first-block effect, 1500 ms none).
    steady_ms: float = 0.0
    # Timed GPU time per block, at least: samples are added (per_round at a time) until the
    # block's samples cover it. Under a power cap the clock swings with a period near a second
    # (NOTES.md v15); a block's 12 samples are one window of about 15-80 ms of that swing, and
    # the same cell moved by up to 4.6% between two runs. 0: `per_round` samples only.
    block_ms: float = 0.0

    @classmethod
    def quick(cls) -> TimingSettings:
        return cls(
            warmup=1,
            iters=3,
            min_sample_ms=0.1,
            max_calls_per_sample=4,
            rounds=1,
            preheat_ms=50.0,
            settle_rounds=0,
        )

    @property
    def per_round(self) -> int:
        """Samples per mode and round: `iters` split over the rounds (rounded up)."""
        return math.ceil(self.iters / max(self.rounds, 1))


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
    set_bytes: int, l2_bytes: int, max_sets: int = 32, memory_budget: int | None = None, cost_per_set: int = 0
) -> int:
    """Input sets to rotate: enough that they total more than 2x L2, at least 2, capped. The
    memory budget is charged `cost_per_set` per set (the inputs, plus the outputs that captured
    graphs keep alive), `set_bytes` when not given."""
    n = max(2, math.ceil(2 * l2_bytes / max(set_bytes, 1)) + 1)
    if memory_budget is not None:
        n = min(n, max(2, memory_budget // max(cost_per_set or set_bytes, 1)))
    return min(n, max_sets)


# More samples than this (blocks timed to `block_ms`) are kept as deciles, not one by one: a
# sweep timed 1 s a block holds ~10^5 samples, megabytes of JSON.
MAX_RAW_SAMPLES = 256


def summarize(
    samples_ms: Sequence[float], calls_per_sample: int, rounds: Sequence[Sequence[float]] | None = None
) -> dict:
    """Median, min, max, the count and the raw samples (over MAX_RAW_SAMPLES of them: their
    deciles, `deciles_ms`, instead); with `rounds` (the samples of each round), the samples of
    all rounds and the median of each round."""
    if rounds is not None:
        samples_ms = [x for r in rounds for x in r]
    out = {
        "median_ms": statistics.median(samples_ms),
        "min_ms": min(samples_ms),
        "max_ms": max(samples_ms),
        "num_samples": len(samples_ms),
        "calls_per_sample": calls_per_sample,
    }
    if len(samples_ms) <= MAX_RAW_SAMPLES:
        out["samples_ms"] = list(samples_ms)
    else:
        out["deciles_ms"] = statistics.quantiles(samples_ms, n=10)
    if rounds is not None:
        out["rounds"] = len(rounds)
        out["samples_per_round"] = [len(r) for r in rounds]
        out["round_medians_ms"] = [statistics.median(r) for r in rounds]
    return out


def _calls_for(call_ms: float, s: TimingSettings) -> int:
    if call_ms <= 0:
        return s.max_calls_per_sample
    return max(1, min(s.max_calls_per_sample, math.ceil(s.min_sample_ms / call_ms)))


class EagerSampler:
    """Back-to-back eager calls rotating over `fns`. Construction warms up and sizes the samples
    from a pilot pass; `samples(n)` then times n samples (the rotation continues across calls)."""

    def __init__(self, fns: Sequence[Callable[[], object]], timer, s: TimingSettings):
        self.fns, self.timer = list(fns), timer
        n = len(self.fns)
        for i in range(max(s.warmup, 1)):
            self.fns[i % n]()
        timer.synchronize()
        a = timer.mark()
        for f in self.fns:
            f()
        b = timer.mark()
        timer.synchronize()
        self.calls = _calls_for(timer.elapsed_ms(a, b) / n, s)
        self._next = 0

    def samples(self, count: int) -> list[float]:
        fns, timer, n, calls = self.fns, self.timer, len(self.fns), self.calls
        marks = []
        c = self._next
        for _ in range(count):
            a = timer.mark()
            for _ in range(calls):
                fns[c % n]()
                c += 1
            marks.append((a, timer.mark()))
        self._next = c % n
        timer.synchronize()
        return [timer.elapsed_ms(a, b) / calls for a, b in marks]


def run_untimed(sampler, ms: float, batch: int = 8) -> float:
    """Run `sampler` untimed for at least `ms` of GPU time; returns the time spent (ms)."""
    spent = 0.0
    while spent < ms:
        step = sum(sampler.samples(batch)) * sampler.calls
        if step <= 0:  # a timer that reports nothing would never get there
            break
        spent += step
    return spent


def timed_samples(sampler, count: int, block_ms: float = 0.0) -> list[float]:
    """`count` samples of `sampler`, then more, `count` at a time, until they cover `block_ms` of
    GPU time (per-call ms times calls per sample)."""
    samples = sampler.samples(count)
    covered = sum(samples) * sampler.calls
    while block_ms > 0 and covered < block_ms:
        more = sampler.samples(count)
        if sum(more) <= 0:  # a timer that reports nothing would never get there
            break
        samples += more
        covered += sum(more) * sampler.calls
    return samples


def time_eager(fns: Sequence[Callable[[], object]], timer, s: TimingSettings) -> dict:
    """Warm up, size the samples from a pilot pass, then `s.iters` samples of back-to-back calls."""
    sampler = EagerSampler(fns, timer, s)
    return summarize(sampler.samples(s.iters), sampler.calls)


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


class GraphSampler:
    """One CUDA graph of one call per input set, captured once and replayed for every sample
    block until `close()` (which frees the graph and the outputs it keeps)."""

    def __init__(self, fns: Sequence[Callable[[], object]], timer, s: TimingSettings):
        self.timer, self.n = timer, len(fns)
        self.graph, self.outs = capture_graph(fns)
        try:
            for _ in range(max(s.warmup, 1)):
                self.graph.replay()
            timer.synchronize()
            a = timer.mark()
            self.graph.replay()
            b = timer.mark()
            timer.synchronize()
            # A replay holds n calls: size samples in replays, capped at max_calls_per_sample calls.
            self.replays = min(
                _calls_for(timer.elapsed_ms(a, b), s), math.ceil(s.max_calls_per_sample / self.n)
            )
        except BaseException:
            self.close()
            raise

    @property
    def calls(self) -> int:
        return self.replays * self.n

    def samples(self, count: int) -> list[float]:
        timer, graph = self.timer, self.graph
        marks = []
        for _ in range(count):
            a = timer.mark()
            for _ in range(self.replays):
                graph.replay()
            marks.append((a, timer.mark()))
        timer.synchronize()
        return [timer.elapsed_ms(a, b) / self.calls for a, b in marks]

    def close(self) -> None:
        self.graph = self.outs = None


def time_graph(fns: Sequence[Callable[[], object]], timer, s: TimingSettings) -> dict:
    """Capture, replay to warm up, then `s.iters` samples of back-to-back replays."""
    sampler = GraphSampler(fns, timer, s)
    try:
        return summarize(sampler.samples(s.iters), sampler.calls)
    finally:
        sampler.close()


def round_schedule(n: int, rounds: int) -> Iterator[list[tuple[int, str]]]:
    """Per round, the (backend index, mode) blocks in order: every backend once, each with its
    eager and graph blocks back to back; round r starts at backend r mod n, and eager goes first
    in even rounds, graph in odd ones."""
    for r in range(rounds):
        modes = MODES if r % 2 == 0 else MODES[::-1]
        yield [((r + k) % n, m) for k in range(n) for m in modes]


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


class MatmulLoad:
    """cuBLAS fp16 n^3 matmuls on fixed operands: the practical tensor-core roofline, and the
    sustained load that pre-heats the GPU before timing."""

    def __init__(self, device, n: int = 8192):
        import torch

        self.n = n
        self.a = torch.randn(n, n, device=device, dtype=torch.float16)
        self.b = torch.randn(n, n, device=device, dtype=torch.float16)
        self.c = torch.empty(n, n, device=device, dtype=torch.float16)
        self._matmul = torch.matmul

    def __call__(self):
        return self._matmul(self.a, self.b, out=self.c)

    def heat(self, timer, ms: float) -> None:
        """Keep the GPU busy for about `ms` of its time (sized from one timed call), then wait."""
        if ms <= 0:
            return
        timer.synchronize()
        a = timer.mark()
        self()
        b = timer.mark()
        timer.synchronize()
        one = max(timer.elapsed_ms(a, b), 1e-3)
        for _ in range(min(math.ceil(ms / one), 100_000)):
            self()
        timer.synchronize()


def measure_matmul(device, timer, s: TimingSettings, n: int = 8192, load: MatmulLoad | None = None) -> dict:
    """The matmul rate, timed like the attention: pre-heated, then `s.rounds` blocks of samples."""
    from hopper_fmha.bench.flops import matmul_flops, tflops

    load = load or MatmulLoad(device, n)
    sampler = EagerSampler([load], timer, s)
    load.heat(timer, s.preheat_ms)
    t = summarize([], sampler.calls, rounds=[sampler.samples(s.per_round) for _ in range(max(s.rounds, 1))])
    flops = matmul_flops(load.n, load.n, load.n)
    return {
        "shape": [load.n, load.n, load.n],
        "dtype": "float16",
        "flops": flops,
        "tflops": tflops(flops, t["median_ms"]),
        **t,
    }
