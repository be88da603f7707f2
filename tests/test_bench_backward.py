"""The bench's backward pieces on CPU: training problems (FLOPs 2.5x and 3.5x the forward's,
labels, dicts, bytes), the `backward` preset and its backends, the inputs' dout, the autograd call
every backend is timed through (the forward outside the timed call for "bwd", ours called on
inputs that require grad with no environment variable set), the gradient check, the report's pass
column, summary and note, and a whole run with stand-in backends (one correct peer, one wrong, one
whose backward raises)."""

import argparse
import dataclasses
import os
import sys
from types import ModuleType

import pytest
import torch
from bench_cpu_run import execute_on_cpu

from hopper_fmha.bench import cli as bench_cli
from hopper_fmha.bench import plots, presets, registry, report, runner, timing
from hopper_fmha.bench.flops import BWD, FWD, FWD_BWD, attention_flops, pass_flops
from hopper_fmha.bench.registry import Backend, Problem
from hopper_fmha.reference import reference

pytestmark = pytest.mark.cpu

# Small enough for CPU: odd lengths so the causal mask cuts through tiles; GQA.
SMALL = Problem(1, 67, 67, 4, 2, 64, causal=True, dtype="bfloat16", passes=BWD)


def _parser():
    parser = argparse.ArgumentParser(prog="hopper-fmha")
    bench_cli.register(parser.add_subparsers())
    return parser


def _bench_help() -> str:
    return bench_cli.register(argparse.ArgumentParser(prog="hopper-fmha").add_subparsers()).format_help()


# ---- the problem ----


def test_training_flops_are_2_5_and_3_5_times_the_forward():
    # The paper shape at d=64: 4 * 4 * 32 * 4096^2 * 64 forward FLOPs; causal halves it.
    forward = Problem(4, 4096, 4096, 32, 32, 64)
    assert forward.flops == 549_755_813_888 == attention_flops(4, 32, 4096, 4096, 64)
    assert dataclasses.replace(forward, passes=BWD).flops == 1_374_389_534_720  # 2.5x
    assert dataclasses.replace(forward, passes=FWD_BWD).flops == 1_924_145_348_608  # 3.5x
    causal = dataclasses.replace(forward, causal=True)
    assert dataclasses.replace(causal, passes=BWD).flops == 687_194_767_360
    assert dataclasses.replace(causal, passes=FWD_BWD).flops == 962_072_674_304
    assert pass_flops(1000.0, FWD) == 1000.0 and pass_flops(1000.0, BWD) == 2500.0
    with pytest.raises(ValueError, match="passes must be one of"):
        pass_flops(1.0, "bwd+fwd")


def test_training_problems_are_told_apart():
    p = Problem(4, 4096, 4096, 16, 16, 128, causal=True, passes=FWD_BWD)
    assert p.training and not dataclasses.replace(p, passes=FWD).training
    assert p.label() == "B4 N4096 H16 d128 fp16 causal fwd+bwd"
    assert dataclasses.replace(p, passes=BWD).label() == "B4 N4096 H16 d128 fp16 causal bwd"
    assert dataclasses.replace(p, passes=FWD).label() == "B4 N4096 H16 d128 fp16 causal"
    # Through JSON and back; forward problems keep their dicts (no "passes" key).
    d = p.to_dict()
    assert d["passes"] == "fwd+bwd" and Problem.from_dict(d) == p
    assert "passes" not in dataclasses.replace(p, passes=FWD).to_dict()
    # A set holds q, k, v, out, dout and the three gradients: 8 tensors of 64 MiB here.
    assert p.input_bytes == 8 * 4 * 4096 * 16 * 128 * 2 == 2 * dataclasses.replace(p, passes=FWD).input_bytes
    assert p.output_bytes == 4 * 4 * 4096 * 16 * 128 * 2  # out, dq, dk, dv
    with pytest.raises(ValueError, match="passes must be one of"):
        Problem(1, 64, 64, 2, 2, 64, passes="backward")
    with pytest.raises(ValueError, match="timed on dense and varlen problems"):
        dataclasses.replace(Problem.decode(2, 64, 4, 2, 64), passes=BWD)


# ---- the preset ----


