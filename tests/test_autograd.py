"""flash_attn_func's gradients, on CPU: the autograd plumbing (`hopper_fmha.backward`) with the
kernels replaced by stand-ins.

The forward stand-in is `reference` (as in test_validation.py); the backward stand-in takes what
the backward kernel takes (q, k, v, out, dout, lse, dlse) and computes the FlashAttention backward
densely in float64 from them, through `backward.row_delta` as the kernel's host code does, so the
tests check the op wiring, the LSE's gradient, GQA's reduction, the refusals and torch.compile,
against torch's autograd of the reference. The kernel itself: tests/test_gpu_backward.py.
"""

import os

import pytest
import torch

from hopper_fmha import backward, flash_attn_func, interface
from hopper_fmha.reference import reference, visible_keys

pytestmark = pytest.mark.cpu
# fp16 gradients from the stand-in (float64 from the fp16 out and lse) vs float64 autograd cast to
# fp16: both round once to fp16, the stand-in's D also carries out's fp16 rounding.
TOL = dict(rtol=1e-2, atol=1e-2)


def dense_backward(q, k, v, out, dout, lse, dlse, scale, causal, window=(-1, -1), softcap=0.0):
    """The backward kernel's contract, densely in float64: P = exp(S - lse), dV = P^T dO,
    dS = P (dO V^T - D), dQ = scale dS K, dK = scale dS^T Q; GQA heads summed into their kv head.
    A window hides keys (P = 0); softcap makes S = cap tanh(scale QK^T / cap) and multiplies dS by
    its derivative 1 - tanh^2."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    dtanh = 1.0
    if softcap:
        t = torch.tanh(s / softcap)
        s, dtanh = softcap * t, 1.0 - t * t
    sq, sk = q.shape[1], k.shape[1]
    seen = visible_keys(torch.arange(sq), sq, sk, window[0], 0 if causal else window[1])
    p = torch.where(seen, torch.exp(s - lse.double()[..., None]), 0.0)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, vv)
    ds = p * (dp - backward.row_delta(out, dout, dlse).double()[..., None]) * dtanh
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale

    def per_kv_head(t):
        return t.view(t.shape[0], t.shape[1], k.shape[2], group, t.shape[3]).sum(3)

    return dq.to(out.dtype), per_kv_head(dk).to(out.dtype), per_kv_head(dv).to(out.dtype)


@pytest.fixture
def cpu_kernels(monkeypatch):
    """The forward and backward on CPU; records every launch."""
    launches = {"fwd": [], "bwd": []}

    def fake_launch(q, k, v, out, lse, softmax_scale, causal, cfg, exact_lse, features=None):
        kwargs = {}
        if features is not None:
            kwargs = dict(
                window_size=(features.left, features.right),
                softcap=features.softcap,
                learnable_sink=features.sink,
            )
        o, l = reference(q, k, v, softmax_scale, causal, **kwargs)
        out.copy_(o)
        lse.copy_(l)
        launches["fwd"].append(dict(exact_lse=exact_lse, features=features))

    def fake_backward(q, k, v, out, dout, lse, dlse, scale, causal, deterministic, window, softcap, sink):
        assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
        launches["bwd"].append(
            dict(dlse=dlse, deterministic=deterministic, causal=causal, dout=dout, window=window, sink=sink)
        )
        grads = dense_backward(q, k, v, out, dout, lse, dlse, scale, causal, window, softcap)
        if sink is None:
            return grads
        return grads + (backward.sink_gradient(lse, backward.row_delta(out, dout, dlse), sink),)

    monkeypatch.setattr(interface, "_check_device", lambda q, k, v: None)
    monkeypatch.setattr(interface, "_launch", fake_launch)
    monkeypatch.setattr(backward, "_launch_backward", fake_backward)
    return launches


def leaves(batch=2, seqlen_q=37, seqlen_k=45, heads=4, kv_heads=2, head_dim=64, dtype=torch.float16):
    g = torch.Generator().manual_seed(1)
    shapes = ((seqlen_q, heads), (seqlen_k, kv_heads), (seqlen_k, kv_heads))
    return [torch.randn(batch, s, h, head_dim, generator=g).to(dtype).requires_grad_() for s, h in shapes]


def reference_grads(q, k, v, causal, dout, dlse=None, learnable_sink=None, **features):
    """torch's autograd of the float64 reference, cast to the inputs' dtype (the sink's: float64)."""
    ins = [t.detach().double().requires_grad_() for t in (q, k, v)]
    sink = None if learnable_sink is None else learnable_sink.detach().double().requires_grad_()
    out, lse = reference(*ins, causal=causal, dtype=torch.float64, learnable_sink=sink, **features)
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + (lse * dlse.double()).sum()
    grads = torch.autograd.grad(loss, ins + ([sink] if sink is not None else []))
    return [g.to(q.dtype) for g in grads[:3]] + list(grads[3:])


def test_row_delta_is_the_gradient_of_out_and_lse():
    # The identity the kernel rests on, in float64 without stand-ins: with D = row_delta(out, dO,
    # dlse), dS = P (dP - D) gives the gradients of <out, dO> + <lse, dlse>.
    q, k, v = (t.detach().double() for t in leaves(heads=2, kv_heads=2))
    out, lse = reference(q, k, v, causal=True, dtype=torch.float64)
    g = torch.Generator().manual_seed(2)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    got = dense_backward(q, k, v, out, dout, lse, dlse, q.shape[-1] ** -0.5, True)
    for ours, ref in zip(got, reference_grads(q, k, v, True, dout, dlse), strict=True):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)  # D is float32, as the kernel's
    # Without dlse the LSE's part is missing: the test can tell the two apart.
    no_dlse = dense_backward(q, k, v, out, dout, lse, None, q.shape[-1] ** -0.5, True)
    assert (no_dlse[0] - got[0]).abs().max() > 1e-3


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_gradients_flow_to_q_k_v(cpu_kernels, causal, kv_heads):
    q, k, v = leaves(kv_heads=kv_heads)
    out = flash_attn_func(q, k, v, causal=causal)
    assert out.grad_fn is not None
    dout = torch.randn_like(out)
    out.backward(dout)
    for name, ours, ref in zip(
        "qkv", (q.grad, k.grad, v.grad), reference_grads(q, k, v, causal, dout), strict=True
    ):
        assert ours.shape == ref.shape, name
        torch.testing.assert_close(ours, ref, **TOL, msg=name)
    # The forward ran with the exact LSE (the backward's input), though the caller did not ask for it.
    assert cpu_kernels["fwd"][-1]["exact_lse"] is True
    assert cpu_kernels["bwd"][-1]["causal"] is causal


