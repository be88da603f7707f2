"""NumPy (fp64) emulation of FlashAttention-2 at tile level: the paper's Algorithm 2.

The kernel's arithmetic, one tile at a time, without the GPU: each Q tile of block_m rows keeps
an output accumulator O, a running row max m and a running row sum Σ while it walks the K/V
tiles of block_n rows (the online softmax). Tiles read past the end of the sequence are padded
with zeros, as TMA fills out-of-bounds elements, and the padded keys are masked to -inf. With
causal=True the walk stops at the last K/V tile with a key visible to the Q tile, as the kernel
does. Every (batch, head) pair is an independent CTA in the kernel; here NumPy broadcasts over
them. Comments "line n" refer to Algorithm 2, "FlashAttention-2 (FMHA)", in the paper
(Bikshandi & Shah, "A Case Study in CUDA Kernel Fusion: Implementing FlashAttention-2 on NVIDIA
Hopper Architecture using the CUTLASS Library").
"""

from __future__ import annotations

import math

import numpy as np

from hopper_fmha.config import default_softmax_scale


def _as_f64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _pad_rows(x: np.ndarray, start: int, size: int) -> np.ndarray:
    """Rows [start, start + size) of x along axis -2, zero-filled past the end (TMA OOB fill)."""
    tile = x[..., start : start + size, :]
    missing = size - tile.shape[-2]
    if missing:
        pad = [(0, 0)] * (x.ndim - 2) + [(0, missing), (0, 0)]
        tile = np.pad(tile, pad)
    return tile


def causal_kv_tiles(m_start: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int) -> int:
    """Number of K/V tiles the Q tile starting at row m_start must visit under the causal mask.

    The last row of the tile sees keys up to (m_start + block_m - 1) + seqlen_k - seqlen_q; the
    tiles after the one holding that key are fully masked and skipped.
    """
    visible = m_start + block_m + seqlen_k - seqlen_q
    return max(0, min(math.ceil(seqlen_k / block_n), math.ceil(visible / block_n)))


def emulate(q, k, v, softmax_scale=None, causal=False, block_m=128, block_n=128):
    """Attention by Algorithm 2. q: (B, Sq, H, D); k, v: (B, Sk, Hkv, D), NumPy or torch.

    Returns (out, lse) as fp64 NumPy arrays of shapes (B, Sq, H, D) and (B, H, Sq); rows that
    see no key give out = 0 and lse = -inf.
    """
    q, k, v = _as_f64(q), _as_f64(k), _as_f64(v)
    batch, seqlen_q, heads, head_dim = q.shape
    _, seqlen_k, kv_heads, _ = k.shape
    group = heads // kv_heads
    scale = default_softmax_scale(head_dim) if softmax_scale is None else float(softmax_scale)

    # Heads-major: (B, Hkv, group, S, D) for Q, (B, Hkv, 1, S, D) for K and V (GQA shares them).
    q = q.transpose(0, 2, 1, 3).reshape(batch, kv_heads, group, seqlen_q, head_dim)
    k = k.transpose(0, 2, 1, 3)[:, :, None]
    v = v.transpose(0, 2, 1, 3)[:, :, None]
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:-1], -np.inf)
    n_tiles_k = math.ceil(seqlen_k / block_n)

    for m_start in range(0, seqlen_q, block_m):  # line 1: for each tile of Q
        q_i = _pad_rows(q, m_start, block_m)  # line 2: load Q_i
        o_i = np.zeros(q_i.shape)  # line 3: O_i = 0
        m_i = np.full(q_i.shape[:-1], -np.inf)  # line 4: m_i = -inf, Σ_i = 0
        sum_i = np.zeros(q_i.shape[:-1])
        rows = m_start + np.arange(block_m)
        n_tiles = causal_kv_tiles(m_start, block_m, block_n, seqlen_q, seqlen_k) if causal else n_tiles_k
        for j in range(n_tiles):  # line 5: for each tile of K (that has a visible key)
            n_start = j * block_n
            k_j = _pad_rows(k, n_start, block_n)  # line 6: load K_j
            s_ij = scale * (q_i @ np.swapaxes(k_j, -1, -2))  # line 7: S_ij = scale Q_i K_j^T
            cols = n_start + np.arange(block_n)
            hidden = cols[None, :] >= seqlen_k  # padded keys past the sequence end
            if causal:
                hidden = hidden | (cols[None, :] > rows[:, None] + seqlen_k - seqlen_q)
            s_ij = np.where(hidden, -np.inf, s_ij)
            m_old = m_i  # line 8: rowmax update, keeping m_old and m_new
            m_i = np.maximum(m_old, s_ij.max(axis=-1))
            # A row with no visible key so far has m_new = -inf: shift it by 0, so that P and the
            # rescale factor are exp(-inf) = 0 instead of exp(-inf - (-inf)) = nan.
            m_shift = np.where(np.isneginf(m_i), 0.0, m_i)
            p_ij = np.exp(s_ij - m_shift[..., None])  # line 9: P_ij = exp(S_ij - m_new)
            rescale = np.exp(m_old - m_shift)  # exp(m_old - m_new)
            sum_i = rescale * sum_i + p_ij.sum(axis=-1)  # line 10: Σ_i update
            v_j = _pad_rows(v, n_start, block_n)  # line 11: load V_j
            o_i = rescale[..., None] * o_i + p_ij @ v_j  # line 12: O_i = rescale O_i + P_ij V_j
        stop = min(m_start + block_m, seqlen_q)
        empty = sum_i == 0  # rows that saw no key: out = 0, lse = -inf
        o_i = o_i / np.where(empty, 1.0, sum_i)[..., None]  # line 14: O_i = O_i / Σ_i
        out[..., m_start:stop, :] = o_i[..., : stop - m_start, :]  # line 15: write O_i
        with np.errstate(divide="ignore"):
            lse_i = np.where(empty, -np.inf, m_i + np.log(sum_i))
        lse[..., m_start:stop] = lse_i[..., : stop - m_start]

    out = out.reshape(batch, heads, seqlen_q, head_dim).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(out), lse.reshape(batch, heads, seqlen_q)
