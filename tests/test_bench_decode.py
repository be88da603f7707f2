"""The bench's decode pieces on CPU: decode problems (bytes and FLOPs per sequence, labels, dicts),
the `decode` preset, the cache inputs (ragged lengths, shuffled page tables), the check against
`reference_with_kvcache`, the backends' decode calls and skips, the copy yardstick, the decode
table, and a whole run with a fake backend of ours."""

import json
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from hopper_fmha.bench import cli as bench_cli
from hopper_fmha.bench import presets, registry, report, runner, timing
from hopper_fmha.bench.registry import COPY, COPY_UNCHECKED, PADDED, Backend, Problem
from hopper_fmha.reference_kvcache import reference_with_kvcache

pytestmark = pytest.mark.cpu

# Small enough for CPU: odd lengths (one empty but for a token, one full), GQA.
LENS = (37, 64, 5)
RAGGED = Problem.decode(3, 64, heads=4, kv_heads=2, head_dim=64, cache_seqlens=LENS)
PAGED = Problem.decode(3, 64, heads=4, kv_heads=2, head_dim=64, page_size=16, cache_seqlens=LENS)
SPEC = Problem.decode(3, 64, heads=4, kv_heads=2, head_dim=64, seqlen_q=3, causal=True)

# `presets.decode_lengths(64, 8192)`: random.Random(0).randint(1, 8192), 64 times; 270,570 tokens.
PRESET_LENGTHS = (
    6312, 6891, 664, 4243, 7962, 6635, 4970, 7809, 5867, 3579, 2282, 4618, 2290, 1554, 4105, 2408,
    5082, 1619, 1209, 5410, 7736, 1650, 5797, 7114, 5181, 3351, 7816, 7254, 4268, 1021, 231, 1529,
    6535, 19, 8087, 5459, 3997, 5329, 1032, 3131, 3633, 3910, 2335, 7340, 1495, 1319, 5244, 8017,
    1787, 4939, 4770, 2045, 5452, 3330, 4713, 7291, 1502, 6307, 5195, 3967, 4757, 3013, 3103, 3060,
)  # fmt: skip


# ---- the problem ----


def test_decode_problem_counts_the_tokens_attended():
    p = Problem.decode(2, 64, heads=4, kv_heads=2, head_dim=8, dtype="fp16", cache_seqlens=(10, 64))
    assert (p.batch, p.seqlen_q, p.seqlen_k, p.kvcache, p.cache_lengths) == (2, 1, 64, True, (10, 64))
    # K and V of 74 tokens: 74 * 2 kv heads * (8 + 8) * 2 bytes.
    assert p.kv_bytes == 74 * 2 * 16 * 2 == 4736
    # 4 * H * seqlen_q * len * d summed over the sequences.
    assert p.flops == 4 * 4 * 1 * 74 * 8 == 9472
    # Causal with 3 queries: not halved (each query sees nearly all of its keys).
    assert Problem.decode(2, 64, 4, 2, 8, seqlen_q=3, causal=True, cache_seqlens=(10, 64)).flops == 3 * 9472
    # An input set holds q, the output and the whole cache: 2 * (2 * 2*1*4*8 + 2 * 2*64*2*8).
    assert p.input_bytes == 2 * (2 * 64 + 2 * 2048) and p.output_bytes == 2 * 64
    full = Problem.decode(2, 64, 4, 2, 8)
    assert full.cache_seqlens is None and full.cache_lengths == (64, 64) and full.kv_bytes == 128 * 64
    # Paged or not, the bytes read are the same.
    assert Problem.decode(2, 64, 4, 2, 8, page_size=16).kv_bytes == full.kv_bytes
    # Lengths all at the capacity are the full cache: one problem.
    assert Problem.decode(2, 64, 4, 2, 8, cache_seqlens=(64, 64)) == full


