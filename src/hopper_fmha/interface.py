"""Public API: `flash_attn_func`, its argument validation, and the `hopper_fmha::fwd` custom op.

Host path per call: validate (metadata only) -> select the kernel config (cached) -> conform
strides (copy only if needed) -> allocate out/lse -> `hopper_fmha.kernels.forward`.
Under `torch.compile` the call goes through the `torch.library.custom_op` `hopper_fmha::fwd` (with
a fake implementation), so graphs trace through it; eager calls run the op's implementation
directly, skipping the dispatcher. Everything that needs real storage (data_ptr alignment, the
launch) happens inside the implementation.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import torch

from hopper_fmha import backward, config, kvcache_args, reference, varlen_args

_DTYPES = (torch.float16, torch.bfloat16)
# TMA needs 16-byte aligned base addresses and 16-byte multiples for all strides but the last.
_ALIGN_BYTES = 16
_STRIDE_MULTIPLE = 8  # elements: 16 bytes of fp16/bf16

# Device indices already checked to be Hopper (the query costs a driver call).
_HOPPER_DEVICES: set[int] = set()


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    *,
    learnable_sink: torch.Tensor | None = None,
    deterministic: bool = False,
    variant: str | None = None,
    tile: tuple[int, int] | None = None,
):
    """Fused attention on a Hopper GPU: softmax(softmax_scale * q k^T) v, differentiable.

    Args:
        q: (batch, seqlen_q, heads, head_dim), float16 or bfloat16, CUDA (sm_90).
        k, v: (batch, seqlen_k, kv_heads, head_dim), same dtype and device as q. kv_heads may
            divide heads (GQA/MQA): q head h uses kv head h // (heads // kv_heads).
        softmax_scale: finite float > 0; None means 1/sqrt(head_dim).
        causal: if True, query row i sees key j iff j <= i + seqlen_k - seqlen_q (the mask is
            aligned to the bottom-right corner, as in FlashAttention >= 2.1).
        window_size: (left, right), a sliding window: query row i sees key j iff
            i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; -1 is a side
            without limit. causal=True is (-1, 0) and, given with a window, sets right = 0.
        softcap: > 0 caps the scores: s = softcap * tanh(softmax_scale * q.k / softcap) (Gemma 2);
            0 is off.
        return_lse: also return the log-sum-exp of the scaled scores (with a sink, the sink's
            exp joins the sum, as in FlashAttention-4).
        learnable_sink: (heads,) float tensor on q's device, a logit per q head that joins each
            row's softmax denominator and nothing else (gpt-oss); None is off.
        deterministic: the backward adds dq's parts in a fixed order (bitwise reproducible, a
            little slower); no effect on the forward.
        variant: kernel variant (see `hopper_fmha.config.VARIANTS`); None picks per problem
            (`hopper_fmha.config.auto_variant`; "ws" when a tile is given).
        tile: optional (tile_m, tile_n) override, for tests and benchmarks; None takes the
            problem's (`hopper_fmha.config.auto_tile`), else the table's.

    Returns:
        out: same shape and dtype as q, contiguous. With return_lse, (out, lse) where lse is
        (batch, heads, seqlen_q) float32, natural log. A query row that sees no key gives
        out = 0 and lse = -inf.

    The last dim of q, k, v must be contiguous, the other strides multiples of 8 elements and the
    data 16-byte aligned; non-conforming strides are copied (a contiguous copy is made), not
    rejected. Raises TypeError/ValueError for bad arguments (all checked before the device) and
    RuntimeError when the tensors are not on one CUDA device of compute capability 9.x.

    Gradients: in grad mode with an input that requires grad, the output has a grad_fn (the
    backward kernel, `hopper_fmha.backward`: head dims up to 256 (past 128 on its wide kernel,
    `backward.WIDE_BACKWARD`), causal or not, MHA/GQA/MQA, windows,
    softcap and the learnable sink (which gets a gradient too); a differentiable call it does not
    serve raises NotImplementedError before the forward runs).
    """
    scale, cfg = _validate(q, k, v, softmax_scale, causal, variant, tile)
    features = None
    # The call without score features tests three arguments, nothing more (hot: host time).
    if softcap or learnable_sink is not None or window_size != (-1, -1):
        features, causal, feature_cfg = _score_features(
            q.shape[1], k.shape[1], q.shape[2], q.shape[3], causal, window_size, softcap, learnable_sink,
            variant, tile, None if v.shape[3] == q.shape[3] else v.shape[3],
        )  # fmt: skip
        cfg = feature_cfg or cfg
    grad = backward.grad_needed(q, k, v, learnable_sink)
    if grad:
        backward.check_supported(q.shape[3], v.shape[3], deterministic)
    _check_device(q, k, v)
    if features is not None and features.sink is not None and features.sink.device != q.device:
        raise RuntimeError(f"learnable_sink must be on q's device {q.device}, got {features.sink.device}")
    if grad or torch.compiler.is_compiling():
        # Through the dispatcher: autograd records the op (its backward needs the exact LSE).
        left, right, cap, sink = features if features is not None else (-1, -1, 0.0, None)
        out, lse = torch.ops.hopper_fmha.fwd(
            q, k, v, scale, causal, cfg.variant, cfg.tile_m, cfg.tile_n, return_lse or grad, left, right,
            cap, sink, deterministic,
        )  # fmt: skip
    else:
        # Eager: the op's own implementation, without the dispatcher's ~23 µs per call (measured on
        # the H200 host, NOTES.md "host path"); the same function the custom op runs.
        out, lse = _fwd_impl(q, k, v, scale, causal, cfg, return_lse, features)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    *,
    seqused_k: torch.Tensor | None = None,
    learnable_sink: torch.Tensor | None = None,
    deterministic: bool = False,
    tile: tuple[int, int] | None = None,
):
    """`flash_attn_func` on packed sequences of different lengths (FlashAttention's varlen API).

    Args:
        q: (total_q, heads, head_dim); k, v: (total_k, kv_heads, head_dim), float16 or bfloat16,
            CUDA (sm_90). Sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] and likewise k, v.
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 offsets on q's device, starting at 0,
            non-decreasing; sequences may be empty.
        max_seqlen_q, max_seqlen_k: ints >= the longest q / k sequence. max_seqlen_q sizes the
            grid: under CUDA graph capture, where the offsets cannot be read back and checked, a
            smaller value leaves rows uncomputed (never out of bounds).
        softmax_scale, causal, window_size, softcap, learnable_sink: as `flash_attn_func`, per
            sequence (the mask aligned to each sequence's bottom-right corner).
        seqused_k: (batch,) int32 or None: only the first seqused_k[b] keys of sequence b count.
        deterministic: as `flash_attn_func`'s (the backward's dq summation order).
        tile: optional (tile_m, tile_n) override of the ws kernel's tile (tests, benchmarks).

    Returns:
        out: (total_q, heads, head_dim), q's dtype, contiguous. With return_lse, (out, lse) where
        lse is (heads, total_q) float32. Rows that see no key: out 0, lse -inf (or the sink).

    The values of cu_seqlens and seqused_k are checked with one device-to-host copy, except under
    CUDA graph capture or torch.compile, or with HOPPER_FMHA_CHECK_VALUES=0 in the environment
    (`varlen_args.varlen_values_checkable`).
    """
    shape = varlen_args.check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
        check_values=varlen_args.varlen_values_checkable(),
    )  # fmt: skip
    config.check_head_dims(shape.head_dim, shape.head_dim_v)
    head_dim_v = None if shape.head_dim_v == shape.head_dim else shape.head_dim_v
    scale = _check_scale(softmax_scale, shape.head_dim)
    if causal is not True and causal is not False:
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    features, causal, cfg = _score_features(
        shape.max_seqlen_q, shape.max_seqlen_k, shape.heads, shape.head_dim, causal, window_size, softcap,
        learnable_sink, "ws", tile, head_dim_v,
    )  # fmt: skip
    if cfg is None:  # no score feature: the ws kernel's config at the longest key sequence
        cfg = _select(shape.head_dim, causal, shape.max_seqlen_k, "ws", tile, _selector(), head_dim_v)
    grad = backward.grad_needed(q, k, v, learnable_sink)
    if grad:
        backward.check_supported(shape.head_dim, shape.head_dim_v, deterministic)
        if seqused_k is not None:
            raise NotImplementedError(
                "hopper_fmha's varlen backward pass does not support seqused_k (forward only: call under "
                "torch.no_grad())"
            )
    _check_device(q, k, v)
    if features is not None and features.sink is not None and features.sink.device != q.device:
        raise RuntimeError(f"learnable_sink must be on q's device {q.device}, got {features.sink.device}")
    args = (
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_k,
        shape.max_seqlen_q,
        shape.max_seqlen_k,
        scale,
        causal,
    )
    if grad or torch.compiler.is_compiling():
        # Through the dispatcher: autograd records the op (its backward needs the exact LSE).
        left, right, cap, sink = features if features is not None else (-1, -1, 0.0, None)
        out, lse = torch.ops.hopper_fmha.varlen_fwd(
            *args, cfg.tile_m, cfg.tile_n, return_lse or grad, left, right, cap, sink, deterministic
        )
    else:
        out, lse = _varlen_fwd_impl(*args, cfg, return_lse, features)
    return (out, lse) if return_lse else out


@torch.compiler.disable
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    cache_seqlens: int | torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    num_splits: int = 0,
    *,
    learnable_sink: torch.Tensor | None = None,
):
    """Attention of a few query tokens against a KV cache (FlashAttention's decode API).

    Args:
        q: (batch, seqlen_q, heads, head_dim); seqlen_q small (1 for a decode step).
        k_cache, v_cache: (batch, capacity, kv_heads, head_dim / head_dim_v), dense, with the
            kernels' strides (last dim contiguous, others multiples of 8 elements, 16-byte
            aligned data: a cache is never copied).
        k, v: None, or (batch, seqlen_new, kv_heads, head_dim / head_dim_v) new tokens, written
            into the cache in place at cache_seqlens[b] .. + seqlen_new - 1, then attended.
        cache_seqlens: tokens already in each sequence's cache: an int, an int32 (batch,) tensor
            on q's device, or None (the whole capacity, no new tokens).
        page_table: None, or (batch, pages per sequence) int32 on q's device: then k_cache, v_cache
            are pages (num_pages, page_size, kv_heads, head_dim / head_dim_v), page_size a multiple
            of 16, and sequence b's token t is in page page_table[b, t // page_size].
        softmax_scale, causal, window_size, softcap, learnable_sink: as `flash_attn_func`, the
            masks aligned to the bottom-right: the end of each sequence's keys.
        num_splits: key ranges per query tile (split-KV); 0 chooses (`kernels.num_splits_heuristic`).

    Returns out (batch, seqlen_q, heads, head_dim_v), and with return_lse (out, lse) with lse
    (batch, heads, seqlen_q) float32.

    The values of a cache_seqlens tensor and of page_table are checked with one device-to-host copy,
    except under CUDA graph capture or torch.compile, or with HOPPER_FMHA_CHECK_VALUES=0 in the
    environment (`kvcache_args`). Nothing is written to the cache when a call is rejected.
    Under torch.compile the call runs eagerly (a graph break).
    """
    shape = kvcache_args.check_kvcache(
        q,
        k_cache,
        v_cache,
        k,
        v,
        cache_seqlens,
        page_table,
        check_values=varlen_args.varlen_values_checkable(),
    )
    scale = _check_scale(softmax_scale, shape.head_dim)
    if causal is not True and causal is not False:
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    if (
        isinstance(num_splits, bool)
        or not isinstance(num_splits, numbers.Integral)
        or not 0 <= num_splits <= 256
    ):
        raise ValueError(f"num_splits must be an int in [0, 256] (0: chosen per call), got {num_splits!r}")
    head_dim_v = None if shape.head_dim_v == shape.head_dim else shape.head_dim_v
    features, causal, cfg = _score_features(
        shape.seqlen_q, shape.capacity, shape.heads, shape.head_dim, causal, window_size, softcap,
        learnable_sink, "ws", None, head_dim_v,
    )  # fmt: skip
    if cfg is None:
        cfg = _select(shape.head_dim, causal, shape.capacity, "ws", None, _selector(), head_dim_v)
    if shape.paged:  # key blocks that are one TMA from one page each
        tile_n = config.paged_tile_n(shape.page_size, cfg.tile_n)
        if tile_n != cfg.tile_n:
            cfg = _select(
                shape.head_dim, causal, shape.capacity, "ws", (cfg.tile_m, tile_n), _selector(), head_dim_v
            )
    if backward.grad_needed(q, q if k is None else k, q if v is None else v, learnable_sink):
        raise backward.no_backward("flash_attn_with_kvcache")
    _check_device(q, k_cache, v_cache)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if _conforming(cache) is not cache:
            raise ValueError(
                f"{name} must have its last dim contiguous, its other strides multiples of 8 elements "
                f"and 16-byte aligned data (the cache is read in place, never copied); got strides "
                f"{cache.stride()}"
            )
    if features is not None and features.sink is not None and features.sink.device != q.device:
        raise RuntimeError(f"learnable_sink must be on q's device {q.device}, got {features.sink.device}")
    # ---- every rule checked: from here on the cache may be written ----
    if shape.seqlen_new:
        kvcache_args.append_kv(k_cache, v_cache, k, v, cache_seqlens, page_table)
    seqused = None  # the keys of each sequence: all of the (sliced) cache, or a tensor of lengths
    if isinstance(cache_seqlens, torch.Tensor):
        seqused = cache_seqlens + shape.seqlen_new if shape.seqlen_new else cache_seqlens
    elif shape.paged:  # pages have no extent to slice: the lengths as a tensor
        n = shape.capacity if cache_seqlens is None else int(cache_seqlens) + shape.seqlen_new
        seqused = torch.full((shape.batch,), n, dtype=torch.int32, device=q.device)
    elif cache_seqlens is not None:
        n = int(cache_seqlens) + shape.seqlen_new
        k_cache, v_cache = k_cache[:, :n], v_cache[:, :n]
    out, lse = _empty_outputs(q, shape.head_dim_v)
    if out.numel() == 0:
        return (out, lse) if return_lse else out
    if (shape.capacity if shape.paged else k_cache.shape[1]) == 0:
        out, lse = _no_keys(out, lse, features, (1, -1, 1))
        return (out, lse) if return_lse else out
    q = _conforming(q)
    global _kernels
    if _kernels is None:
        from hopper_fmha import kernels as _kernels
    pack = _kernels.use_pack_gqa(
        shape.seqlen_q, shape.heads // shape.kv_heads, features is not None and features.sink is not None
    )
    if num_splits == 0:
        sms = _kernels._sm_count(q.get_device())
        heads, rows = (
            (shape.kv_heads, shape.seqlen_q * shape.heads // shape.kv_heads)
            if pack
            else (shape.heads, shape.seqlen_q)
        )
        num_splits = _kernels.num_splits_heuristic(shape.batch, heads, rows, shape.capacity, cfg, sms)
    _kernels.kvcache_forward(
        q, k_cache, v_cache, out, lse, scale, causal, cfg, seqused, num_splits, exact_lse=return_lse,
        pack_gqa=pack, page_table=page_table, **_feature_kwargs(features),
    )  # fmt: skip
    return (out, lse) if return_lse else out


class ScoreFeatures(NamedTuple):
    """The score features of a call, reduced to what the kernel must do: window sides (-1: no
    limit, and never a right side with causal: that is the causal mask), softcap (0: off) and
    the sink as a contiguous float32 (heads,) tensor (None: off)."""

    left: int
    right: int
    softcap: float
    sink: torch.Tensor | None

    @staticmethod
    def from_op(left: int, right: int, softcap: float, sink) -> ScoreFeatures | None:
        """The features a custom op's plain arguments carry (-1, -1, 0, None: none)."""
        if left >= 0 or right >= 0 or softcap or sink is not None:
            return ScoreFeatures(left, right, softcap, sink)
        return None


