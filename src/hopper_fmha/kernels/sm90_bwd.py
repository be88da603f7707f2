"""Backward pass, first version (verified on an H200, tests/test_gpu_backward.py).

The main loop of `hopper_fmha.emulate_bwd` (its docstring is the specification) as one warpgroup
per CTA, correctness first: no warp specialization, one stage per buffer, every step waits for
its loads and GEMMs. A CTA owns key block n (tile_n = 64 keys) of one (batch, q head) and walks
the query blocks (tile_m = 64 rows) that see a key of it, ascending:

    S^T  = K_n Q_m^T                 SS-WGMMA, M = keys, N = queries, K = d
    P^T  = exp2(S^T * scale log2 e - LSE_m log2 e), 0 where masked or out of range
    dP^T = V_n dO_m^T                SS-WGMMA, M = keys, N = queries, K = d
    dS^T = P^T * (dP^T - D_m)
    dV_n += P^T dO_m                 RS-WGMMA: P^T from registers (16-bit), dO^T as MN-major B
    dK_n += dS^T Q_m                 RS-WGMMA: dS^T from registers, Q^T as MN-major B
    dQacc[m] += scale * dS K_n       dS^T through shared memory (stmatrix), read back transposed
                                     as an MN-major A; K^T as MN-major B; fp32 atomics to global

Working with S^T (keys as rows) puts P^T and dS^T in the accumulator layout that RS-WGMMA takes as
operand A for dV and dK (FlashAttention-3's choice); only dQ needs dS through shared memory.

The epilogue writes dK_n * scale and dV_n in fp32 per q head; the host sums a GQA group's heads
into their kv head and casts (`kernels.backward`). D = rowsum(dO * O) (minus the LSE's own gradient
where the caller used the LSE) and LSE log2 e come from the preprocess kernel (`row_stats`), the
zeroed fp32 dQ accumulator and dQ = cast(dQacc) from torch.

Deterministic mode (FlashAttention-3's semaphores, the order of `emulate_bwd.dq_order`): each query
block m has an int32 counter, zeroed by the host; the CTA of key block n adds its dQ contribution
to block m only when the counter equals its turn, then (after a GPU-scope fence) increments it.
Turns ascend with n without a causal mask and descend from the last key block m sees with one
(the CTAs of later key blocks reach block m first, as they start at a later query block). Fixed
turns give a fixed order of the fp32 additions, so dQ is bitwise reproducible. A CTA only waits for
CTAs launched before it: blocks launch in blockIdx.x order, and with the causal mask the CTA of
blockIdx.x takes key block num_n - 1 - blockIdx.x (the later key blocks first), so waiting never
holds an SM that a CTA it waits for would need.

Layout of the arguments: Q, dO (b, s_q, h, d); K, V (b, s_k, h_kv, d) 16-bit; LSE log2 e and D
(b, h, s_pad) float32 from the preprocess (`bwd_preprocess`: s_pad a multiple of 64; +inf and 0
for rows past s_q, LSE log2 e +inf for rows without keys); dQacc (b, s_q, h, d), dK, dV (b, s_k, h, d)
float32; the semaphores (b, h, ceil(s_q / 64)) int32, deterministic mode only (else None).
"""

from __future__ import annotations

import sys

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup

from . import GRID_YZ_MAX as _GRID_YZ_MAX
from .sm90_common import (
    LOG2_E,
    acc_mn_layout,
    acc_to_operand_a_layout,
    convert,
    gemm,
    smem_layout,
    stmatrix_copy,
    tiled_mma_64,
    tma_load,
)

NUM_THREADS = 128
TILE = 64  # keys per CTA and queries per step
HEAD_DIMS = (64, 128)
# CUDA's limit on gridDim.y and .z (heads, batch): the host launches in parts past it.
GRID_YZ_MAX = _GRID_YZ_MAX


