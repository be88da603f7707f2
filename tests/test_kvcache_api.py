"""flash_attn_with_kvcache on the CPU: the call path with a reference stand-in for the kernel
(`kernels.kvcache_forward`): the append happens before the launch and only for accepted calls,
the lengths the kernel gets (a tensor of cache_seqlens + new tokens, or a cache sliced to an int's
length; paged: a tensor, and key blocks that divide the page), split counts, empty caches, and
the errors of the rules the API adds (num_splits, non-conforming caches). The argument rules
themselves: tests/test_kvcache_args.py.
"""

import math
import types

import pytest
import torch

from hopper_fmha import flash_attn_with_kvcache, interface
from hopper_fmha.config import pages_per_block
from hopper_fmha.reference import reference
from hopper_fmha.reference_kvcache import reference_with_kvcache

pytestmark = pytest.mark.cpu


def cache(batch=3, capacity=40, heads=8, kv_heads=2, d=64, seqlen_q=1, seqlen_new=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, d, generator=g).to(dtype)
    k_cache = torch.randn(batch, capacity, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(batch, capacity, kv_heads, d, generator=g).to(dtype)
    k = v = None
    if seqlen_new:
        k = torch.randn(batch, seqlen_new, kv_heads, d, generator=g).to(dtype)
        v = torch.randn(batch, seqlen_new, kv_heads, d, generator=g).to(dtype)
    return q, k_cache, v_cache, k, v


@pytest.fixture
def cpu_kernel(monkeypatch):
    launches = []

    def kvcache_forward(
        q, k_cache, v_cache, out, lse, scale, causal, cfg, cache_seqlens=None, num_splits=1, *,
        exact_lse=True, window=None, softcap=0.0, learnable_sink=None, pack_gqa=None, page_table=None,
    ):  # fmt: skip
        assert cfg.variant == "ws" and num_splits >= 1
        if page_table is not None:
            assert pages_per_block(k_cache.shape[1], cfg.tile_n) >= 1 and cache_seqlens is not None
        for b in range(q.shape[0]):
            n = k_cache.shape[1] if cache_seqlens is None else int(cache_seqlens[b])
            keys, values = k_cache[b : b + 1, :n], v_cache[b : b + 1, :n]
            if page_table is not None:  # the sequence's pages, in its table's order
                keys = k_cache[page_table[b].long()].flatten(0, 1)[None, :n]
                values = v_cache[page_table[b].long()].flatten(0, 1)[None, :n]
            o, l = reference(
                q[b : b + 1], keys, values, scale, causal,
                window_size=window or (-1, -1), softcap=softcap, learnable_sink=learnable_sink,
            )  # fmt: skip
            out[b : b + 1] = o
            lse[b : b + 1] = l
        launches.append(
            dict(
                seqlens=cache_seqlens,
                splits=num_splits,
                keys=k_cache.shape[1],
                causal=causal,
                pack=pack_gqa,
                table=page_table,
                tile_n=cfg.tile_n,
            )  # fmt: skip
        )

    from hopper_fmha import kernels

    fake = types.SimpleNamespace(
        kvcache_forward=kvcache_forward,
        num_splits_heuristic=lambda *a: 5,
        _sm_count=lambda i: 132,
        use_pack_gqa=kernels.use_pack_gqa,
    )
    monkeypatch.setattr(interface, "_check_device", lambda q, k, v: None)
    monkeypatch.setattr(interface, "_kernels", fake)
    return launches


@pytest.mark.parametrize(
    "seqlen_q,seqlen_new,causal", [(1, 0, False), (1, 1, True), (4, 4, True), (2, 0, True)]
)
def test_matches_the_reference_and_appends(cpu_kernel, seqlen_q, seqlen_new, causal):
    q, k_cache, v_cache, k, v = cache(seqlen_q=seqlen_q, seqlen_new=seqlen_new)
    lengths = torch.tensor([0, 17, 40 - seqlen_new], dtype=torch.int32)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=lengths, causal=causal, return_lse=True, num_splits=2
    )
    ref_out, ref_lse = reference_with_kvcache(q, ref_k, ref_v, k, v, cache_seqlens=lengths, causal=causal)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)  # appended in place, the same
    torch.testing.assert_close(out, ref_out.to(q.dtype), rtol=0, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-4)
    (launch,) = cpu_kernel
    assert launch["splits"] == 2 and launch["keys"] == 40
    assert torch.equal(launch["seqlens"], lengths + seqlen_new)


def test_int_cache_seqlens_slice_the_cache(cpu_kernel):
    q, k_cache, v_cache, k, v = cache(seqlen_new=2)
    flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=10)
    assert cpu_kernel[0]["seqlens"] is None and cpu_kernel[0]["keys"] == 12
    assert torch.equal(k_cache[:, 10:12], k)
    flash_attn_with_kvcache(q, k_cache, v_cache)  # None: the whole capacity
    assert cpu_kernel[1]["keys"] == 40 and cpu_kernel[1]["splits"] == 5  # the heuristic's


