source .gpu/activate.sh
cd _head
python -c "import sys; sys.path.insert(0, 'src'); from hopper_fmha.bench.runner import source_digest; print('sources', source_digest())"
timeout 560 python -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py -k "test_ws_q_release or lazy_rescale or public_api or strided or grid_limits or requiring_grad or returned_lse" > $OUT/gpu-tier-rest.log 2>&1; echo "pytest rc $?"
tail -2 $OUT/gpu-tier-rest.log; grep -E "^FAILED|^ERROR" $OUT/gpu-tier-rest.log | head -20
