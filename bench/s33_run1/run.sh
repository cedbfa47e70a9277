# Session 33, lease 1: the one-pass combine (attention_merge::merge_slices) against the three-round one
# (the default; EYRIE_COMBINE_ONE_PASS=1 takes the one-pass) in the quick benchmark at 8 heads (every check with the one-pass merge), the prefill MoE
# probe (scripts/moe_prefill_probe.py: a tiled grouped INT4 GEMM in plain CUDA) beside the engine's prefill MoE
# (`gpu_kernels prefill`) in the same lease, then the combine launches under Nsight Compute (8 x 8k, 8 heads):
# one-pass and three-round at 4 x 128 threads a (row, head), one-pass at 2 and 8 x 128 (EYRIE_COMBINE_HALVES).
cd .device-s33 && for f in *.gz; do gunzip -f $f; done; chmod +x *; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w1; rm -rf $W; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w1; }
D=.device-s33; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
EYRIE_COMBINE_ONE_PASS=1 timeout 150 $D/gpu_attention --quick --heads 8 --json $W/ga8.json > $W/ga8.txt 2>&1; echo "ga8 rc=$? $(el)"; pack
grep -cE " ok \|$" $W/ga8.txt; grep -E "FAIL" $W/ga8.txt | head -5 | cut -c1-250
grep -E "copy bandwidth|^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \|" $W/ga8.txt | cut -c1-250
EYRIE_COMBINE_ONE_PASS=0 timeout 110 $D/gpu_attention --quick --heads 8 --json $W/ga8_old.json > $W/ga8_old.txt 2>&1
echo "ga8 old rc=$? $(el)"; pack; grep -E "copy bandwidth|^\| [0-9]+ \| [0-9]+ \| [0-9.]+ \|" $W/ga8_old.txt | cut -c1-250
timeout 150 python3 scripts/moe_prefill_probe.py --tokens 1024,8192 --json $W/probe.json > $W/probe.txt 2>&1
echo "probe rc=$? $(el)"; pack; tail -14 $W/probe.txt | cut -c1-200
timeout 130 $D/gpu_kernels prefill --m 1024,8192 --json $W/gk_prefill.json > $W/gk_prefill.txt 2>&1
echo "gk prefill rc=$? $(el)"; pack; grep -E "^\| [0-9]+ \| [0-9]+ \||FAIL|rror" $W/gk_prefill.txt | cut -c1-120 | tail -10
for v in "1 4" "0 4" "1 2" "1 8"; do
  set -- $v; tag=p$1_h$2
  EYRIE_COMBINE_ONE_PASS=$1 EYRIE_COMBINE_HALVES=$2 timeout 40 ncu --metrics gpu__time_duration.sum,dram__bytes.sum \
    --csv -k regex:combine $D/gpu_attention --profile 8x8192 --heads 8 > $W/ncu_$tag.csv 2> $W/ncu_$tag.err
  echo "ncu $tag rc=$? $(el)"; grep -E "gpu__time" $W/ncu_$tag.csv | cut -c1-200 | tail -2
done; pack
