"""GPU check of the ws kernel: correctness against the fp32 reference, then TFLOP/s beside its peers.

Run from the project root on the GPU machine (about 2-3 minutes):

    source .gpu/activate.sh && export PYTHONPATH=$PWD/src:$PYTHONPATH &&
        timeout 300 python scripts/check_ws.py

Stages, each wrapped so that a failure is reported and the next stage still runs:
  1. compile every kernel used below in parallel processes (fills the disk cache);
  2. smoke: one small launch under a 30 s watchdog (a hang exits the script, not the session);
  3. correctness: ws against `hopper_fmha.reference.reference` on shapes with tails, causal
     Sq != Sk, rows that see no key, GQA/MQA; outputs poisoned with NaN before each call;
  4. timing on the paper preset (B=4, N=4096, fp16; d/heads 64/32, 128/16, 256/8): ws, its
     ablations (schedule, pingpong, overlap, early O rescale, tiles), paper, SDPA flash (FA2) and
     cuDNN, FA4; after a matmul pre-heat, 5 interleaved rounds of 10 CUDA-event samples per
     backend (first backend rotating), median over two input sets; cuBLAS fp16 8192^3 last.
"""

from __future__ import annotations

import concurrent.futures as futures
import dataclasses
import faulthandler
import math
import multiprocessing
import sys
import time
import traceback

import torch

from hopper_fmha import config
from hopper_fmha.bench.flops import attention_flops, matmul_flops, tflops
from hopper_fmha.kernels import KernelKey, get_kernel, launch
from hopper_fmha.reference import reference

PRESET = ((64, 32), (128, 16), (256, 8))  # (head_dim, heads) at hidden 2048
BATCH, SEQLEN = 4, 4096
# (batch, seqlen_q, seqlen_k, heads, kv_heads): why each is here.
SHAPES = (
    (1, 1, 1, 2, 2),  # one key
    (2, 113, 203, 6, 2),  # tails on both sides, GQA, causal Sq < Sk
    (1, 799, 3, 4, 1),  # MQA; causal: most rows see no key, 3-key tail
    (1, 300, 200, 2, 2),  # causal Sq > Sk: the first 100 rows see no key
    (2, 1023, 1024, 4, 4),  # one row short of a tile
    (1, 4224, 4224, 2, 1),  # many key blocks: masked and unmasked loops both run
)
# Schedules checked: the default, one CTA per tile, and 3 persistent CTAs (many tiles each, so
# the Q barrier phases, the K/V pipelines and the O buffer are reused across tiles).
MAX_CTAS = (None, 0, 3)
OUT_FLOOR = {torch.float16: 1e-4, torch.bfloat16: 1e-3}


def ws_key(dtype: str, head_dim: int, causal: bool, tile=None, **switches) -> KernelKey:
    cfg = dataclasses.replace(config.select_config(head_dim, "ws", tile), **switches)
    return KernelKey.from_config(dtype, causal, cfg)


def paper_key(dtype: str, head_dim: int, causal: bool) -> KernelKey:
    cfg = config.select_config(head_dim, "paper")
    return KernelKey(dtype, head_dim, cfg.tile_m, cfg.tile_n, causal, "paper")


def timed_backends(head_dim: int, causal: bool) -> dict[str, KernelKey]:
    """name -> kernel; a name ending in /single or /persistent runs that schedule instead of the default."""
    ours = {"ws": ws_key("float16", head_dim, causal), "paper": paper_key("float16", head_dim, causal)}
    ours["ws/single"] = ours["ws"]
    if head_dim == 64:  # 2 consumer warpgroups instead of 3
        ours["ws-128x128"] = ws_key("float16", 64, causal, (128, 128))
    if head_dim == 128:  # the two ablations, where FA3 measured them; FA3's non-causal tile
        ours["ws-nopingpong"] = ws_key("float16", 128, causal, pingpong=False)
        ours["ws-nooverlap"] = ws_key("float16", 128, causal, intra_wg_overlap=False)
        ours["ws-128x176"] = ws_key("float16", 128, causal, (128, 176))
        ours["ws-early-rescale"] = ws_key("float16", 128, causal, rescale_o_early=True)
    if head_dim == 256:  # FA4's early O rescale off; pingpong on
        ours["ws-late-rescale"] = ws_key("float16", 256, causal, rescale_o_early=False)
        ours["ws-pingpong"] = ws_key("float16", 256, causal, pingpong=True)
    return ours


