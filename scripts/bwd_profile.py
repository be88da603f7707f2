"""Where the backward's time goes, on the GPU: every kernel of one `sm90_bwd.backward` call (torch
profiler), the main kernel alone per version (CUDA events, median), and probes that remove one
part of v2 to price it (`nodq`: dQ's reduce-add into dQacc, its staging in smem kept). `--ncu`
runs one call only, for `ncu --kernel-name regex:BwdWsSm90`.

    python scripts/bwd_profile.py --d 128 --heads 16 [--causal] [--deterministic] [--probes nodq]
    python scripts/bwd_profile.py --d 64 --heads 32 --versions 2 --tile-m 64 128  # d64's query tile
    python scripts/bwd_profile.py --d 128 --heads 16 --versions 2 --tile-m 64 80  # d128's
    python scripts/bwd_profile.py --d 128 --heads 16 --versions 2 --tile-m 64 80 --dkv-tma  # dK, dV stores
    python scripts/bwd_profile.py --d 256 --heads 8 --versions 2 --wide  # the wide kernel (past 128)
    python scripts/bwd_profile.py --d 192 --dv 128 --heads 16 --versions 2 --wide  # DeepSeek's shape
    python scripts/bwd_profile.py --d 64 --heads 32 --ab dq-at-cast=off dq-at-cast=on --rounds 8

`--ab` times settings of the switches below against each other in one process: each setting's
kernels built into their own `sm90_bwd._compiled`, then timed in rounds whose order rotates, so
that the clock's drift under the power cap falls on all of them alike (separate processes, one
after another, differed by up to 6% for the same kernel: v30's `exp_after_mask.txt`).
"""

from __future__ import annotations

import argparse
import statistics

import cutlass
import cutlass.cute as cute
import torch

from hopper_fmha import flash_attn_func, flash_attn_varlen_func
from hopper_fmha.cli import _time_ms
from hopper_fmha.kernels import sm90_bwd, sm90_bwd_wide, sm90_bwd_ws


@cute.jit
def _no_dq(
    self, sdQ, tma_atom_dQ, mdQacc, m_block, head, batch, seqlen, wg, store: cutlass.Constexpr = False
):
    pass


# v2's method replaced by a no-op: the adds of dQ into dQacc, whichever warp issues them (v20's
# "noatomic", which replaced the since removed per-thread atomics, measured 3.10 -> 2.22 ms at
# d128). The probe's kernel has a name of its own in the disk cache (`cache.build_name` hashes
# where each method comes from), so it is never loaded for the real one, nor saved as it.
PROBES = {"nodq": ("reduce_dq", _no_dq)}


# The switches a run may set: on/off ones, then those naming a place (flag, module, name, [choices,] what).
ON_OFF = (
    ("--dq-at-cast", sm90_bwd, "DQ_SCALE_AT_CAST", "dQ's softmax scale applied as the host casts dQacc"),
    ("--dq-fragments", sm90_bwd, "DQ_FRAGMENTS", "dQ staged and added in fragment order"),
    ("--dq-writer", sm90_bwd, "DQ_WRITER_WARP", "deterministic: turns and dQ adds by a warp of their own"),
    ("--dq-writer-plain", sm90_bwd, "DQ_WRITER_PLAIN", "not deterministic: dQ adds by the writer warp"),
    ("--dq-writer-plain-wide", sm90_bwd, "DQ_WRITER_PLAIN_WIDE", "the same in the wide kernel"),
    ("--dq-fragments-wide", sm90_bwd, "DQ_FRAGMENTS_WIDE", "dQ in fragment order in the wide kernel"),
    ("--wide-rotate", sm90_bwd, "WIDE_ROTATE", "deterministic: the wide kernel's rotated walk"),
    ("--dq-store-first", sm90_bwd_ws, "DQ_STORE_FIRST", "deterministic: first turns store, dQacc unzeroed"),
    ("--dq-unfragment", sm90_bwd, "DQ_UNFRAGMENT_KERNEL", "fragment-ordered dQ put in order by a kernel"),
    ("--dq-laps", sm90_bwd_ws, "DQ_LAPS", "deterministic: the rotated walk's chains as laps"),
    ("--varlen-dq-fragments", sm90_bwd, "VARLEN_DQ_FRAGMENTS", "the varlen backward's dQ in fragment order"),
    ("--dq-chains-masked", sm90_bwd, "DQ_CHAINS_MASKED", "deterministic: chains with causal or a window"),
    ("--dq-store-first-masked", sm90_bwd_ws, "DQ_STORE_FIRST_MASKED", "deterministic: first stores, masked"),
    ("--plain-rotate", sm90_bwd, "PLAIN_ROTATE", "not deterministic: the rotated walk (no causal or window)"),
    ("--copies-in-unfragment", sm90_bwd, "DQ_COPIES_IN_UNFRAGMENT", "deterministic: the kernel sums chains"),
    ("--zero-by-block", sm90_bwd, "DQ_ZERO_BY_BLOCK", "deterministic: zero only blocks without a turn"),
)
PLACES = (
    ("--lse-load", sm90_bwd_ws, "LSE_LOAD", ("before_s", "after_s", "after_dp"), "where d128 reads the LSE"),
    ("--lpt-heads", sm90_bwd_ws, "LPT_HEADS", ("0", "2", "4", "8", "16"), "causal: longest CTAs first"),
    (
        "--exp-early",
        sm90_bwd_ws,
        "EXP_EARLY",
        tuple(sm90_bwd_ws.EXP_EARLY_SHARES),
        "the share of P's exponentials before the wait for dP^T",
    ),
    (
        "--multicast",
        sm90_bwd,
        "QDO_MULTICAST",
        {"off": frozenset(), "on": frozenset(sm90_bwd.HEAD_DIMS + (256,))},
        "CTA pairs sharing Q and dO loads (plain dense walk), at every kernel head dim or none",
    ),
    (
        "--wide-d256",
        sm90_bwd_wide,
        "SHAPES",
        {
            "64kvq": sm90_bwd_wide.SHAPES,
            "48": sm90_bwd_wide.SHAPES_D256_48,
        },
        "the wide d256 kernel's shape (64kvq: the default; 48: until v41)",
    ),
    (
        "--dq-chains-d256",
        sm90_bwd,
        "DQ_CHAINS",
        {str(k): {(256, 256): k} for k in (1, 2, 3)},
        "deterministic d256's dQ chains (--dq-chains as an --ab setting)",
    ),
)


