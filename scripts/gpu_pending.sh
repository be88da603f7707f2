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
# bench/results/2026-11-28-h200-v35) at ed51f72, 28-30 (session 36) at b3033b5, 32 (session 37,
# bench/results/2026-12-06-h100-v37) in the commit that adds that folder, 31 and 34-36 (sessions 38-39,
# bench/results/2026-12-06-h100-v38 and -v39) at a2c18af, 40-42 at 0cd2c3a, 43 (session 41,
# bench/results/2026-12-07-h100-v41) at 1c35ee0, 44 at ad64cb9, 45-47 (session 42,
# bench/results/2026-12-07-h100-v42) at 8563f37, 48 (session 43,
# bench/results/2026-12-07-h100-v43) in the commit that adds that folder, e.g. `git show ed51f72:scripts/gpu_pending.sh`.
# Each results README names its files' parts.
#   33 the backward and backward-features presets (bf16 and fp16; backward-features bf16), meant
#      for an H200: v36's H200 presets predate v37's switches and v41's d256 tile; ran on an H100 in
#      session 42, where backward-features was cut at 42 of 72 records (~5 min for the backward
#      preset, ~4 for backward-features: give it a call of its own)
#   34 (ran on an H100 in session 39, back for an H200) where the d256 backward's bytes go: one
#      bf16 B4 N4096 H8 d256 forward and backward each of ours, cuDNN (SDPA) and FA4 under ncu,
#      every kernel's DRAM and L2 bytes, throughputs and time; the H100's is
#      bench/results/2026-12-06-h100-v39/ncu_l2.txt (~2 min)
#   49 tests/test_gpu_backward.py but the ids with 256 or 192 (v42 ran those 970), in three shards
#      (`gpu_pending.sh 49 0`, `... 49 1`, `... 49 2`, ~150-200 s each; on several GPUs, all at
#      once); session 43 ran them on an H100 (3 x 1058 passed): again after a kernel change
#   50 (session 43, built, off: no device time was left) deterministic dQ's chain copies summed by
#      `dq_unfragment` and only the blocks without a turn zeroed (`sm90_bwd.DQ_COPIES_IN_UNFRAGMENT`,
#      `DQ_ZERO_BY_BLOCK`): the backward's time per kernel with both on (`bwd_breakdown.py`, d256
#      causal, plain and deterministic), the A/B off / on at d256 causal and not, then, with both on
#      (a pytest plugin), the tests they touch: unfragment, d256's deterministic, bitwise (~5 min).
#      If on wins and the tests pass: turn both on, then the backward preset (part 33)
#   51 (session 43) `EXP_EARLY` "half" at d128's tiles 80 and 64 too: on an H100 (v43) "half" beat
#      "all" (their default since v34, chosen on an H200) in six d128 cells by 1.2-2.8%. The A/B on
#      an H200 (d128 bf16 / fp16, causal and not, 8 rounds), then the d128 tests of the backward tier
#      with `EXP_EARLY_BY_TILE` = "half" at every tile (a pytest plugin; what a 200 s budget reaches).
#      If it wins on the H200 too and the tests pass: change `EXP_EARLY_BY_TILE`, run the d128 tests
# The forward's no-regression set is `scripts/sweep_set.sh` (about 30 minutes on one GPU; two calls on four).
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-50}

