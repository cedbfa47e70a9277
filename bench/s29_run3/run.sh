# Session 29, lease 3: the same CubeCL sources (`cargo xtask kernels --dump`) compiled on the GPU machine by its NVRTC
# (CUDA 13.0) the way the engine does (PTX, loaded and JIT-compiled by the driver) and to a CUBIN, each launched from
# the probe's harness beside the NVRTC 12.8 CUBINs of lease 1; then the engine's layer loading its kernels from
# NVRTC's CUBIN (EYRIE_NVRTC_CUBIN=1, this session's default) and from the PTX (=0), alternated.
cd .device-s29 && gunzip -f gk.gz 2>/dev/null; chmod +x gk; cd ..
export LD_LIBRARY_PATH=/usr/local/cuda/lib64
W=/tmp/w; mkdir -p $W; pack() { tar -C /tmp -czf $OUT/run.tgz w; }
D=.device-s29; T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s]"; }
NV=$(ls /usr/local/cuda/lib64/libnvrtc.so* | head -1); echo "NVRTC $NV"; ls /usr/local/cuda/include | grep -i cccl
OPTS="--gpu-architecture=sm_90a --include-path=/usr/local/cuda/include -lineinfo"
[ -d /usr/local/cuda/include/cccl ] && OPTS="$OPTS --include-path=/usr/local/cuda/include/cccl"
for kind in ptx cubin; do
  mkdir -p $D/n13$kind $D/n13${kind}_entry
  for f in $D/src/*.cu; do
    b=$(basename $f .cu); o=$D/n13$kind/$b.$kind
    case $b in entry_*) o=$D/n13${kind}_entry/${b#entry_}.$kind;; esac
    k=""; [ $kind = ptx ] && k=--ptx
    python3 scripts/nvrtc_compile.py --nvrtc $NV $k $f $o -- $OPTS --ptxas-options=-v 2>&1 | tail -2
  done
done
for v in n13ptx cub n13cubin n12ptx n13ptx; do
  timeout 120 python3 scripts/pdl_probe.py --cubecl $D/$v --cubecl-entry $D/${v}_entry --json $W/pdl_$v.json \
    > $W/pdl_$v.txt 2>&1; echo "pdl_probe $v rc=$? $(el)"; pack; grep -E "cubecl \|" $W/pdl_$v.txt
done
for c in 0 1 0 1; do
  EYRIE_NVRTC_CUBIN=$c timeout 90 $D/gk bench --m 1 --no-sweep --json $W/gk_m1_cubin$c.json > $W/gk_m1_cubin$c.txt 2>&1
  echo "gk m1 EYRIE_NVRTC_CUBIN=$c rc=$? $(el)"; cat $W/gk_m1_cubin$c.txt >> $W/gk_all.txt; pack
  grep -E "^\| 1 \||^\(m = 1" $W/gk_m1_cubin$c.txt | cut -c1-200
done
# Notes: `gk_all.txt` holds the four engine runs in order (the per-switch files keep the second of each). The
# EYRIE_NVRTC_CUBIN switch was a patch of this lease's binary only (vendored cubecl-cuda `context.rs`: load NVRTC's
# CUBIN via nvrtcGetCUBIN instead of the PTX); it measured no difference (69.0 / 68.8 us against 66.4 / 69.4) and was
# not kept. The lease ran an earlier copy of `scripts/nvrtc_compile.py` (the same NVRTC calls, positional arguments;
the command above is the committed script's) for the n13* kernels, and here the n12ptx ones (NVRTC 12.8); the sources are the
# `--dump` .cu files, the down waiting at its entry dumped with EYRIE_PDL_LATE=0.
