"""Results: the JSON file (the record of a run), and the Markdown and terminal tables made from it.

Everything here reads only the results dict, so reports can be regenerated from a JSON file
on any machine (`hopper-fmha bench --from-json FILE`).

Ratios between backends (÷FA2, ÷best peer, the summary) use the "primary" time: the CUDA-graph
time (kernel time) where the backend was captured, else the eager time, marked "(e)". Eager
times include host overhead and have their own table and ratio column.

A run with varlen problems (the `varlen` preset) also has the varlen table: per varlen problem and
backend of ours, its rate, FA4's on the same problem, our dense twin's (`presets.dense_twin`, the
same backend, found among the run's problems) and the padded call's (`hopper-fmha:padded`), and
ours divided by each, against the targets (`VARLEN_TARGETS`).

A run with decode problems (the `decode` preset) also has the decode table: per decode problem and
backend of ours, TB/s of K and V read (`bandwidth`: `Problem.kv_bytes` over the same time as the
TFLOP/s), cuDNN's and FA4's, ours ÷ the best peer, the `copy` yardstick's TB/s and ours as a
percentage of it, and ours ÷ ours on the twin cell (`presets.decode_twin`), against
`DECODE_TARGETS`. The copy is no attention: the TFLOP/s tables leave it out.

A run with training problems (the `backward` and `backward-features` presets: `Problem.passes`
"bwd" or "fwd+bwd") has a "pass" column in the TFLOP/s tables, a summary subset per pass, the
training FLOPs and check in the method line, and in the details the gradient (dq, dk or dv) whose
error is shown. They are timed eagerly only, so their ratios use eager time, marked (e).

A run with score features or a v head dim of their own (the `features` and `backward-features`
presets: `Problem.window_size`, `softcap`, `sink`, `head_dim_v`) has a "features" column in the
TFLOP/s tables (d shown as d/dv where they differ), the FLOP rules in the method line
(`FEATURES_NOTE`), and the features table: per dense problem (forward or training) and backend of
ours, its rate, FA4's and cuDNN's and ours divided by each, and ours on the problem ÷ ours on its
twin without the feature in the same pass (`presets.feature_twin`: window ÷ causal, softcap ÷
plain, sink ÷ plain), against `FEATURE_TARGETS`.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from hopper_fmha.bench.flops import FWD, PASS_FLOPS, tflops
from hopper_fmha.bench.presets import decode_twin, dense_twin, feature_twin
from hopper_fmha.bench.registry import BEST_PEERS, COPY, FA2, PADDED, REGISTRY, Problem

SCHEMA = "hopper-fmha-bench/1"
MISSING = "–"
PRIMARY = "primary"  # graph time where there is one, else eager
FALLBACK = " (e)"  # marks a primary number that is eager time (no CUDA graph)
RATIO_RULE = "ratios use kernel time (CUDA graph); eager includes host overhead"
BEST_TEXT = "best of " + "/".join(REGISTRY[n].label if n in REGISTRY else n for n in BEST_PEERS)
# The sweep's summary is also given for long and for short sequences.
SUBSETS = (
    ("all", lambda p: True),
    ("N≥2048", lambda p: p.seqlen_q >= 2048),
    ("N∈{512,1024}", lambda p: p.seqlen_q in (512, 1024)),
)
# Ours on a varlen problem ÷ FA4 on it, and ÷ ours on its dense twin: the varlen issue's targets.
VARLEN_TARGETS = {"fa4": 1.0, "twin": 0.95}
# Ours on a decode cell ÷ the best peer on it, and a paged cell ÷ ours on its dense twin.
DECODE_TARGETS = {"peer": 1.0, "paged": 0.9}
# Ours on a feature problem ÷ FA4 on it, and ÷ ours on its twin without the feature (window ÷
# causal, softcap ÷ plain): the features issue's targets.
FEATURE_TARGETS = {"fa4": 1.0, "twin": 0.9}


def steady_text(steady_ms: float) -> str:
    """The method line's words for the untimed start of every block (`--steady-ms`)."""
    if not steady_ms:
        return ""
    return f", each block after {steady_ms:g} ms of untimed calls of the same backend"


def num_samples(t: dict) -> int:
    """Samples behind a timing (results written before `num_samples` list every sample)."""
    return t["num_samples"] if "num_samples" in t else len(t["samples_ms"])


def samples_text(per_round: int, rounds: int, block_ms: float) -> str:
    """The method line's words for the samples of a block (`--block-ms`: more where short)."""
    if not block_ms:
        return f"{per_round} samples per mode and round: median of all {per_round * rounds} samples"
    return (
        f"{per_round} samples per mode and round, {per_round} more at a time until the block's "
        f"samples cover {block_ms:g} ms of GPU time: median of all of them"
    )


def settle_text(settle: int) -> str:
    """The method line's words for the untimed rounds after the pre-heat."""
    if not settle:
        return ""
    return f" and {settle} untimed round{'s' if settle > 1 else ''} of every backend"


def new_results(preset: str, env: dict, settings: dict, command: str, tag: str | None = None) -> dict:
    return {
        "schema": SCHEMA,
        "preset": preset,
        "tag": tag,
        "command": command,
        "env": env,
        "settings": settings,
        "matmul": None,
        "matmul_end": None,
        "records": [],
        "summary": None,  # claims_summary(), written at the end of the run
        "complete": False,
    }


def output_stem(results: dict) -> str:
    """<preset>-<device-slug>-<UTC date and time>[-<tag>]."""
    date = results["env"]["date"][:16].replace(":", "").replace("-", "")  # 20261121T0530
    tag = f"-{results['tag']}" if results.get("tag") else ""
    return f"{results['preset']}-{results['env']['device_slug']}-{date}{tag}"


