"""The bench's score-feature pieces on CPU: the exact count of visible (query, key) pairs under a
sliding window (against brute force), feature problems (FLOPs, dicts, labels, bytes), the
`features` preset and its twins, the reference and PyTorch baselines with the features, the
keywords each backend gets, the cells that skip (SDPA, an FA4 without a keyword, FA3, the paper
variant), the features table, and a whole run with stand-in backends."""

import argparse
import dataclasses
import inspect
import json
import math
import sys
from types import ModuleType

import pytest
import torch
from bench_cpu_run import execute_on_cpu

from hopper_fmha.bench import cli as bench_cli
from hopper_fmha.bench import presets, registry, report, runner, timing
from hopper_fmha.bench.flops import attention_flops, visible_pairs, window_bounds, window_flops
from hopper_fmha.bench.registry import SDPA_NO_FEATURES, Backend, Problem
from hopper_fmha.reference import reference, visible_keys

pytestmark = pytest.mark.cpu

# Small enough for CPU: odd lengths, so windows and the causal mask end mid-tile; GQA.
SMALL = Problem(1, 37, 37, 4, 2, 64, causal=True, dtype="bfloat16")
WINDOWS = [(-1, -1), (-1, 0), (0, 0), (2, 0), (0, 3), (2, 3), (-1, 2), (3, -1), (40, 40)]


def _parser():
    parser = argparse.ArgumentParser(prog="hopper-fmha")
    bench_cli.register(parser.add_subparsers())
    return parser


# ---- the visible pairs ----


def _brute_force_pairs(sq: int, sk: int, left: int, right: int) -> int:
    """The rule written out pair by pair: row i sees key j iff
    i + sk - sq - left <= j <= i + sk - sq + right, a side of -1 without limit."""
    count = 0
    for i in range(sq):
        for j in range(sk):
            after_first = left < 0 or j >= i + sk - sq - left
            before_last = right < 0 or j <= i + sk - sq + right
            count += after_first and before_last
    return count


@pytest.mark.parametrize("sq, sk", [(7, 7), (5, 9), (9, 5), (1, 6), (6, 1), (13, 13)])
@pytest.mark.parametrize("window", WINDOWS)
def test_visible_pairs_match_brute_force(sq, sk, window):
    left, right = window
    want = _brute_force_pairs(sq, sk, left, right)
    assert visible_pairs(sq, sk, left, right) == want
    # The package's own mask (what the reference applies) agrees.
    assert visible_keys(torch.arange(sq), sq, sk, left, right).sum().item() == want


def test_visible_pairs_closed_forms():
    assert visible_pairs(6, 6) == 36 and visible_pairs(6, 6, -1, 0) == 21  # all; causal N(N+1)/2
    assert visible_pairs(6, 6, 0, 0) == 6  # the diagonal only
    assert visible_pairs(3, 8, -1, 0) == 6 + 7 + 8  # bottom-right: row i sees keys 0..i + 5
    assert visible_pairs(8, 3, -1, 0) == 1 + 2 + 3  # rows 0..4 see no key
    # The preset's window: row i sees min(i, 4096) + 1 keys.
    assert visible_pairs(32768, 32768, 4096, 0) == 4097 * 32768 - 4096 * 4097 // 2 == 125_859_840
    assert window_bounds(True, (4096, -1)) == (4096, 0) and window_bounds(False, (4096, -1)) == (4096, -1)


