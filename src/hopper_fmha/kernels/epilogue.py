"""Where a tile's results go: O (16-bit) through shared memory and a TMA store, LSE to global memory.

Contract (`Epilogue`, built from the tile shape and the O buffer):
    host:       make_atom(mO, sQ_layout) -> O's smem layout, its size in elements (for the
                shared storage) and the TMA store atom and tensor.
    consumers:  store(acc_O, lse, ...) once per tile, after `Softmax.finalize`; drain(tidx) before
                the kernel exits (the threads that issued stores wait until the last has read sO).
O buffers (`o_buffer`, `config.ws_o_buffer` decides which fits):
    "own"    a tile_m x d buffer of its own: the next tile's Q loads while this tile's O is stored;
             the buffer is written again once the previous tile's store has read it.
    "split"  a 64 x min(d, 128) buffer per consumer warpgroup, stored in d / 128 passes at d = 256.
    "q"      Q's buffer: the store must have read it before the next Q loads (`mbar_Q_empty`).
Dense (b, s, h, d) O and (b, h, s) LSE: rows past seqlen_q clipped by the TMA store and skipped
for LSE. Varlen: packed (total, h, d) O through a ragged TMA view that clips at each sequence's
end (`SeqlenInfo.ragged_tile`), LSE (h, total) at the sequence's offset.
To come, each one field of the compile key: split-KV (partial O and LSE to a workspace, combined
by a second kernel), pack-GQA (a tile's rows from several heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync

from .seqlen import SeqlenInfo
from .sm90_common import acc_mn_layout, convert, smem_layout, stmatrix_copy, tiled_mma_64

WARPGROUP = 128


@dataclass(frozen=True)
class Epilogue:
    """The O/LSE stores of `num_mma_wg` consumer warpgroups (64 rows each) for tile_m x head_dim
    (V's and O's columns; those past the data's are clipped by the TMA store)
    tiles. Named barriers: `barrier_epilogue` (all consumers) and `barrier_o_slot` + warpgroup
    (split: that warpgroup's buffer is written / free)."""

    dtype: cutlass.Constexpr[type]
    tile_m: cutlass.Constexpr[int]
    head_dim: cutlass.Constexpr[int]
    num_mma_wg: cutlass.Constexpr[int]
    o_buffer: cutlass.Constexpr[str]
    barrier_epilogue: cutlass.Constexpr[int]
    barrier_o_slot: cutlass.Constexpr[int]

    @property
    def num_mma_threads(self) -> int:
        return WARPGROUP * self.num_mma_wg

    @property
    def o_cols(self) -> int:
        """Columns of a split buffer."""
        return min(self.head_dim, 128)

    @property
    def separate_o(self) -> bool:
        return self.o_buffer == "own"

    @property
    def split_o(self) -> bool:
        return self.o_buffer == "split"

    # ---------------------------------------------------------------- host side
    def make_atom(self, mO: cute.Tensor):
        """(sO_layout, o_elems, tma_atom_O, tma_O): O's smem layout (over Q's storage when O reuses
        Q's buffer; then o_elems is a token 8), and the TMA store of the whole tile or (split)
        64 x o_cols."""
        sO_layout = smem_layout(self.dtype, self.tile_m, self.head_dim)
        o_box = (self.tile_m, self.head_dim)
        if const_expr(self.split_o):
            sO_layout = smem_layout(self.dtype, 64, self.o_cols, self.num_mma_wg)
            o_box = (64, self.o_cols)
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]), o_box
        )
        o_elems = 8
        if const_expr(self.separate_o or self.split_o):
            o_elems = cute.cosize(sO_layout)
        return sO_layout, o_elems, tma_atom_O, tma_O

    # ---------------------------------------------------------------- device side
    @cute.jit
    def store(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        sO: cute.Tensor,
        mbar_Q_empty: cute.Pointer,
        tma_atom_O: cute.CopyAtom,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        tiled_mma_pv: cute.TiledMma,
        thr_mma_pv: cute.ThrMma,
        tidx: Int32,
        m_block: Int32,
        head: Int32,
        batch: Int32,
        seqlen: SeqlenInfo,
    ):
        """O (normalized, `Softmax.finalize`) via smem + TMA store; LSE to global memory."""
        # LSE: one lane per row quad writes (the lane holding column 0), rows inside the sequence.
        cO = thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        tOcO_mn = cute.make_tensor(cO.iterator, acc_mn_layout(cO.layout))
        if tOcO_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.tile_m + tOcO_mn[r, 0][0]
                if row < seqlen.seqlen_q:
                    if const_expr(seqlen.varlen):
                        mLSE[seqlen.offset_q + row, head, 0] = lse[r]
                    else:
                        mLSE[row, head, batch] = lse[r]

        # O: registers -> smem (stmatrix) -> TMA store. With its own buffer, O waits only for the
        # previous tile's store to have read it. In Q's buffer: a warpgroup's rows of sQ are read
        # only by its own GEMM-Is, all complete here, so it writes them without a barrier.
        rO = cute.make_rmem_tensor(acc_O.layout, self.dtype)
        convert(acc_O, rO)
        if const_expr(self.split_o):
            self.store_o_split(rO, sO, tma_atom_O, mO, tidx, m_block, head, batch, seqlen)
            return
        if const_expr(self.separate_o):
            if tidx // 32 == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=self.barrier_epilogue, number_of_threads=self.num_mma_threads)
        smem_copy_O = stmatrix_copy(self.dtype, tiled_mma_pv, tidx)
        cute.copy(smem_copy_O, smem_copy_O.retile(rO), smem_copy_O.partition_D(sO))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=self.barrier_epilogue, number_of_threads=self.num_mma_threads)
        if tidx // 32 == 0:
            gO = cute.local_tile(
                self.o_rows(mO, head, batch, seqlen), (self.tile_m, self.head_dim), (m_block, 0)
            )
            tOsO, tOgO = cpasync.tma_partition(
                tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2)
            )
            cute.copy(tma_atom_O, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(not self.separate_o):
                # Q's buffer is free once the store has read it.
                cute.arch.cp_async_bulk_wait_group(0, read=True)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive(mbar_Q_empty)

    @cute.jit
    def store_o_split(
        self,
        rO: cute.Tensor,
        sO: cute.Tensor,
        tma_atom_O: cute.CopyAtom,
        mO: cute.Tensor,
        tidx: Int32,
        m_block: Int32,
        head: Int32,
        batch: Int32,
        seqlen: SeqlenInfo,
    ):
        """split: a warpgroup's 64 rows of O through its own buffer, o_cols columns per pass.

        The first warp of the warpgroup issues each TMA store and, before the buffer is written
        again (next pass or next tile), waits until that store has read it.
        """
        wg = cute.arch.make_warp_uniform(tidx // WARPGROUP)
        wtid = tidx % WARPGROUP
        # The accumulator of one 64 x o_cols block, as a single-warpgroup GEMM would hold it.
        slot_mma = tiled_mma_64(self.dtype, OperandMajorMode.K, self.o_cols)
        smem_copy_O = stmatrix_copy(self.dtype, slot_mma, wtid)
        sO_wg = sO[None, None, wg]
        tOsO = smem_copy_O.partition_D(sO_wg)
        gO = cute.local_tile(
            self.o_rows(mO, head, batch, seqlen), (64, self.o_cols), (m_block * self.num_mma_wg + wg, None)
        )
        tOsO_tma, tOgO_tma = cpasync.tma_partition(
            tma_atom_O, 0, cute.make_layout(1), cute.group_modes(sO_wg, 0, 2), cute.group_modes(gO, 0, 2)
        )
        # Pass h holds column groups [h * o_cols / 8, (h + 1) * o_cols / 8) of the accumulator.
        groups = self.o_cols // 8
        pass_layout = cute.make_layout(((2, 2, groups), 1, 1), stride=((1, 2, 4), 0, 0))
        issuer = wtid < 32
        # Passes over the data's columns only: where v's head dim is padded (256 data columns of
        # 128), a pass past them would find gO's column mode of size 1 (stride 0) and store the
        # padding's zeros over pass 0's columns.
        passes = min(self.head_dim // self.o_cols, cute.size(gO, mode=[2]))
        for h in cutlass.range_constexpr(passes):
            if issuer:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=self.barrier_o_slot + wg, number_of_threads=WARPGROUP)
            rO_h = cute.make_tensor(rO.iterator + h * 4 * groups, pass_layout)
            cute.copy(smem_copy_O, smem_copy_O.retile(rO_h), tOsO)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=self.barrier_o_slot + wg, number_of_threads=WARPGROUP)
            if issuer:
                cute.copy(tma_atom_O, tOsO_tma, tOgO_tma[None, h])
                cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def store_partial(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mOPartial: cute.Tensor,
        mLSEPartial: cute.Tensor,
        thr_mma_pv: cute.ThrMma,
        tidx: Int32,
        m_block: Int32,
        head: Int32,
        batch: Int32,
        split: Int32,
        seqlen: SeqlenInfo,
        pack_gqa: cutlass.Constexpr[int] = 1,
    ):
        """Split-KV: this split's O (fp32, normalized within the split) and LSE straight from the
        registers to the workspace, mOPartial (splits, b, s_q, h, dv) and mLSEPartial (splits, b,
        h, s_q): rows inside the sequence and columns inside the data's dv (the kernel's may be
        padded). Each thread stores its accumulator's column pairs as 8-byte words. pack_gqa > 1:
        tile rows are packed (`row_of`), `head` the kv head."""
        cO = thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        acc_O_mn = cute.make_tensor(acc_O.iterator, acc_mn_layout(acc_O.layout))

        def lse_store(row, h, value):
            mLSEPartial[split, batch, h, row] = value

        self.store_rows(
            acc_O_mn, lse, cO, m_block, head, seqlen.seqlen_q * pack_gqa, mOPartial.shape[4], pack_gqa,
            lse_store, lambda row, h: mOPartial[split, batch, row, h, None],
        )  # fmt: skip

    @cute.jit
    def store_packed(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        thr_mma_pv: cute.ThrMma,
        m_block: Int32,
        head_kv: Int32,
        batch: Int32,
        seqlen: SeqlenInfo,
        pack_gqa: cutlass.Constexpr[int],
    ):
        """Pack-GQA: O (normalized, 16-bit) and LSE of the tile's packed rows straight from the
        registers to the plain (s, d, h, b) O and (s, h, b) LSE: row R is query R // G of q head
        head_kv * G + R % G; rows past the sequence and columns past the data's dv are skipped.
        Column pairs go out as 4-byte words (decode's O is small beside the K/V it reads)."""
        cO = thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim)))
        rO = cute.make_rmem_tensor(acc_O.layout, self.dtype)
        convert(acc_O, rO)
        rO_mn = cute.make_tensor(rO.iterator, acc_mn_layout(rO.layout))

        def lse_store(row, h, value):
            mLSE[row, h, batch] = value

        self.store_rows(
            rO_mn, lse, cO, m_block, head_kv, seqlen.seqlen_q * pack_gqa, mO.shape[1], pack_gqa,
            lse_store, lambda row, h: mO[row, None, h, batch],
        )  # fmt: skip

    @cute.jit
    def store_rows(
        self, values_mn, lse, cO, m_block: Int32, head: Int32, rows, dv, pack_gqa: cutlass.Constexpr[int],
        lse_store, o_row,
    ):  # fmt: skip
        """O from registers (values_mn: the accumulator's row/column view, fp32 or 16-bit) and LSE,
        row by row: tile rows below `rows` (`row_of` names their query row and q head), columns
        below dv, as words of a column pair; lse_store(row, head, value) and o_row(row, head) (the
        row's dv-vector of O) say where."""
        tOcO_mn = cute.make_tensor(cO.iterator, acc_mn_layout(cO.layout))
        if tOcO_mn[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                packed = m_block * self.tile_m + tOcO_mn[r, 0][0]
                if packed < rows:
                    row, h = self.row_of(packed, head, pack_gqa)
                    lse_store(row, h, lse[r])
        for r in cutlass.range_constexpr(cute.size(values_mn, mode=[0])):
            packed = m_block * self.tile_m + tOcO_mn[r, 0][0]
            if packed < rows:
                row, h = self.row_of(packed, head, pack_gqa)
                dst_row = o_row(row, h)
                for c in cutlass.range_constexpr(cute.size(values_mn, mode=[1]) // 2):
                    col = tOcO_mn[r, 2 * c][1]
                    if col < dv:
                        pair = cute.make_rmem_tensor((2,), values_mn.element_type)
                        pair[0] = values_mn[r, 2 * c]
                        pair[1] = values_mn[r, 2 * c + 1]
                        cute.autovec_copy(pair, cute.make_tensor(dst_row.iterator + col, cute.make_layout(2)))

    @cute.jit
    def row_of(self, packed: Int32, head: Int32, pack_gqa: cutlass.Constexpr[int]):
        """(query row, q head) of tile row `packed` (counted from the sequence's first): itself and
        `head` without pack-GQA; query packed // G of q head head * G + packed % G with it."""
        if const_expr(pack_gqa > 1):
            return packed // pack_gqa, head * pack_gqa + packed % pack_gqa
        return packed, head

    @cute.jit
    def o_rows(self, mO: cute.Tensor, head: Int32, batch: Int32, seqlen: SeqlenInfo) -> cute.Tensor:
        """The (s, d) rows of O's TMA tensor that hold this sequence's head `head`: dense, the
        batch's; varlen, a ragged view that ends where the sequence does (host: `ragged_rows`)."""
        if const_expr(seqlen.varlen):
            return seqlen.ragged_tile(mO, head)
        return mO[None, None, head, batch]

    @cute.jit
    def drain(self, tidx: Int32):
        """Before exit: the threads that issued O stores stay until the last one has read sO."""
        if const_expr(self.separate_o):
            if tidx // 32 == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        if const_expr(self.split_o):
            if tidx % WARPGROUP < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
