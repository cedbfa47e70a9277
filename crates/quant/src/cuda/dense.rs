//! Dense GEMV/skinny GEMM with BF16 weights and f32 activations, for the decode and verification widths of the
//! model's dense Linears (attention projections, shared experts, dense MLPs, `lm_head`): `out[t, r] = sum_c
//! x[t, c] * W[r, c]` with `W` `[rows, k]` BF16 as the checkpoint stores it (row-major, `[out, in]`), `x` `[n, k]`
//! f32, f32 accumulation. Every BF16 weight is exactly an f32 (its bits shifted up by 16), so the result is the
//! f32 product with the checkpoint's weights, at 2 bytes a weight read instead of 4.
//!
//! Work split: grid `(row tiles, token tiles)`; each warp owns `rows_at_once` rows; lane `l` streams the 16-byte
//! vectors (8 weights) `l, l + 32, ...` of each of its rows (coalesced, `rows_at_once` loads in flight) and
//! multiplies them with the matching 8 activations of up to `tb` tokens read from global memory (the same few KB
//! for every warp, served by L1/L2); a warp sum finishes each dot product.
//!
//! The CPU reference is [`gemv_reference`] (f64 accumulation), always built and tested in CI.

/// Most token rows the model norms inside a GEMV launch (`gemv_norm`): each block norms its rows one after another,
/// so at 4 rows `q_b_proj`'s normed launch took 31.3 us against 26.2 for the norm launch and the GEMV (H200,
/// `gpu_gemv --normed`; 1 row 17.6 against 27.3, 2 rows 20.2 against 25.2: bench/REPORT.md, session 20).
pub const NORMED_GEMV_MAX_TOKENS: usize = 2;

/// `x` `[n, k]` times `W^T` for `W` `[rows, k]` BF16 (as `u16` bits, row-major): `[n, rows]`, f64 accumulation.
pub fn gemv_reference(x: &[f32], w_bits: &[u16], n: usize, rows: usize, k: usize) -> Vec<f32> {
    assert_eq!(x.len(), n * k, "x is [n, k]");
    assert_eq!(w_bits.len(), rows * k, "W is [rows, k]");
    let mut out = vec![0.0f32; n * rows];
    for t in 0..n {
        for r in 0..rows {
            let mut acc = 0.0f64;
            for c in 0..k {
                acc += f64::from(x[t * k + c]) * f64::from(f32::from_bits(u32::from(w_bits[r * k + c]) << 16));
            }
            out[t * rows + r] = acc as f32;
        }
    }
    out
}

/// The SwiGLU of two BF16 weights, `out[t, r] = silu(x_t . Wg[r]) * (x_t . Wu[r])` (the gate and up projections of
/// an MLP in one pass), `[n, rows]`, f64 dot products and activation.
pub fn swiglu_reference(x: &[f32], wg_bits: &[u16], wu_bits: &[u16], n: usize, rows: usize, k: usize) -> Vec<f32> {
    let g = gemv_reference_f64(x, wg_bits, n, rows, k);
    let u = gemv_reference_f64(x, wu_bits, n, rows, k);
    g.iter().zip(&u).map(|(&g, &u)| (g / (1.0 + (-g).exp()) * u) as f32).collect()
}

fn gemv_reference_f64(x: &[f32], w_bits: &[u16], n: usize, rows: usize, k: usize) -> Vec<f64> {
    assert_eq!(x.len(), n * k, "x is [n, k]");
    assert_eq!(w_bits.len(), rows * k, "W is [rows, k]");
    let mut out = vec![0.0f64; n * rows];
    for t in 0..n {
        for r in 0..rows {
            out[t * rows + r] = (0..k)
                .map(|c| f64::from(x[t * k + c]) * f64::from(f32::from_bits(u32::from(w_bits[r * k + c]) << 16)))
                .sum();
        }
    }
    out
}

#[cfg(feature = "cuda")]
pub use gpu::{
    GemvConfig, GemvJob, bf16x8_dot, gemv_bf16, gemv_bf16_kernel, gemv_norm, gemv_norm_kernel, gemv_pair,
    gemv_pair_kernel, gemv_swiglu, gemv_swiglu_kernel, tuned_shapes,
};

#[cfg(feature = "cuda")]
mod gpu {
    use burn::cubecl;
    use cubecl::prelude::*;
    use cubecl::server::Handle;

    use crate::cuda::norm::{norm_row, normed4};

    pub use super::super::dense_shapes::{GemvConfig, tuned_shapes};

