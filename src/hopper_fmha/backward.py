"""The backward pass's host side: which calls it serves, the `hopper_fmha::bwd` custom op, and the
autograd formula of `hopper_fmha::fwd` (registered by `hopper_fmha.interface`).

A call of `flash_attn_func` in grad mode with an input that requires grad goes through the custom
op `hopper_fmha::fwd` (the dispatcher, so autograd records it) with the exact LSE; its backward
runs the op `hopper_fmha::bwd`, whose fake implementation lets `torch.compile` trace both.

Status: verified on an H200 GPU on 2026-11-25 (`tests/test_gpu_backward.py`: both kernel versions,
`kernels/sm90_bwd.py` and `kernels/sm90_bwd_ws.py`, against float64 autograd on FlashAttention's
seqlen grid, autograd through `flash_attn_func`, bitwise-reproducible deterministic mode, batch and
heads past 65535, torch.compile(fullgraph=True)), and on by default.

What the kernel serves: fp16/bf16, head dims up to 256 (64, 128, 192/128 and 256 natively, the
others on zero-padded copies, v's may differ), causal or not, MHA/GQA/MQA,
deterministic or not, sliding windows, softcap and the learnable sink (whose gradient the host
reduces from the kernel's row sums: `sink_gradient`; windows and softcap are the kernel's).
`flash_attn_varlen_func` has the same backward through `hopper_fmha::varlen_bwd` (without
seqused_k). Other head dims are refused before the forward runs, with the rule named.

Head dims past 128 (up to 256): the wide kernel `kernels/sm90_bwd_wide.py` at (192, 128) and
(256, 256), the others on zero-padded copies (`WIDE_BACKWARD`; built in session 26, its GPU tests
passed in session 27 on an H100).
"""

from __future__ import annotations

import torch

HEAD_DIMS = (64, 128)  # = kernels.sm90_bwd.HEAD_DIMS (that module needs the CuTe DSL to import)
# Head dims past 128: the wide kernel (`kernels.sm90_bwd_wide`) at (head_dim, head_dim_v) = (192, 128)
# and (256, 256) (= its SHAPES), the others in (128, 256] on zero-padded copies. False: head dims
# past 128 are refused (as before session 27, when `test_gpu_backward.py -k wide` first passed).
WIDE_BACKWARD = True
WIDE_KERNEL_DIMS = ((192, 128), (256, 256))


def kernel_dims() -> tuple[tuple[int, int], ...]:
    """The backward kernels' (head_dim, head_dim_v) pairs, cheapest first."""
    return tuple((d, d) for d in HEAD_DIMS) + (WIDE_KERNEL_DIMS if WIDE_BACKWARD else ())


def kernel_head_dims(head_dim: int, head_dim_v: int) -> tuple[int, int] | None:
    """The kernel pair that serves q, k's `head_dim` and v's `head_dim_v`: the first of
    `kernel_dims()` at least as large in both (the host zero-pads the rest:
    `kernels.sm90_bwd.backward`), None past the largest."""
    return next(((kd, kdv) for kd, kdv in kernel_dims() if head_dim <= kd and head_dim_v <= kdv), None)


def grad_needed(q, k, v, sink=None) -> bool:
    """In grad mode, with an input that requires grad. On every call's host path: the attribute
    tests first (inference inputs require no grad), the grad-mode query only when one does."""
    return (
        q.requires_grad or k.requires_grad or v.requires_grad or (sink is not None and sink.requires_grad)
    ) and torch.is_grad_enabled()


