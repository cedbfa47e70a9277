# Session 31, lease 4: as committed: the TF32 kernel picked for <= 16 heads (4 warps x 16 positions, two blocks a
# multiprocessor, at most 96 slices), the combine with 512 threads a (row, head) above 8 slices. Checks and the
# quick benchmark at 8 heads (with EYRIE_ATTENTION_TF32=0 after it: the dim lanes, same lease) and at 64 heads.
cd .device-s31 && for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w4; rm -rf $W; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w4; }
D=.device-s31; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 170 $D/gpu_attention --quick --heads 8 --json $W/ga8.json > $W/ga8.txt 2>&1; echo "ga8 rc=$? $(el)"; pack
grep -cE " ok \|$" $W/ga8.txt; grep -E "FAIL" $W/ga8.txt | head -5 | cut -c1-250
grep -E "copy bandwidth|^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \|" $W/ga8.txt | cut -c1-250
EYRIE_ATTENTION_TF32=0 timeout 100 $D/gpu_attention --quick --heads 8 --json $W/ga8_dims.json > $W/ga8_dims.txt 2>&1
echo "ga8 dims rc=$? $(el)"; pack; grep -E "copy bandwidth|^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \|" $W/ga8_dims.txt | cut -c1-250
timeout 170 $D/gpu_attention --quick --json $W/ga64.json > $W/ga64.txt 2>&1; echo "ga64 rc=$? $(el)"; pack
grep -cE " ok \|$" $W/ga64.txt; grep -E "FAIL" $W/ga64.txt | head -5 | cut -c1-250
grep -E "copy bandwidth|^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \|" $W/ga64.txt | cut -c1-250
