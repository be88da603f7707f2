"""The bench's host-path pieces: the `host` preset, the `+lse` backends and the stage table."""

import pytest

from hopper_fmha.bench import presets, registry, report
from hopper_fmha.bench.registry import Problem

pytestmark = pytest.mark.cpu


def test_host_preset_is_tiny():
    p = presets.get_preset("host")
    assert len(p.problems) == 4
    assert {(q.head_dim, q.causal) for q in p.problems} == {(d, c) for d in (64, 128) for c in (False, True)}
    assert all(q.batch == 1 and q.seqlen_q == q.seqlen_k == 128 for q in p.problems)


def test_lse_backends_call_with_return_lse(monkeypatch):
    calls = []
    import hopper_fmha

    monkeypatch.setattr(hopper_fmha, "flash_attn_func", lambda *a, **kw: calls.append(kw))
    (plain,) = registry.get_backend("hopper-fmha:auto")
    (lse,) = registry.get_backend("hopper-fmha:auto+lse")
    (tiled,) = registry.get_backend("hopper-fmha:ws@192x128+lse")
    assert (lse.name, tiled.name) == ("hopper-fmha:auto+lse", "hopper-fmha:ws@192x128+lse")
    p = Problem(1, 8, 8, 2, 2, 64)
    for b in (plain, lse, tiled):
        b.build(p, None, None, None)()
    assert [c["return_lse"] for c in calls] == [False, True, True]
    assert calls[2]["variant"] == "ws" and calls[2]["tile"] == (192, 128)
    with pytest.raises(ValueError, match="schedule"):
        registry.get_backend("hopper-fmha:ws/single+lse")


def test_host_stage_table():
    p = Problem(1, 128, 128, 16, 16, 128).to_dict()
    results = {
        "records": [
            {"problem": p, "backend": "ours", "profile": {"host_stages_us": {"a": 1.2, "b": 3.0}}},
            {"problem": p, "backend": "hopper-fmha:ws", "profile": {"host_stages_us": {"reason": "no GPU"}}},
            {"problem": p, "backend": "sdpa-cudnn", "profile": None},
        ]
    }
    table = report.host_stage_table(results)
    lines = table.splitlines()
    assert "| a | b | note |" in lines[0]
    assert "| 1.2 | 3.0 |" in lines[2]
    assert "no GPU" in lines[3] and len(lines) == 4
    assert report.host_stage_table({"records": results["records"][2:]}) == ""


def test_host_stages_call_the_interface_as_it_is(monkeypatch):
    """`bench.hostpath.host_stages` on CPU tensors, the GPU-only pieces stubbed: every stage calls
    the interface's helpers with their current signatures (a stale call broke the H200 profile
    of 2026-11-24 with a TypeError in every row)."""
    import torch

    from hopper_fmha import interface, kernels
    from hopper_fmha.bench import hostpath

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **kw: None)
    monkeypatch.setattr(interface, "_check_device", lambda *a: None)
    monkeypatch.setattr(interface, "flash_attn_func", lambda *a, **kw: None)
    monkeypatch.setattr(kernels, "prepared_launch", lambda *a, **kw: (lambda *args: None, ()))
    monkeypatch.setattr(kernels, "forward", lambda *a, **kw: None)
    q = torch.randn(1, 128, 4, 64, dtype=torch.bfloat16)
    k = v = torch.randn(1, 128, 2, 64, dtype=torch.bfloat16)
    stages = hostpath.host_stages(q, k, v, causal=True, calls=2)
    assert set(stages) >= {"flash_attn_func", "validate", "allocate out, lse", "kernels.forward"}
    assert all(t >= 0 for t in stages.values())
