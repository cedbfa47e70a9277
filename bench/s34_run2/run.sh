# Session 34, lease 2: the tiled grouped GEMM of prefill chunks (`moe_tiled`, MoeConfig::tiled_gemm) in
# `gpu_kernels prefill`: its checks (three shapes, both weight layouts, groups 32 and 64) beside every tokens-a-pass
# check, then a Kimi-K2 layer at 1024..8192 tokens by tokens a pass and tiled ("0"), then the quick check set.
cd .device-s34 && for f in *.gz; do gunzip -f $f; done; chmod +x *; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w2; rm -rf $W; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w2; }
D=.device-s34; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 300 $D/gpu_kernels prefill --m 1024,2048,4096,8192 --json $W/gk_prefill.json > $W/gk_prefill.txt 2>&1
echo "gk prefill rc=$? $(el)"; pack; grep -E "prefill check|^\| [0-9]+ \| [0-9]+ \||FAIL|panic|rror" $W/gk_prefill.txt | cut -c1-170
timeout 200 $D/gpu_kernels check --quick > $W/gk_check.txt 2>&1; echo "gk check rc=$? $(el)"; pack
grep -cE "\| ok" $W/gk_check.txt; grep -E "FAIL|panic|rror" $W/gk_check.txt | head -5; tail -2 $W/gk_check.txt
