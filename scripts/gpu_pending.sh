# The GPU checks still owed by changes built without a GPU (NOTES.md "v24"), in one device call of
# about 7 minutes: their GPU tests, then each switch measured against the default in the same call.
# On the GPU machine, from the project root:
#
#     source .gpu/activate.sh && bash scripts/gpu_pending.sh
#
# Logs and bench files go under $OUT (default /tmp/pending). Switches measured:
#   sm90_bwd_ws.DKV_TMA_TILES   dK, dV through smem + TMA stores (bwd_profile --dkv-tma)
#   kernels.VARLEN_TILE_COUNTER non-causal varlen tiles from the global counter (--preset varlen)
#   kernels.KVCACHE_TILE_COUNTER likewise for ragged non-causal decode (--preset decode)
set -x
OUT=${OUT:-/tmp/pending}
mkdir -p "$OUT"

python scripts/gpu_tier.py --out /tmp/pending-tier --archive "$OUT/tier.tar.gz" --procs 15 --budget 200 \
    --stall 90 -k "dkv_by_tma or tile_counter" \
    tests/test_gpu_backward.py tests/test_gpu_varlen.py tests/test_gpu_kvcache.py > "$OUT/tier.log" 2>&1
tail -3 "$OUT/tier.log"
grep -h "^FAILED" /tmp/pending-tier/report*.txt | head -10

# Backward, bf16 B4 N4096 hidden 2048: register stores, then TMA stores, each twice.
for run in 1 2; do
    python scripts/bwd_profile.py --d 128 --heads 16 --versions 2 --tile-m 64 80 --dkv-tma 2>&1 | grep TFLOP
    python scripts/bwd_profile.py --d 128 --heads 16 --versions 2 --tile-m 64 80 --dkv-tma 64 80 2>&1 | grep TFLOP
    python scripts/bwd_profile.py --d 64 --heads 32 --versions 2 --tile-m 128 --dkv-tma 2>&1 | grep TFLOP
    python scripts/bwd_profile.py --d 64 --heads 32 --versions 2 --tile-m 128 --dkv-tma 128 2>&1 | grep TFLOP
done | tee "$OUT/dkv_tma.txt"

# Forward varlen and decode: the presets as shipped, then with the tile counter.
bench_with() {  # bench_with FLAG PRESET OUTDIR
    python -c "import sys, hopper_fmha.kernels as k; k.$1 = True; from hopper_fmha.cli import main; \
sys.exit(main(['bench', '--preset', '$2', '--out', '$3']))"
}
python -m hopper_fmha bench --preset varlen --out "$OUT/varlen-plain" > "$OUT/varlen-plain.log" 2>&1
bench_with VARLEN_TILE_COUNTER varlen "$OUT/varlen-counter" > "$OUT/varlen-counter.log" 2>&1
python -m hopper_fmha bench --preset decode --out "$OUT/decode-plain" > "$OUT/decode-plain.log" 2>&1
bench_with KVCACHE_TILE_COUNTER decode "$OUT/decode-counter" > "$OUT/decode-counter.log" 2>&1
grep -h -A6 "^summary" "$OUT"/varlen-*.log "$OUT"/decode-*.log
