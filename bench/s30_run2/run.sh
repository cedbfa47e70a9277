# Session 30, lease 2: where the engine's fixed cost a GPU-time sample sits (s30_run1: the layer's figure falls from
# 69-71 us a call at 8 calls behind the copy to 64-65 at 32, a slope of 61-63; the probe's is flat at 61.3-62.0).
# `gpu_kernels bench --call-trace` (new): an event after the copy and after each call, so the copy's own time in the
# run and each call's time show which of them carries it. Default routing cycle, then one routing, then a 64-expert
# pool (the probe's).
cd .device-s30 && gunzip -f gk.gz 2>/dev/null; chmod +x gk; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s30; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
i=0
for v in "" "--routings 1" "--pool 64" ""; do
  i=$((i+1))
  timeout 100 $D/gk bench --m 1 --no-sweep --calls 8,32 --call-trace $v --json $W/gk_$i.json > $W/gk_$i.txt 2>&1
  echo "gk $i '$v' rc=$? $(el)"; pack; grep -E "^\| 1 \||^\(m = 1: (GPU us a|call)" $W/gk_$i.txt | cut -c1-700
done
