"""Where a batch's sequence lies: its query rows in Q and O, its keys in K and V.

Contract: `SeqlenInfo.create(batch, ...)` gives, for one batch index, `offset_q` and `seqlen_q`
(the rows of Q and O that hold its queries start at offset_q) and `offset_k` and `seqlen_k`
(likewise for the keys of K and V). The other parts take lengths from here, never from tensor
shapes: the mask (the sequence tail, the causal diagonal), the scheduler (tiles past a sequence's
end are skipped), the loader (which rows to load) and the epilogue (which rows of O and LSE to
write). `rows(mX, head, batch, offset)` is a head's (s, d) view of a sequence's rows.

Two layouts, one compile-key field (`varlen`):
    dense   (b, s, h, d) tensors, every sequence the whole of its batch's rows: offsets 0,
            lengths the tensors' s. Needs no reads and emits no code.
    varlen  packed (total, h, d) tensors, seen by the kernel as (total, d, h, 1): sequence b is
            rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1.
A second field, `seqused_k`: only the first seqused_k[b] of a sequence's keys count (a KV cache's
filled rows, dense or varlen).
Loads may run past a sequence's end (into the next sequence, or zeros past the tensor): the mask
hides those keys and the epilogue drops those rows. Stores may not: O's TMA store takes a ragged
view (`ragged_rows` on the host, `ragged_tile` per tile) whose bound is the sequence's end.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

# The ragged view's row extent and its extra mode's (the TMA's coordinates are int32).
RAGGED_ROWS = 2**30
RAGGED_END = 2**31 - 1


@dataclass(frozen=True)
class SeqlenInfo:
    """offset_q, seqlen_q, offset_k, seqlen_k of one batch (Int32 values, or Python ints where
    they are known at compile time), and whether the tensors are packed (varlen)."""

    offset_q: Int32
    seqlen_q: Int32
    offset_k: Int32
    seqlen_k: Int32
    varlen: cutlass.Constexpr[bool] = False

    @staticmethod
    @cute.jit
    def create(
        batch: Int32,
        seqlen_q_static: Int32,
        seqlen_k_static: Int32,
        cu_seqlens_q: cute.Tensor | None = None,
        cu_seqlens_k: cute.Tensor | None = None,
        seqused_k: cute.Tensor | None = None,
    ) -> SeqlenInfo:
        """Batch `batch`'s sequence. The static lengths are the tensors' rows: dense, every
        sequence's length; varlen, the packed totals. Varlen: offsets and lengths from
        cu_seqlens_q/k (int32, batch + 1 each) and, where given, the keys used from seqused_k
        (int32, batch).

        The host checks the offsets (`varlen_args`), except under CUDA graph capture; so that
        bad ones cannot write out of bounds even then, a sequence's query rows are cut at the
        packed total, and a negative offset makes it empty (loads are bounded by TMA anyway)."""
        if const_expr(cu_seqlens_q is None):
            if const_expr(seqused_k is not None):
                # A dense KV cache: the first seqused_k[batch] of its rows hold keys.
                return SeqlenInfo(0, seqlen_q_static, 0, cutlass.min(seqused_k[batch], seqlen_k_static))
            return SeqlenInfo(0, seqlen_q_static, 0, seqlen_k_static)
        offset_q = cu_seqlens_q[batch]
        offset_k = cu_seqlens_k[batch]
        seqlen_q = cutlass.min(cu_seqlens_q[batch + 1], seqlen_q_static) - offset_q
        if offset_q < 0:
            seqlen_q = Int32(0)
        if const_expr(seqused_k is not None):
            seqlen_k = seqused_k[batch]
        else:
            seqlen_k = cu_seqlens_k[batch + 1] - offset_k
        return SeqlenInfo(offset_q, seqlen_q, offset_k, seqlen_k, True)

    @cute.jit
    def rows(self, mX: cute.Tensor, head: Int32, batch: Int32, offset: Int32) -> cute.Tensor:
        """Head `head`'s (s, d) view of the sequence whose rows start at `offset` (offset_q or
        offset_k), from an (s, d, h, b) tensor: dense, batch `batch`'s; varlen, the packed rows
        from `offset` on (its batch mode has one entry)."""
        if const_expr(not self.varlen):
            return mX[None, None, head, batch]
        return cute.domain_offset((offset, 0), mX[None, None, head, 0])

    @cute.jit
    def ragged_tile(self, mX_ragged: cute.Tensor, head: Int32) -> cute.Tensor:
        """Head `head`'s (s, d) view of this sequence's query rows in a `ragged_rows` tensor:
        coordinates past seqlen_q are out of bounds, so a TMA store clips there."""
        end = self.offset_q + self.seqlen_q
        return cute.domain_offset((RAGGED_ROWS - self.seqlen_q, 0), mX_ragged[None, None, head, end])


def ragged_rows(mX: cute.Tensor) -> cute.Tensor:
    """Host side: a packed (total, d, h, 1) tensor as (RAGGED_ROWS, d, h, RAGGED_END) whose
    element (r, c, h, e) is the packed element (e - RAGGED_ROWS + r, c, h): with e = a sequence's
    end and r counted from RAGGED_ROWS - its length (`SeqlenInfo.ragged_tile`), row r of the
    sequence is packed row offset + r, and the row bound RAGGED_ROWS is the sequence's end.
    (The idea of FlashAttention-4's ragged TMA tensors: a TMA box clips at a tensor's bounds, so
    the bound is moved to where each sequence stops.)"""
    row_stride = mX.stride[0]
    base = cute.domain_offset((-RAGGED_ROWS, 0, 0, 0), mX).iterator
    shape = (RAGGED_ROWS, mX.shape[1], mX.shape[2], RAGGED_END)
    stride = (row_stride, mX.stride[1], mX.stride[2], row_stride)
    return cute.make_tensor(base, cute.make_layout(shape, stride=stride))


def packed_view(mX: cute.Tensor) -> cute.Tensor:
    """Host side: a packed (total, h, d) tensor as (total, d, h, 1), the kernels' (s, d, h, b)
    order with one batch entry."""
    return cute.make_tensor(
        mX.iterator, cute.append(cute.select(mX.layout, mode=[0, 2, 1]), cute.make_layout(1, stride=0))
    )
