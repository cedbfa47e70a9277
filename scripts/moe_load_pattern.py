#!/usr/bin/env python3
"""How fast one token's MoE expert weights can be read, by load pattern (issue 4, the MoE at batch 1).

A measurement, not a kernel of ours: read-only CUDA kernels (NVRTC through `torch.cuda._compile_kernel`) stream the
packed INT4 words and BF16 scales of 8 experts' matrices of Kimi-K2's shape, each with a different address pattern.
`--matrix gate_up` (default): gate+up rows, 2 x 2048 rows of 7168 columns (14.7 MB of words and 1.8 MB of scales
an expert); `--matrix down`: 7168 rows of 2048 columns (7.3 MB and 0.9 MB). Patterns:

- `rowtile`: what `moe_mma::expert_mma_kernel` reads from the checkpoint's row-major layout: a warp owns a 16-row
  tile (gate/up: of gate and the matching up tile); for each 128-column block, lane (g, c) loads 16-byte vector
  4i + c of rows g and g + 8 (8 rows x 64 contiguous bytes an instruction) and their BF16 scales;
- `tiled`: the same warps and blocks over the layout the kernel reads now (`experts::tiled_vector`: each 16-row
  tile's block 1 KB contiguous, an instruction 512 contiguous bytes), `ksplit` warps a task taking every
  `ksplit`-th block;
- `rot`: `tiled`, each warp starting at its task's index (mod its block count) and wrapping: tasks side by side
  read different offsets of their tiles;
- `chunk`: `tiled`, the `ksplit` warps of a task each taking a contiguous run of blocks instead of every
  `ksplit`-th;
- `deep4`: `tiled` with four blocks' loads issued before any is used (more bytes in flight a warp);
- `bmajor`: the kernel's warps over a layout that stores block i of every tile of an expert side by side (warps at
  the same offset read neighbouring kilobytes);
- `rows`: a warp streams whole rows (an instruction reads 512 contiguous bytes of one row), the GEMV pattern;
- `flat`: the same bytes read as one contiguous stream per expert, four 16-byte loads a thread in flight (no
  structure: what one launch of this size reaches);
- the ladder from `tiled` to the kernel's loads-alone launch, one step a level, at the one-token launch shape:
  `kchain` (behind the kernel's chain of routing reads), `kx` (and the activations' loads), `kred` (and the k-split
  reduction with its two barriers), `kpipe` (and the kernel's explicit one-block-ahead double buffer), `kmma` (and
  the kernel's dequantization and MMAs: the expert kernel in plain CUDA, less its scale layout and epilogue);
  `kred`'s shared memory is sized for the ladder's block (until session 26 it was 16 KB whatever the block, which
  cut down's 2-warp blocks to 14 a multiprocessor);
- `kbulk2`, `kbulk4` (down only): `kmma` with each warp's weights and scales staged in a ring of 2 / 4 blocks in
  shared memory by TMA bulk copies (`cp.async.bulk`, one lane a block, one mbarrier a stage): more bytes in flight
  without registers for them. Checked: their output words must equal `kmma`'s (the script exits otherwise);
- `kx_xq`, `kpipe_xq`, `kmma_xq` (and `kbulk2_xq`): those levels with each block's activation vectors transposed
  (a warp load reads 64 contiguous bytes a part instead of 4 vectors 64 bytes apart).

Every launch reads another 8 of 64 experts (far beyond the 50 MB L2). Prints GB/s per pattern and parameter (k-split,
rows a warp) and torch's copy bandwidth in the same run; `--json PATH` writes them.
"""

import argparse
import json
import sys
import time

import torch

