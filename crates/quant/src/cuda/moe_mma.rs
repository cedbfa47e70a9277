//! The fused INT4 MoE's expert kernels on tensor cores (`mma.sync.m16n8k16`, BF16 operands, f32 accumulation), at
//! f32 precision: the same math as [`super::kernels::expert_rows_kernel`] (weights `bf16(q * scale)` exactly as
//! compressed-tensors decompresses them, f32 activations, f32 accumulation) with a fraction of its instructions.
//!
//! # Operands
//!
//! - A (16 rows x 16 columns of one expert's matrix): the dequantized weights, built in registers two at a time
//!   exactly as the CUDA-core kernel does (`(128 + u) - 136`, then one rounding multiply by the scale: a packed
//!   BF16 pair is one A register).
//! - B (16 columns x 8): the activations as three exact BF16 parts, `x = hi + mid + lo` (each part the remainder
//!   of the previous one with its low 16 bits cut, as [`super::gemm::split_bf16x3`]), one B column per part and
//!   token: column `3 t + p` is part `p` of token `t`, so one MMA covers 2 tokens and `ceil(3 tb / 8)` MMAs cover
//!   `tb`. Every product of two BF16s is exact in f32; the parts of a token are added in f32 at the end.
//! - Accumulation: each 128-column block (8 MMAs, chained through the tensor core's accumulator) starts from zero
//!   and is added into f32 registers, so the tensor core never sums more than 128 products (its adds truncate;
//!   `super::gemm` measured what long chains cost).
//!
//! # No repacking: the K order is the lanes' own
//!
//! An MMA sums over its 16 K positions in any order, so the kernel chooses which matrix column each K slot of each
//! lane is, and gives B the same choice. Lane `(g, c)` (`g = lane / 4`, `c = lane % 4`) loads, for each 128-column
//! block `i`, the 16-byte vector `4 i + c` of rows `g` and `g + 8` of its 16-row tile: one coalesced load each, no
//! lane loads what another uses. MMA `t` (0..8) of the block takes from every lane word `t / 2` of its vector,
//! nibble pairs `2 (t % 2)` and `2 (t % 2) + 1` (a pair is nibbles `p` and `p + 4`: columns `8 w + p` and
//! `8 w + p + 4`, one packed BF16 register). The activations are stored permuted to match ([`split_x3_kernel`]):
//! within each 32-column vector, word `4 w + p` holds columns `(8 w + p, 8 w + p + 4)`, so lane `(n, c)`'s B
//! registers for the block's 8 MMAs are the 64 contiguous bytes of vector `4 i + c` of its column's row.
//!
//! # Work split
//!
//! Grid `(row tiles, expert slots)` as the CUDA-core kernel (class bounds on the device, each grid row looping over
//! its class's slots). A warp computes one task: gated (gate/up), 16 units = a 16-row gate tile and the matching up
//! tile; otherwise `16 tiles` consecutive rows. `ksplit` warps share a task, each taking every `ksplit`-th block
//! of 128 columns, and add up through shared memory. No activation staging, no barrier before the weight loads:
//! the B operands come from global memory (L1/L2-resident: every warp of the layer reads the same few KB). A warp
//! loads its next block while it computes the current one (two register sets; a third, two blocks ahead, measured
//! no faster on the H200: bench/REPORT.md).
//!
//! Weights staged in shared memory instead (a ring of `cp.async` copies, one `mbarrier` a stage: commit a13e488)
//! were correct and no faster on the H200 (bench/REPORT.md, session 18): the barrier and copy instructions add a
//! third to the loop, which the registers' version does not need to keep enough bytes in flight.
//!
//! # Programmatic dependent launch
//!
//! On sm_90+ every CubeCL kernel is a programmatic dependent launch that waits for its predecessor (vendored
//! cubecl-cuda, `eyrie_source_rewrite`). The down launch (ungated) places its waits itself
//! (`comment!("EYRIE_PDL_WAIT")`): its first block of weights and scales, and the routing (written by the router,
//! two launches back), are read before it waits for gate/up's intermediate, so those loads overlap gate/up's tail;
//! every thread passes a second wait before it ends. The gated launch reads the routing its predecessor wrote and
//! waits at its entry.

