#!/bin/bash
# Session 21, run 2: the server's overlap scheduling on the H200 (gpu_serve_check.py, with and without
# --disable-overlap-schedule), then the one-row attention under Nsight Compute (full set) at 1k and 8k.
set -u
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
gunzip -kf eyrie.gz bench_decode.gz && chmod +x eyrie bench_decode
W=/tmp/s21run2 && mkdir -p $W/serve
( cd .. && timeout 330 python3 scripts/gpu_serve_check.py .device-s21/eyrie $W/serve > $W/serve/check_stdout.txt 2>&1; echo "rc $?" >> $W/serve/check_stdout.txt )
tail -n 40 $W/serve/check_stdout.txt
grep -h "tok/s\|TPOT\|concurrency" $W/serve/bench_serve_gpu*.txt | head -30
for ctx in 1024 8192; do
  timeout 200 ncu --profile-from-start off --clock-control none --kernel-name regex:mla_attention_kernel --launch-count 2 --set full \
    --csv --page details ./bench_decode --splits 1x1 --layers 4 --batch 1 --context $ctx --steps 2 --warmup 2 --profile-steps 1 > $W/ncu_att_$ctx.csv 2> $W/ncu_att_$ctx.err
  echo "ncu $ctx rc $?"; wc -l $W/ncu_att_$ctx.csv
done
timeout 120 ncu --profile-from-start off --clock-control none --kernel-name regex:mla_output_kernel --launch-count 1 --set full \
    --csv --page details ./bench_decode --splits 1x1 --layers 4 --batch 1 --context 1024 --steps 2 --warmup 2 --profile-steps 1 > $W/ncu_out_1024.csv 2> $W/ncu_out_1024.err
echo "ncu out rc $?"
tar czf $OUT/s21_run2.tgz -C $W .
ls -la $W $W/serve
