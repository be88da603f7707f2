"""Run GPU test files in several pytest processes at once on one GPU, within a time budget.

Most of a cold GPU tier's time is kernel compilation (one CPU core per compile; the device
machine has 16): N processes compile N kernels at a time while the GPU runs the others' tests.
The tests of the given files are collected once and dealt round-robin to `--procs` processes
(tests of one parametrized function spread over all of them); each writes its log and a report
(`tests/conftest.py`: a line per outcome, a failure's text) under `--out`. The processes share
the on-disk kernel cache, so a kernel one compiles the others load. A process without a new
outcome for `--stall` seconds (a kernel that hangs) is stopped, the test marked HUNG, and a new
one goes on with the rest. Prints one summary line per process and the totals; exits 1 if any
test failed or hung, 2 if the budget ran out (the unfinished processes are stopped, logs kept).
Tests go out in collection order: neighbours, which often share a kernel, start on different
processes at about the same time (the whole of tests/test_gpu_kernels.py, 2384 tests, took 212 s
with 13 processes on the H200, 2026-11-24).
`--chunked` deals contiguous runs of tests instead, so that neighbours that share a kernel stay in
one process (written for the backward's kernels before they had a disk cache, session 29; still
useful where many processes would compile the same kernel at once).
`--archive` packs the folder into one .tar.gz (the device tool brings back at most 8 files).

    python scripts/gpu_tier.py --out /tmp/tier --archive $OUT/tier.tar.gz --procs 6 --budget 540 \
        tests/test_gpu_varlen.py ...
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path


def collect(files: list[str], selector: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", *files]
    if selector:
        cmd += ["-k", selector]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False).stdout
    return [line.strip() for line in out.splitlines() if "::" in line and not line.startswith(" ")]


def reported(path: Path) -> dict[str, int]:
    """A process's counts from its report file (`tests/conftest.py` appends a line per test)."""
    counts = {"tests": 0, "failures": 0, "hung": 0, "skipped": 0}
    if not path.exists():
        return counts
    for line in path.read_text().splitlines():
        word = line.split(" ", 1)[0]
        if word in ("PASSED", "FAILED", "SKIPPED", "HUNG"):
            counts["tests"] += 1
            counts["failures"] += word == "FAILED"
            counts["skipped"] += word == "SKIPPED"
            counts["hung"] += word == "HUNG"
    return counts


class Worker:
    """One pytest process over a share of the tests; restarted past a test that hangs."""

    def __init__(self, index: int, ids: list[str], out: Path):
        self.index, self.ids, self.out = index, ids, out
        self.report = out / f"report{index}.txt"
        self.proc = None
        self.log = None
        self.hung: list[str] = []
        self.offset = 0  # ids before this were run by earlier processes of this worker
        self.report.unlink(missing_ok=True)
        (out / f"ids{index}.txt").write_text("\n".join(ids) + "\n")

    def done(self) -> int:
        """Tests of this worker with an outcome (a hung one counts)."""
        if not self.report.exists():
            return 0
        return sum(
            line.split(" ", 1)[0] in ("PASSED", "FAILED", "SKIPPED", "HUNG")
            for line in self.report.read_text().splitlines()
        )

    def start(self) -> None:
        self.offset = self.done()
        rest = self.ids[self.offset :]
        if not rest:
            self.proc = None
            return
        self.log = open(self.out / f"log{self.index}.txt", "a")  # noqa: SIM115 (closed in stop)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *rest]
        env = {**os.environ, "HOPPER_FMHA_TEST_REPORT": str(self.report)}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.progress = (self.done(), time.monotonic())

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None

    def poll(self, stall: float) -> None:
        if self.proc is None:
            return
        done = self.done()
        if self.proc.poll() is not None:  # finished, or crashed: go on after the last outcome
            rc = self.proc.returncode
            crashed = done < len(self.ids) and rc not in (0, 1)
            self.stop()
            if crashed:
                with open(self.report, "a") as f:
                    f.write(f"HUNG {self.ids[done]} (its process exited with {rc})\n")
                self.hung.append(self.ids[done])
                self.start()
            return
        if done != self.progress[0]:
            self.progress = (done, time.monotonic())
        elif time.monotonic() - self.progress[1] > stall:
            self.stop()
            with open(self.report, "a") as f:
                f.write(f"HUNG {self.ids[done]} (no outcome for {stall:.0f} s: stopped)\n")
            self.hung.append(self.ids[done])
            self.start()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", help="test files (or node ids)")
    p.add_argument("--ids", default=None, help="a file of node ids, one per line (run in this order)")
    p.add_argument("--out", required=True, help="folder for the logs and JUnit files")
    p.add_argument("--procs", type=int, default=6)
    p.add_argument("--budget", type=float, default=540.0, help="seconds before the processes are stopped")
    p.add_argument("-k", dest="selector", default=None, help="pytest -k expression")
    p.add_argument(
        "--stall",
        type=float,
        default=150.0,
        help="seconds without a test outcome before a process is stopped",
    )
    p.add_argument("--archive", default=None, help="also pack --out into this .tar.gz")
    p.add_argument(
        "--chunked", action="store_true", help="contiguous runs of tests per process, not round-robin"
    )
    args = p.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tests = collect(args.files, args.selector) if args.files else []
    if args.ids:
        tests += [line.strip() for line in Path(args.ids).read_text().splitlines() if line.strip()]
    print(f"{len(tests)} tests in {len(args.files)} files, {args.procs} processes", flush=True)
    start = time.monotonic()
    n, procs = len(tests), args.procs
    shares = [
        tests[i * n // procs : (i + 1) * n // procs] if args.chunked else tests[i::procs]
        for i in range(procs)
    ]
    workers = [Worker(i, share, out) for i, share in enumerate(shares)]
    workers = [w for w in workers if w.ids]
    for w in workers:
        w.start()
    timed_out = False
    while any(w.proc is not None for w in workers):
        time.sleep(2)
        if time.monotonic() - start > args.budget:
            timed_out = True
            for w in workers:
                w.stop()
            break
        for w in workers:
            w.poll(args.stall)
    totals = {"tests": 0, "failures": 0, "hung": 0, "skipped": 0}
    for w in workers:
        counts = reported(w.report)
        for key in totals:
            totals[key] += counts[key]
        print(f"process {w.index}: {counts}, {len(w.ids) - w.done()} not run", flush=True)
    line = f"total {totals} of {len(tests)} collected, {time.monotonic() - start:.0f} s"
    print(line, flush=True)
    for w in workers:
        for entry in w.hung:
            print(f"hung (stopped after {args.stall:.0f} s without progress): {entry}", flush=True)
    (out / "summary.txt").write_text(line + "\n")
    if args.archive:
        with tarfile.open(args.archive, "w:gz") as tar:
            tar.add(out, arcname=out.name)
    if timed_out:
        return 2
    return 1 if totals["failures"] or totals["hung"] else 0


if __name__ == "__main__":
    sys.exit(main())
