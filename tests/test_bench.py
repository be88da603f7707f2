"""The benchmark suite on CPU: FLOP formula, registry skips, presets, writers, argparse, and a
whole run with fake backends and a wall-clock timer (the GPU run differs only in the timer,
the CUDA graphs and the matmul rate)."""

import argparse
import dataclasses
import json
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hopper_fmha.bench import cli as bench_cli
from hopper_fmha.bench import presets, registry, report, runner, timing
from hopper_fmha.bench.flops import attention_flops, matmul_flops, tflops
from hopper_fmha.bench.plots import write_plots
from hopper_fmha.bench.registry import Backend, BackendSkip, Problem
from hopper_fmha.config import PAPER_TILES, VARIANTS
from hopper_fmha.reference import reference

pytestmark = pytest.mark.cpu

# The PNG charts need matplotlib, which only the bench extra installs.
NEEDS_MATPLOTLIB = 'PNG charts need matplotlib: pip install -e ".[bench]"'

# Small enough for CPU, odd lengths so causal masks cut through tiles, GQA.
SMALL = Problem(batch=1, seqlen_q=67, seqlen_k=67, heads=4, kv_heads=2, head_dim=64, dtype="bfloat16")


# ---- FLOPs ----


def test_flops_hand_computed():
    # Paper shape, d=64: 4 * 4 * 32 * 4096^2 * 64.
    assert attention_flops(4, 32, 4096, 4096, 64) == 549_755_813_888
    assert attention_flops(4, 32, 4096, 4096, 64, causal=True) == 274_877_906_944
    assert attention_flops(1, 1, 3, 5, 7) == 420  # Nq != Nk: 4*3*5*7
    assert attention_flops(1, 1, 3, 5, 7, causal=True) == 210
    assert matmul_flops(8192, 8192, 8192) == 2 * 8192**3
    assert tflops(1e12, 1000.0) == pytest.approx(1.0)
    assert tflops(549_755_813_888, 1.0) == pytest.approx(549.755813888)
    assert tflops(1.0, 0.0) is None and tflops(1.0, None) is None
    assert Problem(4, 4096, 4096, 16, 16, 128, causal=True).flops == 274_877_906_944


# ---- registry ----


def test_registry_names():
    expected = ["hopper-fmha:auto"] + [f"hopper-fmha:{v}" for v in VARIANTS]
    assert [b.name for b in registry.get_backend("hopper-fmha")] == expected
    assert [b.name for b in registry.get_backend("hopper-fmha:auto/single")] == ["hopper-fmha:auto/single"]
    (b,) = registry.get_backend("hopper-fmha:paper@128x64")
    assert b.name == "hopper-fmha:paper@128x64" and b.ours
    names = [b.name for b in registry.resolve_backends(["fa2", "sdpa-flash", "cudnn", "fa4"])]
    assert names == ["sdpa-flash", "sdpa-cudnn", "fa4"]  # aliases resolved, duplicates dropped
    assert [b.name for b in registry.resolve_backends(registry.DEFAULT_BACKENDS)][-5:] == [
        "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "fa4", "fa3"
    ]  # fmt: skip


@pytest.mark.parametrize(
    "name, match",
    [("flashinfer", "unknown backend 'flashinfer'; known: .*sdpa-cudnn"),
     ("hopper-fmha:nope", "unknown hopper-fmha variant"),
     ("hopper-fmha:paper@128", "tile must look like 128x64")],
)  # fmt: skip
def test_registry_unknown_name_is_a_clear_error(name, match):
    with pytest.raises(ValueError, match=match):
        registry.resolve_backends([name])


def _checker(p, sets):
    return lambda: runner.Checker(p, *sets[0], reference=reference)


def _step(p, backend):
    sets = runner.make_inputs(p, 2, "cpu", seed=0)
    quick = timing.TimingSettings.quick()
    return runner.run_step(p, backend, sets, _checker(p, sets), timing.CpuTimer(), quick, graph=False)


def test_import_failure_is_skipped_with_reason(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "flash_attn_interface", None)  # import fails
    rec = _step(SMALL, registry.REGISTRY["fa3"])
    assert rec["status"] == "skipped"
    assert "flash_attn_interface.flash_attn_func not importable" in rec["reason"]
    assert rec["eager"] is None


def test_raising_backend_is_skipped_with_reason():
    def build(p, q, k, v):
        def fn():
            raise RuntimeError("head dim not supported\nsecond line")

        return fn

    def build_raises(p, q, k, v):
        raise NotImplementedError("nothing here")

    rec = _step(SMALL, Backend("boom", "boom", build))
    assert rec["status"] == "skipped" and rec["reason"] == "raised RuntimeError: head dim not supported"

    def build_warns(p, q, k, v):
        def fn():
            __import__("warnings").warn("Flash attention kernel not used because: head_dim > 256")
            raise RuntimeError("No available kernel. Aborting execution.")

        return fn

    rec = _step(SMALL, Backend("warns", "warns", build_warns))
    assert rec["reason"] == (
        "raised RuntimeError: No available kernel. Aborting execution. "
        "(Flash attention kernel not used because: head_dim > 256)"
    )
    rec = _step(SMALL, Backend("boom2", "boom2", build_raises))
    assert rec["status"] == "skipped" and rec["reason"] == "build raised NotImplementedError: nothing here"


def test_rejected_tile_and_unsupported_problems():
    # 128x128 at d=256 does not fit (hopper_fmha.config): rejected before anything runs.
    (b,) = registry.get_backend("hopper-fmha:paper@128x128")
    p = Problem(1, 64, 64, 1, 1, 256)
    with pytest.raises(BackendSkip) as e:
        b.build(p, None, None, None)
    assert e.value.status == "rejected" and e.value.reason.startswith("rejected: tile 128x128")
    # SDPA's causal mask is top-left: with Nq != Nk it computes something else.
    p = Problem(1, 64, 96, 2, 2, 64, causal=True)
    rec = _step(p, registry.REGISTRY["sdpa-flash"])
    assert rec["status"] == "skipped" and "top-left" in rec["reason"]
    # This package on a CPU tensor raises (needs a Hopper GPU): skipped, not fatal.
    (ours,) = registry.get_backend("hopper-fmha:paper")
    rec = _step(SMALL, ours)
    assert rec["status"] == "skipped" and rec["reason"].startswith("raised ")


