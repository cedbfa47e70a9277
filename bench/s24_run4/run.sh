set -x
cd .device-s24
for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention gpu_kernels gpu_ops bench_decode 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 150 ./gpu_attention --quick --json $OUT/att_h64.json > $OUT/att_h64.txt 2>&1; echo rc=$?
grep -c "ok |" $OUT/att_h64.txt; grep -h FAIL $OUT/att_h64.txt | head -20
grep -h -A8 "copy bandwidth" $OUT/att_h64.txt
timeout 100 ./gpu_attention --quick --heads 8 > $OUT/att_h8.txt 2>&1; echo rc=$?
grep -c "ok |" $OUT/att_h8.txt; grep -h FAIL $OUT/att_h8.txt | head -20
grep -h -A8 "copy bandwidth" $OUT/att_h8.txt
timeout 150 ./gpu_ops > $OUT/gpu_ops.txt 2>&1; echo gpu_ops rc=$?; tail -3 $OUT/gpu_ops.txt; grep -ci fail $OUT/gpu_ops.txt
timeout 150 ./gpu_kernels check --quick > $OUT/moe_check.txt 2>&1; echo moe rc=$?; grep -c "ok" $OUT/moe_check.txt; grep -i fail $OUT/moe_check.txt | head; tail -3 $OUT/moe_check.txt
timeout 120 ./bench_decode --splits 1x1 --layers 10 --batch 1,8 --context 8192 --steps 30 --warmup 4 --overlap > $OUT/slice_8192.txt 2>&1; echo slice rc=$?
grep -E "overlapped|ms/step median" $OUT/slice_8192.txt