def write_json(results: dict, path: Path) -> None:
    path = Path(path)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    tmp.replace(path)


def load_results(path) -> dict:
    results = json.loads(Path(path).read_text())
    if results.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a hopper-fmha bench result (schema {results.get('schema')!r})")
    return results


def rate(rec: dict, mode: str) -> float | None:
    """TFLOP/s of a record in mode "eager", "graph" or PRIMARY (graph, else eager); None when
    not timed."""
    if mode == PRIMARY:
        r = rate(rec, "graph")
        return r if r is not None else rate(rec, "eager")
    t = rec.get(mode)
    if not t or rec["status"] not in ("ok", "wrong"):
        return None
    return tflops(rec["flops"], t["median_ms"])


def bandwidth(rec: dict, mode: str) -> float | None:
    """TB/s of K and V read (`Problem.kv_bytes`) in the time `rate` uses; None when not timed.
    (rate = flops / time, so bytes / time = rate · bytes / flops.)"""
    r = rate(rec, mode)
    return None if r is None else r * Problem.from_dict(rec["problem"]).kv_bytes / rec["flops"]


def fell_back(rec: dict | None, mode: str) -> bool:
    """Whether a PRIMARY rate of this record is eager time (no graph timing)."""
    return bool(rec) and mode == PRIMARY and rate(rec, "graph") is None and rate(rec, "eager") is not None


def mode_text(mode: str) -> str:
    return {"eager": "eager", "graph": "CUDA graph", PRIMARY: "CUDA graph; (e) eager where no graph"}[mode]


def matmul_rate(results: dict) -> float | None:
    return (results.get("matmul") or {}).get("tflops")


def by_problem(results: dict) -> list[tuple[Problem, dict[str, dict]]]:
    """Records grouped by problem, in run order: [(problem, {backend name: record})]."""
    groups: dict[Problem, dict[str, dict]] = {}
    for rec in results["records"]:
        groups.setdefault(Problem.from_dict(rec["problem"]), {})[rec["backend"]] = rec
    return list(groups.items())


def backends_in(results: dict, timed_only: bool = True) -> list[tuple[str, str, bool]]:
    """(name, label, ours) of the backends, ours first, in run order; with timed_only, those
    that produced at least one timing."""
    seen: dict[str, tuple[str, str, bool]] = {}
    for rec in results["records"]:
        if not timed_only or rec["status"] in ("ok", "wrong"):
            seen.setdefault(rec["backend"], (rec["backend"], rec["label"], rec["ours"]))
    return sorted(seen.values(), key=lambda b: not b[2])


def good_record(recs: dict[str, dict], name: str, mode: str) -> dict | None:
    """Backend `name`'s record on one problem if it is correct and has a rate in `mode`."""
    rec = recs.get(name)
    return rec if rec and rec["status"] == "ok" and rate(rec, mode) is not None else None


def reference_records(recs: dict[str, dict], mode: str) -> tuple[dict | None, dict | None]:
    """(FA2 record, fastest record among BEST_PEERS) for one problem, those with a rate in
    `mode`; wrong results do not count."""
    peers = [r for r in (good_record(recs, n, mode) for n in BEST_PEERS) if r is not None]
    return good_record(recs, FA2, mode), max(peers, key=lambda r: rate(r, mode)) if peers else None


def reference_rates(recs: dict[str, dict], mode: str) -> tuple[float | None, float | None]:
    """(FA2 rate, best rate among BEST_PEERS) for one problem; wrong results do not count."""
    fa2, best = reference_records(recs, mode)
    return (rate(fa2, mode) if fa2 else None), (rate(best, mode) if best else None)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return MISSING if x is None else f"{x:{spec}}{suffix}"


def _cell(rec: dict | None, mode: str, value=rate, spec: str = ".1f") -> str:
    """A record's `value` (TFLOP/s, or `bandwidth`), marked (e) and ✗, or why it has none."""
    if rec is None:
        return MISSING
    if rec["status"] == "rejected":
        return "rejected"
    if rec["status"] in ("skipped", "error"):
        return rec["status"]
    r = value(rec, mode)
    mark = FALLBACK if fell_back(rec, mode) else ""
    return _fmt(r, spec) + mark + (" ✗" if rec["status"] == "wrong" and r is not None else "")


def _ratio_cell(
    rec: dict | None, ref: dict | None, mode: str, value=rate, spec: str = ".2f", suffix: str = "×"
) -> str:
    """ours ÷ a reference, marked (e) when either is eager time in PRIMARY mode, ✗ when ours is
    wrong; `value` as `_cell`'s (a percentage: spec ".0%", no suffix)."""
    if rec is None or ref is None:
        return MISSING
    r = ratio(value(rec, mode), value(ref, mode))
    if r is None:
        return MISSING
    mark = FALLBACK if fell_back(rec, mode) or fell_back(ref, mode) else ""
    return _fmt(r, spec, suffix) + mark + (" ✗" if rec["status"] == "wrong" else "")


