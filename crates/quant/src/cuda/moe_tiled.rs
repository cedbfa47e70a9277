//! The fused INT4 MoE at prefill widths as a tiled grouped GEMM on tensor cores (`mma.sync.m16n8k16`, BF16
//! operands, f32 accumulation), at f32 precision: the math of [`super::moe_mma`] (weights `bf16(q * scale)` exactly
//! as compressed-tensors decompresses them, f32 activations split exactly into three BF16 parts, short tensor-core
//! chains added in f32), with shared-memory tiles so each weight is read once for 64 token-expert pairs instead of
//! 8 or 16. `scripts/moe_prefill_probe.py` is the same kernel in plain CUDA (its measured target: a Kimi-K2 layer
//! of 8192 tokens 64.7 ms against the 16-tokens-a-pass path's 110.3 on an H100, bench/REPORT.md session 33). This
//! one, the whole layer (splits, tile list, both GEMMs, combine), same H100 model (session 34, `gpu_kernels
//! prefill`): 8192 tokens 58.5 ms (98.7 TFLOP/s of useful work) against 110.3, 4096 38.0 against 56.2, 2048 19.2
//! against 29.6; at 1024 (~21 pairs an expert, tiles a third full) 18.8 against 16.8, so the launcher takes it
//! from [`super::gpu::TILED_GEMM_MIN_TOKENS`]. Checked against the CPU references (`gpu_kernels check`, f32 and
//! BF16 inputs, both weight layouts, groups 32 and 64): 2.0e-7..4.3e-7 of the compressed-tensors reference.
//!
//! # Launches
//!
//! 1. [`split_rows_kernel`]: the layer input `x` `[m, hidden]` as `[m, 3, hidden]` BF16 parts (`x = hi + mid +
//!    lo`, each part the remainder of the previous ones with its low 16 bits cut), columns in order.
//! 2. [`tile_list_kernel`]: the tiles of the routing: each active expert's pairs (positions of
//!    [`super::gpu::GpuRouting`]'s `pairs`, grouped by expert) cut into tiles of up to [`BM`] pairs, written as
//!    `(slot, first position, pairs)` after their count; the routing stays on the device.
//! 3. [`tiled_expert_kernel`], gated: block `(x, tile)` computes 64 intermediate columns (64 gate rows and the
//!    matching 64 up rows of the tile's expert) for the tile's pairs, `silu(gate) * up` in f32, and writes it split
//!    the same way (`[pairs, 3, inter]` BF16 parts, rows by position in `pairs`): the down launch's input.
//! 4. [`tiled_expert_kernel`], down: block `(x, tile)` computes 128 output columns of the tile's pairs into `y`
//!    `[pairs, hidden]` f32 by pair index (`t * topk + k`), which the layer's combine launch sums.
//!
//! # The block
//!
//! 128 threads, 4 warps as 2 x 2 (32 pairs x 64 weight rows each); 32 columns a stage (one scale group of 32, or
//! part of one of 64 or 128). Each stage: thread `t` dequantizes weight row `t`'s 32 columns into shared memory
//! (`(128 + u) - 136` then one rounding multiply by the BF16 scale, as [`super::kernels::weight_pair`]); the
//! activations' three parts of the next stage are loaded into registers (gathered by token for gate/up) while
//! this stage's MMAs run, then stored into the other of two shared buffers. Fragments come from shared memory by
//! `ldmatrix` (rows padded to 40 BF16s, 80 bytes, so the 8 row addresses of a matrix fall on distinct banks). Each
//! stage's products (2 x 16 columns x 3 parts) are chained in the tensor core from zero and added into f32
//! registers. Rows past a tile's pair count read the tile's last pair (finite values) and are not written.

use burn::cubecl;
use cubecl::cmma::{MatrixIdent, MmaDefinition};
use cubecl::prelude::*;
use half::bf16;

use super::kernels::{WEIGHT_BIAS, scale_pair, tiled_scale, tiled_vector};
use super::moe_mma::{mma_into, split_part};