def test_window_and_head_dim_flops():
    # 2·B·H·(d + dv) per visible pair.
    assert window_flops(2, 3, 6, 6, 64, 2, 0) == 2 * 2 * 3 * 128 * visible_pairs(6, 6, 2, 0)
    assert window_flops(1, 1, 6, 6, 192, -1, -1, head_dim_v=128) == 2 * 320 * 36
    # v's head dim: 2·B·H·N²·(d + dv), halved for causal; dv = d is the old formula.
    assert attention_flops(4, 16, 4096, 4096, 192, head_dim_v=128) == 2 * 4 * 16 * 4096**2 * 320
    assert attention_flops(4, 16, 4096, 4096, 192, True, 128) == 4 * 16 * 4096**2 * 320
    assert attention_flops(4, 32, 4096, 4096, 64, head_dim_v=64) == attention_flops(4, 32, 4096, 4096, 64)
    # A problem's FLOPs: the exact pairs under a window (causal sets right = 0), the simple
    # half for causal alone, nothing for softcap and sink.
    causal = Problem(1, 32768, 32768, 16, 16, 128, causal=True, dtype="bf16")
    window = dataclasses.replace(causal, window_size=(4096, 0))
    assert causal.flops == 4 * 16 * 32768**2 * 128 / 2
    assert window.flops == 4 * 128 * 16 * 125_859_840
    assert dataclasses.replace(causal, window_size=(4096, -1)).flops == window.flops
    no_limit = dataclasses.replace(causal, causal=False, window_size=(-1, 0))  # causal, counted exactly
    assert (
        no_limit.flops == 4 * 128 * 16 * 32768 * 32769 // 2 and no_limit.flops / causal.flops - 1 == 1 / 32768
    )
    capped = dataclasses.replace(causal, softcap=30.0, sink=True)
    assert capped.flops == causal.flops
    deepseek = Problem(4, 4096, 4096, 16, 16, 192, causal=True, dtype="bf16", head_dim_v=128)
    assert deepseek.flops == 4 * 16 * 4096**2 * 320


# ---- the problem ----


def test_feature_problems_through_json_labels_and_bytes():
    plain = Problem(4, 4096, 4096, 16, 16, 128, causal=True, dtype="bf16")
    old_keys = {"batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "head_dim", "causal", "dtype"}
    assert set(plain.to_dict()) == old_keys  # a plain problem's JSON is unchanged
    p = dataclasses.replace(plain, window_size=(256, 0), softcap=30, sink=True)
    d = json.loads(json.dumps(p.to_dict()))
    assert {k: d[k] for k in set(d) - old_keys} == {"window_size": [256, 0], "softcap": 30.0, "sink": True}
    back = Problem.from_dict(d)
    assert back == p and hash(back) == hash(p) and back.window_size == (256, 0)
    assert p.has_features and not plain.has_features
    assert p.label() == "B4 N4096 H16 d128 bf16 causal window256/0 softcap30 sink"
    assert p.feature_words() == ["window 256/0", "softcap 30", "sink"]
    # v's head dim: its own key and label; equal to head_dim it is the plain problem.
    deepseek = dataclasses.replace(plain, head_dim=192, head_dim_v=128)
    assert deepseek.to_dict()["head_dim_v"] == 128 and Problem.from_dict(deepseek.to_dict()) == deepseek
    assert deepseek.label() == "B4 N4096 H16 d192 dv128 bf16 causal" and deepseek.dv == 128
    assert dataclasses.replace(plain, head_dim_v=128) == plain and plain.dv == 128
    # q and k at d, v and the output at dv: (4·4096·16) rows each, 2 bytes an element.
    rows = 4 * 4096 * 16
    assert (
        deepseek.input_bytes == 2 * rows * (192 + 192 + 128 + 128) and deepseek.output_bytes == 2 * rows * 128
    )
    assert deepseek.kv_bytes == rows * (192 + 128) * 2
    assert plain.input_bytes == 4 * 2 * rows * 128  # as before


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"window_size": (4, -2)}, "ints >= -1"),
        ({"window_size": (4,)}, "pair"),
        ({"softcap": -1.0}, "finite float >= 0"),
        ({"softcap": math.inf}, "finite float >= 0"),
        ({"head_dim_v": 0}, "positive"),
    ],
)
def test_feature_problems_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Problem(1, 64, 64, 2, 2, 64, **kwargs)


def test_features_are_dense_only():
    with pytest.raises(ValueError, match="dense problems only"):
        Problem(2, 5, 5, 2, 2, 64, seqlens=(3, 5), softcap=30.0)
    with pytest.raises(ValueError, match="dense problems only"):
        dataclasses.replace(Problem.decode(2, 64, 4, 2, 64), window_size=(8, 0))
    with pytest.raises(ValueError, match="dense problems only"):
        Problem(2, 5, 5, 2, 2, 64, seqlens=(3, 5), head_dim_v=32)
    # Training with v's own head dim (the backward-features preset's DeepSeek cells).
    assert Problem(1, 64, 64, 2, 2, 128, passes="bwd", head_dim_v=64).dv == 64


