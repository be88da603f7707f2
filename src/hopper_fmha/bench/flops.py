"""The one FLOP formula of the project, and the conversions every report uses.

Attention forward counts two GEMMs (S = Q·Kᵀ and O = P·V) of 2·Nq·Nk·d FLOPs each per head:
4·B·H·Nq·Nk·d, halved for causal. This is the convention of the seed paper and of
FlashAttention (the causal halving ignores the diagonal, and for Nq ≠ Nk it is the
same simple half, so numbers stay comparable with the published ones).

Training passes follow FlashAttention's convention too: the backward counts 2.5 times the
forward's FLOPs (its five GEMMs, S recomputed, dP, dV, dK and dQ, against the forward's two),
and the forward and backward together 3.5 times, the causal halving included in the forward's.
"""

from __future__ import annotations


def attention_flops(
    batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool = False
) -> float:
    """FLOPs of one attention forward (softmax and scaling are not counted)."""
    flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops / 2 if causal else flops


# The passes a problem can time: the forward alone, the backward alone (the forward run once
# beforehand, untimed), and the forward then the backward.
FWD, BWD, FWD_BWD = "fwd", "bwd", "fwd+bwd"
PASS_FLOPS = {FWD: 1.0, BWD: 2.5, FWD_BWD: 3.5}


def pass_flops(forward_flops: float, passes: str) -> float:
    """FLOPs of `passes` (FWD, BWD or FWD_BWD) of an attention whose forward counts
    `forward_flops` (module docstring); ValueError for another name."""
    if passes not in PASS_FLOPS:
        raise ValueError(f"passes must be one of {tuple(PASS_FLOPS)}, got {passes!r}")
    return PASS_FLOPS[passes] * forward_flops


def matmul_flops(m: int, n: int, k: int) -> float:
    """FLOPs of an (m x k) @ (k x n) matmul."""
    return 2.0 * m * n * k


def tflops(flops: float, ms: float | None) -> float | None:
    """TFLOP/s for `flops` done in `ms` milliseconds (None when there is no time)."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12