def all_keys() -> list[KernelKey]:
    keys = {ws_key(dt, d, c) for dt in ("float16", "bfloat16") for d, _ in PRESET for c in (False, True)}
    keys |= {k for d, _ in PRESET for c in (False, True) for k in timed_backends(d, c).values()}
    return sorted(keys)


def _compile(key: KernelKey) -> tuple[str, float, str]:
    t0 = time.perf_counter()
    try:
        get_kernel(key)
        return key.slug(), time.perf_counter() - t0, ""
    except Exception as e:
        return key.slug(), time.perf_counter() - t0, f"{type(e).__name__}: {e}"


def stage_compile() -> None:
    keys = all_keys()
    t0 = time.perf_counter()
    with futures.ProcessPoolExecutor(max_workers=12, mp_context=multiprocessing.get_context("spawn")) as pool:
        for slug, seconds, error in pool.map(_compile, keys):
            print(f"  {slug:<45} {seconds:5.1f}s {'FAILED ' + error if error else ''}")
    print(f"  {len(keys)} kernels in {time.perf_counter() - t0:.1f}s")


def run_ws(q, k, v, causal, key, max_ctas=None):
    """One launch; max_ctas None: the default schedule, else that many persistent CTAs (0: one per tile)."""
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), math.nan, device=q.device, dtype=torch.float32)
    launch(get_kernel(key), q, k, v, out, lse, q.shape[-1] ** -0.5, causal, ws=True, max_ctas=max_ctas)
    return out, lse


def make_qkv(batch, sq, sk, heads, kv_heads, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((batch, sq, heads, d), (batch, sk, kv_heads, d), (batch, sk, kv_heads, d))
    return [torch.randn(s, device="cuda", dtype=dtype, generator=g) for s in shapes]


def stage_smoke() -> None:
    faulthandler.dump_traceback_later(30, exit=True)  # a hang prints where and exits
    q, k, v = make_qkv(1, 200, 300, 2, 2, 128, torch.float16)
    out, lse = run_ws(q, k, v, False, ws_key("float16", 128, False))
    torch.cuda.synchronize()
    faulthandler.cancel_dump_traceback_later()
    print(f"  launched and returned; finite: {bool(torch.isfinite(out).all())}")


def check_one(q, k, v, causal, key, max_ctas=None) -> str:
    """'' if within tolerance, else the failure: error at most 2x PyTorch-in-dtype's, plus a floor."""
    out, lse = run_ws(q, k, v, causal, key, max_ctas)
    scale = q.shape[-1] ** -0.5
    ref_out, ref_lse = reference(q, k, v, softmax_scale=scale, causal=causal)
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        hidden = torch.arange(sk, device="cuda")[None, :] > torch.arange(sq, device="cuda")[:, None] + sk - sq
        s = s.masked_fill(hidden, -math.inf)
    base_out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1).nan_to_num(0.0), vv)
    base_lse = torch.logsumexp(s.float(), dim=-1)
    if not torch.isfinite(out).all():
        return "NaN/inf in out (unwritten element?)"
    empty = torch.isinf(ref_lse)
    if not torch.equal(torch.isneginf(lse), empty) or torch.isnan(lse).any():
        return "lse: -inf pattern differs from the reference, or NaN"
    err = (out.float() - ref_out).abs().max().item()
    tol = 2 * (base_out.float() - ref_out).abs().max().item() + OUT_FLOOR[q.dtype]
    if err > tol:
        return f"out error {err:.3g} > {tol:.3g}"
    if (~empty).any():
        err_lse = (lse - ref_lse)[~empty].abs().max().item()
        tol_lse = 2 * (base_lse - ref_lse)[~empty].abs().max().item() + 1e-4
        if err_lse > tol_lse:
            return f"lse error {err_lse:.3g} > {tol_lse:.3g}"
    return ""


def stage_correctness() -> int:
    failures = 0
    for dtype in (torch.float16, torch.bfloat16):
        for d, _ in PRESET:
            for causal in (False, True):
                key = ws_key(str(dtype).removeprefix("torch."), d, causal)
                for i, (b, sq, sk, h, hkv) in enumerate(SHAPES):
                    for max_ctas in MAX_CTAS:
                        try:
                            faulthandler.dump_traceback_later(60, exit=True)
                            q, k, v = make_qkv(b, sq, sk, h, hkv, d, dtype, seed=i)
                            problem = check_one(q, k, v, causal, key, max_ctas)
                            faulthandler.cancel_dump_traceback_later()
                        except Exception as e:
                            problem = f"{type(e).__name__}: {e}"
                        if problem:
                            failures += 1
                            print(
                                f"  FAIL {key.slug()} ctas={max_ctas} b={b} sq={sq} sk={sk} h={h}/{hkv}: "
                                + problem
                            )
    total = 2 * len(PRESET) * 2 * len(SHAPES) * len(MAX_CTAS)
    print(f"  {total - failures}/{total} cases passed")
    return failures


