# The GPU checks owed by changes built without a GPU (NOTES.md "v25", "v26"; run in session 27,
# results in bench/results/2026-11-27-h100-v27/probes; the switches are on by default since), in two
# device calls of under 10 minutes each. On the GPU machine, from the project root:
#
#     source .gpu/activate.sh && OUT=$OUT bash scripts/gpu_pending.sh 1    # then ... 2
#
# Logs go under $OUT (default /tmp/pending). Part 1: the GPU tests of everything below (one tier
# run), then the d256 kernel timed. Part 2: the A/B measurements.
#   backward.WIDE_BACKWARD      head dims past 128 on the wide kernel (sm90_bwd_wide; session 26), at
#                               (256, 256) and (192, 128): tests -k wide (644), bwd_profile --wide
#   sm90_bwd.DQ_SCALE_AT_CAST   dQacc unscaled, the scale applied as the host casts (bwd_profile --dq-at-cast)
#   sm90_bwd.DQ_FRAGMENTS       dQ in fragment order, STS.128 + 1-D bulk reduce-add, every dense tile
#                               (bwd_profile --dq-fragments), alone and with the above
#   sm90_bwd.DQ_WRITER_WARP     deterministic: turns and dQ adds by a warp of their own (FA4's); part 2
#                               A/B (bwd_profile --dq-writer), tests -k dq_writer in part 1
#   d192/dv128 pingpong         sustained.py, ws against ws:pingpong=1 (v25: causal 0.975x FA4's time
#                               with it, 0.998x without; non-causal not measured at 128x128)
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-1}

if [ "$part" = 1 ]; then
    python scripts/gpu_tier.py --out /tmp/pending-tier --archive "$OUT/tier.tar.gz" --procs 15 --budget 420 \
        --stall 120 --chunked -k "wide or dq_scale or dq_fragments or dq_writer" tests/test_gpu_backward.py > "$OUT/tier.log" 2>&1
    tail -2 "$OUT/tier.log"
    grep -h "^FAILED" /tmp/pending-tier/report*.txt | head -20
    # The d256 kernel: bf16 B4 N4096 hidden 2048 (H8), the backward preset's d256 cells
    # (FA4 / cuDNN anchors, peers.md: 361 / 335 TFLOP/s), causal or not, deterministic or not.
    for args in "" "--causal" "--deterministic" "--causal --deterministic"; do
        timeout 60 python scripts/bwd_profile.py --d 256 --heads 8 --versions 2 --wide $args 2>&1 | grep -A4 TFLOP
    done | tee "$OUT/wide.txt"
    # DeepSeek's (192, 128) natively, both masks; and (160, 160) on the d256 kernel's padded copies.
    for args in "--d 192 --dv 128" "--d 192 --dv 128 --causal" "--d 160"; do
        timeout 60 python scripts/bwd_profile.py $args --heads 16 --versions 2 --wide 2>&1 | grep TFLOP
    done | tee -a "$OUT/wide.txt"
    exit 0
fi

# Backward, bf16 B4 N4096 hidden 2048, the default tiles (d128 80, causal 64; d64 128): dQ as now,
# in fragment order, scaled at the cast, both; the default again last (drift).
for cfg in "--d 128 --heads 16" "--d 128 --heads 16 --causal" "--d 64 --heads 32" \
           "--d 128 --heads 16 --deterministic"; do
    for pair in "off off" "on off" "off on" "on on" "off off"; do
        set -- $pair
        timeout 60 python scripts/bwd_profile.py $cfg --versions 2 --dq-fragments $1 --dq-at-cast $2 \
            2>&1 | grep TFLOP | sed "s/\$/  (fragments $1, at cast $2)/"
    done
done | tee "$OUT/dq_switches.txt"

# Deterministic: the dQ writer warp off / on / off, d128 (rotated walk), d128 causal, d64 causal.
for cfg in "--d 128 --heads 16" "--d 128 --heads 16 --causal" "--d 64 --heads 32 --causal"; do
    for w in off on off; do
        timeout 60 python scripts/bwd_profile.py $cfg --versions 2 --deterministic --dq-writer $w \
            2>&1 | grep TFLOP | sed "s/\$/  (writer $w)/"
    done
done | tee "$OUT/dq_writer.txt"

python scripts/sustained.py --backends fa4 ws ws:pingpong=1 --headdim 192 --headdim-v 128 --seqlen 4096 \
    --batch 4 --heads 16 --causal both --dtype bf16 --passes 2 --seconds 0.6 --settle 0.3 2>&1 \
    | grep -v Warning | tee "$OUT/d192-pingpong.txt" | grep "mean ms"
