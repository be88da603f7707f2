# GPU checks of switches built without a GPU, in device calls of under 10 minutes. On the GPU
# machine, from the project root:
#
#     source .gpu/activate.sh && OUT=$OUT bash scripts/gpu_pending.sh 8
#
# Logs go under $OUT (default /tmp/pending). Parts 1-4 ran in session 28 (bench/results/
# 2026-11-27-h100-v28; in git history at da8f994); parts 5-7 in session 29
# (bench/results/2026-11-28-h100-v29, whose README names each file's part):
#   5  tests and A/Bs of sm90_bwd.VARLEN_DQ_GATHER, sm90_bwd.WIDE_ROTATE and the 64-row decode tile
#      with features / at (192, 128)
#   6  the backward and backward-features presets
#   7  the writer warp without deterministic mode (sm90_bwd.DQ_WRITER_PLAIN): tests, A/B, a preset
#      probe; scripts/decode_tile_ab.py
#   8  owed: the GPU tiers twice with the backward disk cache (the second run loads from disk), the
#      backward preset with DQ_WRITER_PLAIN at tile 80
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-8}

if [ "$part" = 5 ]; then
    python scripts/gpu_tier.py --out /tmp/pending-tier5 --archive "$OUT/tier5.tar.gz" --procs 15 --budget 300 \
        --stall 120 --chunked -k "dq_gather or rotated_walk or features_and_192" tests/test_gpu_backward.py \
        tests/test_gpu_kvcache.py > "$OUT/tier5.log" 2>&1
    tail -2 "$OUT/tier5.log"
    grep -h "^FAILED" /tmp/pending-tier5/report*.txt | head -20
    for flag in False True False; do
        timeout 150 python scripts/trace_calls.py --preset backward-features --words "varlen24 bwd" \
            --backends hopper-fmha:auto --set hopper_fmha.kernels.sm90_bwd.VARLEN_DQ_GATHER=$flag 2>&1 \
            | grep -v Warning
    done | tee "$OUT/dq_gather_ab.txt" | grep "eager ms\|VARLEN"
    for args in "--d 256 --heads 8" "--d 192 --dv 128 --heads 16"; do
        for r in off on off; do
            timeout 90 python scripts/bwd_profile.py $args --versions 2 --wide --deterministic --wide-rotate $r \
                2>&1 | grep TFLOP | sed "s/\$/  (wide rotate $r)/"
        done
    done | tee "$OUT/wide_rotate.txt"
    exit 0
fi

if [ "$part" = 6 ]; then
    # Session 29: the backward presets with VARLEN_DQ_GATHER and WIDE_ROTATE on.
    timeout 280 python -m hopper_fmha bench --preset backward --dtype float16 bfloat16 --out "$OUT/bwd" > "$OUT/bwd.log" 2>&1
    echo "backward rc=$?"; grep -h "auto\` | \(bwd\|fwd+bwd\)" "$OUT"/bwd/*.md
    timeout 280 python -m hopper_fmha bench --preset backward-features --out "$OUT/bwdf" > "$OUT/bwdf.log" 2>&1
    echo "backward-features rc=$?"; grep -h "auto\` | \(bwd\|fwd+bwd\)" "$OUT"/bwdf/*.md
    tar czf "$OUT/presets6.tar.gz" -C "$OUT" bwd bwdf && rm -rf "$OUT/bwd" "$OUT/bwdf"
    exit 0
fi

if [ "$part" = 7 ]; then
    # Session 29: the writer warp without deterministic mode (sm90_bwd.DQ_WRITER_PLAIN), alone and
    # with dQ in fragment order: its tests, an A/B (bwd_profile), the backward preset (fp16) with
    # both on at every tile; the 64-row decode tile with features / at 192/128 (decode_tile_ab.py).
    python scripts/gpu_tier.py --out /tmp/pending-tier7 --archive "$OUT/tier7.tar.gz" --procs 15 --budget 150 \
        --stall 100 --chunked -k "writer_plain" tests/test_gpu_backward.py > "$OUT/tier7.log" 2>&1
    tail -2 "$OUT/tier7.log"
    grep -h "^FAILED" /tmp/pending-tier7/report*.txt | head -20
    # (writer, fragments): the default first (fragments on at d64's tile 128 only)
    d128=("off off" "on on" "on off" "off off" "on on")
    d64=("off on" "on on" "off on" "on on")
    for args in "--d 128 --heads 16" "--d 128 --heads 16 --causal" "--d 64 --heads 32" "--d 64 --heads 32 --causal"; do
        if [ "${args:4:2}" = 64 ]; then runs=("${d64[@]}"); else runs=("${d128[@]}"); fi
        for r in "${runs[@]}"; do
            set -- $r
            timeout 60 python scripts/bwd_profile.py $args --versions 2 --dq-writer-plain $1 --dq-fragments $2 \
                2>&1 | grep TFLOP | sed "s/\$/  (writer $1, fragments $2)/"
        done
    done | tee "$OUT/writer_plain.txt"
    timeout 180 python -c "
import sys
from hopper_fmha.kernels import sm90_bwd
sm90_bwd.DQ_WRITER_PLAIN = True
sm90_bwd.DQ_FRAGMENTS = True
from hopper_fmha.cli import main
sys.exit(main(['bench', '--preset', 'backward', '--dtype', 'float16', '--out', '$OUT/bwd7', '--tag', 'writer-fragments']))
" > "$OUT/bwd7.log" 2>&1
    echo "backward (writer + fragments) rc=$?"; grep -h "auto\` | \(bwd\|fwd+bwd\)" "$OUT"/bwd7/*.md
    timeout 100 python scripts/decode_tile_ab.py --rounds 4 2>&1 | tee "$OUT/decode_tile_ab.txt" | grep "ms\|Error"
    tar czf "$OUT/presets7.tar.gz" -C "$OUT" bwd7 && rm -rf "$OUT/bwd7"
    exit 0
fi

if [ "$part" = 8 ]; then
    # Owed by session 29: the backward's disk cache (kernels loaded back from disk in the second
    # run of each tier: HOPPER_FMHA_CACHE_DIR kept between them) and the backward preset with
    # DQ_WRITER_PLAIN at tile 80 on.
    export HOPPER_FMHA_CACHE_DIR=/tmp/pending-kernel-cache HOPPER_FMHA_DISK_CACHE_ALL=1
    for run in 1 2; do
        python scripts/gpu_tier.py --out /tmp/pending-tier8-$run --archive "$OUT/tier8-$run.tar.gz" --procs 15 \
            --budget 150 --stall 100 --chunked -k "dq_writer or varlen_backward or test_backward_matches_reference" \
            tests/test_gpu_backward.py tests/test_gpu_combine.py > "$OUT/tier8-$run.log" 2>&1
        tail -1 "$OUT/tier8-$run.log"
        grep -h "^FAILED" /tmp/pending-tier8-$run/report*.txt | head -10
        ls "$HOPPER_FMHA_CACHE_DIR"/*/ | grep -c "^bwd_\|^combine_\|^dq_gather_\|^bwd_pre_"
    done
    timeout 280 python -m hopper_fmha bench --preset backward --dtype float16 bfloat16 --out "$OUT/bwd8" > "$OUT/bwd8.log" 2>&1
    echo "backward rc=$?"; grep -h "auto\` | \(bwd\|fwd+bwd\)" "$OUT"/bwd8/*.md
    tar czf "$OUT/presets8.tar.gz" -C "$OUT" bwd8 && rm -rf "$OUT/bwd8"
    exit 0
fi
