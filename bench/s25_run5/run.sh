cd .device-s25 && gunzip -f gk_new.gz gk_head.gz && chmod +x gk_new gk_head
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
for i in 1 2; do for b in head new; do
  timeout 60 ./gk_$b bench --m 1 --json $OUT/bench_${b}_$i.json > $OUT/bench_${b}_$i.txt 2>&1; echo "$b $i rc=$?"; grep -E "^\| 1 |copy" $OUT/bench_${b}_$i.txt
done; done
timeout 60 ./gk_new stages --m 1 --stage down --json $OUT/down_new.json > $OUT/down_new.txt 2>&1; echo "down new rc=$?"; grep -E "^\| 1 \| [124] \||whole" $OUT/down_new.txt | head -12
cd ..
timeout 45 python3 scripts/moe_load_pattern.py --matrix down --json $OUT/pattern_down.json > $OUT/pattern_down.txt 2>&1; echo "pattern rc=$?"; cat $OUT/pattern_down.txt
