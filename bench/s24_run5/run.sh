cd .device-s24 && gunzip -f gpu_kernels.gz && chmod +x gpu_kernels
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
timeout 230 ./gpu_kernels stages --m 1 --stage down --loads --json $OUT/down_weights_m1.json > $OUT/down_weights_m1.txt 2>&1; echo rc=$?
grep -E "^\||copy|m = " $OUT/down_weights_m1.txt | head -40
