# Session 16: compute-sanitizer memcheck and racecheck on HEAD, one call set per head dim
# (VARIANTS="paper" or "ws"; PLAIN=1 first runs the script without the sanitizer, compiling the kernels).
source .gpu/activate.sh
export HOPPER_FMHA_CACHE_DIR=/tmp/kc
date -u +%H:%M:%S; git log --oneline -1 | cut -c1-60
python -c "import hopper_fmha.bench.runner as r; print('sources', r.source_digest())"
if [ "$PLAIN" = 1 ]; then timeout 330 python scripts/sanitize.py > $OUT/sanitize-plain.log 2>&1; echo "plain rc=$?"; date -u +%H:%M:%S; fi
for v in $VARIANTS; do for t in memcheck racecheck; do
  timeout 130 compute-sanitizer --tool $t python scripts/sanitize.py $v > $OUT/sanitize-$v-$t.log 2>&1; echo "$v $t rc=$? $(tail -1 $OUT/sanitize-$v-$t.log)"; date -u +%H:%M:%S
done; done
