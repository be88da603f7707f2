"""Sustained rate at the power cap: ms per call, SM clock, board power, cycles and energy per call.

A bench block times tens to hundreds of ms. On a power-capped H100/H200 the clock follows each
kernel's power draw with a lag and then swings with a period near a second (NOTES.md, "Timing
method"), so two kernels can time a few % apart in short blocks while taking the same cycles.
This probe times each backend the way the card runs it for long: per problem and backend, one
CUDA graph of `--calls` calls (input sets rotating, more than 2x L2 in all) is replayed untimed
for `--settle` s, then timed for `--seconds` s between CUDA events, while `nvidia-smi` samples
the SM clock and the board power every 20 ms. The backends of a problem run in `--passes`
passes, the order reversed every other pass. One line per backend and pass:

    B4 N4096 H16 d128 fp16   hopper-fmha:auto   0.9120 ms   1523 MHz   692 W   1.389 Mcyc   631.1 mJ

Mcyc is ms x mean MHz / 1000: cycles per call at the mean clock, which decides a comparison where
the card is not at its cap. mJ is ms x mean W: energy per call, which decides the clock where it
is. nvidia-smi's power reading lags (it averages over a window), so the first pass after an idle
gap reads low. Before the first pass the first backend's graph runs `--preheat` s untimed, so the
first block does not start from an idle card's boost. Each problem ends with every backend's mean
over the passes against the first's.

Backends: any name `hopper-fmha bench --backends` takes (`hopper_fmha.bench.registry`), e.g.
`hopper-fmha:auto`, `hopper-fmha:paper@64x64`, `hopper-fmha:ws/single`, `sdpa-cudnn`, `fa4`; and
`ws[@MxN][:switch=value,...]`: the ws kernel as `flash_attn_func(variant="ws")` launches it on
the problem (its tile, CTA pairs and causal switches: `config.auto_tile`, `config.launch_config`),
then the named `KernelConfig` switches (`config.WS_SWITCHES`) changed, e.g. `ws:pin_pv_wait=8`,
`ws@128x64:num_stages=3,mma_rowsum=1`. Every backend's output on the first input set is checked
against the fp32 reference by the bench's rule first (`--no-check` skips it).

Decode (`--preset decode WORD...`): `kv[:field=value,...]` runs `hopper-fmha:auto` with those
`KernelKey` fields set over its KV-cache launches (`kernels.KVCACHE_SWITCHES`), e.g.
`kv:num_stages=3`, `kv:tile_counter=0,schedule=single`.

Problems: `--preset NAME [WORD...]` takes a bench preset's problems (those a WORD matches), or
`--headdim` (and `--headdim-v`), `--seqlen`, `--causal no|yes|both`, `--dtype`; B = 16384 / N and
H = 2048 / d unless `--batch` / `--heads` are given, as in the bench's sweep.

On the GPU machine, from the project root:

    source .gpu/activate.sh && python scripts/sustained.py --backends hopper-fmha:auto fa4 \\
        --headdim 64 128 256 --seqlen 4096 --causal both --dtype bf16

`--trace MS` also prints the timed span in windows of MS ms of GPU time, e.g. the clock's swing
right after another backend: `--settle 0 --seconds 3 --trace 100`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

WS_PREFIX = "ws"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_ws_spec(spec: str) -> tuple[tuple[int, int] | None, dict]:
    """`ws[@MxN][:name=value,...]` -> (tile or None, {switch: value}), checked against
    `config.WS_SWITCHES` and typed by `KernelConfig`'s defaults."""
    from hopper_fmha.bench.registry import parse_tile
    from hopper_fmha.config import WS_SWITCHES, KernelConfig

    head, _, items = spec.partition(":")
    name, _, tile_text = head.partition("@")
    if name != WS_PREFIX:
        raise ValueError(f"not a ws spec: {spec!r}")
    tile = parse_tile(tile_text) if tile_text else None
    defaults = {f.name: f.default for f in dataclasses.fields(KernelConfig)}
    switches: dict = {}
    for item in filter(None, items.split(",")):
        key, eq, value = item.partition("=")
        if key not in WS_SWITCHES or not eq:
            raise ValueError(f"{spec!r}: {item!r} is not switch=value; switches: {', '.join(WS_SWITCHES)}")
        if key == "tile_counter":  # its kernels need a counter slot that only their launches ask for
            raise ValueError(
                f"{spec!r}: tile_counter is set per launch (kernels.VARLEN_TILE_COUNTER, "
                "KVCACHE_TILE_COUNTER), not on these dense problems"
            )
        if isinstance(defaults[key], bool):
            if value.lower() not in _TRUE | _FALSE:
                raise ValueError(f"{spec!r}: {key} takes 0/1, got {value!r}")
            switches[key] = value.lower() in _TRUE
        else:
            switches[key] = int(value)
    return tile, switches


