"""GPU tier, packed variable-length batches (`flash_attn_varlen_func`, the ws kernel with
`varlen`): random lengths with empty sequences on both sides, MHA/GQA/MQA, causal, windows,
softcap, sink and seqused_k, fp16 and bf16, d in {64, 128, 256}. Each sequence is held to
tests/test_gpu_kernels.py's rule (error at most twice PyTorch's in the inputs' dtype, plus a
floor) on its slice of out and lse. Outputs start as NaN (`flash_attn_varlen_func` allocates
them uninitialised, so the kernel call goes through `kernels.varlen_forward` with poisoned
buffers), and rows outside every sequence must stay untouched: the ragged O store and the LSE
stores stop at each sequence's end.
"""

from __future__ import annotations

import math
import random
import zlib

import pytest
import torch
from test_gpu_kernels import assert_close_to_reference  # noqa: E402  (tests/ is on sys.path)

import hopper_fmha
from hopper_fmha import config

pytestmark = pytest.mark.gpu

DTYPES = [torch.float16, torch.bfloat16]
HEAD_DIMS = [64, 128, 256]
HEADS = {"mha": (6, 6), "gqa": (6, 2), "mqa": (6, 1)}
# Length draws: short (inside one tile, tails everywhere), mixed (1 .. 1100 with empty ones),
# long (several tiles of each).
LENGTHS = {
    "short": lambda rng: [rng.choice([0, 1, 3, 17, 64, 127, 128, 129]) for _ in range(7)],
    "mixed": lambda rng: [rng.choice([0, rng.randint(1, 1100)]) for _ in range(9)],
    "long": lambda rng: [rng.randint(900, 2500) for _ in range(3)],
}
CASES = [
    # (name, causal, window, softcap, sink, seqused_k)
    ("plain", False, None, 0.0, False, False),
    ("causal", True, None, 0.0, False, False),
    ("window", False, (90, 17), 0.0, False, False),
    ("window_causal", True, (200, -1), 0.0, False, False),
    ("softcap_sink", False, None, 5.0, True, False),
    ("seqused_k", False, None, 0.0, False, True),
    ("seqused_k_causal", True, None, 0.0, False, True),
]


def packed_problem(lengths_q, lengths_k, heads, kv_heads, d, dtype, seed, pad_rows=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    q = torch.randn(total_q + pad_rows, heads, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(total_k, kv_heads, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(total_k, kv_heads, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v, cu_q, cu_k


def run_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap, sink, used, exact_lse):
    """`kernels.varlen_forward` into NaN-filled out and lse, with flash_attn_varlen_func's config."""
    from hopper_fmha import kernels

    features, kernel_causal, cfg = hopper_fmha.interface._score_features(
        max_q, max_k, q.shape[1], q.shape[2], causal, window or (-1, -1), softcap, sink, "ws", None
    )
    if cfg is None:
        cfg = config.select_config(q.shape[2], "ws", config.auto_tile("ws", q.shape[2], causal, max_k))
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[1], q.shape[0]), math.nan, device="cuda", dtype=torch.float32)
    f_window, f_cap, f_sink = None, 0.0, None
    if features is not None:
        f_window, f_cap, f_sink = (features.left, features.right), features.softcap, features.sink
    kernels.varlen_forward(
        q, k, v, out, lse, scale, kernel_causal, cfg, cu_q, cu_k, max_q, max_k, used, exact_lse=exact_lse,
        window=f_window, softcap=f_cap, learnable_sink=f_sink,
    )  # fmt: skip
    return out, lse


def check_sequences(q, k, v, cu_q, cu_k, used, scale, causal, window, softcap, sink, out, lse):
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        q0, q1, k0 = cu_q[b], cu_q[b + 1], cu_k[b]
        k1 = cu_k[b + 1] if used is None else k0 + int(used[b])
        if q1 == q0:
            continue
        qs, ks, vs = q[None, q0:q1], k[None, k0:k1], v[None, k0:k1]
        if k1 == k0:  # no key: out 0 and lse -inf (or the sink), which the rule's reference needs keys for
            assert torch.equal(out[q0:q1], torch.zeros_like(out[q0:q1])), f"sequence {b}: out not 0"
            expected = (
                sink[:, None].expand(-1, q1 - q0)
                if sink is not None
                else torch.full_like(lse[:, q0:q1], -math.inf)
            )
            assert torch.equal(lse[:, q0:q1], expected), f"sequence {b}: lse of no key"
            continue
        assert_close_to_reference(
            qs, ks, vs, scale, causal, out[None, q0:q1], lse[None, :, q0:q1], window=window, softcap=softcap,
            sink=sink,
        )  # fmt: skip


@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("name,causal,window,softcap,with_sink,with_used", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_varlen(hopper_gpu, dtype, d, name, causal, window, softcap, with_sink, with_used, lengths, heads):
    seed = zlib.crc32(repr((name, d, lengths, heads, str(dtype))).encode()) % 2**31
    rng = random.Random(seed)
    lengths_q = LENGTHS[lengths](rng)
    # Keys: as many as queries, or a different number (more, fewer, none) for some sequences.
    lengths_k = [rng.choice([n, n, rng.randint(0, 2 * n + 5)]) for n in lengths_q]
    h, hkv = HEADS[heads]
    pad = 37  # rows past cu_seqlens_q[-1]: no sequence's, never written
    q, k, v, cu_q, cu_k = packed_problem(lengths_q, lengths_k, h, hkv, d, dtype, seed, pad_rows=pad)
    used = None
    if with_used:
        used = torch.tensor([rng.randint(0, n) for n in lengths_k], dtype=torch.int32, device="cuda")
    sink = torch.randn(h, device="cuda") * 2 if with_sink else None
    scale = 1.0 if softcap else d**-0.5
    max_q, max_k = max(lengths_q), max(lengths_k)
    for exact_lse in (True, False):
        out, lse = run_varlen(
            q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window, softcap, sink, used, exact_lse
        )
        total_q = sum(lengths_q)
        assert torch.isnan(out[total_q:]).all() and torch.isnan(lse[:, total_q:]).all(), (
            "rows past the sequences written"
        )
        check_sequences(q, k, v, cu_q, cu_k, used, scale, causal, window, softcap, sink, out, lse)


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_varlen_public_api(hopper_gpu, d):
    """flash_attn_varlen_func itself: out and lse of each sequence, against the dense call."""
    rng = random.Random(d)
    lengths = [rng.randint(0, 700) for _ in range(6)] + [0]
    q, k, v, cu_q, cu_k = packed_problem(lengths, lengths, 8, 2, d, torch.bfloat16, d)
    out, lse = hopper_fmha.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lengths), max(lengths), causal=True, return_lse=True
    )
    assert out.shape == q.shape and lse.shape == (8, q.shape[0])
    check_sequences(q, k, v, cu_q, cu_k, None, d**-0.5, True, None, 0.0, None, out, lse)


