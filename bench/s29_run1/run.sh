# Session 29, lease 1: CubeCL's own one-token layer kernels (the CUBINs `cargo xtask kernels --arch sm_90 --dump`
# writes) launched from the plain-CUDA probe's harness, all four and each expert kernel alone among the plain-CUDA
# ones; again with gate/up recompiled at 72 registers (`__maxnreg__(72)` for `__launch_bounds__(768)`, NVRTC 12.8);
# the engine's layer benchmark for reference; the shared-memory attribute's host time (session 28's run4).
cd .device-s29 && gunzip -f gk.gz && chmod +x gk && cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s29; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
for v in cub cub72 cub; do  # (the third run overwrites the first one's files)
  timeout 170 python3 scripts/pdl_probe.py --cubecl $D/$v --cubecl-entry $D/cub_entry --json $W/pdl_$v.json \
    > $W/pdl_$v.txt 2>&1; echo "pdl_probe $v rc=$? $(el)"; pack; cat $W/pdl_$v.txt
done
for a in 0 1; do
  EYRIE_FUNC_ATTR_EACH_LAUNCH=$a EYRIE_TRACE_STREAM=$W/trace_attr$a.tsv timeout 90 $D/gk bench --m 1 --no-sweep \
    --json $W/gk_attr$a.json > $W/gk_attr$a.txt 2>&1; echo "gk attr_each=$a rc=$? $(el)"; gzip -f $W/trace_attr$a.tsv; pack
  grep -E "^\| 1 \||^\(m = 1|^routings" $W/gk_attr$a.txt | cut -c1-200
done