def test_rejected_calls_write_nothing(cpu_kernel):
    q, k_cache, v_cache, k, v = cache(seqlen_new=3)
    before = k_cache.clone()
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=38)  # 38 + 3 > 40
    with pytest.raises(ValueError, match="num_splits must be an int in"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=1, num_splits=-1)
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=1, softcap=-2.0)
    bad = k_cache.transpose(1, 3).contiguous().transpose(1, 3)  # last dim not contiguous
    with pytest.raises(ValueError, match="k_cache must have its last dim contiguous"):
        flash_attn_with_kvcache(q, bad, v_cache, k, v, cache_seqlens=1)
    assert torch.equal(k_cache, before) and cpu_kernel == []


def test_paged_caches(cpu_kernel):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 1, 8, 64, generator=g).to(torch.bfloat16)
    k_pages = torch.randn(7, 16, 2, 64, generator=g).to(torch.bfloat16)
    v_pages = torch.randn(7, 16, 2, 64, generator=g).to(torch.bfloat16)
    k_new = torch.randn(2, 3, 2, 64, generator=g).to(torch.bfloat16)
    v_new = torch.randn(2, 3, 2, 64, generator=g).to(torch.bfloat16)
    table = torch.tensor([[4, 0, 6], [1, 5, 2]], dtype=torch.int32)
    ref_k, ref_v = k_pages.clone(), v_pages.clone()
    out, lse = flash_attn_with_kvcache(
        q, k_pages, v_pages, k_new, v_new, cache_seqlens=15, page_table=table, return_lse=True
    )
    ref_out, ref_lse = reference_with_kvcache(
        q, ref_k, ref_v, k_new, v_new, cache_seqlens=15, page_table=table
    )
    assert torch.equal(k_pages, ref_k) and torch.equal(v_pages, ref_v)  # the append crossed a page
    torch.testing.assert_close(out, ref_out.to(q.dtype), rtol=0, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-4)
    (launch,) = cpu_kernel
    assert torch.equal(launch["seqlens"], torch.tensor([18, 18], dtype=torch.int32))
    # Pages of 16: key blocks of the table's tile_n (192x128 at d = 64), 8 whole pages each.
    assert launch["table"] is table and launch["tile_n"] == 128


def test_empty_cache_gives_zero_and_minus_inf(cpu_kernel):
    q, k_cache, v_cache, _, _ = cache()
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=0, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    sink = torch.tensor([0.5] * 8)
    out, lse = flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=0, return_lse=True, learnable_sink=sink
    )
    assert torch.equal(lse, torch.full_like(lse, 0.5)) and cpu_kernel == []
    assert not math.isnan(lse.sum().item())


def test_pack_gqa_for_decode(cpu_kernel):
    q, k_cache, v_cache, _, _ = cache()  # 8 q heads on 2 kv heads, one query
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5)
    flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5, learnable_sink=torch.zeros(8))
    mha = cache(kv_heads=8)
    flash_attn_with_kvcache(*mha[:3], cache_seqlens=5)
    assert [launch["pack"] for launch in cpu_kernel] == [True, True, False]


def test_decode_tiles_take_one_consumer_warpgroup(monkeypatch):
    """Tiles of at most 64 query rows (seqlen_q x the packed group; DECODE_TILE_DIMS; a window or
    softcap with DECODE_TILE_FEATURES) run at tile_m 64 without pingpong, O's buffer chosen for
    that tile; more rows keep the table's tile."""
    from hopper_fmha import config, kernels
    from hopper_fmha.kernels.cache import KernelKey

    cfg = config.launch_config(config.select_config(192, "ws", None, 192), False, 1)
    wide = KernelKey.from_config("bfloat16", False, cfg)._replace(pack_gqa=4, cluster_m=1)
    assert kernels.decode_tile(wide, 4) is wide  # (192, 192): not run on a GPU at 64 rows
    for d, dv in ((64, 64), (128, 128), (256, 256), (192, 128)):
        cfg = config.launch_config(config.select_config(d, "ws", None, dv), False, 1)
        key = KernelKey.from_config("bfloat16", False, cfg)._replace(pack_gqa=4, cluster_m=1)
        small = kernels.decode_tile(key, 64)
        assert (small.tile_m, small.pingpong, small.cluster_m) == (64, False, 1)
        assert small.tile_n == key.tile_n and small.num_stages == key.num_stages
        assert small.split_o == config.ws_split_o(d, 64, key.tile_n, key.num_stages, key.mma_rowsum, dv)
        assert kernels.decode_tile(key, 65) is key
        monkeypatch.setattr(kernels, "DECODE_TILE_FEATURES", False)
        assert kernels.decode_tile(key._replace(softcap=True), 1).tile_m == key.tile_m
        monkeypatch.setattr(kernels, "DECODE_TILE_FEATURES", True)
        assert kernels.decode_tile(key._replace(softcap=True, window="left"), 1).tile_m == 64
        monkeypatch.setattr(kernels, "DECODE_TILE_M", None)
        assert kernels.decode_tile(key, 1) is key
        monkeypatch.setattr(kernels, "DECODE_TILE_M", 64)
