# GPU checks of switches built without a GPU, in device calls of under 10 minutes. On the GPU
# machine, from the project root:
#
#     source .gpu/activate.sh && OUT=$OUT bash scripts/gpu_pending.sh 16
#
# Logs go under $OUT (default /tmp/pending). Parts that have run are removed once their results
# are committed: parts 1-4 (session 28, bench/results/2026-11-27-h100-v28) are in git history at
# da8f994; parts 5-7 (session 29, bench/results/2026-11-28-h100-v29) and 8-11 (session 30,
# bench/results/2026-11-28-h200-v30) at 96436f8; part 12 at cb14a0c and parts 13-15 at 5da15f4
# (session 31, bench/results/2026-11-28-h200-v31), e.g. `git show 5da15f4:scripts/gpu_pending.sh`.
# Each results README names its files' parts.
#   16 sm90_bwd.DQ_WRITER_WARPS = 2 before it is turned on (session 31, not yet run): on this
#      machine's copy of the tree (sed), the deterministic backward tests (~1165, of every kernel:
#      dense, varlen, wide, fragments, rotated, chains) and the backward preset
#   17 sm90_bwd.DQ_WRITER_PLAIN_WIDE (session 31, not yet run): the writer warp without
#      deterministic mode in the wide kernel: its GPU tests, then an A/B of d256 and d192/dv128
#      (plain and causal)
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-16}

tier() {  # name, budget (s), -k expression, test files...: true when nothing failed or hung
    local name=$1 budget=$2 expr=$3
    shift 3
    python scripts/gpu_tier.py --out "/tmp/pending-$name" --archive "$OUT/$name.tar.gz" --procs 15 \
        --budget "$budget" --stall 120 --chunked -k "$expr" "$@" > "$OUT/$name.log" 2>&1
    tail -1 "$OUT/$name.log"
    grep -h "^FAILED" /tmp/pending-"$name"/report*.txt | head -10
    grep -q "'failures': 0, 'hung': 0" <(tail -1 "$OUT/$name.log")
}

if [ "$part" = 16 ]; then
    sed -i 's/^DQ_WRITER_WARPS = 1$/DQ_WRITER_WARPS = 2/' src/hopper_fmha/kernels/sm90_bwd.py
    grep -n "^DQ_WRITER_WARPS" src/hopper_fmha/kernels/sm90_bwd.py
    if tier tier16 200 "deterministic or dq_writer or writer_warps or dq_chains or rotated" \
        tests/test_gpu_backward.py tests/test_gpu_combine.py; then
        timeout 280 python -m hopper_fmha bench --preset backward --dtype float16 bfloat16 --out "$OUT/bwd16" \
            > "$OUT/bwd16.log" 2>&1
        echo "backward rc=$?"; grep -h "auto\(+det\)\?\` | \(bwd\|fwd+bwd\)" "$OUT"/bwd16/*.md
    fi
    exit 0
fi

if [ "$part" = 17 ]; then
    if tier tier17 150 "wide_writer_plain" tests/test_gpu_backward.py; then
        for args in "--d 256 --heads 8" "--d 256 --heads 8 --causal" "--d 192 --dv 128 --heads 16" \
            "--d 192 --dv 128 --heads 16 --causal"; do
            for r in off on off on; do
                timeout 60 python scripts/bwd_profile.py $args --wide --versions 2 --dq-writer-plain-wide $r \
                    2>&1 | grep TFLOP | sed "s/\$/  (writer plain wide $r)/"
            done
        done | tee "$OUT/writer_plain_wide.txt"
    fi
    exit 0
fi
