"""GPU tier, ws variant's score features: sliding window (one- and two-sided, 0, with and without
causal), softcap and a learnable sink, alone and together, against `reference` with the same
features, by the rule of tests/test_gpu_kernels.py: the kernel's error at most twice that of
PyTorch computing the same attention in the inputs' dtype, plus a floor.

`test_ws_features` calls `kernels.forward(..., window=, softcap=, learnable_sink=)` with the ws
table's config; `test_flash_attn_func_score_features` goes through the public API.
"""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch
from test_gpu_kernels import assert_close_to_reference  # noqa: E402  (tests/ is on sys.path)

from hopper_fmha import config

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128, 256]
# FlashAttention's grid of tails: one key, tiny tiles, tails on both sides, many queries on few
# keys (rows that see nothing), one row short of a tile, many tiles.
SEQLENS = [(1, 1), (3, 3), (113, 203), (128, 217), (239, 1), (799, 3), (1023, 1024), (4224, 4224)]
HEADS = {"mha": (6, 6), "gqa": (6, 2), "mqa": (6, 1)}
# (name, causal, window kind, softcap, sink): window kinds are drawn per problem (`draw_window`).
CASES = [
    ("win_both", False, "both", 0.0, False),
    ("win_left", False, "left", 0.0, False),
    ("win_right", False, "right", 0.0, False),
    ("win_zero", False, "zero", 0.0, False),
    ("win_left_causal", True, "left", 0.0, False),
    ("win_both_causal", True, "both", 0.0, False),
    ("softcap", False, None, 5.0, False),
    ("softcap_causal", True, None, 5.0, False),
    ("sink", False, None, 0.0, True),
    ("sink_causal", True, None, 0.0, True),
    ("all", False, "both", 5.0, True),
    ("all_causal", True, "left", 5.0, True),
]


def draw_window(kind, sq, sk, rng: random.Random):
    """A random window of `kind` for sq queries and sk keys (sizes 0 .. sk, -1 on an open side)."""
    if kind is None:
        return None
    if kind == "zero":
        return (0, 0)
    left = rng.randint(0, sk) if kind in ("left", "both") else -1
    right = rng.randint(0, sk) if kind in ("right", "both") else -1
    return (left, right)


def run_kernel(q, k, v, scale, causal, cfg, window, softcap, sink):
    from hopper_fmha import kernels

    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), math.nan, device=q.device, dtype=torch.float32)
    kernels.forward(
        q, k, v, out, lse, scale, causal, cfg, exact_lse=True, window=window, softcap=softcap,
        learnable_sink=sink,
    )  # fmt: skip
    return out, lse


