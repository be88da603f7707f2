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
# bench/results/2026-12-06-h100-v37) in the commit that adds that folder, e.g. `git show ed51f72:scripts/gpu_pending.sh`.
# Each results README names its files' parts.
#   31 the whole of tests/test_gpu_backward.py with v37's defaults (DQ_LAPS, LPT_HEADS = 4,
#      VARLEN_DQ_FRAGMENTS, DQ_CHAINS_MASKED, DQ_STORE_FIRST_MASKED on; v36 ran 1737 of its
#      tests; v37 the 84 of `-k dq_chains2_masked`, the 1060 of `-k "dq_laps or lpt or row_order
#      or varlen or sink or (determin and (256 or causal or window))"` before DQ_STORE_FIRST_MASKED
#      and the 588 of `-k "(determin and (causal or window)) or dq_chains or writer_warps"` with
#      it), in three shards of every third test:
#      `gpu_pending.sh 31 0 1 2` runs the shards named, each on GPU (shard + 1) % GPUs at once where
#      a machine has several (x4: GPUs 1, 2, 3, ~6 min), one after another on one GPU (~6 min each:
#      one shard per call)
#      Session 38 ran shards 0 and 1 (0 failed; 3 of shard 1 not reached; bench/results/2026-12-06-h100-v38): `gpu_pending.sh
#      31 2` is left.
#   33 the backward and backward-features presets with v37's switches (DQ_CHAINS_MASKED,
#      DQ_STORE_FIRST_MASKED; v37 measured them on an H100 only; v36's H200 presets predate them),
#      meant for an H200 (~5 min)
#   34 where the d256 backward's bytes go (NOTES "Next", backward 7: ours 371-374 TFLOP/s on the
#      H200 but 300-326 on the H100, cuDNN 346-386 on both): one bf16 B4 N4096 H8 d256 forward and
#      backward each of ours, cuDNN (SDPA) and FA4 under ncu, every kernel, with DRAM and L2 bytes,
#      throughputs and time (`$OUT/ncu34.csv`, summed per backend by the lines printed). Run it on
#      an H100 and on an H200 (~2 min each).
#   35 `sm90_bwd.PLAIN_ROTATE` (session 38, built, off): its 34 GPU tests (`-k plain_rotated`), then
#      `bwd_profile --ab plain-rotate=off plain-rotate=on` (bf16 B4 N4096, one process, rotating
#      rounds) at d256 H8, d128 H16 and d64 H32, non-causal (~4 min); on an H100 and an H200.
#   36 `sm90_bwd.QDO_MULTICAST` (session 39, built, off): its 86 GPU tests (`-k qdo_multicast`), then
#      `bwd_profile --ab multicast=off multicast=on` (bf16 B4 N4096, one process, rotating rounds)
#      at d256 H8, d128 H16 and d64 H32, non-causal, and d256 at N 8192 (an odd count of key
#      blocks: 171) (~5 min).
#   37 `sm90_bwd.DQ_PAIR_SUM` (session 39, built, off): the 172 `-k qdo_multicast` GPU tests (pairs,
#      and pairs summing dQ), then `bwd_profile --ab multicast=off pair-dq=on multicast=on` at d256
#      H8, d128 H16 (N 4096) and d256 H4 N 8192 (~5 min).
# The forward's no-regression set is `scripts/sweep_set.sh` (about 30 minutes on one GPU; two calls on four).
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"
part=${1:-31}

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

if [ "$part" = 35 ]; then
    HOPPER_FMHA_CACHE_DIR=/tmp/kc35 python scripts/gpu_tier.py tests/test_gpu_backward.py -k plain_rotated \
        --out /tmp/tier35 --archive "$OUT/tier35.tar.gz" --procs 15 --budget 150 --stall 90 > "$OUT/tier35.log" 2>&1
    tail -1 "$OUT/tier35.log"; grep -h "^FAILED" /tmp/tier35/report*.txt | head -10
    for dh in 256:8 128:16 64:32; do
        python scripts/bwd_profile.py --d "${dh%%:*}" --heads "${dh##*:}" --dtype bfloat16 --rounds 8 \
            --ab plain-rotate=off plain-rotate=on 2>&1 | grep " v2 \[" | tee -a "$OUT/ab35.txt"
    done
    exit 0
fi

if [ "$part" = 36 ]; then
    HOPPER_FMHA_CACHE_DIR=/tmp/kc36 python scripts/gpu_tier.py tests/test_gpu_backward.py -k qdo_multicast \
        --out /tmp/tier36 --archive "$OUT/tier36.tar.gz" --procs 15 --budget 200 --stall 90 > "$OUT/tier36.log" 2>&1
    tail -1 "$OUT/tier36.log"; grep -h "^FAILED" /tmp/tier36/report*.txt | head -10
    for dhn in 256:8:4096 128:16:4096 64:32:4096 256:4:8192; do
        IFS=: read -r d h n <<< "$dhn"
        python scripts/bwd_profile.py --d "$d" --heads "$h" --seqlen "$n" --dtype bfloat16 --rounds 8 \
            --ab multicast=off multicast=on 2>&1 | grep " v2 \[" | tee -a "$OUT/ab36.txt"
    done
    exit 0
fi

if [ "$part" = 37 ]; then
    HOPPER_FMHA_CACHE_DIR=/tmp/kc37 python scripts/gpu_tier.py tests/test_gpu_backward.py -k qdo_multicast \
        --out /tmp/tier37 --archive "$OUT/tier37.tar.gz" --procs 15 --budget 240 --stall 90 > "$OUT/tier37.log" 2>&1
    tail -1 "$OUT/tier37.log"; grep -h "^FAILED" /tmp/tier37/report*.txt | head -10
    for dhn in 256:8:4096 128:16:4096 256:4:8192; do
        IFS=: read -r d h n <<< "$dhn"
        python scripts/bwd_profile.py --d "$d" --heads "$h" --seqlen "$n" --dtype bfloat16 --rounds 8 \
            --ab multicast=off pair-dq=on multicast=on 2>&1 | grep " v2 \[" | tee -a "$OUT/ab37.txt"
    done
    exit 0
fi

if [ "$part" = 31 ]; then
    shift
    gpus=$(nvidia-smi -L | wc -l)
    python -m pytest --collect-only -q tests/test_gpu_backward.py 2>/dev/null | grep "::" > /tmp/ids.txt
    for shard in "${@:-0}"; do
        awk -v s="$shard" 'NR % 3 == s' /tmp/ids.txt > "/tmp/ids$shard.txt"
        run="CUDA_VISIBLE_DEVICES=$(( (shard + 1) % gpus )) HOPPER_FMHA_CACHE_DIR=/tmp/kc$shard python scripts/gpu_tier.py \
            --out /tmp/tier$shard --archive $OUT/tier$shard.tar.gz --procs 15 --budget 400 --stall 120 --chunked \
            --ids /tmp/ids$shard.txt > $OUT/tier$shard.log 2>&1"
        if [ "$gpus" -gt 1 ]; then (eval "$run") & else eval "$run"; fi
    done
    wait
    for shard in "${@:-0}"; do tail -1 "$OUT/tier$shard.log"; grep -h "^FAILED" /tmp/tier$shard/report*.txt | head -10; done
    exit 0
fi

echo "no pending part $part"
