# Session 30, lease 8: the direct check of what the old method's fixed cost is. The old method (--subtract-copy)
# with a `get_resource` round trip right after the copy's enqueue (`--flush-after-copy`, new: it hands CubeCL's
# queued tasks to its device thread and records nothing on the stream): if F is the copy waiting in CubeCL's client
# queue (32 tasks a batch), it is gone; against the old method alone, alternated.
cd .device-s30 && gunzip -f gk.gz; chmod +x gk; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s30; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
i=0
for v in "--subtract-copy --flush-after-copy" "--subtract-copy" "--subtract-copy --flush-after-copy"; do
  i=$((i+1))
  timeout 60 $D/gk bench --m 1 --no-sweep --calls 8,32 $v --json $W/gk_$i.json > $W/gk_$i.txt 2>&1
  echo "gk $i '$v' rc=$? $(el)"; pack; grep -E "^\| 1 \||^\(m = 1: GPU us a" $W/gk_$i.txt | cut -c1-600
done
