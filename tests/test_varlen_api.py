"""flash_attn_varlen_func on the CPU: what reaches the kernel and what comes back, with a
reference stand-in for the kernel (as tests/test_validation.py does for flash_attn_func).

The argument rules themselves are tests/test_varlen_args.py's; here, the call's plumbing: the
score features' resolution per longest sequence, the empty cases, the output layouts, grad and
torch.compile.
"""

import math
import types

import pytest
import torch

from hopper_fmha import flash_attn_varlen_func, interface
from hopper_fmha.reference import reference_varlen

pytestmark = pytest.mark.cpu

LENGTHS_Q = [5, 0, 17, 1, 9]
LENGTHS_K = [7, 3, 17, 0, 30]


def packed(lengths_q=LENGTHS_Q, lengths_k=LENGTHS_K, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16):
    g = torch.Generator().manual_seed(0)
    cu_q = torch.tensor([0] + list(torch.tensor(lengths_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lengths_k).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, head_dim, generator=g).to(dtype)
    k = torch.randn(int(cu_k[-1]), kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(int(cu_k[-1]), kv_heads, head_dim, generator=g).to(dtype)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


@pytest.fixture
def cpu_kernel(monkeypatch):
    """The device check skipped and `kernels.varlen_forward` replaced by `reference_varlen`,
    which asserts the kernel's input contract and records every launch."""
    launches = []

    def varlen_forward(
        q, k, v, out, lse, softmax_scale, causal, cfg, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        seqused_k=None, *, exact_lse=True, window=None, softcap=0.0, learnable_sink=None,
    ):  # fmt: skip
        assert cfg.variant == "ws"
        assert out.shape == q.shape[:2] + v.shape[2:] and out.is_contiguous()
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
        assert not (causal and window is not None and window[1] >= 0)
        o, l = reference_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            window_size=window or (-1, -1), softcap=softcap, learnable_sink=learnable_sink,
            seqused_k=seqused_k,
        )  # fmt: skip
        out.copy_(o)
        lse.copy_(l)
        launches.append(dict(causal=causal, cfg=cfg, window=window, softcap=softcap, sink=learnable_sink,
                             exact_lse=exact_lse, seqused_k=seqused_k))  # fmt: skip

    monkeypatch.setattr(interface, "_check_device", lambda q, k, v: None)
    monkeypatch.setattr(interface, "_kernels", types.SimpleNamespace(varlen_forward=varlen_forward))
    return launches


@pytest.mark.parametrize(
    "causal,window,softcap,sink",
    [
        (False, (-1, -1), 0.0, False),
        (True, (-1, -1), 0.0, False),
        (False, (4, 2), 0.0, False),
        (True, (6, -1), 0.0, False),
        (False, (-1, -1), 5.0, True),
        (True, (3, -1), 2.0, True),
    ],
)
def test_matches_the_reference_per_sequence(cpu_kernel, causal, window, softcap, sink):
    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    sink_t = torch.linspace(-1, 1, 4) if sink else None
    out, lse = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window, softcap=softcap,
        learnable_sink=sink_t, return_lse=True,
    )  # fmt: skip
    ref_out, ref_lse = reference_varlen(
        q, k, v, cu_q, cu_k, causal=causal, window_size=window, softcap=softcap, learnable_sink=sink_t
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (4, q.shape[0]) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out.to(q.dtype), rtol=0, atol=1e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
    # The sequence with no keys (index 3): out 0, lse -inf, or the sink.
    rows = slice(int(cu_q[3]), int(cu_q[4]))
    assert torch.equal(out[rows], torch.zeros_like(out[rows]))
    expected = sink_t[:, None] if sink else torch.tensor(-math.inf)
    assert torch.equal(lse[:, rows], expected.expand_as(lse[:, rows]))
    (launch,) = cpu_kernel
    assert launch["exact_lse"] is True


def test_window_sides_are_resolved_on_the_longest_sequences(cpu_kernel):
    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    # left >= max_seqlen_k - 1 = 29 and right >= max_seqlen_q - 1 = 16: no window at all.
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(29, 16))
    assert cpu_kernel[-1]["window"] is None and cpu_kernel[-1]["causal"] is False
    # A right limit 0 is causal's mask.
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(5, 0))
    assert cpu_kernel[-1]["causal"] is True and cpu_kernel[-1]["window"] == (5, -1)
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(28, 16))
    assert cpu_kernel[-1]["window"] == (28, -1)


