"""reference_with_kvcache (flash_attn_with_kvcache's semantics) against attention over keys gathered
here by hand, the in-place append checked element by element, and every rejection rule (with the cache
unchanged after a rejected call)."""

import pytest
import torch

from hopper_fmha.reference import reference
from hopper_fmha.reference_kvcache import reference_with_kvcache

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_torch_thread")]

FP64 = dict(rtol=1e-12, atol=1e-12)
F64 = torch.float64


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def problem(batch, seqlen_q, heads, kv_heads, capacity, seqlen_new, d=8, dv=None, seed=0):
    """q, the logical cache contents (batch, capacity, Hkv, d/dv) and the new tokens."""
    dv = dv or d
    q = randn(batch, seqlen_q, heads, d, seed=seed)
    kc = randn(batch, capacity, kv_heads, d, seed=seed + 1)
    vc = randn(batch, capacity, kv_heads, dv, seed=seed + 2)
    k = randn(batch, seqlen_new, kv_heads, d, seed=seed + 3)
    v = randn(batch, seqlen_new, kv_heads, dv, seed=seed + 4)
    return q, kc, vc, k, v


def paginate(kc, vc, page_size, spare_pages=3, seed=0):
    """The logical cache (batch, capacity, ...) in pages of a random permutation, with spare pages that
    no sequence names. Returns k_pages, v_pages, page_table (int32)."""
    batch, capacity = kc.shape[:2]
    assert capacity % page_size == 0
    pages_per_seq = capacity // page_size
    num_pages = batch * pages_per_seq + spare_pages
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed + 100))
    table = perm[: batch * pages_per_seq].reshape(batch, pages_per_seq)
    k_pages = randn(num_pages, page_size, *kc.shape[2:], seed=seed + 200)  # spare pages: random junk
    v_pages = randn(num_pages, page_size, *vc.shape[2:], seed=seed + 300)
    for b in range(batch):
        k_pages[table[b]] = kc[b].reshape(pages_per_seq, page_size, *kc.shape[2:])
        v_pages[table[b]] = vc[b].reshape(pages_per_seq, page_size, *vc.shape[2:])
    return k_pages, v_pages, table.to(torch.int32)


def unpaginate(pages, table):
    """(batch, pages_per_seq * page_size, ...) logical view of a paged cache."""
    batch, pages_per_seq = table.shape
    return pages[table.long()].reshape(batch, pages_per_seq * pages.shape[1], *pages.shape[2:])


