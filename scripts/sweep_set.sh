# The forward's no-regression set (issue "varlen" must-show 4, the v16 method): the paper preset
# and the sweep at N >= 2048 (60 cells), each cell ours against cuDNN and FA4 in the same bench
# run, 300 ms steady state and 1 s timing blocks, two rounds. On a machine of several GPUs the
# runs go in queues, one per GPU, which run at the same time; a "/" starts the next GPU's queue.
# On the GPU machine, from the project root (each call under 10 minutes; a run takes 3-6):
#
#     source .gpu/activate.sh && OUT=$OUT bash scripts/sweep_set.sh paper / d64 d64c     # 2 GPUs
#     source .gpu/activate.sh && OUT=$OUT bash scripts/sweep_set.sh d128 d128c / d256 d256c
#
# Runs: paper, or dD[c] (head dim D, c = causal) over N = 2048 4096 8192 16384 (NS overrides).
# Each GPU's runs write under $OUT/gpuI (JSON, Markdown; each GPU its own kernel cache); then
# `python scripts/issue_set.py $OUT/gpu*/*.json` (here, after fetching) gives the set's numbers.
OUT=${OUT:-/tmp/sweep}
NS=${NS:-2048 4096 8192 16384}
FLAGS="--backends hopper-fmha:auto sdpa-cudnn fa4 --steady-ms 300 --block-ms 1000 --rounds 2 --iters 24 --no-plot"

queue() {  # gpu index, runs...
    local gpu=$1
    shift
    local out="$OUT/gpu$gpu"
    mkdir -p "$out"
    for run in "$@"; do
        if [ "$run" = paper ]; then
            args=(--preset paper --dtype fp16 bf16 --tag block)
        else
            d=${run#d}
            d=${d%c}
            causal=()
            [ "${run%c}" != "$run" ] && causal=(--causal)
            # shellcheck disable=SC2086
            args=(--seqlen $NS --headdim "$d" "${causal[@]}" --dtype fp16 bf16 --tag "block-$run")
        fi
        # shellcheck disable=SC2086
        CUDA_VISIBLE_DEVICES=$gpu HOPPER_FMHA_CACHE_DIR=/tmp/kc$gpu \
            python -m hopper_fmha bench "${args[@]}" $FLAGS --out "$out" > "$out/$run.log" 2>&1
        echo "gpu $gpu $run rc=$?"
    done
}

nvidia-smi --query-gpu=index,name,power.limit,temperature.gpu --format=csv,noheader
gpu=0
runs=()
pids=()
for arg in "$@" /; do
    if [ "$arg" = / ]; then
        if [ ${#runs[@]} -gt 0 ]; then
            queue "$gpu" "${runs[@]}" &
            pids+=($!)
        fi
        gpu=$((gpu + 1))
        runs=()
    else
        runs+=("$arg")
    fi
done
wait "${pids[@]}"
grep -h "auto\` | " "$OUT"/gpu*/*.md
