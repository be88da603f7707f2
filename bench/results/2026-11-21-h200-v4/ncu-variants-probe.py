"""Variants of ours x3 each, then FA4 x3 (for ncu L2 metrics): prof3.py D"""
import sys, dataclasses, torch
from hopper_fmha import config
from hopper_fmha.kernels import KernelKey, get_kernel, launch
from flash_attn.cute import flash_attn_func as fa4
d = int(sys.argv[1]); H = 2048 // d; causal = False
VARS = {"base": {}, "pin16": dict(pin_pv_wait=16), "pin0": dict(pin_pv_wait=0), "pin8": dict(pin_pv_wait=8)}
names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(VARS)
torch.manual_seed(0)
q, k, v = (torch.randn(4, 4096, H, d, device="cuda", dtype=torch.float16) for _ in range(3))
out = torch.empty_like(q); lse = torch.empty(4, H, 4096, device="cuda")
for n in names:
    cfg = dataclasses.replace(config.select_config(d, "ws", None), **VARS[n])
    fn = get_kernel(KernelKey.from_config("float16", causal, cfg))
    for _ in range(3):
        launch(fn, q, k, v, out, lse, d ** -0.5, causal, ws=True)
    torch.cuda.synchronize(); print(n, "ok", flush=True)
for _ in range(3):
    fa4(q, k, v, causal=causal)
torch.cuda.synchronize(); print("prof done", d)