def test_seqused_k_reaches_the_kernel(cpu_kernel):
    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    used = torch.tensor([7, 1, 10, 0, 25], dtype=torch.int32)
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k=used, return_lse=True)
    ref_out, ref_lse = reference_varlen(q, k, v, cu_q, cu_k, seqused_k=used)
    torch.testing.assert_close(out, ref_out.to(q.dtype), rtol=0, atol=1e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
    assert cpu_kernel[0]["seqused_k"] is used


@pytest.mark.parametrize("lengths_q,lengths_k", [([0, 0], [3, 4]), ([2, 3], [0, 0])], ids=["no-q", "no-k"])
def test_empty_sides_launch_nothing(cpu_kernel, lengths_q, lengths_k):
    q, k, v, cu_q, cu_k, max_q, max_k = packed(lengths_q, lengths_k)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, learnable_sink=sink, return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, sink[:, None].expand_as(lse))
    assert cpu_kernel == []


def test_head_dims_follow_the_rule(cpu_kernel):
    q, k, v, cu_q, cu_k, max_q, max_k = packed(head_dim=64)
    with pytest.raises(ValueError, match=r"head_dim_v \(v's\) must be <= head_dim"):
        flash_attn_varlen_func(q[..., :32], k[..., :32], v, cu_q, cu_k, max_q, max_k)
    q, k, v, cu_q, cu_k, max_q, max_k = packed(head_dim=100)
    with pytest.raises(ValueError, match=r"head_dim must be a multiple of 8"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k)
    assert cpu_kernel == []


def test_v_head_dim_may_be_smaller(cpu_kernel):
    q, k, _, cu_q, cu_k, max_q, max_k = packed(head_dim=192)
    v = packed(head_dim=128)[2]
    out, lse = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True)
    assert out.shape == (q.shape[0], 4, 128)
    ref_out, ref_lse = reference_varlen(q, k, v, cu_q, cu_k, causal=True)
    torch.testing.assert_close(out, ref_out.to(q.dtype), rtol=0, atol=1e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
    assert cpu_kernel[0]["cfg"].kernel_dims == (192, 128)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale must be finite and > 0"),
        (dict(causal=1), TypeError, "causal must be a bool"),
        (dict(window_size=(-3, 0)), ValueError, "window_size left must be >= -1"),
        (dict(softcap=-0.5), ValueError, "softcap must be a finite float >= 0"),
        (dict(learnable_sink=torch.zeros(2)), ValueError, r"learnable_sink must have shape \(heads,\)"),
    ],
    ids=["scale", "causal", "window", "softcap", "sink"],
)
def test_the_shared_rules_apply(cpu_kernel, kwargs, error, match):
    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    with pytest.raises(error, match=match):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)
    assert cpu_kernel == []


def test_bad_offsets_are_refused_before_any_launch(cpu_kernel):
    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        flash_attn_varlen_func(q, k, v, cu_q + 1, cu_k, max_q, max_k)
    with pytest.raises(ValueError, match="max_seqlen_k must be >= the longest k sequence"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k - 1)
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k.long(), max_q, max_k)
    assert cpu_kernel == []


@pytest.fixture
def cpu_backward(monkeypatch):
    """`kernels.sm90_bwd.backward_varlen` replaced by its contract: per sequence, the dense one of
    `test_autograd.dense_backward` (float64 from the forward's lse), and the sink's gradient by
    `backward.sink_gradient`; records each call's arguments."""
    sm90_bwd = pytest.importorskip("hopper_fmha.kernels.sm90_bwd")  # the op imports it
    from test_autograd import dense_backward

    from hopper_fmha import backward

    calls = []

    def backward_varlen(q, k, v, out, dout, lse, cu_q, cu_k, max_q, max_k, scale, causal, *, dlse,
                        deterministic, window_size, softcap, learnable_sink):  # fmt: skip
        calls.append(dict(causal=causal, window=window_size, softcap=softcap, det=deterministic, dlse=dlse,
                          sink=learnable_sink, max=(max_q, max_k)))  # fmt: skip
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for b in range(cu_q.numel() - 1):
            rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
            seq_dlse = None if dlse is None else dlse[None, :, rq]
            dq[rq], dk[rk], dv[rk] = (
                g[0]
                for g in dense_backward(
                    q[None, rq],
                    k[None, rk],
                    v[None, rk],
                    out[None, rq],
                    dout[None, rq],
                    lse[None, :, rq],
                    seq_dlse,
                    scale,
                    causal,
                    window_size,
                    softcap,
                )  # fmt: skip
            )
        if learnable_sink is None:
            return dq, dk, dv
        delta = backward.row_delta(out[None], dout[None], None if dlse is None else dlse[None])
        return dq, dk, dv, backward.sink_gradient(lse[None], delta, learnable_sink)

    monkeypatch.setattr(sm90_bwd, "backward_varlen", backward_varlen)
    return calls


