#!/usr/bin/env bash
# Runs the multi-GPU tensor/expert parallel check (crates/model/examples/parallel_gpu.rs) on a machine with >= 2
# CUDA GPUs and NCCL, from the repository root: scripts/gpu_parallel.sh BIN [GPUS] [OUT_DIR]
# BIN is the release build of the example:
#   cargo build --release -p eyrie-model --features nccl --example parallel_gpu   (target/release/examples/)
# NCCL: scripts/nccl_env.sh.
set -euo pipefail
bin=${1:?usage: scripts/gpu_parallel.sh BIN [GPUS] [OUT_DIR]}
gpus=${2:-$(nvidia-smi -L | wc -l)}
out=${3:-bench}
source "$(dirname "$0")/nccl_env.sh"
nvidia-smi -L
mkdir -p "$out"
"$bin" --gpus "$gpus" --json "$out/parallel_gpu.json" 2>&1 | tee "$out/parallel_gpu.txt"