def ws_backend(spec: str):
    """A bench `Backend` for a ws spec (see the module docstring)."""
    from hopper_fmha.bench.registry import Backend, BackendSkip

    tile, switches = parse_ws_spec(spec)

    def build(p, q, k, v):
        import torch

        from hopper_fmha import config, kernels

        d = p.head_dim
        dv = p.head_dim_v if p.head_dim_v not in (None, d) else None
        try:
            base = config.select_config(d, "ws", tile or config.auto_tile("ws", d, p.causal, p.seqlen_k), dv)
            launched = config.launch_config(base, p.causal, p.seqlen_q, exact_lse=False)  # out only
            cfg = dataclasses.replace(launched, **switches)
            if "split_o" not in switches:  # follows the tile, stages and row sums, as in select_config
                kd, kdv = cfg.kernel_dims
                split = config.ws_split_o(
                    kd, cfg.tile_m, cfg.tile_n, cfg.num_stages, cfg.mma_rowsum, head_dim_v=kdv
                )
                cfg = dataclasses.replace(cfg, split_o=split)
            config.check_fits_ws(d, cfg.tile_m, cfg.tile_n, cfg.num_stages, cfg.mma_rowsum, head_dim_v=dv)
        except ValueError as e:
            raise BackendSkip(str(e), status="rejected") from e
        fn = kernels.get_kernel(kernels.KernelKey.from_config(p.dtype, p.causal, cfg))
        scale = config.default_softmax_scale(d)

        def call():  # allocates its outputs as flash_attn_func does (inside a graph: from its pool)
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
            lse = torch.empty(p.batch, p.heads, p.seqlen_q, device=q.device, dtype=torch.float32)
            kernels.launch(fn, q, k, v, out, lse, scale, p.causal, ws=True)
            return out

        return call

    return Backend(name=spec, label=spec, build=build, ours=True)


KV_PREFIX = "kv"


def kv_backend(spec: str):
    """`kv[:name=value,...]`: `hopper-fmha:auto` on decode problems with `kernels.KVCACHE_SWITCHES`
    set to these KernelKey fields while it is built and captured (`schedule=single|persistent`
    sets `kernels.SCHEDULE` instead), e.g. `kv:num_stages=3`, `kv:tile_counter=0`."""
    from hopper_fmha import kernels
    from hopper_fmha.bench.registry import Backend, get_backend
    from hopper_fmha.kernels.cache import KernelKey

    head, _, items = spec.partition(":")
    if head != KV_PREFIX:
        raise ValueError(f"not a kv spec: {spec!r}")
    switches: dict = {}
    schedule = None
    for item in filter(None, items.split(",")):
        key, eq, value = item.partition("=")
        if key == "schedule" and value in kernels.SCHEDULES:
            schedule = value
            continue
        if key not in KernelKey._fields or not eq:
            raise ValueError(f"{spec!r}: {item!r} is not field=value; fields: {', '.join(KernelKey._fields)}")
        default = KernelKey._field_defaults.get(key)
        if isinstance(default, bool):
            if value.lower() not in _TRUE | _FALSE:
                raise ValueError(f"{spec!r}: {key} takes 0/1, got {value!r}")
            switches[key] = value.lower() in _TRUE
        else:
            switches[key] = int(value)
    (auto,) = get_backend("hopper-fmha:auto")

    def kvcache(p, *inputs):
        call = auto.kvcache(p, *inputs)

        def with_switches():
            saved = kernels.KVCACHE_SWITCHES, kernels.SCHEDULE
            kernels.KVCACHE_SWITCHES = switches
            kernels.SCHEDULE = schedule or saved[1]
            try:
                return call()
            finally:
                kernels.KVCACHE_SWITCHES, kernels.SCHEDULE = saved

        return with_switches

    return Backend(name=spec, label=spec, build=auto.build, ours=True, kvcache=kvcache)


def resolve(names: list[str]) -> list:
    from hopper_fmha.bench.registry import get_backend

    out = []
    for name in names:
        prefix = name.split("@")[0].split(":")[0]
        if prefix == WS_PREFIX:
            out.append(ws_backend(name))
        elif prefix == KV_PREFIX:
            out.append(kv_backend(name))
        else:
            out.extend(get_backend(name))
    return out


