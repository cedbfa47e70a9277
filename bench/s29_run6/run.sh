# Run in session 30 as part of bench/s30_run1 (the `--kernel-copy` rows there: 61.2-61.7 us, as behind cudaMemcpyAsync).
# Session 29, prepared for the next lease (not run: the session's device time was spent): the layers queued behind a
# copy *kernel* launched with PDL, as the engine's benchmark queues them (`--kernel-copy`), against cudaMemcpyAsync
# (the probe's default). Session 29 found every stage of the engine's layer 4.5-8 us a call slower than the same
# CUBINs launched from the probe (bench/REPORT.md, "Session 29"); if the copy in front is the cause, the
# `--kernel-copy` rows rise to the engine's (stage rows: split + gate/up ~44.9, down ~28, combine ~5 us a call).
# CUBINs: `cargo xtask kernels --arch sm_90 --only "<label>" --dump DIR` for the four labels of `pdl_probe.CUBINS`,
# the down also with EYRIE_PDL_LATE=0 into DIR_ENTRY (session 29 carried them in .device-s29/cub, cub_entry).
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s29; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
i=0
for flag in "--kernel-copy" "" "--kernel-copy"; do
  i=$((i+1))
  timeout 100 python3 scripts/pdl_probe.py --cubecl $D/cub --cubecl-entry $D/cub_entry $flag --json $W/pdl_$i.json \
    > $W/pdl_$i.txt 2>&1; echo "pdl_probe $i '$flag' rc=$? $(el)"; pack; grep -E "^copy|cubecl" $W/pdl_$i.txt | grep -v "^kernels"
done
