"""Eager vs graph per-call time on one short problem, and host-side µs per call.
env: NAMES (ours,cudnn,fa4,v:<spec>), D, C (1 causal), DT, N."""
import os, time, statistics, torch
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "power2_lib.py")).read())
d = int(os.environ.get("D", "128")); causal = os.environ.get("C", "0") == "1"
N = int(os.environ.get("N", "512")); B = 16384 // N; H = 2048 // d
sets = [tuple(torch.randn(B, N, H, d, device="cuda", dtype=DT) for _ in range(3)) for _ in range(8)]
def ev(): return torch.cuda.Event(enable_timing=True)
for n in names:
    f = BACKENDS[n]
    for s in sets: f(*s, causal)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(8): f(*sets[i], causal)
    res = {}
    for rep in range(2):
        # warm 0.3 s
        t = time.time()
        while time.time() - t < 0.3:
            g.replay()
        torch.cuda.synchronize()
        for calls in (4, 16, 64):
            ts, hs = [], []
            for smp in range(15):
                a, b = ev(), ev(); a.record(); h0 = time.perf_counter()
                for i in range(calls): f(*sets[i % 8], causal)
                h1 = time.perf_counter(); b.record(); torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) / calls * 1e3); hs.append((h1 - h0) / calls * 1e6)
            res.setdefault(f"eager{calls}", []).append(statistics.median(ts))
            res.setdefault(f"host{calls}", []).append(statistics.median(hs))
        ts = []
        for smp in range(15):
            a, b = ev(), ev(); a.record()
            for _ in range(4): g.replay()
            b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) / 32 * 1e3)
        res.setdefault("graph", []).append(statistics.median(ts))
    print(f"{n:14s} d={d} causal={causal} N={N} {os.environ.get('DT','fp16')} us/call: " +
          " ".join(f"{k} {'/'.join(f'{x:.1f}' for x in v)}" for k, v in res.items()), flush=True)