def _score_features(
    seqlen_q,
    seqlen_k,
    heads,
    head_dim,
    causal,
    window_size,
    softcap,
    learnable_sink,
    variant,
    tile,
    head_dim_v=None,
):
    """(features or None, causal, config or None: unchanged) for a call that names a window,
    softcap or sink. seqlen_q/k: the (longest) sequences' lengths.

    A window side that no row reaches past is dropped (left >= seqlen_k - 1, right >=
    seqlen_q - 1: every key is on that side of every row), and a right limit of 0 is the causal
    mask, so (-1, 0) runs the causal kernel and (-1, -1) the plain one. The paper variant has no
    score features: asked for, it is an error; chosen by `auto`, the ws variant runs instead.
    """
    left, right = reference.resolve_window(causal, window_size)
    softcap = reference.check_softcap(softcap)
    sink = _check_sink(learnable_sink, heads)
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1 and not causal:
        right = -1
    feature_causal = causal or right == 0
    if feature_causal:
        right = -1
    features = None
    if left >= 0 or right >= 0 or softcap or sink is not None:
        features = ScoreFeatures(left, right, softcap, sink)
        if variant == "paper":
            raise ValueError(
                "the paper variant has no sliding window, softcap or learnable_sink (the seed paper's "
                "kernel); use variant='ws' or None"
            )
        variant = "ws"
    elif feature_causal == causal:
        return None, causal, None  # nothing changes: the config of `_validate`
    return (
        features,
        feature_causal,
        _select(head_dim, feature_causal, seqlen_k, variant, tile, _selector(), head_dim_v),
    )


