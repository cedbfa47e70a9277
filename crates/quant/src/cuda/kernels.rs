//! CubeCL kernels of the fused INT4 MoE (W4A16: INT4 weights, BF16 activations, f32 accumulation).
//!
//! # Dequantization without conversions
//!
//! A GEMV over INT4 weights at 4.8 TB/s must spend about one integer and two float instructions per weight,
//! so the kernels never convert integers to floats one by one. For the nibble `u` at bits `[4k, 4k+3]` of a
//! 16-bit half word `s` (`k` in 0..4), `f32::from_bits((s & (0xF << 4k)) | 0x4B00_0000)` is `2^23 + u * 16^k`
//! exactly, and subtracting `2^23 + 8 * 16^k` leaves `(u - 8) * 16^k = q * 16^k` exactly: one LOP3 and one FADD.
//! The `16^k` is cancelled exactly by storing the activation of column `c` pre-multiplied by `2^(-4 (c % 4))`
//! (column `c` of a word always sits at `k = c % 4` of its half word). Each 32-column slice (inside one group,
//! since groups are multiples of 32) is summed as `sum q * x`, then multiplied by its scale and added to the f32
//! accumulator: the exact value of `sum (q * scale) * x` up to f32 rounding. compressed-tensors additionally
//! rounds each product `q * scale` to BF16 when it decompresses; the kernel does not (see `reference::Dequant`).
//!
//! # Work split
//!
//! Grid `(row tiles, active experts)`; a block of `warps` warps first loads the activations of up to `tb` tokens
//! routed to its expert into shared memory (f32, pre-scaled, one padding vector per 32 columns so the warps'
//! 16-byte reads hit distinct banks), then each warp computes two rows for all those tokens: lane `l` streams
//! the 16-byte vectors `l, l + 32, ...` of each row (coalesced), and a warp sum finishes each dot product. An
//! expert's rows are therefore read once per `tb` tokens routed to it.

use burn::cubecl;
use cubecl::prelude::*;
use half::bf16;

/// `q * 16^k` for the nibble at bits `[4k, 4k+3]` of `src` (`k` in 0..4, higher bits ignored): `2^23 + u * 16^k`
/// built by bit operations, minus `2^23 + 8 * 16^k`.
#[cube]
fn nibble(src: u32, #[comptime] k: u32) -> f32 {
    let bits = (src & u32::new(comptime!((0xFu32 << (4 * k)) as i64))) | u32::new(0x4B00_0000);
    f32::reinterpret(bits) - f32::new(comptime!(8_388_608.0f32 + 8.0 * (1u32 << (4 * k)) as f32))
}

