"""A whole `hopper-fmha bench` run on the CPU, as the bench tests make it: `bench.cli.execute` of
a preset's problems and backends with quick timing, the CPU timer and the package's reference
check, its JSON read back."""

from __future__ import annotations

from types import SimpleNamespace

from hopper_fmha.bench import cli as bench_cli
from hopper_fmha.bench import report, timing
from hopper_fmha.bench.registry import Problem
from hopper_fmha.reference import reference


def execute_on_cpu(tmp_path, name: str, problems, backends, *, graph: bool = False):
    """Runs preset `name` (exit code 0 asserted: ours correct everywhere) into tmp_path; returns
    (the results, their records by (backend name, Problem), the JSON file's path)."""
    args = SimpleNamespace(
        no_graph=not graph, seed=0, tag=None, out=str(tmp_path), profile=False, no_plot=True
    )
    code = bench_cli.execute(
        args, name, problems, backends, timing.TimingSettings.quick(), device="cpu",
        timer=timing.CpuTimer(), reference=reference,
    )  # fmt: skip
    assert code == 0
    (json_path,) = tmp_path.glob(f"{name}-*.json")
    results = report.load_results(json_path)
    records = {(r["backend"], Problem.from_dict(r["problem"])): r for r in results["records"]}
    return results, records, json_path
