"""Exact attention on any device: the ground truth for tests, the demo and the benchmarks.

Same semantics as `hopper_fmha.flash_attn_func`: BSHD layout, bottom-right aligned causal mask,
GQA/MQA, and a query row that sees no key gives out = 0 and lse = -inf.
"""

from __future__ import annotations

import math

import torch

from hopper_fmha.config import default_softmax_scale

# Largest score block (elements) materialized at once: 2**27 fp32 scores are 512 MiB, so a
# GPU reference at N=16384 runs in query-row chunks instead of one 32 GiB-per-head matrix.
MAX_SCORE_ELEMENTS = 2**27


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention computed in `dtype` (float32 or float64) on q's device.

    q: (B, Sq, H, D); k, v: (B, Sk, Hkv, D) with H % Hkv == 0.
    Returns out (B, Sq, H, D) and lse (B, H, Sq), both in `dtype`.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    batch, seqlen_q, heads, head_dim = q.shape
    _, seqlen_k, kv_heads, _ = k.shape
    scale = default_softmax_scale(head_dim) if softmax_scale is None else float(softmax_scale)

    out = torch.zeros((batch, seqlen_q, heads, head_dim), dtype=dtype, device=q.device)
    lse = torch.full((batch, heads, seqlen_q), -math.inf, dtype=dtype, device=q.device)
    if out.numel() == 0 or seqlen_k == 0:
        return out, lse
    group = heads // kv_heads
    rows = max(1, MAX_SCORE_ELEMENTS // (heads * seqlen_k))
    key_idx = torch.arange(seqlen_k, device=q.device)

    for b in range(batch):
        kb = k[b].to(dtype).transpose(0, 1)[:, None]  # (Hkv, 1, Sk, D)
        vb = v[b].to(dtype).transpose(0, 1)[:, None]
        for start in range(0, seqlen_q, rows):
            stop = min(start + rows, seqlen_q)
            # (Hkv, group, rows, D): q head h = kv_head * group + g, so h // group is its kv head.
            qc = q[b, start:stop].to(dtype).transpose(0, 1).reshape(kv_heads, group, stop - start, head_dim)
            s = torch.matmul(qc, kb.transpose(-1, -2)) * scale  # (Hkv, group, rows, Sk)
            if causal:
                query_idx = torch.arange(start, stop, device=q.device)
                hidden = key_idx[None, :] > query_idx[:, None] + (seqlen_k - seqlen_q)
                s.masked_fill_(hidden, -math.inf)
            row_max = s.amax(dim=-1, keepdim=True)
            # Rows with every key hidden have max -inf: shift by 0 so exp gives 0 instead of nan.
            row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
            p = torch.exp(s - row_max)
            row_sum = p.sum(dim=-1, keepdim=True)
            o = torch.matmul(p, vb) / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
            out[b, start:stop] = o.reshape(heads, stop - start, head_dim).transpose(0, 1)
            lse[b, :, start:stop] = (row_max + torch.log(row_sum)).reshape(heads, stop - start)
    return out, lse
