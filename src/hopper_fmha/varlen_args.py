"""Argument checks specific to `flash_attn_varlen_func` (packed variable-length batches).

The sequences of a batch are packed along the first dim: q is (total_q, heads, head_dim), k is
(total_k, kv_heads, head_dim), v is (total_k, kv_heads, head_dim_v), and sequence b of q is
q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] (likewise k and v with cu_seqlens_k). cu_seqlens_q and
cu_seqlens_k are int32 tensors of length batch + 1 on q's device; seqused_k, if given, is an int32
tensor of length batch that says how many keys of sequence b are used (the first seqused_k[b]).
max_seqlen_q and max_seqlen_k are Python ints bounding the sequence lengths: the grid is sized
from them, so a value below the real longest length would leave rows uncomputed.

`check_varlen` checks the metadata (types, dtypes, ranks, shapes, devices), which costs nothing,
and, with check_values, the values of cu_seqlens_q, cu_seqlens_k and seqused_k, which live on the
device and cost one device-to-host copy. Such a copy is impossible while a CUDA graph is being
captured and breaks the graph under torch.compile, so the caller passes `varlen_values_checkable()`
as check_values: in those cases the values are NOT checked, and the kernel must stay in bounds
anyway (it must never read or write outside q, k, v, out or lse whatever the offsets hold). The
environment's HOPPER_FMHA_CHECK_VALUES=0 skips the copy in eager calls too: the copy waits for the
GPU to reach the call, so a loop of eager calls (a decode step per call) cannot queue work ahead of
the GPU (H200, session 34, B64 L8192 decode: 0.57 ms per eager call with the copy against 0.48 ms
of kernel time). Bad values then go unreported, as under capture.

The head-dim rules (supported sizes, head_dim_v against head_dim), the other arguments and the
CUDA device rules are checked elsewhere, as for `flash_attn_func`.
"""

from __future__ import annotations

import numbers
import os
from typing import NamedTuple

import torch

_DTYPES = (torch.float16, torch.bfloat16)


class VarlenShape(NamedTuple):
    batch: int
    total_q: int
    total_k: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    max_seqlen_q: int
    max_seqlen_k: int


def varlen_values_checkable() -> bool:
    """Whether `check_varlen` may copy the cu_seqlens values to the host (its check_values).

    False under torch.compile, while a CUDA graph is being captured on the current stream, and
    where the environment sets HOPPER_FMHA_CHECK_VALUES=0 (read on every call).
    """
    if os.environ.get("HOPPER_FMHA_CHECK_VALUES") == "0" or torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_k=None,
    *,
    check_values: bool = True,
) -> VarlenShape:
    """The varlen rules, in the order they are checked; raises for the first one broken.

    TypeError for a wrong type or dtype, ValueError for a wrong shape, device or value.
    """
    _qkv_rules(q, k, v)
    total_q, heads, head_dim = q.shape
    total_k, kv_heads, head_dim_v = v.shape
    cu_seqlens = (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    for name, t in cu_seqlens:
        _int32_vector(name, t)
        if t.shape[0] < 1:
            raise ValueError(f"{name} must have length batch + 1 >= 1, got length 0")
    if cu_seqlens_k.shape[0] != cu_seqlens_q.shape[0]:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), "
            f"got {cu_seqlens_q.shape[0]} and {cu_seqlens_k.shape[0]}"
        )
    for name, t in cu_seqlens:
        _same_device(name, t, q)
    batch = cu_seqlens_q.shape[0] - 1
    if seqused_k is not None:
        _int32_vector("seqused_k", seqused_k)
        if seqused_k.shape[0] != batch:
            raise ValueError(f"seqused_k must have length batch = {batch}, got {seqused_k.shape[0]}")
        _same_device("seqused_k", seqused_k, q)
    max_seqlen_q = _nonnegative_int("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _nonnegative_int("max_seqlen_k", max_seqlen_k)
    if check_values:
        _value_rules(
            cu_seqlens_q, cu_seqlens_k, seqused_k, batch, total_q, total_k, max_seqlen_q, max_seqlen_k
        )
    return VarlenShape(
        batch, total_q, total_k, heads, kv_heads, head_dim, head_dim_v, max_seqlen_q, max_seqlen_k
    )


def _qkv_rules(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must have rank 3 (total, heads, head_dim) in varlen, got shape {tuple(t.shape)}"
            )
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"k and v must have the same (total_k, kv_heads), "
            f"got {tuple(k.shape[:2])} and {tuple(v.shape[:2])}"
        )
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[2]} and {k.shape[2]}")
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(
            f"heads of q must be a multiple of the kv heads of k/v (>= 1), "
            f"got heads={heads}, kv_heads={kv_heads}"
        )


def _int32_vector(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.dim() != 1:
        raise ValueError(f"{name} must have rank 1, got shape {tuple(t.shape)}")


def _same_device(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    if t.device != q.device:
        raise ValueError(f"{name} must be on the same device as q, got {t.device} and q on {q.device}")


def _nonnegative_int(name: str, x) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int (pass a Python int, not a tensor), got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{name} must be >= 0, got {x}")
    return int(x)


def _value_rules(
    cu_seqlens_q, cu_seqlens_k, seqused_k, batch, total_q, total_k, max_seqlen_q, max_seqlen_k
) -> None:
    """The rules on the values of cu_seqlens_q, cu_seqlens_k and seqused_k, read in one copy."""
    tensors = [cu_seqlens_q, cu_seqlens_k] + ([seqused_k] if seqused_k is not None else [])
    values = torch.cat(tensors).tolist()  # the one device-to-host copy
    n = batch + 1
    cu = {"q": values[:n], "k": values[n : 2 * n]}
    total = {"q": total_q, "k": total_k}
    max_seqlen = {"q": max_seqlen_q, "k": max_seqlen_k}
    for t in "qk":
        if cu[t][0] != 0:
            raise ValueError(f"cu_seqlens_{t} must start at 0, got cu_seqlens_{t}[0] = {cu[t][0]}")
    lengths = {t: [cu[t][b + 1] - cu[t][b] for b in range(batch)] for t in "qk"}
    for t in "qk":
        for b, length in enumerate(lengths[t]):
            if length < 0:
                raise ValueError(
                    f"cu_seqlens_{t} must be non-decreasing, got a negative length {length} for batch "
                    f"index {b}: cu_seqlens_{t}[{b}] = {cu[t][b]} > cu_seqlens_{t}[{b + 1}] = {cu[t][b + 1]}"
                )
    for t in "qk":
        if cu[t][-1] > total[t]:
            raise ValueError(
                f"cu_seqlens_{t}[-1] must be <= total_{t} = {t}.shape[0] (the offsets must lie inside "
                f"{t}), got {cu[t][-1]} > {total[t]}"
            )
    for t in "qk":
        longest = max(lengths[t], default=0)
        if max_seqlen[t] < longest:
            raise ValueError(
                f"max_seqlen_{t} must be >= the longest {t} sequence, {longest}, got {max_seqlen[t]}; "
                f"a smaller max_seqlen_{t} would leave rows uncomputed"
            )
    used_k = values[2 * n :]  # empty without seqused_k
    for b, used in enumerate(used_k):
        length = lengths["k"][b]
        if not 0 <= used <= length:
            raise ValueError(
                f"seqused_k[{b}] must be in [0, {length}] (the length of k sequence {b}), got {used}"
            )
