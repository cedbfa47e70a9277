# Session 30, lease 4: the kernels benchmark with BehindCopy's event between the copy and the calls (the default
# since this session), its peers in the same lease, the old method (--subtract-copy) beside it, and the attention's
# checks and GPU times under the new method.
cd .device-s30 && for f in *.gz; do gunzip -f $f; done; chmod +x gk ga gv; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s30; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
timeout 200 $D/gk bench --m 1,8,32,128 --no-sweep --calls 16,32 --json $W/kernels.json > $W/kernels.txt 2>&1
echo "gk all rc=$? $(el)"; pack; grep -E "^\||^\(m = [0-9]+: GPU us a|^device" $W/kernels.txt | cut -c1-500
timeout 200 python3 scripts/bench_kernels_peer.py --out $W/kernels_peer.json > $W/peer.txt 2>&1; echo "peer rc=$? $(el)"
python3 scripts/bench_kernels_peer.py --merge $W/kernels.json $W/kernels_peer.json > $W/merge.txt 2>&1; echo "merge rc=$? $(el)"; pack
tail -12 $W/merge.txt | cut -c1-300
timeout 90 $D/gk bench --m 1 --no-sweep --calls 8,16,32 --subtract-copy --json $W/gk_subtract.json > $W/gk_subtract.txt 2>&1
echo "gk subtract rc=$? $(el)"; pack; grep -E "^\| 1 \||^\(m = 1: GPU us a" $W/gk_subtract.txt | cut -c1-500
timeout 150 $D/ga --quick > $W/ga_quick.txt 2>&1; echo "ga rc=$? $(el)"; pack; grep -ciE "\| ok" $W/ga_quick.txt
grep -iE "mismatch|fail" $W/ga_quick.txt | head -5; tail -14 $W/ga_quick.txt | cut -c1-300
