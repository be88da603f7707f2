"""Kernel dispatch: compile (or load from cache) the CuTe DSL kernel for a config and launch it.

Contract used by `hopper_fmha.interface` (inputs are already validated there):

    forward(q, k, v, out, lse, softmax_scale, causal, cfg) -> None

q: (B, Sq, H, D), k and v: (B, Sk, Hkv, D), CUDA fp16/bf16, last dim contiguous, other strides
multiples of 8 elements, 16-byte aligned data. out: preallocated like q. lse: preallocated
(B, H, Sq) float32. cfg: `hopper_fmha.config.KernelConfig`. Writes out and lse in place.
exact_lse=False lets a kernel take P's row sums from its 16-bit copy (`config.launch_config`):
out is as accurate, lse only to about 1e-3; the caller does not return that lse.

One compiled kernel per key (dtype, head_dim, tile_m, tile_n, causal, variant, and the ws
variant's stages/overlap/pingpong switches); batch, sequence lengths, head counts and strides
are runtime values. Compiled kernels are kept in memory and,
as TVM-FFI object files, on disk (`cache_dir()`), so a second process loads instead of compiling.
"""

from __future__ import annotations

import os
from functools import lru_cache

# CuTe DSL reads the target arch once, at import. Our kernels only exist for sm_90a, which is
# also right on a CPU-only machine, where it lets the kernels compile for inspection.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from hopper_fmha.config import (  # noqa: E402
    kernel_head_dims,
    launch_config,
    pages_per_block,
    short_block_stages,
    ws_split_o,
)

from . import cache  # noqa: E402
from .cache import KernelKey, cache_dir, clear_cache, compile_kernel, dsl_flavor, get_kernel  # noqa: E402, F401
from .inspect import compile_report  # noqa: E402, F401

# How the ws variant walks its tiles: "auto"/"persistent" (one CTA per SM, looping over tiles)
# or "single" (one CTA per tile; causal tiles still longest first). For measurement.
SCHEDULE = "auto"
# Non-causal varlen launches take their tiles from the global tile counter (`tile_counter`), as
# causal ones do, instead of the serpentine order: a packed batch's tiles differ in work (each
# sequence's keys). Session 25, H200, `--preset varlen`: 1.018x -> 1.036x the best peer, the two
# non-causal cells 0.98 -> 1.01 (d128) and 0.98 -> 1.06 (d64) FA4 (NOTES "v25").
VARLEN_TILE_COUNTER = True
# Likewise for non-causal KV-cache launches with cache_seqlens (ragged lengths, which FA4's
# one-CTA-per-tile grid the hardware balances): `--preset decode`'s ragged cell 0.89x -> 0.99x.
KVCACHE_TILE_COUNTER = True
SCHEDULES = ("auto", "persistent", "single")
# KV-cache launches whose tiles hold at most this many query rows (seqlen_q, times the group
# where pack-GQA packs a kv head's q heads) run one consumer warpgroup of 64 rows, no pingpong,
# instead of the table's 2-3 warpgroups (the others' rows all padding). Sustained (H100, session
# 28, ms per call, tile 128 -> 64): the decode preset's B64 L8192 q1 0.7012 -> 0.6990, B1 L131072
# (split-KV) 0.1841 -> 0.1813, q4 causal 0.7144 -> 0.7115 (NOTES "v28"). None: the table's.
DECODE_TILE_M: int | None = 64
# The kernel head dims it applies to: those the KV-cache GPU tests run at 64 rows
# (tests/test_gpu_kvcache.py; (192, 128): `test_kvcache_features_and_192`), not (192, 192).
DECODE_TILE_DIMS = ((64, 64), (96, 96), (128, 128), (256, 256), (192, 128))
# And with a window or softcap (`test_kvcache_features_and_192`, passed on an H100 in session 29).
# `scripts/decode_tile_ab.py` (H100, session 29, B64 L8192 H32/8 bf16 q1, ms per call, table's tile
# -> 64 rows): softcap 30 0.7091 -> 0.7014, window 4096/0 0.3718 -> 0.3671, d192/dv128 0.8970 ->
# 0.8867, d192/dv128 softcap 0.9011 -> 0.8905 (-1.1 to -1.3%; outputs bitwise equal).
DECODE_TILE_FEATURES = True
# KernelKey fields a KV-cache launch sets over the table's and the rules above, e.g.
# {"num_stages": 3}: for measurement (`scripts/sustained.py`'s `kv:` backends); empty by default.
KVCACHE_SWITCHES: dict = {}
# Persistent CTAs; None: one per SM. Tests set a small number so that every CTA runs many tiles.
PERSISTENT_CTAS: int | None = None
# L2 bytes the causal longest-first order may fill with the K and V of the heads it interleaves.
LPT_L2_BYTES = 50 * 1024 * 1024


