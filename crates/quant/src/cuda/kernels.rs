//! CubeCL kernels of the fused INT4 MoE (W4A16: INT4 weights, BF16 activations, f32 accumulation).
//!
//! # Dequantization: the checkpoint's BF16 weights, two at a time
//!
//! compressed-tensors decompresses a pack-quantized weight to `bf16((u - 8) * scale)`: the exact product, rounded
//! once to BF16 (round to nearest, ties to even). That rounded value is the model's weight (HF transformers and
//! vLLM's Marlin kernels compute with it), so the kernels compute with exactly it, never with the unrounded
//! product. They build it with packed BF16 arithmetic, two weights per instruction and no integer-to-float
//! conversion: for nibbles `p` and `p + 4` of a word, `((word >> 4p) & 0x000F_000F) | 0x4300_4300` is the BF16
//! pair `(128 + u_p, 128 + u_(p+4))` exactly; subtracting the pair `(136, 136)` leaves `(q_p, q_(p+4))` exactly,
//! and one packed multiply by `(scale, scale)` rounds each product to BF16 as the library does. Each weight is
//! then widened to f32 (exact) and multiplied by the f32 activation into an f32 accumulator.
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

/// The BF16 pair `(128, 128)`: OR-ed over a word's nibble pair it makes `(128 + u_p, 128 + u_(p+4))` exactly
/// ([`weight_pair`]).
pub const WEIGHT_BIAS: u32 = 0x4300_4300;

/// The checkpoint's weights `bf16(q * scale)` of nibbles `p` and `p + 4` of `word` (columns `p` and `p + 4` of
/// its 8), as a packed BF16 pair: `(128 + u) - 136 = q` exactly, then one rounding multiply (module docs). `bias`
/// is [`WEIGHT_BIAS`]; a kernel that passes it in as an argument rather than a literal saves an instruction a pair:
/// with two immediates (the mask and the bias) ptxas emits two `LOP3`s, with the bias in a register one
/// (`(x & mask) | bias`, checked in the SASS of the tensor-core kernel; bench/REPORT.md, session 17).
#[cube]
pub(super) fn weight_pair(
    word: u32,
    bias: u32,
    scale: Vector<bf16, Const<2>>,
    #[comptime] p: u32,
) -> Vector<bf16, Const<2>> {
    let bits = ((word >> u32::new(comptime!(4 * p as i64))) & u32::new(0x000F_000F)) | bias;
    let biased = Vector::<bf16, Const<2>>::reinterpret(bits);
    let mut offset = Vector::<bf16, Const<2>>::empty();
    offset[0] = bf16::new(136.0);
    offset[1] = bf16::new(136.0);
    (biased - offset) * scale
}

/// A BF16 scale as the packed pair a weight pair is multiplied by.
#[cube]
pub(super) fn scale_pair(s: bf16) -> Vector<bf16, Const<2>> {
    let mut s2 = Vector::<bf16, Const<2>>::empty();
    s2[0] = s;
    s2[1] = s;
    s2
}

/// [`super::experts::tiled_vector`] on the device: the 16-byte vector `v` of row `row` (of all experts' rows) in
/// the tiled layout of a `k`-wide matrix.
#[cube]
pub(super) fn tiled_vector(row: usize, v: usize, #[comptime] k: usize) -> usize {
    let nblk = comptime!(k / 128);
    ((row / 16 * nblk + v / 4) * 2 + (row % 16) / 8) * 32 + (row % 8) * 4 + v % 4
}

/// [`super::experts::tiled_scale`] on the device: the scale of group `gi` of row `row` (`ng` groups a row).
#[cube]
pub(super) fn tiled_scale(row: usize, gi: usize, #[comptime] ng: usize) -> usize {
    (row / 16 * ng + gi) * 16 + row % 16
}

/// Loads this lane's share of `nr` rows (`row0 + q * stride`): 16-byte weight vectors `lane + 32 i` and their
/// scales; vectors past the row's end read as zero words with scale 0.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_rows<N: Size>(
    words: &Array<Vector<u32, N>>,
    scales: &Array<bf16>,
    wv: &mut Array<Vector<u32, N>>,
    sc: &mut Array<Vector<bf16, Const<2>>>,
    row0: usize,
    lane: usize,
    #[comptime] k: usize,
    #[comptime] group: usize,
    #[comptime] stride: usize,
    #[comptime] nr: usize,
    #[comptime] tiled: bool,
) {
    let kv = comptime!(k / 32);
    let per_lane = comptime!(k.div_ceil(1024));
    let ng = comptime!(k / group);
    #[unroll]
    for q in 0..nr {
        let row = row0 + q * stride;
        #[unroll]
        for i in 0..per_lane {
            let v = lane + 32 * i;
            if v < kv {
                if tiled {
                    wv[q * per_lane + i] = words[tiled_vector(row, v, k)];
                    sc[q * per_lane + i] = scale_pair(scales[tiled_scale(row, v * 32 / group, ng)]);
                } else {
                    wv[q * per_lane + i] = words[row * kv + v];
                    sc[q * per_lane + i] = scale_pair(scales[row * ng + v * 32 / group]);
                }
            } else {
                let mut z = Vector::<u32, N>::empty();
                z[0] = u32::new(0);
                z[1] = u32::new(0);
                z[2] = u32::new(0);
                z[3] = u32::new(0);
                wv[q * per_lane + i] = z;
                // (CubeCL emits a reinterpret of a literal as a cast of an rvalue, which nvcc refuses.)
                let mut s2 = Vector::<bf16, Const<2>>::empty();
                s2[0] = bf16::new(0.0);
                s2[1] = bf16::new(0.0);
                sc[q * per_lane + i] = s2;
            }
        }
    }
}

