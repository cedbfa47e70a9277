#!/usr/bin/env python3
"""What programmatic dependent launch (PDL) could save in the one-token MoE layer's chain of launches (issue 4).

A measurement, not a kernel of ours. Session 27 (Nsight Compute, `bench/s27_run1`) found the CubeCL expert kernels
as fast as their plain-CUDA twin (`kmma` of `scripts/moe_load_pattern.py`): the layer's time over its two expert
kernels is spent at launch boundaries (a tiny dependent launch costs ~4-7 us at one token). Hopper's PDL lets a
kernel's blocks be scheduled while the previous grid's tail runs (`cudaLaunchAttributeProgrammaticStreamSerialization`),
each waiting for it (`griddepcontrol.wait`) before reading what it wrote. This probe times the layer's launch chain
as the model runs it since session 27 (route + the input's split: one small launch; gate/up `kmma`; down `kmma`;
the weighted combine: one small launch), 16 layers queued behind a device copy (GPU us a layer, median of 7):

- `plain`: ordinary launches in one stream;
- `pdl_start`: PDL launches, every kernel waiting at its start (what a hook at a CubeCL kernel's entry could do);
- `pdl_early`: PDL launches, down issuing its first weight loads (which depend on the routing, two launches back,
  not on gate/up) before it waits.

With `--cubecl DIR` the same harness also times CubeCL's own kernels of the layer (the CUBINs `cargo xtask kernels
--arch sm_90 --dump DIR` writes: byte for byte the code the engine's device compiles) launched through the driver with
the parameters CubeCL passes, all four in the chain and each expert kernel alone among the plain-CUDA ones
(`--cubecl-entry DIR2`: the dump made with `EYRIE_PDL_LATE=0`, down waiting at its entry, for the `pdl_start` rows).
Session 29 found them as fast as the plain-CUDA chain there (61.5 against 61.2-61.5 us, `bench/s29_run1`).

Builds a CUDA program from `moe_load_pattern.SRC` (the ladder's `kmma` for both matrices, with its PDL hooks) with
`nvcc`, runs it, prints a table; `--json PATH` writes the figures. Needs nvcc and an sm_90 GPU (the GPU machine).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_load_pattern import MATRICES, POOL, SRC, USED  # noqa: E402

MAIN = r"""
#include <cstdio>
#include <cuda.h>
#include <cstdlib>
#include <algorithm>
#include <vector>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  fprintf(stderr, "pdl_probe: %s failed: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

// One small launch of each end of the chain: the route + input split (28 blocks of 256 over the hidden size) and the
// weighted combine of 8 experts' outputs (28 blocks of 256).
__global__ void route_like(const float* x, unsigned* xs, int n) {
  PDL_ENTRY
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { unsigned b = __float_as_uint(x[i]); xs[3 * i] = b >> 16; xs[3 * i + 1] = b & 0xffff; xs[3 * i + 2] = b; }
}
__global__ void combine_like(const float* y, const float* wts, float* out, int n) {
  PDL_ENTRY
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { float s = 0.f; for (int k = 0; k < 8; k++) s += wts[k] * y[k * n + i]; out[i] = s; }
}

// The copy the layers queue behind as the engine's benchmark makes it (PDL_PROBE_KERNEL_COPY=1): a kernel of one
// float4 a thread (CubeCL's `copy_kernel` over 2^29 floats: 524288 blocks of 256), launched with the PDL attribute
// and waiting / triggering at its entry; else `cudaMemcpyAsync`.
__global__ void copy_like(const float4* a, float4* b, size_t n) {
  PDL_WAIT(); PDL_TRIGGER();
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) b[i] = a[i];
}

template <typename... K, typename... A>
static void launch(void (*k)(K...), int blocks, int threads, bool pdl, cudaStream_t st, A... a) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks); cfg.blockDim = dim3(threads); cfg.stream = st;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at; cfg.numAttrs = pdl ? 1 : 0;
  CK(cudaLaunchKernelEx(&cfg, k, a...));
}