/// Rows of one expert's INT4 matrix times the activations of the tokens routed to it.
///
/// - `act`: `[*, k]` activations; row `pair / topk` (`by_token`, the layer input) or `pair` (the intermediate).
/// - `words`: `[E, rows, k/32]` 16-byte vectors (`N` = 4 words); `scales`: `[E, rows, k/group]` BF16.
/// - `experts`, `offsets`, `pairs`: the grouping of [`super::Routing`].
/// - `out`: `gated`: `[pairs, rows/2]`, `silu(row j) * row (j + rows/2)`; else `[pairs, rows]`.
///
/// Each warp computes rows `j` and `j + rows/2` (gate and up of the same unit when `gated`).
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn expert_rows_kernel<F: Float, N: Size>(
    act: &Array<F>,
    words: &Array<Vector<u32, N>>,
    scales: &Array<bf16>,
    experts: &Array<u32>,
    offsets: &Array<u32>,
    pairs: &Array<u32>,
    out: &mut Array<f32>,
    #[comptime] k: usize,
    #[comptime] rows: usize,
    #[comptime] group: usize,
    #[comptime] topk: usize,
    #[comptime] tb: usize,
    #[comptime] rows_per_warp: usize,
    #[comptime] warps: usize,
    #[comptime] gated: bool,
    #[comptime] by_token: bool,
) {
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let tid = UNIT_POS as usize;
    let slot = CUBE_POS_Y as usize;
    let e = experts[slot] as usize;
    let start = offsets[slot] as usize;
    let count = offsets[slot + 1] as usize - start;

    // 16-byte weight vectors per row, per lane, 4-wide activation vectors per row, padded row length.
    let kv = comptime!(k / 32);
    let per_lane = comptime!(k.div_ceil(1024));
    let k4 = comptime!(k / 4);
    let kpad = comptime!(k / 4 + k / 32);
    let ng = comptime!(k / group);
    let half = comptime!(rows / 2);
    let threads = comptime!(32 * warps);
    let fill_iters = comptime!((tb * k / 4).div_ceil(32 * warps));

    let mut xs = SharedMemory::<Vector<f32, N>>::new(comptime!(tb * (k / 4 + k / 32)));

    let n_chunks = (count + tb - 1) / tb;
    for ch in 0..n_chunks {
        let c0 = start + ch * tb;
        let n = count - ch * tb;

        // Activations of this chunk's tokens, f32, column c scaled by 2^(-4 (c % 4)); zero for missing tokens.
        for it in 0..fill_iters {
            let idx = it * threads + tid;
            if idx < comptime!(tb * k / 4) {
                let t = idx / k4;
                let c4 = idx % k4;
                let mut v = Vector::<f32, N>::empty();
                v[0] = f32::new(0.0);
                v[1] = f32::new(0.0);
                v[2] = f32::new(0.0);
                v[3] = f32::new(0.0);
                if t < n {
                    let p = pairs[c0 + t] as usize;
                    let mut row = p;
                    if by_token {
                        row = p / topk;
                    }
                    let base = row * k + c4 * 4;
                    v[0] = f32::cast_from(act[base]);
                    v[1] = f32::cast_from(act[base + 1]) * f32::new(0.0625);
                    v[2] = f32::cast_from(act[base + 2]) * f32::new(0.003_906_25);
                    v[3] = f32::cast_from(act[base + 3]) * f32::new(0.000_244_140_625);
                }
                xs[t * kpad + c4 + c4 / 8] = v;
            }
        }
        sync_cube();

        for r in 0..rows_per_warp {
            let j = (CUBE_POS_X as usize * warps + warp) * rows_per_warp + r;
            if j < half {
                let ra = e * rows + j;
                let rb = ra + half;
                // All of this lane's loads first, so they are in flight together.
                let mut wa = Array::<Vector<u32, N>>::new(per_lane);
                let mut wb = Array::<Vector<u32, N>>::new(per_lane);
                let mut sa = Array::<f32>::new(per_lane);
                let mut sb = Array::<f32>::new(per_lane);
                #[unroll]
                for i in 0..per_lane {
                    let v = lane + 32 * i;
                    if v < kv {
                        wa[i] = words[ra * kv + v];
                        wb[i] = words[rb * kv + v];
                        sa[i] = f32::cast_from(scales[ra * ng + v * 32 / group]);
                        sb[i] = f32::cast_from(scales[rb * ng + v * 32 / group]);
                    } else {
                        let mut z = Vector::<u32, N>::empty();
                        z[0] = u32::new(0);
                        z[1] = u32::new(0);
                        z[2] = u32::new(0);
                        z[3] = u32::new(0);
                        wa[i] = z;
                        wb[i] = z;
                        sa[i] = f32::new(0.0);
                        sb[i] = f32::new(0.0);
                    }
                }

                let mut acc_a = Array::<f32>::new(tb);
                let mut acc_b = Array::<f32>::new(tb);
                #[unroll]
                for t in 0..tb {
                    acc_a[t] = f32::new(0.0);
                    acc_b[t] = f32::new(0.0);
                }

                #[unroll]
                for i in 0..per_lane {
                    // Lanes past the row's end read a valid vector; their scale is 0.
                    let mut v = lane + 32 * i;
                    if v >= kv {
                        v = kv - 1;
                    }
                    let mut pa = Array::<f32>::new(tb);
                    let mut pb = Array::<f32>::new(tb);
                    #[unroll]
                    for t in 0..tb {
                        pa[t] = f32::new(0.0);
                        pb[t] = f32::new(0.0);
                    }
                    #[unroll]
                    for w in 0..4usize {
                        let la = wa[i][w];
                        let ha = la >> 16u32;
                        let lb = wb[i][w];
                        let hb = lb >> 16u32;
                        let a0 = nibble(la, 0u32);
                        let a1 = nibble(la, 1u32);
                        let a2 = nibble(la, 2u32);
                        let a3 = nibble(la, 3u32);
                        let a4 = nibble(ha, 0u32);
                        let a5 = nibble(ha, 1u32);
                        let a6 = nibble(ha, 2u32);
                        let a7 = nibble(ha, 3u32);
                        let b0 = nibble(lb, 0u32);
                        let b1 = nibble(lb, 1u32);
                        let b2 = nibble(lb, 2u32);
                        let b3 = nibble(lb, 3u32);
                        let b4 = nibble(hb, 0u32);
                        let b5 = nibble(hb, 1u32);
                        let b6 = nibble(hb, 2u32);
                        let b7 = nibble(hb, 3u32);
                        #[unroll]
                        for t in 0..tb {
                            let xi = t * kpad + 9 * v + 2 * w;
                            let x0 = xs[xi];
                            let x1 = xs[xi + 1];
                            pa[t] += a0 * x0[0]
                                + a1 * x0[1]
                                + a2 * x0[2]
                                + a3 * x0[3]
                                + a4 * x1[0]
                                + a5 * x1[1]
                                + a6 * x1[2]
                                + a7 * x1[3];
                            pb[t] += b0 * x0[0]
                                + b1 * x0[1]
                                + b2 * x0[2]
                                + b3 * x0[3]
                                + b4 * x1[0]
                                + b5 * x1[1]
                                + b6 * x1[2]
                                + b7 * x1[3];
                        }
                    }
                    #[unroll]
                    for t in 0..tb {
                        acc_a[t] += pa[t] * sa[i];
                        acc_b[t] += pb[t] * sb[i];
                    }
                }

                #[unroll]
                for t in 0..tb {
                    let a = plane_sum(acc_a[t]);
                    let b = plane_sum(acc_b[t]);
                    if lane == 0 && t < n {
                        let p = pairs[c0 + t] as usize;
                        if gated {
                            let ex = (-a).exp();
                            out[p * half + j] = a / (f32::new(1.0) + ex) * b;
                        } else {
                            out[p * rows + j] = a;
                            out[p * rows + j + half] = b;
                        }
                    }
                }
            }
        }
        sync_cube();
    }
}

/// `out[t, c] = sum_k weights[t, k] * y[t * topk + k, c]` (`y`: `[m * topk, hidden]`, `out`: `[m, hidden]`).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn combine_kernel(
    y: &Array<f32>,
    weights: &Array<f32>,
    out: &mut Array<f32>,
    #[comptime] hidden: usize,
    #[comptime] topk: usize,
) {
    let idx = ABSOLUTE_POS;
    if idx < out.len() {
        let t = idx / hidden;
        let c = idx % hidden;
        let mut sum = f32::new(0.0);
        #[unroll]
        for k in 0..topk {
            let p = t * topk + k;
            sum += weights[p] * y[p * hidden + c];
        }
        out[idx] = sum;
    }
}

/// Device-to-device copy, one vector per thread (the grid covers the buffer exactly): the bandwidth ceiling
/// measured beside the kernels.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn copy_kernel<N: Size>(input: &Array<Vector<f32, N>>, output: &mut Array<Vector<f32, N>>) {
    output[ABSOLUTE_POS] = input[ABSOLUTE_POS];
}