/// Rows of one expert's INT4 matrix times the activations of the tokens routed to it.
///
/// - `act`: `[*, k]` activations; row `pair / topk` (`by_token`, the layer input) or `pair` (the intermediate).
/// - `words`: `[E, rows, k/32]` 16-byte vectors (`N` = 4 words); `scales`: `[E, rows, k/group]` BF16.
/// - `experts`, `offsets`, `pairs`: the grouping of [`super::Routing`].
/// - `out`: `gated`: `[pairs, rows/2]`, `silu(row j) * row (j + rows/2)`; else `[pairs, rows]`.
/// - `bounds`: `[4]` slot bounds of the expert classes on the device (slots `bounds[class]..bounds[class + 1]` of
///   `experts` hold this launch's experts; written by the host grouping or by the device router): grid row `y`
///   runs slots `bounds[class] + y`, `+ grid_y`, ... so any grid height is correct, and rows past the class's
///   experts exit at once.
///
/// Each warp computes rows `j + q * rows / rows_at_once`, `q < rows_at_once` (`gated`: 2, gate and up of unit `j`).
#[cube(launch_unchecked, address_type = "dynamic")]
// Kernel code is CubeCL, not Rust: `div_ceil` and `a && b` of a comptime and a runtime value are not expanded the
// same way, and 2^-12 is written out as the exact constant it is.
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil, clippy::collapsible_if, clippy::excessive_precision)]
pub fn expert_rows_kernel<F: Float, N: Size>(
    act: &Array<F>,
    words: &Array<Vector<u32, N>>,
    scales: &Array<bf16>,
    experts: &Array<u32>,
    offsets: &Array<u32>,
    pairs: &Array<u32>,
    out: &mut Array<f32>,
    bounds: &Array<u32>,
    class: u32,
    #[comptime] k: usize,
    #[comptime] rows: usize,
    #[comptime] rows_at_once: usize,
    #[comptime] group: usize,
    #[comptime] topk: usize,
    #[comptime] tb: usize,
    #[comptime] rows_per_warp: usize,
    #[comptime] warps: usize,
    #[comptime] gated: bool,
    #[comptime] by_token: bool,
    #[comptime] prefetch: bool,
    #[comptime] tiled: bool,
) {
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let tid = UNIT_POS as usize;

    // 16-byte weight vectors per row, per lane, 4-wide activation vectors per row, padded row length.
    let kv = comptime!(k / 32);
    let per_lane = comptime!(k.div_ceil(1024));
    let k4 = comptime!(k / 4);
    let kpad = comptime!(k / 4 + k / 32);
    let stride = comptime!(rows / rows_at_once);
    let nr = comptime!(rows_at_once);
    let threads = comptime!(32 * warps);
    let fill_iters = comptime!((tb * k / 4).div_ceil(32 * warps));

    let mut xs = SharedMemory::<Vector<f32, N>>::new(comptime!(tb * (k / 4 + k / 32)));

    let mut wv = Array::<Vector<u32, N>>::new(comptime!(rows_at_once * k.div_ceil(1024)));
    let mut sc = Array::<Vector<bf16, Const<2>>>::new(comptime!(rows_at_once * k.div_ceil(1024)));
    let j_first = (CUBE_POS_X as usize * warps + warp) * rows_per_warp;

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
            if prefetch {
                if j_first < stride {
                    // The first rows' weights do not depend on the activations: start their loads now, so their
                    // latency overlaps the staging below.
                    load_rows::<N>(
                        words,
                        scales,
                        &mut wv,
                        &mut sc,
                        e * rows + j_first,
                        lane,
                        k,
                        group,
                        stride,
                        nr,
                        tiled,
                    );
                }
            }

            // Activations of this chunk's tokens, f32; zero for missing tokens.
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
                        v[1] = f32::cast_from(act[base + 1]);
                        v[2] = f32::cast_from(act[base + 2]);
                        v[3] = f32::cast_from(act[base + 3]);
                    }
                    xs[t * kpad + c4 + c4 / 8] = v;
                }
            }
            sync_cube();

            for r in 0..rows_per_warp {
                let j = (CUBE_POS_X as usize * warps + warp) * rows_per_warp + r;
                if j < stride {
                    let row0 = e * rows + j;
                    // All of this lane's loads first, so they are in flight together: `nr` rows x `per_lane` vectors.
                    // With `prefetch`, the first row group was loaded before the activations were staged.
                    let mut need = true;
                    if prefetch {
                        need = r > 0;
                    }
                    if need {
                        load_rows::<N>(words, scales, &mut wv, &mut sc, row0, lane, k, group, stride, nr, tiled);
                    }

                    let mut acc = Array::<f32>::new(comptime!(rows_at_once * tb));
                    #[unroll]
                    for a in 0..comptime!(rows_at_once * tb) {
                        acc[a] = f32::new(0.0);
                    }

                    #[unroll]
                    for i in 0..per_lane {
                        // Lanes past the row's end read a valid vector; their scale is 0.
                        let mut v = lane + 32 * i;
                        if v >= kv {
                            v = kv - 1;
                        }
                        #[unroll]
                        for w in 0..4usize {
                            // The 8 weights of word w of each row, f32: columns 8w + c, c in 0..8.
                            let mut dq = Array::<f32>::new(comptime!(rows_at_once * 8));
                            #[unroll]
                            for q in 0..nr {
                                let word = wv[q * per_lane + i][w];
                                let s2 = sc[q * per_lane + i];
                                let bias = u32::new(WEIGHT_BIAS as i64);
                                let p0 = weight_pair(word, bias, s2, 0u32);
                                let p1 = weight_pair(word, bias, s2, 1u32);
                                let p2 = weight_pair(word, bias, s2, 2u32);
                                let p3 = weight_pair(word, bias, s2, 3u32);
                                dq[q * 8] = f32::cast_from(p0[0]);
                                dq[q * 8 + 1] = f32::cast_from(p1[0]);
                                dq[q * 8 + 2] = f32::cast_from(p2[0]);
                                dq[q * 8 + 3] = f32::cast_from(p3[0]);
                                dq[q * 8 + 4] = f32::cast_from(p0[1]);
                                dq[q * 8 + 5] = f32::cast_from(p1[1]);
                                dq[q * 8 + 6] = f32::cast_from(p2[1]);
                                dq[q * 8 + 7] = f32::cast_from(p3[1]);
                            }
                            #[unroll]
                            for t in 0..tb {
                                let xi = t * kpad + 9 * v + 2 * w;
                                let x0 = xs[xi];
                                let x1 = xs[xi + 1];
                                #[unroll]
                                for q in 0..nr {
                                    acc[q * tb + t] += dq[q * 8] * x0[0]
                                        + dq[q * 8 + 1] * x0[1]
                                        + dq[q * 8 + 2] * x0[2]
                                        + dq[q * 8 + 3] * x0[3]
                                        + dq[q * 8 + 4] * x1[0]
                                        + dq[q * 8 + 5] * x1[1]
                                        + dq[q * 8 + 6] * x1[2]
                                        + dq[q * 8 + 7] * x1[3];
                                }
                            }
                        }
                    }

                    #[unroll]
                    for t in 0..tb {
                        if gated {
                            let a = plane_sum(acc[t]);
                            let b = plane_sum(acc[tb + t]);
                            if lane == 0 && t < n {
                                let p = pairs[c0 + t] as usize;
                                let ex = (-a).exp();
                                out[p * stride + j] = a / (f32::new(1.0) + ex) * b;
                            }
                        } else {
                            #[unroll]
                            for q in 0..nr {
                                let a = plane_sum(acc[q * tb + t]);
                                if lane == 0 && t < n {
                                    let p = pairs[c0 + t] as usize;
                                    out[p * rows + j + q * stride] = a;
                                }
                            }
                        }
                    }
                }
            }
            sync_cube();
        }
        slot += CUBE_COUNT_Y as usize;
    }
}

/// `out[t, c] = sum_k weights[t, k] * y[t * topk + k, c]` (`y`: `[m * topk, hidden]`, `out`: `[m, hidden]`), plus
/// `addend[t, c]` after the sum when `add` (the shared experts' output: the same f32 sum as adding it afterwards,
/// one launch fewer); `addend` is not read otherwise.
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn combine_kernel(
    y: &Array<f32>,
    weights: &Array<f32>,
    addend: &Array<f32>,
    out: &mut Array<f32>,
    #[comptime] hidden: usize,
    #[comptime] topk: usize,
    #[comptime] add: bool,
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
        if add {
            sum += addend[idx];
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
