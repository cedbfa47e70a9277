# Session 31, lease 3: the TF32 kernel with branch-free copies and chunk loop (809 instructions a warp a stage at
# 8 warps x 16 positions, from 936): checks, the quick benchmark at 8 heads with the attention launch alone beside
# attention + combine, the --tf32 sweep at 8 heads, and the quick benchmark at 64 heads (its checks and picks).
cd .device-s31 && for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w3; rm -rf $W; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w3; }
D=.device-s31; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
timeout 150 $D/gpu_attention --quick --heads 8 --json $W/ga8.json > $W/ga8.txt 2>&1; echo "ga8 rc=$? $(el)"; pack
grep -cE "\| ok \|$" $W/ga8.txt; grep -E "FAIL" $W/ga8.txt | head -5 | cut -c1-250
grep -E "copy bandwidth|^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \|" $W/ga8.txt | cut -c1-250
timeout 200 $D/gpu_attention --quick --tf32 --heads 8 --json $W/ga8_sweep.json > $W/ga8_sweep.txt 2>&1; echo "sweep rc=$? $(el)"; pack
grep -E "^\| [0-9]+ \| [0-9]+ \| TF32" $W/ga8_sweep.txt | sort -t'|' -k2,2n -k3,3n -k10,10g | awk -F'|' '{k=$2$3; if (c[k]++ < 3) print}' | cut -c1-200
grep -E "^best" $W/ga8_sweep.txt | cut -c1-220
timeout 150 $D/gpu_attention --quick --json $W/ga64.json > $W/ga64.txt 2>&1; echo "ga64 rc=$? $(el)"; pack
grep -cE "\| ok \|$" $W/ga64.txt; grep -E "copy bandwidth|^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \|" $W/ga64.txt | cut -c1-250