@pytest.mark.parametrize(
    "kwargs, match",
    [({"cache_seqlens": (0, 5, 5)}, "lengths .* in 1..64"), ({"cache_seqlens": (5, 5)}, "3 lengths"),
     ({"cache_seqlens": (5, 5, 65)}, "in 1..64"), ({"page_size": 48}, "divisor of the capacity 64")],
)  # fmt: skip
def test_decode_problem_rejects_bad_caches(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Problem.decode(3, 64, 4, 2, 64, **kwargs)
    with pytest.raises(ValueError, match="belong to decode problems"):
        Problem(3, 1, 64, 4, 2, 64, page_size=16)


def test_labels_and_dicts():
    shape = {"heads": 32, "kv_heads": 8, "head_dim": 128}
    dense = Problem.decode(64, 8192, **shape)
    assert dense.label() == "decode B64 L8192 H32/8 d128 bf16 q1"
    assert (
        Problem.decode(64, 8192, **shape, page_size=64).label()
        == "decode B64 L8192 H32/8 d128 bf16 q1 paged64"
    )
    ragged = Problem.decode(64, 8192, **shape, cache_seqlens=PRESET_LENGTHS)
    assert ragged.label() == "decode B64 L8192 H32/8 d128 bf16 q1 ragged"
    spec = Problem.decode(
        64, 8192, **shape, seqlen_q=4, causal=True, page_size=16, cache_seqlens=PRESET_LENGTHS
    )
    assert spec.label() == "decode B64 L8192 H32/8 d128 bf16 q4 causal paged16 ragged"
    assert dense.to_dict() == {
        "batch": 64, "seqlen_q": 1, "seqlen_k": 8192, "heads": 32, "kv_heads": 8, "head_dim": 128,
        "causal": False, "dtype": "bfloat16", "kvcache": True,
    }  # fmt: skip
    for p in (dense, ragged, spec):
        d = json.loads(json.dumps(p.to_dict()))
        assert Problem.from_dict(d) == p and hash(Problem.from_dict(d)) == hash(p)
    assert json.loads(json.dumps(spec.to_dict()))["cache_seqlens"] == list(PRESET_LENGTHS)
    # Dense problems keep their dicts: no decode keys.
    assert set(Problem(4, 4096, 4096, 16, 16, 128).to_dict()) == {
        "batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "head_dim", "causal", "dtype"
    }  # fmt: skip


# ---- the preset ----


def test_decode_preset_is_deterministic_and_stated():
    assert presets.decode_lengths(64, 8192) == PRESET_LENGTHS
    torch.manual_seed(123)  # torch's generator plays no part
    assert presets.decode_lengths(64, 8192) == PRESET_LENGTHS and sum(PRESET_LENGTHS) == 270_570
    preset = presets.get_preset("decode")
    assert preset.backends == ("hopper-fmha:auto", "sdpa-cudnn", "fa4", COPY)
    registry.resolve_backends(preset.backends)
    base = "decode {} H32/8 d128 bf16 q{}"
    assert [p.label() for p in preset.problems] == [
        base.format("B64 L8192", 1), base.format("B64 L8192", 1) + " ragged",
        *(base.format("B64 L8192", 1) + f" paged{n}" for n in (16, 64, 256)),
        base.format("B1 L131072", 1), base.format("B4 L131072", 1), base.format("B64 L8192", 4) + " causal",
    ]  # fmt: skip
    assert preset.problems[1].cache_seqlens == PRESET_LENGTHS
    # The bytes read: 2 GiB everywhere but the ragged cell and batch 1.
    gib = [p.kv_bytes / 2**30 for p in preset.problems]
    assert gib == [2, 270_570 * 8 * 256 * 2 / 2**30, 2, 2, 2, 0.5, 2, 2]
    # Twins: paged cells against the dense one, the ragged against the full.
    dense = preset.problems[0]
    assert [presets.decode_twin(p) for p in preset.problems[:5]] == [None, dense, dense, dense, dense]
    args = _parser().parse_args(["bench", "--preset", "decode"])
    assert bench_cli.plan(args) == ("decode", preset.problems, list(preset.backends))


def _parser():
    import argparse

    parser = argparse.ArgumentParser(prog="hopper-fmha")
    bench_cli.register(parser.add_subparsers())
    return parser


# ---- inputs and the check ----


def test_make_inputs_builds_the_cache():
    q, k, v, lens, table = runner.make_inputs(RAGGED, 1, "cpu", seed=5)[0]
    assert q.shape == (3, 1, 4, 64) and k.shape == v.shape == (3, 64, 2, 64) and q.dtype == torch.bfloat16
    assert lens.dtype == torch.int32 and lens.tolist() == list(LENS) and table is None
    sets = runner.make_inputs(PAGED, 2, "cpu", seed=5)
    q, k, v, lens, table = sets[0]
    assert k.shape == v.shape == (12, 16, 2, 64)  # 3 sequences * 64 tokens in pages of 16
    assert table.dtype == torch.int32 and table.shape == (3, 4)
    assert sorted(table.flatten().tolist()) == list(range(12)) and table.flatten().tolist() != list(range(12))
    assert table.tolist() == runner.page_table(PAGED, 5)  # the same table on every machine
    assert sets[1][4] is table and sets[1][3] is lens and not torch.equal(sets[1][1], k)
    again = runner.make_inputs(PAGED, 2, "cpu", seed=5)
    assert all(torch.equal(a, b) for s, t in zip(sets, again, strict=True) for a, b in zip(s, t, strict=True))
    assert runner.page_table(PAGED, 6) != runner.page_table(PAGED, 5)


def _lowp(p, q, k, v, lens, table):
    """PyTorch's low-precision attention per sequence on its cached keys: a correct output."""
    outs = []
    for b in range(p.batch):
        kb, vb = runner.sequence_kv(p, k, v, table, b)
        outs.append(runner.lowp_attention(q[b : b + 1], kb[None], vb[None], p.causal))
    return torch.cat(outs)


@pytest.mark.parametrize("p", [RAGGED, PAGED, SPEC], ids=["ragged", "paged", "spec"])
def test_checker_checks_against_the_kvcache_reference(p):
    q, k, v, lens, table = runner.make_inputs(p, 1, "cpu", seed=3)[0]
    chk = runner.Checker(p, q, k, v, lens, table)
    want, _ = reference_with_kvcache(q, k, v, cache_seqlens=lens, page_table=table, causal=p.causal)
    torch.testing.assert_close(chk.ref, want, rtol=0, atol=0)
    assert (
        0 < chk.torch_err
        and chk.tol == 2 * chk.torch_err + torch.finfo(q.dtype).eps * want.abs().max().item()
    )
    good = _lowp(p, q, k, v, lens, table)
    assert chk.check(good)["passed"] and chk.check(want.to(q.dtype))["passed"]
    bad = good.clone()
    bad[1, -1, 2] += 0.05  # one query row of one head
    assert not chk.check(bad)["passed"]
    # Every key of the capacity instead of each sequence's own: not the answer.
    if p.cache_seqlens:
        full = Problem.decode(3, 64, 4, 2, 64, page_size=p.page_size)
        assert not chk.check(_lowp(full, q, k, v, None, table))["passed"]
    # The pages in pool order instead of the table's: not the answer.
    if p.page_size:
        in_order = torch.arange(12, dtype=torch.int32).reshape(3, 4)
        assert not chk.check(_lowp(p, q, k, v, lens, in_order))["passed"]


# ---- backends ----


def _step(p, backend, seed=0):
    sets = runner.make_inputs(p, 2, "cpu", seed=seed)
    return runner.run_step(
        p, backend, sets, lambda: runner.Checker(p, *sets[0]), timing.CpuTimer(),
        timing.TimingSettings.quick(), graph=False,
    )  # fmt: skip


def test_backends_without_a_decode_call_skip_with_a_reason():
    for name in ("fa3", PADDED):
        rec = _step(RAGGED, registry.REGISTRY[name])
        assert (
            rec["status"] == "skipped"
            and rec["reason"] == f"{name} has no KV-cache (decode) call in this bench"
        )
    for name in ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn"):
        rec = _step(PAGED, registry.REGISTRY[name])
        assert rec["status"] == "skipped" and rec["reason"] == "SDPA takes dense K and V: no paged cache"
    for name, reason in (
        ("hopper-fmha:paper", "flash_attn_with_kvcache runs the ws kernel only, not paper"),
        ("hopper-fmha:ws@128x64", "flash_attn_with_kvcache takes no tile override"),
    ):
        (b,) = registry.get_backend(name)
        assert _step(RAGGED, b)["reason"] == reason
    # Ours on CPU tensors raises (it needs a Hopper GPU): skipped, not fatal.
    (auto,) = registry.get_backend("hopper-fmha:auto")
    rec = _step(PAGED, auto)
    assert rec["status"] == "skipped" and rec["reason"].startswith("raised ")
    # The copy is for decode problems only.
    rec = _step(Problem(1, 64, 64, 2, 2, 64), registry.REGISTRY[COPY])
    assert rec["status"] == "skipped" and "decode problems only" in rec["reason"]


def test_decode_calls(monkeypatch):
    import hopper_fmha

    calls = []
    monkeypatch.setattr(hopper_fmha, "flash_attn_with_kvcache", lambda *a, **kw: calls.append((a, kw)))
    fa4 = ModuleType("flash_attn.cute")
    fa4.flash_attn_varlen_func = lambda *a, **kw: calls.append((a, kw))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fa4)
    spec = Problem.decode(3, 64, 4, 2, 64, seqlen_q=2, causal=True, page_size=16)
    q, k, v, lens, table = runner.make_inputs(spec, 1, "cpu", seed=0)[0]
    for name in ("hopper-fmha:auto", "hopper-fmha:ws+lse", "fa4"):
        (b,) = registry.get_backend(name)
        b.make(spec, q, k, v, lens, table)()
    (a, kw), (a_lse, kw_lse), (a_fa4, kw_fa4) = calls
    assert a == a_lse == a_fa4 == (q, k, v)  # no k, v to append: the timed call is idempotent
    assert kw == {"cache_seqlens": lens, "page_table": table, "causal": True, "return_lse": False}
    assert kw_lse["return_lse"] is True
    # FA4's varlen call with batch-major q and cache: lengths as seqused_k, its default num_splits.
    assert kw_fa4 == {"seqused_k": lens, "page_table": table, "causal": True}


