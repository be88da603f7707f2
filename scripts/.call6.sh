source .gpu/activate.sh
i=0
for a in "--d 128 --heads 16 --causal" "--d 128 --heads 16" "--d 64 --heads 32" "--d 64 --heads 32 --causal"; do
  (CUDA_VISIBLE_DEVICES=$i timeout 280 python scripts/bwd_profile.py $a --rounds 10 --ab lse-load=before_s dq-fragments=on dq-writer-plain=on dq-fragments=on,dq-writer-plain=on 2>&1 | grep -v Warn > $OUT/ab$i.txt) &
  i=$((i+1))
done
wait
cat $OUT/ab*.txt
