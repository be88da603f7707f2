"""Run GPU test files in several pytest processes at once on one GPU, within a time budget.

Most of a cold GPU tier's time is kernel compilation (one CPU core per compile; the device
machine has 16): N processes compile N kernels at a time while the GPU runs the others' tests.
The tests of the given files are collected once and dealt round-robin to `--procs` processes
(tests of one parametrized function spread over all of them); each writes its log and a JUnit
XML under `--out`. The processes share the on-disk kernel cache, so a kernel one compiles the
others load. Prints one summary line per process and the totals; exits 1 if any test failed or
errored, 2 if the budget ran out (the unfinished processes are stopped, their logs kept).
`--archive` packs the folder into one .tar.gz (the device tool brings back at most 8 files).

    python scripts/gpu_tier.py --out /tmp/tier --archive $OUT/tier.tar.gz --procs 6 --budget 540 \
        tests/test_gpu_varlen.py ...
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def collect(files: list[str], selector: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", *files]
    if selector:
        cmd += ["-k", selector]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(" ")]


def summary(xml_path: Path) -> dict[str, int]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if not xml_path.exists():
        return counts
    for suite in ET.parse(xml_path).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="test files (or node ids)")
    p.add_argument("--out", required=True, help="folder for the logs and JUnit files")
    p.add_argument("--procs", type=int, default=6)
    p.add_argument("--budget", type=float, default=540.0, help="seconds before the processes are stopped")
    p.add_argument("-k", dest="selector", default=None, help="pytest -k expression")
    p.add_argument("--archive", default=None, help="also pack --out into this .tar.gz")
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tests = collect(args.files, args.selector)
    print(f"{len(tests)} tests in {len(args.files)} files, {args.procs} processes", flush=True)
    start = time.monotonic()
    procs = []
    for i in range(args.procs):
        ids = tests[i :: args.procs]
        if not ids:
            continue
        (out / f"ids{i}.txt").write_text("\n".join(ids) + "\n")
        log = open(out / f"log{i}.txt", "w")  # noqa: SIM115 (closed below)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={out}/junit{i}.xml",
        ]
        procs.append((i, subprocess.Popen([*cmd, *ids], stdout=log, stderr=subprocess.STDOUT), log))
    timed_out = False
    for _, proc, log in procs:
        left = args.budget - (time.monotonic() - start)
        try:
            proc.wait(timeout=max(left, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            proc.wait()
        log.close()
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for i, proc, _ in procs:
        counts = summary(out / f"junit{i}.xml")
        for key in totals:
            totals[key] += counts[key]
        print(f"process {i}: exit {proc.returncode}, {counts}", flush=True)
    line = f"total {totals} of {len(tests)} collected, {time.monotonic() - start:.0f} s"
    print(line, flush=True)
    (out / "summary.txt").write_text(line + "\n")
    if args.archive:
        with tarfile.open(args.archive, "w:gz") as tar:
            tar.add(out, arcname=out.name)
    if timed_out:
        return 2
    return 1 if totals["failures"] or totals["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
