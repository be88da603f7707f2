# GPU checks of switches built without a GPU, in device calls of under 10 minutes. On the GPU
# machine, from the project root:
#
#     source .gpu/activate.sh && OUT=$OUT bash scripts/gpu_pending.sh 13
#
# Logs go under $OUT (default /tmp/pending). Parts that have run are removed once their results
# are committed: parts 1-4 (session 28, bench/results/2026-11-27-h100-v28) are in git history at
# da8f994; parts 5-7 (session 29, bench/results/2026-11-28-h100-v29) and 8-11 (session 30,
# bench/results/2026-11-28-h200-v30) at 96436f8, part 12 (session 31, SHARED_STARTS, measured
# slower and removed: bench/results/2026-11-28-h200-v31) at cb14a0c, e.g.
# `git show 96436f8:scripts/gpu_pending.sh`. Each results README names its files' parts.
#   13 sm90_bwd.DQ_CHAINS (session 31, run in session 31's second call): its GPU tests, then an A/B of
#      the deterministic backward at k = 1, 2, 3 (d256, d128, d128 causal, d64; B4 N4096), the plain one
#   14 DQ_CHAINS on at (256, 256), k = 2 (session 31): the wide kernel's deterministic tests, an A/B of
#      d256 causal, then the backward preset (both run in session 31)
#   15 DQ_WRITER_WARPS = 2 (then sm90_bwd_ws's, since a8a4ce1 sm90_bwd's) (session 31, the experiment): its GPU tests, then an A/B of the
#      deterministic backward with 1 and 2 writer warps (d256, d128, d128 causal, d256 causal) (run in
#      session 31: 64 passed, +6-14%)
#   16 DQ_WRITER_WARPS = 2 before it is turned on (session 31, not yet run): on this machine's copy of
#      the tree (sed), the deterministic backward tests (~1165, of every kernel: dense, varlen, wide,
#      fragments, rotated, chains) and the backward preset
#   17 sm90_bwd.DQ_WRITER_PLAIN_WIDE (session 31, not yet run): the writer warp without deterministic
#      mode in the wide kernel: its GPU tests, then an A/B of d256 and d192/dv128 (plain and causal)
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-16}

if [ "$part" = 13 ]; then
    python scripts/gpu_tier.py --out /tmp/pending-tier13 --archive "$OUT/tier13.tar.gz" --procs 15 --budget 240 \
        --stall 120 --chunked -k "dq_chains" tests/test_gpu_backward.py > "$OUT/tier13.log" 2>&1
    tail -1 "$OUT/tier13.log"
    grep -h "^FAILED" /tmp/pending-tier13/report*.txt | head -10
    if grep -q "'failures': 0, 'hung': 0" <(tail -1 "$OUT/tier13.log"); then
        for args in "--d 256 --heads 8 --wide" "--d 128 --heads 16" "--d 128 --heads 16 --causal" "--d 64 --heads 32"; do
            timeout 60 python scripts/bwd_profile.py $args --versions 2 2>&1 | grep TFLOP | sed "s/\$/  (plain)/"
            ks="1 2 1 2"
            [ "$args" = "--d 256 --heads 8 --wide" ] && ks="1 2 3 1 2 3"
            for k in $ks; do
                timeout 60 python scripts/bwd_profile.py $args --versions 2 --deterministic --dq-chains $k \
                    2>&1 | grep TFLOP | sed "s/\$/  (deterministic, dq chains $k)/"
            done
        done | tee "$OUT/dq_chains.txt"
    fi
    exit 0
fi

