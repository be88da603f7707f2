"""NumPy (fp64) emulation of the FlashAttention-2/3 backward pass at tile level: the executable
specification of the Hopper backward kernels to come.

The kernels run in three launches (FlashAttention-3's hopper/ and FlashAttention-4's
flash_attn/cute/flash_bwd_preprocess.py, flash_bwd_sm90.py, flash_bwd_postprocess.py):

1. Preprocess, one pass over the query rows: D_i = rowsum(dO_i ∘ O_i) (FA's dPsum), the LSE made
   safe for the main loop (a row that saw no key has lse = -inf; it becomes +inf, so that
   P = exp(S - LSE) = 0 for it instead of exp(-inf + inf) = nan; padded rows past seqlen_q get +inf
   too), the fp32 dQ accumulator zeroed, and, with a learnable sink, dsink (below).
2. The main loop, parallel over KEY blocks: each CTA owns key block n of one (batch, q head), holds
   K_n, V_n and the accumulators dK_n, dV_n, and walks the query blocks m that can see a key of its
   block (`query_block_range`, the forward's `block_range` seen from the key side: the two define the
   same set of (m, n) tile pairs), in ascending m as FA's backward does. Per tile:
       S = scale · Q_m K_nᵀ            (softcap: S = c · tanh(S / c), keeping T = tanh(S / c))
       S = -inf where masked           (only tiles `needs_mask` says cut the window or hold padding)
       P = exp(S - LSE_m)              (the LSE includes the sink, so P is the forward's softmax)
       dV_n += Pᵀ dO_m
       dP = dO_m V_nᵀ
       dS = P ∘ (dP - D_m)             (softcap: dS ∘= 1 - T², the derivative of c · tanh(x / c))
       dK_n += dSᵀ Q_m
       dQaccum[m] += dS K_n            (an atomic / TMA reduce-add into global memory: the ORDER matters)
   and at the end of the walk the epilogue writes dK_n = scale · dK_n and dV_n. With GQA/MQA the q
   heads of a group add their dK_n, dV_n into their kv head's (FA3's dKaccum/dVaccum), here in
   ascending head order (FA3's deterministic dv_semaphore order).
3. Postprocess: dQ = scale · dQaccum, cast to the output type (here: fp64 arrays).

dQaccum's addition order. Several CTAs add into the same dQaccum[m]; on the GPU in whatever order
they arrive (fp32 sums: not bitwise reproducible). The emulator runs the CTAs as one possible
schedule, all resident and each doing one query block per step, and records the order in which the
contributions to each query block were added (`return_order=True`). deterministic=True follows
FlashAttention-3's semaphore scheme: the CTA of key block n waits until dQaccum[m]'s semaphore
counts its turn, so each query block receives its key blocks in a fixed order: descending from its
last visible key block when the mask has a right limit (causal, as FA3's `n_block_max_for_m_block
- 1 - n_block`: the CTAs of later key blocks reach the block first), ascending from its first
otherwise (FA3's `n_block`). `dq_accum_dtype=np.float32` makes the accumulator fp32 like the
kernel's, so that the order shows in the last bits.

The learnable sink. With lse = log(sum_j exp(s_j) + exp(sink)) and o = sum_j p_j v_j, p_j =
exp(s_j - lse), only lse depends on the sink: d p_j / d sink = -p_j · exp(sink - lse), so

    dsink_h = sum_{b, i} dO_i · d o_i / d sink = -sum_{b, i} exp(sink_h - lse_{b,h,i}) · D_{b,h,i},

a per-row quantity the preprocess can reduce. A row that saw no key has o = 0, so D = 0 and it adds
nothing (and lse = sink gives exp(0) = 1, no overflow). Rows that see no key have P = 0 in every tile:
their dO contributes nothing to dK, dV, and their dQ is 0.

Conventions (layouts, the mask, softcap, GQA) are `hopper_fmha.reference`'s; the tile rules are
`hopper_fmha.emulate`'s.
"""

from __future__ import annotations

import random

import numpy as np

