"""The one FLOP formula of the project, and the conversions every report uses.

Attention forward counts two GEMMs (S = Q·Kᵀ and O = P·V) of 2·Nq·Nk·d FLOPs each per head:
4·B·H·Nq·Nk·d, halved for causal. This is the convention of the seed paper and of
FlashAttention (the causal halving ignores the diagonal, and for Nq ≠ Nk it is the
same simple half, so numbers stay comparable with the published ones).

Where v's head dim dv differs from q's and k's d (DeepSeek's d 192, dv 128), the two GEMMs count
2·Nq·Nk·d and 2·Nq·Nk·dv: 2·B·H·Nq·Nk·(d + dv), halved for causal the same way.

A sliding window (`window_size` = (left, right)) counts what it computes, not a fraction of the
square: 2·B·H·(d + dv) FLOPs per visible (query, key) pair, the pairs counted exactly by
`visible_pairs` (bottom-right aligned, as the kernels and `hopper_fmha.reference`). The causal
mask without a window keeps the simple half above (the published numbers' convention); its
exact count, N(N+1)/2 pairs for Nq = Nk = N, is larger by a fraction 1/N.

Training passes follow FlashAttention's convention too: the backward counts 2.5 times the
forward's FLOPs (its five GEMMs, S recomputed, dP, dV, dK and dQ, against the forward's two),
and the forward and backward together 3.5 times, the causal halving included in the forward's.
"""

from __future__ import annotations

import functools


def attention_flops(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    causal: bool = False,
    head_dim_v: int | None = None,
) -> float:
    """FLOPs of one attention forward (softmax and scaling are not counted): 4·B·H·Nq·Nk·d, or
    2·B·H·Nq·Nk·(d + dv) where v's head dim `head_dim_v` is given; halved for causal."""
    if head_dim_v is None:
        flops = 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim
    else:
        flops = 2.0 * batch * heads * seqlen_q * seqlen_k * (head_dim + head_dim_v)
    return flops / 2 if causal else flops


NO_WINDOW = (-1, -1)


def window_bounds(causal: bool, window_size: tuple[int, int] = NO_WINDOW) -> tuple[int, int]:
    """(left, right) of the keys a query row sees, -1 for a side without limit: causal is the
    window (-1, 0) and, given with a window, sets right = 0 and keeps left (the rule of
    `hopper_fmha.reference.resolve_window`, without its argument checks)."""
    left, right = window_size
    return int(left), 0 if causal else int(right)


@functools.lru_cache(maxsize=64)  # a problem's FLOPs are asked for once per backend
def visible_pairs(seqlen_q: int, seqlen_k: int, left: int = -1, right: int = -1) -> int:
    """The (query, key) pairs a bottom-right aligned window lets through: query row i (of
    seqlen_q) sees key j (of seqlen_k) iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k
    - seqlen_q + right, a side of -1 having no limit. Exact: one clamped span per row (O(seqlen_q))."""
    pairs = 0
    for i in range(seqlen_q):
        diagonal = i + seqlen_k - seqlen_q  # the key aligned with row i
        first = 0 if left < 0 else max(0, diagonal - left)
        last = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, diagonal + right)
        pairs += max(0, last - first + 1)
    return pairs


def window_flops(
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    head_dim: int,
    left: int,
    right: int,
    head_dim_v: int | None = None,
) -> float:
    """FLOPs of one attention forward under the window (left, right) (`window_bounds`): 2·(d + dv)
    per visible pair (`visible_pairs`), per batch element and head."""
    dv = head_dim if head_dim_v is None else head_dim_v
    return 2.0 * batch * heads * (head_dim + dv) * visible_pairs(seqlen_q, seqlen_k, left, right)


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
