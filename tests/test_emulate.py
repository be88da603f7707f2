"""The tile-level emulation of Algorithm 2 against the exact reference, both in fp64."""

import random
from functools import lru_cache

import numpy as np
import pytest
import torch

from hopper_fmha.emulate import block_range, causal_kv_tiles, emulate, emulate_varlen, needs_mask, tile_mask
from hopper_fmha.reference import reference, reference_varlen

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_torch_thread")]

# Both sides are fp64; the online softmax only reorders sums and rescales by exp(m_old - m_new),
# so they agree to round-off (observed ~1e-15).
TOL = dict(rtol=1e-10, atol=1e-12)


SEQLENS = [
    (1, 1),  # a single query and key: one partial tile on each side
    (3, 3),  # tiny square, causal is a 3x3 triangle inside one tile
    (113, 203),  # odd lengths: tail tiles in both Q and K, seqlen_q < seqlen_k shifts the causal diagonal
    (128, 217),  # Q exactly one or two full tiles, K ends in a tail tile
    (239, 1),  # a single key: with causal, every row but the last sees nothing (out 0, lse -inf)
    (1023, 1024),  # many tiles, off-by-one against the tile grid on both sides
    (4224, 4224),  # 33 x 128 / 66 x 64 tiles: the long main loop, diagonal tiles, tile skipping
]
# (heads, kv_heads): MHA, GQA, MQA.
HEADS = {"mha": (2, 2), "gqa": (4, 2), "mqa": (3, 1)}
HEAD_DIM = 16  # the head dim does not change the tile walk; small keeps 4224^2 fast


@lru_cache(maxsize=4)
def _problem(seqlen_q, seqlen_k, heads, kv_heads, causal):
    """Inputs and fp64 reference, shared by the four (block_m, block_n) cases."""
    batch = 2 if seqlen_q * seqlen_k < 2**20 else 1
    g = torch.Generator().manual_seed(seqlen_q * 7919 + seqlen_k)
    q = torch.randn(batch, seqlen_q, heads, HEAD_DIM, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seqlen_k, kv_heads, HEAD_DIM, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, kv_heads, HEAD_DIM, generator=g, dtype=torch.float64)
    out, lse = reference(q, k, v, causal=causal, dtype=torch.float64)
    return q.numpy(), k.numpy(), v.numpy(), out.numpy(), lse.numpy()


@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqlen_q,seqlen_k", SEQLENS)
def test_matches_reference(seqlen_q, seqlen_k, causal, heads, block_m, block_n):
    q, k, v, ref_out, ref_lse = _problem(seqlen_q, seqlen_k, *HEADS[heads], causal)
    out, lse = emulate(q, k, v, causal=causal, block_m=block_m, block_n=block_n)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)  # -inf must sit where the reference has it


def test_rows_without_keys():
    q, k, v, _, _ = _problem(239, 1, 2, 2, True)
    out, lse = emulate(q, k, v, causal=True)
    # Row i sees key 0 iff 0 <= i + 1 - 239: only the last row does.
    assert np.isneginf(lse[..., :238]).all() and np.isfinite(lse[..., 238]).all()
    assert (out[:, :238] == 0).all()
    np.testing.assert_allclose(out[:, 238], v[:, 0], **TOL)  # softmax over one key is 1


def test_accepts_torch_tensors():
    q, k, v, ref_out, ref_lse = _problem(113, 203, 4, 2, False)
    out, lse = emulate(*(torch.from_numpy(t).half() for t in (q, k, v)), block_m=64, block_n=64)
    expected = reference(*(torch.from_numpy(t).half() for t in (q, k, v)), dtype=torch.float64)
    np.testing.assert_allclose(out, expected[0].numpy(), **TOL)
    np.testing.assert_allclose(lse, expected[1].numpy(), **TOL)


@pytest.mark.parametrize(
    "m_start,block_m,block_n,seqlen_q,seqlen_k,tiles",
    [
        (0, 64, 64, 256, 256, 1),  # square: the first Q tile only needs the diagonal K tile
        (192, 64, 64, 256, 256, 4),  # the last Q tile needs all of them
        (0, 128, 64, 256, 256, 2),  # a taller Q tile reaches two K tiles
        (0, 64, 64, 512, 128, 0),  # seqlen_q > seqlen_k: the first rows see no key, no tile visited
        (448, 64, 64, 512, 128, 2),  # ... and the last rows see all keys
        (0, 64, 64, 2, 5, 1),  # capped by the number of K tiles
        (0, 64, 128, 1, 300, 3),  # one query row sees every key
    ],
)
def test_causal_tile_skipping(m_start, block_m, block_n, seqlen_q, seqlen_k, tiles):
    assert causal_kv_tiles(m_start, block_m, block_n, seqlen_q, seqlen_k) == tiles


