#!/usr/bin/env bash
# Runs the multi-GPU tensor/expert parallel check (crates/model/examples/parallel_gpu.rs) on a machine with >= 2
# CUDA GPUs and NCCL, from the repository root: scripts/gpu_parallel.sh BIN [GPUS] [OUT_DIR]
# BIN is the release build of the example:
#   cargo build --release -p eyrie-model --features nccl --example parallel_gpu   (target/release/examples/)
# NCCL is loaded at run time as libnccl.so; pip's nvidia-nccl wheels ship only libnccl.so.2, so a link named
# libnccl.so is made in a temporary directory put on LD_LIBRARY_PATH.
set -euo pipefail
bin=${1:?usage: scripts/gpu_parallel.sh BIN [GPUS] [OUT_DIR]}
gpus=${2:-$(nvidia-smi -L | wc -l)}
out=${3:-bench}
# NVLink multicast stays off (a shared host's GPUs can be put out of service by it).
export NCCL_NVLS_ENABLE=0
if ! ldconfig -p 2>/dev/null | grep -q 'libnccl\.so '; then
  lib=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site
dirs = site.getsitepackages() + [site.getusersitepackages()]
hits = [h for d in dirs for h in glob.glob(os.path.join(d, "nvidia", "**", "libnccl.so*"), recursive=True)]
print(sorted(hits)[0] if hits else "")
PY
)
  if [ -z "$lib" ]; then lib=$(find / -name 'libnccl.so*' -not -path '*/proc/*' 2>/dev/null | head -1); fi
  if [ -n "$lib" ]; then
    link=$(mktemp -d)
    ln -sf "$lib" "$link/libnccl.so"
    export LD_LIBRARY_PATH="$link:${LD_LIBRARY_PATH:-}"
    echo "NCCL: $lib"
  fi
fi
nvidia-smi -L
mkdir -p "$out"
"$bin" --gpus "$gpus" --json "$out/parallel_gpu.json" 2>&1 | tee "$out/parallel_gpu.txt"
