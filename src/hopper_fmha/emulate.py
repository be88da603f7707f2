"""NumPy (fp64) emulation of FlashAttention-2 at tile level: the paper's Algorithm 2.

The kernel's arithmetic, one tile at a time, without the GPU: each Q tile of block_m rows keeps
an output accumulator O, a running row max m and a running row sum Σ while it walks the K/V
tiles of block_n rows (the online softmax). Tiles read past the end of the sequence are padded
with zeros, as TMA fills out-of-bounds elements, and the padded keys are masked to -inf. Every
(batch, head) pair is an independent CTA in the kernel; here NumPy broadcasts over them. Comments
"line n" refer to Algorithm 2, "FlashAttention-2 (FMHA)", in the paper (Bikshandi & Shah, "A Case
Study in CUDA Kernel Fusion: Implementing FlashAttention-2 on NVIDIA Hopper Architecture using the
CUTLASS Library").

The forward features beyond the paper follow FlashAttention-4 (flash_attn/cute), with the
semantics of `hopper_fmha.reference` (its docstring):

- The mask (causal, window (left, right)) is a per-tile rule, as in FA4's BlockInfo: a Q tile visits
  only the K/V tiles [n_block_min, n_block_max) that can hold a visible key (`block_range`), and
  only tiles that cut the window or hold padded keys get the element mask (`needs_mask`,
  `tile_mask`). FA4 walks the range from the last tile down; the order only reorders sums.
- softcap is applied to the scaled scores of each tile, before the mask (FA4's softcap score_mod).
- The learnable sink joins at the end, as in FA4's `Softmax.finalize`: the walk keeps m and Σ over
  the scores only, then Σ += exp(sink - m) (with m = sink for a row that saw no key), and
  lse = m + log Σ includes the sink.
- v's head dim may differ from q's and k's: O has v's columns.
- `emulate_varlen` runs the packed varlen layout one sequence at a time, each with its own tile grid.
"""

from __future__ import annotations

import numpy as np

from hopper_fmha.config import default_softmax_scale
from hopper_fmha.reference import check_softcap, resolve_window, varlen_sequences


def _as_f64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pad_rows(x: np.ndarray, start: int, size: int) -> np.ndarray:
    """Rows [start, start + size) of x along axis -2, zero-filled past the end (TMA OOB fill)."""
    tile = x[..., start : start + size, :]
    missing = size - tile.shape[-2]
    if missing:
        pad = [(0, 0)] * (x.ndim - 2) + [(0, missing), (0, 0)]
        tile = np.pad(tile, pad)
    return tile