def test_decode_mask():
    assert registry.decode_mask(Problem.decode(2, 8, 2, 1, 8)) is None  # full, not causal: no mask
    ragged = registry.decode_mask(Problem.decode(2, 8, 2, 1, 8, cache_seqlens=(3, 8)))
    assert ragged.shape == (2, 1, 1, 8)
    assert ragged[:, 0, 0].int().tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1] * 8]
    # Causal, 3 queries, bottom-right: row i sees keys up to i + len - 3.
    spec = registry.decode_mask(Problem.decode(2, 8, 2, 1, 8, seqlen_q=3, causal=True, cache_seqlens=(4, 8)))
    assert spec[0, 0].int().tolist() == [
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
    ]
    assert spec[1, 0, 0].int().tolist() == [1] * 6 + [0, 0]
    full = registry.decode_mask(Problem.decode(2, 8, 2, 1, 8, seqlen_q=3, causal=True))
    assert full.shape == (1, 1, 3, 8) and torch.equal(full[0, 0], spec[1, 0])


@pytest.mark.parametrize("p", [RAGGED, SPEC, Problem.decode(3, 64, 4, 2, 64)], ids=["ragged", "spec", "full"])
def test_sdpa_decode_call_is_correct(p):
    # Built without SDPA's backend choice, PyTorch's CPU kernels run it with the mask: correct.
    q, k, v, lens, table = sets = runner.make_inputs(p, 1, "cpu", seed=1)[0]
    out = registry.REGISTRY["sdpa-cudnn"].make(p, *sets)()
    assert runner.Checker(p, *sets).check(out.transpose(1, 2))["passed"]