if [ "$part" = 14 ]; then
    python scripts/gpu_tier.py --out /tmp/pending-tier14 --archive "$OUT/tier14.tar.gz" --procs 15 --budget 150 \
        --stall 100 --chunked -k "wide and (deterministic or rotated)" tests/test_gpu_backward.py > "$OUT/tier14.log" 2>&1
    tail -1 "$OUT/tier14.log"
    grep -h "^FAILED" /tmp/pending-tier14/report*.txt | head -10
    if grep -q "'failures': 0, 'hung': 0" <(tail -1 "$OUT/tier14.log"); then
        args="--d 256 --heads 8 --wide --causal"
        timeout 60 python scripts/bwd_profile.py $args --versions 2 2>&1 | grep TFLOP | sed "s/\$/  (plain)/"
        for k in 1 2 1 2; do
            timeout 60 python scripts/bwd_profile.py $args --versions 2 --deterministic --dq-chains $k \
                2>&1 | grep TFLOP | sed "s/\$/  (deterministic, dq chains $k)/"
        done | tee "$OUT/dq_chains_causal.txt"
        python -m hopper_fmha bench --preset backward --dtype float16 bfloat16 --out "$OUT/bwd14" > "$OUT/bwd14.log" 2>&1
        tail -3 "$OUT/bwd14.log"
    fi
    exit 0
fi

if [ "$part" = 15 ]; then
    python scripts/gpu_tier.py --out /tmp/pending-tier15 --archive "$OUT/tier15.tar.gz" --procs 15 --budget 150 \
        --stall 100 --chunked -k "writer_warps" tests/test_gpu_backward.py > "$OUT/tier15.log" 2>&1
    tail -1 "$OUT/tier15.log"
    grep -h "^FAILED" /tmp/pending-tier15/report*.txt | head -10
    if grep -q "'failures': 0, 'hung': 0" <(tail -1 "$OUT/tier15.log"); then
        for args in "--d 256 --heads 8 --wide" "--d 128 --heads 16" "--d 128 --heads 16 --causal" "--d 256 --heads 8 --wide --causal"; do
            timeout 60 python scripts/bwd_profile.py $args --versions 2 2>&1 | grep TFLOP | sed "s/\$/  (plain)/"
            for w in 1 2 1 2; do
                timeout 60 python scripts/bwd_profile.py $args --versions 2 --deterministic --writer-warps $w \
                    2>&1 | grep TFLOP | sed "s/\$/  (deterministic, writer warps $w)/"
            done
        done | tee "$OUT/writer_warps.txt"
    fi
    exit 0
fi

if [ "$part" = 16 ]; then
    sed -i 's/^DQ_WRITER_WARPS = 1$/DQ_WRITER_WARPS = 2/' src/hopper_fmha/kernels/sm90_bwd.py
    grep -n "^DQ_WRITER_WARPS" src/hopper_fmha/kernels/sm90_bwd.py
    python scripts/gpu_tier.py --out /tmp/pending-tier16 --archive "$OUT/tier16.tar.gz" --procs 15 --budget 200 \
        --stall 120 --chunked -k "deterministic or dq_writer or writer_warps or dq_chains or rotated" \
        tests/test_gpu_backward.py tests/test_gpu_combine.py > "$OUT/tier16.log" 2>&1
    tail -1 "$OUT/tier16.log"
    grep -h "^FAILED" /tmp/pending-tier16/report*.txt | head -10
    if grep -q "'failures': 0, 'hung': 0" <(tail -1 "$OUT/tier16.log"); then
        timeout 280 python -m hopper_fmha bench --preset backward --dtype float16 bfloat16 --out "$OUT/bwd16" \
            > "$OUT/bwd16.log" 2>&1
        echo "backward rc=$?"; grep -h "auto\(+det\)\?\` | \(bwd\|fwd+bwd\)" "$OUT"/bwd16/*.md
    fi
    exit 0
fi

if [ "$part" = 17 ]; then
    python scripts/gpu_tier.py --out /tmp/pending-tier17 --archive "$OUT/tier17.tar.gz" --procs 15 --budget 150 \
        --stall 100 --chunked -k "wide_writer_plain" tests/test_gpu_backward.py > "$OUT/tier17.log" 2>&1
    tail -1 "$OUT/tier17.log"
    grep -h "^FAILED" /tmp/pending-tier17/report*.txt | head -10
    if grep -q "'failures': 0, 'hung': 0" <(tail -1 "$OUT/tier17.log"); then
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
