"""GPU tier, decoding against a KV cache (`flash_attn_with_kvcache`, dense and paged caches): ragged
cache_seqlens including 0 and the full capacity, new tokens appended in place and attended in the
same call, GQA group sizes 1-16 and MQA, split counts forced from 1 to many, causal (bottom-right
to the cache's end), a sink, LSE returned; against `reference_with_kvcache` by
tests/test_gpu_kernels.py's rule per sequence, and the appended caches element-wise.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from test_gpu_kernels import assert_close_to_reference  # noqa: E402  (tests/ is on sys.path)

import hopper_fmha
from hopper_fmha.reference_kvcache import reference_with_kvcache

pytestmark = pytest.mark.gpu

GROUPS = {"mha": (8, 8), "gqa4": (32, 8), "gqa16": (16, 1), "mqa": (8, 1)}


def make_cache(batch, capacity, heads, kv_heads, d, seqlen_q, seqlen_new, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, d, device="cuda", dtype=dtype, generator=g)
    k_cache = torch.randn(batch, capacity, kv_heads, d, device="cuda", dtype=dtype, generator=g)
    v_cache = torch.randn(batch, capacity, kv_heads, d, device="cuda", dtype=dtype, generator=g)
    k = v = None
    if seqlen_new:
        k = torch.randn(batch, seqlen_new, kv_heads, d, device="cuda", dtype=dtype, generator=g)
        v = torch.randn(batch, seqlen_new, kv_heads, d, device="cuda", dtype=dtype, generator=g)
    # Ragged lengths: 0, full (minus the new tokens), and random ones between.
    lengths = torch.randint(0, capacity - seqlen_new + 1, (batch,), generator=g, device="cuda")
    lengths[0] = 0
    lengths[-1] = capacity - seqlen_new
    return q, k_cache, v_cache, k, v, lengths.to(torch.int32)


def check(q, k_cache, v_cache, k, v, cache_seqlens, causal, num_splits, sink=None):
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    out, lse = hopper_fmha.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, causal=causal, return_lse=True,
        num_splits=num_splits, learnable_sink=sink,
    )  # fmt: skip
    ref_out, ref_lse = reference_with_kvcache(
        q, ref_k, ref_v, k, v, cache_seqlens=cache_seqlens, causal=causal, learnable_sink=sink
    )
    # The appended caches, element-wise.
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    # Each sequence by the tier's rule, on the keys it sees.
    seqlen_new = 0 if k is None else k.shape[1]
    for b in range(q.shape[0]):
        n = int(cache_seqlens[b]) + seqlen_new
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b]))
            continue
        assert_close_to_reference(
            q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n], q.shape[3] ** -0.5, causal,
            out[b : b + 1], lse[b : b + 1], sink=sink,
        )  # fmt: skip
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=0)


@pytest.mark.parametrize("num_splits", [1, 3, 0], ids=["one", "three", "auto"])
@pytest.mark.parametrize("groups", list(GROUPS), ids=list(GROUPS))
@pytest.mark.parametrize(
    "seqlen_q,seqlen_new", [(1, 0), (1, 1), (4, 4), (8, 0)], ids=["1", "1+1", "4+4", "8"]
)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_dense_cache(hopper_gpu, dtype, d, seqlen_q, seqlen_new, groups, num_splits):
    heads, kv_heads = GROUPS[groups]
    seed = zlib.crc32(repr((d, seqlen_q, seqlen_new, groups, num_splits, str(dtype))).encode())
    inputs = make_cache(4, 1000, heads, kv_heads, d, seqlen_q, seqlen_new, dtype, seed)
    check(*inputs, causal=seqlen_q > 1, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
def test_split_counts_and_sink(hopper_gpu, num_splits):
    q, k_cache, v_cache, k, v, lengths = make_cache(2, 9000, 8, 2, 128, 1, 1, torch.bfloat16, num_splits)
    sink = torch.randn(8, device="cuda")
    check(q, k_cache, v_cache, k, v, lengths, causal=True, num_splits=num_splits, sink=sink)


def test_int_cache_seqlens_and_none(hopper_gpu):
    q, k_cache, v_cache, _, _, _ = make_cache(3, 512, 8, 8, 64, 1, 0, torch.bfloat16, 5)
    for cache_seqlens in (300, None):
        out = hopper_fmha.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens)
        n = 512 if cache_seqlens is None else cache_seqlens
        ref = reference_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens)[0]
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=0)
        assert out.shape == q.shape and n > 0


# (page_size, capacity): pages of 16 and 32 make key blocks of several pages (`config.paged_tile_n`);
# 16 x 125 = 2000 keys ends inside a block (its last pages repeat the sequence's last page).
PAGED = [(16, 2048), (16, 2000), (32, 2048), (64, 2048), (256, 2048)]


@pytest.mark.parametrize("num_splits", [1, 0])
@pytest.mark.parametrize("groups", ["gqa4", "mqa", "mha"])
@pytest.mark.parametrize("page_size,capacity", PAGED, ids=[f"p{p}-{c}" for p, c in PAGED])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_paged_cache(hopper_gpu, dtype, page_size, capacity, groups, num_splits):
    """Random page tables (pages in any order, spare pages), ragged lengths, appends crossing
    page boundaries; the pages compared element-wise after the call."""
    heads, kv_heads = GROUPS[groups]
    batch, pages_per_seq, d, seqlen_new = 3, capacity // page_size, 128, 5
    g = torch.Generator(device="cuda").manual_seed(page_size)
    num_pages = batch * pages_per_seq + 3
    k_pages = torch.randn(num_pages, page_size, kv_heads, d, device="cuda", dtype=dtype, generator=g)
    v_pages = torch.randn(num_pages, page_size, kv_heads, d, device="cuda", dtype=dtype, generator=g)
    table = torch.randperm(num_pages, device="cuda", generator=g)[: batch * pages_per_seq]
    table = table.view(batch, pages_per_seq).to(torch.int32)
    q = torch.randn(batch, 1, heads, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(batch, seqlen_new, kv_heads, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(batch, seqlen_new, kv_heads, d, device="cuda", dtype=dtype, generator=g)
    lengths = torch.tensor([0, page_size - 2, capacity - seqlen_new], dtype=torch.int32, device="cuda")
    ref_k, ref_v = k_pages.clone(), v_pages.clone()
    out, lse = hopper_fmha.flash_attn_with_kvcache(
        q, k_pages, v_pages, k, v, cache_seqlens=lengths, page_table=table, return_lse=True,
        num_splits=num_splits,
    )  # fmt: skip
    ref_out, ref_lse = reference_with_kvcache(q, ref_k, ref_v, k, v, cache_seqlens=lengths, page_table=table)
    assert torch.equal(k_pages, ref_k) and torch.equal(v_pages, ref_v)
    torch.testing.assert_close(out.float(), ref_out, atol=2e-2 if dtype == torch.bfloat16 else 4e-3, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=2e-3, rtol=0)


# d = 96 runs 192-row tiles (3 consumer warpgroups) since session 24.
@pytest.mark.parametrize("num_splits", [1, 0], ids=["one", "auto"])
@pytest.mark.parametrize("seqlen_q,seqlen_new", [(1, 1), (8, 0)], ids=["1+1", "8"])
def test_dense_cache_at_d96(hopper_gpu, seqlen_q, seqlen_new, num_splits):
    test_dense_cache(hopper_gpu, torch.bfloat16, 96, seqlen_q, seqlen_new, list(GROUPS)[-1], num_splits)


# Ragged non-causal decode through the global tile counter (`kernels.KVCACHE_TILE_COUNTER`, on by
# default since session 25), on few persistent CTAs and one per SM; dense and paged caches.
@pytest.mark.parametrize("ctas", [None, 3], ids=["per-sm", "3-ctas"])
@pytest.mark.parametrize("num_splits", [1, 3, 0], ids=["one", "three", "auto"])
@pytest.mark.parametrize("groups", ["gqa4", "mha"])
def test_kvcache_tile_counter(hopper_gpu, monkeypatch, groups, num_splits, ctas):
    from hopper_fmha import kernels

    monkeypatch.setattr(kernels, "KVCACHE_TILE_COUNTER", True)
    monkeypatch.setattr(kernels, "PERSISTENT_CTAS", ctas)
    test_dense_cache(hopper_gpu, torch.bfloat16, 128, 1, 1, groups, num_splits)
    test_paged_cache(hopper_gpu, torch.bfloat16, *PAGED[0], groups, num_splits)


# KV-cache calls with a window or softcap, and DeepSeek's (192, 128): the table's tile, and the
# 64-row decode tile with `kernels.DECODE_TILE_FEATURES` on and (192, 128) added to
# `DECODE_TILE_DIMS` (session 28: both left out of the 64-row tile until these pass).
@pytest.mark.parametrize("tile64", [False, True], ids=["table-tile", "tile64"])
@pytest.mark.parametrize("case", ["window", "softcap", "window-softcap", "d192-dv128"])
@pytest.mark.parametrize("seqlen_q", [1, 4])
def test_kvcache_features_and_192(hopper_gpu, monkeypatch, tile64, case, seqlen_q):
    from hopper_fmha import kernels

    if tile64:
        monkeypatch.setattr(kernels, "DECODE_TILE_FEATURES", True)
        monkeypatch.setattr(kernels, "DECODE_TILE_DIMS", (*kernels.DECODE_TILE_DIMS, (192, 128)))
    d, dv = (192, 128) if case == "d192-dv128" else (128, 128)
    window = (100, 0) if "window" in case else None
    softcap = 30.0 if "softcap" in case else 0.0
    g = torch.Generator(device="cuda").manual_seed(zlib.crc32(repr((case, seqlen_q)).encode()))
    q = torch.randn(3, seqlen_q, 32, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k_cache = torch.randn(3, 700, 8, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn(3, 700, 8, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    lengths = torch.tensor([0, 700, 333], dtype=torch.int32, device="cuda")
    causal = seqlen_q > 1
    out, lse = hopper_fmha.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=lengths, causal=causal, window_size=window or (-1, -1),
        softcap=softcap, return_lse=True,
    )  # fmt: skip
    assert out.shape == (3, seqlen_q, 32, dv)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    for b, n in enumerate(lengths.tolist()[1:], start=1):
        assert_close_to_reference(
            q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n], d**-0.5, causal,
            out[b : b + 1], lse[b : b + 1], window=window, softcap=softcap,
        )  # fmt: skip
