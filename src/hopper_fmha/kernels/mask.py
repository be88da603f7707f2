"""Which keys each query row sees: the key blocks a tile visits, which of them need an element
mask, and that mask.

Contract (`Mask`, built from tile_m, tile_n and the mask's kind; a window's sizes are bound at
run time with `with_window`):
    block_range(m_block, seqlen)  -> (n_max, n_unmasked): query tile m_block visits key blocks
                                     [0, n_max); blocks [n_unmasked, n_max) need `apply`
                                     (no left window).
    block_range_local(m_block, seqlen)
                                  -> (n_min, n_max, n_left_masked, n_unmasked): the tile visits
                                     [n_min, n_max); [n_min, n_left_masked) and [n_unmasked, n_max)
                                     need `apply`, [n_left_masked, n_unmasked) do not.
                                     n_max <= n_min: no row of the tile sees a key.
    apply(acc_S, tScS_mn, m_block, n_block, seqlen)
                                  -> S of block n_block set to -inf where a row does not see a key.
    causal_keys(row_end, n_block, seqlen)
                                  -> how many keys of block n_block, counted from its first, the
                                     row before row_end sees (causal_trim skips MMAs past it).
The kernels visit blocks from the last down, so the masked ones come first.

The sequence tail (keys past seqlen_k), causal, bottom-right aligned (row i sees key
j <= i + seqlen_k - seqlen_q, as FlashAttention does when seqlen_q != seqlen_k), and local
(sliding window) attention, FlashAttention's rule: with window (left, right), row i sees key j
iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right. One field of the
compile key, `window` ("", "left", "right", "both": which sides have a limit); the sizes are
runtime Int32 values. Causal is the right limit 0 (a window's right side and causal exclude each
other in the key). A left limit adds a first block n_min > 0 and a run of masked blocks at the
left end of the range ([n_min, n_left_masked)).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    # Sliding window: whether rows have a left / right limit (not causal's, which is right = 0),
    # and the sizes (runtime Int32, bound in the kernel by `with_window`).
    window_left: cutlass.Constexpr[bool] = False
    window_right: cutlass.Constexpr[bool] = False
    # Pack-GQA: tile rows are packed rows R of G q heads, query R // G (1: rows are queries).
    pack_gqa: cutlass.Constexpr[int] = 1
    left: Int32 = None
    right: Int32 = None

    def with_window(self, left: Int32, right: Int32) -> Mask:
        """This mask with the window's runtime sizes (None for a side without limit)."""
        return replace(self, left=left, right=right)

    @cute.jit
    def block_range(self, m_block: Int32, seqlen: SeqlenInfo):
        """(n_max, n_unmasked): the tile visits key blocks [0, n_max); [n_unmasked, n_max) need a mask.

        Causal is bottom-right aligned: row i sees key j <= i + seqlen_k - seqlen_q. n_max <= 0
        means no row of the tile sees a key.
        """
        seqlen_q, seqlen_k = seqlen.seqlen_q, seqlen.seqlen_k
        n_max = (seqlen_k + self.tile_n - 1) // self.tile_n
        n_unmasked = seqlen_k // self.tile_n
        if const_expr(self.causal or self.window_right):
            first_query, span = self.query_range(m_block)
            first_row_limit = first_query + seqlen_k - seqlen_q + 1  # keys < this: all rows see
            if const_expr(self.window_right):
                first_row_limit = first_row_limit + self.right
            last_row_limit = first_row_limit + self.tile_m - 1
            if const_expr(self.pack_gqa > 1):
                last_row_limit = first_row_limit + span
            n_max = cutlass.min(n_max, (cutlass.max(last_row_limit, 0) + self.tile_n - 1) // self.tile_n)
            n_unmasked = cutlass.min(n_unmasked, cutlass.max(first_row_limit, 0) // self.tile_n)
        n_unmasked = cutlass.min(n_unmasked, n_max)
        return n_max, n_unmasked

    @cute.jit
    def block_range_local(self, m_block: Int32, seqlen: SeqlenInfo):
        """(n_min, n_max, n_left_masked, n_unmasked): `block_range` with a left limit.

        The tile visits [n_min, n_max); blocks [n_min, n_left_masked) hold the left edge of some
        row's window and [n_unmasked, n_max) the right edge or the tail: both need `apply`.
        n_min <= n_left_masked <= n_unmasked <= n_max when n_max > n_min; n_max <= n_min: no
        row of the tile sees a key.
        """
        n_max, n_unmasked = self.block_range(m_block, seqlen)
        n_min = 0
        n_left_masked = 0
        if const_expr(self.window_left):
            # Row i sees keys j >= i + seqlen_k - seqlen_q - left: the tile's first row the fewest.
            first_query, span = self.query_range(m_block)
            first_row_min = first_query + seqlen.seqlen_k - seqlen.seqlen_q - self.left
            last_row_min = first_row_min + self.tile_m - 1  # keys >= this: every row sees
            if const_expr(self.pack_gqa > 1):
                last_row_min = first_row_min + span
            n_min = cutlass.max(first_row_min, 0) // self.tile_n
            n_left_masked = (cutlass.max(last_row_min, 0) + self.tile_n - 1) // self.tile_n
            n_unmasked = cutlass.max(n_unmasked, n_min)
            n_left_masked = cutlass.min(cutlass.max(n_left_masked, n_min), n_unmasked)
        return n_min, n_max, n_left_masked, n_unmasked

    def query_range(self, m_block: Int32):
        """(first query index of tile m_block's rows, last minus first: tile_m - 1 without pack).
        Plain Python (inlined where called): without pack the code is that of before."""
        first = m_block * self.tile_m
        if const_expr(self.pack_gqa > 1):
            first_query = first // self.pack_gqa
            return first_query, (first + self.tile_m - 1) // self.pack_gqa - first_query
        return first, self.tile_m - 1

    def query(self, m_block: Int32, r) -> Int32:
        """The query index of tile row r."""
        row = m_block * self.tile_m + r
        if const_expr(self.pack_gqa > 1):
            return row // self.pack_gqa
        return row

    @cute.jit
    def apply(
        self,
        acc_S: cute.Tensor,
        tScS_mn: cute.Tensor,
        m_block: Int32,
        n_block: Int32,
        seqlen: SeqlenInfo,
    ):
        """-inf outside the sequence (key tail), above the bottom-right causal diagonal or past
        the window's right limit, and before its left limit.

        tScS_mn: this thread's (row, column) coordinates in the tile, in acc_S's row/column view.
        """
        seqlen_q, seqlen_k = seqlen.seqlen_q, seqlen.seqlen_k
        acc_S_mn = cute.make_tensor(acc_S.iterator, acc_mn_layout(acc_S.layout))
        col_limit_seq = seqlen_k - n_block * self.tile_n
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            col_limit = col_limit_seq
            if const_expr(self.causal):
                row = self.query(m_block, tScS_mn[r, 0][0])
                col_limit = cutlass.min(col_limit, row + seqlen_k - seqlen_q + 1 - n_block * self.tile_n)
            if const_expr(self.window_right):
                row = self.query(m_block, tScS_mn[r, 0][0])
                col_limit = cutlass.min(
                    col_limit, row + seqlen_k - seqlen_q + 1 + self.right - n_block * self.tile_n
                )
            if const_expr(self.window_left):
                row = self.query(m_block, tScS_mn[r, 0][0])
                col_start = row + seqlen_k - seqlen_q - self.left - n_block * self.tile_n
                for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    col = tScS_mn[0, c][1]
                    if col >= col_limit or col < col_start:
                        acc_S_mn[r, c] = -Float32.inf
            else:
                for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    if tScS_mn[0, c][1] >= col_limit:
                        acc_S_mn[r, c] = -Float32.inf

    # ---- The backward's side: a CTA owns a key block and walks the query tiles that see it.

    @cute.jit
    def query_block_range(self, n_block: Int32, seqlen: SeqlenInfo):
        """(m_min, m_max): the query tiles [m_min, m_max) whose `block_range_local` holds key
        block n_block, the same (m, n) pairs seen from the key side (m_max <= m_min: none).

        From n_min(m) <= n < n_max(m) solved for m: a right limit R (causal: 0) bounds the tiles
        from below, m >= floor((n * tile_n - offset - R) / tile_m); a left limit L from above,
        m < ceil(((n + 1) * tile_n - offset + L) / tile_m) (offset = seqlen_k - seqlen_q).
        `emulate_bwd.query_block_range` is this rule in Python, tested against the forward's."""
        assert not self.pack_gqa > 1, "the backward's tiles hold one q head"
        offset = seqlen.seqlen_k - seqlen.seqlen_q
        n0 = n_block * self.tile_n
        m_min = Int32(0)
        m_max = (seqlen.seqlen_q + self.tile_m - 1) // self.tile_m
        if const_expr(self.causal or self.window_right):
            first_row = n0 - offset  # the first row that sees key n0 (causal)
            if const_expr(self.window_right):
                first_row = first_row - self.right
            m_min = cutlass.max(first_row, 0) // self.tile_m
        if const_expr(self.window_left):
            row_end = n0 + self.tile_n - offset + self.left  # rows below it may see a key of the block
            m_max = cutlass.min(m_max, (cutlass.max(row_end, 0) + self.tile_m - 1) // self.tile_m)
        return m_min, m_max

    @cute.jit
    def tile_needs_mask(self, m_block: Int32, n_block: Int32, seqlen: SeqlenInfo):
        """Whether some row of query tile m_block inside the sequence misses a key of block
        n_block (the backward masks only those tiles). Rows past seqlen_q are not counted: the
        backward takes their LSE as +inf (P = 0). Conservative: a true answer may be spared."""
        offset = seqlen.seqlen_k - seqlen.seqlen_q
        m0 = m_block * self.tile_m
        n0 = n_block * self.tile_n
        past = n0 + self.tile_n - seqlen.seqlen_k  # > 0: keys past the end
        if const_expr(self.causal or self.window_right):
            first_row_last_key = m0 + offset  # the tile's first row sees keys up to this one
            if const_expr(self.window_right):
                first_row_last_key = first_row_last_key + self.right
            past = cutlass.max(past, n0 + self.tile_n - 1 - first_row_last_key)
        if const_expr(self.window_left):
            last_row_first_key = m0 + self.tile_m - 1 + offset - self.left
            past = cutlass.max(past, last_row_first_key - n0)
        return past > 0

    @cute.jit
    def key_bounds(self, query: Int32, seqlen: SeqlenInfo):
        """(start, limit): query row `query` sees keys start <= j < limit (start 0 without a left
        limit; limit at most seqlen_k)."""
        offset = seqlen.seqlen_k - seqlen.seqlen_q
        start = Int32(0)
        limit = seqlen.seqlen_k
        if const_expr(self.causal):
            limit = cutlass.min(limit, query + offset + 1)
        if const_expr(self.window_right):
            limit = cutlass.min(limit, query + offset + 1 + self.right)
        if const_expr(self.window_left):
            start = query + offset - self.left
        return start, limit

    @cute.jit
    def causal_keys(self, row_end: Int32, n_block: Int32, seqlen: SeqlenInfo) -> Int32:
        """Keys of block n_block below this bound, counted from its first, are seen by row
        row_end - 1 (bottom-right causal); <= 0: none, >= tile_n: all."""
        return (row_end + seqlen.seqlen_k - seqlen.seqlen_q) - n_block * self.tile_n
