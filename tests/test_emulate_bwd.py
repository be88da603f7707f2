"""The tile-level emulation of the FlashAttention-2/3 backward against torch.autograd through `reference`."""

import random
from functools import lru_cache

import numpy as np
import pytest
import torch

from hopper_fmha.emulate import block_range
from hopper_fmha.emulate_bwd import (
    dq_order,
    emulate_backward,
    preprocess,
    query_block_range,
    rotated_turns,
    rotated_walk,
)
from hopper_fmha.reference import reference, resolve_window

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_torch_thread")]

# Both sides fp64; the tiles only regroup the sums (observed <= ~1e-13 on gradients of size ~10).
TOL = dict(rtol=1e-10, atol=1e-11)
SCALE = 0.5
TILES = [(64, 128), (128, 64), (64, 64)]


def _sink(heads):
    return 2 * torch.randn(heads, generator=torch.Generator().manual_seed(heads), dtype=torch.float64)


@lru_cache(maxsize=16)
def _autograd(
    seqlen_q, seqlen_k, heads, kv_heads, causal, window, softcap, with_sink, head_dim=16, head_dim_v=16
):
    """Inputs, the forward's out and lse, dout, and the gradients by autograd through `reference` (fp64)."""
    g = torch.Generator().manual_seed(seqlen_q * 7919 + seqlen_k * 31 + heads)
    q = torch.randn(2, seqlen_q, heads, head_dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, seqlen_k, kv_heads, head_dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, seqlen_k, kv_heads, head_dim_v, generator=g, dtype=torch.float64, requires_grad=True)
    sink = _sink(heads).requires_grad_() if with_sink else None
    kwargs = dict(window_size=window, softcap=softcap, learnable_sink=sink)
    out, lse = reference(q, k, v, SCALE, causal, torch.float64, **kwargs)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * dout).sum().backward()
    grads = [q.grad, k.grad, v.grad] + ([sink.grad] if with_sink else [])
    inputs = [t.detach().numpy() for t in (q, k, v, out, dout, lse)]
    return inputs, (None if sink is None else sink.detach().numpy()), [t.numpy() for t in grads]


def _check(case, block_m, block_n, deterministic=False):
    seqlen_q, seqlen_k, heads, kv_heads, causal, window, softcap, with_sink = case[:8]
    inputs, sink, expected = _autograd(*case)
    got = emulate_backward(
        *inputs, SCALE, causal, window, softcap, sink, block_m, block_n, deterministic=deterministic
    )
    assert len(got) == len(expected)
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, expected, strict=False):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, **TOL, err_msg=name)
    return got


NO_WINDOW = (-1, -1)
# (seqlen_q, seqlen_k, heads, kv_heads, causal, window, softcap, sink)
CASES = {
    "mha-full": (113, 203, 2, 2, False, NO_WINDOW, 0.0, False),
    "mha-causal": (113, 203, 2, 2, True, NO_WINDOW, 0.0, False),
    "gqa-causal-sq>sk": (203, 113, 4, 2, True, NO_WINDOW, 0.0, False),  # rows 0-89 see no key
    "mqa-full-sq>sk": (203, 113, 3, 1, False, NO_WINDOW, 0.0, False),
    "mqa-causal": (113, 203, 3, 1, True, NO_WINDOW, 0.0, False),
    "one-one": (1, 1, 2, 2, True, NO_WINDOW, 0.0, False),
    "three-three-gqa": (3, 3, 4, 2, True, NO_WINDOW, 0.0, False),
    "one-query": (1, 203, 3, 1, False, (5, 5), 0.0, True),
    "no-key-rows": (239, 1, 2, 2, True, NO_WINDOW, 0.0, False),  # only the last row sees the key
    "no-key-rows-sink": (239, 1, 4, 2, True, NO_WINDOW, 0.0, True),
    "window-17-5": (300, 277, 4, 2, False, (17, 5), 0.0, False),
    "window-0-0": (113, 203, 3, 1, False, (0, 0), 0.0, False),
    "left-70": (203, 113, 4, 2, False, (70, -1), 0.0, False),
    "right-70": (113, 203, 4, 2, False, (-1, 70), 0.0, False),
    "causal-left-100": (300, 277, 2, 2, True, (100, -1), 0.0, False),
    "softcap": (113, 203, 4, 2, False, NO_WINDOW, 1.5, False),
    "softcap-causal-gqa": (203, 113, 4, 2, True, NO_WINDOW, 0.8, False),
    "sink": (113, 203, 4, 2, False, NO_WINDOW, 0.0, True),
    "sink-mqa-causal": (203, 113, 3, 1, True, NO_WINDOW, 0.0, True),
    "causal-softcap-sink": (113, 203, 4, 2, True, NO_WINDOW, 0.8, True),
    "left-40-right-0-sink": (300, 277, 4, 2, False, (40, 0), 1.2, True),
}