def test_lse_gradient_reaches_the_inputs(cpu_kernels):
    q, k, v = leaves()
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    g = torch.Generator().manual_seed(3)
    dout = torch.randn(out.shape, generator=g)
    dlse = torch.randn(lse.shape, generator=g)
    ((out * dout).sum() + (lse * dlse).sum()).backward()
    ref = reference_grads(q, k, v, True, dout, dlse)
    for ours, r in zip((q.grad, k.grad, v.grad), ref, strict=True):
        torch.testing.assert_close(ours, r, **TOL)


def test_only_some_inputs_require_grad(cpu_kernels):
    q, k, v = leaves()
    k, v = k.detach(), v.detach()
    out = flash_attn_func(q, k, v)
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, q, dout)
    torch.testing.assert_close(dq, reference_grads(q, k, v, False, dout)[0], **TOL)


def test_non_contiguous_dout(cpu_kernels):
    q, k, v = leaves()
    out = flash_attn_func(q, k, v)
    dout = torch.randn(out.shape[0], out.shape[1], out.shape[3], out.shape[2]).transpose(2, 3)
    assert not dout.is_contiguous()
    out.backward(dout)
    torch.testing.assert_close(q.grad, reference_grads(q, k, v, False, dout)[0], **TOL)


def test_deterministic_reaches_the_backward(cpu_kernels):
    q, k, v = leaves()
    flash_attn_func(q, k, v, deterministic=True).sum().backward()
    assert cpu_kernels["bwd"][-1]["deterministic"] is True
    flash_attn_func(q, k, v).sum().backward()
    assert cpu_kernels["bwd"][-1]["deterministic"] is False
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        flash_attn_func(q, k, v, deterministic=1)


