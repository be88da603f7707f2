# GPU checks of switches built without a GPU, in device calls of under 10 minutes. On the GPU
# machine, from the project root:
#
#     source .gpu/activate.sh && OUT=$OUT bash scripts/gpu_pending.sh 16
#
# Logs go under $OUT (default /tmp/pending). Parts that have run are removed once their results
# are committed: parts 1-4 (session 28, bench/results/2026-11-27-h100-v28) are in git history at
# da8f994; parts 5-7 (session 29, bench/results/2026-11-28-h100-v29) and 8-11 (session 30,
# bench/results/2026-11-28-h200-v30) at 96436f8; part 12 at cb14a0c and parts 13-15 at 5da15f4
# (session 31, bench/results/2026-11-28-h200-v31), parts 16-17 at 609635e and part 18 in
# the commit that added parts 19-20 (session 32, bench/results/2026-11-28-h200-v32), parts 19-23
# (session 33, bench/results/2026-11-28-h200-v33) at f2b28ef, e.g.
# `git show f2b28ef:scripts/gpu_pending.sh`.
# Each results README names its files' parts.
#   24 sm90_bwd_ws.EXP_EARLY (session 33, not yet run): the dense kernels' tests (d64 and d128, not
#      wide: masks, windows, varlen, tiles 64/80/128; 1606 collected, as many as 110 s allow) with
#      it at "quarter" and at "none" (sed), ~5 min
#   25 its A/B, `bwd_profile.py --ab` (one process, rotating rounds): d64, d64 causal, d128, d128
#      causal at all / half / quarter / none
# The forward's no-regression set is `scripts/sweep_set.sh` (about 30 minutes on one GPU).
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-24}

tier() {  # name, budget (s), -k expression, test files...: true when nothing failed or hung
    local name=$1 budget=$2 expr=$3
    shift 3
    python scripts/gpu_tier.py --out "/tmp/pending-$name" --archive "$OUT/$name.tar.gz" --procs 15 \
        --budget "$budget" --stall 120 --chunked -k "$expr" "$@" > "$OUT/$name.log" 2>&1
    tail -1 "$OUT/$name.log"
    grep -h "^FAILED" /tmp/pending-"$name"/report*.txt | head -10
    grep -q "'failures': 0, 'hung': 0" <(tail -1 "$OUT/$name.log")
}

if [ "$part" = 24 ]; then
    src=src/hopper_fmha/kernels/sm90_bwd_ws.py
    for early in quarter none; do
        sed -i "s/^EXP_EARLY = .*/EXP_EARLY = \"$early\"/" $src
        grep -n "^EXP_EARLY =" $src
        tier "tier24-$early" 110 "not wide and not softcap and not writer and (matches_reference or query_tile \
or varlen_backward or dq_fragments or score_features)" \
            tests/test_gpu_backward.py
    done
    sed -i 's/^EXP_EARLY = .*/EXP_EARLY = "all"/' $src
    exit 0
fi

if [ "$part" = 25 ]; then
    for args in "--d 64 --heads 32" "--d 64 --heads 32 --causal" "--d 128 --heads 16" \
        "--d 128 --heads 16 --causal"; do
        timeout 140 python scripts/bwd_profile.py $args --rounds 8 \
            --ab exp-early=all exp-early=half exp-early=quarter exp-early=none 2>&1 | grep TFLOP
    done | tee "$OUT/exp_early.txt"
    exit 0
fi

echo "no pending part $part"