def test_copy_times_the_bytes_read():
    rec = _step(RAGGED, registry.REGISTRY[COPY])
    assert rec["status"] == "ok" and rec["check"] == {"passed": None, "reason": COPY_UNCHECKED}
    assert rec["eager"] is not None
    q, k, v, lens, table = sets = runner.make_inputs(RAGGED, 1, "cpu", seed=0)[0]
    out = registry.REGISTRY[COPY].make(RAGGED, *sets)()
    assert out.dtype == torch.uint8 and out.numel() == RAGGED.kv_bytes == 106 * 2 * 128 * 2


# ---- the report ----


def _rec(p: Problem, name: str, tbps: float | None, ours=False, status="ok") -> dict:
    ms = p.kv_bytes / (tbps * 1e12) * 1e3 if tbps else None
    t = timing.summarize([ms] * 3, 1) if ms else None
    return {
        "problem": p.to_dict(), "backend": name, "label": registry.REGISTRY[name].label if name in
        registry.REGISTRY else name, "ours": ours, "flops": p.flops, "n_sets": 2, "set_bytes": p.input_bytes,
        "status": status, "reason": None if t else "no", "check": None, "eager": t, "graph": t,
        "graph_reason": None, "profile": None,
    }  # fmt: skip


def _decode_results() -> dict:
    env = {"date": "2026-11-21T05:30:00+00:00", "device": "NVIDIA H200", "device_slug": "h200"}
    results = report.new_results(
        "decode", env, {"warmup": 5, "iters": 30}, "hopper-fmha bench --preset decode"
    )
    dense, ragged, paged16 = presets.decode().problems[:3]
    ours = "hopper-fmha:auto"
    results["records"] = [
        _rec(dense, ours, 4.5, ours=True), _rec(dense, "sdpa-cudnn", 4.46), _rec(dense, "fa4", 4.36),
        _rec(dense, COPY, 3.0),
        _rec(ragged, ours, 4.0, ours=True), _rec(ragged, "sdpa-cudnn", 2.0),
        _rec(ragged, "fa4", 4.2, status="wrong"), _rec(ragged, COPY, 2.5),
        _rec(paged16, ours, 4.2, ours=True), _rec(paged16, "sdpa-cudnn", None, status="skipped"),
        _rec(paged16, "fa4", 3.47), _rec(paged16, COPY, 3.0),
    ]  # fmt: skip
    results["complete"] = True
    return results