@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("seqlens", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("name,causal,window_kind,softcap,with_sink", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_ws_features(hopper_gpu, dtype, d, name, causal, window_kind, softcap, with_sink, seqlens, heads):
    sq, sk = seqlens
    h, hkv = HEADS[heads]
    seed = zlib.crc32(repr((name, d, seqlens, heads, str(dtype))).encode()) % 2**31
    rng = random.Random(seed)
    window = draw_window(window_kind, sq, sk, rng)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, sq, h, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(2, sk, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(2, sk, hkv, d, device="cuda", dtype=dtype, generator=g)
    sink = torch.randn(h, device="cuda", dtype=torch.float32, generator=g) * 2 if with_sink else None
    # softcap: a scale large enough that the cap bends the scores (tanh well away from linear).
    scale = 1.0 if softcap else config.default_softmax_scale(d)
    cfg = config.select_config(d, "ws")
    out, lse = run_kernel(q, k, v, scale, causal, cfg, window, softcap, sink)
    assert_close_to_reference(q, k, v, scale, causal, out, lse, window=window, softcap=softcap, sink=sink)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_ws_sink_rows_without_keys(hopper_gpu, d):
    """Rows that see no key: out 0 and lse = the head's sink (a window far to the left of them)."""
    q = torch.randn(1, 300, 4, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 20, 4, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    sink = torch.tensor([0.5, -3.0, 10.0, 80.0], device="cuda")
    # Causal, bottom-right: rows 0 .. 279 see no key.
    out, lse = run_kernel(q, k, v, d**-0.5, True, config.select_config(d, "ws"), (4, -1), 0.0, sink)
    assert torch.equal(out[:, :280], torch.zeros_like(out[:, :280]))
    assert torch.allclose(lse[0, :, :280], sink[:, None].expand(4, 280))
    assert_close_to_reference(q, k, v, d**-0.5, True, out, lse, window=(4, -1), sink=sink)


# Through the public API: flash_attn_func resolves the window (sides no row reaches past dropped,
# a right limit 0 run as causal), takes the ws kernel (auto would pick the paper kernel for some of
# these short problems) and returns the sink's LSE.
API_CASES = [
    ("window", False, (37, 5), 0.0, False),
    ("window_right_zero", False, (64, 0), 0.0, False),
    ("window_causal", True, (100, 7), 0.0, False),
    ("softcap_sink", False, (-1, -1), 3.0, True),
    ("all_causal", True, (200, -1), 5.0, True),
]


@pytest.mark.parametrize(
    "seqlens", [(1, 1), (113, 203), (512, 512), (1023, 1024)], ids=lambda s: f"{s[0]}x{s[1]}"
)
@pytest.mark.parametrize("name,causal,window,softcap,with_sink", API_CASES, ids=[c[0] for c in API_CASES])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_flash_attn_func_score_features(
    hopper_gpu, dtype, d, name, causal, window, softcap, with_sink, seqlens
):
    import hopper_fmha

    sq, sk = seqlens
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((name, d, seqlens)).encode()))
    q = torch.randn(2, sq, 6, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(2, sk, 2, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(2, sk, 2, d, device="cuda", dtype=dtype, generator=g)
    sink = torch.randn(6, device="cuda", generator=g).to(torch.bfloat16) if with_sink else None
    scale = 1.0 if softcap else None
    out, lse = hopper_fmha.flash_attn_func(
        q, k, v, scale, causal, window, softcap, return_lse=True, learnable_sink=sink
    )
    scale = config.default_softmax_scale(d) if scale is None else scale
    sink32 = None if sink is None else sink.float()
    assert_close_to_reference(q, k, v, scale, causal, out, lse, window=window, softcap=softcap, sink=sink32)
    # The out-only call (its kernel may take the faster row sums) meets the same rule on out.
    out_only = hopper_fmha.flash_attn_func(q, k, v, scale, causal, window, softcap, learnable_sink=sink)
    assert_close_to_reference(
        q, k, v, scale, causal, out_only, lse, window=window, softcap=softcap, sink=sink32
    )


# d = 96 (and d = 80 on its kernel) runs 3 consumer warpgroups of 64 rows x 112 keys since session
# 24, the table's only 192-row tile besides d = 64's: every case on a few shapes.
@pytest.mark.parametrize("seqlens", [(3, 3), (239, 1), (1023, 1024)], ids=["3x3", "239x1", "1023x1024"])
@pytest.mark.parametrize("name,causal,window_kind,softcap,with_sink", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("d", [96, 80])
def test_ws_features_at_d96(hopper_gpu, d, name, causal, window_kind, softcap, with_sink, seqlens):
    assert config.select_config(d, "ws").tile_m == 192
    args = (name, causal, window_kind, softcap, with_sink, seqlens, "gqa")
    test_ws_features(hopper_gpu, torch.bfloat16, d, *args)


# Softcap at caps from 5 to 200 on rows whose scores all sit at the cap's two ends (t = tanh(...) =
# +1 or -1) beside rows of random scores: the range a softcap softmax must hold (session 38's
# fixed-reference softmax, withdrawn, overflowed fp16's P here: NOTES "v38").
@pytest.mark.parametrize("with_sink", [False, True], ids=["plain", "sink"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("cap", [5.0, 30.0, 55.0, 56.0, 200.0])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_ws_softcap_range(hopper_gpu, dtype, d, cap, causal, with_sink):
    seed = zlib.crc32(repr((d, cap, causal, with_sink, str(dtype))).encode()) % 2**31
    g = torch.Generator(device="cuda").manual_seed(seed)
    sq, sk, h = 300, 517, 4
    u = torch.randn(d, device="cuda", generator=g)
    u = u / u.norm()
    # Every key leans along u; a third of the rows along +u, a third along -u (q.k near +-16 for
    # all keys: t saturates at +-1 with scale = cap), the rest random.
    k = 4 * u + 0.3 * torch.randn(1, sk, h, d, device="cuda", generator=g)
    q = 0.3 * torch.randn(1, sq, h, d, device="cuda", generator=g)
    lean = torch.tensor([4.0, -4.0, 0.0], device="cuda").repeat(sq // 3 + 1)[:sq]
    q = q + lean[None, :, None, None] * u
    v = torch.randn(1, sk, h, d, device="cuda", generator=g)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    sink = torch.randn(h, device="cuda", dtype=torch.float32, generator=g) * 2 if with_sink else None
    cfg = config.select_config(d, "ws")
    out, lse = run_kernel(q, k, v, cap, causal, cfg, None, cap, sink)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert_close_to_reference(q, k, v, cap, causal, out, lse, softcap=cap, sink=sink)
