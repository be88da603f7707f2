source .gpu/activate.sh
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
python -c "import torch, cutlass; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cutlass-dsl', cutlass.__version__)"
python -c "from hopper_fmha.bench.runner import source_digest; print('sources', source_digest())"
timeout 570 python -m pytest -m gpu -q -p no:cacheprovider > $OUT/gpu-tier.log 2>&1; echo "pytest rc $?"
grep -E "passed|failed" $OUT/gpu-tier.log | tail -3; grep -E "^FAILED|^ERROR" $OUT/gpu-tier.log | head -20