/// Token-expert pairs a tile (the GEMM's M).
pub const BM: usize = 64;
/// Weight rows a block (the GEMM's N): 128 down rows, or 64 gate rows and their 64 up rows.
pub const BN: usize = 128;
/// 16-byte vectors a shared-memory row: 32 BF16 columns and 8 of padding.
const ROWV: usize = 5;
/// Most experts the tile list takes (its shared prefix array).
pub const MAX_SLOTS: usize = 1024;
/// Threads of the tile-list launch.
pub const LIST_THREADS: usize = 256;
/// Shared memory of a [`tiled_expert_kernel`] block, bytes: two stages of the activations' three parts and one
/// stage of weights.
pub const SHARED_BYTES: usize = (2 * 3 * BM + BN) * ROWV * 16;

/// `x` `[rows, k]` (f32 or BF16) as `out` `[rows, 3, k / 2]` words: word `j` of part `p` of row `r` holds the
/// parts `p` of columns `2 j` (low half) and `2 j + 1`. One thread a word of the three parts (`words = rows k / 2`).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn split_rows_kernel<F: Float>(x: &Array<F>, out: &mut Array<u32>, words: u32, #[comptime] k: usize) {
    let idx = ABSOLUTE_POS;
    if idx < words as usize {
        let half = comptime!(k / 2);
        let r = idx / half;
        let j = idx % half;
        let a = f32::cast_from(x[r * k + 2 * j]);
        let b = f32::cast_from(x[r * k + 2 * j + 1]);
        let base = r * 3 * half + j;
        #[unroll]
        for p in 0..3usize {
            out[base + p * half] = split_part(a, p) | (split_part(b, p) << 16u32);
        }
    }
}

/// The routing's tiles: `tiles[0]` = their count, then `(slot, first position, pairs)` a tile, for each slot `s <
/// bounds[3]` in order, its pairs `offsets[s]..offsets[s + 1]` cut into tiles of up to `bm`. One block of
/// [`LIST_THREADS`] threads; at most [`MAX_SLOTS`] slots (the launcher's check). `tiles` must hold `1 + 3 x` the
/// most tiles the routing can have (`ceil(pairs / bm) + slots`).
#[cube(launch_unchecked)]
#[allow(clippy::manual_div_ceil)]
pub fn tile_list_kernel(offsets: &Array<u32>, bounds: &Array<u32>, tiles: &mut Array<u32>, #[comptime] bm: usize) {
    let mut start = SharedMemory::<u32>::new(comptime!(MAX_SLOTS + 1));
    let ns = bounds[3] as usize;
    let tid = UNIT_POS as usize;
    let mut s = tid;
    while s < ns {
        let c = offsets[s + 1] - offsets[s];
        start[s + 1] = (c + comptime!(bm as u32) - 1) / comptime!(bm as u32);
        s += comptime!(LIST_THREADS);
    }
    sync_cube();
    if tid == 0 {
        start[0] = 0u32;
        for i in 0..ns {
            start[i + 1] += start[i];
        }
        tiles[0] = start[ns];
    }
    sync_cube();
    let mut s = tid;
    while s < ns {
        let b = offsets[s + 1];
        let mut p = offsets[s];
        let mut n = start[s] as usize;
        while p < b {
            let mut c = b - p;
            if c > comptime!(bm as u32) {
                c = comptime!(bm as u32);
            }
            tiles[1 + 3 * n] = s as u32;
            tiles[2 + 3 * n] = p;
            tiles[3 + 3 * n] = c;
            n += 1;
            p += comptime!(bm as u32);
        }
        s += comptime!(LIST_THREADS);
    }
}

