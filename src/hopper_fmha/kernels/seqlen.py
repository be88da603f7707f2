"""Where a batch's sequence lies: its query rows in Q and O, its keys in K and V.

Contract: `SeqlenInfo.create(batch, ...)` gives, for one batch index, `offset_q` and `seqlen_q`
(the rows of Q and O that hold its queries start at offset_q) and `offset_k` and `seqlen_k`
(likewise for the keys of K and V). The other parts take lengths from here, never from tensor
shapes: the mask (the sequence tail, the causal diagonal), the loader (which rows to load)
and the epilogue (which rows of O and LSE to write).

Today: dense batches, (b, s, h, d) tensors, every sequence the whole of its batch's rows:
offsets 0, lengths the tensors' s.
To come, each one field of the compile key: varlen (`cu_seqlens_q/k`: packed (total, h, d)
tensors, offset = cu_seqlens[b], length = cu_seqlens[b + 1] - cu_seqlens[b]) and seqused
(`seqused_q/k`: only the first seqused[b] rows of a longer buffer, e.g. a KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass

from cutlass import Int32


@dataclass(frozen=True)
class SeqlenInfo:
    """offset_q, seqlen_q, offset_k, seqlen_k of one batch (Int32 values, or Python ints where
    they are known at compile time)."""

    offset_q: Int32
    seqlen_q: Int32
    offset_k: Int32
    seqlen_k: Int32

    @staticmethod
    def create(batch: Int32, seqlen_q_static: Int32, seqlen_k_static: Int32) -> SeqlenInfo:
        """Batch `batch`'s sequence; the static lengths are the tensors' s (dense: every batch's).

        Dense needs no reads and emits no code: the offsets are the constant 0.
        """
        return SeqlenInfo(0, seqlen_q_static, 0, seqlen_k_static)
