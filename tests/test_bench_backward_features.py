"""The bench's backward on varlen and score-feature problems, on CPU: such training problems
(FLOPs 2.5x and 3.5x the forward's per sequence and per visible pair, checked by hand), the
`backward-features` preset, the packed inputs with dout, the autograd calls of ours (window,
softcap, a sink that requires grad, deterministic, cu_seqlens) and of FA4 (its keywords), the
backends that skip (SDPA, the padded baseline), the gradient check with the features and per
sequence, and a whole run with stand-in backends and its report."""

import argparse
import dataclasses
import sys
from types import ModuleType

import pytest
import torch
from bench_cpu_run import execute_on_cpu

from hopper_fmha.bench import cli as bench_cli
from hopper_fmha.bench import presets, registry, report, runner, timing
from hopper_fmha.bench.flops import BWD, FWD, FWD_BWD
from hopper_fmha.bench.registry import PADDED, SDPA_NO_FEATURES, Backend, BackendSkip, Problem
from hopper_fmha.reference import reference, reference_varlen

pytestmark = pytest.mark.cpu

# Small enough for CPU: odd lengths so masks end mid-tile; GQA, so a sink's heads are sliced per
# kv head in the check; two batch elements.
DENSE = Problem(2, 37, 37, 4, 2, 64, causal=True, dtype="bfloat16", passes=BWD)
LENS = (37, 70, 5)
VARLEN = dataclasses.replace(Problem.varlen(LENS, 4, 2, 64, True, "bfloat16"), passes=BWD)
FEATURE_NAMES = ("window_size", "softcap", "learnable_sink")


def _lowp_varlen(q, k, v, cu, causal):
    """PyTorch's low-precision attention per sequence: a correct (and differentiable) varlen output."""
    b = cu.tolist()
    return torch.cat([runner.lowp_attention(q[None, s:e], k[None, s:e], v[None, s:e], causal)[0]
                      for s, e in zip(b[:-1], b[1:], strict=True)])  # fmt: skip


def _grads(fn, q, k, v, dout):
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    return torch.autograd.grad(fn(*leaves), leaves, dout)


# ---- the problems and their FLOPs ----


def test_training_problems_take_varlen_and_features():
    assert VARLEN.training and VARLEN.seqlens == LENS
    assert VARLEN.label() == "varlen3 L5-70 H4/2 d64 bf16 causal bwd"
    window = dataclasses.replace(DENSE, passes=FWD_BWD, window_size=(8, 0), softcap=30, sink=True)
    assert window.label() == "B2 N37 H4/2 d64 bf16 causal fwd+bwd window8/0 softcap30 sink"
    for p in (VARLEN, window):
        d = p.to_dict()
        assert d["passes"] == p.passes and Problem.from_dict(d) == p
    # Packed rows: q, out, dout, dq (112 rows x 4 heads) and k, v, dk, dv (112 x 2), 2 bytes each.
    assert VARLEN.input_bytes == 2 * 2 * (112 * 4 + 112 * 2) * 128
    # Still refused: a backward of a decode step, features or v's own head dim on packed sequences.
    with pytest.raises(ValueError, match="dense and varlen problems"):
        dataclasses.replace(Problem.decode(2, 64, 4, 2, 64), passes=BWD)
    with pytest.raises(ValueError, match="dense problems only, forward or training"):
        dataclasses.replace(VARLEN, softcap=30.0)
    with pytest.raises(ValueError, match="head_dim_v are timed on dense problems only"):
        dataclasses.replace(VARLEN, head_dim=128, head_dim_v=64)
    # v's own head dim in a backward (DeepSeek's shape): dout and dv at v's head dim.
    deepseek = dataclasses.replace(DENSE, head_dim=192, head_dim_v=128)
    assert deepseek.dv == 128 and deepseek.flops == 2.5 * dataclasses.replace(deepseek, passes=FWD).flops


