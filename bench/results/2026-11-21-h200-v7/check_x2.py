"""Correctness of the probe's new kernels against an fp32 reference (ws x2, paper LPT order)."""
import dataclasses, sys, torch
from hopper_fmha import config
from hopper_fmha.kernels import KernelKey, get_kernel, launch
from hopper_fmha.reference import reference as ref
torch.manual_seed(0)
fails = 0; n = 0
def run(variant, tile, extra, dt, B, Sq, Sk, H, Hkv, d, causal, max_ctas=None):
    global fails, n
    q = torch.randn(B, Sq, H, d, device="cuda", dtype=dt)
    k = torch.randn(B, Sk, Hkv, d, device="cuda", dtype=dt)
    v = torch.randn(B, Sk, Hkv, d, device="cuda", dtype=dt)
    cfg = config.select_config(d, variant, tile)
    if variant == "ws":
        cfg = dataclasses.replace(cfg, cluster_m=1, **extra)
    fn = get_kernel(KernelKey.from_config({torch.float16: "float16", torch.bfloat16: "bfloat16"}[dt], causal, cfg))
    out = torch.full_like(q, float("nan")); lse = torch.empty(B, H, Sq, device="cuda")
    launch(fn, q, k, v, out, lse, d ** -0.5, causal, ws=variant == "ws", ctas_per_sm=cfg.ctas_per_sm, max_ctas=max_ctas)
    r, rl = ref(q, k, v, causal=causal)
    err = (out.float() - r.float()).abs().max().item()
    fin = torch.isfinite(rl)
    lerr = (lse[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    ok = err < 2e-2 and lerr < 1e-3 and not torch.isnan(out).any().item()
    n += 1; fails += not ok
    print(("ok  " if ok else "FAIL"), variant, tile, extra, dt, B, Sq, Sk, H, Hkv, d, causal, max_ctas, f"{err:.2e} {lerr:.1e}", flush=True)
for dt in (torch.float16, torch.bfloat16):
    for causal in (True, False):
        for (Sq, Sk) in [(512, 512), (1000, 1000), (300, 700), (700, 300), (1, 129), (2048, 2048)]:
            for extra in (dict(pin_pv_wait=0, ctas_per_sm=2, intra_wg_overlap=False), dict(pin_pv_wait=0, ctas_per_sm=2)):
                if not causal and extra.get("intra_wg_overlap", True):
                    continue
                run("ws", (128, 64), extra, dt, 3, Sq, Sk, 4, 2, 64, causal)
            run("ws", (128, 64), dict(pin_pv_wait=0, ctas_per_sm=2, intra_wg_overlap=False), dt, 2, Sq, Sk, 2, 2, 64, causal, max_ctas=3)
            for d, tile in [(64, (128, 128)), (128, (64, 64))]:
                run("paper", tile, {}, dt, 2, Sq, Sk, 4, 2, d, causal)
print(f"{n - fails}/{n} passed", flush=True)
sys.exit(1 if fails else 0)
