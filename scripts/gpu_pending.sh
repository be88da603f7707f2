# GPU checks of switches built without a GPU, in device calls of under 10 minutes. On the GPU
# machine, from the project root:
#
#     source .gpu/activate.sh && OUT=$OUT bash scripts/gpu_pending.sh 12
#
# Logs go under $OUT (default /tmp/pending). Parts that have run are removed once their results
# are committed: parts 1-4 (session 28, bench/results/2026-11-27-h100-v28) are in git history at
# da8f994; parts 5-7 (session 29, bench/results/2026-11-28-h100-v29) and 8-11 (session 30,
# bench/results/2026-11-28-h200-v30: the disk-cache tiers and backward preset, the ncu of the
# backward against FA4, the EXP_AFTER_MASK A/B, the paper preset in bf16) at 96436f8, e.g.
# `git show 96436f8:scripts/gpu_pending.sh`. Each results README names its files' parts.
#   12 sm90_bwd_ws.SHARED_STARTS (session 30, not yet run): its GPU tests, then an A/B of the
#      deterministic d256 backward (B4 N4096: 64 query blocks, 86 key blocks), the plain kernel for scale
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-12}

if [ "$part" = 12 ]; then
    python scripts/gpu_tier.py --out /tmp/pending-tier12 --archive "$OUT/tier12.tar.gz" --procs 15 --budget 200 \
        --stall 120 --chunked -k "shared_starts" tests/test_gpu_backward.py > "$OUT/tier12.log" 2>&1
    tail -1 "$OUT/tier12.log"
    grep -h "^FAILED" /tmp/pending-tier12/report*.txt | head -10
    if grep -q "'failures': 0, 'hung': 0" <(tail -1 "$OUT/tier12.log"); then
        for args in "--d 256 --heads 8 --wide"; do  # (bwd_profile's q and k share a length: d128 never has C < num_n)
            timeout 60 python scripts/bwd_profile.py $args --versions 2 2>&1 | grep TFLOP | sed "s/\$/  (plain)/"
            for r in off on off on; do
                timeout 60 python scripts/bwd_profile.py $args --versions 2 --deterministic --shared-starts $r \
                    2>&1 | grep TFLOP | sed "s/\$/  (deterministic, shared starts $r)/"
            done
        done | tee "$OUT/shared_starts.txt"
    fi
    exit 0
fi
