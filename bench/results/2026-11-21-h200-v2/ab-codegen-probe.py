"""A/B of WsFwdSm90 code-generation switches, interleaved timing, same process."""
import sys, time, math, faulthandler
import os; os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, "scripts")
import torch
import cutlass.cute as cute
from check_ws import make_qkv, time_ms, preheat, peers, ws_key, BATCH, SEQLEN, PRESET
from hopper_fmha.kernels import schedule, KernelKey
from hopper_fmha.kernels.cache import fake_arguments, _kernel_object
from hopper_fmha.bench.flops import attention_flops, tflops

SWITCHES = ("pin_softmax_before_pv_wait", "elect_release", "rescale_factor_first")
def build(key, **flags):
    kernel, _ = _kernel_object(key)
    cls = type("Probe", (type(kernel),), {k: flags.get(k, getattr(type(kernel), k)) for k in SWITCHES})
    kernel.__class__ = cls
    return cute.compile(kernel, *fake_arguments(key), options="--enable-tvm-ffi")

VARIANTS = {
    "base": dict(pin_softmax_before_pv_wait=False, elect_release=False, rescale_factor_first=False),
    "all": {},
    "pin": dict(elect_release=False, rescale_factor_first=False),
    "elect": dict(pin_softmax_before_pv_wait=False, rescale_factor_first=False),
    "first": dict(pin_softmax_before_pv_wait=False, elect_release=False),
    "pin+elect": dict(rescale_factor_first=False),
}
ROUNDS = 5
for d, heads in PRESET:
    inputs = [make_qkv(BATCH, SEQLEN, SEQLEN, heads, heads, d, torch.float16, seed=s) for s in (1, 2)]
    for causal in (False, True):
        key = ws_key("float16", d, causal)
        names = ["base", "all"] + ([] if causal else ["pin", "elect", "first", "pin+elect"])
        fns = {}
        t0 = time.time()
        for n in names:
            fn = build(key, **VARIANTS[n])
            out = torch.empty_like(inputs[0][0]); lse = torch.empty(BATCH, heads, SEQLEN, device="cuda")
            def run(q, k, v, fn=fn, out=out, lse=lse):
                mc, lg = schedule(q, k, causal)
                fn(q, k, v, out, lse, d**-0.5, 1, mc, lg)
            fns[n] = run
        fns.update(peers(causal))
        flops = attention_flops(BATCH, heads, SEQLEN, SEQLEN, d, causal)
        samples = {n: [] for n in fns}
        for n, f in fns.items():
            time_ms(f, inputs, warmup=3, samples=3)
        preheat()
        order = list(fns)
        for r in range(ROUNDS):
            for n in order[r % len(order):] + order[: r % len(order)]:
                samples[n].append(time_ms(fns[n], inputs, warmup=2, samples=10))
        row = {n: tflops(flops, sorted(ts)[len(ts) // 2]) for n, ts in samples.items()}
        print(f"d={d} causal={causal} (compile {time.time()-t0:.0f}s) " + "  ".join(f"{n}={v:.0f}" for n, v in row.items()), flush=True)