    /// `sum_e W[e] x[e]` over 8 BF16 weights (the 4 words `a`, low half first) and 8 activations (`x0`, `x1`): one
    /// 16-byte weight vector of the GEMV kernels, f32 products summed in order. Every BF16 is an f32 with its low 16
    /// bits zero, so the weights are used exactly.
    #[cube]
    pub fn bf16x8_dot<N: Size>(a: Vector<u32, N>, x0: Vector<f32, N>, x1: Vector<f32, N>) -> f32 {
        let mut s = f32::reinterpret(a[0] << 16u32) * x0[0];
        s += f32::reinterpret((a[0] >> 16u32) << 16u32) * x0[1];
        s += f32::reinterpret(a[1] << 16u32) * x0[2];
        s += f32::reinterpret((a[1] >> 16u32) << 16u32) * x0[3];
        s += f32::reinterpret(a[2] << 16u32) * x1[0];
        s += f32::reinterpret((a[2] >> 16u32) << 16u32) * x1[1];
        s += f32::reinterpret(a[3] << 16u32) * x1[2];
        s += f32::reinterpret((a[3] >> 16u32) << 16u32) * x1[3];
        s
    }

    /// Lane `lane`'s 16-byte weight vectors of stretches `i0 .. i0 + unroll` of its warp (stretch `i` of k-part
    /// `ks` is vector `(i * ksplit + ks) * 32 + lane` of each row), for `rows_at_once` rows from `row0` (rows past
    /// the end re-read the last row; their sums are never written), into `wv[j * rows_at_once + q]`: all loads
    /// first, so they are in flight together. Vectors past the row's end are not loaded.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn load_stretches<N: Size>(
        w: &Array<Vector<u32, N>>,
        wv: &mut Array<Vector<u32, N>>,
        #[comptime] slot0: usize,
        row0: usize,
        rows: usize,
        i0: usize,
        ks: usize,
        lane: usize,
        #[comptime] kv: usize,
        #[comptime] rows_at_once: usize,
        #[comptime] ksplit: usize,
        #[comptime] unroll: usize,
    ) {
        #[unroll]
        for j in 0..unroll {
            let v = ((i0 + j) * ksplit + ks) * 32 + lane;
            if v < kv {
                #[unroll]
                for q in 0..rows_at_once {
                    let mut row = row0 + q;
                    if row >= rows {
                        row = rows - 1;
                    }
                    wv[slot0 + j * rows_at_once + q] = w[row * kv + v];
                }
            }
        }
    }

    /// Adds the products of stretch `j` of the lane's loads (its vector `v` of each row) to the accumulators, for
    /// the pass's `tb` tokens from `t0` (tokens past `n` re-read the last; their sums are never written): `sets` 1
    /// (the plain GEMV: `wv[j * rows_at_once + q]` into `acc[q * tb + t]`) or 2 (gate and up: the up loads
    /// `rows_at_once * unroll` further, into `acc[(rows_at_once + q) * tb + t]`). Each accumulator gets its products
    /// in stretch order either way. With `staged` the activations are the pass's rows in shared memory `xs`
    /// (`[tb][k / 4]`, already normed: [`stage_normed`]) instead of `x`.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn stretch_products<N: Size>(
        x: &Array<Vector<f32, N>>,
        xs: &SharedMemory<Vector<f32, N>>,
        wv: &Array<Vector<u32, N>>,
        acc: &mut Array<f32>,
        v: usize,
        j: usize,
        t0: usize,
        n: usize,
        #[comptime] k4: usize,
        #[comptime] rows_at_once: usize,
        #[comptime] tb: usize,
        #[comptime] unroll: usize,
        #[comptime] sets: usize,
        #[comptime] staged: bool,
    ) {
        #[unroll]
        for t in 0..tb {
            let mut tok = t0 + t;
            if tok >= n {
                tok = n - 1;
            }
            let mut x0 = x[tok * k4 + 2 * v];
            let mut x1 = x[tok * k4 + 2 * v + 1];
            if comptime!(staged) {
                x0 = xs[t * k4 + 2 * v];
                x1 = xs[t * k4 + 2 * v + 1];
            }
            #[unroll]
            for q in 0..rows_at_once {
                #[unroll]
                for set in 0..sets {
                    let w = wv[set * comptime!(rows_at_once * unroll) + j * rows_at_once + q];
                    acc[(set * rows_at_once + q) * tb + t] += bf16x8_dot::<N>(w, x0, x1);
                }
            }
        }
    }

    /// The RMSNorm (weight `g`, `eps`) of the pass's `tb` token rows of `x` into shared memory `xs` `[tb][k / 4]`
    /// through `norm::norm_row` (`rms_norm_kernel`'s own sums and products: the same bits), for the GEMV to read
    /// instead of `x` (`staged`). Every thread of the block (8 warps) must call it; the rows are in place when it
    /// returns.
    #[cube]
    #[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
    fn stage_normed<N: Size>(
        x: &Array<Vector<f32, N>>,
        g: &Array<Vector<f32, N>>,
        xs: &mut SharedMemory<Vector<f32, N>>,
        n: usize,
        eps: f32,
        #[comptime] k: usize,
        #[comptime] tb: usize,
        #[comptime] warps: usize,
    ) {
        let tid = UNIT_POS as usize;
        let kv4 = comptime!(k / 4);
        let threads = comptime!(32 * warps);
        let iters = comptime!((k / 4).div_ceil(32 * warps));
        let mut vals = Array::<Vector<f32, N>>::new(iters);
        let mut unused = Array::<Vector<f32, N>>::new(1usize);
        #[unroll]
        for t in 0..tb {
            let mut tok = CUBE_POS_Y as usize * tb + t;
            if tok >= n {
                tok = n - 1;
            }
            // The row's sums, then (the row parked in `xs`, its registers free) the weight and the normed row: the
            // prologue holds one row's vectors at a time, not the row's and the weight's.
            let inv = norm_row::<N>(x, x, g, &mut vals, &mut unused, tok, eps, k, warps, false, false);
            #[unroll]
            for i in 0..iters {
                let v = tid + i * threads;
                if v < kv4 {
                    xs[t * kv4 + v] = vals[i];
                }
            }
            #[unroll]
            for i in 0..iters {
                let v = tid + i * threads;
                if v < kv4 {
                    xs[t * kv4 + v] = normed4::<N>(xs[t * kv4 + v], inv, g[v]);
                }
            }
        }
        sync_cube();
    }

    /// Adds the `ksplit` warps' partial sums of each of a block's row groups (warp `w` = group `w / ksplit`, part
    /// `w % ksplit`; `acc` already summed over the warp) in part order, through shared memory: afterwards lane 0
    /// of each group's part-0 warp holds the full sums in `acc`. Every thread of the block must call it.
    #[cube]
    fn sum_ksplit(
        acc: &mut Array<f32>,
        warp: usize,
        lane: usize,
        #[comptime] len: usize,
        #[comptime] warps: usize,
        #[comptime] ksplit: usize,
    ) {
        if comptime!(ksplit > 1) {
            let mut parts = SharedMemory::<f32>::new(comptime!(warps * len));
            if lane == 0 {
                #[unroll]
                for a in 0..len {
                    parts[warp * len + a] = acc[a];
                }
            }
            sync_cube();
            if lane == 0 && warp.is_multiple_of(ksplit) {
                #[unroll]
                for p in 1..ksplit {
                    #[unroll]
                    for a in 0..len {
                        acc[a] += parts[(warp + p) * len + a];
                    }
                }
            }
        }
    }

    /// The first `unroll` stretches of block `block`'s rows into `wv`, as [`gemv_block`] loads them first (with
    /// its `preloaded`, it starts from them): a normed launch issues them before its norm prologue, so the weights'
    /// latency overlaps the norm's instead of following it.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn first_loads<N: Size>(
        wg: &Array<Vector<u32, N>>,
        wu: &Array<Vector<u32, N>>,
        wv: &mut Array<Vector<u32, N>>,
        rows: usize,
        block: usize,
        #[comptime] k: usize,
        #[comptime] rows_at_once: usize,
        #[comptime] warps: usize,
        #[comptime] ksplit: usize,
        #[comptime] unroll: usize,
        #[comptime] sets: usize,
    ) {
        let lane = UNIT_POS_X as usize;
        let warp = UNIT_POS_Y as usize;
        let kv = comptime!(k / 8);
        let ks = warp % ksplit;
        let row0 = (block * comptime!(warps / ksplit) + warp / ksplit) * rows_at_once;
        let half = comptime!(rows_at_once * unroll);
        load_stretches::<N>(wg, wv, 0usize, row0, rows, 0usize, ks, lane, kv, rows_at_once, ksplit, unroll);
        if comptime!(sets == 2) {
            load_stretches::<N>(wu, wv, half, row0, rows, 0usize, ks, lane, kv, rows_at_once, ksplit, unroll);
        }
    }

    /// Block `block` of a GEMV launch (module docs of `eyrie_quant::cuda::dense`): one warp per `rows_at_once`
    /// rows (and one `ksplit`-th of their `k`), `tb` tokens per pass (the grid's `y`). `sets` 1: `out = x W^T` for
    /// `W` = `wg` (`wu` unused); `sets` 2: `out = silu(x Wg^T) * (x Wu^T)` (an MLP's gate and up, each warp owning
    /// the same rows of both, twice the loads in flight). The body of [`gemv_bf16_kernel`],
    /// [`gemv_swiglu_kernel`] and both halves of [`gemv_pair_kernel`].
    #[cube]
    #[allow(clippy::too_many_arguments, clippy::manual_div_ceil, clippy::collapsible_if)]
    fn gemv_block<N: Size>(
        x: &Array<Vector<f32, N>>,
        xs: &SharedMemory<Vector<f32, N>>,
        wg: &Array<Vector<u32, N>>,
        wu: &Array<Vector<u32, N>>,
        wv: &mut Array<Vector<u32, N>>,
        out: &mut Array<f32>,
        n: usize,
        rows: usize,
        block: usize,
        #[comptime] k: usize,
        #[comptime] rows_at_once: usize,
        #[comptime] tb: usize,
        #[comptime] warps: usize,
        #[comptime] ksplit: usize,
        #[comptime] unroll: usize,
        #[comptime] sets: usize,
        #[comptime] staged: bool,
        #[comptime] preloaded: bool,
    ) {
        let lane = UNIT_POS_X as usize;
        let warp = UNIT_POS_Y as usize;
        // 16-byte weight vectors (8 weights) per row; 4-float activation vectors per token row.
        let kv = comptime!(k / 8);
        let k4 = comptime!(k / 4);
        let ks = warp % ksplit;
        let row0 = (block * comptime!(warps / ksplit) + warp / ksplit) * rows_at_once;
        let t0 = CUBE_POS_Y as usize * tb;
        // Gate (or the only) rows in accumulators and loads `0 .. rows_at_once * ..`, up rows after them.
        let half = comptime!(rows_at_once * unroll);

        let mut acc = Array::<f32>::new(comptime!(sets * rows_at_once * tb));
        #[unroll]
        for a in 0..comptime!(sets * rows_at_once * tb) {
            acc[a] = f32::new(0.0);
        }
        for ib in 0..comptime!(kv.div_ceil(32 * ksplit).div_ceil(unroll)) {
            let i0 = ib * unroll;
            // (With `preloaded` the first stretches are in `wv` already: `first_loads`.)
            if ib > 0 || !preloaded {
                load_stretches::<N>(wg, wv, 0usize, row0, rows, i0, ks, lane, kv, rows_at_once, ksplit, unroll);
                if comptime!(sets == 2) {
                    load_stretches::<N>(wu, wv, half, row0, rows, i0, ks, lane, kv, rows_at_once, ksplit, unroll);
                }
            }
            #[unroll]
            for j in 0..unroll {
                let v = ((i0 + j) * ksplit + ks) * 32 + lane;
                if v < kv {
                    stretch_products::<N>(x, xs, wv, &mut acc, v, j, t0, n, k4, rows_at_once, tb, unroll, sets, staged);
                }
            }
        }
        #[unroll]
        for a in 0..comptime!(sets * rows_at_once * tb) {
            acc[a] = plane_sum(acc[a]);
        }
        sum_ksplit(&mut acc, warp, lane, comptime!(sets * rows_at_once * tb), warps, ksplit);
        #[unroll]
        for q in 0..rows_at_once {
            #[unroll]
            for t in 0..tb {
                let row = row0 + q;
                let tok = t0 + t;
                if lane == 0 && ks == 0 && row < rows && tok < n {
                    let g = acc[q * tb + t];
                    if comptime!(sets == 2) {
                        let u = acc[(rows_at_once + q) * tb + t];
                        out[tok * rows + row] = g / (f32::new(1.0) + (-g).exp()) * u;
                    } else {
                        out[tok * rows + row] = g;
                    }
                }
            }
        }
    }

    /// One warp per `rows_at_once` rows (and one `ksplit`-th of their `k`), `tb` tokens per pass (module docs of
    /// `eyrie_quant::cuda::dense`).
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_bf16_kernel<N: Size>(
        x: &Array<Vector<f32, N>>,
        w: &Array<Vector<u32, N>>,
        out: &mut Array<f32>,
        tokens: u32,
        rows: u32,
        #[comptime] k: usize,
        #[comptime] rows_at_once: usize,
        #[comptime] tb: usize,
        #[comptime] warps: usize,
        #[comptime] ksplit: usize,
        #[comptime] unroll: usize,
    ) {
        // (`tokens`, not `n`: the launcher the macro writes has a `_n` of its own, for `N`.)
        let (n, rows, block) = (tokens as usize, rows as usize, CUBE_POS_X as usize);
        let none = SharedMemory::<Vector<f32, N>>::new(1usize);
        let mut wv = Array::<Vector<u32, N>>::new(comptime!(rows_at_once * unroll));
        let f = false;
        gemv_block::<N>(
            x,
            &none,
            w,
            w,
            &mut wv,
            out,
            n,
            rows,
            block,
            k,
            rows_at_once,
            tb,
            warps,
            ksplit,
            unroll,
            1usize,
            f,
            f,
        );
    }

    /// [`gemv_bf16_kernel`] over two matrices at once, the gate and up projections of an MLP, writing
    /// `silu(gate) * up` (SwiGLU): one launch where the generic path has two GEMVs, a SiLU and a product. Each warp
    /// owns `rows_at_once` rows of both matrices (twice the loads in flight of the plain kernel).
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_swiglu_kernel<N: Size>(
        x: &Array<Vector<f32, N>>,
        wg: &Array<Vector<u32, N>>,
        wu: &Array<Vector<u32, N>>,
        out: &mut Array<f32>,
        tokens: u32,
        rows: u32,
        #[comptime] k: usize,
        #[comptime] rows_at_once: usize,
        #[comptime] tb: usize,
        #[comptime] warps: usize,
        #[comptime] ksplit: usize,
        #[comptime] unroll: usize,
    ) {
        let (n, rows, block) = (tokens as usize, rows as usize, CUBE_POS_X as usize);
        let none = SharedMemory::<Vector<f32, N>>::new(1usize);
        let mut wv = Array::<Vector<u32, N>>::new(comptime!(2 * rows_at_once * unroll));
        gemv_block::<N>(
            x,
            &none,
            wg,
            wu,
            &mut wv,
            out,
            n,
            rows,
            block,
            k,
            rows_at_once,
            tb,
            warps,
            ksplit,
            unroll,
            2usize,
            false,
            false,
        );
    }

    /// Two GEMV jobs over the same input `x` in one launch ([`gemv_pair`]): blocks `0 .. blocks_a` run job `a`
    /// (`out_a` from `wa`, and `wa_up` when `sets_a` is 2: SwiGLU), the rest job `b`, each with its own rows a
    /// warp, k-split and loads in flight (`*_a`, `*_b`: the shapes [`GemvConfig`] picks for each alone); the same
    /// warps a block and tokens a pass for both. Replaces two launches whose inputs are one tensor: a layer's
    /// `q_a_proj` and `kv_a_proj_with_mqa`, an MoE layer's shared-expert gate/up and its router.
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_pair_kernel<N: Size>(
        x: &Array<Vector<f32, N>>,
        wa: &Array<Vector<u32, N>>,
        wa_up: &Array<Vector<u32, N>>,
        out_a: &mut Array<f32>,
        wb: &Array<Vector<u32, N>>,
        wb_up: &Array<Vector<u32, N>>,
        out_b: &mut Array<f32>,
        tokens: u32,
        rows_a: u32,
        rows_b: u32,
        blocks_a: u32,
        #[comptime] k: usize,
        #[comptime] tb: usize,
        #[comptime] warps: usize,
        #[comptime] rows_at_once_a: usize,
        #[comptime] ksplit_a: usize,
        #[comptime] unroll_a: usize,
        #[comptime] sets_a: usize,
        #[comptime] rows_at_once_b: usize,
        #[comptime] ksplit_b: usize,
        #[comptime] unroll_b: usize,
        #[comptime] sets_b: usize,
    ) {
        let n = tokens as usize;
        let none = SharedMemory::<Vector<f32, N>>::new(1usize);
        let f = false;
        if CUBE_POS_X < blocks_a {
            let block = CUBE_POS_X as usize;
            let rows = rows_a as usize;
            let mut wv = Array::<Vector<u32, N>>::new(comptime!(sets_a * rows_at_once_a * unroll_a));
            gemv_block::<N>(
                x,
                &none,
                wa,
                wa_up,
                &mut wv,
                out_a,
                n,
                rows,
                block,
                k,
                rows_at_once_a,
                tb,
                warps,
                ksplit_a,
                unroll_a,
                sets_a,
                f,
                f,
            );
        } else {
            let block = (CUBE_POS_X - blocks_a) as usize;
            let rows = rows_b as usize;
            let mut wv = Array::<Vector<u32, N>>::new(comptime!(sets_b * rows_at_once_b * unroll_b));
            gemv_block::<N>(
                x,
                &none,
                wb,
                wb_up,
                &mut wv,
                out_b,
                n,
                rows,
                block,
                k,
                rows_at_once_b,
                tb,
                warps,
                ksplit_b,
                unroll_b,
                sets_b,
                f,
                f,
            );
        }
    }

    /// [`gemv_bf16_kernel`] of the RMSNorm of `x`: `out = (x_t / rms(x_t) * g) W^T` for each token row `x_t` (`g`
    /// the norm's weight `[k]`, `eps` its epsilon): each block first norms its pass's token rows into shared memory
    /// ([`stage_normed`]: `rms_norm_kernel`'s own sums and products, the same bits), then reads them there. Replaces a norm launch before a GEMV (a layer's `q_a_layernorm` before `q_b_proj`). `warps`
    /// must be 8 for the norm's bits (the launcher checks).
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
    pub fn gemv_norm_kernel<N: Size>(
        x: &Array<Vector<f32, N>>,
        g: &Array<Vector<f32, N>>,
        w: &Array<Vector<u32, N>>,
        out: &mut Array<f32>,
        tokens: u32,
        rows: u32,
        eps: f32,
        #[comptime] k: usize,
        #[comptime] rows_at_once: usize,
        #[comptime] tb: usize,
        #[comptime] warps: usize,
        #[comptime] ksplit: usize,
        #[comptime] unroll: usize,
    ) {
        let (n, rows, block) = (tokens as usize, rows as usize, CUBE_POS_X as usize);
        let mut xs = SharedMemory::<Vector<f32, N>>::new(comptime!(tb * k / 4));
        let mut wv = Array::<Vector<u32, N>>::new(comptime!(rows_at_once * unroll));
        first_loads::<N>(w, w, &mut wv, rows, block, k, rows_at_once, warps, ksplit, unroll, 1usize);
        stage_normed::<N>(x, g, &mut xs, n, eps, k, tb, warps);
        let t = true;
        gemv_block::<N>(
            x,
            &xs,
            w,
            w,
            &mut wv,
            out,
            n,
            rows,
            block,
            k,
            rows_at_once,
            tb,
            warps,
            ksplit,
            unroll,
            1usize,
            t,
            t,
        );
    }

    /// The checks and the grid shared by [`gemv_bf16`] and [`gemv_swiglu`]: `n`, `rows`, `k` at least 1 and `k` a
    /// multiple of 8, a launch shape the kernels take, every buffer at least its `(name, handle, bytes)`; errors
    /// name the launcher (`what`) and the parameter.
    fn gemv_launch(
        what: &str,
        n: usize,
        rows: usize,
        k: usize,
        cfg: &GemvConfig,
        sizes: &[(&str, &Handle, usize)],
    ) -> Result<(CubeCount, AddressType), String> {
        if n == 0 || rows == 0 || k == 0 || !k.is_multiple_of(8) {
            return Err(format!("{what}: n {n}, rows {rows}, k {k}: need all >= 1 and k a multiple of 8"));
        }
        if !matches!(cfg.tb, 1 | 2 | 4 | 8)
            || cfg.warps == 0
            || cfg.rows_at_once == 0
            || cfg.unroll == 0
            || cfg.ksplit == 0
            || !cfg.warps.is_multiple_of(cfg.ksplit)
        {
            return Err(format!(
                "{what}: launch shape {cfg:?}: tb 1, 2, 4 or 8, warps, rows_at_once, unroll >= 1, warps a multiple \
                 of ksplit"
            ));
        }
        for &(name, h, bytes) in sizes {
            if (h.size_in_used() as usize) < bytes {
                return Err(format!("{what}: {name} holds {} bytes, needs {bytes}", h.size_in_used()));
            }
        }
        let per_block = cfg.warps / cfg.ksplit * cfg.rows_at_once;
        let count = CubeCount::Static(rows.div_ceil(per_block) as u32, n.div_ceil(cfg.tb) as u32, 1);
        Ok((count, AddressType::from_len((rows * k / 2).max(n * k).max(n * rows))))
    }

    /// `out` `[n, rows]` f32 `= silu(x Wg^T) * (x Wu^T)` for `Wg`, `Wu` `[rows, k]` BF16 and `x` `[n, k]` f32 (each
    /// buffer contiguous, row-major), in one launch of [`gemv_swiglu_kernel`]. Sizes as [`gemv_bf16`].
    ///
    /// # Errors
    /// A message naming the parameter when a size does not fit (nothing is launched then).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_swiglu<R: Runtime>(
        client: &ComputeClient<R>,
        x: &Handle,
        wg: &Handle,
        wu: &Handle,
        out: &Handle,
        n: usize,
        rows: usize,
        k: usize,
        cfg: GemvConfig,
    ) -> Result<(), String> {
        let sizes =
            [("x", x, n * k * 4), ("wg", wg, rows * k * 2), ("wu", wu, rows * k * 2), ("out", out, n * rows * 4)];
        let (count, address) = gemv_launch("gemv_swiglu", n, rows, k, &cfg, &sizes)?;
        // SAFETY: sizes checked above; the kernel clamps row and token indices into range and writes only
        // `out[tok * rows + row]` for `tok < n`, `row < rows`.
        unsafe {
            gemv_swiglu_kernel::launch_unchecked::<R>(
                client,
                count,
                CubeDim::new_2d(32, cfg.warps as u32),
                address,
                4,
                ArrayArg::from_raw_parts(x.clone(), n * k / 4),
                ArrayArg::from_raw_parts(wg.clone(), rows * k / 8),
                ArrayArg::from_raw_parts(wu.clone(), rows * k / 8),
                ArrayArg::from_raw_parts(out.clone(), n * rows),
                n as u32,
                rows as u32,
                k,
                cfg.rows_at_once,
                cfg.tb,
                cfg.warps,
                cfg.ksplit,
                cfg.unroll,
            );
        }
        Ok(())
    }

    /// `out` `[n, rows]` f32 = `x` `[n, k]` f32 times `W^T`, `W` `[rows, k]` BF16 (each buffer contiguous,
    /// row-major). `k` must be a multiple of 8 (one 16-byte vector is 8 weights); `n` and `rows` at least 1.
    ///
    /// # Errors
    /// A message naming the parameter when a size does not fit (nothing is launched then).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_bf16<R: Runtime>(
        client: &ComputeClient<R>,
        x: &Handle,
        w: &Handle,
        out: &Handle,
        n: usize,
        rows: usize,
        k: usize,
        cfg: GemvConfig,
    ) -> Result<(), String> {
        let sizes = [("x", x, n * k * 4), ("w", w, rows * k * 2), ("out", out, n * rows * 4)];
        let (count, address) = gemv_launch("gemv_bf16", n, rows, k, &cfg, &sizes)?;
        // SAFETY: sizes checked above; the kernel clamps row and token indices into range and writes only
        // `out[tok * rows + row]` for `tok < n`, `row < rows`.
        unsafe {
            gemv_bf16_kernel::launch_unchecked::<R>(
                client,
                count,
                CubeDim::new_2d(32, cfg.warps as u32),
                address,
                4,
                ArrayArg::from_raw_parts(x.clone(), n * k / 4),
                ArrayArg::from_raw_parts(w.clone(), rows * k / 8),
                ArrayArg::from_raw_parts(out.clone(), n * rows),
                n as u32,
                rows as u32,
                k,
                cfg.rows_at_once,
                cfg.tb,
                cfg.warps,
                cfg.ksplit,
                cfg.unroll,
            );
        }
        Ok(())
    }

    /// `out` `[n, rows]` f32 `= RMSNorm(x) W^T` in one launch of [`gemv_norm_kernel`]: `x` `[n, k]` f32, the norm's
    /// weight `g` `[k]` f32 and `eps`, `W` `[rows, k]` BF16 (each contiguous, row-major). The same values as
    /// `norm::rms_norm_kernel` then [`gemv_bf16`] with `cfg`, which must have 8 warps (the norm kernel's).
    ///
    /// # Errors
    /// A message naming the parameter when a size or the shape does not fit (nothing is launched then).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_norm<R: Runtime>(
        client: &ComputeClient<R>,
        x: &Handle,
        g: &Handle,
        w: &Handle,
        out: &Handle,
        (n, rows, k): (usize, usize, usize),
        eps: f32,
        cfg: GemvConfig,
    ) -> Result<(), String> {
        if cfg.warps != crate::cuda::norm::RMS_NORM_WARPS {
            return Err(format!(
                "gemv_norm: launch shape {cfg:?}: {} warps a block (the norm kernel's)",
                crate::cuda::norm::RMS_NORM_WARPS
            ));
        }
        let sizes = [("x", x, n * k * 4), ("g", g, k * 4), ("w", w, rows * k * 2), ("out", out, n * rows * 4)];
        let (count, address) = gemv_launch("gemv_norm", n, rows, k, &cfg, &sizes)?;
        // SAFETY: sizes checked above; the kernel clamps row and token indices into range, reads `g` vectors `< k / 4`
        // and writes only `out[tok * rows + row]` for `tok < n`, `row < rows`.
        unsafe {
            gemv_norm_kernel::launch_unchecked::<R>(
                client,
                count,
                CubeDim::new_2d(32, cfg.warps as u32),
                address,
                4,
                ArrayArg::from_raw_parts(x.clone(), n * k / 4),
                ArrayArg::from_raw_parts(g.clone(), k / 4),
                ArrayArg::from_raw_parts(w.clone(), rows * k / 8),
                ArrayArg::from_raw_parts(out.clone(), n * rows),
                n as u32,
                rows as u32,
                eps,
                k,
                cfg.rows_at_once,
                cfg.tb,
                cfg.warps,
                cfg.ksplit,
                cfg.unroll,
            );
        }
        Ok(())
    }

    /// One job of [`gemv_pair`]: `out` `[n, rows]` f32 `= x W^T` (`w_up` `None`), or `silu(x W^T) * (x Wu^T)`
    /// (`w_up` the up projection: SwiGLU), `W` and `Wu` `[rows, k]` BF16 (contiguous, row-major), in the launch
    /// shape `cfg` ([`GemvConfig::for_shape`] / [`GemvConfig::for_swiglu`] for the job alone).
    #[derive(Debug, Clone, Copy)]
    pub struct GemvJob<'a> {
        /// `W` (the gate projection for SwiGLU).
        pub w: &'a Handle,
        /// The up projection (SwiGLU), or `None`.
        pub w_up: Option<&'a Handle>,
        /// `[n, rows]` f32.
        pub out: &'a Handle,
        /// Rows of `W`.
        pub rows: usize,
        /// Launch shape.
        pub cfg: GemvConfig,
    }

    /// Two GEMV jobs over one input `x` `[n, k]` f32 in one launch of [`gemv_pair_kernel`] (job `a`'s blocks
    /// first): each job's result is the one [`gemv_bf16`] / [`gemv_swiglu`] gives with its `cfg`, bit for bit.
    /// Both shapes must have the same warps a block and tokens a pass.
    ///
    /// # Errors
    /// A message naming the job and parameter when a size or shape does not fit (nothing is launched then).
    pub fn gemv_pair<R: Runtime>(
        client: &ComputeClient<R>,
        x: &Handle,
        n: usize,
        k: usize,
        a: GemvJob<'_>,
        b: GemvJob<'_>,
    ) -> Result<(), String> {
        if a.cfg.warps != b.cfg.warps || a.cfg.tb != b.cfg.tb {
            return Err(format!(
                "gemv_pair: job a's shape {:?} and job b's {:?} differ in warps or tokens a pass",
                a.cfg, b.cfg
            ));
        }
        let grid = |what: &str, names: [&str; 3], j: &GemvJob<'_>| {
            let mut sizes =
                vec![("x", x, n * k * 4), (names[0], j.w, j.rows * k * 2), (names[1], j.out, n * j.rows * 4)];
            if let Some(u) = j.w_up {
                sizes.push((names[2], u, j.rows * k * 2));
            }
            gemv_launch(what, n, j.rows, k, &j.cfg, &sizes)
        };
        let (ca, _) = grid("gemv_pair job a", ["a.w", "a.out", "a.w_up"], &a)?;
        let (cb, _) = grid("gemv_pair job b", ["b.w", "b.out", "b.w_up"], &b)?;
        let (CubeCount::Static(blocks_a, ty, _), CubeCount::Static(blocks_b, _, _)) = (ca, cb) else {
            return Err("gemv_pair: grids are static".into());
        };
        let len = |j: &GemvJob<'_>| (j.rows * k / 2).max(n * k).max(n * j.rows);
        let address = AddressType::from_len(len(&a).max(len(&b)));
        let sets = |j: &GemvJob<'_>| if j.w_up.is_some() { 2usize } else { 1 };
        // SAFETY: sizes checked above (both jobs); each half clamps its row and token indices into range and writes
        // only its own `out[tok * rows + row]` for `tok < n`, `row < rows`.
        unsafe {
            gemv_pair_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(blocks_a + blocks_b, ty, 1),
                CubeDim::new_2d(32, a.cfg.warps as u32),
                address,
                4,
                ArrayArg::from_raw_parts(x.clone(), n * k / 4),
                ArrayArg::from_raw_parts(a.w.clone(), a.rows * k / 8),
                ArrayArg::from_raw_parts(a.w_up.unwrap_or(a.w).clone(), a.rows * k / 8),
                ArrayArg::from_raw_parts(a.out.clone(), n * a.rows),
                ArrayArg::from_raw_parts(b.w.clone(), b.rows * k / 8),
                ArrayArg::from_raw_parts(b.w_up.unwrap_or(b.w).clone(), b.rows * k / 8),
                ArrayArg::from_raw_parts(b.out.clone(), n * b.rows),
                n as u32,
                a.rows as u32,
                b.rows as u32,
                blocks_a,
                k,
                a.cfg.tb,
                a.cfg.warps,
                a.cfg.rows_at_once,
                a.cfg.ksplit,
                a.cfg.unroll,
                sets(&a),
                b.cfg.rows_at_once,
                b.cfg.ksplit,
                b.cfg.unroll,
                sets(&b),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swiglu_reference_is_silu_of_gate_times_up() {
        let bits = |v: f32| (v.to_bits() >> 16) as u16;
        // x = [1, 2]; gate row [1, 0] -> 1, up row [0.5, 0.25] -> 1: silu(1) * 1.
        let out = swiglu_reference(&[1.0, 2.0], &[bits(1.0), bits(0.0)], &[bits(0.5), bits(0.25)], 1, 1, 2);
        assert!((f64::from(out[0]) - 1.0 / (1.0 + (-1.0f64).exp())).abs() < 1e-7, "{out:?}");
    }

    #[test]
    fn reference_multiplies_by_the_bf16_weights() {
        // W = [[1, 2], [-0.5, 3]] as BF16 bits; x = [[1, 1], [2, -1]].
        let bits = |v: f32| (v.to_bits() >> 16) as u16;
        let w = [bits(1.0), bits(2.0), bits(-0.5), bits(3.0)];
        let out = gemv_reference(&[1.0, 1.0, 2.0, -1.0], &w, 2, 2, 2);
        assert_eq!(out, vec![3.0, 2.5, 0.0, -4.0]);
    }
}
