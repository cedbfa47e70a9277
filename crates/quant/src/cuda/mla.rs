//! The absorbed MLA's kernels around the attention (eyrie-model's `Mla::forward_absorbed` on CUDA launches them;
//! kept here so `cargo xtask kernels` compiles them for every architecture): the query absorption + RoPE
//! ([`mla_query_kernel`]), the value absorption into `o_proj`'s input ([`mla_output_kernel`]) and the step's new
//! latents straight into the paged cache ([`mla_latent_kernel`]). The launch shapes eyrie-model picks are
//! [`query_launch`] and [`output_launch`]. CPU reference: an f64 composition of the same math in eyrie-model's
//! `gpu_ops` program.

use burn::cubecl;
use cubecl::prelude::*;

use super::attention::merge_slices;
use super::dense::bf16x8_dot;

/// Warps of a [`mla_latent_kernel`] block (one row a block).
pub const LATENT_WARPS: usize = 4;

/// Tokens per block and thread groups of [`mla_query_kernel`] for `n` query rows (`nope` must be a multiple of
/// `8 * groups`; one group otherwise). One row: 8 groups (1024 threads, 32 registers), so each thread's weight
/// rows are two batches of 8 loads in flight instead of four (the grid is only the 64 heads).
pub fn query_launch(n: usize, nope: usize) -> (usize, usize) {
    let (tb, groups) = match n {
        1 => (1, 8),
        2 => (2, 4),
        3 | 4 => (4, 4),
        5..=16 => (8, 2),
        _ => (16, 1),
    };
    (tb, if nope.is_multiple_of(8 * groups) { groups } else { 1 })
}

/// Tokens per block, rows per warp and warps of [`mla_output_kernel`] for `n` rows (`vd` must be a multiple of
/// `ra * warps`; one row and one warp otherwise).
pub fn output_launch(n: usize, vd: usize) -> (usize, usize, usize) {
    let (tb, ra, warps) = match n {
        1 => (1, 4, 8),
        2 => (2, 4, 8),
        3 | 4 => (4, 4, 8),
        _ => (8, 2, 8),
    };
    if vd.is_multiple_of(ra * warps) { (tb, ra, warps) } else { (tb, 1, 1) }
}

/// Whether the [`mla_output_kernel`] launch shape `(tb, ra, warps)` ([`output_launch`]) merges the attention's
/// slices itself (`merge`): one token a block (each block merges its tokens one after another: at 8 tokens a block
/// the merged launch made a batch-8 step of the 10-layer slice 0.3 ms slower, bench/REPORT.md session 19) and at
/// least the 128 threads the merge takes.
pub fn output_merges((tb, _, warps): (usize, usize, usize)) -> bool {
    tb == 1 && warps * 32 >= 128
}