// CubeCL's own kernels, loaded from the CUBINs `cargo xtask kernels --dump` writes (the code the engine's device
// compiles, byte for byte) and launched through the driver with the parameters CubeCL passes: its buffers, then the
// `__grid_constant__ info_st` (the scalars, then the buffers' static metadata, which these kernels do not read).
struct Cubin { CUfunction f; unsigned smem; };
static Cubin load_cubin(const char* path, const char* name, unsigned smem) {
  CUmodule mod; CUresult r = cuModuleLoad(&mod, path);
  if (r != CUDA_SUCCESS) { fprintf(stderr, "pdl_probe: cuModuleLoad(%s) failed: %d\n", path, (int)r); exit(1); }
  Cubin k; k.smem = smem;
  if (cuModuleGetFunction(&k.f, mod, name) != CUDA_SUCCESS) { fprintf(stderr, "pdl_probe: no %s in %s\n", name, path); exit(1); }
  if (smem > 48 * 1024) cuFuncSetAttribute(k.f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem);
  return k;
}
static void launch_cubin(const Cubin& k, dim3 g, dim3 b, bool pdl, cudaStream_t st, void** params) {
  CUlaunchConfig cfg = {};
  cfg.gridDimX = g.x; cfg.gridDimY = g.y; cfg.gridDimZ = g.z; cfg.blockDimX = b.x; cfg.blockDimY = b.y;
  cfg.blockDimZ = b.z; cfg.sharedMemBytes = k.smem; cfg.hStream = (CUstream)st;
  CUlaunchAttribute at[1];
  at[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  at[0].value.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at; cfg.numAttrs = pdl ? 1 : 0;
  CUresult r = cuLaunchKernelEx(&cfg, k.f, params, nullptr);
  if (r != CUDA_SUCCESS) { fprintf(stderr, "pdl_probe: cuLaunchKernelEx failed: %d\n", (int)r); exit(1); }
}
struct InfoMma { unsigned sc[2]; unsigned meta[18]; };  // class, WEIGHT_BIAS
struct InfoSplit { unsigned sc[2]; unsigned meta[4]; };  // rows (tokens)
struct InfoCombine { unsigned meta[8]; };  // meta[7]: the output's length

// Every buffer from `cudaMalloc`, or with PDL_PROBE_MALLOC_ASYNC=1 from the stream-ordered allocator's default pool
// (`cudaMallocAsync`, as CubeCL's CUDA storage allocates).
static bool malloc_async() { static int on = -1; if (on < 0) { const char* v = getenv("PDL_PROBE_MALLOC_ASYNC");
  on = v && v[0] == '1'; } return on; }
template <typename T> static cudaError_t dmalloc(T** p, size_t bytes) {
  if (!malloc_async()) return cudaMalloc(p, bytes);
  cudaError_t e = cudaMallocAsync((void**)p, bytes, 0);
  return e != cudaSuccess ? e : cudaStreamSynchronize(0);
}

template <typename T> static T* dev_random(size_t n, unsigned seed) {
  size_t words = (n * sizeof(T) + 3) / 4;  // random words; floats kept finite (exponent field cleared)
  std::vector<unsigned> h(words); unsigned v = seed;
  for (auto& x : h) { v = v * 1664525u + 1013904223u; x = v & 0xbfffffffu; }
  T* d; CK(dmalloc(&d, words * 4)); CK(cudaMemcpy(d, h.data(), words * 4, cudaMemcpyHostToDevice));
  return d;
}

struct Side { uint4* w; unsigned short* s; uint4* xs; unsigned* out; int blocks, threads, ks; };

int main(int argc, char** argv) {
  const int hidden = HIDDEN, reps = 7;
  // PDL_PROBE_ITERS: layers a sample (default 16); two counts give the per-layer slope, free of a fixed cost a sample.
  const char* it_env = getenv("PDL_PROBE_ITERS");
  const int iters = it_env ? atoi(it_env) : 16;
  // CubeCL's CUBINs or PTX (split, gate/up, down waiting at entry, down waiting late, combine), or none (plain CUDA).
  bool cdir = argc == 6;
  CK(cudaFree(0));  // the primary context, current for the driver calls too
  Side gu, dn;
  int rows[2] = {GU_ROWS, DN_ROWS}, kvs[2] = {GU_KV, DN_KV}, kss[2] = {3, 2}, ths[2] = {768, 64}, mts[2] = {2, 1};
  Side* sides[2] = {&gu, &dn};
  for (int m = 0; m < 2; m++) {
    Side& sd = *sides[m];
    size_t vecs = (size_t)POOL_E * rows[m] * kvs[m];
    sd.w = dev_random<uint4>(vecs, 1 + m); sd.s = dev_random<unsigned short>(vecs, 3 + m);
    sd.xs = dev_random<uint4>((size_t)USED_E * 3 * 4 * kvs[m], 5 + m);
    CK(dmalloc(&sd.out, 65536 * 4));
    int warps = USED_E * (rows[m] / 16 / mts[m]) * kss[m];
    sd.blocks = (warps * 32 + ths[m] - 1) / ths[m]; sd.threads = ths[m]; sd.ks = kss[m];
  }
  // The routing of one token: 16 sets of 8 of the POOL_E experts, class 0 holding all 8 slots.
  std::vector<int> hsets(16 * 8);
  unsigned v = 7;
  for (int i = 0; i < 16; i++) {
    std::vector<int> p(POOL_E); for (int e = 0; e < POOL_E; e++) p[e] = e;
    for (int e = POOL_E - 1; e > 0; e--) { v = v * 1664525u + 1013904223u; std::swap(p[e], p[(v >> 8) % (e + 1)]); }
    for (int k = 0; k < 8; k++) hsets[i * 8 + k] = p[k];
  }
  int *sets, *offsets, *pairs, *bounds;
  int hoff[9] = {0, 1, 2, 3, 4, 5, 6, 7, 8}, hpairs[8] = {3, 0, 6, 1, 7, 2, 5, 4}, hb[4] = {0, 8, 8, 8};
  CK(dmalloc(&sets, hsets.size() * 4)); CK(cudaMemcpy(sets, hsets.data(), hsets.size() * 4, cudaMemcpyHostToDevice));
  CK(dmalloc(&offsets, 36)); CK(cudaMemcpy(offsets, hoff, 36, cudaMemcpyHostToDevice));
  CK(dmalloc(&pairs, 32)); CK(cudaMemcpy(pairs, hpairs, 32, cudaMemcpyHostToDevice));
  CK(dmalloc(&bounds, 16)); CK(cudaMemcpy(bounds, hb, 16, cudaMemcpyHostToDevice));
  // PDL_PROBE_COLD_ROUTING=1: each of the 16 routings in buffers of its own (as the engine's layer benchmark uploads
  // them), so that after the copy each layer's first routing reads miss L2; else all layers share one `offsets`,
  // `pairs` and `bounds` and one array of expert sets (L2 hits from the second layer on).
  const char* cold_env = getenv("PDL_PROBE_COLD_ROUTING");
  bool cold = cold_env && cold_env[0] == '1';
  int *csets[16], *coffsets[16], *cpairs[16], *cbounds[16];
  for (int i = 0; i < 16; i++) {
    CK(dmalloc(&csets[i], 32)); CK(cudaMemcpy(csets[i], &hsets[i * 8], 32, cudaMemcpyHostToDevice));
    CK(dmalloc(&coffsets[i], 36)); CK(cudaMemcpy(coffsets[i], hoff, 36, cudaMemcpyHostToDevice));
    CK(dmalloc(&cpairs[i], 32)); CK(cudaMemcpy(cpairs[i], hpairs, 32, cudaMemcpyHostToDevice));
    CK(dmalloc(&cbounds[i], 16)); CK(cudaMemcpy(cbounds[i], hb, 16, cudaMemcpyHostToDevice));
  }
  float* x = dev_random<float>(hidden, 9); unsigned* xsplit; CK(dmalloc(&xsplit, hidden * 12));
  float* y = dev_random<float>(8 * hidden, 11); float* wts = dev_random<float>(8, 13); float* out;
  CK(dmalloc(&out, hidden * 4));
  // The copy the layers queue behind: 2 GiB read, 2 GiB written.
  size_t cbytes = (size_t)1 << 31; void *ca, *cb; CK(dmalloc(&ca, cbytes)); CK(dmalloc(&cb, cbytes));
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t t0, t1; CK(cudaEventCreate(&t0)); CK(cudaEventCreate(&t1));
  const char* kc_env = getenv("PDL_PROBE_KERNEL_COPY");
  bool kernel_copy = kc_env && kc_env[0] == '1';
  auto copy = [&]() {
    if (kernel_copy) {
      size_t n4 = cbytes / 16;
      launch(copy_like, (int)(n4 / 256), 256, true, st, (const float4*)ca, (float4*)cb, n4);
    } else {
      CK(cudaMemcpyAsync(cb, ca, cbytes, cudaMemcpyDeviceToDevice, st));
    }
  };
  auto copy_ms = [&]() {
    CK(cudaEventRecord(t0, st)); copy();
    CK(cudaEventRecord(t1, st)); CK(cudaStreamSynchronize(st)); float ms; CK(cudaEventElapsedTime(&ms, t0, t1));
    return ms;
  };
  std::vector<float> cs; for (int i = 0; i < 6; i++) cs.push_back(copy_ms());
  std::sort(cs.begin(), cs.end()); float copy_alone = cs[3];
  printf("COPY %.1f\n", 2.0 * cbytes / (copy_alone * 1e-3) / 1e9);
  // CubeCL's chain (`gpu_kernels bench --m 1` at its tuned shape): split_x3 (14 x 256) writes the input's split,
  // gate/up (16 x 8 blocks of 32 x 24, 24576 B dynamic shared memory) writes down's split input, down (448 x 8 of
  // 32 x 2, 1028 B as the engine launches it) writes the 8 rows the combine (28 x 256) weighs. Same weights, scales
  // and routings as the plain-CUDA kernels above; each buffer as large as the engine's.
  Cubin c_split, c_gu, c_dn_entry, c_dn_late, c_comb;
  unsigned short* xbf = dev_random<unsigned short>(hidden, 15);
  unsigned *cxs, *chs, *chs_dn; float *cy, *cydn, *cshared;
  CK(dmalloc(&cxs, 3 * hidden * 4)); CK(dmalloc(&chs, 8 * 3 * GU_ROWS * 4)); CK(dmalloc(&chs_dn, 8 * 3 * GU_ROWS * 4));
  CK(dmalloc(&cy, 8 * hidden * 4)); CK(dmalloc(&cydn, 8 * hidden * 4)); CK(dmalloc(&cshared, hidden * 4));
  if (cdir) {
    c_split = load_cubin(argv[1], "split_x3_kernel_f_bf16", 0);
    c_gu = load_cubin(argv[2], "expert_mma_kernel_n_4", 24576);
    c_dn_entry = load_cubin(argv[3], "expert_mma_kernel_n_4", 1028);
    c_dn_late = load_cubin(argv[4], "expert_mma_kernel_n_4", 1028);
    c_comb = load_cubin(argv[5], "combine_kernel", 0);
  }
  InfoMma imma = {{0u, 0x43004300u}, {}};
  InfoSplit isplit = {{1u, 0u}, {}};
  InfoCombine icomb = {{(unsigned)hidden, (unsigned)hidden, (unsigned)hidden, (unsigned)hidden, (unsigned)hidden,
                        (unsigned)hidden, (unsigned)hidden, (unsigned)hidden}};
  // variant: 0 every kernel plain CUDA; 1 every kernel CubeCL's; 2 CubeCL's gate/up, the rest plain CUDA; 3 CubeCL's
  // down, the rest plain CUDA; 4-6 one stage of CubeCL's alone (below). Mode 1 waits at each entry; mode 2: down waits after its first weight loads.
  int *offsets_shared = offsets, *pairs_shared = pairs, *bounds_shared = bounds;
  auto layer = [&](int i, int mode, int variant) {
    bool pdl = mode > 0;
    int* e = cold ? csets[i % 16] : sets + (i % 16) * 8;
    int* offsets = cold ? coffsets[i % 16] : offsets_shared;
    int* pairs = cold ? cpairs[i % 16] : pairs_shared;
    int* bounds = cold ? cbounds[i % 16] : bounds_shared;
    bool cu_all = variant == 1, cu_gu = variant == 1 || variant == 2, cu_dn = variant == 1 || variant == 3;
    // Variants 4-6: one stage of CubeCL's chain alone, as `gpu_kernels bench` times its stages (split + gate/up;
    // down; combine), each call one stage.
    if (variant >= 4) {
      if (variant == 4) {
        void* ps[] = {&xbf, &cxs, &isplit};
        launch_cubin(c_split, dim3(14), dim3(256), pdl, st, ps);
        void* pg[] = {&cxs, &gu.w, &gu.s, &e, &offsets, &pairs, &cy, &chs, &bounds, &imma};
        launch_cubin(c_gu, dim3(GU_ROWS / 2 / 16 / 8, 8), dim3(32, 24), pdl, st, pg);
      } else if (variant == 5) {
        void* p[] = {&chs, &dn.w, &dn.s, &e, &offsets, &pairs, &cydn, &chs_dn, &bounds, &imma};
        launch_cubin(mode == 2 ? c_dn_late : c_dn_entry, dim3(DN_ROWS / 16, 8), dim3(32, 2), pdl, st, p);
      } else {
        void* p[] = {&cydn, &wts, &cshared, &out, &icomb};
        launch_cubin(c_comb, dim3((hidden + 255) / 256), dim3(256), pdl, st, p);
      }
      return;
    }
    if (cu_all) {
      void* p[] = {&xbf, &cxs, &isplit};
      launch_cubin(c_split, dim3(14), dim3(256), pdl, st, p);
    } else {
      launch(route_like, (hidden + 255) / 256, 256, pdl, st, (const float*)x, xsplit, hidden);
    }
    if (cu_gu) {
      void* p[] = {&cxs, &gu.w, &gu.s, &e, &offsets, &pairs, &cy, &chs, &bounds, &imma};
      launch_cubin(c_gu, dim3(GU_ROWS / 2 / 16 / 8, 8), dim3(32, 24), pdl, st, p);
    } else {
      launch(gu_kmma, gu.blocks, gu.threads, pdl, st, (const uint4*)gu.w, (const unsigned short*)gu.s, (const int*)e,
             (const int*)offsets, (const int*)pairs, (const int*)bounds, (const uint4*)gu.xs, gu.out, gu.ks);
    }
    if (cu_dn) {
      void* p[] = {&chs, &dn.w, &dn.s, &e, &offsets, &pairs, &cydn, &chs_dn, &bounds, &imma};
      launch_cubin(mode == 2 ? c_dn_late : c_dn_entry, dim3(DN_ROWS / 16, 8), dim3(32, 2), pdl, st, p);
    } else {
      launch(dn_kmma, dn.blocks, dn.threads, pdl, st, (const uint4*)dn.w, (const unsigned short*)dn.s, (const int*)e,
             (const int*)offsets, (const int*)pairs, (const int*)bounds, (const uint4*)dn.xs, dn.out, dn.ks);
    }
    if (cu_all) {
      void* p[] = {&cydn, &wts, &cshared, &out, &icomb};
      launch_cubin(c_comb, dim3((hidden + 255) / 256), dim3(256), pdl, st, p);
    } else {
      launch(combine_like, (hidden + 255) / 256, 256, pdl, st, (const float*)y, (const float*)wts, out, hidden);
    }
  };
  const char* names[3] = {"plain", "pdl_start", "pdl_early"};
  const char* vnames[7] = {"cuda", "cubecl", "cubecl_gate_up", "cubecl_down", "cubecl_stage_split_gate_up",
                           "cubecl_stage_down", "cubecl_stage_combine"};
  for (int round = 0; round < 2; round++) {
   for (int variant = 0; variant < (cdir ? 7 : 1); variant++) {
    for (int mode = 0; mode < 3; mode++) {
      CK(cudaMemcpyToSymbol(pdl_mode, &mode, sizeof(int)));
      for (int i = 0; i < 4; i++) layer(i, mode, variant);
      std::vector<float> samples;
      for (int r = 0; r < reps; r++) {
        CK(cudaStreamSynchronize(st));
        CK(cudaEventRecord(t0, st)); copy();
        auto h0 = std::chrono::steady_clock::now();
        for (int i = 0; i < iters; i++) layer(i, mode, variant);
        double enq = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count();
        CK(cudaEventRecord(t1, st)); CK(cudaStreamSynchronize(st));
        float ms; CK(cudaEventElapsedTime(&ms, t0, t1));
        if (enq < 0.9 * copy_alone) samples.push_back((ms - copy_alone) * 1e3f / iters);
      }
      std::sort(samples.begin(), samples.end());
      float us = samples.size() >= 3 ? samples[samples.size() / 2] : -1.f;
      printf("ROW %s %s %d %.2f %zu\n", vnames[variant], names[mode], round, us, samples.size());
      CK(cudaGetLastError());
    }
   }
  }
  CK(cudaDeviceSynchronize());
  CK(cudaGetLastError());
  return 0;
}
"""

HOOKS = {
    # gate/up's weights are at addresses the previous launch (the router) writes: it waits at its start.
    "gu": ("if (pdl_mode) { PDL_WAIT(); PDL_TRIGGER(); }", ""),
    # down's weights are at addresses the router wrote two launches back: in mode 2 it loads its first block first.
    "dn": ("if (pdl_mode == 1) PDL_WAIT(); if (pdl_mode) PDL_TRIGGER();", "if (pdl_mode == 2) PDL_WAIT();"),
}


def program(pool=POOL):
    """The probe's CUDA source: the ladder source twice (gate/up and down shapes, in namespaces), then `MAIN`;
    each layer's 8 experts are drawn from `pool`."""
    ladder = SRC.replace('extern "C" ', "")
    parts = ["#include <chrono>\n#include <cuda_runtime.h>\n__device__ int pdl_mode;  // 0 plain, 1 wait at start, "
             "2 down waits after its first weight loads\n"
             '#define PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")\n'
             '#define PDL_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")\n']
    for ns, m, warps in (("gu", "gate_up", 24), ("dn", "down", 2)):
        rows_e, kv, mt = MATRICES[m]
        start, loaded = HOOKS[ns]
        parts.append(f"#define ROWS {rows_e}\n#define KV {kv}\n#define NBLK ({kv} / 4)\n#define MT {mt}\n"
                     f"#define LWARPS {warps}\n#define LADDER_PDL_START {start}\n#define LADDER_PDL_LOADED {loaded}\n"
                     f"namespace {ns} {{\n{ladder}\n}}\n"
                     "#undef ROWS\n#undef KV\n#undef NBLK\n#undef MT\n#undef LWARPS\n#undef LADDER_PDL_START\n"
                     "#undef LADDER_PDL_LOADED\n#undef TPE\n#undef TASKS\n#undef EXPERT_VECS\n")
    parts.append("#define PDL_ENTRY if (pdl_mode) { PDL_WAIT(); PDL_TRIGGER(); }\n"
                 "static const auto gu_kmma = gu::kmma; static const auto dn_kmma = dn::kmma;\n")
    gu_rows, gu_kv, _ = MATRICES["gate_up"]
    dn_rows, dn_kv, _ = MATRICES["down"]
    consts = (f"#define HIDDEN {dn_rows}\n#define GU_ROWS {gu_rows}\n#define GU_KV {gu_kv}\n#define DN_ROWS {dn_rows}\n"
              f"#define DN_KV {dn_kv}\n#define POOL_E {pool}\n#define USED_E {USED}\n")
    return "".join(parts) + consts + MAIN


# The one-token layer's CubeCL kernels at `gpu_kernels bench --m 1`'s tuned shape, by their dumped CUBIN's name.
CUBINS = {"split": "split_x3_bf16_k7168", "gate_up": "mma_gate_up_k7168_tb1_t2_x8_ks3",
          "down": "mma_down_k2048_tb1_t1_x1_ks2", "combine": "combine_hidden7168_topk8"}


def cubin_args(late_dir, entry_dir):
    """The probe's arguments: split, gate/up, down waiting at entry, down waiting late, combine (CUBIN paths)."""
    def path(d, key):
        # A CUBIN, or a PTX (which the driver compiles when it loads it, as it does the engine's).
        for ext in (".cubin", ".ptx"):
            f = os.path.join(d, CUBINS[key] + ext)
            if os.path.isfile(f):
                return f
        sys.exit(f"pdl_probe: no {CUBINS[key]}.cubin or .ptx in {d} (dump one with `cargo xtask kernels --arch sm_90 "
                 "--dump DIR`)")
    return [path(late_dir, "split"), path(late_dir, "gate_up"), path(entry_dir, "down"), path(late_dir, "down"),
            path(late_dir, "combine")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--keep", help="write the generated CUDA source here too")
    ap.add_argument("--cubecl", metavar="DIR",
                    help="also time CubeCL's own kernels in the chain (all four, and its gate/up or down alone among "
                         "the plain-CUDA ones), from the CUBINs `cargo xtask kernels --arch sm_90 --dump DIR` wrote for "
                         f"{', '.join(CUBINS.values())} (down waiting late)")
    ap.add_argument("--cubecl-entry", metavar="DIR",
                    help="the dump made with EYRIE_PDL_LATE=0 (down waiting at its entry; default: --cubecl's down)")
    ap.add_argument("--malloc-async", action="store_true",
                    help="allocate every buffer with cudaMallocAsync (the default pool, as CubeCL does) instead of "
                         "cudaMalloc")
    ap.add_argument("--cold-routing", action="store_true",
                    help="each of the 16 routings in buffers of its own (their first reads after the copy miss L2, "
                         "as in the engine's layer benchmark) instead of shared ones")
    ap.add_argument("--kernel-copy", action="store_true",
                    help="queue the layers behind a copy kernel launched with PDL (as the engine's benchmark does) "
                         "instead of cudaMemcpyAsync")
    ap.add_argument("--iters", type=int, default=16,
                    help="layers queued behind the copy a sample (default 16): the per-layer figure is (copy + "
                         "layers - copy alone) / iters, so two counts separate a fixed cost a sample from a layer's")
    ap.add_argument("--pool", type=int, default=POOL,
                    help=f"experts each layer draws its 8 from (default {POOL}; Kimi-K2's layer has 384)")
    args = ap.parse_args()
    nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
    if nvcc is None:
        sys.exit("pdl_probe: nvcc not found (run it on the GPU machine)")
    if args.pool < USED:
        sys.exit(f"pdl_probe: --pool must be at least {USED}")
    if not 1 <= args.iters <= 64:
        sys.exit(f"pdl_probe: --iters {args.iters}; it must be 1 to 64")
    if args.cubecl_entry and not args.cubecl:
        sys.exit("pdl_probe: --cubecl-entry needs --cubecl (the dump with the other three kernels)")
    cubins = cubin_args(args.cubecl, args.cubecl_entry or args.cubecl) if args.cubecl else []
    src = program(args.pool)
    if args.keep:
        with open(args.keep, "w") as f:
            f.write(src)
    with tempfile.TemporaryDirectory() as d:
        cu, exe = os.path.join(d, "pdl_probe.cu"), os.path.join(d, "pdl_probe")
        with open(cu, "w") as f:
            f.write(src)
        built = subprocess.run([nvcc, "-O3", "-std=c++17", "-arch=sm_90", "-o", exe, cu, "-lcuda"], capture_output=True, text=True)
        if built.returncode != 0:
            sys.exit(f"pdl_probe: nvcc failed:\n{built.stderr[-4000:]}")
        env = dict(os.environ, PDL_PROBE_MALLOC_ASYNC="1" if args.malloc_async else "0",
                   PDL_PROBE_COLD_ROUTING="1" if args.cold_routing else "0",
                   PDL_PROBE_KERNEL_COPY="1" if args.kernel_copy else "0",
                   PDL_PROBE_ITERS=str(args.iters))
        ran = subprocess.run([exe] + cubins, capture_output=True, text=True, env=env)
        if ran.returncode != 0:
            sys.exit(f"pdl_probe: the probe failed (rc {ran.returncode}):\n{ran.stdout}{ran.stderr}")
    copy_gbs, rows = None, []
    for line in ran.stdout.splitlines():
        if m := re.match(r"COPY ([\d.]+)", line):
            copy_gbs = float(m.group(1))
        elif m := re.match(r"ROW (\S+) (\S+) (\d+) ([-\d.]+) (\d+)", line):
            us = float(m.group(4))
            rows.append({"kernels": m.group(1), "mode": m.group(2), "round": int(m.group(3)),
                         "us": us if us >= 0 else None, "samples": int(m.group(5))})
    how = "copy kernel with PDL" if args.kernel_copy else "cudaMemcpy D2D"
    print(f"copy bandwidth ({how}, read + write): {copy_gbs:.0f} GB/s; 8 experts a layer of {args.pool}")
    print("kernels: cuda = route+split, gate/up kmma, down kmma, combine (plain CUDA); cubecl = CubeCL's split_x3, "
          "gate/up, down, combine (its CUBINs); cubecl_gate_up / cubecl_down = that one CubeCL kernel among the CUDA ones; "
          "cubecl_stage_* = one stage of CubeCL's chain alone a call, as `gpu_kernels bench` times its stages")
    print("| kernels | launches | round | GPU us a layer | samples |")
    print("|---|---|---|---|---|")
    for r in rows:
        us = f"{r['us']:.1f}" if r["us"] is not None else "host-bound"
        print(f"| {r['kernels']} | {r['mode']} | {r['round']} | {us} | {r['samples']} of 7 |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbs": copy_gbs, "pool": args.pool, "malloc_async": args.malloc_async,
                       "cold_routing": args.cold_routing, "kernel_copy": args.kernel_copy, "iters": args.iters,
                       "cubins": cubins,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
