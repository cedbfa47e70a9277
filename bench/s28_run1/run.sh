# Session 28, lease 1: the combine fused into down and down's late PDL wait (after its first weight loads),
# checked and timed; a stream-operation trace of the one-token layer; the plain-CUDA PDL probe in the same lease.
# Binaries in .device-s28 (gk = gpu_kernels, this session's head).
cd .device-s28 && for f in *.gz; do gunzip -f $f; done && chmod +x * && cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s28; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
# 1. Correctness: every quick MoE check, with the fused-combine bit-identity rows.
timeout 120 $D/gk check --quick > $W/gk_check.txt 2>&1; echo "gk check rc=$? $(el)"; pack
grep -cE "\| ok" $W/gk_check.txt; grep -E "FAIL|fused combine|panic|rror" $W/gk_check.txt | head -14; tail -2 $W/gk_check.txt
# 2. The one-token layer: late wait on (default) and off, each with fused combine on/off inside.
for late in 1 0; do
  EYRIE_PDL_LATE=$late timeout 110 $D/gk bench --m 1 --json $W/gk_m1_late$late.json > $W/gk_m1_late$late.txt 2>&1
  echo "gk bench late=$late rc=$? $(el)"; pack; grep -E "^\| 1 \||^\(m = 1|best" $W/gk_m1_late$late.txt | cut -c1-400
done
# 3. The plain-CUDA probe in this lease.
timeout 120 python3 scripts/pdl_probe.py --json $W/pdl.json > $W/pdl.txt 2>&1; echo "pdl_probe rc=$? $(el)"; pack; cat $W/pdl.txt
# 4. The stream trace of the same bench (its own process; timings with the trace's cost).
EYRIE_TRACE_STREAM=$W/trace.tsv timeout 110 $D/gk bench --m 1 > $W/gk_m1_trace.txt 2>&1; echo "gk trace rc=$? $(el)"
gzip -f $W/trace.tsv; pack; ls -la $W
grep -E "^\| 1 \||^\(m = 1" $W/gk_m1_trace.txt | cut -c1-300
