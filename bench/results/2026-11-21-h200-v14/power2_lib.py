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
        cfg = dataclasses.replace(config.select_config(d, "ws", None), **sw(name))
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
names = os.environ.get("NAMES", "ours").split(",")
for n in names:
    if n.startswith("v:"):
        BACKENDS[n] = variant(n[2:])
