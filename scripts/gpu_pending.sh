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
#   26 sm90_bwd.DQ_UNFRAGMENT_KERNEL (session 34, not yet run): its tests (the kernel against
#      torch's un-permute, the backward with it), then `bwd_profile --ab` at d64, d64 causal (off /
#      on) and d128 causal (default / fragments + writer + kernel at tile 64), ~6 min
#   27 if 26 wins: the backward preset (fp16, bf16) with the kernel on, DQ_FRAGMENTS at tiles 64
#      and 128 and DQ_WRITER_PLAIN at 64 and 80 (sed on a copy of the tree), ~4 min
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

if [ "$part" = 26 ]; then
    tier tier26 150 "unfragment" tests/test_gpu_backward.py
    for args in "--d 64 --heads 32" "--d 64 --heads 32 --causal"; do
        timeout 120 python scripts/bwd_profile.py $args --rounds 8 --ab dq-unfragment=off dq-unfragment=on \
            2>&1 | grep TFLOP
    done | tee "$OUT/unfragment.txt"
    timeout 150 python scripts/bwd_profile.py --d 128 --heads 16 --causal --rounds 8 --ab dq-unfragment=off \
        dq-fragments=on,dq-writer-plain=on,dq-unfragment=on dq-fragments=on,dq-unfragment=on 2>&1 \
        | grep TFLOP | tee -a "$OUT/unfragment.txt"
    exit 0
fi

if [ "$part" = 27 ]; then
    rm -rf /tmp/t27 && mkdir -p /tmp/t27 && git ls-files -z | xargs -0 cp --parents -t /tmp/t27
    src=/tmp/t27/src/hopper_fmha/kernels/sm90_bwd.py
    sed -i -e 's/^DQ_UNFRAGMENT_KERNEL = .*/DQ_UNFRAGMENT_KERNEL = True/' \
        -e 's/^DQ_FRAGMENTS = .*/DQ_FRAGMENTS = (64, 128)/' \
        -e 's/^DQ_WRITER_PLAIN: tuple\[int, ...\] | bool = .*/DQ_WRITER_PLAIN: tuple[int, ...] | bool = (64, 80)/' $src
    grep -n "^DQ_UNFRAGMENT_KERNEL\|^DQ_FRAGMENTS\|^DQ_WRITER_PLAIN" $src
    (cd /tmp/t27 && PYTHONPATH=/tmp/t27/src:${PYTHONPATH#*:} python -m hopper_fmha bench --preset backward \
        --dtype float16 bfloat16 --out "$OUT/bwd27" > "$OUT/bwd27.log" 2>&1)
    grep -A8 "## Summary" "$OUT"/bwd27/*.md | head -10
    exit 0
fi

echo "no pending part $part"
