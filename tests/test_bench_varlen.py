"""The bench's varlen pieces on CPU: varlen problems (FLOPs per sequence, labels, dicts), the
`varlen` preset and its dense twins, packed inputs, the check per sequence, the padded baseline,
the backends that skip, the varlen table, and a whole run with fake backends."""

import json
import sys
from types import ModuleType

import pytest
import torch
from bench_cpu_run import execute_on_cpu

from hopper_fmha.bench import cli as bench_cli
from hopper_fmha.bench import presets, registry, report, runner, timing
from hopper_fmha.bench.flops import attention_flops
from hopper_fmha.bench.registry import PADDED, PADDED_UNCHECKED, Backend, Problem
from hopper_fmha.reference import reference, reference_varlen

pytestmark = pytest.mark.cpu

# Odd lengths, so causal masks and tiles end mid-block; GQA.
LENS = (37, 70, 5)
SMALL = Problem.varlen(LENS, heads=4, kv_heads=2, head_dim=64, causal=True, dtype="bfloat16")

# `presets.varlen_lengths()`: random.Random(0).randint(256, 4096), 24 times.
PRESET_LENGTHS = (
    3714, 1833, 3360, 3902, 1978, 421, 1316, 2350, 2246, 1914, 4017, 3466,
    3655, 1498, 2208, 1722, 2645, 3908, 3975, 1150, 2323, 826, 1410, 828,
)  # fmt: skip


# ---- the problem ----


def test_varlen_problem_counts_flops_and_bytes_per_sequence():
    p = Problem.varlen((3, 5), heads=2, kv_heads=1, head_dim=8)
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.seqlens) == (2, 5, 5, (3, 5))
    assert p.offsets == (0, 3, 8)
    # 4 * H * d * (3² + 5²) = 4 * 2 * 8 * 34, not the padded 4 * 2 * 2 * 8 * 5².
    assert p.flops == 2176 == attention_flops(1, 2, 3, 3, 8) + attention_flops(1, 2, 5, 5, 8)
    assert Problem.varlen((3, 5), 2, 1, 8, causal=True).flops == 1088
    # 8 real rows: q and out 8 * 2 * 8, k and v 8 * 1 * 8 elements, 2 bytes each.
    assert p.input_bytes == 2 * (2 * 128 + 2 * 64) and p.output_bytes == 2 * 128


def test_labels_and_dicts():
    p = Problem.varlen((421, 4017, 1000), 32, 8, 128, causal=True, dtype="bf16")
    assert p.label() == "varlen3 L421-4017 H32/8 d128 bf16 causal"
    # Dense problems as before: same label, no seqlens key.
    dense = Problem(4, 4096, 4096, 16, 16, 128, causal=True)
    assert dense.label() == "B4 N4096 H16 d128 fp16 causal"
    assert dense.to_dict() == {"batch": 4, "seqlen_q": 4096, "seqlen_k": 4096, "heads": 16, "kv_heads": 16,
                               "head_dim": 128, "causal": True, "dtype": "float16"}  # fmt: skip
    assert Problem.from_dict(dense.to_dict()) == dense
    # Varlen through JSON: the list comes back as the same (hashable) problem.
    d = json.loads(json.dumps(p.to_dict()))
    assert d["seqlens"] == [421, 4017, 1000] and Problem.from_dict(d) == p
    assert hash(Problem.from_dict(d)) == hash(p)
    with pytest.raises(ValueError, match="batch = len"):
        Problem(2, 4017, 4017, 32, 8, 128, seqlens=(421, 4017, 1000))
    with pytest.raises(ValueError, match="positive lengths"):
        Problem.varlen((0, 5), 2, 2, 64)


# ---- the preset ----


def test_varlen_preset_is_deterministic_and_stated():
    assert presets.varlen_lengths() == PRESET_LENGTHS  # the same on every machine
    torch.manual_seed(123)  # torch's generator plays no part
    assert presets.varlen_lengths() == PRESET_LENGTHS
    assert all(256 <= n <= 4096 for n in PRESET_LENGTHS)
    preset = presets.get_preset("varlen")
    assert preset.backends == ("hopper-fmha:auto", "fa4", PADDED)
    registry.resolve_backends(preset.backends)
    varlen, twins = preset.problems[::2], preset.problems[1::2]
    assert [(p.head_dim, p.causal) for p in varlen] == [(128, False), (128, True), (64, False), (64, True)]
    for p, twin in zip(varlen, twins, strict=True):
        assert p.seqlens == PRESET_LENGTHS and (p.heads, p.kv_heads, p.dtype) == (32, 8, "bfloat16")
        assert twin == presets.dense_twin(p) and twin.seqlens is None
        # RMS of the lengths (2604.9) to a multiple of 128; about the same work and tokens.
        assert (twin.batch, twin.seqlen_q, twin.seqlen_k) == (24, 2560, 2560)
        assert (twin.heads, twin.kv_heads, twin.head_dim, twin.causal) == (32, 8, p.head_dim, p.causal)
        assert 0.95 < twin.flops / p.flops < 1.0 and 1.0 < twin.input_bytes / p.input_bytes < 1.1
    assert presets.dense_twin(SMALL) == Problem(3, 128, 128, 4, 2, 64, True, "bfloat16")  # at least 128
    args = _parser().parse_args(["bench", "--preset", "varlen"])
    assert bench_cli.plan(args) == ("varlen", preset.problems, list(preset.backends))