def direct(q, kc, vc, k, v, seqlens, **kw):
    """Sequence b attends to cache[b, :seqlens[b]] followed by its new tokens, one reference() call each."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        keys = torch.cat([kc[b, : seqlens[b]], k[b]])[None]
        values = torch.cat([vc[b, : seqlens[b]], v[b]])[None]
        o, l = reference(q[b : b + 1], keys, values, dtype=F64, **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def expected_cache(kc, k, seqlens):
    """The logical cache after the append: k[b] at seqlens[b] .., everything else as before."""
    out = kc.clone()
    for b, s in enumerate(seqlens):
        out[b, s : s + k.shape[1]] = k[b]
    return out


def assert_close(actual, expected):
    torch.testing.assert_close(actual[0], expected[0], **FP64)
    torch.testing.assert_close(actual[1], expected[1], **FP64)  # -inf must sit where expected has it


# ---- dense cache ----


@pytest.mark.parametrize("seqlen_new", [0, 1, 3])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_ragged_seqlens(causal, seqlen_new):
    capacity = 20
    # 0 (only the new tokens), a middle length, and full capacity (after the append).
    seqlens = [0, 7, capacity - seqlen_new, 13]
    q, kc, vc, k, v = problem(4, 2, 4, 2, capacity, seqlen_new, dv=6, seed=1)
    k_cache, v_cache = kc.clone(), vc.clone()
    got = reference_with_kvcache(
        q,
        k_cache,
        v_cache,
        k if seqlen_new else None,
        v if seqlen_new else None,
        torch.tensor(seqlens, dtype=torch.int32),
        causal=causal,
        dtype=F64,
    )
    assert_close(got, direct(q, kc, vc, k, v, seqlens, causal=causal))
    assert torch.equal(k_cache, expected_cache(kc, k, seqlens))  # written positions, the rest untouched
    assert torch.equal(v_cache, expected_cache(vc, v, seqlens))


def test_int_and_none_cache_seqlens():
    q, kc, vc, k, v = problem(2, 3, 4, 4, 10, 2, seed=2)
    got = reference_with_kvcache(q, kc.clone(), vc.clone(), k, v, 5, dtype=F64)
    assert_close(got, direct(q, kc, vc, k, v, [5, 5]))
    # None: every sequence is the whole cache (no new tokens).
    got = reference_with_kvcache(q, kc, vc, dtype=F64)
    assert_close(got, direct(q, kc, vc, k[:, :0], v[:, :0], [10, 10]))
    assert_close(got, reference(q, kc, vc, dtype=F64))


def test_causal_aligns_to_the_end_of_cache_plus_new():
    """seqlen_q = 2 against 3 cached + 2 new keys: row 0 sees keys 0..3, row 1 keys 0..4 (not 0..0 and
    0..1 as a top-left mask, nor 0..2 / 0..3 as an alignment to the cache alone would give)."""
    q, kc, vc, k, v = problem(1, 2, 2, 2, 8, 2, seed=3)
    base = reference_with_kvcache(q, kc.clone(), vc.clone(), k, v, 3, causal=True, dtype=F64)
    v2 = v.clone()
    v2[0, 1] += 100.0  # the last key's value (key 4)
    moved = reference_with_kvcache(q, kc.clone(), vc.clone(), k, v2, 3, causal=True, dtype=F64)
    torch.testing.assert_close(moved[0][0, 0], base[0][0, 0], **FP64)  # row 0 does not see key 4
    assert (moved[0][0, 1] - base[0][0, 1]).abs().min() > 1e-6  # row 1 does
    v3 = v.clone()
    v3[0, 0] += 100.0  # key 3, the first new token: both rows see it
    moved = reference_with_kvcache(q, kc.clone(), vc.clone(), k, v3, 3, causal=True, dtype=F64)
    assert (moved[0][0] - base[0][0]).abs().amin(dim=-1).min() > 1e-6


@pytest.mark.parametrize("seqlen_q", [1, 2, 5, 16])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2), (6, 2), (8, 2), (16, 1), (8, 1), (32, 2)])
def test_gqa_groups_causal_decode(heads, kv_heads, seqlen_q):
    """Group sizes 1..16 and MQA, seqlen_q 1..16 with causal (new tokens = seqlen_q, as in decoding)."""
    seqlens = [0, 9, 32 - seqlen_q]
    q, kc, vc, k, v = problem(3, seqlen_q, heads, kv_heads, 32, seqlen_q, seed=heads * 31 + seqlen_q)
    got = reference_with_kvcache(
        q, kc.clone(), vc.clone(), k, v, torch.tensor(seqlens, dtype=torch.int32), causal=True, dtype=F64
    )
    assert_close(got, direct(q, kc, vc, k, v, seqlens, causal=True))
    # GQA written out: q head h uses kv head h // group.
    group = heads // kv_heads
    h = heads - 1
    kv = slice(h // group, h // group + 1)
    o, _ = direct(
        q[:, :, h : h + 1], kc[:, :, kv], vc[:, :, kv], k[:, :, kv], v[:, :, kv], seqlens, causal=True
    )
    torch.testing.assert_close(got[0][:, :, h : h + 1], o, **FP64)


@pytest.mark.parametrize(
    "kw",
    [
        dict(window_size=(4, 0)),
        dict(window_size=(3, 1), causal=False),
        dict(causal=True, window_size=(5, -1)),
        dict(softcap=2.0),
        dict(learnable_sink=True),
        dict(causal=True, window_size=(2, -1), softcap=1.5, learnable_sink=True, softmax_scale=0.7),
    ],
    ids=["window", "window-right", "causal-window", "softcap", "sink", "all"],
)
def test_window_softcap_sink_pass_through(kw):
    kw = dict(kw)
    if kw.get("learnable_sink"):
        kw["learnable_sink"] = 2 * randn(4, seed=9)
    seqlens = [0, 5, 11]
    q, kc, vc, k, v = problem(3, 4, 4, 2, 16, 3, seed=10)
    got = reference_with_kvcache(
        q, kc.clone(), vc.clone(), k, v, torch.tensor(seqlens, dtype=torch.int32), dtype=F64, **kw
    )
    assert_close(got, direct(q, kc, vc, k, v, seqlens, **kw))
    if "learnable_sink" in kw:  # the sink is in the LSE (rows are never empty here): differs without it
        kw.pop("learnable_sink")
        plain = direct(q, kc, vc, k, v, seqlens, **kw)
        assert (got[1] - plain[1]).abs().min() > 1e-9


def test_rows_without_keys():
    """Cache 0 and no new tokens: no keys. out 0, lse -inf (or the sink)."""
    q, kc, vc, _, _ = problem(2, 3, 2, 1, 4, 0, seed=11)
    out, lse = reference_with_kvcache(q, kc, vc, cache_seqlens=0, dtype=F64)
    assert (out == 0).all() and torch.isneginf(lse).all()
    sink = randn(2, seed=12)
    out, lse = reference_with_kvcache(q, kc, vc, cache_seqlens=0, learnable_sink=sink, dtype=F64)
    assert (out == 0).all() and torch.equal(lse, sink[None, :, None].expand(2, 2, 3))


# ---- paged cache ----


@pytest.mark.parametrize("page_size", [1, 3, 16, 64, 256])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_paged_random_page_table(page_size, causal):
    """A random permutation of pages; ragged seqlens with 0 and full capacity; appends that cross page
    boundaries. Output as the direct computation, cache written element-wise, every other slot untouched."""
    pages_per_seq = max(2, 48 // page_size)
    capacity = pages_per_seq * page_size
    seqlen_new = min(5, page_size + 2)  # crosses into the next page for small pages
    # 0; the append starting 1 before a page boundary (crosses it); full capacity after the append.
    seqlens = [0, page_size - 1, capacity - seqlen_new]
    q, kc, vc, k, v = problem(3, 2, 4, 2, capacity, seqlen_new, dv=4, seed=page_size)
    k_pages, v_pages, table = paginate(kc, vc, page_size, seed=page_size)
    k_before, v_before = k_pages.clone(), v_pages.clone()
    got = reference_with_kvcache(
        q,
        k_pages,
        v_pages,
        k,
        v,
        torch.tensor(seqlens, dtype=torch.int32),
        page_table=table,
        causal=causal,
        dtype=F64,
    )
    assert_close(got, direct(q, kc, vc, k, v, seqlens, causal=causal))
    # The logical view: new tokens where they belong, the rest as before (including past the new end).
    assert torch.equal(unpaginate(k_pages, table), expected_cache(kc, k, seqlens))
    assert torch.equal(unpaginate(v_pages, table), expected_cache(vc, v, seqlens))
    # Slot by slot: exactly the slots of the new tokens changed; spare pages untouched.
    changed = (k_pages != k_before).any(dim=-1).any(dim=-1)  # (num_pages, page_size)
    expected = torch.zeros_like(changed)
    for b, s in enumerate(seqlens):
        t = torch.arange(s, s + seqlen_new)
        expected[table[b].long()[t // page_size], t % page_size] = True
    assert torch.equal(changed, expected)
    assert torch.equal((v_pages != v_before).any(dim=-1).any(dim=-1), expected)
    # And the dense cache with the same logical contents gives the same result.
    dense = reference_with_kvcache(
        q,
        kc.clone(),
        vc.clone(),
        k,
        v,
        torch.tensor(seqlens, dtype=torch.int32),
        causal=causal,
        dtype=F64,
    )
    assert_close(got, dense)


def test_paged_any_page_order_and_shared_read_only_pages():
    """Pages in any order (descending, interleaved) and a prefix page shared by two sequences (read only)."""
    page_size, d = 4, 8
    k_pages, v_pages = randn(10, page_size, 1, d, seed=20), randn(10, page_size, 1, d, seed=21)
    table = torch.tensor([[9, 7, 5], [9, 2, 0]], dtype=torch.int32)  # page 9 shared as a prefix
    q = randn(2, 1, 4, d, seed=22)
    k, v = randn(2, 2, 1, d, seed=23), randn(2, 2, 1, d, seed=24)
    seqlens = torch.tensor([7, 4], dtype=torch.int32)  # seq 0 appends at 7, 8 (crosses into page 5)
    kc, vc = unpaginate(k_pages, table), unpaginate(v_pages, table)
    got = reference_with_kvcache(q, k_pages, v_pages, k, v, seqlens, page_table=table, dtype=F64)
    assert_close(got, direct(q, kc, vc, k, v, [7, 4]))
    assert torch.equal(k_pages[7, 3], k[0, 0]) and torch.equal(k_pages[5, 0], k[0, 1])
    assert torch.equal(k_pages[2, 0], k[1, 0]) and torch.equal(k_pages[2, 1], k[1, 1])


# ---- rejections: ValueError naming the rule, the cache unchanged ----


def _dense_args():
    q, kc, vc, k, v = problem(2, 1, 4, 2, 8, 2, seed=30)
    return dict(q=q, k_cache=kc, v_cache=vc, k=k, v=v, cache_seqlens=torch.tensor([3, 6], dtype=torch.int32))


def _paged_args():
    q, kc, vc, k, v = problem(2, 1, 4, 2, 8, 2, seed=31)
    k_pages, v_pages, table = paginate(kc, vc, 4, spare_pages=2, seed=31)
    return dict(
        q=q,
        k_cache=k_pages,
        v_cache=v_pages,
        k=k,
        v=v,
        cache_seqlens=torch.tensor([3, 6], dtype=torch.int32),
        page_table=table,
    )


def _set(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def _with(base, **changes):
    def make():
        args = base()
        for name, change in changes.items():
            args[name] = change(args) if callable(change) else change
        return args

    return make


REJECTIONS = {
    "q-dtype": (_with(_dense_args, q=lambda a: a["q"].float()), "dtype"),
    "k-dtype": (_with(_dense_args, k=lambda a: a["k"].float()), "k must have q's dtype"),
    "cache-device": (_with(_dense_args, q=lambda a: a["q"].to("meta")), "device"),
    "head-dim": (_with(_dense_args, q=lambda a: a["q"][..., :4]), "head dim"),
    "v-cache-shape": (_with(_dense_args, v_cache=lambda a: a["v_cache"][:, :7]), "k_cache and v_cache"),
    "heads-multiple": (_with(_dense_args, q=lambda a: a["q"][:, :, :3]), "multiple"),
    "dense-batch": (_with(_dense_args, q=lambda a: a["q"][:1]), "batch"),
    "over-capacity": (_with(_dense_args, cache_seqlens=torch.tensor([3, 7], dtype=torch.int32)), "capacity"),
    "over-capacity-int": (_with(_dense_args, cache_seqlens=7), "capacity"),
    "none-seqlens-with-k": (_with(_dense_args, cache_seqlens=None), "capacity"),
    "negative-seqlens": (_with(_dense_args, cache_seqlens=torch.tensor([3, -1], dtype=torch.int32)), ">= 0"),
    "seqlens-int64": (_with(_dense_args, cache_seqlens=torch.tensor([3, 6])), "int32"),
    "seqlens-shape": (_with(_dense_args, cache_seqlens=torch.tensor([3], dtype=torch.int32)), "shape"),
    "k-without-v": (_with(_dense_args, v=None), "together"),
    "v-without-k": (_with(_dense_args, k=None), "together"),
    "k-heads": (_with(_dense_args, k=lambda a: a["k"][:, :, :1]), "k must be"),
    "k-head-dim": (_with(_dense_args, k=lambda a: a["k"][..., :4]), "k must be"),
    "v-seqlen": (_with(_dense_args, v=lambda a: a["v"][:, :1]), "k must be"),
    "v-head-dim": (_with(_dense_args, v=lambda a: torch.cat([a["v"], a["v"]], -1)), "k must be"),
    "page-table-int64": (_with(_paged_args, page_table=lambda a: a["page_table"].long()), "int32"),
    "page-table-rank": (_with(_paged_args, page_table=lambda a: a["page_table"].flatten()), "2-D"),
    "page-table-batch": (_with(_paged_args, page_table=lambda a: a["page_table"][:1]), "2-D"),
    "paged-over-capacity": (
        _with(_paged_args, cache_seqlens=torch.tensor([3, 7], dtype=torch.int32)),
        "pages_per_seq \\* page_size",
    ),
    "page-out-of-range": (
        _with(_paged_args, page_table=lambda a: _set(a["page_table"], (1, 1), 99)),
        "outside",
    ),
    "shared-write": (  # both sequences append into page 0 at rows 3 and 2..3 of the same page
        _with(
            _paged_args,
            page_table=torch.tensor([[1, 0], [3, 0]], dtype=torch.int32),
            cache_seqlens=torch.tensor([6, 5], dtype=torch.int32),
        ),
        "write the same cache slot",
    ),
    "write-read-by-other": (  # sequence 1 appends into page 2, which sequence 0 reads
        _with(
            _paged_args,
            page_table=torch.tensor([[2, 0], [1, 2]], dtype=torch.int32),
            cache_seqlens=torch.tensor([3, 4], dtype=torch.int32),
        ),
        "reads",
    ),
}


@pytest.mark.parametrize("case", list(REJECTIONS))
def test_rejections_leave_cache_unchanged(case):
    make, match = REJECTIONS[case]
    args = make()
    before = {name: args[name].clone() for name in ("k_cache", "v_cache") if args[name].device.type != "meta"}
    with pytest.raises(ValueError, match=match):
        reference_with_kvcache(**args, dtype=F64)
    for name, tensor in before.items():
        assert torch.equal(args[name], tensor), f"{name} changed by a rejected call"


def test_rejection_after_a_valid_sequence_writes_nothing():
    """Sequence 0's append is valid, sequence 2's overflows: nothing is written, not even sequence 0's."""
    q, kc, vc, k, v = problem(3, 1, 2, 2, 6, 2, seed=40)
    k_cache, v_cache = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match="capacity"):
        reference_with_kvcache(q, k_cache, v_cache, k, v, torch.tensor([0, 4, 5], dtype=torch.int32))
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