def _selector():
    return config.select_config.__wrapped__ if torch.compiler.is_compiling() else config.select_config


def _check_sink(sink, heads: int) -> torch.Tensor | None:
    """learnable_sink as the kernel takes it: None, or (heads,) float32 contiguous."""
    if sink is None:
        return None
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be None or a torch.Tensor, got {type(sink).__name__}")
    if not sink.is_floating_point():
        raise TypeError(f"learnable_sink must be a float tensor, got {sink.dtype}")
    if tuple(sink.shape) != (heads,):
        raise ValueError(f"learnable_sink must have shape (heads,) = ({heads},), got {tuple(sink.shape)}")
    return sink.to(torch.float32).contiguous()


def _validate(q, k, v, softmax_scale, causal, variant, tile) -> tuple[float, config.KernelConfig]:
    """Every rule that needs no GPU; returns the resolved softmax scale and kernel config.

    The common case is one combined test; any failure goes to `_tensor_rules`, which checks the
    rules one by one, in order, and raises for the first that is broken.
    """
    if not (
        isinstance(q, torch.Tensor)
        and isinstance(k, torch.Tensor)
        and isinstance(v, torch.Tensor)
        and q.dim() == 4
        and k.dim() == 4
        and q.dtype in _DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
    ):
        _tensor_rules(q, k, v)
    batch, _, heads, head_dim = q.shape
    k_shape = k.shape
    kv_heads = k_shape[2]
    v_shape = v.shape
    if not (
        (k_shape == v_shape or k_shape[:3] == v_shape[:3])
        and k_shape[0] == batch
        and k_shape[3] == head_dim
        and kv_heads != 0
        and heads % kv_heads == 0
        and (head_dim, v_shape[3]) in config.HEAD_DIM_PAIRS
    ):
        _tensor_rules(q, k, v)
    head_dim_v = None if v_shape[3] == head_dim else v_shape[3]  # v's head dim where it differs
    scale = _check_scale(softmax_scale, head_dim)
    if causal is not True and causal is not False:
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    if torch.compiler.is_compiling():
        # Dynamo traces through lru_cache anyway and warns about it on every compile.
        return scale, _select(head_dim, causal, k_shape[1], variant, tile, _selector(), head_dim_v)
    if variant is None and tile is None:
        seqlen_k = min(k_shape[1], config.AUTO_SEQLEN_K_CAP)
        return scale, config.auto_config(head_dim, causal, seqlen_k, head_dim_v)
    return scale, _select(head_dim, causal, k_shape[1], variant, tile, config.select_config, head_dim_v)


