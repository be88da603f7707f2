"""The backward's time per kernel (torch.profiler, CUDA activity): ours' main kernel, its pre- and
postprocess and torch's own kernels (zeroing, sums, casts), plain and deterministic, so that time
spent outside the main kernel shows. GPU only; not a benchmark (`hopper-fmha bench` is).

    python scripts/bwd_breakdown.py --d 256 --heads 8 --causal
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from hopper_fmha import flash_attn_func


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--set", default=None, help="switches as one of bwd_profile's --ab settings")
    args = parser.parse_args()
    if args.set:
        from bwd_profile import parse_setting  # (this script's folder is on sys.path)

        for module, name, value in parse_setting(args.set):
            setattr(module, name, value)
    torch.manual_seed(0)
    shape = (args.batch, args.seqlen, args.heads, args.d)
    dtype = getattr(torch, args.dtype)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    for det in (False, True):
        out = flash_attn_func(q, k, v, causal=args.causal, deterministic=det)
        g = torch.randn_like(out)
        for _ in range(3):  # (compile and warm up)
            torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
            torch.cuda.synchronize()
        rows = [e for e in prof.key_averages() if e.device_time_total > 0]
        total = sum(e.device_time_total for e in rows) / args.iters
        print(f"deterministic={det}: {total:.1f} us of kernels per backward")
        for e in sorted(rows, key=lambda e: -e.device_time_total):
            per = e.device_time_total / args.iters
            print(f"  {per:9.1f} us  {e.count // args.iters:2d}x  {e.key[:100]}")


if __name__ == "__main__":
    main()
