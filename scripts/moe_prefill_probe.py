#!/usr/bin/env python3
"""What a tiled grouped INT4 GEMM could make of a prefill chunk's MoE layer (issue 4, deliverable 1's prefill path).

A measurement, not a kernel of ours. The engine runs a prefill chunk's experts with `moe_mma::expert_mma_kernel`,
8 or 16 tokens a pass over each expert's weights (no shared-memory tiles): a Kimi-K2 MoE layer of 8192 tokens took
115 ms (50 TFLOP/s of useful work, bench/REPORT.md session 13). This probe times the textbook alternative in plain
CUDA at the engine's precision, so the next kernel of ours has a measured target:

- the activations split once into three exact BF16 parts (`x = hi + mid + lo`, each part the previous remainder
  with its low 16 bits cut, as the engine's `split_x3`), stored `[rows, 3, K]`;
- a block tile of 64 token-expert pairs of one expert x 128 output rows, 32 columns a stage (one scale group):
  the activations' three parts reach shared memory by `cp.async` (rows gathered through the pairs' token index, two
  stages), the stage's INT4 words and scales are loaded into registers one stage ahead and dequantized into shared
  memory as `bf16((u - 8) * scale)` (compressed-tensors' rounding, as the engine), 4 warps of 32 x 64 take their
  fragments by `ldmatrix`;
- `mma.sync.m16n8k16` (BF16, f32 accumulation), three products a weight (one a part); each stage's 6 MMAs an
  accumulator start from zero and are added into f32 registers (short tensor-core chains, as the engine's kernels).

Stages: gate/up (`[pairs, 7168] x [4096, 7168]^T`, rows gathered by token) and down (`[pairs, 2048] x [7168,
2048]^T`), over `--experts` experts of Kimi-K2's shape with uniform random top-8 routing of `--tokens` tokens.
Checked: sampled rows of each stage against a float64 reference over the same dequantized weights and the
unsplit f32 activations (norm-wise relative error, must be under 1e-5). Prints ms a stage, useful TFLOP/s
(`2 pairs N K`), and the BF16 MMA rate it implies (3x); `--json PATH` writes them. Needs nvcc and an sm_90 GPU.

usage: python3 scripts/moe_prefill_probe.py [--tokens 1024,8192] [--experts 384] [--json OUT]
"""

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

HIDDEN, INTER, TOPK, GROUP = 7168, 2048, 8, 32

