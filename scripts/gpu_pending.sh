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
# bench/results/2026-11-28-h200-v34) at c9208e4, parts 26-27 (session 35,
# bench/results/2026-11-28-h200-v35) at ed51f72, 28-30 (session 36) at b3033b5, e.g. `git show ed51f72:scripts/gpu_pending.sh`.
# Each results README names its files' parts.
#   (none pending: parts 28-30 ran in session 36, bench/results/2026-12-06-h200-v36, and are in git
#   history at b3033b5)
# The forward's no-regression set is `scripts/sweep_set.sh` (about 30 minutes on one GPU; two calls on four).
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-31}

echo "no pending part $part"