/// The attention kernel's queries from the query projection, in one launch: `out[t, h, ..r] = q_nope[t, h] W_uk[h]`
/// (the absorption; `W_uk[h]` = rows `h (nope + vd) .. + nope` of `kv_b_proj` `[H (nope + vd), r]`, BF16, read as the
/// checkpoint stores it, f32 products and sums) and `out[t, h, r..] = RoPE(q_pe[t, h])` (the same values and layout
/// as `rope_rows`), from `q` `[N, H (nope + rot)]` and the tables `[N, rot / 2]`.
///
/// Block = `groups` groups of `r / 4` threads, for one head and `tb` tokens: thread `c` of a group owns columns
/// `4c..4c + 4`; group `g` sums `j` over its `nope / groups` slice (weight rows read 8 at a time, 8-byte loads, a
/// row of 1 KB per group), and group 0 adds the groups' sums in order (deterministic).
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub fn mla_query_kernel<N: Size>(
    q: &Array<f32>,
    w: &Array<Vector<u32, N>>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    out: &mut Array<f32>,
    tokens: u32,
    #[comptime] heads: usize,
    #[comptime] nope: usize,
    #[comptime] rot: usize,
    #[comptime] vd: usize,
    #[comptime] r: usize,
    #[comptime] tb: usize,
    #[comptime] groups: usize,
    #[comptime] interleave: bool,
) {
    let c = UNIT_POS_X as usize;
    let g = UNIT_POS_Y as usize;
    let h = CUBE_POS_X as usize;
    let t0 = CUBE_POS_Y as usize * tb;
    let n = tokens as usize;
    let qs = comptime!(heads * (nope + rot));
    let rv = comptime!(r / 4);
    let threads = comptime!(r / 4 * groups);
    let tid = g * rv + c;

    // q_nope of the block's tokens, [tb][nope]; tokens past the end repeat the last one (never written).
    let mut sq = SharedMemory::<f32>::new(comptime!(tb * nope));
    for it in 0..comptime!((tb * nope).div_ceil(r / 4 * groups)) {
        let i = it * threads + tid;
        if i < comptime!(tb * nope) {
            let mut tok = t0 + i / nope;
            if tok >= n {
                tok = n - 1;
            }
            sq[i] = q[tok * qs + h * comptime!(nope + rot) + i % nope];
        }
    }
    sync_cube();

    let mut acc = Array::<f32>::new(comptime!(tb * 4));
    #[unroll]
    for a in 0..comptime!(tb * 4) {
        acc[a] = f32::new(0.0);
    }
    let per = comptime!(nope / groups);
    let row0 = h * comptime!(nope + vd) + g * per;
    let mut wv = Array::<Vector<u32, N>>::new(8usize);
    for jb in 0..comptime!(per / 8) {
        #[unroll]
        for u in 0..8usize {
            wv[u] = w[(row0 + jb * 8 + u) * rv + c];
        }
        #[unroll]
        for u in 0..8usize {
            let v = wv[u];
            let w0 = f32::reinterpret(v[0] << 16u32);
            let w1 = f32::reinterpret((v[0] >> 16u32) << 16u32);
            let w2 = f32::reinterpret(v[1] << 16u32);
            let w3 = f32::reinterpret((v[1] >> 16u32) << 16u32);
            let j = g * per + jb * 8 + u;
            #[unroll]
            for t in 0..tb {
                let x = sq[t * nope + j];
                acc[t * 4] += x * w0;
                acc[t * 4 + 1] += x * w1;
                acc[t * 4 + 2] += x * w2;
                acc[t * 4 + 3] += x * w3;
            }
        }
    }

    // Groups 1.. hand their sums to group 0 through shared memory, [groups - 1][tb][r].
    let mut red = SharedMemory::<f32>::new(comptime!((groups - 1) * tb * r + 1));
    if g > 0 {
        #[unroll]
        for t in 0..tb {
            #[unroll]
            for e in 0..4usize {
                red[((g - 1) * tb + t) * r + 4 * c + e] = acc[t * 4 + e];
            }
        }
    }
    sync_cube();
    if g == 0 {
        #[unroll]
        for gg in 1..groups {
            #[unroll]
            for t in 0..tb {
                #[unroll]
                for e in 0..4usize {
                    acc[t * 4 + e] += red[((gg - 1) * tb + t) * r + 4 * c + e];
                }
            }
        }
        let half = comptime!(rot / 2);
        #[unroll]
        for t in 0..tb {
            let tok = t0 + t;
            if tok < n {
                let base = (tok * heads + h) * comptime!(r + rot);
                #[unroll]
                for e in 0..4usize {
                    out[base + 4 * c + e] = acc[t * 4 + e];
                }
                if c < half {
                    let qb = tok * qs + h * comptime!(nope + rot) + nope;
                    let mut a = q[qb + c];
                    let mut b = q[qb + half + c];
                    if interleave {
                        a = q[qb + 2 * c];
                        b = q[qb + 2 * c + 1];
                    }
                    let cs = cos[tok * half + c];
                    let sn = sin[tok * half + c];
                    out[base + r + c] = a * cs - b * sn;
                    out[base + r + half + c] = b * cs + a * sn;
                }
            }
        }
    }
}

