cd .device-s25 && gunzip -f gpu_kernels.gz && chmod +x gpu_kernels
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 100 ./gpu_kernels check --quick > $OUT/check_r1.txt 2>&1; echo "check r1 rc=$?"
timeout 100 env EYRIE_MOE_ROUNDS=3 ./gpu_kernels check --quick > $OUT/check_r3.txt 2>&1; echo "check r3 rc=$?"
for r in 1 2; do
  timeout 90 env EYRIE_MOE_ROUNDS=$r ./gpu_kernels stages --m 1 --stage down --json $OUT/down_r$r.json > $OUT/down_r$r.txt 2>&1; echo "down r$r rc=$?"
done
timeout 100 ./gpu_kernels bench --m 1,8 --json $OUT/bench.json > $OUT/bench.txt 2>&1; echo "bench rc=$?"
for f in check_r1 check_r3; do echo "== $f"; grep -ciE "\bok\b|true" $OUT/$f.txt; grep -iE "fail|error|mismatch|panick" $OUT/$f.txt | head -5; tail -2 $OUT/$f.txt; done
for r in 1 2; do echo "== down r$r"; grep -E "^\||m = " $OUT/down_r$r.txt | grep -v "^| tiles\|^|---" | head -30; done
echo "== bench"; grep -E "^\||copy" $OUT/bench.txt | head -20
