set -x
cd .device-s23
for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
timeout 280 ./gpu_attention --quick --mma --json $OUT/att_h64.json > $OUT/att_h64.txt 2>&1; echo rc=$?
grep -c "ok |" $OUT/att_h64.txt; grep -h FAIL $OUT/att_h64.txt | head -20
grep "tensor cores" $OUT/att_h64.txt | head -60
grep -h -A8 "copy bandwidth" $OUT/att_h64.txt
grep "best dims" $OUT/att_h64.txt
EYRIE_ATTENTION_MMA=1 timeout 100 ncu --clock-control none --kernel-name regex:mla_attention_mma --launch-count 1 --set full --csv --page details ./gpu_attention --profile 1x8192 > $OUT/ncu_mma_1x8k.csv 2>&1; echo ncu rc=$?
timeout 180 ./gpu_attention --quick --mma --heads 8 --json $OUT/att_h8.json > $OUT/att_h8.txt 2>&1; echo rc=$?
grep -h FAIL $OUT/att_h8.txt | head; grep "tensor cores" $OUT/att_h8.txt | grep -v "|.*|.*|.*x (" | head -60; grep "best dims" $OUT/att_h8.txt
