set -x
cd .device-s23
for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 200 ./gpu_attention --quick --mma --json $OUT/att_h64.json > $OUT/att_h64.txt 2>&1; echo rc=$?
grep -c "ok |" $OUT/att_h64.txt; grep -h FAIL $OUT/att_h64.txt | head -20
grep "^| [0-9]" $OUT/att_h64.txt | grep -E "tensor cores.*\| 1 tiles x 4 \| 4 \| 16 \||qlo|picked" | head -80
grep "best dims" $OUT/att_h64.txt
