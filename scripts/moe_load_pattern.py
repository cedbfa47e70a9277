#!/usr/bin/env python3
"""How fast one token's MoE gate/up weights can be read, by load pattern (issue 4, the MoE at batch 1).

A measurement, not a kernel of ours: three read-only CUDA kernels (NVRTC through `torch.cuda._compile_kernel`)
stream the packed INT4 words and BF16 scales of 8 experts' gate+up rows of Kimi-K2's shape (2 x 2048 rows of 7168
columns: 14.7 MB of words and 1.8 MB of scales an expert), each with a different address pattern:

- `rowtile`: what `moe_mma::expert_mma_kernel` reads from the checkpoint's row-major layout: a warp owns a 16-row
  tile of gate and the matching up tile; for each 128-column block, lane (g, c) loads 16-byte vector 4i + c of rows
  g and g + 8 (8 rows x 64 contiguous bytes an instruction) and their BF16 scales (8 bytes a row);
- `tiled`: the same warps and blocks over a layout repacked so that each 16-row tile's block is 1 KB contiguous
  (an instruction reads 512 contiguous bytes) and its 64 scales 128 contiguous bytes;
- `rows`: a warp streams whole rows (an instruction reads 512 contiguous bytes of one row), the GEMV pattern.

Every launch reads another 8 of 64 experts (940 MB in all, far beyond the 60 MB L2). Prints GB/s per pattern and
k-split (warps sharing a tile's blocks), and torch's copy bandwidth in the same run; `--json PATH` writes them.
"""

import argparse
import json
import sys

import torch

SRC = r"""
#define ROWS 4096      // gate + up rows an expert
#define KV 224         // 16-byte vectors a row (7168 columns / 32)
#define NBLK 56        // 128-column blocks a row
extern "C" __global__ void rowtile(const uint4* __restrict__ w, const unsigned short* __restrict__ s,
                                   const int* __restrict__ experts, unsigned* out, int ksplit) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int g = lane >> 2, c = lane & 3;
  int gw = blockIdx.x * (blockDim.x >> 5) + warp;
  int task = gw / ksplit, part = gw % ksplit;
  int slot = task / 128, j0 = (task % 128) * 16;
  if (slot >= 8) return;
  size_t e = experts[slot];
  unsigned acc = 0;
  #pragma unroll 2
  for (int i = part; i < NBLK; i += ksplit) {
    int v = 4 * i + c;
    #pragma unroll
    for (int mt = 0; mt < 2; mt++) {
      #pragma unroll
      for (int h = 0; h < 2; h++) {
        size_t row = e * ROWS + j0 + mt * 2048 + g + 8 * h;
        uint4 q = w[row * KV + v];
        acc ^= q.x ^ q.y ^ q.z ^ q.w ^ (unsigned)s[row * KV + v];
      }
    }
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}
extern "C" __global__ void tiled(const uint4* __restrict__ w, const unsigned short* __restrict__ s,
                                 const int* __restrict__ experts, unsigned* out, int ksplit) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int gw = blockIdx.x * (blockDim.x >> 5) + warp;
  int task = gw / ksplit, part = gw % ksplit;
  int slot = task / 128, t0 = task % 128;
  if (slot >= 8) return;
  size_t e = experts[slot];
  unsigned acc = 0;
  #pragma unroll 2
  for (int i = part; i < NBLK; i += ksplit) {
    #pragma unroll
    for (int mt = 0; mt < 2; mt++) {
      size_t tile = e * 256 + t0 + mt * 128;
      #pragma unroll
      for (int h = 0; h < 2; h++) {
        size_t at = (tile * NBLK + i) * 64 + h * 32 + lane;
        uint4 q = w[at];
        acc ^= q.x ^ q.y ^ q.z ^ q.w ^ (unsigned)s[at];
      }
    }
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}
extern "C" __global__ void rows(const uint4* __restrict__ w, const unsigned short* __restrict__ s,
                                const int* __restrict__ experts, unsigned* out, int per_warp) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int gw = blockIdx.x * (blockDim.x >> 5) + warp;
  int per_expert = ROWS / per_warp;
  int slot = gw / per_expert;
  if (slot >= 8) return;
  size_t e = experts[slot];
  size_t r0 = e * ROWS + (size_t)(gw % per_expert) * per_warp;
  unsigned acc = 0;
  for (int r = 0; r < per_warp; r++) {
    size_t row = r0 + r;
    #pragma unroll
    for (int i = 0; i < KV / 32; i++) {
      uint4 q = w[row * KV + lane + 32 * i];
      acc ^= q.x ^ q.y ^ q.z ^ q.w ^ (unsigned)s[row * KV + lane + 32 * i];
    }
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}
"""