/// One tiled GEMM of the experts (module docs), grid `(rows / 128 or (rows / 2) / 64, most tiles)`, [`BN`]
/// threads; blocks past `tiles[0]` do nothing.
///
/// - `xs`: the input's three parts `[rows_in, 3, k]` BF16 as 16-byte vectors: the layer input (gated; row = token
///   `pairs[q] / topk`) or the intermediate (down; row = position `q`).
/// - `words`, `scales`: all experts' `[E, rows, k / 8]` words and `[E, rows, k / group]` BF16 scales (tiled or
///   row-major, [`super::experts::KernelLayout`]); `rows` = 2 inter (gate rows, then up rows) or hidden.
/// - `experts`, `pairs`, `tiles`: the routing's slot experts, positions' pair indices and [`tile_list_kernel`]'s
///   list.
/// - gated: `split_out` `[pairs, 3, rows / 4]` words (`silu(gate) * up` split as [`split_rows_kernel`], by
///   position); down: `out` `[pairs, rows]` f32 by pair index. The other is not touched.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn tiled_expert_kernel<N: Size>(
    xs: &Array<Vector<u32, N>>,
    words: &Array<Vector<u32, N>>,
    scales: &Array<bf16>,
    experts: &Array<u32>,
    pairs: &Array<u32>,
    tiles: &Array<u32>,
    split_out: &mut Array<u32>,
    out: &mut Array<f32>,
    #[comptime] k: usize,
    #[comptime] rows: usize,
    #[comptime] group: usize,
    #[comptime] topk: usize,
    #[comptime] gated: bool,
    #[comptime] tiled: bool,
) {
    let ti = CUBE_POS_Y as usize;
    if ti < tiles[0] as usize {
        let tid = UNIT_POS as usize;
        let lane = tid % 32;
        let warp = tid / 32;
        let wm = warp / 2;
        let wn = warp % 2;
        let nb = CUBE_POS_X as usize;
        let slot = tiles[1 + 3 * ti] as usize;
        let q0 = tiles[2 + 3 * ti] as usize;
        let cnt = tiles[3 + 3 * ti] as usize;
        let e = experts[slot] as usize;
        let kv = comptime!(k / 8);
        let nst = comptime!(k / 32);
        let ng = comptime!(k / group);

        let mut sa = SharedMemory::<Vector<bf16, Const<8>>>::new_aligned(comptime!(2 * 3 * BM * ROWV), 16usize);
        let mut sb = SharedMemory::<Vector<bf16, Const<8>>>::new_aligned(comptime!(BN * ROWV), 16usize);

        // This thread's 6 activation vectors a stage: chunk c = tid + 128 i is part c / 256, tile row (c % 256) / 4,
        // 16-byte quarter c % 4 of the stage's 32 columns.
        let mut abase = Array::<usize>::new(6usize);
        let mut adst = Array::<usize>::new(6usize);
        #[unroll]
        for i in 0..6usize {
            let c = tid + 128 * i;
            let part = c / 256;
            let row = (c % 256) / 4;
            let qv = c % 4;
            let mut r = row;
            if r >= cnt {
                r = cnt - 1;
            }
            let q = q0 + r;
            let mut arow = q;
            if comptime!(gated) {
                arow = pairs[q] as usize / topk;
            }
            abase[i] = (arow * 3 + part) * kv + qv;
            adst[i] = (part * BM + row) * ROWV + qv;
        }
        // Weight row of shared row `tid`: down, row 128 nb + tid; gated, warp column half wn = tid / 64 holds gate
        // rows 64 nb + 32 wn + 0..32 then the matching up rows.
        let mut wrow = e * rows + nb * BN + tid;
        if comptime!(gated) {
            let local = tid % 64;
            let base = e * rows + nb * 64 + (tid / 64) * 32;
            wrow = base + local;
            if local >= 32 {
                wrow = base + comptime!(rows / 2) + local - 32;
            }
        }

        let mut areg = Array::<Vector<u32, N>>::new(6usize);
        #[unroll]
        for i in 0..6usize {
            areg[i] = xs[abase[i]];
        }
        #[unroll]
        for i in 0..6usize {
            sa[adst[i]] = Vector::<bf16, Const<8>>::reinterpret(areg[i]);
        }
        let mut wv = words[weight_vector(wrow, 0, k, tiled)];
        let mut sc = scales[weight_scale(wrow, 0, ng, group, tiled)];

        let mut acc = Array::<f32>::new(64usize);
        #[unroll]
        for a in 0..64usize {
            acc[a] = f32::new(0.0);
        }
        let def = MmaDefinition::<bf16, bf16, f32>::new(16usize, 8usize, 16usize);
        let bias = u32::new(WEIGHT_BIAS as i64);
        for kt in 0..nst {
            let st = kt % 2;
            sync_cube(); // every warp is done with `sb` and with the other activation buffer (stage kt - 1)
            let s2 = scale_pair(sc);
            #[unroll]
            for v in 0..4usize {
                let word = wv[v];
                let ev = word & u32::new(0x0F0F_0F0F);
                let od = (word >> 4u32) & u32::new(0x0F0F_0F0F);
                let mut packed = Vector::<u32, N>::empty();
                packed[0] = dequant_pair((ev & u32::new(0xFF)) | ((od << 16u32) & u32::new(0x00FF_0000)), bias, s2);
                packed[1] =
                    dequant_pair(((ev >> 8u32) & u32::new(0xFF)) | ((od << 8u32) & u32::new(0x00FF_0000)), bias, s2);
                packed[2] = dequant_pair(((ev >> 16u32) & u32::new(0xFF)) | (od & u32::new(0x00FF_0000)), bias, s2);
                packed[3] = dequant_pair((ev >> 24u32) | ((od >> 8u32) & u32::new(0x00FF_0000)), bias, s2);
                sb[tid * ROWV + v] = Vector::<bf16, Const<8>>::reinterpret(packed);
            }
            if kt + 1 < nst {
                #[unroll]
                for i in 0..6usize {
                    areg[i] = xs[abase[i] + (kt + 1) * 4];
                }
                wv = words[weight_vector(wrow, kt + 1, k, tiled)];
                sc = scales[weight_scale(wrow, kt + 1, ng, group, tiled)];
            }
            sync_cube(); // `sb` and this stage's activations are visible

            let mut part = Array::<f32>::new(64usize);
            #[unroll]
            for a in 0..64usize {
                part[a] = f32::new(0.0);
            }
            #[unroll]
            for ks in 0..2usize {
                // B fragments of the warp's 8 n tiles: matrix (n half lane / 16, k half (lane / 8) % 2).
                let mut bf = Array::<Vector<bf16, Const<2>>>::new(16usize);
                #[unroll]
                for jj in 0..4usize {
                    let n = wn * 64 + jj * 16 + (lane / 16) * 8 + lane % 8;
                    let at = n * ROWV + ks * 2 + (lane / 8) % 2;
                    let r = def.load_matrix::<Vector<bf16, Const<8>>, Const<2>>(
                        &sb.slice(at, at + 1),
                        MatrixIdent::B,
                        4usize,
                        false,
                    );
                    #[unroll]
                    for u in 0..4usize {
                        bf[4 * jj + u] = r[u];
                    }
                }
                #[unroll]
                for pi in 0..3usize {
                    let p = 2 - pi; // lo, mid, hi: the small products first
                    #[unroll]
                    for m in 0..2usize {
                        let row = wm * 32 + m * 16 + lane % 16;
                        let at = ((st * 3 + p) * BM + row) * ROWV + ks * 2 + lane / 16;
                        let af = def.load_matrix::<Vector<bf16, Const<8>>, Const<2>>(
                            &sa.slice(at, at + 1),
                            MatrixIdent::A,
                            4usize,
                            false,
                        );
                        #[unroll]
                        for j in 0..8usize {
                            let mut rb = Array::<Vector<bf16, Const<2>>>::new(2usize);
                            rb[0] = bf[2 * j];
                            rb[1] = bf[2 * j + 1];
                            mma_into(&af, &rb, &mut part, (m * 8 + j) * 4);
                        }
                    }
                }
            }
            #[unroll]
            for a in 0..64usize {
                acc[a] += part[a];
            }
            if kt + 1 < nst {
                let other = (1 - st) * comptime!(3 * BM * ROWV);
                #[unroll]
                for i in 0..6usize {
                    sa[other + adst[i]] = Vector::<bf16, Const<8>>::reinterpret(areg[i]);
                }
            }
        }

        // Lane (g, c4) holds, for m tile m and n tile j, rows g and g + 8 of the m tile, columns 2 c4 and 2 c4 + 1.
        let g = lane / 4;
        let c4 = lane % 4;
        #[unroll]
        for m in 0..2usize {
            #[unroll]
            for h in 0..2usize {
                let prow = wm * 32 + m * 16 + g + 8 * h;
                if prow < cnt {
                    let q = q0 + prow;
                    if comptime!(gated) {
                        let hw = comptime!(rows / 4);
                        #[unroll]
                        for j in 0..4usize {
                            let g0 = acc[(m * 8 + j) * 4 + 2 * h];
                            let g1 = acc[(m * 8 + j) * 4 + 2 * h + 1];
                            let v0 = g0 / (f32::new(1.0) + (-g0).exp()) * acc[(m * 8 + j + 4) * 4 + 2 * h];
                            let v1 = g1 / (f32::new(1.0) + (-g1).exp()) * acc[(m * 8 + j + 4) * 4 + 2 * h + 1];
                            let col = nb * 64 + wn * 32 + j * 8 + 2 * c4;
                            #[unroll]
                            for p in 0..3usize {
                                split_out[(q * 3 + p) * hw + col / 2] =
                                    split_part(v0, p) | (split_part(v1, p) << 16u32);
                            }
                        }
                    } else {
                        let pid = pairs[q] as usize;
                        #[unroll]
                        for j in 0..8usize {
                            let col = nb * BN + wn * 64 + j * 8 + 2 * c4;
                            out[pid * rows + col] = acc[(m * 8 + j) * 4 + 2 * h];
                            out[pid * rows + col + 1] = acc[(m * 8 + j) * 4 + 2 * h + 1];
                        }
                    }
                }
            }
        }
    }
}

