# Session 25's plan for the next GPU lease (from the repo root; build first, as bench/s25_next/README says).
# 1. The load-pattern ladder: which step from a plain tiled read to the kernel's loads costs (~40 s).
for m in down gate_up; do
  timeout 90 python3 scripts/moe_load_pattern.py --matrix $m --json $OUT/pattern_$m.json > $OUT/pattern_$m.txt 2>&1
  echo "pattern $m rc=$?"; cat $OUT/pattern_$m.txt
done
# 2. The paired scale layout (branch s25-scale-pairs) against main, alternated, then its checks.
cd .device-next && for f in *.gz; do gunzip -f $f; done && chmod +x gk_*
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
for i in 1 2; do for b in main pairs; do
  timeout 60 ./gk_$b bench --m 1 --json $OUT/bench_${b}_$i.json > $OUT/bench_${b}_$i.txt 2>&1
  echo "$b $i rc=$?"; grep -E "^\| 1 |copy" $OUT/bench_${b}_$i.txt
done; done
timeout 150 ./gk_pairs check --quick > $OUT/check_pairs.txt 2>&1; echo "check rc=$?"; grep -c " ok" $OUT/check_pairs.txt
grep -iE "fail|mismatch|error" $OUT/check_pairs.txt | head
