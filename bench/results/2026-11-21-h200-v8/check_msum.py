"""Correctness of ws variants (switches from argv, e.g. msum) on a subset of the GPU matrix + lazy patterns."""
import dataclasses, sys, os, torch
sys.path.insert(0, "tests"); sys.path.insert(0, ".scratch")
from test_gpu_kernels import make_inputs, run_kernel, assert_close_to_reference, max_jumps
from p2sw import sw
from hopper_fmha import config
extra = {}
for spec in sys.argv[1].split("+"):
    extra.update(sw(spec))
n = fails = 0
for dt in (torch.float16, torch.bfloat16):
    for d in [int(x) for x in os.environ.get("DS", "64,128,256").split(",")]:
        for causal in (False, True):
            base = dataclasses.replace(config.select_config(d, "ws"), **extra)
            cases = [(sq, sk, None) for sq, sk in [(1, 1), (113, 203), (239, 1), (799, 3), (1023, 1024), (4224, 4224)]]
            cases += [(1000, 1536, "sharp"), (1000, 1536, "ramp")]
            for sq, sk, pattern in cases:
                q, k, v = make_inputs(2, sq, sk, 6, 2, d, dt, seed=hash((d, causal, sq, sk, pattern)) % 2**31)
                scale = config.default_softmax_scale(d)
                if pattern == "sharp":
                    scale *= 8
                elif pattern == "ramp":
                    k = (k.float() * torch.linspace(16.0, 1.0, sk, device="cuda")[None, :, None, None]).to(dt)
                out, lse = run_kernel(q, k, v, scale, causal, base)
                n += 1
                try:
                    assert_close_to_reference(q, k, v, scale, causal, out, lse)
                    if pattern:
                        assert max_jumps(q, k, scale, causal, base.tile_n) > 0
                except AssertionError as e:
                    fails += 1
                    print("FAIL", dt, d, causal, sq, sk, pattern, e, flush=True)
print(f"{sys.argv[1]}: {n - fails}/{n} passed", flush=True)