/// The BF16 pair `bf16((u0 - 8) s), bf16((u1 - 8) s)` of two nibbles `u0` (bits 0..4) and `u1` (bits 16..20) of
/// `bits`, as one word: `(128 + u) - 136` is exact, the multiply rounds once (compressed-tensors' rounding).
#[cube]
fn dequant_pair(bits: u32, bias: u32, s2: Vector<bf16, Const<2>>) -> u32 {
    let biased = Vector::<bf16, Const<2>>::reinterpret(bits | bias);
    let mut offset = Vector::<bf16, Const<2>>::empty();
    offset[0] = bf16::new(136.0);
    offset[1] = bf16::new(136.0);
    u32::reinterpret((biased - offset) * s2)
}

/// Index of 16-byte vector `v` (columns `32 v .. 32 v + 32`) of matrix row `row` (of all experts' rows).
#[cube]
fn weight_vector(row: usize, v: usize, #[comptime] k: usize, #[comptime] tiled: bool) -> usize {
    let mut at = row * comptime!(k / 32) + v;
    if comptime!(tiled) {
        at = tiled_vector(row, v, k);
    }
    at
}

/// Index of the scale of columns `32 v .. 32 v + 32` of matrix row `row`.
#[cube]
fn weight_scale(
    row: usize,
    v: usize,
    #[comptime] ng: usize,
    #[comptime] group: usize,
    #[comptime] tiled: bool,
) -> usize {
    let gi = v * 32 / group;
    let mut at = row * ng + gi;
    if comptime!(tiled) {
        at = tiled_scale(row, gi, ng);
    }
    at
}

