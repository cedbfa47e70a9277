cd .device-next && gunzip -f gk_main.gz ga.gz && chmod +x gk_main ga && cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 50 python3 scripts/moe_load_pattern.py --overlap > $OUT/overlap.txt 2>&1; echo "overlap rc=$?"; tail -8 $OUT/overlap.txt
timeout 200 .device-next/gk_main stages --m 1 --json $OUT/stages_m1.json > $OUT/stages_m1.txt 2>&1; echo "stages rc=$?"
grep -E "^m = |^\| 8 \| 3 \||^\| 1 \| 1 \| 2 \|" $OUT/stages_m1.txt
timeout 100 .device-next/ga --quick > $OUT/ga_quick.txt 2>&1; echo "ga rc=$?"; grep -iE "check|mismatch|fail| ok" $OUT/ga_quick.txt | head -20
