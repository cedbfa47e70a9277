#!/bin/bash
# Session 21, run 4: the final code's overlapped chain (argmax launch/readback refactored for the workers' picks).
set -u
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
gunzip -kf bench_decode.gz && chmod +x bench_decode
timeout 200 ./bench_decode --splits 1x1 --layers 10 --batch 1,8 --context 1024 --steps 30 --warmup 4 --overlap --json $OUT/ov1k_final.json > $OUT/ov1k_final.txt 2>&1
echo "rc $?"
grep -h "overlap" $OUT/ov1k_final.txt
tail -n 5 $OUT/ov1k_final.txt