class Smi:
    """nvidia-smi sampling the SM clock (MHz) and board power (W) every `period_ms` in a thread."""

    def __init__(self, gpu: str, period_ms: int = 20):
        self.samples: list[tuple[float, float, float]] = []  # (wall time, MHz, W)
        self.proc = None
        if shutil.which("nvidia-smi") is None:
            print("# nvidia-smi not found: no clock or power", file=sys.stderr)
            return
        cmd = ["nvidia-smi", "-i", gpu, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"]
        self.proc = subprocess.Popen(cmd + ["-lms", str(period_ms)], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                mhz, watts = (float(x) for x in line.split(","))
            except ValueError:  # "[N/A]" and the like
                continue
            self.samples.append((time.time(), mhz, watts))

    def window(self, t0: float, t1: float) -> tuple[float, float]:
        """Mean MHz and W of the samples taken between wall times t0 and t1 (nan if none)."""
        win = [(m, w) for t, m, w in self.samples if t0 <= t <= t1]
        if not win:
            return math.nan, math.nan
        return statistics.fmean(m for m, _ in win), statistics.fmean(w for _, w in win)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()


def replay_for(graph, seconds: float, chunk: int, events: bool = False) -> list:
    """Replay `graph` in chunks of `chunk` replays until `seconds` of wall time have passed,
    keeping one chunk queued ahead of the one waited on, so the GPU never runs dry. With `events`,
    returns [(CUDA event, replays so far)], starting with an event before the first replay."""
    import torch

    def mark():
        e = torch.cuda.Event(enable_timing=events)
        e.record()
        return e

    marks = [(mark(), 0)] if events else []
    done, prev = 0, None
    w0 = time.time()
    while True:
        for _ in range(chunk):
            graph.replay()
        done += chunk
        e = mark()
        if events:
            marks.append((e, done))
        if prev is not None:
            prev.synchronize()
        prev = e
        if time.time() - w0 >= seconds:
            break
    prev.synchronize()
    return marks


def trace(marks: list, calls: int, window_ms: float) -> str:
    """The timed span's ms per call in consecutive windows of about `window_ms` of GPU time."""
    start, out, t_prev, n_prev = marks[0][0], [], 0.0, 0
    for e, n in marks[1:]:
        t = start.elapsed_time(e)
        if t - t_prev >= window_ms:
            out.append(f"{(t - t_prev) / ((n - n_prev) * calls):.4f}")
            t_prev, n_prev = t, n
    return " ".join(out)


def label_match(word: str, label: str) -> bool:
    """`--preset`'s WORD against a problem label: "=LABEL" is the whole label, else every
    space-separated token of WORD is a token of the label ("B1", "q4 causal", "paged16")."""
    if word.startswith("="):
        return label == word[1:]
    return set(word.split()) <= set(label.split())


def problems(args) -> list:
    from hopper_fmha.bench.presets import PRESETS, custom_problems

    if args.preset:
        name, *words = args.preset
        found = [
            p for p in PRESETS[name]().problems if not words or any(label_match(w, p.label()) for w in words)
        ]
        if not found:
            raise SystemExit(f"no problem of preset {name!r} has a label with any of {words}")
        return found

    causals = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]
    out = []
    for causal in causals:
        found = custom_problems(
            args.batch, args.seqlen, None, args.heads, None, args.headdim, causal, args.dtype
        )
        out += [dataclasses.replace(p, head_dim_v=args.headdim_v) for p in found] if args.headdim_v else found
    return sorted(out, key=lambda p: (p.dtype, p.head_dim, p.seqlen_q, p.causal))


def run_problem(p, backends, smi: Smi, args) -> None:
    import torch

    from hopper_fmha.bench.registry import BackendSkip
    from hopper_fmha.bench.runner import Checker, make_inputs
    from hopper_fmha.bench.timing import capture_graph, num_input_sets

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sets = make_inputs(p, num_input_sets(p.input_bytes, l2), "cuda", seed=0)
    checker = Checker(p, *sets[0]) if args.check else None
    graphs = {}
    for b in backends:
        try:
            with b.context():
                fns = [b.make(p, *s) for s in sets]
                out = fns[0]()
                if checker is not None:
                    out = out[0] if isinstance(out, (tuple, list)) else out
                    res = checker.check(out.transpose(1, 2) if b.layout == "bhsd" else out)
                    if not res["passed"]:
                        print(f"{p.label():28s} {b.name:24s} WRONG: {res.get('reason') or res}", flush=True)
                        continue
                # (graph, outputs): the outputs stay referenced while the graph lives, as in the bench.
                graphs[b.name] = capture_graph([fns[i % len(fns)] for i in range(args.calls)])
        except BackendSkip as e:
            print(f"{p.label():28s} {b.name:24s} {e.status}: {e.reason}", flush=True)
        except Exception as e:  # a kernel that does not compile or launch: say so, time the others
            print(f"{p.label():28s} {b.name:24s} error: {type(e).__name__}: {e}", flush=True)
    names = list(graphs)
    if names and args.preheat > 0:  # the first block would otherwise start from an idle card's boost
        replay_for(graphs[names[0]][0], args.preheat, args.chunk)
    results: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.passes):
        for name in names if rep % 2 == 0 else names[::-1]:
            graph = graphs[name][0]
            if args.settle > 0:
                replay_for(graph, args.settle, args.chunk)
            w0 = time.time()
            marks = replay_for(graph, args.seconds, args.chunk, events=True)
            w1 = time.time()
            ms = marks[0][0].elapsed_time(marks[-1][0]) / (marks[-1][1] * args.calls)
            mhz, watts = smi.window(w0 + 0.05, w1)
            results[name].append(ms)
            print(
                f"{p.label():28s} {name:24s} {ms:8.4f} ms {mhz:6.0f} MHz {watts:5.0f} W "
                f"{ms * mhz / 1e3:7.3f} Mcyc {ms * watts:7.1f} mJ",
                flush=True,
            )
            if args.trace > 0:
                print(
                    f"{'':28s} {name:24s} trace ms/call: {trace(marks, args.calls, args.trace)}", flush=True
                )
    if names:
        first = statistics.fmean(results[names[0]])
        parts = [
            f"{n} {statistics.fmean(results[n]):.4f} ({statistics.fmean(results[n]) / first:.4f})"
            for n in names
        ]
        print(f"{p.label():28s} mean ms (÷ {names[0]}): " + ", ".join(parts), flush=True)
    del graphs, sets
    torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Sustained ms per call, SM clock, power, cycles and energy per call, CUDA-graph replays.",
        epilog="See the module docstring (scripts/sustained.py) for the backend names and the output.",
    )
    ap.add_argument(
        "--backends",
        nargs="+",
        default=["hopper-fmha:auto", "fa4"],
        help="bench backend names and ws[@MxN][:switch=value,...] specs (default: hopper-fmha:auto fa4)",
    )
    ap.add_argument(
        "--preset",
        nargs="+",
        metavar=("NAME", "WORD"),
        help="the problems of a bench preset (e.g. decode) that any WORD matches (`label_match`; all "
        "without one), in place of --headdim/--seqlen/...",
    )
    ap.add_argument("--headdim", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--seqlen", nargs="+", type=int, default=[4096])
    ap.add_argument("--causal", choices=("no", "yes", "both"), default="no")
    ap.add_argument("--dtype", nargs="+", default=["fp16"], help="fp16 and/or bf16")
    ap.add_argument("--batch", type=int, default=None, help="default 16384 / seqlen")
    ap.add_argument("--heads", type=int, default=None, help="default 2048 / headdim")
    ap.add_argument("--headdim-v", type=int, default=None, help="v's head dim (default: --headdim)")
    ap.add_argument("--passes", type=int, default=2, help="timed passes per backend (default 2)")
    ap.add_argument(
        "--preheat", type=float, default=1.0, help="untimed seconds of the first backend per problem (1.0)"
    )
    ap.add_argument("--settle", type=float, default=0.4, help="untimed seconds before each timed span (0.4)")
    ap.add_argument("--seconds", type=float, default=1.0, help="timed seconds per backend and pass (1.0)")
    ap.add_argument("--calls", type=int, default=10, help="calls per CUDA graph (10)")
    ap.add_argument("--chunk", type=int, default=5, help="graph replays between synchronizations (5)")
    ap.add_argument("--trace", type=float, default=0.0, metavar="MS", help="also print ms per call per MS ms")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness check")
    ap.add_argument(
        "--smi-id",
        default=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
        help="nvidia-smi -i of the GPU timed (default: the first of CUDA_VISIBLE_DEVICES, else 0)",
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backends = resolve(args.backends)  # spelling errors before any GPU work
    import torch

    if not torch.cuda.is_available():
        print("scripts/sustained.py: no CUDA GPU", file=sys.stderr)
        return 2
    import hopper_fmha
    from hopper_fmha.bench.runner import source_digest

    print(
        f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, hopper_fmha from "
        f"{os.path.dirname(hopper_fmha.__file__)} (sources {source_digest()})",
        flush=True,
    )
    print(
        f"# settle {args.settle} s, timed {args.seconds} s x {args.passes} passes, "
        f"{args.calls} calls per graph"
    )
    smi = Smi(args.smi_id)
    try:
        time.sleep(0.5)  # the first nvidia-smi samples
        for p in problems(args):
            run_problem(p, backends, smi, args)
    finally:
        smi.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