SRC = r"""
// ROWS rows an expert (gate/up: gate then up), KV 16-byte vectors a row, NBLK 128-column blocks a row, MT m tiles a
// task (2 gated: the gate tile and the up tile ROWS / 2 rows on), TPE 16-row tiles an expert.
#define TPE (ROWS / 16)
#define TASKS (TPE / MT)
#define EXPERT_VECS ((size_t)ROWS * KV)

__device__ __forceinline__ unsigned fold(uint4 q, unsigned short sc) { return q.x ^ q.y ^ q.z ^ q.w ^ (unsigned)sc; }

// The kernel's warp roles: warp gw of the grid takes task gw / ksplit (slot, t0), part gw % ksplit.
#define ROLE \
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5; \
  int gw = blockIdx.x * (blockDim.x >> 5) + warp; \
  int task = gw / ksplit, part = gw % ksplit; \
  int slot = task / TASKS, t0 = task % TASKS; \
  if (slot >= 8) return; \
  size_t e = experts[slot]; \
  unsigned acc = 0;

// Hooks for `scripts/pdl_probe.py` (programmatic dependent launch): where a level waits for the previous grid, at
// its start or after its first weight loads. Empty here.
#ifndef LADDER_PDL_START
#define LADDER_PDL_START
#define LADDER_PDL_LOADED
#endif

#define TILED_AT(i, mt, h) (((e * TPE + t0 + (mt) * (TPE / 2)) * NBLK + (i)) * 64 + (h) * 32 + lane)

// Block i (128 columns) of the task's m tiles in the tiled layout, words and scales folded.
__device__ __forceinline__ unsigned tiled_block(const uint4* __restrict__ w, const unsigned short* __restrict__ s,
                                                size_t e, int t0, int lane, int i) {
  unsigned acc = 0;
  #pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    #pragma unroll
    for (int h = 0; h < 2; h++) { size_t at = TILED_AT(i, mt, h); acc ^= fold(w[at], s[at]); }
  }
  return acc;
}

extern "C" __global__ void rowtile(const uint4* __restrict__ w, const unsigned short* __restrict__ s,
                                   const int* __restrict__ experts, unsigned* out, int ksplit) {
  ROLE
  int g = lane >> 2, c = lane & 3;
  #pragma unroll 2
  for (int i = part; i < NBLK; i += ksplit) {
    int v = 4 * i + c;
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      #pragma unroll
      for (int h = 0; h < 2; h++) {
        size_t row = e * ROWS + t0 * 16 + mt * (ROWS / 2) + g + 8 * h;
        acc ^= fold(w[row * KV + v], s[row * KV + v]);
      }
    }
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

extern "C" __global__ void tiled(const uint4* __restrict__ w, const unsigned short* __restrict__ s,
                                 const int* __restrict__ experts, unsigned* out, int ksplit) {
  ROLE
  #pragma unroll 2
  for (int i = part; i < NBLK; i += ksplit) {
    acc ^= tiled_block(w, s, e, t0, lane, i);
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

extern "C" __global__ void rot(const uint4* __restrict__ w, const unsigned short* __restrict__ s,
                               const int* __restrict__ experts, unsigned* out, int ksplit) {
  ROLE
  int mb = (NBLK + ksplit - 1 - part) / ksplit;
  if (mb == 0) return;
  int q = (int)((e * TASKS + t0) % mb);
  #pragma unroll 2
  for (int n = 0; n < mb; n++) {
    int i = part + ksplit * q;
    q = q + 1 == mb ? 0 : q + 1;
    acc ^= tiled_block(w, s, e, t0, lane, i);
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

extern "C" __global__ void chunk(const uint4* __restrict__ w, const unsigned short* __restrict__ s,
                                 const int* __restrict__ experts, unsigned* out, int ksplit) {
  ROLE
  int per = (NBLK + ksplit - 1) / ksplit;
  int end = min(NBLK, (part + 1) * per);
  #pragma unroll 2
  for (int i = part * per; i < end; i++) {
    acc ^= tiled_block(w, s, e, t0, lane, i);
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

extern "C" __global__ void deep4(const uint4* __restrict__ w, const unsigned short* __restrict__ s,
                                 const int* __restrict__ experts, unsigned* out, int ksplit) {
  ROLE
  for (int i0 = part; i0 < NBLK; i0 += 4 * ksplit) {
    uint4 q[4][MT][2];
    unsigned short sc[4][MT][2];
    #pragma unroll
    for (int d = 0; d < 4; d++) {
      int i = min(i0 + d * ksplit, NBLK - 1);
      #pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        #pragma unroll
        for (int h = 0; h < 2; h++) { size_t at = TILED_AT(i, mt, h); q[d][mt][h] = w[at]; sc[d][mt][h] = s[at]; }
      }
    }
    #pragma unroll
    for (int d = 0; d < 4; d++) {
      if (i0 + d * ksplit < NBLK) {
        #pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          #pragma unroll
          for (int h = 0; h < 2; h++) acc ^= fold(q[d][mt][h], sc[d][mt][h]);
        }
      }
    }
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

extern "C" __global__ void bmajor(const uint4* __restrict__ w, const unsigned short* __restrict__ s,
                                  const int* __restrict__ experts, unsigned* out, int ksplit) {
  ROLE
  #pragma unroll 2
  for (int i = part; i < NBLK; i += ksplit) {
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      #pragma unroll
      for (int h = 0; h < 2; h++) {
        size_t at = e * EXPERT_VECS + ((size_t)i * TPE + t0 + mt * (TPE / 2)) * 64 + h * 32 + lane;
        acc ^= fold(w[at], s[at]);
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
    for (int i = 0; i < KV / 32; i++) acc ^= fold(w[row * KV + lane + 32 * i], s[row * KV + lane + 32 * i]);
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

// Grid-stride over the 8 experts' vectors, `unroll` (4) loads a thread in flight.
extern "C" __global__ void flat(const uint4* __restrict__ w, const unsigned short* __restrict__ s,
                                const int* __restrict__ experts, unsigned* out, int unused) {
  size_t n = 8 * EXPERT_VECS;
  size_t stride = (size_t)gridDim.x * blockDim.x;
  unsigned acc = 0;
  for (size_t i0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i0 < n; i0 += 4 * stride) {
    uint4 q[4];
    unsigned short sc[4];
    #pragma unroll
    for (int d = 0; d < 4; d++) {
      size_t i = min(i0 + d * stride, n - 1);
      size_t at = experts[i / EXPERT_VECS] * EXPERT_VECS + i % EXPERT_VECS;
      q[d] = w[at];
      sc[d] = s[at];
    }
    #pragma unroll
    for (int d = 0; d < 4; d++) acc ^= fold(q[d], sc[d]);
  }
  if (acc == 0x9e3779b9u) out[0] = acc;
}

// Level 5's math, as the expert kernel does it (`moe_mma::block_mma`): a weight pair is `((word >> 4p) & 0x000F000F)
// | bias` as BF16 (128 + u), minus 136, times the scale (one HADD2 and one HMUL2 a pair: the rounding differs from
// the kernel's, which does not matter for timing), and 8 `mma.sync.m16n8k16` a 128-column block per m tile.
__device__ __forceinline__ unsigned wpair(unsigned word, int p, unsigned bias, unsigned scale2) {
  unsigned bits = ((word >> (4 * p)) & 0x000F000Fu) | bias, r;
  asm("sub.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(bits), "r"(0x43084308u));
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(r), "r"(scale2));
  return r;
}

__device__ __forceinline__ unsigned word_of(uint4 v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

__device__ __forceinline__ void block_mma(const uint4 (&wa)[MT][2], const unsigned short (&sa)[MT][2],
                                          const uint4 (&xb)[4], float (&accf)[MT][4], unsigned bias) {
  #pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    unsigned s0 = (unsigned)sa[mt][0] * 0x10001u, s1 = (unsigned)sa[mt][1] * 0x10001u;
    #pragma unroll
    for (int t = 0; t < 8; t++) {
      int wi = t / 2, p0 = 2 * (t % 2);
      unsigned a0 = wpair(word_of(wa[mt][0], wi), p0, bias, s0), a1 = wpair(word_of(wa[mt][1], wi), p0, bias, s1);
      unsigned a2 = wpair(word_of(wa[mt][0], wi), p0 + 1, bias, s0), a3 = wpair(word_of(wa[mt][1], wi), p0 + 1, bias, s1);
      unsigned b0 = word_of(xb[t / 2], 2 * (t % 2)), b1 = word_of(xb[t / 2], 2 * (t % 2) + 1);
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                   "{%0,%1,%2,%3};"
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                   : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
    #pragma unroll
    for (int q = 0; q < 4; q++) accf[mt][q] += d[q];
  }
}

// Lane (g, c)'s vector q of block i in its part's row of activations: as the kernel reads them (row-major, the
// lane's 4 vectors side by side: a warp load touches 4 vectors 64 bytes apart a part) or, with XQMAJOR, transposed
// within each block's 16 vectors (a warp load reads 64 contiguous bytes a part).
#ifdef XQMAJOR
#define XAT(i, c, q) (16 * (i) + 4 * (q) + (c))
#else
#define XAT(i, c, q) (4 * (4 * (i) + (c)) + (q))
#endif

// The ladder's warp roles and the kernel's chain of routing reads (the class's end, the slot's expert and offsets,
// its pair); returns from the kernel when the slot is past the class (a block's warps share their slot).
#define LADDER_ROLE \
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5; \
  int g = lane >> 2, c = lane & 3; \
  int gw = blockIdx.x * (blockDim.x >> 5) + warp; \
  int task = gw / ksplit, part = gw % ksplit; \
  int slot = task / TASKS, t0 = task % TASKS; \
  if (slot >= bounds[1]) return; \
  size_t e = experts[slot]; \
  int start = offsets[slot], count = offsets[slot + 1] - start; \
  int p = count > 0 ? pairs[start] : 0; \
  size_t xrow = ((size_t)p * 3 + (g < 3 ? g : 0)) * (4 * KV); \
  unsigned acc = (unsigned)p;  /* the pair's read stays live at every level */

// The accumulators folded into the checksum.
__device__ __forceinline__ unsigned fold_acc(unsigned acc, const float (&accf)[MT][4]) {
  #pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    #pragma unroll
    for (int q = 0; q < 4; q++) acc ^= __float_as_uint(accf[mt][q]);
  }
  return acc;
}

// The k-split warps' reduction through shared memory (two barriers; every warp of the block calls it) and part 0's
// output write (every part-0 lane c == 0 its own word: up to 8192 warps).
__device__ __forceinline__ void reduce_out(unsigned acc, unsigned* red, int warp, int lane, int part, int ksplit,
                                           int gw, int g, int c, unsigned* out) {
  #pragma unroll
  for (int a = 0; a < 4; a++) red[(warp * 4 + a) * 32 + lane] = acc + a;
  __syncthreads();
  if (part == 0) {
    for (int s2 = 1; s2 < ksplit; s2++) {
      #pragma unroll
      for (int a = 0; a < 4; a++) acc += red[((warp + s2) * 4 + a) * 32 + lane];
    }
  }
  __syncthreads();
  if (part == 0 && c == 0) out[(gw * 8 + g) & 65535] = acc;
}

// The ladder from `tiled` to the expert kernel (`moe_mma::expert_mma_kernel` with `loads_only`), one step a level:
// 1 `kchain`: `tiled` behind the kernel's chain of reads (the class's end, the slot's expert and offsets, its pair);
// 2 `kx`: and each block's activations (lanes g < 3, 64 bytes each of their split row, L1/L2-resident);
// 3 `kred`: and the k-split warps' reduction through shared memory (two barriers) and an output write;
// 4 `kpipe`: level 3 with the kernel's explicit one-block-ahead double buffer instead of `#pragma unroll 2`;
// 5 `kmma`: level 4 with the kernel's dequantization and MMAs in place of the checksum (the expert kernel itself,
//   less its layout of scales and its epilogue, in plain CUDA);
// 6 `kmma_xs`: level 5 with the block's activations (one slot's 3 parts) copied once into shared memory and read
//   from there: gate/up's 8 tasks a block then share one copy instead of each warp reading its own from L1/L2.
template <int L>
__device__ __forceinline__ void ladder(const uint4* __restrict__ w, const unsigned short* __restrict__ s,
                                       const int* __restrict__ experts, const int* __restrict__ offsets,
                                       const int* __restrict__ pairs, const int* __restrict__ bounds,
                                       const uint4* __restrict__ xs, unsigned* out, int ksplit) {
  // The reduction's words, sized for the ladder's block (LWARPS warps) as the kernel's are; at level 6 the same
  // memory first holds the slot's activations (the reduction comes after a barrier).
  constexpr int XS_VECS = 3 * 4 * KV, RED_WORDS = LWARPS * 4 * 32;
  constexpr int SM_WORDS = L >= 6 && 4 * XS_VECS > RED_WORDS ? 4 * XS_VECS : RED_WORDS;
  __shared__ __align__(16) unsigned smem[SM_WORDS];
  unsigned* red = smem;
  uint4* xsm = reinterpret_cast<uint4*>(smem);
  LADDER_PDL_START
  LADDER_ROLE
  bool xok = L >= 2 && g < 3;
  if (L >= 6) {
    for (int v = threadIdx.x; v < XS_VECS; v += blockDim.x) xsm[v] = xs[(size_t)p * XS_VECS + v];
    __syncthreads();
  }
  const uint4* xsrc = L >= 6 ? xsm + (g < 3 ? g : 0) * (4 * KV) : xs + xrow;
  if (L < 4) {
    #pragma unroll 2
    for (int i = part; i < NBLK; i += ksplit) {
      acc ^= tiled_block(w, s, e, t0, lane, i);
      if (xok) {
        #pragma unroll
        for (int q = 0; q < 4; q++) { uint4 x = xs[xrow + XAT(i, c, q)]; acc ^= x.x ^ x.y ^ x.z ^ x.w; }
      }
    }
  } else {
    uint4 wa[MT][2], wn[MT][2], xb[4], xn[4];
    unsigned short sa[MT][2], sn[MT][2];
    float accf[MT][4] = {};
    // The weights' bias in a register, as the kernel passes it (one LOP3 a pair): from an argument the compiler
    // cannot fold (`ksplit` is small, so the xor changes nothing).
    unsigned bias = 0x43004300u ^ ((unsigned)ksplit & 0x80000000u);
    int i = min(part, NBLK - 1);
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      #pragma unroll
      for (int h = 0; h < 2; h++) { size_t at = TILED_AT(i, mt, h); wa[mt][h] = w[at]; sa[mt][h] = s[at]; }
    }
    LADDER_PDL_LOADED
    #pragma unroll
    for (int q = 0; q < 4; q++) xb[q] = xok ? xsrc[XAT(i, c, q)] : make_uint4(0, 0, 0, 0);
    for (i = part; i < NBLK; i += ksplit) {
      int nx = min(i + ksplit, NBLK - 1);
      #pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        #pragma unroll
        for (int h = 0; h < 2; h++) { size_t at = TILED_AT(nx, mt, h); wn[mt][h] = w[at]; sn[mt][h] = s[at]; }
      }
      #pragma unroll
      for (int q = 0; q < 4; q++) xn[q] = xok ? xsrc[XAT(nx, c, q)] : make_uint4(0, 0, 0, 0);
      if (L >= 5) {
        block_mma(wa, sa, xb, accf, bias);
      } else {
        #pragma unroll
        for (int mt = 0; mt < MT; mt++) {
          #pragma unroll
          for (int h = 0; h < 2; h++) acc ^= fold(wa[mt][h], sa[mt][h]);
        }
        #pragma unroll
        for (int q = 0; q < 4; q++) acc ^= xb[q].x ^ xb[q].y ^ xb[q].z ^ xb[q].w;
      }
      #pragma unroll
      for (int mt = 0; mt < MT; mt++) {
        #pragma unroll
        for (int h = 0; h < 2; h++) { wa[mt][h] = wn[mt][h]; sa[mt][h] = sn[mt][h]; }
      }
      #pragma unroll
      for (int q = 0; q < 4; q++) xb[q] = xn[q];
    }
    acc = fold_acc(acc, accf);
  }
  if (L >= 3) {
    if (L >= 6) __syncthreads();  // every warp is done with the activations `red` overwrites
    reduce_out(acc, red, warp, lane, part, ksplit, gw, g, c, out);
  } else if (acc == 0x9e3779b9u) {
    out[0] = acc;
  }
}

// A ladder kernel `name`: `body` (a device function template) instantiated at `level`.
#define LADDER_KERNEL(name, body, level) \
  extern "C" __global__ void name(const uint4* __restrict__ w, const unsigned short* __restrict__ s, \
                                  const int* __restrict__ experts, const int* __restrict__ offsets, \
                                  const int* __restrict__ pairs, const int* __restrict__ bounds, \
                                  const uint4* __restrict__ xs, unsigned* out, int ksplit) { \
    body<level>(w, s, experts, offsets, pairs, bounds, xs, out, ksplit); \
  }
LADDER_KERNEL(kchain, ladder, 1)
LADDER_KERNEL(kx, ladder, 2)
LADDER_KERNEL(kred, ladder, 3)
LADDER_KERNEL(kpipe, ladder, 4)
LADDER_KERNEL(kmma, ladder, 5)
LADDER_KERNEL(kmma_xs, ladder, 6)

// 6 `kbulk2` / `kbulk4` (down only: static shared memory): level 5 with each warp's weights and scales staged in a
// ring of 2 / 4 blocks in shared memory by TMA bulk copies (`cp.async.bulk`, one lane a block: the tile's contiguous
// 1 KB of words and 128 bytes of scales, one mbarrier a stage), so a warp holds up to 4 blocks in flight without
// registers for them. Same math and order as `kmma`: the same output.
#ifdef BULK
__device__ __forceinline__ unsigned smem_at(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

template <int D>
__device__ __forceinline__ void kbulk_body(const uint4* __restrict__ w, const unsigned short* __restrict__ s,
                                           const int* __restrict__ experts, const int* __restrict__ offsets,
                                           const int* __restrict__ pairs, const int* __restrict__ bounds,
                                           const uint4* __restrict__ xs, unsigned* out, int ksplit) {
  __shared__ __align__(128) uint4 ring[LWARPS][D][MT * 72];  // a stage: MT tiles x (64 word vectors, 8 of scales)
  __shared__ __align__(8) unsigned long long bars[LWARPS][D];
  __shared__ unsigned red[LWARPS * 4 * 32];
  LADDER_ROLE
  bool xok = g < 3;
  int nb = (NBLK - part + ksplit - 1) / ksplit;  // this warp's blocks i = part + n * ksplit
  if (lane == 0) {
    #pragma unroll
    for (int d = 0; d < D; d++) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_at(&bars[warp][d])) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  auto issue = [&](int n) {
    int i = part + n * ksplit, st = n % D;
    unsigned bar = smem_at(&bars[warp][st]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(MT * 1152) : "memory");
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      size_t base = ((e * TPE + t0 + mt * (TPE / 2)) * NBLK + i) * 64;
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 1024, [%2];"
                   :: "r"(smem_at(&ring[warp][st][mt * 72])), "l"(w + base), "r"(bar) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 128, [%2];"
                   :: "r"(smem_at(&ring[warp][st][mt * 72 + 64])), "l"(s + base), "r"(bar) : "memory");
    }
  };
  if (lane == 0) {
    for (int n = 0; n < min(D, nb); n++) issue(n);
  }
  uint4 wa[MT][2], xb[4], xn[4];
  unsigned short sa[MT][2];
  float accf[MT][4] = {};
  unsigned bias = 0x43004300u ^ ((unsigned)ksplit & 0x80000000u);
  #pragma unroll
  for (int q = 0; q < 4; q++) xb[q] = xok ? xs[xrow + XAT(part, c, q)] : make_uint4(0, 0, 0, 0);
  for (int n = 0; n < nb; n++) {
    int i = part + n * ksplit, st = n % D;
    int nx = min(i + ksplit, NBLK - 1);
    #pragma unroll
    for (int q = 0; q < 4; q++) xn[q] = xok ? xs[xrow + XAT(nx, c, q)] : make_uint4(0, 0, 0, 0);
    unsigned bar = smem_at(&bars[warp][st]), phase = (n / D) & 1, done;
    do {
      asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
                   : "=r"(done) : "r"(bar), "r"(phase) : "memory");
    } while (!done);
    const uint4* r = ring[warp][st];
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
      #pragma unroll
      for (int h = 0; h < 2; h++) {
        wa[mt][h] = r[mt * 72 + h * 32 + lane];
        sa[mt][h] = reinterpret_cast<const unsigned short*>(r + mt * 72 + 64)[h * 32 + lane];
      }
    }
    __syncwarp();
    if (lane == 0 && n + D < nb) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      issue(n + D);
    }
    block_mma(wa, sa, xb, accf, bias);
    #pragma unroll
    for (int q = 0; q < 4; q++) xb[q] = xn[q];
  }
  reduce_out(fold_acc(acc, accf), red, warp, lane, part, ksplit, gw, g, c, out);
}

LADDER_KERNEL(kbulk2, kbulk_body, 2)
LADDER_KERNEL(kbulk4, kbulk_body, 4)
#endif
"""