def test_sdpa_backend_runs_and_passes_on_cpu():
    # PyTorch has a CPU flash kernel, so the SDPA wrapper (BHSD views, GQA, causal) runs here.
    p = Problem(2, 67, 67, 4, 2, 64, causal=True, dtype="bfloat16")
    rec = _step(p, registry.REGISTRY["sdpa-flash"])
    if rec["status"] == "skipped" and "No available kernel" in (rec["reason"] or ""):
        pytest.skip(f"this torch has no CPU flash SDPA for the problem: {rec['reason']}")
    assert rec["status"] == "ok", rec["reason"]
    assert rec["check"]["passed"] and rec["check"]["max_abs_err"] <= rec["check"]["tol"]
    assert len(rec["eager"]["samples_ms"]) == 3


# ---- correctness rule ----


@pytest.mark.parametrize("sq, sk", [(67, 67), (33, 95), (95, 33)])
def test_lowp_attention_matches_reference_semantics(sq, sk):
    # In fp32 the baseline must be the reference (bottom-right causal, GQA head mapping, rows
    # that see no key give 0); only then is its low-precision error a fair yardstick.
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, sq, 6, 32, generator=g)
    k, v = (torch.randn(2, sk, 2, 32, generator=g) for _ in range(2))
    for causal in (False, True):
        out = runner.lowp_attention(q, k, v, causal, max_scores=2 * 6 * sk * 7)  # 7-row chunks
        ref, _ = reference(q, k, v, causal=causal)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_checker_tolerance():
    sets = runner.make_inputs(SMALL, 1, "cpu", seed=3)
    chk = runner.Checker(SMALL, *sets[0], reference=reference)
    assert 0 < chk.torch_err < chk.tol
    good = runner.lowp_attention(*sets[0], causal=False)
    assert chk.check(good)["passed"]
    assert not chk.check(good + 0.05)["passed"]
    bad = good.clone()
    bad[0, 0, 0, 0] = float("nan")
    assert chk.check(bad) == {**chk.check(bad), "passed": False, "reason": "non-finite values in the output"}
    assert "shape" in chk.check(good[:, :-1])["reason"]


# ---- timing ----


def test_input_sets_exceed_twice_l2():
    l2 = 50 * 2**20
    paper = presets.paper().problems[0]
    assert timing.num_input_sets(paper.input_bytes, l2) == 2  # 256 MB per set already > 2x L2
    n = timing.num_input_sets(8 * 2**20, l2)
    assert n * 8 * 2**20 > 2 * l2 and n <= 32
    assert timing.num_input_sets(2**20, l2) == 32  # capped
    assert timing.num_input_sets(2**20, l2, memory_budget=5 * 2**20) == 5


def test_time_eager_rotates_and_batches():
    calls = [0, 0, 0]

    def make(i):
        def fn():
            calls[i] += 1

        return fn

    s = timing.TimingSettings(warmup=3, iters=7, min_sample_ms=1e-3, max_calls_per_sample=4)
    t = timing.time_eager([make(i) for i in range(3)], timing.CpuTimer(), s)
    assert len(t["samples_ms"]) == 7 and 1 <= t["calls_per_sample"] <= 4
    assert t["min_ms"] <= t["median_ms"] <= t["max_ms"]
    timed = 7 * t["calls_per_sample"]
    assert sum(calls) == 3 + 3 + timed  # warm-up, pilot pass, timed calls
    assert max(calls) - min(calls) <= 2  # every input set is used


# ---- presets ----


def test_presets():
    paper = presets.get_preset("paper")
    assert len(paper.problems) == 6 and paper.backends is None
    assert {(p.head_dim, p.heads) for p in paper.problems} == {(64, 32), (128, 16), (256, 8)}
    assert all(
        p.batch == 4 and p.seqlen_q == p.seqlen_k == 4096 and p.dtype == "float16" for p in paper.problems
    )
    assert sorted(p.causal for p in paper.problems) == [False] * 3 + [True] * 3

    sweep = presets.get_preset("sweep")
    assert len(sweep.problems) == 6 * 3 * 2 * 2
    assert all(p.batch * p.seqlen_q == 16384 and p.heads * p.head_dim == 2048 for p in sweep.problems)
    assert {p.seqlen_q for p in sweep.problems} == {512, 1024, 2048, 4096, 8192, 16384}
    assert {p.dtype for p in sweep.problems} == {"float16", "bfloat16"}
    assert len(set(sweep.problems)) == len(sweep.problems)

    # The seed paper's Table 1: the paper variant only, over its tiles.
    tiles = presets.get_preset("tiles")
    assert [p.head_dim for p in tiles.problems] == [64, 128, 256]
    assert not any(p.causal for p in tiles.problems)
    assert tiles.backends == tuple(f"hopper-fmha:paper@{m}x{n}" for m, n in PAPER_TILES)
    registry.resolve_backends(tiles.backends)
    # The ws variant's candidates; config rejects some per head dim (reported, not fatal).
    ws = presets.tiles("ws")
    assert ws.name == "tiles-ws" and ws.problems == tiles.problems
    assert len(ws.backends) == 11 and all(b.startswith("hopper-fmha:ws@") for b in ws.backends)
    assert {"hopper-fmha:ws@128x176", "hopper-fmha:ws@192x64", "hopper-fmha:ws@192x128"} <= set(ws.backends)
    rejected = {}
    for p in ws.problems:
        for b in registry.resolve_backends(ws.backends):
            try:
                b.build(p, None, None, None)  # config check only; nothing runs
            except BackendSkip as e:
                assert e.status == "rejected", e.reason
                rejected.setdefault(p.head_dim, []).append(b.name.partition("@")[2])
    # (Which ones is hopper_fmha.config's business; some fit everywhere, d=256 rejects some.)
    assert rejected.get(256) and len(rejected.get(64, [])) < len(ws.backends)
    with pytest.raises(ValueError, match="sweeps the variants"):
        presets.tiles("nope")

    with pytest.raises(ValueError, match="unknown preset"):
        presets.get_preset("nope")