def block_range(
    m_start: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, left: int = -1, right: int = -1
) -> tuple[int, int]:
    """[n_block_min, n_block_max): the K/V tiles the Q tile of rows [m_start, m_start + block_m) visits.

    Row i sees keys i + seqlen_k - seqlen_q - left ..= i + seqlen_k - seqlen_q + right (-1: no limit).
    With a right limit the tile's last row bounds the walk from above, with a left limit its first
    row bounds it from below (FA4's BlockInfo.get_n_block_min_max); the tiles outside hold no key
    any row of the tile sees. An empty range means no key at all: out 0, lse -inf (or the sink).
    """
    offset = seqlen_k - seqlen_q
    n_block_max = _ceil_div(seqlen_k, block_n)
    if right >= 0:
        n_block_max = min(n_block_max, _ceil_div(m_start + block_m + offset + right, block_n))
    n_block_min = max(0, (m_start + offset - left) // block_n) if left >= 0 else 0
    return n_block_min, max(n_block_min, n_block_max)


def causal_kv_tiles(m_start: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int) -> int:
    """Number of K/V tiles the Q tile starting at row m_start visits under the causal mask (from tile 0)."""
    return block_range(m_start, block_m, block_n, seqlen_q, seqlen_k, -1, 0)[1]


def needs_mask(
    m_start: int,
    n_start: int,
    block_m: int,
    block_n: int,
    seqlen_q: int,
    seqlen_k: int,
    left: int = -1,
    right: int = -1,
) -> bool:
    """Whether the (Q tile, K/V tile) pair needs the element mask: some key of it is hidden from some row.

    Three causes: keys past seqlen_k (the tail tile); the tile's last key beyond the first row's right
    limit (the diagonal tiles of causal and of a right window); the tile's first key before the last
    row's left limit (the tiles on a left window's edge). Other tiles are computed unmasked. FA4
    applies the same rule, one key more conservatively on the window edges.
    """
    offset = seqlen_k - seqlen_q
    if n_start + block_n > seqlen_k:
        return True
    if right >= 0 and n_start + block_n - 1 > m_start + offset + right:
        return True
    return left >= 0 and n_start < m_start + block_m - 1 + offset - left


def tile_mask(
    m_start: int,
    n_start: int,
    block_m: int,
    block_n: int,
    seqlen_q: int,
    seqlen_k: int,
    left: int = -1,
    right: int = -1,
) -> np.ndarray:
    """(block_m, block_n) bool: True where row m_start + r can't see key n_start + c or the key is padding."""
    rows = m_start + np.arange(block_m)[:, None]
    cols = n_start + np.arange(block_n)[None, :]
    diagonal = rows + seqlen_k - seqlen_q
    hidden = np.broadcast_to(cols >= seqlen_k, (block_m, block_n))  # padded keys past the sequence end
    if right >= 0:
        hidden = hidden | (cols > diagonal + right)
    if left >= 0:
        hidden = hidden | (cols < diagonal - left)
    return hidden


def emulate(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    block_m=128,
    block_n=128,
    *,
    window_size=(-1, -1),
    softcap=0.0,
    learnable_sink=None,
):
    """Attention by Algorithm 2. q: (B, Sq, H, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv), NumPy or torch.

    learnable_sink: (H,) or None. Returns (out, lse) as fp64 NumPy arrays of shapes (B, Sq, H, Dv)
    and (B, H, Sq); rows that see no key give out = 0 and lse = -inf (lse = sink with a sink).
    """
    left, right = resolve_window(causal, window_size)
    softcap = check_softcap(softcap)
    q, k, v = _as_f64(q), _as_f64(k), _as_f64(v)
    batch, seqlen_q, heads, head_dim = q.shape
    _, seqlen_k, kv_heads, _ = k.shape
    head_dim_v = v.shape[-1]
    group = heads // kv_heads
    scale = default_softmax_scale(head_dim) if softmax_scale is None else float(softmax_scale)
    # (1, Hkv, group, 1): q head h = kv_head * group + g, broadcast against the row statistics.
    sink = None if learnable_sink is None else _as_f64(learnable_sink).reshape(1, kv_heads, group, 1)

    # Heads-major: (B, Hkv, group, S, D) for Q, (B, Hkv, 1, S, D) for K and V (GQA shares them).
    q = q.transpose(0, 2, 1, 3).reshape(batch, kv_heads, group, seqlen_q, head_dim)
    k = k.transpose(0, 2, 1, 3)[:, :, None]
    v = v.transpose(0, 2, 1, 3)[:, :, None]
    out = np.zeros(q.shape[:-1] + (head_dim_v,))
    lse = np.full(q.shape[:-1], -np.inf)

    for m_start in range(0, seqlen_q, block_m):  # line 1: for each tile of Q
        q_i = _pad_rows(q, m_start, block_m)  # line 2: load Q_i
        o_i = np.zeros(q_i.shape[:-1] + (head_dim_v,))  # line 3: O_i = 0
        m_i = np.full(q_i.shape[:-1], -np.inf)  # line 4: m_i = -inf, Σ_i = 0
        sum_i = np.zeros(q_i.shape[:-1])
        n_block_min, n_block_max = block_range(m_start, block_m, block_n, seqlen_q, seqlen_k, left, right)
        for j in range(n_block_min, n_block_max):  # line 5: for each tile of K that can hold a visible key
            n_start = j * block_n
            k_j = _pad_rows(k, n_start, block_n)  # line 6: load K_j
            s_ij = scale * (q_i @ np.swapaxes(k_j, -1, -2))  # line 7: S_ij = scale Q_i K_j^T
            if softcap:
                s_ij = softcap * np.tanh(s_ij / softcap)
            if needs_mask(m_start, n_start, block_m, block_n, seqlen_q, seqlen_k, left, right):
                hidden = tile_mask(m_start, n_start, block_m, block_n, seqlen_q, seqlen_k, left, right)
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
        if sink is not None:  # FA4's finalize: the sink joins Σ_i (only), relative to the scores' max
            m_i = np.where(np.isneginf(m_i), sink, m_i)
            with np.errstate(invalid="ignore"):  # sink = -inf in a row without keys: nan, caught below
                sum_i = sum_i + np.exp(sink - m_i)
        stop = min(m_start + block_m, seqlen_q)
        empty = ~(sum_i > 0)  # rows with nothing in Σ (zero, or nan as above): out = 0, lse = -inf
        o_i = o_i / np.where(empty, 1.0, sum_i)[..., None]  # line 14: O_i = O_i / Σ_i
        out[..., m_start:stop, :] = o_i[..., : stop - m_start, :]  # line 15: write O_i
        with np.errstate(divide="ignore", invalid="ignore"):
            lse_i = np.where(empty, -np.inf, m_i + np.log(sum_i))
        lse[..., m_start:stop] = lse_i[..., : stop - m_start]

    out = out.reshape(batch, heads, seqlen_q, head_dim_v).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(out), lse.reshape(batch, heads, seqlen_q)


def emulate_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    *,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    learnable_sink=None,
    block_m=128,
    block_n=128,
):
    """Algorithm 2 over a packed varlen batch: q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv).

    Each sequence (`hopper_fmha.reference.varlen_sequences`) is its own grid of Q tiles, as the
    varlen kernel's tile scheduler makes it. Returns out (total_q, H, Dv) and lse (H, total_q), fp64.
    """
    q, k, v = _as_f64(q), _as_f64(k), _as_f64(v)
    total_q, heads, head_dim = q.shape
    scale = default_softmax_scale(head_dim) if softmax_scale is None else float(softmax_scale)
    out = np.zeros((total_q, heads, v.shape[-1]))
    lse = np.empty((heads, total_q))
    for q_start, q_end, k_start, k_end in varlen_sequences(
        cu_seqlens_q, cu_seqlens_k, total_q, k.shape[0], seqused_k
    ):
        o, l = emulate(
            q[None, q_start:q_end],
            k[None, k_start:k_end],
            v[None, k_start:k_end],
            scale,
            causal,
            block_m,
            block_n,
            window_size=window_size,
            softcap=softcap,
            learnable_sink=learnable_sink,
        )
        out[q_start:q_end] = o[0]
        lse[:, q_start:q_end] = l[0]
    return out, lse


