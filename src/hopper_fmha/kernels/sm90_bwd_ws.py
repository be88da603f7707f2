"""Backward pass, second version: warp-specialized (the default; verified on an H200 2026-11-25,
tests/test_gpu_backward.py).

The first version's arithmetic (`sm90_bwd`, whose docstring defines it: S^T, P^T, dP^T, dS^T
with the keys as rows) in the forward ws kernel's structure: one producer warp issues every
load, two consumer warpgroups compute. A CTA owns 128 keys of one (batch, q head), consumer
warpgroup w the keys [64w, 64w + 64), so each query block's Q and dO (64 rows) are loaded once
per 128 keys (v1: per 64) and the dQ of 128 keys leaves in one reduce-add per warpgroup. Per
query block m, each consumer warpgroup (LSE log2 e and D of the block's rows arrive by TMA with Q
and dO, from the preprocess):

    S^T_w = K_w Q_m^T,  dP^T_w = V_w dO_m^T     SS-WGMMA, 64 keys x 64 queries (dP^T issued
                                                before P^T is computed, so it runs beside it)
    P^T_w, dS^T_w in registers                  the mask only on blocks that need it
    dS^T_w -> rows [64w, 64w + 64) of sdS[m % 2]  stmatrix, then a named barrier over both
    dV_w += P^T_w dO_m,  dK_w += dS^T_w Q_m     RS-WGMMA
    dQ_m[:, half w] = dS_m K[:, half w]         SS-WGMMA, M = 64 queries, N = d / 2, K = 128
                                                keys: dS_m from both warpgroups (sdS read
                                                transposed), K^T's columns of half w
    dQacc[m][:, half w] += scale * that         through sdQ[w] (fp32, 128B-swizzled) by one TMA
                                                reduce-add (deterministic: at the CTA's turn,
                                                complete before the turn passes, which it
                                                does during the next block's first GEMMs)

Q and dO stream through two-stage TMA pipelines (the producer runs up to two query blocks ahead),
released when a block's last GEMM has read them. sdS has two buffers: when a warpgroup passes
block m + 1's barrier, the other has finished block m (its dQ GEMM read sdS[m % 2] included), so
block m + 2 may overwrite that buffer. sdQ has one buffer per warpgroup: its first warp waits
until the previous block's reduce-add has read it before the warpgroup writes it again.
Deterministic mode: `sm90_bwd`'s semaphores with 128-key blocks (one turn per CTA, both
warpgroups' halves of dQ inside it; dQ is staged in sdQ before the turn is waited for). A CTA
releases a block's turn once its reduce-adds are complete, but not in place: during the next
block's S^T and dP^T GEMMs (`release_turn`; waiting in place cost ~1 block in 5 at d128). Without
causal or window (`rotate`) CTA n starts its walk at query block n * (C // num_n) and wraps, so
the CTAs of a head do not all queue at block 0 (the plain ascending order made CTA n wait n turns
there); the turns follow the arrival order (`turn`). With `dq_writer` the turns are waited for and
passed, and the adds issued, by the producer warpgroup's second warp instead (`write_dq`), so the
consumers never wait for a turn, only (one block later) for their dQ buffers. `dq_chains` k > 1
(writer, dense): a block's turns form k interleaved chains, turn t adding into copy t % k of
dQacc's rows after turn t - k, so a block's hand-offs run k at a time; the host sums the copies
in a fixed order.

The epilogue writes dK * scale and dV per q head (MHA: in the inputs' type), or, with GQA and not
deterministic (`dkv_atomic`), adds them into per-kv-head fp32 sums (red.global.add.v2.f32), so
the host casts instead of summing a group's heads.

Score features and sequences (compile-key fields; `mask.Mask` and `seqlen.SeqlenInfo` are the
parts): a window's sides give the query blocks a key block visits (`Mask.query_block_range`, the
forward's block range seen from the key side) and the element mask; softcap recomputes the
forward's tanh and multiplies dS by its derivative (`capped_probabilities`); a learnable sink
needs nothing here (the LSE holds it; the host derives its gradient). Varlen: a CTA per key
block of the longest key sequence, (sequence, head); the query side's fp32 buffers (LSE, D,
dQacc) are padded per sequence (`padded_rows`).

tile_m (queries per step) is 64, or 128 at d64 (FA4's d64 tile, the default there: 16% faster
non-causal, 9% causal, H200 2026-11-27; it spills 32-56 B, loop-invariant addresses): S^T
of 64 keys x 128 queries per warpgroup, and dQ split by query rows, each warpgroup 64 rows x d.
Or 80 at d128 without causal, window or softcap (FA4's tile there, the default since session 24:
1-8% faster, `sm90_bwd.D128_TILE_M`): S^T of 64 keys x 80 queries, and dQ^T = K^T dS^T
per warpgroup for its half of d (WGMMA's M is 64 rows a warpgroup, so dQ itself cannot have 80),
staged transposed into the (80, d / 2) TMA box; shared memory 226.3 KB of 227.

Arguments and host side: as `sm90_bwd.BwdSm90` (the same `backward` drives both; the
semaphores count tile_m-row query blocks).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir import ir
from cutlass._mlir.dialects import vector
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from .mask import Mask
from .seqlen import SeqlenInfo
from .sm90_bwd import BwdSm90
from .sm90_common import (
    LOG2_E,
    acc_mn_layout,
    acc_to_operand_a_layout,
    bulk_reduce_add_f32,
    bulk_store_f32,
    convert,
    gemm,
    smem_layout,
    stmatrix_copy,
    tiled_mma_64,
)

WARPGROUP = 128
NUM_THREADS = 3 * WARPGROUP  # producer warpgroup (one warp loads) + two consumer warpgroups
NUM_MMA_THREADS = 2 * WARPGROUP
TILE_M = 64  # queries per step
TILE_N = 128  # keys per CTA, 64 per consumer warpgroup
STAGES = 2  # Q and dO pipeline stages
# Producer, consumers (setmaxnreg, which ptxas honours only with min_blocks_per_mp=1 at launch):
# 24 * 128 + 240 * 256 <= 64K.
REGISTERS = (24, 240)
BARRIER_DS = 1  # named barrier: both consumer warpgroups' dS^T rows are in sdS
BARRIER_TURN = 2  # deterministic mode: the CTA's turn to add dQ has come / its adds are done
BARRIER_DQ = 3  # + warpgroup: its dQ buffer is free / written (TMA reduce-add of dQ)
# The query tiles whose MHA dense kernels store dK, dV through shared memory and TMA (`dkv_by_tma`;
# the others, 2-byte stores from registers, 4x the L2 sectors the data needs: ncu, NOTES "v24").
# All three of the dense kernels' tiles (session 25, H200, bwd_profile bf16 B4 N4096: d128 tile 80
# 503/470 -> 536/504 TFLOP/s, tile 64 490 -> 519/527, d64 tile 128 431 -> 441/434; GPU test
# `test_gpu_backward.py -k dkv_by_tma`). Read when a kernel is built (`sm90_bwd._compiled` keeps
# the kernels built before a change).
DKV_TMA_TILES: tuple[int, ...] = (64, 80, 128)
# Where a consumer reads its query columns' LSE log2 e from sLSE (d128's tiles without softcap,
# which keep them in registers): "after_s" (after the S^T GEMM's issue, as from session 21 to 31),
# "before_s" (before it) or "after_dp" (after the dP^T GEMM's issue). Why (session 32): v30's ncu of
# d128 causal put 8% of the stall samples at the dP^T GEMM's fence, which waits for the LDS issued
# behind the S^T GEMM's shared-memory reads. Predicted +2-4% at d128 causal, best "after_dp" (no
# fence after the load). Measured (H200, session 32, `bwd_profile --versions 2 --lse-load`, bf16
# B4 N4096 H16, TFLOP/s, after_s / before_s / after_dp, twice): d128 causal (tile 64) 451 / 482 / 443
# and 421 / 482 / 407; d128 (tile 80) 557 / 560 / 554 and 531 / 558 / 545. "before_s" wins (+7% at
# causal); "after_dp" does not, so the fence was not the whole story: the LDS behind the GEMM's reads
# also delays the exponentials. 754 d128 GPU tests passed with each of the two new places. Read when
# a kernel is built, like `DKV_TMA_TILES`.
LSE_LOAD = "before_s"
# How many of a consumer thread's query columns take their exponentials before the wait for dP^T
# ("all", "half", "quarter", "none"), without softcap. The other columns get S scale log2 e - LSE
# log2 e (-inf where masked) before the wait, in place, and their exponentials after it, each
# column's just before its dS, in one basic block, so that ptxas can interleave the MUFUs with dS's
# arithmetic, packing and stores. Why: v33's ncu of d64 (`ncu-d64.txt` in
# `bench/results/2026-11-28-h200-v33/probes/`) put 82 k stall samples between the S^T and dP^T
# waits in ours (the 64 exponentials, ~40 of them back to back) against FA4's 31 k; FA4 issues 12
# of 64 before the wait and the rest among dS's instructions. Predicted +2-4% at d64, less at d128.
# v34 (H200, bf16 B4 N4096, `bwd_profile --ab`, 8 rounds, TFLOP/s all / half / quarter / none):
# d64 (tile 128) 439 / 471 / 467 / 470, causal 384 / 412 / 412 / 400; d128 (tile 80) 528 / 528 /
# 518 / 514, causal (tile 64) 459 / 453 / 448 / 429. So "half" at tile 128, "all" elsewhere
# (`EXP_EARLY_BY_TILE`, query tile -> setting; "all" where absent); EXP_EARLY, where not None,
# overrides it for every tile (measurements, tests). 1796 d64/d128 GPU tests passed at "half" for
# every tile. Read when a kernel is built.
EXP_EARLY = None
EXP_EARLY_BY_TILE = {128: "half"}
EXP_EARLY_SHARES = {"all": 1.0, "half": 0.5, "quarter": 0.25, "none": 0.0}
# Deterministic dQ without zeroing dQacc (session 32's experiment, on since v33). With the
# writer warp, without causal, window or varlen, every query block takes a turn from every key
# block, so the first turn of each block (of each chain copy, `sm90_bwd.DQ_CHAINS`) writes its dQ
# with a TMA store (fragment order: a 1-D bulk copy) instead of a reduce-add, and the host
# allocates dQacc without zeroing it (`store_first`). Why: the zero fill writes all of dQacc once
# more (128 MB at d128 B4 N4096 H16: ~40 us of ~2.4 ms, d256's two chain copies ~85 us). Predicted
# +1-2% deterministic there; measured (v33, `bwd_profile` off/on twice) d128 502/512 -> 554/523
# TFLOP/s, d256 257/253 -> 267/278, d64 flat; 933 deterministic tests passed. On. Read when a
# kernel is built, like `DKV_TMA_TILES`.
DQ_STORE_FIRST = True
# The same with causal or a window (session 37). There a query block's turns are the key blocks
# its rows see (`Mask.block_range_local`), so the host zeroes dQacc's copies from the fewest turns
# any block gets (`sm90_bwd.fewest_turns`) on: with causal and seqlen_k >= seqlen_q every block
# gets a turn (d256's 48-key CTAs: at least 2), and dQacc goes unzeroed. Why: deterministic d256
# causal runs at 81-82% of plain (v37, H100; target 85%), and its two zeroed chain copies are 256
# MB of writes (~85 us of ~2.8 ms); the first turn's store also skips the add's read. Predicted:
# +2-5% at d256 causal deterministic, +1-3% at d64 / d128 causal deterministic. Measured (H100,
# session 37, `bwd_profile --ab`, bf16 B4 N4096, 6 rounds): d256 causal 244.9 -> 253.5 TFLOP/s
# (+3.5%, rounds apart), d128 causal 459 -> 454, d64 causal 408 -> 413 (both within the rounds'
# spread); the backward preset then put d256 causal deterministic at 86% of plain (81-82% before).
# 588 deterministic GPU tests passed with it (causal, windows, 2-3 chains at every head dim). Read
# when a kernel is built.
DQ_STORE_FIRST_MASKED = True


def store_first(deterministic: bool, dq_writer: bool, masked: bool, varlen: bool) -> bool:
    """Whether a deterministic kernel stores its first turn's dQ (`DQ_STORE_FIRST`, with causal or
    a window `DQ_STORE_FIRST_MASKED`): the kernel (`set_dq_writer`) and the host (dQacc not zeroed)
    ask the same. masked: causal or a window."""
    on = DQ_STORE_FIRST and (DQ_STORE_FIRST_MASKED or not masked)
    return on and deterministic and dq_writer and not varlen


# Deterministic dQ's chains as laps (session 35; on since session 36): with the rotated walk
# (`rotate`) and k > 1 chain copies, the key blocks of a head split into k contiguous laps, lap l
# adding into copy l, each lap its own rotated walk and turn order (`lap_of`), in place of the turns'
# parity (`dq_chains`: turn t into copy t % k). Why: the rotation's stride is C // num_n query blocks
# and is 0 where a head has more key blocks (CTAs) than query blocks: d256's 48-key CTAs at N 4096
# are 86 against 64 query blocks, so every CTA starts at the same block and CTA t waits for t / k
# hand-offs before its first add (the start-up skew of the plain walk). Laps of 43 rotate with
# stride 1, as d192/dv128's 43 CTAs a head do (deterministic at 98% of plain there, d256 at 75%:
# v35's backward-features and backward presets), and three laps fill 129 of 132 SMs. Predicted:
# deterministic d256 75% -> 85-95% of plain; measured (v36, H200): 272 -> 293 TFLOP/s, 81% of plain.
# Read when a kernel is built, like `DQ_STORE_FIRST`.
DQ_LAPS = True


def lap_of(n_block, num_n, laps: int, imin=min):
    """(lap, index in the lap, the lap's key blocks) of key block n_block among num_n in `laps`
    contiguous laps of ceil(num_n / laps) (the last may be shorter; with num_n < laps some are
    empty). Branch-free, so that the kernel (imin = cutlass.min, Int32 values) and the host tests
    (ints) run the same arithmetic."""
    size = (num_n + laps - 1) // laps
    lap = n_block // size
    return lap, n_block - lap * size, imin(size, num_n - lap * size)


def laps_reached(num_n: int, laps: int) -> int:
    """How many of the `laps` copies of dQacc get a turn at all (`lap_of`: the non-empty laps)."""
    return lap_of(num_n - 1, num_n, laps)[0] + 1 if num_n > 0 else 0  # (the last block's lap, + 1)


# The order CTAs take their (key block, head, batch) in the non-deterministic causal kernels (dense;
# session 35; 4 since session 36): 0 is the grid's own (key blocks fastest: each head's longest CTA, key
# block 0, first, so the last heads' longest start in the last wave), k > 0 groups of k (head,
# batch) pairs taken key block by key block, longest first (`lpt_place`): FA3/FA4's longest-first
# order, kept to k heads at a time for L2's sake. Why: causal key block n sees the query blocks
# from its diagonal on, so CTA lengths fall from num_m to ~1. A list-scheduling model (132 SMs,
# CTA time = its query blocks) puts the grid's order at 1.070x / 1.035x / 1.038x the ideal
# makespan at d128 / d64 / d256 causal B4 N4096, groups of 4 or 8 at 1.000-1.009x. Predicted:
# +3-6% at d128 causal, +2-3% at d64 and d256 causal; measured (v36, H200, bf16): +5.6% at d128
# causal, +0.6% and +0.8% at d64 and d256 causal (8 heads: no better). Deterministic runs keep their launch
# order, which their turns follow (a turn must not wait on a CTA that launches later). Read when a
# kernel is built, like `DQ_STORE_FIRST`.
LPT_HEADS = 4


def lpt_place(bx, by, bz, grid, group: int, imin=min):
    """(key block, head, batch) of the CTA launched as (bx, by, bz) in a grid (X, Y, Z) = (key
    blocks, heads, batch) under `LPT_HEADS` = group: launch index x = bx + X (by + Y bz); the
    (head, batch) pairs hb = head + Y batch in groups of `group` (the last may be smaller), each
    group's X * size CTAs taken key block by key block. A bijection of the grid. Branch-free (the
    kernel passes Int64 values and cutlass.min; the host tests ints)."""
    x_len, y_len, z_len = grid
    x = bx + x_len * (by + y_len * bz)
    span = group * x_len
    first = x // span * group  # the group's first pair
    size = imin(group, y_len * z_len - first)
    rest = x - first * x_len
    n = rest // size
    hb = first + rest - n * size
    return n, hb - hb // y_len * y_len, hb // y_len


BARRIER_DKV = 5  # both consumer warpgroups: sK, sV free for dK, dV / dK, dV written (`store_dkdv_tma`)
# `sm90_bwd_wide`'s: both consumer warpgroups' GEMMs of a block have read its one sP/sdS buffer. The
# named barriers of both kernels are numbered here, so that no id meets with two thread counts.
BARRIER_PDS_FREE = 6
# `dq_writer`: both consumer warpgroups' dQ parts are staged / the writer warp has read them
# (consumers 256 threads + the writer's 32).
BARRIER_DQ_FULL = 7
BARRIER_DQ_EMPTY = 8
# `sm90_bwd.DQ_WRITER_WARPS` 2: the odd steps' pair (the even steps' are the two above).
BARRIER_DQ_FULL_ODD = 9
BARRIER_DQ_EMPTY_ODD = 10
DQ_WRITER_THREADS = NUM_MMA_THREADS + 32


class BwdWsSm90(BwdSm90):
    """Compile-time configuration of the warp-specialized backward kernel; `__call__` launches it
    with `sm90_bwd.BwdSm90.__call__`'s arguments. The deterministic turns (`wait_turn`,
    `pass_turn`) are BwdSm90's, over this kernel's `sync_turn`."""

    # Keys per CTA and the stages of the Q and dO pipelines (`sm90_bwd_wide` has others); the
    # producer, the CTA's setup and the walk read them from here.
    tile_n = TILE_N
    q_stages = STAGES
    do_stages = STAGES
    # Whether P goes through shared memory beside dS (`sm90_bwd_wide`): the kernel's sdS is then
    # the pair (sP, sdS).
    p_in_smem = False

    def __init__(
        self,
        dtype,
        head_dim: int,
        causal: bool,
        deterministic: bool = False,
        dkv_atomic: bool = False,
        window_left: bool = False,
        window_right: bool = False,
        softcap: bool = False,
        varlen: bool = False,
        tile_m: int = TILE_M,
        rotate: bool = False,
        dq_unscaled: bool = False,
        dq_fragments: bool = False,
        dq_writer: bool = False,
        dq_chains: int = 1,
        dq_writer_warps: int = 1,
        multicast: bool = False,
    ):
        """dkv_atomic: mdK, mdV are (b, s_k, h_kv, d) fp32, zeroed, and every q head of a GQA
        group adds its dK, dV into its kv head's by red.global.add.v2.f32 (the order of a
        group's additions varies: not with deterministic); else they are written per q head.
        window_left / window_right: the rows' windows have that side (`mask.Mask`: not a right
        side with causal); softcap: the scores were capped (sizes and cap: `__call__`'s).
        varlen: packed sequences (`__call__`'s cu_seqlens; the module docstring's layouts).
        tile_m: queries per step, 64 or (d64 only) 128, FA4's d64 tile: S^T of 64 keys x 128
        queries per warpgroup, and dQ split by query rows (each warpgroup 64 rows x d, K = 128
        keys) instead of by column halves.
        rotate (no causal or window: every key block visits every query block): CTA n walks the
        query blocks from n * (C // num_n) on, wrapping (C query blocks, num_n key blocks), and
        (deterministic) the turns at block m go in the order the CTAs reach it (`turn`). The host
        sets it, deterministic, only where a head's key blocks fit on the GPU at once
        (`sm90_bwd.rotates`): the order has one wrap-around wait on a later-launched CTA; not
        deterministic, with `sm90_bwd.PLAIN_ROTATE`.
        dq_writer: dQ's reduce-adds are issued (deterministic: the turns waited for and passed)
        by a warp of its own (the producer warpgroup's second, `write_dq`); the consumer
        warpgroups only stage dQ and go on (`sm90_bwd.DQ_WRITER_WARP`, `DQ_WRITER_PLAIN`).
        dq_chains (deterministic, dq_writer, dense): the turns at a query block split into this
        many interleaved chains, turn t adding into copy t % dq_chains of dQacc (`write_dq`).
        dq_writer_warps (deterministic, dq_writer): 1, or 2 writer warps taking the walk's even and
        odd steps (`sm90_bwd.DQ_WRITER_WARPS`).
        multicast: CTA pairs share their Q and dO loads (`set_pairs`; `sm90_bwd.QDO_MULTICAST`)."""
        assert head_dim in (64, 128), "the warp-specialized backward takes head_dim 64 or 128"
        assert not (dkv_atomic and deterministic), "atomic dK/dV sums have no fixed order"
        assert not (causal and window_right), "causal is the right limit 0"
        assert tile_m in (TILE_M, 80) or (tile_m == 2 * TILE_M and head_dim == 64), "tile_m 128: d64 only"
        assert tile_m != 80 or (head_dim == 128 and not (causal or window_left or window_right or softcap)), (
            "tile_m 80: d128 without causal, window or softcap"
        )
        assert not rotate or not (causal or window_left or window_right), "rotate: no causal or window"
        assert LSE_LOAD in ("before_s", "after_s", "after_dp"), f"LSE_LOAD {LSE_LOAD!r}"
        assert EXP_EARLY is None or EXP_EARLY in EXP_EARLY_SHARES, f"EXP_EARLY {EXP_EARLY!r}"
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim  # (v's, dO's: `sm90_bwd_wide` has its own)
        self.causal = causal
        self.deterministic = deterministic
        self.dkv_atomic = dkv_atomic
        self.window_left = window_left
        self.window_right = window_right
        self.softcap = softcap
        self.varlen = varlen
        self.tile_m = tile_m
        self.dq_unscaled = dq_unscaled  # `BwdSm90`'s: no softmax scale on dQ's parts
        # dQ leaves in fragment order (`stage_dq`, `issue_dq`): dense (`sm90_bwd.DQ_FRAGMENTS`).
        self.dq_fragments = dq_fragments
        self.dq_writer = dq_writer
        self.set_dq_writer(dq_chains, dq_writer_warps)
        # dQ per warpgroup: 64 rows x d / 2 columns (tile_m 64), or 64 of the 128 rows x d.
        self.dq_by_rows = tile_m == 2 * TILE_M
        # tile_m 80 (FA4's d128 non-causal tile): dQ = dS K has M = 80 queries, which WGMMA does
        # not take (64 rows per warpgroup), so each warpgroup computes dQ^T = K^T dS^T for its
        # half of d (M = d / 2, N = 80, K = 128 keys), staged transposed into the (80, d / 2) box.
        self.dq_swapped = tile_m == 80
        self.dq_tile = (TILE_M, head_dim) if self.dq_by_rows else (tile_m, head_dim // 2)
        # The dQ GEMM's tile per warpgroup (its M, N).
        self.dq_mma_tile = (head_dim // 2, tile_m) if self.dq_swapped else self.dq_tile
        # A stage of sLSE / sD is a TMA load's destination, which must start 128-byte aligned:
        # stages sit 32 floats apart at least (tile_m 80's 320-byte stages faulted on the GPU with
        # "misaligned address" at the second query block).
        self.rows_stride = -(-tile_m // 32) * 32
        # Query tiles of tile_m rows, key tiles of the CTA's 128 keys.
        self.mask = Mask(tile_m, TILE_N, causal, window_left, window_right)
        # Deterministic turns descend from a query block's last key block when rows have a right
        # limit (the CTAs of later key blocks reach the block first), and CTAs launch in that order.
        self.descending = causal or window_right
        self.rotate = rotate
        self.dkv_tma = tile_m in DKV_TMA_TILES
        self.set_pairs(multicast)

    def set_pairs(self, multicast: bool):
        """multicast: the CTAs launch in clusters of two neighbouring key blocks of one (head,
        batch) (the grid's key blocks rounded up to even: a CTA past the keys loads zeros for K and
        V, adds zeros into dQ and stores no row), which walk the same query blocks in the same
        order, so each CTA loads half of every Q and dO tile and multicasts it into both (the L2
        reads of Q and dO halve; LSE and D stay per CTA). Walks that differ between neighbours or
        depend on turns are excluded: causal, windows, deterministic, varlen, rotate."""
        walks_differ = self.causal or self.window_left or self.window_right or self.rotate
        assert not multicast or not (walks_differ or self.deterministic or self.varlen), (
            "multicast: the plain dense walk (no causal, window, deterministic, varlen or rotate)"
        )
        assert not (multicast and self.lpt_heads), "multicast: the grid's own order"
        self.cluster_n = 2 if multicast else 1

    def set_dq_writer(self, dq_chains: int, dq_writer_warps: int):
        """Deterministic dQ's chains (`write_dq`; `sm90_bwd.DQ_CHAINS`): the writer warp's turns,
        on dense rows only (dQacc holds dq_chains copies of the padded query rows); and its writer
        warps (`sm90_bwd.DQ_WRITER_WARPS`)."""
        assert dq_chains == 1 or (self.deterministic and self.dq_writer and not self.varlen), "dq_chains"
        assert dq_writer_warps == 1 or (dq_writer_warps == 2 and self.deterministic and self.dq_writer)
        self.dq_chains = dq_chains
        self.writer_warps = dq_writer_warps
        masked = self.causal or self.window_left or self.window_right
        self.dq_store_first = store_first(self.deterministic, self.dq_writer, masked, self.varlen)

    # ---------------------------------------------------------------- host side
    def _tiled_mmas(self):
        d = self.head_dim
        rmem = warpgroup.OperandSource.RMEM
        return (
            # S^T and dP^T: M = 128 keys (a warpgroup per 64), N = tile_m queries, K = d; B K-major.
            tiled_mma_64(self.dtype, OperandMajorMode.K, self.tile_m, num_wg=2),
            # dV += P^T dO, dK += dS^T Q: M = 128 keys, N = d, K = 64 queries; A from registers.
            tiled_mma_64(self.dtype, OperandMajorMode.MN, d, num_wg=2, a_source=rmem),
            # dQ = dS K: M = 64 queries, N = d as two halves (a warpgroup each), or (tile_m 128)
            # M = 128 queries as two halves, N = d; K = 128 keys; A = dS read transposed from sdS,
            # B = K^T: both MN-major.
            sm90_utils.make_trivial_tiled_mma(
                self.dtype,
                self.dtype,
                OperandMajorMode.MN,
                OperandMajorMode.MN,
                Float32,
                atom_layout_mnk=(2, 1, 1) if self.dq_by_rows or self.dq_swapped else (1, 2, 1),
                tiler_mn=self.dq_mma_tile,  # a warpgroup's part
            ),
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mD: cute.Tensor,
        mdQacc: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mSem: cute.Tensor | None,
        softmax_scale: Float32,
        qhead_per_kvhead: Int32,
        window_size_left: Int32,
        window_size_right: Int32,
        softcap: Float32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        max_seqlen_k: Int32,
        stream: cuda.CUstream,
    ):
        d, dv, tile_m, tile_n = self.head_dim, self.head_dim_v, self.tile_m, self.tile_n
        # Sequence first, as TMA and WGMMA take them: (s, d, h, b); LSE log2 e and D (s_pad, h, b).
        mQ, mK, mV, mdO, mdQacc, mdK, mdV = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
            for t in (mQ, mK, mV, mdO, mdQacc, mdK, mdV)
        ]
        mLSE, mD = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0])) for t in (mLSE, mD)]

        tiled_mma_s, tiled_mma_kv, tiled_mma_dq = self._tiled_mmas()
        kv_layout, v_layout, q_layout, do_layout, ds_layout, dq_layout = self.smem_layouts()
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        # Q and dO (`set_pairs`): each CTA of a pair loads half of the tile into both CTAs.
        tma_op_qdo = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_n > 1) else tma_op
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            tma_op_qdo, mQ, cute.select(q_layout, mode=[0, 1]), (tile_m, d), num_multicast=self.cluster_n
        )
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(
            tma_op_qdo, mdO, cute.select(do_layout, mode=[0, 1]), (tile_m, dv), num_multicast=self.cluster_n
        )
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(tma_op, mK, kv_layout, (tile_n, d))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(tma_op, mV, v_layout, (tile_n, dv))
        # LSE log2 e and D of a query block: tile_m floats, with Q and with dO.
        row_layout = cute.make_layout(tile_m)
        tma_atom_LSE, tma_LSE = cpasync.make_tiled_tma_atom(tma_op, mLSE, row_layout, (tile_m,))
        tma_atom_D, tma_D = cpasync.make_tiled_tma_atom(tma_op, mD, row_layout, (tile_m,))
        # dQ: each warpgroup's fp32 part (`dq_tile`) through shared memory, added into dQacc by a
        # TMA reduce-add (rows past the end clipped by the TMA unit).
        dq_box = self.dq_tile
        if const_expr(self.dq_fragments):  # a 1-D bulk reduce-add of each warpgroup's fragments
            tma_atom_dQ, tma_dQ = None, mdQacc
        else:
            tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), mdQacc, cute.select(dq_layout, mode=[0, 1]), dq_box
            )
        # `dq_store_first`: the first turn's plain TMA store (over the same box and tensor).
        tma_atom_dQs = None
        if const_expr(self.dq_store_first and not self.dq_fragments):
            tma_atom_dQs, _ = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mdQacc, cute.select(dq_layout, mode=[0, 1]), dq_box
            )

        # dK, dV in the inputs' type at q heads (MHA, dense): through sK / sV (free once the last
        # block's GEMMs are done) and a TMA store each, instead of 2-byte stores from registers.
        tma_atom_dK = tma_atom_dV = None
        if const_expr(self.dkv_by_tma(mdK)):
            store_op = cpasync.CopyBulkTensorTileS2GOp()
            tma_atom_dK, mdK = cpasync.make_tiled_tma_atom(store_op, mdK, kv_layout, (tile_n, d))
            tma_atom_dV, mdV = cpasync.make_tiled_tma_atom(store_op, mdV, v_layout, (tile_n, dv))

        def buffer(dtype, size, align=1024):
            return cute.struct.Align[cute.struct.MemRange[dtype, size], align]

        fields = {
            "mbar_KV": cute.struct.MemRange[cutlass.Int64, 1],
            "mbar_Q": cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages],  # full + empty per stage
            "mbar_dO": cute.struct.MemRange[cutlass.Int64, 2 * self.do_stages],
            "sK": buffer(self.dtype, cute.cosize(kv_layout)),
            "sV": buffer(self.dtype, cute.cosize(v_layout)),
            "sQ": buffer(self.dtype, cute.cosize(q_layout)),
            "sdO": buffer(self.dtype, cute.cosize(do_layout)),
        }
        if const_expr(self.p_in_smem):
            fields["sP"] = buffer(self.dtype, cute.cosize(ds_layout))
        fields["sdS"] = buffer(self.dtype, cute.cosize(ds_layout))
        rows = {
            name: buffer(Float32, self.rows_stride * (stages - 1) + tile_m, 128)
            for name, stages in (("sLSE", self.q_stages), ("sD", self.do_stages))
        }
        dq = {"sdQ": buffer(Float32, cute.cosize(dq_layout))}
        # tile_m 80: 226.3 KB of the 227 allowed with the rows last, so that sdQ's 1 KB alignment
        # costs nothing (rows first, as the other tiles have them, would need 227.0); the wide
        # kernel's likewise.
        fields.update({**dq, **rows} if self.dq_swapped or self.p_in_smem else {**rows, **dq})
        SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

        # Key blocks x q heads x batch (varlen: of the longest key sequence x heads x sequences).
        grid = (cute.ceil_div(cute.size(mK.shape[0]), tile_n), cute.size(mQ.shape[2]), cute.size(mQ.shape[3]))
        if const_expr(self.varlen):
            grid = ((max_seqlen_k + tile_n - 1) // tile_n, cute.size(mQ.shape[2]), mCuSeqlensQ.shape[0] - 1)
        if const_expr(self.cluster_n > 1):  # whole pairs
            grid = ((grid[0] + 1) // 2 * 2, grid[1], grid[2])
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
            tma_atom_LSE, tma_LSE, tma_atom_D, tma_D, tma_atom_dQ, tma_dQ, tma_atom_dQs, tma_atom_dK, mdK,
            tma_atom_dV, mdV, mSem, softmax_scale,
            qhead_per_kvhead, window_size_left, window_size_right, softcap, mCuSeqlensQ, mCuSeqlensK,
            kv_layout, v_layout, q_layout, do_layout, ds_layout, dq_layout, tiled_mma_s, tiled_mma_kv,
            tiled_mma_dq, SharedStorage,
        ).launch(
            grid=grid, block=[NUM_THREADS, 1, 1], cluster=[self.cluster_n, 1, 1], stream=stream,
            min_blocks_per_mp=1,
        )  # fmt: skip

    def smem_layouts(self):
        """The shared-memory layouts (K, V, Q's stages, dO's stages, dS^T's two buffers, dQ's
        per-warpgroup fp32 staging): the 16-bit ones row-major, swizzled as widely as their
        columns allow. (`sm90_bwd_wide` has its own.)"""
        d = self.head_dim
        kv = smem_layout(self.dtype, self.tile_n, d)
        q = smem_layout(self.dtype, self.tile_m, d, self.q_stages)
        ds = smem_layout(self.dtype, self.tile_n, self.tile_m, 2)  # dS^T: keys x queries
        dq = smem_layout(Float32, *self.dq_tile, 2)
        return kv, kv, q, q, ds, dq

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_dO: cute.CopyAtom,
        mdO: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_LSE: cute.CopyAtom,
        mLSE: cute.Tensor,
        tma_atom_D: cute.CopyAtom,
        mD: cute.Tensor,
        tma_atom_dQ: cute.CopyAtom | None,
        mdQacc: cute.Tensor,
        tma_atom_dQs: cute.CopyAtom | None,
        tma_atom_dK: cute.CopyAtom | None,
        mdK: cute.Tensor,
        tma_atom_dV: cute.CopyAtom | None,
        mdV: cute.Tensor,
        mSem: cute.Tensor | None,
        softmax_scale: Float32,
        qhead_per_kvhead: Int32,
        window_size_left: Int32,
        window_size_right: Int32,
        softcap: Float32,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        kv_layout: cute.ComposedLayout,
        v_layout: cute.ComposedLayout,
        q_layout: cute.ComposedLayout,
        do_layout: cute.ComposedLayout,
        ds_layout: cute.ComposedLayout,
        dq_layout: cute.ComposedLayout,
        tiled_mma_s: cute.TiledMma,
        tiled_mma_kv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_block, head, batch = cute.arch.block_idx()
        if const_expr(self.lpt_heads > 0):  # (`LPT_HEADS`)
            gx, gy, gz = cute.arch.grid_dim()
            grid = (cutlass.Int64(gx), cutlass.Int64(gy), cutlass.Int64(gz))
            n64, h64, b64 = lpt_place(
                cutlass.Int64(n_block), cutlass.Int64(head), cutlass.Int64(batch), grid, self.lpt_heads,
                cutlass.min,
            )  # fmt: skip
            n_block, head, batch = Int32(n64), Int32(h64), Int32(b64)
        if const_expr(self.varlen):
            seqlen = SeqlenInfo.create(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK)
        else:
            seqlen = SeqlenInfo(0, mQ.shape[0], 0, mK.shape[0])
        mask = self.mask.with_window(window_size_left, window_size_right)
        if const_expr(self.deterministic and (self.descending or self.rotate)):
            # Later key blocks first: they take the earlier turns (varlen: the grid's blocks
            # past a sequence's keys have no work).
            n_block = cute.arch.grid_dim()[0] - 1 - n_block
        # The query blocks that see a key of this CTA's (the mask's rule, from the key side).
        m_min, m_max = mask.query_block_range(n_block, seqlen)
        if const_expr(self.varlen):
            if n_block * self.tile_n >= seqlen.seqlen_k:  # past this sequence's keys: nothing to do
                m_max = m_min
        walk = self.walk(n_block, seqlen, m_min, m_max)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar_KV = storage.mbar_KV.data_ptr()
        if warp_idx == 0:
            for atom in (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_atom_LSE, tma_atom_D):
                cpasync.prefetch_descriptor(atom)
            if const_expr(tma_atom_dK is not None):
                cpasync.prefetch_descriptor(tma_atom_dK)
                cpasync.prefetch_descriptor(tma_atom_dV)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_KV, 1)
        # "full": one producer arrive plus the TMA bytes (with pairs: both halves of the tile, one
        # from each CTA); "empty": one arrive per consumer warp of every CTA of the pair (lane r of
        # a warp signals CTA r).
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumer_warps = NUM_MMA_THREADS // 32 * self.cluster_n
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps)
        # A stage: the 16-bit tile and its rows' fp32 LSE log2 e (Q) or D (dO).
        pipes = [
            pipeline.PipelineTmaAsync.create(
                barrier_storage=mbar.data_ptr(),
                num_stages=stages,
                producer_group=producer_group,
                consumer_group=consumer_group,
                tx_count=cute.size_in_bytes(self.dtype, cute.select(layout, mode=[0, 1])) + self.tile_m * 4,
                cta_layout_vmnk=cute.make_layout((1, self.cluster_n, 1, 1)),
                mcast_mode_mn=(0, 1),
                defer_sync=True,
            )
            for mbar, stages, layout in (
                (storage.mbar_Q, self.q_stages, q_layout),
                (storage.mbar_dO, self.do_stages, do_layout),
            )
        ]
        if const_expr(self.cluster_n > 1):  # the peer's barriers are initialised before any multicast
            cluster_shape_mn = (self.cluster_n, 1)
            pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_shape_mn)
            pipeline.pipeline_init_wait(cluster_shape_mn=cluster_shape_mn)
        else:
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()

        sK = storage.sK.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sdO = storage.sdO.get_tensor(do_layout.outer, swizzle=do_layout.inner)
        sdS = storage.sdS.get_tensor(ds_layout.outer, swizzle=ds_layout.inner)
        if const_expr(self.p_in_smem):
            sdS = (storage.sP.get_tensor(ds_layout.outer, swizzle=ds_layout.inner), sdS)
        sLSE, sD = (
            rows.get_tensor(cute.make_layout((self.tile_m, stages), stride=(1, self.rows_stride)))
            for rows, stages in ((storage.sLSE, self.q_stages), (storage.sD, self.do_stages))
        )
        if const_expr(self.dq_fragments):
            sdQ = storage.sdQ.get_tensor(self.dq_fragment_layout())
        else:
            sdQ = storage.sdQ.get_tensor(dq_layout.outer, swizzle=dq_layout.inner)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(REGISTERS[0])
            if warp_idx == 0:
                self.producer(
                    tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV, tma_atom_LSE,
                    mLSE, tma_atom_D, mD, sQ, sdO, sK, sV, sLSE, sD, mbar_KV, pipes, n_block, head,
                    head // qhead_per_kvhead, batch, seqlen, m_min, m_max, walk,
                )  # fmt: skip
            if const_expr(self.dq_writer):
                for w in cutlass.range_constexpr(self.writer_warps):  # (warps 1, 2: parities 0, 1)
                    if warp_idx == 1 + w:
                        self.write_dq(
                            sdQ, (tma_atom_dQ, tma_atom_dQs), mdQacc, mSem, mask, seqlen, n_block, head,
                            batch, m_min, m_max, walk, w,
                        )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(REGISTERS[1])
            tidx = cute.arch.thread_idx()[0] - WARPGROUP
            self.consumer(
                tidx, sQ, sdO, sK, sV, sdS, sLSE, sD, sdQ, mbar_KV, pipes, tiled_mma_s, tiled_mma_kv,
                tiled_mma_dq, tma_atom_dQ, mdQacc, tma_atom_dK, mdK, tma_atom_dV, mdV, mSem, softmax_scale,
                softcap, mask, seqlen, n_block, head, head // qhead_per_kvhead, batch, m_min, m_max, walk,
            )  # fmt: skip

    # ---------------------------------------------------------------- producer
    @cute.jit
    def producer(
        self, tma_atom_Q, mQ, tma_atom_dO, mdO, tma_atom_K, mK, tma_atom_V, mV, tma_atom_LSE, mLSE,
        tma_atom_D, mD, sQ, sdO, sK, sV, sLSE, sD, mbar_KV, pipes, n_block, head, head_kv, batch,
        seqlen, m_min, m_max, walk,
    ):  # fmt: skip
        """One warp: K and V of the CTA's keys once, then Q (with its rows' LSE log2 e) and dO
        (with D) of every query block it walks, each into the next free stage of its pipeline."""
        d = self.head_dim
        pipe_q, pipe_do = pipes
        dv, tile_n = self.head_dim_v, self.tile_n
        gK = cute.local_tile(seqlen.rows(mK, head_kv, batch, seqlen.offset_k), (tile_n, d), (n_block, 0))
        gV = cute.local_tile(seqlen.rows(mV, head_kv, batch, seqlen.offset_k), (tile_n, dv), (n_block, 0))
        tile_m = self.tile_m
        gQ = cute.local_tile(seqlen.rows(mQ, head, batch, seqlen.offset_q), (tile_m, d), (None, 0))
        gdO = cute.local_tile(seqlen.rows(mdO, head, batch, seqlen.offset_q), (tile_m, dv), (None, 0))
        gLSE = cute.local_tile(self.padded_rows(mLSE, head, batch, seqlen), (tile_m,), (None,))
        gD = cute.local_tile(self.padded_rows(mD, head, batch, seqlen), (tile_m,), (None,))

        def partition(atom, smem_tile, gmem_tiles, rank=0, ctas=1):
            s_grouped, g_grouped = cute.group_modes(smem_tile, 0, 2), cute.group_modes(gmem_tiles, 0, 2)
            return cpasync.tma_partition(atom, rank, cute.make_layout(ctas), s_grouped, g_grouped)

        tKsK, tKgK = partition(tma_atom_K, sK, gK)
        tVsV, tVgV = partition(tma_atom_V, sV, gV)
        # With pairs (`set_pairs`), this CTA's half of each Q and dO tile, into both CTAs.
        rank = cute.arch.block_idx_in_cluster() if const_expr(self.cluster_n > 1) else 0
        tQsQ, tQgQ = partition(tma_atom_Q, sQ, gQ, rank, self.cluster_n)
        tOsdO, tOgdO = partition(tma_atom_dO, sdO, gdO, rank, self.cluster_n)
        mcast = {}
        if const_expr(self.cluster_n > 1):
            mcast = {"mcast_mask": cutlass.Int16((1 << self.cluster_n) - 1)}

        def partition_rows(atom, smem_rows, gmem_rows):
            s_grouped, g_grouped = cute.group_modes(smem_rows, 0, 1), cute.group_modes(gmem_rows, 0, 1)
            return cpasync.tma_partition(atom, 0, cute.make_layout(1), s_grouped, g_grouped)

        tLsLSE, tLgLSE = partition_rows(tma_atom_LSE, sLSE, gLSE)
        tDsD, tDgD = partition_rows(tma_atom_D, sD, gD)
        kv_bytes = cute.size_in_bytes(self.dtype, sK.layout) + cute.size_in_bytes(self.dtype, sV.layout)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_KV, kv_bytes)
        cute.copy(tma_atom_K, tKgK, tKsK, tma_bar_ptr=mbar_KV)
        cute.copy(tma_atom_V, tVgV, tVsV, tma_bar_ptr=mbar_KV)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
        for i in cutlass.range(m_min, m_max, unroll=1):
            m_block = self.walk_block(i, m_min, m_max, walk)
            pipe_q.producer_acquire(q_state)
            cute.copy(
                tma_atom_Q, tQgQ[None, m_block], tQsQ[None, q_state.index],
                tma_bar_ptr=pipe_q.producer_get_barrier(q_state), **mcast,
            )  # fmt: skip
            cute.copy(
                tma_atom_LSE, tLgLSE[None, m_block], tLsLSE[None, q_state.index],
                tma_bar_ptr=pipe_q.producer_get_barrier(q_state),
            )  # fmt: skip
            q_state.advance()
            pipe_do.producer_acquire(do_state)
            cute.copy(
                tma_atom_dO, tOgdO[None, m_block], tOsdO[None, do_state.index],
                tma_bar_ptr=pipe_do.producer_get_barrier(do_state), **mcast,
            )  # fmt: skip
            cute.copy(
                tma_atom_D, tDgD[None, m_block], tDsD[None, do_state.index],
                tma_bar_ptr=pipe_do.producer_get_barrier(do_state),
            )  # fmt: skip
            do_state.advance()
        # Stay until the consumers have released every stage: no arrive lands after exit.
        pipe_q.producer_tail(q_state)
        pipe_do.producer_tail(do_state)

    # ---------------------------------------------------------------- consumers
    @cute.jit
    def consumer(
        self, tidx, sQ, sdO, sK, sV, sdS, sLSE, sD, sdQ, mbar_KV, pipes, tiled_mma_s, tiled_mma_kv,
        tiled_mma_dq, tma_atom_dQ, mdQacc, tma_atom_dK, mdK, tma_atom_dV, mdV, mSem, softmax_scale, softcap,
        mask, seqlen, n_block, head, head_kv, batch, m_min, m_max, walk,
    ):  # fmt: skip
        """Both consumer warpgroups (tidx 0..255): the query blocks [m_min, m_max), then dK, dV."""
        d = self.head_dim
        pipe_q, pipe_do = pipes
        # Scores as the forward made them: S * scale, or (softcap) cap * tanh(S * scale / cap),
        # to the base 2: S * scale_log2, or tanh(S * softcap_scale) * scale_log2.
        scale_log2 = softmax_scale * LOG2_E
        softcap_scale = None
        if const_expr(self.softcap):
            scale_log2 = softcap * LOG2_E
            softcap_scale = softmax_scale / softcap
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        n0 = n_block * TILE_N

        # Transposed views (the forward's V^T), with their stage modes: Q^T, dO^T (d, 64, stages)
        # for dK and dV; K^T (d, 128) and dS (64 queries, 128 keys, buffers) for dQ.
        tile_m = self.tile_m
        staged_t = cute.make_ordered_layout((d, tile_m, STAGES), order=(1, 0, 2))
        sQt, sdOt = cute.composition(sQ, staged_t), cute.composition(sdO, staged_t)
        sKt = cute.composition(sK, cute.make_ordered_layout((d, TILE_N), order=(1, 0)))
        sdSt = cute.composition(sdS, cute.make_ordered_layout((tile_m, TILE_N, 2), order=(1, 0, 2)))

        # smem operand descriptors per warpgroup; accumulators per thread.
        wg_s, wg_kv, wg_dq = (m.get_slice(wg * WARPGROUP) for m in (tiled_mma_s, tiled_mma_kv, tiled_mma_dq))
        thr_s, thr_kv, thr_dq = (m.get_slice(tidx) for m in (tiled_mma_s, tiled_mma_kv, tiled_mma_dq))
        tSrK = wg_s.make_fragment_A(wg_s.partition_A(sK))
        tSrQ = wg_s.make_fragment_B(wg_s.partition_B(sQ))
        tPrV = wg_s.make_fragment_A(wg_s.partition_A(sV))
        tPrdO = wg_s.make_fragment_B(wg_s.partition_B(sdO))
        tVrdOt = wg_kv.make_fragment_B(wg_kv.partition_B(sdOt))
        tKrQt = wg_kv.make_fragment_B(wg_kv.partition_B(sQt))
        if const_expr(self.dq_swapped):  # dQ^T = K^T dS^T: K^T is A, dS^T's view (q, keys) B
            tQrKt = wg_dq.make_fragment_A(wg_dq.partition_A(sKt))
            tQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(sdSt))
        else:
            tQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdSt))
            tQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(sKt))

        acc_shape_S = thr_s.partition_shape_C((TILE_N, tile_m))
        acc_dV = thr_kv.make_fragment_C(thr_kv.partition_shape_C((TILE_N, d)))
        acc_dK = thr_kv.make_fragment_C(thr_kv.partition_shape_C((TILE_N, d)))
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        # This thread's (key, query) coordinates in an S^T tile, as rows and columns.
        cS = thr_s.partition_C(cute.make_identity_tensor((TILE_N, tile_m)))
        tScS = cute.make_tensor(cS.iterator, acc_mn_layout(cS.layout))
        smem_copy_dS = stmatrix_copy(self.dtype, tiled_mma_s, tidx)
        tdSsdS = smem_copy_dS.partition_D(sdS)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        cute.arch.mbarrier_wait(mbar_KV, 0)
        # Deterministic: the query block whose dQ this CTA added last and whose turn it still
        # holds (passed once the add is complete, during the next block's first GEMMs).
        held = Int32(-1)
        for i in cutlass.range(m_min, m_max, unroll=1):
            m_block = self.walk_block(i, m_min, m_max, walk)
            buf = (i - m_min) % 2
            acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
            acc_dP = cute.make_rmem_tensor(acc_shape_S, Float32)
            pipe_q.consumer_wait(q_state)
            # The block's LSE log2 e (from shared memory, with Q), in registers, read where
            # `LSE_LOAD` says (softcap: where it is used, `capped_probabilities`; tile_m 128: at
            # each use, `probabilities`); D (with dO): in `probabilities`.
            lse_log2 = None
            lse_in_registers = not self.softcap and not self.dq_by_rows
            if const_expr(lse_in_registers and LSE_LOAD == "before_s"):
                lse_log2 = self.load_rows(tScS, sLSE, q_state.index)
            gemm(tiled_mma_s, acc_S, tSrK, tSrQ[None, None, None, q_state.index], zero_init=True, wg_wait=-1)
            if const_expr(lse_in_registers and LSE_LOAD == "after_s"):
                lse_log2 = self.load_rows(tScS, sLSE, q_state.index)
            pipe_do.consumer_wait(do_state)
            gemm(
                tiled_mma_s, acc_dP, tPrV, tPrdO[None, None, None, do_state.index], zero_init=True, wg_wait=-1
            )
            if const_expr(lse_in_registers and LSE_LOAD == "after_dp"):
                lse_log2 = self.load_rows(tScS, sLSE, q_state.index)
            if const_expr(self.deterministic and not self.dq_writer):
                if held >= 0:
                    self.release_turn(mSem, held, head, batch, tidx)
            # Blocks that need the element mask: keys past the end, or past the edge of some row's
            # window (causal's diagonal included); rows past seqlen_q need none (P = 0 by their LSE).
            masked = mask.tile_needs_mask(m_block, n_block, seqlen)
            warpgroup.wait_group(1)  # S^T done; dP^T may still run
            if const_expr(self.softcap):
                self.capped_probabilities(
                    acc_S, acc_dP, tScS, sLSE, q_state.index, sD, do_state.index, mask, seqlen, m_block, n0,
                    scale_log2, softcap_scale, masked,
                )  # fmt: skip
            else:
                self.probabilities(
                    acc_S, acc_dP, tScS, lse_log2, sLSE, q_state.index, sD, do_state.index, mask, seqlen,
                    m_block, n0, scale_log2, masked,
                )  # fmt: skip
            rP = cute.make_rmem_tensor(acc_S.layout, self.dtype)
            convert(acc_S, rP)
            rdS = cute.make_rmem_tensor(acc_dP.layout, self.dtype)
            convert(acc_dP, rdS)
            # dS^T to this block's buffer; both warpgroups' rows before either reads it for dQ.
            cute.copy(smem_copy_dS, smem_copy_dS.retile(rdS), tdSsdS[None, None, None, buf])
            cute.arch.fence_view_async_shared()

            # Three commit groups, in this order: dV (needs only this warpgroup's P), then, once
            # both warpgroups' dS^T are in sdS, dQ, then dK. wait_group(1) leaves dK running while
            # dQ is staged in sdQ and its reduce-add is issued.
            tVrP = cute.make_tensor(rP.iterator, acc_to_operand_a_layout(rP.layout))
            tKrdS = cute.make_tensor(rdS.iterator, acc_to_operand_a_layout(rdS.layout))
            gemm(
                tiled_mma_kv,
                acc_dV,
                tVrP,
                tVrdOt[None, None, None, do_state.index],
                zero_init=False,
                wg_wait=-1,
            )
            cute.arch.barrier(barrier_id=BARRIER_DS, number_of_threads=NUM_MMA_THREADS)
            if const_expr(self.dq_swapped):
                acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C((d, tile_m)))
                gemm(tiled_mma_dq, acc_dQ, tQrKt, tQrdS[None, None, None, buf], zero_init=True, wg_wait=-1)
            else:
                acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C((tile_m, d)))
                gemm(tiled_mma_dq, acc_dQ, tQrdS[None, None, None, buf], tQrKt, zero_init=True, wg_wait=-1)
            gemm(
                tiled_mma_kv,
                acc_dK,
                tKrdS,
                tKrQt[None, None, None, q_state.index],
                zero_init=False,
                wg_wait=1,
            )
            # dV and dQ done: dO's last reader (dP^T and dV) is done with its stage.
            pipe_do.consumer_release(do_state)
            do_state.advance()

            # dQ into sdQ, then (deterministic: at the CTA's turn, complete before the turn passes,
            # `release_turn`) added into dQacc by TMA.
            self.stage_dq(acc_dQ, sdQ, softmax_scale, tidx, i > m_min, (i - m_min) % 2 == 1)
            held = self.add_dq_at_turn(
                sdQ, tma_atom_dQ, mdQacc, mSem, mask, seqlen, m_block, n_block, head, batch, m_min, walk,
                held, tidx,
            )  # fmt: skip
            warpgroup.wait_group(0)  # dK done: Q's stage goes back to the producer
            pipe_q.consumer_release(q_state)
            q_state.advance()

        if const_expr(self.deterministic and not self.dq_writer):
            if held >= 0:
                self.release_turn(mSem, held, head, batch, tidx)
        if const_expr(not self.dq_writer):  # (else the writer warp waits for its own)
            if tidx % WARPGROUP < 32:  # the last reduce-add has read its buffer
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        if const_expr(tma_atom_dK is not None):
            self.store_dkdv_tma(
                acc_dK, acc_dV, tiled_mma_kv, sK, sV, tma_atom_dK, mdK, tma_atom_dV, mdV, softmax_scale,
                n_block, head, batch, tidx,
            )  # fmt: skip
        else:
            out_head = head_kv if const_expr(self.dkv_atomic) else head
            self.store_dkdv(acc_dK, acc_dV, thr_kv, mdK, mdV, softmax_scale, n0, out_head, batch, seqlen)

    @cute.jit
    def padded_rows(self, mX, head, batch, seqlen):
        """Head `head`'s rows of a query-side buffer padded to whole query blocks (LSE log2 e and
        D (s_pad, h, b), dQacc (s_pad, d, h, b)): dense, batch `batch`'s; varlen, sequence
        `batch`'s, whose rows start at (offset_q + tile_m * batch) rounded down to a multiple of
        tile_m (`sm90_bwd.padded_starts`: a query block never reaches the next sequence's rows,
        and every block's TMA box starts on a whole block. A 1-D box of LSE or D at a row that is
        not a multiple of 4 floats, 16 bytes, stops the kernel with an illegal instruction:
        measured, H200 2026-11-27)."""
        start = seqlen.offset_q + self.tile_m * batch
        if const_expr(self.tile_m & (self.tile_m - 1) == 0):
            start = start & Int32(-self.tile_m)
        else:  # (80)
            start = start // self.tile_m * self.tile_m
        if const_expr(cute.rank(mX) == 3):
            if const_expr(not self.varlen):
                return mX[None, head, batch]
            return cute.domain_offset((start,), mX[None, head, 0])
        if const_expr(not self.varlen):
            return mX[None, None, head, batch]
        return cute.domain_offset((start, 0), mX[None, None, head, 0])

    @cute.jit
    def load_rows(self, tScS, sRows, stage):
        """This thread's query columns' values from a stage of sLSE or sD (the preprocess's: LSE
        log2 e is +inf past the end and for rows without keys, so P = 0 there; D is 0 past the end)."""
        cols = cute.size(tScS, mode=[1])
        values = cute.make_rmem_tensor((cols,), Float32)
        for c in cutlass.range_constexpr(cols):
            values[c] = sRows[tScS[0, c][1], stage]
        return values

    @cute.jit
    def probabilities(
        self, acc_S, acc_dP, tScS, lse_log2, sLSE, q_stage, sD, do_stage, mask, seqlen, m_block, n0,
        scale_log2, masked,
    ):  # fmt: skip
        """P^T and dS^T in place of S^T and dP^T (waits for dP^T after P^T): P = exp2(S scale log2 e
        - LSE log2 e), 0 where masked; dS = P (dP - D). Columns are queries, rows keys. lse_log2:
        the columns' values in registers (`load_rows`), or None: each read from sLSE where it is
        used, and D likewise (tile_m 128: 32 columns a thread, which held in registers spilled)."""
        acc_S_mn = cute.make_tensor(acc_S.iterator, acc_mn_layout(acc_S.layout))
        acc_dP_mn = cute.make_tensor(acc_dP.iterator, acc_mn_layout(acc_dP.layout))
        cols = cute.size(acc_S_mn, mode=[1])
        rows = cute.size(acc_S_mn, mode=[0])
        # Columns [0, early) exponentiated here, the rest after the wait for dP^T (`EXP_EARLY`).
        setting = EXP_EARLY if EXP_EARLY is not None else EXP_EARLY_BY_TILE.get(self.tile_m, "all")
        early = round(cols * EXP_EARLY_SHARES[setting])

        if masked:
            m0 = m_block * self.tile_m
            for c in cutlass.range_constexpr(cols):
                # The keys [start, limit) this column's query sees (`mask.Mask`).
                start, limit = mask.key_bounds(m0 + tScS[0, c][1], seqlen)
                for r in cutlass.range_constexpr(rows):
                    p = Float32(0.0)
                    if const_expr(c >= early):  # (its exponential comes after the wait)
                        p = Float32(-float("inf"))
                    key = n0 + tScS[r, c][0]
                    if const_expr(self.window_left):
                        if key < limit and key >= start:
                            p = self.exponent(
                                acc_S_mn[r, c], lse_log2, sLSE, tScS, q_stage, c, scale_log2, c < early
                            )
                    elif key < limit:
                        p = self.exponent(
                            acc_S_mn[r, c], lse_log2, sLSE, tScS, q_stage, c, scale_log2, c < early
                        )
                    acc_S_mn[r, c] = p
        else:
            for c in cutlass.range_constexpr(cols):
                for r in cutlass.range_constexpr(rows):
                    acc_S_mn[r, c] = self.exponent(
                        acc_S_mn[r, c], lse_log2, sLSE, tScS, q_stage, c, scale_log2, c < early
                    )
        # D of the columns, read while dP^T may still run (not beside the LSE: fewer registers
        # live across the GEMMs' issue).
        dsum = None
        if const_expr(lse_log2 is not None):
            dsum = self.load_rows(tScS, sD, do_stage)
        warpgroup.wait_group(0)  # dP^T done
        for c in cutlass.range_constexpr(cols):
            d_c = self.column_value(dsum, sD, tScS, do_stage, c)
            for r in cutlass.range_constexpr(rows):
                if const_expr(c >= early):
                    acc_S_mn[r, c] = cute.math.exp2(acc_S_mn[r, c], fastmath=True)
                acc_dP_mn[r, c] = acc_S_mn[r, c] * (acc_dP_mn[r, c] - d_c)

    def exponent(self, s, lse_log2, sLSE, tScS, q_stage, c: int, scale_log2, exponentiate: bool):
        """S scale log2 e - LSE log2 e of query column c, exponentiated (P) where `exponentiate`
        (traced inline)."""
        x = s * scale_log2 - self.column_value(lse_log2, sLSE, tScS, q_stage, c)
        return cute.math.exp2(x, fastmath=True) if exponentiate else x

    def column_value(self, values, sRows, tScS, stage, c: int):
        """Column c's LSE log2 e or D: from `values` (registers, `load_rows`) or, where that is
        None, from its stage of sRows (shared memory)."""
        if const_expr(values is not None):
            return values[c]
        return sRows[tScS[0, c][1], stage]

    @cute.jit
    def capped_probabilities(
        self, acc_S, acc_dP, tScS, sLSE, q_stage, sD, do_stage, mask, seqlen, m_block, n0, scale_log2,
        softcap_scale, masked,
    ):  # fmt: skip
        """`probabilities` with softcap: T = tanh(S scale / cap), the forward's, in place while dP^T
        runs; then, in one pass, P = exp2(T cap log2 e - LSE log2 e) (0 where masked) and
        dS = P (dP - D) (1 - T^2), the derivative of cap tanh(x / cap). T stays in S's registers
        until dS is made, and a column's LSE and D are read from shared memory where they are used:
        1 - T^2 kept beside P, or the LSEs held across the wait for dP^T, spilled at d128."""
        acc_S_mn = cute.make_tensor(acc_S.iterator, acc_mn_layout(acc_S.layout))
        acc_dP_mn = cute.make_tensor(acc_dP.iterator, acc_mn_layout(acc_dP.layout))
        for i in cutlass.range_constexpr(cute.size(acc_S)):
            acc_S[i] = cute.math.tanh(acc_S[i] * softcap_scale, approx=True)
        warpgroup.wait_group(0)  # dP^T done
        cols = cute.size(acc_S_mn, mode=[1])
        rows = cute.size(acc_S_mn, mode=[0])
        if masked:
            m0 = m_block * self.tile_m
            for c in cutlass.range_constexpr(cols):
                start, limit = mask.key_bounds(m0 + tScS[0, c][1], seqlen)  # the keys it sees
                lse_log2 = sLSE[tScS[0, c][1], q_stage]
                dsum = sD[tScS[0, c][1], do_stage]
                for r in cutlass.range_constexpr(rows):
                    t = acc_S_mn[r, c]
                    key = n0 + tScS[r, c][0]
                    p = cute.math.exp2(t * scale_log2 - lse_log2, fastmath=True)
                    if key >= limit or key < start:
                        p = Float32(0.0)
                    acc_S_mn[r, c] = p
                    acc_dP_mn[r, c] = p * (acc_dP_mn[r, c] - dsum) * (1.0 - t * t)
        else:
            for c in cutlass.range_constexpr(cols):
                lse_log2 = sLSE[tScS[0, c][1], q_stage]
                dsum = sD[tScS[0, c][1], do_stage]
                for r in cutlass.range_constexpr(rows):
                    t = acc_S_mn[r, c]
                    p = cute.math.exp2(t * scale_log2 - lse_log2, fastmath=True)
                    acc_S_mn[r, c] = p
                    acc_dP_mn[r, c] = p * (acc_dP_mn[r, c] - dsum) * (1.0 - t * t)

    @property
    def lpt_heads(self) -> int:
        """`LPT_HEADS` where it applies: causal (or a right window), not deterministic, dense."""
        return LPT_HEADS if self.descending and not self.deterministic and not self.varlen else 0

    @property
    def laps(self) -> bool:
        """`DQ_LAPS`: the chains as laps of the rotated walk (deterministic, `rotate`, k > 1)."""
        return DQ_LAPS and self.rotate and self.dq_chains > 1

    @cute.jit
    def walk(self, n_block, seqlen, m_min, m_max):
        """(first query block this CTA visits, stride, num_n[, index in its lap, lap]): [m_min,
        m_max) in order from m_min, or (`rotate`) from m_min + n_block * stride, stride = C // num_n
        for C query blocks and num_n key blocks, wrapping at m_max. stride 0 (C < num_n, or no
        work): no rotation. With `laps`, n_block and num_n are the CTA's lap's (`lap_of`)."""
        first, stride, num_n = m_min, Int32(0), Int32(1)
        n_local, lap = n_block, Int32(0)
        if const_expr(self.rotate):
            num_n = cutlass.max((seqlen.seqlen_k + self.tile_n - 1) // self.tile_n, 1)
            if const_expr(self.varlen):
                num_n = cutlass.min(num_n, cute.arch.grid_dim()[0])  # (as the turns' n_max)
            if const_expr(self.laps):
                lap, n_local, num_n = lap_of(n_block, num_n, self.dq_chains, cutlass.min)
            stride = (m_max - m_min) // num_n
            first = m_min + n_local * stride
        result = (first, stride, num_n)
        if const_expr(self.laps):
            result = (first, stride, num_n, n_local, lap)
        return result

    @cute.jit
    def walk_block(self, i, m_min, m_max, walk):
        """The query block of step i - m_min of the walk (`walk`)."""
        m_block = i
        if const_expr(self.rotate):
            m_block = i + walk[0] - m_min
            if m_block >= m_max:
                m_block = m_block - (m_max - m_min)
        return m_block

    @cute.jit
    def turn(self, m, n_block, walk):
        """`rotate`'s turn of key block n_block at query block m (from m_min): the CTAs in the
        order they reach m. CTA n starts at n * stride, so the last to have started at or before m,
        n0 = min(m // stride, num_n - 1), reaches it first, then n0 - 1, ..., 0, then num_n - 1,
        ..., n0 + 1 (each reaches m stride steps after the one before it). Without rotation
        (stride 0) every CTA starts at m_min: descending, the launch order."""
        stride, num_n = walk[1], walk[2]
        if const_expr(self.laps):
            n_block = walk[3]  # (the index in its lap)
        turn = num_n - 1 - n_block
        if stride > 0:
            n0 = cutlass.min(m // stride, num_n - 1)
            turn = n0 - n_block
            if turn < 0:
                turn = turn + num_n
        return turn

    @cute.jit
    def dq_turn(self, mask, seqlen, m_block, n_block, m_min, walk):
        """Deterministic: this CTA's turn to add into query block m_block's dQ. The key blocks
        that visit the block, by the forward's rule (the same pairs as `query_block_range`):
        descending from the last, or ascending, or (`rotate`) in the order the CTAs reach it."""
        n_min, n_max, _, _ = mask.block_range_local(m_block, seqlen)
        if const_expr(self.varlen):
            # Key blocks past the grid (a max_seqlen_k below the truth, unchecked under graph
            # capture) have no CTA: none of them takes a turn, none is waited for.
            n_max = cutlass.min(n_max, cute.arch.grid_dim()[0])
        turn = n_block - n_min
        if const_expr(self.descending):
            turn = n_max - 1 - n_block
        if const_expr(self.rotate):
            turn = self.turn(m_block - m_min, n_block, walk)
        return turn

    @cute.jit
    def write_dq(
        self, sdQ, atoms, mdQacc, mSem, mask, seqlen, n_block, head, batch, m_min, m_max, walk,
        parity: cutlass.Constexpr = 0,
    ):  # fmt: skip
        """`dq_writer`'s warp (the producer warpgroup's second): per query block of the walk, once
        both consumer warpgroups have staged their dQ parts (`BARRIER_DQ_FULL`), (deterministic:
        wait for the CTA's turn,) add both parts into dQacc, hand the buffers back once read
        (`BARRIER_DQ_EMPTY`, not after the last block, whose staging nobody waits for), and
        (deterministic) pass the turn once the adds are complete. The consumers wait for neither
        a turn nor a bulk group: only for the buffers, one block later. With `writer_warps` 2, this
        warp takes the walk's steps of `parity` (0 even, 1 odd), on that parity's barriers.
        atoms: dQ's TMA reduce-add and (`dq_store_first`) store atoms; a block's first turn (of its
        chain copy) stores with `dq_store_first`."""
        tma_atom_dQ, tma_atom_dQs = atoms
        lane = cute.arch.lane_idx()
        full, empty, step = BARRIER_DQ_FULL, BARRIER_DQ_EMPTY, 1
        if const_expr(self.writer_warps == 2):
            step = 2
            if const_expr(parity == 1):
                full, empty = BARRIER_DQ_FULL_ODD, BARRIER_DQ_EMPTY_ODD
        for i in cutlass.range(m_min + parity, m_max, step, unroll=1):
            m_block = self.walk_block(i, m_min, m_max, walk)
            acc_block = m_block  # (the block of dQacc this block's adds go to)
            first = False
            if const_expr(self.deterministic):
                turn = self.dq_turn(mask, seqlen, m_block, n_block, m_min, walk)  # (before the wait)
                if const_expr(self.laps):
                    # The CTA's lap's copy of the rows and semaphores; the turn is the lap's.
                    blocks = (seqlen.seqlen_q + self.tile_m - 1) // self.tile_m
                    acc_block = m_block + walk[4] * blocks
                elif const_expr(self.dq_chains > 1):
                    # Chain turn % k of the block's turns, each chain its own copy of the rows
                    # and its own semaphore: a CTA waits for the one k turns before it.
                    blocks = (seqlen.seqlen_q + self.tile_m - 1) // self.tile_m
                    acc_block = m_block + turn % self.dq_chains * blocks
                    turn = turn // self.dq_chains
                if const_expr(self.dq_store_first):
                    first = turn == 0
                sem = mSem.iterator + cute.crd2idx((batch, head, acc_block), mSem.layout)
            cute.arch.barrier(barrier_id=full, number_of_threads=DQ_WRITER_THREADS)
            if const_expr(self.deterministic):
                if lane == 0:
                    seen = cute.arch.atomic_add(sem, Int32(0), sem="acquire", scope="gpu")
                    while seen != turn:
                        seen = cute.arch.atomic_add(sem, Int32(0), sem="acquire", scope="gpu")
                cute.arch.sync_warp()
                # The turn was acquired by a generic-proxy load; the reduce-adds are async-proxy
                # writes.
                cute.arch.fence_proxy("async.global")
            for wg in cutlass.range_constexpr(2):
                where = (mdQacc, acc_block, head, batch, seqlen, wg)
                if const_expr(self.dq_store_first):
                    if first:
                        self.write_dq_part(sdQ, tma_atom_dQs, *where, True)
                    else:
                        self.write_dq_part(sdQ, tma_atom_dQ, *where, False)
                else:
                    self.write_dq_part(sdQ, tma_atom_dQ, *where, False)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.sync_warp()
            if i + 1 < m_max:
                cute.arch.barrier_arrive(barrier_id=empty, number_of_threads=DQ_WRITER_THREADS)
            if const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0, read=False)
                cute.arch.fence_proxy("async.global")  # the adds' writes before the turn's release
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.fence_acq_rel_gpu()
                    cute.arch.atomic_add(sem, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def add_dq_at_turn(
        self, sdQ, tma_atom_dQ, mdQacc, mSem, mask, seqlen, m_block, n_block, head, batch, m_min, walk, held,
        tidx,
    ):  # fmt: skip
        """Consumers, after `stage_dq`, without the writer warp (with it, `write_dq` adds): add the
        staged dQ of block m_block into dQacc; deterministic: at the CTA's turn along `walk`, which
        it then holds until `release_turn`. Returns the block whose turn is held (`held` unchanged
        otherwise)."""
        if const_expr(not self.dq_writer):
            if const_expr(self.deterministic):
                turn = self.dq_turn(mask, seqlen, m_block, n_block, m_min, walk)
                self.wait_turn(mSem, m_block, head, batch, turn, tidx)
            self.issue_dq(sdQ, tma_atom_dQ, mdQacc, m_block, head, batch, seqlen, tidx)
            if const_expr(self.deterministic):
                held = m_block
        return held

    @cute.jit
    def release_turn(self, mSem, m_block, head, batch, tidx):
        """Deterministic: once this CTA's reduce-adds into block m_block are complete (each
        warpgroup's issuing warp waits for its bulk group), the block's turn passes on."""
        if tidx % WARPGROUP < 32:
            cute.arch.cp_async_bulk_wait_group(0, read=False)
            cute.arch.fence_proxy("async.global")  # the adds' writes before the turn's release
        self.pass_turn(mSem, m_block, head, batch, tidx)

    def sync_turn(self):
        """`BwdSm90.wait_turn` and `pass_turn` (inherited) sync the two consumer warpgroups only."""
        cute.arch.barrier(barrier_id=BARRIER_TURN, number_of_threads=NUM_MMA_THREADS)

    def dq_fragment_layout(self):
        """sdQ in fragment order: (4 values, 128 threads, values / 4, warpgroup), so that a thread's
        accumulator values 4k..4k+3 are one 16-byte store and a warp's stores 512 contiguous bytes
        (`dq_fragments`). The same size as the swizzled buffer."""
        per_thread = self.dq_tile[0] * self.dq_tile[1] // WARPGROUP
        return cute.make_layout(
            (4, WARPGROUP, per_thread // 4, 2), stride=(1, 4, 4 * WARPGROUP, per_thread * WARPGROUP)
        )

    @cute.jit
    def stage_dq(self, acc_dQ, sdQ, scale, tidx, again, odd=False):
        """scale * acc_dQ (this warpgroup's part of a query block's dQ, `dq_tile`; no scale with
        dq_unscaled) into its buffer of sdQ, once the previous block's reduce-add has read it
        (`issue_dq`'s issuer waits; with `dq_writer`, the writer warp says so where `again`: not
        the walk's first block)."""
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        wtid = tidx % WARPGROUP
        if const_expr(self.dq_fragments):
            self.stage_dq_fragments(acc_dQ, sdQ, scale, wg, wtid, again, odd)
        else:
            # This warpgroup's accumulator is a one-warpgroup GEMM's of `dq_tile`.
            half_mma = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, OperandMajorMode.MN, OperandMajorMode.MN, Float32,
                atom_layout_mnk=(1, 1, 1), tiler_mn=self.dq_mma_tile,
            )  # fmt: skip
            sdQ_wg = sdQ[None, None, wg]
            if const_expr(self.dq_swapped):  # the buffer seen as (d / 2, tile_m): dQ^T's shape
                sdQ_wg = cute.composition(sdQ_wg, cute.make_ordered_layout(self.dq_mma_tile, order=(1, 0)))
            tdQsdQ = half_mma.get_slice(wtid).partition_C(sdQ_wg)
            self.dq_buffer_free(wg, wtid, again, odd)
            for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                tdQsdQ[i] = acc_dQ[i] if const_expr(self.dq_unscaled) else acc_dQ[i] * scale
            cute.arch.fence_view_async_shared()
            self.dq_buffer_written(wg, odd)

    @cute.jit
    def dq_buffer_free(self, wg, wtid, again, odd=False):
        """Until warpgroup wg's sdQ buffer may be written: its previous reduce-add has read it
        (the issuing warp waits for its bulk group, then the warpgroup syncs), or, with
        `dq_writer`, the writer warp has read both buffers (after the walk's first block; with
        `writer_warps` 2, the warp of the other parity than this step's, `odd`)."""
        if const_expr(self.dq_writer):
            if again:
                n = DQ_WRITER_THREADS
                if const_expr(self.writer_warps == 2):
                    if odd:  # (the previous step's: even)
                        cute.arch.barrier(barrier_id=BARRIER_DQ_EMPTY, number_of_threads=n)
                    else:
                        cute.arch.barrier(barrier_id=BARRIER_DQ_EMPTY_ODD, number_of_threads=n)
                else:
                    cute.arch.barrier(barrier_id=BARRIER_DQ_EMPTY, number_of_threads=n)
        else:
            if wtid < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=BARRIER_DQ + wg, number_of_threads=WARPGROUP)

    @cute.jit
    def dq_buffer_written(self, wg, odd=False):
        """After warpgroup wg's part is in sdQ (and fenced for the async proxy): its warpgroup
        syncs before one warp issues the add, or, with `dq_writer`, it tells the writer warp and
        goes on."""
        if const_expr(self.dq_writer):
            n = DQ_WRITER_THREADS
            if const_expr(self.writer_warps == 2):
                if odd:
                    cute.arch.barrier_arrive(barrier_id=BARRIER_DQ_FULL_ODD, number_of_threads=n)
                else:
                    cute.arch.barrier_arrive(barrier_id=BARRIER_DQ_FULL, number_of_threads=n)
            else:
                cute.arch.barrier_arrive(barrier_id=BARRIER_DQ_FULL, number_of_threads=n)
        else:
            cute.arch.barrier(barrier_id=BARRIER_DQ + wg, number_of_threads=WARPGROUP)

    @cute.jit
    def stage_dq_fragments(self, acc_dQ, sdQ, scale, wg, wtid, again, odd=False):
        """`stage_dq` in fragment order (`dq_fragment_layout`): 16-byte stores, no swizzle."""
        self.dq_buffer_free(wg, wtid, again, odd)
        for k in cutlass.range_constexpr(cute.size(acc_dQ) // 4):
            vals = cute.make_rmem_tensor((4,), Float32)
            for c in cutlass.range_constexpr(4):
                v = acc_dQ[4 * k + c]
                vals[c] = v if const_expr(self.dq_unscaled) else v * scale
            cute.autovec_copy(vals, sdQ[None, wtid, k, wg])
        cute.arch.fence_view_async_shared()
        self.dq_buffer_written(wg, odd)

    @cute.jit
    def issue_dq(self, sdQ, tma_atom_dQ, mdQacc, m_block, head, batch, seqlen, tidx):
        """dQacc[block m_block][:, half w] += warpgroup w's sdQ buffer: one TMA reduce-add (or, in
        fragment order, one 1-D bulk reduce-add by one thread) issued by the warpgroup's first
        warp, in flight while the loop goes on (deterministic: the turn passes once its writes are
        done, `release_turn`)."""
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        issuer = tidx % WARPGROUP == 0 if const_expr(self.dq_fragments) else tidx % WARPGROUP < 32
        if issuer:
            if const_expr(self.deterministic):
                # The turn was acquired by a generic-proxy load; the reduce-add is an async-proxy
                # write: the PTX memory model orders the two only through a proxy fence.
                cute.arch.fence_proxy("async.global")
            self.reduce_dq(sdQ, tma_atom_dQ, mdQacc, m_block, head, batch, seqlen, wg)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def write_dq_part(self, sdQ, atom, mdQacc, m_block, head, batch, seqlen, wg, store: cutlass.Constexpr):
        """The writer warp's `reduce_dq` (fragment order: by its first lane), or its store."""
        if const_expr(self.dq_fragments):
            if cute.arch.lane_idx() == 0:
                self.reduce_dq(sdQ, atom, mdQacc, m_block, head, batch, seqlen, wg, store)
        else:
            self.reduce_dq(sdQ, atom, mdQacc, m_block, head, batch, seqlen, wg, store)

    @cute.jit
    def reduce_dq(
        self, sdQ, tma_atom_dQ, mdQacc, m_block, head, batch, seqlen, wg, store: cutlass.Constexpr = False
    ):
        """Issue the add of warpgroup wg's sdQ buffer into its part of dQacc's block m_block (a
        warp's TMA reduce-add; in fragment order one thread's 1-D bulk reduce-add onto the
        warpgroup's contiguous half of the block, the host laying dQacc out per head); store: a
        plain store instead (`dq_store_first`; tma_atom_dQ then the store atom)."""
        if const_expr(self.dq_fragments):
            gdQ = self.padded_rows(mdQacc, head, batch, seqlen)  # (varlen: from its padded start)
            count = cute.size(sdQ, mode=[0]) * cute.size(sdQ, mode=[1]) * cute.size(sdQ, mode=[2])
            dst = gdQ.iterator + cute.crd2idx((m_block * self.tile_m, 0), gdQ.layout) + wg * count
            if const_expr(store):  # (`dq_store_first`)
                bulk_store_f32(dst, sdQ[None, None, None, wg].iterator, count * 4)
            else:
                bulk_reduce_add_f32(dst, sdQ[None, None, None, wg].iterator, count * 4)
        else:
            sdQ_wg = sdQ[None, None, wg]
            # This warpgroup's part: rows of the block's second half (by rows), or columns.
            part = (m_block * 2 + wg, 0) if const_expr(self.dq_by_rows) else (m_block, wg)
            gdQ = cute.local_tile(self.padded_rows(mdQacc, head, batch, seqlen), self.dq_tile, part)
            s_grouped, g_grouped = cute.group_modes(sdQ_wg, 0, 2), cute.group_modes(gdQ, 0, 2)
            tdQs, tdQg = cpasync.tma_partition(tma_atom_dQ, 0, cute.make_layout(1), s_grouped, g_grouped)
            cute.copy(tma_atom_dQ, tdQs, tdQg)

    def dkv_by_tma(self, mdK) -> bool:
        """dK, dV leave through shared memory and TMA stores: written in the inputs' type at q
        heads (MHA), dense (a packed varlen tensor would need a ragged view on the key side), at
        the tiles of DKV_TMA_TILES."""
        return self.dkv_tma and mdK.element_type == self.dtype and not (self.varlen or self.dkv_atomic)

    @cute.jit
    def store_dkdv_tma(
        self, acc_dK, acc_dV, tiled_mma_kv, sK, sV, tma_atom_dK, mdK, tma_atom_dV, mdV, scale, n_block, head,
        batch, tidx,
    ):  # fmt: skip
        """dK * scale and dV of this CTA's 128 keys: converted, written over sK and sV by stmatrix
        (both warpgroups' last GEMMs, which read all of sK, must be done first), then one TMA store
        each, issued by the first consumer warp; rows past seqlen_k are clipped by the TMA unit."""
        acc_dK.store(acc_dK.load() * scale)
        cute.arch.barrier(barrier_id=BARRIER_DKV, number_of_threads=NUM_MMA_THREADS)
        smem_copy = stmatrix_copy(self.dtype, tiled_mma_kv, tidx)
        for acc, smem in ((acc_dK, sK), (acc_dV, sV)):
            r16 = cute.make_rmem_tensor(acc.layout, self.dtype)
            convert(acc, r16)
            cute.copy(smem_copy, smem_copy.retile(r16), smem_copy.partition_D(smem))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BARRIER_DKV, number_of_threads=NUM_MMA_THREADS)
        if tidx < 32:
            for atom, smem, gmem in ((tma_atom_dK, sK, mdK), (tma_atom_dV, sV, mdV)):
                tile = cute.local_tile(gmem[None, None, head, batch], (TILE_N, self.head_dim), (n_block, 0))
                ts, tg = cpasync.tma_partition(
                    atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2), cute.group_modes(tile, 0, 2)
                )
                cute.copy(atom, ts, tg)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # sK, sV stay until the stores read them

    @cute.jit
    def store_dkdv(self, acc_dK, acc_dV, thr_kv, mdK, mdV, scale, n0, head, batch, seqlen):
        """dK * scale and dV of this CTA's keys, rows inside the sequence: stored in mdK's type
        (fp32 per q head with GQA, the inputs' type with MHA) at q head `head`, or (dkv_atomic)
        added into kv head `head`'s fp32 sums."""
        cK = thr_kv.partition_C(cute.make_identity_tensor((TILE_N, self.head_dim)))
        cK_mn = cute.make_tensor(cK.iterator, acc_mn_layout(cK.layout))
        dK_mn = cute.make_tensor(acc_dK.iterator, acc_mn_layout(acc_dK.layout))
        dV_mn = cute.make_tensor(acc_dV.iterator, acc_mn_layout(acc_dV.layout))
        gdK = seqlen.rows(mdK, head, batch, seqlen.offset_k)
        gdV = seqlen.rows(mdV, head, batch, seqlen.offset_k)
        seqlen_k = seqlen.seqlen_k
        if const_expr(self.varlen):
            # Offsets the host could not check (CUDA graph capture, torch.compile) are cut at the
            # packed tensor's ends: no store out of bounds.
            seqlen_k = cutlass.min(seqlen_k, mdK.shape[0] - seqlen.offset_k)
            if seqlen.offset_k < 0:
                seqlen_k = Int32(0)
        pair = ir.VectorType.get([2], ir.F32Type.get())
        for r in cutlass.range_constexpr(cute.size(dK_mn, mode=[0])):
            key = n0 + cK_mn[r, 0][0]
            if key < seqlen_k:
                if const_expr(self.dkv_atomic):  # a GQA group's sum, by column pairs
                    for c in cutlass.range_constexpr(0, cute.size(dK_mn, mode=[1]), 2):
                        offset = cute.crd2idx((key, cK_mn[r, c][1]), gdK.layout)
                        k_lo, k_hi = (dK_mn[r, c + i] * scale for i in range(2))
                        cute.arch.atomic_add(
                            gdK.iterator + offset,
                            vector.from_elements(pair, [k_lo.ir_value(), k_hi.ir_value()]),
                        )
                        offset = cute.crd2idx((key, cK_mn[r, c][1]), gdV.layout)
                        v_lo, v_hi = (dV_mn[r, c + i] for i in range(2))
                        cute.arch.atomic_add(
                            gdV.iterator + offset,
                            vector.from_elements(pair, [v_lo.ir_value(), v_hi.ir_value()]),
                        )
                else:
                    for c in cutlass.range_constexpr(cute.size(dK_mn, mode=[1])):
                        col = cK_mn[r, c][1]
                        gdK[key, col] = (dK_mn[r, c] * scale).to(mdK.element_type)
                        gdV[key, col] = dV_mn[r, c].to(mdV.element_type)
