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
# the commit that added parts 19-20 (session 32, bench/results/2026-11-28-h200-v32), e.g.
# `git show 609635e:scripts/gpu_pending.sh`.
# Each results README names its files' parts.
#   19 sm90_bwd_ws.D_LOAD (session 32, not yet run): the d128 backward tests with D read before the
#      dP^T GEMM and before the S^T GEMM (sed), then an A/B of d128 and d128 causal at the three
#      places (both new places spill: 120 B of stack at tile 80, 40 B at tile 64, against 40 / 0);
#      D_LOAD_TIERS="" runs only the A/B, D_LOAD_TIERS=before_s only that place's tests
#   20 the backward preset with the code as it is (session 32 ran it before `LSE_LOAD`) and with
#      `sm90_bwd.CAST_COPIES` on (sed; the chains' sum cast in its last addition, session 32, not
#      yet run on a GPU), after the deterministic wide tests with it on
#   21 sm90_bwd_ws.LSE_REGISTERS_BY_ROWS (session 32, not yet run; no spill): d64's backward tests
#      with it on (sed), then an A/B of d64 and d64 causal (tile 128)
#   22 sm90_bwd_ws.DQ_STORE_FIRST (session 32, not yet run): the deterministic tests with it on
#      (sed), then an A/B of deterministic d128, d64 and d256
#   23 sm90_ws.SOFTCAP_IN_Q (session 32, not yet run; the forward): the softcap tests of the
#      forward's tiers with it on (sed), then the features preset with it on and off (its
#      "softcap ÷ plain" rows: softcap's cost)
# The forward's no-regression set is `scripts/sweep_set.sh` (about 30 minutes on one GPU).
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-19}

tier() {  # name, budget (s), -k expression, test files...: true when nothing failed or hung
    local name=$1 budget=$2 expr=$3
    shift 3
    python scripts/gpu_tier.py --out "/tmp/pending-$name" --archive "$OUT/$name.tar.gz" --procs 15 \
        --budget "$budget" --stall 120 --chunked -k "$expr" "$@" > "$OUT/$name.log" 2>&1
    tail -1 "$OUT/$name.log"
    grep -h "^FAILED" /tmp/pending-"$name"/report*.txt | head -10
    grep -q "'failures': 0, 'hung': 0" <(tail -1 "$OUT/$name.log")
}

if [ "$part" = 19 ]; then
    src=src/hopper_fmha/kernels/sm90_bwd_ws.py
    for place in ${D_LOAD_TIERS-before_dp before_s}; do
        sed -i "s/^D_LOAD = .*/D_LOAD = \"$place\"/" $src
        grep -n "^D_LOAD" $src
        tier "tier19-$place" 90 \
            "not wide and (matches_reference or query_tile_80 or varlen_backward or deterministic_is_bitwise or dq_writer_plain)" \
            tests/test_gpu_backward.py
    done
    sed -i 's/^D_LOAD = .*/D_LOAD = "after_exp"/' $src
    for args in "--d 128 --heads 16" "--d 128 --heads 16 --causal"; do
        for place in after_exp before_dp before_s after_exp before_dp before_s; do
            timeout 60 python scripts/bwd_profile.py $args --versions 2 --d-load $place \
                2>&1 | grep TFLOP | sed "s/\$/  (d $place)/"
        done
    done | tee "$OUT/d_load.txt"
    exit 0
fi

if [ "$part" = 20 ]; then
    sed -i 's/^CAST_COPIES = False$/CAST_COPIES = True/' src/hopper_fmha/kernels/sm90_bwd.py
    grep -n "^CAST_COPIES" src/hopper_fmha/kernels/sm90_bwd.py
    if tier tier20 100 "wide and (deterministic or rotated or writer_layout)" tests/test_gpu_backward.py; then
        timeout 300 python -m hopper_fmha bench --preset backward --dtype float16 bfloat16 --out "$OUT/bwd20" \
            > "$OUT/bwd20.log" 2>&1
        echo "backward rc=$?"; grep -h "auto\(+det\)\?\` | \(bwd\|fwd+bwd\)" "$OUT"/bwd20/*.md
    fi
    exit 0
fi

if [ "$part" = 21 ]; then
    src=src/hopper_fmha/kernels/sm90_bwd_ws.py
    sed -i 's/^LSE_REGISTERS_BY_ROWS = .*/LSE_REGISTERS_BY_ROWS = True/' $src
    grep -n "^LSE_REGISTERS_BY_ROWS" $src
    if tier tier21 90 \
        "not wide and (query_tile_128 or dq_fragments or (matches_reference and 64) or (varlen_backward and 64))" \
        tests/test_gpu_backward.py; then
        sed -i 's/^LSE_REGISTERS_BY_ROWS = .*/LSE_REGISTERS_BY_ROWS = False/' $src
        for args in "--d 64 --heads 32" "--d 64 --heads 32 --causal"; do
            for r in off on off on off on; do
                timeout 60 python scripts/bwd_profile.py $args --versions 2 --lse-registers-by-rows $r \
                    2>&1 | grep TFLOP | sed "s/\$/  (lse registers $r)/"
            done
        done | tee "$OUT/lse_registers_by_rows.txt"
    fi
    exit 0
fi

if [ "$part" = 22 ]; then
    src=src/hopper_fmha/kernels/sm90_bwd_ws.py
    sed -i 's/^DQ_STORE_FIRST = .*/DQ_STORE_FIRST = True/' $src
    grep -n "^DQ_STORE_FIRST" $src
    if tier tier22 150 "deterministic or writer_layout or rotated" tests/test_gpu_backward.py; then
        sed -i 's/^DQ_STORE_FIRST = .*/DQ_STORE_FIRST = False/' $src
        for args in "--d 128 --heads 16" "--d 64 --heads 32" "--d 256 --heads 8 --wide"; do
            for r in off on off on; do
                timeout 60 python scripts/bwd_profile.py $args --versions 2 --deterministic --dq-store-first $r \
                    2>&1 | grep TFLOP | sed "s/\$/  (store first $r)/"
            done
        done | tee "$OUT/dq_store_first.txt"
    fi
    exit 0
fi

if [ "$part" = 23 ]; then
    src=src/hopper_fmha/kernels/sm90_ws.py
    sed -i 's/^SOFTCAP_IN_Q = .*/SOFTCAP_IN_Q = True/' $src
    grep -n "^SOFTCAP_IN_Q" $src
    if tier tier23 120 softcap tests/test_gpu_ws_features.py tests/test_gpu_varlen.py tests/test_gpu_kvcache.py \
        tests/test_gpu_head_dims.py; then
        for r in True False; do
            sed -i "s/^SOFTCAP_IN_Q = .*/SOFTCAP_IN_Q = $r/" $src
            timeout 200 python -m hopper_fmha bench --preset features --out "$OUT/features23-$r" \
                > "$OUT/features23-$r.log" 2>&1
            echo "softcap in q $r: rc=$?"; grep -h -i "softcap" "$OUT/features23-$r"/*.md | grep "auto" | head -6
        done
    fi
    exit 0
fi

echo "no pending part $part"
