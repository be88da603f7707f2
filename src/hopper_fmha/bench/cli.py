"""`hopper-fmha bench`: argparse wiring and the run from start to files.

`hopper_fmha.cli` calls `register(subparsers)`; the subcommand runs `run(args)`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tarfile
from pathlib import Path

from hopper_fmha.bench.presets import PRESETS, custom_problems, get_preset, tiles, with_dtypes
from hopper_fmha.bench.registry import DEFAULT_BACKENDS, canonical_dtype, parse_tile, resolve_backends
from hopper_fmha.bench.report import (
    claims_summary,
    load_results,
    matmul_rate,
    new_results,
    output_stem,
    record_line,
    render_terminal,
    write_json,
    write_markdown,
)
from hopper_fmha.bench.timing import TimingSettings

DEFAULT_OUT = "bench/results"
EPILOG = """\
presets:
  paper   B=4 N=4096 fp16, d/heads 64/32, 128/16, 256/8, causal off and on (6 problems)
  sweep   16k tokens, hidden 2048: N 512..16384, B=16384/N, d 64/128/256, causal off/on,
          fp16 and bf16 (72 problems)
  tiles   the seed paper's Table 1: the paper variant at every tile and head dim, paper shape,
          this package only; with --variant ws, the ws variant's candidate tiles instead
  host    tiny problems (B=1 N=128, d 64/128, causal off/on, bf16): eager calls time the host
          path; with --profile, each stage of ours alone (4 problems)
  varlen  packed batches: 24 sequences of 256..4096 tokens (uniform, fixed seed), H 32/8, bf16,
          d 64/128, causal off/on, each with its dense twin (B=24, N = RMS length); backends
          hopper-fmha:auto, fa4, hopper-fmha:padded; reports ours ÷ FA4 and ÷ dense twin (8 problems)
  decode  one decode step against a KV cache, bf16, H 32/8, d 128: B64 with 8192 cached tokens
          (full, ragged, paged 16/64/256), B1 and B4 with 131072 (split-KV), B64 with 4 causal
          queries; backends hopper-fmha:auto, sdpa-cudnn, fa4, copy; reports TB/s of K/V read,
          ours ÷ best peer, % of a device-to-device copy, paged ÷ dense (8 problems)
  backward the paper's problems (fp16; --dtype fp16 bf16 for both), each timed as "bwd" (the
          backward alone: torch.autograd.grad after one untimed forward) and "fwd+bwd";
          backends hopper-fmha:auto, fa4, sdpa-cudnn, sdpa-flash, all through autograd, eager
          time only; FLOPs 2.5x / 3.5x the forward's; dq, dk, dv checked against the fp32
          reference (12 problems)
  features the forward's score features and head dims, bf16, each after its twin without the
          feature: sliding window (B1 N32768 d128 H16 causal, then window (4096, 0); FLOPs on the
          visible pairs), softcap 30 (B4 N4096 d128 H16, causal off/on), d96 and d192/dv128 (B4
          N4096 H16, causal off/on), learnable sink (B4 N4096 d64 H32 causal); backends
          hopper-fmha:auto, fa4, sdpa-cudnn (no window/softcap/sink: skipped there); reports
          ours ÷ FA4, window ÷ causal and softcap ÷ plain (12 problems)
  backward-features the backward on varlen and score-feature problems, bf16, each as "bwd" then
          "fwd+bwd": the varlen preset's packed batch (d128 H 32/8, causal off/on), window
          (4096, 0) after causal (B1 N16384 d128 H16), softcap 30 after plain (B4 N4096 d128
          H16, causal off/on), sink after plain (B4 N4096 d64 H32 causal); backends
          hopper-fmha:auto, hopper-fmha:auto+det, fa4, through autograd; dq, dk, dv checked
          (20 problems)

backends (--backends, comma separated): hopper-fmha (every variant), hopper-fmha:<variant>,
  hopper-fmha:<variant>@<M>x<N>, a "+lse" suffix (return_lse=True), sdpa-flash (FA2),
  sdpa-efficient (CUTLASS mem-eff), sdpa-cudnn, fa4, fa3, hopper-fmha:padded (varlen problems
  only: our dense kernel on the zero-padded batch), copy (decode problems only: a device-to-device
  copy of the K/V bytes, the bandwidth yardstick). Default: hopper-fmha, sdpa-flash,
  sdpa-efficient, sdpa-cudnn, fa4, fa3. On varlen problems only ours (auto, ws), fa4 and
  hopper-fmha:padded run; on decode problems ours (auto, ws), SDPA (dense caches), fa4 and copy;
  the others are reported as skipped.

