"""Backends the bench can time, by name, and the problem they are timed on.

A backend turns a `Problem` and one set of input tensors (q, k, v in BSHD) into a
zero-argument callable that runs one attention forward. Anything that keeps a backend from
running a problem (an import that fails, a head dim it lacks, a tile that does not fit) is a
`BackendSkip` with the reason, and the bench reports it instead of failing.

Names: `hopper-fmha` (auto and every variant), `hopper-fmha:auto` (the default: the variant
`hopper_fmha.config.auto_variant` picks per problem), `hopper-fmha:<variant>`,
`hopper-fmha:<variant>@<M>x<N>` (tile override), `hopper-fmha:ws[@<M>x<N>]/<schedule>` (the ws
tile order: auto, persistent or single; see `hopper_fmha.kernels.schedule`), a `+lse` suffix
(calls with return_lse=True: an exact LSE, which some kernels take more time for), `sdpa-flash`
(FlashAttention-2 in PyTorch),
`sdpa-efficient` (the CUTLASS memory-efficient kernel, the seed paper's "CUTLASS" baseline),
`sdpa-cudnn`, `fa4` (FlashAttention-4, CuTe DSL), `fa3` (FlashAttention-3).

Varlen problems (`Problem.seqlens`: a packed batch of sequences of different lengths) take packed
inputs (q, k, v, cu_seqlens) and a backend's `varlen` builder: ours (`flash_attn_varlen_func`,
the ws kernel: auto and ws, with a tile, schedule or +lse), `fa4` (FlashAttention-4's
`flash_attn_varlen_func`) and `hopper-fmha:padded` (our dense `flash_attn_func` on the batch
zero-padded to the longest sequence, the way to run such a batch without varlen: one call, its
output unpadded before the check, its FLOPs those of the real tokens). Every other backend skips
them. Without a key-padding mask, the padded call's rows also attend to the padded (zero) keys
unless the mask is causal (a row never sees the keys past its own sequence's end): non-causal,
its output is not the varlen answer and is timed unchecked (`PADDED_UNCHECKED`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from hopper_fmha.bench.flops import attention_flops

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
    tokens of each sequence."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool = False
    dtype: str = "float16"
    seqlens: tuple[int, ...] | None = None

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

    @classmethod
    def varlen(
        cls, seqlens, heads: int, kv_heads: int, head_dim: int, causal: bool = False, dtype: str = "float16"
    ) -> Problem:
        """A packed batch of sequences of these lengths (queries and keys alike)."""
        lens = tuple(seqlens)
        top = max(lens, default=0)
        return cls(len(lens), top, top, heads, kv_heads, head_dim, causal, dtype, lens)

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
        if self.seqlens is None:
            return attention_flops(
                self.batch, self.heads, self.seqlen_q, self.seqlen_k, self.head_dim, self.causal
            )
        return sum(attention_flops(1, self.heads, n, n, self.head_dim, self.causal) for n in self.seqlens)

    def _rows(self) -> tuple[int, int]:
        """(query rows, key rows) over all sequences."""
        if self.seqlens is None:
            return self.batch * self.seqlen_q, self.batch * self.seqlen_k
        return sum(self.seqlens), sum(self.seqlens)

    @property
    def input_bytes(self) -> int:
        """Bytes of q, k, v and the output: what one call reads and writes."""
        q_rows, k_rows = self._rows()
        return 2 * (2 * q_rows * self.heads * self.head_dim + 2 * k_rows * self.kv_heads * self.head_dim)

    @property
    def output_bytes(self) -> int:
        """Bytes of the output (what a captured graph keeps alive per call)."""
        return 2 * self._rows()[0] * self.heads * self.head_dim

    def label(self) -> str:
        if self.seqlens is not None:
            seq = f"varlen{self.batch} L{min(self.seqlens)}-{self.seqlen_q}"
        elif self.seqlen_q == self.seqlen_k:
            seq = f"B{self.batch} N{self.seqlen_q}"
        else:
            seq = f"B{self.batch} Nq{self.seqlen_q} Nk{self.seqlen_k}"
        heads = f"H{self.heads}" if self.kv_heads == self.heads else f"H{self.heads}/{self.kv_heads}"
        causal = " causal" if self.causal else ""
        return f"{seq} {heads} d{self.head_dim} {_DTYPE_SHORT[self.dtype]}{causal}"

    def to_dict(self) -> dict:
        """The fields as JSON takes them; a dense problem has no `seqlens` key."""
        d = asdict(self)
        if self.seqlens is None:
            del d["seqlens"]
        else:
            d["seqlens"] = list(self.seqlens)
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


# build(problem, q, k, v), or for a varlen problem build(problem, q, k, v, cu_seqlens).
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

    def make(self, p: Problem, *inputs) -> Callable[[], Any]:
        """The call on one input set: `build` for a dense problem, `varlen` for a varlen one."""
        if p.seqlens is None:
            return self.build(p, *inputs)
        if self.varlen is None:
            raise BackendSkip(f"{self.name} has no varlen (packed sequences) call in this bench")
        return self.varlen(p, *inputs)


def _sdpa_backend(attr: str) -> tuple[Builder, Callable[[], contextlib.AbstractContextManager]]:
    def context():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(getattr(SDPBackend, attr))

    def build(p: Problem, q, k, v):
        import torch.nn.functional as F

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

    return build, context


def _import_skip(module: str, attr: str):
    import importlib

    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as e:  # ImportError, or a broken install raising anything at import
        raise BackendSkip(f"{module}.{attr} not importable ({type(e).__name__}: {e})") from e


def _build_fa4(p: Problem, q, k, v):
    fn = _import_skip("flash_attn.cute", "flash_attn_func")
    return lambda: fn(q, k, v, causal=p.causal)  # returns out or (out, lse) by version


def _build_fa4_varlen(p: Problem, q, k, v, cu_seqlens):
    fn = _import_skip("flash_attn.cute", "flash_attn_varlen_func")
    # By keyword: its fourth parameter is qv (MLA), not cu_seqlens_q.
    return lambda: fn(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=p.seqlen_q, max_seqlen_k=p.seqlen_k, causal=p.causal,
    )  # fmt: skip


def _build_fa3(p: Problem, q, k, v):
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
    variant: str | None, tile: tuple[int, int] | None, schedule: str | None = None, lse: bool = False
) -> Backend:
    def checked(p: Problem, kernel: str) -> None:
        """The tile table (or the tile) of variant `kernel` fits p's head dim, else a skip."""
        try:
            from hopper_fmha.config import select_config
        except Exception as e:
            raise BackendSkip(f"hopper_fmha.config not importable ({type(e).__name__}: {e})") from e
        try:
            select_config(p.head_dim, kernel, tile)
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
        return scheduled(lambda: fn(q, k, v, causal=p.causal, return_lse=lse, variant=variant, tile=tile))

    def build_varlen(p: Problem, q, k, v, cu_seqlens):
        if variant not in (None, "ws"):
            raise BackendSkip(f"flash_attn_varlen_func runs the ws kernel only, not {variant}")
        checked(p, "ws")
        fn = _import_skip("hopper_fmha", "flash_attn_varlen_func")
        lens = (cu_seqlens, cu_seqlens, p.seqlen_q, p.seqlen_k)
        return scheduled(lambda: fn(q, k, v, *lens, causal=p.causal, return_lse=lse, tile=tile))

    name = f"hopper-fmha:{variant or AUTO}" + (f"@{tile[0]}x{tile[1]}" if tile else "")
    name += f"/{schedule}" if schedule else ""
    name += "+lse" if lse else ""
    return Backend(name=name, label=name, build=build, ours=True, varlen=build_varlen)


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


