"""Diagnostics: `rc D CAUSAL [pp]` one ws launch for racecheck; `prof D` ours x3 then FA4 x3 (ncu)."""
import sys, dataclasses, torch
from hopper_fmha import config
from hopper_fmha.kernels import KernelKey, get_kernel, launch

def key(d, causal, **sw):
    cfg = dataclasses.replace(config.select_config(d, "ws", None), **sw)
    return KernelKey("float16", d, cfg.tile_m, cfg.tile_n, causal, "ws", cfg.num_stages,
                     cfg.intra_wg_overlap, cfg.pingpong, cfg.rescale_o_early)

def run(d, causal, B, Sq, Sk, H, Hkv, max_ctas=None, **sw):
    torch.manual_seed(0)
    q = torch.randn(B, Sq, H, d, device="cuda", dtype=torch.float16)
    k = torch.randn(B, Sk, Hkv, d, device="cuda", dtype=torch.float16)
    v = torch.randn(B, Sk, Hkv, d, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q); lse = torch.empty(B, H, Sq, device="cuda", dtype=torch.float32)
    fn = get_kernel(key(d, causal, **sw))
    return q, k, v, out, lse, fn

mode = sys.argv[1]
if mode == "rc":
    d, causal = int(sys.argv[2]), sys.argv[3] == "1"
    sw = {"pingpong": True} if "pp" in sys.argv[4:] else {}
    q, k, v, out, lse, fn = run(d, causal, 1, 300, 517, 4, 2, **sw)
    launch(fn, q, k, v, out, lse, d ** -0.5, causal, ws=True)
    torch.cuda.synchronize(); print("rc", d, causal, sw, out.float().abs().mean().item())
else:
    d = int(sys.argv[2]); H = 2048 // d; causal = len(sys.argv) > 3 and sys.argv[3] == "1"
    q, k, v, out, lse, fn = run(d, causal, 4, 4096, 4096, H, H)
    for _ in range(3):
        launch(fn, q, k, v, out, lse, d ** -0.5, causal, ws=True)
    from flash_attn.cute import flash_attn_func as fa4
    for _ in range(3):
        fa4(q, k, v, causal=causal)
    torch.cuda.synchronize(); print("prof done", d)