def time_ms(fn, inputs, warmup=5, samples=30) -> float:
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    start = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(samples)]
    for i in range(samples):
        start[i].record()
        fn(*inputs[i % len(inputs)])
        end[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(start, end, strict=True))[samples // 2]


ROUNDS = 5


def preheat(seconds: float = 0.3) -> None:
    """Sustained matmul load, so that every backend is timed at the clocks it will keep."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            torch.matmul(a, a)
        torch.cuda.synchronize()


def peers(causal: bool) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def fn(q, k, v):
            with sdpa_kernel(backend):
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return fn

    fns = {"sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION)}
    try:
        from flash_attn.cute import flash_attn_func as fa4

        fns["fa4"] = lambda q, k, v: fa4(q, k, v, causal=causal)
    except Exception as e:
        print(f"  FA4 unavailable: {type(e).__name__}: {e}")
    return fns


def launcher(fn, out, lse, scale, causal, ws, mode=None):
    return lambda q, k, v: launch(fn, q, k, v, out, lse, scale, causal, ws=ws, mode=mode)


def stage_timing() -> None:
    rows = []
    for d, heads in PRESET:
        inputs = [make_qkv(BATCH, SEQLEN, SEQLEN, heads, heads, d, torch.float16, seed=s) for s in (1, 2)]
        for causal in (False, True):
            flops = attention_flops(BATCH, heads, SEQLEN, SEQLEN, d, causal)
            fns = {}
            for name, key in timed_backends(d, causal).items():
                out = torch.empty_like(inputs[0][0])
                lse = torch.empty(BATCH, heads, SEQLEN, device="cuda", dtype=torch.float32)
                mode = name.partition("/")[2] or None
                fn = get_kernel(key)
                fns[name] = launcher(fn, out, lse, d**-0.5, causal, key.variant == "ws", mode)
            fns.update(peers(causal))
            row = {"d": d, "causal": causal}
            samples: dict[str, list[float]] = {name: [] for name in fns}
            for name, fn in fns.items():  # warm-up (and FA4's compile) outside the timed rounds
                try:
                    faulthandler.dump_traceback_later(150, exit=True)
                    time_ms(fn, inputs, warmup=3, samples=3)
                    faulthandler.cancel_dump_traceback_later()
                except Exception as e:
                    samples.pop(name)
                    row[name] = None
                    print(f"  {name} d={d} causal={causal}: {type(e).__name__}: {str(e)[:200]}")
            preheat()
            names = list(samples)
            for r in range(ROUNDS):  # interleaved, first backend rotating: fair under clock drift
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    samples[name].append(time_ms(fns[name], inputs, warmup=2, samples=10))
            for name, ts in samples.items():
                row[name] = tflops(flops, sorted(ts)[len(ts) // 2])
            rows.append(row)
            print(
                "  "
                + "  ".join(f"{k}={v:.0f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
            )
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    cublas = tflops(matmul_flops(8192, 8192, 8192), time_ms(torch.matmul, [(a, a)]))
    names = list(dict.fromkeys(n for row in rows for n in row if n not in ("d", "causal")))
    print(f"\nTFLOP/s, B={BATCH} N={SEQLEN} fp16 (cuBLAS 8192^3 fp16: {cublas:.0f})")
    print(f"{'d':>4} {'causal':>6} " + " ".join(f"{n:>13}" for n in names))
    for row in rows:
        cells = (f"{row.get(n):13.0f}" if row.get(n) is not None else f"{'-':>13}" for n in names)
        print(f"{row['d']:>4} {str(row['causal']):>6} " + " ".join(cells))


def main() -> int:
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    status = 0
    for name, stage in (
        ("compile", stage_compile),
        ("smoke", stage_smoke),
        ("correctness", stage_correctness),
        ("timing", stage_timing),
    ):
        print(f"== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            if stage():
                status = 1
        except Exception:
            traceback.print_exc()
            status = 1
        print(f"   ({name}: {time.perf_counter() - t0:.1f}s)", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