if [ "$part" = 33 ]; then
    python -m hopper_fmha bench --preset backward --dtype bfloat16 float16 --out "$OUT/bench" > "$OUT/bench33.log" 2>&1
    python -m hopper_fmha bench --preset backward-features --dtype bfloat16 --out "$OUT/bench" > "$OUT/features33.log" 2>&1
    grep -h -A8 "^## Summary" "$OUT"/bench/*.md
    exit 0
fi

if [ "$part" = 34 ]; then
    cat > /tmp/bwd34.py <<'PY'
import sys, torch
backend = sys.argv[1]
torch.manual_seed(0)
q, k, v = (torch.randn(4, 4096, 8, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
if backend == "ours":
    from hopper_fmha import flash_attn_func
    out = flash_attn_func(q, k, v)
elif backend == "fa4":
    from flash_attn.cute import flash_attn_func
    out = flash_attn_func(q, k, v)
    out = out[0] if isinstance(out, tuple) else out
else:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
PY
    metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum
    metrics=$metrics,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed
    for b in ours cudnn fa4; do
        python /tmp/bwd34.py $b > /dev/null 2>&1  # compile outside the profile
        timeout 200 ncu --clock-control none --metrics "$metrics" --csv python /tmp/bwd34.py $b \
            > "$OUT/ncu34-$b.csv" 2> "$OUT/ncu34-$b.log"
        echo "$b rc=$?"
        python - "$OUT/ncu34-$b.csv" <<'PY'
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, rows = rows[0], rows[1:]
col = {n: i for i, n in enumerate(head)}
for r in rows:  # one line per kernel and metric
    if r[col["Metric Name"]].endswith((".sum", "elapsed")):
        print(f"{r[col['Kernel Name']][:60]:60s} {r[col['Metric Name']]:70s} {r[col['Metric Unit']]:8s} {r[col['Metric Value']]}")
PY
    done
    exit 0
fi

if [ "$part" = 51 ]; then
    for dims in "--d 128 --heads 16" "--d 128 --heads 16 --causal" "--d 128 --heads 16 --dtype float16" \
        "--d 128 --heads 16 --causal --dtype float16"; do
        timeout 60 python scripts/bwd_profile.py $dims --versions 2 --rounds 8 \
            --ab exp-early=all exp-early=half 2>&1 | grep -v Warning | tee -a "$OUT/ab51.txt"
    done
    mkdir -p /tmp/pp
    printf 'import hopper_fmha.kernels.sm90_bwd_ws as W\nW.EXP_EARLY_BY_TILE = {128: "half", 80: "half", 64: "half"}\n' \
        > /tmp/pp/half51.py
    PYTHONPATH=/tmp/pp:$PYTHONPATH PYTEST_PLUGINS=half51 python scripts/gpu_tier.py --out /tmp/tier51 \
        --archive "$OUT/tier51.tar.gz" --procs 15 --budget "${BUDGET:-200}" -k "128 and not wide and not 256" \
        tests/test_gpu_backward.py | tail -3
    exit 0
fi

if [ "$part" = 50 ]; then
    both=copies-in-unfragment=on,zero-by-block=on
    python scripts/bwd_breakdown.py --d 256 --heads 8 --causal --set $both 2>&1 | grep -v Warn | tee -a "$OUT/breakdown50.txt"
    for c in --causal ""; do
        timeout 90 python scripts/bwd_profile.py --d 256 --heads 8 $c --deterministic --versions 2 --rounds 8 \
            --ab copies-in-unfragment=off,zero-by-block=off copies-in-unfragment=on,zero-by-block=on \
            2>&1 | grep -v Warning | tee -a "$OUT/ab50.txt"
    done
    mkdir -p /tmp/pp
    printf 'import hopper_fmha.kernels.sm90_bwd as B\nB.DQ_COPIES_IN_UNFRAGMENT = B.DQ_ZERO_BY_BLOCK = True\n' > /tmp/pp/fused50.py
    k="unfragment or (d256 and (wide_dq_fragments or dq_laps or writer_layout or rotated_walk)) or bitwise or store_first"
    PYTHONPATH=/tmp/pp:$PYTHONPATH PYTEST_PLUGINS=fused50 python scripts/gpu_tier.py --out /tmp/tier50 \
        --archive "$OUT/tier50.tar.gz" --procs 15 --budget "${BUDGET:-170}" -k "$k" tests/test_gpu_backward.py | tail -3
    grep -h "^FAILED" /tmp/tier50/report*.txt | head -10
    exit 0
fi

if [ "$part" = 49 ]; then
    shift
    gpus=$(nvidia-smi -L | wc -l)
    python -m pytest --collect-only -q tests/test_gpu_backward.py 2>/dev/null | grep "::" \
        | grep -v "256\|192" > /tmp/ids.txt
    for shard in "${@:-0}"; do
        awk -v s="$shard" 'NR % 3 == s' /tmp/ids.txt > "/tmp/ids$shard.txt"
        run="CUDA_VISIBLE_DEVICES=$(( shard % gpus )) HOPPER_FMHA_CACHE_DIR=/tmp/kc$shard python scripts/gpu_tier.py \
            --out /tmp/tier$shard --archive $OUT/tier$shard.tar.gz --procs 15 --budget 400 --stall 120 --chunked \
            --ids /tmp/ids$shard.txt > $OUT/tier$shard.log 2>&1"
        if [ "$gpus" -gt 1 ]; then (eval "$run") & else eval "$run"; fi
    done
    wait
    for shard in "${@:-0}"; do tail -1 "$OUT/tier$shard.log"; grep -h "^FAILED" /tmp/tier$shard/report*.txt | head -10; done
    exit 0
fi

echo "no pending part $part"