SRC = r"""
#include <cuda_runtime.h>
#include <cstdint>

#define BM 64
#define BN 128
#define BK 32
#define ROWP 40  // bf16 elements a shared row: 32 + 8 of padding (80 bytes: ldmatrix rows on distinct banks)

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  unsigned n = valid ? 16u : 0u;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(smem_u32(dst)), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

__device__ __forceinline__ void ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(smem_u32(p)));
}

__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// f32 -> bf16 bits, round to nearest even (the products dequantized here are finite).
__device__ __forceinline__ unsigned bf16_rne(float f) {
  unsigned u = __float_as_uint(f);
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// x [rows, K] f32 -> xs [rows, 3, K] bf16 bits: hi, mid, lo (each the remainder's high 16 bits).
extern "C" __global__ void split3(const float* __restrict__ x, uint16_t* __restrict__ xs, long rows, int K) {
  long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * K) return;
  long r = i / K; int k = (int)(i % K);
  float v = x[i];
  unsigned hi = __float_as_uint(v) >> 16;
  float r1 = v - __uint_as_float(hi << 16);
  unsigned mid = __float_as_uint(r1) >> 16;
  float r2 = r1 - __uint_as_float(mid << 16);
  unsigned lo = __float_as_uint(r2) >> 16;
  uint16_t* o = xs + r * 3 * (long)K + k;
  o[0] = (uint16_t)hi; o[K] = (uint16_t)mid; o[2 * (long)K] = (uint16_t)lo;
}

// out [pairs, N] = rows xrow[p] of xs times expert e's dequantized W [N, K]^T, for every tile
// (expert, first pair, pairs) of `tiles`; grid (N / BN, tiles).
extern "C" __global__ void __launch_bounds__(128, 2)
grouped_gemm(const uint16_t* __restrict__ xs, const uint32_t* __restrict__ wq, const uint16_t* __restrict__ wscale,
             const int* __restrict__ tiles, const int* __restrict__ xrow, float* __restrict__ out, int N, int K) {
  __shared__ __align__(16) uint16_t sa[2][3][BM][ROWP];
  __shared__ __align__(16) uint16_t sb[BN][ROWP];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 1, wn = warp & 1;
  const int e = tiles[3 * blockIdx.y], p0 = tiles[3 * blockIdx.y + 1], cnt = tiles[3 * blockIdx.y + 2];
  const int n0 = blockIdx.x * BN;
  const int KT = K / BK;

  // This thread's 6 activation copies a stage: chunk c = tid + 128 i -> part c / 256, row (c % 256) / 4, 16-byte
  // quarter c % 4 of the stage's 32 columns.
  const uint16_t* asrc[6];
  bool aok[6];
#pragma unroll
  for (int i = 0; i < 6; i++) {
    int c = tid + 128 * i, part = c >> 8, row = (c & 255) >> 2, q = c & 3;
    aok[i] = row < cnt;
    long xr = aok[i] ? (long)xrow[p0 + row] : 0;
    asrc[i] = xs + (xr * 3 + part) * (long)K + q * 8;
  }
  auto load_a = [&](int kt, int st) {
#pragma unroll
    for (int i = 0; i < 6; i++) {
      int c = tid + 128 * i, part = c >> 8, row = (c & 255) >> 2, q = c & 3;
      cp_async16(&sa[st][part][row][q * 8], asrc[i] + kt * BK, aok[i]);
    }
  };
  // Weight row n0 + tid: 4 words (32 columns) and one scale a stage.
  const uint4* wrow = reinterpret_cast<const uint4*>(wq + ((long)e * N + n0 + tid) * (K / 8));
  const uint16_t* srow = wscale + ((long)e * N + n0 + tid) * (K / 32);

  float acc[2][8][4];
#pragma unroll
  for (int a = 0; a < 2; a++)
#pragma unroll
    for (int b = 0; b < 8; b++)
#pragma unroll
      for (int c = 0; c < 4; c++) acc[a][b][c] = 0.f;

  load_a(0, 0);
  cp_commit();
  uint4 wnext = __ldg(wrow);
  uint16_t snext = __ldg(srow);

  for (int kt = 0; kt < KT; kt++) {
    const int st = kt & 1;
    __syncthreads();  // every warp is done with sb and sa[st ^ 1] (stage kt - 1)
    if (kt + 1 < KT) load_a(kt + 1, st ^ 1);
    cp_commit();
    {
      // Dequantize this stage's row: bf16((u - 8) * scale), two columns a word of shared memory.
      const float s = __uint_as_float((unsigned)snext << 16);
      const unsigned w4[4] = {wnext.x, wnext.y, wnext.z, wnext.w};
      unsigned packed[16];
#pragma unroll
      for (int j = 0; j < 4; j++)
#pragma unroll
        for (int h = 0; h < 4; h++) {
          int u0 = (w4[j] >> (8 * h)) & 0xf, u1 = (w4[j] >> (8 * h + 4)) & 0xf;
          packed[4 * j + h] = bf16_rne((float)(u0 - 8) * s) | (bf16_rne((float)(u1 - 8) * s) << 16);
        }
      uint4* dst = reinterpret_cast<uint4*>(&sb[tid][0]);
#pragma unroll
      for (int v = 0; v < 4; v++)
        dst[v] = make_uint4(packed[4 * v], packed[4 * v + 1], packed[4 * v + 2], packed[4 * v + 3]);
    }
    if (kt + 1 < KT) { wnext = __ldg(wrow + kt + 1); snext = __ldg(srow + kt + 1); }
    cp_wait<1>();
    __syncthreads();  // sb and sa[st] are visible

    float part[2][8][4];
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
      for (int b = 0; b < 8; b++)
#pragma unroll
        for (int c = 0; c < 4; c++) part[a][b][c] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 2; ks++) {
      unsigned bf[8][2];
#pragma unroll
      for (int j = 0; j < 4; j++) {
        int n = wn * 64 + j * 16 + (lane >> 4) * 8 + (lane & 7);
        int k = ks * 16 + ((lane >> 3) & 1) * 8;
        ldsm_x4(bf[2 * j][0], bf[2 * j][1], bf[2 * j + 1][0], bf[2 * j + 1][1], &sb[n][k]);
      }
#pragma unroll
      for (int p = 2; p >= 0; p--) {  // lo, mid, hi: the small products first
#pragma unroll
        for (int m = 0; m < 2; m++) {
          unsigned af[4];
          int row = wm * 32 + m * 16 + (lane & 15);
          int k = ks * 16 + (lane >> 4) * 8;
          ldsm_x4(af[0], af[1], af[2], af[3], &sa[st][p][row][k]);
#pragma unroll
          for (int j = 0; j < 8; j++) mma_bf16(part[m][j], af, bf[j][0], bf[j][1]);
        }
      }
    }
#pragma unroll
    for (int a = 0; a < 2; a++)
#pragma unroll
      for (int b = 0; b < 8; b++)
#pragma unroll
        for (int c = 0; c < 4; c++) acc[a][b][c] += part[a][b][c];
  }

  const int g = lane >> 2, c4 = lane & 3;
#pragma unroll
  for (int m = 0; m < 2; m++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      int row = wm * 32 + m * 16 + g + 8 * h;
      if (row < cnt) {
        float* o = out + (long)(p0 + row) * N + n0 + wn * 64 + 2 * c4;
#pragma unroll
        for (int j = 0; j < 8; j++)
          *reinterpret_cast<float2*>(o + j * 8) = make_float2(acc[m][j][2 * h], acc[m][j][2 * h + 1]);
      }
    }
}

extern "C" int launch_split(const float* x, uint16_t* xs, long rows, int K) {
  long n = rows * K;
  split3<<<(unsigned)((n + 255) / 256), 256>>>(x, xs, rows, K);
  return (int)cudaGetLastError();
}

extern "C" int launch_gemm(const uint16_t* xs, const uint32_t* wq, const uint16_t* ws, const int* tiles, int ntiles,
                           const int* xrow, float* out, int N, int K) {
  dim3 grid(N / BN, ntiles);
  grouped_gemm<<<grid, 128>>>(xs, wq, ws, tiles, xrow, out, N, K);
  return (int)cudaGetLastError();
}
"""


