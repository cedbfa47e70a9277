# Session 30, lease 6: is the old method's fixed cost a sample (s30_run1-3: ~45-75 us, with PDL or without, gone
# with an event between the copy and the calls) tied to CubeCL's copy kernel in front? The calls behind the
# driver's cuMemcpyDtoDAsync on CubeCL's stream (`--driver-copy`, new) against the kernel, both methods, alternated.
cd .device-s30 && for f in *.gz; do gunzip -f $f; done; chmod +x gk; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s30; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
i=0
for v in "--subtract-copy" "--subtract-copy --driver-copy" "--driver-copy" "--subtract-copy --driver-copy" "--subtract-copy"; do
  i=$((i+1))
  timeout 100 $D/gk bench --m 1 --no-sweep --calls 8,32 $v --json $W/gk_$i.json > $W/gk_$i.txt 2>&1
  echo "gk $i '$v' rc=$? $(el)"; pack; grep -E "^\| 1 \||^\(m = 1: GPU us a" $W/gk_$i.txt | cut -c1-600
done