# ---- writers, on synthetic timings ----


PROFILE = {"compile_s": 12.5, "cached_load_s": 0.2, "launch_us": 21.0}


def _rec(p: Problem, name: str, label: str, tf: float | None, status="ok", ours=False, graph_tf=None):
    def timed(rate):
        ms = p.flops / (rate * 1e12) * 1e3
        return timing.summarize([], 1, rounds=[[ms * 1.01, ms], [ms, ms * 0.99], [ms * 0.98, ms]])

    return {
        "problem": p.to_dict(), "backend": name, "label": label, "ours": ours, "flops": p.flops,
        "n_sets": 2, "set_bytes": p.input_bytes, "status": status,
        "reason": None if status in ("ok",) else f"{status} for a reason",
        "check": {"max_abs_err": 1e-3, "tol": 2e-3, "torch_lowp_err": 9e-4, "passed": status != "wrong"},
        "eager": timed(tf) if tf else None, "graph": timed(graph_tf) if graph_tf else None,
        "graph_reason": None, "profile": PROFILE if ours else None,
    }  # fmt: skip


def _synthetic() -> dict:
    env = {"date": "2026-11-21T05:30:00+00:00", "device": "NVIDIA H200", "device_slug": "h200",
           "capability": "9.0", "sm_count": 132, "memory_gib": 139.8, "l2_bytes": 60 * 2**20,
           "torch": "2.11.0", "cuda": "13.0", "cudnn": 91900, "hopper-fmha": "0.1.0",
           "versions": {"nvidia-cutlass-dsl": "4.8.1", "flash-attn-4": "4.0.0b36"}}  # fmt: skip
    results = report.new_results("paper", env, {"warmup": 5, "iters": 30}, "hopper-fmha bench --preset paper")
    results["matmul"] = {"shape": [8192] * 3, "tflops": 750.0}
    p1, p2 = presets.paper().problems[:2]
    results["records"] = [
        _rec(p1, "hopper-fmha:paper", "paper", 600.0, ours=True, graph_tf=640.0),
        _rec(p1, "sdpa-flash", "FA2", 300.0, graph_tf=310.0),
        _rec(p1, "sdpa-cudnn", "cuDNN", 500.0, graph_tf=520.0),
        _rec(p1, "fa4", "FA4", 550.0, graph_tf=600.0),
        _rec(p1, "fa3", "FA3", None, status="skipped"),
        _rec(p2, "hopper-fmha:paper", "paper", 450.0, ours=True),  # not captured: eager, marked (e)
        _rec(p2, "sdpa-flash", "FA2", 250.0, graph_tf=260.0),
        _rec(p2, "sdpa-cudnn", "cuDNN", 400.0, graph_tf=470.0),
        # Wrong results never count as the best peer.
        _rec(p2, "fa4", "FA4", 900.0, status="wrong", graph_tf=950.0),
        _rec(p2, "fa3", "FA3", None, status="skipped"),
    ]
    results["complete"] = True
    return results


def test_source_digest_names_the_code(tmp_path):
    # Over every .py file below the root, by relative path and content, so a copy of the tree
    # without its git history still says which code ran.
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not code")
    first = runner.source_digest(tmp_path)
    assert len(first) == 12 and int(first, 16) >= 0 and runner.source_digest(tmp_path) == first
    (tmp_path / "notes.txt").write_text("changed, still not code")
    assert runner.source_digest(tmp_path) == first
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    changed = runner.source_digest(tmp_path)
    assert changed != first
    (tmp_path / "sub" / "b.py").rename(tmp_path / "b.py")
    assert runner.source_digest(tmp_path) not in (first, changed)
    # The package's own digest, recorded with every run and shown beside the git commit.
    assert runner.source_digest() == runner.source_digest() and len(runner.source_digest()) == 12
    results = _synthetic()
    results["env"].update(git="85ab35a-dirty", sources=first)
    assert f"hopper-fmha 0.1.0 (git 85ab35a-dirty, sources {first})" in report.render_markdown(results)
    del results["env"]["git"]
    assert f"hopper-fmha 0.1.0 (sources {first})" in report.render_markdown(results)


