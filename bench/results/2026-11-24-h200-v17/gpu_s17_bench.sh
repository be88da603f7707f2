source .gpu/activate.sh
NEW="PYTHONPATH=$PWD/_head/src:$PYTHONPATH"; OLD="PYTHONPATH=$PWD/_old/src:$PYTHONPATH"
env $NEW python -c "from hopper_fmha.bench.runner import source_digest; print('sources', source_digest())"
(cd _head && timeout 110 python -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py -k "returned_lse and paper" > $OUT/lse-tests.log 2>&1; tail -1 $OUT/lse-tests.log; grep -E "^FAILED" $OUT/lse-tests.log | head)
# host path: the 300-call measurement (old and new code) and the bench's profile (new)
env $OLD python _hostcall.py 2>&1 | tee $OUT/host-old.txt
env $NEW python _hostcall.py 2>&1 | tee $OUT/host-new.txt
env $NEW timeout 90 python -m hopper_fmha bench --preset host --profile --backends hopper-fmha:auto sdpa-cudnn fa4 --iters 20 --rounds 2 --no-plot --out $OUT/bench-host > $OUT/bench-host.log 2>&1; tail -2 $OUT/bench-host.log
# the cost of an exact LSE at d64 non-causal (tensor-core row sums vs fp32 sums), settled blocks
env $NEW timeout 100 python -m hopper_fmha bench --seqlen 4096 --headdim 64 --dtype bf16 --backends hopper-fmha:auto hopper-fmha:auto+lse --steady-ms 300 --block-ms 1000 --rounds 2 --iters 24 --no-plot --out $OUT/bench-lse > $OUT/bench-lse.log 2>&1; tail -3 $OUT/bench-lse.log
# the paper kernel's grid along x: d64 short problems (the paper kernel's), old vs new code, against cuDNN
for c in "" "--causal"; do
  env $OLD timeout 50 python -m hopper_fmha bench --seqlen 512 1024 --headdim 64 --dtype bf16 $c --backends hopper-fmha:auto sdpa-cudnn --steady-ms 300 --block-ms 1000 --rounds 2 --iters 24 --no-plot --tag old --out $OUT/bench-paper-old > /dev/null 2>&1
  env $NEW timeout 50 python -m hopper_fmha bench --seqlen 512 1024 --headdim 64 --dtype bf16 $c --backends hopper-fmha:auto sdpa-cudnn --steady-ms 300 --block-ms 1000 --rounds 2 --iters 24 --no-plot --tag new --out $OUT/bench-paper-new > /dev/null 2>&1
done
ls $OUT/bench-paper-old $OUT/bench-paper-new