# rows an expert, 16-byte vectors a row, m tiles a task
MATRICES = {"gate_up": (4096, 224, 2), "down": (7168, 64, 1)}
POOL, USED = 64, 8


def compiler():
    """torch's NVRTC front end (`torch.cuda._compile_kernel`), or exit naming what is missing."""
    try:
        from torch.cuda import _compile_kernel
    except ImportError as e:
        sys.exit(f"torch.cuda._compile_kernel is not in this torch ({torch.__version__}): {e}")
    return _compile_kernel


def queued_copy(dev, floats):
    """The copy that `behind_copy` queues before the launches it times (`floats` f32 read and as many written):
    its buffers, two timing events, its time alone (ms, median of 5) and its bandwidth (GB/s, read + write)."""
    a = torch.empty(floats, dtype=torch.float32, device=dev)
    b = torch.empty_like(a)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def copy_ms():
        b.copy_(a)
        torch.cuda.synchronize()
        t0.record()
        b.copy_(a)
        t1.record()
        torch.cuda.synchronize()
        return t0.elapsed_time(t1)

    copy_alone = sorted(copy_ms() for _ in range(5))[2]
    return a, b, t0, t1, copy_alone, 2 * floats * 4 / (copy_alone * 1e-3) / 1e9


def behind_copy(run, iters, reps, copy):
    """GPU us a call of `run(i)`: `iters` calls queued behind a copy (`copy`: its buffers, two timing events and its
    time alone in ms), (copy + calls - copy) / iters, the median of `reps` samples after 4 warm-up calls; NaN if fewer
    than 3 samples had their enqueue shorter than the copy (a sample whose enqueue outlasted it measured the host)."""
    a, b, t0, t1, copy_alone = copy
    for i in range(4):
        run(i)
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0.record()
        b.copy_(a)
        h0 = time.perf_counter()
        for i in range(iters):
            run(i)
        enqueue_ms = (time.perf_counter() - h0) * 1e3
        t1.record()
        torch.cuda.synchronize()
        if enqueue_ms < 0.9 * copy_alone:
            samples.append((t0.elapsed_time(t1) - copy_alone) * 1e3 / iters)
    return sorted(samples)[len(samples) // 2] if len(samples) >= 3 else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--matrix", choices=sorted(MATRICES), default="gate_up")
    ap.add_argument("--iters", type=int, default=16)
    ap.add_argument("--overlap", action="store_true",
                    help="instead: gate/up's and down's `kmma` alone, one after the other, and on two streams at once")
    args = ap.parse_args()
    if args.iters < 1:
        ap.error(f"--iters {args.iters}: at least 1 launch is timed a sample")
    if not torch.cuda.is_available():
        sys.exit("moe_load_pattern: no CUDA device (run it on the GPU machine)")
    if args.overlap:
        return overlap(args)
    rows_e, kv, mt = MATRICES[args.matrix]
    tasks = rows_e // 16 // mt
    dev = torch.device("cuda")
    words = torch.randint(-(2**31), 2**31 - 1, (POOL * rows_e * kv * 4,), dtype=torch.int32, device=dev)
    scales = torch.randint(0, 2**15, (POOL * rows_e * kv,), dtype=torch.int16, device=dev)
    out = torch.zeros(65536, dtype=torch.int32, device=dev)
    # The ladder's routing of one token: class 0 holds all 8 slots, one pair each (pairs 0..8 in a fixed order),
    # and the pairs' split activations (3 BF16 parts of k columns a pair: 4 KV 16-byte vectors a part).
    bounds = torch.tensor([0, USED, USED, USED], dtype=torch.int32, device=dev)
    offsets = torch.arange(USED + 1, dtype=torch.int32, device=dev)
    pairs = torch.tensor([3, 0, 6, 1, 7, 2, 5, 4], dtype=torch.int32, device=dev)
    xs = torch.randint(-(2**31), 2**31 - 1, (USED * 3 * 4 * kv * 4,), dtype=torch.int32, device=dev)
    gen = torch.Generator().manual_seed(7)
    sets = [torch.randperm(POOL, generator=gen)[:USED].to(torch.int32).to(dev) for _ in range(16)]
    bytes_per = USED * rows_e * kv * (16 + 2)

    # torch's copy bandwidth (read + write) in the same run; the same copy (4 GiB read, 4 GiB written) queued before
    # each pattern's launches hides the host's enqueue of them (~20-50 us a launch from Python, longer than the
    # kernels): a pattern's time is (copy + launches) - copy
    a, b, t0, t1, copy_alone, copy_gbs = queued_copy(dev, 1 << 30)

    _compile_kernel = compiler()
    # The ladder's launch shape (gate/up 8 tasks x k-split 3, down 1 task x k-split 2): its reduction's shared
    # memory is sized for its block, as the kernel's is (a 16 KB array in 2-warp blocks cut down's occupancy).
    ladder_ks, ladder_threads = (3, 768) if args.matrix == "gate_up" else (2, 64)
    defines = (f"#define ROWS {rows_e}\n#define KV {kv}\n#define NBLK ({kv} / 4)\n#define MT {mt}\n"
               f"#define LWARPS {ladder_threads // 32}\n" + ("#define BULK\n" if args.matrix == "down" else ""))
    names = ("rowtile", "tiled", "rot", "chunk", "deep4", "bmajor", "rows", "flat", "kchain", "kx", "kred", "kpipe",
             "kmma", "kmma_xs")
    bulk = ("kbulk2", "kbulk4") if args.matrix == "down" else ()
    names += bulk
    kern = {name: _compile_kernel(defines + SRC, name) for name in names}
    # The activation levels again with the lanes' activation vectors transposed within a block (`XQMAJOR`).
    xq = ("kx", "kpipe", "kmma") + bulk[:1]
    kern.update({name + "_xq": _compile_kernel(defines + "#define XQMAJOR\n" + SRC, name) for name in xq})
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def timed(name, warps, param, threads):
        k = kern[name]
        blocks = (warps * 32 + threads - 1) // threads
        if name.startswith("k"):  # the ladder's levels
            bufs = lambda i: [words, scales, sets[i % 16], offsets, pairs, bounds, xs, out, param]
        else:
            bufs = lambda i: [words, scales, sets[i % 16], out, param]
        us = behind_copy(lambda i: k(grid=(blocks, 1, 1), block=(threads, 1, 1), args=bufs(i)), args.iters, 5,
                         (a, b, t0, t1, copy_alone))
        return us, bytes_per / (us * 1e-6) / 1e9

    rows_out = []
    print(f"{args.matrix}: copy bandwidth (torch copy_, read + write): {copy_gbs:.0f} GB/s; bytes a launch "
          f"{bytes_per / 1e6:.1f} MB")
    print("| pattern | k-split / rows a warp | threads | warps | us | GB/s | % of copy |")
    print("|---|---|---|---|---|---|---|")
    if args.matrix == "gate_up":
        cases = [("rowtile", ks, 256) for ks in (1, 2, 3, 4)] + [("tiled", ks, 256) for ks in (1, 2, 3, 4)]
        cases += [("rowtile", 2, 128), ("tiled", 2, 128), ("tiled", 3, 768), ("rot", 3, 768), ("chunk", 3, 768)]
        cases += [("deep4", 1, 256), ("deep4", 3, 768), ("bmajor", 3, 768)]
    else:
        cases = [(p, ks, th) for p in ("tiled", "rot") for ks in (1, 2, 4) for th in (64, 256)]
        cases += [("chunk", 2, 64), ("chunk", 4, 256), ("deep4", 1, 64), ("deep4", 1, 256), ("deep4", 2, 64)]
        cases += [("bmajor", 1, 64), ("bmajor", 2, 64), ("bmajor", 2, 256), ("rowtile", 2, 64)]
    cases += [("rows", pw, 256) for pw in (1, 2, 4, 8)] + [("flat", 0, 256), ("flat", 0, 512), ("flat", 0, 1024)]
    # The ladder at the one-token launch shapes (gate/up 8 tasks x k-split 3, down 1 task x k-split 2), `tiled` first.
    cases += [(name, ladder_ks, ladder_threads) for name in ("tiled", "kchain", "kx", "kred", "kpipe", "kmma") + bulk]
    cases += [(name + "_xq", ladder_ks, ladder_threads) for name in xq] + [("kx", ladder_ks, ladder_threads)]
    cases += [(name, ladder_ks, ladder_threads) for name in ("kmma_xs", "kmma")]
    # The staged levels compute what `kmma` does, in the same order: their outputs must be the same words.
    for name in bulk + ("kmma_xs",):
        outs = []
        for k in ("kmma", name):
            out.zero_()
            warps = USED * tasks * ladder_ks
            kern[k](grid=((warps * 32 + ladder_threads - 1) // ladder_threads, 1, 1), block=(ladder_threads, 1, 1),
                    args=[words, scales, sets[0], offsets, pairs, bounds, xs, out, ladder_ks])
            torch.cuda.synchronize()
            outs.append(out.clone())
        same = bool(torch.equal(outs[0], outs[1])) and bool(outs[0].ne(0).any())
        print(f"{name} output == kmma output: {same}")
        if not same:
            sys.exit(f"{name}: its output differs from kmma's")
    for name, p, threads in cases:
        if name == "rows":
            warps = USED * rows_e // p
        elif name == "flat":
            warps = sms * threads // 32 * (2048 // threads)
        else:
            warps = USED * tasks * p
        us, gbs = timed(name, warps, p, threads)
        rows_out.append({"pattern": name, "param": p, "threads": threads, "warps": warps, "us": us, "gbs": gbs,
                         "pct_copy": 100 * gbs / copy_gbs})
        print(f"| {name} | {p} | {threads} | {warps} | {us:.1f} | {gbs:.0f} | {100 * gbs / copy_gbs:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "matrix": args.matrix,
                       "copy_gbs": copy_gbs, "bytes": bytes_per, "rows": rows_out}, f, indent=1)


def overlap(args):
    """What running the two matrices' `kmma` launches at once could save: each alone, one after the other on one
    stream (as the layer runs them, less the dependency), and on two streams with nothing ordering them (an upper
    bound for one launch doing both, where down's weight streams need not wait for gate/up's tail). GPU us a pair of
    launches, behind a queued copy as in `main`."""
    dev = torch.device("cuda")
    _compile_kernel = compiler()

    side = {}
    gen = torch.Generator().manual_seed(7)
    sets = [torch.randperm(POOL, generator=gen)[:USED].to(torch.int32).to(dev) for _ in range(16)]
    bounds = torch.tensor([0, USED, USED, USED], dtype=torch.int32, device=dev)
    offsets = torch.arange(USED + 1, dtype=torch.int32, device=dev)
    pairs = torch.tensor([3, 0, 6, 1, 7, 2, 5, 4], dtype=torch.int32, device=dev)
    mbytes = {}
    for m, (ks, threads) in (("gate_up", (3, 768)), ("down", (2, 64))):
        rows_e, kv, mt = MATRICES[m]
        defines = (f"#define ROWS {rows_e}\n#define KV {kv}\n#define NBLK ({kv} / 4)\n#define MT {mt}\n"
                   f"#define LWARPS {threads // 32}\n")
        words = torch.randint(-(2**31), 2**31 - 1, (POOL * rows_e * kv * 4,), dtype=torch.int32, device=dev)
        scales = torch.randint(0, 2**15, (POOL * rows_e * kv,), dtype=torch.int16, device=dev)
        xs = torch.randint(-(2**31), 2**31 - 1, (USED * 3 * 4 * kv * 4,), dtype=torch.int32, device=dev)
        out = torch.zeros(65536, dtype=torch.int32, device=dev)
        warps = USED * (rows_e // 16 // mt) * ks
        side[m] = (_compile_kernel(defines + SRC, "kmma"), (warps * 32 + threads - 1) // threads, threads,
                   words, scales, xs, out, ks)
        mbytes[m] = USED * rows_e * kv * (16 + 2)
    total_bytes = mbytes["gate_up"] + mbytes["down"]

    def launch(m, i, stream):
        k, blocks, threads, words, scales, xs, out, ks = side[m]
        with torch.cuda.stream(stream):
            k(grid=(blocks, 1, 1), block=(threads, 1, 1),
              args=[words, scales, sets[i % 16], offsets, pairs, bounds, xs, out, ks])

    main_s = torch.cuda.current_stream()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    # An 8 GiB copy: the two-stream mode's enqueue (events and waits besides two launches) takes longer.
    a, b, t0, t1, copy_alone, copy_gbs = queued_copy(dev, 1 << 31)

    def run(mode, i):
        if mode in ("gate_up", "down"):
            launch(mode, i, main_s)
        elif mode == "sequential":
            launch("gate_up", i, main_s)
            launch("down", i, main_s)
        else:  # two streams, each ordered after what the main stream queued so far, joined back after
            ev = torch.cuda.Event()
            ev.record(main_s)
            s1.wait_event(ev)
            s2.wait_event(ev)
            launch("gate_up", i, s1)
            launch("down", i, s2)
            main_s.wait_stream(s1)
            main_s.wait_stream(s2)

    print(f"copy bandwidth (torch copy_, read + write): {copy_gbs:.0f} GB/s; both matrices' bytes "
          f"{total_bytes / 1e6:.1f} MB")
    print("| launches (kmma, one-token shapes) | GPU us | % of copy over the launches' bytes |")
    print("|---|---|---|")
    rows = []
    for mode in ("gate_up", "down", "sequential", "streams", "sequential", "streams"):
        us = behind_copy(lambda i: run(mode, i), args.iters, 7, (a, b, t0, t1, copy_alone))
        pct = 100 * mbytes.get(mode, total_bytes) / (us * 1e-6) / 1e9 / copy_gbs
        rows.append({"mode": mode, "us": us, "pct_copy": pct})
        print(f"| {mode} | {us:.1f} | {pct:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gbs": copy_gbs,
                       "bytes_both": total_bytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
