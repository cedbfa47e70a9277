set -x
cd .device-s23
for f in *.gz; do gunzip -f $f; done; chmod +x bench_decode gpu_attention
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 100 python3 ../scripts/bench_attention_peer.py --quick --json $OUT/peer.json > $OUT/peer.txt 2>&1; echo peer rc=$?; tail -12 $OUT/peer.txt
i=0; for mode in mma dims mma; do i=$((i+1))
  case $mode in mma) E="";; dims) E="EYRIE_ATTENTION_MMA=0";; esac
  env $E timeout 70 ./bench_decode --splits 1x1 --layers 10 --batch 1 --context 8192 --steps 30 --warmup 4 --overlap > $OUT/s8k_${i}_$mode.txt 2>&1; echo $mode rc=$?
  grep -E "^\| 1 \| 1 \| 1" $OUT/s8k_${i}_$mode.txt
done