def forward(
    q,
    k,
    v,
    out,
    lse,
    softmax_scale: float,
    causal: bool,
    cfg,
    *,
    exact_lse: bool = True,
    window=None,
    softcap: float = 0.0,
    learnable_sink=None,
) -> None:
    """Score features (ws variant only; `flash_attn_func` passes them, resolved):
    window=(left, right) (-1: no limit on that side; with causal, right is 0 and left kept),
    softcap > 0 (s = softcap * tanh(softmax_scale * q.k / softcap)), learnable_sink: (H,) float32
    logits. Their defaults launch the kernels of before (`score_features`)."""
    # The per-call path without features tests three arguments, nothing more (hot: host time).
    features = None
    if window is not None or softcap or learnable_sink is not None:
        features = score_features(causal, window, softcap, learnable_sink)
    if features is not None:
        if cfg.variant != "ws":
            raise NotImplementedError("window, softcap and learnable_sink need the ws variant")
        cfg = launch_config(cfg, causal, q.shape[1], exact_lse=exact_lse)
        fn = get_kernel(feature_key(KernelKey.from_config(_DTYPE_NAMES[q.dtype], causal, cfg), features))
        fn(*launch_arguments(q, k, v, out, lse, softmax_scale, causal, ws=True, features=features))
        return
    fn, args = prepared_launch(q, k, v, out, lse, softmax_scale, causal, cfg, exact_lse=exact_lse)
    if cfg.variant == "paper" and (q.shape[0] > GRID_YZ_MAX or q.shape[2] > GRID_YZ_MAX):
        for part in grid_parts(q, k, v, out, lse):
            fn(*launch_arguments(*part, softmax_scale, causal, ws=False))
        return
    fn(*args)