from hopper_fmha.config import default_softmax_scale
from hopper_fmha.emulate import _as_f64, _ceil_div, _pad_rows, block_range, needs_mask, tile_mask
from hopper_fmha.reference import check_softcap, resolve_window


def query_block_range(
    n_start: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, left: int = -1, right: int = -1
) -> tuple[int, int]:
    """[m_block_min, m_block_max): the Q tiles the K/V tile of keys [n_start, n_start + block_n) visits.

    Row i sees key j iff j - offset - right <= i <= j - offset + left (offset = seqlen_k - seqlen_q,
    -1: no limit). With a right limit the tile's first key bounds the rows from below, with a left
    limit its last key bounds them from above (FA4's BlockInfo.get_m_block_min_max). Tile m is in
    this range iff tile n is in `block_range` of tile m: the same (m, n) pairs as the forward.
    """
    offset = seqlen_k - seqlen_q
    m_block_max = _ceil_div(seqlen_q, block_m)
    if left >= 0:
        m_block_max = min(m_block_max, _ceil_div(n_start + block_n - offset + left, block_m))
    m_block_min = max(0, (n_start - offset - right) // block_m) if right >= 0 else 0
    return m_block_min, max(m_block_min, m_block_max)


def dq_order(
    m_block: int, block_m: int, block_n: int, seqlen_q: int, seqlen_k: int, left: int = -1, right: int = -1
) -> list[int]:
    """The fixed order (deterministic mode) in which the key blocks add into dQaccum of query block m.

    Descending from the last visible key block when the mask has a right limit (FA3's causal turn
    n_block_max_for_m_block - 1 - n_block), ascending from the first otherwise.
    """
    blocks = list(range(*block_range(m_block * block_m, block_m, block_n, seqlen_q, seqlen_k, left, right)))
    return blocks[::-1] if right >= 0 else blocks


def rotated_walk(n_block: int, n_m_blocks: int, n_n_blocks: int) -> list[int]:
    """The query blocks key block n_block visits, in order, in the rotated deterministic mode (the
    v2 kernel's `rotate`: no causal, no window): from n_block * stride on, wrapping, stride =
    n_m_blocks // n_n_blocks; from 0 where that is 0 (fewer query blocks than key blocks)."""
    first = n_block * (n_m_blocks // n_n_blocks)
    return [(first + i) % n_m_blocks for i in range(n_m_blocks)]


def rotated_turns(m_block: int, n_m_blocks: int, n_n_blocks: int) -> list[int]:
    """The order in which the key blocks add into dQaccum[m_block] in the rotated mode: the order
    in which their `rotated_walk`s reach it, n0 = min(m // stride, n - 1) first, then n0 - 1, ...,
    0, n - 1, ..., n0 + 1; descending (the kernel's launch order) where stride is 0."""
    stride = n_m_blocks // n_n_blocks
    n0 = min(m_block // stride, n_n_blocks - 1) if stride else n_n_blocks - 1
    return [(n0 - t) % n_n_blocks for t in range(n_n_blocks)]


def preprocess(out, dout, lse, learnable_sink=None):
    """The backward's first kernel, per query row. out, dout: (B, Sq, H, Dv); lse: (B, H, Sq).

    Returns D (B, H, Sq) = rowsum(dO ∘ O) and dsink (H,) = -sum_{b,i} exp(sink_h - lse) D
    (None without a sink).
    """
    out, dout, lse = _as_f64(out), _as_f64(dout), _as_f64(lse)
    d = np.einsum("bshd,bshd->bhs", dout, out)
    if learnable_sink is None:
        return d, None
    sink = _as_f64(learnable_sink)[None, :, None]
    with np.errstate(invalid="ignore"):  # sink = lse = -inf (no key, no sink weight): 0, not nan
        p_sink = np.where(np.isneginf(lse), 0.0, np.exp(sink - lse))
    return d, -(p_sink * d).sum(axis=(0, 2))


def emulate_backward(
    q,
    k,
    v,
    out,
    dout,
    lse,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    learnable_sink=None,
    block_m=64,
    block_n=128,
    deterministic=False,
    *,
    return_order=False,
    dq_accum_dtype=np.float64,
    schedule_seed=None,
    rotate=False,
):
    """Gradients of `reference`'s out by the FA2/3 backward, tile by tile (module docstring).

    q: (B, Sq, H, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv); out, dout: (B, Sq, H, Dv); lse: (B, H, Sq),
    the forward's (with the sink in it); learnable_sink: (H,) or None. NumPy or torch inputs.
    Returns fp64 NumPy dq (B, Sq, H, D), dk (B, Sk, Hkv, D), dv (B, Sk, Hkv, Dv), then dsink (H,) when
    learnable_sink is given, then, with return_order=True, order: {query block m: [key blocks in the
    order their dS K was added to dQaccum[m]]} (the same for every (batch, head)).
    deterministic: the fixed order of `dq_order`; otherwise the order of the emulated schedule, in
    which the CTAs of one step go in ascending key block, or shuffled by schedule_seed when given.
    dq_accum_dtype: the dQ accumulator's type (np.float32 as the kernel's).
    rotate (deterministic, no causal or window): the CTAs walk `rotated_walk` and add in
    `rotated_turns` order.
    """
    left, right = resolve_window(causal, window_size)
    if rotate and not (deterministic and left < 0 and right < 0):
        raise ValueError("rotate: the deterministic mode without causal or a window")
    softcap = check_softcap(softcap)
    q, k, v, out, dout, lse = (_as_f64(t) for t in (q, k, v, out, dout, lse))
    batch, seqlen_q, heads, head_dim = q.shape
    _, seqlen_k, kv_heads, _ = k.shape
    head_dim_v = v.shape[-1]
    group = heads // kv_heads
    scale = default_softmax_scale(head_dim) if softmax_scale is None else float(softmax_scale)
    dq_accum_dtype = np.dtype(dq_accum_dtype)  # np.float32, "float32", ...

    # 1. Preprocess: D, dsink, the LSE with +inf for rows without keys and for padding, dQaccum = 0.
    d_rows, dsink = preprocess(out, dout, lse, learnable_sink)
    n_m_blocks, n_n_blocks = _ceil_div(seqlen_q, block_m), _ceil_div(seqlen_k, block_n)
    rows_padded = n_m_blocks * block_m  # FA's seqlen_q_rounded
    pad = ((0, 0), (0, 0), (0, 0), (0, rows_padded - seqlen_q))

    def heads_major(x):  # (B, S, H, X) -> (B, Hkv, group, S, X): q head h = kv_head * group + g
        return x.transpose(0, 2, 1, 3).reshape(batch, kv_heads, group, x.shape[1], x.shape[3])

    q, out, dout = heads_major(q), heads_major(out), heads_major(dout)
    k = k.transpose(0, 2, 1, 3)[:, :, None]  # (B, Hkv, 1, Sk, D): shared by the group
    v = v.transpose(0, 2, 1, 3)[:, :, None]
    lse = np.where(np.isneginf(lse), np.inf, lse).reshape(batch, kv_heads, group, seqlen_q)
    lse = np.pad(lse, pad, constant_values=np.inf)
    d_rows = np.pad(d_rows.reshape(batch, kv_heads, group, seqlen_q), pad)
    dq_accum = np.zeros((batch, kv_heads, group, rows_padded, head_dim), dtype=dq_accum_dtype)
    dk = np.zeros((batch, kv_heads, seqlen_k, head_dim))
    dv = np.zeros((batch, kv_heads, seqlen_k, head_dim_v))

    # 2. The main loop: one CTA per key block (for all (batch, head) at once), scheduled in steps.
    def cta(n):
        """The walk of key block n: yields (m, dS K) per query block; returns after its epilogue."""
        n_start = n * block_n
        # K_n, V_n given to each q head of the group (a broadcast operand would take NumPy's slow matmul).
        k_n, v_n = (
            np.ascontiguousarray(np.broadcast_to(x, q.shape[:3] + x.shape[3:]))
            for x in (_pad_rows(k, n_start, block_n), _pad_rows(v, n_start, block_n))
        )
        dk_n = np.zeros(q.shape[:3] + (block_n, head_dim))  # per q head: (B, Hkv, group, block_n, D)
        dv_n = np.zeros(q.shape[:3] + (block_n, head_dim_v))
        walk = range(*query_block_range(n_start, block_m, block_n, seqlen_q, seqlen_k, left, right))
        if rotate:
            walk = rotated_walk(n, n_m_blocks, n_n_blocks)
        for m in walk:
            m_start = m * block_m
            rows = slice(m_start, m_start + block_m)
            q_m, do_m = _pad_rows(q, m_start, block_m), _pad_rows(dout, m_start, block_m)
            s = scale * (q_m @ np.swapaxes(k_n, -1, -2))  # (B, Hkv, group, block_m, block_n)
            if softcap:
                t = np.tanh(s / softcap)
                s = softcap * t
            if needs_mask(m_start, n_start, block_m, block_n, seqlen_q, seqlen_k, left, right):
                hidden = tile_mask(m_start, n_start, block_m, block_n, seqlen_q, seqlen_k, left, right)
                s = np.where(hidden, -np.inf, s)
            p = np.exp(s - lse[..., rows, None])  # masked: exp(-inf) = 0; no-key and padded rows: LSE = +inf
            dv_n += np.swapaxes(p, -1, -2) @ do_m
            dp = do_m @ np.swapaxes(v_n, -1, -2)
            ds = p * (dp - d_rows[..., rows, None])
            if softcap:
                ds = ds * (1.0 - t * t)  # d(c tanh(x / c))/dx
            dk_n += np.swapaxes(ds, -1, -2) @ q_m
            yield m, ds @ k_n
        # Epilogue: the group's q heads add into their kv head in ascending order; rows past Sk dropped.
        stop = min(n_start + block_n, seqlen_k)
        for g in range(group):
            dk[:, :, n_start:stop] += scale * dk_n[:, :, g, : stop - n_start]
            dv[:, :, n_start:stop] += dv_n[:, :, g, : stop - n_start]

    ctas = {n: cta(n) for n in range(n_n_blocks)}
    # Each CTA's next dQ addition; a CTA without query blocks has run its epilogue here already.
    active = {n: item for n, item in ((n, next(walk, None)) for n, walk in ctas.items()) if item is not None}
    order = {m: [] for m in range(n_m_blocks)}
    turns = {m: dq_order(m, block_m, block_n, seqlen_q, seqlen_k, left, right) for m in order}
    if rotate:
        turns = {m: rotated_turns(m, n_m_blocks, n_n_blocks) for m in order}
    rng = None if schedule_seed is None else random.Random(schedule_seed)
    while active:  # one step: every CTA with work left makes one addition, unless it must wait
        step = sorted(active)
        if rng is not None and not deterministic:
            rng.shuffle(step)
        progressed = False
        for n in step:
            m, contribution = active[n]
            if deterministic and turns[m][len(order[m])] != n:
                continue  # dQaccum[m]'s semaphore has not reached this CTA's turn: wait
            dq_accum[..., m * block_m : (m + 1) * block_m, :] += contribution.astype(dq_accum_dtype)
            order[m].append(n)
            progressed = True
            item = next(ctas[n], None)  # the next query block, or the epilogue and the end of the CTA
            if item is None:
                del active[n]
            else:
                active[n] = item
        if not progressed:
            raise RuntimeError(f"the deterministic schedule deadlocked: {sorted(active)} wait")

    # 3. Postprocess: dQ = scale * dQaccum, the padded rows dropped.
    dq = (dq_accum[..., :seqlen_q, :] * dq_accum_dtype.type(scale)).astype(np.float64)
    dq = np.ascontiguousarray(dq.reshape(batch, heads, seqlen_q, head_dim).transpose(0, 2, 1, 3))
    dk = np.ascontiguousarray(dk.transpose(0, 2, 1, 3))
    dv = np.ascontiguousarray(dv.transpose(0, 2, 1, 3))
    result = (dq, dk, dv) if learnable_sink is None else (dq, dk, dv, dsink)
    return (*result, order) if return_order else result