use burn::cubecl;
use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;
use half::bf16;

use super::kernels::{scale_pair, weight_pair};

/// Split-permuted activations for [`expert_mma_kernel`]: `out` `[rows, 3, k / 2]` words, word `j` of part `p` of
/// row `r` = BF16 parts `p` of columns `(32 v + 8 w + q, 32 v + 8 w + q + 4)` (`j = 16 v + 4 w + q`), low half
/// first. One thread per word of the three parts.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn split_x3_kernel<F: Float>(x: &Array<F>, out: &mut Array<u32>, rows: u32, #[comptime] k: usize) {
    let idx = ABSOLUTE_POS;
    if idx < rows as usize * comptime!(k / 2) {
        split_x3_word::<F>(x, out, idx, k);
    }
}

/// Word `idx` of [`split_x3_kernel`]'s output (row `idx / (k / 2)`), all three parts; `idx` must be below
/// `rows * k / 2`. Also run by the device router's launch (`router::route_kernel` with `split_k`), which then
/// spares the MoE layer this launch.
#[cube]
pub(crate) fn split_x3_word<F: Float>(x: &Array<F>, out: &mut Array<u32>, idx: usize, #[comptime] k: usize) {
    let half = comptime!(k / 2);
    let r = idx / half;
    let j = idx % half;
    let col = (j / 16) * 32 + ((j % 16) / 4) * 8 + j % 4;
    let a = f32::cast_from(x[r * k + col]);
    let b = f32::cast_from(x[r * k + col + 4]);
    let a_hi = u32::reinterpret(a) >> 16u32;
    let b_hi = u32::reinterpret(b) >> 16u32;
    let a_r = a - f32::reinterpret(a_hi << 16u32);
    let b_r = b - f32::reinterpret(b_hi << 16u32);
    let a_mid = u32::reinterpret(a_r) >> 16u32;
    let b_mid = u32::reinterpret(b_r) >> 16u32;
    let a_lo = u32::reinterpret(a_r - f32::reinterpret(a_mid << 16u32)) >> 16u32;
    let b_lo = u32::reinterpret(b_r - f32::reinterpret(b_mid << 16u32)) >> 16u32;
    let base = r * 3 * half + j;
    out[base] = a_hi | (b_hi << 16u32);
    out[base + half] = a_mid | (b_mid << 16u32);
    out[base + 2 * half] = a_lo | (b_lo << 16u32);
}

/// Loads the operands of 32-column vector `v` for one lane: rows `g` and `g + 8` of each m tile of the task at
/// `j0` of expert `e` (16-byte weight vectors and their scale pairs), and the 64 bytes of vector `v` of the lane's
/// B column in each n tile (zeros where the lane has no column).
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_block<N: Size>(
    xs: &Array<Vector<u32, N>>,
    words: &Array<Vector<u32, N>>,
    scales: &Array<bf16>,
    xrow: &Array<usize>,
    xok: &Array<u32>,
    wa: &mut Array<Vector<u32, N>>,
    sa: &mut Array<Vector<bf16, Const<2>>>,
    xb: &mut Array<Vector<u32, N>>,
    e: usize,
    j0: usize,
    g: usize,
    v: usize,
    #[comptime] k: usize,
    #[comptime] rows: usize,
    #[comptime] group: usize,
    #[comptime] tb: usize,
    #[comptime] tiles: usize,
    #[comptime] gated: bool,
    #[comptime] tiled: bool,
    #[comptime] wait: bool,
) {
    let kv = comptime!(k / 32);
    let ng = comptime!(k / group);
    let mtiles = comptime!(if gated { 2 } else { tiles });
    let task_rows = comptime!(rows / if gated { 2 } else { 1 });
    #[unroll]
    for mt in 0..mtiles {
        #[unroll]
        for h in 0..2usize {
            // The tile's first row within the expert (a multiple of 16), and the lane's row.
            let mut t0 = j0 + 16 * mt;
            if gated {
                t0 = j0 + mt * task_rows;
            }
            let row = e * rows + t0 + g + 8 * h;
            if tiled {
                // `tiled_vector` / `tiled_scale` of `row`, written with what the lane knows: `row % 16 = g + 8 h`
                // and `v = 4 i + c` (shifts and masks, no divisions).
                let tile = e * comptime!(rows / 16) + t0 / 16;
                let at = ((tile * comptime!(k / 128) + v / 4) * 2 + h) * 32 + g * 4 + v % 4;
                wa[2 * mt + h] = words[at];
                sa[2 * mt + h] = scale_pair(scales[(tile * ng + v * 32 / group) * 16 + g + 8 * h]);
            } else {
                wa[2 * mt + h] = words[row * kv + v];
                sa[2 * mt + h] = scale_pair(scales[row * ng + v * 32 / group]);
            }
        }
    }
    if wait {
        // The activations are the previous launch's output: wait for it here, after the weight loads (PDL, see
        // `expert_mma_kernel`).
        comment!("EYRIE_PDL_WAIT");
    }
    load_x::<N>(xs, xrow, xok, xb, v, tb);
}