def test_backward_preset_grid_and_backends():
    preset = presets.get_preset("backward")
    assert preset.name == "backward" and len(preset.problems) == 12
    # Hidden 2048: H = 2048 / d; B = 4, N = 4096, kv heads = heads, fp16 (the paper's default).
    assert [(p.head_dim, p.heads, p.causal, p.passes) for p in preset.problems] == [
        (d, 2048 // d, c, x) for d in (64, 128, 256) for c in (False, True) for x in (BWD, FWD_BWD)
    ]
    assert all(
        (p.batch, p.seqlen_q, p.seqlen_k, p.kv_heads, p.dtype) == (4, 4096, 4096, p.heads, "float16")
        for p in preset.problems
    )
    # The same shapes as the paper preset, each once per pass.
    shapes = {dataclasses.replace(p, passes=FWD) for p in preset.problems}
    assert shapes == set(presets.paper().problems)
    assert preset.backends == ("hopper-fmha:auto", "hopper-fmha:auto+det", "fa4", "sdpa-cudnn", "sdpa-flash")
    assert [b.name for b in registry.resolve_backends(preset.backends)] == list(preset.backends)
    assert registry.get_backend("fa2") == [registry.REGISTRY["sdpa-flash"]]  # the registry's FA2
    args = _parser().parse_args(["bench", "--preset", "backward"])
    assert bench_cli.plan(args) == ("backward", preset.problems, list(preset.backends))
    # --dtype: the same grid in each dtype, dtype-major, the passes kept.
    _, problems, _ = bench_cli.plan(
        _parser().parse_args(["bench", "--preset", "backward", "--dtype", "fp16,bf16"])
    )
    assert len(problems) == 24 and [p.dtype for p in problems] == ["float16"] * 12 + ["bfloat16"] * 12
    assert [dataclasses.replace(p, dtype="float16") for p in problems[12:]] == list(preset.problems)
    # `hopper-fmha bench --help` lists it, among the choices and in the presets' descriptions.
    text = _bench_help()
    assert "{backward,backward-features,decode,features,host,paper,sweep,tiles,varlen}" in text
    assert "\n  backward the paper's problems" in text
    assert "backends hopper-fmha:auto, fa4, sdpa-cudnn, sdpa-flash, all through autograd" in text


# ---- inputs and the autograd call ----


def test_make_inputs_adds_dout_after_the_forward_inputs():
    sets = runner.make_inputs(SMALL, 2, "cpu", seed=5)
    q, k, v, dout = sets[0]
    assert dout.shape == q.shape and dout.dtype == q.dtype == torch.bfloat16
    assert not torch.equal(dout, q) and not torch.equal(sets[1][3], dout)
    # q, k, v are those of the forward problem with the same seed: dout is drawn after them.
    fq, fk, fv = runner.make_inputs(dataclasses.replace(SMALL, passes=FWD), 1, "cpu", seed=5)[0]
    assert torch.equal(fq, q) and torch.equal(fk, k) and torch.equal(fv, v)


def _counting(calls: list):
    """A stand-in dense build: PyTorch's attention, counting the forwards it runs."""

    def build(p, q, k, v):
        def forward():
            calls.append(p.passes)
            return runner.lowp_attention(q, k, v, p.causal)

        return forward

    return build


def _torch_grads(p, q, k, v, dout):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    return torch.autograd.grad(runner.lowp_attention(*leaves, p.causal), leaves, dout)


def test_autograd_call_runs_the_forward_outside_the_timed_call():
    calls = []
    backend = Backend("standin", "standin", _counting(calls))
    q, k, v, dout = runner.make_inputs(SMALL, 1, "cpu", seed=1)[0]
    want = _torch_grads(SMALL, q, k, v, dout)
    call = backend.make(SMALL, q, k, v, dout)
    assert calls == [BWD]  # the one forward, at build time
    for _ in range(3):  # retain_graph: the backward alone, again and again
        grads = call()
        assert len(grads) == 3 and all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))
    assert calls == [BWD]
    both = backend.make(dataclasses.replace(SMALL, passes=FWD_BWD), q, k, v, dout)
    assert calls == [BWD]  # nothing runs before the first call
    both()
    both()
    assert calls == [BWD, FWD_BWD, FWD_BWD]  # one forward per call
    assert not q.requires_grad  # the inputs themselves are left alone