def test_report_shows_decode_bandwidth_and_ratios():
    results = _decode_results()
    rows = report.decode_rows(results)
    label = "decode B64 L8192 H32/8 d128 bf16 q1"
    # 4.5 / 4.46 = 1.01 (cuDNN the best peer), 4.5 / 3.0 = 150% of the copy; no twin.
    assert rows[0] == [
        label,
        "2.15",
        "hopper-fmha:auto",
        "4.50",
        "4.46",
        "4.36",
        "1.01×",
        "3.00",
        "150%",
        "–",
        "–",
    ]
    # A wrong FA4 is no yardstick: the best peer is cuDNN's masked call; 4.0 / 4.5 = 0.89 of full.
    assert rows[1] == [label + " ragged", "1.11", "hopper-fmha:auto", "4.00", "2.00", "4.20 ✗", "2.00×",
                       "2.50", "160%", "full", "0.89×"]  # fmt: skip
    # Paged: FA4 is the only peer (4.2 / 3.47 = 1.21), 4.2 / 4.5 = 0.93 of ours dense.
    assert rows[2] == [label + " paged16", "2.15", "hopper-fmha:auto", "4.20", "skipped", "3.47", "1.21×",
                       "3.00", "140%", "dense", "0.93×"]  # fmt: skip
    assert len(rows) == 3
    md = report.render_markdown(results)
    assert "## Decode: TB/s of K/V read, ours ÷ best peer, % of copy, ÷ twin" in md
    assert (
        "| problem | GB read | backend | TB/s | cuDNN | FA4 | ÷ best peer (≥ 1.0) | copy | % of copy | "
        "twin | ÷ twin (paged ≥ 0.9) |" in md
    )
    assert "its TB/s counting the bytes it reads" in md
    # The TFLOP/s tables keep the decode cells, told apart, without the copy column.
    assert "| 64 | 1/cache 8192 paged16 | 32/8 | 128 | no | bfloat16 |" in md
    tflops_header = next(line for line in md.splitlines() if line.startswith("| B | N |"))
    assert "cuDNN" in tflops_header and "copy" not in tflops_header
    term = report.render_terminal(results).splitlines()
    at = term.index(
        "decode: TB/s of K/V read (CUDA graph; (e) eager where no graph); ours ÷ best peer, % of copy, ÷ twin"
    )
    want = ["hopper-fmha:auto", "4.50", "4.46", "4.36", "1.01×", "3.00", "150%", "–", "–"]
    assert term[at + 3].split()[-9:] == want
    assert "4.50 TB/s" in report.record_line(results["records"][0])
    # No decode problem, no decode table.
    dense = {**results, "records": [r for r in results["records"] if "kvcache" not in r["problem"]]}
    assert report.decode_rows(dense) == [] and "## Decode" not in report.render_markdown(dense)


