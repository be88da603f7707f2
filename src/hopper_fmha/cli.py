"""`hopper-fmha` / `python -m hopper_fmha`: info, demo, and the subcommands other modules register.

Extension point: a module with `register(subparsers)` that adds its own subparser and sets
`func` (taking the parsed args, returning an exit code) via `set_defaults(func=...)`.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import platform
import statistics
import sys
import time

import torch

# (subcommand, module): registered when the module exists.
EXTENSIONS = (("bench", "hopper_fmha.bench.cli"), ("layouts", "hopper_fmha.kernels.layouts"))

# The CPU demo: odd lengths (tail tiles on both sides), GQA, the tile the kernel uses for d=64.
CPU_DEMO_SHAPE = dict(batch=2, seqlen=333, heads=4, kv_heads=2, head_dim=64)
# fp64 emulator (NumPy) vs fp64 reference (torch): they differ only in summation order and in the
# BLAS and exp/log each library picks for the CPU. Observed: ~6e-16 on our 2-core AMD machines, but
# 5.4e-10 (out) and 2.8e-10 (lse), non-causal only, on the CI machine at 3427ada (cause not found;
# the emulator is plain NumPy). A wrong tile walk, mask or rescale is off by 1e-3 or more, so 1e-8
# still tells a correct algorithm from a wrong one.
CPU_DEMO_TOL = 1e-8
# Kernel LSE vs the fp32 reference LSE on the same fp16/bf16 inputs: both accumulate in fp32, in a
# different order (and the kernel uses exp2); observed differences are ~1e-5, a wrong scale or
# mask moves the LSE by far more than this.
LSE_TOL = 1e-3


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _gpu() -> tuple[bool, str]:
    """(whether a Hopper GPU is here, a sentence saying what was found)."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU found (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability()
    found = f"{torch.cuda.get_device_name()}, compute capability {major}.{minor}"
    return major == 9, found


def _import_kernels():
    """(hopper_fmha.kernels, None) or (None, the import error as text)."""
    try:
        return importlib.import_module("hopper_fmha.kernels"), None
    except Exception as e:  # a broken or missing DSL install is reported, not raised
        return None, f"{type(e).__name__}: {e}"


def _print_rows(rows: list[tuple[str, str]]) -> None:
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _print_table(records: list[dict]) -> None:
    columns = list(dict.fromkeys(key for record in records for key in record))

    def fmt(value) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    cells = [[fmt(record.get(c, "")) for c in columns] for record in records]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    for row in [columns, *cells]:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


# ---- info ----