def build(workdir):
    """The probe's shared library (nvcc, sm_90a), loaded with ctypes."""
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        sys.exit("moe_prefill_probe: nvcc not found (run it on the GPU machine)")
    cu, so = os.path.join(workdir, "probe.cu"), os.path.join(workdir, "probe.so")
    with open(cu, "w") as f:
        f.write(SRC)
    built = subprocess.run([nvcc, "-O3", "-std=c++17", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC",
                            "-Xptxas", "-v", "-o", so, cu], capture_output=True, text=True)
    if built.returncode != 0:
        sys.exit(f"moe_prefill_probe: nvcc failed:\n{built.stderr[-4000:]}")
    for line in built.stderr.splitlines():
        if "registers" in line or "spill" in line:
            print("ptxas:", line.strip())
    lib = ctypes.CDLL(so)
    lib.launch_split.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    lib.launch_gemm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib


def dequant(wq, ws, e):
    """Expert e's weights as compressed-tensors decompresses them: bf16((u - 8) * scale), as float64."""
    words = wq[e].to(torch.int64) & 0xFFFFFFFF  # [N, K / 8]
    shifts = torch.arange(8, device=wq.device, dtype=torch.int64) * 4
    u = ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(words.shape[0], -1)  # [N, K]
    scale = ws[e].view(torch.bfloat16).float().repeat_interleave(GROUP, dim=1)
    return ((u - 8).float() * scale).to(torch.bfloat16).double()