# ---- the preset ----


def test_features_preset_grid_backends_and_cli():
    preset = presets.get_preset("features")
    assert preset.name == "features" and preset.backends == ("hopper-fmha:auto", "fa4", "sdpa-cudnn")
    assert [b.name for b in registry.resolve_backends(preset.backends)] == list(preset.backends)
    got = [
        (p.batch, p.seqlen_q, p.heads, p.head_dim, p.dv, p.causal, p.feature_words()) for p in preset.problems
    ]
    assert got == [
        (1, 32768, 16, 128, 128, True, []),
        (1, 32768, 16, 128, 128, True, ["window 4096/0"]),
        (4, 4096, 16, 128, 128, False, []),
        (4, 4096, 16, 128, 128, False, ["softcap 30"]),
        (4, 4096, 16, 128, 128, True, []),
        (4, 4096, 16, 128, 128, True, ["softcap 30"]),
        (4, 4096, 16, 96, 96, False, []),
        (4, 4096, 16, 96, 96, True, []),
        (4, 4096, 16, 192, 128, False, []),
        (4, 4096, 16, 192, 128, True, []),
        (4, 4096, 32, 64, 64, True, []),
        (4, 4096, 32, 64, 64, True, ["sink"]),
    ]
    assert all(
        p.seqlen_k == p.seqlen_q and p.kv_heads == p.heads and p.dtype == "bfloat16" for p in preset.problems
    )
    # Every feature problem comes right after its twin; the others have none.
    for i, p in enumerate(preset.problems):
        twin = presets.feature_twin(p)
        assert (twin == preset.problems[i - 1]) if p.has_features else twin is None
    args = _parser().parse_args(["bench", "--preset", "features"])
    assert bench_cli.plan(args) == ("features", preset.problems, list(preset.backends))
    text = bench_cli.register(argparse.ArgumentParser(prog="hopper-fmha").add_subparsers()).format_help()
    assert "features" in text.split("[--preset {")[1].split("}")[0].split(",")
    assert "\n  features the forward's score features" in text


# ---- baselines and the check ----


def test_sink_logits_are_fixed_bf16_values_near_log_seqlen():
    p = dataclasses.replace(SMALL, sink=True)
    sink = registry.sink_logits(p)
    assert sink.dtype == torch.float32 and sink.shape == (4,)
    assert torch.equal(sink, registry.sink_logits(p))  # the same every time (and machine)
    assert torch.equal(sink, sink.to(torch.bfloat16).float())  # exact in bf16: FA4 sees the same
    assert (sink - math.log(37)).abs().max() < 4
    assert registry.sink_logits(SMALL) is None


@pytest.mark.parametrize("sq, sk", [(29, 29), (17, 41), (41, 17)])
@pytest.mark.parametrize(
    "features",
    [{"window_size": (5, 2)}, {"window_size": (-1, 3), "softcap": 2.0}, {"softcap": 0.5}, {"sink": True}],
)
def test_lowp_attention_applies_the_features_as_the_reference(sq, sk, features):
    # In fp32 the baseline must be the reference, features and v's head dim included.
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, sq, 4, 32, generator=g)
    k = torch.randn(2, sk, 2, 32, generator=g)
    v = torch.randn(2, sk, 2, 16, generator=g)
    p = Problem(2, sq, sk, 4, 2, 32, head_dim_v=16, **features)
    kwargs = registry.feature_kwargs(p)
    assert set(kwargs) == ({"learnable_sink"} if "sink" in features else set(features))
    for causal in (False, True):
        out = runner.lowp_attention(q, k, v, causal, max_scores=2 * 4 * sk * 7, **kwargs)  # 7-row chunks
        ref, _ = reference(q, k, v, causal=causal, **kwargs)
        assert out.shape == (2, sq, 4, 16)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        # ... and the features change the answer: without them it is another one.
        assert not torch.allclose(out, runner.lowp_attention(q, k, v, causal), atol=1e-3)