/// Whether the tiled path takes experts of `shape`: widths that split into whole blocks and stages, groups of a
/// multiple of 32 dividing both widths, at most [`MAX_SLOTS`] experts, and the block's shared memory within
/// `smem_limit`.
pub fn tiled_fits(shape: &super::MoeShape, smem_limit: usize) -> bool {
    let s = shape;
    s.hidden.is_multiple_of(BN)
        && s.inter.is_multiple_of(64)
        && s.group.is_multiple_of(32)
        && s.hidden.is_multiple_of(s.group)
        && s.inter.is_multiple_of(s.group)
        && s.experts <= MAX_SLOTS
        && SHARED_BYTES <= smem_limit
}

/// The indexing width of the tiled launches for `m` tokens of `pairs` pairs (the largest array they index, in
/// its elements: the words of either matrix in bytes' quarters, the splits, `y`).
pub fn tiled_address(shape: &super::MoeShape, m: usize, pairs: usize) -> AddressType {
    let s = shape;
    let words = s.experts * 2 * s.inter * s.hidden / 8;
    AddressType::from_len(
        [m * 3 * s.hidden / 2, pairs * 3 * s.inter / 2, words, pairs * s.hidden].into_iter().max().unwrap_or(0),
    )
}

/// Token-expert pairs of the widest prefill chunk the specialisation lists assume (8192 tokens of top-8; the
/// model's `KERNEL_MAX_PAIRS`).
pub const SPEC_PAIRS: usize = 65_536;

/// Whether one step of `m` tokens and `pairs` pairs over `slots` expert slots fits the launches' limits: the most
/// tiles within a grid's height (65535) and the input split's word count within `u32` (its launch argument). Past
/// them the launcher keeps the 16-tokens-a-pass kernels (the model's chunks, 8192 tokens of top-8, stay far below).
pub fn tiled_launchable(shape: &super::MoeShape, m: usize, pairs: usize, slots: usize) -> bool {
    max_tiles(pairs, slots) <= 65_535 && m * shape.hidden / 2 <= u32::MAX as usize
}

/// Most tiles a routing of `pairs` pairs over `slots` expert slots can cut into.
pub fn max_tiles(pairs: usize, slots: usize) -> usize {
    pairs.div_ceil(BM) + slots
}
