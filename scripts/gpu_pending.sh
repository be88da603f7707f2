# The GPU checks owed by changes built without a GPU (NOTES.md "v25"), in one device call of about
# 7 minutes: their GPU tests, then each measured against the default in the same call.
# On the GPU machine, from the project root:
#
#     source .gpu/activate.sh && OUT=$OUT bash scripts/gpu_pending.sh
#
# Logs go under $OUT (default /tmp/pending). Measured:
#   sm90_bwd.DQ_SCALE_AT_CAST   dQacc unscaled, the scale applied as the host casts (bwd_profile --dq-at-cast)
#   sm90_bwd.DQ_FRAGMENTS       d128 tile 80: dQ in fragment order, STS.128 + 1-D bulk reduce-add
#                               (bwd_profile --dq-fragments), alone and with the above
#   d192/dv128 pingpong         sustained.py, ws against ws:pingpong=1 (v25: causal 0.975x FA4's time
#                               with it, 0.998x without; non-causal not measured at 128x128)
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"

python scripts/gpu_tier.py --out /tmp/pending-tier --archive "$OUT/tier.tar.gz" --procs 15 --budget 150 \
    --stall 90 -k "dq_scale or dq_fragments" tests/test_gpu_backward.py > "$OUT/tier.log" 2>&1
tail -2 "$OUT/tier.log"
grep -h "^FAILED" /tmp/pending-tier/report*.txt | head -10

# Backward, bf16 B4 N4096 hidden 2048, the default tiles: dQ scaled per step, then at the cast, twice.
for run in 1 2; do
    for cast in off on; do
        python scripts/bwd_profile.py --d 128 --heads 16 --versions 2 --dq-at-cast $cast 2>&1 | grep TFLOP
        python scripts/bwd_profile.py --d 128 --heads 16 --versions 2 --causal --dq-at-cast $cast 2>&1 | grep TFLOP
        python scripts/bwd_profile.py --d 64 --heads 32 --versions 2 --dq-at-cast $cast 2>&1 | grep TFLOP
        python scripts/bwd_profile.py --d 128 --heads 16 --versions 2 --deterministic --dq-at-cast $cast 2>&1 | grep TFLOP
    done
done | tee "$OUT/dq_at_cast.txt"

# d128 non-causal (tile 80): dQ as now, in fragment order, and in fragment order unscaled; twice.
for run in 1 2; do
    for frag in "off off" "on off" "on on"; do
        set -- $frag
        for det in "" --deterministic; do
            python scripts/bwd_profile.py --d 128 --heads 16 --versions 2 $det --dq-fragments $1 --dq-at-cast $2 \
                2>&1 | grep TFLOP | sed "s/\$/  (fragments $1, at cast $2)/"
        done
    done
done | tee "$OUT/dq_fragments.txt"

python scripts/sustained.py --backends fa4 ws ws:pingpong=1 --headdim 192 --headdim-v 128 --seqlen 4096 \
    --batch 4 --heads 16 --causal both --dtype bf16 --passes 2 --seconds 0.6 --settle 0.3 2>&1 \
    | grep -v Warning | tee "$OUT/d192-pingpong.txt" | grep "mean ms"
