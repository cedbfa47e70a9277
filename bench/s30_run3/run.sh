# Session 30, lease 3: s30_run2's call trace (an event after the copy and after every call) carried no fixed cost
# (first call +6 us, then 64-65 us each, the copy on time), where the plain figure carries ~70 us a sample. Here: an
# event between the copy and the calls only (`--mid-event`, new), and programmatic dependent launch off
# (`EYRIE_PDL=0`), each at 8 and 32 calls, alternated with the plain figure.
cd .device-s30 && gunzip -f gk.gz 2>/dev/null; chmod +x gk; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s30; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
i=0
for v in "1 --mid-event" "0" "1" "0 --mid-event" "1 --mid-event"; do
  i=$((i+1)); set -- $v
  EYRIE_PDL=$1 timeout 100 $D/gk bench --m 1 --no-sweep --calls 8,32 $2 --json $W/gk_$i.json > $W/gk_$i.txt 2>&1
  echo "gk $i EYRIE_PDL=$1 $2 rc=$? $(el)"; pack; grep -E "^\| 1 \||^\(m = 1: GPU us a" $W/gk_$i.txt | cut -c1-700
done
