"""Exact attention against a KV cache: the semantics of FlashAttention's `flash_attn_with_kvcache`.

Followed: the docstring of `flash_attn_with_kvcache` in hopper/flash_attn_interface.py (FA3) and
flash_attn/flash_attn_interface.py (FA2), and FA3's host checks (hopper/flash_api.cpp, `mha_fwd`) and
per-sequence lengths (hopper/seqlen.h: seqlen_k = seqused_k[b] + seqlen_k_new when appending).

- k_cache, v_cache: dense (batch, capacity, kv_heads, d / dv), or paged (num_pages, page_size,
  kv_heads, d / dv) with page_table (batch, pages_per_seq) int32: token t of sequence b lives in page
  page_table[b, t // page_size] at row t % page_size. The capacity of a sequence is the cache's
  seqlen (dense) or pages_per_seq * page_size (paged), as FA3's seqlen_k.
- cache_seqlens: int or (batch,) int32, the tokens already in the cache; None = the capacity (FA3:
  seqused_k absent, every sequence is the whole cache).
- k, v (batch, seqlen_new, kv_heads, d / dv): new tokens, written into the cache in place at positions
  cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (across page boundaries when paged), then
  attended in the same call. Sequence b's keys are its first cache_seqlens[b] + seqlen_new tokens,
  and the mask rules of `hopper_fmha.reference` (causal and window bottom-right aligned, softcap,
  learnable sink, GQA head mapping) apply with that seqlen_k.

Differences from FlashAttention, on purpose:
- Inconsistent inputs raise ValueError before anything is written (the cache stays unchanged). FA
  leaves overflowing the capacity to the caller ("you must make sure that the cache is large
  enough") and writes out of bounds; here cache_seqlens + seqlen_new > capacity is an error, as is
  a page index outside [0, num_pages) among the pages a sequence uses, and two sequences writing
  the same cache slot or one writing a slot another reads (a race in a kernel; FA calls duplicate
  writes undefined for cache_batch_idx).
- FA3 requires cache_seqlens whenever k is given; here None means the capacity, so with new tokens
  it is rejected by the capacity rule (unless seqlen_new is 0).
- Not supported: rotary embedding, cache_batch_idx, cache_leftpad, qv, varlen q / k_new
  (cu_seqlens_q, cu_seqlens_k_new), descales, attention_chunk, alibi. num_splits and pack_gqa are
  performance switches with no effect on the result (their math: `hopper_fmha.emulate`).
- The LSE is returned always (FA: return_softmax_lse), with the sink included as in
  `hopper_fmha.reference`.
"""

from __future__ import annotations

import numbers

import torch

from hopper_fmha.reference import _check_dtype, check_softcap, reference, resolve_window


def _cache_seqlens(cache_seqlens, batch: int, capacity: int) -> torch.Tensor:
    """(batch,) int64 CPU tensor of the tokens already in each sequence's cache."""
    if cache_seqlens is None:
        return torch.full((batch,), capacity, dtype=torch.int64)
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        seqlens = torch.full((batch,), int(cache_seqlens), dtype=torch.int64)
    elif isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32:
            raise ValueError(
                f"cache_seqlens must be an int or an int32 tensor, got dtype {cache_seqlens.dtype}"
            )
        if tuple(cache_seqlens.shape) != (batch,):
            raise ValueError(
                f"cache_seqlens must have shape (batch,) = ({batch},), got {tuple(cache_seqlens.shape)}"
            )
        seqlens = cache_seqlens.detach().cpu().to(torch.int64)
    else:
        raise ValueError(f"cache_seqlens must be None, an int or an int32 tensor, got {type(cache_seqlens)}")
    if (seqlens < 0).any():
        raise ValueError(f"cache_seqlens must be >= 0, got {seqlens.tolist()}")
    return seqlens


def _check_same(name: str, x: torch.Tensor, q: torch.Tensor) -> None:
    if x.dtype != q.dtype:
        raise ValueError(f"{name} must have q's dtype {q.dtype}, got {x.dtype}")
    if x.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {x.device}")


