# Session 29, lease 2: the MoE layer benchmark with BehindCopy timed on CUDA events (the host clock's figure of the
# same runs beside it): one token twice at its tuned shape, then 1, 8, 32, 128 tokens; the tinygemm / bf16 peers.
cd .device-s29 && gunzip -f gk.gz && chmod +x gk && cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s29; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
for i in 1 2; do
  timeout 90 $D/gk bench --m 1 --no-sweep --json $W/gk_m1_$i.json > $W/gk_m1_$i.txt 2>&1; echo "gk m1 $i rc=$? $(el)"; pack
  grep -E "^\| 1 \||^\(m = 1" $W/gk_m1_$i.txt | cut -c1-200
done
timeout 200 $D/gk bench --m 1,8,32,128 --no-sweep --json $W/kernels.json > $W/kernels.txt 2>&1; echo "gk all rc=$? $(el)"; pack
grep -E "^\||^\(m =|copy" $W/kernels.txt | cut -c1-220
timeout 200 python3 scripts/bench_kernels_peer.py --out $W/kernels_peer.json > $W/peer.txt 2>&1; echo "peer rc=$? $(el)"
python3 scripts/bench_kernels_peer.py --merge $W/kernels.json $W/kernels_peer.json > $W/merge.txt 2>&1; echo "merge rc=$? $(el)"; pack
tail -20 $W/peer.txt; cat $W/merge.txt | tail -20
