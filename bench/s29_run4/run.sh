# Session 29, lease 4: what differs between the engine's layer benchmark and the probe's harness, with the same
# CUBINs. (1) The routing buffers: the engine's benchmark cycles 16 routings uploaded into buffers of their own, so
# after the 2 GiB copy each layer's first reads of its routing miss L2; the probe's layers share theirs
# (--cold-routing gives each its own). (2) The allocator: CubeCL allocates with cuMemAllocAsync, the probe with
# cudaMalloc (--malloc-async: cudaMallocAsync; EYRIE_MALLOC_SYNC=1: the engine with cuMemAlloc).
# Then the engine's layer with one routing for every call (--routings 1: its buffers stay in L2) against 16.
cd .device-s29 && for f in *.gz; do gunzip -f $f; done; chmod +x gk gops bd; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s29; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
i=0
for flag in "" "--cold-routing" "--malloc-async" "--cold-routing"; do
  i=$((i+1))
  timeout 120 python3 scripts/pdl_probe.py --cubecl $D/cub --cubecl-entry $D/cub_entry $flag --json $W/pdl_$i.json \
    > $W/pdl_$i.txt 2>&1; echo "pdl_probe $i '$flag' rc=$? $(el)"; pack; grep -E "pdl_early" $W/pdl_$i.txt
done
i=0
for cfg in "0 16" "0 1" "1 16" "0 16" "0 1"; do
  set -- $cfg; i=$((i+1))
  EYRIE_MALLOC_SYNC=$1 timeout 90 $D/gk bench --m 1 --no-sweep --routings $2 --json $W/gk_$i.json > $W/gk_$i.txt 2>&1
  echo "gk $i EYRIE_MALLOC_SYNC=$1 routings=$2 rc=$? $(el)"; pack; grep -E "^\| 1 \||^\(m = 1: GPU" $W/gk_$i.txt | cut -c1-200
done
i=0
for s in 1 0; do
  i=$((i+1))
  EYRIE_MALLOC_SYNC=$s timeout 120 $D/bd --splits 1x1 --layers 10 --batch 1,8 --context 1024 --steps 30 --warmup 4 \
    --overlap --json $W/decode_$i.json > $W/decode_$i.txt 2>&1; echo "decode $i EYRIE_MALLOC_SYNC=$s rc=$? $(el)"; pack
  grep -E "^\|" $W/decode_$i.txt | tail -4 | cut -c1-220
done
# Note: EYRIE_MALLOC_SYNC was a switch of this lease's binary only (`malloc_sync_switch.patch`, vendored cubecl-cuda
# `storage/gpu.rs`); it measured no difference (68.0 us against 68.5 / 68.8; decode 2.509 / 2.505 ms) and was not kept.
