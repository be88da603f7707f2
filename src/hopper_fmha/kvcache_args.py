"""Argument checks and the cache append of `flash_attn_with_kvcache` (attention against a KV cache).

The layouts (the semantics are `hopper_fmha.reference_kvcache`'s):
- q: (batch, seqlen_q, heads, head_dim), float16 or bfloat16.
- k_cache, v_cache: dense (batch, capacity, kv_heads, head_dim / head_dim_v) when page_table is None;
  paged (num_pages, page_size, kv_heads, head_dim / head_dim_v) with page_table (batch, pages_per_seq)
  int32, where token t of sequence b lives at row t % page_size of page page_table[b, t // page_size]
  and capacity = pages_per_seq * page_size.
- k, v: (batch, seqlen_new, kv_heads, head_dim / head_dim_v), the new tokens, appended to sequence b
  at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1.
- cache_seqlens: the tokens already cached per sequence: None (every sequence is full: the capacity),
  a Python int (all sequences alike) or an int32 (batch,) tensor.

`check_kvcache` checks the metadata (types, dtypes, ranks, shapes, devices), which costs nothing, an
int cache_seqlens (it lives on the host), and, with check_values, the values that live on the device
(a cache_seqlens tensor, the page table) in ONE device-to-host copy. That copy is impossible while a
CUDA graph is being captured and breaks the graph under torch.compile, so the caller passes
`hopper_fmha.varlen_args.varlen_values_checkable()` as check_values: under capture or compile (or
with HOPPER_FMHA_CHECK_VALUES=0 in the environment) the device values are NOT checked, and
`append_kv` and the kernel must stay inside the cache whatever they hold.

`append_kv` writes the new tokens into the cache in place with device ops only (no host copy, no
sync: it can be captured in a CUDA graph).

Not checked here (`reference_with_kvcache` rejects them): two sequences of a paged cache writing the
same slot, or one writing a slot that another reads. Either makes the result depend on the order of
the writes, but every write stays inside the cache.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from hopper_fmha.config import check_head_dims

_DTYPES = (torch.float16, torch.bfloat16)
# The kernel loads a page in whole 16-row blocks by TMA.
PAGE_SIZE_MULTIPLE = 16


class KVCacheShape(NamedTuple):
    """The problem sizes of a checked `flash_attn_with_kvcache` call.

    capacity: tokens a sequence can hold (the dense cache's seqlen, or pages_per_seq * page_size);
    page_size and num_pages: 0 for a dense cache; seqlen_new: 0 without k and v.
    """

    batch: int
    seqlen_q: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    capacity: int
    paged: bool
    page_size: int
    num_pages: int
    seqlen_new: int


def check_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    cache_seqlens=None,
    page_table=None,
    *,
    check_values: bool = True,
) -> KVCacheShape:
    """The rules, in the order they are checked; raises for the first one broken.

    TypeError for a wrong type or dtype, ValueError for a wrong shape, device or value; the message
    names the argument, the rule and what was given.

    1. q: a tensor of rank 4 (batch, seqlen_q, heads, head_dim), float16 or bfloat16.
    2. k_cache, v_cache: tensors of q's dtype and device, rank 4; dense (batch, capacity, kv_heads,
       head_dim / head_dim_v) without page_table, else paged (num_pages, page_size, kv_heads,
       head_dim / head_dim_v). They agree on their first three dims; k_cache's last dim is q's
       head_dim; heads % kv_heads == 0 with kv_heads >= 1; dense: k_cache.shape[0] == batch.
    3. page_table: None, or an int32 tensor of shape (batch, pages_per_seq) on q's device, with
       page_size a multiple of 16 (>= 16).
    4. k, v: both or neither; q's dtype and device, k (batch, seqlen_new, kv_heads, head_dim) and
       v (batch, seqlen_new, kv_heads, head_dim_v).
    5. cache_seqlens: None, a Python int (not a bool), or an int32 (batch,) tensor on q's device.
    6. `hopper_fmha.config.check_head_dims(head_dim, head_dim_v)`.
    7. Always (host values): None needs seqlen_new == 0 (the sequences are full); an int must be in
       [0, capacity - seqlen_new].
    8. Only with check_values (one device-to-host copy): each cache_seqlens[b] in
       [0, capacity - seqlen_new]; paged: the first ceil((cache_seqlens[b] + seqlen_new) / page_size)
       entries of page_table[b] (the pages sequence b uses) in [0, num_pages).
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q must have rank 4 (batch, seqlen_q, heads, head_dim), got shape {tuple(q.shape)}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    batch, seqlen_q, heads, head_dim = q.shape

    paged = page_table is not None
    layout = "paged (num_pages, page_size, kv_heads, d)" if paged else "dense (batch, capacity, kv_heads, d)"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        _like_q(name, t, q, f"{layout} as page_table is {'given' if paged else 'None'}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache and v_cache must agree on their first three dims, "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.shape[3] != head_dim:
        raise ValueError(
            f"k_cache's last dim must be q's head_dim {head_dim}, got shape {tuple(k_cache.shape)}"
        )
    kv_heads, head_dim_v = k_cache.shape[2], v_cache.shape[3]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"heads of q must be a multiple of the kv heads of k_cache/v_cache (>= 1), "
            f"got heads={heads}, kv_heads={kv_heads}"
        )
    if not paged and k_cache.shape[0] != batch:
        raise ValueError(
            f"a dense k_cache must have q's batch {batch} as its first dim, got shape {tuple(k_cache.shape)}"
        )

    page_size = num_pages = 0
    capacity = k_cache.shape[1]
    if paged:
        if not isinstance(page_table, torch.Tensor):
            raise TypeError(
                f"page_table must be None or a torch.Tensor of int32, got {type(page_table).__name__}"
            )
        if page_table.dtype != torch.int32:
            raise TypeError(f"page_table must be int32, got {page_table.dtype}")
        if page_table.dim() != 2 or page_table.shape[0] != batch:
            raise ValueError(
                f"page_table must have shape (batch, pages_per_seq) with q's batch {batch}, "
                f"got {tuple(page_table.shape)}"
            )
        _same_device("page_table", page_table, q)
        num_pages, page_size = k_cache.shape[:2]
        if page_size < PAGE_SIZE_MULTIPLE or page_size % PAGE_SIZE_MULTIPLE:
            raise ValueError(
                f"page_size (k_cache.shape[1]) must be a multiple of {PAGE_SIZE_MULTIPLE} (the kernel loads "
                f"whole {PAGE_SIZE_MULTIPLE}-row blocks of a page by TMA), got {page_size}"
            )
        capacity = page_table.shape[1] * page_size

    if (k is None) != (v is None):
        raise ValueError(
            f"k and v must be given both or neither, got k {'None' if k is None else 'a tensor'} "
            f"and v {'None' if v is None else 'a tensor'}"
        )
    seqlen_new = 0
    if k is not None:
        _like_q("k", k, q, "(batch, seqlen_new, kv_heads, head_dim)")
        _like_q("v", v, q, "(batch, seqlen_new, kv_heads, head_dim_v)")
        seqlen_new = k.shape[1]
        for name, t, d in (("k", k, head_dim), ("v", v, head_dim_v)):
            expected = (batch, seqlen_new, kv_heads, d)
            if tuple(t.shape) != expected:
                raise ValueError(
                    f"{name} must have shape {expected} (q's batch, k's seqlen_new, the cache's kv_heads "
                    f"and {name}_cache's last dim), got {tuple(t.shape)}"
                )

    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens must be an int32 tensor, got {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (batch,):
            raise ValueError(
                f"cache_seqlens must have shape (batch,) = ({batch},), got {tuple(cache_seqlens.shape)}"
            )
        _same_device("cache_seqlens", cache_seqlens, q)
    elif cache_seqlens is not None and (
        isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, numbers.Integral)
    ):
        raise TypeError(
            f"cache_seqlens must be None, an int or an int32 tensor, got {type(cache_seqlens).__name__}"
        )

    check_head_dims(head_dim, head_dim_v)

    limit = capacity - seqlen_new  # the largest cache_seqlens that leaves room for the new tokens
    if cache_seqlens is None and seqlen_new:
        raise ValueError(
            f"cache_seqlens None means every sequence is full (the capacity {capacity}): no room for "
            f"k and v (seqlen_new {seqlen_new}); pass cache_seqlens"
        )
    if isinstance(cache_seqlens, numbers.Integral) and not 0 <= cache_seqlens <= limit:
        raise ValueError(
            f"cache_seqlens must be in [0, capacity - seqlen_new] = [0, {limit}] (capacity {capacity}, "
            f"seqlen_new {seqlen_new}), got {cache_seqlens}"
        )
    if check_values:
        _value_rules(cache_seqlens, page_table, batch, capacity, page_size, num_pages, seqlen_new)
    return KVCacheShape(
        batch,
        seqlen_q,
        heads,
        kv_heads,
        head_dim,
        head_dim_v,
        capacity,
        paged,
        page_size,
        num_pages,
        seqlen_new,
    )