/// The B operands of 32-column vector `v` for one lane: the 64 bytes of vector `v` of the lane's B column in each n
/// tile (zeros where the lane has no column).
#[cube]
fn load_x<N: Size>(
    xs: &Array<Vector<u32, N>>,
    xrow: &Array<usize>,
    xok: &Array<u32>,
    xb: &mut Array<Vector<u32, N>>,
    v: usize,
    #[comptime] tb: usize,
) {
    let ntiles = comptime!((3 * tb).div_ceil(8));
    #[unroll]
    for nt in 0..ntiles {
        #[unroll]
        for q in 0..4usize {
            let mut z = Vector::<u32, N>::empty();
            z[0] = u32::new(0);
            z[1] = u32::new(0);
            z[2] = u32::new(0);
            z[3] = u32::new(0);
            if xok[nt] == 1 {
                z = xs[xrow[nt] + 4 * v + q];
            }
            xb[4 * nt + q] = z;
        }
    }
}

/// One 128-column block of a lane's task: 8 MMAs per (m tile, n tile) from a zero accumulator (the tensor core
/// never sums more than 128 products), then added into `acc` in f32.
#[cube]
fn block_mma<N: Size>(
    wa: &Array<Vector<u32, N>>,
    sa: &Array<Vector<bf16, Const<2>>>,
    xb: &Array<Vector<u32, N>>,
    acc: &mut Array<f32>,
    bias: u32,
    #[comptime] mtiles: usize,
    #[comptime] ntiles: usize,
) {
    let nacc = comptime!(mtiles * ntiles * 4);
    let mut blk = Array::<f32>::new(nacc);
    #[unroll]
    for a in 0..nacc {
        blk[a] = f32::new(0.0);
    }
    #[unroll]
    for t in 0..8usize {
        let w = t / 2;
        #[unroll]
        for mt in 0..mtiles {
            let mut ra = Array::<Vector<bf16, Const<2>>>::new(4usize);
            let p0 = comptime!((2 * (t % 2)) as u32);
            let p1 = comptime!((2 * (t % 2) + 1) as u32);
            ra[0] = weight_pair(wa[2 * mt][w], bias, sa[2 * mt], p0);
            ra[1] = weight_pair(wa[2 * mt + 1][w], bias, sa[2 * mt + 1], p0);
            ra[2] = weight_pair(wa[2 * mt][w], bias, sa[2 * mt], p1);
            ra[3] = weight_pair(wa[2 * mt + 1][w], bias, sa[2 * mt + 1], p1);
            #[unroll]
            for nt in 0..ntiles {
                let mut rb = Array::<Vector<bf16, Const<2>>>::new(2usize);
                let b0 = xb[4 * nt + t / 2][2 * (t % 2)];
                let b1 = xb[4 * nt + t / 2][2 * (t % 2) + 1];
                rb[0] = Vector::<bf16, Const<2>>::reinterpret(b0);
                rb[1] = Vector::<bf16, Const<2>>::reinterpret(b1);
                mma_into(&ra, &rb, &mut blk, (mt * ntiles + nt) * 4);
            }
        }
    }
    #[unroll]
    for a in 0..nacc {
        acc[a] += blk[a];
    }
}

