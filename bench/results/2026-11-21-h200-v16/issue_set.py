"""Issue-5 aggregates over bench JSON files: issue set (paper + N>=2048), short cells, cuBLAS rate."""
import json, math, sys
rows = []  # (src, problem key, mode, ratio, peer, ours tflops)
cublas = {}
for f in sys.argv[1:]:
    d = json.load(open(f))
    src = "paper" if d["preset"] == "paper" else "sweep"
    mm = d["matmul"]["tflops"] if isinstance(d.get("matmul"), dict) and "tflops" in d["matmul"] else None
    by = {}
    for r in d["records"]:
        p = r["problem"]
        key = (p["dtype"], p["head_dim"], p["causal"], p["seqlen_q"])
        by.setdefault(key, {})[r["backend"]] = r
    for key, recs in by.items():
        ours = recs["hopper-fmha:auto"]
        for mode in ("graph", "eager"):
            peers = {b: r[mode]["median_ms"] for b, r in recs.items() if b != "hopper-fmha:auto" and r["status"] == "ok" and r.get(mode)}
            best = min(peers, key=peers.get)
            rows.append((src, key, mode, peers[best] / ours[mode]["median_ms"], best, ours["flops"] / ours[mode]["median_ms"] / 1e9, f, mm))
def agg(sel, mode, name):
    rs = [r for r in rows if sel(r) and r[2] == mode]
    g = math.exp(sum(math.log(r[3]) for r in rs) / len(rs))
    low = sorted(rs, key=lambda r: r[3])[:5]
    print(f"{name:28s} {mode:5s} n={len(rs):2d} geomean {g:.4f} >=1: {sum(r[3] >= 1 for r in rs)}/{len(rs)} "
          f"lowest: " + ", ".join(f"{r[1][0][:2]}{'b' if r[1][0]=='bfloat16' else ''} d{r[1][1]} {'c' if r[1][2] else 'nc'} N{r[1][3]} {r[3]:.4f} ({r[4]})" for r in low[:3]))
for mode in ("graph", "eager"):
    agg(lambda r: r[0] == "paper" or r[1][3] >= 2048, mode, "issue set (paper + N>=2048)")
    agg(lambda r: r[0] == "sweep" and r[1][3] >= 2048, mode, "sweep N>=2048")
    agg(lambda r: r[0] == "paper", mode, "paper")
    agg(lambda r: r[0] == "sweep" and r[1][3] < 2048, mode, "short (N 512/1024)")
