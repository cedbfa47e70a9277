# Session 27, lease 3: programmatic dependent launch (vendored cubecl-cuda, on by default; EYRIE_PDL=0 off).
# Binaries in .device-next (this session's head: bench_decode, gpu_ops, gpu_kernels, gpu_attention).
cd .device-next && for f in *.gz; do gunzip -f $f; done && chmod +x * && cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-next; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
# 1. Correctness with PDL on: every gpu_ops row, the MoE kernel check, the attention check.
timeout 150 $D/gpu_ops --json $W/gops.json > $W/gops.txt 2>&1; echo "gpu_ops rc=$? $(el)"; pack
grep -cE "\| true \|$" $W/gops.txt; grep -E "\| false \|$|panic|rror" $W/gops.txt | head -8
timeout 90 $D/gk check --quick > $W/gk_check.txt 2>&1; echo "gk check rc=$? $(el)"; pack; tail -3 $W/gk_check.txt
timeout 90 $D/ga --quick > $W/ga_quick.txt 2>&1; echo "ga rc=$? $(el)"; pack; grep -ciE "\| ok" $W/ga_quick.txt; grep -iE "mismatch|fail|off\b" $W/ga_quick.txt | head -5; tail -2 $W/ga_quick.txt
# 2. The slice's decode step, PDL off and on alternated (overlapped greedy chain, batch 1 and 8, 1k).
for i in 1 2; do for p in 0 1; do
  EYRIE_PDL=$p timeout 100 $D/bd --splits 1x1 --layers 10 --batch 1,8 --context 1024 --steps 30 --warmup 4 --overlap \
    --json $W/decode_pdl${p}_$i.json > $W/decode_pdl${p}_$i.txt 2>&1
  echo "decode pdl=$p $i rc=$? $(el)"; pack; grep -E "^\| 1 \| 1 \| 1 \| (1|8) " $W/decode_pdl${p}_$i.txt | head -4
done; done
# 3. The MoE layer at one token (gpu_kernels bench --m 1), PDL off and on.
for p in 0 1; do
  EYRIE_PDL=$p timeout 100 $D/gk bench --m 1 --json $W/gk_m1_pdl$p.json > $W/gk_m1_pdl$p.txt 2>&1
  echo "gk bench pdl=$p rc=$? $(el)"; pack; grep -E "^\| 1 \||^\(m = 1" $W/gk_m1_pdl$p.txt
done
