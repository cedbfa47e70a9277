# Session 28, lease 2: the one-token layer at its tuned shape (no sweep), down's late PDL wait on and off in
# alternate processes, each with the fused combine against its own launch inside; routings over 64 experts
# against 384; the plain-CUDA probe over 384 and 64 experts.
cd .device-s28 && for f in *.gz; do gunzip -f $f; done && chmod +x * && cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s28; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
row() { grep -E "^\| 1 \||^\(m = 1|^routings" $1 | cut -c1-200; }
i=0
for cfg in "1 384" "0 384" "1 64" "0 384" "1 384"; do
  set -- $cfg; i=$((i+1))
  EYRIE_PDL_LATE=$1 timeout 90 $D/gk bench --m 1 --no-sweep --pool $2 --json $W/gk_$i.json > $W/gk_$i.txt 2>&1
  echo "gk bench $i late=$1 pool=$2 rc=$? $(el)"; pack; row $W/gk_$i.txt
done
for pool in 384 64; do
  timeout 150 python3 scripts/pdl_probe.py --pool $pool --json $W/pdl_$pool.json > $W/pdl_$pool.txt 2>&1
  echo "pdl_probe pool=$pool rc=$? $(el)"; pack; cat $W/pdl_$pool.txt
done
