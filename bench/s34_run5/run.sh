# Session 34, lease 5: the slice's prefill of 8 sequences x 8192 tokens (forwards of 8192 rows, so the MoE takes the
# tiled grouped GEMM) with the tiled GEMM on (default) and off (EYRIE_MOE_TILED_GEMM=0), same binary, order off/on/off.
cd .device-s34 && for f in *.gz; do gunzip -f $f; done; chmod +x *; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w5; rm -rf $W; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w5; }
D=.device-s34; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for v in 0 1 0; do
  EYRIE_MOE_TILED_GEMM=$v timeout 100 $D/bench_decode --splits 1x1 --layers 10 --batch 8 --context 8192 --steps 5 --warmup 2 \
    --json $W/prefill_tiled$v.json > $W/prefill_tiled$v.txt 2>&1
  echo "tiled=$v rc=$? $(el)"; pack; grep -E "^\| 1 \| 1 \| 1 \| 8 " $W/prefill_tiled$v.txt | cut -c1-200
done