def test_no_grad_and_inference_mode_take_the_plain_path(cpu_kernels):
    q, k, v = leaves()
    with torch.no_grad():
        out = flash_attn_func(q, k, v)
    assert out.grad_fn is None and cpu_kernels["fwd"][-1]["exact_lse"] is False
    with torch.inference_mode():
        assert flash_attn_func(q, k, v).grad_fn is None


def test_backward_is_on_by_default(cpu_kernels, monkeypatch):
    # The backward needs no switch: with no HOPPER_FMHA_* environment variable set, a call where
    # any one of q, k, v requires grad returns an output with a grad_fn, and its gradient is the
    # reference's.
    for name in [n for n in os.environ if n.startswith("HOPPER_FMHA")]:
        monkeypatch.delenv(name)
    q, k, v = leaves()
    for i in range(3):
        args = [t.detach() for t in (q, k, v)]
        args[i].requires_grad_()
        out = flash_attn_func(*args, causal=True)
        assert out.grad_fn is not None and cpu_kernels["fwd"][-1]["exact_lse"] is True
        dout = torch.randn_like(out)
        (grad,) = torch.autograd.grad(out, args[i], dout)
        torch.testing.assert_close(grad, reference_grads(*args, True, dout)[i], **TOL)
    assert len(cpu_kernels["fwd"]) == len(cpu_kernels["bwd"]) == 3


@pytest.mark.parametrize(
    "causal, features",
    [
        (True, dict(window_size=(8, -1))),
        (False, dict(window_size=(8, 0))),
        (False, dict(window_size=(5, 3))),
        (False, dict(window_size=(-1, 4))),
        (False, dict(window_size=(20, -1))),
        (False, dict(softcap=5.0)),
        (True, dict(softcap=2.0, window_size=(6, -1))),
        (False, dict(learnable_sink="sink")),
        (True, dict(learnable_sink="sink", softcap=5.0, window_size=(7, 0))),
    ],
    ids=["causal-left", "window-causal", "window-both", "window-right", "window-left", "softcap",
         "softcap-causal-left", "sink", "all"],
)  # fmt: skip
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_score_features_have_gradients(cpu_kernels, causal, features, kv_heads):
    # Windows, softcap and the sink reach the backward as the forward ran them (the window's sides
    # resolved, causal as the right limit 0); the gradients of q, k, v and the sink are those of
    # torch's autograd of the reference, the LSE's gradient included.
    q, k, v = leaves(kv_heads=kv_heads)
    sink = None
    if features.get("learnable_sink") == "sink":
        sink = torch.randn(4, generator=torch.Generator().manual_seed(5)).requires_grad_()
        features = dict(features, learnable_sink=sink)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_lse=True, **features)
    g = torch.Generator().manual_seed(4)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    dlse = torch.randn(lse.shape, generator=g)
    ((out.float() * dout.float()).sum() + (lse * dlse).sum()).backward()
    ref = reference_grads(q, k, v, causal, dout, dlse, **features)
    for name, ours, r in zip("qkv", (q.grad, k.grad, v.grad), ref, strict=False):
        torch.testing.assert_close(ours, r, **TOL, msg=name)
    if sink is not None:
        assert sink.grad.shape == sink.shape and sink.grad.dtype == sink.dtype
        torch.testing.assert_close(sink.grad.double(), ref[3], rtol=1e-3, atol=1e-3)
    else:
        assert cpu_kernels["bwd"][-1]["sink"] is None
    # The features reached the backward: a window changes the gradients (checked against the
    # reference above); here that the backward got the forward's sides.
    fwd = cpu_kernels["fwd"][-1]["features"]
    assert cpu_kernels["bwd"][-1]["window"] == (fwd.left, fwd.right)


