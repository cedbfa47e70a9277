# Session 30, lease 5: s30_run4's 32-token layer took 1429 us GPU time (8 calls behind the copy) against 1325 us wall
# and 1312 us for its stages' sum: the call trace there (an event after each of 8 calls), twice, and the 8-call
# figure under both methods.
cd .device-s30 && for f in *.gz; do gunzip -f $f; done; chmod +x gk; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s30; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
i=0
for v in "" "--subtract-copy" ""; do
  i=$((i+1))
  timeout 120 $D/gk bench --m 32 --no-sweep --calls 4,8 --call-trace $v --json $W/gk_$i.json > $W/gk_$i.txt 2>&1
  echo "gk $i '$v' rc=$? $(el)"; pack; grep -E "^\| 32 \||^\(m = 32: (GPU us a|call)|^\(m = 32" $W/gk_$i.txt | cut -c1-600
done
