"""Decoding math in the emulator: split-KV partials and their LSE combine, and PackGQA's row mapping,
against the unsplit emulator and the exact reference (all fp64)."""

import numpy as np
import pytest
import torch

from hopper_fmha.emulate import (
    _ceil_div,
    combine_splits,
    emulate,
    emulate_pack_gqa,
    emulate_split_kv,
    pack_gqa_rows,
    split_block_range,
)
from hopper_fmha.reference import reference
from hopper_fmha.reference_kvcache import reference_with_kvcache

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_torch_thread")]

TOL = dict(rtol=1e-10, atol=1e-12)
F64 = torch.float64


def qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, d=8, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, d, generator=g, dtype=F64)
    k = torch.randn(batch, seqlen_k, kv_heads, d, generator=g, dtype=F64)
    v = torch.randn(batch, seqlen_k, kv_heads, dv or d, generator=g, dtype=F64)
    return q, k, v


def assert_same(actual, expected):
    out, lse = actual
    np.testing.assert_allclose(out, np.asarray(expected[0]), **TOL)
    np.testing.assert_allclose(lse, np.asarray(expected[1]), **TOL)  # -inf where expected has it


# ---- split boundaries ----


def test_split_block_range_by_hand():
    # 5 tiles in 2 splits: 3 + 2; in 4 splits: 2 + 2 + 1 + (empty); a range not starting at 0.
    assert [split_block_range(0, 5, s, 2) for s in range(2)] == [(0, 3), (3, 5)]
    assert [split_block_range(0, 5, s, 4) for s in range(4)] == [(0, 2), (2, 4), (4, 5), (6, 6)]
    assert [split_block_range(2, 5, s, 2) for s in range(2)] == [(2, 4), (4, 5)]
    assert [split_block_range(3, 3, s, 3) for s in range(3)] == [(3, 3)] * 3  # no tiles: all empty
    for nblocks in range(1, 12):
        for num_splits in range(1, nblocks + 3):
            ranges = [split_block_range(0, nblocks, s, num_splits) for s in range(num_splits)]
            covered = [j for a, b in ranges for j in range(a, b)]
            assert covered == list(range(nblocks))  # contiguous, in order, each tile once
            per = _ceil_div(nblocks, num_splits)
            assert [a for a, b in ranges if b > a] == [
                s * per for s in range(num_splits) if s * per < nblocks
            ]
    with pytest.raises(ValueError):
        split_block_range(0, 5, 2, 2)


# ---- split-KV equals the unsplit walk ----

SPLIT_CASES = {
    # (seqlen_q, seqlen_k, heads, kv_heads, kwargs)
    "decode": (1, 75, 4, 2, dict()),
    "decode-causal-mqa": (1, 80, 6, 1, dict(causal=True)),
    "spec-decode-causal": (4, 70, 4, 2, dict(causal=True)),
    "window": (3, 77, 2, 2, dict(window_size=(20, 0))),
    "softcap-sink": (2, 64, 4, 1, dict(causal=True, softcap=3.0, sink=True)),
    "rows-without-keys": (9, 3, 2, 1, dict(causal=True, sink=True)),
}
BLOCK_N = 16


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["rows", "packgqa"])
@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_every_split_count(case, pack_gqa):
    """num_splits from 1 to the number of key tiles, and past it (empty splits), all equal the unsplit
    emulator and the reference."""
    seqlen_q, seqlen_k, heads, kv_heads, kw = SPLIT_CASES[case]
    kw = dict(kw)
    q, k, v = qkv(2, seqlen_q, seqlen_k, heads, kv_heads, dv=5, seed=seqlen_k)
    if kw.pop("sink", False):
        kw["learnable_sink"] = 2 * torch.randn(heads, generator=torch.Generator().manual_seed(1), dtype=F64)
    expected = reference(q, k, v, dtype=F64, **kw)
    unsplit = emulate(q, k, v, block_m=16, block_n=BLOCK_N, **kw)
    assert_same(unsplit, expected)
    nblocks = _ceil_div(seqlen_k, BLOCK_N)
    for num_splits in range(1, nblocks + 3):
        out_p, lse_p = emulate_split_kv(
            q, k, v, num_splits, block_m=16, block_n=BLOCK_N, pack_gqa=pack_gqa, **kw
        )
        assert out_p.shape == (num_splits, *unsplit[0].shape) and lse_p.shape == (
            num_splits,
            *unsplit[1].shape,
        )
        assert np.isfinite(out_p).all() and not np.isnan(lse_p).any()
        assert_same(combine_splits(out_p, lse_p), unsplit)