# ---- forward features: window, softcap, learnable sink, dv != d, varlen ------------------------------

TILES = [(64, 64), (64, 128), (128, 64), (128, 128)]
FEATURES = {
    "window-17-5": dict(window_size=(17, 5)),
    "window-0-0": dict(window_size=(0, 0)),  # one key per row: most tiles skipped on both sides
    "left-70": dict(window_size=(70, -1)),
    "right-70": dict(window_size=(-1, 70)),
    "right-0": dict(window_size=(-1, 0)),  # causal written as a window
    "wide-130-130": dict(window_size=(130, 130)),  # both edges cross tile boundaries
    "causal-left-100": dict(causal=True, window_size=(100, -1)),
    "softcap": dict(softcap=1.5),
    "sink": dict(sink=True),
    "causal-softcap-sink": dict(causal=True, softcap=0.8, sink=True),
    "left-40-right-0-sink": dict(window_size=(40, 0), sink=True),
}
# (130, 256): offset 126 = 2 * 64 - 2, so with right = 0 the first row of a Q tile sees up to the key just
# before a K tile's last one: the edge of needs_mask's rule.
FEATURE_SEQLENS = [(1, 1), (3, 3), (113, 203), (203, 113), (300, 277), (130, 256), (239, 1)]


def _sink(heads):
    return 2 * torch.randn(heads, generator=torch.Generator().manual_seed(heads), dtype=torch.float64)


