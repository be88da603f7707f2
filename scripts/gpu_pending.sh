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
#   9  ncu of the backward, ours against FA4: d128 non-causal and causal, d256 plain and
#      deterministic (ours); each kernel's details page and its SASS source page (xz)
#   10 sm90_bwd_ws.EXP_AFTER_MASK: an A/B (bwd_profile, off/on twice), the backward tier's masked
#      and varlen tests, the backward preset (bf16)
#   11 the paper preset in bf16 by the steady method (v28 ran 9 of its 12 cells before a timeout;
#      this covers the 3 missing ones, on whatever card comes)
#   12 sm90_bwd_ws.SHARED_STARTS (session 30, not yet run): its GPU tests, then an A/B of the
#      deterministic d256 backward (B4 N4096: 64 query blocks, 86 key blocks), the plain kernel for scale
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-12}

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

if [ "$part" = 9 ]; then
    # Session 30: where the backward's cycles go now (the writer warp at tile 80), against FA4.
    cat > /tmp/fa4_bwd.py <<'PY'
import sys, torch
from flash_attn.cute import flash_attn_func
d, heads, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "causal"
torch.manual_seed(0)
q, k, v = (torch.randn(4, 4096, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = flash_attn_func(q, k, v, causal=causal)
out = out[0] if isinstance(out, tuple) else out
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
PY
    prof() {  # name, kernel regex, command...
        local name=$1 regex=$2; shift 2
        timeout 150 ncu --clock-control none --kernel-name "regex:$regex" --launch-count 1 --set full \
            --import-source no -o "/tmp/ncu-$name" "$@" > "/tmp/ncu-$name.log" 2>&1
        echo "$name rc=$?"
        ncu -i "/tmp/ncu-$name.ncu-rep" --page details > "$OUT/ncu-$name-details.txt" 2>&1
        ncu -i "/tmp/ncu-$name.ncu-rep" --page source --csv --print-source sass > "/tmp/ncu-$name.csv" 2>&1
        xz -9 -c "/tmp/ncu-$name.csv" > "/tmp/ncu-src-$name.csv.xz"
    }
    prof ours128 BwdWsSm90 python scripts/bwd_profile.py --d 128 --heads 16 --dtype bfloat16 --ncu
    prof fa4128 FlashAttentionBackwardSm90 python /tmp/fa4_bwd.py 128 16 plain
    prof ours128c BwdWsSm90 python scripts/bwd_profile.py --d 128 --heads 16 --dtype bfloat16 --causal --ncu
    prof fa4128c FlashAttentionBackwardSm90 python /tmp/fa4_bwd.py 128 16 causal
    prof ours256det BwdWideSm90 python scripts/bwd_profile.py --d 256 --heads 8 --dtype bfloat16 --wide --deterministic --ncu
    prof ours256 BwdWideSm90 python scripts/bwd_profile.py --d 256 --heads 8 --dtype bfloat16 --wide --ncu
    tar cf "$OUT/ncu-src.tar" -C /tmp $(cd /tmp && ls ncu-src-*.csv.xz)
    tar czf "$OUT/ncu-details.tar.gz" -C "$OUT" $(cd "$OUT" && ls ncu-*-details.txt) && rm "$OUT"/ncu-*-details.txt
    grep -h "Duration\|Elapsed Cycles\|Executed Ipc E\|Registers Per" /tmp/ncu-*.log | head -0
    for f in /tmp/ncu-*.ncu-rep; do echo "$f"; ncu -i "$f" --page details 2>/dev/null | grep -m4 "Elapsed Cycles\|Duration\|Executed Ipc Elapsed\|Compute (SM) Throughput"; done
    exit 0
fi

if [ "$part" = 10 ]; then
    # Session 30: P's exponentials after the mask's branch (sm90_bwd_ws.EXP_AFTER_MASK).
    for args in "--d 128 --heads 16" "--d 128 --heads 16 --causal" "--d 64 --heads 32" "--d 64 --heads 32 --causal"; do
        for flag in False True False True; do
            timeout 60 python -c "
import runpy, sys
import hopper_fmha.kernels.sm90_bwd_ws as w
w.EXP_AFTER_MASK = $flag
sys.argv = ['bwd_profile.py'] + '$args --versions 2'.split()
runpy.run_path('scripts/bwd_profile.py', run_name='__main__')
" 2>&1 | grep TFLOP | sed "s/\$/  (exp after mask $flag)/"
        done
    done | tee "$OUT/exp_after_mask.txt"
    python scripts/gpu_tier.py --out /tmp/pending-tier10 --archive "$OUT/tier10.tar.gz" --procs 15 --budget 170 \
        --stall 100 --chunked -k "window or causal or varlen_backward or test_backward_matches_reference" \
        tests/test_gpu_backward.py > "$OUT/tier10.log" 2>&1
    tail -1 "$OUT/tier10.log"
    grep -h "^FAILED" /tmp/pending-tier10/report*.txt | head -10
    timeout 170 python -m hopper_fmha bench --preset backward --dtype bfloat16 --out "$OUT/bwd10" > "$OUT/bwd10.log" 2>&1
    echo "backward rc=$?"; grep -h "auto\` | \(bwd\|fwd+bwd\)" "$OUT"/bwd10/*.md
    tar czf "$OUT/presets10.tar.gz" -C "$OUT" bwd10 && rm -rf "$OUT/bwd10"
    exit 0
fi

if [ "$part" = 11 ]; then
    timeout 300 python -m hopper_fmha bench --preset paper --dtype bfloat16 --backends hopper-fmha:auto sdpa-cudnn fa4 \
        --steady-ms 300 --block-ms 1000 --rounds 2 --iters 24 --out "$OUT/paper11" > "$OUT/paper11.log" 2>&1
    echo "paper rc=$?"; grep "TFLOP" "$OUT/paper11.log"; grep -h "auto\` |" "$OUT"/paper11/*.md
    exit 0
fi

if [ "$part" = 12 ]; then
    python scripts/gpu_tier.py --out /tmp/pending-tier12 --archive "$OUT/tier12.tar.gz" --procs 15 --budget 200 \
        --stall 120 --chunked -k "shared_starts" tests/test_gpu_backward.py > "$OUT/tier12.log" 2>&1
    tail -1 "$OUT/tier12.log"
    grep -h "^FAILED" /tmp/pending-tier12/report*.txt | head -10
    if grep -q "'failures': 0, 'hung': 0" <(tail -1 "$OUT/tier12.log"); then
        for args in "--d 256 --heads 8 --wide"; do  # (bwd_profile's q and k share a length: d128 never has C < num_n)
            timeout 60 python scripts/bwd_profile.py $args --versions 2 2>&1 | grep TFLOP | sed "s/\$/  (plain)/"
            for r in off on off on; do
                timeout 60 python scripts/bwd_profile.py $args --versions 2 --deterministic --shared-starts $r \
                    2>&1 | grep TFLOP | sed "s/\$/  (deterministic, shared starts $r)/"
            done
        done | tee "$OUT/shared_starts.txt"
    fi
    exit 0
fi
