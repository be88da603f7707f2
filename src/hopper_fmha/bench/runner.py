"""Run a grid of problems over a list of backends: inputs, correctness check, timings.

Per problem, every backend is first prepared in turn (built, checked for correctness, warmed up,
its eager samples sized and its CUDA graph captured); then the GPU is pre-heated and the
backends are timed together in interleaved rounds (`timing.round_schedule`), so that clock
drift under sustained load falls on all of them alike. The graphs live until the problem is done.

Every (problem, backend) pair yields one record (a plain dict, the unit of the JSON file):
status "ok" (timed, correct), "wrong" (timed, but failed the correctness check), "skipped"
(could not run: not importable, unsupported, raised), "rejected" (config refused by
hopper_fmha.config), or "error" (raised while being timed).

Correctness rule (FlashAttention's test rule): the backend's max abs error against the fp32
reference must be at most 2x the error of PyTorch computing the same attention in the input
dtype (fp16/bf16 matmuls, fp32 softmax: `lowp_attention`), plus a floor of one ulp of the
output's largest value (eps(dtype) * max|ref|). On a varlen problem both are computed sequence by
sequence and the rule applies to the packed rows. On a decode problem the reference is
`reference_with_kvcache` and PyTorch's error is computed per sequence on its first
cache_seqlens[b] keys (gathered from the pages when paged). On a training problem (a backward,
`GradChecker`) the rule applies to each of dq, dk and dv: the fp32 reference's gradients by
autograd against PyTorch's in the input dtype (`lowp_attention` differentiated), the same random
dout for both and for the backend, with the problem's score features, sequence by sequence on a
varlen problem. A learnable sink's own gradient is computed by the backends (the sink requires
grad) but not returned by the timed call, so it is not checked.

Training problems are timed eagerly only: autograd runs each backward op on the stream its
forward op ran on, so the backward of a forward run before a CUDA-graph capture would not be on
the capture stream (`TRAINING_NOT_CAPTURED`).

Problems with score features (a window, softcap or sink) or a v head dim of their own are checked
the same way, the reference and PyTorch's attention given the same window, softcap, sink
(`registry.feature_kwargs`) and v. The reference runs in blocks of query rows (at most 2^27
scores each, `hopper_fmha.reference.MAX_SCORE_ELEMENTS`), as does `lowp_attention`, so the
features preset's N = 32768 (B 1, H 16: 256 rows a block) is checked in full, like the sweep's
N = 16384.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.metadata
import math
import platform
import random
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from hopper_fmha.bench.flops import NO_WINDOW, window_bounds
from hopper_fmha.bench.registry import (
    PADDED_UNCHECKED,
    Backend,
    BackendSkip,
    Problem,
    feature_kwargs,
    first_output,
    unpad,
)
from hopper_fmha.bench.timing import (
    L2_FALLBACK_BYTES,
    EagerSampler,
    GraphSampler,
    TimingSettings,
    launch_us,
    num_input_sets,
    round_schedule,
    run_untimed,
    summarize,
    time_first_call,
    timed_samples,
)

PEER_DISTRIBUTIONS = (
    "nvidia-cutlass-dsl",
    "flash-attn-4",
    "flash-attn",
    "flash-attn-3",
    "quack-kernels",
    "apache-tvm-ffi",
    "triton",
    "numpy",
)


class CudaContextLost(RuntimeError):
    """A sticky CUDA error (e.g. an illegal address): nothing after it can run in this process.
    `record` is the step that hit it; `records` every record of its problem so far, in order."""

    def __init__(self, reason: str, record: dict, records: list[dict] | None = None):
        super().__init__(reason)
        self.record = record
        self.records = records if records is not None else [record]


def device_slug(name: str) -> str:
    """ "NVIDIA H100 80GB HBM3" -> "h100-80gb-hbm3"."""
    name = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def _run(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _own_version() -> str | None:
    """The installed version, else the source tree's pyproject.toml (the GPU machine runs ./src)."""
    v = _version("hopper-fmha")
    if v:
        return v
    pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
    try:
        import tomllib

        return tomllib.loads(pyproject.read_text())["project"]["version"] + " (source tree)"
    except Exception:
        return None


