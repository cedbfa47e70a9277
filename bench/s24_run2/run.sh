export LD_LIBRARY_PATH=/usr/local/cuda/lib64
cd .device-s24 && gunzip -f gpu_attention.gz && chmod +x gpu_attention && cd ..
timeout 300 ./.device-s24/gpu_attention --quick --mma --heads 8 --json $OUT/att8_v2.json > $OUT/att8_v2.txt 2>&1; echo rc=$?
grep -c "ok |" $OUT/att8_v2.txt; grep -E "FAIL" $OUT/att8_v2.txt | head -20
grep -E "^\| (1|8|32) \| (1024|8192) \| [0-9.]+ \|" $OUT/att8_v2.txt
grep -E "^\| (1|8|32) \| (1024|8192) \| (positions|dims|keys)" $OUT/att8_v2.txt
tail -3 $OUT/att8_v2.txt
