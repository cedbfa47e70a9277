# Session 28, lease 3: the model's GPU op checks with this session's final kernels (down's late PDL wait, the
# function attribute set once at load), then the Kimi-K2 slice's decode step (overlapped greedy chain, batch 1 and
# 8, 1k context, 10 layers) with down's late wait on and off alternated, and the MoE kernel checks.
cd .device-s28 && for f in *.gz; do gunzip -f $f; done && chmod +x * && cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s28; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
timeout 150 $D/gops --json $W/gops.json > $W/gops.txt 2>&1; echo "gpu_ops rc=$? $(el)"; pack
grep -cE "\| true \|$" $W/gops.txt; grep -E "\| false \|$|panic|rror" $W/gops.txt | head -8; tail -1 $W/gops.txt
dec() {  # name, env...
  local n=$1; shift
  env "$@" timeout 90 $D/bd --splits 1x1 --layers 10 --batch 1,8 --context 1024 --steps 30 --warmup 4 --overlap \
    --json $W/decode_$n.json > $W/decode_$n.txt 2>&1
  echo "decode $n rc=$? $(el)"; pack; grep -E "^\| 1 \| 1 \| 1 \| (1|8) " $W/decode_$n.txt | head -4
}
dec late1_1 EYRIE_PDL_LATE=1; dec late0_1 EYRIE_PDL_LATE=0; dec late1_2 EYRIE_PDL_LATE=1; dec late0_2 EYRIE_PDL_LATE=0
timeout 110 $D/gk check --quick > $W/gk_check.txt 2>&1; echo "gk check rc=$? $(el)"; pack
grep -cE "\| ok" $W/gk_check.txt; grep -E "FAIL|panic|rror" $W/gk_check.txt | head -5; tail -1 $W/gk_check.txt