@pytest.mark.parametrize(
    "change", [{"window_size": (6, 0)}, {"softcap": 1.0}, {"sink": True}, {"head_dim": 128, "head_dim_v": 64}]
)
def test_checker_checks_with_the_features(change):
    p = dataclasses.replace(SMALL, **change)
    q, k, v = runner.make_inputs(p, 1, "cpu", seed=3)[0]
    assert v.shape[-1] == p.dv and k.shape[-1] == p.head_dim
    chk = runner.Checker(p, q, k, v)  # the default reference, as on the GPU
    want, _ = reference(q, k, v, causal=True, **registry.feature_kwargs(p))
    torch.testing.assert_close(chk.ref, want, rtol=1e-5, atol=1e-5)
    good = runner.lowp_attention(q, k, v, True, **registry.feature_kwargs(p))
    assert chk.check(good)["passed"]
    # The same attention without the feature fails (softcap 1 bends scores of unit spread).
    if p.has_features:
        assert not chk.check(runner.lowp_attention(q, k, v, True))["passed"]
    else:
        assert "shape" in chk.check(good[..., :-8])["reason"]


# ---- the backends' calls ----


def _fa4_standin(calls: list, softcap: bool = True, sink: bool = True) -> ModuleType:
    """flash_attn.cute with a flash_attn_func of FA4's keywords (softcap= and learnable_sink=
    left out on request: an install without them), recording each call, answering correctly."""

    def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), **features):
        calls.append({"causal": causal, "window_size": window_size, **features})
        window = tuple(-1 if side is None else side for side in window_size)
        sink_ = features.get("learnable_sink")
        out = runner.lowp_attention(
            q, k, v, causal, window_size=window, softcap=features.get("softcap", 0.0), learnable_sink=sink_
        )
        return out, None

    names = ["softcap"] * softcap + ["learnable_sink"] * sink
    params = list(inspect.signature(flash_attn_func).parameters.values())[:-1]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in names]
    flash_attn_func.__signature__ = inspect.Signature(params)
    module = ModuleType("flash_attn.cute")
    module.flash_attn_func = flash_attn_func
    return module


def test_features_reach_ours_and_fa4(monkeypatch):
    import hopper_fmha

    ours_calls, fa4_calls = [], []
    monkeypatch.setattr(hopper_fmha, "flash_attn_func", lambda *a, **kw: ours_calls.append(kw))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", _fa4_standin(fa4_calls))
    p = dataclasses.replace(SMALL, window_size=(8, -1), softcap=30.0, sink=True)
    q, k, v = runner.make_inputs(p, 1, "cpu", seed=0)[0]
    for name in ("hopper-fmha:auto", "hopper-fmha:ws", "fa4"):
        (b,) = registry.get_backend(name)
        b.make(p, q, k, v)()
    auto, ws = ours_calls
    sink = auto.pop("learnable_sink")
    assert auto == {"causal": True, "return_lse": False, "variant": None, "tile": None,
                    "window_size": (8, -1), "softcap": 30.0}  # fmt: skip
    assert ws["variant"] == "ws" and ws["window_size"] == (8, -1)
    assert sink.dtype == torch.float32 and torch.equal(sink, registry.sink_logits(p))
    (fa4,) = fa4_calls
    # FA4: None for a side without limit, the sink in bfloat16 (the same values).
    assert fa4["window_size"] == (8, None) and fa4["softcap"] == 30.0 and fa4["causal"] is True
    assert fa4["learnable_sink"].dtype == torch.bfloat16 and torch.equal(fa4["learnable_sink"].float(), sink)
    # A plain problem's calls are unchanged: no feature keyword at all.
    ours_calls.clear()
    fa4_calls.clear()
    q, k, v = runner.make_inputs(SMALL, 1, "cpu", seed=0)[0]
    for name in ("hopper-fmha:auto", "fa4"):
        registry.get_backend(name)[0].make(SMALL, q, k, v)()
    assert ours_calls == [{"causal": True, "return_lse": False, "variant": None, "tile": None}]
    assert fa4_calls == [{"causal": True, "window_size": (None, None)}]