def test_partials_are_softmaxes_over_their_tiles():
    """Without a mask, split s is exactly attention over keys [s * per * block_n, ...) (per =
    ceil(nblocks / num_splits)); splits past the last tile are out 0, lse -inf."""
    q, k, v = qkv(1, 2, 70, 4, 2, seed=5)  # 5 tiles of 16
    num_splits = 4  # per = 2: tiles [0, 2), [2, 4), [4, 5), empty
    out_p, lse_p = emulate_split_kv(q, k, v, num_splits, block_m=16, block_n=16)
    for s, (a, b) in enumerate([(0, 32), (32, 64), (64, 70)]):
        assert_same((out_p[s], lse_p[s]), reference(q, k[:, a:b], v[:, a:b], dtype=F64))
    assert (out_p[3] == 0).all() and np.isneginf(lse_p[3]).all()


def test_sink_counted_once():
    """The sink joins split 0 only: the combined LSE includes it once (reference's convention)."""
    q, k, v = qkv(1, 1, 64, 2, 1, seed=6)
    sink = torch.tensor([0.5, 3.0], dtype=F64)
    out_p, lse_p = emulate_split_kv(q, k, v, 4, block_n=16, learnable_sink=sink)
    no_sink = emulate_split_kv(q, k, v, 4, block_n=16)
    np.testing.assert_allclose(lse_p[1:], no_sink[1][1:], **TOL)
    assert (lse_p[0] > no_sink[1][0]).all()
    assert_same(combine_splits(out_p, lse_p), reference(q, k, v, dtype=F64, learnable_sink=sink))


# ---- combine ----


def test_combine_by_hand_with_neg_inf():
    rng = np.random.default_rng(7)
    out_p = rng.standard_normal((3, 1, 4, 2, 5))  # (splits, B, Sq, H, Dv)
    lse_p = rng.standard_normal((3, 1, 2, 4))  # (splits, B, H, Sq)
    lse_p[1, 0, 0, 0] = -np.inf  # one split empty for one row
    lse_p[:, 0, 1, 2] = -np.inf  # every split empty for another row
    lse_p[0, 0, 1, 3] = 700.0  # large LSEs: no overflow
    lse_p[2, 0, 1, 3] = 699.0
    out, lse = combine_splits(out_p, lse_p)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.isneginf(lse[0, 1, 2]) and (out[0, 2, 1] == 0).all()
    expected_lse = torch.logsumexp(torch.from_numpy(lse_p), dim=0).numpy()
    np.testing.assert_allclose(lse, expected_lse, **TOL)
    weights = np.exp(lse_p - np.where(np.isneginf(expected_lse), 0.0, expected_lse))  # (S, B, H, Sq)
    expected_out = (weights.transpose(0, 1, 3, 2)[..., None] * out_p).sum(0)
    np.testing.assert_allclose(out, expected_out, **TOL)
    # The empty split's (garbage) output does not leak in: changing it changes nothing.
    out_p2 = out_p.copy()
    out_p2[1, 0, 0, 0] = 1e6
    np.testing.assert_array_equal(combine_splits(out_p2, lse_p)[0], out)


def test_combine_all_empty_and_single_split():
    out_p = np.zeros((3, 2, 1, 2, 4))
    lse_p = np.full((3, 2, 2, 1), -np.inf)
    out, lse = combine_splits(out_p, lse_p)
    assert (out == 0).all() and np.isneginf(lse).all()
    rng = np.random.default_rng(8)
    one_out, one_lse = rng.standard_normal((1, 2, 3, 2, 4)), rng.standard_normal((1, 2, 2, 3))
    out, lse = combine_splits(one_out, one_lse)
    np.testing.assert_allclose(out, one_out[0], **TOL)
    np.testing.assert_allclose(lse, one_lse[0], **TOL)


