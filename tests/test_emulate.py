"""The tile-level emulation of Algorithm 2 against the exact reference, both in fp64."""

from functools import lru_cache

import numpy as np
import pytest
import torch

from hopper_fmha.emulate import causal_kv_tiles, emulate
from hopper_fmha.reference import reference

pytestmark = pytest.mark.cpu

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
