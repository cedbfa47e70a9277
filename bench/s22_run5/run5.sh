set -x
cd .device-s22
for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention bench_decode
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 70 ./gpu_attention --quick --heads 8 --json $OUT/att_h8.json > $OUT/att_h8.txt 2>&1; echo rc=$?
grep -c "ok |" $OUT/att_h8.txt; grep -h FAIL $OUT/att_h8.txt | head -3
grep -h -A7 "copy bandwidth" $OUT/att_h8.txt
timeout 40 ncu --clock-control none --kernel-name regex:mla_ --launch-count 2 --set full --csv --page details ./gpu_attention --heads 8 --profile 8x8192 > $OUT/ncu_h8_8x8k.csv 2>&1; echo ncu rc=$?
grep -E '"(Duration|Registers Per Thread)"' $OUT/ncu_h8_8x8k.csv | cut -d, -f5,13,15
timeout 120 ./bench_decode --splits 1x1 --layers 10 --batch 1,8 --context 8192 --steps 30 --warmup 4 --overlap > $OUT/slice_8192.txt 2>&1; echo rc=$?
grep -E "^\|" $OUT/slice_8192.txt | tail -3
