"""Exact attention on any device: the ground truth for tests, the demo and the benchmarks.

Same semantics as `hopper_fmha.flash_attn_func`, with FlashAttention's names and conventions:

- Layout BSHD (`reference`) or packed varlen (`reference_varlen`); GQA/MQA: q head h uses kv head
  h // (heads // kv_heads). v's head dim dv may differ from q's and k's d: out has dv columns.
- Scores s = softmax_scale * q·k, or with softcap > 0, s = softcap * tanh(softmax_scale * q·k / softcap).
- Mask, bottom-right aligned: with window_size = (left, right), query row i (of seqlen_q rows, keys
  seqlen_k) sees key j iff i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right,
  a side with -1 having no limit. causal=True is window (-1, 0); given with a window it sets
  right = 0 and keeps left.
- learnable_sink (heads,): a per-head logit, in the units of s, that joins each row's softmax
  denominator and nothing else: out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink_h)).
  The LSE follows FlashAttention-4 (flash_attn/cute): the sink is part of it,
  lse = log(sum_j exp(s_j) + exp(sink_h)). FA4's kernels add exp(sink - m) to the row sum in
  `Softmax.finalize` before taking lse = m + log(row_sum), its empty-input path returns
  lse = learnable_sink, its reference (`testing.attention_ref`) computes the LSE over the scores
  and the sink, and its backward reads dsink from dlse; an LSE without the sink could not merge
  split or partial results exactly.
- A row that sees no key gives out = 0 and lse = -inf; with a sink, out = 0 (the sink has no
  value vector) and lse = sink_h.
- LSE layouts as FA4: (batch, heads, seqlen_q) dense, (heads, total_q) varlen
  (`flash_attn_varlen_func`'s docstring and `_flash_attn_fwd`'s lse_shape).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from hopper_fmha.config import default_softmax_scale

# Largest score block (elements) materialized at once: 2**27 fp32 scores are 512 MiB, so a
# GPU reference at N=16384 runs in query-row chunks instead of one 32 GiB-per-head matrix.
MAX_SCORE_ELEMENTS = 2**27


def resolve_window(causal: bool, window_size=(-1, -1)) -> tuple[int, int]:
    """(left, right) of the attention window, -1 for a side without limit.

    causal=True is the window (-1, 0); given with a window, it sets right = 0 and keeps left.
    """
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    for name, side in (("left", left), ("right", right)):
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window_size {name} must be an int, got {side!r}")
        if side < -1:
            raise ValueError(f"window_size {name} must be >= -1 (-1 = no limit), got {side}")
    return int(left), 0 if causal else int(right)


def check_softcap(softcap) -> float:
    softcap = float(softcap)
    if not softcap >= 0 or math.isinf(softcap):  # also rejects nan
        raise ValueError(f"softcap must be a finite float >= 0 (0 = off), got {softcap}")
    return softcap


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")


def visible_keys(rows: torch.Tensor, seqlen_q: int, seqlen_k: int, left: int, right: int) -> torch.Tensor:
    """(len(rows), seqlen_k) bool: row i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right."""
    diagonal = (rows + (seqlen_k - seqlen_q))[:, None]  # the key aligned with each row
    keys = torch.arange(seqlen_k, device=rows.device)[None, :]
    visible = torch.ones((rows.numel(), seqlen_k), dtype=torch.bool, device=rows.device)
    if right >= 0:
        visible &= keys <= diagonal + right
    if left >= 0:
        visible &= keys >= diagonal - left
    return visible


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    dtype: torch.dtype = torch.float32,
    *,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention computed in `dtype` (float32 or float64) on q's device.

    q: (B, Sq, H, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv) with H % Hkv == 0;
    learnable_sink: (H,) or None. softmax_scale defaults to 1/sqrt(D).
    Returns out (B, Sq, H, Dv) and lse (B, H, Sq), both in `dtype` (conventions: module docstring).
    """
    _check_dtype(dtype)
    left, right = resolve_window(causal, window_size)
    softcap = check_softcap(softcap)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D (B, S, H, D), got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    batch, seqlen_q, heads, head_dim = q.shape
    _, seqlen_k, kv_heads, _ = k.shape
    head_dim_v = v.shape[-1]
    if k.shape[0] != batch or v.shape[:3] != k.shape[:3] or k.shape[-1] != head_dim:
        raise ValueError(
            f"k must be (B, Sk, Hkv, D) and v (B, Sk, Hkv, Dv) with q's B and D: q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if learnable_sink is not None and tuple(learnable_sink.shape) != (heads,):
        raise ValueError(
            f"learnable_sink must have shape (heads,) = ({heads},), got {tuple(learnable_sink.shape)}"
        )
    scale = default_softmax_scale(head_dim) if softmax_scale is None else float(softmax_scale)
    group = heads // kv_heads
    # (Hkv, group, 1, 1): q head h = kv_head * group + g, the layout of the score blocks below.
    sink = (
        None if learnable_sink is None else learnable_sink.to(q.device, dtype).reshape(kv_heads, group, 1, 1)
    )

    out = torch.zeros((batch, seqlen_q, heads, head_dim_v), dtype=dtype, device=q.device)
    lse = torch.full((batch, heads, seqlen_q), -math.inf, dtype=dtype, device=q.device)
    if sink is not None:
        lse[:] = sink.reshape(1, heads, 1)  # rows without keys: lse = sink
    if out.numel() == 0 or seqlen_k == 0:
        return out, lse
    rows = max(1, MAX_SCORE_ELEMENTS // (heads * seqlen_k))
    masked = left >= 0 or right >= 0

    for b in range(batch):
        kb = k[b].to(dtype).transpose(0, 1)[:, None]  # (Hkv, 1, Sk, D)
        vb = v[b].to(dtype).transpose(0, 1)[:, None]  # (Hkv, 1, Sk, Dv)
        for start in range(0, seqlen_q, rows):
            stop = min(start + rows, seqlen_q)
            # (Hkv, group, rows, D): q head h = kv_head * group + g, so h // group is its kv head.
            qc = q[b, start:stop].to(dtype).transpose(0, 1).reshape(kv_heads, group, stop - start, head_dim)
            s = torch.matmul(qc, kb.transpose(-1, -2)) * scale  # (Hkv, group, rows, Sk)
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            if masked:
                query_idx = torch.arange(start, stop, device=q.device)
                s.masked_fill_(~visible_keys(query_idx, seqlen_q, seqlen_k, left, right), -math.inf)
            row_max = s.amax(dim=-1, keepdim=True)
            if sink is not None:
                row_max = torch.maximum(row_max, sink)  # the max over the scores and the sink
            # Rows with every key hidden (and no sink) have max -inf: shift by 0 so exp gives 0, not nan.
            row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
            p = torch.exp(s - row_max)
            row_sum = p.sum(dim=-1, keepdim=True)
            if sink is not None:
                row_sum = row_sum + torch.exp(sink - row_max)  # the sink joins the denominator only
            o = torch.matmul(p, vb) / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
            out[b, start:stop] = o.reshape(heads, stop - start, head_dim_v).transpose(0, 1)
            lse[b, :, start:stop] = (row_max + torch.log(row_sum)).reshape(heads, stop - start)
    return out, lse


def _int_vector(x, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu()
    arr = np.asarray(x)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer) or arr.size == 0):
        raise ValueError(f"{name} must be a 1-D integer tensor, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64)


def varlen_sequences(
    cu_seqlens_q,
    cu_seqlens_k,
    total_q: int,
    total_k: int,
    seqused_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
) -> list[tuple[int, int, int, int]]:
    """The sequences of a varlen batch as (q_start, q_end, k_start, k_end) row ranges.

    Sequence b has query rows cu_seqlens_q[b]:cu_seqlens_q[b+1] and keys cu_seqlens_k[b]:cu_seqlens_k[b+1],
    of which only the first seqused_k[b] count when seqused_k is given (k_end = k_start + seqused_k[b]).
    cu_seqlens_q must end at total_q (every query row belongs to a sequence); keys past
    cu_seqlens_k[-1] are never read, as in FlashAttention. max_seqlen_q/k, when given, must bound
    every sequence's (used) length.
    """
    cu_q = _int_vector(cu_seqlens_q, "cu_seqlens_q")
    cu_k = _int_vector(cu_seqlens_k, "cu_seqlens_k")
    if cu_q.size == 0 or cu_q.size != cu_k.size:
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must both have length batch + 1 >= 1, "
            f"got {cu_q.size} and {cu_k.size}"
        )
    for name, cu, total in (("cu_seqlens_q", cu_q, total_q), ("cu_seqlens_k", cu_k, total_k)):
        if cu[0] != 0 or (np.diff(cu) < 0).any():
            raise ValueError(f"{name} must start at 0 and be non-decreasing, got {cu.tolist()}")
        if cu[-1] > total:
            raise ValueError(f"{name}[-1] = {cu[-1]} exceeds the {total} rows of the packed tensor")
    if cu_q[-1] != total_q:
        raise ValueError(f"cu_seqlens_q[-1] = {cu_q[-1]} must equal total_q = {total_q}")
    seqlens_k = np.diff(cu_k)
    if seqused_k is not None:
        used = _int_vector(seqused_k, "seqused_k")
        if used.size != seqlens_k.size:
            raise ValueError(f"seqused_k must have shape (batch,) = ({seqlens_k.size},), got ({used.size},)")
        if (used < 0).any() or (used > seqlens_k).any():
            raise ValueError(
                f"seqused_k must lie in [0, cu_seqlens_k[b+1] - cu_seqlens_k[b]]: {used.tolist()} "
                f"against {seqlens_k.tolist()}"
            )
        seqlens_k = used
    seqlens_q = np.diff(cu_q)
    for name, bound, lengths in (
        ("max_seqlen_q", max_seqlen_q, seqlens_q),
        ("max_seqlen_k", max_seqlen_k, seqlens_k),
    ):
        if bound is not None and lengths.size and int(bound) < lengths.max():
            raise ValueError(f"{name} = {bound} is below the longest sequence ({lengths.max()})")
    return [
        (int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b] + seqlens_k[b]))
        for b in range(seqlens_q.size)
    ]


