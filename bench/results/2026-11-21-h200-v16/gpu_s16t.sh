# Session 16: the full GPU tier on the current code, then precompile the bench kernels.
source .gpu/activate.sh
export HOPPER_FMHA_CACHE_DIR=/tmp/kc
date -u +%H:%M:%S; git log --oneline -1
nvidia-smi --query-gpu=name,driver_version,power.limit,temperature.gpu --format=csv,noheader
python -c "import hopper_fmha.bench.runner as r; print('sources', r.source_digest())"
timeout 420 python -m pytest -m gpu -q -p no:cacheprovider > $OUT/tier.txt 2>&1; echo "tier rc=$?"
tail -5 $OUT/tier.txt; date -u +%H:%M:%S
timeout 100 python .scratch/pre_rs.py 14 > $OUT/precompile.txt 2>&1; tail -1 $OUT/precompile.txt; date -u +%H:%M:%S