def _step(p, backend):
    sets = runner.make_inputs(p, 2, "cpu", seed=0)

    def checker():
        return runner.Checker(p, *sets[0], reference=reference)

    return runner.run_step(
        p, backend, sets, checker, timing.CpuTimer(), timing.TimingSettings.quick(), graph=False
    )


def test_unsupported_features_are_skipped_with_the_reason(monkeypatch):
    softcap = dataclasses.replace(SMALL, softcap=30.0)
    window = dataclasses.replace(SMALL, window_size=(8, 0))
    for name in ("sdpa-cudnn", "sdpa-flash", "sdpa-efficient"):
        for p in (softcap, window):
            rec = _step(p, registry.REGISTRY[name])
            assert rec["status"] == "skipped" and rec["reason"] == SDPA_NO_FEATURES and rec["eager"] is None
    rec = _step(softcap, registry.REGISTRY["fa3"])
    assert rec["status"] == "skipped" and "no score features" in rec["reason"]
    (paper,) = registry.get_backend("hopper-fmha:paper")
    rec = _step(window, paper)
    assert rec["status"] == "rejected" and "paper variant has no window" in rec["reason"]
    # An FA4 without a keyword: skipped, the keyword named; never called without it.
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn.cute", _fa4_standin(calls, softcap=False))
    rec = _step(softcap, registry.REGISTRY["fa4"])
    assert rec["status"] == "skipped" and calls == []
    assert rec["reason"].startswith(
        "flash_attn.cute.flash_attn_func (as installed) takes no softcap= keyword"
    )
    rec = _step(window, registry.REGISTRY["fa4"])  # the window it has: timed, and correct
    assert rec["status"] == "ok" and rec["check"]["passed"] and calls
    # An FA4 that refuses a head dim at the call: skipped, not fatal.
    refusing = ModuleType("flash_attn.cute")

    def flash_attn_func(q, k, v, causal=False):
        raise AssertionError("head_dim_v != head_dim is not supported on SM 9.0")

    refusing.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn.cute", refusing)
    rec = _step(dataclasses.replace(SMALL, head_dim=128, head_dim_v=64), registry.REGISTRY["fa4"])
    assert rec["status"] == "skipped" and rec["reason"].startswith("raised AssertionError: head_dim_v")


def test_registry_helpers():
    def fa4_like(q, k, v, causal=False, window_size=(None, None), *, softcap=0.0):
        pass

    assert registry.missing_keywords(fa4_like, ["window_size", "softcap", "learnable_sink"]) == [
        "learnable_sink"
    ]
    assert registry.missing_keywords(lambda q, **kw: None, ["learnable_sink"]) == []  # **kwargs takes all
    p = dataclasses.replace(SMALL, window_size=(-1, 4))
    assert registry.fa4_feature_kwargs(p) == {"window_size": (None, 4)}
    assert registry.feature_kwargs(p) == {"window_size": (-1, 4)}
    assert registry.feature_kwargs(SMALL) == registry.fa4_feature_kwargs(SMALL) == {}


# ---- the report ----


def _rec(p: Problem, name: str, tf: float | None, ours=False, status="ok") -> dict:
    ms = p.flops / (tf * 1e12) * 1e3 if tf else None
    t = timing.summarize([ms] * 3, 1) if ms else None
    label = registry.REGISTRY[name].label if name in registry.REGISTRY else name
    return {
        "problem": p.to_dict(), "backend": name, "label": label, "ours": ours, "flops": p.flops,
        "n_sets": 2, "set_bytes": p.input_bytes, "status": status,
        "reason": None if t else SDPA_NO_FEATURES, "check": None, "eager": t, "graph": t,
        "graph_reason": None, "profile": None,
    }  # fmt: skip


