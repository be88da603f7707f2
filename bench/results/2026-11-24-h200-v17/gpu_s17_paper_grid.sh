source .gpu/activate.sh
NEW="PYTHONPATH=$PWD/_head/src:$PYTHONPATH"; OLD="PYTHONPATH=$PWD/_old/src:$PYTHONPATH"
mkdir -p /tmp/pp
for c in "" "--causal"; do
  for side in old new; do
    if [ $side = old ]; then E=$OLD; else E=$NEW; fi
    env $E timeout 55 python -m hopper_fmha bench --seqlen 512 1024 --headdim 64 --dtype bf16 $c --backends hopper-fmha:auto sdpa-cudnn --steady-ms 300 --block-ms 1000 --rounds 2 --iters 24 --no-plot --tag $side --out /tmp/pp/$side > /dev/null 2>&1
  done
done
python - <<'PY' | tee $OUT/paper-grid-old-new.txt
import json, glob
for side in ("old", "new"):
    for f in sorted(glob.glob(f"/tmp/pp/{side}/*.json")):
        d = json.load(open(f))
        print(side, f.split("/")[-1], d["env"].get("sources", d["env"].get("git", "")))
        for r in d["records"]:
            p = r["problem"]; g = r["graph"]; e = r["eager"]
            print(f"  N{p['seqlen_q']} causal={p['causal']} {r['backend']:18s} graph {g['median_ms']:.4f} ms  eager {e['median_ms']:.4f} ms")
PY