# ---- a whole run ----


def test_whole_decode_run_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "collect_env", lambda device: {**_decode_results()["env"], "device": "cpu"})

    def kvcache(p, q, k, v, lens, table):  # a correct decode call: the reference in q's dtype
        kwargs = {"cache_seqlens": lens, "page_table": table, "causal": p.causal}
        return lambda: reference_with_kvcache(q, k, v, **kwargs)[0].to(q.dtype)

    ours = Backend("hopper-fmha:fake", "fake", lambda p, q, k, v: None, ours=True, kvcache=kvcache)
    backends = [ours, registry.REGISTRY["sdpa-flash"], registry.REGISTRY["fa4"], registry.REGISTRY[COPY]]
    dense = Problem.decode(3, 64, 4, 2, 64)
    problems = (dense, RAGGED, PAGED)
    args = SimpleNamespace(no_graph=True, seed=0, tag=None, out=str(tmp_path), profile=False, no_plot=True)
    code = bench_cli.execute(
        args,
        "decode",
        problems,
        backends,
        timing.TimingSettings.quick(),
        device="cpu",
        timer=timing.CpuTimer(),
    )
    assert code == 0
    (json_path,) = tmp_path.glob("decode-*.json")
    results = report.load_results(json_path)
    status = {(r["backend"], Problem.from_dict(r["problem"])): r for r in results["records"]}
    for p in problems:
        assert status[("hopper-fmha:fake", p)]["check"]["passed"]
        assert status[(COPY, p)]["status"] == "ok" and status[(COPY, p)]["check"]["passed"] is None
        assert status[("fa4", p)]["status"] == "skipped"  # not installed, or no CPU path
    assert status[("sdpa-flash", RAGGED)]["check"]["passed"]  # CPU SDPA with the mask
    assert status[("sdpa-flash", PAGED)]["status"] == "skipped"
    rows = report.decode_rows(results)
    assert [r[:3] for r in rows] == [
        [p.label(), f"{p.kv_bytes / 1e9:.2f}", "hopper-fmha:fake"] for p in problems
    ]
    # The ragged cell against the full one; the paged (ragged) cell against the same lengths dense.
    assert [r[9] for r in rows] == ["–", "full", "dense"] and rows[2][10] != "–"
    assert rows[0][8].endswith("% (e)")  # eager only on CPU
    assert "## Decode" in json_path.with_suffix(".md").read_text()