def _parser():
    import argparse

    parser = argparse.ArgumentParser(prog="hopper-fmha")
    bench_cli.register(parser.add_subparsers())
    return parser


# ---- inputs and the check ----


def test_make_inputs_packs_the_sequences():
    sets = runner.make_inputs(SMALL, 2, "cpu", seed=5)
    q, k, v, cu = sets[0]
    assert q.shape == (112, 4, 64) and k.shape == v.shape == (112, 2, 64) and q.dtype == torch.bfloat16
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 37, 107, 112]
    assert not torch.equal(sets[1][0], q)  # each set its own draw
    again = runner.make_inputs(SMALL, 2, "cpu", seed=5)
    assert all(torch.equal(a, b) for s, t in zip(sets, again, strict=True) for a, b in zip(s, t, strict=True))


def _lowp_varlen(q, k, v, cu, causal):
    """PyTorch's low-precision attention per sequence: a correct varlen output."""
    b = cu.tolist()
    return torch.cat([runner.lowp_attention(q[None, s:e], k[None, s:e], v[None, s:e], causal)[0]
                      for s, e in zip(b[:-1], b[1:], strict=True)])  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
def test_checker_checks_varlen_outputs_per_sequence(causal):
    p = Problem.varlen(LENS, 4, 2, 64, causal, "bfloat16")
    q, k, v, cu = runner.make_inputs(p, 1, "cpu", seed=3)[0]
    chk = runner.Checker(p, q, k, v, cu)  # the default reference, as on the GPU
    # The reference is the package's varlen reference, and the tolerance rule is unchanged.
    want, _ = reference_varlen(q, k, v, cu, cu, causal=causal)
    torch.testing.assert_close(chk.ref, want, rtol=1e-5, atol=1e-5)
    assert (
        0 < chk.torch_err
        and chk.tol == 2 * chk.torch_err + torch.finfo(q.dtype).eps * want.abs().max().item()
    )
    good = _lowp_varlen(q, k, v, cu, causal)
    assert chk.check(good)["passed"]
    bad = good.clone()
    bad[40:45] += 0.05  # a few rows of the second sequence
    assert not chk.check(bad)["passed"]
    # A dense answer over the whole packed batch is not the varlen answer.
    assert not chk.check(runner.lowp_attention(q[None], k[None], v[None], causal)[0])["passed"]
    assert "shape" in chk.check(good[:-1])["reason"]


# ---- backends ----


def _step(p, backend):
    sets = runner.make_inputs(p, 2, "cpu", seed=0)

    def checker():
        return runner.Checker(p, *sets[0], reference=reference)

    return runner.run_step(
        p, backend, sets, checker, timing.CpuTimer(), timing.TimingSettings.quick(), graph=False
    )


def test_pad_and_unpad_are_exact():
    x = torch.randn(112, 3, 8)
    padded = registry.pad(x, LENS)
    assert padded.shape == (3, 70, 3, 8)
    assert torch.equal(padded[0, :37], x[:37]) and torch.equal(padded[2, :5], x[107:])
    assert not padded[0, 37:].any() and not padded[2, 5:].any()
    assert torch.equal(registry.unpad(padded, LENS), x)