/// `loads_only`: every loaded word XORed into the first accumulator's bits, so that no load is dead code and the
/// launch's memory traffic is the real one's at a few instructions a block (the output means nothing).
#[cube]
fn fold_loads<N: Size>(
    wa: &Array<Vector<u32, N>>,
    sa: &Array<Vector<bf16, Const<2>>>,
    xb: &Array<Vector<u32, N>>,
    acc: &mut Array<f32>,
    #[comptime] mtiles: usize,
    #[comptime] ntiles: usize,
) {
    let mut h = u32::reinterpret(acc[0]);
    #[unroll]
    for q in 0..comptime!(2 * mtiles) {
        let w = wa[q];
        h ^= w[0] ^ w[1] ^ w[2] ^ w[3] ^ u32::reinterpret(sa[q]);
    }
    #[unroll]
    for q in 0..comptime!(4 * ntiles) {
        let x = xb[q];
        h ^= x[0] ^ x[1] ^ x[2] ^ x[3];
    }
    acc[0] = f32::reinterpret(h);
}

/// BF16 bits of part `c` (0, 1, 2) of `v = hi + mid + lo`, each part the remainder of the previous ones with its
/// low 16 bits cut, as [`split_x3_kernel`] splits.
#[cube]
pub(crate) fn split_part(v: f32, c: usize) -> u32 {
    let hi = u32::reinterpret(v) >> 16u32;
    let r = v - f32::reinterpret(hi << 16u32);
    let mid = u32::reinterpret(r) >> 16u32;
    let lo = u32::reinterpret(r - f32::reinterpret(mid << 16u32)) >> 16u32;
    let mut part = hi;
    if c == 1 {
        part = mid;
    }
    if c == 2 {
        part = lo;
    }
    part
}

/// One `mma.m16n8k16` (BF16 operands in PTX register order, f32 accumulators) into the four accumulator floats of
/// a lane at `blk[base..base + 4]`: (row g, columns 2c, 2c + 1), (row g + 8, the same columns). Shared by the MoE
/// and dense tensor-core kernels.
#[cube]
pub(crate) fn mma_into(
    ra: &Array<Vector<bf16, Const<2>>>,
    rb: &Array<Vector<bf16, Const<2>>>,
    blk: &mut Array<f32>,
    base: usize,
) {
    let def = MmaDefinition::<bf16, bf16, f32>::new(16usize, 8usize, 16usize);
    let mut rc = Array::<Vector<f32, Const<2>>>::new(2usize);
    let mut c0v = Vector::<f32, Const<2>>::empty();
    c0v[0] = blk[base];
    c0v[1] = blk[base + 1];
    let mut c1v = Vector::<f32, Const<2>>::empty();
    c1v[0] = blk[base + 2];
    c1v[1] = blk[base + 3];
    rc[0] = c0v;
    rc[1] = c1v;
    def.execute_inplace(ra, rb, &mut rc);
    let d0 = rc[0];
    let d1 = rc[1];
    blk[base] = d0[0];
    blk[base + 1] = d0[1];
    blk[base + 2] = d1[0];
    blk[base + 3] = d1[1];
}

/// The k-split warps of a task add their `nacc` accumulators (per lane) into part 0's through `red` (every warp
/// of the block must call it: two block barriers).
#[cube]
pub(crate) fn ksplit_reduce(
    acc: &mut Array<f32>,
    red: &mut SharedMemory<f32>,
    warp: usize,
    lane: usize,
    part: usize,
    #[comptime] nacc: usize,
    #[comptime] ksplit: usize,
) {
    #[unroll]
    for a in 0..nacc {
        red[(warp * nacc + a) * 32 + lane] = acc[a];
    }
    sync_cube();
    if part == 0 {
        #[unroll]
        for s in 1..ksplit {
            #[unroll]
            for a in 0..nacc {
                acc[a] += red[((warp + s) * nacc + a) * 32 + lane];
            }
        }
    }
    sync_cube();
}

