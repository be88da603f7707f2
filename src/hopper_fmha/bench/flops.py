"""The one FLOP formula of the project, and the conversions every report uses.

Attention forward counts two GEMMs (S = Q·Kᵀ and O = P·V) of 2·Nq·Nk·d FLOPs each per head:
4·B·H·Nq·Nk·d, halved for causal. This is the convention of the seed paper and of
FlashAttention (the causal halving ignores the diagonal, and for Nq ≠ Nk it is the
same simple half, so numbers stay comparable with the published ones).
"""

from __future__ import annotations


def attention_flops(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool = False
) -> float:
    """FLOPs of one attention forward (softmax and scaling are not counted)."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


def matmul_flops(m: int, n: int, k: int) -> float:
    """FLOPs of an (m x k) @ (k x n) matmul."""
    return 2.0 * m * n * k


def tflops(flops: float, ms: float | None) -> float | None:
    """TFLOP/s for `flops` done in `ms` milliseconds (None when there is no time)."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12
