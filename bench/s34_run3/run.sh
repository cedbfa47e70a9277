# Session 34, lease 3: the model's CUDA checks (`gpu_ops`; its MoE block at 3000 tokens now runs the tiled grouped
# GEMM and is checked against the 16-tokens-a-pass kernels), then the tiled GEMM's Kimi layer again
# (`gpu_kernels prefill --m 2048,8192`) on whichever GPU came.
cd .device-s34 && for f in *.gz; do gunzip -f $f; done; chmod +x *; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w3; rm -rf $W; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w3; }
D=.device-s34; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 240 $D/gpu_ops --json $W/gops.json > $W/gops.txt 2>&1; echo "gpu_ops rc=$? $(el)"; pack
grep -cE "\| true \|$" $W/gops.txt; grep -E "\| false \|$|panic|rror" $W/gops.txt | head -8 | cut -c1-250
grep -E "moe block" $W/gops.txt | cut -c1-220; tail -1 $W/gops.txt
timeout 150 $D/gpu_kernels prefill --m 2048,8192 --json $W/gk_prefill.json > $W/gk_prefill.txt 2>&1
echo "gk prefill rc=$? $(el)"; pack; grep -E "prefill check|^\| [0-9]+ \| [0-9]+ \||FAIL|panic|rror" $W/gk_prefill.txt | cut -c1-120
