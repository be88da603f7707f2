"""CPU tier: every launch `hopper_fmha.kernels` builds passes exactly what the compiled kernel was
compiled with: as many arguments as `cache.fake_arguments` gave the compiler (less the stream),
None exactly where it gave None.

The kernel is a recorder (`get_kernel` patched), so `forward`, `varlen_forward` and
`kvcache_forward` run their real argument building on CPU tensors. An object file loaded from the
disk cache refuses any other count (`test_compile_disk_cache.py`); the launches of session 18
passed 11 to 22 of the ws kernel's 23 and failed that way on the GPU (the stand-in
kernels of the API tests replace these functions, so they could not see it)."""

import inspect

import pytest
import torch
from tvm_ffi_binding import assert_binds

from hopper_fmha import config, kernels
from hopper_fmha.kernels import cache
from hopper_fmha.kernels.sm90_paper import PaperFwdSm90
from hopper_fmha.kernels.sm90_ws import WsFwdSm90

pytestmark = pytest.mark.cpu


@pytest.fixture
def recorded(monkeypatch):
    """The (key, arguments) of each launch; the GPU-only helpers replaced by CPU ones."""
    launches = []

    def get_kernel(key):
        return lambda *args: launches.append((key, args))

    monkeypatch.setattr(kernels, "get_kernel", get_kernel)
    monkeypatch.setattr(cache, "by_config", {})
    monkeypatch.setattr(kernels, "_sm_count", lambda index: 132)
    counters = torch.zeros(64, dtype=torch.int32)
    monkeypatch.setattr(kernels, "_tile_counters", lambda index, needed: (counters, 0))
    import hopper_fmha.kernels.combine as combine

    monkeypatch.setattr(combine, "combine", lambda *a: None)
    return launches


def assert_follows_compiled_signature(key, args):
    # Every parameter of the kernel's __call__ but self and the stream (defaults included: the
    # object file takes them all), and None exactly where the compile was given None.
    kernel_class = WsFwdSm90 if key.variant == "ws" else PaperFwdSm90
    params = [p for p in inspect.signature(kernel_class.__call__).parameters if p not in ("self", "stream")]
    assert len(args) == len(params), f"{key.slug()}: {len(args)} arguments, the kernel has {len(params)}"
    fake = cache.fake_arguments(key, tvm_ffi=False)
    stream = 5 + (2 if key.variant == "paper" else 6)  # q, k, v, out, lse, scale, group[, ws: 4]
    compiled = fake[:stream] + fake[stream + 1 :]
    assert len(args) == len(compiled), f"{key.slug()}: {len(args)} arguments, compiled with {len(compiled)}"
    assert [a is None for a in args] == [c is None for c in compiled], key.slug()
    assert_binds(compiled, args, key.slug())


def bshd(b, s, h, d):
    return torch.randn(b, s, h, d, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "variant,features",
    [("ws", {}), ("paper", {}), ("ws", {"window": (5, -1), "softcap": 3.0}), ("ws", {"learnable_sink": "s"})],
    ids=["ws", "paper", "window-softcap", "sink"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_launches(recorded, variant, features, causal):
    q, k, v = bshd(2, 100, 4, 64), bshd(2, 120, 2, 64), bshd(2, 120, 2, 64)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 100)
    if features.get("learnable_sink") == "s":
        features = {"learnable_sink": torch.zeros(4)}
    cfg = config.select_config(64, variant)
    kernels.forward(q, k, v, out, lse, 0.125, causal, cfg, **features)
    ((key, args),) = recorded
    assert_follows_compiled_signature(key, args)


@pytest.mark.parametrize("seqused", [False, True])
def test_varlen_launch(recorded, seqused):
    cu = torch.tensor([0, 30, 100], dtype=torch.int32)
    q, k, v = (torch.randn(100, h, 128, dtype=torch.bfloat16) for h in (4, 2, 2))
    out, lse = torch.empty_like(q), torch.empty(4, 100)
    used = torch.tensor([20, 70], dtype=torch.int32) if seqused else None
    cfg = config.select_config(128, "ws")
    kernels.varlen_forward(q, k, v, out, lse, 0.1, True, cfg, cu, cu, 70, 70, used, window=(16, -1))
    ((key, args),) = recorded
    assert key.varlen and key.seqused_k == seqused
    assert_follows_compiled_signature(key, args)


@pytest.mark.parametrize(
    "splits,pack,paged",
    [(1, False, False), (3, False, False), (3, True, False), (1, True, True), (4, False, True)],
)
def test_kvcache_launch(recorded, splits, pack, paged):
    q = bshd(2, 1, 8, 128)
    if paged:
        k_cache, v_cache = bshd(6, 64, 2, 128), bshd(6, 64, 2, 128)
        table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
        cfg = config.select_config(128, "ws", (128, config.paged_tile_n(64, 128)))
    else:
        k_cache, v_cache, table = bshd(2, 192, 2, 128), bshd(2, 192, 2, 128), None
        cfg = config.select_config(128, "ws")
    out, lse = torch.empty_like(q), torch.empty(2, 8, 1)
    seqlens = torch.tensor([100, 150], dtype=torch.int32)
    kernels.kvcache_forward(
        q, k_cache, v_cache, out, lse, 0.1, False, cfg, seqlens, splits, pack_gqa=pack, page_table=table
    )
    ((key, args),) = recorded
    assert key.split_kv == (splits > 1) and key.paged == paged and (key.pack_gqa > 1) == pack
    assert_follows_compiled_signature(key, args)


def test_sustained_specs_refuse_tile_counter():
    # A tile_counter kernel needs a counter slot of its own, which only the varlen and KV-cache
    # launches that set it ask for; the probe's dense launches refuse the switch by name.
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import sustained

    assert sustained.parse_ws_spec("ws@128x128:pingpong=0") == ((128, 128), {"pingpong": False})
    with pytest.raises(ValueError, match="tile_counter is set per launch"):
        sustained.parse_ws_spec("ws:tile_counter=1")
