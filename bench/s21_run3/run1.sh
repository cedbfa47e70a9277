#!/bin/bash
# Session 21, run 1: the overlapped greedy chain against the plain step, one binary.
set -u
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
gunzip -kf bench_decode.gz && chmod +x bench_decode
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv > $OUT/gpu.txt
for i in 1 2; do
  timeout 150 ./bench_decode --splits 1x1 --layers 10 --batch 1,8 --context 1024 --steps 30 --warmup 4 --overlap --json $OUT/ov1k_$i.json > $OUT/ov1k_$i.txt 2>&1
  tail -n 6 $OUT/ov1k_$i.txt
done
timeout 200 ./bench_decode --splits 1x1 --layers 10 --batch 1,8 --context 8192 --steps 20 --warmup 3 --overlap --json $OUT/ov8k.json > $OUT/ov8k.txt 2>&1
tail -n 6 $OUT/ov8k.txt
grep -h "overlap" $OUT/*.txt | head -20
