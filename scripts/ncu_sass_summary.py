"""Sum an Nsight Compute source page by SASS opcode, for one kernel or two side by side.

The input is what NOTES.md's method writes: `ncu -i REP --page source --csv --print-source sass
> ours.csv`. The first line names the kernel; the second is the header, one row per SASS
instruction after it. Every numeric column is summed per opcode: the opcode is the instruction's
first word after an optional predicate (`@P0`, `@!UP1`), with its modifiers kept
(`SYNCS.PHASECHK.TRANS64.TRYWAIT`); `--base` drops them (`SYNCS`).

    python scripts/ncu_sass_summary.py ours.csv fa4.csv --metric "Instructions Executed" --top 30

Prints, for `--metric` (a header, or any part of one), the top opcodes by the larger of the two
sums and their difference, then every column whose header names a stall reason ("stall" in it,
either case, not the "Warp Stall Sampling" totals) as a share of the sum of those columns, per
file. The column names are ncu's; a metric missing from a file
is an error that lists the headers it has.
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import defaultdict

_PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


def opcode(source: str, base: bool) -> str:
    """The opcode of one SASS line ('' for an empty one)."""
    text = _PREDICATE.sub("", source.strip())
    word = text.split(" ", 1)[0].rstrip(";")
    return word.split(".", 1)[0] if base else word


def _number(text: str) -> float | None:
    text = text.strip().replace(",", "")
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def read(path: str, base: bool) -> tuple[str, list[str], dict[str, dict[str, float]]]:
    """(kernel line, headers, {header: {opcode: sum}}) of one source-page CSV."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) < 2:
        raise SystemExit(f"{path}: expected a kernel line and a header, got {len(rows)} lines")
    kernel, header = ",".join(rows[0]), rows[1]
    try:
        source = header.index("Source")
    except ValueError:
        raise SystemExit(f"{path}: no 'Source' column; headers: {header}") from None
    sums: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for row in rows[2:]:
        if len(row) != len(header):
            continue
        op = opcode(row[source], base)
        if not op:
            continue
        for name, cell in zip(header, row, strict=True):
            value = _number(cell)
            if value is not None and name != "Address":
                sums[name][op] += value
    return kernel, header, sums


def column(header: list[str], metric: str, path: str) -> str:
    """The header `metric` names: itself, else the one header containing it."""
    if metric in header:
        return metric
    found = [h for h in header if metric.lower() in h.lower()]
    if len(found) != 1:
        raise SystemExit(f"{path}: {metric!r} matches {found or 'no header'}; headers: {header}")
    return found[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="one or two source-page CSV files")
    parser.add_argument("--metric", default="Instructions Executed")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--base", action="store_true", help="opcodes without their modifiers")
    args = parser.parse_args(argv)
    if len(args.files) > 2:
        raise SystemExit("one or two files")
    data = [read(path, args.base) for path in args.files]
    names = [f"file{i + 1}" for i in range(len(data))]
    for name, path, (kernel, _, _) in zip(names, args.files, data, strict=True):
        print(f"{name}: {path}: {kernel[:150]}")
    pairs = zip(args.files, data, strict=True)
    metrics = [column(header, args.metric, path) for path, (_, header, _) in pairs]
    by_op = [data[i][2][metrics[i]] for i in range(len(data))]
    totals = [sum(s.values()) for s in by_op]
    print(f"\n{args.metric}, by opcode (totals: {', '.join(f'{t:,.0f}' for t in totals)})")
    ops = sorted(set().union(*by_op), key=lambda op: -max(s.get(op, 0.0) for s in by_op))
    for op in ops[: args.top]:
        values = [s.get(op, 0.0) for s in by_op]
        cells = "  ".join(f"{n} {v:14,.0f}" for n, v in zip(names, values, strict=True))
        diff = f"  diff {values[0] - values[1]:+14,.0f}" if len(values) == 2 else ""
        print(f"  {op:40s} {cells}{diff}")
    print("\nstall columns, % of their sum")
    for name, (_, header, sums) in zip(names, data, strict=True):
        reasons = [h for h in header if "stall" in h.lower() and "sampling" not in h.lower() and h in sums]
        stalls = {h: sum(sums[h].values()) for h in reasons}
        whole = sum(stalls.values()) or 1.0
        print(f"  {name}:")
        for h, v in sorted(stalls.items(), key=lambda kv: -kv[1]):
            print(f"    {h:50s} {100 * v / whole:5.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
