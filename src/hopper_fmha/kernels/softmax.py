"""The online softmax of one consumer thread's rows: what happens to a score, and what joins the
denominator.

Contract (`Softmax`, one per consumer thread, its row statistics in registers):
    reset()                     before a tile: max -inf, sums 0.
    online_softmax(acc_S, is_first)
                                S -> P = exp2(S * scale_log2 - max * scale_log2) in place; the row
                                max and sums move on; returns (row_scale, rescale): O's factor per
                                row and whether any row of the warp has one (lazy rescaling).
    rescale_O(accs, row_scale, rescale), rescale_O_pending(accs, o_scale)
                                O (and the tensor-core row sums) *= that factor.
    finalize(acc_O, acc_sum)    O /= row sum; returns LSE per row ((max * scale_log2 + log2 sum) * ln 2).
The score scale is folded into the exponent (scale_log2 = softmax_scale * log2 e): one FFMA per
score. Lazy rescaling: the max the exponentials are taken against moves only when some row of the
warp has grown past it by more than RESCALE_THRESHOLD (log2 units), so P stays below
2^RESCALE_THRESHOLD and after the first blocks O's rescale is mostly a skipped branch.

Score features, each one field of the compile key:
- softcap (`softcap_scale` set): s = cap * tanh(softmax_scale * q.k / cap). `apply_softcap` turns
  S into tanh(S * softmax_scale / cap) (tanh.approx) before the mask and the row max; the kernel
  then sets scale_log2 = cap * log2 e, so the exponent and the LSE see s itself. Called before
  the mask, so masked entries (-inf) stay -inf (tanh(-inf) would be -1).
- learnable sink (`finalize`'s sink_log2: the head's sink logit * log2 e, in the units of s):
  joins every row's denominator, taken against max(row max, sink) so that neither overflows;
  the LSE includes it (lse = log(sum exp(s) + exp(sink))); a row with no key gets O = 0 and
  lse = sink.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .sm90_common import LN_2, acc_mn_layout, pinned_wait_group

# Lazy rescaling: the softmax max moves only when a row's max grows by more than this (log2 units).
RESCALE_THRESHOLD = 8.0


@dataclass(frozen=True)
class Softmax:
    """Row max and row sum of this thread's rows, and the scale (log2 units) of the scores.

    mma_rowsum: the row sums come from the tensor cores (a GEMM of P against ones, accumulated like
    O in `acc_sum`), so `online_softmax` adds nothing and `finalize` reads them there.
    A frozen dataclass: the DSL's loops pass it through unchanged (its tensors are registers).
    """

    scale_log2: Float32
    row_max: cute.Tensor
    row_sum: cute.Tensor
    mma_rowsum: cutlass.Constexpr[bool] = False
    # softcap: softmax_scale / cap (runtime), None when off (then scale_log2 = cap * log2 e).
    softcap_scale: Float32 = None

    @staticmethod
    def create(
        scale_log2: Float32, rows: int, mma_rowsum: bool = False, softcap_scale: Float32 = None
    ) -> Softmax:
        """Statistics of `rows` rows per thread (registers, set by `reset`)."""
        row_max = cute.make_rmem_tensor((rows,), Float32)
        row_sum = cute.make_rmem_tensor((rows,), Float32)
        return Softmax(scale_log2, row_max, row_sum, mma_rowsum, softcap_scale)

    @cute.jit
    def apply_softcap(self, acc_S: cute.Tensor):
        """softcap: S -> tanh(S * softmax_scale / cap) in place (before the mask: masked entries
        are set to -inf after it). Nothing without softcap."""
        if const_expr(self.softcap_scale is not None):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = cute.math.tanh(acc_S[i] * self.softcap_scale, approx=True)

    @cute.jit
    def reset(self):
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def online_softmax(
        self,
        acc_S: cute.Tensor,
        is_first: cutlass.Constexpr[bool],
        wait_pv_after: cutlass.Constexpr[int] = 0,
    ):
        """S -> exp2(S*scale - max*scale) in place; updates the row stats; returns O's row rescale
        and whether any row of this warp has one (None for the first block: nothing to rescale).

        Row maxima first, then S*scale - max for every element, then the exponentials, then the
        sums (not with mma_rowsum: the tensor cores sum P). row_sum stays a per-thread partial sum
        (the quad reduction happens once, in `finalize`). wait_pv_after > 0: wait for the
        warpgroup's GEMMs in flight (GEMM-II) after that many exponentials (`pinned_wait_group`).
        """
        row_max, row_sum, scale_log2 = self.row_max, self.row_sum, self.scale_log2
        acc_S_mn = cute.make_tensor(acc_S.iterator, acc_mn_layout(acc_S.layout))
        rows = cute.size(row_max)
        cols = cute.size(acc_S_mn, mode=[1])
        row_scale = cute.make_rmem_tensor(row_max.layout, Float32)
        max_scaled = cute.make_rmem_tensor(row_max.layout, Float32)
        m_seen = cute.make_rmem_tensor(row_max.layout, Float32)
        for r in cutlass.range_constexpr(rows):
            # Four independent max chains for ILP, then the quad (4 lanes own a row) reduction.
            part = [acc_S_mn[r, 0], acc_S_mn[r, 1], acc_S_mn[r, 2], acc_S_mn[r, 3]]
            for c in cutlass.range_constexpr(4, cols):
                part[c % 4] = cute.arch.fmax(part[c % 4], acc_S_mn[r, c])
            m_new = cute.arch.fmax(cute.arch.fmax(part[0], part[1]), cute.arch.fmax(part[2], part[3]))
            if const_expr(not is_first):
                m_new = cute.arch.fmax(m_new, row_max[r])
            m_new = cute.arch.fmax(m_new, cute.arch.shuffle_sync_bfly(m_new, offset=2))
            m_new = cute.arch.fmax(m_new, cute.arch.shuffle_sync_bfly(m_new, offset=1))
            if const_expr(is_first):
                max_scaled[r] = self.exp_base(m_new, scale_log2)
                row_scale[r] = Float32(1.0)
                row_max[r] = m_new
            else:
                m_seen[r] = m_new
        rescale = None
        if const_expr(not is_first):
            # Growth of the max, the largest over this thread's rows (-inf - -inf is NaN, which
            # fmax drops: a row with no key yet needs nothing; -inf -> finite is +inf: rescale).
            grow = m_seen[0] - row_max[0]
            for r in cutlass.range_constexpr(1, rows):
                grow = cute.arch.fmax(grow, m_seen[r] - row_max[r])
            rescale = cute.arch.vote_any_sync(grow * scale_log2 > RESCALE_THRESHOLD)
            row_scale.fill(1.0)
            if rescale:
                for r in cutlass.range_constexpr(rows):
                    row_scale[r] = cute.math.exp2(
                        row_max[r] * scale_log2 - self.exp_base(m_seen[r], scale_log2), fastmath=True
                    )
                    row_max[r] = m_seen[r]
            for r in cutlass.range_constexpr(rows):
                max_scaled[r] = self.exp_base(row_max[r], scale_log2)
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                acc_S_mn[r, c] = acc_S_mn[r, c] * scale_log2 - max_scaled[r]
        for i in cutlass.range_constexpr(rows * cols):
            acc_S_mn[i // cols, i % cols] = cute.math.exp2(acc_S_mn[i // cols, i % cols], fastmath=True)
            if const_expr(i + 1 == min(wait_pv_after, rows * cols)):
                pinned_wait_group(acc_S_mn[i // cols, i % cols])
        if const_expr(not self.mma_rowsum):
            for r in cutlass.range_constexpr(rows):
                sums = [Float32(0.0)] * 4
                for c in cutlass.range_constexpr(cols):
                    sums[c % 4] = sums[c % 4] + acc_S_mn[r, c]
                block_sum = (sums[0] + sums[1]) + (sums[2] + sums[3])
                if const_expr(is_first):
                    row_sum[r] = block_sum
                else:
                    row_sum[r] = row_sum[r] * row_scale[r] + block_sum
        return row_scale, rescale

    @cute.jit
    def exp_base(self, m: Float32, scale_log2: Float32) -> Float32:
        """m * scale_log2, or 0 for a row that has seen no key yet (max -inf)."""
        m_scaled = m * scale_log2
        if m == -Float32.inf:
            m_scaled = Float32(0.0)
        return m_scaled

    @cute.jit
    def rescale_O(self, accs: list, row_scale: cute.Tensor, rescale):
        """Each accumulator of `accs` (O, and the tensor-core row sums) *= row_scale by rows, if
        `rescale` (warp-uniform)."""
        if rescale:
            self.rescale_rows(accs, row_scale)

    @cute.jit
    def rescale_O_pending(self, accs: list, o_scale: cute.Tensor):
        """`rescale_O` by a factor an `online_softmax` left for later: all 1.0 when lazy
        rescaling skipped it, else below 2^-RESCALE_THRESHOLD on some row of the warp."""
        smallest = o_scale[0]
        for r in cutlass.range_constexpr(1, cute.size(o_scale)):
            smallest = cute.arch.fmin(smallest, o_scale[r])
        self.rescale_O(accs, o_scale, cute.arch.vote_any_sync(smallest < Float32(1.0)))

    @cute.jit
    def rescale_rows(self, accs: list, row_scale: cute.Tensor):
        for acc in accs:
            acc_mn = cute.make_tensor(acc.iterator, acc_mn_layout(acc.layout))
            for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
                for j in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    acc_mn[r, j] = acc_mn[r, j] * row_scale[r]

    @cute.jit
    def finalize(self, acc_O: cute.Tensor, acc_sum=None, sink_log2=None) -> cute.Tensor:
        """O /= rowsum; returns LSE = (m * scale * log2 e + log2 rowsum) * ln 2 per row.

        acc_sum (mma_rowsum): the tensor cores' row sums, every column holding its row's sum.
        sink_log2 (learnable sink): the head's sink logit * log2 e, or (pack-GQA, rows of several
        heads) a tensor of one per row; it joins the row sum and the LSE, both taken against
        max(m * scale_log2, sink_log2).
        """
        row_max, row_sum, scale_log2 = self.row_max, self.row_sum, self.scale_log2
        if const_expr(self.mma_rowsum):
            acc_sum_mn = cute.make_tensor(acc_sum.iterator, acc_mn_layout(acc_sum.layout))
            for r in cutlass.range_constexpr(cute.size(row_sum)):
                row_sum[r] = acc_sum_mn[r, 0]
        acc_O_mn = cute.make_tensor(acc_O.iterator, acc_mn_layout(acc_O.layout))
        lse = cute.make_rmem_tensor((cute.size(row_sum),), Float32)
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            total = row_sum[r]
            if const_expr(not self.mma_rowsum):  # partial sums of the row's four lanes
                total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
                total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            inv = Float32(0.0)
            if const_expr(sink_log2 is not None):
                # The sink joins the denominator; the reference is the larger of the row's max and
                # the sink. A row that saw no key: max -inf, O stays 0 and LSE is the sink.
                sink = sink_log2[r] if const_expr(isinstance(sink_log2, cute.Tensor)) else sink_log2
                m_scaled = row_max[r] * scale_log2
                m_ref = cute.arch.fmax(m_scaled, sink)
                row_factor = cute.math.exp2(m_scaled - m_ref, fastmath=True)
                total = total * row_factor + cute.math.exp2(sink - m_ref, fastmath=True)
                inv = row_factor * cute.arch.rcp_approx(total)
                lse[r] = (m_ref + cute.math.log2(total, fastmath=True)) * LN_2
            else:
                # A row that saw no key: O stays 0 and LSE is -inf.
                lse[r] = -Float32.inf
                if total > 0.0:
                    inv = cute.arch.rcp_approx(total)
                    lse[r] = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
            for c in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[1])):
                acc_O_mn[r, c] = acc_O_mn[r, c] * inv
        return lse