@lru_cache(maxsize=8)
def _feature_problem(seqlen_q, seqlen_k, feature, head_dim=16, head_dim_v=16):
    """Inputs, sink and fp64 reference for one feature set, shared by the four tile shapes."""
    heads, kv_heads = (4, 2) if (seqlen_q + seqlen_k) % 2 else (3, 1)  # GQA or MQA
    g = torch.Generator().manual_seed(seqlen_q * 7919 + seqlen_k)
    q = torch.randn(2, seqlen_q, heads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(2, seqlen_k, kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(2, seqlen_k, kv_heads, head_dim_v, generator=g, dtype=torch.float64)
    kwargs = dict(FEATURES[feature])
    if kwargs.pop("sink", False):
        kwargs["learnable_sink"] = _sink(heads)
    causal = kwargs.pop("causal", False)
    out, lse = reference(q, k, v, 0.5, causal, torch.float64, **kwargs)
    return q.numpy(), k.numpy(), v.numpy(), causal, kwargs, out.numpy(), lse.numpy()


@pytest.mark.parametrize("block_m,block_n", TILES)
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("seqlen_q,seqlen_k", FEATURE_SEQLENS)
def test_features_match_reference(seqlen_q, seqlen_k, feature, block_m, block_n):
    q, k, v, causal, kwargs, ref_out, ref_lse = _feature_problem(seqlen_q, seqlen_k, feature)
    out, lse = emulate(q, k, v, 0.5, causal, block_m, block_n, **kwargs)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)


@pytest.mark.parametrize("block_m,block_n", TILES)
@pytest.mark.parametrize("feature", ["sink", "causal-softcap-sink", "wide-130-130"])
def test_head_dim_v_differs(feature, block_m, block_n):
    q, k, v, causal, kwargs, ref_out, ref_lse = _feature_problem(113, 203, feature, 192, 128)
    out, lse = emulate(q, k, v, 0.5, causal, block_m, block_n, **kwargs)
    assert out.shape == (2, 113, q.shape[2], 128)
    np.testing.assert_allclose(out, ref_out, **TOL)
    np.testing.assert_allclose(lse, ref_lse, **TOL)


def _random_windows(n, seed):
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        seqlen_q, seqlen_k = rng.choice([(37, 300), (300, 37), (257, 300), (300, 257), (129, 129)])
        longest = max(seqlen_q, seqlen_k)
        window = tuple(rng.choice([-1, 0, rng.randint(1, 70), rng.randint(64, longest + 10)]) for _ in "lr")
        cases.append(
            (seqlen_q, seqlen_k, window, rng.random() < 0.3, rng.choice([0.0, 1.2]), rng.random() < 0.5)
        )
    return cases


@pytest.mark.parametrize("block_m,block_n", TILES)
@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,window,causal,softcap,with_sink",
    _random_windows(12, seed=5),
    ids=lambda x: str(x).replace(" ", ""),
)
def test_random_windows_match_reference(
    seqlen_q, seqlen_k, window, causal, softcap, with_sink, block_m, block_n
):
    g = torch.Generator().manual_seed(seqlen_q + 1000 * seqlen_k + 17 * window[0] + window[1])
    q = torch.randn(1, seqlen_q, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, seqlen_k, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    kwargs = dict(window_size=window, softcap=softcap, learnable_sink=_sink(4) if with_sink else None)
    ref_out, ref_lse = reference(q, k, v, 0.5, causal, torch.float64, **kwargs)
    out, lse = emulate(q, k, v, 0.5, causal, block_m, block_n, **kwargs)
    np.testing.assert_allclose(out, ref_out.numpy(), **TOL)
    np.testing.assert_allclose(lse, ref_lse.numpy(), **TOL)


def test_rows_without_keys_with_sink():
    q, k, v, _, _ = _problem(239, 1, 2, 2, True)
    sink = np.array([0.25, -1.5])
    out, lse = emulate(q, k, v, causal=True, learnable_sink=sink)
    # Rows 0-237 see no key: out 0 and lse = the head's sink (FA4's finalize). Row 238 sees key 0 with
    # score s: lse = log(e^s + e^sink) and out = v_0 e^s / (e^s + e^sink) = v_0 (1 - e^(sink - lse)).
    assert (out[:, :238] == 0).all()
    np.testing.assert_array_equal(lse[:, :, :238], np.broadcast_to(sink[None, :, None], (2, 2, 238)))
    s = 16**-0.5 * np.einsum("bhd,bhd->bh", q[:, 238], k[:, 0])
    np.testing.assert_allclose(lse[:, :, 238], np.logaddexp(s, sink), **TOL)
    np.testing.assert_allclose(out[:, 238], v[:, 0] * (1 - np.exp(sink - lse[:, :, 238]))[..., None], **TOL)


def test_minus_inf_sink_is_no_sink():
    q, k, v, _, _ = _problem(239, 1, 2, 2, True)
    out, lse = emulate(q, k, v, causal=True, learnable_sink=np.array([-np.inf, -np.inf]))
    plain_out, plain_lse = emulate(q, k, v, causal=True)
    np.testing.assert_array_equal(out, plain_out)
    np.testing.assert_array_equal(lse, plain_lse)


VARLEN = {  # seqlens_q, seqlens_k, seqused_k
    "mixed": ([5, 0, 113, 1, 200, 37], [7, 3, 90, 0, 257, 37], None),
    "seqused": ([5, 0, 113, 1, 200, 37], [7, 3, 90, 4, 257, 37], [7, 0, 41, 4, 130, 36]),
}


@pytest.mark.parametrize("block_m,block_n", TILES)
@pytest.mark.parametrize("feature", ["right-0", "window-17-5", "causal-softcap-sink"])
@pytest.mark.parametrize("lengths", list(VARLEN))
def test_varlen_matches_reference(lengths, feature, block_m, block_n):
    seqlens_q, seqlens_k, seqused = VARLEN[lengths]
    g = torch.Generator().manual_seed(11)
    cu = lambda n: torch.tensor([0, *np.cumsum(n)], dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(seqlens_q), 4, 16, generator=g, dtype=torch.float64)
    k = torch.randn(sum(seqlens_k), 1, 16, generator=g, dtype=torch.float64)
    v = torch.randn(sum(seqlens_k), 1, 8, generator=g, dtype=torch.float64)
    kwargs = dict(FEATURES[feature])
    kwargs["learnable_sink"] = _sink(4) if kwargs.pop("sink", False) else None
    used = None if seqused is None else torch.tensor(seqused, dtype=torch.int32)
    ref_out, ref_lse = reference_varlen(
        q,
        k,
        v,
        cu(seqlens_q),
        cu(seqlens_k),
        softmax_scale=0.5,
        seqused_k=used,
        dtype=torch.float64,
        **kwargs,
    )
    tiles = dict(block_m=block_m, block_n=block_n)
    out, lse = emulate_varlen(
        q, k, v, cu(seqlens_q), cu(seqlens_k), seqused_k=used, softmax_scale=0.5, **tiles, **kwargs
    )
    assert out.shape == (sum(seqlens_q), 4, 8) and lse.shape == (4, sum(seqlens_q))
    np.testing.assert_allclose(out, ref_out.numpy(), **TOL)
    np.testing.assert_allclose(lse, ref_lse.numpy(), **TOL)


# ---- the per-tile mask rules --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "m_start,block_m,block_n,seqlen_q,seqlen_k,left,right,expected",
    [
        (0, 64, 64, 256, 256, -1, -1, (0, 4)),  # no mask: every tile
        (128, 64, 64, 256, 256, 64, 0, (1, 3)),  # rows 128-191 see keys 64..191
        (128, 64, 64, 256, 256, 63, 0, (1, 3)),  # first row sees from 65: tile 1 still
        (128, 64, 64, 256, 256, 65, 0, (0, 3)),  # first row sees from 63: tile 0 too
        (0, 64, 64, 64, 128, 0, 0, (1, 2)),  # offset 64, the diagonal keys 64..127 only
        (0, 64, 64, 512, 128, -1, 0, (0, 0)),  # causal, rows 0-63 see no key: nothing visited
        (0, 64, 64, 512, 128, 0, -1, (0, 2)),  # left only, offset -384: all tiles
        (448, 64, 64, 512, 128, 10, 0, (0, 2)),  # rows 448-511 see keys 54..127
        (0, 128, 128, 100, 1000, -1, -1, (0, 8)),  # capped by the number of K tiles
        (0, 128, 64, 1, 300, 5, 5, (4, 5)),  # one row, keys 294..299
        (0, 64, 64, 64, 64, -1, 70, (0, 1)),  # a right window past the end: capped
    ],
)
def test_block_range(m_start, block_m, block_n, seqlen_q, seqlen_k, left, right, expected):
    assert block_range(m_start, block_m, block_n, seqlen_q, seqlen_k, left, right) == expected


