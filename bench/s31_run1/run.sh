# Session 31, lease 1: the TF32 attention kernel (attention_tf32) for few heads: checks at every case (8-64 heads),
# the quick benchmark at 8 heads with the TF32 pick and with EYRIE_ATTENTION_TF32=0 (the dim lanes), the --tf32
# sweep at 8 heads; the checks (fixed cases, 4-64 heads) include the TF32 launches.
cd .device-s31 && for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s31; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
timeout 150 $D/gpu_attention --quick --heads 8 --json $W/ga8.json > $W/ga8.txt 2>&1; echo "ga8 rc=$? $(el)"; pack
grep -c "| ok" $W/ga8.txt; grep -E "FAIL|rror" $W/ga8.txt | head -8; grep "TF32" $W/ga8.txt | head -40 | cut -c1-250
tail -8 $W/ga8.txt | cut -c1-300
EYRIE_ATTENTION_TF32=0 timeout 100 $D/gpu_attention --quick --heads 8 --json $W/ga8_dims.json > $W/ga8_dims.txt 2>&1
echo "ga8 dims rc=$? $(el)"; pack; tail -6 $W/ga8_dims.txt | cut -c1-300
timeout 200 $D/gpu_attention --quick --tf32 --heads 8 --json $W/ga8_sweep.json > $W/ga8_sweep.txt 2>&1; echo "sweep rc=$? $(el)"; pack
grep -E "^best|TF32|picked" $W/ga8_sweep.txt | grep -v "^| [a-zA-Z]" | cut -c1-200 | head -90