def switches() -> dict:
    """The on/off and place switches: flag (without --) -> (module, name, the values it takes)."""
    table = {flag[2:]: (module, name, ("on", "off")) for flag, module, name, _ in ON_OFF}
    table.update({flag[2:]: (module, name, choices) for flag, module, name, choices, _ in PLACES})
    return table


def switch_value(choices: tuple, value: str):
    """A switch's module value for its flag's `value`: True / False for "on" / "off", an int for a
    number, the value a dict of choices gives it, else the name."""
    if isinstance(choices, dict):
        return choices[value]
    if choices == ("on", "off"):
        return value == "on"
    return int(value) if value.isdigit() else value


def parse_setting(text: str) -> list:
    """One `--ab` setting, "flag=value[,flag=value...]" -> [(module, name, value)]."""
    table, pairs = switches(), []
    for part in text.split(","):
        flag, _, value = part.partition("=")
        if flag not in table:
            raise SystemExit(f"--ab: unknown switch {flag!r}; known: {', '.join(sorted(table))}")
        module, name, choices = table[flag]
        if value not in choices:
            raise SystemExit(f"--ab: {flag} takes {' / '.join(choices)}, not {value!r}")
        pairs.append((module, name, switch_value(choices, value)))
    return pairs


def interleaved_ab(settings: list, call, time_fn, rounds: int) -> dict:
    """settings: [(label, [(module, name, value)])]. Each setting's kernels are built (`call()`)
    into a `sm90_bwd._compiled` of their own, with its switches set and the others as they were;
    then `rounds` rounds time each setting once (`time_fn(call)`, ms), the order rotating by one
    setting per round. Each setting's gradients are compared with the first's (printed). Returns
    {label: [ms per round]}; the switches and `_compiled` are restored."""
    saved = {(module, name): getattr(module, name) for _, pairs in settings for module, name, _ in pairs}
    compiled, kernels = sm90_bwd._compiled, {}

    def apply(label, pairs):
        for (module, name), value in saved.items():
            setattr(module, name, value)
        for module, name, value in pairs:
            setattr(module, name, value)
        sm90_bwd._compiled = kernels.setdefault(label, {})

    times = {label: [] for label, _ in settings}
    try:
        first = None
        for label, pairs in settings:
            apply(label, pairs)
            grads = [g.float() for g in call() or () if isinstance(g, torch.Tensor)]
            if first is None:
                first = grads
            elif grads:  # the same gradients up to the order of dQ's fp32 adds
                diffs = [
                    (g - f).abs().max().item() / f.abs().max().item()
                    for g, f in zip(grads, first, strict=True)
                ]
                text = " ".join(f"{x:.1e}" for x in diffs)
                print(f"[{label}] gradients' max |diff| / max |the first setting's|: {text}")
        for r in range(rounds):
            shift = r % len(settings)
            for label, pairs in settings[shift:] + settings[:shift]:
                apply(label, pairs)
                times[label].append(time_fn(call))
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
        sm90_bwd._compiled = compiled
    return times


