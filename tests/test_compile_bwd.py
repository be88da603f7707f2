"""Compile tier, the backward kernels (`kernels/sm90_bwd.py` v1, `kernels/sm90_bwd_ws.py` v2): each
(dtype, head dim, mask, deterministic) compiles for sm_90a without spills, with its five GEMMs as
WGMMAs: S^T, dP^T and dQ from shared memory, dV and dK with A from registers. The GPU tier:
tests/test_gpu_backward.py."""

import re
import tempfile

import pytest

from hopper_fmha.kernels.inspect import kernel_resources, sass, sass_summary

pytestmark = pytest.mark.compile


def cubin_of(compile_fn, *key, **switches):
    """The cubin `compile_fn(*key, **switches)` (compile_bwd, compile_preprocess, ...) builds for sm_90a."""
    with tempfile.TemporaryDirectory() as dump:
        return compile_fn(*key, **switches, options=f"--keep-cubin --dump-dir={dump}").artifacts.CUBIN


def bwd_cubin(*key, **switches):
    from hopper_fmha.kernels.sm90_bwd import compile_bwd

    return cubin_of(compile_bwd, *key, **switches)


def stack_bytes(cubin) -> int:
    return kernel_resources(cubin)["stack_bytes"]


def sass_or_skip(cubin) -> str:
    """The cubin's SASS; the test is skipped where nvdisasm is missing."""
    try:
        return sass(cubin)
    except RuntimeError as e:
        pytest.skip(str(e))


# Every (head dim, mask, mode, version) in bf16; fp16 (the same code but the MMA's input type) at
# one of each version, to keep the compile tier's time in CI.
BWD_CONFIGS = [
    ("bfloat16", d, causal, det, version)
    for version in (1, 2)
    for det in (False, True)
    for causal in (False, True)
    for d in (64, 128)
] + [("float16", 128, True, False, 1), ("float16", 128, True, False, 2)]


@pytest.mark.parametrize(
    "dtype,head_dim,causal,deterministic,version",
    BWD_CONFIGS,
    ids=[
        "-".join((dt, f"d{d}", "causal" if c else "full", "deterministic" if det else "atomic", f"v{v}"))
        for dt, d, c, det, v in BWD_CONFIGS
    ],
)
def test_backward_compiles_without_spills(dtype, head_dim, causal, deterministic, version):
    cubin = bwd_cubin(dtype, head_dim, causal, deterministic, version)
    assert stack_bytes(cubin) == 0, f"{stack_bytes(cubin)} bytes of stack: registers spill"
    text = sass_or_skip(cubin)
    summary = sass_summary(text)
    assert summary["ldl"] == 0 and summary["stl"] == 0
    # Per query block: S^T and dP^T (K = d, 16 per WGMMA), dQ (K = 64 keys in v1, 128 in v2, a
    # warpgroup per half of d); dV and dK (K = 64 queries) with A from registers.
    assert summary["hgmma_ss"] == 2 * head_dim // 16 + 64 * version // 16
    assert summary["hgmma_rs"] == 2 * 64 // 16
    dq_n = head_dim if version == 1 else head_dim // 2
    assert f"64x{dq_n}x16" in summary["hgmma_shapes"]
    if version == 2:  # the register split (setmaxnreg) took effect
        assert "USETMAXREG" in text
        # A query block's LSE log2 e and D come by TMA with its Q and dO (the first GPU profile:
        # per-column global loads of them stalled the consumers for a third of the kernel's time):
        # no LDG is left (the deterministic mode's semaphore polls are generic LD.E.STRONG.GPU).
        assert "UTMALDG.3D" in text  # (s_pad, h, b) rows
        assert "LDG.E" not in text
        # dQ by TMA reduce-add (deterministic too, at the CTA's turn), no per-thread atomics.
        assert "UTMAREDG.4D.ADD" in text and "G.E.ADD.F32x2" not in text
    assert summary["utmaldg"] > 0
    # The semaphores' GPU-scope fence (release) exists in deterministic mode only.
    assert ("MEMBAR.ALL.GPU" in text) == deterministic


# Score features and varlen (v2 only): (dtype, head dim, causal, deterministic, mha, dkv_atomic,
# left, right, softcap, varlen). Each side of the window, softcap and varlen is a compile-key field
# (the sizes and offsets are runtime).
FEATURE_CONFIGS = [
    ("bfloat16", 64, True, False, False, True, True, False, False, False),
    ("bfloat16", 128, True, True, False, False, True, False, False, False),
    ("bfloat16", 64, False, True, False, False, True, True, False, False),
    ("bfloat16", 128, False, False, False, True, True, True, False, False),
    ("bfloat16", 128, False, False, True, False, False, True, False, False),
    ("bfloat16", 64, False, False, True, False, False, False, True, False),
    ("bfloat16", 128, True, False, False, True, False, False, True, False),
    ("float16", 128, True, True, False, False, True, False, True, False),
    ("bfloat16", 128, True, True, False, False, False, False, False, True),
    ("bfloat16", 64, False, False, False, True, False, False, False, True),
    ("bfloat16", 128, False, False, False, True, False, False, False, True),
    ("bfloat16", 128, False, False, True, False, True, True, False, True),
    ("bfloat16", 128, True, False, False, True, True, False, True, True),
]
# Spills measured with both compilers (cu12 / cu13 ptxas), in bytes of stack: d128 with softcap
# keeps a few loop-invariant addresses on the stack (reloaded once per query block: 56-64 B; 72 B
# with cu13 for varlen + a left window + softcap since the varlen padded start is rounded to a
# whole query block, session 23), as do d128's two-sided windows and varlen (8 B); every other
# configuration has none.
FEATURE_STACK_LIMIT = {(128, "softcap"): 72, (128, "both"): 16, (128, "varlen"): 16}