def _peers() -> dict[str, Backend]:
    peers = {}
    for name, label, attr in (
        ("sdpa-flash", "FA2", "FLASH_ATTENTION"),
        ("sdpa-efficient", "mem-eff", "EFFICIENT_ATTENTION"),
        ("sdpa-cudnn", "cuDNN", "CUDNN_ATTENTION"),
    ):
        build, context = _sdpa_backend(attr)
        peers[name] = Backend(name=name, label=label, build=build, layout="bhsd", context=context)
    peers["fa4"] = Backend(name="fa4", label="FA4", build=_build_fa4, varlen=_build_fa4_varlen)
    peers["fa3"] = Backend(name="fa3", label="FA3", build=_build_fa3)
    return peers


# Backends by name; tests register fakes here.
REGISTRY: dict[str, Backend] = {**_peers(), PADDED: _padded()}
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
        lse = spec.endswith("+lse")
        spec = spec.removesuffix("+lse")
        if lse and "/" in spec:
            raise ValueError(f"+lse does not combine with a schedule in {name!r}")
        spec, _, schedule = spec.partition("/")
        variant, _, tile_text = spec.partition("@")
        if variant == AUTO and not tile_text:
            return [_ours(None, None, schedule or None, lse)]
        if variant not in _variants():
            raise ValueError(f"unknown hopper-fmha variant {variant!r} in {name!r}; variants: {_variants()}")
        from hopper_fmha.kernels import SCHEDULES

        if schedule and schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r} in {name!r}; schedules: {', '.join(SCHEDULES)}")
        return [_ours(variant, parse_tile(tile_text) if tile_text else None, schedule or None, lse)]
    known = sorted(set(REGISTRY) | set(ALIASES)) + [
        "hopper-fmha",
        "hopper-fmha:<variant>[@MxN][/schedule]",
        "hopper-fmha:<variant>[@MxN]+lse",
    ]
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(known)}")


def resolve_backends(names: Sequence[str]) -> list[Backend]:
    """Backends for a list of names, in order, without duplicates."""
    out: dict[str, Backend] = {}
    for name in names:
        for b in get_backend(name.strip()):
            out.setdefault(b.name, b)
    return list(out.values())