def source_digest(root: Path | None = None) -> str:
    """The first 12 hex digits of a sha256 over the package's Python sources (relative path, then
    bytes, in path order). It names the code a result was measured with where git cannot: a copy of
    the tree whose `.git` is missing or stale, as on a machine the tree is shipped to."""
    root = root or Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def collect_env(device: str) -> dict:
    import torch

    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "hopper-fmha": _own_version(),
        "sources": source_digest(),
        "versions": {d: v for d in PEER_DISTRIBUTIONS if (v := _version(d))},
        "device": "cpu",
        "device_slug": "cpu",
    }
    repo = Path(__file__).resolve().parents[3]
    commit = _run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"])
    if commit:
        dirty = _run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"])
        env["git"] = commit + ("-dirty" if dirty else "")
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            device=props.name,
            device_slug=device_slug(props.name),
            capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            l2_bytes=getattr(props, "L2_cache_size", None) or L2_FALLBACK_BYTES,
            driver=_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i", "0"]),
        )
    return env


def page_table(p: Problem, seed: int) -> list[list[int]]:
    """A paged decode problem's page table: the batch · capacity / page_size pages shuffled by
    Python's own generator (the same on every machine), capacity / page_size per sequence, so
    that a sequence's pages lie anywhere in the pool, in any order."""
    per_seq = p.seqlen_k // p.page_size
    pages = list(range(p.batch * per_seq))
    random.Random(seed).shuffle(pages)
    return [pages[b * per_seq : (b + 1) * per_seq] for b in range(p.batch)]