@pytest.mark.parametrize(
    "causal,window,softcap,sink",
    [(False, (-1, -1), 0.0, False), (True, (-1, -1), 0.0, False), (False, (4, 2), 0.0, False),
     (True, (3, -1), 2.0, True)],
)  # fmt: skip
def test_gradients_through_the_varlen_op(cpu_kernel, cpu_backward, causal, window, softcap, sink):
    # flash_attn_varlen_func is differentiable: the forward runs with the exact LSE through the
    # `hopper_fmha::varlen_fwd` op, whose backward (`hopper_fmha::varlen_bwd`) gets the resolved
    # features, dLSE and deterministic; the gradients (the sink's too) are the reference's.
    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sink_t = torch.linspace(-1, 1, 4).requires_grad_() if sink else None
    out, lse = flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window, softcap=softcap,
        learnable_sink=sink_t, return_lse=True, deterministic=True,
    )  # fmt: skip
    assert out.grad_fn is not None and cpu_kernel[-1]["exact_lse"] is True
    g = torch.Generator().manual_seed(1)
    dout, dlse = torch.randn(out.shape, generator=g).to(out.dtype), torch.randn(lse.shape, generator=g)
    ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
    (call,) = cpu_backward
    assert call["det"] is True and call["max"] == (max_q, max_k) and call["dlse"] is not None
    assert call["window"] == ((cpu_kernel[-1]["window"] or (-1, -1)) if window != (-1, -1) else (-1, -1))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sink_leaf = sink_t.detach().double().requires_grad_() if sink else None
    o, l = reference_varlen(
        *leaves, cu_q, cu_k, causal=causal, window_size=window, softcap=softcap, learnable_sink=sink_leaf,
        dtype=torch.float64,
    )  # fmt: skip
    ref = torch.autograd.grad(
        (o * dout.double()).sum() + (l * dlse.double()).sum(), leaves + ([sink_leaf] if sink else [])
    )
    for name, ours, r in zip("qkv", (q.grad, k.grad, v.grad), ref, strict=False):
        torch.testing.assert_close(ours.double(), r, rtol=1e-2, atol=1e-2, msg=name)
    if sink:
        torch.testing.assert_close(sink_t.grad.double(), ref[3], rtol=1e-3, atol=1e-3)


def test_varlen_backward_refuses_what_it_does_not_serve(cpu_kernel, monkeypatch):
    monkeypatch.setattr(interface.backward, "WIDE_BACKWARD", False)  # d192: refused with it off
    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    used = torch.tensor([5, 0, 10, 0, 9], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="does not support seqused_k"):
        flash_attn_varlen_func(q.requires_grad_(), k, v, cu_q, cu_k, max_q, max_k, seqused_k=used)
    qq, kk, vv, *_ = packed(head_dim=192)
    with pytest.raises(NotImplementedError, match="head dims up to 128"):
        flash_attn_varlen_func(qq.requires_grad_(), kk, vv, cu_q, cu_k, max_q, max_k)
    assert cpu_kernel == []  # refused before the forward
    with torch.no_grad():
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k=used)
    assert len(cpu_kernel) == 1


def test_torch_compile_traces_the_op(cpu_kernel):
    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    compiled = torch.compile(
        lambda q, k, v, cu_q, cu_k: flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, causal=True, window_size=(4, -1), return_lse=True
        ),
        fullgraph=True,
        backend="aot_eager",
    )
    out, lse = compiled(q, k, v, cu_q, cu_k)
    ref_out, ref_lse = reference_varlen(q, k, v, cu_q, cu_k, causal=True, window_size=(4, -1))
    torch.testing.assert_close(out, ref_out.to(q.dtype), rtol=0, atol=1e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
    assert cpu_kernel[-1]["window"] == (4, -1)


def test_torch_compile_traces_the_backward(cpu_kernel, cpu_backward):
    # fullgraph=True through the varlen forward op and its backward op: the same gradients as eager.
    q, k, v, cu_q, cu_k, max_q, max_k = packed()
    proj = torch.nn.Linear(64, 64).to(torch.float16)

    def f(q, k, v):
        out = flash_attn_varlen_func(
            proj(q), k, v, cu_q, cu_k, max_q, max_k, causal=True, window_size=(4, -1)
        )
        return out.float().square().sum()

    eager = torch.autograd.grad(f(q, k, v), proj.parameters())
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    grads = torch.autograd.grad(compiled(q, k, v), proj.parameters())
    for g, e in zip(grads, eager, strict=True):
        torch.testing.assert_close(g, e)
    assert len(cpu_backward) == 2 and cpu_backward[-1]["window"] == (4, -1)