def feature_id(cfg):
    dtype, d, causal, det, mha, atomic, left, right, softcap, varlen = cfg
    sides = {(True, True): "both", (True, False): "left", (False, True): "right"}.get((left, right), "")
    parts = (dtype, f"d{d}", "varlen" if varlen else "", "causal" if causal else "", sides)
    parts += ("softcap" if softcap else "",)
    return "-".join(p for p in parts + ("det" if det else "mha" if mha else "gqa",) if p)


@pytest.mark.parametrize("cfg", FEATURE_CONFIGS, ids=[feature_id(c) for c in FEATURE_CONFIGS])
def test_backward_with_score_features_compiles(cfg):
    dtype, d, causal, det, mha, atomic, left, right, softcap, varlen = cfg
    cubin = bwd_cubin(dtype, d, causal, det, 2, mha, atomic, left, right, softcap, varlen)
    present = [
        name for name, on in (("softcap", softcap), ("both", left and right), ("varlen", varlen)) if on
    ]
    limit = max((FEATURE_STACK_LIMIT.get((d, name), 0) for name in present), default=0)
    stack = stack_bytes(cubin)
    assert stack <= limit, f"{stack} bytes of stack (limit {limit}): registers spill"
    text = sass_or_skip(cubin)
    summary = sass_summary(text)
    # The same GEMMs as without features (the mask and softcap act on registers between them).
    assert summary["hgmma_ss"] == 2 * d // 16 + 128 // 16
    assert summary["hgmma_rs"] == 2 * 64 // 16
    assert "USETMAXREG" in text and "UTMAREDG.4D.ADD" in text
    # softcap: the forward's tanh.approx, once per score of the thread's 64 x 64 S^T (32).
    assert text.count("MUFU.TANH") == (32 if softcap else 0)
    assert ("MEMBAR.ALL.GPU" in text) == det


@pytest.mark.parametrize("version", [1, 2], ids=["v1", "v2ws"])
def test_mha_stores_dk_dv_in_the_inputs_type(version):
    # MHA: dK, dV leave as 16-bit values (no fp32 buffers for the host to sum and cast).
    texts = {}
    for mha in (False, True):
        cubin = bwd_cubin("bfloat16", 128, True, False, version, mha)
        assert stack_bytes(cubin) == 0
        texts[mha] = sass_or_skip(cubin)
    assert "STG.E.U16" not in texts[False]
    # v1 stores them from registers; v2 through smem and TMA (`sm90_bwd_ws.DKV_TMA_TILES`).
    assert ("STG.E.U16" in texts[True]) == (version == 1) and ("UTMASTG" in texts[True]) == (version == 2)


