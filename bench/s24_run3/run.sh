export LD_LIBRARY_PATH=/usr/local/cuda/lib64
cd .device-s24 && gunzip -f gpu_attention.gz && chmod +x gpu_attention && cd ..
timeout 250 ./.device-s24/gpu_attention --quick --mma --json $OUT/att64_chains.json > $OUT/att64_chains.txt 2>&1; echo rc=$?
timeout 250 ./.device-s24/gpu_attention --quick --mma --heads 8 --json $OUT/att8_chains.json > $OUT/att8_chains.txt 2>&1; echo rc=$?
for f in att64_chains att8_chains; do echo "== $f"; grep -c "ok |" $OUT/$f.txt; grep -E "FAIL" $OUT/$f.txt | head -5
grep -E "^\| (1|8|32) \| (1024|8192) \| [0-9.]+ \|" $OUT/$f.txt
grep -E "^\| (1|8|32) \| (1024|8192) \| (positions|dims|keys|tensor)" $OUT/$f.txt | sort -t'|' -k2,2n -k3,3n -k10,10n | awk -F'|' '{k=$2 $3 $4; if (!(k in seen)) {seen[k]=1; print}}'
grep "best dims" $OUT/$f.txt; done