def test_json_round_trip_and_markdown_ratios(tmp_path):
    results = _synthetic()
    stem = report.output_stem(results)
    assert stem == "paper-h200-20261121T0530"
    path = tmp_path / f"{stem}.json"
    report.write_json(results, path)
    loaded = report.load_results(path)
    assert loaded == json.loads(json.dumps(results))
    md = report.render_markdown(loaded)
    assert md == report.render_markdown(results)
    # Two tables: CUDA graph first (its ratios are the claims), then eager.
    graph_md, eager_md = md.split("## TFLOP/s, CUDA-graph replays")[1].split("## TFLOP/s, eager calls")
    assert "ratios use kernel time (cuda graph); eager includes host overhead" in md.lower()

    def row(table, causal):
        return next(x for x in table.splitlines() if x.startswith(f"| 4 | 4096 | 32 | 64 | {causal} |"))

    # Graph: 640 / 310 FA2 = 2.06x; best of cuDNN 520, FA4 600 = 600: 640 / 600 = 1.07x.
    assert row(graph_md, "no").endswith("| 640.0 | 310.0 | 520.0 | 600.0 | 2.06× | 1.07× |")
    # Ours has no graph here: its eager 450 stands in, marked; FA4 is wrong, so the best is
    # cuDNN's graph 470: 450 / 470 = 0.96x; 450 / 260 = 1.73x.
    assert row(graph_md, "yes").endswith("| 450.0 (e) | 260.0 | 470.0 | 950.0 ✗ | 1.73× (e) | 0.96× (e) |")
    # Eager: 600 / 300 = 2.00x, 600 / 550 = 1.09x; 450 / 250 = 1.80x, 450 / 400 = 1.12x.
    assert row(eager_md, "no").endswith("| 600.0 | 300.0 | 500.0 | 550.0 | 2.00× | 1.09× |")
    assert row(eager_md, "yes").endswith("| 450.0 | 250.0 | 400.0 | 900.0 ✗ | 1.80× | 1.12× |")
    assert "**750.0 TFLOP/s**" in md
    assert "`fa3` (all problems): skipped for a reason" in md
    assert "| 80.0% | 85.3% |" in md  # profile: 600/750 and 640/750
    assert "| 1.5% / 1.5% |" in md  # round spread: per-round medians 1.005, 0.995, 0.99 of the median
    term = report.render_terminal(results)
    lines = term.splitlines()
    assert lines[0].split() == ["problem", "backend", "eager", "graph", "%mm", "÷FA2", "÷best", "÷best(e)",
                                "err/tol", "status"]  # fmt: skip
    ours1 = next(x for x in lines if "hopper-fmha:paper" in x and "causal" not in x)
    assert ours1.split()[6:13] == ["600.0", "640.0", "85%", "2.06", "1.07", "1.09", "0.50"]
    ours2 = next(x for x in lines if "hopper-fmha:paper" in x and "causal" in x)
    assert "0.96 (e)" in ours2 and "1.12" in ours2
    assert "ratios use kernel time (CUDA graph)" in term
    with pytest.raises(ValueError, match="schema"):
        bad = tmp_path / "bad.json"
        bad.write_text("{}")
        report.load_results(bad)


def test_claims_summary():
    results = _synthetic()
    (g, e) = report.claims_summary(results)["rows"]
    # Graph: 640/600 and 450 (e) / 470; eager: 600/550 and 450/400.
    assert g["backend"] == "hopper-fmha:paper" and g["subset"] == "all" and g["mode"] == "graph"
    assert g["geomean"] == pytest.approx((640 / 600 * 450 / 470) ** 0.5, abs=1e-4)
    assert (g["wins"], g["problems"], g["of"], g["eager_fallbacks"]) == (1, 2, 2, 1)
    assert e["geomean"] == pytest.approx((600 / 550 * 450 / 400) ** 0.5, abs=1e-4) and e["wins"] == 2
    term = report.render_terminal(results)
    assert (
        "hopper-fmha:paper  all  graph 1.011× (≥ best on 1/2, 1 eager)  eager 1.108× (≥ best on 2/2)" in term
    )
    assert "| `hopper-fmha:paper` | all | 2/2 | 1.011× | 1/2 | 1.108× | 2/2 | 1 |" in report.render_markdown(
        results
    )

    # The sweep: also N ≥ 2048 and N in {512, 1024}; ours is 1.1x the best at long N, 0.8x at short.
    sweep = _synthetic()
    sweep["preset"] = "sweep"
    sweep["records"] = []
    for p in presets.sweep().problems:
        f = 1.1 if p.seqlen_q >= 2048 else 0.8
        sweep["records"] += [
            _rec(p, "hopper-fmha:paper", "paper", 400.0 * f, ours=True, graph_tf=500.0 * f),
            _rec(p, "sdpa-cudnn", "cuDNN", 380.0, graph_tf=450.0),
            _rec(p, "fa4", "FA4", 400.0, graph_tf=500.0),
        ]
    rows = {(r["subset"], r["mode"]): r for r in report.claims_summary(sweep)["rows"]}
    assert set(rows) == {(s, m) for s in ("all", "N≥2048", "N∈{512,1024}") for m in ("graph", "eager")}
    for mode in ("graph", "eager"):
        assert rows[("N≥2048", mode)]["geomean"] == pytest.approx(1.1)
        assert (rows[("N≥2048", mode)]["wins"], rows[("N≥2048", mode)]["problems"]) == (48, 48)
        assert rows[("N∈{512,1024}", mode)]["geomean"] == pytest.approx(0.8)
        assert rows[("N∈{512,1024}", mode)]["wins"] == 0
        assert rows[("all", mode)]["geomean"] == pytest.approx(1.1 ** (2 / 3) * 0.8 ** (1 / 3), abs=1e-4)
        assert rows[("all", mode)]["problems"] == 72
    assert len(report.summary_lines(sweep)) == 1 + 3


def _tiles_results() -> dict:
    results = _synthetic()
    results["preset"] = "tiles"
    recs = []
    # The paper's C++ kernel on an H200 (peers.md); 128x128 at d=256 marked rejected.
    table = [(391, 429, 407, 431), (493, 477, 489, 338), (540, 461, 57, None)]
    for p, rates in zip(presets.tiles().problems, table, strict=True):
        for (m, n), r in zip(PAPER_TILES, rates, strict=True):
            name = f"hopper-fmha:paper@{m}x{n}"
            recs.append(_rec(p, name, f"paper@{m}x{n}", r, status="ok" if r else "rejected", ours=True))
    results["records"] = recs
    return results


def test_tile_grid_markdown():
    results = _tiles_results()
    md = report.render_markdown(results)
    assert "## Tiles, variant `paper` (seed paper Table 1), TFLOP/s (eager), best in bold" in md
    assert "| B4 N4096 H8 d256 fp16 | **540.0** | 461.0 | 57.0 | rejected |" in md
    assert "| B4 N4096 H16 d128 fp16 | **493.0** |" in md
    # With graph timings the grid shows graph time, eager marked (e) where a tile was not captured.
    for rec in results["records"]:
        if rec["eager"] and rec["backend"] != "hopper-fmha:paper@64x64":
            rec["graph"] = {**rec["eager"], "median_ms": rec["eager"]["median_ms"] / 2}
    md = report.render_markdown(results)
    assert "TFLOP/s (CUDA graph; (e) eager where no graph), best in bold" in md
    assert "| B4 N4096 H32 d64 fp16 | 391.0 (e) | 858.0 | 814.0 | **862.0** |" in md
    assert not report.claims_summary(results)["rows"]  # no peers: no summary