def _problem_cells(p: Problem, passes: bool = False, features: bool = False) -> list[str]:
    """The problem columns of a TFLOP/s table (`PROBLEM_HEADERS`, d as d/dv where v's differs),
    then with `passes` its pass, with `features` its score features ("–": none)."""
    n = str(p.seqlen_q) if p.seqlen_q == p.seqlen_k else f"{p.seqlen_q}/{p.seqlen_k}"
    if p.seqlens is not None:
        n = f"varlen {min(p.seqlens)}–{p.seqlen_q}"
    if p.kvcache:
        n = f"{p.seqlen_q}/cache {p.seqlen_k}" + f" paged{p.page_size}" * bool(p.page_size)
        n += " ragged" * bool(p.cache_seqlens)
    h = str(p.heads) if p.heads == p.kv_heads else f"{p.heads}/{p.kv_heads}"
    d = str(p.head_dim) if p.head_dim_v is None else f"{p.head_dim}/{p.head_dim_v}"
    cells = [str(p.batch), n, h, d, "yes" if p.causal else "no", p.dtype] + [p.passes] * passes
    return cells + [", ".join(p.feature_words()) or MISSING] * features


PROBLEM_HEADERS = ["B", "N", "H", "d", "causal", "dtype"]
PASS_HEADER = "pass"  # after PROBLEM_HEADERS where the run has training problems
FEATURES_HEADER = "features"  # after those where the run has score features or a v head dim


def has_training(results: dict) -> bool:
    """Whether the run has a training problem (a backward: `Problem.passes` not "fwd")."""
    return any(r["problem"].get("passes", FWD) != FWD for r in results["records"])


def has_features(results: dict) -> bool:
    """Whether the run has a problem with a score feature or a v head dim of its own (the keys
    `Problem.to_dict` writes only where set)."""
    keys = ("window_size", "softcap", "sink", "head_dim_v")
    return any(key in r["problem"] for r in results["records"] for key in keys)


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def has_graph(results: dict) -> bool:
    return any(rate(r, "graph") is not None for r in results["records"])


def rate_table(results: dict, mode: str) -> str | None:
    """Problems x backends TFLOP/s, then each of ours divided by FA2 and by the best peer (the
    copy yardstick left out: it does no attention)."""
    groups = by_problem(results)
    backends = [b for b in backends_in(results) if b[0] != COPY]
    if not any(rate(r, mode) for _, recs in groups for r in recs.values()):
        return None
    ours = [b for b in backends if b[2]]
    has_fa2 = any(reference_records(recs, mode)[0] for _, recs in groups)
    has_best = any(reference_records(recs, mode)[1] for _, recs in groups)
    passes, features = has_training(results), has_features(results)
    headers = (
        PROBLEM_HEADERS + [PASS_HEADER] * passes + [FEATURES_HEADER] * features + [b[1] for b in backends]
    )
    for _, label, _ in ours:
        headers += [f"{label} ÷ FA2"] * has_fa2 + [f"{label} ÷ best peer"] * has_best
    rows = []
    for p, recs in groups:
        fa2, best = reference_records(recs, mode)
        row = _problem_cells(p, passes, features) + [_cell(recs.get(name), mode) for name, _, _ in backends]
        for name, _, _ in ours:
            if has_fa2:
                row.append(_ratio_cell(recs.get(name), fa2, mode))
            if has_best:
                row.append(_ratio_cell(recs.get(name), best, mode))
        rows.append(row)
    return md_table(headers, rows)


def geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def ratio_to_best(recs: dict[str, dict], name: str, mode: str) -> tuple[float, bool] | None:
    """(backend `name`'s rate ÷ the best peer's, whether either side is eager time standing in
    for graph) for one problem's records; None where `name` is not ok or no peer has a rate."""
    rec, (_, best) = recs.get(name), reference_records(recs, mode)
    if rec is None or rec["status"] != "ok" or best is None or rate(rec, mode) is None:
        return None
    return rate(rec, mode) / rate(best, mode), fell_back(rec, mode) or fell_back(best, mode)


def claims_summary(results: dict) -> dict:
    """Per backend of ours: the geometric mean over problems of ours ÷ the best peer, and on how
    many problems ours is at least as fast, in "graph" mode (PRIMARY: graph time, eager where a
    side has no graph, counted in `eager_fallbacks`) and in "eager" mode. Over all problems, and
    when the run has both long (N ≥ 2048) and short (N 512, 1024) sequences, over each group;
    when it has several passes (`Problem.passes`: "bwd", "fwd+bwd"), over each pass.
    Problems where ours is wrong or no peer has a correct timing are left out (`problems` counts
    those compared, `of` those in the group)."""
    groups = by_problem(results)
    seqlens = {p.seqlen_q for p, _ in groups}
    subsets = SUBSETS if any(n >= 2048 for n in seqlens) and seqlens & {512, 1024} else SUBSETS[:1]
    subsets = list(subsets) + pass_subsets([p for p, _ in groups])
    rows = []
    for name, _, ours in backends_in(results, timed_only=False):
        if not ours:
            continue
        these = []
        for subset, keep in subsets:
            chosen = [recs for p, recs in groups if keep(p)]
            for key, mode in (("graph", PRIMARY), ("eager", "eager")):
                compared = [c for c in (ratio_to_best(recs, name, mode) for recs in chosen) if c]
                ratios, fallbacks = [r for r, _ in compared], sum(fb for _, fb in compared)
                g = geomean(ratios)
                these.append({
                    "backend": name, "subset": subset, "mode": key,
                    "geomean": None if g is None else round(g, 4),
                    "wins": sum(r >= 1 for r in ratios), "problems": len(ratios), "of": len(chosen),
                    "eager_fallbacks": fallbacks,
                })  # fmt: skip
        if any(r["problems"] for r in these):
            rows += these
    return {"versus": BEST_TEXT, "rule": RATIO_RULE, "rows": rows}