def test_training_flops_by_hand():
    # Varlen: the preset's 24 lengths, sum of L² = 163,457,807; forward 4·H·d per (query, key)
    # pair of each sequence: 4 · 32 · 128 · 163,457,807 = 2,678,092,709,888.
    lens = presets.varlen_lengths()
    assert sum(n * n for n in lens) == 163_457_807
    varlen = Problem.varlen(lens, 32, 8, 128, False, "bf16")
    assert varlen.flops == 2_678_092_709_888
    assert dataclasses.replace(varlen, passes=BWD).flops == 6_695_231_774_720  # 2.5x
    assert dataclasses.replace(varlen, passes=FWD_BWD).flops == 9_373_324_484_608  # 3.5x
    causal = Problem.varlen(lens, 32, 8, 128, True, "bf16")
    assert dataclasses.replace(causal, passes=FWD_BWD).flops == 4_686_662_242_304  # halved
    # Window (4096, 0) at N 16384: row i sees min(i, 4096) + 1 keys, 4097 · 16384 − 4096 · 4097 / 2
    # = 58,734,592 pairs; the forward 2 · B · H · (d + dv) = 2 · 16 · 256 FLOPs per pair.
    window = Problem(1, 16384, 16384, 16, 16, 128, True, "bf16", window_size=(4096, 0))
    assert window.flops == 8192 * 58_734_592 == 481_153_777_664
    assert dataclasses.replace(window, passes=BWD).flops == 1_202_884_444_160  # 2.5x
    assert dataclasses.replace(window, passes=FWD_BWD).flops == 1_684_038_221_824  # 3.5x
    # Softcap and sink add none: their training FLOPs are their twin's.
    plain = Problem(4, 4096, 4096, 32, 32, 64, True, "bf16", passes=BWD)
    assert dataclasses.replace(plain, sink=True, softcap=30.0).flops == plain.flops == 687_194_767_360


# ---- the preset ----


def _parser():
    parser = argparse.ArgumentParser(prog="hopper-fmha")
    bench_cli.register(parser.add_subparsers())
    return parser


def test_backward_features_preset():
    preset = presets.get_preset("backward-features")
    assert preset.name == "backward-features"
    assert preset.backends == ("hopper-fmha:auto", "hopper-fmha:auto+det", "fa4")
    assert [b.name for b in registry.resolve_backends(preset.backends)] == list(preset.backends)
    labels = [p.label() for p in preset.problems]
    assert labels == [
        "varlen24 L421-4017 H32/8 d128 bf16 bwd",
        "varlen24 L421-4017 H32/8 d128 bf16 fwd+bwd",
        "varlen24 L421-4017 H32/8 d128 bf16 causal bwd",
        "varlen24 L421-4017 H32/8 d128 bf16 causal fwd+bwd",
        "B1 N16384 H16 d128 bf16 causal bwd",
        "B1 N16384 H16 d128 bf16 causal fwd+bwd",
        "B1 N16384 H16 d128 bf16 causal bwd window4096/0",
        "B1 N16384 H16 d128 bf16 causal fwd+bwd window4096/0",
        "B4 N4096 H16 d128 bf16 bwd",
        "B4 N4096 H16 d128 bf16 fwd+bwd",
        "B4 N4096 H16 d128 bf16 bwd softcap30",
        "B4 N4096 H16 d128 bf16 fwd+bwd softcap30",
        "B4 N4096 H16 d128 bf16 causal bwd",
        "B4 N4096 H16 d128 bf16 causal fwd+bwd",
        "B4 N4096 H16 d128 bf16 causal bwd softcap30",
        "B4 N4096 H16 d128 bf16 causal fwd+bwd softcap30",
        "B4 N4096 H32 d64 bf16 causal bwd",
        "B4 N4096 H32 d64 bf16 causal fwd+bwd",
        "B4 N4096 H32 d64 bf16 causal bwd sink",
        "B4 N4096 H32 d64 bf16 causal fwd+bwd sink",
        "B4 N4096 H16 d192 dv128 bf16 bwd",
        "B4 N4096 H16 d192 dv128 bf16 fwd+bwd",
        "B4 N4096 H16 d192 dv128 bf16 causal bwd",
        "B4 N4096 H16 d192 dv128 bf16 causal fwd+bwd",
    ]
    varlen = preset.problems[0]
    assert varlen.seqlens == presets.varlen_lengths() and varlen.heads // varlen.kv_heads == 4
    assert preset.problems[6].window_size == (4096, 0) and preset.problems[10].softcap == 30.0
    # The varlen preset's batch, the features preset's features: the same problems in training.
    assert dataclasses.replace(varlen, passes=FWD) == presets.varlen().problems[0]
    feature_problems = {dataclasses.replace(p, passes=FWD) for p in preset.problems[8:]}
    assert feature_problems <= set(presets.features().problems)
    # Every feature problem's twin (the same pass, no feature) is in the preset before it.
    for i, p in enumerate(preset.problems):
        if p.has_features:
            assert presets.feature_twin(p) in preset.problems[:i]
    args = _parser().parse_args(["bench", "--preset", "backward-features"])
    assert bench_cli.plan(args) == ("backward-features", preset.problems, list(preset.backends))
    text = bench_cli.register(argparse.ArgumentParser(prog="hopper-fmha").add_subparsers()).format_help()
    assert "\n  backward-features the backward on varlen and score-feature problems" in text


