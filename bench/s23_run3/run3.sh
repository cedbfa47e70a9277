set -x
cd .device-s23
for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention gpu_ops bench_decode eyrie 2>/dev/null
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 200 ./gpu_attention --quick --json $OUT/att_h64.json > $OUT/att_h64.txt 2>&1; echo rc=$?
grep -c "ok |" $OUT/att_h64.txt; grep -h FAIL $OUT/att_h64.txt | head -20
grep -h -A8 "copy bandwidth" $OUT/att_h64.txt
timeout 200 ./gpu_ops > $OUT/gpu_ops.txt 2>&1; echo gpu_ops rc=$?; tail -3 $OUT/gpu_ops.txt; grep -ci fail $OUT/gpu_ops.txt
for mode in mma dims nomerge; do
  case $mode in mma) E="";; dims) E="EYRIE_ATTENTION_MMA=0";; nomerge) E="EYRIE_OUTPUT_MERGE=0";; esac
  env $E timeout 150 ./bench_decode --splits 1x1 --layers 10 --batch 1,8 --context 8192 --steps 30 --warmup 4 --overlap > $OUT/slice_8192_$mode.txt 2>&1; echo $mode rc=$?
  grep -E "overlapped|ms/step median" $OUT/slice_8192_$mode.txt
done