def pass_subsets(problems: list[Problem]) -> list[tuple[str, Callable[[Problem], bool]]]:
    """A summary subset per pass of the problems, in `PASS_FLOPS` order ("fwd", "bwd",
    "fwd+bwd"), named after it; none where they all have the same pass."""
    found = {p.passes for p in problems}
    if len(found) < 2:
        return []
    return [(name, lambda p, name=name: p.passes == name) for name in PASS_FLOPS if name in found]


def summary_lines(results: dict) -> list[str]:
    """The claims summary as text lines (one per backend and subset), [] when nothing compares."""
    rows = claims_summary(results)["rows"]
    if not rows:
        return []
    cells = defaultdict(dict)
    for r in rows:
        cells[(r["backend"], r["subset"])][r["mode"]] = r

    def part(r):
        if not r or r["geomean"] is None:
            return f"{MISSING:>6}"
        fb = f", {r['eager_fallbacks']} eager" if r["eager_fallbacks"] and r["mode"] == "graph" else ""
        return f"{r['geomean']:.3f}× (≥ best on {r['wins']}/{r['problems']}{fb})"

    width = max(len(b) for b, _ in cells)
    sub_w = max(len(s) for _, s in cells)
    lines = [f"summary: ours ÷ {BEST_TEXT}, geometric mean over problems; {RATIO_RULE}"]
    for (backend, subset), modes in cells.items():
        lines.append(
            f"  {backend:{width}}  {subset:{sub_w}}  graph {part(modes.get('graph'))}  "
            f"eager {part(modes.get('eager'))}"
        )
    return lines


def summary_table(results: dict) -> str | None:
    rows = claims_summary(results)["rows"]
    if not rows:
        return None
    cells = defaultdict(dict)
    for r in rows:
        cells[(r["backend"], r["subset"])][r["mode"]] = r
    out = []
    for (backend, subset), modes in cells.items():
        g, e = modes["graph"], modes["eager"]
        out.append([
            f"`{backend}`", subset, f"{g['problems']}/{g['of']}",
            _fmt(g["geomean"], ".3f", "×"), f"{g['wins']}/{g['problems']}",
            _fmt(e["geomean"], ".3f", "×"), f"{e['wins']}/{e['problems']}",
            str(g["eager_fallbacks"]),
        ])  # fmt: skip
    headers = ["backend", "subset", "compared", "geomean ÷ best (graph)", "≥ best (graph)",
               "geomean ÷ best (eager)", "≥ best (eager)", "eager fallbacks (graph)"]  # fmt: skip
    return md_table(headers, out)


VARLEN_HEADERS = [
    "problem", "backend", "TFLOP/s", "FA4", f"÷ FA4 (≥ {VARLEN_TARGETS['fa4']})", "dense twin",
    "twin TFLOP/s", f"÷ twin (≥ {VARLEN_TARGETS['twin']})", "padded", "÷ padded",
]  # fmt: skip


VARLEN_NOTE = (
    "FLOPs per sequence, on the real tokens, for every backend (the padded call included). Dense "
    "twin: batch = the number of sequences, N = the RMS of the lengths rounded to a multiple of "
    "128, timed with the same backend; padded: our dense kernel on the batch zero-padded to the "
    "longest sequence (non-causal: timed, not checked, its rows see the padded keys)."
)


def varlen_rows(results: dict, mode: str = PRIMARY) -> list[list[str]]:
    """The varlen table's rows (module docstring): one per varlen problem and backend of ours
    that ran on it; ratios to correct results only, "–" where the run lacks one."""
    groups = dict(by_problem(results))
    ours = [name for name, _, is_ours in backends_in(results, timed_only=False) if is_ours and name != PADDED]
    rows = []
    for p, recs in groups.items():
        if p.seqlens is None:
            continue
        twin = dense_twin(p)
        twin_recs = groups.get(twin, {})
        fa4, padded = good_record(recs, "fa4", mode), good_record(recs, PADDED, mode)
        for name in ours:
            if name not in recs:
                continue
            rec = recs[name]
            rows.append([
                p.label(), name, _cell(rec, mode), _cell(recs.get("fa4"), mode), _ratio_cell(rec, fa4, mode),
                f"B{twin.batch} N{twin.seqlen_q}", _cell(twin_recs.get(name), mode),
                _ratio_cell(rec, good_record(twin_recs, name, mode), mode),
                _cell(recs.get(PADDED), mode), _ratio_cell(rec, padded, mode),
            ])  # fmt: skip
    return rows


DECODE_HEADERS = [
    "problem", "GB read", "backend", "TB/s", "cuDNN", "FA4", f"÷ best peer (≥ {DECODE_TARGETS['peer']})",
    "copy", "% of copy", "twin", f"÷ twin (paged ≥ {DECODE_TARGETS['paged']})",
]  # fmt: skip


DECODE_NOTE = (
    "TB/s = the K and V bytes of the tokens attended (Σ over sequences of length · kv_heads · 2d · 2 "
    "bytes; GB read) ÷ time, for every backend. cuDNN: SDPA on dense caches only, with a boolean "
    "mask where keys are hidden (ragged lengths; causal with several queries), so it reads the "
    "whole capacity. FA4: `flash_attn_varlen_func` with seqused_k and page_table, unsplit (it has "
    "no split-KV on sm90). Copy: a device-to-device copy of the same bytes in the same run, its "
    "TB/s counting the bytes it reads (it writes as many: its memory traffic is twice that); "
    "% of copy = ours ÷ copy. Twin: the same cell with a dense cache (paged cells; target ≥ "
    f"{DECODE_TARGETS['paged']}) or a full one (ragged cells: ≈ 1 when the cost is in proportion to "
    "the tokens read). The issue's floors: ≥ 4.4 TB/s at B64 L8192 q1 dense, ≥ 4.0 at batch 1–4 "
    "with 128k cached tokens. The TFLOP/s tables count 4·H·Nq·len·d per sequence for these cells, "
    "not halved for causal."
)


