"""Which keys each query row sees: the key blocks a tile visits, which of them need an element
mask, and that mask.

Contract (`Mask`, built from tile_m, tile_n and the mask's kind):
    block_range(m_block, seqlen)  -> (n_max, n_unmasked): query tile m_block visits key blocks
                                     [0, n_max); blocks [n_unmasked, n_max) need `apply`.
    apply(acc_S, tScS_mn, m_block, n_block, seqlen)
                                  -> S of block n_block set to -inf where a row does not see a key.
    causal_keys(row_end, n_block, seqlen)
                                  -> how many keys of block n_block, counted from its first, the
                                     row before row_end sees (causal_trim skips MMAs past it).
The kernels visit blocks from the last down, so the masked ones come first.

Today: the sequence tail (keys past seqlen_k) and causal, bottom-right aligned (row i sees key
j <= i + seqlen_k - seqlen_q, as FlashAttention does when seqlen_q != seqlen_k).
To come: local (sliding window) attention, one field of the compile key: a window adds a first
block n_min > 0 and a run of masked blocks at the left end of the range ([n_min, n_unmasked_min)),
and a left limit per row in `apply`.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .seqlen import SeqlenInfo
from .sm90_common import acc_mn_layout


@dataclass(frozen=True)
class Mask:
    """The mask of a kernel with `tile_m` x `tile_n` tiles: the sequence tail, and causal if set."""

    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    causal: cutlass.Constexpr[bool]

    @cute.jit
    def block_range(self, m_block: Int32, seqlen: SeqlenInfo):
        """(n_max, n_unmasked): the tile visits key blocks [0, n_max); [n_unmasked, n_max) need a mask.

        Causal is bottom-right aligned: row i sees key j <= i + seqlen_k - seqlen_q. n_max <= 0
        means no row of the tile sees a key.
        """
        seqlen_q, seqlen_k = seqlen.seqlen_q, seqlen.seqlen_k
        n_max = (seqlen_k + self.tile_n - 1) // self.tile_n
        n_unmasked = seqlen_k // self.tile_n
        if const_expr(self.causal):
            first_row_limit = m_block * self.tile_m + seqlen_k - seqlen_q + 1  # keys < this: all rows see
            last_row_limit = first_row_limit + self.tile_m - 1
            n_max = cutlass.min(n_max, (cutlass.max(last_row_limit, 0) + self.tile_n - 1) // self.tile_n)
            n_unmasked = cutlass.min(n_unmasked, cutlass.max(first_row_limit, 0) // self.tile_n)
        n_unmasked = cutlass.min(n_unmasked, n_max)
        return n_max, n_unmasked

    @cute.jit
    def apply(
        self,
        acc_S: cute.Tensor,
        tScS_mn: cute.Tensor,
        m_block: Int32,
        n_block: Int32,
        seqlen: SeqlenInfo,
    ):
        """-inf outside the sequence (key tail) and above the bottom-right causal diagonal.

        tScS_mn: this thread's (row, column) coordinates in the tile, in acc_S's row/column view.
        """
        seqlen_q, seqlen_k = seqlen.seqlen_q, seqlen.seqlen_k
        acc_S_mn = cute.make_tensor(acc_S.iterator, acc_mn_layout(acc_S.layout))
        col_limit_seq = seqlen_k - n_block * self.tile_n
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            col_limit = col_limit_seq
            if const_expr(self.causal):
                row = m_block * self.tile_m + tScS_mn[r, 0][0]
                col_limit = cutlass.min(col_limit, row + seqlen_k - seqlen_q + 1 - n_block * self.tile_n)
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                if tScS_mn[0, c][1] >= col_limit:
                    acc_S_mn[r, c] = -Float32.inf

    @cute.jit
    def causal_keys(self, row_end: Int32, n_block: Int32, seqlen: SeqlenInfo) -> Int32:
        """Keys of block n_block below this bound, counted from its first, are seen by row
        row_end - 1 (bottom-right causal); <= 0: none, >= tile_n: all."""
        return (row_end + seqlen.seqlen_k - seqlen.seqlen_q) - n_block * self.tile_n
