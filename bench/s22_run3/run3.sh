set -x
cd .device-s22
for f in *.gz; do gunzip -f $f; done; chmod +x bench_decode
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
for ctx in 8192 1024; do
for mode in 1 0 1; do
EYRIE_ATTENTION_DIMS=$mode timeout 140 ./bench_decode --splits 1x1 --layers 10 --batch 1,8 --context $ctx --steps 30 --warmup 4 --overlap > $OUT/slice_${ctx}_$mode.txt 2>&1; echo rc=$?
grep -E "^\|" $OUT/slice_${ctx}_$mode.txt | tail -4
done; done