@pytest.mark.extras
def test_plots_are_small_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason=NEEDS_MATPLOTLIB)
    from PIL import Image

    paths, why = write_plots(_synthetic(), tmp_path, "paper")
    assert why is None and [p.name for p in paths] == ["paper-float16.png"]
    tile_paths, _ = write_plots(_tiles_results(), tmp_path, "tiles")
    assert [p.name for p in tile_paths] == ["tiles-tiles.png"]
    sweep = _synthetic()
    sweep["records"] = [
        _rec(p, name, label, 100.0 + i)
        for i, p in enumerate(presets.sweep().problems)
        for name, label in (("hopper-fmha:paper", "paper"), ("sdpa-flash", "FA2"), ("fa4", "FA4"))
    ]
    sweep_paths, _ = write_plots(sweep, tmp_path, "sweep")
    assert len(sweep_paths) == 2
    for path in paths + tile_paths + sweep_paths:
        assert path.stat().st_size < 150_000
        with Image.open(path) as im:
            assert im.format == "PNG" and im.size[0] < 2000


# ---- argparse and the whole command ----


def _parser():
    parser = argparse.ArgumentParser(prog="hopper-fmha")
    bench_cli.register(parser.add_subparsers())
    return parser


def test_register_wires_the_bench_subcommand():
    args = _parser().parse_args(
        ["bench", "--preset", "sweep", "--quick", "--no-graph", "--backends", "fa2,cudnn"]
    )
    assert args.func is bench_cli.run and args.quick and args.no_graph
    name, problems, names = bench_cli.plan(args)
    assert name == "sweep" and len(problems) == 72 and names == ["fa2", "cudnn"]
    assert bench_cli.timing_settings(args) == timing.TimingSettings.quick()
    assert timing.TimingSettings.quick().rounds == 1 and timing.TimingSettings().rounds == 3
    assert timing.TimingSettings.quick().settle_rounds == 0 and timing.TimingSettings().settle_rounds == 1
    assert timing.TimingSettings().per_round == 10  # 30 samples over 3 rounds
    settings = bench_cli.timing_settings(_parser().parse_args(["bench", "--rounds", "4", "--iters", "10"]))
    assert (settings.rounds, settings.per_round) == (4, 3)
    with pytest.raises(ValueError, match="--rounds must be at least 1"):
        bench_cli.timing_settings(_parser().parse_args(["bench", "--rounds", "0"]))

    name, problems, names = bench_cli.plan(_parser().parse_args(["bench", "--preset", "tiles"]))
    assert name == "tiles" and names == [f"hopper-fmha:paper@{m}x{n}" for m, n in PAPER_TILES]
    name, _, names = bench_cli.plan(_parser().parse_args(["bench", "--preset", "tiles", "--variant", "ws"]))
    assert name == "tiles-ws" and names == list(presets.tiles("ws").backends)
    with pytest.raises(ValueError, match="drop --tile"):
        bench_cli.plan(_parser().parse_args(["bench", "--preset", "tiles", "--tile", "128x64"]))

    args = _parser().parse_args(
        "bench --seqlen 512 1024 --seqlen-k 2048 --headdim 64 --kv-heads 4 --causal --dtype bf16 "
        "--variant paper --tile 64x128 --iters 7".split()
    )
    name, problems, names = bench_cli.plan(args)
    assert name == "custom" and [(p.batch, p.seqlen_q, p.seqlen_k) for p in problems] == [
        (32, 512, 2048),
        (16, 1024, 2048),
    ]
    assert all(p.heads == 32 and p.kv_heads == 4 and p.causal and p.dtype == "bfloat16" for p in problems)
    assert names[0] == "hopper-fmha:paper@64x128" and "hopper-fmha" not in names
    assert bench_cli.timing_settings(args).iters == 7

    with pytest.raises(ValueError, match="drop --batch"):
        bench_cli.plan(_parser().parse_args(["bench", "--preset", "paper", "--batch", "2"]))
    # --dtype beside a preset: the preset's shapes in those dtypes, dtype-major.
    _, problems, _ = bench_cli.plan(
        _parser().parse_args(["bench", "--preset", "paper", "--dtype", "fp16,bf16"])
    )
    assert len(problems) == 12 and [p.dtype for p in problems] == ["float16"] * 6 + ["bfloat16"] * 6
    assert [dataclasses.replace(p, dtype="float16") for p in problems[6:]] == list(problems[:6])
    _, problems, _ = bench_cli.plan(_parser().parse_args(["bench", "--preset", "sweep", "--dtype", "bf16"]))
    assert len(problems) == 36 and {p.dtype for p in problems} == {"bfloat16"}


def test_run_without_gpu_or_with_bad_flags_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_cli.run(_parser().parse_args(["bench", "--preset", "paper"])) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert bench_cli.run(_parser().parse_args(["bench", "--backends", "nope"])) == 2
    assert "unknown backend 'nope'" in capsys.readouterr().err


def test_from_json_rerenders_without_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "paper-h200-20261121T0530.json"
    report.write_json(_synthetic(), path)
    out = tmp_path / "out"
    args = _parser().parse_args(["bench", "--from-json", str(path), "--out", str(out), "--no-plot"])
    assert bench_cli.run(args) == 0
    assert (out / "paper-h200-20261121T0530.md").read_text() == report.render_markdown(_synthetic())


def _fake(name, fn_of_inputs, ours=False):
    def build(p, q, k, v):
        return lambda: fn_of_inputs(q, k, v, p.causal)

    return Backend(name, name, build, ours=ours)


