# Session 34, lease 4: the Kimi-K2 slice's decode step (overlapped greedy chain, 10 layers, batch 1 and 8) at 1k and
# 8k context on the current code (one-pass combine; the 8k prefill's MoE chunks on the tiled grouped GEMM).
cd .device-s34 && for f in *.gz; do gunzip -f $f; done; chmod +x *; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w4; rm -rf $W; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w4; }
D=.device-s34; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for c in 1024 8192; do
  timeout 160 $D/bench_decode --splits 1x1 --layers 10 --batch 1,8 --context $c --steps 30 --warmup 4 --overlap \
    --json $W/decode_$c.json > $W/decode_$c.txt 2>&1
  echo "decode $c rc=$? $(el)"; pack; grep -E "^\| 1 \| 1 \| 1 \| (1|8) " $W/decode_$c.txt | head -4 | cut -c1-240
done