def test_padded_backend_is_checked_on_the_real_rows(monkeypatch):
    import hopper_fmha

    calls = []

    def dense(q, k, v, causal=False):  # stands in for our dense kernel
        calls.append(q.shape)
        return runner.lowp_attention(q, k, v, causal)

    monkeypatch.setattr(hopper_fmha, "flash_attn_func", dense)
    backend = registry.REGISTRY[PADDED]
    rec = _step(SMALL, backend)
    # One dense call on the batch padded to the longest sequence; causal, the padded keys are
    # past every real row, so the unpadded rows are the varlen answer.
    assert calls[0] == (3, 70, 4, 64)
    assert rec["status"] == "ok" and rec["check"]["passed"], rec
    assert rec["flops"] == SMALL.flops  # the real tokens' FLOPs
    # Non-causal, the real rows see the zero keys: not the varlen answer, so timed unchecked.
    noncausal = Problem.varlen(LENS, 4, 2, 64, False, "bfloat16")
    rec = _step(noncausal, backend)
    assert rec["status"] == "ok" and rec["check"] == {"passed": None, "reason": PADDED_UNCHECKED}
    assert rec["eager"] is not None
    q, k, v, cu = runner.make_inputs(noncausal, 1, "cpu", seed=0)[0]
    out = registry.unpad(dense(*(registry.pad(x, LENS) for x in (q, k, v))), LENS)
    assert not runner.Checker(noncausal, q, k, v, cu, reference=reference).check(out)["passed"]
    # A dense problem is not its business.
    rec = _step(Problem(1, 64, 64, 2, 2, 64), backend)
    assert rec["status"] == "skipped" and "varlen problems only" in rec["reason"]


def test_backends_without_varlen_skip_with_a_reason():
    for name in ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "fa3"):
        rec = _step(SMALL, registry.REGISTRY[name])
        assert rec["status"] == "skipped"
        assert rec["reason"] == f"{name} has no varlen (packed sequences) call in this bench"
    (paper,) = registry.get_backend("hopper-fmha:paper")
    rec = _step(SMALL, paper)
    assert (
        rec["status"] == "skipped"
        and rec["reason"] == "flash_attn_varlen_func runs the ws kernel only, not paper"
    )
    # Ours on a CPU tensor raises (needs a Hopper GPU): skipped, not fatal.
    (auto,) = registry.get_backend("hopper-fmha:auto")
    rec = _step(SMALL, auto)
    assert rec["status"] == "skipped" and rec["reason"].startswith("raised ")


def test_varlen_calls(monkeypatch):
    import hopper_fmha

    calls = []
    monkeypatch.setattr(hopper_fmha, "flash_attn_varlen_func", lambda *a, **kw: calls.append((a, kw)))
    fa4 = ModuleType("flash_attn.cute")
    fa4.flash_attn_varlen_func = lambda *a, **kw: calls.append((a, kw))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fa4)
    q, k, v, cu = runner.make_inputs(SMALL, 1, "cpu", seed=0)[0]
    for name in ("hopper-fmha:auto", "hopper-fmha:ws@128x128+lse", "fa4"):
        (b,) = registry.get_backend(name)
        b.make(SMALL, q, k, v, cu)()
    (a, kw), (a_lse, kw_lse), (a_fa4, kw_fa4) = calls
    assert a[:5] == (q, k, v, cu, cu) and a[5:] == (70, 70)
    assert kw == {"causal": True, "return_lse": False, "tile": None}
    assert kw_lse == {"causal": True, "return_lse": True, "tile": (128, 128)}
    # FA4's fourth parameter is qv: everything past v by keyword.
    assert a_fa4 == (q, k, v) and kw_fa4 == {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 70,
                                             "max_seqlen_k": 70, "causal": True}  # fmt: skip


# ---- the report ----


def _rec(p: Problem, name: str, graph_tf: float | None, ours=False, status="ok") -> dict:
    ms = p.flops / (graph_tf * 1e12) * 1e3 if graph_tf else None
    t = timing.summarize([ms] * 3, 1) if ms else None
    return {
        "problem": p.to_dict(), "backend": name, "label": name, "ours": ours, "flops": p.flops,
        "n_sets": 2, "set_bytes": p.input_bytes, "status": status, "reason": None if t else "no",
        "check": None, "eager": t, "graph": t, "graph_reason": None, "profile": None,
    }  # fmt: skip


def _varlen_results() -> dict:
    env = {"date": "2026-11-21T05:30:00+00:00", "device": "NVIDIA H200", "device_slug": "h200"}
    results = report.new_results(
        "varlen", env, {"warmup": 5, "iters": 30}, "hopper-fmha bench --preset varlen"
    )
    p, twin, pc, twin_c = presets.varlen().problems[:4]
    results["records"] = [
        _rec(p, "hopper-fmha:auto", 612.0, ours=True),
        _rec(p, "fa4", 600.0),
        _rec(p, PADDED, 306.0, ours=True),
        _rec(twin, "hopper-fmha:auto", 640.0, ours=True),
        _rec(twin, "fa4", 650.0),
        _rec(twin, PADDED, None, ours=True, status="skipped"),
        _rec(pc, "hopper-fmha:auto", 500.0, ours=True),
        _rec(pc, "fa4", 520.0, status="wrong"),  # a wrong FA4 is no yardstick
        _rec(pc, PADDED, 270.0, ours=True),
        _rec(twin_c, "hopper-fmha:auto", 520.0, ours=True),
    ]
    results["complete"] = True
    return results