# ---- Decoding: split-KV (flash decoding) and PackGQA ----
#
# The FA3 kernels (hopper/block.h, hopper/pack_gqa.h, hopper/flash_fwd_combine_kernel.h) and FA4's
# (flash_attn/cute): with num_splits > 1, each Q tile's K/V tile range [n_block_min, n_block_max)
# is cut into num_splits contiguous pieces of ceil((n_block_max - n_block_min) / num_splits) whole
# tiles (FA3's BlockInfo.get_n_block_min_max); split s writes a partial (O_s, LSE_s) normalized
# over its own keys, and a combine kernel merges them by their LSE. Without a mask limiting the
# range, split s takes tiles [s * ceil(nblocks / num_splits), (s + 1) * ceil(nblocks / num_splits)).
# Splits past the end hold no tile: O_s = 0, LSE_s = -inf. The learnable sink joins split 0 only
# (FA4: `split_idx == 0`), so it is counted once in the combined LSE.
#
# PackGQA: the `group` q heads sharing one kv head are packed with the queries into one row
# dimension of seqlen_q * group rows, row r = query index r // group, q head (within the group)
# r % group (FA3's ((qhead_per_khead, seqlen_q)) layout, divmod(r, qhead_per_khead)), so a decode
# step (seqlen_q = 1) fills a tile with the group's heads instead of one row. A tile's mask and
# tile range follow the query indices of its rows.


