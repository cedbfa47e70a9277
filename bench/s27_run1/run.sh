# Session 27, lease 1 (from the repo root; binaries in .device-next, built as bench/s26_next/README.md says).
cd .device-next && for f in *.gz; do gunzip -f $f; done && chmod +x * && cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-next; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
# 1. Correctness: the route launch's split against the layer's own (bit-identical), and every other gpu_ops row.
timeout 200 $D/gops_split --json $W/gops_split.json > $W/gops_split.txt 2>&1; echo "gpu_ops rc=$? $(el)"; pack
grep -E "input split in the route launch|device vs host router|false" $W/gops_split.txt | head -20
# 2. The slice's decode step, main and the branch alternated (overlapped greedy chain, batch 1 and 8, 1k).
for i in 1 2; do for b in main split; do
  timeout 120 $D/bd_$b --splits 1x1 --layers 10 --batch 1,8 --context 1024 --steps 30 --warmup 4 --overlap \
    --json $W/decode_${b}_$i.json > $W/decode_${b}_$i.txt 2>&1
  echo "decode $b $i rc=$? $(el)"; pack; grep -E "^\| (1|8) " $W/decode_${b}_$i.txt | head -4
done; done
# 3. Nsight Compute: the CubeCL layer's launches at one token vs the plain-CUDA ladder's kmma (same sections).
S="--clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section InstructionStats --section SchedulerStats"
timeout 120 ncu $S --launch-skip 30 --launch-count 10 $D/gk_main profile --m 1 --calls 10 > $W/ncu_cubecl_m1.txt 2>&1
echo "ncu cubecl rc=$? $(el)"; pack
timeout 120 ncu $S -k regex:kmma --launch-skip 2 --launch-count 20 python3 scripts/moe_load_pattern.py --overlap --iters 1 > $W/ncu_kmma.txt 2>&1
echo "ncu kmma rc=$? $(el)"; pack
for f in $W/ncu_cubecl_m1.txt $W/ncu_kmma.txt; do
  grep -E "^  [a-z_A-Z].*\(|Duration|Executed Instructions  |Registers Per|Grid Size|Block Size|Achieved Occupancy|DRAM Throughput|Issue Slots Busy|Warp Cycles Per Issued" $f | head -120
done