timing: per problem every backend is checked, warmed up and captured, then the GPU is pre-heated
  (0.3 s of matmuls) and all backends are timed in --rounds interleaved rounds (eager and graph
  blocks, the first backend rotating, eager/graph order alternating). Ratios use kernel time
  (CUDA graph); eager includes host overhead.

exit status: 0 done, 1 a hopper-fmha result failed its correctness check, 2 usage error or
no CUDA GPU, 3 the CUDA context was lost (partial results written), 130 interrupted.
"""


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="time attention against the peers, forward (or --preset backward) (TFLOP/s, JSON/Markdown/PNG)",
        description="Time hopper-fmha and its peers on this GPU; write JSON, Markdown and PNG charts.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = p.add_argument_group("what to run")
    what.add_argument("--preset", choices=sorted(PRESETS), help="a named problem grid (see below)")
    what.add_argument("--batch", type=int, help="batch (default: 16384 tokens / seqlen)")
    what.add_argument("--seqlen", type=int, nargs="+", help="query length(s) (default 4096)")
    what.add_argument("--seqlen-k", type=int, nargs="+", help="key length(s) (default: seqlen)")
    what.add_argument("--heads", type=int, help="query heads (default: 2048 / headdim)")
    what.add_argument("--kv-heads", type=int, help="key/value heads, fewer for GQA (default: heads)")
    what.add_argument("--headdim", type=int, nargs="+", help="head dim(s) (default 128)")
    what.add_argument("--causal", action="store_true", help="causal (bottom-right aligned)")
    what.add_argument("--dtype", nargs="+", help="float16 / bfloat16 (default float16)")
    what.add_argument("--backends", nargs="+", help="backend names, comma or space separated")
    what.add_argument(
        "--variant", help="only this hopper-fmha variant (--preset tiles: whose tiles to sweep)"
    )
    what.add_argument("--tile", help="hopper-fmha tile override, e.g. 128x64")
    how = p.add_argument_group("how")
    how.add_argument("--warmup", type=int, help="warm-up calls per step (default 5)")
    how.add_argument("--iters", type=int, help="timed samples per mode, all rounds together (default 30)")
    how.add_argument(
        "--rounds", type=int, help="interleaved timing rounds per problem (default 3, --quick 1)"
    )
    how.add_argument(
        "--steady-ms",
        type=float,
        help="run each timing block this long untimed first, so every kernel is timed at the clock "
        "its own power draw settles to (default 0; 300 suits a power-capped card at N >= 2048; "
        "short problems need ~1500 for the block order not to matter, NOTES.md v14)",
    )
    how.add_argument(
        "--block-ms",
        type=float,
        help="time each block until its samples cover this much GPU time (default 0: --iters / "
        "--rounds samples); the power-capped clock swings with a period near 1 s, so ~1000 averages "
        "a swing where a few short samples catch one phase of it (NOTES.md v15)",
    )
    how.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    how.add_argument("--quick", action="store_true", help="few iterations: a smoke test, not a measurement")
    how.add_argument(
        "--profile", action="store_true", help="hopper-fmha: %% of matmul, host µs/call, compile/load times"
    )
    how.add_argument("--seed", type=int, default=0, help="input seed")
    out = p.add_argument_group("output")
    out.add_argument(
        "--out", help=f"results folder (default {DEFAULT_OUT}; with --from-json, the file's folder)"
    )
    out.add_argument("--tag", help="appended to the file names")
    out.add_argument("--no-plot", action="store_true", help="no PNG charts")
    out.add_argument(
        "--archive", action="store_true", help="also write <stem>.tar.gz holding the JSON, Markdown and PNGs"
    )
    out.add_argument(
        "--from-json", metavar="FILE", help="re-render Markdown, PNGs and the table from a saved run (no GPU)"
    )
    p.set_defaults(func=run)
    return p


_PROBLEM_FLAGS = ("batch", "seqlen", "seqlen_k", "heads", "kv_heads", "headdim", "dtype")


def _split(values: list[str] | None) -> list[str]:
    return [x for v in values or [] for x in v.split(",") if x.strip()]


def plan(args) -> tuple[str, tuple, list[str]]:
    """(preset name, problems, backend names) from the flags; ValueError on a bad combination."""
    free = [f for f in _PROBLEM_FLAGS if getattr(args, f) is not None] + (["causal"] if args.causal else [])
    if args.preset:
        free = [f for f in free if f != "dtype"]  # a preset's problems, in the dtypes asked for
        if free:
            flags = ", ".join("--" + f.replace("_", "-") for f in free)
            raise ValueError(f"--preset {args.preset} fixes the problems; drop {flags}")
        if args.preset == "tiles" and args.tile:
            raise ValueError("--preset tiles sweeps the tiles; drop --tile")
        preset = tiles(args.variant or "paper") if args.preset == "tiles" else get_preset(args.preset)
        name, problems, names = preset.name, preset.problems, list(preset.backends or DEFAULT_BACKENDS)
        if args.dtype:
            problems = with_dtypes(problems, [canonical_dtype(d) for d in _split(args.dtype)])
    else:
        problems = custom_problems(
            args.batch,
            args.seqlen or [4096],
            args.seqlen_k,
            args.heads,
            args.kv_heads,
            args.headdim or [128],
            args.causal,
            [canonical_dtype(d) for d in _split(args.dtype)] or ["float16"],
        )
        name, names = "custom", list(DEFAULT_BACKENDS)
    if args.backends:
        names = _split(args.backends)
    if (args.variant or args.tile) and args.preset != "tiles":
        names = _select_ours(names, args.variant, args.tile)
    return name, problems, names


def _select_ours(names: list[str], variant: str | None, tile: str | None) -> list[str]:
    """Narrow the hopper-fmha entries to the chosen variant and/or tile: generic entries become
    the choice; explicit-tile entries (the tiles preset) stay unless --tile replaces them."""
    if variant:
        variants = [variant]
    else:
        from hopper_fmha.config import VARIANTS

        variants = list(VARIANTS)
    suffix = ""
    if tile:
        m, n = parse_tile(tile)
        suffix = f"@{m}x{n}"
    ours = [f"hopper-fmha:{v}{suffix}" for v in variants]
    out: list[str] = []
    for name in names:
        if not name.startswith("hopper-fmha"):
            out.append(name)
            continue
        v, _, t = name.removeprefix("hopper-fmha").lstrip(":").partition("@")
        if t and not tile:
            if variant is None or v == variant:
                out.append(name)
        else:
            out += [o for o in ours if o not in out]
    return out if any(n.startswith("hopper-fmha") for n in out) else ours + out


def timing_settings(args) -> TimingSettings:
    s = TimingSettings.quick() if args.quick else TimingSettings()
    keys = ("warmup", "iters", "rounds", "steady_ms", "block_ms")
    changes = {k: getattr(args, k, None) for k in keys if getattr(args, k, None) is not None}
    if changes.get("iters", 1) < 1 or changes.get("warmup", 0) < 0 or changes.get("rounds", 1) < 1:
        raise ValueError("--iters and --rounds must be at least 1 and --warmup at least 0")
    for key in ("steady_ms", "block_ms"):
        if changes.get(key, 0) < 0:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 0")
    return TimingSettings(**{**s.__dict__, **changes})


class Progress:
    """tqdm bar on a terminal; otherwise (logs, no tqdm) one plain line per step."""

    def __init__(self, total: int, matmul: float | None):
        self.total, self.matmul, self.i = total, matmul, 0
        self.bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, leave=False)
            except ImportError:
                pass

    def start(self, problem, backend) -> None:
        if self.bar is not None:
            self.bar.set_description_str(f"{problem.label()} {backend.name}")

    def done(self, rec: dict) -> None:
        self.i += 1
        line = record_line(rec, self.matmul)
        if self.bar is not None:
            self.bar.write(line)
            self.bar.update(1)
        else:
            print(f"[{self.i}/{self.total}] {line}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _render(results: dict, out_dir: Path, stem: str, plot: bool) -> list[Path]:
    """Markdown, terminal table and PNGs; returns the files written."""
    md = out_dir / f"{stem}.md"
    write_markdown(results, md)
    print(render_terminal(results))
    print(f"wrote {md}")
    paths = [md]
    if plot:
        from hopper_fmha.bench.plots import write_plots

        pngs, why = write_plots(results, out_dir, stem)
        for path in pngs:
            print(f"wrote {path}")
        if why:
            print(why)
        paths += pngs
    return paths


def write_archive(paths: list[Path], out_dir: Path, stem: str) -> Path:
    """<stem>.tar.gz holding `paths` by file name: a run in one file."""
    archive = Path(out_dir) / f"{stem}.tar.gz"
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for path in dict.fromkeys(Path(p) for p in paths):
            tar.add(path, arcname=path.name)
    tmp.replace(archive)
    print(f"wrote {archive}")
    return archive


def _from_json(args) -> int:
    path = Path(args.from_json)
    try:
        results = load_results(path)
    except (OSError, ValueError) as e:
        print(f"hopper-fmha bench: cannot read {path}: {e}", file=sys.stderr)
        return 2
    out_dir = Path(args.out) if args.out else path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = _render(results, out_dir, path.stem, not args.no_plot)
    if getattr(args, "archive", False):
        write_archive([path, *paths], out_dir, path.stem)
    return 0


def run(args) -> int:
    if args.from_json:
        return _from_json(args)
    try:
        preset, problems, names = plan(args)
        backends = resolve_backends(names)
        settings = timing_settings(args)
    except ValueError as e:
        print(f"hopper-fmha bench: {e}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(
            "hopper-fmha bench needs a CUDA GPU (Hopper: H100/H200) and torch sees none "
            f"(torch {torch.__version__}). To re-render saved results: hopper-fmha bench --from-json FILE",
            file=sys.stderr,
        )
        return 2
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        print(f"note: {torch.cuda.get_device_name()} is sm_{major}{minor}, not Hopper (sm_90): expect skips")
    return execute(args, preset, problems, backends, settings, device="cuda")


def execute(args, preset, problems, backends, settings, *, device, timer=None, reference=None) -> int:
    """The run proper; `device`, `timer` and `reference` are parameters so it runs on CPU in tests."""
    from hopper_fmha.bench.runner import CudaContextLost, collect_env, run_suite
    from hopper_fmha.bench.timing import CudaTimer, MatmulLoad, measure_matmul

    timer = timer or CudaTimer()
    graph = device == "cuda" and not args.no_graph
    env = collect_env(device)
    command = shlex.join(["hopper-fmha", *sys.argv[1:]])
    results = new_results(
        preset, env, {**settings.__dict__, "graph": graph, "seed": args.seed}, command, args.tag
    )
    out_dir = Path(args.out or DEFAULT_OUT)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = output_stem(results)
    json_path = out_dir / f"{stem}.json"
    print(
        f"hopper-fmha bench: {preset}, {len(problems)} problems x {len(backends)} backends on {env['device']}"
    )
    print(f"backends: {', '.join(b.name for b in backends)}")
    memory_budget = None
    load = heat = None
    if device == "cuda":
        import torch

        try:
            load = MatmulLoad(device)
            results["matmul"] = measure_matmul(device, timer, settings, load=load)
            print(f"cuBLAS fp16 matmul: {results['matmul']['tflops']:.1f} TFLOP/s (pre-heated)")
        except Exception as e:  # the attention numbers stand without it
            print(f"cuBLAS fp16 matmul failed ({type(e).__name__}: {e}); no % of matmul in this run")
        if load is not None:

            def heat() -> None:
                load.heat(timer, settings.preheat_ms)

        memory_budget = int(torch.cuda.mem_get_info()[0] * 0.3)
    progress = Progress(len(problems) * len(backends), matmul_rate(results))

    def on_record(rec: dict) -> None:
        results["records"].append(rec)
        write_json(results, json_path)
        progress.done(rec)

    code = 0
    try:
        run_suite(
            problems, backends, settings, timer, device,
            graph=graph, profile=args.profile, reference=reference, seed=args.seed,
            l2_bytes=env.get("l2_bytes") or 50 * 2**20, memory_budget=memory_budget, heat=heat,
            on_start=progress.start, on_record=on_record,
        )  # fmt: skip
        if results["matmul"]:
            results["matmul_end"] = measure_matmul(device, timer, settings, load=load)
        results["complete"] = True
    except CudaContextLost as e:
        print(
            f"\nhopper-fmha bench: CUDA context lost ({e}); stopping, partial results kept", file=sys.stderr
        )
        code = 3
    except KeyboardInterrupt:
        print("\nhopper-fmha bench: interrupted; partial results kept", file=sys.stderr)
        code = 130
    finally:
        progress.close()
        results["summary"] = claims_summary(results)
        write_json(results, json_path)
        print(f"wrote {json_path}")
        paths = _render(results, out_dir, stem, not args.no_plot)
        if getattr(args, "archive", False):
            write_archive([json_path, *paths], out_dir, stem)
    if code == 0 and any(r["ours"] and r["status"] == "wrong" for r in results["records"]):
        print("hopper-fmha bench: a hopper-fmha result failed its correctness check", file=sys.stderr)
        code = 1
    return code