def _whole_run(tmp_path, monkeypatch):
    """One whole bench run on CPU with fake backends: exit code, JSON path, archive names, backends."""
    monkeypatch.setattr(runner, "collect_env", lambda device: {**_synthetic()["env"], "device": "cpu"})
    good = _fake("good", runner.lowp_attention)
    wrong = _fake("wrong", lambda q, k, v, c: torch.zeros_like(q))
    ours_wrong = _fake("hopper-fmha:fake", lambda q, k, v, c: (torch.ones_like(q), None), ours=True)
    backends = [good, wrong, ours_wrong, registry.REGISTRY["sdpa-flash"], registry.REGISTRY["fa3"]]
    problems = (SMALL, Problem(1, 40, 72, 2, 2, 64, causal=True, dtype="bfloat16"))
    args = SimpleNamespace(
        no_graph=False, seed=0, tag="t", out=str(tmp_path), profile=True, no_plot=False, archive=True
    )
    settings = timing.TimingSettings(warmup=1, iters=4, min_sample_ms=0.1, max_calls_per_sample=4, rounds=2)
    code = bench_cli.execute(
        args, "custom", problems, backends, settings, device="cpu",
        timer=timing.CpuTimer(), reference=reference,
    )  # fmt: skip
    (json_path,) = tmp_path.glob("custom-h200-*-t.json")
    (archive,) = tmp_path.glob("custom-h200-*-t.tar.gz")
    with tarfile.open(archive) as tar:
        names = sorted(tar.getnames())
    return code, json_path, names, backends


def test_whole_run_on_cpu(tmp_path, monkeypatch):
    code, json_path, names, backends = _whole_run(tmp_path, monkeypatch)
    assert code == 1  # a hopper-fmha backend failed its check
    results = report.load_results(json_path)
    assert results["complete"] and len(results["records"]) == 2 * len(backends)
    assert results["settings"]["rounds"] == 2
    good_rec = next(r for r in results["records"] if r["backend"] == "good")
    assert good_rec["eager"]["rounds"] == 2 and len(good_rec["eager"]["samples_ms"]) == 4
    assert len(good_rec["eager"]["round_medians_ms"]) == 2 and good_rec["eager"]["samples_per_round"] == [
        2,
        2,
    ]
    # No peer of BEST_PEERS ran, so the summary has no rows, but it is there.
    assert results["summary"] == report.claims_summary(results) and results["summary"]["rows"] == []
    # --archive: the whole run in one file.
    assert json_path.name in names and json_path.with_suffix(".md").name in names
    status = {(r["backend"], r["problem"]["seqlen_k"]): r["status"] for r in results["records"]}
    assert status[("good", 67)] == status[("good", 72)] == "ok"
    assert status[("wrong", 67)] == "wrong" and status[("hopper-fmha:fake", 67)] == "wrong"
    assert status[("fa3", 67)] == "skipped" and status[("sdpa-flash", 72)] == "skipped"
    prof = next(r["profile"] for r in results["records"] if r["ours"])
    assert prof["launch_us"] > 0  # CPU: no clear_cache for a fake, but the launch time is measured
    assert Path(json_path.with_suffix(".md")).exists()


@pytest.mark.extras
def test_whole_run_writes_charts(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib", reason=NEEDS_MATPLOTLIB)
    _, _, names, _ = _whole_run(tmp_path, monkeypatch)
    assert any(n.endswith("-bfloat16.png") for n in names)  # in the archive
    assert list(tmp_path.glob("custom-h200-*-t-bfloat16.png"))


# ---- the CUDA-only code paths, with torch.cuda faked (control flow, not GPU behaviour) ----


class _FakeEvent:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = __import__("time").perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


class _FakeGraph:
    replays = 0

    def replay(self):
        _FakeGraph.replays += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    import contextlib

    stream = SimpleNamespace(wait_stream=lambda s: None)
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                            total_memory=80 * 2**30, L2_cache_size=50 * 2**20)  # fmt: skip
    for name, value in {
        "Event": _FakeEvent, "Stream": lambda: stream, "current_stream": lambda: stream,
        "stream": lambda s: contextlib.nullcontext(), "synchronize": lambda: None,
        "CUDAGraph": _FakeGraph, "graph": lambda g: contextlib.nullcontext(),
        "get_device_properties": lambda i: props,
    }.items():  # fmt: skip
        monkeypatch.setattr(torch.cuda, name, value)


def test_cuda_paths_with_fakes(fake_cuda):
    env = runner.collect_env("cuda")
    assert (
        env["device_slug"] == "h100-80gb-hbm3"
        and env["l2_bytes"] == 50 * 2**20
        and env["capability"] == "9.0"
    )
    timer = timing.CudaTimer()
    mm = timing.measure_matmul("cpu", timer, timing.TimingSettings.quick(), n=64)
    assert mm["tflops"] > 0 and len(mm["samples_ms"]) == 3
    good = _fake("good", runner.lowp_attention)
    sets = runner.make_inputs(SMALL, 3, "cpu", seed=0)
    _FakeGraph.replays = 0
    rec = runner.run_step(
        SMALL,
        good,
        sets,
        _checker(SMALL, sets),
        timer,
        timing.TimingSettings.quick(),
        graph=True,
        profile=True,
    )
    assert rec["status"] == "ok" and rec["graph"] is not None and rec["graph_reason"] is None
    assert rec["graph"]["calls_per_sample"] % 3 == 0 and _FakeGraph.replays >= 1 + 1 + 3
    assert rec["profile"]["launch_us"] > 0


def test_round_schedule():
    rounds = list(timing.round_schedule(3, 3))
    assert rounds[0] == [(0, "eager"), (0, "graph"), (1, "eager"), (1, "graph"), (2, "eager"), (2, "graph")]
    assert rounds[1] == [(1, "graph"), (1, "eager"), (2, "graph"), (2, "eager"), (0, "graph"), (0, "eager")]
    assert rounds[2][:2] == [(2, "eager"), (2, "graph")]


