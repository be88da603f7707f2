"""The backward pass's host side: which calls it serves, the `hopper_fmha::bwd` custom op, and the
autograd formula of `hopper_fmha::fwd` (registered by `hopper_fmha.interface`).

A call of `flash_attn_func` in grad mode with an input that requires grad goes through the custom
op `hopper_fmha::fwd` (the dispatcher, so autograd records it) with the exact LSE; its backward
runs the op `hopper_fmha::bwd`, whose fake implementation lets `torch.compile` trace both.

Status: verified on an H200 GPU on 2026-11-25 (`tests/test_gpu_backward.py`: both kernel versions,
`kernels/sm90_bwd.py` and `kernels/sm90_bwd_ws.py`, against float64 autograd on FlashAttention's
seqlen grid, autograd through `flash_attn_func`, bitwise-reproducible deterministic mode, batch and
heads past 65535, torch.compile(fullgraph=True)), and on by default.

What the kernel serves: fp16/bf16, head_dim 64 or 128 (v's the same), causal or not, MHA/GQA/MQA,
deterministic or not. Windows, softcap, learnable sinks, other head dims and varlen are refused
before the forward runs, with the rule named.
"""

from __future__ import annotations

import torch

HEAD_DIMS = (64, 128)  # = kernels.sm90_bwd.HEAD_DIMS (that module needs the CuTe DSL to import)


def grad_needed(q, k, v, sink=None) -> bool:
    """In grad mode, with an input that requires grad. On every call's host path: the attribute
    tests first (inference inputs require no grad), the grad-mode query only when one does."""
    return (
        q.requires_grad or k.requires_grad or v.requires_grad or (sink is not None and sink.requires_grad)
    ) and torch.is_grad_enabled()


def check_supported(head_dim: int, head_dim_v: int, features, deterministic) -> None:
    """Raise, naming the rule, for a differentiable call the backward kernel does not serve.

    Called before the forward runs, so a refused call costs nothing on the device. Any forward
    variant serves: the backward needs only out and the exact LSE."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__} {deterministic!r}")
    if features is not None:
        raise NotImplementedError(
            "hopper_fmha's backward pass does not support window_size, softcap or learnable_sink yet "
            "(forward only: call under torch.no_grad())"
        )
    if head_dim not in HEAD_DIMS or head_dim_v != head_dim:
        raise NotImplementedError(
            f"hopper_fmha's backward pass supports head_dim {' and '.join(map(str, HEAD_DIMS))} with v's "
            f"head_dim equal; got head_dim {head_dim}, head_dim_v {head_dim_v} (forward only: call under "
            "torch.no_grad())"
        )


def no_backward(what: str) -> RuntimeError:
    """The error for a differentiable call of an entry point that has no backward at all."""
    return RuntimeError(
        f"hopper_fmha.{what} has no backward pass yet, but an input requires grad: its output would "
        "have no grad_fn and gradients would silently stop here. For inference, call it under "
        "torch.no_grad() or torch.inference_mode(); otherwise detach the inputs first."
    )


def row_delta(out: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """D (b, h, s_q) float32 of dS = P * (dP - D): rowsum(dout * out), minus the LSE's gradient
    where the caller used the LSE (d lse / d s = P, so dlse adds P * dlse to dS).
    out, dout: (b, s_q, h, dv); dlse: (b, h, s_q) or None."""
    delta = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    if dlse is not None:
        delta = delta - dlse
    return delta.contiguous()


# ---- the backward custom op ----


def _check_dout(dout, out) -> None:
    if not isinstance(dout, torch.Tensor):
        raise TypeError(f"the gradient of out must be a torch.Tensor, got {type(dout).__name__}")
    if dout.shape != out.shape or dout.dtype != out.dtype or dout.device != out.device:
        raise ValueError(
            f"the gradient of out must have out's shape, dtype and device {tuple(out.shape)} {out.dtype} "
            f"{out.device}, got {tuple(dout.shape)} {dout.dtype} {dout.device}"
        )


def _launch_backward(q, k, v, out, dout, lse, dlse, softmax_scale, causal, deterministic):
    from hopper_fmha.kernels.sm90_bwd import backward as kernel_backward

    return kernel_backward(
        q, k, v, out, dout, lse, softmax_scale, causal, dlse=dlse, deterministic=deterministic
    )


@torch.library.custom_op("hopper_fmha::bwd", mutates_args=())
def _bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    softmax_scale: float,
    causal: bool,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_dout(dout, out)
    if out.numel() == 0 or k.shape[1] == 0:  # nothing attended: every gradient is zero
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return _launch_backward(q, k, v, out, dout, lse, dlse, softmax_scale, causal, deterministic)


@_bwd.register_fake
def _(dout, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# ---- autograd of hopper_fmha::fwd ----
# The forward op's inputs: (q, k, v, softmax_scale, causal, variant, tile_m, tile_n, return_lse,
# window_left, window_right, softcap, learnable_sink, deterministic); outputs (out, lse).
_FWD_NON_TENSOR_INPUTS = 11


def fwd_setup_context(ctx, inputs, output) -> None:
    q, k, v, softmax_scale, causal, _variant, _tm, _tn, return_lse, left, right, softcap, sink, det = inputs
    out, lse = output
    if left >= 0 or right >= 0 or softcap or sink is not None:
        ctx.unsupported = "window_size, softcap or learnable_sink"
    elif not return_lse:
        ctx.unsupported = "an LSE computed without return_lse (its fast path is not exact)"
    else:
        ctx.unsupported = None
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.deterministic = det


def fwd_backward(ctx, dout, dlse):
    if ctx.unsupported is not None:  # flash_attn_func refuses these before the forward
        raise NotImplementedError(f"hopper_fmha's backward pass does not support {ctx.unsupported}")
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.hopper_fmha.bwd(
        dout, q, k, v, out, lse, dlse, ctx.softmax_scale, ctx.causal, ctx.deterministic
    )
    return (dq, dk, dv) + (None,) * _FWD_NON_TENSOR_INPUTS
