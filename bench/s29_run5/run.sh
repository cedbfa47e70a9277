# Session 29, lease 5: each stage of the one-token layer alone, CubeCL's CUBINs in the probe's harness
# (`cubecl_stage_*` rows) against the engine's own stage figures (`gpu_kernels bench`: "GPU gate/up, down, combine").
cd .device-s29 && gunzip -f gk.gz 2>/dev/null; chmod +x gk; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s29; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
timeout 100 python3 scripts/pdl_probe.py --cubecl $D/cub --cubecl-entry $D/cub_entry --json $W/pdl.json > $W/pdl.txt 2>&1
echo "pdl_probe rc=$? $(el)"; pack; grep -E "cubecl" $W/pdl.txt | grep -v "^kernels"
for i in 1 2; do
  timeout 80 $D/gk bench --m 1 --no-sweep --json $W/gk_$i.json > $W/gk_$i.txt 2>&1; echo "gk $i rc=$? $(el)"; pack
  grep -E "^\| 1 \||^\(m = 1: GPU|best" $W/gk_$i.txt | cut -c1-300
done