/// Token `t`'s result for row half `h` of m tile `mt`: lane `(g, c)` holds columns `2c`, `2c + 1` of each n tile,
/// and a token's three parts (columns `3t .. 3t + 3`) are spread over the quad, so the lane's share is summed and
/// then added across the quad (every lane of the warp must call it; all quad lanes get the sum).
#[cube]
pub(crate) fn token_sum(acc: &Array<f32>, t: usize, h: usize, mt: usize, c: usize, #[comptime] ntiles: usize) -> f32 {
    let mut sum = f32::new(0.0);
    #[unroll]
    for nt in 0..ntiles {
        #[unroll]
        for q in 0..2usize {
            let col = 8 * nt + 2 * c + q;
            if col >= 3 * t && col < 3 * t + 3 {
                sum += acc[(mt * ntiles + nt) * 4 + 2 * h + q];
            }
        }
    }
    sum += plane_shuffle_xor(sum, 1u32);
    sum += plane_shuffle_xor(sum, 2u32);
    sum
}

/// Rows of one expert's INT4 matrix times the split activations of the tokens routed to it, on tensor cores.
///
/// - `xs`: split-permuted activations ([`split_x3_kernel`]) as 16-byte vectors, `[*, 3, k / 8]`; row `pair / topk`
///   (`by_token`, the layer input) or `pair` (the intermediate).
/// - `words`, `scales`, `experts`, `offsets`, `pairs`, `bounds`, `class`: as `expert_rows_kernel`.
/// - `bias`: [`super::kernels::WEIGHT_BIAS`], an argument so that it sits in a register (one `LOP3` a weight pair
///   instead of two).
/// - `out`: `gated`: `[pairs, rows / 2]`, `silu(gate unit) * up unit`; else `[pairs, rows]`.
///
/// `k` a multiple of 128; the task rows (`rows / 2` gated, else `rows`) a multiple of 16 (`16 tiles` ungated).
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil, clippy::collapsible_if, clippy::collapsible_else_if)]
pub fn expert_mma_kernel<N: Size>(
    xs: &Array<Vector<u32, N>>,
    words: &Array<Vector<u32, N>>,
    scales: &Array<bf16>,
    experts: &Array<u32>,
    offsets: &Array<u32>,
    pairs: &Array<u32>,
    out: &mut Array<f32>,
    hs_out: &mut Array<u32>,
    bounds: &Array<u32>,
    class: u32,
    bias: u32,
    #[comptime] k: usize,
    #[comptime] rows: usize,
    #[comptime] group: usize,
    #[comptime] topk: usize,
    #[comptime] tb: usize,
    #[comptime] tiles: usize,
    #[comptime] tasks: usize,
    #[comptime] ksplit: usize,
    #[comptime] gated: bool,
    #[comptime] by_token: bool,
    #[comptime] tiled: bool,
    #[comptime] split_out: bool,
    #[comptime] loads_only: bool,
) {
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let g = lane / 4;
    let c = lane % 4;

    let xv = comptime!(k / 8);
    let nblk = comptime!(k / 128);
    let ntiles = comptime!((3 * tb).div_ceil(8));
    let mtiles = comptime!(if gated { 2 } else { tiles });
    let task_rows = comptime!(rows / if gated { 2 } else { 1 });
    let step = comptime!(if gated { 16 } else { 16 * tiles });
    // Accumulator floats per lane: (m tile, n tile, row half, column pair).
    let nacc = comptime!(mtiles * ntiles * 4);
    // Gated launches may write the down launch's split input instead of the f32 intermediate.
    let split = comptime!(split_out && gated);

    let mut red = SharedMemory::<f32>::new(comptime!(if ksplit > 1 { tasks * ksplit * nacc * 32 } else { 1 }));

    let task = CUBE_POS_X as usize * tasks + warp / ksplit;
    let part = warp % ksplit;
    let j0 = task * step;
    let active = j0 < task_rows;

    let class_end = bounds[class as usize + 1] as usize;
    let mut slot = bounds[class as usize] as usize + CUBE_POS_Y as usize;
    while slot < class_end {
        let e = experts[slot] as usize;
        let start = offsets[slot] as usize;
        let count = offsets[slot + 1] as usize - start;
        let n_chunks = (count + tb - 1) / tb;
        for ch in 0..n_chunks {
            let c0 = start + ch * tb;
            let n = count - ch * tb;

            // This lane's B column in each n tile: part `col % 3` of token `col / 3`, or none (zeros).
            let mut xrow = Array::<usize>::new(comptime!((3 * tb).div_ceil(8)));
            let mut xok = Array::<u32>::new(comptime!((3 * tb).div_ceil(8)));
            #[unroll]
            for nt in 0..ntiles {
                let col = 8 * nt + g;
                let t = col / 3;
                xok[nt] = u32::new(0);
                xrow[nt] = 0;
                if col < comptime!(3 * tb) && t < n {
                    xok[nt] = u32::new(1);
                    let p = pairs[c0 + t] as usize;
                    let mut row = p;
                    if by_token {
                        row = p / topk;
                    }
                    xrow[nt] = (row * 3 + col % 3) * xv;
                }
            }

            let mut acc = Array::<f32>::new(comptime!(mtiles * (3 * tb).div_ceil(8) * 4));
            #[unroll]
            for a in 0..nacc {
                acc[a] = f32::new(0.0);
            }

            if active {
                // Software pipeline: block i's operands are in (wa, sa, xb) while block i + ksplit's load; the last
                // block reloads itself (a clamped index keeps every load in range and the loop free of branches).
                let mut wa = Array::<Vector<u32, N>>::new(comptime!(2 * if gated { 2 } else { tiles }));
                let mut sa = Array::<Vector<bf16, Const<2>>>::new(comptime!(2 * if gated { 2 } else { tiles }));
                let mut xb = Array::<Vector<u32, N>>::new(comptime!(4 * (3 * tb).div_ceil(8)));
                let mut wn = Array::<Vector<u32, N>>::new(comptime!(2 * if gated { 2 } else { tiles }));
                let mut sn = Array::<Vector<bf16, Const<2>>>::new(comptime!(2 * if gated { 2 } else { tiles }));
                let mut xn = Array::<Vector<u32, N>>::new(comptime!(4 * (3 * tb).div_ceil(8)));
                let mut first = part;
                if first >= nblk {
                    first = nblk - 1;
                }
                load_block::<N>(
                    xs,
                    words,
                    scales,
                    &xrow,
                    &xok,
                    &mut wa,
                    &mut sa,
                    &mut xb,
                    e,
                    j0,
                    g,
                    4 * first + c,
                    k,
                    rows,
                    group,
                    tb,
                    tiles,
                    gated,
                    tiled,
                    comptime!(!gated),
                );
                let mut i = part;
                while i < nblk {
                    let mut next = i + ksplit;
                    if next >= nblk {
                        next = nblk - 1;
                    }
                    load_block::<N>(
                        xs,
                        words,
                        scales,
                        &xrow,
                        &xok,
                        &mut wn,
                        &mut sn,
                        &mut xn,
                        e,
                        j0,
                        g,
                        4 * next + c,
                        k,
                        rows,
                        group,
                        tb,
                        tiles,
                        gated,
                        tiled,
                        false,
                    );

                    if loads_only {
                        fold_loads::<N>(&wa, &sa, &xb, &mut acc, mtiles, ntiles);
                    } else {
                        block_mma::<N>(&wa, &sa, &xb, &mut acc, bias, mtiles, ntiles);
                    }
                    #[unroll]
                    for q in 0..comptime!(2 * if gated { 2 } else { tiles }) {
                        wa[q] = wn[q];
                        sa[q] = sn[q];
                    }
                    #[unroll]
                    for q in 0..comptime!(4 * (3 * tb).div_ceil(8)) {
                        xb[q] = xn[q];
                    }
                    i += ksplit;
                }
            }

            // The k-split warps of a task add up through shared memory (every warp reaches both barriers).
            if ksplit > 1 {
                ksplit_reduce(&mut acc, &mut red, warp, lane, part, nacc, ksplit);
            }

            if active && part == 0 {
                // Lane (g, c) holds columns 2c, 2c + 1 of each n tile for rows g (h = 0) and g + 8 (h = 1); a
                // token's three parts are spread over the quad: sum the lane's share, then across the quad.
                #[unroll]
                for t in 0..tb {
                    if t < n {
                        let p = pairs[c0 + t] as usize;
                        #[unroll]
                        for h in 0..2usize {
                            let mut vals = Array::<f32>::new(comptime!(if gated { 2 } else { tiles }));
                            #[unroll]
                            for mt in 0..mtiles {
                                vals[mt] = token_sum(&acc, t, h, mt, c, ntiles);
                            }
                            if split {
                                // The down launch's input written here, split and permuted as `split_x3_kernel`
                                // writes it (no launch of its own): row `r = j0 + g + 8 h` (g < 4) and row `r + 4`
                                // (lane g + 4's) are the two halves of word `j0 / 2 + 4 h + g`, and lane c of the
                                // quad writes part c.
                                let a = vals[0];
                                let v = a / (f32::new(1.0) + (-a).exp()) * vals[1];
                                let w = plane_shuffle_xor(v, 16u32);
                                if g < 4 && c < 3 {
                                    let j = j0 / 2 + 4 * h + g;
                                    let word = split_part(v, c) | (split_part(w, c) << 16u32);
                                    hs_out[(p * 3 + c) * comptime!(rows / 4) + j] = word;
                                }
                            } else {
                                if c == 0 {
                                    let r = j0 + g + 8 * h;
                                    if gated {
                                        let a = vals[0];
                                        out[p * task_rows + r] = a / (f32::new(1.0) + (-a).exp()) * vals[1];
                                    } else {
                                        #[unroll]
                                        for mt in 0..mtiles {
                                            out[p * rows + r + 16 * mt] = vals[mt];
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        slot += CUBE_COUNT_Y as usize;
    }
    if !gated {
        // Every thread waits for the previous launch before it ends (those that loaded no activations have not
        // yet), so that this launch's completion implies its predecessor's, as with the wait at the entry.
        comment!("EYRIE_PDL_WAIT");
    }
}

#[cfg(test)]
mod tests {
    //! The kernel's K order, modelled on the CPU: the activation layout `split_x3_kernel` writes, the A and B
    //! registers each lane builds for each MMA of a 128-column block, exact products, the parts of a token summed.
    //! Against the plain dot product of the checkpoint's weights (`bf16(q * scale)`) with `x`, in f64: the layout
    //! must pair every weight with its own column, each column once. (The GPU check, `examples/gpu_kernels.rs`,
    //! tests the kernel itself; this pins the index algebra both of its sides rely on.)
    use crate::cuda::experts::{tiled_scale, tiled_vector};
    use crate::cuda::gemm::{bf16_value, split_bf16x3};
    use crate::cuda::{KernelLayout, MoeExperts, MoeShape, SplitMix64};

    /// Columns `(lo, hi)` of word `j` of a row's split-permuted parts (`split_x3_kernel`).
    fn permuted_columns(j: usize) -> (usize, usize) {
        let col = (j / 16) * 32 + ((j % 16) / 4) * 8 + j % 4;
        (col, col + 4)
    }

    /// Word `w` of 16-byte vector `v` and the BF16 scale of column `col` of gate row `r` of expert 0, read
    /// from the kernel layout the way the kernel reads it (tiled where the shape is).
    fn layout_word_scale(l: &KernelLayout, r: usize, v: usize, w: usize, col: usize) -> (u32, f32) {
        let (k, group) = (l.shape.hidden, l.shape.group);
        let (ng, kv) = (k / group, k / 32);
        if l.shape.tiled() {
            (l.w13[tiled_vector(r, v, k) * 4 + w], l.s13[tiled_scale(r, col / group, ng)].to_f32())
        } else {
            (l.w13[(r * kv + v) * 4 + w], l.s13[r * ng + col / group].to_f32())
        }
    }

    /// The gated launch's fused epilogue (`split_out`) writes rows `r = j0 + g + 8 h` (g < 4, lane g's) and
    /// `r + 4` (lane g + 4's) as word `j0 / 2 + 4 h + g`: exactly the word `split_x3_kernel` puts those two rows
    /// in, and over a task's lanes every word of its 16 rows once.
    #[test]
    fn fused_split_epilogue_writes_split_x3_words() {
        let inter = 2048;
        let mut seen = vec![0u32; inter / 2];
        for j0 in (0..inter).step_by(16) {
            for h in 0..2 {
                for g in 0..4 {
                    let r = j0 + g + 8 * h;
                    let j = j0 / 2 + 4 * h + g;
                    assert_eq!(permuted_columns(j), (r, r + 4), "j0 {j0} h {h} g {g}");
                    seen[j] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&n| n == 1));
    }

    #[test]
    fn lanes_pair_every_weight_with_its_own_column() {
        // Row-major (inter 32 is not a multiple of 128) and tiled.
        for (inter, group) in [(32, 32), (128, 32), (128, 64)] {
            lanes_pair_columns(MoeShape { hidden: 384, inter, experts: 1, group });
        }
    }

    fn lanes_pair_columns(shape: MoeShape) {
        let ex = MoeExperts::random(shape, 3).unwrap();
        let layout = ex.kernel_layout();
        let w = ex.gate(0);
        let (rows, k) = (w.out_features(), w.in_features());
        let mut rng = SplitMix64::new(9);
        let x: Vec<f32> = (0..k).map(|_| rng.next_f32() - 0.5).collect();
        let mut dense = vec![0f32; rows * k];
        w.dequantize_rows_into(0..rows, &mut dense).unwrap();
        // Split-permuted parts of x, as the kernel reads them: parts[p][j] = (lo, hi) BF16 bits.
        let parts: Vec<Vec<(u16, u16)>> = (0..3)
            .map(|p| {
                (0..k / 2)
                    .map(|j| {
                        let (lo, hi) = permuted_columns(j);
                        (split_bf16x3(x[lo])[p], split_bf16x3(x[hi])[p])
                    })
                    .collect()
            })
            .collect();
        // bf16(q * scale): the product is exact in f32, then rounded to nearest even as compressed-tensors does.
        let weight = |word: u32, nibble: usize, scale: f32| {
            let q = ((word >> (4 * nibble)) & 0xF) as i32 - 8;
            f64::from(half::bf16::from_f32(q as f32 * scale).to_f32())
        };
        for r in 0..rows {
            let mut seen = vec![0u32; k];
            let mut got = 0f64;
            for i in 0..k / 128 {
                for c in 0..4 {
                    let v = 4 * i + c;
                    for t in 0..8 {
                        for reg in 0..2 {
                            // A: word t / 2 of vector v, nibble pair p (nibbles p and p + 4).
                            let p = 2 * (t % 2) + reg;
                            let (a_lo, a_hi) = (32 * v + 8 * (t / 2) + p, 32 * v + 8 * (t / 2) + p + 4);
                            let (word, scale) = layout_word_scale(&layout, r, v, t / 2, a_lo);
                            // B: word 2t + reg of the lane's 64 bytes (16 words) of vector v.
                            let j = 16 * v + 2 * t + reg;
                            assert_eq!(permuted_columns(j), (a_lo, a_hi), "row {r} block {i} lane {c} mma {t}");
                            seen[a_lo] += 1;
                            seen[a_hi] += 1;
                            for part in &parts {
                                let (b_lo, b_hi) = part[j];
                                got += weight(word, p, scale) * f64::from(bf16_value(b_lo))
                                    + weight(word, p + 4, scale) * f64::from(bf16_value(b_hi));
                            }
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "row {r}: every column exactly once");
            let want: f64 = (0..k).map(|col| f64::from(dense[r * k + col]) * f64::from(x[col])).sum();
            assert!((got - want).abs() <= 1e-12 * want.abs().max(1.0), "row {r}: {got} vs {want}");
        }
    }
}
