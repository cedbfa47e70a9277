set -x
cd .device-s22
for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention bench_decode
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 100 ./gpu_attention --quick --heads 8 --json $OUT/att_h8.json > $OUT/att_h8.txt 2>&1; echo rc=$?
timeout 100 ./gpu_attention --quick --json $OUT/att_h64.json > $OUT/att_h64.txt 2>&1; echo rc=$?
grep -c "ok |" $OUT/att_h8.txt $OUT/att_h64.txt; grep -h FAIL $OUT/att_h8.txt $OUT/att_h64.txt | head
grep -h -A7 "copy bandwidth" $OUT/att_h8.txt $OUT/att_h64.txt
timeout 60 ncu --clock-control none --kernel-name regex:mla_ --launch-count 2 --set full --csv --page details ./gpu_attention --heads 8 --profile 8x8192 > $OUT/ncu_h8_8x8k.csv 2>&1; echo ncu rc=$?
timeout 60 ncu --clock-control none --kernel-name regex:mla_ --launch-count 2 --set full --csv --page details ./gpu_attention --profile 1x8192 > $OUT/ncu_h64_1x8k.csv 2>&1; echo ncu rc=$?
timeout 130 ./bench_decode --splits 1x1 --layers 10 --batch 1,8 --context 8192 --steps 30 --warmup 4 --overlap > $OUT/slice_8192.txt 2>&1; echo rc=$?
grep -E "^\|" $OUT/slice_8192.txt | tail -3
timeout 80 ./bench_decode --splits 1x1 --layers 10 --batch 1,8 --context 1024 --steps 30 --warmup 4 --overlap > $OUT/slice_1024.txt 2>&1; echo rc=$?
grep -E "^\|" $OUT/slice_1024.txt | tail -3
timeout 100 ./gpu_attention --dims --heads 8 --quick > $OUT/dims_h8.txt 2>&1; echo rc=$?; grep "best dims" $OUT/dims_h8.txt