def test_problem_is_timed_in_interleaved_rounds(fake_cuda, monkeypatch):
    import gc
    import weakref

    log = []
    graphs = []

    class Graph(_FakeGraph):
        def __init__(self):
            graphs.append(weakref.ref(self))

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    real_block = runner._block

    def block(entry, mode, count, timer, keep=True, **kw):
        log.append((entry.backend.name, mode, keep))
        real_block(entry, mode, count, timer, keep, **kw)

    monkeypatch.setattr(runner, "_block", block)
    backends = [
        _fake("a", runner.lowp_attention),
        _fake("skip", lambda q, k, v, c: (_ for _ in ()).throw(RuntimeError("no"))),
        _fake("b", runner.lowp_attention, ours=True),
    ]
    sets = runner.make_inputs(SMALL, 2, "cpu", seed=0)
    settings = timing.TimingSettings(
        warmup=1, iters=5, min_sample_ms=0.01, max_calls_per_sample=2, rounds=2, settle_rounds=1
    )
    recs = runner.run_problem(
        SMALL, backends, sets, _checker(SMALL, sets), timing.CudaTimer(), settings, graph=True,
        heat=lambda: log.append("heat"),
    )  # fmt: skip
    # Pre-heat once, an untimed round from backend a with eager first, then timed round 1 from b
    # with graph first and round 2 from a with eager first.
    assert log == ["heat", ("a", "eager", False), ("a", "graph", False), ("b", "eager", False),
                   ("b", "graph", False), ("b", "graph", True), ("b", "eager", True),
                   ("a", "graph", True), ("a", "eager", True), ("a", "eager", True),
                   ("a", "graph", True), ("b", "eager", True), ("b", "graph", True)]  # fmt: skip
    assert [r["backend"] for r in recs] == ["a", "skip", "b"]
    assert [r["status"] for r in recs] == ["ok", "skipped", "ok"]
    for rec in (recs[0], recs[2]):
        for mode in ("eager", "graph"):
            t = rec[mode]
            assert t["rounds"] == 2 and t["samples_per_round"] == [3, 3] and len(t["samples_ms"]) == 6
            assert len(t["round_medians_ms"]) == 2
    # One graph per timed backend, captured once, freed with the problem.
    assert len(graphs) == 2
    gc.collect()
    assert all(g() is None for g in graphs)


def test_graph_capture_failure_is_reported_not_fatal(fake_cuda, monkeypatch):
    def broken_graph(g):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph", broken_graph)
    sets = runner.make_inputs(SMALL, 2, "cpu", seed=0)
    good = _fake("good", runner.lowp_attention)
    rec = runner.run_step(
        SMALL,
        good,
        sets,
        _checker(SMALL, sets),
        timing.CudaTimer(),
        timing.TimingSettings.quick(),
        graph=True,
    )
    assert rec["status"] == "ok" and rec["eager"] and rec["graph"] is None
    assert (
        rec["graph_reason"]
        == "capture or replay raised RuntimeError: operation not permitted when stream is capturing"
    )
    md = report.render_markdown({**_synthetic(), "records": [rec]})
    assert "graph n/a: capture or replay raised" in md


def test_lost_cuda_context_stops_the_run_and_keeps_records(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "collect_env", lambda device: {**_synthetic()["env"], "device": "cpu"})
    state = {"dead": False}

    class DyingTimer(timing.CpuTimer):
        def synchronize(self):
            if state["dead"]:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def crash(q, k, v, causal):
        state["dead"] = True
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    backends = [_fake("good", runner.lowp_attention), _fake("hopper-fmha:crash", crash, ours=True)]
    args = SimpleNamespace(no_graph=True, seed=0, tag=None, out=str(tmp_path), profile=False, no_plot=True)
    code = bench_cli.execute(
        args, "custom", (SMALL, SMALL), backends, timing.TimingSettings.quick(), device="cpu",
        timer=DyingTimer(), reference=reference,
    )  # fmt: skip
    assert code == 3
    (json_path,) = tmp_path.glob("*.json")
    results = report.load_results(json_path)
    # The crash happened while preparing the second backend: the first was never timed.
    assert not results["complete"] and [r["status"] for r in results["records"]] == ["error", "skipped"]
    assert results["records"][0]["check"]["passed"]
    assert results["records"][0]["reason"].startswith("not timed: the CUDA context was lost")
    assert "(CUDA context lost)" in results["records"][1]["reason"]
    assert "incomplete run" in json_path.with_suffix(".md").read_text()


def test_method_line_names_the_untimed_rounds():
    from hopper_fmha.bench.report import settle_text

    assert settle_text(0) == ""
    assert settle_text(1) == " and 1 untimed round of every backend"
    assert settle_text(2).endswith("2 untimed rounds of every backend")


def test_steady_blocks_run_untimed_first():
    from hopper_fmha.bench.report import steady_text

    class Sampler:
        calls = 2

        def __init__(self):
            self.taken = 0

        def samples(self, n):
            self.taken += n
            return [0.5] * n  # 1 ms of GPU time per sample (2 calls of 0.5 ms)

    s = Sampler()
    assert timing.run_untimed(s, 20.0) == 24.0 and s.taken == 24  # whole batches of 8
    assert timing.run_untimed(Sampler(), 0.0) == 0.0
    assert timing.TimingSettings().steady_ms == 0.0
    settings = bench_cli.timing_settings(_parser().parse_args(["bench", "--steady-ms", "300"]))
    assert settings.steady_ms == 300.0
    with pytest.raises(ValueError, match="--steady-ms"):
        bench_cli.timing_settings(_parser().parse_args(["bench", "--steady-ms", "-1"]))
    assert steady_text(0) == "" and "300 ms of untimed calls" in steady_text(300.0)


