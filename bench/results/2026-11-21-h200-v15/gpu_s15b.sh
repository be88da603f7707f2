# Session 15: --block-ms 1000 (blocks timed over >= 1 s of GPU time), the paper shape fp16 at
# d = 64/128/256, non-causal and causal, each run twice: does the same cell repeat closer than
# with short timed blocks (the settled runs moved one cell up to 2.5% between two runs)?
source .gpu/activate.sh
export HOPPER_FMHA_CACHE_DIR=/tmp/kc
rm -rf /tmp/s; mkdir -p /tmp/s
date -u +%H:%M:%S
timeout 60 python .scratch/pre_rs.py 14 > $OUT/precompile.txt 2>&1; tail -1 $OUT/precompile.txt
nvidia-smi --query-gpu=name,driver_version,power.limit,temperature.gpu --format=csv,noheader
for rep in 1 2; do for C in "" "--causal"; do
  timeout 135 python -m hopper_fmha bench --seqlen 4096 --headdim 64 128 256 $C --dtype fp16 --backends hopper-fmha:auto sdpa-cudnn fa4 --steady-ms 300 --block-ms 1000 --rounds 2 --iters 24 --archive --no-plot --tag block-r$rep$C --out /tmp/s >> $OUT/bench.log 2>&1
  echo "rep $rep $C rc=$?"; date -u +%H:%M:%S
done; done
cp /tmp/s/*.tar.gz $OUT/
grep -h "auto\` | " /tmp/s/*.md
