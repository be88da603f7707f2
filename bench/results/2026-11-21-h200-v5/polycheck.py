import sys, math, dataclasses, torch
sys.path.insert(0, "tests")
from test_gpu_kernels import make_inputs, assert_close_to_reference
from hopper_fmha import config, kernels
for d, ks in ((64, (2, 3, 4, 8)), (128, (4,))):
    for k in ks:
        for dtype in (torch.float16, torch.bfloat16):
            for causal in (False, True):
                cfg = dataclasses.replace(config.select_config(d, "ws"), exp2_poly_every=k)
                for sq, sk in ((1023, 1024), (4224, 4224), (239, 1), (799, 3)):
                    c = config.launch_config(cfg, causal, sq)
                    q, kk, v = make_inputs(2, sq, sk, 6, 2, d, dtype, seed=sq + k)
                    out = torch.full_like(q, math.nan)
                    lse = torch.full((2, 6, sq), math.nan, device="cuda", dtype=torch.float32)
                    fn = kernels.get_kernel(kernels.KernelKey.from_config(str(dtype)[6:], causal, c))
                    kernels.launch(fn, q, kk, v, out, lse, d ** -0.5, causal, ws=True)
                    try:
                        assert_close_to_reference(q, kk, v, d ** -0.5, causal, out, lse)
                        print("ok", d, k, dtype, causal, sq, sk, flush=True)
                    except AssertionError as e:
                        print("FAIL", d, k, dtype, causal, sq, sk, e, flush=True)