# ---- inputs and the calls ----


def test_varlen_training_inputs_pack_dout_after_cu_seqlens():
    sets = runner.make_inputs(VARLEN, 2, "cpu", seed=5)
    q, k, v, cu, dout = sets[0]
    assert q.shape == dout.shape == (112, 4, 64) and k.shape == (112, 2, 64)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 37, 107, 112]
    assert dout.dtype == torch.bfloat16 and not torch.equal(dout, sets[1][4])
    # q, k, v are the forward problem's with the same seed: dout is drawn after them.
    fq, fk, fv, fcu = runner.make_inputs(dataclasses.replace(VARLEN, passes=FWD), 1, "cpu", seed=5)[0]
    assert all(torch.equal(a, b) for a, b in ((fq, q), (fk, k), (fv, v), (fcu, cu)))


def _ours_standins(monkeypatch, calls: list):
    """hopper_fmha's flash_attn_func and flash_attn_varlen_func as correct PyTorch attention,
    recording whether the inputs require grad and the keywords."""
    import hopper_fmha

    def dense(q, k, v, causal=False, return_lse=False, variant=None, tile=None, **kw):
        calls.append(("dense", q.requires_grad and torch.is_grad_enabled(), kw))
        features = {name: kw[name] for name in FEATURE_NAMES if name in kw}
        return runner.lowp_attention(q, k, v, causal, **features)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=False, return_lse=False, tile=None, **kw):
        calls.append(("varlen", q.requires_grad and torch.is_grad_enabled(), (cu_q, cu_k, max_q, max_k), kw))
        return _lowp_varlen(q, k, v, cu_q, causal)

    monkeypatch.setattr(hopper_fmha, "flash_attn_func", dense)
    monkeypatch.setattr(hopper_fmha, "flash_attn_varlen_func", varlen)


def test_ours_runs_through_autograd_with_the_keywords(monkeypatch):
    calls = []
    _ours_standins(monkeypatch, calls)
    (auto,), (det,) = registry.get_backend("hopper-fmha:auto"), registry.get_backend("hopper-fmha:auto+det")
    # Dense with every feature: window_size, softcap, a float32 sink that requires grad.
    p = dataclasses.replace(DENSE, window_size=(8, 0), softcap=30.0, sink=True)
    q, k, v, dout = runner.make_inputs(p, 1, "cpu", seed=1)[0]
    grads = auto.make(p, q, k, v, dout)()
    det.make(p, q, k, v, dout)()
    (_, needs_grad, kw), (_, det_grad, det_kw) = calls
    assert needs_grad and det_grad
    sink = kw.pop("learnable_sink")
    assert kw == {"window_size": (8, 0), "softcap": 30.0}
    assert sink.dtype == torch.float32 and sink.requires_grad and sink.is_leaf
    assert torch.equal(sink.detach(), registry.sink_logits(p))
    assert det_kw["deterministic"] is True and "deterministic" not in kw
    want = _grads(lambda *x: runner.lowp_attention(*x, True, **registry.feature_kwargs(p)), q, k, v, dout)
    assert all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))
    # A forward sink problem's sink is what it was: no grad.
    assert not registry.feature_kwargs(dataclasses.replace(p, passes=FWD))["learnable_sink"].requires_grad
    # Varlen: flash_attn_varlen_func on packed leaves, cu_seqlens for q and k, the longest length.
    calls.clear()
    q, k, v, cu, dout = runner.make_inputs(VARLEN, 1, "cpu", seed=2)[0]
    call = auto.make(VARLEN, q, k, v, cu, dout)
    assert len(calls) == 1  # "bwd": the forward once, at build time
    grads = call()
    det.make(dataclasses.replace(VARLEN, passes=FWD_BWD), q, k, v, cu, dout)()
    (kind, needs_grad, lens, kw), (_, _, _, det_kw) = calls
    assert kind == "varlen" and needs_grad and lens == (cu, cu, 70, 70)
    assert kw == {} and det_kw == {"deterministic": True}
    want = _grads(lambda *x: _lowp_varlen(*x, cu, True), q, k, v, dout)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(torch.equal(g, w) for g, w in zip(grads, want, strict=True))