def test_sink_gradient_only_when_wanted(cpu_kernels):
    # A sink that does not require grad: the backward runs without it (no dsink is made).
    q, k, v = leaves()
    flash_attn_func(q, k, v, learnable_sink=torch.zeros(4)).sum().backward()
    assert cpu_kernels["bwd"][-1]["sink"] is None and q.grad is not None


def test_sink_gradient_without_keys(cpu_kernels):
    # No keys: out = 0, lse = the sink; only the LSE's gradient reaches the sink (p_sink = 1).
    q, k, v = leaves(seqlen_k=0)
    sink = torch.randn(4).requires_grad_()
    out, lse = flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True)
    dlse = torch.randn(lse.shape)
    (out.float().sum() + (lse * dlse).sum()).backward()
    torch.testing.assert_close(sink.grad, dlse.sum(dim=(0, 2)))
    assert not cpu_kernels["bwd"] and not q.grad.any()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(head_dim=192), "head dims up to 128"),
        (dict(head_dim=256), "head dims up to 128"),
    ],
    ids=["d192", "d256"],
)
def test_unsupported_backward_is_refused_before_the_forward(cpu_kernels, monkeypatch, kwargs, match):
    # With the wide kernel off (`backward.WIDE_BACKWARD`), the rule names head dims up to 128.
    monkeypatch.setattr(backward, "WIDE_BACKWARD", False)
    head_dim = kwargs.pop("head_dim", 64)
    q, k, v = leaves(head_dim=head_dim)
    with pytest.raises(NotImplementedError, match=match):
        flash_attn_func(q, k, v, **kwargs)
    assert not cpu_kernels["fwd"]
    with torch.no_grad():  # the forward alone serves them
        flash_attn_func(q, k, v, **kwargs)


def test_kvcache_refuses_grad():
    # (flash_attn_varlen_func's gradients: tests/test_varlen_api.py.)
    from hopper_fmha import flash_attn_with_kvcache

    q4 = torch.randn(1, 1, 2, 64, dtype=torch.float16, requires_grad=True)
    cache = torch.randn(1, 16, 2, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="flash_attn_with_kvcache has no backward pass yet"):
        flash_attn_with_kvcache(q4, cache, cache)


def test_bwd_op_checks_dout():
    q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="gradient of out must have out's shape, dtype"):
        torch.ops.hopper_fmha.bwd(q[:, :4], q, q, q, q, lse, None, 0.125, False, False)
    with pytest.raises(ValueError, match="gradient of out must have out's shape, dtype"):
        torch.ops.hopper_fmha.bwd(q.float(), q, q, q, q, lse, None, 0.125, False, False)


def test_empty_problems_give_zero_gradients(cpu_kernels):
    q, k, v = leaves(seqlen_k=0)
    out = flash_attn_func(q, k, v)
    out.sum().backward()
    assert q.grad.abs().sum() == 0 and k.grad.shape == k.shape
    assert not cpu_kernels["bwd"]  # no launch without keys


def test_torch_compile_fullgraph_forward_and_backward(cpu_kernels):
    # A block with a projection before the attention: compiled with fullgraph=True (a graph break
    # raises), its gradients equal eager's.
    torch.manual_seed(0)
    proj = torch.nn.Linear(64, 3 * 64).to(torch.float16)
    x = torch.randn(2, 33, 64, dtype=torch.float16)

    def block(x):
        q, k, v = proj(x).view(2, 33, 3, 1, 64).unbind(2)
        return flash_attn_func(q, k, v, causal=True).sum(dim=(2, 3))

    eager_out = block(x)
    eager_grads = torch.autograd.grad(eager_out.square().sum(), proj.parameters())
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    grads = torch.autograd.grad(out.square().sum(), proj.parameters())
    torch.testing.assert_close(out, eager_out)
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e)
    assert len(cpu_kernels["bwd"]) == 2
