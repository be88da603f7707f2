"""Clock transients when one backend follows another: graph replays back to back, one event pair
per replay (8 calls over 8 input sets), binned per 100 ms; nvidia-smi clock/power every 20 ms.
env: SEQ="fa4:1.5,ours:2.5,..." (backend:seconds), D, C (1 causal), DT, N."""
import os, time, statistics, torch
exec(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "power2_lib.py")).read())
threading.Thread(target=poll, daemon=True).start()
d = int(os.environ.get("D", "64")); causal = os.environ.get("C", "1") == "1"
N = int(os.environ.get("N", "1024")); B = 16384 // N; H = 2048 // d
sets = [tuple(torch.randn(B, N, H, d, device="cuda", dtype=DT) for _ in range(3)) for _ in range(8)]
seq = [(s.split(":")[0], float(s.split(":")[1])) for s in os.environ["SEQ"].split(",")]
for n, _ in seq:
    if n.startswith("v:") and n not in BACKENDS:
        BACKENDS[n] = variant(n[2:])
graphs = {}
for n in dict.fromkeys(x for x, _ in seq):
    f = BACKENDS[n]
    for s in sets: f(*s, causal)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(8): f(*sets[i], causal)
    graphs[n] = g
torch.cuda.synchronize()
print(f"# d={d} causal={causal} N={N} {os.environ.get('DT','fp16')} SEQ={os.environ['SEQ']}", flush=True)
for n, secs in seq:
    g = graphs[n]
    evs = []
    t0 = time.time()
    # enqueue in chunks so the host never runs far ahead
    while True:
        chunk = []
        for _ in range(20):
            a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
            a.record(); g.replay(); b.record(); chunk.append((a, b))
        chunk[-1][1].synchronize()
        evs += chunk
        if time.time() - t0 > secs:
            break
    t1 = time.time()
    per = [a.elapsed_time(b) / 8 for a, b in evs]
    base = evs[0][0]
    starts = [base.elapsed_time(a) for a, _ in evs]
    bins = {}
    for s, p in zip(starts, per):
        bins.setdefault(int(s // 100), []).append(p)
    clk = [m for (w, m, p) in samples if t0 <= w <= t1]
    print(f"{n:8s} {secs:.1f}s: ms/call per 100 ms: " + " ".join(f"{statistics.median(v):.4f}" for k, v in sorted(bins.items())), flush=True)
    nb = max(1, len(clk) // 10)
    print(f"{'':8s} MHz per ~{nb*20} ms: " + " ".join(f"{statistics.mean(clk[i:i+nb]):.0f}" for i in range(0, len(clk), nb)), flush=True)
