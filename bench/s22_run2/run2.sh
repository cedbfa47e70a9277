set -x
cd .device-s22
for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention gpu_ops bench_decode
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 150 ./gpu_attention --quick --heads 8 --json $OUT/att_h8.json > $OUT/att_h8.txt 2>&1; echo rc=$?
timeout 150 ./gpu_attention --quick --json $OUT/att_h64.json > $OUT/att_h64.txt 2>&1; echo rc=$?
grep -c "ok |" $OUT/att_h8.txt $OUT/att_h64.txt; grep -h FAIL $OUT/att_h8.txt $OUT/att_h64.txt | head
grep -h -A7 "copy bandwidth" $OUT/att_h8.txt $OUT/att_h64.txt
timeout 120 ncu --clock-control none --kernel-name regex:mla_attention_dims --launch-count 1 --set full --csv --page details ./gpu_attention --heads 8 --profile 8x8192 > $OUT/ncu_h8_8x8k.csv 2>&1; echo ncu rc=$?
timeout 120 ncu --clock-control none --kernel-name regex:mla_attention_dims --launch-count 1 --set full --csv --page details ./gpu_attention --profile 1x8192 > $OUT/ncu_h64_1x8k.csv 2>&1; echo ncu rc=$?
timeout 200 ./gpu_ops > $OUT/gpu_ops.txt 2>&1; echo gpu_ops rc=$?; tail -4 $OUT/gpu_ops.txt; grep -ci fail $OUT/gpu_ops.txt
