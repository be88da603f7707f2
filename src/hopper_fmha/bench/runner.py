"""Run a grid of problems over a list of backends: inputs, correctness check, timings.

Every (problem, backend) step yields one record (a plain dict, the unit of the JSON file):
status "ok" (timed, correct), "wrong" (timed, but failed the correctness check), "skipped"
(could not run: not importable, unsupported, raised), "rejected" (config refused by
hopper_fmha.config), or "error" (raised while being timed).

Correctness rule (FlashAttention's test rule): the backend's max abs error against the fp32
reference must be at most 2x the error of PyTorch computing the same attention in the input
dtype (fp16/bf16 matmuls, fp32 softmax: `lowp_attention`), plus a floor of one ulp of the
output's largest value (eps(dtype) * max|ref|).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import platform
import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path

from hopper_fmha.bench.registry import Backend, BackendSkip, Problem
from hopper_fmha.bench.timing import (
    L2_FALLBACK_BYTES,
    TimingSettings,
    launch_us,
    num_input_sets,
    time_eager,
    time_first_call,
    time_graph,
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
    `record` is the step that hit it."""

    def __init__(self, reason: str, record: dict):
        super().__init__(reason)
        self.record = record


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


def collect_env(device: str) -> dict:
    import torch

    env = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "hopper-fmha": _own_version(),
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


def make_inputs(p: Problem, n_sets: int, device: str, seed: int) -> list[tuple]:
    import torch

    dtype = getattr(torch, p.dtype)
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    sets = []
    for _ in range(n_sets):
        q = torch.randn(p.batch, p.seqlen_q, p.heads, p.head_dim, dtype=dtype, device=device, generator=g)
        k, v = (
            torch.randn(p.batch, p.seqlen_k, p.kv_heads, p.head_dim, dtype=dtype, device=device, generator=g)
            for _ in range(2)
        )
        sets.append((q, k, v))
    return sets


