"""A/B of the 64-row decode tile (`kernels.DECODE_TILE_M`) where it is not on by default yet: KV-cache
calls with a window or softcap (`kernels.DECODE_TILE_FEATURES`) and at (192, 128)
(`kernels.DECODE_TILE_DIMS`). A probe for a switch, not a claim: claims come from `hopper-fmha
bench`.

Per case (bf16, batch 64, 8192 cached tokens, 32 q heads / 8 kv heads, one query token), one CUDA
graph of 8 calls (two cache sets, 2 GiB each at d128, rotating) per setting, both settings'
graphs replayed in turns for `--rounds` rounds of `--reps` replays each; the median ms per call
of each setting, and the outputs of the two compared (the same kernel arithmetic per row, so
equal to the bf16 rounding).

    source .gpu/activate.sh && python scripts/decode_tile_ab.py
"""

from __future__ import annotations

import argparse
import statistics

import torch

import hopper_fmha
from hopper_fmha import kernels

CASES = {
    "softcap 30": dict(softcap=30.0),
    "window 4096/0": dict(window_size=(4096, 0)),
    "d192/dv128": dict(d=192, dv=128),
    "d192/dv128 softcap 30": dict(d=192, dv=128, softcap=30.0),
}


def setting(on: bool, dims: tuple) -> None:
    kernels.DECODE_TILE_FEATURES = on
    kernels.DECODE_TILE_DIMS = (*dims, (192, 128)) if on else dims


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    args = ap.parse_args()
    base_dims = tuple(d for d in kernels.DECODE_TILE_DIMS if d != (192, 128))
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.cases:
        opts = dict(CASES[name])
        d, dv = opts.pop("d", 128), opts.pop("dv", 128)
        sets = []
        for _ in range(2):
            q = torch.randn(64, 1, 32, d, device="cuda", dtype=torch.bfloat16, generator=g)
            kc = torch.randn(64, 8192, 8, d, device="cuda", dtype=torch.bfloat16, generator=g)
            vc = torch.randn(64, 8192, 8, dv, device="cuda", dtype=torch.bfloat16, generator=g)
            sets.append((q, kc, vc))
        graphs, outs = {}, {}
        for on in (False, True):
            setting(on, base_dims)
            for s in sets:  # compile and warm up outside the capture
                hopper_fmha.flash_attn_with_kvcache(*s, **opts)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                results = [hopper_fmha.flash_attn_with_kvcache(*sets[i % 2], **opts) for i in range(8)]
            graphs[on], outs[on] = graph, results[0]
        setting(False, base_dims)
        times = {False: [], True: []}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for r in range(args.rounds):
            for on in (False, True) if r % 2 == 0 else (True, False):
                graphs[on].replay()  # untimed: the clock settles on this kernel
                start.record()
                for _ in range(args.reps):
                    graphs[on].replay()
                end.record()
                end.synchronize()
                times[on].append(start.elapsed_time(end) / (8 * args.reps))
        graphs[False].replay()
        graphs[True].replay()
        torch.cuda.synchronize()
        diff = (outs[False].float() - outs[True].float()).abs().max().item()
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(
            f"{name:24s} table's tile {off:.4f} ms   64 rows {on:.4f} ms   ratio {on / off:.4f}   "
            f"max |out diff| {diff:.2e}"
        )
        del sets, graphs, outs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
