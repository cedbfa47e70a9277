# Sourced by the multi-GPU scripts: NCCL for cudarc, which loads `libnccl.so` at run time. pip's nvidia-nccl
# wheels ship only libnccl.so.2, so a link named libnccl.so is made in a temporary directory put on
# LD_LIBRARY_PATH. NVLink multicast stays off (on a shared host it can put the GPUs out of service).
export NCCL_NVLS_ENABLE=0
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  nccl_lib=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site
dirs = site.getsitepackages() + [site.getusersitepackages()]
hits = [h for d in dirs for h in glob.glob(os.path.join(d, "nvidia", "**", "libnccl.so*"), recursive=True)]
print(sorted(hits)[0] if hits else "")
PY
)
  if [ -z "$nccl_lib" ]; then nccl_lib=$(find / -name 'libnccl.so*' -not -path '/proc/*' 2>/dev/null | head -1); fi
  if [ -n "$nccl_lib" ]; then
    nccl_link=$(mktemp -d)
    ln -sf "$nccl_lib" "$nccl_link/libnccl.so"
    export LD_LIBRARY_PATH="$nccl_link:${LD_LIBRARY_PATH:-}"
    echo "NCCL: $nccl_lib"
  fi
fi