def decode_rows(results: dict, mode: str = PRIMARY) -> list[list[str]]:
    """The decode table's rows (module docstring): one per decode problem and backend of ours
    that ran on it; ratios to correct results only, "–" where the run lacks one."""
    groups = dict(by_problem(results))
    ours = [name for name, _, is_ours in backends_in(results, timed_only=False) if is_ours and name != PADDED]
    rows = []

    def tb(rec: dict | None) -> str:
        return _cell(rec, mode, bandwidth, ".2f")

    for p, recs in groups.items():
        if not p.kvcache:
            continue
        best, copy = reference_records(recs, mode)[1], good_record(recs, COPY, mode)
        twin = decode_twin(p)
        twin_recs = groups.get(twin, {}) if twin else {}
        kind = MISSING if twin is None else "dense" if p.page_size else "full"
        for name in (n for n in ours if n in recs):
            rec = recs[name]
            rows.append([
                p.label(), f"{p.kv_bytes / 1e9:.2f}", name, tb(rec), tb(recs.get("sdpa-cudnn")),
                tb(recs.get("fa4")), _ratio_cell(rec, best, mode), tb(recs.get(COPY)),
                _ratio_cell(rec, copy, mode, bandwidth, ".0%", ""), kind,
                _ratio_cell(rec, good_record(twin_recs, name, mode), mode, bandwidth),
            ])  # fmt: skip
    return rows


FEATURE_HEADERS = [
    "problem", "backend", "TFLOP/s", "FA4", f"÷ FA4 (≥ {FEATURE_TARGETS['fa4']})", "cuDNN", "÷ cuDNN",
    "without the feature", "its TFLOP/s", f"÷ without (≥ {FEATURE_TARGETS['twin']})",
]  # fmt: skip


FEATURES_NOTE = (
    "- score features: FLOPs under a sliding window count the visible (query, key) pairs exactly, "
    "2·B·H·(d + dv) per pair (row i sees key j iff i + Nk − Nq − left ≤ j ≤ i + Nk − Nq + right; "
    "causal sets right = 0); otherwise 2·B·H·Nq·Nk·(d + dv), halved for causal (dv: v's head dim, "
    "shown as d/dv where it differs); softcap and sink add none. Every backend gets the same window, "
    "softcap and sink, and the reference applies them. cuDNN (SDPA) has no window, softcap or sink: "
    "those cells are skipped, not emulated with a mask."
)

FEATURE_TABLE_NOTE = (
    "Per problem, ours ÷ FA4 and ÷ cuDNN on it (correct results only), and ours ÷ ours on the same "
    "problem without its feature, in the same run: the window ÷ the causal problem (TFLOP/s on the "
    f"visible keys; target ≥ {FEATURE_TARGETS['twin']}), softcap ÷ plain (the softcap's cost; target ≥ "
    f"{FEATURE_TARGETS['twin']}), sink ÷ plain. Target ÷ FA4 ≥ {FEATURE_TARGETS['fa4']} (head dims 96 "
    "and 192/128 included)."
)


def feature_rows(results: dict, mode: str = PRIMARY) -> list[list[str]]:
    """The features table's rows (module docstring): one per problem (of a run with features)
    and backend of ours that ran on it, dense problems only (forward or training); ratios to
    correct results only, "–" where the run lacks one."""
    if not has_features(results):
        return []
    groups = dict(by_problem(results))
    ours = [name for name, _, is_ours in backends_in(results, timed_only=False) if is_ours and name != PADDED]
    rows = []
    for p, recs in groups.items():
        if p.seqlens is not None or p.kvcache:
            continue
        twin = feature_twin(p)
        twin_recs = groups.get(twin, {}) if twin else {}
        fa4, cudnn = good_record(recs, "fa4", mode), good_record(recs, "sdpa-cudnn", mode)
        for name in (n for n in ours if n in recs):
            rec = recs[name]
            rows.append([
                p.label(), name, _cell(rec, mode), _cell(recs.get("fa4"), mode), _ratio_cell(rec, fa4, mode),
                _cell(recs.get("sdpa-cudnn"), mode), _ratio_cell(rec, cudnn, mode),
                twin.label() if twin else MISSING, _cell(twin_recs.get(name), mode),
                _ratio_cell(rec, good_record(twin_recs, name, mode), mode),
            ])  # fmt: skip
    return rows


def tile_grids(results: dict, mode: str = PRIMARY) -> list[tuple[str, list[str], list[list[str]], list]]:
    """Seed-paper Table 1: per variant, problems x tiles. [(variant, tiles, rows, cells)] where
    cells holds (problem, tile, rate or None, status, eager fallback) for the plots."""
    grids: dict[str, dict] = defaultdict(lambda: {"tiles": [], "cells": {}})
    for rec in results["records"]:
        name = rec["backend"]
        if not rec["ours"] or "@" not in name:
            continue
        variant, tile = name.removeprefix("hopper-fmha:").split("@")
        g = grids[variant]
        if tile not in g["tiles"]:
            g["tiles"].append(tile)
        g["cells"][(Problem.from_dict(rec["problem"]), tile)] = rec
    out = []
    for variant, g in grids.items():
        problems = list(dict.fromkeys(p for p, _ in g["cells"]))
        rows, cells = [], []
        for p in problems:
            rates = {t: rate(g["cells"][(p, t)], mode) for t in g["tiles"] if (p, t) in g["cells"]}
            best = max((r for r in rates.values() if r is not None), default=None)
            row = [p.label()]
            for t in g["tiles"]:
                rec = g["cells"].get((p, t))
                cell = _cell(rec, mode)
                if best is not None and rates.get(t) == best:
                    cell = f"**{cell}**"
                row.append(cell)
                cells.append((p, t, rates.get(t), rec["status"] if rec else None, fell_back(rec, mode)))
            rows.append(row)
        out.append((variant, g["tiles"], rows, cells))
    return out