class BwdSm90:
    """Compile-time configuration of the first backward kernel; `__call__` launches it."""

    def __init__(
        self, dtype, head_dim: int, causal: bool, deterministic: bool = False, dq_unscaled: bool = False
    ):
        assert head_dim in HEAD_DIMS, f"the first backward kernel takes head_dim {HEAD_DIMS}"
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal
        self.deterministic = deterministic
        # dQacc gathers dS K without the softmax scale, which the host applies as it casts dQ
        # (`DQ_SCALE_AT_CAST`); else every step's part is scaled before it is added.
        self.dq_unscaled = dq_unscaled

    # ---------------------------------------------------------------- host side
    def _tiled_mmas(self):
        d = self.head_dim
        rmem = warpgroup.OperandSource.RMEM
        return (
            # S^T = K Q^T and dP^T = V dO^T: A = K or V (keys x d), B = Q or dO (queries x d), K-major.
            tiled_mma_64(self.dtype, OperandMajorMode.K, TILE),
            # dV += P^T dO and dK += dS^T Q: A from registers, B = dO^T or Q^T (d x queries), MN-major.
            tiled_mma_64(self.dtype, OperandMajorMode.MN, d, a_source=rmem),
            # dQ = dS K: A = dS (queries x keys) read transposed from dS^T's buffer, B = K^T, both MN-major.
            tiled_mma_64(self.dtype, OperandMajorMode.MN, d, a_major=OperandMajorMode.MN),
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
        # window_size_left/right, softcap and the varlen arguments: v2's (`sm90_bwd_ws`); this
        # kernel has none of them and takes them unused, so that both versions launch alike.
        # Sequence first, as TMA and WGMMA take them: (s, d, h, b); LSE and D (s, h, b).
        mQ, mK, mV, mdO, mdQacc, mdK, mdV = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
            for t in (mQ, mK, mV, mdO, mdQacc, mdK, mdV)
        ]
        mLSE, mD = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0])) for t in (mLSE, mD)]

        tiled_mma_s, tiled_mma_kv, tiled_mma_dq = self._tiled_mmas()
        s_layout = smem_layout(self.dtype, TILE, self.head_dim)
        ds_layout = smem_layout(self.dtype, TILE, TILE)
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        box = (TILE, self.head_dim)
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(tma_op, mQ, s_layout, box)
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(tma_op, mdO, s_layout, box)
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(tma_op, mK, s_layout, box)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(tma_op, mV, s_layout, box)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, 4]  # K, V (once), Q, dO (per query block)
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(s_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(s_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(s_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(s_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ds_layout)], 1024]

        grid = (cute.ceil_div(cute.size(mK.shape[0]), TILE), cute.size(mQ.shape[2]), cute.size(mQ.shape[3]))
        self.kernel(
            tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
            mLSE, mD, mdQacc, mdK, mdV, mSem, softmax_scale, qhead_per_kvhead,
            s_layout, ds_layout, tiled_mma_s, tiled_mma_kv, tiled_mma_dq, SharedStorage,
        ).launch(grid=grid, block=[NUM_THREADS, 1, 1], stream=stream)  # fmt: skip

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
        mLSE: cute.Tensor,
        mD: cute.Tensor,
        mdQacc: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mSem: cute.Tensor | None,
        softmax_scale: Float32,
        qhead_per_kvhead: Int32,
        s_layout: cute.ComposedLayout,
        ds_layout: cute.ComposedLayout,
        tiled_mma_s: cute.TiledMma,
        tiled_mma_kv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        d = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head, batch = cute.arch.block_idx()
        head_kv = head // qhead_per_kvhead
        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        num_n = (seqlen_k + TILE - 1) // TILE
        if const_expr(self.deterministic and self.causal):
            n_block = num_n - 1 - n_block  # later key blocks first: they take the earlier turns
        is_tma_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0
        scale_log2 = softmax_scale * LOG2_E

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        mbar_K = storage.mbar.data_ptr()
        mbar_V, mbar_Q, mbar_dO = mbar_K + 1, mbar_K + 2, mbar_K + 3
        sK, sV, sQ, sdO = (
            buf.get_tensor(s_layout.outer, swizzle=s_layout.inner)
            for buf in (storage.sK, storage.sV, storage.sQ, storage.sdO)
        )
        sdS = storage.sdS.get_tensor(ds_layout.outer, swizzle=ds_layout.inner)  # dS^T: keys x queries
        # Transposed views (the forward's V^T): (d, 64) of a (64, d) buffer, and dS (queries x keys).
        transposed = cute.make_ordered_layout((d, TILE), order=(1, 0))
        sQt, sdOt, sKt = (cute.composition(t, transposed) for t in (sQ, sdO, sK))
        sdSt = cute.composition(sdS, cute.make_ordered_layout((TILE, TILE), order=(1, 0)))

        if is_tma_warp:
            for atom in (tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V):
                cpasync.prefetch_descriptor(atom)
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(4):
                    cute.arch.mbarrier_init(mbar_K + i, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        gK = cute.local_tile(mK[None, None, head_kv, batch], (TILE, d), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (TILE, d), (n_block, 0))
        gQ = cute.local_tile(mQ[None, None, head, batch], (TILE, d), (None, 0))
        gdO = cute.local_tile(mdO[None, None, head, batch], (TILE, d), (None, 0))

        def partition(atom, smem_tile, gmem_tiles):
            s_grouped, g_grouped = cute.group_modes(smem_tile, 0, 2), cute.group_modes(gmem_tiles, 0, 2)
            return cpasync.tma_partition(atom, 0, cute.make_layout(1), s_grouped, g_grouped)

        tKsK, tKgK = partition(tma_atom_K, sK, gK)
        tVsV, tVgV = partition(tma_atom_V, sV, gV)
        tQsQ, tQgQ = partition(tma_atom_Q, sQ, gQ)
        tOsdO, tOgdO = partition(tma_atom_dO, sdO, gdO)
        tile_bytes = cute.size_in_bytes(self.dtype, s_layout)

        if is_tma_warp:
            tma_load(tma_atom_K, tKgK, tKsK, mbar_K, tile_bytes)
            tma_load(tma_atom_V, tVgV, tVsV, mbar_V, tile_bytes)

        thr_s = tiled_mma_s.get_slice(tidx)
        thr_kv = tiled_mma_kv.get_slice(tidx)
        thr_dq = tiled_mma_dq.get_slice(tidx)
        tSrK = thr_s.make_fragment_A(thr_s.partition_A(sK))
        tSrQ = thr_s.make_fragment_B(thr_s.partition_B(sQ))
        tPrV = thr_s.make_fragment_A(thr_s.partition_A(sV))
        tPrdO = thr_s.make_fragment_B(thr_s.partition_B(sdO))
        tVrdOt = thr_kv.make_fragment_B(thr_kv.partition_B(sdOt))
        tKrQt = thr_kv.make_fragment_B(thr_kv.partition_B(sQt))
        tQrdS = thr_dq.make_fragment_A(thr_dq.partition_A(sdSt))
        tQrKt = thr_dq.make_fragment_B(thr_dq.partition_B(sKt))

        acc_shape_S = thr_s.partition_shape_C((TILE, TILE))
        acc_dV = thr_kv.make_fragment_C(thr_kv.partition_shape_C((TILE, d)))
        acc_dK = thr_kv.make_fragment_C(thr_kv.partition_shape_C((TILE, d)))
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        # This thread's (key, query) coordinates in an S^T tile, as rows and columns.
        cS = thr_s.partition_C(cute.make_identity_tensor((TILE, TILE)))
        tScS = cute.make_tensor(cS.iterator, acc_mn_layout(cS.layout))
        smem_copy_dS = stmatrix_copy(self.dtype, tiled_mma_s, tidx)
        tdSsdS = smem_copy_dS.partition_D(sdS)

        # Query blocks that see a key of this block: all, or (causal, bottom-right aligned) those
        # whose last row reaches the block's first key: row i sees key j iff j <= i + s_k - s_q.
        num_m = (seqlen_q + TILE - 1) // TILE
        m_min = 0
        if const_expr(self.causal):
            first_row = n_block * TILE - (seqlen_k - seqlen_q)  # the first row that sees the first key
            m_min = cutlass.max(first_row, 0) // TILE
        n0 = n_block * TILE
        cute.arch.mbarrier_wait(mbar_K, 0)
        cute.arch.mbarrier_wait(mbar_V, 0)
        phase = Int32(0)
        for m_block in cutlass.range(m_min, num_m, unroll=1):
            if is_tma_warp:
                tma_load(tma_atom_Q, tQgQ[None, m_block], tQsQ, mbar_Q, tile_bytes)
                tma_load(tma_atom_dO, tOgdO[None, m_block], tOsdO, mbar_dO, tile_bytes)
            m0 = m_block * TILE
            cute.arch.mbarrier_wait(mbar_Q, phase)
            acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
            gemm(tiled_mma_s, acc_S, tSrK, tSrQ, zero_init=True, wg_wait=-1)
            cute.arch.mbarrier_wait(mbar_dO, phase)
            acc_dP = cute.make_rmem_tensor(acc_shape_S, Float32)
            gemm(tiled_mma_s, acc_dP, tPrV, tPrdO, zero_init=True, wg_wait=0)
            phase = phase ^ 1

            # P^T and dS^T in place of S^T and dP^T.
            acc_S_mn = cute.make_tensor(acc_S.iterator, acc_mn_layout(acc_S.layout))
            acc_dP_mn = cute.make_tensor(acc_dP.iterator, acc_mn_layout(acc_dP.layout))
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                q = m0 + tScS[0, c][1]
                # LSE log2 e and D, padded: +inf and 0 past the end and for rows without keys (P = 0).
                lse_log2 = mLSE[q, head, batch]
                dsum = mD[q, head, batch]
                for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                    key = n0 + tScS[r, c][0]
                    # Visible: inside the keys, and (causal) key <= q + s_k - s_q: the bound is
                    # folded into one limit (a key past either one gets P = 0).
                    limit = seqlen_k
                    if const_expr(self.causal):
                        limit = cutlass.min(seqlen_k, q + seqlen_k - seqlen_q + 1)
                    p = Float32(0.0)
                    if key < limit:
                        p = cute.math.exp2(acc_S_mn[r, c] * scale_log2 - lse_log2, fastmath=True)
                    acc_S_mn[r, c] = p
                    acc_dP_mn[r, c] = p * (acc_dP_mn[r, c] - dsum)

            rP = cute.make_rmem_tensor(acc_S.layout, self.dtype)
            convert(acc_S, rP)
            rdS = cute.make_rmem_tensor(acc_dP.layout, self.dtype)
            convert(acc_dP, rdS)
            # dS^T to shared memory for dQ (the previous step's dQ GEMM has completed: wait_group 0).
            cute.copy(smem_copy_dS, smem_copy_dS.retile(rdS), tdSsdS)
            cute.arch.fence_view_async_shared()
            cute.arch.sync_threads()

            tVrP = cute.make_tensor(rP.iterator, acc_to_operand_a_layout(rP.layout))
            tKrdS = cute.make_tensor(rdS.iterator, acc_to_operand_a_layout(rdS.layout))
            gemm(tiled_mma_kv, acc_dV, tVrP, tVrdOt, zero_init=False, wg_wait=-1)
            gemm(tiled_mma_kv, acc_dK, tKrdS, tKrQt, zero_init=False, wg_wait=-1)
            acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C((TILE, d)))
            gemm(tiled_mma_dq, acc_dQ, tQrdS, tQrKt, zero_init=True, wg_wait=0)
            # Every GEMM reading Q, dO and dS^T has completed: the next block may overwrite them.
            cute.arch.sync_threads()

            if const_expr(self.deterministic):
                turn = n_block
                if const_expr(self.causal):  # descending from the last key block m_block sees
                    n_end = cutlass.min(num_n, (m0 + TILE - 1 + seqlen_k - seqlen_q) // TILE + 1)
                    turn = n_end - 1 - n_block
                self.wait_turn(mSem, m_block, head, batch, turn, tidx)
            self.add_dq(acc_dQ, thr_dq, mdQacc, softmax_scale, m0, head, batch, seqlen_q)
            if const_expr(self.deterministic):
                self.pass_turn(mSem, m_block, head, batch, tidx)

        self.store_dkdv(acc_dK, acc_dV, thr_kv, mdK, mdV, softmax_scale, n0, head, batch, seqlen_k)

    def sync_turn(self):
        """The barrier of `wait_turn` and `pass_turn` over the threads that add dQ (all of them
        here; `sm90_bwd_ws` syncs its consumer warpgroups only)."""
        cute.arch.sync_threads()

    @cute.jit
    def wait_turn(self, mSem, m_block, head, batch, turn, tidx):
        """Until dQacc[m_block]'s counter reaches `turn` (one thread spins; acquire, GPU scope)."""
        if tidx == 0:
            sem = mSem.iterator + cute.crd2idx((batch, head, m_block), mSem.layout)
            seen = cute.arch.atomic_add(sem, Int32(0), sem="acquire", scope="gpu")
            while seen != turn:
                seen = cute.arch.atomic_add(sem, Int32(0), sem="acquire", scope="gpu")
        self.sync_turn()

    @cute.jit
    def pass_turn(self, mSem, m_block, head, batch, tidx):
        """The CTA's dQ additions made visible at GPU scope (v1: every thread's atomics; v2: its
        issuing threads' reduce-adds, waited for to completion), then the counter moves on."""
        cute.arch.fence_acq_rel_gpu()
        self.sync_turn()
        if tidx == 0:
            sem = mSem.iterator + cute.crd2idx((batch, head, m_block), mSem.layout)
            cute.arch.atomic_add(sem, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def add_dq(self, acc_dQ, thr_dq, mdQacc, scale, m0, head, batch, seqlen_q):
        """dQacc[m0 + i, :] += scale * acc_dQ[i, :] (no scale with dq_unscaled) by fp32 atomics, rows
        inside the sequence."""
        cQ = thr_dq.partition_C(cute.make_identity_tensor((TILE, self.head_dim)))
        cQ_mn = cute.make_tensor(cQ.iterator, acc_mn_layout(cQ.layout))
        acc_mn = cute.make_tensor(acc_dQ.iterator, acc_mn_layout(acc_dQ.layout))
        gdQ = mdQacc[None, None, head, batch]
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            q = m0 + cQ_mn[r, 0][0]
            if q < seqlen_q:
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    col = cQ_mn[r, c][1]
                    ptr = gdQ.iterator + cute.crd2idx((q, col), gdQ.layout)
                    cute.arch.atomic_add(
                        ptr, acc_mn[r, c] if const_expr(self.dq_unscaled) else acc_mn[r, c] * scale
                    )

    @cute.jit
    def store_dkdv(self, acc_dK, acc_dV, thr_kv, mdK, mdV, scale, n0, head, batch, seqlen_k):
        """dK * scale and dV of this key block in mdK's type (fp32 per q head with GQA, the inputs'
        type with MHA), rows inside the sequence (this q head's)."""
        cK = thr_kv.partition_C(cute.make_identity_tensor((TILE, self.head_dim)))
        cK_mn = cute.make_tensor(cK.iterator, acc_mn_layout(cK.layout))
        dK_mn = cute.make_tensor(acc_dK.iterator, acc_mn_layout(acc_dK.layout))
        dV_mn = cute.make_tensor(acc_dV.iterator, acc_mn_layout(acc_dV.layout))
        for r in cutlass.range_constexpr(cute.size(dK_mn, mode=[0])):
            key = n0 + cK_mn[r, 0][0]
            if key < seqlen_k:
                for c in cutlass.range_constexpr(cute.size(dK_mn, mode=[1])):
                    col = cK_mn[r, c][1]
                    mdK[key, col, head, batch] = (dK_mn[r, c] * scale).to(mdK.element_type)
                    mdV[key, col, head, batch] = dV_mn[r, c].to(mdV.element_type)


_DTYPES = {"float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}


def fake_arguments(
    dtype,
    head_dim: int,
    deterministic: bool = False,
    mha: bool = False,
    dkv_atomic: bool = False,
    varlen: bool = False,
    head_dim_v: int | None = None,
    dq_copies: bool = False,
):
    """Compile-time stand-ins for `BwdSm90.__call__`'s arguments (v, dO, dV of head_dim_v where
    given): sizes symbolic, 16-bit and fp32
    tensors with TMA-ready strides (multiples of 8 elements, 16-byte aligned), LSE and D's last
    mode contiguous, the semaphores (deterministic mode) contiguous; the stream TVM-FFI's current one.
    dK, dV: fp32 per q head, or (mha) in the inputs' type, the gradients themselves, or
    (dkv_atomic) fp32 per kv head. varlen: cu_seqlens_q/k int32 (batch + 1,) (the 16-bit and fp32
    tensors then hold the packed rows with a batch mode of 1, and LSE, D, dQacc the padded ones:
    dQacc's rows and the semaphores' sequences get symbols of their own, since TVM-FFI checks at
    the call that the sizes sharing a symbol are equal). dq_copies: dQacc's rows a symbol of their
    own also when dense (`DQ_CHAINS`' copies of the padded rows)."""
    b, sq, sk, h, hkv, nm, sp = (cute.sym_int() for _ in range(7))
    dq_rows, sem_batch = (cute.sym_int(), cute.sym_int()) if varlen else (sq, b)
    if dq_copies:
        dq_rows = cute.sym_int()

    def bshd(seqlen, heads, elem, dim=head_dim):
        stride = tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)
        return cute.runtime.make_fake_tensor(elem, (b, seqlen, heads, dim), stride=stride, assumed_align=16)

    def bhs():  # (b, h, s_pad): s_pad a multiple of 64, so every stride is (v2's TMA takes them)
        stride = (cute.sym_int64(divisibility=64), cute.sym_int64(divisibility=64), 1)
        return cute.runtime.make_fake_tensor(Float32, (b, h, sp), stride=stride, assumed_align=256)

    dim_v = head_dim if head_dim_v is None else head_dim_v
    q, do = bshd(sq, h, dtype), bshd(sq, h, dtype, dim_v)
    k, v = bshd(sk, hkv, dtype), bshd(sk, hkv, dtype, dim_v)
    dkv = dtype if mha else Float32
    dkv_heads = hkv if dkv_atomic else h
    dq, dk, dv = bshd(dq_rows, h, Float32), bshd(sk, dkv_heads, dkv), bshd(sk, dkv_heads, dkv, dim_v)
    sem = None
    if deterministic:
        sem = cute.runtime.make_fake_tensor(
            Int32, (sem_batch, h, nm), stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4
        )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    scalars = (Float32(1.0), Int32(1), Int32(-1), Int32(-1), Float32(0.0))  # scale, group, window, softcap
    cu_q = cu_k = None
    if varlen:
        cu_q, cu_k = (
            cute.runtime.make_fake_tensor(Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
            for _ in range(2)
        )
    return (q, k, v, do, bhs(), bhs(), dq, dk, dv, sem, *scalars, cu_q, cu_k, Int32(0), stream)


# The kernel `backward` runs: 1 = `BwdSm90` (one warpgroup per 64 keys), 2 = `sm90_bwd_ws.BwdWsSm90`
# (a producer warp and two consumer warpgroups per 128 keys). Both verified on an H200
# (tests/test_gpu_backward.py).
VERSIONS = (1, 2)
DEFAULT_VERSION = 2
# D by the preprocess kernel (`bwd_preprocess`, one read of O and dO) rather than by torch (fp32
# copies of both); verified on an H200 too.
PREPROCESS_KERNEL = True


def compile_bwd(
    dtype_name: str,
    head_dim: int,
    causal: bool,
    deterministic: bool = False,
    version: int = DEFAULT_VERSION,
    mha: bool = False,
    dkv_atomic: bool = False,
    window_left: bool = False,
    window_right: bool = False,
    softcap: bool = False,
    varlen: bool = False,
    tile_m: int = TILE,
    rotate: bool = False,
    dq_unscaled: bool = False,
    dq_fragments: bool = False,
    head_dim_v: int | None = None,
    dq_writer: bool = False,
    dq_chains: int = 1,
    dq_writer_warps: int = 1,
    multicast: bool = False,
    options: str = "",
):
    """Compile the kernel for sm_90a with TVM-FFI (torch tensors pass straight); no GPU needed.
    window_left/right, softcap: the score features the kernel handles; varlen: packed sequences;
    tile_m: queries per step (`query_tile`); rotate: the deterministic walk (`rotates`) (version 2
    only); dq_unscaled: dQacc without the softmax scale (`DQ_SCALE_AT_CAST`); dq_fragments: dQacc in
    fragment order (`DQ_FRAGMENTS`); head_dim_v: v's, dO's, dV's (None: head_dim), past 128 the
    wide kernel's pairs (`sm90_bwd_wide.SHAPES`); dq_writer: deterministic turns and dQ's adds by
    a warp of their own (`DQ_WRITER_WARP`); dq_chains: deterministic dQ's chains (`DQ_CHAINS`);
    dq_writer_warps: deterministic dQ's writer warps (`DQ_WRITER_WARPS`); multicast: CTA pairs
    share their Q and dO loads (`multicasts`).
    `options` adds to the compiler's, e.g. "--keep-cubin --dump-dir=DIR"."""
    dtype = _DTYPES[dtype_name]
    opts = " ".join(o for o in ("--enable-tvm-ffi", options) if o)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    if version == 2 and head_dim > HEAD_DIMS[-1]:
        from .sm90_bwd_wide import BwdWideSm90

        assert not dkv_atomic, "wide: dK, dV per q head"
        assert tile_m == TILE, "the wide kernel steps 64 queries"
        kernel = BwdWideSm90(
            dtype, head_dim, head_dim_v, causal, deterministic, window_left, window_right, softcap, varlen,
            dq_unscaled, dq_writer, rotate, dq_chains, dq_writer_warps, dq_fragments, multicast,
        )  # fmt: skip
    elif version == 2:
        from .sm90_bwd_ws import BwdWsSm90

        kernel = BwdWsSm90(
            dtype, head_dim, causal, deterministic, dkv_atomic, window_left, window_right, softcap, varlen,
            tile_m, rotate, dq_unscaled, dq_fragments, dq_writer, dq_chains, dq_writer_warps, multicast,
        )  # fmt: skip
    else:
        assert not dkv_atomic, "version 1 writes dK, dV per q head"
        assert not (window_left or window_right or softcap or varlen), "version 1: no window, softcap, varlen"
        assert tile_m == TILE, "version 1 steps 64 queries"
        assert not rotate, "version 1: no rotated deterministic walk"
        assert not (dq_fragments or dq_writer), "version 1: dQ by atomics"
        assert dq_chains == dq_writer_warps == 1, "version 1: no writer warp"
        assert not multicast, "version 1: no CTA pairs"
        kernel = BwdSm90(dtype, head_dim, causal, deterministic, dq_unscaled)
    return cute.compile(
        kernel,
        *fake_arguments(dtype, head_dim, deterministic, mha, dkv_atomic, varlen, head_dim_v, dq_chains > 1),
        options=opts,
    )


_compiled: dict = {}


def _kernel(key: tuple):
    """The kernel of a compile key (`compile_bwd`'s arguments) not yet in `_compiled`: compiled, or,
    with the disk cache on (`cache.load_or_compile`), loaded or compiled and saved; kept in
    `_compiled`."""
    from . import mask, seqlen, sm90_bwd_wide, sm90_bwd_ws, sm90_common
    from .cache import load_or_compile

    modules = (sys.modules[__name__], sm90_bwd_ws, sm90_bwd_wide, sm90_common, mask, seqlen)
    fn = _compiled[key] = load_or_compile("bwd", key, modules, lambda: compile_bwd(*key))
    return fn


# The softmax scale of dQ applied once, as the host casts dQacc to dQ (one fused multiply-and-cast,
# `cast_dq`), instead of on every step's part before it is added: ncu (v25, d128 tile 80) counted
# those multiplies as 35 M of the kernel's 488 M instructions, which FA4's (408 M) does not have.
# The query tiles where it is on (True: every tile; dense and varlen). v27 (H100, bf16 B4 N4096,
# `bwd_profile`): d128 tile 80 530 -> 538 TFLOP/s, causal tile 64 428 -> 446; d64 tile 128 438 -> 426
# (off there). Part of the compile key (`_compiled`).
DQ_SCALE_AT_CAST = (64, 80)
# dQ in the accumulator's own order (dense): each warpgroup stages its part of a query block's dQ
# as 16-byte stores of 4 consecutive accumulator values (the swizzled TMA buffer takes them one or
# two 4-byte stores each; tile 80 transposed: ncu v25, 34 M STS against FA4's 8.5 M STS.128) and
# adds it by one 1-D bulk reduce-add into a dQacc laid out per (batch, head) and block, which
# `dq_from_fragments` puts back in order for the cast. Built for every query tile of the dense
# kernel (80: d128 non-causal; 64: causal, windows, softcap; 128: d64); on at these (True: all).
# v27 (H100, bf16 B4 N4096, `bwd_profile`): d64 tile 128 438 -> 469 TFLOP/s; d128 tile 80 530 -> 529,
# causal tile 64 428 -> 435, deterministic tile 80 (no writer warp) 355 -> 330. At tile 64 torch's
# un-permute ate the main kernel's gain until `DQ_UNFRAGMENT_KERNEL` (session 35: on at 64 and 80 with
# it; H200 `bwd_profile --ab`, bf16 B4 N4096 TFLOP/s, off -> on: d128 tile 80 533 -> 551, deterministic
# 516 -> 528, d128 causal deterministic 418 -> 437). Part of the compile key.
DQ_FRAGMENTS = (64, 80, 128)


# The same in the wide kernel (dense; its dQ is tile 64's: each warpgroup half of d, `fragment_dims`),
# `dq_unfragment` putting it back in order (session 35). Measured (H200, `bwd_profile --wide --ab`,
# bf16 B4 N4096, TFLOP/s, off -> on): d256 308 -> 351, causal 295 -> 326, deterministic 278 -> 278;
# d192/dv128 413 -> 439, causal 364 -> 393. On. Part of the compile key (the dq_fragments field).
DQ_FRAGMENTS_WIDE = True


def tile_switch(switch, tile_m: int) -> bool:
    """Whether a per-query-tile switch (`DQ_SCALE_AT_CAST`, `DQ_FRAGMENTS`: a tuple of tiles, or
    True / False for all / none) is on at `tile_m`."""
    if isinstance(switch, bool):
        return switch
    return tile_m in switch


def fragments_on(tile_m: int, wide: bool) -> bool:
    """Whether a v2 kernel adds dQ in fragment order: `DQ_FRAGMENTS` at its query tile, or the
    wide kernel's `DQ_FRAGMENTS_WIDE` (varlen: and `VARLEN_DQ_FRAGMENTS`, checked by its host)."""
    return DQ_FRAGMENTS_WIDE if wide else tile_switch(DQ_FRAGMENTS, tile_m)


# Deterministic mode: a warp of the producer warpgroup waits for the CTA's turn at each query block,
# adds both consumer warpgroups' dQ parts and passes the turn (FA4's dQ writer warp); the consumers
# only stage dQ, so a late turn costs them nothing until their next block's staging. v27 (H100, bf16
# B4 N4096, `bwd_profile`, off -> on): d128 355 -> 474 TFLOP/s, d128 causal 286 -> 380, d64 causal
# 268 -> 369 (the plain backward: 530, 430). Part of the compile key.
DQ_WRITER_WARP = True
# The same warp without deterministic mode (FA4's design in both modes): the consumers stage dQ and
# go on; the writer warp issues both warpgroups' reduce-adds and waits for their reads, in place of
# each consumer warpgroup's first warp (issue, then a bulk-group wait and a warpgroup sync before
# the next staging). Static SASS (session 29, d128 bf16, against FA4's `flash_bwd_sm90`): the
# issue costs warp 0 of each consumer warpgroup 33-36 more instructions per block than warps 1-3.
# The instructions did not set the time: H100 session 29, `bwd_profile` bf16 B4 N4096 TFLOP/s (default
# -> writer / writer with DQ_FRAGMENTS): d128 tile 80 524 545 537 537 -> 557 552 552 / 540 540 539 536;
# d128 causal tile 64 447 447 -> 433 / 443 443; d64 tile 128 (fragments on) 473 456 -> 462 458,
# causal 367 396 -> 399 400 (noise); the backward preset (fp16) with writer and fragments at every
# tile: d128 508 -> 529, causal 432 -> 419 TFLOP/s. On at tile 80 alone (d128 without causal, window
# or softcap: +2.8%). The query tiles where it is on (`tile_switch`; the varlen kernel's too; never
# the wide kernel's). Tile 64 joined in session 35 with DQ_FRAGMENTS and `DQ_UNFRAGMENT_KERNEL`
# (d128 causal 464 -> 473 TFLOP/s over fragments alone). Part of the compile key.
DQ_WRITER_PLAIN: tuple[int, ...] | bool = (64, 80)


# The writer warp without deterministic mode in the wide kernel too (session 31): its consumers
# stage dQ and go on, where before each warpgroup's first warp issued the reduce-add and waited for
# its bulk group, and the warpgroup synced around the staging. Predicted +2-3% (tile 80's gain from
# the same change). Measured (H200, session 32, `bwd_profile --wide --versions 2
# --dq-writer-plain-wide off/on/off/on`, bf16 B4 N4096, TFLOP/s): d256 303 / 320 / 301 / 319, causal
# 283 / 291 / 268 / 303; d192/dv128 418 / 421 / 423 / 430, causal 346 / 376 / 363 / 375; the preset:
# d256 308/311 -> 325/327. Part of the compile key (the dq_writer field).
DQ_WRITER_PLAIN_WIDE = True


def dq_writer(deterministic: bool, tile_m: int, wide: bool = False) -> bool:
    """Whether v2's dQ adds go through the writer warp: deterministic (`DQ_WRITER_WARP`), or plain
    at `DQ_WRITER_PLAIN`'s tiles (dense head dims) or in the wide kernel (`DQ_WRITER_PLAIN_WIDE`)."""
    if deterministic:
        return DQ_WRITER_WARP
    return DQ_WRITER_PLAIN_WIDE if wide else tile_switch(DQ_WRITER_PLAIN, tile_m)


# Deterministic dQ in k chains per query block (`sm90_bwd_ws` `dq_chains`, dense): turn t adds into
# copy t % k of dQacc after turn t - k, and the host sums the copies in order, so a block's
# hand-offs (wait for the turn, reduce-add, its completion, the release) run k at a time. Why
# (v30, ncu, d256 B4 N4096: 64 query blocks, 86 key blocks, no rotation): 39% of the stall samples
# were the consumers waiting for the writer warp, which polled each turn 2.4 times; each block's
# adds were one chain of 86 hand-offs. Predicted (a simulation of the hand-offs) 69% of the plain
# rate -> 85-95% at k = 2. Measured (H200, session 31, `bwd_profile --versions 2 --deterministic
# --dq-chains k`, bf16 B4 N4096, TFLOP/s, k = 1 / 2 / 3, twice): d256 212 210 / 236 225 / 232 224
# (plain 308: 69% -> 75%); d128 497 497 / 466 469 (plain 556); d128 causal 376 378 / 341 358;
# d64 440 444 / 408 430 (plain 443): a loss where the chains were short already (k - 1 more zeroed
# copies of dQacc and their sum); d256 causal 217 215 / 212 210 (plain 282). The backward preset
# (k = 2 at d256, causal included): deterministic d256 216 -> 237 TFLOP/s fp16 (70% -> 77% of plain),
# causal 221 -> 214. On for the kernel head dims (d, dv) listed, k each, without causal or window.
DQ_CHAINS: dict[tuple[int, int], int] = {(256, 256): 2}

# `DQ_CHAINS` with causal or a window too (built in session 36, on since session 37). Why:
# deterministic d256 causal ran at 64-65% of plain (v36, H200). Its turns at a query block go from
# the key block on its diagonal down to key block 0 (`descending`), so CTA n's add waits for CTA
# n + 1's, which reached the block one step earlier (48-key CTAs against 64-query blocks: every
# fourth pair starts on the same diagonal block, with no step to spare). A model of those
# hand-offs (`scripts/turn_model.py`: 132 SMs, 32 heads x 86 CTAs of 64 - 3n/4 steps, launched as
# the kernel does, a hand-off latency L in steps) gives 95% of plain for L <= 1 step but 62% at
# L = 1.5 and 47% at 2: past one step, the delays pile up along the chain. With 2 chains (CTA n
# waits for n + 2, two steps ahead) it gives 95% up to L = 1.5. Session 31 had measured chains at
# d256 causal as no gain, but with one writer warp, whose serial path per block was itself about a
# step. Predicted: 64% -> 80-93% of plain. Measured (H100, session 37, `bwd_profile --ab`, B4
# N4096 H8 d256 causal deterministic): bf16 212.6 -> 245.6 TFLOP/s (+15.5%; plain 287.1: 74% ->
# 86%), fp16 199.6 -> 233.4 (+17%); a window (512, 0) 1124 -> 1101 (-2%, rounds overlapping);
# 3 chains lose (201-209). Backward preset (H100): d256 causal deterministic 81-82% of plain.
# Tests: 84 (`-k dq_chains2_masked`) and 1060 of the deterministic, varlen and sink tests with it
# on, 0 failed.
DQ_CHAINS_MASKED = True


def dq_chains(
    deterministic: bool, version: int, writer: bool, head_dims: tuple[int, int], masked: bool = False
) -> int:
    """The dense kernel's dQ chains (`DQ_CHAINS`) at kernel head dims (d, dv): deterministic v2
    with the writer warp, and not `masked` (causal or a window) unless `DQ_CHAINS_MASKED`."""
    on = deterministic and version == 2 and writer and (DQ_CHAINS_MASKED or not masked)
    return DQ_CHAINS.get(head_dims, 1) if on else 1


# Session 31 (deterministic with the writer warp): 2 writer warps, the producer
# warpgroup's second and third, take the walk's even and odd steps (`sm90_bwd_ws.write_dq`), so
# that one block's wait for its adds to complete and the release of its turn overlap the next
# block's turn and adds. Why: with `DQ_CHAINS` at 2 and 3 alike, deterministic d256 still ran at 76%
# of plain; one warp's serial path per block (the turn's poll, the reduce-add's read, its writes'
# completion, the release) is about one step's length there. Measured (H200, session 31,
# `bwd_profile --versions 2 --deterministic --writer-warps 1/2/1/2`, bf16 B4 N4096, TFLOP/s): d256
# 222 / 253 / 228 / 260 (plain 299: 75% -> 86%), d128 448 / 488 / 478 / 525 (plain 514), d128 causal
# 400 / 444 / 398 / 402 (plain 451), d256 causal 215 / 215 / 211 / 217; 64 GPU tests passed (`-k
# writer_warps`). On since session 32: the deterministic tier passed with it (1176 tests) and the
# backward preset's deterministic geomean went 0.711x -> 0.757x (d256 237 -> 270 TFLOP/s; at d256
# causal, where there are no chains, it changed nothing). Part of the compile key.
DQ_WRITER_WARPS = 2


def writer_warps(deterministic: bool, writer: bool) -> int:
    """The deterministic writer's warps (`DQ_WRITER_WARPS`); 1 where there is no writer."""
    return DQ_WRITER_WARPS if deterministic and writer else 1


def fragment_dims(tile_m: int, head_dim: int):
    """How a block of `tile_m` queries x `head_dim` of the fragment-ordered dQacc is laid out
    (`DQ_FRAGMENTS`): (J, query_dims, d_dims, perm). A block holds, per warpgroup wg, the values
    [j][thread][4] (j < J, thread = 32 warp + lane, the 4 = accumulator values 4 j + 2 h + e);
    the SM90 accumulator puts value 4 j + 2 h + e of (warp, lane) at row 16 warp + 8 h + lane // 4
    and column 8 j + 2 (lane % 4) + e of the warpgroup's GEMM. Viewed as (b, h, blocks, wg, j,
    warp, lane // 4, lane % 4, h, e), `perm` orders it as dQ's (b, blocks, *query_dims, h,
    *d_dims):
      tile 80 (dQ^T = K^T dS^T, d as rows): d = 64 wg + 16 warp + 8 h + lane // 4,
          query = 80 m + 8 j + 2 (lane % 4) + e;
      tile 128 (each warpgroup 64 of the rows): query = 128 m + 64 wg + 16 warp + 8 h + lane // 4,
          d = 8 j + 2 (lane % 4) + e;
      tile 64 (each warpgroup half of d): query = 64 m + 16 warp + 8 h + lane // 4,
          d = head_dim / 2 wg + 8 j + 2 (lane % 4) + e."""
    if tile_m == 80:
        return 10, (10, 4, 2), (2, 4, 2, 8), (0, 2, 4, 7, 9, 1, 3, 5, 8, 6)
    if tile_m == 2 * TILE:
        return head_dim // 8, (2, 4, 2, 8), (head_dim // 8, 4, 2), (0, 2, 3, 5, 8, 6, 1, 4, 7, 9)
    assert tile_m == TILE
    return head_dim // 16, (4, 2, 8), (2, head_dim // 16, 4, 2), (0, 2, 5, 8, 6, 1, 3, 4, 7, 9)


# `dq_from_fragments` by a kernel of its own (`dq_unfragment`, tiles 64, 128 and 80) instead of torch's
# strided elementwise pass, which took 0.159 ms of d64's 2.95 ms backward (B4 N4096 H32 bf16) and
# 0.208 ms at d128 causal tile 64 with DQ_FRAGMENTS there, against 0.066 ms for the plain cast of
# the same bytes (H200, session 34, `bwd_profile`; FA4's postprocess ~0.045 ms). Predicted: d64
# +3%, and DQ_FRAGMENTS with DQ_WRITER_PLAIN at tile 64 (its main kernel 1.196 vs 1.247 ms) then
# ~+4% at d128 causal. Built in session 34 (SASS: 16 LDG.128 and 32 STG.32 per thread at d64,
# 360 instructions, no stack). Measured (H200, session 35, `bwd_profile --ab`, bf16 B4 N4096,
# TFLOP/s, off -> on): d64 459 -> 471, d64 causal 382 -> 404; d128 causal tile 64 433 -> 473 with
# DQ_FRAGMENTS and DQ_WRITER_PLAIN there too (464 without the writer). The backward preset in the same
# call (fp16+bf16, 12 cells, one GPU each): bwd 0.887x -> 0.907x the best peer, deterministic 0.782x
# -> 0.808x (bench/results/2026-11-28-h200-v35). On.
DQ_UNFRAGMENT_KERNEL = True


def dq_from_fragments(buf, seqlen_q: int, dtype, scale: float | None, tile_m: int, copies: int = 1):
    """dQ (b, s_q, h, d) in `dtype`, contiguous, from the fragment-ordered fp32 dQacc `buf`
    (b, h, copies * blocks * tile_m, d) (`fragment_dims`; copies > 1: `DQ_CHAINS`' copies, one
    after another, summed in order), times `scale` where given: one elementwise pass (fp32 math,
    one rounding) from a permuted view of `buf` into dQ's whole blocks, and the last, partial
    block through a one-block buffer; or `dq_unfragment`'s kernel, which adds the copies too
    where `DQ_COPIES_IN_UNFRAGMENT` says (else torch's `sum_copies` first)."""
    import torch

    b, h, rows, d = buf.shape
    assert rows % copies == 0
    kernel = False
    if DQ_UNFRAGMENT_KERNEL and buf.is_contiguous():
        from .dq_unfragment import supports, unfragment_dq

        kernel = supports(tile_m, d)
    if copies > 1 and not (kernel and DQ_COPIES_IN_UNFRAGMENT):  # torch's sum, in their order
        buf, rows, copies = sum_copies(buf.view(b, h, copies, rows // copies, d).unbind(2)), rows // copies, 1
    if kernel:
        return unfragment_dq(buf, seqlen_q, dtype, scale, tile_m, copies)
    assert rows % tile_m == 0 and rows - tile_m < seqlen_q <= rows
    j, query_dims, d_dims, perm = fragment_dims(tile_m, d)
    src = buf.view(b, h, rows // tile_m, 2, j, 4, 8, 4, 2, 2).permute(*perm)

    def write(dst, part):
        return dst.copy_(part) if scale is None else torch.mul(part, scale, out=dst)

    dq = torch.empty(b, seqlen_q, h, d, device=buf.device, dtype=dtype)
    full = seqlen_q // tile_m
    if full:
        write(dq[:, : full * tile_m].view(b, full, *query_dims, h, *d_dims), src[:, :full])
    if full * tile_m < seqlen_q:
        last = torch.empty(b, tile_m, h, d, device=buf.device, dtype=dtype)
        write(last.view(b, 1, *query_dims, h, *d_dims), src[:, full:])
        dq[:, full * tile_m :] = last[:, : seqlen_q - full * tile_m]
    return dq


# Deterministic dQ's chain copies (`DQ_CHAINS`: d256) in fragment order summed by `dq_unfragment`'s
# kernel as it puts dQ in order (copy 0 + copy 1 in fp32, then the scale and the cast: the bits of
# `sum_copies` then the kernel), and (DQ_ZERO_BY_BLOCK) with first-turn stores the host zeroing copy
# c only in the query blocks with c turns or fewer (`block_turns`), not the whole copy. Why (session
# 43, `scripts/bwd_breakdown.py`, H100, B4 N4096 H8 bf16 d256 causal, us per backward): plain 1801,
# deterministic 2156, of which 149 torch's strided sum of the two copies and 80 its zero fill of
# copy 1 (`fewest_turns` 1: query block 0 sees one key block, the others 2 or more); the main
# kernels under ncu 1.80 / 1.63 ms (90.6%), against 83.5% end to end: ~7 points are these host passes.
# Predicted 2156 -> ~1970 us, deterministic d256 causal 82% -> ~91% of plain (non-causal: the sum
# only). Built session 43, CPU only (host tests with torch stand-ins; SASS: 2 x 32 LDG.128 per
# thread at d256, no stack, 82 registers; copies = 1 unchanged): off until `gpu_pending.sh 50`
# has A/B'd and tested it. Read at each call.
DQ_COPIES_IN_UNFRAGMENT = False
DQ_ZERO_BY_BLOCK = False


def sum_copies(copies):
    """copies[0] + copies[1] + ... (fp32), added in that order: a fixed order, as deterministic
    mode needs (`DQ_CHAINS`)."""
    total = copies[0] + copies[1]
    for c in copies[2:]:
        total += c
    return total


# The chains' copies summed and cast by `cast_copies` (session 32, host only; on since session 33's
# GPU run, v33: 231 wide deterministic tests passed, the backward preset ran with it), else summed
# in fp32 (`sum_copies`), then cast.
CAST_COPIES = True


def cast_copies(copies, dtype, scale: float | None):
    """`cast_dq` of `sum_copies(copies)` (`DQ_CHAINS`): without a scale, the last addition writes
    `dtype` directly (torch adds in fp32 and rounds once on the write, as the cast of the fp32
    sum does: the same bits), so the fp32 sum of all copies is never written and read back."""
    import torch

    if scale is not None:
        return cast_dq(sum_copies(copies), dtype, scale)
    total = sum_copies(copies[:-1]) if len(copies) > 2 else copies[0]
    dq = torch.empty(copies[0].shape, device=copies[0].device, dtype=dtype)
    return torch.add(total, copies[-1], out=dq)


def cast_dq(dq_acc, dtype, scale: float | None):
    """dQ in `dtype` from the fp32 dQacc: cast, or (scale given: the kernel left it out) scaled and
    cast in one elementwise pass (torch computes in fp32 and rounds once on the write)."""
    import torch

    if scale is None:
        return dq_acc.to(dtype)
    dq = torch.empty(dq_acc.shape, device=dq_acc.device, dtype=dtype)
    return torch.mul(dq_acc, scale, out=dq)


# The varlen backward's dQ: scaled, cast and gathered to the packed rows by one kernel
# (`dq_gather`) instead of torch's cast of every padded row and a gather of the 16-bit result
# (H100, session 28, the backward-features preset's varlen cell: 0.52 + 0.33 ms of 14.7). Predicted
# -0.35 ms there (+2%); measured (H100, session 29, `scripts/trace_calls.py`, eager ms per call,
# off / on / off): 14.64 / 14.02 / 14.40, causal 8.90 / 8.50 / 8.96 (-3.5%, -4.8%). On.
VARLEN_DQ_GATHER = True


# v2's query tile at d64: 64, or 128 (FA4's d64 tile: twice the GEMM work per step for the same
# fixed cost: 369 -> 428 TFLOP/s non-causal, 336 -> 367 causal, bf16 B4 N4096 H32, `bwd_profile
# --tile-m 64 128`, H200 2026-11-27). Not with softcap, whose kernel spills 232 bytes at 128.
D64_TILE_M = 128
# v2's query tile at d128 without causal, window or softcap: 64, or 80 (FA4's d128 non-causal
# tile, dQ as dQ^T = K^T dS^T). 80 is the default: bf16 B4 N4096 H16 485 / 488 -> 501 / 493
# TFLOP/s, deterministic 337 / 328 -> 356 / 353 (`bwd_profile --d 128 --tile-m 64 80 64 80`, H200
# 2026-11-27), far under the 560-600 predicted (NOTES "v24").
D128_TILE_M = 80


# The rotated walk without deterministic mode too (session 38; built, measured, off). Why:
# without it every CTA of a head starts at query block 0 and walks up, so a head's CTAs (86 at
# d256, 48 keys each, N 4096) reduce-add their dQ into the same 64 KB block at about the same time,
# and read the same Q and dO blocks. Rotated, CTA n starts at block n * (C // num_n) (`walk`), the
# adds spread over the head's blocks. Measured (H100, session 39, `bwd_profile --ab`, bf16 B4 N4096,
# TFLOP/s off / on): d256 325.6 / 325.9, d128 543 / 538, d64 478 / 469: no hot block to spread.
# Any head dim, no causal or window (the walk covers [m_min, m_max) in any order; no turns). Part of
# the compile key (`rotate`). `bwd_profile --plain-rotate on` / `--ab plain-rotate=on`.
PLAIN_ROTATE = False


def rotates(
    deterministic: bool,
    version: int,
    causal: bool,
    left: int,
    right: int,
    seqlen_k: int,
    device,
    head_dim: int = 128,
    head_dim_v: int | None = None,
) -> bool:
    """Whether the deterministic v2 kernel walks its query blocks rotated (`BwdWsSm90`'s
    `rotate`): every key block visits every query block (no causal, no window), and a head's key
    blocks (its CTAs) fit on the GPU at once. The rotated turn order has one wait on a CTA that
    launches later (the wrap-around); with all of a head's CTAs resident it cannot block forever,
    as the earliest unfinished head then always has every CTA launched. (The SM count is torch's:
    a MIG slice's own; an MPS client limited to fewer SMs than that is not covered.) head_dim,
    head_dim_v: the kernel's (the wide kernel's only with WIDE_ROTATE), whose keys per CTA
    (`keys_per_cta`) make a head's CTAs, one per SM in both kernels. Not deterministic: where
    `PLAIN_ROTATE` is on (no turns, so no residency rule), without causal or window."""
    if not (version == 2 and not causal and left < 0 and right < 0):
        return False
    if not deterministic:
        return PLAIN_ROTATE
    if head_dim > HEAD_DIMS[-1] and not WIDE_ROTATE:
        return False
    keys = keys_per_cta(head_dim, head_dim if head_dim_v is None else head_dim_v)
    return -(-seqlen_k // keys) <= _sm_count(device)


# Q and dO shared by CTA pairs (session 39; built, measured, off): the v2 kernels launch in
# clusters of two neighbouring key blocks of a head, which walk the same query blocks in step; each
# CTA loads half of every Q and dO tile and multicasts it into both (`BwdWsSm90.set_pairs`). Why:
# ncu of the d256 backward on an H100 (bf16 B4 N4096 H8): our kernel moves 29.4 GB through L2 at
# 95.7% of L2's peak throughput and 4.9% of DRAM's, 4.01 ms (cuDNN's 12.6 GB at 52%, 3.48 ms), 11.7
# GB of it reads of Q and dO (each 48-key CTA reads a head's whole Q and dO). Pairs halved those
# reads and took L2 to 90.3%, but lost (`bwd_profile --ab`, H100, TFLOP/s off / on): d256 325.9 /
# 318.0, N 8192 345 / 332, d128 545 / 532, d64 476 / 476: the reads were not what bound it (the dQ
# reduce-adds are: NOTES v39), and the pair's lockstep costs. Kept as the base of pair designs.
# The kernel head dims where it is on; part of the compile key (`multicasts`). Only the plain
# dense walk (no causal, window, deterministic mode, varlen or PLAIN_ROTATE).
# `bwd_profile --multicast on` / `--ab multicast=on`.
QDO_MULTICAST: frozenset = frozenset()


def multicasts(
    deterministic: bool, version: int, causal: bool, left: int, right: int, rotate: bool, head_dim: int
) -> bool:
    """Whether the dense v2 kernel runs in CTA pairs sharing Q and dO (`QDO_MULTICAST`): the
    plain walk only (`BwdWsSm90.set_pairs`), at the kernel head dims listed."""
    plain = version == 2 and not (deterministic or causal or rotate) and left < 0 and right < 0
    return plain and head_dim in QDO_MULTICAST


# The wide kernel's deterministic mode walks rotated too (`rotates` with its keys per CTA; session 28).
# Predicted deterministic d256 at 67-77% of the plain backward (H100, v28) -> 80-90%. Measured (H100,
# session 29, `bwd_profile --wide --deterministic`, bf16 B4 N4096, TFLOP/s off / on / off): d256 H8
# 195.6 / 203.2 / 197.0 (+3.5%, short of the prediction), d192/dv128 H16 301.3 / 331.0 / 290.9. On.
WIDE_ROTATE = True


def keys_per_cta(head_dim: int, head_dim_v: int) -> int:
    """The v2 kernels' keys per CTA: 128 (`sm90_bwd_ws`), or the wide kernel's tile (64 at
    (256, 256), 96 at (192, 128): `sm90_bwd_wide.SHAPES`), for kernel head dims."""
    if head_dim <= HEAD_DIMS[-1]:
        return 128
    from .sm90_bwd_wide import SHAPES

    return SHAPES[head_dim, head_dim_v].tile_n


def key_blocks_seen(m, seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, left: int, right: int):
    """How many key blocks of tile_n keys query block m (an int or an int64 array) of tile_m rows
    visits, the forward's rule (`Mask.block_range_local`) with `emulate.block_range`'s sides (-1
    no limit, causal right = 0): [n_min, n_max)'s length, below 0 where its rows see no key."""
    num_n = -(-seqlen_k // tile_n)
    first = m * tile_m + seqlen_k - seqlen_q  # (the block's first row's diagonal)
    n_max = num_n if right < 0 else np.minimum(num_n, -(-np.maximum(first + tile_m + right, 0) // tile_n))
    n_min = 0 if left < 0 else np.maximum(first - left, 0) // tile_n
    return n_max - n_min


def block_turns(seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, left: int, right: int):
    """Each query block's deterministic turns (`key_blocks_seen`, 0 where its rows see no key):
    an int64 array, one entry per query block."""
    blocks = -(-seqlen_q // tile_m)
    seen = key_blocks_seen(np.arange(blocks, dtype=np.int64), seqlen_q, seqlen_k, tile_m, tile_n, left, right)
    return np.broadcast_to(np.maximum(seen, 0), (blocks,))


def fewest_turns(seqlen_q: int, seqlen_k: int, tile_m: int, tile_n: int, left: int, right: int) -> int:
    """The fewest key blocks that any query block visits (`key_blocks_seen`): every block of
    dQacc gets at least this many deterministic turns. 0 when some block's rows see no key, or
    there are no keys (no kernel runs) or no query blocks."""
    blocks, num_n = -(-seqlen_q // tile_m), -(-seqlen_k // tile_n)
    if blocks == 0 or num_n == 0:
        return 0
    dims = (seqlen_q, seqlen_k, tile_m, tile_n, left, right)
    # n_min and n_max never fall as m grows: without a left limit (n_min 0) block 0 sees the
    # fewest, without a right one (n_max all) the last block; with both, any block may.
    if left < 0:
        fewest = key_blocks_seen(0, *dims)
    elif right < 0:
        fewest = key_blocks_seen(blocks - 1, *dims)
    else:
        fewest = block_turns(*dims).min()
    return int(max(fewest, 0))


def zero_blocks(copy, which) -> None:
    """Zero the blocks of one dQacc copy (`copy`: (..., blocks, block's floats)) where `which` (a
    bool array, one per block) holds: one slice per run of such blocks (causal: the first few)."""
    m, blocks = 0, len(which)
    while m < blocks:
        if not which[m]:
            m += 1
            continue
        end = m + 1
        while end < blocks and which[end]:
            end += 1
        copy[..., m:end, :].zero_()
        m = end


# The SM count `rotates` assumes for tensors off the GPU (the host tests' stand-in kernels).
HOST_SM_COUNT = 132


def _sm_count(device) -> int:
    """The SM count of `device` (a torch.device): `kernels._sm_count`'s cached one on a GPU."""
    if device.type != "cuda":
        return HOST_SM_COUNT
    from . import _sm_count as device_sm_count

    return device_sm_count(device.index)  # (a tensor's CUDA device always has its index)


# The varlen backward's dQ in fragment order too (session 35; on since session 36): at
# the query tiles of `DQ_FRAGMENTS` (the wide kernel: `DQ_FRAGMENTS_WIDE`), dQacc per head in whole
# blocks of the padded rows, each sequence's blocks from its padded start (a multiple of tile_m),
# and `dq_unfragment`'s kernel with a row map (padded row -> packed row, -1 for padding) puts dQ
# back in order, scaled and cast, in place of `dq_gather`. Predicted: the dense gains of session
# 35 (d128 tile 80 +3%, causal tile 64 +9%) on the varlen backward (0.93x / 0.91x FA4 in v35);
# measured (v36, H200, 24 sequences): d64 +8.6%, d128 +1%, d128 causal +2.5% (0.96x / 0.93x FA4).
VARLEN_DQ_FRAGMENTS = True


def padded_starts(cu_seqlens_q, tile_m: int):
    """Where each sequence's rows start in the varlen backward's padded query-side buffers:
    (cu_seqlens_q[b] + tile_m * b) rounded down to a multiple of tile_m. Sequence b's query blocks
    end before sequence b + 1's start (floor((c + L + (b + 1) t) / t) >= floor((c + b t) / t) +
    ceil(L / t)), the last ends by total_q + tile_m * batch, and every query block starts on a
    multiple of tile_m (the TMA boxes of LSE and D need 16-byte-aligned starts)."""
    import torch

    b = torch.arange(cu_seqlens_q.shape[0], device=cu_seqlens_q.device, dtype=cu_seqlens_q.dtype)
    return (cu_seqlens_q + tile_m * b) // tile_m * tile_m


def query_tile(version: int, head_dim: int, softcap: bool = False, masked: bool = False) -> int:
    """Queries per step of the kernel that runs (version, head_dim, softcap, masked: causal or a
    window): the LSE/D padding and the deterministic semaphores count blocks of it."""
    if version != 2 or softcap:
        return TILE
    if head_dim == 64:
        return D64_TILE_M
    return D128_TILE_M if head_dim == 128 and not masked else TILE


def kernel_head_dims(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """The kernels' (head_dim, head_dim_v) for q, k's `head_dim` and v's `head_dim_v`
    (`backward.kernel_head_dims`: (64, 64), (128, 128), and the wide kernel's (192, 128),
    (256, 256) where it is on). The host zero-pads q, k to the first, v, out and dout to the
    second, which is exact: zero columns add nothing to S = Q K^T, dP = dO V^T or D = rowsum(dO O),
    and the padding's gradients are dropped. Raises NotImplementedError past the largest."""
    from hopper_fmha.backward import kernel_dims
    from hopper_fmha.backward import kernel_head_dims as pair

    dims = pair(head_dim, head_dim_v)
    if dims is None:
        raise NotImplementedError(
            f"the backward kernels take head dims up to {kernel_dims()[-1][0]} (q, k's and v's); got "
            f"head_dim {head_dim}, head_dim_v {head_dim_v}"
        )
    return dims


def _check_inputs(dtype_name: str, q, out, dout) -> None:
    if dtype_name not in _DTYPES:
        raise NotImplementedError(f"the backward kernel takes float16/bfloat16, got {q.dtype}")
    if dout.shape != out.shape or dout.dtype != out.dtype:
        raise ValueError(
            f"dout must match out: {tuple(out.shape)} {out.dtype}, got {tuple(dout.shape)} {dout.dtype}"
        )


def _window_sides(window_size, causal: bool) -> tuple[int, int]:
    """(left, right) as the kernel takes them: with causal the right side is the causal mask's
    (the right limit 0, the tighter of the two), so -1."""
    left, right = (int(x) for x in window_size)
    return left, -1 if causal else right


def _padded(tensors, kd: int, kdv: int):
    """q, k, v, out, dout with their last mode zero-padded to the kernel's head dims: kd (q, k) and
    kdv (v, out, dout)."""
    import torch.nn.functional as F

    dims = (kd, kd, kdv, kdv, kdv)
    pairs = zip(tensors, dims, strict=True)
    return [t if t.shape[-1] == n else F.pad(t, (0, n - t.shape[-1])) for t, n in pairs]


def _unpadded(grads, head_dim: int, head_dim_v: int):
    """dq, dk, dv cut back to the inputs' head dims (contiguous), the rest (dsink) as it is."""
    dq, dk, dv = (
        g[..., :n].contiguous() for g, n in zip(grads[:3], (head_dim, head_dim, head_dim_v), strict=True)
    )
    return (dq, dk, dv) + tuple(grads[3:])


def row_stats(out, dout, lse, dlse, block: int = TILE):
    """(D, LSE log2 e) as the kernels read them: (b, h, s_pad) float32, s_pad = s_q rounded up to
    a multiple of `block` (the kernel's query tile), then of 64 (the strides' declared
    divisibility; 80-row blocks), D = rowsum(dout * out) - dlse, +inf and 0
    past s_q and +inf where lse = -inf (`bwd_preprocess`'s contract): from the preprocess kernel
    (PREPROCESS_KERNEL), else from torch. s_q >= 1."""
    import torch

    batch, seqlen_q, heads = out.shape[:3]
    seqlen_pad = -(-seqlen_q // block) * block
    seqlen_pad = -(-seqlen_pad // TILE) * TILE
    delta = torch.empty(batch, heads, seqlen_pad, device=out.device, dtype=torch.float32)
    lse2 = torch.empty_like(delta)
    lse = lse.float().contiguous()
    if PREPROCESS_KERNEL and seqlen_q:
        from .bwd_preprocess import row_stats_kernel

        row_stats_kernel(out.contiguous(), dout, lse, None if dlse is None else dlse.float(), delta, lse2)
        return delta, lse2
    from hopper_fmha.backward import row_delta

    delta.zero_()
    lse2.fill_(float("inf"))
    if seqlen_q:
        delta[..., :seqlen_q] = row_delta(out, dout, dlse)
        lse2[..., :seqlen_q] = torch.where(lse == -float("inf"), float("inf"), lse * LOG2_E)
    return delta, lse2


def backward(
    q,
    k,
    v,
    out,
    dout,
    lse,
    softmax_scale: float,
    causal: bool,
    *,
    dlse=None,
    deterministic=False,
    version=None,
    window_size=(-1, -1),
    softcap=0.0,
    learnable_sink=None,
):
    """(dq, dk, dv) of `flash_attn_func`'s forward (q, k, v, out, lse as it returned them, lse
    exact), for the upstream gradients dout and, where the caller used the LSE, dlse (b, h, s_q);
    d = 64 or 128, with `backward.WIDE_BACKWARD` also (192, 128) and (256, 256) for (d, dv)
    (`sm90_bwd_wide`, version 2), others on zero-padded copies of the next pair; fp16/bf16, BSHD,
    GQA/MQA.

    Score features as the forward ran them (version 2 only): window_size (left, right), -1 for a
    side without limit (with causal the right side is the causal mask's); softcap the cap (0:
    off); learnable_sink the (h,) float32 logits, whose gradient (h,) float32 comes fourth:
    (dq, dk, dv, dsink). The kernel needs nothing for the sink (the LSE holds it).

    D = rowsum(dout * out) - dlse and LSE log2 e, padded, come from `row_stats`, the zeroed fp32 dQ
    accumulator from torch;
    the kernel writes per-q-head fp32 dK, dV that a GQA group's sum reduces to its kv head, or,
    with MHA, dK and dV in the inputs' type. Batch and heads past CUDA's 65535 grid limit launch
    in parts (`kernels.grid_spans`)."""
    import torch

    dtype_name = str(q.dtype).removeprefix("torch.")
    batch, seqlen_q, heads, d = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    _check_inputs(dtype_name, q, out, dout)
    d_v = v.shape[3]
    kd, kdv = kernel_head_dims(d, d_v)
    if (kd, kdv) != (d, d_v):  # the next kernel up, on zero-padded copies
        grads = backward(
            *_padded((q, k, v, out, dout), kd, kdv), lse, softmax_scale, causal, dlse=dlse,
            deterministic=deterministic, version=version, window_size=window_size, softcap=softcap,
            learnable_sink=learnable_sink,
        )  # fmt: skip
        return _unpadded(grads, d, d_v)
    version = DEFAULT_VERSION if version is None else version
    wide = d > HEAD_DIMS[-1]  # `sm90_bwd_wide`: dK, dV per q head
    if wide and version != 2:
        raise NotImplementedError(
            f"backward kernel version {version} takes head dims up to 128 (past 128: version 2)"
        )
    left, right = _window_sides(window_size, causal)
    features = (left >= 0, right >= 0, bool(softcap))  # which, not their sizes: runtime values
    if any(features) and version != 2:
        raise NotImplementedError(f"backward kernel version {version} has no window or softcap (v2 has)")
    q, k, v, dout = (t.contiguous() for t in (q, k, v, dout))  # no copy where already contiguous
    masked = causal or left >= 0 or right >= 0
    tile_m = query_tile(version, d, bool(softcap), masked)
    delta, lse2 = row_stats(out, dout, lse, dlse, tile_m)
    # The kernel and the host below agree on these two (both in the compile key).
    dq_unscaled = tile_switch(DQ_SCALE_AT_CAST, tile_m)
    dq_fragments = version == 2 and fragments_on(tile_m, wide)
    writer = dq_writer(bool(deterministic), tile_m, wide) and version == 2
    chains = dq_chains(bool(deterministic), version, writer, (d, d_v), masked)
    blocks = -(-seqlen_q // tile_m)
    # Deterministic: the kernel stores each block's first turn, so dQacc needs no zeros, but where
    # a chain copy of some block gets no turn (fewer key blocks than copies; with causal or a
    # window, fewer key blocks seen by some block's rows) or no kernel runs
    # (`sm90_bwd_ws.store_first`; imported only when deterministic).
    stored = laps = False
    rotate = rotates(deterministic, version, causal, left, right, seqlen_k, q.device, d, d_v)
    if deterministic and version == 2:
        from . import sm90_bwd_ws

        stored = sm90_bwd_ws.store_first(True, writer, masked, False)
        laps = sm90_bwd_ws.DQ_LAPS and rotate and chains > 1  # (the kernel's `laps`)
    alloc_acc = torch.empty if stored else torch.zeros
    if dq_fragments:  # per (batch, head), whole blocks: each block's fragments contiguous
        frag = alloc_acc(batch, heads, chains * blocks * tile_m, d, device=q.device, dtype=torch.float32)
        dq_acc = frag.transpose(1, 2)[:, : seqlen_q if chains == 1 else None]
    else:  # (chains: copies of the padded rows, one after another)
        rows = seqlen_q if chains == 1 else chains * blocks * tile_m
        dq_acc = alloc_acc(batch, rows, heads, d, device=q.device, dtype=torch.float32)
    if stored:
        # Each query block's turns: the key blocks its rows see (masked), else all of them.
        sides = (left, 0 if causal else right) if masked else (-1, -1)
        turn_dims = (seqlen_q, seqlen_k, tile_m, keys_per_cta(d, d_v), *sides)
        turns = fewest_turns(*turn_dims)
        reached = sm90_bwd_ws.laps_reached(turns, chains) if laps else turns  # (copies with a turn)
        if turns == 0:  # no kernel runs, or some block gets no turn: all of dQacc
            (frag if dq_fragments else dq_acc).zero_()
        elif reached < chains:  # the copies not every block's turns reach
            if dq_fragments:
                parts = frag.view(batch, heads, chains, blocks, tile_m * d).unbind(2)
            else:
                parts = dq_acc.view(batch, chains, blocks, tile_m * heads * d).unbind(1)
            # laps (no mask: all blocks alike): the copies of the laps without key blocks, whole;
            # else (DQ_ZERO_BY_BLOCK) copy c of the blocks with c turns or fewer (causal: the first).
            per_block = block_turns(*turn_dims) if DQ_ZERO_BY_BLOCK and not laps else None
            for c in range(reached, chains):
                zero_blocks(parts[c], np.full(blocks, True) if per_block is None else per_block <= c)
    group = heads // kv_heads
    mha = group == 1
    # GQA: v2 adds a group's dK, dV into fp32 sums per kv head (zeroed), unless deterministic;
    # otherwise per q head, summed below. Each key row is written by the CTA that owns it.
    atomic = version == 2 and not mha and not deterministic and not wide
    alloc = torch.zeros if atomic else torch.empty  # (sums start at 0)
    dkv_heads, dkv_dtype = (kv_heads if atomic else heads), (q.dtype if mha else torch.float32)
    dk, dv = (alloc(batch, seqlen_k, dkv_heads, n, device=q.device, dtype=dkv_dtype) for n in (d, d_v))
    sem = None
    if deterministic:
        sem = torch.zeros(batch, heads, chains * blocks, device=q.device, dtype=torch.int32)
    key = (dtype_name, d, bool(causal), bool(deterministic), version, mha, atomic, *features, False, tile_m)
    warps = writer_warps(bool(deterministic), writer)
    pairs = multicasts(bool(deterministic), version, bool(causal), left, right, rotate, d)
    key = key + (rotate, dq_unscaled, dq_fragments, d_v, writer, chains, warps, pairs)
    fn = _compiled.get(key) or _kernel(key)
    if seqlen_k > 0 and seqlen_q > 0:
        from . import grid_spans

        # Parts within CUDA's grid limits, as the forward's (`kernels.grid_spans`).
        for b, h, kv in grid_spans(batch, heads, kv_heads, GRID_YZ_MAX):
            dkv = kv if atomic else h  # dK, dV's heads: kv heads or q heads
            fn(
                q[b, :, h], k[b, :, kv], v[b, :, kv], dout[b, :, h], lse2[b, h], delta[b, h],
                dq_acc[b, :, h], dk[b, :, dkv], dv[b, :, dkv], None if sem is None else sem[b, h],
                softmax_scale, group, left, right, float(softcap), None, None, 0,
            )  # fmt: skip
    else:
        dk.zero_()
        dv.zero_()
    if not mha and not atomic:
        dk = dk.view(batch, seqlen_k, kv_heads, group, d).sum(3)
        dv = dv.view(batch, seqlen_k, kv_heads, group, d_v).sum(3)
    scale = softmax_scale if dq_unscaled else None
    if dq_fragments:  # (and the chains' copies summed, in their order)
        dq = dq_from_fragments(frag, seqlen_q, q.dtype, scale, tile_m, chains)
    elif chains > 1:  # the copies' sum, in their order, cast
        copies = dq_acc.view(batch, chains, blocks * tile_m, heads, d)[:, :, :seqlen_q].unbind(1)
        if CAST_COPIES:
            dq = cast_copies(copies, q.dtype, scale)
        else:
            dq = cast_dq(sum_copies(copies), q.dtype, scale)
    else:
        dq = cast_dq(dq_acc, q.dtype, scale)
    grads = (dq, dk.to(q.dtype), dv.to(q.dtype))  # (no copy where already q's type)
    if learnable_sink is None:
        return grads
    from hopper_fmha.backward import sink_gradient

    return grads + (sink_gradient(lse, delta[..., :seqlen_q], learnable_sink),)


def backward_varlen(
    q,
    k,
    v,
    out,
    dout,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    *,
    dlse=None,
    deterministic=False,
    window_size=(-1, -1),
    softcap=0.0,
    learnable_sink=None,
):
    """`backward` for `flash_attn_varlen_func`'s packed sequences (version 2): q, out, dout
    (total_q, h, d), k, v (total_k, h_kv, d), lse and dlse (h, total_q) float32, cu_seqlens_q/k
    (batch + 1,) int32 on q's device (checked by the forward), max_seqlen_q/k at least the longest
    sequences. Returns (dq, dk, dv), and dsink fourth with learnable_sink.

    The query side's fp32 buffers (LSE log2 e, D, dQacc) hold each sequence's rows followed by
    padding (+inf, 0, 0): sequence b's rows start at `padded_starts` (tile_m the kernel's query
    tile, `query_tile`), so a query block never reads or adds into the next sequence's rows (the
    kernel's `padded_rows`). D and LSE log2 e come from the preprocess kernel on the packed rows,
    scattered into that layout; dq is gathered back from it."""
    import torch

    dtype_name = str(q.dtype).removeprefix("torch.")
    total_q, heads, d = q.shape
    total_k, kv_heads = k.shape[0], k.shape[1]
    batch = cu_seqlens_q.shape[0] - 1
    _check_inputs(dtype_name, q, out, dout)
    d_v = v.shape[2]
    kd, kdv = kernel_head_dims(d, d_v)
    if (kd, kdv) != (d, d_v):  # the next kernel up, on zero-padded copies
        grads = backward_varlen(
            *_padded((q, k, v, out, dout), kd, kdv), lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, softmax_scale, causal, dlse=dlse, deterministic=deterministic,
            window_size=window_size, softcap=softcap, learnable_sink=learnable_sink,
        )  # fmt: skip
        return _unpadded(grads, d, d_v)
    if batch > GRID_YZ_MAX or heads > GRID_YZ_MAX:
        raise NotImplementedError(
            f"the varlen backward launches one grid: at most {GRID_YZ_MAX} sequences and q heads, "
            f"got {batch} and {heads}"
        )
    left, right = _window_sides(window_size, causal)
    q, k, v, dout = (t.contiguous() for t in (q, k, v, dout))
    device = q.device
    # Each packed row's place in the padded buffers: its sequence's padded start + its row in it.
    tile_m = query_tile(2, d, bool(softcap), causal or left >= 0 or right >= 0)
    rows = torch.arange(total_q, device=device)
    seq = torch.searchsorted(cu_seqlens_q[1:].long(), rows, right=True).clamp_(max=batch - 1)
    cu = cu_seqlens_q.long()
    padded = padded_starts(cu, tile_m)[seq] + rows - cu[seq]
    total_pad = -(-(total_q + tile_m * batch) // TILE) * TILE  # (LSE, D's head stride: 64 | it)
    # D and LSE log2 e of the packed rows by the preprocess kernel (the packed batch seen as one
    # sequence: `row_stats`; v26's torch D took 2.8 ms of an 18 ms backward, H32 24 sequences),
    # then scattered into the padded layout. Rows past the last sequence (cu_seqlens_q[-1] <=
    # total_q) were never written by the forward: their out and lse may hold anything, so they get
    # D = 0 and no LSE (no sink weight below).
    lse = lse.float()
    if total_q:
        dlse_rows = None if dlse is None else dlse[None]
        d_rows, l2_rows = row_stats(out[None], dout[None], lse[None], dlse_rows, tile_m)
        d_rows, l2_rows = d_rows[0, :, :total_q], l2_rows[0, :, :total_q]
    else:
        d_rows = l2_rows = lse
    in_sequence = rows < cu_seqlens_q[-1]
    delta_rows = torch.where(in_sequence, d_rows, 0.0)  # (h, total_q)
    delta = torch.zeros(heads, total_pad, device=device, dtype=torch.float32)
    lse2 = torch.full((heads, total_pad), float("inf"), device=device, dtype=torch.float32)
    delta[:, padded] = delta_rows
    lse2[:, padded] = torch.where(in_sequence, l2_rows, float("inf"))
    wide = d > HEAD_DIMS[-1]  # `sm90_bwd_wide`: dK, dV per q head
    dq_fragments = VARLEN_DQ_FRAGMENTS and fragments_on(tile_m, wide)
    if dq_fragments:  # per head, whole blocks of the padded rows (blocks start on multiples of tile_m)
        frag_rows = -(-total_pad // tile_m) * tile_m
        frag = torch.zeros(heads, frag_rows, d, device=device, dtype=torch.float32)
        dq_acc = frag.transpose(0, 1)
    else:
        dq_acc = torch.zeros(total_pad, heads, d, device=device, dtype=torch.float32)
    group = heads // kv_heads
    mha = group == 1
    atomic = not mha and not deterministic and not wide
    # Zeroed: keys past max_seqlen_k (a max_seqlen_k below the truth) get no CTA.
    dkv_dtype = q.dtype if mha else torch.float32
    dkv_heads = kv_heads if atomic else heads
    dk, dv = (torch.zeros(total_k, dkv_heads, n, device=device, dtype=dkv_dtype) for n in (d, d_v))
    sem = None
    if deterministic:
        # A counter per query block of any sequence: sized by total_q, not max_seqlen_q, so that a
        # max_seqlen_q below the truth (unchecked under graph capture) cannot index past them.
        sem = torch.zeros(batch, heads, max(1, -(-total_q // tile_m)), device=device, dtype=torch.int32)
    dq_unscaled = tile_switch(DQ_SCALE_AT_CAST, tile_m)  # the kernel and the cast below agree on it
    writer = dq_writer(bool(deterministic), tile_m, d > HEAD_DIMS[-1])
    key = (dtype_name, d, bool(causal), bool(deterministic), 2, mha, atomic, left >= 0, right >= 0)
    key = key + (
        bool(softcap),
        True,
        tile_m,
        rotates(deterministic, 2, causal, left, right, max_seqlen_k, device, d, d_v),
        dq_unscaled,
        dq_fragments,
        d_v,
        writer,
        1,  # dq_chains: dense only
        writer_warps(bool(deterministic), writer),
        False,  # multicast: dense only
    )
    fn = _compiled.get(key) or _kernel(key)
    if total_k > 0 and total_q > 0 and batch > 0 and max_seqlen_k > 0:
        fn(
            q[None], k[None], v[None], dout[None], lse2[None], delta[None], dq_acc[None], dk[None], dv[None],
            sem, softmax_scale, group, left, right, float(softcap), cu_seqlens_q, cu_seqlens_k, max_seqlen_k,
        )  # fmt: skip
    if not mha and not atomic:
        dk = dk.view(total_k, kv_heads, group, d).sum(2)
        dv = dv.view(total_k, kv_heads, group, d_v).sum(2)
    dq_scale = softmax_scale if dq_unscaled else None
    if dq_fragments and DQ_UNFRAGMENT_KERNEL:  # put in order, scaled, cast and gathered by one kernel
        from .dq_unfragment import unfragment_dq_rows

        dest = torch.full((frag_rows,), -1, device=device, dtype=torch.int32)
        dest[padded] = torch.arange(total_q, device=device, dtype=torch.int32)
        dq = unfragment_dq_rows(frag, dest, total_q, q.dtype, dq_scale, tile_m)
    elif dq_fragments:  # torch's un-permute of every padded row, then the packed rows
        dq = dq_from_fragments(frag[None], frag_rows, q.dtype, dq_scale, tile_m)[0][padded]
    elif VARLEN_DQ_GATHER:
        from .dq_gather import gather_dq

        dq = gather_dq(dq_acc, padded, q.dtype, dq_scale)
    else:  # cast, then gathered: the gather moves 2-byte values, not 4 (0.3 ms, v27)
        dq = cast_dq(dq_acc, q.dtype, dq_scale)[padded]
    grads = (dq, dk.to(q.dtype), dv.to(q.dtype))
    if learnable_sink is None:
        return grads
    from hopper_fmha.backward import sink_gradient

    lse_rows = torch.where(in_sequence, lse, -float("inf"))
    return grads + (sink_gradient(lse_rows[None], delta_rows[None], learnable_sink),)