def test_autograd_call_matches_layouts_and_first_outputs(monkeypatch):
    # SDPA returns BHSD: dout is transposed to match, and the gradients come back in BSHD.
    q, k, v, dout = sets = runner.make_inputs(SMALL, 1, "cpu", seed=2)[0]
    grads = registry.REGISTRY["sdpa-flash"].make(SMALL, *sets)()
    assert [tuple(g.shape) for g in grads] == [tuple(q.shape), tuple(k.shape), tuple(v.shape)]
    assert runner.make_checker(SMALL, *sets, reference=reference).check(grads)["passed"]
    # FA4 returns (out, lse) in some versions: the grad is of out.
    fa4 = ModuleType("flash_attn.cute")
    fa4.flash_attn_func = lambda q, k, v, causal=False: (runner.lowp_attention(q, k, v, causal), None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fa4)
    grads = registry.REGISTRY["fa4"].make(SMALL, *sets)()
    assert all(torch.equal(g, w) for g, w in zip(grads, _torch_grads(SMALL, *sets), strict=True))


def test_ours_is_called_on_inputs_that_require_grad_with_the_environment_untouched(monkeypatch):
    # Our backward is on by default: the bench calls flash_attn_func on leaves that require grad,
    # in grad mode, and sets no environment variable for it (nor does a peer's call).
    import hopper_fmha

    environ = dict(os.environ)
    seen = []

    def ours(q, k, v, causal=False, return_lse=False, variant=None, tile=None):
        seen.append((q.requires_grad, k.requires_grad, v.requires_grad, torch.is_grad_enabled()))
        return runner.lowp_attention(q, k, v, causal)

    monkeypatch.setattr(hopper_fmha, "flash_attn_func", ours)
    (auto,) = registry.get_backend("hopper-fmha:auto")
    sets = runner.make_inputs(SMALL, 1, "cpu", seed=3)[0]
    registry.REGISTRY["sdpa-flash"].make(SMALL, *sets)
    grads = auto.make(SMALL, *sets)()
    assert seen == [(True, True, True, True)]  # the forward, once, before the timed grad
    assert dict(os.environ) == environ
    assert runner.make_checker(SMALL, *sets, reference=reference).check(grads)["passed"]


# ---- the gradient check ----


