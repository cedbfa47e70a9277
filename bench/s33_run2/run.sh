# Session 33, lease 2: `cargo xtask gpu-test`'s checks with the one-pass combine (the model's ops, the MoE kernels,
# the GEMV, the prefill GEMM and the prefill attention; `gpu_attention --quick` ran in lease 1), then the Kimi-K2
# slice's decode step (overlapped greedy chain, 10 layers, batch 1 and 8) at 1k and 8k context, one-pass combine on
# and off.
cd .device-s33 && for f in *.gz; do gunzip -f $f; done && chmod +x * && cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w2; rm -rf $W; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w2; }
D=.device-s33; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 150 $D/gpu_ops --json $W/gops.json > $W/gops.txt 2>&1; echo "gpu_ops rc=$? $(el)"; pack
grep -cE "\| true \|$" $W/gops.txt; grep -E "\| false \|$|panic|rror" $W/gops.txt | head -8; tail -1 $W/gops.txt
for p in "gpu_gemv" "gpu_gemm --quick" "gpu_prefill_attention --quick"; do
  n=${p%% *}; timeout 90 $D/$p > $W/$n.txt 2>&1; echo "$p rc=$? $(el)"; pack
  grep -ciE "\| ok|\| true" $W/$n.txt; grep -E "FAIL|false \||panic|rror" $W/$n.txt | head -4 | cut -c1-200
done
dec() {  # name, context, env...
  local n=$1 c=$2; shift 2
  env "$@" timeout 130 $D/bench_decode --splits 1x1 --layers 10 --batch 1,8 --context $c --steps 30 --warmup 4 --overlap \
    --json $W/decode_$n.json > $W/decode_$n.txt 2>&1
  echo "decode $n rc=$? $(el)"; pack; grep -E "^\| 1 \| 1 \| 1 \| (1|8) " $W/decode_$n.txt | head -4 | cut -c1-220
}
timeout 110 $D/gpu_kernels check --quick > $W/gk_check.txt 2>&1; echo "gk check rc=$? $(el)"; pack
grep -cE "\| ok" $W/gk_check.txt; grep -E "FAIL|panic|rror" $W/gk_check.txt | head -5; tail -1 $W/gk_check.txt
dec 1k_new 1024 EYRIE_COMBINE_ONE_PASS=1; dec 8k_new 8192 EYRIE_COMBINE_ONE_PASS=1; dec 8k_old 8192 EYRIE_COMBINE_ONE_PASS=0
