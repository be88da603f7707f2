"""GPU tier, the first backward kernel (`kernels/sm90_bwd.backward`), written before any GPU run:
dq, dk, dv against float64 autograd of the same attention, each within 2x the error of PyTorch's
backward in the input dtype + a floor; FlashAttention's seqlen pairs (odd sizes, one key, rows
without keys), MHA/GQA/MQA, causal or not, d = 64 and 128."""

from __future__ import annotations

import zlib

import pytest
import torch
from test_gpu_kernels import HEADS, SEQLENS, make_inputs  # noqa: E402  (tests/ is on sys.path)

from hopper_fmha.reference import visible_keys

pytestmark = pytest.mark.gpu

GRAD_FLOOR = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


def attention(q, k, v, scale, causal):
    """Attention in q's dtype, differentiable everywhere: masked scores get a large negative value
    and P is multiplied by the mask, so a row without keys has out = 0 and zero gradients."""
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    sq, sk = q.shape[1], k.shape[1]
    seen = visible_keys(torch.arange(sq, device=q.device), sq, sk, -1, 0 if causal else -1)
    s = s.masked_fill(~seen, torch.finfo(s.dtype).min / 2)
    p = torch.softmax(s, dim=-1) * seen
    return torch.einsum("bhqk,bkhd->bqhd", p, vv)


def grads(q, k, v, dout, scale, causal, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    attention(*leaves, scale, causal).backward(dout.to(dtype))
    return [t.grad for t in leaves]


@pytest.mark.parametrize("heads", list(HEADS), ids=list(HEADS))
@pytest.mark.parametrize("seqlens", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_backward_matches_reference(hopper_gpu, dtype, d, causal, seqlens, heads):
    import hopper_fmha
    from hopper_fmha.kernels.sm90_bwd import backward

    sq, sk = seqlens
    if sq * sk > 2048 * 2048:
        pytest.skip("the float64 reference holds the whole score matrix")
    h, hkv = HEADS[heads]
    seed = zlib.crc32(repr(("bwd", d, causal, seqlens, heads, str(dtype))).encode())
    q, k, v = make_inputs(2, sq, sk, h, hkv, d, dtype, seed)
    dout = torch.randn_like(q)
    scale = d**-0.5
    with torch.no_grad():
        out, lse = hopper_fmha.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = backward(q, k, v, out, dout, lse, scale, causal)
    ref = grads(q, k, v, dout, scale, causal, torch.float64)
    base = grads(q, k, v, dout, scale, causal, dtype)
    for name, ours, r, b in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, base, strict=True):
        assert ours.shape == r.shape and ours.dtype == dtype, name
        assert torch.isfinite(ours).all(), f"{name} has NaN/inf"
        err = (ours.double() - r).abs().max().item()
        tol = 2 * (b.double() - r).abs().max().item() + GRAD_FLOOR[dtype] * max(1.0, r.abs().max().item())
        assert err <= tol, f"{name}: error {err:.3g} > {tol:.3g}"
