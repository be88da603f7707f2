# Session 16: the sweep's problems with --steady-ms 300 --block-ms 1000, one head dim and causality
# per call (D=64|128|256, CAUSAL= or --causal, PRE=1 to precompile first); PAPER=1: the paper preset.
source .gpu/activate.sh
export HOPPER_FMHA_CACHE_DIR=/tmp/kc
rm -rf /tmp/s; mkdir -p /tmp/s
date -u +%H:%M:%S
if [ "$PRE" = 1 ]; then timeout 110 python .scratch/pre_rs.py 14 > $OUT/precompile.txt 2>&1; tail -1 $OUT/precompile.txt; fi
nvidia-smi --query-gpu=name,driver_version,power.limit,temperature.gpu --format=csv,noheader
F="--backends hopper-fmha:auto sdpa-cudnn fa4 --steady-ms 300 --block-ms 1000 --rounds 2 --iters 24 --archive --no-plot --out /tmp/s"
if [ "$PAPER" = 1 ]; then
  timeout 560 python -m hopper_fmha bench --preset paper --dtype fp16 bf16 $F --tag block > $OUT/bench.log 2>&1
else
  timeout 560 python -m hopper_fmha bench --seqlen ${NS:-512 1024 2048 4096 8192 16384} --headdim $D $CAUSAL --dtype fp16 bf16 $F --tag block-d$D$CAUSAL > $OUT/bench.log 2>&1
fi
echo "rc=$?"; date -u +%H:%M:%S
cp /tmp/s/*.tar.gz $OUT/
grep -h "auto\` | " /tmp/s/*.md
