# Session 31, lease 5: the TF32 kernel with a ring of three stages (no end-of-stage block barrier) picked where it
# fits, the two-stage ring timed beside it at the same slices ("the other ring"); checks of every TF32 shape.
cd .device-s31 && for f in *.gz; do gunzip -f $f; done; chmod +x gpu_attention; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w5; rm -rf $W; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w5; }
D=.device-s31; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
timeout 150 $D/gpu_attention --quick --heads 8 --json $W/ga8.json > $W/ga8.txt 2>&1; echo "ga8 rc=$? $(el)"; pack
grep -cE " ok \|$" $W/ga8.txt; grep -E "FAIL" $W/ga8.txt | head -5 | cut -c1-250
grep "TF32" $W/ga8.txt | grep -v "^| [0-9]" | awk -F'|' '{print $8}' | sort -g | tail -1
grep -E "copy bandwidth|^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \|" $W/ga8.txt | cut -c1-250
