set -x
cd .device-s22 && gunzip -f gpu_attention.gz && chmod +x gpu_attention
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 280 ./gpu_attention --quick --dims --heads 8 --json $OUT/h8.json > $OUT/h8.txt 2>&1; echo rc=$?
tail -60 $OUT/h8.txt
timeout 250 ./gpu_attention --quick --dims --json $OUT/h64.json > $OUT/h64.txt 2>&1; echo rc=$?
grep -E "FAIL|best dims|error" $OUT/h64.txt | head -40
