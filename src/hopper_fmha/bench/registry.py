"""Backends the bench can time, by name, and the problem they are timed on.

A backend turns a `Problem` and one set of input tensors (q, k, v in BSHD) into a
zero-argument callable that runs one attention forward. Anything that keeps a backend from
running a problem (an import that fails, a head dim it lacks, a tile that does not fit) is a
`BackendSkip` with the reason, and the bench reports it instead of failing.

Names: `hopper-fmha` (auto and every variant), `hopper-fmha:auto` (the default: the variant
`hopper_fmha.config.auto_variant` picks per problem), `hopper-fmha:<variant>`,
`hopper-fmha:<variant>@<M>x<N>` (tile override), `hopper-fmha:ws[@<M>x<N>]/<schedule>` (the ws
tile order: auto, persistent or single; see `hopper_fmha.kernels.schedule`), a `+lse` suffix
(calls with return_lse=True: an exact LSE, which some kernels take more time for), a `+det`
suffix (deterministic=True: the backward's fixed dQ order; the backward preset), `sdpa-flash`
(FlashAttention-2 in PyTorch),
`sdpa-efficient` (the CUTLASS memory-efficient kernel, the seed paper's "CUTLASS" baseline),
`sdpa-cudnn`, `fa4` (FlashAttention-4, CuTe DSL), `fa3` (FlashAttention-3).

Varlen problems (`Problem.seqlens`: a packed batch of sequences of different lengths) take packed
inputs (q, k, v, cu_seqlens) and a backend's `varlen` builder: ours (`flash_attn_varlen_func`,
the ws kernel: auto and ws, with a tile, schedule, +lse or +det), `fa4` (FlashAttention-4's
`flash_attn_varlen_func`) and `hopper-fmha:padded` (our dense `flash_attn_func` on the batch
zero-padded to the longest sequence, the way to run such a batch without varlen: one call, its
output unpadded before the check, its FLOPs those of the real tokens). Every other backend skips
them. Without a key-padding mask, the padded call's rows also attend to the padded (zero) keys
unless the mask is causal (a row never sees the keys past its own sequence's end): non-causal,
its output is not the varlen answer and is timed unchecked (`PADDED_UNCHECKED`).

Decode problems (`Problem.kvcache`: a few query tokens against a KV cache) take the inputs (q,
k_cache, v_cache, cache_seqlens, page_table) and a backend's `kvcache` builder; no new tokens are
appended in the timed call, so it is idempotent and can be captured in a CUDA graph. Ours:
`flash_attn_with_kvcache` (auto and ws, with a schedule or +lse). `fa4`: FlashAttention-4's cute
interface has no `flash_attn_with_kvcache`; its `flash_attn_varlen_func` takes the same call (a
batch-major q and cache, `seqused_k` = cache_seqlens, `page_table`), with its default num_splits
= 1, as its sm90 path refuses split-KV ("SplitKV not supported on SM 9.0"). SDPA (`sdpa-cudnn`,
and `sdpa-flash` / `sdpa-efficient` alike): dense caches only (paged ones skip), the cache as K
and V with enable_gqa; where some keys are hidden (ragged lengths, or causal with seqlen_q > 1) a
boolean mask (`decode_mask`) hides them, so SDPA still reads the whole capacity: its time is that
of the same answer, not of the tokens read. `copy` (`COPY`): the bandwidth yardstick, a
device-to-device copy (`dst.copy_(src)`, cudaMemcpy) of `Problem.kv_bytes` bytes, timed in the
same run as the kernels; its output is not attention and is not checked (`COPY_UNCHECKED`).

Training problems (`Problem.passes` "bwd" or "fwd+bwd", the `backward` and `backward-features`
presets) take the inputs (q, k, v, dout), or for a varlen problem (q, k, v, cu_seqlens, dout), and
run every backend's forward (`Backend.forward`: `build`, or `varlen` on packed inputs) through
autograd (`autograd_call`): the backward alone (the forward run once beforehand, untimed) or the
forward then the backward, each call returning (dq, dk, dv). Score features reach the forward as
in a forward problem (below), the sink requiring grad (a learnable sink is trained: the backends'
backward computes its gradient, which the call does not return). The backends without such a
forward skip them (`copy`; `hopper-fmha:padded`, whose padding runs once at build time, outside
the timed call and its graph).

Score features (`Problem.window_size`, `softcap`, `sink`, the `features` preset; dense problems,
forward or training) and v's head dim (`Problem.head_dim_v`, dense forward problems only): each
backend gets them through its own keywords, spelled out in one function per backend so that a
renamed keyword is one line to fix. Ours and the reference: `feature_kwargs` (window_size=(left,
right), softcap=, learnable_sink= float32). FA4: `fa4_feature_kwargs` (its cute flash_attn_func's
window_size with None for a side without limit, softcap=, learnable_sink= in bfloat16);
where the installed FA4's flash_attn_func lacks one of those keywords the cell is skipped with
the keyword named (`missing_keywords`), never called without it. SDPA (cuDNN and the others)
has no window, softcap or sink: such cells are skipped (`SDPA_NO_FEATURES`), not emulated with
a dense mask, which would time another computation; a v head dim of its own (d 192, dv 128) is
passed as is, and SDPA takes or refuses it (reported as skipped with its reason). FA3 gets no
feature keywords in this bench and skips them. The sink's values are the problem's
(`sink_logits`), the same for every backend and for the check.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hopper_fmha.bench.flops import (
    BWD,
    FWD,
    NO_WINDOW,
    PASS_FLOPS,
    attention_flops,
    pass_flops,
    window_bounds,
    window_flops,
)

DTYPES = ("float16", "bfloat16")
_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16"}
_DTYPE_SHORT = {"float16": "fp16", "bfloat16": "bf16"}


def canonical_dtype(name: str) -> str:
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES} (or fp16/bf16), got {name!r}")
    return name


@dataclass(frozen=True)
class Problem:
    """One attention forward to time. Dense: `batch` sequences of `seqlen_q` queries and
    `seqlen_k` keys. Varlen (`seqlens` given, `Problem.varlen`): one packed batch of
    len(seqlens) sequences, sequence b with seqlens[b] queries and as many keys; batch is then
    the number of sequences and seqlen_q = seqlen_k the longest. FLOPs and bytes count the real
    tokens of each sequence.

    Decode (`kvcache`, `Problem.decode`): `batch` sequences of `seqlen_q` query tokens against a
    KV cache of capacity `seqlen_k` tokens per sequence, of which sequence b holds
    cache_seqlens[b] (None: all full); dense caches (batch, capacity, kv_heads, d), or paged ones
    of `page_size` tokens per page. The bytes are the K and V of the tokens attended
    (`kv_bytes`); the FLOPs 4·H·seqlen_q·len·d per sequence, not halved for causal (a few
    queries at the end of a long cache see nearly every key).

    Training (`passes` "bwd" or "fwd+bwd", dense or varlen problems, score features included;
    "fwd", the default, is the forward): the backward alone or the forward then the backward,
    timed through autograd (`autograd_call`); the FLOPs 2.5 or 3.5 times the forward's
    (`flops.pass_flops`: the forward's as counted below, per sequence or per visible pair).

    Score features (dense problems, forward or training): `window_size` (left, right), a sliding
    window as `hopper_fmha.flash_attn_func`'s ((-1, -1): none; causal sets right = 0), `softcap`
    (0: off), `sink` (a learnable_sink of shape (heads,), `sink_logits`), and `head_dim_v`, v's
    head dim where it differs from q's and k's (None: the same; equal to head_dim reads as None;
    dense forward problems only: no backward cell uses it). FLOPs: 2·(d + dv) per visible
    (query, key) pair under a window (`flops.window_flops`), else 2·B·H·Nq·Nk·(d + dv), halved
    for causal; softcap and sink add none."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool = False
    dtype: str = "float16"
    seqlens: tuple[int, ...] | None = None
    kvcache: bool = False
    cache_seqlens: tuple[int, ...] | None = None
    page_size: int | None = None
    passes: str = FWD
    window_size: tuple[int, int] = NO_WINDOW
    softcap: float = 0.0
    sink: bool = False
    head_dim_v: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        for field in ("batch", "seqlen_q", "seqlen_k", "heads", "kv_heads", "head_dim"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.seqlens is not None:
            lens = tuple(int(n) for n in self.seqlens)  # a JSON list back to a (hashable) tuple
            object.__setattr__(self, "seqlens", lens)
            if not lens or min(lens) < 1:
                raise ValueError(f"seqlens must be positive lengths, got {lens}")
            if (self.batch, self.seqlen_q, self.seqlen_k) != (len(lens), max(lens), max(lens)):
                raise ValueError(
                    f"a varlen problem has batch = len(seqlens) = {len(lens)} and seqlen_q = seqlen_k = "
                    f"max(seqlens) = {max(lens)}, got {self.batch}, {self.seqlen_q}, {self.seqlen_k}"
                )
        if self.kvcache:
            self._check_cache()
        elif self.cache_seqlens is not None or self.page_size is not None:
            raise ValueError("cache_seqlens and page_size belong to decode problems (kvcache=True)")
        if self.passes not in PASS_FLOPS:
            raise ValueError(f"passes must be one of {tuple(PASS_FLOPS)}, got {self.passes!r}")
        if self.training and self.kvcache:
            raise ValueError(f"passes={self.passes!r} (a backward) is timed on dense and varlen problems")
        self._check_features()

    def _check_features(self) -> None:
        """window_size a pair of ints >= -1 (a JSON list back to a tuple), softcap a finite float
        >= 0, head_dim_v positive (equal to head_dim: None); the features and head_dim_v on dense
        problems only."""
        try:
            window = tuple(int(side) for side in self.window_size)
        except (TypeError, ValueError):
            raise ValueError(f"window_size must be a pair (left, right), got {self.window_size!r}") from None
        if len(window) != 2 or min(window) < -1:
            raise ValueError(
                f"window_size must be a pair (left, right) of ints >= -1, got {self.window_size!r}"
            )
        object.__setattr__(self, "window_size", window)
        softcap = float(self.softcap)
        if not 0 <= softcap < math.inf:
            raise ValueError(f"softcap must be a finite float >= 0 (0: off), got {self.softcap!r}")
        object.__setattr__(self, "softcap", softcap)
        object.__setattr__(self, "sink", bool(self.sink))
        if self.head_dim_v is not None:
            if self.head_dim_v < 1:
                raise ValueError(f"head_dim_v must be positive, got {self.head_dim_v}")
            if self.head_dim_v == self.head_dim:  # one problem, one label
                object.__setattr__(self, "head_dim_v", None)
        dense = not self.kvcache and self.seqlens is None
        if (self.has_features or self.head_dim_v) and not dense:
            raise ValueError(
                "score features (window_size, softcap, sink) and head_dim_v are timed on dense problems "
                "only, forward or training"
            )

    def _check_cache(self) -> None:
        if self.seqlens is not None:
            raise ValueError("a decode problem has a cache per sequence, not packed seqlens")
        if self.cache_seqlens is not None:
            lens = tuple(int(n) for n in self.cache_seqlens)
            if len(lens) != self.batch or not all(1 <= n <= self.seqlen_k for n in lens):
                raise ValueError(
                    f"cache_seqlens must be {self.batch} lengths (the batch) in 1..{self.seqlen_k} (the "
                    f"capacity), got {lens}"
                )
            # All full is the full cache: one problem, one label.
            object.__setattr__(self, "cache_seqlens", None if min(lens) == self.seqlen_k else lens)
        if self.page_size is not None and (self.page_size < 1 or self.seqlen_k % self.page_size):
            raise ValueError(
                f"page_size must be a positive divisor of the capacity {self.seqlen_k}, got {self.page_size}"
            )

    @classmethod
    def varlen(
        cls, seqlens, heads: int, kv_heads: int, head_dim: int, causal: bool = False, dtype: str = "float16"
    ) -> Problem:
        """A packed batch of sequences of these lengths (queries and keys alike)."""
        lens = tuple(seqlens)
        top = max(lens, default=0)
        return cls(len(lens), top, top, heads, kv_heads, head_dim, causal, dtype, lens)

    @classmethod
    def decode(
        cls,
        batch: int,
        capacity: int,
        heads: int,
        kv_heads: int,
        head_dim: int,
        seqlen_q: int = 1,
        causal: bool = False,
        dtype: str = "bfloat16",
        cache_seqlens=None,
        page_size: int | None = None,
    ) -> Problem:
        """`seqlen_q` new query tokens per sequence against a KV cache of `capacity` tokens per
        sequence, holding cache_seqlens[b] of them (None: full); paged when page_size is given."""
        lens = None if cache_seqlens is None else tuple(cache_seqlens)
        shape = (batch, seqlen_q, capacity, heads, kv_heads, head_dim, causal, dtype)
        return cls(*shape, kvcache=True, cache_seqlens=lens, page_size=page_size)

    @property
    def has_features(self) -> bool:
        """Whether the problem has a score feature: a window, a softcap or a sink."""
        return self.window_size != NO_WINDOW or bool(self.softcap) or self.sink

    @property
    def dv(self) -> int:
        """v's head dim (`head_dim_v`, else head_dim)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    def feature_words(self) -> list[str]:
        """The score features as short words, e.g. ["window 4096/0", "softcap 30", "sink"]."""
        words = [f"window {self.window_size[0]}/{self.window_size[1]}"] * (self.window_size != NO_WINDOW)
        return words + [f"softcap {self.softcap:g}"] * bool(self.softcap) + ["sink"] * self.sink

    @property
    def training(self) -> bool:
        """Whether the problem times a backward (`passes` other than "fwd")."""
        return self.passes != FWD

    @property
    def cache_lengths(self) -> tuple[int, ...]:
        """Decode: the tokens each sequence attends (its cache_seqlens, else the capacity)."""
        return self.cache_seqlens or (self.seqlen_k,) * self.batch

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V over the keys attended, each read once: decode's bytes, the sum over
        sequences of length · kv_heads · (d + dv) · 2 bytes."""
        keys = sum(self.cache_lengths) if self.kvcache else self._rows()[1]
        return keys * self.kv_heads * (self.head_dim + self.dv) * 2

    @property
    def offsets(self) -> tuple[int, ...]:
        """Varlen: where each sequence's rows start in the packed tensors, then the total
        (cu_seqlens)."""
        out = [0]
        for n in self.seqlens:
            out.append(out[-1] + n)
        return tuple(out)

    @property
    def flops(self) -> float:
        """FLOPs of the passes timed: `pass_flops` of the forward's (class docstring)."""
        if self.kvcache:
            per_key = attention_flops(1, self.heads, self.seqlen_q, 1, self.head_dim)
            return per_key * sum(self.cache_lengths)
        return pass_flops(self._forward_flops(), self.passes)

    def _forward_flops(self) -> float:
        """One forward's FLOPs: per sequence for a varlen problem, per visible pair under a window."""
        if self.seqlens is not None:
            return sum(attention_flops(1, self.heads, n, n, self.head_dim, self.causal) for n in self.seqlens)
        shape = (self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim)
        if self.window_size != NO_WINDOW:
            left, right = window_bounds(self.causal, self.window_size)
            return window_flops(*shape, left, right, self.head_dim_v)
        return attention_flops(*shape, self.causal, self.head_dim_v)

    def _rows(self) -> tuple[int, int]:
        """(query rows, key rows) over all sequences."""
        if self.seqlens is None:
            return self.batch * self.seqlen_q, self.batch * self.seqlen_k
        return sum(self.seqlens), sum(self.seqlens)

    @property
    def input_bytes(self) -> int:
        """Bytes of q, k, v and the output: what one call reads and writes (decode: what one input
        set holds, the whole capacity of the cache; training: q, k, v, the output, its gradient
        dout, and dq, dk, dv)."""
        q_rows, k_rows = self._rows()
        per_side = 2 if self.training else 1  # (q, out) and (k, v); training: their gradients too
        return 2 * per_side * (q_rows * self.heads + k_rows * self.kv_heads) * (self.head_dim + self.dv)

    @property
    def output_bytes(self) -> int:
        """Bytes of the output (what a captured graph keeps alive per call); training: the output
        each input set's call keeps for autograd and the gradients dq, dk, dv it returns."""
        q_rows, k_rows = self._rows()
        q_side = 2 * q_rows * self.heads * self.dv
        if not self.training:
            return q_side
        return 2 * q_side + 2 * (2 * k_rows * self.kv_heads * self.head_dim)

    def label(self) -> str:
        if self.kvcache:
            return self._decode_label()
        if self.seqlens is not None:
            seq = f"varlen{self.batch} L{min(self.seqlens)}-{self.seqlen_q}"
        elif self.seqlen_q == self.seqlen_k:
            seq = f"B{self.batch} N{self.seqlen_q}"
        else:
            seq = f"B{self.batch} Nq{self.seqlen_q} Nk{self.seqlen_k}"
        heads = f"H{self.heads}" if self.kv_heads == self.heads else f"H{self.heads}/{self.kv_heads}"
        causal = " causal" if self.causal else ""
        passes = f" {self.passes}" if self.training else ""
        dims = f"d{self.head_dim}" + (f" dv{self.head_dim_v}" if self.head_dim_v else "")
        features = "".join(" " + w.replace(" ", "") for w in self.feature_words())  # "window4096/0"
        return f"{seq} {heads} {dims} {_DTYPE_SHORT[self.dtype]}{causal}{passes}{features}"

    def _decode_label(self) -> str:
        """E.g. "decode B64 L8192 H32/8 d128 bf16 q1 paged64 ragged"."""
        heads = f"H{self.heads}" if self.kv_heads == self.heads else f"H{self.heads}/{self.kv_heads}"
        words = [f"decode B{self.batch} L{self.seqlen_k} {heads} d{self.head_dim}"]
        words.append(f"{_DTYPE_SHORT[self.dtype]} q{self.seqlen_q}")
        words += ["causal"] * self.causal + [f"paged{self.page_size}"] * bool(self.page_size)
        return " ".join(words + ["ragged"] * bool(self.cache_seqlens))

    def to_dict(self) -> dict:
        """The fields as JSON takes them; a field at its default (seqlens, the decode fields,
        passes "fwd", the score features, head_dim_v) has no key, so forward problems read as
        before."""
        d = asdict(self)
        defaults = {
            "passes": FWD,
            "window_size": NO_WINDOW,
            "softcap": 0.0,
            "sink": False,
            "head_dim_v": None,
        }
        for key, default in defaults.items():
            if d[key] == default:
                del d[key]
        if "window_size" in d:
            d["window_size"] = list(d["window_size"])
        for key in ("seqlens", "kvcache", "cache_seqlens", "page_size"):
            if d[key] in (None, False):
                del d[key]
            elif isinstance(d[key], tuple):
                d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Problem:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class BackendSkip(Exception):
    """A backend cannot run a problem; `status` is "skipped" or "rejected" (config refused)."""

    def __init__(self, reason: str, status: str = "skipped"):
        super().__init__(reason)
        self.reason = reason
        self.status = status


# build(problem, q, k, v); for a varlen problem build(problem, q, k, v, cu_seqlens); for a decode
# problem build(problem, q, k_cache, v_cache, cache_seqlens, page_table).
Builder = Callable[..., Callable[[], Any]]


@dataclass(frozen=True)
class Backend:
    name: str
    label: str  # short column title
    build: Builder
    # Layout of what the callable returns: "bshd", "bhsd", or "padded" (a varlen problem's
    # sequences as a zero-padded (batch, longest, heads, d) batch, unpadded before the check).
    layout: str = "bshd"
    ours: bool = False
    # Entered around everything the bench does with this backend (e.g. SDPA backend choice),
    # so that per-call host overhead is the call's own.
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    varlen: Builder | None = None  # builds the call on a varlen problem's packed inputs
    kvcache: Builder | None = None  # builds the call on a decode problem's cache
    unchecked: str | None = None  # why its output is not checked (not attention), if it is not

    def make(self, p: Problem, *inputs) -> Callable[[], Any]:
        """The call on one input set: `kvcache` for a decode problem, `autograd_call` (around
        `forward`) for a training one, else `forward`."""
        if p.kvcache:
            if self.kvcache is None:
                raise BackendSkip(f"{self.name} has no KV-cache (decode) call in this bench")
            return self.kvcache(p, *inputs)
        if p.training:
            return autograd_call(self, p, *inputs)
        return self.forward(p, *inputs)

    def forward(self, p: Problem, *inputs) -> Callable[[], Any]:
        """The forward call: `build` for a dense problem, `varlen` for a varlen one (packed inputs)."""
        if p.seqlens is None:
            return self.build(p, *inputs)
        if self.varlen is None:
            raise BackendSkip(f"{self.name} has no varlen (packed sequences) call in this bench")
        return self.varlen(p, *inputs)


def first_output(out):
    """The output of a call that returns out or (out, lse) (FA4 and FA3 by version, ours with
    return_lse)."""
    return out[0] if isinstance(out, (tuple, list)) else out


def autograd_call(backend: Backend, p: Problem, q, k, v, *rest) -> Callable[[], Any]:
    """A training problem's call on one input set, (q, k, v, dout) or for a varlen problem (q, k,
    v, cu_seqlens, dout), built the same way for every backend: its forward (`backend.forward`)
    on leaves that require grad (q, k, v detached; a sink gets requires_grad from
    `feature_kwargs`), then `torch.autograd.grad(out, (q, k, v), dout)`, out being the forward's
    output (the first of (out, lse)) and dout transposed to match an output in the "bhsd" layout.
    The call returns (dq, dk, dv) in the layout of q, k, v (BSHD, or packed rows) for every
    backend.

    passes "bwd": the forward runs once here, outside the timed call, and the call is the grad
    alone, with retain_graph=True so that it can be repeated; "fwd+bwd": the call runs the forward
    then the grad. Whatever raises here (the forward included, for "bwd") reaches the runner,
    which reports the backend as skipped for this problem."""
    import torch

    if backend.layout == "padded":
        # Its padding runs once at build: a graph through it could not be run again (fwd+bwd),
        # and it would not be the padded forward alone that is timed.
        raise BackendSkip(f"{backend.name} times the forward only (its padding runs once, at build time)")
    *lens, dout = rest  # (cu_seqlens,) for a varlen problem, else ()
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
    forward = backend.forward(p, *leaves, *lens)
    grad_out = dout.transpose(1, 2) if backend.layout == "bhsd" else dout
    if p.passes == BWD:
        out = first_output(forward())
        return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
    return lambda: torch.autograd.grad(first_output(forward()), leaves, grad_out)


def decode_mask(p: Problem, device=None):
    """A decode problem's keys as SDPA's boolean attn_mask (True: attended), broadcast over heads:
    key j of sequence b counts for query row i iff j < len_b and, causal, j <= i + len_b - seqlen_q
    (bottom-right aligned). (batch, 1, seqlen_q, capacity), or (1, 1, seqlen_q, capacity) for a
    full cache; None where every key counts (full and not causal)."""
    import torch

    if p.cache_seqlens is None and not p.causal:
        return None
    lens = torch.tensor(p.cache_seqlens or (p.seqlen_k,), device=device)[:, None, None, None]
    rows = torch.arange(p.seqlen_q, device=device)[:, None]
    keys = torch.arange(p.seqlen_k, device=device)
    mask = keys < lens
    if p.causal:
        mask = mask & (keys <= rows + lens - p.seqlen_q)
    return mask


# Sink logits near log(seqlen_k): with scores of unit spread (random q, k at the default scale) a
# row's sum of exp is about 1.65 per visible key, so the sink holds a sizable share of each row's
# softmax mass at any length, and a call that drops it fails the check.
SINK_SEED = 0


def sink_logits(p: Problem, device=None):
    """A sink problem's learnable_sink: (heads,) float32, log(seqlen_k) plus one draw from N(0, 1)
    per head by Python's own generator (the same on every machine), rounded to bfloat16 values,
    so that FA4 (which takes it in bfloat16) and ours (float32) and the check see the same
    numbers; None for a problem without a sink."""
    import torch

    if not p.sink:
        return None
    rng = random.Random(SINK_SEED)
    logits = [math.log(p.seqlen_k) + rng.gauss(0.0, 1.0) for _ in range(p.heads)]
    return torch.tensor(logits, dtype=torch.bfloat16).to(device=device, dtype=torch.float32)


def feature_kwargs(p: Problem, device=None) -> dict:
    """The score-feature keywords of our flash_attn_func and of `hopper_fmha.reference` (the same
    names): window_size=(left, right), softcap=, learnable_sink= (float32, `sink_logits`;
    requiring grad in a training problem, as a learnable sink is trained), each only where the
    problem sets it, so that a plain problem's call is unchanged."""
    kwargs: dict[str, Any] = {}
    if p.window_size != NO_WINDOW:
        kwargs["window_size"] = p.window_size
    if p.softcap:
        kwargs["softcap"] = p.softcap
    if p.sink:
        kwargs["learnable_sink"] = sink_logits(p, device).requires_grad_(p.training)
    return kwargs


def fa4_feature_kwargs(p: Problem, device=None) -> dict:
    """The same for FA4's cute flash_attn_func and flash_attn_varlen_func (as of flash-attn-4
    4.0.0b36): window_size=(left, right) with None for a side without limit (its -1 is no such
    marker), softcap=, and learnable_sink= in bfloat16 (the dtype earlier versions assert;
    4.0.0b36 takes float16 and float32 too), a leaf requiring grad in a training problem
    (4.0.0b36's backward computes the sink's gradient on sm90). Only where set, as
    `feature_kwargs`."""
    kwargs: dict[str, Any] = {}
    if p.window_size != NO_WINDOW:
        kwargs["window_size"] = tuple(None if side < 0 else side for side in p.window_size)
    if p.softcap:
        kwargs["softcap"] = p.softcap
    if p.sink:
        import torch

        kwargs["learnable_sink"] = sink_logits(p, device).to(torch.bfloat16).requires_grad_(p.training)
    return kwargs


def missing_keywords(fn: Callable, names) -> list[str]:
    """The names among `names` that `fn` takes by no keyword; none where it takes **kwargs or its
    signature cannot be read (then the call itself decides)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return []
    if any(x.kind is inspect.Parameter.VAR_KEYWORD for x in params):
        return []
    named = {
        x.name
        for x in params
        if x.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return [name for name in names if name not in named]


# Why SDPA backends skip problems with score features (module docstring).
SDPA_NO_FEATURES = (
    "not supported: SDPA takes no sliding window, softcap or learnable sink (a dense mask would time "
    "another computation, so the bench does not emulate them)"
)


def _sdpa_backend(attr: str) -> tuple[Builder, Builder, Callable[[], contextlib.AbstractContextManager]]:
    def context():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, attr))

    def build(p: Problem, q, k, v):
        import torch.nn.functional as F

        if p.has_features:
            raise BackendSkip(SDPA_NO_FEATURES)
        if p.causal and p.seqlen_q != p.seqlen_k:
            raise BackendSkip(
                "SDPA's causal mask is top-left aligned, this package's is bottom-right: "
                "they differ when seqlen_q != seqlen_k"
            )
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        kwargs = {"is_causal": p.causal}
        if p.kv_heads != p.heads:
            kwargs["enable_gqa"] = True
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, **kwargs)

    def build_kvcache(p: Problem, q, k_cache, v_cache, cache_seqlens, page_table):
        import torch.nn.functional as F

        if page_table is not None:
            raise BackendSkip("SDPA takes dense K and V: no paged cache")
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k_cache, v_cache))
        kwargs = {"attn_mask": decode_mask(p, q.device)}
        if p.kv_heads != p.heads:
            kwargs["enable_gqa"] = True
        return lambda: F.scaled_dot_product_attention(qt, kt, vt, **kwargs)

    return build, build_kvcache, context


def _import_skip(module: str, attr: str):
    import importlib

    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as e:  # ImportError, or a broken install raising anything at import
        raise BackendSkip(f"{module}.{attr} not importable ({type(e).__name__}: {e})") from e


def _build_fa4(p: Problem, q, k, v):
    fn = _import_skip("flash_attn.cute", "flash_attn_func")
    kwargs = fa4_feature_kwargs(p, q.device) if p.has_features else {}
    missing = missing_keywords(fn, kwargs)
    if missing:
        raise BackendSkip(
            f"flash_attn.cute.flash_attn_func (as installed) takes no {', '.join(m + '=' for m in missing)} "
            "keyword: see registry.fa4_feature_kwargs"
        )
    return lambda: fn(q, k, v, causal=p.causal, **kwargs)  # returns out or (out, lse) by version


def _build_fa4_varlen(p: Problem, q, k, v, cu_seqlens):
    fn = _import_skip("flash_attn.cute", "flash_attn_varlen_func")
    # By keyword: its fourth parameter is qv (MLA), not cu_seqlens_q.
    return lambda: fn(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=p.seqlen_q, max_seqlen_k=p.seqlen_k, causal=p.causal,
    )  # fmt: skip


def _build_fa4_kvcache(p: Problem, q, k_cache, v_cache, cache_seqlens, page_table):
    fn = _import_skip("flash_attn.cute", "flash_attn_varlen_func")
    kwargs = {"seqused_k": cache_seqlens, "page_table": page_table, "causal": p.causal}
    return lambda: fn(q, k_cache, v_cache, **kwargs)  # the module docstring says why this call


def _build_fa3(p: Problem, q, k, v):
    if p.has_features:
        raise BackendSkip("this bench passes no score features (window, softcap, sink) to fa3")
    fn = _import_skip("flash_attn_interface", "flash_attn_func")
    return lambda: fn(q, k, v, causal=p.causal)


def parse_tile(text: str) -> tuple[int, int]:
    """ "128x64" -> (128, 64)."""
    try:
        m, n = text.lower().split("x")
        return int(m), int(n)
    except ValueError:
        raise ValueError(f"tile must look like 128x64 (tile_m x tile_n), got {text!r}") from None


# `hopper-fmha:auto`: what a user gets by default (variant=None: hopper_fmha.config.auto_variant).
AUTO = "auto"


def _ours(
    variant: str | None,
    tile: tuple[int, int] | None,
    schedule: str | None = None,
    lse: bool = False,
    deterministic: bool = False,
) -> Backend:
    def checked(p: Problem, kernel: str) -> None:
        """The tile table (or the tile) of variant `kernel` fits p's head dims, and the variant
        has p's score features, else a skip."""
        if kernel == "paper" and p.has_features:
            raise BackendSkip("rejected: the paper variant has no window, softcap or sink", status="rejected")
        try:
            from hopper_fmha.config import select_config
        except Exception as e:
            raise BackendSkip(f"hopper_fmha.config not importable ({type(e).__name__}: {e})") from e
        try:
            select_config(p.head_dim, kernel, tile, p.head_dim_v)
        except ValueError as e:
            raise BackendSkip(f"rejected: {e}", status="rejected") from e

    def scheduled(call: Callable[[], Any]) -> Callable[[], Any]:
        if schedule is None:
            return call
        from hopper_fmha import kernels

        def with_schedule():
            kernels.SCHEDULE = schedule  # the ws tile order; restored to "auto" after each call
            try:
                return call()
            finally:
                kernels.SCHEDULE = "auto"

        return with_schedule

    def build(p: Problem, q, k, v):
        checked(p, "ws" if variant is None else variant)
        fn = _import_skip("hopper_fmha", "flash_attn_func")
        kwargs = feature_kwargs(p, q.device) if p.has_features else {}
        if deterministic:
            kwargs["deterministic"] = True
        return scheduled(
            lambda: fn(q, k, v, causal=p.causal, return_lse=lse, variant=variant, tile=tile, **kwargs)
        )

    def build_varlen(p: Problem, q, k, v, cu_seqlens):
        if variant not in (None, "ws"):
            raise BackendSkip(f"flash_attn_varlen_func runs the ws kernel only, not {variant}")
        checked(p, "ws")
        fn = _import_skip("hopper_fmha", "flash_attn_varlen_func")
        lens = (cu_seqlens, cu_seqlens, p.seqlen_q, p.seqlen_k)
        kwargs = {"deterministic": True} if deterministic else {}
        return scheduled(lambda: fn(q, k, v, *lens, causal=p.causal, return_lse=lse, tile=tile, **kwargs))

    def build_kvcache(p: Problem, q, k_cache, v_cache, cache_seqlens, page_table):
        if variant not in (None, "ws"):
            raise BackendSkip(f"flash_attn_with_kvcache runs the ws kernel only, not {variant}")
        if tile is not None:
            raise BackendSkip("flash_attn_with_kvcache takes no tile override")
        checked(p, "ws")
        fn = _import_skip("hopper_fmha", "flash_attn_with_kvcache")
        kwargs = {"cache_seqlens": cache_seqlens, "page_table": page_table, "causal": p.causal}
        return scheduled(lambda: fn(q, k_cache, v_cache, **kwargs, return_lse=lse))

    name = f"hopper-fmha:{variant or AUTO}" + (f"@{tile[0]}x{tile[1]}" if tile else "")
    name += f"/{schedule}" if schedule else ""
    name += "+lse" if lse else ""
    name += "+det" if deterministic else ""
    return Backend(name=name, label=name, build=build, ours=True, varlen=build_varlen, kvcache=build_kvcache)


# Our dense kernel on a varlen problem's batch padded to the longest sequence (module docstring).
PADDED = "hopper-fmha:padded"
PADDED_UNCHECKED = (
    "not checked: non-causal, the padded call's rows also attend to the zero keys that pad their "
    "sequence (no key-padding mask), so its output is not the varlen answer; timed as the dense baseline"
)


def pad(x, seqlens: Sequence[int]):
    """Packed rows (total, ...) of sequences of these lengths -> (len(seqlens), longest, ...),
    zero past each sequence's end."""
    out = x.new_zeros((len(seqlens), max(seqlens), *x.shape[1:]))
    start = 0
    for b, n in enumerate(seqlens):
        out[b, :n] = x[start : start + n]
        start += n
    return out


def unpad(x, seqlens: Sequence[int]):
    """The inverse of `pad`: each sequence's real rows of a padded batch, packed."""
    import torch

    return torch.cat([x[b, :n] for b, n in enumerate(seqlens)])


def _padded() -> Backend:
    def build(p: Problem, q, k, v):
        raise BackendSkip(f"{PADDED} runs varlen problems only (their batch padded to the longest)")

    def build_varlen(p: Problem, q, k, v, cu_seqlens):
        fn = _import_skip("hopper_fmha", "flash_attn_func")
        qp, kp, vp = (pad(x, p.seqlens) for x in (q, k, v))
        return lambda: fn(qp, kp, vp, causal=p.causal)

    return Backend(PADDED, "padded", build, layout="padded", ours=True, varlen=build_varlen)


# The bandwidth yardstick of decode problems (module docstring).
COPY = "copy"
COPY_UNCHECKED = "not checked: a device-to-device copy of the K/V bytes, the bandwidth yardstick"


def _copy() -> Backend:
    def build(p: Problem, *inputs):
        raise BackendSkip(f"{COPY} (the bandwidth yardstick) runs decode problems only")

    def build_kvcache(p: Problem, q, k_cache, v_cache, cache_seqlens, page_table):
        import torch

        src = torch.empty(p.kv_bytes, dtype=torch.uint8, device=q.device)  # its values do not matter
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)

    return Backend(COPY, "copy", build, kvcache=build_kvcache, unchecked=COPY_UNCHECKED)


def _peers() -> dict[str, Backend]:
    peers = {}
    for name, label, attr in (
        ("sdpa-flash", "FA2", "FLASH_ATTENTION"),
        ("sdpa-efficient", "mem-eff", "EFFICIENT_ATTENTION"),
        ("sdpa-cudnn", "cuDNN", "CUDNN_ATTENTION"),
    ):
        build, kvcache, context = _sdpa_backend(attr)
        peers[name] = Backend(name, label, build, layout="bhsd", context=context, kvcache=kvcache)
    peers["fa4"] = Backend("fa4", "FA4", _build_fa4, varlen=_build_fa4_varlen, kvcache=_build_fa4_kvcache)
    peers["fa3"] = Backend(name="fa3", label="FA3", build=_build_fa3)
    return peers


# Backends by name; tests register fakes here.
REGISTRY: dict[str, Backend] = {**_peers(), PADDED: _padded(), COPY: _copy()}
ALIASES = {"fa2": "sdpa-flash", "flash": "sdpa-flash", "efficient": "sdpa-efficient",
           "cutlass": "sdpa-efficient", "cudnn": "sdpa-cudnn"}  # fmt: skip
DEFAULT_BACKENDS = ("hopper-fmha", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "fa4", "fa3")
# The reference points of every report: FA2 (what the seed paper compares with) and the best
# of the state of the art.
FA2 = "sdpa-flash"
BEST_PEERS = ("sdpa-cudnn", "fa4", "fa3")


def _variants() -> tuple[str, ...]:
    from hopper_fmha.config import VARIANTS

    return tuple(VARIANTS)


def get_backend(name: str) -> list[Backend]:
    """The backend(s) a name stands for; `hopper-fmha` alone expands to `auto` and every variant."""
    name = ALIASES.get(name, name)
    if name in REGISTRY:
        return [REGISTRY[name]]
    if name == "hopper-fmha":
        return [_ours(None, None)] + [_ours(v, None) for v in _variants()]
    if name.startswith("hopper-fmha:"):
        spec = name.removeprefix("hopper-fmha:")
        deterministic = spec.endswith("+det")
        spec = spec.removesuffix("+det")
        lse = spec.endswith("+lse")
        spec = spec.removesuffix("+lse")
        if lse and "/" in spec:
            raise ValueError(f"+lse does not combine with a schedule in {name!r}")
        spec, _, schedule = spec.partition("/")
        variant, _, tile_text = spec.partition("@")
        if variant == AUTO and not tile_text:
            return [_ours(None, None, schedule or None, lse, deterministic)]
        if variant not in _variants():
            raise ValueError(f"unknown hopper-fmha variant {variant!r} in {name!r}; variants: {_variants()}")
        from hopper_fmha.kernels import SCHEDULES

        if schedule and schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r} in {name!r}; schedules: {', '.join(SCHEDULES)}")
        tile = parse_tile(tile_text) if tile_text else None
        return [_ours(variant, tile, schedule or None, lse, deterministic)]
    known = sorted(set(REGISTRY) | set(ALIASES)) + [
        "hopper-fmha",
        "hopper-fmha:<variant>[@MxN][/schedule]",
        "hopper-fmha:<variant>[@MxN]+lse",
        "hopper-fmha:<variant>[@MxN][+lse]+det",
    ]
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(known)}")


def resolve_backends(names: Sequence[str]) -> list[Backend]:
    """Backends for a list of names, in order, without duplicates."""
    out: dict[str, Backend] = {}
    for name in names:
        for b in get_backend(name.strip()):
            out.setdefault(b.name, b)
    return list(out.values())
