"""Compile tier, decoding against a KV cache: the ws kernel with seqused_k on a dense cache
(cache_seqlens), with split_kv (partials to a workspace), pack-GQA and paged K/V, each head dim,
causal or not, with a sink, compile for sm_90a without spills.

Compiled, not run here: tests/test_gpu_kvcache.py checks the numbers on a Hopper GPU.
"""

import inspect

import pytest
from test_compile_ws_features import inspected, inspected_without_spills  # noqa: E402  (tests/ is on sys.path)

from hopper_fmha.config import (
    SUPPORTED_HEAD_DIMS,
    launch_config,
    paged_tile_n,
    pages_per_block,
    select_config,
    short_block_stages,
)
from hopper_fmha.kernels import feature_key, num_splits_heuristic, score_features, use_pack_gqa
from hopper_fmha.kernels.cache import KernelKey, dsl_flavor
from hopper_fmha.kernels.sm90_ws import WsFwdSm90

pytestmark = pytest.mark.compile


def decode_key(head_dim, causal, split_kv, sink=False) -> KernelKey:
    cfg = launch_config(select_config(head_dim, "ws"), causal, 1, exact_lse=True)
    key = KernelKey.from_config("bfloat16", causal, cfg)
    if sink:
        key = feature_key(key, score_features(causal, None, 0.0, "sink"))
    key = key._replace(seqused_k=True, split_kv=split_kv)
    return key._replace(cluster_m=1) if split_kv else key