def _check_scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return config.default_softmax_scale(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            f"softmax_scale must be None or a float, got {type(softmax_scale).__name__} {softmax_scale!r}"
        )
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {softmax_scale!r}")
    return scale


def _select(head_dim, causal, seqlen_k, variant, tile, select, head_dim_v=None):
    """The config for an explicit variant and/or tile (or none), through `select`; head_dim_v:
    v's head dim where it differs from q's (the ws variant's)."""
    if variant is None:
        variant = config.DEFAULT_VARIANT
        if tile is None and head_dim_v is None:
            variant = config.auto_variant(head_dim, causal, seqlen_k)
    elif not isinstance(variant, str):
        raise ValueError(f"variant must be one of {config.VARIANTS}, got {variant!r}")
    if tile is not None:
        if not isinstance(tile, (tuple, list)):
            raise ValueError(f"tile must be a pair of ints (tile_m, tile_n), got {tile!r}")
        tile = tuple(tile)
    else:
        tile = config.auto_tile(variant, head_dim, causal, seqlen_k)
    return select(head_dim, variant, tile, head_dim_v)


def _tensor_rules(q, k, v) -> None:
    """The rules on q, k and v, in the order they are checked; raises for the first one broken."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have rank 4 (batch, seqlen, heads, head_dim), got shape {tuple(t.shape)}"
            )
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, _, heads, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"q, k, v must have the same batch size, got {batch}, {k.shape[0]}, {v.shape[0]}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must have the same (batch, seqlen_k, kv_heads), "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[3] != head_dim:
        raise ValueError(f"q and k must have the same head_dim, got {head_dim} and {k.shape[3]}")
    kv_heads = k.shape[2]
    if (kv_heads == 0 and heads != 0) or (kv_heads != 0 and heads % kv_heads != 0):
        raise ValueError(
            f"heads of q must be a multiple of the kv heads of k/v, got heads={heads}, kv_heads={kv_heads}"
        )
    config.check_head_dims(head_dim, v.shape[3])


def _check_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The GPU rules, checked after all the others: one CUDA device, and it is a Hopper."""
    index = q.get_device()  # -1 off CUDA; an int is cheaper to compare than torch.device objects
    if index in _HOPPER_DEVICES and k.get_device() == index and v.get_device() == index and q.is_cuda:
        return
    if not (q.device == k.device == v.device):
        raise RuntimeError(f"q, k, v must be on the same device, got {q.device}, {k.device}, {v.device}")
    if q.device.type != "cuda":
        raise RuntimeError(f"q, k, v must be CUDA tensors, got device {q.device}")
    _check_arch(q.device)