def _features_results() -> dict:
    env = {"date": "2026-11-21T05:30:00+00:00", "device": "NVIDIA H100", "device_slug": "h100"}
    results = report.new_results(
        "features", env, {"warmup": 5, "iters": 30}, "hopper-fmha bench --preset features"
    )
    causal, window, plain, capped = presets.features().problems[:4]
    d192 = presets.features().problems[8]
    ours = "hopper-fmha:auto"
    results["records"] = [
        _rec(causal, ours, 600.0, ours=True), _rec(causal, "fa4", 580.0), _rec(causal, "sdpa-cudnn", 590.0),
        _rec(window, ours, 546.0, ours=True), _rec(window, "fa4", 520.0),
        _rec(window, "sdpa-cudnn", None, status="skipped"),
        _rec(plain, ours, 640.0, ours=True), _rec(plain, "fa4", 650.0), _rec(plain, "sdpa-cudnn", 600.0),
        _rec(capped, ours, 552.0, ours=True), _rec(capped, "fa4", 500.0, status="wrong"),
        _rec(capped, "sdpa-cudnn", None, status="skipped"),
        _rec(d192, ours, 610.0, ours=True), _rec(d192, "fa4", 600.0), _rec(d192, "sdpa-cudnn", 305.0),
    ]  # fmt: skip
    results["complete"] = True
    return results


def test_report_shows_feature_ratios():
    results = _features_results()
    rows = report.feature_rows(results)
    # Window ÷ causal 546 / 600 = 0.91; ÷ FA4 546 / 520 = 1.05; cuDNN skipped.
    assert rows[1] == ["B1 N32768 H16 d128 bf16 causal window4096/0", "hopper-fmha:auto", "546.0",
                       "520.0", "1.05×", "skipped", "–", "B1 N32768 H16 d128 bf16 causal", "600.0",
                       "0.91×"]  # fmt: skip
    # Softcap ÷ plain 552 / 640 = 0.8625; FA4 wrong: no ratio.
    assert rows[3] == ["B4 N4096 H16 d128 bf16 softcap30", "hopper-fmha:auto", "552.0", "500.0 ✗", "–",
                       "skipped", "–", "B4 N4096 H16 d128 bf16", "640.0", "0.86×"]  # fmt: skip
    # A problem without a feature: its ratios to FA4 and cuDNN, no twin.
    assert rows[0][4:] == ["1.03×", "590.0", "1.02×", "–", "–", "–"]
    assert rows[4] == ["B4 N4096 H16 d192 dv128 bf16", "hopper-fmha:auto", "610.0", "600.0", "1.02×",
                       "305.0", "2.00×", "–", "–", "–"]  # fmt: skip
    md = report.render_markdown(results)
    assert "## Features: ours ÷ FA4, ÷ cuDNN, ÷ ours without the feature" in md
    assert (
        "| problem | backend | TFLOP/s | FA4 | ÷ FA4 (≥ 1.0) | cuDNN | ÷ cuDNN | without the feature |" in md
    )
    assert report.FEATURES_NOTE in md and report.FEATURE_TABLE_NOTE in md
    # The TFLOP/s tables: a features column, and d as d/dv.
    assert "| B | N | H | d | causal | dtype | features | hopper-fmha:auto | FA4 | cuDNN |" in md
    assert "| 1 | 32768 | 16 | 128 | yes | bfloat16 | window 4096/0 | 546.0 | 520.0 | skipped |" in md
    assert "| 4 | 4096 | 16 | 192/128 | no | bfloat16 | – | 610.0 | 600.0 | 305.0 |" in md
    term = report.render_terminal(results).splitlines()
    at = term.index("features: TFLOP/s (CUDA graph; (e) eager where no graph); ours ÷ FA4, ÷ cuDNN, ÷ ours "
                    "without the feature")  # fmt: skip
    assert "0.91×" in term[at + 4] and "window4096/0" in term[at + 4]
    # A run without features: no table, no column, no note.
    plain_run = {
        **results,
        "records": [r for r in results["records"] if set(r["problem"]) <= set(SMALL.to_dict())],
    }
    md = report.render_markdown(plain_run)
    assert report.feature_rows(plain_run) == [] and "## Features" not in md and "| features |" not in md
    assert report.FEATURES_NOTE not in md


