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
# (session 33, bench/results/2026-11-28-h200-v33) at f2b28ef, parts 24-25 (session 34,
# bench/results/2026-11-28-h200-v34) at c9208e4, e.g.
# `git show f2b28ef:scripts/gpu_pending.sh`.
# Each results README names its files' parts.
# The forward's no-regression set is `scripts/sweep_set.sh` (about 30 minutes on one GPU; two calls on four).
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-26}

tier() {  # name, budget (s), -k expression, test files...: true when nothing failed or hung
    local name=$1 budget=$2 expr=$3
    shift 3
    python scripts/gpu_tier.py --out "/tmp/pending-$name" --archive "$OUT/$name.tar.gz" --procs 15 \
        --budget "$budget" --stall 120 --chunked -k "$expr" "$@" > "$OUT/$name.log" 2>&1
    tail -1 "$OUT/$name.log"
    grep -h "^FAILED" /tmp/pending-"$name"/report*.txt | head -10
    grep -q "'failures': 0, 'hung': 0" <(tail -1 "$OUT/$name.log")
}

echo "no pending part $part"
