"""A/B of the pinned GEMM-II wait (softmax_style / pin_exps), interleaved timing, same process."""
import sys, time
import os; os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, "scripts")
import torch
import cutlass.cute as cute
from check_ws import make_qkv, time_ms, preheat, peers, ws_key, BATCH, SEQLEN, PRESET
from hopper_fmha.kernels import schedule, _tile_counters
from hopper_fmha.kernels.cache import fake_arguments, _kernel_object
from hopper_fmha.bench.flops import attention_flops, tflops

SWITCHES = ("claim_late",)
def build(key, **flags):
    kernel, _ = _kernel_object(key)
    cls = type("Probe", (type(kernel),), {k: flags.get(k, getattr(type(kernel), k)) for k in SWITCHES})
    kernel.__class__ = cls
    return cute.compile(kernel, *fake_arguments(key), options="--enable-tvm-ffi")

VARIANTS = {"late": {}, "early": dict(claim_late=False)}
ROUNDS = int(os.environ.get("ROUNDS", "5"))
DS = [int(x) for x in os.environ.get("DS", "64,128,256").split(",")]
for d, heads in PRESET:
    if d not in DS:
        continue
    inputs = [make_qkv(BATCH, SEQLEN, SEQLEN, heads, heads, d, torch.float16, seed=s) for s in (1, 2)]
    for causal in (True,):
        key = ws_key("float16", d, causal)
        fns = {}; outs = {}
        t0 = time.time()
        for n, flags in VARIANTS.items():
            fn = build(key, **flags)
            out = torch.empty_like(inputs[0][0]); lse = torch.empty(BATCH, heads, SEQLEN, device="cuda")
            def run(q, k, v, fn=fn, out=out, lse=lse):
                mc, lg = schedule(q, k, causal)
                counters, slot = _tile_counters(q.get_device(), causal)
                fn(q, k, v, out, lse, d**-0.5, 1, mc, lg, counters, slot)
            fns[n] = run; outs[n] = out
        # correctness: every variant equals base on input 0
        for n in fns:
            outs[n].fill_(float("nan")); fns[n](*inputs[0])
        torch.cuda.synchronize()
        diffs = {n: (outs[n].float() - outs["late"].float()).abs().max().item() for n in fns}
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
        print(f"d={d} causal={causal} (compile {time.time()-t0:.0f}s) " + "  ".join(f"{n}={v:.0f}" for n, v in row.items())
              + "  | maxdiff vs base " + " ".join(f"{n}={v:.1e}" for n, v in diffs.items() if n != "late"), flush=True)
