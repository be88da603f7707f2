"""The seed paper's kernel: FlashAttention-2 forward on Hopper, one warpgroup per CTA.

Algorithm (the paper's Algorithm 2 with its COPY-GEMM overlap), per CTA = one tile of
`tile_m` query rows of one (batch, head):

    TMA Q, K_0, V_0 -> smem                              (128B-swizzled, K-major, mbarriers)
    for j in key tiles (ascending; unmasked tiles first, then the masked ones):
        TMA V_j -> smem (j > 0)                          (overlaps GEMM-I and the softmax)
        S = Q K_j^T                                      SS-WGMMA, fp32 accumulators in registers
        TMA K_{j+1} -> smem                              (overlaps the softmax and GEMM-II)
        mask S (sequence tail, causal), online softmax   exp2 with log2(e)*scale folded in,
                                                         quad shuffles for row max
        O *= exp(m_old - m_new); P = fp16/bf16(S)        P stays in registers: the accumulator
        O += P V_j                                       layout re-viewed as the A operand (RS-WGMMA)
    O /= rowsum; LSE = m + log(rowsum); O -> smem -> TMA store; LSE -> gmem

Causal 128x128 tiles (d = 64, beyond the paper): in a diagonal block whose keys 64..127 lie past
the causal limit of every one of the first 64 rows, those rows run a 64x64 GEMM-I and a GEMM-II
over the first 64 keys only; the block's other half runs in full.

Which key blocks a tile visits and the element mask (sequence tail, bottom-right causal) come
from `mask.Mask`, with lengths from `seqlen.SeqlenInfo`: the parts the ws kernel uses.

Warp roles: none. All 128 threads run the math; warp 0 also issues the TMA copies.
Register use: fp32 S (tile_m*tile_n/128) and O (tile_m*d/128) accumulators per thread plus P;
`hopper_fmha.config.check_fits` rejects tiles that cannot fit. Shared memory: one stage of Q,
K and V; O reuses Q's buffer.

Constraints: head_dim in {64, 128, 256}; fp16/bf16 in, fp32 accumulate; tile_m in {64, 128}
(one warpgroup issues tile_m/64 WGMMA rows), tile_n in {64, 128}.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from .mask import Mask
from .seqlen import SeqlenInfo
from .sm90_common import (
    LN_2,
    LOG2_E,
    acc_mn_layout,
    acc_to_operand_a_layout,
    atom_rows,
    convert,
    gemm,
    smem_layout,
    stmatrix_copy,
    tiled_mma_64,
    tma_load,
)

NUM_THREADS = 128

# CTAs per SM a kernel is compiled for, where that is more than its registers allow uncapped:
# (head_dim, tile_m, tile_n, causal) -> CTAs. The launch then asks for at least that many CTAs
# per SM and ptxas caps the registers to fit (65536 / (128 * CTAs), in steps of 8). Kept here,
# not in `config`, so that the kernel cache's fingerprint (this package's sources) changes with it.
# d = 64 causal 64x64 (`config.PAPER_SHORT_TILE`): 99 registers fit four CTAs; compiled for five
# it takes 94, without spills, and runs 5-8% fewer cycles per call and 1.6-3.3% less time at the
# power cap (v14, sustained, ms, four vs five CTAs (cuDNN), `bench/results/2026-11-21-h200-v14/
# power-d64-paper-5ctas.txt` at 7468fb9): N = 1024 bf16 0.2147 vs 0.2088 (0.2175), fp16 0.2222 vs 0.2187
# (0.2248); N = 512 bf16 0.1328 vs 0.1284 (0.1388), fp16 0.1373 vs 0.1336 (0.1435). Six CTAs
# (80 registers) do not compile.
CTAS_PER_SM = {(64, 64, 64, True): 5}
# Named barrier 0 is __syncthreads; the main loop uses its own id.
BARRIER_MAINLOOP = 1


class PaperFwdSm90:
    """Compile-time configuration of the paper kernel; `__call__` is the host-side launcher."""

    def __init__(self, dtype, head_dim: int, tile_m: int, tile_n: int, causal: bool):
        assert head_dim in (64, 128, 256)
        assert tile_m in (64, 128) and tile_n in (64, 128)
        self.ctas_per_sm = CTAS_PER_SM.get((head_dim, tile_m, tile_n, causal), 0)
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.causal = causal
        self.mask = Mask(tile_m, tile_n, causal)
        # Causal, 128x128: in a diagonal block the first 64 rows see at most the first 64 keys,
        # so their GEMM-I is 64x64 and their GEMM-II takes half the K blocks (`step`).
        self.trim_diagonal = causal and tile_m == 128 and tile_n == 128

    # ---------------------------------------------------------------- host side
    def _tiled_mmas(self):
        # GEMM-I (Q, K from smem), GEMM-II (P from registers, V^T), and GEMM-I of the first 64
        # rows of a trimmed diagonal block (64 keys).
        return (
            tiled_mma_64(self.dtype, OperandMajorMode.K, self.tile_n),
            tiled_mma_64(
                self.dtype, OperandMajorMode.MN, self.head_dim, a_source=warpgroup.OperandSource.RMEM
            ),
            tiled_mma_64(self.dtype, OperandMajorMode.K, 64),
        )

    def _smem_layout(self, rows: int):
        return smem_layout(self.dtype, rows, self.head_dim)

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
        stream: cuda.CUstream,
    ):
        # Sequence first, as the TMA tiles and WGMMA expect: (s, d, h, b) and LSE (s, h, b).
        mQ, mK, mV, mO = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0])) for t in (mQ, mK, mV, mO)
        ]
        mLSE = cute.make_tensor(mLSE.iterator, cute.select(mLSE.layout, mode=[2, 1, 0]))

        tiled_mma_qk, tiled_mma_pv, tiled_mma_qk_half = self._tiled_mmas()
        sQ_layout = self._smem_layout(self.tile_m)
        sK_layout = self._smem_layout(self.tile_n)
        sV_layout = self._smem_layout(self.tile_n)

        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(tma_op, mQ, sQ_layout, (self.tile_m, self.head_dim))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(tma_op, mK, sK_layout, (self.tile_n, self.head_dim))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(tma_op, mV, sV_layout, (self.tile_n, self.head_dim))
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, sQ_layout, (self.tile_m, self.head_dim)
        )

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 3]  # Q, K, V "full" barriers
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        # One CTA per (m_block, head, batch). A grid's y and z stop at 65535: `kernels.forward`
        # launches larger head counts and batches in parts (`kernels.grid_parts`).
        grid = (
            cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m),
            cute.size(mQ.shape[2]),
            cute.size(mQ.shape[3]),
        )
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
            softmax_scale * LOG2_E,
            qhead_per_kvhead,
            sQ_layout,
            sK_layout,
            sV_layout,
            tiled_mma_qk,
            tiled_mma_pv,
            tiled_mma_qk_half,
            SharedStorage,
        ).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream, **self._occupancy())

    def _occupancy(self) -> dict:
        """Launch options for `ctas_per_sm` (`CTAS_PER_SM`). A shared-memory carveout is passed
        (-1: the driver's default) because without one the DSL asks the device for its shared
        memory per SM, which fails where there is no GPU (the compile tier)."""
        if self.ctas_per_sm <= 1:
            return {}
        return {"min_blocks_per_mp": self.ctas_per_sm, "preferred_smem_carveout": -1}

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
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tiled_mma_qk_half: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        head_kv = head // qhead_per_kvhead
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        # Warp 0 issues the TMA copies (the copy elects its own thread; barrier setup elects one).
        is_tma_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar_Q = storage.mbar.data_ptr()
        mbar_K = mbar_Q + 1
        mbar_V = mbar_Q + 2
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        # V^T for GEMM-II: the paper's composition with a row-major (d, tile_n) layout.
        sVt = cute.composition(sV, cute.make_ordered_layout((self.head_dim, self.tile_n), order=(1, 0)))

        if is_tma_warp:
            for tma_atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(tma_atom)
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(3):
                    cute.arch.mbarrier_init(mbar_Q + i, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # gmem tiles of this CTA: Q/O by m_block; K/V indexed by key tile.
        gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        bytes_Q = cute.size_in_bytes(self.dtype, sQ_layout)
        bytes_KV = cute.size_in_bytes(self.dtype, sK_layout)

        # Key tiles this query tile sees; tiles [0, n_unmasked) need no mask.
        seqlen = SeqlenInfo.create(batch, seqlen_q, seqlen_k)
        n_max, n_unmasked = self.mask.block_range(m_block, seqlen)

        if is_tma_warp:
            tma_load(tma_atom_Q, tQgQ, tQsQ, mbar_Q, bytes_Q)
            if n_max > 0:
                tma_load(tma_atom_K, tKgK[None, 0], tKsK, mbar_K, bytes_KV)
                # V of the first block too: issued by `step`, it would wait for Q to land.
                tma_load(tma_atom_V, tVgV[None, 0], tVsV, mbar_V, bytes_KV)

        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
        tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK))
        tOrV = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt))
        acc_shape_S = thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        acc_O = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C((self.tile_m, self.head_dim)))
        acc_O.fill(0.0)
        acc_O_mn = cute.make_tensor(acc_O.iterator, acc_mn_layout(acc_O.layout))
        rows_per_thread = cute.size(acc_O_mn, mode=[0])
        row_max = cute.make_rmem_tensor((rows_per_thread,), Float32)
        row_sum = cute.make_rmem_tensor((rows_per_thread,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        # Coordinates of this thread's S elements inside the tile, for masking.
        tScS_mn = cute.make_tensor(
            thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))).iterator,
            acc_mn_layout(
                thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))).layout
            ),
        )

        # Trimmed diagonal blocks: the first 64 rows' Q and K fragments for the 64x64 GEMM-I, the
        # last 64 rows' Q fragment for the full-width one, and their accumulator shapes.
        trim = None
        if const_expr(self.trim_diagonal):
            thr_mma_half = tiled_mma_qk_half.get_slice(tidx)
            rows = (64, self.head_dim)
            sQ_lo, sQ_hi, sK_lo = (cute.local_tile(t, rows, (i, 0)) for t, i in ((sQ, 0), (sQ, 1), (sK, 0)))
            trim = (
                tiled_mma_qk_half,
                thr_mma_half.make_fragment_A(thr_mma_half.partition_A(sQ_lo)),
                thr_mma_half.make_fragment_B(thr_mma_half.partition_B(sK_lo)),
                thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ_hi)),
                thr_mma_half.partition_shape_C((64, 64)),
                thr_mma_qk.partition_shape_C((64, self.tile_n)),
            )

        cute.arch.mbarrier_wait(mbar_Q, 0)
        for n_block in cutlass.range(n_unmasked, unroll=1):
            self.step(
                n_block, n_max, False, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_shape_S, acc_O,
                acc_O_mn, row_max, row_sum, tScS_mn, scale_log2, m_block, seqlen,
                tma_atom_K, tKgK, tKsK, tma_atom_V, tVgV, tVsV, mbar_K, mbar_V, bytes_KV, is_tma_warp,
                None,
            )  # fmt: skip
        for n_block in cutlass.range(n_unmasked, n_max, unroll=1):
            self.step(
                n_block, n_max, True, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, acc_shape_S, acc_O,
                acc_O_mn, row_max, row_sum, tScS_mn, scale_log2, m_block, seqlen,
                tma_atom_K, tKgK, tKsK, tma_atom_V, tVgV, tVsV, mbar_K, mbar_V, bytes_KV, is_tma_warp,
                trim,
            )  # fmt: skip

        self.epilogue(
            acc_O, acc_O_mn, row_max, row_sum, scale_log2, sQ, tma_atom_O, mO, mLSE, tiled_mma_pv,
            thr_mma_pv, tidx, m_block, head, batch, seqlen.seqlen_q, is_tma_warp,
        )  # fmt: skip

    @cute.jit
    def step(
        self,
        n_block: Int32,
        n_max: Int32,
        masked: cutlass.Constexpr[bool],
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        tSrQ: cute.Tensor,
        tSrK: cute.Tensor,
        tOrV: cute.Tensor,
        acc_shape_S: cute.Shape,
        acc_O: cute.Tensor,
        acc_O_mn: cute.Tensor,
        row_max: cute.Tensor,
        row_sum: cute.Tensor,
        tScS_mn: cute.Tensor,
        scale_log2: Float32,
        m_block: Int32,
        seqlen: SeqlenInfo,
        tma_atom_K: cute.CopyAtom,
        tKgK: cute.Tensor,
        tKsK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        tVgV: cute.Tensor,
        tVsV: cute.Tensor,
        mbar_K: cute.Pointer,
        mbar_V: cute.Pointer,
        bytes_KV: cutlass.Constexpr[int],
        is_tma_warp: cutlass.Boolean,
        trim,
    ):
        """One iteration of the mainloop: the paper's COPY-GEMM overlap around both GEMMs.

        trim (masked blocks of a causal 128x128 kernel, else None): where the block's keys
        64..127 lie past every causal limit of the tile's first 64 rows, those rows run a 64x64
        GEMM-I and a GEMM-II over the first 64 keys only (a quarter of the block's MMAs saved).
        """
        phase = n_block % 2
        # sV is free: every thread finished the previous GEMM-II before the last barrier (V of
        # block 0 was loaded with Q).
        if is_tma_warp:
            if n_block > 0:
                tma_load(tma_atom_V, tVgV[None, n_block], tVsV, mbar_V, bytes_KV)

        # GEMM-I: S = Q K^T (SS-WGMMA).
        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
        cute.arch.mbarrier_wait(mbar_K, phase)
        if const_expr(trim is None):
            gemm(tiled_mma_qk, acc_S, tSrQ, tSrK, zero_init=True)
        else:
            # Row 63 of the tile, the last of the first 64, sees keys up to
            # m_block * 128 + 63 + seqlen_k - seqlen_q: none of keys 64..127 of this block.
            trimmed = m_block * self.tile_m + seqlen.seqlen_k - seqlen.seqlen_q <= n_block * self.tile_n
            if trimmed:
                self.gemm_qk_trimmed(acc_S, tSrK, tiled_mma_qk, trim)
            else:
                gemm(tiled_mma_qk, acc_S, tSrQ, tSrK, zero_init=True)

        # sK is free once every thread's GEMM-I has completed: prefetch the next K tile.
        cute.arch.barrier(barrier_id=BARRIER_MAINLOOP, number_of_threads=NUM_THREADS)
        if is_tma_warp:
            if n_block + 1 < n_max:
                tma_load(tma_atom_K, tKgK[None, n_block + 1], tKsK, mbar_K, bytes_KV)

        # Online softmax on S, in registers.
        acc_S_mn = cute.make_tensor(acc_S.iterator, acc_mn_layout(acc_S.layout))
        if const_expr(masked):
            self.mask.apply(acc_S, tScS_mn, m_block, n_block, seqlen)
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            m_old = row_max[r]
            m_new = m_old
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                m_new = cute.arch.fmax(m_new, acc_S_mn[r, c])
            # A row is owned by a quad of 4 consecutive lanes: xor-shuffle reduce over it.
            m_new = cute.arch.fmax(m_new, cute.arch.shuffle_sync_bfly(m_new, offset=2))
            m_new = cute.arch.fmax(m_new, cute.arch.shuffle_sync_bfly(m_new, offset=1))
            # A row that has seen no key yet keeps max -inf; exponentiate against 0 instead.
            m_scaled = m_new * scale_log2
            if m_new == -Float32.inf:
                m_scaled = Float32(0.0)
            rescale = cute.math.exp2(m_old * scale_log2 - m_scaled, fastmath=True)
            row_max[r] = m_new
            # The chain starts from the rescaled old sum (not from 0.0: ptxas keeps an add of
            # +0.0, which is not a no-op for -0.0).
            row_sum_new = row_sum[r] * rescale
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                p = cute.math.exp2(acc_S_mn[r, c] * scale_log2 - m_scaled, fastmath=True)
                acc_S_mn[r, c] = p
                row_sum_new += p
            row_sum[r] = row_sum_new
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[r, c] = acc_O_mn[r, c] * rescale

        # P in registers, re-viewed from the accumulator layout into the A-operand layout.
        # Two values per cvt: `.to(bf16)` converts one at a time (`convert`'s docstring).
        tOrP_acc = cute.make_rmem_tensor(acc_S.layout, self.dtype)
        convert(acc_S, tOrP_acc)
        tOrP = cute.make_tensor(tOrP_acc.iterator, acc_to_operand_a_layout(acc_S.layout))

        # GEMM-II: O += P V (RS-WGMMA).
        cute.arch.mbarrier_wait(mbar_V, phase)
        if const_expr(trim is None):
            gemm(tiled_mma_pv, acc_O, tOrP, tOrV, zero_init=False)
        elif trimmed:
            # Rows 64..127 over every key block of V, rows 0..63 over the first 64 keys (P is 0
            # past them), in one commit group.
            tOrP_lo = atom_rows(tOrP, 0, num_k=cute.size(tOrP, mode=[2]) // 2)
            gemm(
                tiled_mma_pv, atom_rows(acc_O, 1), atom_rows(tOrP, 1), tOrV, zero_init=False,
                then=(tiled_mma_pv, atom_rows(acc_O, 0), tOrP_lo, tOrV),
            )  # fmt: skip
        else:
            gemm(tiled_mma_pv, acc_O, tOrP, tOrV, zero_init=False)
        # sV is free for the next iteration's load once every thread's GEMM-II has completed.
        cute.arch.barrier(barrier_id=BARRIER_MAINLOOP, number_of_threads=NUM_THREADS)

    @cute.jit
    def gemm_qk_trimmed(self, acc_S: cute.Tensor, tSrK: cute.Tensor, tiled_mma_qk: cute.TiledMma, trim):
        """S of a trimmed diagonal block: rows 64..127 against all 128 keys, rows 0..63 against
        the first 64 (one commit group); rows 0..63's other columns are -inf."""
        tiled_mma_half, tSrQ_lo, tSrK_lo, tSrQ_hi, shape_lo, shape_hi = trim
        acc_lo = cute.make_rmem_tensor(shape_lo, Float32)
        acc_hi = cute.make_rmem_tensor(shape_hi, Float32)
        gemm(
            tiled_mma_qk, acc_hi, tSrQ_hi, tSrK, zero_init=True,
            then=(tiled_mma_half, acc_lo, tSrQ_lo, tSrK_lo), then_zero_init=True,
        )  # fmt: skip
        # Accumulator registers run column group by column group, so keys 0..63 are the first
        # half of each 64-row block's values.
        for i in cutlass.range_constexpr(cute.size(acc_hi)):
            acc_S[i, 1, 0] = acc_hi[i]
            if const_expr(i < cute.size(acc_lo)):
                acc_S[i, 0, 0] = acc_lo[i]
            else:
                acc_S[i, 0, 0] = -Float32.inf

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        acc_O_mn: cute.Tensor,
        row_max: cute.Tensor,
        row_sum: cute.Tensor,
        scale_log2: Float32,
        sO: cute.Tensor,
        tma_atom_O: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        tiled_mma_pv: cute.TiledMma,
        thr_mma_pv: cute.ThrMma,
        tidx: Int32,
        m_block: Int32,
        head: Int32,
        batch: Int32,
        seqlen_q: Int32,
        is_tma_warp: cutlass.Boolean,
    ):
        """O /= rowsum, LSE = (m * scale * log2 e + log2 rowsum) * ln 2; O via smem + TMA store."""
        lse = cute.make_rmem_tensor((cute.size(row_sum),), Float32)
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            total = row_sum[r]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            # A row that saw no key: O stays 0 and LSE is -inf.
            inv = Float32(0.0)
            lse[r] = -Float32.inf
            if total > 0.0:
                inv = cute.arch.rcp_approx(total)
                lse[r] = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[r, c] = acc_O_mn[r, c] * inv

        # LSE: one lane per row quad writes (the lane holding column 0), rows inside the sequence.
        cO = cute.make_identity_tensor((self.tile_m, self.head_dim))
        tOcO_mn = cute.make_tensor(
            thr_mma_pv.partition_C(cO).iterator, acc_mn_layout(thr_mma_pv.partition_C(cO).layout)
        )
        if tOcO_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.tile_m + tOcO_mn[r, 0][0]
                if row < seqlen_q:
                    mLSE[row, head, batch] = lse[r]

        # O: registers -> smem (stmatrix, into Q's buffer, free since the last GEMM-I) -> TMA store.
        rO = cute.make_rmem_tensor(acc_O.layout, self.dtype)
        convert(acc_O, rO)
        smem_copy_O = stmatrix_copy(self.dtype, tiled_mma_pv, tidx)
        cute.copy(smem_copy_O, smem_copy_O.retile(rO), smem_copy_O.partition_D(sO))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BARRIER_MAINLOOP, number_of_threads=NUM_THREADS)
        if is_tma_warp:
            gO = cute.local_tile(mO[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0))
            tOsO, tOgO = cpasync.tma_partition(
                tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
            )
            cute.copy(tma_atom_O, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