@pytest.mark.parametrize("split_kv", [False, True], ids=["one", "split"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_decode_kernels_compile_without_spills(head_dim, causal, split_kv, record_property):
    key = decode_key(head_dim, causal, split_kv, sink=causal)
    assert key.slug().endswith("_used_splitkv" if split_kv else "_used")
    row = inspected_without_spills(key, record_property)
    # Split kernels store O from registers (no TMA store); the others through TMA.
    assert (row["utmastg"] > 0) == (not split_kv)


@pytest.mark.parametrize(
    "head_dim,causal,group,split_kv",
    [(128, False, 4, False), (128, True, 4, True), (64, True, 8, False), (256, False, 16, True)],
)
def test_pack_gqa_compiles_without_spills(head_dim, causal, group, split_kv, record_property):
    key = decode_key(head_dim, causal, split_kv)._replace(pack_gqa=group, cluster_m=1, causal_trim=False)
    assert key.slug().endswith(f"_pack{group}")
    row = inspected_without_spills(key, record_property)
    assert row["utmastg"] == 0  # O leaves from registers


@pytest.mark.parametrize(
    "head_dim,causal,page_size,group,split_kv",
    [(128, False, 16, 4, False), (128, True, 64, 1, True), (128, False, 256, 4, True),
     (64, True, 16, 8, False), (256, False, 256, 1, False), (128, True, 32, 4, True),
     (256, False, 16, 1, True)],
)  # fmt: skip
def test_paged_compiles_without_spills(head_dim, causal, page_size, group, split_kv, record_property):
    cfg = select_config(head_dim, "ws")
    cfg = select_config(head_dim, "ws", (cfg.tile_m, paged_tile_n(page_size, cfg.tile_n)))
    key = KernelKey.from_config("bfloat16", causal, launch_config(cfg, causal, 1, exact_lse=True))
    stages = short_block_stages(*cfg.kernel_dims, cfg.tile_m, cfg.tile_n, key.num_stages)
    key = key._replace(
        seqused_k=True, split_kv=split_kv, paged=pages_per_block(page_size, cfg.tile_n), cluster_m=1,
        pack_gqa=group, causal_trim=False,
        num_stages=stages, sink=group > 1,
    )  # fmt: skip
    if page_size < key.tile_n:  # a key block of several pages, one TMA each
        assert key.paged == key.tile_n // page_size > 1 and key.slug().endswith(f"_paged{key.paged}")
    else:
        assert key.paged == 1 and key.slug().endswith("_paged") and page_size % key.tile_n == 0
    if split_kv and causal and dsl_flavor() == "cu12":
        # The one exception: CUDA 12's ptxas spills 16 bytes (4 registers) at d = 128, 128x64,
        # 4 stages, causal, split and paged, since the consumers' loops stop at a split's first
        # block (1af2260: without that, split-KV hung). CUDA 13's (the measured one) spills none.
        row = inspected(key)
        record_property("kernel_resources", row)
        assert row["stack_bytes"] <= 16, f"{row['stack_bytes']} bytes of stack (16 allowed here)"
    else:
        row = inspected_without_spills(key, record_property)
    assert row.get("utmaldg", 1) > 0


def test_paged_tile_n():
    # Pages of 16 and 32 rows: blocks of the table's tile_n (8 and 4 pages); 48 does not divide 128.
    assert [paged_tile_n(p, 128) for p in (16, 32, 48, 64, 80, 128, 144, 256, 1024)] == [
        128, 128, 48, 64, 80, 128, 48, 128, 128,
    ]  # fmt: skip
    assert paged_tile_n(256, 80) == 64 and paged_tile_n(16, 80) == 80 and paged_tile_n(32, 80) == 32
    assert [pages_per_block(p, paged_tile_n(p, 128)) for p in (16, 32, 48, 64, 256)] == [8, 4, 1, 1, 1]
    with pytest.raises(ValueError, match="must divide page_size 48 or be a multiple of it"):
        pages_per_block(48, 128)


def test_use_pack_gqa():
    assert use_pack_gqa(1, 4, False) and use_pack_gqa(16, 8, False)
    assert not use_pack_gqa(1, 1, False)  # MHA: nothing to pack
    assert not use_pack_gqa(17, 4, False)  # prefill lengths
    assert use_pack_gqa(1, 4, True)  # each packed row takes its q head's sink


def test_short_block_stages():
    assert [short_block_stages(128, 128, 128, n, 2) for n in (16, 32, 64, 128)] == [8, 8, 4, 2]
    assert short_block_stages(256, 256, 128, 64, 2) == 2  # no room for more


def test_num_splits_heuristic():
    cfg = select_config(128, "ws")  # 128 x 128 tiles
    # Tiles that fill the SMs: no split.
    assert num_splits_heuristic(64, 32, 1, 8192, cfg, 132) == 1
    # batch 1, 8 heads, 128k keys: enough splits to fill 132 SMs.
    assert num_splits_heuristic(1, 8, 1, 131072, cfg, 132) == 16  # one wave: 128 CTAs on 132 SMs
    assert num_splits_heuristic(4, 8, 1, 131072, cfg, 132) == 4  # 128 CTAs, not 5 splits in 160
    # Few key blocks: no split.
    assert num_splits_heuristic(1, 8, 1, 512, cfg, 132) == 1


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"softcap": True},
        {"seqused_k": True},
        {"seqused_k": True, "split_kv": True, "cluster_m": 1},
        {"seqused_k": True, "paged": True, "cluster_m": 1},
        {"seqused_k": True, "split_kv": True, "paged": True, "cluster_m": 1, "sink": True},
        {"varlen": True},
        {"varlen": True, "seqused_k": True, "window": "left", "cluster_m": 1},
    ],
    ids=["dense", "softcap", "used", "split", "paged", "split-paged-sink", "varlen", "varlen-used-window"],
)
def test_launch_arguments_follow_the_compiled_signature(changes):
    """`kernels.extra_arguments` passes, after the stream, what `cache.fake_arguments` compiled: as
    many arguments, None exactly where the kernel was compiled without the argument."""
    from hopper_fmha.kernels import extra_arguments
    from hopper_fmha.kernels.cache import fake_arguments

    key = KernelKey.from_config("bfloat16", False, select_config(128, "ws"))._replace(**changes)
    fake = fake_arguments(key, tvm_ffi=False)
    compiled_extras = fake[12:]  # q, k, v, o, lse, scale, group, max_ctas, lpt_group, counters, slot, stream
    features = (
        1 if "left" in key.window else None,
        None,
        2.0 if key.softcap else None,
        "sink" if key.sink else None,
    )
    used = "used" if key.seqused_k else None
    sequences = ("cu_q", "cu_k", used, 7) if key.varlen else (None, None, used, None)
    passed = extra_arguments(
        key, features if key.features else None, sequences, ("o_part", "lse_part"), 3, "table"
    )
    assert len(passed) == len(compiled_extras)
    assert [a is None for a in passed] == [a is None for a in compiled_extras]
    # All of the kernel's parameters after the stream, every time: an object file loaded from the
    # disk cache takes exactly its compiled list (a shorter one is a TypeError).
    params = list(inspect.signature(WsFwdSm90.__call__).parameters)
    assert len(passed) == len(params) - params.index("stream") - 1


@pytest.mark.parametrize(
    "split_kv,group,paged", [(False, 4, 0), (True, 4, 0), (True, 1, 8)], ids=["one", "split", "paged"]
)
def test_tile_counter_decode_compiles_without_spills(split_kv, group, paged, record_property):
    # `kernels.KVCACHE_TILE_COUNTER` (on since session 25): non-causal ragged decode takes
    # its tiles from the global counter, split, packed and paged kernels alike.
    key = decode_key(128, False, split_kv)._replace(cluster_m=1, pack_gqa=group, tile_counter=True)
    if paged:
        key = key._replace(paged=paged, num_stages=short_block_stages(128, 128, key.tile_m, key.tile_n, 2))
    assert key.slug().endswith("_ctr")
    inspected_without_spills(key, record_property)
