"""Warp-specialized FlashAttention forward for Hopper (FlashAttention-3's design), persistent.

Algorithm, per tile = `tile_m` query rows of one (batch, head); each consumer warpgroup owns 64
of those rows and runs the loop below on its own, key blocks visited from the last (the only
ones that need a mask come first) down to block 0:

    S = Q K_last^T; mask; online softmax; P = fp16/bf16(S)              (first block)
    for j = last-1 .. 0:
        S_next = Q K_j^T          SS-WGMMA, issued async   \\ both in flight together;
        O += P V_{j+1}            RS-WGMMA, issued async   /  wait for GEMM-I only
        mask S_next (first iterations only); online softmax   <- overlaps GEMM-II
        wait GEMM-II; P = fp16/bf16(S_next); O *= exp(m_old - m_new)
    O += P V_0
    O /= rowsum; LSE = m + log(rowsum); O -> smem (stmatrix) -> TMA store

Parts, one file and one concept each (today's cases; to come, after the semicolon): the loops
below call them, and a feature that changes one adds its field to the compile key there.
    seqlen.py     `SeqlenInfo`     where a batch's query rows and keys are (dense; varlen, seqused)
    mask.py       `Mask`           which key blocks a tile visits, which need an element mask,
                                   and that mask (sequence tail, bottom-right causal; windows)
    softmax.py    `Softmax`        what happens to a score and what joins the denominator: the
                                   online softmax with lazy rescaling, O's normalization, the
                                   LSE (scale; softcap, sinks)
    scheduler.py  `TileScheduler`  who takes which tile (persistent CTAs, serpentine order or
                                   longest-first from a global counter; varlen, split-KV)
    loader.py     `TmaLoader`      how Q, K and V arrive (TMA, multicast over CTA pairs; paged K/V)
    epilogue.py   `Epilogue`       where O and LSE go (O through its own, a per-warpgroup or
                                   Q's buffer and a TMA store; varlen, split-KV)
    sm90_common.py                 the WGMMA issue, accumulator views, fp32 -> 16-bit packing
The parts are frozen dataclasses, their static fields `Constexpr`: the DSL's dynamic loops pass
them through as they are (a plain object used inside a dynamic `while` does not compile).
This file: the switches (`__init__`), the launcher (`__call__`), the warp roles (`kernel`), the
producer's load order and the consumers' block steps (both GEMMs, the overlap, pingpong,
causal_trim, Q's release).

Warp roles (`num_threads` = 128 * (1 + tile_m / 64)):
    warpgroup 0      producer. Its warp 0 walks the CTA's tiles, announces each to the
                     consumers and issues every TMA load: K_last, Q, then K_{j} ahead of
                     V_{j+1} (GEMM-I of a block needs K only), through two mbarrier pipelines
                     (K and V, `num_stages` buffers each) and Q's full/empty barriers.
    warpgroups 1..   consumers, 64 query rows each: both GEMMs, softmax, epilogue.
Persistent CTAs (one per SM, `max_ctas`) loop over tiles; the K/V pipelines run on across
tiles, so the next tile's loads overlap this tile's last blocks and epilogue.
Pingpong (`pingpong=True`): the consumer warpgroups pass a token around a ring of named
barriers and issue their GEMMs only while holding it, so one warpgroup's softmax runs while
the other's GEMMs occupy the tensor cores (FlashAttention-3's warp scheduler barriers).
`rescale_o_early` (d = 256) rescales O while GEMM-I runs instead of after GEMM-II.
`mma_rowsum` (d = 64 non-causal): P's row sums come from a 64x8 GEMM of P against ones, issued
with GEMM-II, instead of adds in the softmax.
`intra_wg_overlap=False` gives the plain loop (GEMM-I, softmax, GEMM-II, each waited).
`release_q_at_qk`: the consumers release Q's buffer right after the tile's last GEMM-I (block 0's),
not after its last GEMM-II, so the next tile's Q loads beside block 0's softmax, GEMM-II and
the epilogue (where O has a buffer of its own or per warpgroup).
`causal_trim` (d = 256 causal): a consumer warpgroup issues no MMAs for a key block past all of its
rows, and only half of them where the block's second half is (`keys_seen`).

Register split (setmaxnreg; needs `min_blocks_per_mp=1` at launch or ptxas ignores it):
2 consumer warpgroups: producer 24, consumers 240; 3 consumer warpgroups: 32 and 160
(128 threads per warpgroup times those counts: 64512 and 65536 of the 64K-register file).
Per consumer thread: O (head_dim/2 fp32), S (tile_n/2 fp32) and P (tile_n/4 32-bit registers)
are live together across the overlapped step. P and O are packed to 16 bits two values per
instruction (`convert`): the DSL's `.to()` did not pair bf16 values and cost registers.

Shared memory: Q (tile_m x d), K and V (num_stages x tile_n x d each), 128B-swizzled; O has its
own buffer where it fits (d <= 128), else reuses Q's. Named barriers: 0 = __syncthreads
(setup), 1 = epilogue, 2.. = pingpong ring, 5/6 = tile index written/read.

Score features, one compile-key field each (default off: the code above, unchanged):
`window` ("left", "right", "both": a sliding window's sides with a limit; sizes are runtime
Int32 arguments; `Mask`), `softcap` (runtime cap; `Softmax.apply_softcap`, before the mask) and
`sink` (a per-head fp32 logit tensor; `Softmax.finalize`). A left limit makes tiles visit key
blocks [n_min, n_max) instead of [0, n_max): the producer loads and the consumers visit the
same blocks (last down to n_min), the blocks at the window's left edge masked last. Windows
need cluster_m = 1 (paired tiles visit different blocks) and, with a left limit, no causal_trim.

Packed variable-length sequences (`varlen`, and `seqused_k`): q, k, v, out (total, h, d) seen
as (total, d, h, 1); `SeqlenInfo` reads each batch's offsets and lengths from cu_seqlens, the
scheduler counts tiles up to max_seqlen_q and the producer skips those past a sequence's end
(`skip_empty`), loads start at the sequence's offset and O's TMA store goes through a ragged view
that clips at the sequence's end (`seqlen.ragged_rows`).

Head dims: (head_dim, head_dim_v) of `config.WS_KERNEL_HEAD_DIMS` (q and k, v and O); data of
smaller head dims runs the next kernel up, TMA filling the missing columns with zeros on loading
and clipping them on storing (`config.kernel_head_dims`).

Constraints: fp16/bf16 in, fp32 accumulate; tile_m in {128, 192};
tile_n a multiple of 16 (the P·V K-blocks), at most 256 (WGMMA N); bottom-right causal.
`hopper_fmha.config` owns the tile table and the checks that a tile fits.
"""

from __future__ import annotations

from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from hopper_fmha.config import (
    ROWSUM_COLS,
    SMEM_CAPACITY_BYTES,
    WS_KERNEL_HEAD_DIMS,
    ws_o_buffer,
    ws_smem_bytes,
)

from .epilogue import Epilogue
from .loader import TmaLoader
from .mask import Mask
from .scheduler import TileScheduler
from .seqlen import SeqlenInfo, packed_view, ragged_rows
from .sm90_common import (
    LOG2_E,
    acc_mn_layout,
    acc_to_operand_a_layout,
    atom_rows,
    convert,
    gemm,
    smem_layout,
    tiled_mma_64,
)
from .softmax import Softmax

WARPGROUP = 128
# Named barrier ids (0 is __syncthreads).
BARRIER_EPILOGUE = 1
BARRIER_PINGPONG = 2  # + consumer warpgroup index: the barrier that warpgroup waits on for its turn
BARRIER_TILE_FULL = 5  # the producer has written the next tile index
BARRIER_TILE_EMPTY = 6  # every consumer thread has read it
BARRIER_O_SLOT = 7  # + consumer warpgroup index: that warpgroup's O buffer is written / free (split_o)
# (producer, consumer) registers per thread, by number of consumer warpgroups (FlashAttention-3's).
REGISTER_SPLIT = {1: (24, 240), 2: (24, 240), 3: (32, 160)}


def _minus(count, n_min):
    """count - n_min, or count itself where n_min is the constant 0 (no left window: the same code
    as before windows)."""
    if isinstance(n_min, int) and n_min == 0:
        return count
    return count - n_min