@pytest.mark.parametrize(
    "d, causal, tile_m, stack",
    [(128, True, 64, 0), (64, False, 128, 40), (128, False, 80, 40)],
    ids=["64", "128", "80"],
)
def test_mha_dense_dk_dv_by_tma(monkeypatch, d, causal, tile_m, stack):
    # With `sm90_bwd_ws.DKV_TMA_TILES` naming the tile (all three by default since session 25): dK,
    # dV through sK / sV and a TMA store each, two boxes of 64 columns per tensor at d128 (the
    # 128-byte swizzle's span), no 16-bit stores from registers; GQA's fp32 buffers and packed
    # varlen (a ragged key-side view would be needed) keep their stores from registers. Stack: d64
    # tile 128 spills 40 bytes with or without it; tile 80 40 instead of 24.
    from hopper_fmha.kernels import sm90_bwd_ws

    monkeypatch.setattr(sm90_bwd_ws, "DKV_TMA_TILES", (tile_m,))
    mha = bwd_cubin("bfloat16", d, causal, False, 2, True, False, False, False, False, False, tile_m)
    assert stack_bytes(mha) == stack
    text = sass_or_skip(mha)
    assert text.count("UTMASTG") == 2 * (d * 2 // 128) and "STG.E.U16" not in text
    gqa = sass_or_skip(
        bwd_cubin("bfloat16", d, causal, False, 2, False, False, False, False, False, False, tile_m)
    )
    assert "UTMASTG" not in gqa
    packed = bwd_cubin("bfloat16", d, causal, False, 2, True, False, False, False, False, True, tile_m)
    assert "UTMASTG" not in sass_or_skip(packed)


@pytest.mark.parametrize(
    "dtype,head_dim_v,with_dlse",
    [("bfloat16", dv, dl) for dv in (64, 72, 128, 256) for dl in (False, True)] + [("float16", 128, True)],
)
def test_preprocess_compiles(dtype, head_dim_v, with_dlse):
    # D = rowsum(dO * O) - dLSE and LSE log2 e: 128-bit loads of O and dO, scalar loads of the LSE
    # (and dLSE), two fp32 stores per row, no stack.
    from hopper_fmha.kernels.bwd_preprocess import compile_preprocess

    cubin = cubin_of(compile_preprocess, dtype, head_dim_v, with_dlse)
    assert stack_bytes(cubin) == 0
    text = sass_or_skip(cubin)
    assert "LDG.E.128" in text and "STG.E " in text
    assert text.count("LDG.E ") == 1 + with_dlse  # the LSE's (and dLSE's) scalar load per row
    assert text.count("STG.E ") == 2


@pytest.mark.parametrize("dtype,head_dim", [("bfloat16", d) for d in (64, 72, 128, 256)] + [("float16", 128)])
def test_dq_gather_compiles(dtype, head_dim):
    # The varlen dQ's scale, cast and gather (`dq_gather`): per 8 columns two 128-bit loads of
    # fp32 and one 128-bit store of 16-bit values, the row index by one 64-bit load; no stack.
    from hopper_fmha.kernels.dq_gather import compile_dq_gather

    cubin = cubin_of(compile_dq_gather, dtype, head_dim)
    assert stack_bytes(cubin) == 0
    text = sass_or_skip(cubin)
    steps = -(-head_dim // 8 // (1 << (min(16, head_dim // 8).bit_length() - 1)))
    assert text.count("LDG.E.128") == 2 * steps and text.count("STG.E.128") == steps
    assert text.count("LDG.E.64") == 1 and "STG.E " not in text


@pytest.mark.parametrize("head_dim", [64, 128])
def test_gqa_sums_dk_dv_by_vector_atomics(head_dim):
    # v2 with GQA (not deterministic): dK, dV added into per-kv-head fp32 sums, two columns per
    # red.global.add.v2.f32; no stores of them. dQ goes by TMA reduce-add, not by these.
    reds = {}
    for atomic in (False, True):
        cubin = bwd_cubin("bfloat16", head_dim, False, False, 2, False, atomic)
        assert stack_bytes(cubin) == 0
        text = sass_or_skip(cubin)
        reds[atomic] = text.count("REDG.E.ADD.F32x2")
        assert "UTMAREDG.4D.ADD" in text  # dQ's reduce-add, a warpgroup's 64 x d/2 block
    # Per thread: dK and dV's 64 x d rows over 128 threads of a warpgroup, pairs (2 * d / 4).
    assert reds[False] == 0 and reds[True] == head_dim // 2


# d64 with 128-query steps (`sm90_bwd.D64_TILE_M`, FA4's d64 tile; the default at d64 without
# softcap since session 23, 16% / 9% faster than 64 on an H200 despite the spills below; the
# tile-64 kernels above stay spill-free): (dtype, causal, deterministic, mha, dkv_atomic, left,
# right, varlen).
TILE_128_CONFIGS = [
    ("bfloat16", False, False, False, True, False, False, False),
    ("bfloat16", True, True, False, False, False, False, False),
    ("bfloat16", False, False, True, False, True, True, False),
    ("bfloat16", True, True, False, False, True, False, True),
    ("float16", True, False, True, False, False, False, False),
]
# Measured: 32-56 bytes of stack (loop-invariant addresses around dS's stmatrix, reloaded once per
# 128-query block), with the LSE and D of a thread's 32 columns read from smem where used.
TILE_128_STACK_LIMIT = 64


@pytest.mark.parametrize("cfg", TILE_128_CONFIGS, ids=[str(i) for i in range(len(TILE_128_CONFIGS))])
def test_d64_query_tile_128_compiles(cfg):
    dtype, causal, det, mha, atomic, left, right, varlen = cfg
    cubin = bwd_cubin(dtype, 64, causal, det, 2, mha, atomic, left, right, False, varlen, 128)
    assert stack_bytes(cubin) <= TILE_128_STACK_LIMIT, f"{stack_bytes(cubin)} bytes of stack"
    text = sass_or_skip(cubin)
    summary = sass_summary(text)
    # S^T, dP^T: 64 keys x 128 queries per warpgroup, K = 64 (4 each); dQ: 64 rows x 64, K = 128
    # keys (8); dV, dK: K = 128 queries (8 each, A from registers).
    assert summary["hgmma_ss"] == 4 + 4 + 8 and summary["hgmma_rs"] == 16
    assert "64x128x16" in summary["hgmma_shapes"] and "64x64x16" in summary["hgmma_shapes"]
    assert "UTMAREDG.4D.ADD" in text and ("MEMBAR.ALL.GPU" in text) == det


@pytest.mark.parametrize("d, tile_m", [(128, 64), (64, 128)], ids=["d128", "d64-tile128"])
def test_rotated_deterministic_walk_compiles(d, tile_m):
    # The rotated walk (deterministic, no causal or window: `rotate`, compile-key field 12) adds
    # integer work only: the same GEMMs, the semaphores' fences, and no more stack than the
    # plain deterministic kernel of the same tile.
    plain = bwd_cubin("bfloat16", d, False, True, 2, False, False, False, False, False, False, tile_m)
    rotated = bwd_cubin("bfloat16", d, False, True, 2, False, False, False, False, False, False, tile_m, True)
    assert stack_bytes(rotated) <= stack_bytes(plain)
    texts = [sass_or_skip(c) for c in (plain, rotated)]
    summaries = [sass_summary(t) for t in texts]
    for key in ("hgmma_ss", "hgmma_rs"):
        assert summaries[0][key] == summaries[1][key]
    assert all("MEMBAR.ALL.GPU" in t and "UTMAREDG.4D.ADD" in t for t in texts)


# d128 without causal or window with 80-query steps (`sm90_bwd.D128_TILE_M = 80`, FA4's tile, the
# default): (dtype, deterministic, mha, dkv_atomic, varlen, rotate).
TILE_80_CONFIGS = [
    ("bfloat16", False, False, True, False, False),
    ("bfloat16", True, False, False, False, True),
    ("float16", False, True, False, False, False),
    ("bfloat16", False, False, True, True, False),
]
# Measured (cu13): 24 B of stack, 32 deterministic; 40 for MHA with dK/dV by TMA store.
TILE_80_STACK_LIMIT = 40


@pytest.mark.parametrize("cfg", TILE_80_CONFIGS, ids=[str(i) for i in range(len(TILE_80_CONFIGS))])
def test_d128_query_tile_80_compiles(cfg):
    # S^T and dP^T: 64 keys x 80 queries per warpgroup (K = d); dQ^T = K^T dS^T: 64 of d x 80
    # queries (K = 128 keys), so the SS count is that of tile 64; dV and dK take K = 80 (5 RS).
    dtype, det, mha, atomic, varlen, rotate = cfg
    cubin = bwd_cubin(dtype, 128, False, det, 2, mha, atomic, False, False, False, varlen, 80, rotate)
    assert stack_bytes(cubin) <= TILE_80_STACK_LIMIT, f"{stack_bytes(cubin)} bytes of stack"
    text = sass_or_skip(cubin)
    summary = sass_summary(text)
    assert summary["hgmma_ss"] == 2 * 128 // 16 + 128 // 16
    assert summary["hgmma_rs"] == 2 * 80 // 16
    assert "64x80x16" in summary["hgmma_shapes"] and "64x128x16" in summary["hgmma_shapes"]
    assert "UTMAREDG.4D.ADD" in text and ("MEMBAR.ALL.GPU" in text) == det


@pytest.mark.parametrize(
    "d, causal, version, mha, tile_m",
    [
        (128, False, 2, True, 80),
        (64, False, 2, False, 128),
        (128, True, 2, False, 64),
        (128, False, 1, True, 64),
    ],
    ids=["v2-d128-80", "v2-d64-128", "v2-d128-64-causal", "v1-d128"],
)
def test_dq_unscaled_drops_the_per_step_multiplies(d, causal, version, mha, tile_m):
    # `sm90_bwd.DQ_SCALE_AT_CAST` (on at query tiles 64 and 80 since session 27): the kernel
    # adds dS K into dQacc unscaled (the host scales as it casts), so each thread's dQ part loses
    # one FMUL per value: tile_m x d / 2 per warpgroup of 128 threads (v2), 64 x d / 128 (v1);
    # the stack does not grow.
    key = ("bfloat16", d, causal, False, version, mha, False, False, False, False, False, tile_m, False)
    plain, unscaled = bwd_cubin(*key), bwd_cubin(*key, True)
    assert stack_bytes(unscaled) <= stack_bytes(plain)
    fmuls = [len(re.findall(r"\bFMUL\b", sass_or_skip(c))) for c in (plain, unscaled)]
    per_thread = tile_m * d // 2 // 128 if version == 2 else 64 * d // 128
    assert fmuls[0] - fmuls[1] == per_thread


FRAGMENT_CASES = {
    # (d, causal, softcap, tile_m, STS.128 a thread, the plain kernel's stack bytes)
    "d128-tile80": (128, False, False, 80, 10, 40),
    "d128-causal-tile64": (128, True, False, 64, 8, 0),
    "d64-tile128": (64, False, False, 128, 8, 40),
    "d64-softcap-tile64": (64, False, True, 64, 4, 0),
}


@pytest.mark.parametrize("deterministic", [False, True], ids=["plain", "deterministic"])
@pytest.mark.parametrize("case", list(FRAGMENT_CASES))
def test_dq_fragments_stage_in_16_byte_stores(case, deterministic):
    # `sm90_bwd.DQ_FRAGMENTS` (on at query tile 128 since session 27): each
    # warpgroup's dQ part leaves as 16-byte stores (4 accumulator values each) and one 1-D bulk
    # reduce-add (UBLKRED), in place of 4- and 8-byte stores into the swizzled buffer and a TMA
    # reduce-add; the staging's address registers go, and with them the spills of tiles 80, 128.
    d, causal, softcap, tile_m, stores, stack = FRAGMENT_CASES[case]
    key = ("bfloat16", d, causal, deterministic, 2, True, False, False, False, softcap, False, tile_m)
    plain, frag = bwd_cubin(*key, False, False, False), bwd_cubin(*key, False, False, True)
    texts = [sass_or_skip(c) for c in (plain, frag)]
    assert texts[1].count("STS.128") == stores and len(re.findall(r"\bSTS\b(?!\.)", texts[1])) == 0
    assert "UBLKRED.G.S.ADD.F32" in texts[1] and "UTMAREDG" not in texts[1]
    assert texts[0].count("STS.128") == 0 and "UTMAREDG" in texts[0]
    assert stack_bytes(frag) <= min(8, stack_bytes(plain))
    if not deterministic:
        assert stack_bytes(plain) == stack


# The wide kernel (`kernels/sm90_bwd_wide.py`; `backward.WIDE_BACKWARD`, on since its GPU tests
# passed in session 27): dK^T and dV^T with d as WGMMA's M, P and dS through shared memory;
# (256, 256) 48 keys per CTA, the warpgroups splitting d; (192, 128) 96 keys, the warpgroups
# splitting them.
WIDE_CONFIGS = {
    "full": dict(causal=False),
    "causal-mha": dict(causal=True, mha=True),
    "deterministic": dict(causal=True, deterministic=True),
    "window-softcap": dict(causal=False, window_left=True, window_right=True, softcap=True),
    "varlen": dict(causal=True, varlen=True),
    # `sm90_bwd.WIDE_ROTATE`'s walk, with the writer warp and without (a wait at the CTA's turn).
    "rotated": dict(causal=False, deterministic=True, rotate=True),
    "rotated-writer": dict(causal=False, deterministic=True, rotate=True, dq_writer=True),
}
# (S + dP, dV^T + dK^T, dQ WGMMAs a block; their shapes; a thread's 16-bit P and dS words and fp32
# dQ values into shared memory)
WIDE_SHAPES = {
    (256, 256): ((16 + 16, 8 + 8, 4), ["64x32x16", "64x64x16", "64x128x16"], 16 + 64),
    (192, 128): ((12 + 8, 8 + 12, 6), ["64x48x16", "64x96x16"], 24 + 48),
}


@pytest.mark.parametrize("dims", list(WIDE_SHAPES), ids=[f"d{a}-dv{b}" for a, b in WIDE_SHAPES])
@pytest.mark.parametrize("cfg", list(WIDE_CONFIGS))
def test_wide_kernel_compiles_without_spills(cfg, dims):
    (sdp, dkv, dq), shapes, words = WIDE_SHAPES[dims]
    cubin = bwd_cubin("bfloat16", dims[0], head_dim_v=dims[1], **WIDE_CONFIGS[cfg])
    assert stack_bytes(cubin) == 0, f"{stack_bytes(cubin)} bytes of stack: registers spill"
    text = sass_or_skip(cubin)
    summary = sass_summary(text)
    # Per query block, all from shared memory: S and dP (K = d and dv, 16 per WGMMA), dV^T and dK^T
    # (64-row blocks of dv and d, K = 64 queries), dQ (K = the CTA's keys, N = d / 2).
    assert summary["hgmma_ss"] == sdp + dkv + dq and summary["hgmma_rs"] == 0
    assert summary["hgmma_shapes"] == shapes
    assert "USETMAXREG" in text and "UTMAREDG" in text
    # LSE log2 e and D by TMA with Q and dO: no global loads but varlen's cu_seqlens.
    assert ("LDG.E" in text) == (cfg == "varlen")
    # A thread's 4-byte words into shared memory per query block: P and dS as 16-bit pairs, its
    # fp32 values of dQ: nothing stored twice.
    stored = len(re.findall(r"\bSTS\b(?!\.)", text)) + 2 * text.count("STS.64") + 4 * text.count("STS.128")
    assert stored == words


# `sm90_bwd.DQ_FRAGMENTS_WIDE` (session 35): the wide kernel's dQ as the dense kernel's tile 64 in
# fragment order: a thread's d / 4 fp32 values per query block leave as d / 16 16-byte stores and
# one 1-D bulk reduce-add (UBLKRED) per warpgroup, in place of the swizzled buffer's 4- and 8-byte
# stores and a TMA reduce-add; no stack, the P and dS stores as they were.
@pytest.mark.parametrize("deterministic", [False, True], ids=["plain", "deterministic"])
@pytest.mark.parametrize("dims", list(WIDE_SHAPES), ids=[f"d{a}-dv{b}" for a, b in WIDE_SHAPES])
def test_wide_dq_fragments(dims, deterministic):
    cubins = [
        bwd_cubin(
            "bfloat16", dims[0], False, deterministic, head_dim_v=dims[1], dq_writer=True,
            dq_fragments=fragments, dq_chains=2 if deterministic and dims[0] == 256 else 1,
            dq_writer_warps=2 if deterministic else 1,
        )
        for fragments in (False, True)
    ]  # fmt: skip
    plain, frag = (sass_or_skip(c) for c in cubins)
    assert frag.count("STS.128") == plain.count("STS.128") + dims[0] // 16
    assert "UBLKRED.G.S.ADD.F32" in frag and "UTMAREDG" not in frag and "UTMAREDG" in plain
    words = [len(re.findall(r"\bSTS\b(?!\.)", t)) + 2 * t.count("STS.64") for t in (plain, frag)]
    assert words[0] - words[1] == dims[0] // 4  # (the 4- and 8-byte stores: dQ's alone)
    assert stack_bytes(cubins[1]) == 0


# `sm90_bwd_wide`'s other d256 shape, 48 keys (the default until v41, two Q stages, `bwd_profile
# --wide-d256 48`) compiles with no stack, plain and causal-deterministic, a kernel of its own.
@pytest.mark.parametrize("mode", ["plain", "causal-deterministic"])
def test_wide_d256_48_keys_compiles(monkeypatch, mode):
    from hopper_fmha.kernels import sm90_bwd_wide

    causal = deterministic = mode == "causal-deterministic"
    texts = []
    for shapes in (sm90_bwd_wide.SHAPES, sm90_bwd_wide.SHAPES_D256_48):
        monkeypatch.setattr(sm90_bwd_wide, "SHAPES", shapes)
        cubin = bwd_cubin(
            "bfloat16", 256, causal, deterministic, head_dim_v=256, dq_writer=True, dq_fragments=True,
            dq_chains=2 if deterministic else 1, dq_writer_warps=2 if deterministic else 1,
        )  # fmt: skip
        assert stack_bytes(cubin) == 0, f"{shapes[256, 256]}: {stack_bytes(cubin)} bytes of stack"
        texts.append(re.sub(r"/\*[0-9a-f]+\*/", "", sass_or_skip(cubin)))
    assert texts[0] != texts[1]


# `sm90_bwd_ws.DQ_LAPS` (session 35): the deterministic rotated walk in laps, at d256 (the wide
# kernel: 2 chains, 2 writer warps, fragments, as `sm90_bwd.backward` asks for it) and d128 tile 80
# with 3 chains: it compiles, a different kernel, no stack where there was none.
@pytest.mark.parametrize("d, tile, chains", [(256, 64, 2), (128, 80, 3)], ids=["wide-d256", "d128-tile80"])
def test_dq_laps_compiles(monkeypatch, d, tile, chains):
    from hopper_fmha.kernels import sm90_bwd_ws

    cubins = []
    for laps in (False, True):
        monkeypatch.setattr(sm90_bwd_ws, "DQ_LAPS", laps)
        cubins.append(
            bwd_cubin(
                "bfloat16", d, False, True, mha=True, tile_m=tile, rotate=True, dq_writer=True,
                dq_fragments=True, dq_chains=chains, dq_writer_warps=2, head_dim_v=d,
            )
        )  # fmt: skip
    plain, laps = (sass_or_skip(c) for c in cubins)
    assert plain != laps
    assert stack_bytes(cubins[1]) <= max(stack_bytes(cubins[0]), 0 if d == 256 else 8)


# `sm90_bwd.PLAIN_ROTATE` (session 38, off): the non-deterministic kernels walk rotated (d128 tile
# 80, d64 tile 128, the wide d256, as `sm90_bwd.backward` builds them): a different kernel, no more
# stack than the plain walk's.
PLAIN_ROTATE_TILES = [(128, 80), (64, 128), (256, 64)]


@pytest.mark.parametrize("d, tile", PLAIN_ROTATE_TILES, ids=["d128-tile80", "d64", "wide-d256"])
def test_plain_rotated_walk_compiles(d, tile):
    cubins = [
        bwd_cubin(
            "bfloat16", d, False, False, mha=True, tile_m=tile, rotate=rotate, dq_writer=True,
            dq_fragments=True, head_dim_v=d,
        )
        for rotate in (False, True)
    ]  # fmt: skip
    plain, rotated = (sass_or_skip(c) for c in cubins)
    assert plain != rotated
    assert stack_bytes(cubins[1]) <= stack_bytes(cubins[0])


# `sm90_bwd.QDO_MULTICAST` (session 39, off): the plain kernels (as `sm90_bwd.backward` builds them)
# in CTA pairs: Q's and dO's loads become multicast TMAs, half as many as before (each CTA loads
# half of every tile), the pair's barriers are set up across the cluster, and the consumer warps
# signal the peer's empty barriers (a remote arrive); no more stack than the producer's 16 bytes.
@pytest.mark.parametrize("d, tile", PLAIN_ROTATE_TILES, ids=["d128-tile80", "d64", "wide-d256"])
def test_qdo_multicast_compiles(d, tile):
    import re

    cubins = [
        bwd_cubin(
            "bfloat16", d, False, False, mha=True, tile_m=tile, dq_writer=True, dq_fragments=True,
            dq_unscaled=tile in (64, 80), head_dim_v=d, multicast=multicast,
        )
        for multicast in (False, True)
    ]  # fmt: skip
    single, pairs = (sass_or_skip(c) for c in cubins)

    def count(pattern, text):
        return len(re.findall(pattern, text))

    loads = r"UTMALDG\.4D\s"  # Q, dO, K, V tiles (LSE and D are 3-D)
    assert count(r"UTMALDG\.4D\.MULTICAST", single) == 0
    assert count(r"UTMALDG\.4D\.MULTICAST", pairs) == count(loads, single) // 2 > 0
    assert count(loads, pairs) == count(loads, single) // 2
    assert count(r"UCGABAR_WAIT", pairs) >= 1 and count(r"UCGABAR_WAIT", single) == 0
    assert count(r"SYNCS\.ARRIVE\.TRANS64\.RED", pairs) >= 2
    assert stack_bytes(cubins[1]) <= max(stack_bytes(cubins[0]), 16)


# `sm90_bwd_ws.LPT_HEADS` (session 35): the causal non-deterministic kernels (d128 tile 64, d64
# tile 128, the wide d256) take their CTA's place from `lpt_place`: a different kernel, the main
# loop's registers and stack as before; deterministic and varlen kernels ignore it.
@pytest.mark.parametrize("d, tile", [(128, 64), (64, 128), (256, 64)], ids=["d128", "d64", "wide-d256"])
def test_lpt_order_compiles(monkeypatch, d, tile):
    from hopper_fmha.kernels import sm90_bwd_ws

    texts, stacks = {}, {}
    for lpt, deterministic in ((0, False), (4, False), (0, True), (4, True)):
        monkeypatch.setattr(sm90_bwd_ws, "LPT_HEADS", lpt)
        cubin = bwd_cubin(
            "bfloat16", d, True, deterministic, mha=True, tile_m=tile, head_dim_v=d, dq_writer=True,
            dq_fragments=True,
        )  # fmt: skip
        texts[lpt, deterministic] = sass_or_skip(cubin)
        stacks[lpt, deterministic] = stack_bytes(cubin)
    assert texts[4, False] != texts[0, False] and texts[4, True] == texts[0, True]
    assert stacks[4, False] == stacks[0, False]


# `sm90_bwd.VARLEN_DQ_FRAGMENTS` (session 35): the varlen kernels' dQ in fragment order, added from
# each sequence's padded start: one 1-D bulk reduce-add per warpgroup (UBLKRED) instead of the TMA
# reduce-add, no more stack than without, at d128 tile 80 and causal tile 64, d64 tile 128 and the
# wide d256.
@pytest.mark.parametrize(
    "d, causal, tile", [(128, False, 80), (128, True, 64), (64, False, 128), (256, True, 64)],
    ids=["d128-tile80", "d128-causal", "d64", "wide-d256-causal"],
)  # fmt: skip
def test_varlen_dq_fragments_compile(d, causal, tile):
    cubins = [
        bwd_cubin(
            "bfloat16", d, causal, False, varlen=True, tile_m=tile, head_dim_v=d, dq_writer=True,
            dq_fragments=fragments,
        )
        for fragments in (False, True)
    ]  # fmt: skip
    plain, frag = (sass_or_skip(c) for c in cubins)
    assert "UBLKRED.G.S.ADD.F32" in frag and "UTMAREDG" not in frag and "UTMAREDG" in plain
    assert stack_bytes(cubins[1]) <= stack_bytes(cubins[0])


WRITER_CASES = {
    # (d, causal, tile_m, rotate, fragments, varlen, dv)
    "d128-tile80": (128, False, 80, False, False, False, None),
    "d128-causal-tile64": (128, True, 64, False, False, False, None),
    "d64-tile128": (64, False, 128, False, False, False, None),
    "d128-tile80-rotated-fragments": (128, False, 80, True, True, False, None),
    "d128-causal-varlen": (128, True, 64, False, False, True, None),
    # the wide kernel (`sm90_bwd_wide`, since session 27): the same hand-over
    "wide-d256": (256, False, 64, False, False, False, None),
    "wide-d192-dv128-causal": (192, True, 64, False, False, False, 128),
}


@pytest.mark.parametrize("case", list(WRITER_CASES))
def test_dq_writer_warp_compiles(case):
    # `sm90_bwd.DQ_WRITER_WARP` (deterministic; on since session 27):
    # the consumers hand their staged dQ to the writer warp by a barrier arrive (BAR.ARV) and wait
    # for the buffers by a barrier sync, and no longer sync their warpgroup around the staging
    # (3 of the plain kernel's BAR.SYNC go); the writer issues both warpgroups' adds.
    d, causal, tile_m, rotate, fragments, varlen, dv = WRITER_CASES[case]
    key = ("bfloat16", d, causal, True, 2, not varlen, False, False, False, False, varlen, tile_m, rotate)
    key = key + (False, fragments, dv)
    plain, writer = bwd_cubin(*key, False), bwd_cubin(*key, True)
    texts = [sass_or_skip(c) for c in (plain, writer)]
    assert "BAR.ARV" not in texts[0] and texts[1].count("BAR.ARV") >= 2
    assert texts[1].count("BAR.SYNC") == texts[0].count("BAR.SYNC") - 3
    add = "UBLKRED" if fragments else "UTMAREDG"
    assert add in texts[0] and add in texts[1]
    assert stack_bytes(writer) <= stack_bytes(plain) + 8


PLAIN_WRITER_CASES = {
    # (d, causal, tile_m, fragments, mha, varlen)
    "d128-tile80-fragments": (128, False, 80, True, True, False),
    "d128-tile80": (128, False, 80, False, True, False),
    "d128-causal-tile64-gqa": (128, True, 64, False, False, False),
    "d64-tile128-fragments": (64, False, 128, True, True, False),
    "d64-varlen-gqa": (64, False, 128, False, False, True),
    "wide-d256": (256, False, 64, False, True, False),
    "wide-d192-dv128-causal-varlen": (192, True, 64, False, False, True),
}


@pytest.mark.parametrize("case", list(PLAIN_WRITER_CASES))
def test_dq_writer_plain_compiles(case):
    # `sm90_bwd.DQ_WRITER_PLAIN` (session 29; the wide kernel's: `DQ_WRITER_PLAIN_WIDE`, session
    # 31): the writer warp without deterministic mode. The
    # consumers hand dQ over by barrier arrives as in deterministic mode; no turn is taken (no
    # semaphore atomics), and the consumers no longer issue the adds or wait for their bulk groups
    # (the add instructions stay, in the writer's code: one UTMAREDG / UBLKRED site per warpgroup).
    d, causal, tile_m, fragments, mha, varlen = PLAIN_WRITER_CASES[case]
    atomic = not mha and d <= 128  # GQA without deterministic: dK, dV by atomic sums (not wide)
    key = ("bfloat16", d, causal, False, 2, mha, atomic, False, False, False, varlen, tile_m, False)
    key = key + (tile_m in (64, 80), fragments, 128 if d == 192 else None)
    plain, writer = bwd_cubin(*key, False), bwd_cubin(*key, True)
    texts = [sass_or_skip(c) for c in (plain, writer)]
    assert "BAR.ARV" not in texts[0] and texts[1].count("BAR.ARV") >= 2
    assert "ATOMG" not in texts[1]  # (the deterministic writer's turns are ATOMG.E.ADD.STRONG.GPU)
    add = "UBLKRED" if fragments else "UTMAREDG"
    assert add in texts[1]
    assert stack_bytes(writer) <= stack_bytes(plain)
    if tile_m == 80 and fragments:
        assert stack_bytes(writer) == 0  # (the swizzled staging spills 40 bytes there: NOTES "v25")


def test_dq_chains_compile():
    # `sm90_bwd.DQ_CHAINS` (compile-key field 17): the writer warp picks the copy of dQacc and the
    # semaphore by its turn (turn % k, turn // k); same stack, the same adds and turns, more code.
    key = ("bfloat16", 128, False, True, 2, True, False, False, False, False, False, 80, True)
    key = key + (True, False, None, True)
    one, two = bwd_cubin(*key, 1), bwd_cubin(*key, 2)
    texts = [sass_or_skip(c) for c in (one, two)]
    assert texts[0] != texts[1]
    for op in ("UTMAREDG", "ATOMG", "BAR.ARV"):
        assert texts[0].count(op) == texts[1].count(op), op
    assert stack_bytes(two) == stack_bytes(one)


def test_dq_chains_masked_compiles():
    # `sm90_bwd.DQ_CHAINS_MASKED` (on since session 37): the wide d256 kernel, causal and deterministic
    # as `sm90_bwd.backward` asks for it (writer warps 2, fragments), with 2 chains: a different
    # kernel with the same adds and turn sites (the copy and semaphore picked by turn % 2), no
    # more stack.
    cubins = [
        bwd_cubin(
            "bfloat16", 256, True, True, mha=True, tile_m=64, dq_writer=True, dq_fragments=True,
            dq_chains=chains, dq_writer_warps=2, head_dim_v=256,
        )
        for chains in (1, 2)
    ]  # fmt: skip
    one, two = (sass_or_skip(c) for c in cubins)
    assert one != two
    for op in ("UBLKRED", "ATOMG", "BAR.ARV"):
        assert one.count(op) == two.count(op), op
    assert stack_bytes(cubins[1]) <= stack_bytes(cubins[0])


def test_dq_writer_warps_compile(monkeypatch):
    # `sm90_bwd.DQ_WRITER_WARPS` 2 (compile-key field 18; session 31, on since session 32): a second writer
    # warp with the odd steps' barrier pair (ids 9 and 10), so every add and turn site of the
    # writer appears twice; the consumers' staging picks the pair by the step's parity. (Without
    # the first-turn stores, `DQ_STORE_FIRST_MASKED`, whose store / add branch ptxas lays out
    # differently per warp: the add sites then do not simply double.)
    from hopper_fmha.kernels import sm90_bwd_ws

    monkeypatch.setattr(sm90_bwd_ws, "DQ_STORE_FIRST_MASKED", False)
    key = ("bfloat16", 128, True, True, 2, True, False, False, False, False, False, 64, False)
    key = key + (True, False, None, True, 1)
    one, two = bwd_cubin(*key, 1), bwd_cubin(*key, 2)
    texts = [sass_or_skip(c) for c in (one, two)]
    ids = [set(re.findall(r"\bBAR\.(?:SYNC|ARV)\S* (0x[0-9a-f]+)", t)) for t in texts]
    assert not ids[0] & {"0x9", "0xa"} and {"0x9", "0xa"} <= ids[1]
    for op in ("UTMAREDG", "ATOMG"):
        assert texts[1].count(op) == 2 * texts[0].count(op), op
    assert stack_bytes(two) <= stack_bytes(one)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("fragments", [False, True], ids=["rows", "fragments"])
def test_dq_store_first_compiles(monkeypatch, fragments, causal):
    # `sm90_bwd_ws.DQ_STORE_FIRST` (session 32's experiment, on since v33), and with causal
    # `DQ_STORE_FIRST_MASKED` (session 37): the writer warp's first turn of a block stores (TMA
    # store, or in fragment order a 1-D bulk copy) where the others add; no more stack.
    # Deterministic: d128 tile 80 rotated or d64 tile 128 in fragment order; causal, d128 tile 64.
    from hopper_fmha.kernels import sm90_bwd_ws

    d, tile, rotate = (64, 128, False) if fragments else (128, 80, True)
    if causal:
        d, tile, rotate = 128, 64, False
    key = ("bfloat16", d, causal, True, 2, True, False, False, False, False, False, tile, rotate, False)
    key = key + (fragments, None, True)
    cubins = []
    for on in (False, True):
        monkeypatch.setattr(sm90_bwd_ws, "DQ_STORE_FIRST_MASKED" if causal else "DQ_STORE_FIRST", on)
        cubins.append(bwd_cubin(*key))
    off, on = (sass_or_skip(c) for c in cubins)
    store = "UBLKCP" if fragments else "UTMASTG"  # (rows: dK, dV may leave by TMA store too)
    if fragments:
        assert store not in off
    assert on.count(store) > off.count(store)
    assert stack_bytes(cubins[1]) <= stack_bytes(cubins[0])


def mufu_after_dp_wait(text: str) -> int:
    """MUFU.EX2 between the wait for dP^T (the `WARPGROUP.DEPBAR.LE gsb0, 0x0` with the most of
    them before the next HGMMA) and that HGMMA."""
    lines = text.splitlines()
    counts = []
    for i, line in enumerate(lines):
        if "DEPBAR.LE gsb0, 0x0" in line:
            n = 0
            for after in lines[i + 1 :]:
                if "HGMMA" in after:
                    break
                n += "MUFU.EX2" in after
            counts.append(n)
    return max(counts)


def d64_tile128_key(causal: bool) -> tuple:
    """compile_bwd's key of the d64 MHA kernel at tile_m 128 (bf16, v2, dQ in fragment order)."""
    flags = (False,) * 5  # GQA atomics, window sides, softcap, varlen: off
    return ("bfloat16", 64, causal, False, 2, True, *flags, 128, False, False, True)


@pytest.mark.parametrize("early", [None, "quarter"])
def test_exp_early_moves_exponentials_after_the_dp_wait(monkeypatch, early):
    # `sm90_bwd_ws.EXP_EARLY`: at d64's tile 128 (32 query columns a thread) the default (None:
    # `EXP_EARLY_BY_TILE`, "half" there, v34) leaves 16 columns' exponentials (32 MUFUs) before the
    # wait for dP^T, in each branch of the mask, and issues the other 32 after it, shared by both;
    # "quarter" leaves 8 columns (16 MUFUs) and issues 48 after it. ptxas keeps them there (at d128
    # it hoists some above the wait). "all" issues every one before the wait. No stack.
    from hopper_fmha.kernels import sm90_bwd_ws

    assert sm90_bwd_ws.EXP_EARLY is None and sm90_bwd_ws.EXP_EARLY_BY_TILE.get(128) == "half"
    key = d64_tile128_key(causal=False)
    cubins = []
    for setting in ("all", early):
        monkeypatch.setattr(sm90_bwd_ws, "EXP_EARLY", setting)
        cubins.append(bwd_cubin(*key))
    off, on = (sass_or_skip(c) for c in cubins)
    after = 48 if early == "quarter" else 32
    assert mufu_after_dp_wait(off) == 0 and mufu_after_dp_wait(on) >= after - 1
    assert off.count("MUFU.EX2") == 128 and on.count("MUFU.EX2") == 128 - 2 * 64 + 2 * (64 - after) + after
    assert stack_bytes(cubins[0]) == stack_bytes(cubins[1]) == 0


@pytest.mark.parametrize(
    "dtype, d, tile, copies",
    [
        ("bfloat16", 64, 128, 1), ("float16", 128, 64, 1), ("bfloat16", 64, 64, 1), ("float16", 128, 80, 1),
        ("bfloat16", 256, 64, 2), ("float16", 128, 64, 3),
    ],
)  # fmt: skip
@pytest.mark.parametrize("mapped", [False, True], ids=["dense", "mapped"])
def test_dq_unfragment_kernel_compiles(dtype, d, tile, copies, mapped):
    # `dq_unfragment` (`sm90_bwd.DQ_UNFRAGMENT_KERNEL`): each thread's loads first (in batches of
    # up to 16 // copies chunks), one 16-byte load per 512-float chunk of the block (tile * d / 512
    # of them) and copy (`DQ_CHAINS`' copies, summed), then two 4-byte stores per chunk (tile 80,
    # transposed: four 2-byte stores); no stack, few registers. Copies are the dense backward's
    # only (mapped: the varlen one's, which has no chains).
    from hopper_fmha.kernels.dq_unfragment import compile_dq_unfragment, load_batch

    if mapped and copies > 1:
        with pytest.raises(AssertionError):
            compile_dq_unfragment(dtype, d, tile, mapped, copies)
        return
    cubin = cubin_of(compile_dq_unfragment, dtype, d, tile, mapped, copies)
    text = sass_or_skip(cubin)
    chunks = tile * d // 512
    store = "STG.E.U16 " if tile == 80 else "STG.E "
    assert text.count("LDG.E.128") == chunks * copies
    assert text.count(store) == (4 if tile == 80 else 2) * chunks
    assert text.count("FADD") >= chunks * 4 * (copies - 1)  # (each value's adds of the copies)
    # mapped (`unfragment_dq_rows`, the varlen backward): each row's destination, a 4-byte load
    assert ("LDG.E " in text) == mapped
    batch = load_batch(chunks, copies)
    assert batch * copies <= 16
    for first in range(0, chunks, batch):  # each batch's loads before its first store
        span = slice(first * copies, (first + batch) * copies)
        loads = [i for i in range(len(text)) if text.startswith("LDG.E.128", i)][span]
        assert text.find(store, loads[0]) > loads[-1]
    res = kernel_resources(cubin)
    assert res["stack_bytes"] == 0 and res["registers"] <= 128
