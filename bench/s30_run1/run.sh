# Session 30, lease 1: is the engine's extra GPU time a call (session 29: 4.5-8 us a call on every stage, the stages'
# extras summing past the layer's) a cost paid once a sample, spread over its calls? Each stage timed at 8, 16 and 32
# calls behind the copy in one process (`gpu_kernels bench --calls 8,16,32`, new): a fixed cost F a sample adds F / n
# to the plain figure and nothing to the slope between counts. The probe the same (`pdl_probe.py --iters`, new), and
# session 29's prepared run: the probe behind a PDL copy kernel (`--kernel-copy`) as the engine's benchmark queues.
cd .device-s30 && gunzip -f gk.gz 2>/dev/null; chmod +x gk; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s30; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for i in 1 2; do
  timeout 90 $D/gk bench --m 1 --no-sweep --calls 8,16,32 --json $W/gk_$i.json > $W/gk_$i.txt 2>&1; echo "gk $i rc=$? $(el)"
  pack; grep -E "^\| 1 \||^\(m = 1: GPU" $W/gk_$i.txt | cut -c1-600
done
P="python3 scripts/pdl_probe.py --cubecl $D/cub --cubecl-entry $D/cub_entry"
for v in "8" "32" "16 --kernel-copy" "32 --kernel-copy" "16"; do
  n=$(echo $v | tr -d ' -'); timeout 100 $P --iters $v --json $W/pdl_$n.json > $W/pdl_$n.txt 2>&1
  echo "pdl_probe --iters $v rc=$? $(el)"; pack; grep -E "^copy|^\| (cuda|cubecl|cubecl_stage_[a-z_]+) \| pdl_early" $W/pdl_$n.txt
done
timeout 150 $D/gk bench --m 1,8,32,128 --no-sweep --calls 8,16 --json $W/gk_all.json > $W/gk_all.txt 2>&1
echo "gk all rc=$? $(el)"; pack; grep -E "^\| [0-9]+ \||^\(m = [0-9]+: GPU us a" $W/gk_all.txt | cut -c1-600
