"""The reference's forward features (window, softcap, learnable sink, dv != d, varlen) against a naive
dense implementation written here, and the mask rules written out by hand."""

import math
import random

import pytest
import torch

from hopper_fmha import reference as reference_module
from hopper_fmha.reference import reference, reference_varlen

pytestmark = [pytest.mark.cpu, pytest.mark.usefixtures("one_torch_thread")]

# Both sides compute in fp64 on CPU: they differ only by summation order.
FP64 = dict(rtol=1e-12, atol=1e-12)


def qkv(batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, head_dim_v=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seqlen_k, kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seqlen_k, kv_heads, head_dim_v or head_dim, generator=g, dtype=torch.float64)
    return q, k, v


def sinks(heads, seed=0):
    return 2 * torch.randn(heads, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)


def naive(q, k, v, scale, causal=False, window=(-1, -1), softcap=0.0, sink=None):
    """Dense fp64 attention: the whole (B, H, Sq, Sk) score matrix, hidden scores set to -inf, and the
    softmax taken explicitly over the scores with the sink appended as one more column (no value)."""
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    k = k.repeat_interleave(heads // kv_heads, dim=2)
    v = v.repeat_interleave(heads // kv_heads, dim=2)
    s = scale * torch.einsum("bqhd,bkhd->bhqk", q, k)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    left, right = window[0], 0 if causal else window[1]
    i = torch.arange(seqlen_q)[:, None]
    j = torch.arange(seqlen_k)[None, :]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if left != -1:
        visible &= j >= i + seqlen_k - seqlen_q - left
    if right != -1:
        visible &= j <= i + seqlen_k - seqlen_q + right
    s = s.masked_fill(~visible, -math.inf)
    # The sink column; without a sink, a column of -inf (exp gives 0), so that seqlen_k = 0 has a column.
    sink_col = torch.full((heads,), -math.inf, dtype=s.dtype) if sink is None else sink
    s = torch.cat([s, sink_col.view(1, heads, 1, 1).expand(batch, heads, seqlen_q, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - m)
    p = (e / e.sum(dim=-1, keepdim=True)).nan_to_num(0.0)  # a row of -inf only: nan -> 0
    out = torch.einsum("bhqk,bkhd->bqhd", p[..., :seqlen_k], v)
    return out, lse


# (seqlen_q, seqlen_k, heads, kv_heads, head_dim, head_dim_v, causal, window, softcap, sink)
CASES = [
    (113, 203, 4, 2, 16, 16, False, (17, 5), 0.0, False),
    (203, 113, 4, 1, 16, 16, False, (17, 5), 0.0, False),
    (113, 203, 2, 2, 16, 16, False, (0, 0), 0.0, False),
    (113, 203, 4, 2, 16, 16, False, (0, -1), 0.0, False),  # one-sided: left only
    (203, 113, 4, 2, 16, 16, False, (-1, 0), 0.0, False),  # causal written as a window
    (203, 113, 4, 2, 16, 16, False, (-1, 3), 0.0, False),  # one-sided: right only
    (113, 203, 3, 1, 16, 16, True, (9, -1), 0.0, False),  # causal + window: right = 0, left kept
    (113, 203, 3, 1, 16, 16, True, (9, 40), 0.0, False),  # causal overrides right = 40
    (203, 113, 4, 2, 16, 16, False, (-1, -1), 1.5, False),  # softcap
    (113, 203, 4, 2, 16, 16, True, (-1, -1), 0.7, True),  # softcap + causal + sink
    (203, 113, 4, 4, 16, 16, False, (-1, -1), 0.0, True),  # sink
    (203, 113, 4, 2, 16, 16, True, (30, -1), 0.0, True),  # sink with rows that see no key
    (113, 203, 4, 1, 192, 128, False, (-1, -1), 0.0, False),  # dv != d
    (203, 113, 4, 2, 192, 128, True, (25, -1), 2.0, True),  # dv != d with every feature
    (1, 1, 2, 1, 16, 16, False, (0, 0), 0.0, True),
    (3, 3, 2, 2, 16, 8, True, (1, -1), 1.0, True),
    (1, 203, 2, 2, 16, 16, False, (5, 5), 0.0, False),
    (203, 1, 2, 2, 16, 16, False, (3, 3), 0.0, True),
]


def random_cases(n, seed):
    """Random windows: each side -1, 0, small or beyond the sequence; causal, softcap and sink mixed in."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        seqlen_q, seqlen_k = rng.choice([(1, 3), (3, 1), (113, 203), (203, 113), (64, 64), (3, 113)])
        heads, kv_heads = rng.choice([(2, 2), (4, 2), (3, 1)])
        longest = max(seqlen_q, seqlen_k)
        window = tuple(rng.choice([-1, 0, rng.randint(1, 9), rng.randint(10, longest + 10)]) for _ in "lr")
        cases.append(
            (seqlen_q, seqlen_k, heads, kv_heads, 16, rng.choice([16, 8]), rng.random() < 0.3, window)
            + (rng.choice([0.0, 0.0, 1.3]), rng.random() < 0.5)
        )
    return cases


def _case_id(case):
    sq, sk, h, hkv, d, dv, causal, window, softcap, sink = case
    return (
        f"{sq}x{sk}-h{h}:{hkv}-d{d}:{dv}-{'causal-' if causal else ''}w{window[0]},{window[1]}-cap{softcap}"
        + ("-sink" if sink else "")
    )


@pytest.mark.parametrize("case", CASES + random_cases(40, seed=1), ids=_case_id)
def test_matches_naive(case):
    seqlen_q, seqlen_k, heads, kv_heads, head_dim, head_dim_v, causal, window, softcap, with_sink = case
    seed = hash(case) % 2**31
    q, k, v = qkv(2, seqlen_q, seqlen_k, heads, kv_heads, head_dim, head_dim_v, seed=seed)
    sink = sinks(heads, seed) if with_sink else None
    out, lse = reference(
        q, k, v, 0.5, causal, torch.float64, window_size=window, softcap=softcap, learnable_sink=sink
    )
    expected_out, expected_lse = naive(q, k, v, 0.5, causal, window, softcap, sink)
    assert out.shape == (2, seqlen_q, heads, head_dim_v) and lse.shape == (2, heads, seqlen_q)
    torch.testing.assert_close(out, expected_out, **FP64)
    torch.testing.assert_close(lse, expected_lse, **FP64)  # -inf where the naive one has it


# The window rule written out: row i sees key j iff i + Sk - Sq - left <= j <= i + Sk - Sq + right.
# (seqlen_q, seqlen_k, causal, window) -> visible[i][j]
WINDOWS = {
    (4, 6, False, (1, 1)): [  # offset 2: row i sees i+1 ..= i+3
        [0, 1, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
        [0, 0, 0, 0, 1, 1],
    ],
    (5, 3, False, (0, -1)): [  # offset -2, left only: j >= i - 2
        [1, 1, 1],
        [1, 1, 1],
        [1, 1, 1],
        [0, 1, 1],
        [0, 0, 1],
    ],
    (5, 3, True, (1, -1)): [  # causal + left 1: i - 3 <= j <= i - 2
        [0, 0, 0],
        [0, 0, 0],
        [1, 0, 0],
        [1, 1, 0],
        [0, 1, 1],
    ],
    (3, 5, False, (-1, 1)): [  # right only: j <= i + 3
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1],
    ],
    (3, 5, False, (0, 0)): [  # the diagonal key only
        [0, 0, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 0, 1],
    ],
    (3, 5, True, (-1, 5)): [  # causal sets right = 0
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
    ],
    (2, 4, False, (100, 100)): [  # windows past both ends limit nothing
        [1, 1, 1, 1],
        [1, 1, 1, 1],
    ],
}


@pytest.mark.parametrize("seqlen_q,seqlen_k,causal,window", list(WINDOWS))
def test_window_tables(seqlen_q, seqlen_k, causal, window):
    # q = 0 makes every score 0 and v = identity (dv = seqlen_k) makes out[i] the attention row
    # itself: uniform 1/n over the n keys row i sees, and lse = log(n). Also a dv != d case.
    visible = torch.tensor(WINDOWS[(seqlen_q, seqlen_k, causal, window)], dtype=torch.float64)
    q = torch.zeros(1, seqlen_q, 1, 4, dtype=torch.float64)
    k = torch.randn(1, seqlen_k, 1, 4, dtype=torch.float64)
    v = torch.eye(seqlen_k, dtype=torch.float64).view(1, seqlen_k, 1, seqlen_k)
    out, lse = reference(q, k, v, 1.0, causal, torch.float64, window_size=window)
    count = visible.sum(dim=1, keepdim=True)
    torch.testing.assert_close(out[0, :, 0], visible / count.clamp(min=1), **FP64)
    torch.testing.assert_close(lse[0, 0], count[:, 0].log(), **FP64)  # log 0 = -inf for rows without keys


def test_sink_values():
    # Scores 0: a row that sees n keys has out = sum(v) / (n + e^sink), lse = log(n + e^sink);
    # a row that sees none has out = 0 and lse = sink. Causal, seqlen_q 4 > seqlen_k 2, v[j] = j + 1.
    v = torch.tensor([1.0, 2.0], dtype=torch.float64).view(1, 2, 1, 1)
    sink = torch.tensor([math.log(3.0)], dtype=torch.float64)
    out, lse = reference(torch.zeros(1, 4, 1, 1), v, v, 1.0, True, torch.float64, learnable_sink=sink)
    expected = torch.tensor([0.0, 0.0, 1 / (1 + 3), (1 + 2) / (2 + 3)], dtype=torch.float64)
    torch.testing.assert_close(out[0, :, 0, 0], expected, **FP64)
    expected_lse = torch.tensor([math.log(3), math.log(3), math.log(4), math.log(5)], dtype=torch.float64)
    torch.testing.assert_close(lse[0, 0], expected_lse, **FP64)


def test_sink_dominates_without_overflow():
    # A sink far above the scores (exp(200) overflows fp32): out -> 0, lse -> sink, finite in fp32.
    q, k, v = qkv(1, 5, 7, 2, 2, 8)
    sink = torch.tensor([200.0, -200.0], dtype=torch.float64)
    out, lse = reference(q, k, v, dtype=torch.float32, learnable_sink=sink)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert out[:, :, 0].abs().max() < 1e-30 and torch.equal(lse[0, 0], torch.full((5,), 200.0))
    torch.testing.assert_close(out[:, :, 1], reference(q, k, v, dtype=torch.float32)[0][:, :, 1])


def test_minus_inf_sink_is_no_sink():
    q, k, v = qkv(2, 113, 37, 4, 2, 16)
    sink = torch.tensor([-math.inf, 0.5, -math.inf, 1.0], dtype=torch.float64)
    out, lse = reference(q, k, v, None, True, torch.float64, window_size=(3, -1), learnable_sink=sink)
    plain_out, plain_lse = reference(q, k, v, None, True, torch.float64, window_size=(3, -1))
    for h in (0, 2):
        torch.testing.assert_close(out[:, :, h], plain_out[:, :, h], **FP64)
        torch.testing.assert_close(lse[:, h], plain_lse[:, h], **FP64)
    assert not torch.equal(out[:, :, 1], plain_out[:, :, 1])


def test_softcap_values():
    # d = 1, scale 1: key scores are q*k = 8 and -2; capped at 4: 4 tanh(2) and 4 tanh(-0.5).
    q = torch.tensor([2.0], dtype=torch.float64).view(1, 1, 1, 1)
    k = torch.tensor([4.0, -1.0], dtype=torch.float64).view(1, 2, 1, 1)
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64).view(1, 2, 1, 2)
    out, lse = reference(q, k, v, 1.0, dtype=torch.float64, softcap=4.0)
    s = torch.tensor([4 * math.tanh(2.0), 4 * math.tanh(-0.5)], dtype=torch.float64)
    torch.testing.assert_close(out[0, 0, 0], torch.softmax(s, 0), **FP64)
    torch.testing.assert_close(lse[0, 0, 0], torch.logsumexp(s, 0), **FP64)


@pytest.mark.parametrize("with_sink", [False, True], ids=["plain", "sink"])
def test_rows_without_keys(with_sink):
    # seqlen_q 7 > seqlen_k 3, causal with left 0: row i sees key i - 4 only, so rows 0-3 see nothing.
    q, k, v = qkv(2, 7, 3, 4, 2, 16, 8)
    sink = sinks(4) if with_sink else None
    out, lse = reference(q, k, v, None, True, torch.float64, window_size=(0, -1), learnable_sink=sink)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    empty_lse = sink.view(1, 4, 1).expand(2, 4, 4) if with_sink else torch.full((2, 4, 4), -math.inf)
    torch.testing.assert_close(lse[:, :, :4], empty_lse.double(), **FP64)
    assert torch.isfinite(lse[:, :, 4:]).all()

    # No keys at all (seqlen_k = 0): the same values everywhere.
    q, k, v = qkv(2, 5, 0, 4, 2, 16, 8)
    out, lse = reference(q, k, v, dtype=torch.float64, learnable_sink=sink)
    assert torch.equal(out, torch.zeros(2, 5, 4, 8, dtype=torch.float64))
    empty_lse = sink.view(1, 4, 1).expand(2, 4, 5) if with_sink else torch.full((2, 4, 5), -math.inf)
    torch.testing.assert_close(lse, empty_lse.double(), **FP64)


def test_query_chunks_match_one_block(monkeypatch):
    q, k, v = qkv(2, 203, 113, 4, 2, 16, 24)
    kwargs = dict(window_size=(20, 7), softcap=1.1, learnable_sink=sinks(4))
    whole = reference(q, k, v, None, False, torch.float64, **kwargs)
    monkeypatch.setattr(reference_module, "MAX_SCORE_ELEMENTS", 4 * 113 * 50)  # 50-row chunks
    chunked = reference(q, k, v, None, False, torch.float64, **kwargs)
    for a, b in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b, **FP64)


def test_fp32_compute_with_features():
    q, k, v = qkv(1, 113, 203, 4, 2, 192, 128)
    kwargs = dict(window_size=(40, 3), softcap=2.0, learnable_sink=sinks(4))
    out, lse = reference(q.half(), k.half(), v.half(), **kwargs)
    out64, lse64 = reference(q.half(), k.half(), v.half(), dtype=torch.float64, **kwargs)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, out64.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, lse64.float(), rtol=1e-5, atol=1e-6)


# ---- varlen ---------------------------------------------------------------------------------------


def packed(seqlens_q, seqlens_k, heads, kv_heads, head_dim, head_dim_v, extra_k=0, seed=0):
    """Packed q, k, v and int32 cu_seqlens; extra_k rows of nan keys past cu_seqlens_k[-1]."""
    g = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(seqlens_q), sum(seqlens_k)
    q = torch.randn(total_q, heads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(total_k + extra_k, kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(total_k + extra_k, kv_heads, head_dim_v, generator=g, dtype=torch.float64)
    k[total_k:], v[total_k:] = math.nan, math.nan
    cu = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return q, k, v, cu(seqlens_q), cu(seqlens_k)


VARLEN_CASES = {  # seqlens_q, seqlens_k, seqused_k or None
    "mixed": ([5, 0, 113, 1, 64, 37], [7, 3, 90, 0, 200, 37], None),
    "seqused": ([5, 0, 113, 1, 64, 37], [7, 3, 90, 4, 200, 37], [7, 0, 41, 4, 113, 36]),
    "single": ([203], [113], None),
    "all-empty-k": ([3, 4], [0, 0], None),
}
VARLEN_FEATURES = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(9, 2)),
    "causal-window-cap-sink": dict(causal=True, window_size=(30, -1), softcap=1.5, sink=True),
    "sink": dict(sink=True),
}


@pytest.mark.parametrize("features", list(VARLEN_FEATURES))
@pytest.mark.parametrize("lengths", list(VARLEN_CASES))
def test_varlen_matches_per_sequence(lengths, features):
    seqlens_q, seqlens_k, seqused = VARLEN_CASES[lengths]
    kwargs = dict(VARLEN_FEATURES[features])
    heads, kv_heads = 4, 2
    q, k, v, cu_q, cu_k = packed(seqlens_q, seqlens_k, heads, kv_heads, 32, 16, extra_k=3)
    sink = sinks(heads) if kwargs.pop("sink", False) else None
    seqused_k = None if seqused is None else torch.tensor(seqused, dtype=torch.int32)
    if seqused is not None:  # keys past seqused_k must not be read
        for start, used, length in zip(cu_k[:-1].tolist(), seqused, seqlens_k, strict=True):
            k[start + used : start + length], v[start + used : start + length] = math.nan, math.nan
    kwargs.update(seqused_k=seqused_k, learnable_sink=sink, dtype=torch.float64)
    out, lse = reference_varlen(q, k, v, cu_q, cu_k, max(seqlens_q), None, 0.3, **kwargs)
    total_q = sum(seqlens_q)
    assert out.shape == (total_q, heads, 16) and lse.shape == (heads, total_q)  # FA's varlen LSE layout
    window = kwargs.pop("window_size", (-1, -1))
    causal = kwargs.pop("causal", False)
    softcap = kwargs.pop("softcap", 0.0)
    for b in range(len(seqlens_q)):
        qs, qe, ks = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item()
        ke = ks + (seqlens_k[b] if seqused is None else seqused[b])
        o, l = naive(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], 0.3, causal, window, softcap, sink)
        torch.testing.assert_close(out[qs:qe], o[0], **FP64)
        torch.testing.assert_close(lse[:, qs:qe], l[0], **FP64)


def test_varlen_random_lengths():
    rng = random.Random(7)
    batch = 9
    seqlens_q = [rng.choice([0, 1, rng.randint(2, 80)]) for _ in range(batch)]
    seqlens_k = [rng.choice([0, 1, rng.randint(2, 80)]) for _ in range(batch)]
    seqused = [rng.randint(0, n) for n in seqlens_k]
    q, k, v, cu_q, cu_k = packed(seqlens_q, seqlens_k, 3, 1, 16, 16, seed=3)
    kwargs = dict(causal=True, window_size=(5, -1), softcap=0.9, learnable_sink=sinks(3))
    used = torch.tensor(seqused, dtype=torch.int32)
    out, lse = reference_varlen(q, k, v, cu_q, cu_k, seqused_k=used, dtype=torch.float64, **kwargs)
    for b in range(batch):
        qs, qe, ks = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item()
        ke = ks + seqused[b]
        o, l = reference(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke], dtype=torch.float64, **kwargs)
        torch.testing.assert_close(out[qs:qe], o[0], **FP64)
        torch.testing.assert_close(lse[:, qs:qe], l[0], **FP64)


def test_varlen_empty_batch():
    q, k, v, cu_q, cu_k = packed([], [], 2, 2, 8, 4)
    out, lse = reference_varlen(q, k, v, cu_q, cu_k, learnable_sink=sinks(2))
    assert out.shape == (0, 2, 4) and lse.shape == (2, 0)


# ---- argument rules -------------------------------------------------------------------------------


def _dense_call(**kwargs):
    q, k, v = qkv(1, 4, 4, 2, 1, 8)
    args = dict(q=q, k=k, v=v)
    args.update(kwargs)
    return reference(**args)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(window_size=(-2, 0)), r"window_size left must be >= -1 \(-1 = no limit\), got -2"),
        (dict(window_size=(0, -5)), r"window_size right must be >= -1"),
        (dict(window_size=(1, 2, 3)), r"window_size must be a pair \(left, right\)"),
        (dict(softcap=-1.0), r"softcap must be a finite float >= 0 \(0 = off\), got -1.0"),
        (dict(softcap=math.nan), r"softcap must be a finite float >= 0"),
        (
            dict(learnable_sink=torch.zeros(3)),
            r"learnable_sink must have shape \(heads,\) = \(2,\), got \(3,\)",
        ),
        (
            dict(k=torch.zeros(1, 4, 3, 8), v=torch.zeros(1, 4, 3, 8)),
            r"heads \(2\) must be a multiple of kv_heads",
        ),
        (dict(k=torch.zeros(1, 4, 1, 6)), r"k must be \(B, Sk, Hkv, D\) and v \(B, Sk, Hkv, Dv\)"),
        (dict(v=torch.zeros(1, 5, 1, 8)), r"k must be \(B, Sk, Hkv, D\) and v \(B, Sk, Hkv, Dv\)"),
    ],
)
def test_dense_rules(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _dense_call(**kwargs)


def test_window_side_must_be_int():
    with pytest.raises(TypeError, match=r"window_size left must be an int, got 1.5"):
        _dense_call(window_size=(1.5, 0))


I32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731


@pytest.mark.parametrize(
    "cu_q,cu_k,extra,message",
    [
        (I32(0, 3, 7), I32(0, 5), {}, r"must both have length batch \+ 1 >= 1, got 3 and 2"),
        (I32(), I32(), {}, r"must both have length batch \+ 1 >= 1, got 0 and 0"),
        (I32(1, 7), I32(0, 5), {}, r"cu_seqlens_q must start at 0 and be non-decreasing"),
        (I32(0, 5, 3, 7), I32(0, 1, 2, 5), {}, r"cu_seqlens_q must start at 0 and be non-decreasing"),
        (I32(0, 6), I32(0, 5), {}, r"cu_seqlens_q\[-1\] = 6 must equal total_q = 7"),
        (I32(0, 8), I32(0, 5), {}, r"cu_seqlens_q\[-1\] = 8 exceeds the 7 rows"),
        (I32(0, 7), I32(0, 6), {}, r"cu_seqlens_k\[-1\] = 6 exceeds the 5 rows"),
        (torch.tensor([0.0, 7.0]), I32(0, 5), {}, r"cu_seqlens_q must be a 1-D integer tensor"),
        (I32(0, 7), I32(0, 5), dict(seqused_k=I32(1, 2)), r"seqused_k must have shape \(batch,\) = \(1,\)"),
        (I32(0, 7), I32(0, 5), dict(seqused_k=I32(6)), r"seqused_k must lie in \[0, cu_seqlens_k\[b\+1\]"),
        (I32(0, 7), I32(0, 5), dict(max_seqlen_q=6), r"max_seqlen_q = 6 is below the longest sequence \(7\)"),
        (I32(0, 7), I32(0, 5), dict(max_seqlen_k=4), r"max_seqlen_k = 4 is below the longest sequence \(5\)"),
        (I32(0, 7), I32(0, 5), dict(window_size=(-3, -1)), r"window_size left must be >= -1"),
        (I32(0, 7), I32(0, 5), dict(dtype=torch.float16), r"float32 or torch.float64, got torch.float16"),
    ],
)
def test_varlen_rules(cu_q, cu_k, extra, message):
    q, k, v, _, _ = packed([7], [5], 2, 1, 8, 8)
    with pytest.raises(ValueError, match=message):
        reference_varlen(q, k, v, cu_q, cu_k, **extra)


def test_varlen_accepts_max_seqlen_bounds_and_spare_keys():
    q, k, v, cu_q, cu_k = packed([7, 2], [5, 1], 2, 1, 8, 8, extra_k=4)  # 4 nan keys never read
    out, lse = reference_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=100, max_seqlen_k=5, seqused_k=I32(3, 1))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