def test_max_seqlen_too_small_and_offsets_past_the_end_stay_in_bounds(hopper_gpu):
    """Under CUDA graph capture the offsets are not checked: a max_seqlen_q below the longest
    sequence leaves rows uncomputed, and offsets past the packed rows write nothing outside out
    and lse (guard rows after the views stay NaN)."""
    from hopper_fmha import kernels

    d, h = 128, 4
    total = 300
    q = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    out_buf = torch.full((total + 256, h, d), math.nan, device="cuda", dtype=torch.bfloat16)
    lse_buf = torch.full((h, total + 256), math.nan, device="cuda")
    out, lse = out_buf[:total], lse_buf[:, :total]
    # Sequence 1 claims rows 200 .. 500 of a 300-row tensor; max_seqlen_q = 64 < the real 200.
    cu = torch.tensor([0, 200, 500], dtype=torch.int32, device="cuda")
    cfg = config.select_config(d, "ws")
    kernels.varlen_forward(q, k, v, out, lse, d**-0.5, False, cfg, cu, cu, 64, 300, None)
    torch.cuda.synchronize()
    assert torch.isnan(out_buf[total:]).all() and torch.isnan(lse_buf[:, total:]).all()
    # The first tile of each sequence is computed (rows past max_seqlen_q, at tile granularity, not).
    assert torch.isfinite(out[:64]).all() and torch.isfinite(out[200:264]).all()


# d = 96 runs 192-row tiles (3 consumer warpgroups) since session 24: every case, mixed lengths.
@pytest.mark.parametrize("name,causal,window,softcap,with_sink,with_used", CASES, ids=[c[0] for c in CASES])
def test_varlen_at_d96(hopper_gpu, name, causal, window, softcap, with_sink, with_used):
    assert config.select_config(96, "ws").tile_m == 192
    args = (name, causal, window, softcap, with_sink, with_used, "mixed", "gqa")
    test_varlen(hopper_gpu, torch.bfloat16, 96, *args)


# Non-causal packed sequences through the global tile counter (`kernels.VARLEN_TILE_COUNTER`, on
# by default since session 25): few persistent CTAs, so that each draws many tiles and
# skips the empty ones past its sequences' ends.
@pytest.mark.parametrize("ctas", [None, 3], ids=["per-sm", "3-ctas"])
@pytest.mark.parametrize("lengths", list(LENGTHS), ids=list(LENGTHS))
@pytest.mark.parametrize("name,causal,window,softcap,with_sink,with_used", CASES, ids=[c[0] for c in CASES])
def test_varlen_tile_counter(
    hopper_gpu, monkeypatch, name, causal, window, softcap, with_sink, with_used, lengths, ctas
):
    from hopper_fmha import kernels

    monkeypatch.setattr(kernels, "VARLEN_TILE_COUNTER", True)
    monkeypatch.setattr(kernels, "PERSISTENT_CTAS", ctas)
    args = (name, causal, window, softcap, with_sink, with_used, lengths, "gqa")
    for d in (64, 128):
        test_varlen(hopper_gpu, torch.bfloat16, d, *args)
