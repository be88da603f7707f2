# Session 15: sustained ms / clock / power / energy, ours vs FA4, at the cells the settled runs put below 1.0.
source .gpu/activate.sh
export HOPPER_FMHA_CACHE_DIR=/tmp/kc
P=$OUT/power-settled-misses.txt
for c in "fp16 4096 256 causal" "bf16 16384 128 nc" "fp16 16384 64 causal-only" "bf16 16384 256 causal-only" "bf16 8192 128 nc"; do set -- $c
  echo "## $1 N=$2 d=$3 $4" >> $P
  if [ $4 = nc ]; then A=; else A=$4; fi
  DT=$1 N=$2 timeout 150 python .scratch/power2.py ours,fa4 $3 $A 2>&1 | grep "^d=\|Error" >> $P
done
cat $P; date -u +%H:%M:%S