def _check_arch(device: torch.device) -> None:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _HOPPER_DEVICES:
        return
    major, minor = torch.cuda.get_device_capability(index)
    if major != 9:
        raise RuntimeError(
            f"hopper_fmha kernels need a Hopper GPU (sm_90, compute capability 9.x); "
            f"{device} is {torch.cuda.get_device_name(index)} with compute capability {major}.{minor}"
        )
    _HOPPER_DEVICES.add(index)


def _conforming(t: torch.Tensor) -> torch.Tensor:
    """t itself if its layout is what the kernel's TMA descriptors accept, else a contiguous copy."""
    s0, s1, s2, s3 = t.stride()
    if (
        s3 == 1
        and s0 > 0
        and s1 > 0
        and s2 > 0
        and not (s0 % _STRIDE_MULTIPLE or s1 % _STRIDE_MULTIPLE or s2 % _STRIDE_MULTIPLE)
        and t.data_ptr() % _ALIGN_BYTES == 0
    ):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _conforming_packed(t: torch.Tensor) -> torch.Tensor:
    """`_conforming` for a packed (total, heads, head_dim) tensor."""
    s0, s1, s2 = t.stride()
    if (
        s2 == 1
        and s0 > 0
        and s1 > 0
        and not (s0 % _STRIDE_MULTIPLE or s1 % _STRIDE_MULTIPLE)
        and t.data_ptr() % _ALIGN_BYTES == 0
    ):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _launch(q, k, v, out, lse, softmax_scale, causal, cfg, exact_lse, features=None) -> None:
    global _kernels
    if _kernels is None:  # imported on first use: importing the package needs no CuTe DSL
        from hopper_fmha import kernels as _kernels
    if features is None:
        _kernels.forward(q, k, v, out, lse, softmax_scale, causal, cfg, exact_lse=exact_lse)
    else:
        _kernels.forward(
            q, k, v, out, lse, softmax_scale, causal, cfg, exact_lse=exact_lse, **_feature_kwargs(features)
        )


