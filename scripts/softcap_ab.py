"""What softcap costs the forward, and what its fixed reference (`kernels/softmax.py`,
SOFTCAP_FIXED_MAX) buys: one kernel timed with softcap off, at cap 30 (the fixed reference: cap
* log2 e <= SOFTCAP_FIXED_SPAN) and at cap 60 (past the span: the same compiled kernel takes the
running row max, a uniform branch on the runtime cap). A probe, not a claim: claims come from
`hopper-fmha bench --preset features`.

Per problem (B4 N4096 H16 d128 bf16 by default, the features preset's softcap problem; causal off
and on), one CUDA graph of `--calls` calls over two input sets per setting, the graphs replayed in
turns (first setting rotating) for `--rounds` rounds of `--reps` replays; the median ms per call
and TFLOP/s of each, and each softcap setting's time over the plain one.

    source .gpu/activate.sh && python scripts/softcap_ab.py
"""

from __future__ import annotations

import argparse
import statistics

import torch

import hopper_fmha

SETTINGS = {"plain": 0.0, "cap 30 (fixed)": 30.0, "cap 60 (running max)": 60.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--headdim", type=int, nargs="+", default=[128])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    for d in args.headdim:
        for causal in (False, True):
            shape = (args.batch, args.seqlen, args.heads, d)
            sets = [
                [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]
                for _ in range(2)
            ]
            graphs = {}
            for name, cap in SETTINGS.items():
                for q, k, v in sets:  # compile and warm up outside the capture
                    hopper_fmha.flash_attn_func(q, k, v, causal=causal, softcap=cap)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for i in range(args.calls):
                        q, k, v = sets[i % 2]
                        hopper_fmha.flash_attn_func(q, k, v, causal=causal, softcap=cap)
                graphs[name] = graph
            times = {name: [] for name in SETTINGS}
            names = list(SETTINGS)
            for r in range(args.rounds):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(args.reps):
                        graphs[name].replay()
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end) / (args.reps * args.calls))
            flops = 4 * args.batch * args.heads * args.seqlen**2 * d / (2 if causal else 1)
            plain = statistics.median(times["plain"])
            for name in names:
                ms = statistics.median(times[name])
                print(
                    f"B{args.batch} N{args.seqlen} H{args.heads} d{d} bf16{' causal' if causal else ''}  "
                    f"{name:22s} {ms:.4f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  x{ms / plain:.3f} of plain  "
                    f"(rounds {min(times[name]):.4f}-{max(times[name]):.4f})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
