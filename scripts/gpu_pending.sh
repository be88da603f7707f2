# The GPU checks owed by session 28's changes and its questions, in device calls of under 10
# minutes. On the GPU machine, from the project root:
#
#     source .gpu/activate.sh && OUT=$OUT bash scripts/gpu_pending.sh 1
#
# Logs go under $OUT (default /tmp/pending). Parts 1-4 ran in session 28 (bench/results/
# 2026-11-27-h100-v28); part 5 is owed: sm90_bwd.VARLEN_DQ_GATHER and sm90_bwd.WIDE_ROTATE (built
# without a GPU), their tests, the KV-cache tests with a window, softcap and (192, 128) (at the
# table's tile and at 64 rows: kernels.DECODE_TILE_FEATURES / DECODE_TILE_DIMS), the A/B of the first on the backward-features preset's varlen cells
# and of the second on the wide kernel's deterministic d256 and d192/dv128 (bwd_profile).
#   d192/dv128 causal pingpong  config.WS_CAUSAL_SWITCHES[(192, 128)]: tests -k 192v128 (both masks,
#                               and the varlen 192/128 test)
#   decode                      sustained.py over the decode preset's dense q1, B1 (split-KV) and
#                               q4 causal cells: K/V stages, tile_n 64, pingpong, the tile counter,
#                               one CTA per tile, against FA4 and cuDNN
#   varlen backward             trace_calls.py: eager ms per call, kernels and GPU idle per call,
#                               ours and FA4's, on the backward-features preset's varlen cells
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-1}

if [ "$part" = 1 ]; then
    python scripts/gpu_tier.py --out /tmp/pending-tier --archive "$OUT/tier.tar.gz" --procs 12 --budget 150 \
        --stall 120 -k "192v128 or varlen_192" tests/test_gpu_head_dims.py > "$OUT/tier.log" 2>&1
    tail -2 "$OUT/tier.log"
    grep -h "^FAILED" /tmp/pending-tier/report*.txt | head -20
    cells=("=decode B64 L8192 H32/8 d128 bf16 q1" "B1" "q4 causal")
    kv=(kv:num_stages=3 kv:tile_n=64,num_stages=4 kv:tile_n=64,num_stages=5 kv:pingpong=0 kv:tile_counter=0
        kv:schedule=single)
    # Compile every variant first, three processes at once (the disk cache keeps them), untimed.
    for cell in "${cells[@]}"; do
        python scripts/sustained.py --preset decode "$cell" --backends "${kv[@]}" --no-check --passes 1 \
            --seconds 0.01 --settle 0 --preheat 0 > /dev/null 2>&1 &
    done
    wait
    python scripts/sustained.py --preset decode "${cells[@]}" \
        --backends hopper-fmha:auto "${kv[@]}" fa4 sdpa-cudnn --passes 2 --seconds 0.5 --settle 0.2 \
        --preheat 0.5 2>&1 | tee "$OUT/decode.txt" | grep "mean ms"
    timeout 200 python scripts/trace_calls.py --preset backward-features --words "varlen24 bwd" \
        --backends hopper-fmha:auto fa4 2>&1 | tee "$OUT/varlen_bwd_trace.txt"
    exit 0
fi

if [ "$part" = 2 ]; then
    # Tests of the combine's dependent launch (every split), the varlen counter's skip_to.
    python scripts/gpu_tier.py --out /tmp/pending-tier2 --archive "$OUT/tier2.tar.gz" --procs 14 --budget 240 \
        --stall 120 tests/test_gpu_combine.py tests/test_gpu_kvcache.py tests/test_gpu_varlen.py::test_varlen_tile_counter \
        > "$OUT/tier2.log" 2>&1
    tail -2 "$OUT/tier2.log"
    grep -h "^FAILED" /tmp/pending-tier2/report*.txt | head -20
    cells=("=decode B64 L8192 H32/8 d128 bf16 q1" "B1" "q4 causal")
    kv=(kv:tile_m=64,pingpong=0 kv:tile_m=64,pingpong=0,num_stages=3 kv:tile_m=64,pingpong=0,tile_n=64,num_stages=4)
    for cell in "${cells[@]}"; do
        python scripts/sustained.py --preset decode "$cell" --backends "${kv[@]}" --no-check --passes 1 \
            --seconds 0.01 --settle 0 --preheat 0 > /dev/null 2>&1 &
    done
    wait
    python scripts/sustained.py --preset decode "${cells[@]}" \
        --backends hopper-fmha:auto "${kv[@]}" fa4 sdpa-cudnn --passes 2 --seconds 0.5 --settle 0.2 \
        --preheat 0.5 2>&1 | tee "$OUT/decode2.txt" | grep "mean ms\|WRONG\|error"
    python -m hopper_fmha bench --preset varlen --out "$OUT/varlen" 2>&1 | tail -3
    python -m hopper_fmha bench --preset features --out "$OUT/features" 2>&1 | tail -3
    tar czf "$OUT/presets.tar.gz" -C "$OUT" varlen features && rm -rf "$OUT/varlen" "$OUT/features"
    exit 0
fi

if [ "$part" = 3 ]; then
    # kernels.DECODE_TILE_M (one consumer warpgroup for tiles of <= 64 query rows): every KV-cache
    # and combine test, then the decode preset; the paper preset last, short blocks (a smoke check).
    python scripts/gpu_tier.py --out /tmp/pending-tier3 --archive "$OUT/tier3.tar.gz" --procs 14 --budget 200 \
        --stall 120 tests/test_gpu_combine.py tests/test_gpu_kvcache.py > "$OUT/tier3.log" 2>&1
    tail -2 "$OUT/tier3.log"
    grep -h "^FAILED" /tmp/pending-tier3/report*.txt | head -20
    python -m hopper_fmha bench --preset decode --out "$OUT/decode" 2>&1 | tail -2
    timeout 200 python -m hopper_fmha bench --preset paper --dtype fp16 bf16 --out "$OUT/paper" 2>&1 | tail -2
    tar czf "$OUT/presets3.tar.gz" -C "$OUT" decode paper && rm -rf "$OUT/decode" "$OUT/paper"
    exit 0
fi

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

if [ "$part" = 4 ]; then
    # The paged decode cells (and the dense one) at DECODE_TILE_M against the table's 128-row tile;
    # then the paper preset by the v16 method (README's), as far as 280 s take it.
    python scripts/sustained.py --preset decode "=decode B64 L8192 H32/8 d128 bf16 q1" paged16 paged64 paged256 \
        --backends hopper-fmha:auto kv:tile_m=128,pingpong=1 fa4 --passes 2 --seconds 0.5 --settle 0.2 \
        --preheat 0.5 2>&1 | tee "$OUT/decode_paged.txt" | grep "mean ms\|WRONG\|error"
    F="--backends hopper-fmha:auto sdpa-cudnn fa4 --steady-ms 300 --block-ms 1000 --rounds 2 --iters 24 --no-plot"
    timeout 280 python -m hopper_fmha bench --preset paper --dtype fp16 bf16 $F --out "$OUT/paper" > "$OUT/paper.log" 2>&1
    echo "paper rc=$?"
    grep -h "auto\` | " "$OUT"/paper/*.md
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