def varlen_forward(
    q,
    k,
    v,
    out,
    lse,
    softmax_scale: float,
    causal: bool,
    cfg,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    seqused_k=None,
    *,
    exact_lse: bool = True,
    window=None,
    softcap: float = 0.0,
    learnable_sink=None,
) -> None:
    """Packed variable-length sequences (ws variant): q, out (total_q, H, D), k, v (total_k, Hkv,
    D), lse (H, total_q) float32; cu_seqlens_q/k (batch + 1,) int32 offsets, seqused_k (batch,)
    int32 or None, on q's device. max_seqlen_q sizes the grid (rows past it are not computed; a
    sequence's tiles past its own end are skipped); max_seqlen_k picks the tile and the causal
    order's groups. Score features as `forward`'s."""
    if cfg.variant != "ws":
        raise NotImplementedError("varlen needs the ws variant")
    features = score_features(causal, window, softcap, learnable_sink)
    cfg = launch_config(cfg, causal, max_seqlen_q, exact_lse=exact_lse)
    key = KernelKey.from_config(_DTYPE_NAMES[q.dtype], causal, cfg)
    if features is not None:
        key = feature_key(key, features)
    key = varlen_key(key, seqused_k is not None)
    if VARLEN_TILE_COUNTER and not causal:
        # The counter deals tiles to single CTAs: the two CTAs of a pair would draw different ones.
        key = key._replace(tile_counter=True, cluster_m=1)
    fn = get_kernel(key)
    ctas, lpt_group = schedule_varlen(q, k, causal, max_seqlen_k)
    counters, slot = _tile_counters(q.get_device(), causal or key.tile_counter)
    args = (q, k, v, out, lse, softmax_scale, q.shape[1] // k.shape[1], ctas, lpt_group, counters, slot)
    fn(*args, *extra_arguments(key, features, (cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q)))


def kvcache_forward(
    q,
    k_cache,
    v_cache,
    out,
    lse,
    softmax_scale: float,
    causal: bool,
    cfg,
    cache_seqlens=None,
    num_splits: int = 1,
    *,
    exact_lse: bool = True,
    window=None,
    softcap: float = 0.0,
    learnable_sink=None,
    pack_gqa: bool | None = None,
    page_table=None,
) -> None:
    """Attention of q (B, Sq, H, D) against a dense KV cache k_cache, v_cache (B, capacity, Hkv,
    D / Dv), of which sequence b's first cache_seqlens[b] rows count (int32 (B,) on q's device; None:
    all). num_splits > 1: split-KV, each (query tile, head, batch) in num_splits key ranges whose
    partials (a workspace reused across calls, `split_workspace`) `combine.combine` merges into out
    and lse. Score features as `forward`'s. pack_gqa (None: `use_pack_gqa`): the q heads of a kv
    head share each tile's rows, so a K/V block is read once per kv head. page_table (B, pages per
    sequence) int32: k_cache, v_cache are (num_pages, page_size, Hkv, D / Dv) pages, cache_seqlens
    is required, and cfg's tile_n must divide page_size or be a multiple of it, a key block of
    whole pages (`config.paged_tile_n`, `config.pages_per_block`)."""
    if cfg.variant != "ws":
        raise NotImplementedError("a KV cache needs the ws variant")
    group = q.shape[2] // k_cache.shape[2]
    if pack_gqa is None:
        pack_gqa = use_pack_gqa(q.shape[1], group, learnable_sink is not None)
    features = score_features(causal, window, softcap, learnable_sink)
    split = num_splits > 1
    # Split partials are weighed by their LSE: those take fp32 row sums whatever is returned.
    cfg = launch_config(cfg, causal, q.shape[1], exact_lse=exact_lse or split)
    key = KernelKey.from_config(_DTYPE_NAMES[q.dtype], causal, cfg)
    if features is not None:
        key = feature_key(key, features)
    key = key._replace(seqused_k=cache_seqlens is not None, split_kv=split)
    if split:
        key = key._replace(cluster_m=1)  # the CTAs of a pair would take different splits
    if pack_gqa and group > 1:
        key = key._replace(pack_gqa=group, cluster_m=1, causal_trim=False)
    if page_table is not None:
        if cache_seqlens is None:
            raise ValueError("paged K/V needs cache_seqlens")
        pages = pages_per_block(k_cache.shape[1], cfg.tile_n)
        kd, kdv = cfg.kernel_dims
        stages = short_block_stages(kd, kdv, cfg.tile_m, cfg.tile_n, key.num_stages)
        key = key._replace(paged=pages, cluster_m=1, num_stages=stages)
    if KVCACHE_TILE_COUNTER and not causal and cache_seqlens is not None:
        key = key._replace(tile_counter=True, cluster_m=1)
    key = decode_tile(key, q.shape[1] * (group if pack_gqa else 1))
    if KVCACHE_SWITCHES:
        key = key._replace(**KVCACHE_SWITCHES)
    fn = get_kernel(key)
    ctas, lpt_group = schedule(q, k_cache, causal)
    if split:
        lpt_group = 0  # the split scheduler has no longest-first order
    counters, slot = _tile_counters(q.get_device(), causal or key.tile_counter)
    partials = split_workspace(q, out.shape[3], num_splits) if split else None
    args = (q, k_cache, v_cache, out, lse, softmax_scale, group, ctas, lpt_group, counters, slot)
    fn(
        *args,
        *extra_arguments(key, features, (None, None, cache_seqlens, None), partials, num_splits, page_table),
    )
    if split:
        from .combine import combine

        combine(*partials, out, lse, num_splits)


def decode_tile(key: KernelKey, rows: int) -> KernelKey:
    """`key` at DECODE_TILE_M query rows, one consumer warpgroup, where a tile's `rows` fit them
    (O's shared-memory buffer chosen again for the smaller tile); else `key`."""
    if DECODE_TILE_M is None or rows > DECODE_TILE_M or key.tile_m <= DECODE_TILE_M:
        return key
    if (key.window or key.softcap) and not DECODE_TILE_FEATURES:
        return key  # not run on a GPU at 64 rows yet
    return _at_decode_tile(key, DECODE_TILE_M, DECODE_TILE_DIMS)


@lru_cache(maxsize=256)
def _at_decode_tile(key: KernelKey, tile_m: int, dims: tuple) -> KernelKey:
    """`decode_tile`'s key, once per key (a decode step's per-call path): `key` at tile_m rows
    where its kernel head dims are among `dims`, else `key`."""
    kd, kdv = kernel_head_dims(key.head_dim, key.head_dim_v or key.head_dim)
    if (kd, kdv) not in dims:
        return key
    split_o = ws_split_o(kd, tile_m, key.tile_n, key.num_stages, key.mma_rowsum, kdv)
    return key._replace(tile_m=tile_m, pingpong=False, cluster_m=1, split_o=split_o)


def extra_arguments(
    key: KernelKey, features, sequences, partials=None, num_splits=1, page_table=None
) -> tuple:
    """The twelve launch arguments after the stream of every ws kernel, in `cache.fake_arguments`'
    order, None where `key` does not take them: the score features' four (window_left,
    window_right, softcap, learnable_sink), the sequences' four (cu_seqlens_q, cu_seqlens_k,
    seqused_k, max_seqlen_q), split-KV's three (out_partial, lse_partial, num_splits) and the page
    table.

    All twelve always: a kernel loaded from the disk cache takes exactly its compiled parameter
    list (the in-process compiled one also accepts a shorter list, filling the defaults)."""
    args = tuple(features) if features is not None else NO_FEATURES
    args += tuple(sequences) if key.sequence_arguments else NO_SEQUENCES
    args += (*partials, num_splits) if key.split_kv else NO_SPLITS
    return args + (page_table if key.paged else None,)


NO_FEATURES = (None,) * 4
NO_SEQUENCES = (None,) * 4
NO_SPLITS = (None,) * 3
# The tail of a ws kernel without score features, sequences, splits or pages.
NO_EXTRAS = NO_FEATURES + NO_SEQUENCES + NO_SPLITS + (None,)


# Split-KV partials, per device: one float32 buffer grown to the largest call's need and reused
# (views per call), so no call allocates in proportion to anything but its own partials.
_WORKSPACES: dict = {}


def split_workspace(q, head_dim_v: int, num_splits: int):
    """(out_partial (splits, B, Sq, H, Dv), lse_partial (splits, B, H, Sq)) float32 views of the
    device's reused workspace. Launches on one stream use it in order; calls on concurrent streams
    must not share a device's workspace (as the tile counters, one per launch slot, do not)."""
    import torch

    batch, seqlen_q, heads = q.shape[0], q.shape[1], q.shape[2]
    rows = num_splits * batch * seqlen_q * heads
    need = rows * (head_dim_v + 1)
    index = q.get_device()
    buf = _WORKSPACES.get(index)
    if buf is None or buf.numel() < need:
        buf = _WORKSPACES[index] = torch.empty(need, dtype=torch.float32, device=q.device)
    out_partial = buf[: rows * head_dim_v].view(num_splits, batch, seqlen_q, heads, head_dim_v)
    lse_partial = buf[rows * head_dim_v : need].view(num_splits, batch, heads, seqlen_q)
    return out_partial, lse_partial


# Pack-GQA pays where a tile would hold few query rows of one head (decode); up to this many
# queries per call (FlashAttention-3 packs for decode and speculative decoding alike).
PACK_GQA_MAX_SEQLEN_Q = 16


def use_pack_gqa(seqlen_q: int, group: int, sink: bool = False) -> bool:
    """Whether a call packs the q heads of each kv head into one tile: GQA (group > 1) at decode
    lengths (a learnable sink too: each packed row takes its q head's)."""
    return group > 1 and seqlen_q <= PACK_GQA_MAX_SEQLEN_Q


def num_splits_heuristic(batch: int, heads: int, seqlen_q: int, seqlen_k: int, cfg, num_sms: int) -> int:
    """Key ranges per query tile for a decode call (flash decoding): 1 where the tiles already
    fill the SMs; otherwise as many as fit in one wave (tiles * splits <= SMs: one CTA per SM,
    no second wave for a few), at most one per 4 key blocks and at most 64. With pack-GQA pass kv
    heads and seqlen_q * group. H200, B1 / B4 at 131072 keys (8 kv heads, pack-GQA): ceil, 17 / 5
    splits (136 / 160 CTAs on 132 SMs), measured 2.48 / 3.14 TB/s (NOTES "decode")."""
    tiles = batch * heads * -(-seqlen_q // cfg.tile_m)
    blocks = -(-seqlen_k // cfg.tile_n)
    if tiles >= num_sms or blocks < 8:
        return 1
    return max(1, min(num_sms // tiles, blocks // 4, 64))


def varlen_key(key: KernelKey, seqused_k: bool) -> KernelKey:
    """`key` for packed sequences (`kernels/seqlen.py`), with seqused_k where given."""
    return key._replace(varlen=True, seqused_k=seqused_k)


def schedule_varlen(q, k, causal: bool, max_seqlen_k: int, mode: str | None = None) -> tuple[int, int]:
    """`schedule` for packed tensors: the causal order's groups sized by the longest sequence."""
    mode = SCHEDULE if mode is None else mode
    max_ctas = 0
    if mode in ("auto", "persistent"):
        max_ctas = PERSISTENT_CTAS if PERSISTENT_CTAS is not None else _sm_count(q.get_device())
    return max_ctas, _lpt_group(causal, max_seqlen_k * k.shape[2] * 2 * k.element_size())


# The paper kernel's grid is (query tiles, heads, batch), and a grid's y and z stop at 65535 (x at
# 2^31 - 1). Larger head counts or batches launch in parts (`grid_parts`), so that the kernel keeps
# the block indices its tiles were tuned with (a grid along x alone, split by division in the
# kernel, measured 2-6% slower at d = 64, N = 512 and 1024, the problems it runs).
# The ws kernel's grid is along x alone.
GRID_YZ_MAX = 65535


def grid_spans(batch: int, heads: int, kv_heads: int, limit: int = GRID_YZ_MAX):
    """(batch slice, q-head slice, kv-head slice) parts of at most `limit` batches and `limit` q
    heads each, covering every (batch, head) once. A part holds whole GQA groups, or, where a
    group is larger than `limit`, a slice of one group with its one kv head (a kernel given the
    group size then maps all the part's q heads to it: local head // group = 0)."""
    group = heads // kv_heads
    if group <= limit:
        step = limit // group * group
        spans = [(h0, min(h0 + step, heads)) for h0 in range(0, heads, step)]
    else:
        spans = [
            (g * group + s, min(g * group + s + limit, (g + 1) * group))
            for g in range(kv_heads)
            for s in range(0, group, limit)
        ]
    for b0 in range(0, batch, limit):
        b = slice(b0, min(b0 + limit, batch))
        for h0, h1 in spans:
            yield b, slice(h0, h1), slice(h0 // group, (h1 - 1) // group + 1)


def grid_parts(q, k, v, out, lse, limit: int = GRID_YZ_MAX):
    """(q, k, v, out, lse) views of the parts of `grid_spans`."""
    for b, h, kv in grid_spans(q.shape[0], q.shape[2], k.shape[2], limit):
        yield q[b, :, h], k[b, :, kv], v[b, :, kv], out[b, :, h], lse[b, h]


def prepared_launch(q, k, v, out, lse, softmax_scale: float, causal: bool, cfg, *, exact_lse: bool = True):
    """(compiled kernel, its arguments): what `forward` calls, for timing the call alone."""
    ws = cfg.variant == "ws"
    if ws:
        cfg = launch_config(cfg, causal, q.shape[1], exact_lse=exact_lse)
    # The configs launch_config returns are cached objects: their identity, the dtype and the mask
    # find the compiled kernel without building and hashing a KernelKey on every call.
    found = cache.by_config.get((id(cfg), q.dtype, causal))
    if found is None or found[0] is not cfg:
        found = (cfg, get_kernel(KernelKey.from_config(_DTYPE_NAMES[q.dtype], causal, cfg)))
        cache.by_config[(id(cfg), q.dtype, causal)] = found  # holds cfg: its id is not reused
    return found[1], launch_arguments(q, k, v, out, lse, softmax_scale, causal, ws=ws)


def launch(fn, q, k, v, out, lse, softmax_scale, causal, *, ws: bool, mode=None, max_ctas=None) -> None:
    """Call a compiled kernel with its arguments (`launch_arguments`)."""
    fn(*launch_arguments(q, k, v, out, lse, softmax_scale, causal, ws=ws, mode=mode, max_ctas=max_ctas))


def score_features(causal: bool, window=None, softcap: float = 0.0, learnable_sink=None):
    """(window_left, window_right, softcap, learnable_sink) for the ws kernel's score features,
    each None where off, or None when all are off (the kernels of before).

    window=(left, right), -1 a side without limit; causal is the right limit 0 (the mask's
    `causal`), so with causal only a left limit remains a window side.
    """
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if causal:
        right = -1
    features = (
        left if left >= 0 else None,
        right if right >= 0 else None,
        float(softcap) if softcap else None,
        learnable_sink,
    )
    return None if all(f is None for f in features) else features


# Tiles the score features change (head_dim, tile_m, tile_n) -> tile_n, where a left window
# (its two-sided mask) or softcap (its tanh) spill at the table's tile: d = 64 at 192 x 128, with
# 160 registers per consumer thread, spills 16-80 bytes; 192 x 96 (and 128 x 128) do not
# (tests/test_compile_ws_features.py). A right limit alone and the sink fit at 192 x 128.
# d = 96 at 192 x 112 spills 72-136 bytes with a left limit and 8 with softcap, 192 x 96 still 8-24
# with a left limit: 192 x 80 there.
FEATURE_TILE_N = {(64, 192, 128): 96, (96, 192, 112): 80}


def feature_key(key: KernelKey, features) -> KernelKey:
    """`key` with the score features of `score_features`: a window takes unpaired CTAs (paired
    tiles visit the same key blocks) and, with a left limit, no causal_trim; a left limit or
    softcap take the narrower tile of `FEATURE_TILE_N` where the table's would spill."""
    left, right, softcap, sink = features
    window = {(True, True): "both", (True, False): "left", (False, True): "right"}.get(
        (left is not None, right is not None), ""
    )
    changes = {"window": window, "softcap": softcap is not None, "sink": sink is not None}
    if window:
        changes["cluster_m"] = 1
    if left is not None:
        changes["causal_trim"] = False
    if left is not None or softcap is not None:
        kernel_d = kernel_head_dims(key.head_dim, key.head_dim_v or key.head_dim)[0]
        changes["tile_n"] = FEATURE_TILE_N.get((kernel_d, key.tile_m, key.tile_n), key.tile_n)
    return key._replace(**changes)


def launch_arguments(
    q, k, v, out, lse, softmax_scale, causal, *, ws: bool, mode=None, max_ctas=None, features=None
) -> tuple:
    """A compiled kernel's arguments; for ws, with the schedule's (see `schedule`).

    mode and max_ctas override SCHEDULE and the CTA count (measurement and tests). features:
    `score_features`' tuple, for a kernel compiled with them (`feature_key`); None: none.
    """
    group = q.shape[2] // k.shape[2]
    if not ws:
        return (q, k, v, out, lse, softmax_scale, group)
    ctas, lpt_group = schedule(q, k, causal, mode)
    if max_ctas is not None:
        ctas = max_ctas
    # Causal ws kernels always take tiles from the counters (one CTA per tile included).
    counters, slot = _tile_counters(q.get_device(), causal)
    args = (q, k, v, out, lse, softmax_scale, group, ctas, lpt_group, counters, slot)
    # The twelve after the stream (`extra_arguments`): a kernel loaded from disk takes them all.
    return args + (NO_EXTRAS if features is None else tuple(features) + NO_EXTRAS[4:])


def schedule(q, k, causal: bool, mode: str | None = None) -> tuple[int, int]:
    """(max_ctas, lpt_group) for the ws kernel: 0 CTAs means one per tile, 0 group means no LPT.

    Persistent CTAs (one per SM) overlap a tile's epilogue with the next tile's loads. Tiles of
    equal work are dealt in a fixed serpentine order; causal tiles, longest first, go to
    whichever CTA asks next (a global counter).
    """
    mode = SCHEDULE if mode is None else mode
    persistent = mode in ("auto", "persistent")
    max_ctas = 0
    if persistent:
        max_ctas = PERSISTENT_CTAS if PERSISTENT_CTAS is not None else _sm_count(q.get_device())
    return max_ctas, _lpt_group(causal, k.shape[1] * k.shape[3] * 2 * k.element_size())


def _lpt_group(causal: bool, kv_head_bytes: int) -> int:
    """(head, batch) pairs per longest-first group: as many as have K and V (`kv_head_bytes`
    each) in LPT_L2_BYTES, a power of two (as FlashAttention's LPT scheduler); 0 (none) unless
    causal."""
    if not causal:
        return 0
    fit = max(1, LPT_L2_BYTES // max(kv_head_bytes, 1))
    return 1 << (fit.bit_length() - 1)


# Persistent causal launches take tiles from a pair of int32 counters in global memory, which
# the launch's last CTA sets back to zero. Each launch uses the next of COUNTER_SLOTS pairs, so
# launches in flight at the same time on different streams do not share one.
COUNTER_SLOTS = 4096
_COUNTERS: dict = {}
_next_slot = 0


def _tile_counters(index: int, needed: bool):
    """(counter buffer of device `index`, slot) for a launch; slot 0 when the kernel reads none.

    Slots 1..COUNTER_SLOTS-1 rotate among the launches that count; slot 0 is never handed out
    to one, so it stays zero.
    """
    global _next_slot
    buf = _COUNTERS.get(index)
    if buf is None:
        import torch

        buf = _COUNTERS[index] = torch.zeros(2 * COUNTER_SLOTS, dtype=torch.int32, device=f"cuda:{index}")
    if not needed:
        return buf, 0
    _next_slot = _next_slot % (COUNTER_SLOTS - 1) + 1
    return buf, _next_slot


_SM_COUNTS: dict = {}


def _sm_count(index) -> int:
    n = _SM_COUNTS.get(index)
    if n is None:
        import torch

        n = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return n


class _DtypeNames(dict):
    """torch dtype -> "float16"/"bfloat16", filled on first use so that importing needs no torch."""

    def __missing__(self, dtype):
        name = str(dtype).removeprefix("torch.")
        self[dtype] = name
        return name


_DTYPE_NAMES = _DtypeNames()
