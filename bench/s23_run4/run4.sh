set -x
cd .device-s23
for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention gpu_ops bench_decode eyrie 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
for mode in mma dims; do
  case $mode in mma) E="";; dims) E="EYRIE_ATTENTION_MMA=0";; esac
  env $E timeout 100 ./bench_decode --splits 1x1 --layers 10 --batch 1,8 --context 1024 --steps 30 --warmup 4 --overlap > $OUT/slice_1024_$mode.txt 2>&1; echo $mode rc=$?
  grep -E "overlapped|ms/step median" $OUT/slice_1024_$mode.txt
done
timeout 150 ncu --profile-from-start off --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv --print-units base ./bench_decode --splits 1x1 --layers 10 --batch 1 --context 8192 --steps 4 --warmup 3 --profile-steps 2 > $OUT/ncu_step_b1_8k.csv 2>$OUT/ncu_step_b1_8k.err; echo ncu rc=$?
python3 ../scripts/ncu_step_summary.py $OUT/ncu_step_b1_8k.csv --steps 2 --top 30 || tail -5 $OUT/ncu_step_b1_8k.err
mkdir -p /tmp/serve; timeout 280 python3 ../scripts/gpu_serve_check.py ./eyrie /tmp/serve > /tmp/serve/check.txt 2>&1; echo serve rc=$?; tail -25 /tmp/serve/check.txt
tar czf $OUT/serve.tgz -C /tmp serve  # (unpacked into bench/s23_run4/serve)
