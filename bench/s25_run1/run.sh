nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > $OUT/smi.txt
timeout 90 python3 scripts/moe_load_pattern.py --matrix down --json $OUT/pattern_down.json > $OUT/pattern_down.txt 2>&1; echo rc=$?
timeout 90 python3 scripts/moe_load_pattern.py --matrix gate_up --json $OUT/pattern_gate_up.json > $OUT/pattern_gate_up.txt 2>&1; echo rc=$?
cat $OUT/pattern_down.txt $OUT/pattern_gate_up.txt | tail -70
cd .device-s25 && gunzip -f gpu_kernels.gz && chmod +x gpu_kernels
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 180 ./gpu_kernels stages --m 1 --stage down --loads --json $OUT/down_m1.json > $OUT/down_m1.txt 2>&1; echo rc=$?
timeout 180 env EYRIE_MOE_ROTATE=1 ./gpu_kernels stages --m 1 --stage down --loads --json $OUT/down_m1_rot.json > $OUT/down_m1_rot.txt 2>&1; echo rc=$?
for f in down_m1 down_m1_rot; do echo "== $f"; grep -E "^\||m = |copy" $OUT/$f.txt | grep -v "^| tasks\|^|---" | head -40; done
