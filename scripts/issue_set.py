"""Aggregate bench runs over several JSON files: ours ÷ the best peer on the issue set.

    python scripts/issue_set.py custom-…-block-d64.json … paper-…-block.json

Issue 5's set is the `paper` preset plus the sweep's problems at N ≥ 2048; the paper preset's
problems are also sweep problems (N = 4096), so a file's records count as the paper's when its
preset is `paper`, and as the sweep's otherwise. Ratios follow the bench's own summary rule
(`report.ratio_to_best`: graph time, best of the peers with correct results).
"""

from __future__ import annotations

import sys

from hopper_fmha.bench import report

GROUPS = (
    ("issue set (paper + N>=2048)", lambda src, p: src == "paper" or p.seqlen_q >= 2048),
    ("sweep N>=2048", lambda src, p: src == "sweep" and p.seqlen_q >= 2048),
    ("paper", lambda src, p: src == "paper"),
    ("short (N 512/1024)", lambda src, p: src == "sweep" and p.seqlen_q in (512, 1024)),
)
OURS = "hopper-fmha:auto"


def cells(paths: list[str]) -> list[tuple[str, object, str, float]]:
    """(source, problem, mode, ratio) for every problem of every file and both modes."""
    out = []
    for path in paths:
        results = report.load_results(path)
        src = "paper" if results["preset"] == "paper" else "sweep"
        for problem, recs in report.by_problem(results):
            for mode in (report.PRIMARY, "eager"):
                compared = report.ratio_to_best(recs, OURS, mode)
                if compared:
                    out.append((src, problem, mode, compared[0]))
    return out


def main(paths: list[str]) -> None:
    rows = cells(paths)
    for mode in (report.PRIMARY, "eager"):
        for name, keep in GROUPS:
            chosen = sorted((r for r in rows if r[2] == mode and keep(r[0], r[1])), key=lambda r: r[3])
            if not chosen:
                continue
            ratios = [r[3] for r in chosen]
            lowest = ", ".join(f"{p.label()} {x:.4f}" for _, p, _, x in chosen[:3])
            print(
                f"{name:28s} {'graph' if mode == report.PRIMARY else mode:5s} n={len(ratios):2d} "
                f"geomean {report.geomean(ratios):.4f} >=1: {sum(x >= 1 for x in ratios)}/{len(ratios)} "
                f"lowest: {lowest}"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