def pack_gqa_rows(seqlen_q: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """PackGQA's row mapping: for packed rows r = 0 .. seqlen_q * group - 1, (q head in group, query index).

    Row r is q head kv_head * group + r % group at query index r // group.
    """
    r = np.arange(seqlen_q * group)
    return r % group, r // group


def split_block_range(n_block_min: int, n_block_max: int, split: int, num_splits: int) -> tuple[int, int]:
    """The K/V tiles of split `split` within a Q tile's range [n_block_min, n_block_max) (FA3's rule).

    Contiguous pieces of ceil(range / num_splits) tiles; the last pieces may be short or empty.
    """
    if num_splits < 1 or not 0 <= split < num_splits:
        raise ValueError(f"need 0 <= split < num_splits with num_splits >= 1, got {split}, {num_splits}")
    per_split = _ceil_div(n_block_max - n_block_min, num_splits) if n_block_max > n_block_min else 0
    start = n_block_min + split * per_split
    stop = min(start + per_split, n_block_max)
    return start, max(start, stop)


def _walk_rows(
    q_rows, row_group, k, v, seqlen_q, scale, left, right, softcap, sink, block_m, block_n, splits
):
    """Algorithm 2 over rows of query index r // row_group, one partial result per split.

    q_rows (..., R, D) with R rows, row r at query index r // row_group (1 unpacked, group packed);
    k, v (..., Sk, D / Dv) broadcasting against it; sink None or (..., R) broadcasting against it.
    `splits`: (split, num_splits) pairs, each walking its piece of every tile's range. Returns a
    list of (O (..., R, Dv), lse (..., R)), each normalized over its own keys (O = 0 and lse = -inf
    where it saw none; lse = sink there with the sink).
    """
    seqlen_k = k.shape[-2]
    num_rows = q_rows.shape[-2]
    head_dim_v = v.shape[-1]
    results = []
    for split, num_splits in splits:
        out = np.zeros(np.broadcast_shapes(q_rows.shape[:-2], v.shape[:-2]) + (num_rows, head_dim_v))
        lse = np.full(out.shape[:-1], -np.inf)
        for m_start in range(0, num_rows, block_m):
            q_i = _pad_rows(q_rows, m_start, block_m)
            # The tile's rows, unclamped past the end as the kernel's tile range is (FA3: m_idx_max from
            # (m_block + 1) * kBlockM): query index of row r is r // group packed, r otherwise.
            rows_q = (m_start + np.arange(block_m)) // row_group
            q_first, q_last = int(rows_q[0]), int(rows_q[-1])
            n_min, n_max = block_range(
                q_first, q_last - q_first + 1, block_n, seqlen_q, seqlen_k, left, right
            )
            n_min, n_max = split_block_range(n_min, n_max, split, num_splits)
            o_i = np.zeros(out.shape[:-2] + (block_m, head_dim_v))
            m_i = np.full(out.shape[:-2] + (block_m,), -np.inf)
            sum_i = np.zeros(m_i.shape)
            diagonal = (rows_q + seqlen_k - seqlen_q)[:, None]
            for j in range(n_min, n_max):
                n_start = j * block_n
                s_ij = scale * (q_i @ np.swapaxes(_pad_rows(k, n_start, block_n), -1, -2))
                if softcap:
                    s_ij = softcap * np.tanh(s_ij / softcap)
                if needs_mask(
                    q_first, n_start, q_last - q_first + 1, block_n, seqlen_q, seqlen_k, left, right
                ):
                    cols = n_start + np.arange(block_n)[None, :]
                    hidden = np.broadcast_to(cols >= seqlen_k, (block_m, block_n))
                    if right >= 0:
                        hidden = hidden | (cols > diagonal + right)
                    if left >= 0:
                        hidden = hidden | (cols < diagonal - left)
                    s_ij = np.where(hidden, -np.inf, s_ij)
                m_old = m_i
                m_i = np.maximum(m_old, s_ij.max(axis=-1))
                m_shift = np.where(np.isneginf(m_i), 0.0, m_i)
                p_ij = np.exp(s_ij - m_shift[..., None])
                rescale = np.exp(m_old - m_shift)
                sum_i = rescale * sum_i + p_ij.sum(axis=-1)
                o_i = rescale[..., None] * o_i + p_ij @ _pad_rows(v, n_start, block_n)
            stop = min(m_start + block_m, num_rows)
            if sink is not None and split == 0:  # FA4: the sink joins split 0's finalize only
                sink_i = np.broadcast_to(_pad_rows(sink[..., None], m_start, block_m)[..., 0], m_i.shape)
                m_i = np.where(np.isneginf(m_i), sink_i, m_i)
                with np.errstate(invalid="ignore"):
                    sum_i = sum_i + np.exp(sink_i - m_i)
            empty = ~(sum_i > 0)
            o_i = o_i / np.where(empty, 1.0, sum_i)[..., None]
            out[..., m_start:stop, :] = o_i[..., : stop - m_start, :]
            with np.errstate(divide="ignore", invalid="ignore"):
                lse_i = np.where(empty, -np.inf, m_i + np.log(sum_i))
            lse[..., m_start:stop] = lse_i[..., : stop - m_start]
        results.append((out, lse))
    return results


def _decode_inputs(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, pack_gqa):
    """Heads-major rows for `_walk_rows`: (B, Hkv, group, Sq, D) unpacked, (B, Hkv, Sq * group, D) packed."""
    left, right = resolve_window(causal, window_size)
    softcap = check_softcap(softcap)
    q, k, v = _as_f64(q), _as_f64(k), _as_f64(v)
    batch, seqlen_q, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    scale = default_softmax_scale(head_dim) if softmax_scale is None else float(softmax_scale)
    sink = None if learnable_sink is None else _as_f64(learnable_sink).reshape(kv_heads, group)
    q = q.reshape(batch, seqlen_q, kv_heads, group, head_dim)
    if pack_gqa:
        # (B, Hkv, Sq, group, D) -> rows r = query * group + g: FA3's ((qhead_per_khead, seqlen_q)).
        q_rows = q.transpose(0, 2, 1, 3, 4).reshape(batch, kv_heads, seqlen_q * group, head_dim)
        head_in_group, _ = pack_gqa_rows(seqlen_q, group)
        row_group = group
        k = k.transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        if sink is not None:
            sink = sink[:, head_in_group][None]  # (1, Hkv, Sq * group): each row's head's sink
    else:
        q_rows = q.transpose(0, 2, 3, 1, 4)  # (B, Hkv, group, Sq, D)
        row_group = 1
        k = k.transpose(0, 2, 1, 3)[:, :, None]
        v = v.transpose(0, 2, 1, 3)[:, :, None]
        if sink is not None:
            sink = np.broadcast_to(sink[None, :, :, None], (1, kv_heads, group, seqlen_q))
    return q_rows, row_group, k, v, seqlen_q, scale, left, right, softcap, sink


def _decode_outputs(out, lse, batch, seqlen_q, heads, pack_gqa):
    """(B, Sq, H, Dv) and (B, H, Sq) from `_walk_rows`' packed or unpacked rows."""
    head_dim_v = out.shape[-1]
    if pack_gqa:  # (B, Hkv, Sq * group, ...) -> (B, Hkv, Sq, group, ...)
        kv_heads = out.shape[1]
        out = out.reshape(batch, kv_heads, seqlen_q, heads // kv_heads, head_dim_v).transpose(0, 2, 1, 3, 4)
        lse = lse.reshape(batch, kv_heads, seqlen_q, heads // kv_heads).transpose(0, 1, 3, 2)
    else:  # (B, Hkv, group, Sq, ...)
        out = out.transpose(0, 3, 1, 2, 4)
    return (
        np.ascontiguousarray(out.reshape(batch, seqlen_q, heads, head_dim_v)),
        np.ascontiguousarray(lse.reshape(batch, heads, seqlen_q)),
    )


def emulate_split_kv(
    q,
    k,
    v,
    num_splits,
    softmax_scale=None,
    causal=False,
    block_m=128,
    block_n=128,
    *,
    window_size=(-1, -1),
    softcap=0.0,
    learnable_sink=None,
    pack_gqa=False,
):
    """Split-KV (flash decoding): the partial results of each split, before `combine_splits`.

    q: (B, Sq, H, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv). Split s walks piece s of each Q tile's
    K/V tile range (`split_block_range`). Returns out_partials (num_splits, B, Sq, H, Dv) and
    lse_partials (num_splits, B, H, Sq), fp64: each split's softmax over its own keys (O_s = 0 and
    LSE_s = -inf for a split without keys; the sink in split 0 only).
    """
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    batch, seqlen_q, heads = np.shape(q)[:3]
    args = _decode_inputs(q, k, v, softmax_scale, causal, window_size, softcap, learnable_sink, pack_gqa)
    parts = _walk_rows(*args, block_m, block_n, [(s, num_splits) for s in range(num_splits)])
    parts = [_decode_outputs(o, l, batch, seqlen_q, heads, pack_gqa) for o, l in parts]
    return np.stack([o for o, _ in parts]), np.stack([l for _, l in parts])


def combine_splits(out_partials, lse_partials):
    """Merge split partials by their LSE (FA3's combine kernel): split axis 0.

    lse = log sum_s exp(lse_s) and out = sum_s exp(lse_s - lse) out_s. Splits with lse_s = -inf weigh 0;
    a row with every lse_s = -inf gives out = 0 and lse = -inf (no NaN). out_partials (S, B, Sq, H, Dv)
    and lse_partials (S, B, H, Sq) give out (B, Sq, H, Dv) and lse (B, H, Sq), fp64.
    """
    out_partials, lse_partials = _as_f64(out_partials), _as_f64(lse_partials)
    lse_max = lse_partials.max(axis=0)
    shift = np.where(np.isneginf(lse_max), 0.0, lse_max)  # all -inf: exp(-inf - 0) = 0, not nan
    weights = np.exp(lse_partials - shift)  # (S, B, H, Sq)
    total = weights.sum(axis=0)
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, shift + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    scale = weights / np.where(total > 0, total, 1.0)  # exp(lse_s - lse)
    out = np.einsum("sbhq,sbqhd->bqhd", scale, out_partials)
    return out, lse


def emulate_pack_gqa(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    block_m=128,
    block_n=128,
    *,
    window_size=(-1, -1),
    softcap=0.0,
    learnable_sink=None,
    num_splits=1,
):
    """Algorithm 2 with PackGQA: per (batch, kv head), one walk over seqlen_q * group rows (`pack_gqa_rows`).

    Same inputs and outputs as `emulate`; with num_splits > 1 it is split-KV then `combine_splits`.
    """
    out_partials, lse_partials = emulate_split_kv(
        q,
        k,
        v,
        num_splits,
        softmax_scale,
        causal,
        block_m,
        block_n,
        window_size=window_size,
        softcap=softcap,
        learnable_sink=learnable_sink,
        pack_gqa=True,
    )
    return combine_splits(out_partials, lse_partials)