class WsFwdSm90:
    """Compile-time configuration of the warp-specialized kernel; `__call__` is the host launcher."""

    def __init__(
        self,
        dtype,
        head_dim: int,
        tile_m: int,
        tile_n: int,
        causal: bool,
        *,
        num_stages: int = 2,
        intra_wg_overlap: bool = True,
        pingpong: bool = True,
        rescale_o_early: bool = False,
        pin_pv_wait: int = 0,
        cluster_m: int = 1,
        split_o: bool = False,
        mma_rowsum: bool = False,
        causal_trim: bool = False,
        release_q_at_qk: bool = False,
        window: str = "",
        softcap: bool = False,
        sink: bool = False,
        varlen: bool = False,
        seqused_k: bool = False,
        head_dim_v: int | None = None,
        split_kv: bool = False,
        pack_gqa: int = 1,
        paged: int = 0,
        tile_counter: bool = False,
    ):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        assert (head_dim, head_dim_v) in WS_KERNEL_HEAD_DIMS
        assert not (tile_counter and cluster_m > 1), "the tile counter deals tiles to single CTAs"
        assert tile_m in (64, 128, 192) and tile_n % 16 == 0 and 16 <= tile_n <= 256
        assert num_stages >= 1
        self.dtype = dtype
        self.head_dim = head_dim
        # V's and O's columns (q and k: head_dim); both may exceed the data's (`config.kernel_head_dims`).
        self.head_dim_v = head_dim_v
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.causal = causal
        self.num_stages = num_stages
        self.intra_wg_overlap = intra_wg_overlap
        self.pingpong = pingpong
        # Rescale O by the previous block's factor while GEMM-I runs, before GEMM-II is issued,
        # instead of after GEMM-II completes, where it delays the next GEMMs (overlapped loop
        # only). FlashAttention-4 does so above d = 128, where O is the largest.
        self.rescale_o_early = rescale_o_early and intra_wg_overlap
        # n > 0: in the overlapped loop, wait for GEMM-II after the softmax's first n
        # exponentials. Left to itself, ptxas (CUDA 13) hoists that wait above all of them, to
        # just after the row maxima, so no exponential runs beside GEMM-II; a branch on the n-th
        # result (both arms wait) keeps the first n ahead of it.
        self.pin_pv_wait = pin_pv_wait if intra_wg_overlap else 0
        # cluster_m = 2: CTAs work in pairs on neighbouring query tiles of one (batch, head), in
        # lockstep over the same key blocks; each loads half of every K/V block and multicasts it
        # into both, which halves the L2 reads of K and V. Non-causal only: both tiles must visit
        # the same blocks.
        assert cluster_m in (1, 2) and (cluster_m == 1 or not causal)
        assert tile_n % (8 * cluster_m) == 0  # each half whole swizzle atoms
        self.cluster_m = cluster_m
        self.num_mma_wg = tile_m // 64
        self.num_mma_threads = WARPGROUP * self.num_mma_wg
        self.num_threads = WARPGROUP + self.num_mma_threads
        self.producer_regs, self.consumer_regs = REGISTER_SPLIT[self.num_mma_wg]
        # O gets its own shared-memory buffer where it fits beside Q, K and V: the next tile's Q
        # then loads while this tile's epilogue runs. Otherwise O reuses Q's buffer and the next
        # Q waits until the TMA store has read it (K and V of the next tile still load early).
        #
        # split_o: each consumer warpgroup has a buffer of 64 rows x min(d, 128) columns and
        # stores its O through it, in d / 128 passes at d = 256; Q's buffer is free once the tile's
        # last GEMM-I completes, as with a separate buffer. At d = 256 this fits beside 128x64
        # tiles, where a whole separate O does not.
        # Which fit: `config.ws_o_buffer` ("own" fits "split" too).
        fits = ws_o_buffer(head_dim, tile_m, tile_n, num_stages, dtype.width // 8, mma_rowsum, head_dim_v)
        assert not split_o or fits != "q", "split_o: the O buffers do not fit beside Q, K and V"
        self.split_o = split_o
        # mma_rowsum: the row sums of P come from the tensor cores, a 64x8 GEMM of P against a
        # block of ones in shared memory issued with GEMM-II (every column of the result holds
        # the row's sum), instead of tile_n / 2 adds per thread and block in the softmax.
        self.mma_rowsum = mma_rowsum
        # causal_trim: where a key block (or its second half) lies past the causal limit of all
        # 64 rows of a consumer warpgroup, that warpgroup issues no MMAs for it (or GEMM-I at
        # tile_n / 2 and GEMM-II over the first half of the keys). Blocks still go through the
        # K/V pipelines, the pingpong ring and the commit groups as any other (`keys_seen`).
        # Overlapped loop without mma_rowsum only: with the plain loop (d128) or the row sums
        # (d64), ptxas serializes every WGMMA of the kernel once the trimmed branches are in.
        self.trim = causal and causal_trim
        assert not self.trim or (self.intra_wg_overlap and not mma_rowsum), (
            "causal_trim needs intra_wg_overlap and no mma_rowsum (else ptxas serializes the WGMMAs)"
        )
        self.trim_half = self.trim and tile_n % 32 == 0  # half of the keys in whole 16-key K blocks
        self.separate_o = not split_o and fits == "own"
        # Split-KV kernels write O from registers (`Epilogue.store_partial`): Q's buffer is free
        # after the last GEMM-I, as with an O buffer of its own.
        self.early_q_release = self.separate_o or split_o or split_kv or pack_gqa > 1
        # release_q_at_qk (overlapped loop): the consumers release Q's buffer in the block step
        # whose GEMM-I is the tile's last (block 0), right after it completes, instead of after
        # the tile's last GEMM-II: the next tile's Q load then has block 0's softmax and GEMM-II
        # and the epilogue to arrive in.
        self.release_q_at_qk = release_q_at_qk and self.early_q_release and intra_wg_overlap
        o_buffer = "own" if self.separate_o else "split" if split_o else "q"
        self.smem_bytes = ws_smem_bytes(
            head_dim, tile_m, tile_n, num_stages, dtype.width // 8, mma_rowsum, o_buffer, head_dim_v
        )
        assert not mma_rowsum or self.smem_bytes <= SMEM_CAPACITY_BYTES, (
            "mma_rowsum: the block of ones does not fit in shared memory beside Q, K and V"
        )

        # Score features (module docstring): a window's sides, softcap, a learnable sink.
        assert window in ("", "left", "right", "both"), f"window {window!r}"
        self.window_left = window in ("left", "both")
        self.window_right = window in ("right", "both")
        assert not (causal and self.window_right), "causal is the right limit 0: no window right side"
        assert not window or cluster_m == 1, "a window needs cluster_m = 1 (pairs visit the same blocks)"
        assert not (self.trim and self.window_left), "causal_trim with a left window is not supported"
        self.softcap = softcap
        self.sink = sink
        # Packed variable-length sequences (`SeqlenInfo`): cu_seqlens_q/k; seqused_k (a KV
        # cache's filled rows, dense or packed).
        self.varlen = varlen
        self.seqused_k = seqused_k
        # Split-KV: a tile is one of num_splits ranges of its key blocks; it writes a partial O
        # (fp32, normalized within the split) and LSE to a workspace that `combine` merges. The
        # sink joins split 0 only. No CTA pairs (the splits of a pair would differ).
        assert not (split_kv and cluster_m > 1), "split_kv needs cluster_m = 1"
        self.split_kv = split_kv
        # Pack-GQA (pack_gqa = G > 1, the q heads per kv head): a tile's rows are the query rows of
        # the G q heads of one kv head, packed row R = query * G + (q head within the group), so a
        # K/V block serves all of them (decode: seqlen_q * G rows instead of seqlen_q per tile).
        # Q arrives by the producer warp's vector loads (`load_q_packed`), O and LSE leave from
        # registers (`Epilogue.store_packed`), the mask maps packed rows to queries.
        assert pack_gqa >= 1
        assert pack_gqa == 1 or not (varlen or cluster_m > 1 or self.trim), (
            "pack_gqa: no varlen, CTA pairs or causal_trim"
        )
        self.pack_gqa = pack_gqa
        # Paged K/V (`TmaLoader.paged`): a page table per sequence; keys per sequence from
        # seqused_k (the cache's capacity is no tensor's extent); `paged` pages per key block.
        assert not paged or (seqused_k and cluster_m == 1 and not varlen), (
            "paged: seqused_k, no pairs, no varlen"
        )
        assert paged <= 1 or (tile_n % paged == 0 and (tile_n // paged) % 16 == 0)
        self.paged = paged

        # The parts (see the module docstring).
        self.mask = Mask(tile_m, tile_n, causal, self.window_left, self.window_right, pack_gqa)
        self.loader = TmaLoader(dtype, tile_m, tile_n, head_dim, head_dim_v, cluster_m, paged)
        # Persistent CTAs take tiles from a global counter (first come, first served) when tiles
        # differ in work (causal), else in a fixed serpentine order.
        self.scheduler = TileScheduler(
            tile_m,
            cluster_m,
            causal or tile_counter,  # tiles from the global counter, else serpentine
            32 + self.num_mma_threads,
            BARRIER_TILE_FULL,
            BARRIER_TILE_EMPTY,
            split_kv,
        )
        self.epilogue = Epilogue(
            dtype, tile_m, head_dim_v, self.num_mma_wg, o_buffer, BARRIER_EPILOGUE, BARRIER_O_SLOT
        )

    # ---------------------------------------------------------------- host side
    def _tiled_mmas(self):
        def tiled_mma(b_major, n, a_source=warpgroup.OperandSource.SMEM):
            return tiled_mma_64(self.dtype, b_major, n, self.num_mma_wg, a_source)  # warpgroups along M

        # GEMM-I (Q, K from smem), GEMM-II (P from registers, V^T), P's row sums (ones K-major).
        tiled_mma_qk = tiled_mma(OperandMajorMode.K, self.tile_n)
        tiled_mma_pv = tiled_mma(OperandMajorMode.MN, self.head_dim_v, warpgroup.OperandSource.RMEM)
        tiled_mma_sum = tiled_mma(OperandMajorMode.K, ROWSUM_COLS, warpgroup.OperandSource.RMEM)
        # GEMM-I over the first half of a key block (causal_trim).
        tiled_mma_qk_half = tiled_mma(OperandMajorMode.K, self.tile_n // 2)
        return tiled_mma_qk, tiled_mma_pv, tiled_mma_sum, tiled_mma_qk_half

    def _smem_layout(self, rows: int, stages: int | None = None, cols: int | None = None):
        return smem_layout(self.dtype, rows, self.head_dim if cols is None else cols, stages)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h, d)
        mK: cute.Tensor,  # (b, s_k, h_kv, d)
        mV: cute.Tensor,  # (b, s_k, h_kv, d)
        mO: cute.Tensor,  # (b, s_q, h, d)
        mLSE: cute.Tensor,  # (b, h, s_q) float32
        softmax_scale: Float32,
        qhead_per_kvhead: Int32,
        max_ctas: Int32,
        lpt_group: Int32,
        tile_counters: cute.Tensor,  # int32, 2 per slot, zero between launches
        counter_slot: Int32,
        stream: cuda.CUstream,
        window_left: Int32 | None = None,
        window_right: Int32 | None = None,
        softcap: Float32 | None = None,
        mSink: cute.Tensor | None = None,
        mCuSeqlensQ: cute.Tensor | None = None,
        mCuSeqlensK: cute.Tensor | None = None,
        mSeqUsedK: cute.Tensor | None = None,
        max_seqlen_q: Int32 | None = None,
        mOPartial: cute.Tensor | None = None,
        mLSEPartial: cute.Tensor | None = None,
        num_splits: Int32 | None = None,
        mPageTable: cute.Tensor | None = None,
    ):
        """Launch over every (m_block, head, batch) tile; `max_ctas` > 0 makes it persistent.

        max_ctas: 0 launches one CTA per tile; otherwise min(max_ctas, tiles) CTAs each loop over
        tiles: causal ones through the counters of `counter_slot` (which the last CTA to finish
        sets back to zero), others in serpentine order. lpt_group: > 0 orders tiles longest first
        (causal) within groups of that many (head, batch) pairs, whose K and V fit in L2 together.
        Score features, given only to kernels compiled with them (else None): window_left and
        window_right (sizes >= 0 of the sides `window` limits), softcap (the cap, > 0) and mSink
        ((h,) float32 logits).
        Varlen, given only to kernels compiled with it: q, k, v, out packed (total, h, d), lse
        (h, total_q); mCuSeqlensQ/K (int32, batch + 1), mSeqUsedK (int32, batch; seqused_k
        kernels) and max_seqlen_q, which sizes the grid (rows past it are not computed). Dense
        seqused_k kernels take mSeqUsedK alone (a KV cache's filled rows).
        Split-KV, given only to kernels compiled with it: mOPartial (num_splits, b, s_q, h, dv) and
        mLSEPartial (num_splits, b, h, s_q), float32, and num_splits; O and LSE are not written.
        Paged, given only to kernels compiled with it: k and v (num_pages, page_size, h_kv, d) and
        mPageTable (b, pages per sequence) int32.
        """
        # Sequence first, as the TMA tiles and WGMMA expect: (s, d, h, b) and LSE (s, h, b).
        if const_expr(self.varlen):
            num_batch = mCuSeqlensQ.shape[0] - 1
            mQ, mK, mV, mO = [packed_view(t) for t in (mQ, mK, mV, mO)]
            mLSE = cute.make_tensor(
                mLSE.iterator,
                cute.append(cute.select(mLSE.layout, mode=[1, 0]), cute.make_layout(1, stride=0)),
            )
            seqlen_q_grid = max_seqlen_q
        else:
            mQ, mK, mV, mO = [
                cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
                for t in (mQ, mK, mV, mO)
            ]
            mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))
            num_batch = mQ.shape[3]
            seqlen_q_grid = mQ.shape[0]

        tiled_mma_qk, tiled_mma_pv, tiled_mma_sum, tiled_mma_qk_half = self._tiled_mmas()
        # Ones (ROWSUM_COLS x tile_n, K-major), GEMM-II's partner's B operand (mma_rowsum).
        sOnes_layout = self._smem_layout(ROWSUM_COLS, cols=self.tile_n)
        ones_elems = cute.cosize(sOnes_layout) if const_expr(self.mma_rowsum) else 8
        sQ_layout = self._smem_layout(self.tile_m)
        sK_layout = self._smem_layout(self.tile_n, self.num_stages)
        sV_layout = self._smem_layout(self.tile_n, self.num_stages, cols=self.head_dim_v)

        tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V = self.loader.make_atoms(
            mQ, mK, mV, sQ_layout, cute.select(sK_layout, mode=[0, 1]), cute.select(sV_layout, mode=[0, 1])
        )
        # O: the whole tile from Q's or its own buffer, or (split_o) 64 x 128 from a warpgroup's.
        # Pack-GQA: Q and O also as plain (s, d, h, b) tensors (loaded and stored without TMA).
        mQ_raw, mO_raw = (mQ, mO) if const_expr(self.pack_gqa > 1) else (None, None)
        # Varlen: a ragged view, so that each tile's store clips at its sequence's end.
        sO_layout, o_elems, tma_atom_O, tma_O = self.epilogue.make_atom(
            ragged_rows(mO) if const_expr(self.varlen) else mO
        )

        @cute.struct
        class SharedStorage:
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 1]
            mbar_K: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]  # full + empty per stage
            mbar_V: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_Q_empty: cute.struct.MemRange[cutlass.Int64, 1]
            tile_index: cute.struct.MemRange[Int32, 4]  # the tile the producer announces
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, o_elems], 1024]
            sOnes: cute.struct.Align[cute.struct.MemRange[self.dtype, ones_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        # The host's checks (`config.check_fits_ws`, `config.ws_o_buffer`) count these bytes.
        assert SharedStorage.size_in_bytes() == self.smem_bytes, (
            f"shared storage {SharedStorage.size_in_bytes()} bytes, config.ws_smem_bytes {self.smem_bytes}"
        )

        scale_log2 = softmax_scale * LOG2_E
        softcap_scale = None
        if const_expr(self.softcap):
            # s = cap * tanh(S * softmax_scale / cap): the exponent's scale is cap * log2 e.
            scale_log2 = softcap * LOG2_E
            softcap_scale = softmax_scale / softcap
        if const_expr(not self.window_left):
            window_left = None
        if const_expr(not self.window_right):
            window_right = None
        if const_expr(not self.sink):
            mSink = None
        if const_expr(not self.varlen):
            max_seqlen_q, mCuSeqlensQ, mCuSeqlensK = None, None, None
        if const_expr(not self.seqused_k):
            mSeqUsedK = None
        if const_expr(not self.split_kv):
            mOPartial, mLSEPartial, num_splits = None, None, 1
        if const_expr(not self.paged):
            mPageTable = None

        # Tiles (cluster_m = 2: pairs of query tiles), one per cluster at a time.
        num_heads_grid = mQ.shape[2]
        if const_expr(self.pack_gqa > 1):  # tiles of packed rows, per kv head
            seqlen_q_grid, num_heads_grid = seqlen_q_grid * self.pack_gqa, mK.shape[2]
        grid = self.scheduler.grid(seqlen_q_grid, num_heads_grid, num_batch, max_ctas, num_splits)
        self.kernel(
            tma_atom_Q,
            tma_Q,
            tma_atom_K,
            tma_K,
            tma_atom_V,
            tma_V,
            tma_atom_O,
            tma_O,
            mLSE,
            scale_log2,
            qhead_per_kvhead,
            lpt_group,
            tile_counters,
            counter_slot,
            sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout,
            tiled_mma_qk,
            tiled_mma_pv,
            tiled_mma_sum,
            tiled_mma_qk_half,
            sOnes_layout,
            SharedStorage,
            window_left,
            window_right,
            softcap_scale,
            mSink,
            max_seqlen_q,
            mCuSeqlensQ,
            mCuSeqlensK,
            mSeqUsedK,
            mOPartial,
            mLSEPartial,
            num_splits,
            mQ_raw,
            mO_raw,
            mPageTable,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            cluster=[self.cluster_m, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_O: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        scale_log2: Float32,
        qhead_per_kvhead: Int32,
        lpt_group: Int32,
        tile_counters: cute.Tensor,
        counter_slot: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tiled_mma_sum: cute.TiledMma,
        tiled_mma_qk_half: cute.TiledMma,
        sOnes_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
        window_left: Int32 | None,
        window_right: Int32 | None,
        softcap_scale: Float32 | None,
        mSink: cute.Tensor | None,
        max_seqlen_q: Int32 | None,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mOPartial: cute.Tensor | None,
        mLSEPartial: cute.Tensor | None,
        num_splits: Int32,
        mQ_raw: cute.Tensor | None,
        mO_raw: cute.Tensor | None,
        mPageTable: cute.Tensor | None,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for tma_atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(tma_atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar_Q = storage.mbar_Q.data_ptr()
        mbar_Q_empty = storage.mbar_Q_empty.data_ptr()
        if warp_idx == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(mbar_Q, 1)
                # Released once per consumer warp after its last GEMM-I (O not in Q's buffer), or
                # once, by the thread that waited for the O store to read Q's buffer.
                cute.arch.mbarrier_init(
                    mbar_Q_empty, self.num_mma_threads // 32 if self.early_q_release else 1
                )
        # Pipelines initialise their barriers from warp 0; "full" completes on one producer
        # arrive plus the TMA bytes (with multicast: both halves, one from each CTA), "empty" on
        # one arrive per consumer WARP of every CTA the stage is multicast to (lane r signals
        # CTA r of the cluster).
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumer_group = pipeline.CooperativeGroup(
            pipeline.Agent.Thread, self.num_mma_threads // 32 * self.cluster_m
        )
        cta_layout_vmnk = cute.make_layout((1, self.cluster_m, 1, 1))
        bytes_K = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        bytes_V = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))
        pipeline_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_K.data_ptr(),
            num_stages=self.num_stages,
            producer_group=producer_group,
            consumer_group=consumer_group,
            tx_count=bytes_K,
            cta_layout_vmnk=cta_layout_vmnk,
            mcast_mode_mn=(0, 1),
            defer_sync=True,
        )
        pipeline_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_V.data_ptr(),
            num_stages=self.num_stages,
            producer_group=producer_group,
            consumer_group=consumer_group,
            tx_count=bytes_V,
            cta_layout_vmnk=cta_layout_vmnk,
            mcast_mode_mn=(0, 1),
            defer_sync=True,
        )
        cluster_shape_mn = (self.cluster_m, 1) if const_expr(self.cluster_m > 1) else None
        sOnes = None
        if const_expr(self.mma_rowsum):
            # Every element is 1, so the swizzle does not matter for the fill: write it flat.
            flat = storage.sOnes.get_tensor(cute.make_layout(cute.cosize(sOnes_layout)))
            tid = cute.arch.thread_idx()[0]
            for j in cutlass.range_constexpr(cute.ceil_div(cute.cosize(sOnes_layout), self.num_threads)):
                if tid + j * self.num_threads < cute.cosize(sOnes_layout):
                    flat[tid + j * self.num_threads] = self.dtype(1.0)
            cute.arch.fence_view_async_shared()  # visible to the tensor cores' reads
            cute.arch.sync_threads()
            sOnes = storage.sOnes.get_tensor(sOnes_layout.outer, swizzle=sOnes_layout.inner)
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster_shape_mn)
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster_shape_mn)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sO = sQ
        if const_expr(self.head_dim_v != self.head_dim and not (self.separate_o or self.split_o)):
            # O through Q's buffer, in fewer columns than Q: its own layout over Q's storage.
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        if const_expr(self.separate_o or self.split_o):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)

        # `SeqlenInfo.create`'s arguments after the batch. Dense: every batch's sequence lengths.
        # Varlen: tiles up to max_seqlen_q, lengths and offsets from cu_seqlens (and seqused_k).
        num_heads = mQ.shape[2]
        if const_expr(self.varlen):
            seqlen_q_grid, num_batch = max_seqlen_q, mCuSeqlensQ.shape[0] - 1
            seqlens = (mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        else:
            seqlen_q_grid, num_batch = mQ.shape[0], mQ.shape[3]
            seqlens = (mQ.shape[0], mK.shape[0])
            if const_expr(self.seqused_k):
                capacity = mK.shape[0]
                if const_expr(self.paged):  # the pages of a sequence's table
                    capacity = mPageTable.shape[1] * mK.shape[0]
                seqlens = (mQ.shape[0], capacity, None, None, mSeqUsedK)
        s_tile = storage.tile_index.get_tensor(cute.make_layout(1))
        counters = tile_counters.iterator + 2 * counter_slot
        if const_expr(self.pack_gqa > 1):
            seqlen_q_grid, num_heads = seqlen_q_grid * self.pack_gqa, mK.shape[2]
        sched = self.scheduler.create(
            seqlen_q_grid, num_heads, num_batch, lpt_group, s_tile, counters, num_splits
        )
        mask = self.mask
        if const_expr(self.window_left or self.window_right):
            mask = self.mask.with_window(window_left, window_right)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.producer(
                    tma_atom_Q, mQ, tma_atom_K, mK, tma_atom_V, mV, sQ, sK, sV, mbar_Q, mbar_Q_empty,
                    pipeline_k, pipeline_v, qhead_per_kvhead, seqlens, sched, mask, mQ_raw, mPageTable,
                )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            tidx = cute.arch.thread_idx()[0] - WARPGROUP
            self.consumer(
                tiled_mma_qk, tiled_mma_pv, tiled_mma_sum, tiled_mma_qk_half, sQ, sK, sV, sO, sOnes, mbar_Q,
                mbar_Q_empty, pipeline_k, pipeline_v, tma_atom_O, mO, mLSE, scale_log2, tidx, seqlens, sched,
                mask, softcap_scale, mSink, mOPartial, mLSEPartial, mO_raw,
            )  # fmt: skip

    # ---------------------------------------------------------------- producer
    @cute.jit
    def producer(
        self,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        mbar_Q: cute.Pointer,
        mbar_Q_empty: cute.Pointer,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        qhead_per_kvhead: Int32,
        seqlens: tuple,
        sched: TileScheduler,
        mask: Mask,
        mQ_raw: cute.Tensor | None,
        mPageTable: cute.Tensor | None,
    ):
        """One warp: every TMA load, tile after tile, in the order the consumers use them.

        The K/V pipelines run on across tiles, so the next tile's first blocks load while the
        consumers finish this one; Q waits until the consumers release Q's buffer. Each tile is
        announced to the consumers (`TileScheduler.announce`), and at the end an index past the
        last tile, which tells them to stop. seqlens: `SeqlenInfo.create`'s arguments after the
        batch (dense: the tensors' seqlen_q, seqlen_k; varlen: also cu_seqlens, seqused_k). mask:
        `self.mask` with the window's sizes: the blocks [n_min, n_max) it gives, as the consumers.
        """
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        num_tiles = sched.num_tiles()
        cta, num_ctas = sched.ctas()
        loader = self.loader.create(tma_atom_Q, mQ, sQ, tma_atom_K, mK, sK, tma_atom_V, mV, sV, mPageTable)
        tile = self.skip_empty(sched, cta, cta, num_ctas, seqlens)
        q_phase = Int32(0)
        announced = Int32(0)
        while tile < num_tiles:
            sched.announce(tile, announced)
            announced += 1
            m_block, head, batch, split = sched.tile_coords(tile)
            head_kv = head // qhead_per_kvhead
            if const_expr(self.pack_gqa > 1):
                head_kv = head  # the scheduler's heads are kv heads
            seqlen = SeqlenInfo.create(batch, *seqlens)
            n_min, n_max, _, _ = self.block_range(mask, m_block, seqlen, split, sched.num_splits)
            kv = loader.partition(m_block, head, head_kv, batch, seqlen)
            if n_max > n_min:
                k_state = loader.load_k(kv, pipeline_k, k_state, n_max - 1)
            # Q is loaded for every tile (also one whose rows see no key) so that both sides
            # count Q's phases alike.
            cute.arch.mbarrier_wait(mbar_Q_empty, q_phase ^ 1)
            if const_expr(self.pack_gqa > 1):
                self.load_q_packed(mQ_raw, sQ, m_block, head_kv, batch, seqlen, mbar_Q)
            else:
                loader.load_q(kv, mbar_Q)
            q_phase = q_phase ^ 1
            if n_max > n_min:
                if const_expr(self.intra_wg_overlap):
                    # GEMM-I of block n runs beside GEMM-II of block n + 1: K_n goes ahead of V_{n+1}.
                    for i in cutlass.range(_minus(n_max - 1, n_min), unroll=1):
                        n_block = n_max - 2 - i
                        k_state = loader.load_k(kv, pipeline_k, k_state, n_block)
                        v_state = loader.load_v(kv, pipeline_v, v_state, n_block + 1)
                    v_state = loader.load_v(kv, pipeline_v, v_state, n_min)
                else:
                    v_state = loader.load_v(kv, pipeline_v, v_state, n_max - 1)
                    for i in cutlass.range(_minus(n_max - 1, n_min), unroll=1):
                        n_block = n_max - 2 - i
                        k_state = loader.load_k(kv, pipeline_k, k_state, n_block)
                        v_state = loader.load_v(kv, pipeline_v, v_state, n_block)
            # Claim the next tile only now, with this tile's last loads issued: the consumers
            # still have about num_stages blocks to go, which hides the atomic. Claimed when
            # this tile started, a CTA would hold a tile it cannot start while others run dry:
            # d256 causal measured 611 vs 673 TFLOP/s (a simulation of the order predicted 7%).
            tile = self.skip_empty(sched, sched.fetch_tile(tile, cta, num_ctas), cta, num_ctas, seqlens)
        sched.announce(tile, announced)  # past the last tile: the consumers stop
        sched.finish(num_ctas)
        if const_expr(self.split_kv):
            # No tile left for this CTA: the combine (launched dependent, `combine.py`) may start
            # its CTAs, which wait for this grid's completion before reading the partials.
            cute.arch.griddepcontrol_launch_dependents()
        # Stay until the consumers have released every buffer: no arrive lands after exit.
        pipeline_k.producer_tail(k_state)
        pipeline_v.producer_tail(v_state)

    # ---------------------------------------------------------------- consumers
    @cute.jit
    def consumer(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tiled_mma_sum: cute.TiledMma,
        tiled_mma_qk_half: cute.TiledMma,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sO: cute.Tensor,
        sOnes,
        mbar_Q: cute.Pointer,
        mbar_Q_empty: cute.Pointer,
        pipeline_k: pipeline.PipelineAsync,
        pipeline_v: pipeline.PipelineAsync,
        tma_atom_O: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        scale_log2: Float32,
        tidx: Int32,
        seqlens: tuple,
        sched: TileScheduler,
        mask: Mask,
        softcap_scale: Float32,
        mSink: cute.Tensor,
        mOPartial: cute.Tensor,
        mLSEPartial: cute.Tensor,
        mO_raw: cute.Tensor,
    ):
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        # smem operand descriptors are per warpgroup; accumulators per thread.
        wg_mma_qk = tiled_mma_qk.get_slice(wg * WARPGROUP)
        wg_mma_pv = tiled_mma_pv.get_slice(wg * WARPGROUP)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        # V^T (d, tile_n, stages) for GEMM-II's MN-major B operand.
        sVt = cute.composition(
            sV, cute.make_ordered_layout((self.head_dim_v, self.tile_n, self.num_stages), order=(1, 0, 2))
        )
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrV = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        acc_shape_S = thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        acc_O = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C((self.tile_m, self.head_dim_v)))
        # P, the A operand of GEMM-II: the accumulator layout of S re-viewed (no data movement).
        tOrP_acc = cute.make_rmem_tensor(acc_shape_S, self.dtype)
        tOrP = cute.make_tensor(tOrP_acc.iterator, acc_to_operand_a_layout(tOrP_acc.layout))
        rows_per_thread = cute.size(acc_mn_layout(acc_O.layout), mode=[0])
        # mma_rowsum: P's row sums, accumulated by the tensor cores like O (column 0 is read).
        acc_sum = None
        tOrOnes = None
        if const_expr(self.mma_rowsum):
            wg_mma_sum = tiled_mma_sum.get_slice(wg * WARPGROUP)
            tOrOnes = wg_mma_sum.make_fragment_B(wg_mma_sum.partition_B(sOnes))
            thr_mma_sum = tiled_mma_sum.get_slice(tidx)
            acc_sum = thr_mma_sum.make_fragment_C(thr_mma_sum.partition_shape_C((self.tile_m, ROWSUM_COLS)))
        accs = [acc_O, acc_sum] if const_expr(self.mma_rowsum) else [acc_O]  # what O's rescale scales
        # causal_trim at tile_n / 2: Q and the first half of every K stage for the narrow GEMM-I.
        tSrQ_half = None
        tSrK_half = None
        acc_shape_S_half = None
        if const_expr(self.trim_half):
            wg_mma_half = tiled_mma_qk_half.get_slice(wg * WARPGROUP)
            sK_half = cute.local_tile(sK, (self.tile_n // 2, self.head_dim, self.num_stages), (0, 0, 0))
            tSrQ_half = wg_mma_half.make_fragment_A(wg_mma_half.partition_A(sQ))
            tSrK_half = wg_mma_half.make_fragment_B(wg_mma_half.partition_B(sK_half))
            acc_shape_S_half = tiled_mma_qk_half.get_slice(tidx).partition_shape_C(
                (self.tile_m, self.tile_n // 2)
            )
        softmax = Softmax.create(scale_log2, rows_per_thread, self.mma_rowsum, softcap_scale)
        # With rescale_o_early: the factor of the last softmax, applied before the next GEMM-II.
        o_scale = cute.make_rmem_tensor((rows_per_thread,), Float32)
        cS = thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        tScS_mn = cute.make_tensor(cS.iterator, acc_mn_layout(cS.layout))

        if const_expr(self.pingpong):
            # The first consumer warpgroup starts with the token.
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=BARRIER_PINGPONG, number_of_threads=2 * WARPGROUP)

        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        num_tiles = sched.num_tiles()
        q_phase = Int32(0)
        tile = sched.next_announced()
        while tile < num_tiles:
            sched.ack_announced()
            if const_expr(not self.pingpong):
                # Not needed for correctness (`ack_announced` orders the read before the
                # producer's next write), but without it compute-sanitizer's racecheck reports
                # that write as a WAR hazard; kernels with pingpong, whose consumers pass a
                # consumer-only bar.sync right after the arrive, are reported clean. One sync of
                # the consumers per tile.
                cute.arch.barrier(barrier_id=BARRIER_EPILOGUE, number_of_threads=self.num_mma_threads)
            m_block, head, batch, split = sched.tile_coords(tile)
            seqlen = SeqlenInfo.create(batch, *seqlens)
            n_min, n_max, n_left_masked, n_unmasked = self.block_range(
                mask, m_block, seqlen, split, sched.num_splits
            )
            acc_O.fill(0.0)
            if const_expr(self.mma_rowsum):
                acc_sum.fill(0.0)
            softmax.reset()
            # What every block step of this tile reads (registers and views, nothing copied).
            ctx = SimpleNamespace(
                tiled_mma_qk=tiled_mma_qk, tiled_mma_pv=tiled_mma_pv, tiled_mma_sum=tiled_mma_sum, tSrQ=tSrQ,
                tSrK=tSrK, tOrV=tOrV, tOrOnes=tOrOnes, acc_sum=acc_sum, tiled_mma_qk_half=tiled_mma_qk_half,
                tSrQ_half=tSrQ_half, tSrK_half=tSrK_half, acc_shape_S=acc_shape_S,
                acc_shape_S_half=acc_shape_S_half, acc_O=acc_O, tOrP_acc=tOrP_acc, tOrP=tOrP, softmax=softmax,
                accs=accs, o_scale=o_scale, tScS_mn=tScS_mn, pipeline_k=pipeline_k,
                pipeline_v=pipeline_v, m_block=m_block, seqlen=seqlen, wg=wg,
                mbar_Q_empty=mbar_Q_empty, mask=mask, n_min=n_min,
            )  # fmt: skip
            cute.arch.mbarrier_wait(mbar_Q, q_phase)
            q_phase = q_phase ^ 1
            if n_max > n_min:
                n_first = n_max - 1
                n_masked_end = cutlass.min(n_unmasked, n_first)  # blocks [n_masked_end, n_first) need a mask
                # Unmasked blocks [n_left_end, n_masked_end), then (left window) the masked
                # blocks [n_min, n_left_end) at the window's left edge. Without split-KV, n_min is
                # the constant 0 unless there is a left window.
                n_left_end = n_min
                if const_expr(self.window_left):
                    n_left_end = cutlass.min(n_left_masked, n_masked_end)

                if const_expr(self.intra_wg_overlap):
                    k_state = self.first_block(n_first, k_state, ctx)
                    for i in cutlass.range(n_first - n_masked_end, unroll=1):
                        k_state, v_state = self.overlapped_block(n_first - 1 - i, True, k_state, v_state, ctx)
                    n_plain = n_masked_end
                    if const_expr(self.trim):
                        # The first unmasked block's GEMM-II takes P of the last masked block,
                        # which may be trimmed: that one step checks (`pv_trimmed`).
                        if n_masked_end > n_min:
                            k_state, v_state = self.overlapped_block(
                                n_masked_end - 1, False, k_state, v_state, ctx, pv_trimmed=True
                            )
                        n_plain = n_masked_end - 1
                    for i in cutlass.range(_minus(n_plain, n_left_end), unroll=1):
                        k_state, v_state = self.overlapped_block(
                            n_plain - 1 - i, False, k_state, v_state, ctx
                        )
                    if const_expr(self.window_left):
                        for i in cutlass.range(n_left_end - n_min, unroll=1):
                            k_state, v_state = self.overlapped_block(
                                n_left_end - 1 - i, True, k_state, v_state, ctx
                            )
                    v_state = self.last_pv(v_state, ctx)
                else:
                    k_state, v_state = self.plain_block(n_first, True, True, k_state, v_state, ctx)
                    for i in cutlass.range(n_first - n_masked_end, unroll=1):
                        k_state, v_state = self.plain_block(
                            n_first - 1 - i, True, False, k_state, v_state, ctx
                        )
                    for i in cutlass.range(_minus(n_masked_end, n_left_end), unroll=1):
                        k_state, v_state = self.plain_block(
                            n_masked_end - 1 - i, False, False, k_state, v_state, ctx
                        )
                    if const_expr(self.window_left):
                        for i in cutlass.range(n_left_end - n_min, unroll=1):
                            k_state, v_state = self.plain_block(
                                n_left_end - 1 - i, True, False, k_state, v_state, ctx
                            )
                    self.pingpong_pass(wg)
            if const_expr(self.early_q_release):
                # Every GEMM-I of this warp has completed: Q's buffer may take the next tile
                # (release_q_at_qk: block 0's step has released it, unless the tile had no block).
                if const_expr(self.release_q_at_qk):
                    if n_max <= n_min:
                        self.release_q(mbar_Q_empty)
                else:
                    self.release_q(mbar_Q_empty)
            sink_log2 = None
            if const_expr(self.sink and self.pack_gqa > 1):
                sink_log2 = self.packed_sink_logits(mSink, head, split, m_block, tScS_mn, rows_per_thread)
            elif const_expr(self.sink):
                sink_log2 = Float32(mSink[head]) * LOG2_E
                if const_expr(self.split_kv):
                    if split > 0:  # the sink joins split 0 only; far below any score, not -inf (nan)
                        sink_log2 = Float32(-1.0e30)
            lse = softmax.finalize(acc_O, acc_sum, sink_log2)
            if const_expr(self.split_kv):
                self.epilogue.store_partial(
                    acc_O, lse, mOPartial, mLSEPartial, thr_mma_pv, tidx, m_block, head, batch, split, seqlen,
                    self.pack_gqa,
                )  # fmt: skip
            elif const_expr(self.pack_gqa > 1):
                self.epilogue.store_packed(
                    acc_O, lse, mO_raw, mLSE, thr_mma_pv, m_block, head, batch, seqlen, self.pack_gqa
                )
            else:
                self.epilogue.store(
                    acc_O, lse, sO, mbar_Q_empty, tma_atom_O, mO, mLSE, tiled_mma_pv,
                    thr_mma_pv, tidx, m_block, head, batch, seqlen,
                )  # fmt: skip
            tile = sched.next_announced()
        self.epilogue.drain(tidx)

    @cute.jit
    def packed_sink_logits(
        self, mSink: cute.Tensor, head_kv: Int32, split, m_block: Int32, tScS_mn, rows_per_thread
    ):
        """Pack-GQA: the learnable sink * log2 e of each of this thread's rows (its q head's), a
        tensor of one per row. Split-KV: split 0 only; the others get a value far below any
        score (not -inf: -inf - -inf is nan in the finalize)."""
        sinks = cute.make_rmem_tensor((rows_per_thread,), Float32)
        for r in cutlass.range_constexpr(rows_per_thread):
            packed = m_block * self.tile_m + tScS_mn[r, 0][0]
            sinks[r] = Float32(mSink[head_kv * self.pack_gqa + packed % self.pack_gqa]) * LOG2_E
            if const_expr(self.split_kv):
                if split > 0:
                    sinks[r] = Float32(-1.0e30)
        return sinks

    @cute.jit
    def load_q_packed(
        self,
        mQ: cute.Tensor,
        sQ: cute.Tensor,
        m_block: Int32,
        head_kv: Int32,
        batch: Int32,
        seqlen: SeqlenInfo,
        mbar_Q: cute.Pointer,
    ):
        """Pack-GQA, producer warp: the tile's packed rows of Q (row R: query R // G of q head
        head_kv * G + R % G) from the plain (s, d, h, b) tensor into Q's buffer, 16 bytes per
        lane and step; rows past the sequence and columns past the data's head dim as zeros. Then
        Q's barrier (one arrive, no bytes to count)."""
        group = self.pack_gqa
        vec = 8  # 16 bytes of fp16/bf16
        per_row = self.head_dim // vec
        lane = cute.arch.lane_idx()
        packed_rows = seqlen.seqlen_q * group
        data_d = mQ.shape[1]
        zeros = cute.make_rmem_tensor((vec,), self.dtype)
        zeros.fill(0.0)
        # A rolled loop: the producer warp runs on 24-32 registers.
        for i in cutlass.range(self.tile_m * per_row // 32, unroll=1):
            unit = lane + 32 * i
            row = unit // per_row
            cv = unit % per_row
            dst = cute.local_tile(sQ[row, None], (vec,), (cv,))
            packed = m_block * self.tile_m + row
            if packed < packed_rows and cv * vec < data_d:
                src = cute.local_tile(
                    mQ[packed // group, None, head_kv * group + packed % group, batch], (vec,), (cv,)
                )
                cute.autovec_copy(src, dst)
            else:
                cute.autovec_copy(zeros, dst)
        cute.arch.fence_view_async_shared()  # visible to the tensor cores' (async proxy) reads
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(mbar_Q)

    @cute.jit
    def skip_empty(self, sched: TileScheduler, tile: Int32, cta: Int32, num_ctas: Int32, seqlens: tuple):
        """Producer: `tile`, or (varlen) the first tile from it on whose query rows start inside
        their sequence (tiles count up to max_seqlen_q rows; a shorter sequence's last ones are
        empty and never announced). With CTA pairs, the pair's first tile decides, for both."""
        if const_expr(self.varlen):
            num_tiles = sched.num_tiles()
            searching = tile < num_tiles
            while searching:
                m_block, _, batch, _ = sched.tile_coords(tile)
                seqlen = SeqlenInfo.create(batch, *seqlens)
                searching = False
                if (m_block - m_block % self.cluster_m) * self.tile_m >= seqlen.seqlen_q:
                    tile = sched.fetch_tile(tile, cta, num_ctas)
                    searching = tile < num_tiles
        return tile

    @cute.jit
    def block_range(self, mask: Mask, m_block: Int32, seqlen: SeqlenInfo, split, num_splits):
        """(n_min, n_max, n_left_masked, n_unmasked) of a tile (`Mask.block_range_local`); without
        a left window n_min and n_left_masked are the constant 0 and the code is `Mask.block_range`'s.
        Split-KV: split `split`'s piece of [n_min, n_max), ceil(blocks / num_splits) blocks each
        (`emulate.split_block_range`); the mask's bounds stay those of the whole range."""
        if const_expr(self.window_left):
            n_min, n_max, n_left_masked, n_unmasked = mask.block_range_local(m_block, seqlen)
        else:
            n_max, n_unmasked = mask.block_range(m_block, seqlen)
            n_min, n_left_masked = 0, 0
        if const_expr(self.split_kv):
            per_split = (n_max - n_min + num_splits - 1) // num_splits
            n_min = n_min + split * per_split
            n_max = cutlass.max(cutlass.min(n_min + per_split, n_max), n_min)
            # The consumers' loops stop at n_min, where the producer's loads stop (the bounds
            # below n_min, of the whole range, had them wait for blocks never loaded: split-KV
            # hung on the GPU before this).
            n_unmasked = cutlass.max(n_unmasked, n_min)
            if const_expr(self.window_left):
                n_left_masked = cutlass.max(n_left_masked, n_min)
        return n_min, n_max, n_left_masked, n_unmasked

    @cute.jit
    def pingpong_wait(self, wg: Int32):
        """Block until this warpgroup holds the GEMM-issue token."""
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=BARRIER_PINGPONG + wg, number_of_threads=2 * WARPGROUP)

    @cute.jit
    def pingpong_pass(self, wg: Int32):
        """Hand the token to the next consumer warpgroup of the ring."""
        if const_expr(self.pingpong):
            next_wg = wg + 1
            if next_wg == self.num_mma_wg:
                next_wg = Int32(0)
            cute.arch.barrier_arrive(barrier_id=BARRIER_PINGPONG + next_wg, number_of_threads=2 * WARPGROUP)

    @cute.jit
    def first_block(
        self,
        n_block: Int32,
        k_state: pipeline.PipelineState,
        c: SimpleNamespace,
    ):
        """Overlapped loop, first half: S of the last block, its mask and softmax, P (no GEMM-II yet)."""
        acc_S, k_state = self.qk_waited(k_state, True, c, n_block)
        self.release_q_after(n_block, c)
        c.softmax.apply_softcap(acc_S)
        c.mask.apply(acc_S, c.tScS_mn, c.m_block, n_block, c.seqlen)
        c.softmax.online_softmax(acc_S, True)
        convert(acc_S, c.tOrP_acc)
        if const_expr(self.rescale_o_early):
            c.o_scale.fill(1.0)
        return k_state

    @cute.jit
    def overlapped_block(
        self,
        n_block: Int32,
        masked: cutlass.Constexpr[bool],
        k_state: pipeline.PipelineState,
        v_state: pipeline.PipelineState,
        c: SimpleNamespace,
        pv_trimmed: cutlass.Constexpr[bool] = False,
    ):
        """S = Q K_n^T and O += P V_{n+1} in flight together; softmax of S while GEMM-II runs.

        causal_trim, in masked blocks (and with pv_trimmed, where P of block n + 1 was masked):
        where this warpgroup's rows skip keys of either GEMM (`keys_seen`), `trimmed_steps`.
        """
        if const_expr(self.trim and (masked or pv_trimmed)):
            qk_keys = Int32(self.tile_n)
            if const_expr(masked):
                qk_keys = self.keys_seen(c, n_block)
            pv_keys = self.keys_seen(c, n_block + 1)
            # Every WGMMA of either branch completes inside it: ptxas serializes all WGMMAs of
            # a kernel whose asynchronous ones stay in flight across a join of branches.
            if qk_keys + pv_keys == 2 * self.tile_n:
                self.overlapped_steps(n_block, masked, k_state, v_state, c, False)
            else:
                self.trimmed_steps(n_block, masked, qk_keys, pv_keys, k_state, v_state, c)
            k_state.advance()
            v_state.advance()
        else:
            self.overlapped_steps(n_block, masked, k_state, v_state, c, True)
        return k_state, v_state

    @cute.jit
    def overlapped_steps(
        self,
        n_block: Int32,
        masked: cutlass.Constexpr[bool],
        k_state: pipeline.PipelineState,
        v_state: pipeline.PipelineState,
        c: SimpleNamespace,
        advance: cutlass.Constexpr[bool],
    ):
        """The body of `overlapped_block`; advance: move both pipeline states on (else the caller does)."""
        acc_S = cute.make_rmem_tensor(c.acc_shape_S, Float32)
        c.pipeline_k.consumer_wait(k_state)
        self.pingpong_wait(c.wg)
        gemm(
            c.tiled_mma_qk, acc_S, c.tSrQ, c.tSrK[None, None, None, k_state.index], zero_init=True, wg_wait=-1
        )
        if const_expr(self.rescale_o_early):
            c.softmax.rescale_O_pending(c.accs, c.o_scale)  # while GEMM-I runs
        c.pipeline_v.consumer_wait(v_state)
        self.gemm_pv(v_state.index, -1, c)
        self.pingpong_pass(c.wg)
        warpgroup.wait_group(1)  # GEMM-I done, GEMM-II may still run
        c.pipeline_k.consumer_release(k_state)
        self.release_q_after(n_block, c)
        if const_expr(advance):
            k_state.advance()
        c.softmax.apply_softcap(acc_S)  # before the mask: masked entries stay -inf
        if const_expr(masked):
            c.mask.apply(acc_S, c.tScS_mn, c.m_block, n_block, c.seqlen)
        row_scale, rescale = c.softmax.online_softmax(acc_S, False, self.pin_pv_wait)
        if const_expr(self.pin_pv_wait == 0):
            warpgroup.wait_group(0)  # GEMM-II done: P's registers and sV_{n+1} are free
        c.pipeline_v.consumer_release(v_state)
        if const_expr(advance):
            v_state.advance()
        self.finish_p(acc_S, row_scale, rescale, c)

    @cute.jit
    def release_q(self, mbar_Q_empty: cute.Pointer):
        """This warp has read Q's buffer for the last time this tile (one arrive per warp)."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(mbar_Q_empty)

    @cute.jit
    def release_q_after(self, n_block: Int32, c: SimpleNamespace):
        """release_q_at_qk: called once GEMM-I of n_block has completed; block 0's is the tile's
        last (blocks run from the last down to n_min, 0 without a left window), so Q's buffer is
        released there."""
        if const_expr(self.release_q_at_qk):
            if n_block == c.n_min:
                self.release_q(c.mbar_Q_empty)

    @cute.jit
    def finish_p(self, acc_S: cute.Tensor, row_scale: cute.Tensor, rescale, c: SimpleNamespace):
        """P = fp16/bf16(S) for the next GEMM-II; O's rescale now or (rescale_o_early) pending."""
        convert(acc_S, c.tOrP_acc)
        if const_expr(self.rescale_o_early):
            c.o_scale.store(row_scale.load())
        else:
            c.softmax.rescale_O(c.accs, row_scale, rescale)

    @cute.jit
    def trimmed_steps(
        self,
        n_block: Int32,
        masked: cutlass.Constexpr[bool],
        qk_keys: Int32,
        pv_keys: Int32,
        k_state: pipeline.PipelineState,
        v_state: pipeline.PipelineState,
        c: SimpleNamespace,
    ):
        """`overlapped_steps` for a block whose GEMM-I covers qk_keys keys and whose GEMM-II (P of
        block n + 1) pv_keys: both GEMMs issued and waited one after the other, then the softmax
        (none of it beside GEMM-II). Pipeline waits and releases and the pingpong turn as there."""
        acc_S = cute.make_rmem_tensor(c.acc_shape_S, Float32)
        c.pipeline_k.consumer_wait(k_state)
        self.pingpong_wait(c.wg)
        if const_expr(self.rescale_o_early):
            c.softmax.rescale_O_pending(c.accs, c.o_scale)
        # A GEMM-I at tile_n / 2 here, with P and O live beside it, leaves ptxas (d = 64, 160
        # registers) short of registers for asynchronous WGMMAs: a half block runs whole.
        self.gemm_qk_keys(acc_S, k_state.index, qk_keys, c, False)
        c.pipeline_v.consumer_wait(v_state)
        self.gemm_pv_keys(v_state.index, pv_keys, c)
        self.pingpong_pass(c.wg)
        c.pipeline_k.consumer_release(k_state)
        self.release_q_after(n_block, c)
        c.softmax.apply_softcap(acc_S)
        if const_expr(masked):
            c.mask.apply(acc_S, c.tScS_mn, c.m_block, n_block, c.seqlen)
        row_scale, rescale = c.softmax.online_softmax(acc_S, False)
        c.pipeline_v.consumer_release(v_state)
        self.finish_p(acc_S, row_scale, rescale, c)

    @cute.jit
    def last_pv(
        self,
        v_state: pipeline.PipelineState,
        c: SimpleNamespace,
    ):
        """Overlapped loop, second half: O += P V_0."""
        if const_expr(self.rescale_o_early):
            c.softmax.rescale_O_pending(c.accs, c.o_scale)
        return self.pv_waited(v_state, False, c, Int32(0))

    @cute.jit
    def qk_waited(
        self,
        k_state: pipeline.PipelineState,
        take_token: cutlass.Constexpr[bool],
        c: SimpleNamespace,
        n_block=None,
    ):
        """S = Q K^T for K's next stage, waited, the stage released; returns (S, next K state).

        take_token: wait for the pingpong token first (else the caller holds it); it is passed
        on once the GEMM is issued. n_block (causal_trim): S's key block, multiplied as far as
        `keys_seen` says (the token is then passed once the GEMM completes).
        """
        acc_S = cute.make_rmem_tensor(c.acc_shape_S, Float32)
        c.pipeline_k.consumer_wait(k_state)
        if const_expr(take_token):
            self.pingpong_wait(c.wg)
        if const_expr(self.trim and n_block is not None):
            self.gemm_qk_keys(acc_S, k_state.index, self.keys_seen(c, n_block), c, True)
            self.pingpong_pass(c.wg)
        else:
            gemm(
                c.tiled_mma_qk, acc_S, c.tSrQ, c.tSrK[None, None, None, k_state.index], zero_init=True,
                wg_wait=-1,
            )  # fmt: skip
            self.pingpong_pass(c.wg)
            warpgroup.wait_group(0)
        c.pipeline_k.consumer_release(k_state)
        k_state.advance()
        return acc_S, k_state

    @cute.jit
    def pv_waited(
        self,
        v_state: pipeline.PipelineState,
        take_token: cutlass.Constexpr[bool],
        c: SimpleNamespace,
        p_block=None,
    ):
        """O += P V for V's next stage, waited, the stage released; returns the next V state.

        take_token: wait for the pingpong token after V lands (the token is not passed here).
        p_block (causal_trim): P's key block, multiplied as far as `keys_seen` says.
        """
        c.pipeline_v.consumer_wait(v_state)
        if const_expr(take_token):
            self.pingpong_wait(c.wg)
        if const_expr(self.trim and p_block is not None):
            self.gemm_pv_keys(v_state.index, self.keys_seen(c, p_block), c)
        else:
            self.gemm_pv(v_state.index, 0, c)
        c.pipeline_v.consumer_release(v_state)
        v_state.advance()
        return v_state

    @cute.jit
    def gemm_pv(self, v_index: Int32, wg_wait: cutlass.Constexpr[int], c: SimpleNamespace, tOrP=None):
        """O += P V for V's stage v_index, issued (wait_group(wg_wait) if >= 0); with mma_rowsum,
        P's row sums accumulate in the same commit group. tOrP: a view of P's first K blocks
        (only those are multiplied), else all of P."""
        tOrP = c.tOrP if const_expr(tOrP is None) else tOrP
        rowsum = (c.tiled_mma_sum, c.acc_sum, tOrP, c.tOrOnes) if const_expr(self.mma_rowsum) else None
        gemm(
            c.tiled_mma_pv,
            c.acc_O,
            tOrP,
            c.tOrV[None, None, None, v_index],
            zero_init=False,
            wg_wait=wg_wait,
            then=rowsum,
        )

    # ------------------------------------------------ causal_trim
    # A warpgroup's rows end before the keys of a block, or of its second half, in at most the
    # first two blocks a tile visits. Those blocks keep their pipeline waits and releases and
    # pingpong turns; only the MMAs are skipped, each GEMM variant in its own branch and waited
    # there (`overlapped_block`).
    @cute.jit
    def keys_seen(self, c: SimpleNamespace, n_block: Int32) -> Int32:
        """How many keys of block n_block, counted from its first, this warpgroup multiplies: 0
        when all of them lie past the causal limit of its last row, tile_n / 2 when the second
        half does (trim_half), else tile_n. Warp-uniform."""
        # Keys of the block below this bound are seen by the warpgroup's last row.
        bound = self.mask.causal_keys(c.m_block * self.tile_m + 64 * c.wg + 64, n_block, c.seqlen)
        keys = Int32(self.tile_n)
        if const_expr(self.trim_half):
            if bound <= self.tile_n // 2:
                keys = Int32(self.tile_n // 2)
        if bound <= 0:
            keys = Int32(0)
        return keys

    @cute.jit
    def gemm_qk_keys(
        self,
        acc_S: cute.Tensor,
        k_index: Int32,
        keys: Int32,
        c: SimpleNamespace,
        half: cutlass.Constexpr[bool],
    ):
        """S = Q K^T for K's stage k_index over the block's first `keys` keys, waited; S's other
        columns are -inf. half=False: a half block is multiplied whole (the mask clears it)."""
        whole = keys == self.tile_n
        if const_expr(not (self.trim_half and half)):
            whole = keys > 0
        if whole:
            gemm(c.tiled_mma_qk, acc_S, c.tSrQ, c.tSrK[None, None, None, k_index], zero_init=True)
        else:
            # The accumulator's values run column group by column group: the first half of them
            # are keys 0 .. tile_n / 2 - 1.
            mid = cute.size(acc_S) // 2
            for i in cutlass.range_constexpr(mid, cute.size(acc_S)):
                acc_S[i] = -Float32.inf
            if const_expr(self.trim_half and half):
                if keys > 0:
                    acc_lo = cute.make_tensor(acc_S.iterator, cute.make_layout(c.acc_shape_S_half))
                    gemm(
                        c.tiled_mma_qk_half, acc_lo, c.tSrQ_half, c.tSrK_half[None, None, None, k_index],
                        zero_init=True,
                    )  # fmt: skip
                else:
                    for i in cutlass.range_constexpr(mid):
                        acc_S[i] = -Float32.inf
            else:  # keys == 0
                for i in cutlass.range_constexpr(mid):
                    acc_S[i] = -Float32.inf

    @cute.jit
    def gemm_pv_keys(self, v_index: Int32, keys: Int32, c: SimpleNamespace):
        """O += P V for V's stage v_index over P's first `keys` keys (the rest of P is 0), waited."""
        if keys == self.tile_n:
            self.gemm_pv(v_index, 0, c)
        if const_expr(self.trim_half):
            if keys == self.tile_n // 2:
                self.gemm_pv(v_index, 0, c, atom_rows(c.tOrP, 0, num_k=cute.size(c.tOrP, mode=[2]) // 2))

    @cute.jit
    def plain_block(
        self,
        n_block: Int32,
        masked: cutlass.Constexpr[bool],
        is_first: cutlass.Constexpr[bool],
        k_state: pipeline.PipelineState,
        v_state: pipeline.PipelineState,
        c: SimpleNamespace,
    ):
        """No intra-warpgroup overlap: GEMM-I, softmax, GEMM-II, each waited.

        With pingpong the token is held from GEMM-II of one block through GEMM-I of the next, so
        the two GEMMs of a warpgroup issue back to back while the other warpgroup does softmax.
        """
        trim_block = n_block if const_expr(masked) else None
        acc_S, k_state = self.qk_waited(k_state, is_first, c, trim_block)
        c.softmax.apply_softcap(acc_S)
        if const_expr(masked):
            c.mask.apply(acc_S, c.tScS_mn, c.m_block, n_block, c.seqlen)
        row_scale, rescale = c.softmax.online_softmax(acc_S, is_first)
        convert(acc_S, c.tOrP_acc)
        if const_expr(not is_first):
            c.softmax.rescale_O(c.accs, row_scale, rescale)
        v_state = self.pv_waited(v_state, True, c, trim_block)
        return k_state, v_state
