"""How Q, K and V arrive in shared memory: the producer warp's loads.

Contract (`TmaLoader`, built from the tile shape and `cluster_m`):
    host:      make_atoms(mQ, mK, mV, sQ_layout, sKV_stage_layout) -> the TMA atoms and tensors.
    producer:  create(atoms, tensors, smem buffers) once; per tile, partition(m_block, head,
               head_kv, batch, seqlen) -> that tile's views; then load_q(views, mbar) and
               load_k/load_v(views, pipe, state, n_block) -> the next pipeline state, each load
               into the pipeline's next free stage with its barrier armed for the bytes.
Today: TMA from dense (s, d, h, b) tensors; with CTA pairs (cluster_m = 2) each CTA loads half of
every K/V block and multicasts it into both CTAs of the pair.
Varlen: the batch's rows start at `seqlen.offset_q/offset_k` of packed tensors (`SeqlenInfo.rows`).
Paged K/V (`paged` = pages per key block): (num_pages, page_size, h_kv, d) caches seen as
(page_size, d, h_kv, num_pages). paged = 1: each key block is one TMA from the page the page table
names, tile_n a divisor of page_size. paged = n > 1 (small pages, page_size = tile_n / n): a key
block is n whole pages, n TMAs of page_size rows into consecutive rows of one stage, armed on the
stage's one barrier; pages past the sequence's last repeat its last page (their keys are masked).
The host picks the tile (`config.paged_tile_n`). No CTA pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync

from .seqlen import SeqlenInfo
from .sm90_common import tma_load


@dataclass(frozen=True)
class TmaLoader:
    """Loads of tile_m x head_dim Q tiles, tile_n x head_dim K blocks and tile_n x head_dim_v V
    blocks, by TMA (columns past the data's head dims arrive as zeros). `create`
    adds the producer's atoms, tensors and buffers. A frozen dataclass: the DSL's loops pass it
    through unchanged."""

    dtype: cutlass.Constexpr[type]
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    head_dim: cutlass.Constexpr[int]
    head_dim_v: cutlass.Constexpr[int]
    cluster_m: cutlass.Constexpr[int] = 1
    # Paged K/V: mK, mV are (page_size, d, h_kv, num_pages). paged = 1: a sequence's key block n
    # lies in page page_table[batch, n * tile_n // page_size] (one TMA per block); paged = p > 1:
    # in pages page_table[batch, n * p + i], i < p, of tile_n / p rows each (0: not paged).
    paged: cutlass.Constexpr[int] = 0
    page_table: cute.Tensor = None
    tma_atom_Q: cute.CopyAtom = None
    mQ: cute.Tensor = None
    sQ: cute.Tensor = None
    tma_atom_K: cute.CopyAtom = None
    mK: cute.Tensor = None
    sK: cute.Tensor = None
    tma_atom_V: cute.CopyAtom = None
    mV: cute.Tensor = None
    sV: cute.Tensor = None
    rank: Int32 = None

    # ---------------------------------------------------------------- host side
    def make_atoms(
        self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, sQ_layout, sK_stage_layout, sV_stage_layout
    ):
        """TMA atoms and tensors of Q (one tile per load) and K, V (one block, multicast over the
        cluster when cluster_m > 1), from (s, d, h, b) tensors."""
        tma_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(tma_op, mQ, sQ_layout, (self.tile_m, self.head_dim))
        tma_op_kv = tma_op
        if const_expr(self.cluster_m > 1):
            tma_op_kv = cpasync.CopyBulkTensorTileG2SMulticastOp()
        rows = self.tile_n
        if const_expr(self.paged > 1):  # one page per TMA, into the first rows of a stage
            rows = self.tile_n // self.paged
            sK_stage_layout = self.first_rows(sK_stage_layout, rows, self.head_dim)
            sV_stage_layout = self.first_rows(sV_stage_layout, rows, self.head_dim_v)
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            tma_op_kv, mK, sK_stage_layout, (rows, self.head_dim), num_multicast=self.cluster_m
        )
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            tma_op_kv, mV, sV_stage_layout, (rows, self.head_dim_v), num_multicast=self.cluster_m
        )
        return tma_atom_Q, tma_Q, tma_atom_K, tma_K, tma_atom_V, tma_V

    def first_rows(self, stage_layout, rows: int, cols: int):
        """The (rows, cols) part of a (tile_n, cols) stage layout at its first row: where page i
        of a block lands, shifted by i * rows rows (a whole number of swizzle atoms: rows is a
        multiple of 16)."""
        return cute.composition(stage_layout, cute.make_layout((rows, cols), stride=(1, self.tile_n)))

    # ---------------------------------------------------------------- device side
    def create(
        self,
        tma_atom_Q: cute.CopyAtom,
        mQ: cute.Tensor,
        sQ: cute.Tensor,
        tma_atom_K: cute.CopyAtom,
        mK: cute.Tensor,
        sK: cute.Tensor,
        tma_atom_V: cute.CopyAtom,
        mV: cute.Tensor,
        sV: cute.Tensor,
        page_table: cute.Tensor = None,
    ) -> TmaLoader:
        """The producer's loader: the TMA atoms and tensors, the smem buffers (K and V with a
        stage mode), and this CTA's rank in its cluster."""
        return replace(
            self,
            tma_atom_Q=tma_atom_Q,
            mQ=mQ,
            sQ=sQ,
            tma_atom_K=tma_atom_K,
            mK=mK,
            sK=sK,
            tma_atom_V=tma_atom_V,
            mV=mV,
            sV=sV,
            rank=cute.arch.block_idx_in_cluster(),
            page_table=page_table,
        )

    @cute.jit
    def partition(self, m_block: Int32, head: Int32, head_kv: Int32, batch: Int32, seqlen: SeqlenInfo):
        """One tile's views: its Q tile, its head's K and V blocks (indexed by key block) and
        the smem buffers, as the TMA copies take them. seqlen: where the batch's sequence is
        (dense: the whole of the batch's rows; varlen: packed rows from its offsets on, loads
        past its end masked or dropped by the consumers)."""
        sQ, sK, sV = self.sQ, self.sK, self.sV
        mQ = seqlen.rows(self.mQ, head, batch, seqlen.offset_q)
        mK = seqlen.rows(self.mK, head_kv, batch, seqlen.offset_k)
        mV = seqlen.rows(self.mV, head_kv, batch, seqlen.offset_k)
        gQ = cute.local_tile(mQ, (self.tile_m, self.head_dim), (m_block, 0))
        gK = cute.local_tile(mK, (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(mV, (self.tile_n, self.head_dim_v), (None, 0))
        tQsQ, tQgQ = cpasync.tma_partition(
            self.tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        # With a cluster, this CTA's share of each K/V block (1/cluster_m of it).
        kv_layout = cute.make_layout(self.cluster_m)
        tKsK, tKgK = cpasync.tma_partition(
            self.tma_atom_K, self.rank, kv_layout, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            self.tma_atom_V, self.rank, kv_layout, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        return SimpleNamespace(
            tQsQ=tQsQ, tQgQ=tQgQ, tKsK=tKsK, tKgK=tKgK, tVsV=tVsV, tVgV=tVgV, head_kv=head_kv, batch=batch,
            seqlen_k=seqlen.seqlen_k,
        )  # fmt: skip

    @cute.jit
    def load_q(self, views: SimpleNamespace, mbar_Q: cute.Pointer):
        """The tile's Q into Q's buffer (whole warp), `mbar_Q` armed for its bytes."""
        tma_load(
            self.tma_atom_Q, views.tQgQ, views.tQsQ, mbar_Q, cute.size_in_bytes(self.dtype, self.sQ.layout)
        )

    @cute.jit
    def load_k(
        self,
        views: SimpleNamespace,
        pipe: pipeline.PipelineAsync,
        state: pipeline.PipelineState,
        n_block: Int32,
    ):
        """K of block n_block into the pipeline's next stage; returns the advanced state."""
        if const_expr(self.paged):
            return self.load_block_paged(
                pipe, state, self.tma_atom_K, self.mK, self.sK, self.head_dim, views, n_block
            )
        return self.load_block(pipe, state, self.tma_atom_K, views.tKgK, views.tKsK, n_block)

    @cute.jit
    def load_v(
        self,
        views: SimpleNamespace,
        pipe: pipeline.PipelineAsync,
        state: pipeline.PipelineState,
        n_block: Int32,
    ):
        """V of block n_block into the pipeline's next stage; returns the advanced state."""
        if const_expr(self.paged):
            return self.load_block_paged(
                pipe, state, self.tma_atom_V, self.mV, self.sV, self.head_dim_v, views, n_block
            )
        return self.load_block(pipe, state, self.tma_atom_V, views.tVgV, views.tVsV, n_block)

    @cute.jit
    def load_block_paged(
        self,
        pipe: pipeline.PipelineAsync,
        state: pipeline.PipelineState,
        tma_atom: cute.CopyAtom,
        mX: cute.Tensor,
        sX: cute.Tensor,
        cols: cutlass.Constexpr[int],
        views: SimpleNamespace,
        n_block: Int32,
    ):
        """Paged: block n_block of the sequence from its page (the page table's entry for the
        block's first key) at the block's offset in the page; one TMA, as `load_block`. Several
        pages per block: one TMA per page (`load_pages`)."""
        if const_expr(self.paged > 1):
            return self.load_pages(pipe, state, tma_atom, mX, sX, cols, views, n_block)
        page_size = mX.shape[0]
        first_key = n_block * self.tile_n
        page = self.page_table[views.batch, first_key // page_size]
        gX = cute.local_tile(
            mX[None, None, views.head_kv, page],
            (self.tile_n, cols),
            ((first_key % page_size) // self.tile_n, 0),
        )
        tXsX, tXgX = cpasync.tma_partition(
            tma_atom, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
        )
        pipe.producer_acquire(state)
        cute.copy(tma_atom, tXgX, tXsX[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state))
        state.advance()
        return state

    @cute.jit
    def load_pages(
        self,
        pipe: pipeline.PipelineAsync,
        state: pipeline.PipelineState,
        tma_atom: cute.CopyAtom,
        mX: cute.Tensor,
        sX: cute.Tensor,
        cols: cutlass.Constexpr[int],
        views: SimpleNamespace,
        n_block: Int32,
    ):
        """Block n_block as `paged` whole pages: page i of it (the table's entry n_block * paged
        + i, or the sequence's last page past its end) into rows [i * rows, (i + 1) * rows) of
        the stage, every TMA on the stage's barrier (armed for the whole stage)."""
        rows = self.tile_n // self.paged
        last_page = cutlass.max(views.seqlen_k - 1, 0) // rows
        pipe.producer_acquire(state)
        sX_stage = sX[None, None, state.index]
        # A loop, not unrolled: the producer warp has few registers (unrolled, it spilled).
        for i in cutlass.range(self.paged, unroll=1):
            page = self.page_table[views.batch, cutlass.min(n_block * self.paged + i, last_page)]
            gX = cute.local_tile(mX[None, None, views.head_kv, page], (rows, cols), (0, 0))
            sX_page = cute.local_tile(sX_stage, (rows, cols), (i, 0))
            tXsX, tXgX = cpasync.tma_partition(
                tma_atom, 0, cute.make_layout(1), cute.group_modes(sX_page, 0, 2), cute.group_modes(gX, 0, 2)
            )
            cute.copy(tma_atom, tXgX, tXsX, tma_bar_ptr=pipe.producer_get_barrier(state))
        state.advance()
        return state

    @cute.jit
    def load_block(
        self,
        pipe: pipeline.PipelineAsync,
        state: pipeline.PipelineState,
        tma_atom: cute.CopyAtom,
        tXgX: cute.Tensor,
        tXsX: cute.Tensor,
        n_block: Int32,
    ):
        """Wait for a free stage, arm its barrier with the byte count, issue the TMA (whole warp)."""
        pipe.producer_acquire(state)
        # With a cluster: into the same stage of every CTA of it; each one's barrier counts the bytes.
        mcast = {"mcast_mask": cutlass.Int16((1 << self.cluster_m) - 1)} if self.cluster_m > 1 else {}
        cute.copy(
            tma_atom,
            tXgX[None, n_block],
            tXsX[None, state.index],
            tma_bar_ptr=pipe.producer_get_barrier(state),
            **mcast,
        )
        state.advance()
        return state
