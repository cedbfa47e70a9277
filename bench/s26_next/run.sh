# Session 26's plan for the next GPU lease (from the repo root; build first, as bench/s26_next/README.md says).
cd .device-next && for f in *.gz; do gunzip -f $f; done && chmod +x * && cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
D=.device-next
# 1. Correctness: the route launch's split against the layer's own (bit-identical), and every other gpu_ops row.
timeout 240 $D/gops_split --json $OUT/gops_split.json > $OUT/gops_split.txt 2>&1; echo "gpu_ops rc=$?"
grep -E "input split in the route launch|device vs host router|false" $OUT/gops_split.txt | head -20
# 2. The slice's decode step, main and the branch alternated (overlapped greedy chain, batch 1 and 8, 1k).
for i in 1 2; do for b in main split; do
  timeout 150 $D/bd_$b --splits 1x1 --layers 10 --batch 1,8 --context 1024 --steps 30 --warmup 4 --overlap \
    --json $OUT/decode_${b}_$i.json > $OUT/decode_${b}_$i.txt 2>&1
  echo "decode $b $i rc=$?"; grep -E "^\| (1|8) " $OUT/decode_${b}_$i.txt | head -4
done; done
