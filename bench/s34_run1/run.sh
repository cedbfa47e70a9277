# Session 34, lease 1 (H200 wanted): the MLA decode target at a TP rank's 8 heads with the one-pass combine (the
# default since 0765ca9) and the three-round one (EYRIE_COMBINE_ONE_PASS=0), then the PyTorch peer at 8 heads.
cd .device-s34 && for f in *.gz; do gunzip -f $f; done; chmod +x *; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w1; rm -rf $W; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w1; }
D=.device-s34; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 260 $D/gpu_attention --quick --heads 8 --json $W/ga8.json > $W/ga8.txt 2>&1; echo "ga8 rc=$? $(el)"; pack
grep -cE " ok \|$" $W/ga8.txt; grep -E "FAIL" $W/ga8.txt | head -5 | cut -c1-250
grep -E "copy bandwidth|^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \|" $W/ga8.txt | cut -c1-250
EYRIE_COMBINE_ONE_PASS=0 timeout 110 $D/gpu_attention --quick --heads 8 --json $W/ga8_old.json > $W/ga8_old.txt 2>&1
echo "ga8 old rc=$? $(el)"; pack; grep -E "copy bandwidth|^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \|" $W/ga8_old.txt | cut -c1-250
timeout 100 $D/gpu_attention --quick --heads 8 --json $W/ga8_b.json > $W/ga8_b.txt 2>&1; echo "ga8 again rc=$? $(el)"; pack
grep -E "copy bandwidth|^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \|" $W/ga8_b.txt | cut -c1-250
timeout 120 python3 scripts/bench_attention_peer.py --quick --heads 8 --json $W/peer8.json > $W/peer8.txt 2>&1
echo "peer rc=$? $(el)"; pack; tail -12 $W/peer8.txt | cut -c1-220