@pytest.mark.parametrize("block_m,block_n", TILES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_autograd(case, block_m, block_n):
    _check(CASES[case], block_m, block_n)


DV_CASES = {  # d = 192, dv = 128 (DeepSeek's shape); short sequences, since wide tiles are what costs here
    "mqa-causal": (37, 77, 3, 1, True, NO_WINDOW, 0.0, False),
    "causal-softcap-sink": (77, 37, 4, 2, True, NO_WINDOW, 0.8, True),
    "window-17-5-gqa": (70, 70, 4, 2, False, (17, 5), 0.0, False),
}


@pytest.mark.parametrize("block_m,block_n", TILES)
@pytest.mark.parametrize("case", list(DV_CASES))
def test_head_dim_v_differs(case, block_m, block_n):
    dq, dk, dv, *_ = _check(DV_CASES[case] + (192, 128), block_m, block_n)
    assert dq.shape[-1] == dk.shape[-1] == 192 and dv.shape[-1] == 128


def _random_windows(n, seed):
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        seqlen_q, seqlen_k = rng.choice([(37, 300), (300, 37), (129, 129), (1, 77), (77, 1)])
        window = tuple(rng.choice([-1, 0, rng.randint(1, 70), rng.randint(64, 310)]) for _ in "lr")
        heads = rng.choice([(2, 2), (4, 2), (3, 1)])
        causal, softcap, sink = rng.random() < 0.3, rng.choice([0.0, 1.2]), rng.random() < 0.5
        cases.append((seqlen_q, seqlen_k, *heads, causal, window, softcap, sink))
    return cases


@pytest.mark.parametrize("case", _random_windows(16, seed=7), ids=lambda x: str(x).replace(" ", ""))
def test_random_windows_match_autograd(case):
    block_m, block_n = TILES[sum(case[:2]) % len(TILES)]
    _check(case, block_m, block_n, deterministic=case[1] % 2 == 0)


# ---- the pieces: D, dsink, rows without keys, the key-side block range -------------------------------


def test_preprocess_d_and_dsink():
    # D_i = rowsum(dO_i ∘ O_i) is also sum_j P_ij dP_ij (O_i = sum_j P_ij v_j: the sink has no value vector),
    # the identity that makes dS = P ∘ (dP - D) the softmax's backward; dsink = -sum exp(sink - lse) D.
    case = CASES["causal-softcap-sink"]
    (q, k, v, out, dout, lse), sink, expected = _autograd(*case)
    d, dsink = preprocess(out, dout, lse, sink)
    np.testing.assert_allclose(d, np.einsum("bshd,bshd->bhs", dout, out), rtol=1e-14)
    group = q.shape[2] // k.shape[2]
    kk, vv = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = 0.8 * np.tanh(SCALE * np.einsum("bihd,bjhd->bhij", q, kk) / 0.8)
    i, j = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
    s = np.where(j <= i + k.shape[1] - q.shape[1], s, -np.inf)
    p = np.exp(s - lse[..., None])
    dp = np.einsum("bihd,bjhd->bhij", dout, vv)
    np.testing.assert_allclose(d, (p * dp).sum(-1), **TOL)
    np.testing.assert_allclose(dsink, -(np.exp(sink[None, :, None] - lse) * d).sum(axis=(0, 2)), rtol=1e-14)
    np.testing.assert_allclose(dsink, expected[3], **TOL)  # and autograd agrees
    assert preprocess(out, dout, lse)[1] is None


def test_rows_without_keys_give_nothing():
    # seqlen_q 239, seqlen_k 1, causal: rows 0-237 see no key. Their dQ is 0 and their dO adds nothing to
    # dK, dV: changing it changes no gradient. With a sink their lse = sink and D = 0, so no dsink either.
    for name in ("no-key-rows", "no-key-rows-sink"):
        (q, k, v, out, dout, lse), sink, _ = _autograd(*CASES[name])
        grads = emulate_backward(q, k, v, out, dout, lse, SCALE, True, learnable_sink=sink)
        assert (grads[0][:, :238] == 0).all()
        if sink is not None:  # row 238's one key competes with the sink (without it, P = 1: dq = 0 too)
            assert (grads[0][:, 238] != 0).all()
        noisy = dout.copy()
        noisy[:, :238] = np.random.default_rng(0).standard_normal(noisy[:, :238].shape)
        again = emulate_backward(q, k, v, out, noisy, lse, SCALE, True, learnable_sink=sink)
        for a, b in zip(grads, again, strict=True):
            np.testing.assert_array_equal(a, b)


def _pairs_seen(n_start, block_m, block_n, seqlen_q, seqlen_k, left, right):
    """The Q tiles holding a real row that sees a real key of the K tile at n_start (brute force)."""
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(n_start, min(n_start + block_n, seqlen_k))[None, :]
    seen = np.ones((seqlen_q, j.size), dtype=bool)
    if right >= 0:
        seen &= j <= i + seqlen_k - seqlen_q + right
    if left >= 0:
        seen &= j >= i + seqlen_k - seqlen_q - left
    return set((np.nonzero(seen.any(axis=1))[0] // block_m).tolist())


def test_query_block_range_is_the_forward_rule_from_the_key_side():
    # The key side visits exactly the (m, n) pairs the forward's block_range does, and those cover every
    # pair in which a real row sees a real key.
    rng = random.Random(4)
    for _ in range(1500):
        block_m, block_n = rng.choice(TILES + [(128, 128)])
        seqlen_q, seqlen_k = rng.randint(1, 400), rng.randint(1, 400)
        left, right = (rng.choice([-1, 0, rng.randint(1, 40), rng.randint(41, 500)]) for _ in "lr")
        n_blocks, m_blocks = -(-seqlen_k // block_n), -(-seqlen_q // block_m)
        key_side = {
            (m, n)
            for n in range(n_blocks)
            for m in range(*query_block_range(n * block_n, block_m, block_n, seqlen_q, seqlen_k, left, right))
        }
        query_side = {
            (m, n)
            for m in range(m_blocks)
            for n in range(*block_range(m * block_m, block_m, block_n, seqlen_q, seqlen_k, left, right))
        }
        args = (block_m, block_n, seqlen_q, seqlen_k, left, right)
        assert key_side == query_side, args
        for n in range(n_blocks):
            assert {(m, n) for m in _pairs_seen(n * block_n, *args)} <= key_side, (n, args)


@pytest.mark.parametrize(
    "n_start,block_m,block_n,seqlen_q,seqlen_k,left,right,expected",
    [
        (0, 64, 128, 256, 256, -1, 0, (0, 4)),  # causal: key block 0 is seen by every query block
        (128, 64, 128, 256, 256, -1, 0, (2, 4)),  # keys 128-255: rows from 128
        (0, 64, 64, 512, 128, -1, 0, (6, 8)),  # seqlen_q > seqlen_k: rows 384.. see key 0
        (0, 64, 64, 64, 128, 0, 0, (0, 0)),  # offset 64: keys 0-63 are seen by no row
        (128, 128, 128, 100, 1000, 5, 5, (0, 0)),  # keys 128-255 are far left of rows 0-99 (keys 900..)
        (64, 64, 64, 256, 256, 64, -1, (0, 3)),  # left 64: keys 64-127 seen by rows up to 191
    ],
)
def test_query_block_range(n_start, block_m, block_n, seqlen_q, seqlen_k, left, right, expected):
    assert query_block_range(n_start, block_m, block_n, seqlen_q, seqlen_k, left, right) == expected


# ---- dQ accumulation order: deterministic and not ----------------------------------------------------


@pytest.mark.parametrize("case", ["mha-causal", "window-17-5", "gqa-causal-sq>sk", "left-70", "sink"])
def test_deterministic_order(case):
    seqlen_q, seqlen_k, heads, kv_heads, causal, window, softcap, _ = CASES[case]
    inputs, sink, _ = _autograd(*CASES[case])
    block_m, block_n = 128, 64
    left, right = resolve_window(causal, window)
    runs = {}
    for deterministic, seed in ((True, None), (True, 1), (False, None), (False, 1), (False, 2)):
        *grads, order = emulate_backward(
            *inputs, SCALE, causal, window, softcap, sink, block_m, block_n, deterministic,
            return_order=True, schedule_seed=seed,
        )  # fmt: skip
        runs[deterministic, seed] = grads, order
        for m, added in order.items():
            visitors = range(*block_range(m * block_m, block_m, block_n, seqlen_q, seqlen_k, left, right))
            assert sorted(added) == list(visitors)  # every visiting key block adds once, none else
            if deterministic:  # the fixed order: descending with a right limit (causal), else ascending
                assert added == dq_order(m, block_m, block_n, seqlen_q, seqlen_k, left, right)
                assert added == (list(visitors)[::-1] if right >= 0 else list(visitors))
    for grads, _ in runs.values():  # the order changes no gradient (beyond fp64 round-off)
        for a, b in zip(grads, runs[True, None][0], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)
    assert runs[True, None][1] == runs[True, 1][1]  # deterministic: the schedule's seed changes nothing
    if case == "mha-causal":  # ... while the shuffled schedules add in other orders
        assert runs[False, 1][1] != runs[True, None][1] or runs[False, 2][1] != runs[True, None][1]


@pytest.mark.parametrize("seqlens", [(203, 113), (300, 300), (64, 500), (129, 257)], ids=str)
def test_rotated_deterministic_order(seqlens):
    # The v2 kernel's rotated walk (deterministic, no causal or window): every key block adds into
    # every query block once, in `rotated_turns` order, fixed whatever the schedule, and the
    # gradients are those of the plain order.
    seqlen_q, seqlen_k = seqlens
    inputs, _, expected = _autograd(seqlen_q, seqlen_k, 4, 2, False, NO_WINDOW, 0.0, False)
    block_m, block_n = 64, 128
    n_m, n_n = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    orders = []
    for seed in (None, 3):
        *grads, order = emulate_backward(
            *inputs, SCALE, False, NO_WINDOW, 0.0, None, block_m, block_n, True,
            return_order=True, schedule_seed=seed, rotate=True,
        )  # fmt: skip
        for m, added in order.items():
            assert added == rotated_turns(m, n_m, n_n) and sorted(added) == list(range(n_n))
        for a, b in zip(grads, expected, strict=True):
            np.testing.assert_allclose(a, b, **TOL)
        orders.append(order)
    assert orders[0] == orders[1]
    with pytest.raises(ValueError, match="rotate"):
        emulate_backward(*inputs, SCALE, True, deterministic=True, rotate=True)


def test_rotated_turns_follow_the_arrival_order():
    # In the rotated walk a query block's turns go in the order the CTAs reach it, each at least
    # `stride` steps after the one before: in lockstep no CTA waits for a turn (the plain
    # ascending order makes CTA n wait n steps at the first block). Fewer query blocks than key
    # blocks (stride 0): no rotation, descending, the kernel's launch order.
    for n_m in range(1, 40):
        for n_n in range(1, 40):
            stride = n_m // n_n
            walks = [rotated_walk(n, n_m, n_n) for n in range(n_n)]
            assert all(sorted(w) == list(range(n_m)) for w in walks)
            for m in range(n_m):
                turns = rotated_turns(m, n_m, n_n)
                assert sorted(turns) == list(range(n_n))
                if stride == 0:
                    assert turns == list(range(n_n))[::-1]
                    continue
                steps = [walks[n].index(m) for n in turns]
                assert all(b - a >= stride for a, b in zip(steps, steps[1:], strict=False)), (n_m, n_n, m)


def test_fp32_accumulator():
    # dq_accum_dtype=float32 is the kernel's accumulator: dQ within fp32 round-off of the fp64 one, not equal.
    inputs, sink, expected = _autograd(*CASES["causal-softcap-sink"])
    args = (*inputs, SCALE, True, NO_WINDOW, 0.8, sink, 64, 64)
    dq32 = emulate_backward(*args, dq_accum_dtype="float32")[0]
    dq64 = emulate_backward(*args)[0]
    assert dq32.dtype == np.float64 and not np.array_equal(dq32, dq64)
    np.testing.assert_allclose(dq32, expected[0], rtol=1e-5, atol=1e-5)


def test_accepts_torch_tensors():
    inputs, sink, expected = _autograd(*CASES["sink-mqa-causal"])
    grads = emulate_backward(
        *(torch.from_numpy(t) for t in inputs), SCALE, True, learnable_sink=torch.from_numpy(sink)
    )
    for a, b in zip(grads, expected, strict=True):
        np.testing.assert_allclose(a, b, **TOL)


def test_deterministic_schedule_never_deadlocks():
    # The semaphore waits point one way (to later key blocks with a right limit, to earlier ones without),
    # so the emulated schedule always completes, in the fixed order, whatever the window and tiles.
    rng = random.Random(9)
    gen = np.random.default_rng(9)
    for _ in range(60):
        block_m, block_n = rng.choice(TILES + [(128, 128)])
        seqlen_q, seqlen_k = rng.randint(1, 300), rng.randint(1, 300)
        left, right = (rng.choice([-1, 0, rng.randint(1, 40), rng.randint(41, 300)]) for _ in "lr")
        q, k, v, out, dout = (gen.standard_normal((1, s, 1, 2)) for s in (seqlen_q, seqlen_k, seqlen_k, 1, 1))
        out, dout = (np.broadcast_to(x, (1, seqlen_q, 1, 2)) for x in (out, dout))
        lse = np.zeros((1, 1, seqlen_q))
        *_, order = emulate_backward(
            q, k, v, out, dout, lse, 1.0, False, (left, right), 0.0, None, block_m, block_n, True,
            return_order=True,
        )  # fmt: skip
        for m, added in order.items():
            assert added == dq_order(m, block_m, block_n, seqlen_q, seqlen_k, left, right)


def test_empty_sequences():
    q, k = np.ones((2, 5, 2, 8)), np.ones((2, 0, 1, 8))
    out, lse = np.zeros((2, 5, 2, 4)), np.full((2, 2, 5), 0.5)  # no key: out 0, lse = the sink
    dq, dk, dv, dsink = emulate_backward(
        q, k, k[..., :4], out, np.ones_like(out), lse, learnable_sink=[0.5, 0.5]
    )
    assert (dq == 0).all() and dk.shape == (2, 0, 1, 8) and dv.shape == (2, 0, 1, 4) and (dsink == 0).all()
    dq, dk, dv = emulate_backward(q[:, :0], k, k, out[:, :0], out[:, :0], lse[..., :0], causal=True)
    assert dq.shape == (2, 0, 2, 8) and dk.shape == (2, 0, 1, 8)