/// The absorbed attention's output projection into `o_proj`'s input, in one launch: `out[t, h vd + v] = o_lat[t, h]
/// . W_uv[h, v]` (`W_uv[h]` = rows `h (nope + vd) + nope .. + vd` of `kv_b_proj`, BF16, f32 products and sums), from
/// the attention kernel's `o_lat` `[N, H, r]`. GEMV form (as eyrie-quant's `gemv_bf16`): a warp owns `ra` weight rows
/// of one head, lane `l` streams the 16-byte vectors `l, l + 32, ..` of each, a warp sum finishes each dot product.
///
/// With `merge`, `o_lat` is instead the attention's unmerged slices `[splits, N H, r]` with their `(max, sum)`
/// `ml_part` `[splits, N H, 2]` (`attention::AttentionParts`): each block first merges its head's `tb` rows into
/// shared memory with `attention::merge_slices`, the combine launch's own code (the same values), and the merge
/// launch and its gap are gone. Without `merge`, `ml_part` and `splits` are not read.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub fn mla_output_kernel<N: Size>(
    o_lat: &Array<Vector<f32, N>>,
    ml_part: &Array<f32>,
    w: &Array<Vector<u32, N>>,
    out: &mut Array<f32>,
    tokens: u32,
    splits: u32,
    #[comptime] heads: usize,
    #[comptime] nope: usize,
    #[comptime] vd: usize,
    #[comptime] r: usize,
    #[comptime] ra: usize,
    #[comptime] tb: usize,
    #[comptime] warps: usize,
    #[comptime] merge: bool,
) {
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let n = tokens as usize;
    // Output column (h, v) of the warp's first row; a block's rows never cross a head (vd % (warps ra) == 0).
    let col0 = (CUBE_POS_X as usize * warps + warp) * ra;
    let h = col0 / vd;
    let v0 = col0 % vd;
    let t0 = CUBE_POS_Y as usize * tb;
    let kv = comptime!(r / 8);
    let k4 = comptime!(r / 4);
    let wrow0 = h * comptime!(nope + vd) + nope + v0;

    // With `merge`, the warp's weights are loaded first (all of them: `ra` rows of `r` BF16, 2 vectors a lane at
    // Kimi's 512) so their latency overlaps the merge's; without it, a row group at a time in the loop below.
    let ahead = comptime!(if merge { ra * kv.div_ceil(32) } else { 1 });
    let mut wall = Array::<Vector<u32, N>>::new(ahead);
    if comptime!(merge) {
        #[unroll]
        for i in 0..comptime!(kv.div_ceil(32)) {
            let vi = lane + 32 * i;
            if vi < kv {
                #[unroll]
                for q in 0..ra {
                    wall[i * ra + q] = w[(wrow0 + q) * kv + vi];
                }
            }
        }
    }
    // The merged rows of the block's head (`merge`): row `t` of the token tile at `t * k4`.
    let mut merged = SharedMemory::<Vector<f32, N>>::new(comptime!(if merge { tb * r / 4 } else { 1 }));
    if comptime!(merge) {
        let tid = UNIT_POS as usize;
        #[unroll]
        for t in 0..tb {
            let mut tok = t0 + t;
            if tok >= n {
                tok = n - 1;
            }
            let mut acc = Array::<f32>::new(comptime!(4 * (r / 4).div_ceil(128)));
            merge_slices::<N>(
                o_lat,
                ml_part,
                &mut acc,
                n * heads,
                splits as usize,
                tok * heads + h,
                tid,
                r,
                comptime!((warps * 32 / 128).max(1)),
            );
            #[unroll]
            for it in 0..comptime!((r / 4).div_ceil(128)) {
                let c4 = it * 128 + tid;
                if tid < 128 && c4 < k4 {
                    let mut o = Vector::<f32, N>::empty();
                    #[unroll]
                    for e in 0..4usize {
                        o[e] = acc[4 * it + e];
                    }
                    merged[t * k4 + c4] = o;
                }
            }
        }
        sync_cube();
    }

    let mut acc = Array::<f32>::new(comptime!(ra * tb));
    #[unroll]
    for a in 0..comptime!(ra * tb) {
        acc[a] = f32::new(0.0);
    }
    let mut wv = Array::<Vector<u32, N>>::new(ra);
    #[unroll]
    for i in 0..comptime!(kv.div_ceil(32)) {
        let vi = lane + 32 * i;
        if vi < kv {
            #[unroll]
            for q in 0..ra {
                if comptime!(merge) {
                    wv[q] = wall[i * ra + q];
                } else {
                    wv[q] = w[(wrow0 + q) * kv + vi];
                }
            }
            #[unroll]
            for t in 0..tb {
                let mut tok = t0 + t;
                if tok >= n {
                    tok = n - 1;
                }
                // (The merged rows, or `o_lat`'s: chosen at compile time.)
                let xb = (tok * heads + h) * k4;
                let mut x0 = o_lat[xb + 2 * vi];
                let mut x1 = o_lat[xb + 2 * vi + 1];
                if comptime!(merge) {
                    x0 = merged[t * k4 + 2 * vi];
                    x1 = merged[t * k4 + 2 * vi + 1];
                }
                #[unroll]
                for q in 0..ra {
                    acc[q * tb + t] += bf16x8_dot::<N>(wv[q], x0, x1);
                }
            }
        }
    }
    #[unroll]
    for q in 0..ra {
        #[unroll]
        for t in 0..tb {
            let s = plane_sum(acc[q * tb + t]);
            let tok = t0 + t;
            if lane == 0 && tok < n {
                out[tok * comptime!(heads * vd) + col0 + q] = s;
            }
        }
    }
}