def _feature_kwargs(features: ScoreFeatures | None) -> dict:
    """The `hopper_fmha.kernels` keywords of score features ({} for none)."""
    if features is None:
        return {}
    return {
        "window": (features.left, features.right),
        "softcap": features.softcap,
        "learnable_sink": features.sink,
    }


def _no_keys(out: torch.Tensor, lse: torch.Tensor, features, sink_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs where no query row sees a key: out 0, lse -inf, or with a sink the head's logit
    (the sink viewed as `sink_shape` against lse's layout)."""
    out.zero_()
    if features is not None and features.sink is not None:
        return out, lse.copy_(features.sink.view(sink_shape).expand_as(lse))
    return out, lse.fill_(-math.inf)


_kernels = None


def _empty_outputs(q: torch.Tensor, head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seqlen_q, heads, head_dim = q.shape
    # Contiguous whatever q's strides: the fake implementation cannot see data_ptr alignment,
    # so out's layout must not depend on whether q gets copied. (empty_like takes 60% of the host
    # time of torch.empty with a shape, dtype and device to parse.)
    if head_dim_v == head_dim:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        out = torch.empty((batch, seqlen_q, heads, head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads, seqlen_q), dtype=torch.float32, device=q.device)
    return out, lse


def _fwd_impl(
    q, k, v, softmax_scale: float, causal: bool, cfg, return_lse: bool, features: ScoreFeatures | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _empty_outputs(q, v.shape[3])
    if out.numel() == 0:
        return out, lse
    if k.shape[1] == 0:
        return _no_keys(out, lse, features, (1, -1, 1))
    q, k, v = _conforming(q), _conforming(k), _conforming(v)
    _launch(q, k, v, out, lse, softmax_scale, causal, cfg, return_lse, features)
    return out, lse


@torch.library.custom_op("hopper_fmha::fwd", mutates_args=())
def _fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    variant: str,
    tile_m: int,
    tile_n: int,
    return_lse: bool,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    # deterministic: the backward's (`backward.fwd_backward`); the forward is the same either way.
    dv = v.shape[3]
    cfg = config.select_config(q.shape[3], variant, (tile_m, tile_n), None if dv == q.shape[3] else dv)
    features = ScoreFeatures.from_op(window_left, window_right, softcap, learnable_sink)
    return _fwd_impl(q, k, v, softmax_scale, causal, cfg, return_lse, features)


@_fwd.register_fake
def _(q, k, v, softmax_scale, causal, variant, tile_m, tile_n, return_lse, *features):
    return _empty_outputs(q, v.shape[3])


def _varlen_empty_outputs(q: torch.Tensor, head_dim_v: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty((q.shape[0], q.shape[1], head_dim_v), dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    return out, lse


def _varlen_fwd_impl(
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, cfg,
    return_lse, features,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    out, lse = _varlen_empty_outputs(q, v.shape[2])
    if out.numel() == 0 or max_seqlen_q == 0:
        return out, lse
    if k.shape[0] == 0 or max_seqlen_k == 0:
        return _no_keys(out, lse, features, (-1, 1))
    q, k, v = _conforming_packed(q), _conforming_packed(k), _conforming_packed(v)
    global _kernels
    if _kernels is None:
        from hopper_fmha import kernels as _kernels
    _kernels.varlen_forward(
        q, k, v, out, lse, softmax_scale, causal, cfg, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        seqused_k, exact_lse=return_lse, **_feature_kwargs(features),
    )  # fmt: skip
    return out, lse


@torch.library.custom_op("hopper_fmha::varlen_fwd", mutates_args=())
def _varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    seqused_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    tile_m: int,
    tile_n: int,
    return_lse: bool,
    window_left: int = -1,
    window_right: int = -1,
    softcap: float = 0.0,
    learnable_sink: torch.Tensor | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    # deterministic: the backward's (`backward.varlen_fwd_backward`); the forward is the same.
    dv = v.shape[2]
    cfg = config.select_config(q.shape[2], "ws", (tile_m, tile_n), None if dv == q.shape[2] else dv)
    features = ScoreFeatures.from_op(window_left, window_right, softcap, learnable_sink)
    return _varlen_fwd_impl(
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
        cfg, return_lse, features,
    )  # fmt: skip


@_varlen_fwd.register_fake
def _(q, k, v, *args):
    return _varlen_empty_outputs(q, v.shape[2])


_fwd.register_autograd(backward.fwd_backward, setup_context=backward.fwd_setup_context)
_varlen_fwd.register_autograd(backward.varlen_fwd_backward, setup_context=backward.varlen_fwd_setup_context)