def _env_lines(results: dict) -> list[str]:
    env = results["env"]
    dev = env.get("device", "?")
    if env.get("capability"):
        l2 = env.get("l2_bytes")
        dev += f" (sm {env['capability']}, {env.get('sm_count')} SMs, {env.get('memory_gib')} GiB"
        dev += f", L2 {l2 / 2**20:.0f} MiB)" if l2 else ")"
    versions = [f"torch {env.get('torch')}", f"CUDA {env.get('cuda')}", f"cuDNN {env.get('cudnn')}"]
    code = [f"git {env['git']}"] if env.get("git") else []
    code += [f"sources {env['sources']}"] if env.get("sources") else []
    versions += [f"hopper-fmha {env.get('hopper-fmha')}" + (f" ({', '.join(code)})" if code else "")]
    versions += [f"{k} {v}" for k, v in env.get("versions", {}).items()]
    lines = [
        f"- date: {env.get('date')}",
        f"- command: `{results.get('command')}`",
        f"- device: {dev}, driver {env.get('driver') or '?'}",
        f"- versions: {', '.join(versions)}",
    ]
    mm, mm_end = results.get("matmul"), results.get("matmul_end")
    if mm:
        line = f"- cuBLAS fp16 {mm['shape'][0]}³ matmul: **{mm['tflops']:.1f} TFLOP/s** (median"
        line += f", pre-heated, {mm['rounds']} rounds)" if mm.get("rounds") else ")"
        if mm_end:
            line += f"; {mm_end['tflops']:.1f} at the end of the run"
        lines.append(line)
    s = results.get("settings", {})
    rounds = s.get("rounds")
    if rounds:
        per_round = math.ceil(s.get("iters", 0) / rounds)
        timing = (
            f"Per problem every backend is checked, warmed up ({s.get('warmup')} calls) and captured; "
            f"then, after {s.get('preheat_ms', 0) / 1e3:.2f} s of sustained matmul load"
            f"{settle_text(s.get('settle_rounds', 0))}, all are timed "
            f"in {rounds} interleaved round(s), round-robin (first backend rotating, eager/graph order "
            f"alternating){steady_text(s.get('steady_ms', 0))}, "
            f"{samples_text(per_round, rounds, s.get('block_ms', 0))}, CUDA events."
        )
    else:  # results written before rounds existed
        timing = f"Median of {s.get('iters')} samples after {s.get('warmup')} warm-up calls, CUDA events."
    lines.append(
        "- method: FLOPs = 4·B·H·Nq·Nk·d, halved for causal (varlen: summed over the sequences). "
        f"{timing} Eager: back-to-back calls from Python (host overhead included); graph: CUDA-graph "
        "replays (kernel time). Inputs rotate over sets totalling > 2×L2. Correct (else ✗): max abs "
        "error vs the fp32 reference ≤ 2× that of PyTorch in the input dtype + eps·max|ref|."
    )
    if has_training(results):
        lines.append(TRAINING_NOTE)
    if has_features(results):
        lines.append(FEATURES_NOTE)
    lines.append(
        f"- **{RATIO_RULE[0].upper() + RATIO_RULE[1:]}**: ÷FA2, ÷best peer ({BEST_TEXT}, correct "
        "results only), the summary and the charts use CUDA-graph time, or eager time marked (e) "
        "for a backend that could not be captured."
    )
    if not results.get("complete", True):
        lines.append("- **incomplete run** (stopped early; see the last records)")
    return lines


TRAINING_NOTE = (
    f"- training passes: bwd = the backward alone, `torch.autograd.grad(out, (q, k, v), dout, "
    f"retain_graph=True)` after one untimed forward; fwd+bwd = the forward then that grad; every "
    f"backend through autograd, dout random. FLOPs: bwd {PASS_FLOPS['bwd']:g}×, fwd+bwd "
    f"{PASS_FLOPS['fwd+bwd']:g}× the forward's (FlashAttention's convention, causal halved). Timed "
    "eagerly only (no CUDA graph: autograd runs a backward op on its forward op's stream), so "
    "their ratios use eager time (e). Correct: each of dq, dk, dv by the rule above, against "
    "the fp32 reference's and PyTorch's gradients by autograd (score features included; varlen: "
    "per sequence). A learnable sink requires grad: the backends compute its gradient, which is "
    "not checked."
)


def _ms(t: dict | None) -> str:
    return f"{t['median_ms']:.3f} [{t['min_ms']:.3f}–{t['max_ms']:.3f}]" if t else MISSING


def round_spread(t: dict | None) -> float | None:
    """(max − min) of the per-round medians over the overall median: the drift across rounds."""
    meds = (t or {}).get("round_medians_ms")
    if not meds or len(meds) < 2:
        return None
    return (max(meds) - min(meds)) / t["median_ms"]