def inputs(args):
    torch.manual_seed(0)
    shape = (args.batch, args.seqlen, args.heads, args.d)
    dtype = getattr(torch, args.dtype)
    q, k = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(*shape[:3], args.dv or args.d, device="cuda", dtype=dtype)
    with torch.no_grad():
        out, lse = flash_attn_func(
            q, k, v, causal=args.causal, window_size=tuple(args.window), softcap=args.softcap,
            return_lse=True,
        )  # fmt: skip
    dout = torch.randn_like(out)
    return q, k, v, out, dout, lse


def varlen_inputs(args):
    """Packed sequences of 256..4096 tokens (`--varlen` of them, fixed seed), MHA: q, k, v, out,
    dout, lse (heads, total) of the varlen forward, cu_seqlens, the longest."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(256, 4097, (args.varlen,), generator=g)
    cu = torch.zeros(args.varlen + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    cu = cu.cuda()
    total = int(cu[-1])
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    q, k = (torch.randn(total, args.heads, args.d, device="cuda", dtype=dtype) for _ in range(2))
    v = torch.randn(total, args.heads, args.dv or args.d, device="cuda", dtype=dtype)
    longest = int(lengths.max())
    with torch.no_grad():
        out, lse = flash_attn_varlen_func(
            q, k, v, cu, cu, longest, longest, causal=args.causal, window_size=tuple(args.window),
            softcap=args.softcap, return_lse=True,
        )  # fmt: skip
    return q, k, v, out, torch.randn_like(out), lse, cu, longest


def time_ms(fn):
    return _time_ms(fn, warmup=3, repeats=20)  # the CLI demo's: median of CUDA-event times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dv", type=int, default=None, help="v's head dim (default: --d)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--softcap", type=float, default=0.0, help="the score cap (0: off)")
    parser.add_argument(
        "--varlen",
        type=int,
        default=0,
        metavar="SEQS",
        help="packed sequences of 256..4096 tokens (uniform, fixed seed), MHA, through the varlen "
        "backward (version 2), --batch and --seqlen unused (0: dense)",
    )
    parser.add_argument(
        "--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"), help="window_size"
    )
    parser.add_argument("--versions", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--probes", nargs="*", default=[])
    parser.add_argument(
        "--dkv-tma",
        type=int,
        nargs="*",
        help="the query tiles whose MHA kernels store dK, dV by TMA (sm90_bwd_ws.DKV_TMA_TILES; empty: none)",
    )
    for flag, module, name, what in ON_OFF:
        where = f"{module.__name__}.{name}"
        parser.add_argument(flag, choices=("on", "off"), default=None, help=f"{what} ({where}), or not")
    for flag, module, name, choices, what in PLACES:
        parser.add_argument(flag, choices=choices, default=None, help=f"{what} ({module.__name__}.{name})")
    parser.add_argument(
        "--writer-warps",
        type=int,
        default=None,
        help="deterministic dQ's writer warps (sm90_bwd.DQ_WRITER_WARPS)",
    )
    parser.add_argument(
        "--dq-chains",
        type=int,
        default=None,
        help="deterministic dQ's chains at this head dim (sm90_bwd.DQ_CHAINS; 1: off)",
    )
    parser.add_argument(
        "--wide",
        action="store_true",
        help="head dims past 128 on the wide kernel (backward.WIDE_BACKWARD; others padded to its pairs)",
    )
    parser.add_argument("--ncu", action="store_true", help="one call, no timing (v2 at the first --tile-m)")
    parser.add_argument(
        "--ab",
        nargs="+",
        metavar="FLAG=VALUE[,FLAG=VALUE]",
        help="settings of the on/off and place switches above (flags without --), timed against "
        "each other in interleaved rounds (v2, default tile)",
    )
    parser.add_argument("--rounds", type=int, default=8, help="--ab's rounds")
    parser.add_argument(
        "--tile-m",
        type=int,
        nargs="+",
        default=None,
        help="v2's query tiles to time: d64 64 / 128 (default D64_TILE_M), d128 64 / 80 (default "
        "D128_TILE_M; 80 without --causal only)",
    )
    args = parser.parse_args()
    if args.dkv_tma is not None:
        sm90_bwd_ws.DKV_TMA_TILES = tuple(args.dkv_tma)
    for flag, (module, name, choices) in switches().items():
        if (value := getattr(args, flag.replace("-", "_"))) is not None:
            setattr(module, name, switch_value(choices, value))
    if args.writer_warps is not None:
        sm90_bwd.DQ_WRITER_WARPS = args.writer_warps
    if args.dq_chains is not None:
        sm90_bwd.DQ_CHAINS = {(args.d, args.dv or args.d): args.dq_chains}
    if args.wide:
        import hopper_fmha.backward

        hopper_fmha.backward.WIDE_BACKWARD = True
    scale = args.d**-0.5
    dv = args.dv or args.d
    if args.varlen:
        args.versions = [2]
        q, k, v, out, dout, lse, cu, longest = varlen_inputs(args)
        lengths = (cu[1:] - cu[:-1]).double()
        # 2.5 times the forward's FLOPs, summed over the sequences, causal halved
        fmul = 2.5 * 2 * args.heads * float((lengths**2).sum()) * (args.d + dv) / (2 if args.causal else 1)

        def call(version):
            return sm90_bwd.backward_varlen(
                q, k, v, out, dout, lse, cu, cu, longest, longest, scale, args.causal,
                deterministic=args.deterministic, window_size=tuple(args.window), softcap=args.softcap,
            )  # fmt: skip

    else:
        q, k, v, out, dout, lse = inputs(args)
        # 2.5 times the forward's FLOPs, 2 B H N^2 (d + dv), causal halved
        fmul = 2.5 * 2 * args.batch * args.heads * args.seqlen**2 * (args.d + dv) / (2 if args.causal else 1)

        def call(version):
            return sm90_bwd.backward(
                q, k, v, out, dout, lse, scale, args.causal, deterministic=args.deterministic,
                version=version, window_size=tuple(args.window), softcap=args.softcap,
            )  # fmt: skip

    shape = f"varlen{args.varlen}" if args.varlen else f"B{args.batch} N{args.seqlen}"
    name = f"{shape} H{args.heads} d{args.d}{f'/{dv}' if dv != args.d else ''} {args.dtype}"
    name += " causal" if args.causal else ""
    name += " deterministic" if args.deterministic else ""
    name += f" softcap {args.softcap:g}" if args.softcap else ""
    name += f" window {tuple(args.window)}" if tuple(args.window) != (-1, -1) else ""
    if args.ab:
        times = interleaved_ab(
            [(text, parse_setting(text)) for text in args.ab], lambda: call(2), time_ms, args.rounds
        )
        for label, ms in times.items():
            med = statistics.median(ms)
            rates = " ".join(f"{fmul / t / 1e9:.0f}" for t in ms)
            print(f"{name} v2 [{label}]: median {med:.3f} ms, {fmul / med / 1e9:.1f} TFLOP/s; rounds {rates}")
        return
    switch = "D128_TILE_M" if args.d == 128 else "D64_TILE_M"  # (the query tile of that head dim only)
    if args.ncu:  # the default kernel, or v2 at the first --tile-m
        if args.tile_m:
            setattr(sm90_bwd, switch, args.tile_m[0])
        call(None)
        torch.cuda.synchronize()
        return
    runs = [(version, 64) for version in args.versions if version == 1]
    default_tile = getattr(sm90_bwd, switch)
    runs += [(2, tile_m) for tile_m in args.tile_m or [default_tile] if 2 in args.versions]
    for version, tile_m in runs:
        setattr(sm90_bwd, switch, tile_m)
        ms = time_ms(lambda version=version: call(version))
        tile = f" tile_m {sm90_bwd.query_tile(2, args.d, masked=args.causal)}" if version == 2 else ""
        print(f"{name} v{version}{tile}: backward() {ms:.3f} ms, {fmul / ms / 1e9:.1f} TFLOP/s")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            call(version)
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_time_total > 0:
                print(f"    {e.device_time_total / 1e3:8.3f} ms  {e.key[:100]}")
    setattr(sm90_bwd, switch, default_tile)  # the probes time the default kernel
    for probe in args.probes:
        method, fn = PROBES[probe]
        saved = getattr(sm90_bwd_ws.BwdWsSm90, method)
        setattr(sm90_bwd_ws.BwdWsSm90, method, fn)
        sm90_bwd._compiled.clear()
        ms = time_ms(lambda: call(2))
        tflops = fmul / ms / 1e9
        print(f"{name} v2 probe {probe}: backward() {ms:.3f} ms, {tflops:.1f} TFLOP/s (wrong results)")
        setattr(sm90_bwd_ws.BwdWsSm90, method, saved)
        sm90_bwd._compiled.clear()


if __name__ == "__main__":
    main()