def _like_q(name: str, t, q: torch.Tensor, layout: str) -> None:
    """t is a tensor of q's dtype and device, of rank 4 (`layout` says which dims)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != q.dtype:
        raise TypeError(f"{name} must have q's dtype {q.dtype}, got {t.dtype}")
    _same_device(name, t, q)
    if t.dim() != 4:
        raise ValueError(f"{name} must have rank 4, {layout}, got shape {tuple(t.shape)}")


def _same_device(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    if t.device != q.device:
        raise ValueError(f"{name} must be on the same device as q, got {t.device} and q on {q.device}")


def _value_rules(cache_seqlens, page_table, batch, capacity, page_size, num_pages, seqlen_new) -> None:
    """The rules on the values that live on the device, read in one copy (none if there are none)."""
    on_device = isinstance(cache_seqlens, torch.Tensor)
    tensors = ([cache_seqlens] if on_device else []) + (
        [page_table.reshape(-1)] if page_table is not None else []
    )
    if not tensors:
        return
    values = torch.cat(tensors).to("cpu", torch.int64)  # the one device-to-host copy
    limit = capacity - seqlen_new
    if on_device:
        seqlens, values = values[:batch], values[batch:]
        bad = ((seqlens < 0) | (seqlens > limit)).nonzero()
        if bad.numel():
            b = int(bad[0])
            raise ValueError(
                f"cache_seqlens[{b}] must be in [0, capacity - seqlen_new] = [0, {limit}] (capacity "
                f"{capacity}, seqlen_new {seqlen_new}), got {int(seqlens[b])}"
            )
    else:
        seqlens = torch.full((batch,), capacity if cache_seqlens is None else int(cache_seqlens))
    if page_table is None:
        return
    table = values.reshape(page_table.shape)
    pages_used = (seqlens + seqlen_new + page_size - 1) // page_size
    used = torch.arange(table.shape[1]) < pages_used[:, None]
    bad = (used & ((table < 0) | (table >= num_pages))).nonzero()
    if bad.numel():
        b, j = bad[0].tolist()
        raise ValueError(
            f"page_table[{b}, {j}] must be a page of k_cache in [0, num_pages) = [0, {num_pages}), "
            f"got {int(table[b, j])} (sequence {b} uses its first {int(pages_used[b])} pages: "
            f"{int(seqlens[b])} cached + {seqlen_new} new tokens)"
        )


def append_kv(k_cache, v_cache, k, v, cache_seqlens, page_table=None) -> None:
    """Write the new tokens into the cache in place: k[b, i] and v[b, i] go to token position
    pos = cache_seqlens[b] + i of sequence b, i.e. k_cache[b, pos] (dense) or
    k_cache[page_table[b, pos // page_size], pos % page_size] (paged), for all b and i.

    The arguments pass `check_kvcache`'s shape rules; cache_seqlens is an int or an int32 (batch,)
    tensor (any value when seqlen_new is 0). cache_seqlens itself is not advanced.

    Device ops only, no device-to-host copy or sync, so the call can be captured in a CUDA graph; the
    memory it allocates grows with batch * seqlen_new, not with the cache. Its values may therefore be
    unchecked (`check_kvcache` with check_values False): positions are clamped to [0, capacity - 1]
    and page ids to [0, num_pages - 1] before indexing, so an overflowing cache_seqlens or a bad page
    id overwrites slots of the cache (which ones is unspecified), never memory outside it. Two writes
    to one slot (only with such values or a page shared by sequences) leave one of them, unspecified.
    """
    batch, seqlen_new = k.shape[:2]
    capacity = k_cache.shape[1] * (page_table.shape[1] if page_table is not None else 1)
    if batch * seqlen_new == 0 or capacity == 0 or k_cache.shape[0] == 0:
        return  # nothing to write, or no slot to write it to
    device = k_cache.device
    if isinstance(cache_seqlens, torch.Tensor):
        start = cache_seqlens.to(torch.int64)[:, None]
    else:
        start = min(max(int(cache_seqlens), 0), capacity)  # a host int: clamped here (no int64 overflow)
    pos = (start + torch.arange(seqlen_new, device=device)).clamp_(0, capacity - 1).expand(batch, seqlen_new)
    if page_table is None:
        first, row = torch.arange(batch, device=device)[:, None].expand(batch, seqlen_new), pos
    else:
        page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
        first = page_table.gather(1, pos // page_size).to(torch.int64).clamp_(0, num_pages - 1)
        row = pos % page_size
    index = (first.reshape(-1), row.reshape(-1))
    k_cache.index_put_(index, k.reshape(batch * seqlen_new, *k.shape[2:]))
    v_cache.index_put_(index, v.reshape(batch * seqlen_new, *v.shape[2:]))