def cmd_info(args) -> int:
    from hopper_fmha import __version__

    hopper, found = _gpu()
    rows = [
        ("hopper-fmha", __version__),
        ("python", platform.python_version()),
        ("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
        ("nvidia-cutlass-dsl", _version("nvidia-cutlass-dsl")),
        ("GPU", found),
    ]
    kernels, error = _import_kernels()
    arch = os.environ.get("CUTE_DSL_ARCH")
    if kernels is None:
        rows.append(("kernels", f"unavailable: {error}"))
    elif hopper:
        rows.append(("kernels", "can run here (sm_90)"))
    else:
        rows.append(("kernels", f"compile only here (CUTE_DSL_ARCH={arch}); running them needs a Hopper GPU"))
    if kernels is not None and hasattr(kernels, "dsl_flavor"):
        try:
            rows.append(("DSL compiler", kernels.dsl_flavor()))
        except Exception as e:
            rows.append(("DSL compiler", f"unknown ({type(e).__name__}: {e})"))
    if kernels is not None and hasattr(kernels, "cache_dir"):
        try:
            rows.append(("kernel cache", str(kernels.cache_dir())))
        except Exception as e:
            rows.append(("kernel cache", f"unknown ({type(e).__name__}: {e})"))
    _print_rows(rows)
    return 0


# ---- demo ----


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(fn, warmup: int, repeats: int) -> float:
    """Median milliseconds of `repeats` calls after `warmup` calls, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _sdpa_peer(q, k, v, causal: bool):
    """(name, fn, out) for torch SDPA on BSHD tensors: the flash backend where it runs, else the default."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def default(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        )
        return out.transpose(1, 2)

    def flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return default(q, k, v)

    try:
        return "SDPA flash", flash, flash(q, k, v)
    except RuntimeError:  # no flash backend for this GPU, dtype or shape
        return "SDPA default", default, default(q, k, v)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over finite entries; entries that are -inf in both count as equal."""
    a, b = a.double(), b.double()
    both_inf = torch.isneginf(a) & torch.isneginf(b)
    return torch.where(both_inf, 0.0, (a - b).abs()).max().item()


def _demo_gpu(args, device: torch.device) -> int:
    from hopper_fmha import flash_attn_func
    from hopper_fmha.bench.flops import attention_flops, tflops
    from hopper_fmha.reference import reference

    dtype = getattr(torch, args.dtype)
    b, n, h, d = args.batch, args.seqlen, args.heads, args.head_dim
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    print(f"hopper-fmha demo on {name}: B={b} N={n} H={h} d={d} {args.dtype}")
    print(
        f"check: max |out - fp32 reference| <= 2 x SDPA's + 1 ulp of {args.dtype} at the output's scale; "
        f"max |lse - reference| <= {LSE_TOL}"
    )
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, generator=g, device=device, dtype=dtype) for _ in range(3))
    records, ok = [], True
    for causal in (False, True):
        t0 = time.perf_counter()
        out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
        _sync(device)
        first_s = time.perf_counter() - t0
        ref_out, ref_lse = reference(q, k, v, causal=causal)
        peer_name, peer, peer_out = _sdpa_peer(q, k, v, causal)
        err = _max_abs_diff(out, ref_out)
        peer_err = _max_abs_diff(peer_out, ref_out)
        lse_err = _max_abs_diff(lse, ref_lse)
        tol = 2 * peer_err + torch.finfo(dtype).eps * ref_out.abs().max().item()
        passed = err <= tol and lse_err <= LSE_TOL  # False for nan
        ok &= passed
        flops = attention_flops(b, h, n, n, d, causal)
        ms = _time_ms(lambda c=causal: flash_attn_func(q, k, v, causal=c), args.warmup, args.repeats)
        peer_ms = _time_ms(lambda p=peer: p(q, k, v), args.warmup, args.repeats)
        records.append(
            {
                "causal": causal,
                "max err": err,
                f"{peer_name} err": peer_err,
                "lse err": lse_err,
                "check": "ok" if passed else "FAIL",
                "first call s": first_s,
                "ms": ms,
                "TFLOP/s": tflops(flops, ms),
                f"{peer_name} ms": peer_ms,
                f"{peer_name} TFLOP/s": tflops(flops, peer_ms),
            }
        )
    _print_table(records)
    print(
        f"times: median of {args.repeats} calls after {args.warmup} warm-up, CUDA events; "
        "first call includes compiling or loading the kernel"
    )
    print("demo passed" if ok else "demo FAILED: the kernel's output is off (see check above)")
    return 0 if ok else 1


def _demo_emulator() -> bool:
    from hopper_fmha.config import select_config
    from hopper_fmha.emulate import emulate
    from hopper_fmha.reference import reference

    s = CPU_DEMO_SHAPE
    tile = select_config(s["head_dim"]).tile
    g = torch.Generator().manual_seed(0)
    q = torch.randn(s["batch"], s["seqlen"], s["heads"], s["head_dim"], generator=g, dtype=torch.float64)
    k, v = (
        torch.randn(s["batch"], s["seqlen"], s["kv_heads"], s["head_dim"], generator=g, dtype=torch.float64)
        for _ in range(2)
    )
    print(
        f"CPU emulator (Algorithm 2, tiles {tile[0]}x{tile[1]}) vs exact reference, fp64, "
        f"B={s['batch']} N={s['seqlen']} H={s['heads']} (kv heads {s['kv_heads']}) d={s['head_dim']}:"
    )
    ok = True
    for causal in (False, True):
        out, lse = emulate(q, k, v, causal=causal, block_m=tile[0], block_n=tile[1])
        ref_out, ref_lse = reference(q, k, v, causal=causal, dtype=torch.float64)
        err = _max_abs_diff(torch.from_numpy(out), ref_out)
        lse_err = _max_abs_diff(torch.from_numpy(lse), ref_lse)
        passed = err <= CPU_DEMO_TOL and lse_err <= CPU_DEMO_TOL
        ok &= passed
        verdict = "ok" if passed else f"FAIL (tolerance {CPU_DEMO_TOL})"
        print(f"  causal={causal!s:<5}  max |out err| {err:.2e}  max |lse err| {lse_err:.2e}  {verdict}")
    return ok


def _demo_compile_report() -> bool:
    kernels, error = _import_kernels()
    if kernels is None:
        print(f"hopper_fmha.kernels cannot be imported, so no kernel was compiled: {error}")
        return False
    if not hasattr(kernels, "compile_report"):
        print("hopper_fmha.kernels has no compile_report() yet: no kernel was compiled.")
        return True
    print(f"Compiling the kernels for {os.environ.get('CUTE_DSL_ARCH', 'sm_90a')} (no launch):")
    try:
        report = kernels.compile_report()
    except Exception as e:
        print(f"compile report FAILED: {type(e).__name__}: {e}")
        return False
    records = [report] if isinstance(report, dict) else list(report)
    if records:
        _print_table(records)
    failed = [r for r in records if r.get("ok") is False or r.get("error")]
    if failed:
        print(f"{len(failed)} of {len(records)} kernels failed to compile")
    return not failed


def cmd_demo(args) -> int:
    hopper, found = _gpu()
    if hopper:
        try:
            return _demo_gpu(args, torch.device("cuda", torch.cuda.current_device()))
        except (TypeError, ValueError) as e:  # arguments flash_attn_func rejects
            print(f"demo FAILED: {e}")
            return 1
    print(f"No Hopper GPU here: {found}. The kernels cannot run on this machine.")
    print()
    ok = _demo_emulator()
    print()
    ok = _demo_compile_report() and ok
    print("\ndemo passed (CPU only: no kernel was run)" if ok else "\ndemo FAILED")
    return 0 if ok else 1


# ---- parser ----


def _register_unavailable(subparsers, name: str, module: str, error: str) -> None:
    def unavailable(args) -> int:
        print(f"`{name}` is unavailable: importing {module} failed: {error}", file=sys.stderr)
        return 1

    if name in subparsers.choices:  # register() failed after adding its parser: keep that one
        return
    sub = subparsers.add_parser(name, help=f"(unavailable: {error})")
    sub.set_defaults(func=unavailable)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hopper-fmha", description="Fused multi-head attention forward for NVIDIA Hopper (CuTe DSL)."
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")

    info = subparsers.add_parser("info", help="versions, GPU, whether the kernels can run here")
    info.set_defaults(func=cmd_info)

    demo = subparsers.add_parser(
        "demo", help="run and check the kernel on a Hopper GPU (or the CPU emulator elsewhere)"
    )
    demo.add_argument("--batch", type=int, default=4)
    demo.add_argument("--seqlen", type=int, default=4096)
    demo.add_argument("--heads", type=int, default=16)
    demo.add_argument("--head-dim", type=int, default=128)
    demo.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
    demo.add_argument("--warmup", type=int, default=5)
    demo.add_argument("--repeats", type=int, default=20)
    demo.set_defaults(func=cmd_demo)

    for name, module in EXTENSIONS:
        try:
            importlib.import_module(module).register(subparsers)
        except ModuleNotFoundError as e:
            if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
                continue  # not written yet
            _register_unavailable(subparsers, name, module, f"{type(e).__name__}: {e}")
        except Exception as e:
            _register_unavailable(subparsers, name, module, f"{type(e).__name__}: {e}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)