# ---- a whole run ----


def _cpu_size(p: Problem) -> Problem:
    """A preset problem shrunk to CPU size, its window shrunk with it (4096 of 32768 -> 5 of 40)."""
    window = (5, 0) if p.has_features and p.window_size[0] > 0 else p.window_size
    return dataclasses.replace(p, batch=1, seqlen_q=40, seqlen_k=40, heads=2, kv_heads=2, window_size=window)


def test_whole_features_run_on_cpu(tmp_path, monkeypatch):
    import hopper_fmha

    monkeypatch.setattr(runner, "collect_env", lambda device: {**_features_results()["env"], "device": "cpu"})
    seen = []

    def ours(
        q, k, v, causal=False, return_lse=False, variant=None, tile=None, **features
    ):  # a correct kernel
        seen.append(set(features))
        return runner.lowp_attention(q, k, v, causal, **features)

    monkeypatch.setattr(hopper_fmha, "flash_attn_func", ours)
    fa4_calls = []
    monkeypatch.setitem(
        sys.modules, "flash_attn.cute", _fa4_standin(fa4_calls, sink=False)
    )  # no sink keyword
    build, _, context = registry._sdpa_backend("MATH")  # the SDPA wrapper, on a kernel CPUs have
    backends = [
        registry.get_backend("hopper-fmha:auto")[0],
        registry.REGISTRY["fa4"],
        Backend("sdpa-cudnn", "cuDNN", build, layout="bhsd", context=context),
    ]
    problems = tuple(_cpu_size(p) for p in presets.features().problems)
    assert problems[1].window_size == (5, 0) and problems[1].flops < problems[0].flops
    results, recs, json_path = execute_on_cpu(tmp_path, "features", problems, backends)
    assert {"window_size", "softcap", "learnable_sink"} <= set().union(*seen)
    assert results["complete"] and len(results["records"]) == 3 * len(problems)
    for p in problems:
        rec = recs[("hopper-fmha:auto", p)]
        assert rec["status"] == "ok" and rec["check"]["passed"] and rec["flops"] == p.flops, (p.label(), rec)
        fa4, cudnn = recs[("fa4", p)], recs[("sdpa-cudnn", p)]
        if p.sink:
            assert fa4["status"] == "skipped" and "learnable_sink=" in fa4["reason"]
        else:
            assert fa4["status"] == "ok" and fa4["check"]["passed"], (p.label(), fa4)
        if p.has_features:
            assert cudnn["status"] == "skipped" and cudnn["reason"] == SDPA_NO_FEATURES
        else:  # SDPA's math kernel takes every head dim here, d192 with dv128 too
            assert cudnn["status"] == "ok" and cudnn["check"]["passed"], (p.label(), cudnn)
    # The features table's ratios are those of the recorded times (eager: no graphs on CPU).
    rows = {(row[0], row[1]): row for row in report.feature_rows(results)}

    def ratio(a: Problem, b: Problem) -> str:
        mine, other = (report.rate(recs[("hopper-fmha:auto", x)], "eager") for x in (a, b))
        return f"{mine / other:.2f}× (e)"

    causal, window, plain, capped = problems[:4]
    assert rows[(window.label(), "hopper-fmha:auto")][7:] == [causal.label(), report._cell(
        recs[("hopper-fmha:auto", causal)], report.PRIMARY), ratio(window, causal)]  # fmt: skip
    assert rows[(capped.label(), "hopper-fmha:auto")][9] == ratio(capped, plain)
    fa4_ratio = report.rate(recs[("hopper-fmha:auto", capped)], "eager") / report.rate(
        recs[("fa4", capped)], "eager"
    )
    assert rows[(capped.label(), "hopper-fmha:auto")][4] == f"{fa4_ratio:.2f}× (e)"
    md = json_path.with_suffix(".md").read_text()
    assert "## Features" in md and f"| {window.label()} | hopper-fmha:auto |" in md
    assert f"- `sdpa-cudnn` ({window.label()}; " in md and SDPA_NO_FEATURES in md