def _hidden(rows, cols, seqlen_q, seqlen_k, left, right):
    """The rule written out again: padding, or outside [i + Sk - Sq - left, i + Sk - Sq + right]."""
    i, j = rows[:, None], cols[None, :]
    hidden = (j >= seqlen_k) | np.zeros_like(i, dtype=bool)
    if right != -1:
        hidden |= j > i + seqlen_k - seqlen_q + right
    if left != -1:
        hidden |= j < i + seqlen_k - seqlen_q - left
    return hidden


def test_block_rules_against_brute_force():
    # Random tiles and windows: the visited range holds every K tile some real row of the Q tile sees,
    # tile_mask is the rule, and needs_mask is exactly "some key of the tile is hidden from some row".
    rng = random.Random(3)
    for _ in range(2000):
        block_m, block_n = rng.choice(TILES)
        seqlen_q, seqlen_k = rng.randint(1, 400), rng.randint(1, 400)
        left, right = (rng.choice([-1, 0, rng.randint(1, 40), rng.randint(41, 500)]) for _ in "lr")
        m_start = block_m * rng.randrange(-(-seqlen_q // block_m))
        n_min, n_max = block_range(m_start, block_m, block_n, seqlen_q, seqlen_k, left, right)
        tile_rows = m_start + np.arange(block_m)
        real_rows = tile_rows[tile_rows < seqlen_q]
        for n in range(-(-seqlen_k // block_n)):
            cols = n * block_n + np.arange(block_n)
            seen = ~_hidden(real_rows, cols, seqlen_q, seqlen_k, left, right)
            if seen.any():
                assert n_min <= n < n_max, (m_start, n, block_m, block_n, seqlen_q, seqlen_k, left, right)
            if n_min <= n < n_max:
                hidden = _hidden(tile_rows, cols, seqlen_q, seqlen_k, left, right)
                mask = tile_mask(m_start, n * block_n, block_m, block_n, seqlen_q, seqlen_k, left, right)
                np.testing.assert_array_equal(mask, hidden)
                assert needs_mask(
                    m_start, n * block_n, block_m, block_n, seqlen_q, seqlen_k, left, right
                ) == (hidden.any())
