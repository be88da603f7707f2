"""Results: the JSON file (the record of a run), and the Markdown and terminal tables made from it.

Everything here reads only the results dict, so reports can be regenerated from a JSON file
on any machine (`hopper-fmha bench --from-json FILE`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from hopper_fmha.bench.flops import tflops
from hopper_fmha.bench.registry import BEST_PEERS, FA2, Problem

SCHEMA = "hopper-fmha-bench/1"
MISSING = "–"


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
    """TFLOP/s of a record in mode "eager" or "graph" (None when not timed)."""
    t = rec.get(mode)
    if not t or rec["status"] not in ("ok", "wrong"):
        return None
    return tflops(rec["flops"], t["median_ms"])


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


def reference_rates(recs: dict[str, dict], mode: str) -> tuple[float | None, float | None]:
    """(FA2 rate, best rate among BEST_PEERS) for one problem; wrong results do not count."""

    def good(name):
        rec = recs.get(name)
        return rate(rec, mode) if rec and rec["status"] == "ok" else None

    peers = [r for r in (good(n) for n in BEST_PEERS) if r is not None]
    return good(FA2), max(peers) if peers else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(x: float | None, spec: str = ".1f", suffix: str = "") -> str:
    return MISSING if x is None else f"{x:{spec}}{suffix}"


def _cell(rec: dict | None, mode: str) -> str:
    if rec is None:
        return MISSING
    if rec["status"] == "rejected":
        return "rejected"
    if rec["status"] in ("skipped", "error"):
        return rec["status"]
    r = rate(rec, mode)
    return _fmt(r) + (" ✗" if rec["status"] == "wrong" and r is not None else "")


def _problem_cells(p: Problem) -> list[str]:
    n = str(p.seqlen_q) if p.seqlen_q == p.seqlen_k else f"{p.seqlen_q}/{p.seqlen_k}"
    h = str(p.heads) if p.heads == p.kv_heads else f"{p.heads}/{p.kv_heads}"
    return [str(p.batch), n, h, str(p.head_dim), "yes" if p.causal else "no", p.dtype]


PROBLEM_HEADERS = ["B", "N", "H", "d", "causal", "dtype"]


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def rate_table(results: dict, mode: str) -> str | None:
    """Problems x backends TFLOP/s, then each of ours divided by FA2 and by the best peer."""
    groups = by_problem(results)
    backends = backends_in(results)
    if not any(rate(r, mode) for _, recs in groups for r in recs.values()):
        return None
    ours = [b for b in backends if b[2]]
    has_fa2 = any(reference_rates(recs, mode)[0] for _, recs in groups)
    has_best = any(reference_rates(recs, mode)[1] for _, recs in groups)
    headers = PROBLEM_HEADERS + [b[1] for b in backends]
    for _, label, _ in ours:
        headers += [f"{label} ÷ FA2"] * has_fa2 + [f"{label} ÷ best peer"] * has_best
    rows = []
    for p, recs in groups:
        fa2, best = reference_rates(recs, mode)
        row = _problem_cells(p) + [_cell(recs.get(name), mode) for name, _, _ in backends]
        for name, _, _ in ours:
            mine = rate(recs[name], mode) if name in recs else None
            mark = " ✗" if name in recs and recs[name]["status"] == "wrong" else ""
            if has_fa2:
                row.append(_fmt(ratio(mine, fa2), ".2f", "×") + (mark if ratio(mine, fa2) else ""))
            if has_best:
                row.append(_fmt(ratio(mine, best), ".2f", "×") + (mark if ratio(mine, best) else ""))
        rows.append(row)
    return md_table(headers, rows)


def tile_grids(results: dict, mode: str = "eager") -> list[tuple[str, list[str], list[list[str]], list]]:
    """Seed-paper Table 1: per variant, problems x tiles. [(variant, tiles, rows, cells)] where
    cells holds (problem, tile, rate or None, status) for the plots."""
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
                cells.append((p, t, rates.get(t), rec["status"] if rec else None))
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
    versions += [f"hopper-fmha {env.get('hopper-fmha')}" + (f" (git {env['git']})" if env.get("git") else "")]
    versions += [f"{k} {v}" for k, v in env.get("versions", {}).items()]
    lines = [
        f"- date: {env.get('date')}",
        f"- command: `{results.get('command')}`",
        f"- device: {dev}, driver {env.get('driver') or '?'}",
        f"- versions: {', '.join(versions)}",
    ]
    mm, mm_end = results.get("matmul"), results.get("matmul_end")
    if mm:
        line = f"- cuBLAS fp16 {mm['shape'][0]}³ matmul: **{mm['tflops']:.1f} TFLOP/s** (median)"
        if mm_end:
            line += f"; {mm_end['tflops']:.1f} at the end of the run"
        lines.append(line)
    s = results.get("settings", {})
    lines.append(
        f"- method: FLOPs = 4·B·H·Nq·Nk·d, halved for causal. Median of {s.get('iters')} samples after "
        f"{s.get('warmup')} warm-up calls, CUDA events. Eager: back-to-back calls from Python "
        "(host overhead included); graph: CUDA-graph replays (kernel time). Inputs rotate over "
        "sets totalling > 2×L2. Correct (else ✗): max abs error vs the fp32 reference ≤ 2× that of "
        "PyTorch in the input dtype + eps·max|ref|."
    )
    if not results.get("complete", True):
        lines.append("- **incomplete run** (stopped early; see the last records)")
    return lines


def details_table(results: dict) -> str:
    mm = matmul_rate(results)
    rows = []
    for rec in results["records"]:
        p = Problem.from_dict(rec["problem"])
        e = rec.get("eager")
        chk = rec.get("check") or {}
        err = MISSING
        if chk.get("max_abs_err") is not None:
            err = f"{chk['max_abs_err']:.2e} / {chk['tol']:.2e}"
        elif chk.get("reason"):
            err = chk["reason"]
        status = rec["status"] + (f": {rec['reason']}" if rec.get("reason") else "")
        if rec.get("graph_reason"):
            status += f"; graph n/a: {rec['graph_reason']}"
        eager_ms = f"{e['median_ms']:.3f} [{e['min_ms']:.3f}–{e['max_ms']:.3f}]" if e else MISSING
        re_, rg = rate(rec, "eager"), rate(rec, "graph")
        pct = f"{_fmt(ratio(re_, mm), '.0%')} / {_fmt(ratio(rg, mm), '.0%')}" if mm else MISSING
        calls = f"{e['calls_per_sample']}×{len(e['samples_ms'])}" if e else MISSING
        rows.append(
            [
                p.label(),
                rec["backend"],
                eager_ms,
                _fmt(re_),
                _fmt(rg),
                pct,
                err,
                calls,
                status.replace("|", "/"),
            ]
        )
    headers = ["problem", "backend", "eager ms med [min–max]", "eager TFLOP/s", "graph TFLOP/s",
               "% matmul eager / graph", "max err / tol", "calls×samples", "status"]  # fmt: skip
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
    for mode, heading in (("eager", "TFLOP/s, eager calls"), ("graph", "TFLOP/s, CUDA-graph replays")):
        t = rate_table(results, mode)
        if t:
            parts += ["", f"## {heading}", "", t]
    for variant, tiles, rows, _ in tile_grids(results):
        parts += ["", f"## Tiles, variant `{variant}` (seed paper Table 1), TFLOP/s eager, best in bold", ""]
        parts.append(md_table(["problem"] + tiles, rows))
    prof = profile_rows(results)
    if prof:
        headers = ["problem", "backend", "% matmul eager", "% matmul graph", "host µs/call (eager − graph)",
                   "launch µs/call", "first call s (compile)", "cached load s"]  # fmt: skip
        parts += ["", "## Profile", "", md_table(headers, prof)]
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
    pct = f" ({e / mm:.0%} of matmul)" if mm and e else ""
    flag = "  WRONG: " + (rec["reason"] or "") if rec["status"] == "wrong" else ""
    return f"{p:34} {rec['backend']:24} eager {_fmt(e):>6} graph {_fmt(g):>6} TFLOP/s{pct}{flag}"


def render_terminal(results: dict) -> str:
    """The summary table printed at the end of a run."""
    mm = matmul_rate(results)
    headers = ["problem", "backend", "eager", "graph", "%mm", "÷FA2", "÷best", "err/tol", "status"]
    rows = []
    for p, recs in by_problem(results):
        fa2, best = reference_rates(recs, "eager")
        for name, rec in recs.items():
            e = rate(rec, "eager")
            chk = rec.get("check") or {}
            errtol = MISSING
            if chk.get("max_abs_err") is not None and chk["tol"]:
                errtol = f"{chk['max_abs_err'] / chk['tol']:.2f}"
            status = (
                rec["status"] if rec["status"] in ("ok", "wrong") else f"{rec['status']}: {rec['reason']}"
            )
            rows.append([
                p.label(), name, _fmt(e), _fmt(rate(rec, "graph")), _fmt(ratio(e, mm), ".0%"),
                _fmt(ratio(e, fa2), ".2f"), _fmt(ratio(e, best), ".2f"), errtol, status[:60],
            ])  # fmt: skip
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    if mm:
        lines.append(f"TFLOP/s; cuBLAS fp16 matmul in this run: {mm:.1f} TFLOP/s (%mm); err/tol ≤ 1 passes")
    return "\n".join(lines)
