"""Compile (into HOPPER_FMHA_CACHE_DIR) every kernel the split_o tests and probes launch, in parallel."""
import dataclasses, sys, time
from multiprocessing import Pool
sys.path.insert(0, "tests")
from hopper_fmha import config

def keys():
    from hopper_fmha.kernels import KernelKey
    from test_gpu_kernels import SPLIT_O, CLUSTER_SEQLENS
    out = set()
    for dt in ("float16", "bfloat16"):
        for d, tile, st in SPLIT_O:
            for causal in (False, True):
                for sq, _ in CLUSTER_SEQLENS:
                    cfg = dataclasses.replace(config.select_config(d, "ws", tile), split_o=True, num_stages=st)
                    out.add(KernelKey.from_config(dt, causal, config.launch_config(cfg, causal, sq)))
        # probe variants (power2 v:...: causal forces cluster_m=1, no causal switches)
        for d, tile, extra in [(256, (128, 64), {}), (256, None, {})]:
            for dO in (False, True):
                if dO and tile is None:
                    continue
                for causal in (False, True):
                    cfg = dataclasses.replace(config.select_config(d, "ws", tile), split_o=dO, **extra)
                    if causal:
                        cfg = dataclasses.replace(cfg, cluster_m=1)
                    out.add(KernelKey.from_config(dt, causal, cfg))
    return sorted(out)

def build(key):
    from hopper_fmha.kernels import get_kernel
    t = time.time()
    get_kernel(key)
    return key.slug(), round(time.time() - t, 1)

if __name__ == "__main__":
    ks = keys()
    print(len(ks), "kernels", flush=True)
    t = time.time()
    with Pool(int(sys.argv[1]) if len(sys.argv) > 1 else 14) as p:
        for slug, s in p.imap_unordered(build, ks):
            pass
    print("compiled in", round(time.time() - t, 1), "s", flush=True)