def test_grad_checker_checks_each_gradient():
    q, k, v, dout = sets = runner.make_inputs(SMALL, 1, "cpu", seed=4)[0]
    chk = runner.make_checker(SMALL, *sets, reference=reference)
    assert isinstance(chk, runner.GradChecker)
    with pytest.raises(ValueError, match="GradChecker"):
        runner.Checker(SMALL, *sets)
    # The reference's gradients are fp32 autograd of the reference.
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(reference(*leaves, causal=True)[0], leaves, dout.float())
    for got, w in zip(chk.refs, want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    # Per batch element and kv-head block or all at once: the same gradients.
    one_block = runner._grad_baselines(SMALL, q, k, v, dout, reference=reference, max_scores=10)
    for got, w in zip(one_block[0], chk.refs, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    good = _torch_grads(SMALL, q, k, v, dout)
    res = chk.check(good)
    assert res["passed"] and set(res["grads"]) == {"dq", "dk", "dv"} and res["grad"] in res["grads"]
    assert all(0 < r["torch_lowp_err"] < r["tol"] for r in res["grads"].values())
    assert res["max_abs_err"] == res["grads"][res["grad"]]["max_abs_err"]
    # One wrong gradient fails the check, and is named.
    dq, dk, dv = good
    wrong = dk.clone()
    wrong[0, 30, 1] += 1.0  # one key row of one kv head
    bad = chk.check((dq, wrong, dv))
    assert not bad["passed"] and bad["grad"] == "dk" and bad["reason"].startswith("dk: max abs error")
    assert bad["grads"]["dq"]["passed"] and bad["grads"]["dv"]["passed"]
    nan = dv.clone()
    nan[0, 0, 0, 0] = float("nan")
    assert chk.check((dq, dk, nan))["reason"] == "non-finite values in the dv"
    assert "dq shape" in chk.check((dq[:, :-1], dk, dv))["reason"]
    assert chk.check(dq)["reason"] == "the call returned Tensor, not (dq, dk, dv)"
    # The forward's output is not the gradients.
    assert not chk.check((runner.lowp_attention(q, k, v, True), dk, dv))["passed"]


def test_training_problems_are_not_captured():
    calls = []
    p = dataclasses.replace(SMALL, passes=FWD_BWD)
    sets = runner.make_inputs(p, 2, "cpu", seed=0)
    rec = runner.run_step(
        p, Backend("standin", "standin", _counting(calls)), sets,
        lambda: runner.make_checker(p, *sets[0], reference=reference), timing.CpuTimer(),
        timing.TimingSettings.quick(), graph=True,
    )  # fmt: skip
    # graph=True, yet no capture was tried (on CPU it would raise): eager time only, with why.
    assert rec["status"] == "ok" and rec["graph"] is None and rec["eager"] is not None
    assert rec["graph_reason"] == runner.TRAINING_NOT_CAPTURED
    assert (
        rec["check"]["passed"] and rec["flops"] == p.flops == 3.5 * dataclasses.replace(p, passes=FWD).flops
    )


# ---- the report ----


def _rec(p: Problem, name: str, tf: float | None, ours=False, status="ok") -> dict:
    ms = p.flops / (tf * 1e12) * 1e3 if tf else None
    t = timing.summarize([ms] * 3, 1) if ms else None
    return {
        "problem": p.to_dict(), "backend": name, "label": registry.REGISTRY[name].label
        if name in registry.REGISTRY else name, "ours": ours, "flops": p.flops, "n_sets": 2,
        "set_bytes": p.input_bytes, "status": status, "reason": None if t else "raised X",
        "check": {"max_abs_err": 1e-3, "tol": 2e-3, "torch_lowp_err": 9e-4, "passed": status != "wrong",
                  "grad": "dk"},
        "eager": t, "graph": None, "graph_reason": runner.TRAINING_NOT_CAPTURED, "profile": None,
    }  # fmt: skip


def _backward_results() -> dict:
    env = {"date": "2026-11-21T05:30:00+00:00", "device": "NVIDIA H100", "device_slug": "h100"}
    settings = {"warmup": 5, "iters": 30, "rounds": 3}
    results = report.new_results("backward", env, settings, "hopper-fmha bench --preset backward")
    bwd, fwd_bwd, bwd_c = presets.backward().problems[:3]
    ours = "hopper-fmha:auto"
    results["records"] = [
        _rec(bwd, ours, 400.0, ours=True), _rec(bwd, "fa4", 500.0), _rec(bwd, "sdpa-cudnn", 450.0),
        _rec(bwd, "sdpa-flash", 200.0),
        _rec(fwd_bwd, ours, 420.0, ours=True), _rec(fwd_bwd, "fa4", 900.0, status="wrong"),
        _rec(fwd_bwd, "sdpa-cudnn", 350.0), _rec(fwd_bwd, "sdpa-flash", 210.0),
        _rec(bwd_c, ours, None, ours=True, status="skipped"), _rec(bwd_c, "fa4", 300.0),
        _rec(bwd_c, "sdpa-cudnn", 310.0), _rec(bwd_c, "sdpa-flash", 150.0),
    ]  # fmt: skip
    results["complete"] = True
    return results


def test_report_has_a_pass_column_ratios_and_a_summary_per_pass():
    results = _backward_results()
    md = report.render_markdown(results)
    table = md.split("## TFLOP/s, eager calls (no CUDA-graph timings in this run)")[1]
    header = (
        "| B | N | H | d | causal | dtype | pass | hopper-fmha:auto | FA4 | cuDNN | FA2 | "
        "hopper-fmha:auto ÷ FA2 | hopper-fmha:auto ÷ best peer |"
    )
    assert header in table
    # bwd: best peer FA4 500: 400 / 500 = 0.80x, 400 / 200 = 2.00x FA2.
    row = "| 4 | 4096 | 32 | 64 | no | float16 | bwd | 400.0 | 500.0 | 450.0 | 200.0 | 2.00× | 0.80× |"
    assert row in table
    # fwd+bwd: FA4 is wrong, so the best peer is cuDNN: 420 / 350 = 1.20x.
    row = "| 4 | 4096 | 32 | 64 | no | float16 | fwd+bwd | 420.0 | 900.0 ✗ | 350.0 | 210.0 | 2.00× | 1.20× |"
    assert row in table
    # Ours failed on the causal bwd cell: reported, no ratio.
    row = "| 4 | 4096 | 32 | 64 | yes | float16 | bwd | skipped | 300.0 | 310.0 | 150.0 | – | – |"
    assert row in table
    assert "- `hopper-fmha:auto` (B4 N4096 H32 d64 fp16 causal bwd): raised X" in md
    assert report.TRAINING_NOTE in md and "FLOPs: bwd 2.5×, fwd+bwd 3.5× the forward's" in md
    assert "(dk)" in md.split("## Details")[1]  # the gradient whose error is shown
    # The summary: all problems, then each pass.
    rows = {(r["subset"], r["mode"]): r for r in report.claims_summary(results)["rows"]}
    assert rows[("all", "eager")]["problems"] == 2 and rows[("all", "eager")]["of"] == 3
    assert rows[("bwd", "eager")]["geomean"] == 0.8 and rows[("bwd", "eager")]["of"] == 2
    assert rows[("fwd+bwd", "eager")]["geomean"] == 1.2 and rows[("fwd+bwd", "eager")]["wins"] == 1
    assert [r["subset"] for r in report.claims_summary(results)["rows"]][::2] == ["all", "bwd", "fwd+bwd"]
    term = report.render_terminal(results)
    assert "B4 N4096 H32 d64 fp16 fwd+bwd" in term
    # A forward-only run: no pass column, no note, no pass subsets.
    forward = {
        **results,
        "records": [{**r, "problem": {**r["problem"], "passes": FWD}} for r in results["records"]],
    }
    fmd = report.render_markdown(forward)
    assert "| pass |" not in fmd and report.TRAINING_NOTE not in fmd
    assert "| B | N | H | d | causal | dtype |" in fmd


def test_chart_labels_name_the_pass():
    bwd, fwd_bwd = presets.backward().problems[:2]
    assert plots._x_label(bwd, [bwd, fwd_bwd]) == "4096 bwd"
    assert plots._x_label(fwd_bwd, [bwd, fwd_bwd]) == "4096 fwd+bwd"
    forward = presets.paper().problems[0]
    assert plots._x_label(forward, [forward]) == "4096"


# ---- a whole run ----


class _NoBackward(torch.autograd.Function):
    """The identity, whose backward raises: a backend whose backward fails on the problem."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("no backward kernel for this problem")


def test_whole_backward_run_on_cpu(tmp_path, monkeypatch):
    import hopper_fmha

    monkeypatch.setattr(runner, "collect_env", lambda device: {**_backward_results()["env"], "device": "cpu"})
    seen = []

    def ours(q, k, v, causal=False, return_lse=False, variant=None, tile=None):  # stands in for the kernel
        seen.append(q.requires_grad and torch.is_grad_enabled())
        return runner.lowp_attention(q, k, v, causal)

    monkeypatch.setattr(hopper_fmha, "flash_attn_func", ours)
    (auto,) = registry.get_backend("hopper-fmha:auto")

    def build(fn):
        return lambda p, q, k, v: lambda: fn(q, k, v, p.causal)

    backends = [
        auto,
        Backend("fa4", "FA4", build(runner.lowp_attention)),  # a correct peer
        # A wrong peer, and a fast one: it must not count as the best.
        Backend("fa3", "FA3", build(lambda q, k, v, causal: q + (k + v) * 0.5)),
        Backend(
            "sdpa-cudnn",
            "cuDNN",
            build(lambda q, k, v, c: _NoBackward.apply(runner.lowp_attention(q, k, v, c))),
        ),
        registry.REGISTRY["sdpa-flash"],  # the real one: PyTorch has CPU flash kernels
    ]
    # The preset's grid at d=64, shrunk to CPU size.
    shrink = {"batch": 1, "seqlen_q": 67, "seqlen_k": 67, "heads": 4, "kv_heads": 4, "dtype": "bfloat16"}
    problems = tuple(
        dataclasses.replace(p, **shrink) for p in presets.backward().problems if p.head_dim == 64
    )
    assert [(p.causal, p.passes) for p in problems] == [(c, x) for c in (False, True) for x in (BWD, FWD_BWD)]
    # Exit 0: ours correct everywhere; the failing and wrong peers are reported, not fatal.
    results, recs, json_path = execute_on_cpu(tmp_path, "backward", problems, backends, graph=True)
    assert seen and all(seen)  # ours ran on inputs that require grad, in grad mode
    assert results["complete"] and len(results["records"]) == len(problems) * len(backends)
    for p in problems:
        forward = dataclasses.replace(p, passes=FWD).flops
        for name in ("hopper-fmha:auto", "fa4", "sdpa-flash"):
            rec = recs[(name, p)]
            assert rec["status"] == "ok" and rec["check"]["passed"], (name, p, rec["reason"])
            assert rec["flops"] == (2.5 if p.passes == BWD else 3.5) * forward
        assert recs[("fa3", p)]["status"] == "wrong" and recs[("fa3", p)]["check"]["grad"] in (
            "dq",
            "dk",
            "dv",
        )
        failed = recs[("sdpa-cudnn", p)]
        assert failed["status"] == "skipped" and failed["eager"] is None
        assert failed["reason"] == "raised RuntimeError: no backward kernel for this problem"
    # The report: one row per problem, the pass named, ours ÷ the best correct peer (FA4, the
    # only one: cuDNN failed, FA3 is wrong), eager time (e).
    md = json_path.with_suffix(".md").read_text()
    table = md.split("## TFLOP/s, eager calls")[1].split("\n\n")[1].splitlines()
    assert table[0] == (
        "| B | N | H | d | causal | dtype | pass | hopper-fmha:auto | FA4 | FA3 | FA2 | "
        "hopper-fmha:auto ÷ FA2 | hopper-fmha:auto ÷ best peer |"
    )
    assert len(table) == 2 + len(problems)
    for line, p in zip(table[2:], problems, strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        ours_rate, fa4_rate = (report.rate(recs[(n, p)], "eager") for n in ("hopper-fmha:auto", "fa4"))
        fa2_rate = report.rate(recs[("sdpa-flash", p)], "eager")
        assert cells[:7] == ["1", "67", "4", "64", "yes" if p.causal else "no", "bfloat16", p.passes]
        assert cells[7] == f"{ours_rate:.1f}" and cells[9].endswith("✗")
        assert cells[-2] == f"{ours_rate / fa2_rate:.2f}×" and cells[-1] == f"{ours_rate / fa4_rate:.2f}×"
    assert "- `sdpa-cudnn` (all problems): raised RuntimeError: no backward kernel for this problem" in md
    summary = {(r["subset"], r["mode"]): r for r in results["summary"]["rows"]}
    assert summary[("bwd", "eager")]["problems"] == summary[("fwd+bwd", "eager")]["problems"] == 2
    assert summary[("all", "graph")]["eager_fallbacks"] == 4  # no graphs: all eager, counted


def test_deterministic_backend_passes_the_keyword(monkeypatch):
    import hopper_fmha

    seen = []

    def ours(q, k, v, causal=False, return_lse=False, variant=None, tile=None, **kwargs):
        seen.append(kwargs)
        return runner.lowp_attention(q, k, v, causal)

    monkeypatch.setattr(hopper_fmha, "flash_attn_func", ours)
    (det,) = registry.get_backend("hopper-fmha:auto+det")
    (plain,) = registry.get_backend("hopper-fmha:auto")
    assert det.name == "hopper-fmha:auto+det" and det.ours
    sets = runner.make_inputs(SMALL, 1, "cpu", seed=3)[0]
    det.make(SMALL, *sets)()
    plain.make(SMALL, *sets)()
    assert seen == [{"deterministic": True}, {}]
    (ws_det,) = registry.get_backend("hopper-fmha:ws@128x128+lse+det")
    assert ws_det.name == "hopper-fmha:ws@128x128+lse+det"
