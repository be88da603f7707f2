"""The reference against PyTorch's own attention, and the masking conventions written out by hand."""

import math

import pytest
import torch
import torch.nn.functional as F

from hopper_fmha import reference as reference_module
from hopper_fmha.reference import reference

pytestmark = pytest.mark.cpu

# Both sides compute in fp64 on CPU: they differ only by summation order, a few ulps of 1.0.
FP64 = dict(rtol=1e-12, atol=1e-12)


def qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=g, dtype=dtype)
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=g, dtype=dtype)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=g, dtype=dtype)
    return q, k, v


def sdpa(q, k, v, scale, is_causal=False, attn_mask=None):
    """torch SDPA on BSHD tensors, kv heads repeated for GQA."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return out.transpose(1, 2)


def scaled_scores(q, k, scale):
    """(B, H, Sq, Sk) scale * q k^T with kv heads repeated."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return scale * torch.einsum("bqhd,bkhd->bhqk", q, k)


# (seqlen_q, seqlen_k, heads, kv_heads): odd lengths; MHA, GQA (4:2) and MQA (4:1).
SHAPES = [(1, 1, 2, 2), (113, 203, 4, 2), (203, 113, 4, 1), (128, 128, 4, 4)]


@pytest.mark.parametrize("seqlen_q,seqlen_k,heads,kv_heads", SHAPES)
def test_matches_sdpa_non_causal(seqlen_q, seqlen_k, heads, kv_heads):
    q, k, v = qkv(2, seqlen_q, seqlen_k, heads, kv_heads, 32)
    out, lse = reference(q, k, v, softmax_scale=0.3, dtype=torch.float64)
    torch.testing.assert_close(out, sdpa(q, k, v, 0.3), **FP64)
    torch.testing.assert_close(lse, torch.logsumexp(scaled_scores(q, k, 0.3), dim=-1), **FP64)


@pytest.mark.parametrize("seqlen,heads,kv_heads", [(1, 2, 2), (113, 4, 2), (203, 4, 1)])
def test_matches_sdpa_causal_square(seqlen, heads, kv_heads):
    # With seqlen_q == seqlen_k, bottom-right and SDPA's top-left causal masks coincide.
    q, k, v = qkv(2, seqlen, seqlen, heads, kv_heads, 32)
    out, lse = reference(q, k, v, causal=True, dtype=torch.float64)
    scale = 32**-0.5
    torch.testing.assert_close(out, sdpa(q, k, v, scale, is_causal=True), **FP64)
    scores = scaled_scores(q, k, scale).masked_fill(torch.ones(seqlen, seqlen).triu(1).bool(), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), **FP64)


# Bottom-right alignment written out: row i sees key j iff j <= i + seqlen_k - seqlen_q.
VISIBLE = {
    (2, 5): [
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ],
    (5, 2): [
        [0, 0],
        [0, 0],
        [0, 0],
        [1, 0],
        [1, 1],
    ],
}


@pytest.mark.parametrize("seqlen_q,seqlen_k", list(VISIBLE))
def test_bottom_right_causal_mask(seqlen_q, seqlen_k):
    visible = torch.tensor(VISIBLE[(seqlen_q, seqlen_k)], dtype=torch.bool)
    q, k, v = qkv(1, seqlen_q, seqlen_k, 2, 1, 16)
    out, lse = reference(q, k, v, causal=True, dtype=torch.float64)
    scores = scaled_scores(q, k, 16**-0.5).masked_fill(~visible, -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), **FP64)
    seen = visible.any(dim=1)
    expected = sdpa(q[:, seen], k, v, 16**-0.5, attn_mask=visible[seen])
    torch.testing.assert_close(out[:, seen], expected, **FP64)
    assert torch.equal(out[:, ~seen], torch.zeros_like(out[:, ~seen]))


def test_bottom_right_causal_values():
    # q = 0 makes every score 0: each row averages the values of the keys it sees, and its lse
    # is log(number of keys seen). v[j] = j + 1.
    v = torch.arange(1.0, 6.0, dtype=torch.float64).view(1, 5, 1, 1).expand(1, 5, 1, 2)
    out, lse = reference(torch.zeros(1, 2, 1, 2, dtype=torch.float64), v, v, causal=True, dtype=torch.float64)
    torch.testing.assert_close(out[0, :, 0, 0], torch.tensor([2.5, 3.0], dtype=torch.float64), **FP64)
    torch.testing.assert_close(
        lse[0, 0], torch.tensor([math.log(4), math.log(5)], dtype=torch.float64), **FP64
    )

    v = v[:, :2]
    out, lse = reference(torch.zeros(1, 5, 1, 2, dtype=torch.float64), v, v, causal=True, dtype=torch.float64)
    torch.testing.assert_close(
        out[0, :, 0, 0], torch.tensor([0.0, 0.0, 0.0, 1.0, 1.5], dtype=torch.float64), **FP64
    )
    expected_lse = torch.tensor([-math.inf, -math.inf, -math.inf, 0.0, math.log(2)], dtype=torch.float64)
    torch.testing.assert_close(lse[0, 0], expected_lse, **FP64)


def test_no_keys():
    q, k, v = qkv(2, 3, 0, 4, 2, 16)
    out, lse = reference(q, k, v, dtype=torch.float64)
    assert torch.equal(out, torch.zeros_like(q))
    assert torch.equal(lse, torch.full((2, 4, 3), -math.inf, dtype=torch.float64))


def test_query_chunks_match_one_block(monkeypatch):
    # Large problems are split into query-row chunks; force that on a small one.
    q, k, v = qkv(2, 203, 113, 4, 2, 16)
    whole = reference(q, k, v, causal=True, dtype=torch.float64)
    monkeypatch.setattr(reference_module, "MAX_SCORE_ELEMENTS", 4 * 113 * 50)  # 50-row chunks
    chunked = reference(q, k, v, causal=True, dtype=torch.float64)
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, **FP64)


def test_low_precision_inputs_computed_in_fp32():
    q, k, v = qkv(1, 64, 64, 2, 2, 64, dtype=torch.float16)
    out, lse = reference(q, k, v)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    out64, lse64 = reference(q, k, v, dtype=torch.float64)
    # fp32 accumulation over d=64 and N=64 terms of O(1) values: errors of a few fp32 ulps.
    torch.testing.assert_close(out, out64.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, lse64.float(), rtol=1e-5, atol=1e-6)


def test_rejects_low_precision_compute():
    q, k, v = qkv(1, 4, 4, 1, 1, 16)
    with pytest.raises(ValueError, match=r"float32 or torch.float64, got torch.float16"):
        reference(q, k, v, dtype=torch.float16)