def details_table(results: dict) -> str:
    mm = matmul_rate(results)
    rows = []
    for rec in results["records"]:
        p = Problem.from_dict(rec["problem"])
        e, g = rec.get("eager"), rec.get("graph")
        chk = rec.get("check") or {}
        err = MISSING
        if chk.get("max_abs_err") is not None:
            which = f" ({chk['grad']})" if chk.get("grad") else ""  # a training problem's gradient
            err = f"{chk['max_abs_err']:.2e} / {chk['tol']:.2e}{which}"
        elif chk.get("reason"):
            err = chk["reason"]
        status = rec["status"] + (f": {rec['reason']}" if rec.get("reason") else "")
        if rec.get("graph_reason"):
            status += f"; graph n/a: {rec['graph_reason']}"
        re_, rg = rate(rec, "eager"), rate(rec, "graph")
        pct = f"{_fmt(ratio(rg, mm), '.0%')} / {_fmt(ratio(re_, mm), '.0%')}" if mm else MISSING
        calls = " / ".join(f"{t['calls_per_sample']}×{num_samples(t)}" if t else MISSING for t in (g, e))
        spread = f"{_fmt(round_spread(g), '.1%')} / {_fmt(round_spread(e), '.1%')}"
        rows.append([
            p.label(), rec["backend"], _ms(g), _ms(e), _fmt(rg), _fmt(re_), pct, spread, err, calls,
            status.replace("|", "/"),
        ])  # fmt: skip
    headers = ["problem", "backend", "graph ms med [min–max]", "eager ms med [min–max]", "graph TFLOP/s",
               "eager TFLOP/s", "% matmul graph / eager", "round spread graph / eager", "max err / tol",
               "calls×samples graph / eager", "status"]  # fmt: skip
    return md_table(headers, rows)


def profile_rows(results: dict) -> list[list[str]]:
    mm = matmul_rate(results)
    rows = []
    for rec in results["records"]:
        prof = rec.get("profile")
        if prof is None or rec["status"] not in ("ok", "wrong"):
            continue
        e, g = rec.get("eager"), rec.get("graph")
        host = (e["median_ms"] - g["median_ms"]) * 1e3 if e and g else None
        comp, load = prof.get("compile_s"), prof.get("cached_load_s")
        rows.append([
            Problem.from_dict(rec["problem"]).label(),
            rec["backend"],
            _fmt(ratio(rate(rec, "eager"), mm), ".1%"),
            _fmt(ratio(rate(rec, "graph"), mm), ".1%"),
            _fmt(host, ".1f"),
            _fmt(prof.get("launch_us"), ".1f"),
            _fmt(comp, ".2f") if comp is not None else (prof.get("reason") or MISSING),
            _fmt(load, ".3f"),
        ])  # fmt: skip
    return rows


def host_stage_table(results: dict) -> str:
    """Host µs per call of each stage of our eager path (`bench.hostpath`), where profiled."""
    rows, stages = [], []
    for rec in results["records"]:
        found = (rec.get("profile") or {}).get("host_stages_us")
        if not found:
            continue
        if "reason" in found:
            rows.append((rec, {}, found["reason"]))
            continue
        stages = stages or list(found)
        rows.append((rec, found, ""))
    if not rows:
        return ""
    headers = ["problem", "backend", *stages, "note"]
    body = [
        [Problem.from_dict(rec["problem"]).label(), rec["backend"]]
        + [_fmt(found.get(name), ".1f") for name in stages]
        + [note or ""]
        for rec, found, note in rows
    ]
    return md_table(headers, body)


def skipped_lines(results: dict) -> list[str]:
    seen: dict[tuple[str, str], list[str]] = defaultdict(list)
    for rec in results["records"]:
        if rec["status"] in ("skipped", "rejected", "error"):
            seen[(rec["backend"], rec["reason"] or "")].append(Problem.from_dict(rec["problem"]).label())
    total = len({json.dumps(r["problem"], sort_keys=True) for r in results["records"]})
    lines = []
    for (name, reason), probs in seen.items():
        where = "all problems" if len(probs) == total else "; ".join(probs)
        lines.append(f"- `{name}` ({where}): {reason}")
    return lines


def render_markdown(results: dict) -> str:
    title = f"# hopper-fmha bench: `{results['preset']}` on {results['env'].get('device', '?')}"
    parts = [title, "", *_env_lines(results)]
    summary = summary_table(results)
    if summary:
        parts += ["", f"## Summary: ours ÷ {BEST_TEXT}, geometric mean over problems", "", summary]
    varlen = varlen_rows(results)
    if varlen:
        heading = f"## Varlen: ours ÷ FA4, ÷ our dense twin, ÷ padded (TFLOP/s: {mode_text(PRIMARY)})"
        parts += ["", heading, "", VARLEN_NOTE, "", md_table(VARLEN_HEADERS, varlen)]
    decode = decode_rows(results)
    if decode:
        heading = f"## Decode: TB/s of K/V read, ours ÷ best peer, % of copy, ÷ twin ({mode_text(PRIMARY)})"
        parts += ["", heading, "", DECODE_NOTE, "", md_table(DECODE_HEADERS, decode)]
    features = feature_rows(results)
    if features:
        heading = (
            f"## Features: ours ÷ FA4, ÷ cuDNN, ÷ ours without the feature (TFLOP/s: {mode_text(PRIMARY)})"
        )
        parts += ["", heading, "", FEATURE_TABLE_NOTE, "", md_table(FEATURE_HEADERS, features)]
    tables = [(PRIMARY, "TFLOP/s, CUDA-graph replays (kernel time; (e): eager, not captured)")]
    if not has_graph(results):
        tables = [("eager", "TFLOP/s, eager calls (no CUDA-graph timings in this run)")]
    else:
        tables.append(("eager", "TFLOP/s, eager calls (host overhead included)"))
    for mode, heading in tables:
        t = rate_table(results, mode)
        if t:
            parts += ["", f"## {heading}", "", t]
    tile_mode = PRIMARY if has_graph(results) else "eager"
    for variant, tiles, rows, _ in tile_grids(results, tile_mode):
        table1 = " (seed paper Table 1)" if variant == "paper" else ""
        heading = f"## Tiles, variant `{variant}`{table1}, TFLOP/s ({mode_text(tile_mode)}), best in bold"
        parts += ["", heading, ""]
        parts.append(md_table(["problem"] + tiles, rows))
    prof = profile_rows(results)
    if prof:
        headers = ["problem", "backend", "% matmul eager", "% matmul graph", "host µs/call (eager − graph)",
                   "launch µs/call", "first call s (compile)", "cached load s"]  # fmt: skip
        parts += ["", "## Profile", "", md_table(headers, prof)]
    stages = host_stage_table(results)
    if stages:
        parts += ["", "## Host path: µs per eager call, each stage alone (`hopper_fmha.bench.hostpath`)", "",
                  stages]  # fmt: skip
    skipped = skipped_lines(results)
    if skipped:
        parts += ["", "## Not run", "", *skipped]
    parts += ["", "## Details", "", details_table(results), ""]
    return "\n".join(parts)