def kvcache_slots(
    page_table: torch.Tensor | None, page_size: int, b: int, start: int, stop: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first index, row) into the cache of tokens start..stop-1 of sequence b.

    Dense: (b, t). Paged: (page_table[b, t // page_size], t % page_size).
    """
    t = torch.arange(start, stop, dtype=torch.int64)
    if page_table is None:
        return torch.full_like(t, b), t
    return page_table[b].detach().cpu().to(torch.int64)[t // page_size], t % page_size


def reference_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode-style attention of q against a (paged) KV cache, appending k, v first (module docstring).

    q: (B, Sq, H, D). Returns out (B, Sq, H, Dv) and lse (B, H, Sq) in `dtype` on q's device.
    k_cache and v_cache are modified in place when k and v are given; a rejected call leaves them as
    they were.
    """
    # ---- validate everything before writing ----
    _check_dtype(dtype)
    resolve_window(causal, window_size)
    check_softcap(softcap)
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (B, Sq, H, D), got {q.dim()}-D")
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"k_cache and v_cache must be 4-D, got {k_cache.dim()}-D and {v_cache.dim()}-D")
    batch, _, heads, head_dim = q.shape
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_same(name, cache, q)
    if k_cache.shape[-1] != head_dim:
        raise ValueError(f"k_cache head dim {k_cache.shape[-1]} must equal q's head dim {head_dim}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache and v_cache must agree on all but the head dim: {tuple(k_cache.shape)} and "
            f"{tuple(v_cache.shape)}"
        )
    kv_heads, head_dim_v = k_cache.shape[2], v_cache.shape[-1]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of the cache's kv_heads ({kv_heads})")

    if page_table is None:
        page_size = 1
        if k_cache.shape[0] != batch:
            raise ValueError(f"a dense k_cache must have q's batch {batch}, got {k_cache.shape[0]}")
        capacity = k_cache.shape[1]
    else:
        if page_table.dtype != torch.int32:
            raise ValueError(f"page_table must have dtype torch.int32, got {page_table.dtype}")
        if page_table.dim() != 2 or page_table.shape[0] != batch:
            raise ValueError(
                f"page_table must be 2-D (batch, pages_per_seq) with batch {batch}, "
                f"got {tuple(page_table.shape)}"
            )
        page_size = k_cache.shape[1]
        capacity = page_table.shape[1] * page_size

    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new tokens have both a key and a value)")
    seqlen_new = 0
    if k is not None:
        if k.dim() != 4 or v.dim() != 4:
            raise ValueError(f"k and v must be 4-D (B, S_new, Hkv, D), got {k.dim()}-D and {v.dim()}-D")
        _check_same("k", k, q)
        _check_same("v", v, q)
        expected_k = (batch, k.shape[1], kv_heads, head_dim)
        expected_v = (batch, k.shape[1], kv_heads, head_dim_v)
        if tuple(k.shape) != expected_k or tuple(v.shape) != expected_v:
            raise ValueError(
                f"k must be {expected_k} and v {expected_v} (q's batch, the cache's kv_heads and head dims, "
                f"one seqlen_new), got {tuple(k.shape)} and {tuple(v.shape)}"
            )
        seqlen_new = k.shape[1]

    seqlens = _cache_seqlens(cache_seqlens, batch, capacity)
    seqlens_k = seqlens + seqlen_new
    if (seqlens_k > capacity).any():
        raise ValueError(
            f"cache_seqlens + seqlen_new must not exceed the cache capacity {capacity}"
            f"{' (pages_per_seq * page_size)' if page_table is not None else ''}: cache_seqlens "
            f"{seqlens.tolist()} + {seqlen_new}"
        )
    if page_table is not None:
        num_pages = k_cache.shape[0]
        table = page_table.detach().cpu().to(torch.int64)
        for b in range(batch):
            used = table[b, : -(-int(seqlens_k[b]) // page_size)]
            if ((used < 0) | (used >= num_pages)).any():
                raise ValueError(
                    f"page_table[{b}] names pages outside [0, {num_pages}) among the {used.numel()} pages "
                    f"sequence {b} uses: {used.tolist()}"
                )
        if seqlen_new:
            # Slots as page * page_size + row: each new token needs a slot of its own that no cached
            # token (of any sequence) is read from, or the result would depend on the write order.
            written = {}
            for b in range(batch):
                pages, rows = kvcache_slots(page_table, page_size, b, int(seqlens[b]), int(seqlens_k[b]))
                for slot in (pages * page_size + rows).tolist():
                    if slot in written:
                        raise ValueError(
                            f"page_table: sequences {written[slot]} and {b} write the same cache slot "
                            f"(page {slot // page_size}, row {slot % page_size})"
                        )
                    written[slot] = b
            for b in range(batch):
                pages, rows = kvcache_slots(page_table, page_size, b, 0, int(seqlens[b]))
                for slot in (pages * page_size + rows).tolist():
                    if slot in written:
                        raise ValueError(
                            f"page_table: sequence {written[slot]} writes a cache slot that "
                            f"sequence {b} reads "
                            f"(page {slot // page_size}, row {slot % page_size})"
                        )

    # ---- append the new tokens in place ----
    if seqlen_new:
        for b in range(batch):
            first, rows = kvcache_slots(page_table, page_size, b, int(seqlens[b]), int(seqlens_k[b]))
            first, rows = first.to(k_cache.device), rows.to(k_cache.device)
            k_cache[first, rows] = k[b]
            v_cache[first, rows] = v[b]

    # ---- attend: sequence b's keys are its first seqlens_k[b] tokens ----
    outs, lses = [], []
    for b in range(batch):
        first, rows = kvcache_slots(page_table, page_size, b, 0, int(seqlens_k[b]))
        first, rows = first.to(k_cache.device), rows.to(k_cache.device)
        o, l = reference(
            q[b : b + 1],
            k_cache[first, rows][None],
            v_cache[first, rows][None],
            softmax_scale,
            causal,
            dtype,
            window_size=window_size,
            softcap=softcap,
            learnable_sink=learnable_sink,
        )
        outs.append(o)
        lses.append(l)
    if not outs:  # batch 0
        return (
            torch.zeros((0, q.shape[1], heads, head_dim_v), dtype=dtype, device=q.device),
            torch.zeros((0, heads, q.shape[1]), dtype=dtype, device=q.device),
        )
    return torch.cat(outs), torch.cat(lses)
