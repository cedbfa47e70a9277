cd .device-s25 && gunzip -f gpu_kernels.gz && chmod +x gpu_kernels
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
for p in none nox noscales weights; do
  timeout 110 env EYRIE_MOE_LOADS_PROBE=$p ./gpu_kernels stages --m 1 --loads --json $OUT/stages_$p.json > $OUT/stages_$p.txt 2>&1; echo "$p rc=$?"
done
for p in none nox noscales weights; do echo "== $p"; grep -E "^\||m = " $OUT/stages_$p.txt | grep -v "^| tasks\|^| tiles\|^|---" | head -45; done