# ---- PackGQA ----


def test_pack_gqa_rows_by_hand():
    heads, queries = pack_gqa_rows(2, 3)
    assert heads.tolist() == [0, 1, 2, 0, 1, 2] and queries.tolist() == [0, 0, 0, 1, 1, 1]
    heads, queries = pack_gqa_rows(3, 1)  # MHA: packing is the identity
    assert heads.tolist() == [0, 0, 0] and queries.tolist() == [0, 1, 2]


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("seqlen_q", [1, 3, 16])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(5, 1), softcap=2.0)], ids=str)
def test_pack_gqa_matches(group, seqlen_q, kw):
    """Packed rows (query * group + head) in tiles of 16: tiles hold several queries (causal diagonal
    inside a tile) and a decode step's group in one tile; same result as the unpacked walk."""
    kv_heads = 1 if group == 16 else 2  # group 16 as MQA
    q, k, v = qkv(1, seqlen_q, 40, group * kv_heads, kv_heads, seed=group * 17 + seqlen_q)
    expected = reference(q, k, v, dtype=F64, **kw)
    assert_same(emulate_pack_gqa(q, k, v, block_m=16, block_n=16, **kw), expected)
    assert_same(emulate_pack_gqa(q, k, v, block_m=16, block_n=16, num_splits=2, **kw), expected)


def test_pack_gqa_row_mapping_drives_the_result():
    """Each packed row's output is its (q head, query) row of the unpacked result: permuting q's heads
    within a group permutes the packed rows accordingly."""
    seqlen_q, group = 3, 4
    q, k, v = qkv(1, seqlen_q, 20, group, 1, seed=9)
    out, lse = emulate_pack_gqa(q, k, v, block_m=8, block_n=8, causal=True)
    heads, queries = pack_gqa_rows(seqlen_q, group)
    for r in range(seqlen_q * group):
        h, i = heads[r], queries[r]
        # The row alone: query i of head h against the same keys, with query i's causal limit.
        visible = 20 - seqlen_q + i + 1
        o, l = reference(q[:, i : i + 1, h : h + 1], k[:, :visible], v[:, :visible], dtype=F64)
        np.testing.assert_allclose(out[0, i, h], o[0, 0, 0].numpy(), **TOL)
        np.testing.assert_allclose(lse[0, h, i], l[0, 0, 0].numpy(), **TOL)


# ---- end to end: a decode step against a paged cache, split ----


def test_decode_step_paged_split():
    """reference_with_kvcache on a paged cache with an append, and split-KV + PackGQA over the keys it
    attended (gathered from the updated pages), agree."""
    batch, heads, kv_heads, d, page_size = 2, 8, 2, 8, 16
    g = torch.Generator().manual_seed(10)
    k_pages = torch.randn(9, page_size, kv_heads, d, generator=g, dtype=F64)
    v_pages = torch.randn(9, page_size, kv_heads, d, generator=g, dtype=F64)
    table = torch.randperm(9, generator=g)[:8].reshape(batch, 4).to(torch.int32)
    q = torch.randn(batch, 1, heads, d, generator=g, dtype=F64)
    k = torch.randn(batch, 1, kv_heads, d, generator=g, dtype=F64)
    v = torch.randn(batch, 1, kv_heads, d, generator=g, dtype=F64)
    seqlens = [47, 15]  # appends at 47 (last row of page 2) and 15 (last row of page 0)
    out, lse = reference_with_kvcache(
        q,
        k_pages,
        v_pages,
        k,
        v,
        torch.tensor(seqlens, dtype=torch.int32),
        page_table=table,
        causal=True,
        dtype=F64,
    )
    for b, s in enumerate(seqlens):
        keys = k_pages[table[b].long()].reshape(-1, kv_heads, d)[: s + 1][None]
        values = v_pages[table[b].long()].reshape(-1, kv_heads, d)[: s + 1][None]
        for num_splits in (1, 2, 3, 5):
            parts = emulate_split_kv(
                q[b : b + 1], keys, values, num_splits, causal=True, block_n=16, pack_gqa=True
            )
            assert_same(combine_splits(*parts), (out[b : b + 1].numpy(), lse[b : b + 1].numpy()))