POOL, USED, ROWS, KV = 64, 8, 4096, 224


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--iters", type=int, default=64)
    args = ap.parse_args()
    dev = torch.device("cuda")
    words = torch.randint(-(2**31), 2**31 - 1, (POOL * ROWS * KV * 4,), dtype=torch.int32, device=dev)
    scales = torch.randint(0, 2**15, (POOL * ROWS * KV,), dtype=torch.int16, device=dev)
    out = torch.zeros(1, dtype=torch.int32, device=dev)
    gen = torch.Generator().manual_seed(7)
    sets = [torch.randperm(POOL, generator=gen)[:USED].to(torch.int32).to(dev) for _ in range(16)]
    bytes_per = USED * ROWS * KV * (16 + 2)

    # torch's copy bandwidth (read + write) in the same run
    a = torch.empty(1 << 28, dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(10):
        b.copy_(a)
    t1.record()
    torch.cuda.synchronize()
    copy_gbs = 2 * a.numel() * 4 * 10 / (t0.elapsed_time(t1) * 1e-3) / 1e9
    del a, b

    try:
        from torch.cuda import _compile_kernel
    except ImportError as e:
        sys.exit(f"torch.cuda._compile_kernel is not in this torch ({torch.__version__}): {e}")
    kern = {name: _compile_kernel(SRC, name) for name in ("rowtile", "tiled", "rows")}

    def timed(name, warps, param, threads=256):
        k = kern[name]
        blocks = (warps * 32 + threads - 1) // threads
        run = lambda i: k(grid=(blocks, 1, 1), block=(threads, 1, 1), args=[words, scales, sets[i % 16], out, param])
        for i in range(4):
            run(i)
        torch.cuda.synchronize()
        t0.record()
        for i in range(args.iters):
            run(i)
        t1.record()
        torch.cuda.synchronize()
        us = t0.elapsed_time(t1) * 1e3 / args.iters
        return us, bytes_per / (us * 1e-6) / 1e9

    rows_out = []
    print(f"copy bandwidth (torch copy_, read + write): {copy_gbs:.0f} GB/s; bytes a launch {bytes_per / 1e6:.1f} MB")
    print("| pattern | k-split / rows a warp | threads | warps | us | GB/s | % of copy |")
    print("|---|---|---|---|---|---|---|")
    cases = [("rowtile", ks, 256) for ks in (1, 2, 3, 4)] + [("tiled", ks, 256) for ks in (1, 2, 3, 4)]
    cases += [("rowtile", 2, 128), ("tiled", 2, 128)]
    cases += [("rows", pw, 256) for pw in (1, 2, 4, 8)]
    for name, p, threads in cases:
        warps = USED * 128 * p if name != "rows" else USED * ROWS // p
        us, gbs = timed(name, warps, p, threads)
        rows_out.append({"pattern": name, "param": p, "threads": threads, "warps": warps, "us": us, "gbs": gbs,
                         "pct_copy": 100 * gbs / copy_gbs})
        print(f"| {name} | {p} | {threads} | {warps} | {us:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbs": copy_gbs,
                       "bytes": bytes_per, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