def _fa4_standin(calls: list) -> ModuleType:
    """flash_attn.cute with FA4's flash_attn_func and flash_attn_varlen_func keywords (4.0.0b36),
    recording each call, answering correctly with (out, lse)."""

    def features(window_size, softcap, learnable_sink):
        window = tuple(-1 if side is None else side for side in window_size)
        return {"window_size": window, "softcap": softcap, "learnable_sink": learnable_sink}

    def flash_attn_func(
        q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
        window_size=(None, None), learnable_sink=None, softcap=0.0, deterministic=False,
    ):  # fmt: skip
        calls.append({"q": q, "causal": causal, "window_size": window_size, "softcap": softcap,
                      "learnable_sink": learnable_sink})  # fmt: skip
        return runner.lowp_attention(q, k, v, causal, **features(window_size, softcap, learnable_sink)), None

    def flash_attn_varlen_func(
        q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
        causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0, deterministic=False,
    ):  # fmt: skip
        lens = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
                "max_seqlen_k": max_seqlen_k}  # fmt: skip
        calls.append({"q": q, **lens, "causal": causal})
        return _lowp_varlen(q, k, v, cu_seqlens_q, causal), None

    module = ModuleType("flash_attn.cute")
    module.flash_attn_func = flash_attn_func
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