def make_inputs(p: Problem, n_sets: int, device: str, seed: int) -> list[tuple]:
    """`n_sets` input sets drawn from one generator seeded with `seed`: (q, k, v) in BSHD, or
    for a varlen problem packed (q, k, v, cu_seqlens): q (total, heads, d), k and v (total,
    kv_heads, d), cu_seqlens the int32 offsets (`Problem.offsets`, one tensor for all sets), or
    for a decode problem (q, k_cache, v_cache, cache_seqlens, page_table): q (batch, seqlen_q,
    heads, d), the caches dense (batch, capacity, kv_heads, d) or paged (pages, page_size,
    kv_heads, d) with the int32 (batch, capacity / page_size) `page_table(p, seed)` (None when
    dense), cache_seqlens int32 (batch,) (`Problem.cache_lengths`); one table and one
    cache_seqlens for all sets; or for a training problem the same with dout last, (q, k, v,
    dout) or packed (q, k, v, cu_seqlens, dout), dout random like the output (the output's
    gradient, v's head dim), drawn after k and v. v's last dim is `Problem.dv` (a sink is no input:
    `registry.sink_logits`)."""
    import torch

    dtype = getattr(torch, p.dtype)
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    if p.kvcache:
        lens = torch.tensor(p.cache_lengths, dtype=torch.int32, device=device)
        table, kv_rows = None, (p.batch, p.seqlen_k)
        if p.page_size:
            table = torch.tensor(page_table(p, seed), dtype=torch.int32, device=device)
            kv_rows = (p.batch * p.seqlen_k // p.page_size, p.page_size)
        q_rows, extra = (p.batch, p.seqlen_q), (lens, table)
    elif p.seqlens is None:
        q_rows, kv_rows, extra = (p.batch, p.seqlen_q), (p.batch, p.seqlen_k), ()
    else:
        total = sum(p.seqlens)
        q_rows, kv_rows = (total,), (total,)
        extra = (torch.tensor(p.offsets, dtype=torch.int32, device=device),)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(*q_rows, p.heads, p.head_dim, dtype=dtype, device=device, generator=g)
        k, v = (
            torch.randn(*kv_rows, p.kv_heads, d, dtype=dtype, device=device, generator=g)
            for d in (p.head_dim, p.dv)
        )
        dout = ()
        if p.training:
            dout = (torch.randn(*q_rows, p.heads, p.dv, dtype=dtype, device=device, generator=g),)
        sets.append((q, k, v, *extra, *dout))
    return sets


def lowp_attention(
    q,
    k,
    v,
    causal: bool,
    max_scores: int = 2**27,
    *,
    window_size: tuple[int, int] = NO_WINDOW,
    softcap: float = 0.0,
    learnable_sink=None,
):
    """Attention computed by PyTorch in the inputs' dtype: fp16/bf16 matmuls, softmax in fp32
    rounded back to the input dtype (FlashAttention's test baseline). BSHD, bottom-right causal,
    GQA, v's head dim its own; the score features of `hopper_fmha.reference` (the same keywords
    and rules): the window (causal sets right = 0), the softcap applied in fp32 to the scaled
    scores, the sink (heads,) a logit that joins each row's softmax and nothing else. Query-row
    chunks keep at most `max_scores` scores alive. Differentiable (nothing autograd saves is
    changed in place), for the training problems' check."""
    import torch

    from hopper_fmha.reference import visible_keys

    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    left, right = window_bounds(causal, window_size)
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    out = qt.new_empty((b, h, sq, v.shape[-1]))
    rows = max(1, max_scores // (b * h * sk))
    for i in range(0, sq, rows):
        s = (torch.matmul(qt[:, :, i : i + rows], kt.transpose(-1, -2)) * d**-0.5).float()
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if left >= 0 or right >= 0:
            query_rows = torch.arange(i, min(i + rows, sq), device=q.device)
            s = s.masked_fill(~visible_keys(query_rows, sq, sk, left, right), float("-inf"))
        if learnable_sink is None:
            p = torch.softmax(s, dim=-1)
        else:  # the sink as one more column of the softmax, then dropped: it has no value row
            sink = learnable_sink.float().reshape(1, h, 1, 1).expand(b, h, s.shape[2], 1)
            p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        out[:, :, i : i + rows] = torch.matmul(p.nan_to_num(0.0).to(q.dtype), vt)
    return out.transpose(1, 2)


@contextlib.contextmanager
def _exact_fp32_matmul():
    """The fp32 reference must not run on TF32 (its error is as large as fp16's), whatever a
    library imported earlier set."""
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def sequence_kv(p: Problem, k_cache, v_cache, page_table, b: int) -> tuple:
    """A decode problem's sequence b: its first cache_seqlens[b] keys and values, (len, kv_heads,
    d), gathered from the pages when paged."""
    from hopper_fmha.reference_kvcache import kvcache_slots

    first, rows = kvcache_slots(page_table, p.page_size or 1, b, 0, p.cache_lengths[b])
    first, rows = first.to(k_cache.device), rows.to(k_cache.device)
    return k_cache[first, rows], v_cache[first, rows]


def _per_sequence(fn: Callable, q, k, v, cu_seqlens):
    """fn(q, k, v) -> BSHD output; with cu_seqlens (packed inputs), fn on each sequence as a
    batch of one, the outputs packed back into rows."""
    import torch

    if cu_seqlens is None:
        return fn(q, k, v)
    bounds = cu_seqlens.tolist()
    spans = zip(bounds[:-1], bounds[1:], strict=True)
    return torch.cat([fn(*(x[None, a:b] for x in (q, k, v)))[0] for a, b in spans])


def _tolerance(ref, lowp, dtype) -> tuple[float, float]:
    """(PyTorch's error, the tolerance) for an fp32 reference `ref` and PyTorch's answer `lowp`
    in `dtype`: max |lowp - ref|, and twice that plus eps(dtype) · max |ref|."""
    import torch

    torch_err = (lowp.float() - ref).abs().max().item()
    return torch_err, 2 * torch_err + torch.finfo(dtype).eps * ref.abs().max().item()


def _compare(out, ref, tol: float, torch_err: float, what: str = "output") -> dict:
    """The check of one tensor against its fp32 reference: its max abs error, passed when finite,
    of the reference's shape and within `tol`."""
    import torch

    res = {"max_abs_err": None, "tol": tol, "torch_lowp_err": torch_err, "passed": False}
    if tuple(out.shape) != tuple(ref.shape):
        res["reason"] = f"{what} shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
        return res
    out = out.float()
    if not torch.isfinite(out).all().item():
        res["reason"] = f"non-finite values in the {what}"
        return res
    res["max_abs_err"] = (out - ref).abs().max().item()
    res["passed"] = res["max_abs_err"] <= tol
    return res


class Checker:
    """The fp32 reference and the tolerance for one problem, computed from the first input set
    (with cu_seqlens: a varlen problem's packed set, checked sequence by sequence; a decode
    problem's set (q, k_cache, v_cache, cache_seqlens, page_table): against
    `reference_with_kvcache`, whatever `reference`, which is the dense one). Forward problems
    only: a training problem's gradients are `GradChecker`'s (`make_checker` picks)."""

    def __init__(self, p: Problem, q, k, v, *extra, reference: Callable | None = None):
        if p.training:
            raise ValueError(f"{p.label()}: a training problem is checked by GradChecker")
        if p.kvcache:
            ref, lowp = _kvcache_baselines(p, q, k, v, *extra)
        else:
            ref, lowp = _attention_baselines(p, q, k, v, *extra, reference=reference)
        self.ref = ref.float()
        self.torch_err, self.tol = _tolerance(self.ref, lowp, q.dtype)

    def check(self, out) -> dict:
        return _compare(out, self.ref, self.tol, self.torch_err)


GRAD_NAMES = ("dq", "dk", "dv")


class GradChecker:
    """The fp32 reference's gradients and their tolerances for one training problem, computed
    from the first input set ((q, k, v, dout), or (q, k, v, cu_seqlens, dout) for a varlen one):
    `check((dq, dk, dv))` applies the rule (module docstring) to each gradient and passes when
    all three pass. Its result is the worst gradient's check (a shape or non-finite failure
    first, else the largest error ÷ tolerance), that gradient named in "grad" (and in "reason"
    when it fails), every gradient's check in "grads"."""

    def __init__(self, p: Problem, q, k, v, *rest, reference: Callable | None = None):
        self.refs, lowp = _grad_baselines(p, q, k, v, *rest, reference=reference)
        self.bounds = tuple(_tolerance(ref, low, q.dtype) for ref, low in zip(self.refs, lowp, strict=True))

    def check(self, grads) -> dict:
        if not isinstance(grads, (tuple, list)) or len(grads) != len(GRAD_NAMES):
            what = f"{len(grads)} tensors" if isinstance(grads, (tuple, list)) else type(grads).__name__
            return {"max_abs_err": None, "tol": None, "torch_lowp_err": None, "passed": False,
                    "reason": f"the call returned {what}, not (dq, dk, dv)"}  # fmt: skip
        each = {
            name: _compare(g, ref, tol, err, name)
            for name, g, ref, (err, tol) in zip(GRAD_NAMES, grads, self.refs, self.bounds, strict=True)
        }

        def badness(name: str) -> float:
            err, tol = each[name]["max_abs_err"], each[name]["tol"]
            if err is None:
                return math.inf
            if tol > 0:
                return err / tol
            return 0.0 if err == 0 else math.inf

        worst = max(GRAD_NAMES, key=badness)
        res = {**each[worst], "grad": worst, "grads": each}
        res["passed"] = all(r["passed"] for r in each.values())
        if not res["passed"]:
            r = each[worst]
            res["reason"] = r.get("reason") or (
                f"{worst}: max abs error {r['max_abs_err']:.3g} > tolerance {r['tol']:.3g}"
            )
        return res


def make_checker(p: Problem, *inputs, reference: Callable | None = None) -> Checker | GradChecker:
    """The checker of a problem on its first input set: `GradChecker` for a training problem,
    else `Checker`."""
    kind = GradChecker if p.training else Checker
    return kind(p, *inputs, reference=reference)


def _grad_baselines(p: Problem, q, k, v, *rest, reference: Callable | None, max_scores=2**27) -> tuple:
    """((dq, dk, dv) of the fp32 reference, the same of PyTorch in the input dtype), by autograd
    for the output gradient dout (rest: (dout,), or (cu_seqlens, dout) for packed inputs), with
    the problem's score features, in the layout of q, k, v. Attention is independent across
    sequences (batch elements, or a varlen problem's packed sequences) and kv heads (with the q
    heads that use them, and their sinks), so both are computed per sequence and block of kv
    heads, each block at most `max_scores` scores (what autograd keeps alive is a few times that)."""
    import torch

    if reference is None:
        from hopper_fmha.reference import reference

    def exact(*qkv, **features):
        return first_output(reference(*qkv, causal=p.causal, **features))

    def lowp(*qkv, **features):
        return lowp_attention(*qkv, p.causal, **features)

    *lens, dout = rest
    features = feature_kwargs(p, q.device)
    sink = features.pop("learnable_sink", None)
    if lens:  # a sequence's packed rows
        bounds = lens[0].tolist()
        sequences = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    else:  # a batch element's rows
        sequences = list(range(p.batch))
    group = p.heads // p.kv_heads
    step = max(1, max_scores // (group * p.seqlen_q * p.seqlen_k))
    ref = tuple(torch.empty_like(x, dtype=torch.float32) for x in (q, k, v))
    low = tuple(torch.empty_like(x) for x in (q, k, v))
    for rows in sequences:
        for first in range(0, p.kv_heads, step):
            kv_heads = slice(first, min(first + step, p.kv_heads))
            q_heads = slice(kv_heads.start * group, kv_heads.stop * group)
            # x[rows] is one sequence (length, heads, d); as a batch of one, these heads.
            block = (q[rows][None, :, q_heads], k[rows][None, :, kv_heads], v[rows][None, :, kv_heads])
            grad_out = dout[rows][None, :, q_heads]
            if sink is not None:  # these heads' sinks, no gradient wanted
                features["learnable_sink"] = sink[q_heads].detach()
            with _exact_fp32_matmul():
                want = _grads(exact, block, grad_out, torch.float32, features)
            got = _grads(lowp, block, grad_out, q.dtype, features)
            for heads, dst_ref, dst_low, g_ref, g_low in zip(
                (q_heads, kv_heads, kv_heads), ref, low, want, got, strict=True
            ):
                dst_ref[rows][:, heads] = g_ref[0]  # dst[rows] is a view: this writes into dst
                dst_low[rows][:, heads] = g_low[0]
    return ref, low


def _grads(fn: Callable, inputs: tuple, dout, dtype, features: dict) -> tuple:
    """The gradients of fn(*inputs, **features) for the output gradient dout, the inputs and dout
    cast to `dtype` (the features as they are)."""
    import torch

    leaves = tuple(x.detach().to(dtype).requires_grad_() for x in inputs)
    return torch.autograd.grad(fn(*leaves, **features), leaves, dout.to(dtype))


def _attention_baselines(p: Problem, q, k, v, cu_seqlens=None, *, reference: Callable | None) -> tuple:
    """(fp32 reference, PyTorch in the input dtype) of a dense or varlen problem, in q's layout,
    both with the problem's score features (`registry.feature_kwargs`: no keyword where none)."""
    if reference is None:
        from hopper_fmha.reference import reference
    features = feature_kwargs(p, q.device)
    with _exact_fp32_matmul():
        ref = _per_sequence(
            lambda *qkv: first_output(reference(*qkv, causal=p.causal, **features)), q, k, v, cu_seqlens
        )
    return ref, _per_sequence(lambda *qkv: lowp_attention(*qkv, p.causal, **features), q, k, v, cu_seqlens)


def _kvcache_baselines(p: Problem, q, k_cache, v_cache, cache_seqlens, page_table) -> tuple:
    """(fp32 reference, PyTorch in the input dtype) of a decode problem, (batch, seqlen_q, heads, d)."""
    import torch

    from hopper_fmha.reference_kvcache import reference_with_kvcache

    with _exact_fp32_matmul():
        ref, _ = reference_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=page_table, causal=p.causal
        )
    lowp = []
    for b in range(p.batch):
        k, v = sequence_kv(p, k_cache, v_cache, page_table, b)
        lowp.append(lowp_attention(q[b : b + 1], k[None], v[None], p.causal))
    return ref, torch.cat(lowp)


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:300]


def _alive(timer) -> bool:
    try:
        timer.synchronize()
        return True
    except Exception:
        return False


def kernel_key(p: Problem, b: Backend) -> tuple:
    """What changes the generated code (not batch or seqlen): one compile per key."""
    kind = (p.seqlens is not None, p.kvcache, p.page_size, p.passes)
    features = (p.dv, p.window_size != NO_WINDOW, bool(p.softcap), p.sink)
    return (b.name, p.dtype, p.head_dim, p.causal, p.heads // p.kv_heads, *kind, *features)


def _profile_compile(fn, timer) -> dict:
    try:
        from hopper_fmha import kernels
    except Exception as e:
        return {"compile_s": None, "cached_load_s": None, "reason": f"hopper_fmha.kernels: {_short(e)}"}
    clear = getattr(kernels, "clear_cache", None)
    if clear is None:
        return {"compile_s": None, "cached_load_s": None, "reason": "kernels.clear_cache absent"}
    try:
        clear(memory=True, disk=True)
        compile_s = time_first_call(fn, timer)
        clear(memory=True, disk=False)
        return {"compile_s": compile_s, "cached_load_s": time_first_call(fn, timer)}
    except Exception as e:
        return {"compile_s": None, "cached_load_s": None, "reason": _short(e)}


def _host_stages(p: Problem, inputs) -> dict:
    """`hostpath.host_stages` on one input set, or the reason it could not run."""
    try:
        from hopper_fmha.bench.hostpath import host_stages

        return host_stages(*inputs[:3], p.causal)
    except Exception as e:
        return {"reason": _short(e)}


def _new_record(p: Problem, backend: Backend, n_sets: int) -> dict:
    return {
        "problem": p.to_dict(),
        "backend": backend.name,
        "label": backend.label,
        "ours": backend.ours,
        "flops": p.flops,
        "n_sets": n_sets,
        "set_bytes": p.input_bytes,
        "status": "skipped",
        "reason": None,
        "check": None,
        "eager": None,
        "graph": None,
        "graph_reason": None,
        "profile": None,
    }


class _Entry:
    """One backend on one problem: its record, and while it is being timed its samplers and the
    samples of every round."""

    def __init__(self, backend: Backend, rec: dict):
        self.backend, self.rec = backend, rec
        self.samplers: dict[str, EagerSampler | GraphSampler] = {}
        self.rounds: dict[str, list[list[float]]] = {"eager": [], "graph": []}

    def drop(self, mode: str) -> None:
        sampler = self.samplers.pop(mode, None)
        if isinstance(sampler, GraphSampler):
            sampler.close()
        self.rounds[mode] = []

    def close(self) -> None:
        """Summaries from the rounds run so far; samplers (and graphs) freed."""
        for mode in ("eager", "graph"):
            sampler = self.samplers.get(mode)
            if sampler is not None and self.rounds[mode]:
                self.rec[mode] = summarize([], sampler.calls, rounds=self.rounds[mode])
            self.drop(mode)


def _warned(caught) -> str:
    """The first lines of the warnings caught, as " (...)" after a failure's reason; "" if none."""
    why = "; ".join(dict.fromkeys(str(w.message).strip().splitlines()[0] for w in caught if str(w.message)))
    return f" ({why[:400]})" if why else ""


# Why a training problem has no CUDA-graph time (module docstring).
TRAINING_NOT_CAPTURED = (
    "not captured: backward passes are timed eagerly (autograd runs a backward op on its forward "
    "op's stream, not the capture stream)"
)


def _prepare(p, entry: _Entry, sets, checker, timer, settings, fail, graph, profile_compile, profile) -> None:
    """Build, check, warm up and size the eager samples, capture the graph. Sets the record's
    status; leaves samplers in `entry` for the rounds."""
    backend, rec = entry.backend, entry.rec
    with backend.context():
        # SDPA explains a refusal only in warnings ("Flash attention kernel not used because ..."),
        # at the first call, or at the build for a backward (its forward runs there).
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                fns = [backend.make(p, *s) for s in sets]
            except BackendSkip as e:
                return fail(e.status, e.reason)
            except Exception as e:
                return fail("skipped", "build raised " + _short(e) + _warned(caught))
            try:
                if profile or profile_compile:
                    rec["profile"] = _profile_compile(fns[0], timer) if profile_compile else {}
                out = fns[0]()
                if not p.training:  # a training call returns (dq, dk, dv) in q, k, v's layout
                    out = first_output(out)  # FA4 / FA3 return (out, lse) in some versions
                    if backend.layout == "bhsd":
                        out = out.transpose(1, 2)
                    elif backend.layout == "padded":
                        out = unpad(out, p.seqlens)
                timer.synchronize()
            except Exception as e:
                return fail("skipped", "raised " + _short(e) + _warned(caught))
        try:
            if backend.unchecked:
                rec["check"] = {"passed": None, "reason": backend.unchecked}
            elif backend.layout == "padded" and not p.causal:
                rec["check"] = {"passed": None, "reason": PADDED_UNCHECKED}
            else:
                rec["check"] = checker().check(out)
        except Exception as e:
            rec["check"] = {"passed": None, "reason": "reference failed: " + _short(e)}
            if not _alive(timer):
                raise CudaContextLost(rec["check"]["reason"], rec) from e
        del out
        try:
            entry.samplers["eager"] = EagerSampler(fns, timer, settings)
        except Exception as e:
            return fail("error", "eager timing raised " + _short(e))
        rec["status"] = "wrong" if rec["check"].get("passed") is False else "ok"
        if rec["check"].get("passed") is False:
            rec["reason"] = rec["check"].get("reason") or (
                f"max abs error {rec['check']['max_abs_err']:.3g} > tolerance {rec['check']['tol']:.3g}"
            )
        if graph and p.training:
            rec["graph_reason"] = TRAINING_NOT_CAPTURED
        elif graph:
            try:
                entry.samplers["graph"] = GraphSampler(fns, timer, settings)
            except Exception as e:
                rec["graph_reason"] = "capture or replay raised " + _short(e)
                if not _alive(timer):
                    raise CudaContextLost(rec["graph_reason"], rec) from e
        if profile:
            rec["profile"]["launch_us"] = launch_us(fns, timer)
            if backend.ours and p.seqlens is None and not p.kvcache and not p.training and not p.has_features:
                # the stages are those of flash_attn_func's plain forward
                rec["profile"]["host_stages_us"] = _host_stages(p, sets[0])


def _block(
    entry: _Entry,
    mode: str,
    count: int,
    timer,
    keep: bool = True,
    steady_ms: float = 0.0,
    block_ms: float = 0.0,
) -> None:
    """One block of samples for one backend in one mode, after `steady_ms` of untimed calls:
    `count` samples, more where they cover less than `block_ms` of GPU time (thrown away unless
    `keep`: a settling round); a failure drops that mode (eager: the whole backend) and is
    recorded. Raises CudaContextLost."""
    sampler = entry.samplers.get(mode)
    if sampler is None:
        return
    rec = entry.rec
    try:
        with entry.backend.context():
            if steady_ms > 0:
                run_untimed(sampler, steady_ms)
            samples = timed_samples(sampler, count, block_ms)
            if keep:
                entry.rounds[mode].append(samples)
    except Exception as e:
        reason = ("eager timing raised " if mode == "eager" else "capture or replay raised ") + _short(e)
        if mode == "eager":
            entry.drop("eager")
            entry.drop("graph")
            rec.update(status="error", reason=reason)
        else:
            entry.drop("graph")
            rec["graph_reason"] = reason
        if not _alive(timer):
            if mode == "eager":
                rec["reason"] += " (CUDA context lost)"
            raise CudaContextLost(reason, rec) from e


def run_problem(
    p: Problem,
    backends: Sequence[Backend],
    sets: list[tuple],
    checker: Callable[[], Checker],
    timer,
    settings: TimingSettings,
    *,
    graph: bool,
    profile_compile: Callable[[Backend], bool] = lambda b: False,
    profile: Callable[[Backend], bool] = lambda b: False,
    heat: Callable[[], None] | None = None,
    on_start: Callable[[Problem, Backend], None] | None = None,
) -> list[dict]:
    """Every backend on one problem: prepared one after the other, then timed in interleaved
    rounds after a pre-heat. Returns the records in backend order. Raises CudaContextLost (with
    every record of the problem so far) when the CUDA context is gone."""
    entries: list[_Entry] = []
    try:
        for b in backends:
            if on_start:
                on_start(p, b)
            entry = _Entry(b, _new_record(p, b, len(sets)))
            entries.append(entry)

            def fail(status: str, reason: str, rec=entry.rec) -> None:
                rec.update(status=status, reason=reason)
                if not _alive(timer):
                    rec["reason"] += " (CUDA context lost)"
                    raise CudaContextLost(reason, rec)

            try:
                _prepare(
                    p, entry, sets, checker, timer, settings, fail, graph,
                    profile_compile(b), profile(b),
                )  # fmt: skip
            except CudaContextLost:
                raise
            except Exception as e:  # anything unforeseen (e.g. entering the backend's context)
                entry.drop("eager")
                entry.drop("graph")
                fail("error", "unexpected " + _short(e))
        timed = [e for e in entries if e.samplers]
        if timed:
            if heat is not None:
                try:
                    heat()
                except Exception as e:  # timing without the pre-heat beats no timing
                    if not _alive(timer):
                        raise CudaContextLost("pre-heat raised " + _short(e), {"backend": "pre-heat"}) from e
            settle = max(settings.settle_rounds, 0)
            for r, blocks in enumerate(round_schedule(len(timed), settle + max(settings.rounds, 1))):
                for i, mode in blocks:
                    _block(
                        timed[i], mode, settings.per_round, timer, keep=r >= settle,
                        steady_ms=settings.steady_ms, block_ms=settings.block_ms,
                    )  # fmt: skip
    except CudaContextLost as e:
        for entry in entries:
            if entry.rec is not e.record and entry.samplers and not any(entry.rounds.values()):
                entry.rec.update(
                    status="error",
                    reason=f"not timed: the CUDA context was lost (at {e.record['backend']}) before "
                    "its timing",
                )
            entry.close()
        raise CudaContextLost(str(e), e.record, [entry.rec for entry in entries]) from e
    finally:
        for entry in entries:
            entry.close()
    return [entry.rec for entry in entries]


def run_step(
    p: Problem,
    backend: Backend,
    sets: list[tuple],
    checker: Callable[[], Checker],
    timer,
    settings: TimingSettings,
    *,
    graph: bool,
    profile_compile: bool = False,
    profile: bool = False,
    heat: Callable[[], None] | None = None,
) -> dict:
    """One backend alone on one problem (`run_problem` with one backend)."""
    (rec,) = run_problem(
        p, [backend], sets, checker, timer, settings, graph=graph,
        profile_compile=lambda b: profile_compile, profile=lambda b: profile, heat=heat,
    )  # fmt: skip
    return rec


def run_suite(
    problems: Sequence[Problem],
    backends: Sequence[Backend],
    settings: TimingSettings,
    timer,
    device: str,
    *,
    graph: bool = True,
    profile: bool = False,
    reference: Callable | None = None,
    l2_bytes: int = L2_FALLBACK_BYTES,
    memory_budget: int | None = None,
    seed: int = 0,
    heat: Callable[[], None] | None = None,
    on_start: Callable[[Problem, Backend], None] | None = None,
    on_record: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Every backend on every problem; records in order (passed to on_record once a problem is
    timed). CudaContextLost propagates (the records so far have been passed to on_record)."""
    records = []
    profiled: set[tuple] = set()
    for i, p in enumerate(problems):
        # The budget pays for the inputs and for the outputs each backend's graph keeps alive (a
        # backward's calls keep the forward's output and return gradients, captured or not).
        cost = p.input_bytes + (len(backends) * p.output_bytes if graph or p.training else 0)
        n_sets = num_input_sets(p.input_bytes, l2_bytes, settings.max_sets, memory_budget, cost)
        sets = make_inputs(p, n_sets, device, seed + i)
        cache: list[Checker | GradChecker] = []

        def checker(p=p, sets=sets, cache=cache) -> Checker | GradChecker:
            if not cache:
                cache.append(make_checker(p, *sets[0], reference=reference))
            return cache[0]

        def first_compile(b: Backend, p=p) -> bool:
            key = kernel_key(p, b)
            first = profile and b.ours and key not in profiled
            profiled.add(key)
            return first

        try:
            try:
                recs = run_problem(
                    p, backends, sets, checker, timer, settings, graph=graph,
                    profile_compile=first_compile, profile=lambda b: profile and b.ours,
                    heat=heat, on_start=on_start,
                )  # fmt: skip
            except CudaContextLost as e:
                records += e.records
                if on_record:
                    for rec in e.records:
                        on_record(rec)
                raise
            records += recs
            if on_record:
                for rec in recs:
                    on_record(rec)
        finally:
            del sets, cache, checker  # the inputs and the reference go before the next problem's
            if device == "cuda" and "torch" in sys.modules:
                sys.modules["torch"].cuda.empty_cache()
    return records