def reference_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over a packed batch of variable-length sequences, one `reference` call per sequence.

    q: (total_q, H, D); k: (total_k, Hkv, D); v: (total_k, Hkv, Dv); cu_seqlens_q/k: (batch + 1,)
    cumulative offsets from 0; seqused_k: (batch,) or None (sequences: `varlen_sequences`). The mask
    rules apply per sequence with its seqlen_q and seqlen_k (= seqused_k[b] when given).
    Returns out (total_q, H, Dv) and lse (H, total_q), FlashAttention's varlen LSE layout.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"varlen q, k, v must be 3-D (total, H, D), got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D"
        )
    total_q, heads, head_dim = q.shape
    _check_dtype(dtype)
    resolve_window(causal, window_size)
    check_softcap(softcap)
    sequences = varlen_sequences(
        cu_seqlens_q, cu_seqlens_k, total_q, k.shape[0], seqused_k, max_seqlen_q, max_seqlen_k
    )
    scale = default_softmax_scale(head_dim) if softmax_scale is None else float(softmax_scale)
    out = torch.zeros((total_q, heads, v.shape[-1]), dtype=dtype, device=q.device)
    lse = torch.empty((heads, total_q), dtype=dtype, device=q.device)
    for q_start, q_end, k_start, k_end in sequences:
        o, l = reference(
            q[None, q_start:q_end],
            k[None, k_start:k_end],
            v[None, k_start:k_end],
            scale,
            causal,
            dtype,
            window_size=window_size,
            softcap=softcap,
            learnable_sink=learnable_sink,
        )
        out[q_start:q_end] = o[0]
        lse[:, q_start:q_end] = l[0]
    return out, lse