def check_supported(head_dim: int, head_dim_v: int, deterministic) -> None:
    """Raise, naming the rule, for a differentiable call the backward kernel does not serve.

    Called before the forward runs, so a refused call costs nothing on the device. Any forward
    variant serves: the backward needs only out and the exact LSE (score features included)."""
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__} {deterministic!r}")
    if head_dim <= HEAD_DIMS[-1] and head_dim_v <= HEAD_DIMS[-1]:  # (the per-call path: no tuples)
        return
    if kernel_head_dims(head_dim, head_dim_v) is None:
        dims = kernel_dims()
        natively = " and ".join(str(kd) if kd == kdv else f"{kd}/{kdv}" for kd, kdv in dims)
        raise NotImplementedError(
            f"hopper_fmha's backward pass supports head dims up to {dims[-1][0]} (q, k's and v's; "
            f"{natively} natively, others padded to the next); got head_dim "
            f"{head_dim}, head_dim_v {head_dim_v} (forward only: call under torch.no_grad())"
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


def sink_gradient(lse: torch.Tensor, delta: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """d loss / d learnable_sink, (h,) float32: -sum over batch and rows of exp(sink - lse) * D.

    Only the LSE depends on the sink (d p_j / d sink = -p_j exp(sink - lse) for every key j),
    so it takes the row sums D (b, h, s_q) = rowsum(dO * O) - dLSE of the main backward and the
    forward's lse (b, h, s_q) (`emulate_bwd.preprocess` derives it). A row with lse = -inf (no key
    and a sink of -inf) adds 0."""
    lse = lse.float()
    p_sink = torch.exp(sink.float()[None, :, None] - lse)
    p_sink = torch.where(lse == -float("inf"), 0.0, p_sink)
    return -(p_sink * delta.float()).sum(dim=(0, 2))


# ---- the backward custom op ----


def _check_dout(dout, out) -> None:
    if not isinstance(dout, torch.Tensor):
        raise TypeError(f"the gradient of out must be a torch.Tensor, got {type(dout).__name__}")
    if dout.shape != out.shape or dout.dtype != out.dtype or dout.device != out.device:
        raise ValueError(
            f"the gradient of out must have out's shape, dtype and device {tuple(out.shape)} {out.dtype} "
            f"{out.device}, got {tuple(dout.shape)} {dout.dtype} {dout.device}"
        )


def _launch_backward(q, k, v, out, dout, lse, dlse, scale, causal, deterministic, window, softcap, sink):
    from hopper_fmha.kernels.sm90_bwd import backward as kernel_backward

    return kernel_backward(
        q, k, v, out, dout, lse, scale, causal, dlse=dlse, deterministic=deterministic,
        window_size=window, softcap=softcap, learnable_sink=sink,
    )  # fmt: skip


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
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsink): dsink (h,) float32 when learnable_sink is given (its gradient is
    wanted), else an empty tensor."""
    _check_dout(dout, out)
    if out.numel() == 0 or k.shape[1] == 0:  # nothing attended: every gradient but the sink's is zero
        dsink = _no_sink(q.device)
        if learnable_sink is not None:
            delta = row_delta(out, dout, dlse) if out.numel() else torch.zeros_like(lse)
            dsink = sink_gradient(lse, delta, learnable_sink)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dsink
    grads = _launch_backward(
        q, k, v, out, dout, lse, dlse, softmax_scale, causal, deterministic, (window_left, window_right),
        softcap, learnable_sink,
    )  # fmt: skip
    return grads if learnable_sink is not None else grads + (_no_sink(q.device),)


@_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, scale, causal, deterministic, left=-1, right=-1, cap=0.0, sink=None):
    dsink = q.new_empty((0,) if sink is None else sink.shape, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


# ---- autograd of hopper_fmha::fwd ----
# The forward op's inputs: (q, k, v, softmax_scale, causal, variant, tile_m, tile_n, return_lse,
# window_left, window_right, softcap, learnable_sink, deterministic); outputs (out, lse).
_SINK_INPUT = 12


def fwd_setup_context(ctx, inputs, output) -> None:
    q, k, v, softmax_scale, causal, _variant, _tm, _tn, return_lse, left, right, softcap, sink, det = inputs
    out, lse = output
    if not return_lse:
        ctx.unsupported = "an LSE computed without return_lse (its fast path is not exact)"
    else:
        ctx.unsupported = None
    ctx.save_for_backward(q, k, v, out, lse, sink)
    ctx.softmax_scale = softmax_scale
    ctx.causal = causal
    ctx.window = (left, right)
    ctx.softcap = softcap
    ctx.deterministic = det


def fwd_backward(ctx, dout, dlse):
    if ctx.unsupported is not None:  # flash_attn_func refuses these before the forward
        raise NotImplementedError(f"hopper_fmha's backward pass does not support {ctx.unsupported}")
    q, k, v, out, lse, sink = ctx.saved_tensors
    want_sink = sink is not None and ctx.needs_input_grad[_SINK_INPUT]
    grads = torch.ops.hopper_fmha.bwd(
        dout, q, k, v, out, lse, dlse, ctx.softmax_scale, ctx.causal, ctx.deterministic, *ctx.window,
        ctx.softcap, sink if want_sink else None,
    )  # fmt: skip
    return _input_grads(ctx, grads, _SINK_INPUT if want_sink else None)


def _input_grads(ctx, grads, sink_input: int | None) -> tuple:
    """A forward op's input gradients from the backward op's (dq, dk, dv, dsink): dq, dk, dv
    first, dsink at `sink_input` (None: no sink gradient wanted), None for the other inputs."""
    dq, dk, dv, dsink = grads
    out = [dq, dk, dv] + [None] * (len(ctx.needs_input_grad) - 3)
    if sink_input is not None:
        out[sink_input] = dsink
    return tuple(out)


def _no_sink(device) -> torch.Tensor:
    """The backward ops' dsink where no sink gradient is wanted (an op returns tensors only)."""
    return torch.empty(0, device=device, dtype=torch.float32)


# ---- varlen: the backward op and the autograd of hopper_fmha::varlen_fwd ----


@torch.library.custom_op("hopper_fmha::varlen_bwd", mutates_args=())
def _varlen_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    deterministic: bool,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_bwd` for packed sequences (`kernels.sm90_bwd.backward_varlen`); lse, dlse (h, total_q)."""
    _check_dout(dout, out)
    from hopper_fmha.kernels.sm90_bwd import backward_varlen

    grads = backward_varlen(
        q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
        causal, dlse=dlse, deterministic=deterministic, window_size=(window_left, window_right),
        softcap=softcap, learnable_sink=learnable_sink,
    )  # fmt: skip
    return grads if learnable_sink is not None else grads + (_no_sink(q.device),)


@_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, scale, causal, det, *features):
    sink = features[3] if len(features) > 3 else None
    dsink = q.new_empty((0,) if sink is None else sink.shape, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsink


# The varlen forward op's inputs: (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
# max_seqlen_k, softmax_scale, causal, tile_m, tile_n, return_lse, window_left, window_right,
# softcap, learnable_sink, deterministic); outputs (out, lse).
_VARLEN_SINK_INPUT = 16


def varlen_fwd_setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, scale, causal = inputs[:10]
    return_lse, left, right, softcap, sink, det = inputs[12:]
    out, lse = output
    ctx.unsupported = None
    if not return_lse:
        ctx.unsupported = "an LSE computed without return_lse (its fast path is not exact)"
    elif seqused_k is not None:
        ctx.unsupported = "seqused_k"
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sink)
    ctx.args = (max_q, max_k, scale, causal, det, left, right, softcap)


def varlen_fwd_backward(ctx, dout, dlse):
    if ctx.unsupported is not None:  # flash_attn_varlen_func refuses these before the forward
        raise NotImplementedError(f"hopper_fmha's varlen backward pass does not support {ctx.unsupported}")
    q, k, v, out, lse, cu_q, cu_k, sink = ctx.saved_tensors
    max_q, max_k, scale, causal, det, left, right, softcap = ctx.args
    want_sink = sink is not None and ctx.needs_input_grad[_VARLEN_SINK_INPUT]
    grads = torch.ops.hopper_fmha.varlen_bwd(
        dout, q, k, v, out, lse, dlse, cu_q, cu_k, max_q, max_k, scale, causal, det, left, right, softcap,
        sink if want_sink else None,
    )  # fmt: skip
    return _input_grads(ctx, grads, _VARLEN_SINK_INPUT if want_sink else None)