def write_markdown(results: dict, path: Path) -> None:
    Path(path).write_text(render_markdown(results))


def record_line(rec: dict, mm: float | None = None) -> str:
    """One line for the progress log."""
    p = Problem.from_dict(rec["problem"]).label()
    if rec["status"] not in ("ok", "wrong"):
        return f"{p:34} {rec['backend']:24} {rec['status']}: {rec['reason']}"
    e, g = rate(rec, "eager"), rate(rec, "graph")
    pct = f" ({rate(rec, PRIMARY) / mm:.0%} of matmul)" if mm and rate(rec, PRIMARY) else ""
    if "kvcache" in rec["problem"]:
        pct += f", {_fmt(bandwidth(rec, PRIMARY), '.2f')} TB/s"
    flag = "  WRONG: " + (rec["reason"] or "") if rec["status"] == "wrong" else ""
    return f"{p:34} {rec['backend']:24} eager {_fmt(e):>6} graph {_fmt(g):>6} TFLOP/s{pct}{flag}"


def render_terminal(results: dict) -> str:
    """The table printed at the end of a run (TFLOP/s eager and graph; %mm and ratios on the
    primary time, ÷best(e) on eager), then the claims summary."""
    mm = matmul_rate(results)
    headers = ["problem", "backend", "eager", "graph", "%mm", "÷FA2", "÷best", "÷best(e)", "err/tol",
               "status"]  # fmt: skip
    rows = []
    for p, recs in by_problem(results):
        fa2, best = reference_records(recs, PRIMARY)
        _, best_e = reference_records(recs, "eager")
        for name, rec in recs.items():
            prim = rate(rec, PRIMARY)
            fb = FALLBACK if fell_back(rec, PRIMARY) else ""
            chk = rec.get("check") or {}
            errtol = MISSING
            if chk.get("max_abs_err") is not None and chk["tol"]:
                errtol = f"{chk['max_abs_err'] / chk['tol']:.2f}"
            status = (
                rec["status"] if rec["status"] in ("ok", "wrong") else f"{rec['status']}: {rec['reason']}"
            )
            rows.append([
                p.label(), name, _fmt(rate(rec, "eager")), _fmt(rate(rec, "graph")),
                _fmt(ratio(prim, mm), ".0%") + (fb if ratio(prim, mm) else ""),
                _ratio_cell(rec, fa2, PRIMARY).replace("×", "").replace(" ✗", ""),
                _ratio_cell(rec, best, PRIMARY).replace("×", "").replace(" ✗", ""),
                _fmt(ratio(rate(rec, "eager"), rate(best_e, "eager") if best_e else None), ".2f"),
                errtol, status[:60],
            ])  # fmt: skip
    lines = columns(headers, rows)
    foot = f"TFLOP/s; {RATIO_RULE}: %mm, ÷FA2, ÷best use graph time ((e): eager, not captured)"
    foot += f", ÷best(e) eager time; best = {BEST_TEXT}; err/tol ≤ 1 passes"
    if mm:
        foot += f"; cuBLAS fp16 matmul in this run: {mm:.1f} TFLOP/s (%mm)"
    lines.append(foot)
    lines += summary_lines(results)
    varlen = varlen_rows(results)
    if varlen:
        lines += ["", f"varlen: TFLOP/s ({mode_text(PRIMARY)}); ours ÷ FA4, ÷ our dense twin, ÷ padded"]
        lines += columns(VARLEN_HEADERS, varlen)
    decode = decode_rows(results)
    if decode:
        lines += ["", f"decode: TB/s of K/V read ({mode_text(PRIMARY)}); ours ÷ best peer, % of copy, ÷ twin"]
        lines += columns(DECODE_HEADERS, decode)
    features = feature_rows(results)
    if features:
        lines += [
            "",
            f"features: TFLOP/s ({mode_text(PRIMARY)}); ours ÷ FA4, ÷ cuDNN, ÷ ours without the feature",
        ]
        lines += columns(FEATURE_HEADERS, features)
    return "\n".join(lines)


def columns(headers: list[str], rows: list[list[str]]) -> list[str]:
    """A plain-text table: a header line, a rule, then the rows, columns padded to their width."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    return lines + ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