def routing(tokens, experts, gen, dev):
    """Uniform random top-8 routing: the pairs sorted by expert, each pair's token, and the tiles (expert, first
    pair, pairs <= 64)."""
    scores = torch.rand(tokens, experts, generator=gen, device="cpu")
    ids = scores.topk(TOPK, dim=1).indices.reshape(-1)  # pair t * 8 + j
    order = torch.argsort(ids, stable=True)
    tok = (order // TOPK).to(torch.int32)
    counts = torch.bincount(ids, minlength=experts).tolist()
    tiles, p = [], 0
    for e, c in enumerate(counts):
        for i in range(0, c, 64):
            tiles.append((e, p + i, min(64, c - i)))
        p += c
    return tok.to(dev), torch.tensor(tiles, dtype=torch.int32, device=dev), counts


def timed(fn, reps=7):
    """Median GPU ms of `fn` over `reps` runs after one warm-up (CUDA events on the current stream)."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def check(lib_out, x_rows, wq, ws, tiles, n, label, gen):
    """Norm-wise relative error of 32 sampled rows (from 8 tiles) against float64."""
    worst = 0.0
    picks = torch.randint(0, tiles.shape[0], (8,), generator=gen).tolist()
    for t in picks:
        e, p0, cnt = tiles[t].tolist()
        w = dequant(wq, ws, e)
        for r in range(0, cnt, max(1, cnt // 4)):
            want = x_rows(p0 + r).double() @ w.T
            got = lib_out[p0 + r].double()
            worst = max(worst, ((got - want).norm() / want.norm()).item())
    ok = worst < 1e-5
    print(f"check {label}: worst norm-wise relative error {worst:.2e} over sampled rows ({'ok' if ok else 'FAIL'})")
    return worst, ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--experts", type=int, default=384)
    ap.add_argument("--json")
    args = ap.parse_args()
    try:
        token_counts = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        sys.exit(f"--tokens: {args.tokens!r} is not a comma list of counts")
    if args.experts < TOPK or any(t < 1 for t in token_counts):
        sys.exit(f"--experts at least {TOPK}, --tokens at least 1")
    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(7)
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(tmp)
        E = args.experts
        # Random INT4 words (every nibble) and positive BF16 scales of the checkpoint's magnitude.
        wq_gu = torch.randint(-2**31, 2**31 - 1, (E, 2 * INTER, HIDDEN // 8), dtype=torch.int32, device=dev)
        wq_dn = torch.randint(-2**31, 2**31 - 1, (E, HIDDEN, INTER // 8), dtype=torch.int32, device=dev)
        ws_gu = (torch.rand(E, 2 * INTER, HIDDEN // GROUP, device=dev) * 0.01 + 0.002).to(torch.bfloat16).view(torch.int16)
        ws_dn = (torch.rand(E, HIDDEN, INTER // GROUP, device=dev) * 0.01 + 0.002).to(torch.bfloat16).view(torch.int16)
        rows = []
        failed = False
        print("| tokens | pairs | tiles | stage | ms | useful TFLOP/s | BF16 MMA TFLOP/s |\n|---|---|---|---|---|---|---|")
        for T in token_counts:
            tok, tiles, _ = routing(T, E, gen, dev)
            pairs = T * TOPK
            x = torch.randn(T, HIDDEN, device=dev)
            xs = torch.empty(T, 3, HIDDEN, dtype=torch.int16, device=dev)
            h = torch.randn(pairs, INTER, device=dev)
            hs = torch.empty(pairs, 3, INTER, dtype=torch.int16, device=dev)
            ident = torch.arange(pairs, dtype=torch.int32, device=dev)
            y_gu = torch.empty(pairs, 2 * INTER, device=dev)
            y_dn = torch.empty(pairs, HIDDEN, device=dev)

            def split(src, dst, n_rows, k):
                assert lib.launch_split(src.data_ptr(), dst.data_ptr(), n_rows, k) == 0

            def gemm(src, wq, ws, xrow, out, n, k):
                assert lib.launch_gemm(src.data_ptr(), wq.data_ptr(), ws.data_ptr(), tiles.data_ptr(),
                                       tiles.shape[0], xrow.data_ptr(), out.data_ptr(), n, k) == 0

            stages = [
                ("split x", lambda: split(x, xs, T, HIDDEN), 0),
                ("gate/up", lambda: gemm(xs, wq_gu, ws_gu, tok, y_gu, 2 * INTER, HIDDEN), 2 * pairs * 2 * INTER * HIDDEN),
                ("split h", lambda: split(h, hs, pairs, INTER), 0),
                ("down", lambda: gemm(hs, wq_dn, ws_dn, ident, y_dn, HIDDEN, INTER), 2 * pairs * HIDDEN * INTER),
            ]
            total = 0.0
            for name, fn, flops in stages:
                ms = timed(fn)
                total += ms
                tf = flops / ms / 1e9 if flops else 0.0
                print(f"| {T} | {pairs} | {tiles.shape[0]} | {name} | {ms:.3f} | {tf:.1f} | {3 * tf:.1f} |")
                rows.append({"tokens": T, "pairs": pairs, "tiles": tiles.shape[0], "stage": name, "ms": ms,
                             "useful_tflops": tf})
            useful = 2 * pairs * 3 * INTER * HIDDEN
            print(f"| {T} | {pairs} | {tiles.shape[0]} | all four | {total:.3f} | {useful / total / 1e9:.1f} | "
                  f"{3 * useful / total / 1e9:.1f} |")
            rows.append({"tokens": T, "stage": "all", "ms": total, "useful_tflops": useful / total / 1e9})
            torch.cuda.synchronize()
            _, ok1 = check(y_gu, lambda p: x[tok[p].item()], wq_gu, ws_gu, tiles.cpu(), 2 * INTER,
                           f"gate/up {T}", gen)
            _, ok2 = check(y_dn, lambda p: h[p], wq_dn, ws_dn, tiles.cpu(), HIDDEN, f"down {T}", gen)
            failed |= not (ok1 and ok2)
            del x, xs, h, hs, y_gu, y_dn
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "experts": args.experts,
                       "rows": rows}, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