def test_fa4_runs_through_autograd_with_its_keywords(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn.cute", _fa4_standin(calls))
    fa4 = registry.REGISTRY["fa4"]
    p = dataclasses.replace(DENSE, window_size=(8, -1), softcap=30.0, sink=True)
    q, k, v, dout = runner.make_inputs(p, 1, "cpu", seed=3)[0]
    grads = fa4.make(p, q, k, v, dout)()
    (call,) = calls
    # None for the side without limit; the sink in bfloat16, a leaf that requires grad.
    assert call["window_size"] == (8, None) and call["softcap"] == 30.0 and call["causal"] is True
    sink = call["learnable_sink"]
    assert sink.dtype == torch.bfloat16 and sink.requires_grad and sink.is_leaf
    assert torch.equal(sink.detach().float(), registry.sink_logits(p))
    assert call["q"].requires_grad
    chk = runner.make_checker(p, q, k, v, dout, reference=reference)
    assert chk.check(grads)["passed"]
    # Varlen: everything past v by keyword (its fourth parameter is qv).
    calls.clear()
    q, k, v, cu, dout = sets = runner.make_inputs(VARLEN, 1, "cpu", seed=4)[0]
    grads = fa4.make(dataclasses.replace(VARLEN, passes=FWD_BWD), *sets)()
    (call,) = calls
    assert call["q"].requires_grad and call["cu_seqlens_q"] is cu and call["cu_seqlens_k"] is cu
    assert (call["max_seqlen_q"], call["max_seqlen_k"], call["causal"]) == (70, 70, True)
    assert runner.make_checker(VARLEN, *sets, reference=reference).check(grads)["passed"]


def _step(p, backend):
    sets = runner.make_inputs(p, 2, "cpu", seed=0)
    return runner.run_step(
        p, backend, sets, lambda: runner.make_checker(p, *sets[0], reference=reference), timing.CpuTimer(),
        timing.TimingSettings.quick(), graph=False,
    )  # fmt: skip


def test_backends_without_the_feature_skip_with_a_reason():
    build, _, context = registry._sdpa_backend("MATH")  # the SDPA wrapper, on a kernel CPUs have
    cudnn = Backend("sdpa-cudnn", "cuDNN", build, layout="bhsd", context=context)
    for change in ({"window_size": (8, 0)}, {"softcap": 30.0}, {"sink": True}):
        for passes in (BWD, FWD_BWD):
            rec = _step(dataclasses.replace(DENSE, passes=passes, **change), cudnn)
            assert rec["status"] == "skipped" and rec["reason"] == SDPA_NO_FEATURES and rec["eager"] is None
    # The same wrapper without a feature: timed and checked, so the skips above are the features'.
    rec = _step(DENSE, cudnn)
    assert rec["status"] == "ok" and rec["check"]["passed"]
    for name in ("sdpa-cudnn", "sdpa-flash", "fa3"):
        rec = _step(VARLEN, registry.REGISTRY[name])
        assert rec["status"] == "skipped"
        assert rec["reason"] == f"{name} has no varlen (packed sequences) call in this bench"
    rec = _step(dataclasses.replace(DENSE, softcap=30.0), registry.REGISTRY["fa3"])
    assert rec["status"] == "skipped" and "no score features" in rec["reason"]
    # The padded baseline is a forward: skipped, the reason given, before anything runs.
    sets = runner.make_inputs(VARLEN, 1, "cpu", seed=0)[0]
    with pytest.raises(BackendSkip, match="times the forward only"):
        registry.REGISTRY[PADDED].make(VARLEN, *sets)
    rec = _step(VARLEN, registry.REGISTRY[PADDED])
    assert rec["status"] == "skipped" and rec["reason"].startswith(f"{PADDED} times the forward only")


# ---- the gradient check ----


@pytest.mark.parametrize("change", [{"window_size": (6, 0)}, {"softcap": 1.0}, {"sink": True}])
def test_grad_checker_applies_the_features(change):
    p = dataclasses.replace(DENSE, **change)
    q, k, v, dout = sets = runner.make_inputs(p, 1, "cpu", seed=6)[0]
    chk = runner.make_checker(p, *sets)  # the default reference, as on the GPU
    features = registry.feature_kwargs(dataclasses.replace(p, passes=FWD))  # a sink without grad
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = torch.autograd.grad(reference(*leaves, causal=True, **features)[0], leaves, dout.float())
    for got, w in zip(chk.refs, want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    # Per kv-head block (each block's sinks its own heads'): the same gradients.
    blocks = runner._grad_baselines(p, *sets, reference=reference, max_scores=10)
    for got, w in zip(blocks[0], chk.refs, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    good = _grads(lambda *x: runner.lowp_attention(*x, True, **features), q, k, v, dout)
    assert chk.check(good)["passed"]
    # Without the feature the gradients are another attention's: they fail.
    assert not chk.check(_grads(lambda *x: runner.lowp_attention(*x, True), q, k, v, dout))["passed"]


@pytest.mark.parametrize("causal", [False, True])
def test_grad_checker_checks_varlen_per_sequence(causal):
    p = dataclasses.replace(VARLEN, causal=causal)
    q, k, v, cu, dout = sets = runner.make_inputs(p, 1, "cpu", seed=7)[0]
    chk = runner.make_checker(p, *sets)
    assert isinstance(chk, runner.GradChecker)
    # The reference: the package's varlen reference, differentiated in fp32.
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    out, _ = reference_varlen(*leaves, cu, cu, causal=causal)
    for got, w in zip(chk.refs, torch.autograd.grad(out, leaves, dout.float()), strict=True):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5)
    good = _grads(lambda *x: _lowp_varlen(*x, cu, causal), q, k, v, dout)
    assert chk.check(good)["passed"]
    # Attention across the whole packed batch is not the varlen answer.
    dense = _grads(lambda *x: runner.lowp_attention(*(y[None] for y in x), causal)[0], q, k, v, dout)
    assert not chk.check(dense)["passed"]
    dq, dk, dv = good
    wrong = dv.clone()
    wrong[40] += 1.0  # one key row of the second sequence
    bad = chk.check((dq, dk, wrong))
    assert not bad["passed"] and bad["grad"] == "dv"


# ---- a whole run and its report ----


def _cpu_size(p: Problem) -> Problem:
    """A preset problem shrunk to CPU size: varlen to LENS (4/2 heads), dense to N40 H2 (batch 1
    or 2, so that the causal window twin and the causal softcap twin stay apart), its window
    shrunk with it (4096 of 16384 -> 10 of 40)."""
    if p.seqlens is not None:
        return dataclasses.replace(Problem.varlen(LENS, 4, 2, 64, p.causal, p.dtype), passes=p.passes)
    window = (10, 0) if p.window_size[0] > 0 else p.window_size
    shape = {"batch": min(p.batch, 2), "seqlen_q": 40, "seqlen_k": 40, "heads": 2, "kv_heads": 2}
    return dataclasses.replace(p, **shape, window_size=window)


def test_whole_backward_features_run_on_cpu(tmp_path, monkeypatch):
    env = {"date": "2026-11-21T05:30:00+00:00", "device": "cpu", "device_slug": "cpu"}
    monkeypatch.setattr(runner, "collect_env", lambda device: env)
    calls, fa4_calls = [], []
    _ours_standins(monkeypatch, calls)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", _fa4_standin(fa4_calls))
    build, _, context = registry._sdpa_backend("MATH")
    backends = registry.resolve_backends(presets.backward_features().backends) + [
        Backend("sdpa-cudnn", "cuDNN", build, layout="bhsd", context=context)
    ]
    problems = tuple(_cpu_size(p) for p in presets.backward_features().problems)
    assert len(set(problems)) == len(problems) == 24
    assert problems[-1].head_dim_v == 128 and problems[-1].causal and problems[-1].passes == FWD_BWD
    assert problems[6].window_size == (10, 0) and problems[6].flops < problems[4].flops
    results, recs, json_path = execute_on_cpu(tmp_path, "backward-features", problems, backends)
    # Ours ran through autograd on every problem: varlen calls with cu_seqlens, dense ones with
    # the features, +det with deterministic=True.
    assert all(needs_grad for _, needs_grad, *_ in calls)
    assert {c[0] for c in calls} == {"dense", "varlen"}
    assert any(c[-1].get("deterministic") for c in calls if c[0] == "varlen")
    assert {"window_size", "softcap", "learnable_sink"} <= set().union(
        *(c[2] for c in calls if c[0] == "dense")
    )
    assert results["complete"] and len(results["records"]) == len(problems) * len(backends)
    for p in problems:
        forward = dataclasses.replace(p, passes=FWD).flops
        for name in ("hopper-fmha:auto", "hopper-fmha:auto+det", "fa4"):
            rec = recs[(name, p)]
            assert rec["status"] == "ok" and rec["check"]["passed"], (name, p.label(), rec["reason"])
            assert rec["check"]["grad"] in ("dq", "dk", "dv")
            assert rec["flops"] == p.flops == (2.5 if p.passes == BWD else 3.5) * forward
            assert rec["eager"] is not None and rec["graph"] is None
        cudnn = recs[("sdpa-cudnn", p)]
        if p.seqlens is not None:
            assert cudnn["status"] == "skipped" and "no varlen" in cudnn["reason"]
        elif p.has_features:
            assert cudnn["status"] == "skipped" and cudnn["reason"] == SDPA_NO_FEATURES
        else:
            assert cudnn["status"] == "ok" and cudnn["check"]["passed"]
    # The report: pass and features columns, the features table per pass (window ÷ causal in
    # the same pass), the varlen table (ours ÷ FA4), the training note.
    md = json_path.with_suffix(".md").read_text()
    assert "| B | N | H | d | causal | dtype | pass | features | hopper-fmha:auto |" in md
    assert report.TRAINING_NOTE in md and report.FEATURES_NOTE in md
    rows = {(row[0], row[1]): row for row in report.feature_rows(results)}
    causal_bwd, window_bwd = problems[4], problems[6]
    row = rows[(window_bwd.label(), "hopper-fmha:auto")]
    mine, twin = (report.rate(recs[("hopper-fmha:auto", x)], "eager") for x in (window_bwd, causal_bwd))
    fa4 = report.rate(recs[("fa4", window_bwd)], "eager")
    assert row[4] == f"{mine / fa4:.2f}× (e)" and row[5] == "skipped"
    assert row[7:] == [causal_bwd.label(), f"{twin:.1f} (e)", f"{mine / twin:.2f}× (e)"]
    assert (problems[-1].label(), "hopper-fmha:auto+det") in rows  # the sink's fwd+bwd, ours det
    varlen_rows = {(row[0], row[1]): row for row in report.varlen_rows(results)}
    row = varlen_rows[(problems[0].label(), "hopper-fmha:auto")]
    mine, fa4 = (report.rate(recs[(n, problems[0])], "eager") for n in ("hopper-fmha:auto", "fa4"))
    assert row[4] == f"{mine / fa4:.2f}× (e)" and row[6] == report.MISSING  # no dense twin in this run
    assert "## Features" in md and "## Varlen" in md
    summary = {(r["backend"], r["subset"], r["mode"]): r for r in results["summary"]["rows"]}
    assert summary[("hopper-fmha:auto", "bwd", "eager")]["of"] == len(problems) // 2