def test_report_shows_varlen_ratios():
    results = _varlen_results()
    rows = report.varlen_rows(results)
    # 612 / 600 = 1.02 FA4, 612 / 640 = 0.96 twin, 612 / 306 = 2.00 padded.
    assert rows[0] == ["varlen24 L421-4017 H32/8 d128 bf16", "hopper-fmha:auto", "612.0", "600.0", "1.02×",
                       "B24 N2560", "640.0", "0.96×", "306.0", "2.00×"]  # fmt: skip
    assert rows[1] == ["varlen24 L421-4017 H32/8 d128 bf16 causal", "hopper-fmha:auto", "500.0", "520.0 ✗",
                       "–", "B24 N2560", "520.0", "0.96×", "270.0", "1.85×"]  # fmt: skip
    assert len(rows) == 2  # one backend of ours (the padded one is a column)
    md = report.render_markdown(results)
    assert "## Varlen: ours ÷ FA4, ÷ our dense twin, ÷ padded" in md
    assert (
        "| problem | backend | TFLOP/s | FA4 | ÷ FA4 (≥ 1.0) | dense twin | twin TFLOP/s | ÷ twin (≥ 0.95) |"
        in md
    )
    assert (
        "| varlen24 L421-4017 H32/8 d128 bf16 | hopper-fmha:auto | 612.0 | 600.0 | 1.02× | B24 N2560 |" in md
    )
    assert "| 24 | varlen 421–4017 | 32/8 | 128 | no | bfloat16 |" in md  # the TFLOP/s tables
    assert "(varlen: summed over the sequences)" in md
    term = report.render_terminal(results).splitlines()
    at = term.index(
        "varlen: TFLOP/s (CUDA graph; (e) eager where no graph); ours ÷ FA4, ÷ our dense twin, ÷ padded"
    )
    assert term[at + 1].split()[:6] == ["problem", "backend", "TFLOP/s", "FA4", "÷", "FA4"]
    assert term[at + 3].split()[5:] == ["hopper-fmha:auto", "612.0", "600.0", "1.02×", "B24", "N2560",
                                        "640.0", "0.96×", "306.0", "2.00×"]  # fmt: skip
    # No varlen problem, no varlen table.
    dense = {**results, "records": [r for r in results["records"] if "seqlens" not in r["problem"]]}
    assert report.varlen_rows(dense) == [] and "## Varlen" not in report.render_markdown(dense)


# ---- a whole run ----


def test_whole_varlen_run_on_cpu(tmp_path, monkeypatch):
    import hopper_fmha

    monkeypatch.setattr(runner, "collect_env", lambda device: {**_varlen_results()["env"], "device": "cpu"})
    monkeypatch.setattr(hopper_fmha, "flash_attn_func", lambda q, k, v, causal=False: runner.lowp_attention(
        q, k, v, causal))  # fmt: skip
    ours = Backend(
        "hopper-fmha:fake", "fake", lambda p, q, k, v: lambda: runner.lowp_attention(q, k, v, p.causal),
        ours=True, varlen=lambda p, q, k, v, cu: lambda: _lowp_varlen(q, k, v, cu, p.causal),
    )  # fmt: skip
    backends = [ours, registry.REGISTRY["fa4"], registry.REGISTRY[PADDED], registry.REGISTRY["sdpa-flash"]]
    problems = (SMALL, presets.dense_twin(SMALL))
    results, _, json_path = execute_on_cpu(tmp_path, "varlen", problems, backends)
    status = {(r["backend"], "seqlens" in r["problem"]): r["status"] for r in results["records"]}
    assert status[("hopper-fmha:fake", True)] == status[(PADDED, True)] == "ok"
    assert status[("hopper-fmha:fake", False)] == "ok"
    assert status[("sdpa-flash", True)] == status[(PADDED, False)] == "skipped"
    assert status[("fa4", True)] == "skipped"  # not installed, or no CPU path
    varlen_rec = next(
        r for r in results["records"] if r["backend"] == "hopper-fmha:fake" and r["problem"].get("seqlens")
    )
    assert varlen_rec["check"]["passed"] and varlen_rec["flops"] == SMALL.flops
    (row,) = report.varlen_rows(results)
    assert row[:2] == [SMALL.label(), "hopper-fmha:fake"] and row[5] == "B3 N128" and row[7].endswith("× (e)")
    assert "## Varlen" in json_path.with_suffix(".md").read_text()
