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
# bench/results/2026-11-28-h200-v35) at ed51f72, e.g. `git show ed51f72:scripts/gpu_pending.sh`.
# Each results README names its files' parts.
#   28 session 35's test edits, DQ_LAPS and LPT_HEADS (built, off): all of tests/test_gpu_backward.py
#      (GPU tests now seed torch per test id; dsink's 1000x128 bf16 case is open; the new
#      `dq_laps` and `lpt_order` tests) in three shards on GPUs 0, 2, 3 (~6-7 min); on GPU 1
#      `bwd_profile --ab`: dq-laps off/on at d256 deterministic (and the plain rate beside it),
#      lpt-heads 0/4/8 at d128 and d64 causal (~5 min). x4 machine.
#   29 for what 28 shows wins: the backward preset (fp16, bf16) with DQ_LAPS on and LPT_HEADS at
#      ${LPT:-4} (sed on a copy; LPT=0 or LAPS=False leaves one off), ~4 min; VARLEN_DQ_FRAGMENTS
#      is measured by part 30's A/B and `--preset backward-features`
#   30 `bwd_profile --ab`: lpt-heads 0/4 at d256 causal; varlen-dq-fragments off/on at d128 varlen
#      (24 sequences), causal, and d64 (~5 min; beside part 29 on another GPU)
# The forward's no-regression set is `scripts/sweep_set.sh` (about 30 minutes on one GPU; two calls on four).
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-28}

if [ "$part" = 28 ]; then
    python -m pytest --collect-only -q tests/test_gpu_backward.py 2>/dev/null | grep "::" > /tmp/ids.txt
    for g in 0 2 3; do
        awk -v g=$g 'NR % 3 == (g == 0 ? 0 : g - 1)' /tmp/ids.txt > /tmp/ids$g.txt
        (CUDA_VISIBLE_DEVICES=$g HOPPER_FMHA_CACHE_DIR=/tmp/kc$g python scripts/gpu_tier.py --out /tmp/tier$g \
            --archive "$OUT/tier$g.tar.gz" --procs 15 --budget 420 --stall 120 --chunked --ids /tmp/ids$g.txt \
            > "$OUT/tier$g.log" 2>&1) &
    done
    (export CUDA_VISIBLE_DEVICES=1 HOPPER_FMHA_CACHE_DIR=/tmp/kc1
     P="timeout 150 python scripts/bwd_profile.py --rounds 8"
     $P --d 256 --heads 8 --wide --deterministic --ab dq-laps=off dq-laps=on
     $P --d 256 --heads 8 --wide --ab dq-laps=off
     $P --d 128 --heads 16 --causal --ab lpt-heads=0 lpt-heads=4 lpt-heads=8
     $P --d 64 --heads 32 --causal --ab lpt-heads=0 lpt-heads=4 lpt-heads=8
    ) 2>&1 | grep TFLOP > "$OUT/ab28.txt" &
    wait
    for g in 0 2 3; do tail -1 "$OUT/tier$g.log"; grep -h "^FAILED" /tmp/tier$g/report*.txt | head -10; done
    cat "$OUT/ab28.txt"
    exit 0
fi

if [ "$part" = 30 ]; then  # one GPU, or beside part 29 on another (CUDA_VISIBLE_DEVICES)
    P="timeout 150 python scripts/bwd_profile.py --rounds 8"
    ($P --d 256 --heads 8 --wide --causal --ab lpt-heads=0 lpt-heads=4
     $P --d 128 --heads 16 --varlen 24 --ab varlen-dq-fragments=off varlen-dq-fragments=on
     $P --d 128 --heads 16 --varlen 24 --causal --ab varlen-dq-fragments=off varlen-dq-fragments=on
     $P --d 64 --heads 32 --varlen 24 --ab varlen-dq-fragments=off varlen-dq-fragments=on
    ) 2>&1 | grep TFLOP | tee "$OUT/ab30.txt"
    exit 0
fi

if [ "$part" = 29 ]; then
    rm -rf /tmp/t29 && mkdir -p /tmp/t29 && git ls-files -z | xargs -0 cp --parents -t /tmp/t29
    sed -i -e "s/^DQ_LAPS = .*/DQ_LAPS = ${LAPS:-True}/" -e "s/^LPT_HEADS = .*/LPT_HEADS = ${LPT:-4}/" \
        /tmp/t29/src/hopper_fmha/kernels/sm90_bwd_ws.py
    grep -n "^DQ_LAPS\|^LPT_HEADS" /tmp/t29/src/hopper_fmha/kernels/sm90_bwd_ws.py
    (cd /tmp/t29 && PYTHONPATH=/tmp/t29/src:${PYTHONPATH#*:} python -m hopper_fmha bench --preset backward \
        --dtype float16 bfloat16 --out "$OUT/bwd29" > "$OUT/bwd29.log" 2>&1)
    grep -A10 "## Summary" "$OUT"/bwd29/*.md | head -12
    exit 0
fi

echo "no pending part $part"