def test_blocks_are_timed_until_they_cover_block_ms():
    from hopper_fmha.bench.report import samples_text

    class Sampler:
        def __init__(self, calls, ms):
            self.calls, self.ms, self.taken = calls, ms, 0

        def samples(self, n):
            self.taken += n
            return [self.ms] * n

    # 2 calls of 0.5 ms a sample: 12 samples are 12 ms; 12 more at a time until >= 30 ms.
    s = Sampler(2, 0.5)
    assert len(timing.timed_samples(s, 12, 30.0)) == 36 and s.taken == 36
    # Without block_ms, or where the first samples cover it, just `count`.
    assert len(timing.timed_samples(Sampler(2, 0.5), 12)) == 12
    assert len(timing.timed_samples(Sampler(1, 5.0), 12, 30.0)) == 12
    # A timer that reports nothing stops after one more batch instead of looping.
    assert len(timing.timed_samples(Sampler(1, 0.0), 4, 30.0)) == 4
    assert timing.TimingSettings().block_ms == 0.0
    settings = bench_cli.timing_settings(_parser().parse_args(["bench", "--block-ms", "1000"]))
    assert settings.block_ms == 1000.0
    with pytest.raises(ValueError, match="--block-ms"):
        bench_cli.timing_settings(_parser().parse_args(["bench", "--block-ms", "-5"]))
    # Past MAX_RAW_SAMPLES the samples are kept as deciles; median, count and rounds as before.
    many = [[float(i) for i in range(200)], [float(i) for i in range(200, 400)]]
    t = timing.summarize([], 1, rounds=many)
    assert "samples_ms" not in t and t["num_samples"] == 400 and len(t["deciles_ms"]) == 9
    assert t["median_ms"] == 199.5 and t["round_medians_ms"] == [99.5, 299.5]
    assert t["deciles_ms"][4] == t["median_ms"]
    few = timing.summarize([1.0, 2.0, 3.0], 4)
    assert few["samples_ms"] == [1.0, 2.0, 3.0] and few["num_samples"] == 3 and "deciles_ms" not in few
    assert report.num_samples(t) == 400 and report.num_samples({"samples_ms": [1.0, 2.0]}) == 2
    assert samples_text(12, 2, 0) == "12 samples per mode and round: median of all 24 samples"
    assert "cover 1000 ms of GPU time" in samples_text(12, 2, 1000.0)


def test_run_problem_passes_block_ms_to_every_block(fake_cuda, monkeypatch):
    seen = []
    real_block = runner._block

    def block(entry, mode, count, timer, keep=True, **kw):
        seen.append(kw)
        real_block(entry, mode, count, timer, keep, **kw)

    monkeypatch.setattr(runner, "_block", block)
    sets = runner.make_inputs(SMALL, 2, "cpu", seed=0)
    settings = timing.TimingSettings(
        warmup=1, iters=2, min_sample_ms=0.01, max_calls_per_sample=2, rounds=1, settle_rounds=0,
        steady_ms=0.0, block_ms=20.0,
    )  # fmt: skip
    (rec,) = runner.run_problem(
        SMALL, [_fake("a", runner.lowp_attention)], sets, _checker(SMALL, sets), timing.CudaTimer(),
        settings, graph=False,
    )  # fmt: skip
    assert seen and all(kw == {"steady_ms": 0.0, "block_ms": 20.0} for kw in seen)
    # The timed block covers the 20 ms (the fake timer is the wall clock), whatever 2 samples took.
    t = rec["eager"]
    assert rec["status"] == "ok" and t["num_samples"] >= 2 and t["num_samples"] % 2 == 0
    assert sum(t["samples_ms"]) * t["calls_per_sample"] >= 20.0


def test_issue_set_script_aggregates_runs(tmp_path, capsys):
    # scripts/issue_set.py: the paper preset's cells and the sweep's at N >= 2048 form the issue
    # set, the sweep's N = 512/1024 the short cells; a paper problem that the sweep also has
    # counts once for each file.
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "issue_set", Path(__file__).parents[1] / "scripts/issue_set.py"
    )
    issue_set = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(issue_set)
    paper, sweep = _synthetic(), _synthetic()
    paper["records"] = [
        r
        for p in presets.paper().problems[:2]
        for r in (
            _rec(p, "hopper-fmha:auto", "auto", 420.0, ours=True, graph_tf=525.0),
            _rec(p, "fa4", "FA4", 400.0, graph_tf=500.0),
        )
    ]
    sweep["preset"], sweep["records"] = "sweep", []
    for n, f in ((512, 0.9), (4096, 1.05), (16384, 1.2)):
        p = Problem(16384 // n, n, n, 16, 16, 128)
        sweep["records"] += [
            _rec(p, "hopper-fmha:auto", "auto", 400.0 * f, ours=True, graph_tf=500.0 * f),
            _rec(p, "sdpa-cudnn", "cuDNN", 380.0, graph_tf=450.0),
            _rec(p, "fa4", "FA4", 400.0, graph_tf=500.0),
        ]
    paths = []
    for name, results in (("paper.json", paper), ("sweep.json", sweep)):
        report.write_json(results, tmp_path / name)
        paths.append(str(tmp_path / name))
    cells = issue_set.cells(paths)
    assert len(cells) == 2 * (2 + 3)
    issue_set.main(paths)
    out = capsys.readouterr().out.splitlines()
    # Issue set: 1.05 (paper) twice, 1.05 and 1.2 (sweep); short: 0.9 alone.
    want = (1.05**3 * 1.2) ** 0.25
    assert out[0].startswith(f"issue set (paper + N>=2048)  graph n= 4 geomean {want:.4f} >=1: 4/4")
    assert out[3].startswith("short (N 512/1024)           graph n= 1 geomean 0.9000 >=1: 0/1")
    assert "B32 N512 H16 d128 fp16 0.9000" in out[3]
    assert len(out) == 8 and out[4].startswith("issue set (paper + N>=2048)  eager n= 4")
