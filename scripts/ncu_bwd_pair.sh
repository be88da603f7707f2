# Nsight Compute of one backward call, ours against FA4's, on the GPU machine from the project root:
#
#     source .gpu/activate.sh && OUT=$OUT bash scripts/ncu_bwd_pair.sh 64:32 64:32:causal
#
# Each argument is head_dim:heads[:causal] (bf16, B4 N4096). Per case and backend it writes under
# $OUT the details page (`ncu-<name>-details.txt`, in one tar.gz) and the source page's SASS as
# CSV (xz, in one tar), for `scripts/ncu_sass_summary.py ours.csv fa4.csv` (NOTES.md, backward).
# Session 30's ncu (bench/results/2026-11-28-h200-v30/probes/ncu-bwd-v30.txt) used the same flags.
OUT=${OUT:-/tmp/ncu}
mkdir -p "$OUT"
cat > /tmp/fa4_bwd.py <<'PY'
import sys, torch
from flash_attn.cute import flash_attn_func
d, heads, causal = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "causal"
torch.manual_seed(0)
q, k, v = (torch.randn(4, 4096, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = flash_attn_func(q, k, v, causal=causal)
out = out[0] if isinstance(out, tuple) else out
out.backward(torch.randn_like(out))
torch.cuda.synchronize()
PY
prof() {  # name, kernel regex, command...
    local name=$1 regex=$2; shift 2
    timeout 150 ncu --clock-control none --kernel-name "regex:$regex" --launch-count 1 --set full \
        --import-source no -o "/tmp/ncu-$name" "$@" > "/tmp/ncu-$name.log" 2>&1
    echo "$name rc=$?"
    ncu -i "/tmp/ncu-$name.ncu-rep" --page details > "$OUT/ncu-$name-details.txt" 2>&1
    ncu -i "/tmp/ncu-$name.ncu-rep" --page source --csv --print-source sass > "/tmp/ncu-$name.csv" 2>&1
    xz -9 -c "/tmp/ncu-$name.csv" > "/tmp/ncu-src-$name.csv.xz"
    grep -m4 "Elapsed Cycles\|Duration\|Registers Per\|Executed Ipc Elapsed" "$OUT/ncu-$name-details.txt"
}
for case in "$@"; do
    IFS=: read -r d heads causal <<< "$case"
    name=d$d${causal:+c}
    prof "ours-$name" BwdWsSm90 python scripts/bwd_profile.py --d "$d" --heads "$heads" --dtype bfloat16 \
        ${causal:+--causal} --ncu
    prof "fa4-$name" FlashAttentionBackwardSm90 python /tmp/fa4_bwd.py "$d" "$heads" "${causal:-plain}"
done
tar cf "$OUT/ncu-src.tar" -C /tmp $(cd /tmp && ls ncu-src-*.csv.xz)
tar czf "$OUT/ncu-details.tar.gz" -C "$OUT" $(cd "$OUT" && ls ncu-*-details.txt) && rm "$OUT"/ncu-*-details.txt
