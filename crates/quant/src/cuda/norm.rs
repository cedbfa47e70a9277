//! RMSNorm of rows in one launch, optionally with the residual add fused (eyrie-model's `RmsNorm` on CUDA launches
//! it; kept here so `cargo xtask kernels` compiles it for every architecture). CPU reference: eyrie-model's generic
//! `RmsNorm` ops, checked against this kernel by its `gpu_ops` program.

use burn::cubecl;
use cubecl::prelude::*;

/// Warps of a [`rms_norm_kernel`] block (one row a block).
pub const RMS_NORM_WARPS: usize = 8;

/// RMSNorm of each row in one launch (the generic path is seven burn ops: square, mean, add, sqrt, reciprocal and
/// two products); with `add`, of `x + res` (the residual stream's update, written to `sum`), in the same launch. One
/// block of 8 warps per row; f32 throughout; the row's sum of squares in a different order than burn's mean, so
/// results differ from the generic path by f32 rounding only.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::manual_div_ceil, clippy::too_many_arguments)]
pub fn rms_norm_kernel<N: Size>(
    x: &Array<Vector<f32, N>>,
    res: &Array<Vector<f32, N>>,
    w: &Array<Vector<f32, N>>,
    sum: &mut Array<Vector<f32, N>>,
    out: &mut Array<Vector<f32, N>>,
    eps: f32,
    #[comptime] width: usize,
    #[comptime] warps: usize,
    #[comptime] add: bool,
) {
    let row = CUBE_POS_X as usize;
    let tid = UNIT_POS as usize;
    let wv = comptime!(width / 4);
    let threads = comptime!(32 * warps);
    let iters = comptime!((width / 4).div_ceil(32 * warps));
    let mut vals = Array::<Vector<f32, N>>::new(iters);
    let mut gains = Array::<Vector<f32, N>>::new(iters);
    let inv = norm_row::<N>(x, res, w, &mut vals, &mut gains, row, eps, width, warps, add, true);
    #[unroll]
    for i in 0..iters {
        let v = tid + i * threads;
        if v < wv {
            let a = vals[i];
            if add {
                sum[row * wv + v] = a;
            }
            out[row * wv + v] = normed4::<N>(a, inv, gains[i]);
        }
    }
}

/// `(a * inv) * g`, element by element: the normed vector as every RMSNorm of eyrie-quant writes it.
#[cube]
pub fn normed4<N: Size>(a: Vector<f32, N>, inv: f32, g: Vector<f32, N>) -> Vector<f32, N> {
    let mut o = Vector::<f32, N>::empty();
    o[0] = a[0] * inv * g[0];
    o[1] = a[1] * inv * g[1];
    o[2] = a[2] * inv * g[2];
    o[3] = a[3] * inv * g[3];
    o
}

/// The RMSNorm of row `row` of `x` (of `x + res` with `add`) by a block of `warps` warps, every thread of which must
/// call it: returns the row's inverse RMS, with thread `tid`'s vectors `tid + i * threads` of the row (`x + res`) in
/// `vals[i]` and, with `load_gains`, of the weight `w` in `gains[i]` (`iters = ceil(width / 4 / threads)` each,
/// loaded with the row: their latencies overlap; without it `gains` is not touched and the caller loads the weight
/// later, holding fewer registers); the normed vector is then [`normed4`]`(vals[i], inv, gains[i])`. Its sums in one fixed order (each thread its vectors, a warp sum, the
/// warps' sums in warp order), so every kernel that takes a row's norm through it (`rms_norm_kernel`, the normed
/// GEMVs of `dense`) gets the same bits. Every load of the row and of the weight is issued before any is used (a
/// loop of load-then-use made one row's norm a chain of memory latencies: ~5 us at one row of 7168 on the H200).
#[cube]
#[allow(clippy::manual_div_ceil, clippy::too_many_arguments)]
pub fn norm_row<N: Size>(
    x: &Array<Vector<f32, N>>,
    res: &Array<Vector<f32, N>>,
    w: &Array<Vector<f32, N>>,
    vals: &mut Array<Vector<f32, N>>,
    gains: &mut Array<Vector<f32, N>>,
    row: usize,
    eps: f32,
    #[comptime] width: usize,
    #[comptime] warps: usize,
    #[comptime] add: bool,
    #[comptime] load_gains: bool,
) -> f32 {
    let tid = UNIT_POS as usize;
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let wv = comptime!(width / 4);
    let threads = comptime!(32 * warps);
    let iters = comptime!((width / 4).div_ceil(32 * warps));
    #[unroll]
    for i in 0..iters {
        let v = tid + i * threads;
        if v < wv {
            let mut a = x[row * wv + v];
            if add {
                a += res[row * wv + v];
            }
            vals[i] = a;
            if comptime!(load_gains) {
                gains[i] = w[v];
            }
        }
    }
    let mut ss = f32::new(0.0);
    #[unroll]
    for i in 0..iters {
        let v = tid + i * threads;
        if v < wv {
            let a = vals[i];
            ss += a[0] * a[0] + a[1] * a[1] + a[2] * a[2] + a[3] * a[3];
        }
    }
    let s = plane_sum(ss);
    let mut part = SharedMemory::<f32>::new(warps);
    if lane == 0 {
        part[warp] = s;
    }
    sync_cube();
    let mut total = f32::new(0.0);
    #[unroll]
    for q in 0..warps {
        total += part[q];
    }
    let inv = f32::new(1.0) / (total / f32::new(comptime!(width as f32)) + eps).sqrt();
    // Every warp has read `part` before a next call's sums go in.
    sync_cube();
    inv
}
