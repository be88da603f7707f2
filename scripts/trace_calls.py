"""Where a bench call's time goes: per-call times, and the kernels and gaps inside a call.

For each problem of a bench preset that `--words` match (`sustained.label_match`) and each backend,
the call the bench times (`Backend.make` on `runner.make_inputs`: for a training problem the
autograd call of `registry.autograd_call`) is warmed up, then:
1. timed `--calls` times back to back from Python, CUDA events around each call (eager, as the
   bench's training passes): median, min and max ms;
2. run `--profiled` times under torch.profiler: per call, the GPU time of each kernel name (summed
   over the calls, divided by their number), the number of kernel launches, and how much of the
   span from the first kernel's start to the last one's end no kernel ran (the GPU idle).

    source .gpu/activate.sh && python scripts/trace_calls.py --preset backward-features \\
        --words "varlen24 bwd" --backends hopper-fmha:auto fa4

`--set MODULE.NAME=VALUE` sets module attributes first (a switch's A/B: run it twice).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def kernel_spans(prof) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of every GPU kernel the profiler saw, by start."""
    spans = []
    for e in prof.events():
        if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0:
            spans.append((e.name, e.time_range.start, e.time_range.end))
    return sorted(spans, key=lambda s: s[1])


def idle_us(spans) -> float:
    """Time inside [first start, last end] covered by no span."""
    idle, reach = 0.0, spans[0][2]
    for _, start, end in spans[1:]:
        if start > reach:
            idle += start - reach
        reach = max(reach, end)
    return idle


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", required=True)
    ap.add_argument("--words", nargs="*", default=[], help="problem label words (sustained.label_match)")
    ap.add_argument("--backends", nargs="+", default=["hopper-fmha:auto", "fa4"])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--profiled", type=int, default=5)
    ap.add_argument("--top", type=int, default=12, help="kernel names listed per backend")
    ap.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="module attributes set first (Python literals), e.g. "
        "hopper_fmha.kernels.sm90_bwd.VARLEN_DQ_GATHER=True",
    )
    args = ap.parse_args(argv)
    import ast
    import importlib

    for item in args.set:
        target, _, value = item.partition("=")
        module, _, name = target.rpartition(".")
        setattr(importlib.import_module(module), name, ast.literal_eval(value))
        print(f"# {module}.{name} = {value}")

    import torch
    from sustained import label_match

    from hopper_fmha.bench.presets import PRESETS
    from hopper_fmha.bench.registry import BackendSkip, resolve_backends
    from hopper_fmha.bench.runner import make_inputs

    words, preset = args.words, PRESETS[args.preset]()
    problems = [p for p in preset.problems if not words or any(label_match(w, p.label()) for w in words)]
    backends = resolve_backends(args.backends)
    for p in problems:
        (inputs,) = make_inputs(p, 1, "cuda", seed=0)
        for b in backends:
            try:
                with b.context():
                    call = b.make(p, *inputs)
                    for _ in range(3):
                        call()
                    torch.cuda.synchronize()
                    times = []
                    for _ in range(args.calls):
                        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        e0.record()
                        call()
                        e1.record()
                        times.append((e0, e1))
                    torch.cuda.synchronize()
                    ms = [a.elapsed_time(z) for a, z in times]
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for _ in range(args.profiled):
                            call()
                        torch.cuda.synchronize()
            except BackendSkip as e:
                print(f"{p.label()} | {b.name}: skipped: {e.reason}")
                continue
            spans = kernel_spans(prof)
            n = args.profiled
            per_name = collections.Counter()
            for name, start, end in spans:
                per_name[name] += (end - start) / n
            busy = sum(per_name.values())
            print(
                f"{p.label()} | {b.name}: eager ms median {statistics.median(ms):.3f} min {min(ms):.3f} "
                f"max {max(ms):.3f}; profiled: {len(spans) / n:.0f} kernels/call, "
                f"GPU busy {busy / 1e3:.3f} ms/call, "
                f"idle {idle_us(spans) / n / 1e3:.3f} ms/call inside the span"
            )
            for name, us in per_name.most_common(args.top):
                print(f"    {us / 1e3:8.3f} ms  {name[:110]}")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