/// The step's new latents straight into the cache, in one launch: for row `t` of `kv` `[N, r + rot]` (the
/// `kv_a_proj_with_mqa` output), `pool[slots[t], ..r] = RMSNorm(kv[t, ..r]) * w` (the `kv_a_layernorm`, f32) and
/// `pool[slots[t], r..] = RoPE(kv[t, r..])` (the same values and layout as `rope_rows`). Replaces a narrow copy,
/// the norm, RoPE, a concatenation (two slice-assigns) and the scatter. One block of 4 warps a row; pool rows are
/// `row_stride` floats apart (CubeCL may pitch a 2-D buffer's rows).
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub fn mla_latent_kernel(
    kv: &Array<f32>,
    w: &Array<f32>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    slots: &Array<u32>,
    pool: &mut Array<f32>,
    eps: f32,
    row_stride: u32,
    #[comptime] r: usize,
    #[comptime] rot: usize,
    #[comptime] interleave: bool,
) {
    let row = CUBE_POS_X as usize;
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let tid = UNIT_POS as usize;
    let width = comptime!(r + rot);
    let half = comptime!(rot / 2);
    let src = row * width;
    let mut ss = f32::new(0.0);
    for i in 0..comptime!(r.div_ceil(128)) {
        let c = tid + i * 128;
        if c < r {
            let a = kv[src + c];
            ss += a * a;
        }
    }
    let s = plane_sum(ss);
    let mut part = SharedMemory::<f32>::new(4usize);
    if lane == 0 {
        part[warp] = s;
    }
    sync_cube();
    let total = part[0] + part[1] + part[2] + part[3];
    let inv = f32::new(1.0) / (total / f32::new(comptime!(r as f32)) + eps).sqrt();
    let dst = slots[row] as usize * row_stride as usize;
    for i in 0..comptime!(r.div_ceil(128)) {
        let c = tid + i * 128;
        if c < r {
            pool[dst + c] = kv[src + c] * inv * w[c];
        }
    }
    for i in 0..comptime!(half.div_ceil(128)) {
        let j = tid + i * 128;
        if j < half {
            let mut a = kv[src + r + j];
            let mut b = kv[src + r + half + j];
            if interleave {
                a = kv[src + r + 2 * j];
                b = kv[src + r + 2 * j + 1];
            }
            let cs = cos[row * half + j];
            let sn = sin[row * half + j];
            pool[dst + r + j] = a * cs - b * sn;
            pool[dst + r + half + j] = b * cs + a * sn;
        }
    }
}