def lowp_attention(q, k, v, causal: bool, max_scores: int = 2**27):
    """Attention computed by PyTorch in the inputs' dtype: fp16/bf16 matmuls, softmax in fp32
    rounded back to the input dtype (FlashAttention's test baseline). BSHD, bottom-right causal,
    GQA; query-row chunks keep at most `max_scores` scores alive."""
    import torch

    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qt = q.transpose(1, 2)
    kt = k.transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    vt = v.transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    out = torch.empty_like(qt)
    rows = max(1, max_scores // (b * h * sk))
    for i in range(0, sq, rows):
        s = torch.matmul(qt[:, :, i : i + rows], kt.transpose(-1, -2)) * d**-0.5
        if causal:
            r = torch.arange(i, min(i + rows, sq), device=q.device)[:, None] + (sk - sq)
            s = s.masked_fill(torch.arange(sk, device=q.device)[None, :] > r, float("-inf"))
        p = torch.softmax(s.float(), dim=-1).nan_to_num_(0.0).to(q.dtype)
        out[:, :, i : i + rows] = torch.matmul(p, vt)
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


class Checker:
    """The fp32 reference and the tolerance for one problem, computed from the first input set."""

    def __init__(self, p: Problem, q, k, v, reference: Callable | None = None):
        import torch

        if reference is None:
            from hopper_fmha.reference import reference
        with _exact_fp32_matmul():
            self.ref = _first(reference(q, k, v, causal=p.causal)).float()
        self.torch_err = (lowp_attention(q, k, v, p.causal).float() - self.ref).abs().max().item()
        floor = torch.finfo(q.dtype).eps * self.ref.abs().max().item()
        self.tol = 2 * self.torch_err + floor

    def check(self, out) -> dict:
        import torch

        res = {"max_abs_err": None, "tol": self.tol, "torch_lowp_err": self.torch_err, "passed": False}
        if tuple(out.shape) != tuple(self.ref.shape):
            res["reason"] = f"output shape {tuple(out.shape)} != reference {tuple(self.ref.shape)}"
            return res
        out = out.float()
        if not torch.isfinite(out).all().item():
            res["reason"] = "non-finite values in the output"
            return res
        res["max_abs_err"] = (out - self.ref).abs().max().item()
        res["passed"] = res["max_abs_err"] <= self.tol
        return res


def _first(out):
    """The output of a call that returns out or (out, lse)."""
    return out[0] if isinstance(out, (tuple, list)) else out


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
    return (b.name, p.dtype, p.head_dim, p.causal, p.heads // p.kv_heads)


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
) -> dict:
    """One backend on one problem. Raises CudaContextLost when the CUDA context is gone."""
    rec = {
        "problem": p.to_dict(),
        "backend": backend.name,
        "label": backend.label,
        "ours": backend.ours,
        "flops": p.flops,
        "n_sets": len(sets),
        "set_bytes": p.input_bytes,
        "status": "skipped",
        "reason": None,
        "check": None,
        "eager": None,
        "graph": None,
        "graph_reason": None,
        "profile": None,
    }

    def fail(status: str, reason: str) -> dict:
        rec.update(status=status, reason=reason)
        if not _alive(timer):
            rec["reason"] += " (CUDA context lost)"
            raise CudaContextLost(reason, rec)
        return rec

    try:
        return _measure(
            p, backend, sets, checker, timer, settings, rec, fail, graph, profile_compile, profile
        )
    except CudaContextLost:
        raise
    except Exception as e:  # anything unforeseen (e.g. entering the backend's context)
        return fail("error", "unexpected " + _short(e))


def _measure(p, backend, sets, checker, timer, settings, rec, fail, graph, profile_compile, profile) -> dict:
    with backend.context():
        try:
            fns = [backend.build(p, *s) for s in sets]
        except BackendSkip as e:
            return fail(e.status, e.reason)
        except Exception as e:
            return fail("skipped", "build raised " + _short(e))
        # SDPA explains a refusal only in warnings ("Flash attention kernel not used because ...").
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if profile or profile_compile:
                    rec["profile"] = _profile_compile(fns[0], timer) if profile_compile else {}
                out = _first(fns[0]())  # FA4 / FA3 return (out, lse) in some versions
                if backend.layout == "bhsd":
                    out = out.transpose(1, 2)
                timer.synchronize()
            except Exception as e:
                why = "; ".join(
                    dict.fromkeys(str(w.message).strip().splitlines()[0] for w in caught if str(w.message))
                )
                return fail("skipped", "raised " + _short(e) + (f" ({why[:400]})" if why else ""))
        try:
            rec["check"] = checker().check(out)
        except Exception as e:
            rec["check"] = {"passed": None, "reason": "reference failed: " + _short(e)}
            if not _alive(timer):
                raise CudaContextLost(rec["check"]["reason"], rec) from e
        del out
        try:
            rec["eager"] = time_eager(fns, timer, settings)
        except Exception as e:
            return fail("error", "eager timing raised " + _short(e))
        rec["status"] = "wrong" if rec["check"].get("passed") is False else "ok"
        if rec["check"].get("passed") is False:
            rec["reason"] = rec["check"].get("reason") or (
                f"max abs error {rec['check']['max_abs_err']:.3g} > tolerance {rec['check']['tol']:.3g}"
            )
        if graph:
            try:
                rec["graph"] = time_graph(fns, timer, settings)
            except Exception as e:
                rec["graph_reason"] = "capture or replay raised " + _short(e)
                if not _alive(timer):
                    raise CudaContextLost(rec["graph_reason"], rec) from e
        if profile:
            rec["profile"]["launch_us"] = launch_us(fns, timer)
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
    on_start: Callable[[Problem, Backend], None] | None = None,
    on_record: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Every backend on every problem; records in order. CudaContextLost propagates (the records
    so far have been passed to on_record)."""
    records = []
    profiled: set[tuple] = set()
    for i, p in enumerate(problems):
        n_sets = num_input_sets(p.input_bytes, l2_bytes, settings.max_sets, memory_budget)
        sets = make_inputs(p, n_sets, device, seed + i)
        cache: list[Checker] = []

        def checker(p=p, sets=sets, cache=cache) -> Checker:
            if not cache:
                cache.append(Checker(p, *sets[0], reference=reference))
            return cache[0]

        try:
            for b in backends:
                if on_start:
                    on_start(p, b)
                key = kernel_key(p, b)
                first = profile and b.ours and key not in profiled
                profiled.add(key)
                try:
                    rec = run_step(
                        p, b, sets, checker, timer, settings,
                        graph=graph, profile_compile=first, profile=profile and b.ours,
                    )  # fmt: skip
                except CudaContextLost as e:
                    records.append(e.record)
                    if on_record:
                        on_record(e.record)
                    raise
                records.append(rec)
                if on_record:
                    on_record(rec)
        finally:
            del sets, cache, checker  # the inputs and the reference go before the next problem's
            if device == "cuda" and "torch" in sys.modules:
                sys.modules["torch"].cuda.empty_cache()
    return records
