"""Clock and power under sustained load: ours vs FA4 (vs cuDNN), paper shapes, CUDA graphs.

Per backend and problem: 0.4 s of replays to settle, then ~1 s timed; nvidia-smi samples the SM
clock and board power every 20 ms. Prints ms/call, mean MHz, mean W, Mcycles/call, J/call.
"""
import subprocess, sys, threading, time, statistics
import torch
import hopper_fmha
print("# hopper_fmha from", hopper_fmha.__file__, flush=True)
from flash_attn.cute import flash_attn_func as fa4

samples = []  # (wall, mhz, watts)
def poll():
    p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                          "-lms", "20"], stdout=subprocess.PIPE, text=True)
    for line in p.stdout:
        try:
            mhz, w = (float(x) for x in line.split(","))
            samples.append((time.time(), mhz, w))
        except ValueError:
            pass
threading.Thread(target=poll, daemon=True).start()

def sdpa_cudnn(q, k, v, causal):
    from torch.nn.attention import sdpa_kernel, SDPBackend
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)

import hopper_fmha.kernels as hk
def ours_mode(mode):
    def f(q, k, v, c):
        hk.SCHEDULE = mode
        try:
            return hopper_fmha.flash_attn_func(q, k, v, causal=c)
        finally:
            hk.SCHEDULE = "auto"
    return f
import dataclasses
from hopper_fmha import config
from hopper_fmha.kernels import KernelKey, get_kernel, launch
import os
if os.environ.get("PAPER_CTAS"):  # "64:64:64:0=5;..." -> sm90_paper.CTAS_PER_SM (use its own cache dir)
    from hopper_fmha.kernels import sm90_paper
    for item in os.environ["PAPER_CTAS"].split(";"):
        k, v = item.split("=")
        d_, m_, n_, c_ = (int(x) for x in k.split(":"))
        sm90_paper.CTAS_PER_SM[(d_, m_, n_, bool(c_))] = int(v)
DT = {"fp16": torch.float16, "bf16": torch.bfloat16}[os.environ.get("DT", "fp16")]
def sw(name):
    if name == "base":
        return {}
    if "+" in name:
        out = {}
        for part in name.split("+"):
            out.update(sw(part))
        return out
    if name == "msum":
        return dict(mma_rowsum=True)
    if name == "nomsum":
        return dict(mma_rowsum=False)
    if name == "notrim":
        return dict(causal_trim=False)
    if name == "trim":
        return dict(causal_trim=True)
    if name == "late":
        return dict(rescale_o_early=False)
    if name == "early":
        return dict(rescale_o_early=True)
    if name == "noov":
        return dict(intra_wg_overlap=False)
    if name.startswith("x") and name[1:].isdigit():
        return dict(ctas_per_sm=int(name[1:]))
    if name.startswith("q") and name[1:].isdigit():
        return dict(q_stages=int(name[1:]))
    if name == "tov":
        return dict(q_stages=2, split_o=True, overlap_tiles=True, mma_rowsum=False)
    if name == "relq":
        return dict(release_q_at_qk=True)
    if name == "sO":
        return dict(split_o=True)
    if name.startswith("s") and name[1:].isdigit():
        return dict(num_stages=int(name[1:]))
    if name.startswith("poly"):
        return dict(exp2_poly_every=int(name[4:]))
    if name.startswith("cl"):
        return dict(cluster_m=int(name[2:]))
    if name.startswith("pin"):
        return dict(pin_pv_wait=int(name[3:]))
    if name.startswith("tile"):
        m, n = name[4:].split("x")
        return dict(tile_m=int(m), tile_n=int(n))
    raise ValueError(name)
def variant(name):
    def f(q, k, v, c):
        d = q.shape[-1]
        if name.startswith("paper"):
            nm, _, lg = name.partition("@")
            tile = tuple(int(x) for x in nm[5:].split("x")) if len(nm) > 5 else None
            cfg = config.select_config(d, "paper", tile)
            fn = get_kernel(KernelKey.from_config({torch.float16: "float16", torch.bfloat16: "bfloat16"}[q.dtype], c, cfg))
            out = torch.empty_like(q); lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device="cuda")
            launch(fn, q, k, v, out, lse, d ** -0.5, c, ws=False, **({"lpt_group": int(lg)} if lg else {}))
            return out
        # As launched (CTA pairs only where they apply, causal switches), then the variant's switches.
        cfg = config.launch_config(config.select_config(d, "ws", None), c, q.shape[1])
        cfg = dataclasses.replace(cfg, **sw(name))
        if c:
            cfg = dataclasses.replace(cfg, cluster_m=1)
        fn = get_kernel(KernelKey.from_config({torch.float16: "float16", torch.bfloat16: "bfloat16"}[q.dtype], c, cfg))
        out = torch.empty_like(q); lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device="cuda")
        launch(fn, q, k, v, out, lse, d ** -0.5, c, ws=True)
        return out
    return f
BACKENDS = {
    "ours": lambda q, k, v, c: hopper_fmha.flash_attn_func(q, k, v, causal=c),
    "ours1": ours_mode("single"),
    "fa4": lambda q, k, v, c: fa4(q, k, v, causal=c),
    "cudnn": sdpa_cudnn,
}
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["ours", "fa4"]
for n in names:
    if n.startswith("v:"):
        BACKENDS[n] = variant(n[2:])
cases = [(d, 2048 // d) for d in (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 and sys.argv[2][0].isdigit() else "64,128,256").split(","))]
causals = [True] if "causal-only" in sys.argv else [False, True] if "causal" in sys.argv else [False]
time.sleep(0.5)
for d, H in cases:
    for causal in causals:
        N = int(os.environ.get("N", "4096")); B = 16384 // N
        sets = [tuple(torch.randn(B, N, H, d, device="cuda", dtype=DT) for _ in range(3))
                for _ in range(2)]
        graphs = {}
        for n in names:
            f = BACKENDS[n]
            for s in sets:
                f(*s, causal)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(10):
                    f(*sets[i % 2], causal)
            graphs[n] = g
        res = {n: [] for n in names}
        for rep in range(2):
            for n in (names if rep == 0 else names[::-1]):
                g = graphs[n]
                t_end = time.time() + 0.4
                while time.time() < t_end:
                    g.replay(); torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                w0 = time.time(); e0.record(); reps = 0
                while time.time() - w0 < 1.0:
                    for _ in range(5):
                        g.replay()
                    reps += 5
                    torch.cuda.synchronize()
                e1.record(); torch.cuda.synchronize(); w1 = time.time()
                ms = e0.elapsed_time(e1) / (reps * 10)
                win = [(m, w) for t, m, w in samples if w0 + 0.05 <= t <= w1]
                mhz = statistics.mean(m for m, _ in win) if win else float("nan")
                watt = statistics.mean(w for _, w in win) if win else float("nan")
                res[n].append((ms, mhz, watt))
        for n in names:
            for ms, mhz, watt in res[n]:
                print(f"d={d} N={N} causal={int(causal)} {n:6s} {ms:.4f} ms  {mhz:6.0f} MHz  {watt:5.0f} W  "
                      f"{ms * mhz / 1e3:7.3f} Mcyc  {ms * watt:6.1f} mJ", flush=True)
