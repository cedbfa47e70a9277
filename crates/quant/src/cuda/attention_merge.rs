//! The merge of an MLA attention's slices (flash decoding: a row's positions split over blocks, each leaving its
//! normalized output and `(max, sum)`): [`merge_slices`], the merge of one (row, head) by a block's first 128 threads,
//! run by the combine launch [`mla_combine_kernel`] (one block a (row, head), [`merge_parts`] launches it) and, at
//! one token a block, by `mla::mla_output_kernel` itself (`merge`). What an unmerged attention leaves is
//! [`AttentionParts`] (`attention::mla_attention_parts`). The CPU reference of the merge is the attention's
//! (`attention::mla_attention_reference` merges nothing: it is the unsplit attention the merge must equal).

use burn::cubecl;
use cubecl::prelude::*;
use cubecl::server::Handle;

/// Merges the slices of each (row, head): weights `l_s exp(m_s - max m)` over the slices' normalized outputs.
/// One block of `128 * halves` threads per (row, head) ([`combine_halves`]), thread `i < 128` owning 4-float vectors
/// `i, i + 128, ...` of the output ([`merge_slices`], which `mla::mla_output_kernel` also runs in place of this
/// launch).
#[cube(launch_unchecked, address_type = "dynamic")]
pub fn mla_combine_kernel<N: Size>(
    o_part: &Array<Vector<f32, N>>,
    ml_part: &Array<f32>,
    out: &mut Array<Vector<f32, N>>,
    pairs: u32,
    splits: u32,
    #[comptime] r: usize,
    #[comptime] halves: usize,
    #[comptime] one_pass: bool,
) {
    let rh = CUBE_POS_X as usize;
    let tid = UNIT_POS as usize;
    let rv = comptime!(r / 4);
    let mut acc = Array::<f32>::new(comptime!(4 * (r / 4).div_ceil(128)));
    if comptime!(one_pass) {
        merge_slices_one_pass::<N>(o_part, ml_part, &mut acc, pairs as usize, splits as usize, rh, tid, r, halves);
    } else {
        merge_slices::<N>(o_part, ml_part, &mut acc, pairs as usize, splits as usize, rh, tid, r, halves);
    }
    #[unroll]
    for it in 0..comptime!((r / 4).div_ceil(128)) {
        let c4 = it * 128 + tid;
        if tid < 128 && c4 < rv {
            let mut o = Vector::<f32, N>::empty();
            #[unroll]
            for e in 0..4usize {
                o[e] = acc[4 * it + e];
            }
            out[rh * rv + c4] = o;
        }
    }
}

/// [`merge_slices`] in one round of loads (the combine launch's unless `EYRIE_COMBINE_ONE_PASS=0`; the same
/// contract and result up to rounding): the merge of (row, head) `rh`'s slices by the block's first `128 * halves` threads
/// (the others, if any, only take part in its barriers; every thread of the block must call it): into `acc` (`4 *
/// ceil(r / 512)` floats) of the first 128 threads, thread `tid`'s 4-float vectors `tid, tid + 128, ...` of `sum_s
/// w_s o_s / sum_s w_s`, `w_s = l_s exp(m_s - max m)` over the slices' normalized outputs `o_part` `[splits, pairs,
/// r]` and their `(m, l)` in `ml_part`. Thread `tid` takes every `halves`-th slice (from `half = tid / 128`), 8 at a time: the 8 slices'
/// `(m, l)` and output vectors are loaded together (16-byte loads, all in flight at once: at 32 slices and
/// `halves` 4, one round of loads for the whole merge), and merged online against the thread's running maximum
/// (the sums rescaled by `exp(m_old - m_new)` when it grows); the halves' `(max, sum, vectors)` then meet through
/// shared memory, rescaled to the block's maximum, in order of `half`. A slice with `l = 0` (no positions) weighs
/// 0 (its output is written as zeros by the attention kernel). Every thread of a half runs the same slices, so
/// its maximum and sum are the half's. With `halves` 1 there is no barrier; else two, the last after every read of
/// shared memory, so calls may follow one another in a loop.
#[cube]
#[allow(clippy::manual_div_ceil, clippy::too_many_arguments)]
pub fn merge_slices_one_pass<N: Size>(
    o_part: &Array<Vector<f32, N>>,
    ml_part: &Array<f32>,
    acc: &mut Array<f32>,
    pairs: usize,
    splits: usize,
    rh: usize,
    tid: usize,
    #[comptime] r: usize,
    #[comptime] halves: usize,
) {
    let width = comptime!(128 * halves);
    let active = tid < width;
    let c = tid % 128;
    let half = tid / 128;
    let rv = comptime!(r / 4);
    let nv = comptime!((r / 4).div_ceil(128));
    let na = comptime!(4 * (r / 4).div_ceil(128));

    #[unroll]
    for a in 0..na {
        acc[a] = f32::new(0.0);
    }
    let mut m_run = f32::new(-1.0e30);
    let mut den = f32::new(0.0);
    let mut mine = 0usize;
    if active && half < splits {
        mine = (splits - half + halves - 1) / halves;
    }
    for j8 in 0..(mine + 7) / 8 {
        let mut ms = Array::<f32>::new(8usize);
        let mut ls = Array::<f32>::new(8usize);
        let mut v = Array::<Vector<f32, N>>::new(comptime!(8 * (r / 4).div_ceil(128)));
        #[unroll]
        for u in 0..8usize {
            let k = j8 * 8 + u;
            ms[u] = f32::new(-1.0e30);
            ls[u] = f32::new(0.0);
            if k < mine {
                let sp = half + halves * k;
                ms[u] = ml_part[(sp * pairs + rh) * 2];
                ls[u] = ml_part[(sp * pairs + rh) * 2 + 1];
                #[unroll]
                for it in 0..nv {
                    let c4 = it * 128 + c;
                    if c4 < rv {
                        v[u * nv + it] = o_part[(sp * pairs + rh) * rv + c4];
                    }
                }
            }
        }
        let mut mc = m_run;
        #[unroll]
        for u in 0..8usize {
            if ls[u] > f32::new(0.0) {
                mc = f32::max(mc, ms[u]);
            }
        }
        let scale = (m_run - mc).exp();
        m_run = mc;
        den *= scale;
        #[unroll]
        for a in 0..na {
            acc[a] *= scale;
        }
        #[unroll]
        for u in 0..8usize {
            if ls[u] > f32::new(0.0) {
                let wj = ls[u] * (ms[u] - mc).exp();
                den += wj;
                #[unroll]
                for it in 0..nv {
                    #[unroll]
                    for e in 0..4usize {
                        acc[4 * it + e] += wj * v[u * nv + it][e];
                    }
                }
            }
        }
    }
    if comptime!(halves > 1) {
        // The halves' maxima, sums and vectors into the first's, rescaled to the largest maximum, in order.
        let mut hm = SharedMemory::<f32>::new(comptime!(2 * halves));
        let mut rest = SharedMemory::<f32>::new(comptime!((halves - 1) * 4 * (r / 4).div_ceil(128) * 128));
        if active && c == 0 {
            hm[2 * half] = m_run;
            hm[2 * half + 1] = den;
        }
        if active && half > 0 {
            #[unroll]
            for a in 0..na {
                rest[((half - 1) * na + a) * 128 + c] = acc[a];
            }
        }
        sync_cube();
        if half == 0 {
            let mut mx = hm[0];
            #[unroll]
            for h in 1..halves {
                mx = f32::max(mx, hm[2 * h]);
            }
            let s0 = (hm[0] - mx).exp();
            den *= s0;
            #[unroll]
            for a in 0..na {
                acc[a] *= s0;
            }
            #[unroll]
            for h in 1..halves {
                let sh = (hm[2 * h] - mx).exp();
                den += sh * hm[2 * h + 1];
                #[unroll]
                for a in 0..na {
                    acc[a] += sh * rest[((h - 1) * na + a) * 128 + c];
                }
            }
        }
        // So that a caller's next merge (a loop over tokens) cannot write `hm` / `rest` before these reads.
        sync_cube();
    }
    let mut inv = f32::new(0.0);
    if den > f32::new(0.0) {
        inv = f32::new(1.0) / den;
    }
    #[unroll]
    for a in 0..na {
        acc[a] *= inv;
    }
}

/// The merge of (row, head) `rh`'s slices by the block's first `128 * halves` threads (the others, if any, only
/// take part in its barriers; every thread of the block must call it): into `acc` (`4 * ceil(r / 512)` floats) of
/// the first 128 threads, thread `tid`'s 4-float vectors `tid, tid + 128, ...` of `sum_s w_s o_s / sum_s w_s`, `w_s
/// = l_s exp(m_s - max m)` over the slices' normalized outputs `o_part` `[splits, pairs, r]` and their `(m, l)` in
/// `ml_part`. The maximum is a block reduction; then, `128 * halves` slices at a time, each thread computes one
/// slice's weight into shared memory and thread `tid` adds every `halves`-th slice of them (from `tid / 128`) to
/// its vectors, 8 at a time (8 independent 16-byte loads in flight: one load after another, as a loop of dependent
/// adds, made the merge ~42 us at 33 slices, one row of Kimi's 64 heads: more than the attention it merges); with
/// `halves` 2 each thread's chain of loads is half as long, and the second half's sums are added to the first's
/// through shared memory at the end. A slice with `l = 0` (no positions) weighs 0 (its output is written as zeros
/// by the attention kernel).
#[cube]
#[allow(clippy::manual_div_ceil, clippy::too_many_arguments)]
pub fn merge_slices<N: Size>(
    o_part: &Array<Vector<f32, N>>,
    ml_part: &Array<f32>,
    acc: &mut Array<f32>,
    pairs: usize,
    splits: usize,
    rh: usize,
    tid: usize,
    #[comptime] r: usize,
    #[comptime] halves: usize,
) {
    let width = comptime!(128 * halves);
    let active = tid < width;
    let c = tid % 128;
    let half = tid / 128;
    let rv = comptime!(r / 4);
    let nv = comptime!((r / 4).div_ceil(128));

    let mut mx = f32::new(-1.0e30);
    for i in 0..(splits + width - 1) / width {
        let sp = i * width + tid;
        if active && sp < splits && ml_part[(sp * pairs + rh) * 2 + 1] > f32::new(0.0) {
            mx = f32::max(mx, ml_part[(sp * pairs + rh) * 2]);
        }
    }
    mx = plane_max(mx);
    let mut red = SharedMemory::<f32>::new(comptime!(4 * halves));
    if active && tid.is_multiple_of(32) {
        red[tid / 32] = mx;
    }
    sync_cube();
    mx = red[0];
    #[unroll]
    for w in 1..comptime!(4 * halves) {
        mx = f32::max(mx, red[w]);
    }

    let mut wts = SharedMemory::<f32>::new(comptime!(128 * halves));
    #[unroll]
    for a in 0..comptime!(4 * (r / 4).div_ceil(128)) {
        acc[a] = f32::new(0.0);
    }
    let mut den = f32::new(0.0);
    for chunk in 0..(splits + width - 1) / width {
        let sp = chunk * width + tid;
        let mut wgt = f32::new(0.0);
        if active && sp < splits {
            let l = ml_part[(sp * pairs + rh) * 2 + 1];
            if l > f32::new(0.0) {
                wgt = l * (ml_part[(sp * pairs + rh) * 2] - mx).exp();
            }
        }
        // The previous chunk's readers are done with `wts`.
        sync_cube();
        if active {
            wts[tid] = wgt;
        }
        sync_cube();
        let mut here = splits - chunk * width;
        if here > width {
            here = width;
        }
        // This thread's slices of the chunk: `half, half + halves, ..` below `here`.
        let mine = (here + halves - 1 - half) / halves;
        for j8 in 0..(mine + 7) / 8 {
            #[unroll]
            for it in 0..nv {
                let c4 = it * 128 + c;
                if active && c4 < rv {
                    let mut v = Array::<Vector<f32, N>>::new(8usize);
                    #[unroll]
                    for u in 0..8usize {
                        let k = j8 * 8 + u;
                        if k < mine {
                            v[u] = o_part[((chunk * width + half + halves * k) * pairs + rh) * rv + c4];
                        }
                    }
                    #[unroll]
                    for u in 0..8usize {
                        let k = j8 * 8 + u;
                        if k < mine {
                            let wj = wts[half + halves * k];
                            #[unroll]
                            for e in 0..4usize {
                                acc[4 * it + e] += wj * v[u][e];
                            }
                        }
                    }
                }
            }
        }
        for j8 in 0..(here + 7) / 8 {
            #[unroll]
            for u in 0..8usize {
                let j = j8 * 8 + u;
                if j < here {
                    den += wts[j];
                }
            }
        }
    }
    if comptime!(halves > 1) {
        // The other halves' sums into the first's, in order.
        let mut rest = SharedMemory::<f32>::new(comptime!((halves - 1) * 4 * (r / 4).div_ceil(128) * 128));
        if active && half > 0 {
            #[unroll]
            for a in 0..comptime!(4 * (r / 4).div_ceil(128)) {
                rest[((half - 1) * comptime!(4 * (r / 4).div_ceil(128)) + a) * 128 + c] = acc[a];
            }
        }
        sync_cube();
        if half == 0 {
            #[unroll]
            for h in 1..halves {
                #[unroll]
                for a in 0..comptime!(4 * (r / 4).div_ceil(128)) {
                    acc[a] += rest[((h - 1) * comptime!(4 * (r / 4).div_ceil(128)) + a) * 128 + c];
                }
            }
        }
    }
    let mut inv = f32::new(0.0);
    if den > f32::new(0.0) {
        inv = f32::new(1.0) / den;
    }
    #[unroll]
    for a in 0..comptime!(4 * (r / 4).div_ceil(128)) {
        acc[a] *= inv;
    }
}

/// The combine launch of [`mla_attention`](super::attention::mla_attention): `out` `[pairs, r]` = the merge of
/// `parts` (from [`mla_attention_parts`](super::attention::mla_attention_parts) over `pairs` = rows x heads, which
/// checked `out`'s size); nothing when `parts` has one slice (the attention wrote `out` itself).
pub fn merge_parts<R: Runtime>(
    client: &ComputeClient<R>,
    parts: &AttentionParts,
    pairs: usize,
    r: usize,
    out: &Handle,
) {
    if parts.splits > 1 {
        let o_len = parts.splits * pairs * r;
        let halves = combine_halves(parts.splits);
        // SAFETY: `mla_attention_parts` reserved `o` as `[splits, pairs, r]` and `ml` as `[splits, pairs, 2]`;
        // `out` holds `[pairs, r]` (checked there); block `rh < pairs` writes row `rh` of `out`.
        unsafe {
            mla_combine_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(pairs as u32, 1, 1),
                CubeDim::new_1d((128 * halves) as u32),
                AddressType::from_len(o_len),
                4,
                ArrayArg::from_raw_parts(parts.o.clone(), o_len / 4),
                ArrayArg::from_raw_parts(parts.ml.clone(), parts.splits * pairs * 2),
                ArrayArg::from_raw_parts(out.clone(), pairs * r / 4),
                pairs as u32,
                parts.splits as u32,
                r,
                halves,
                combine_one_pass(),
            );
        }
    }
}

/// Whether the combine launch runs [`merge_slices_one_pass`] instead of [`merge_slices`]: on unless
/// `EYRIE_COMBINE_ONE_PASS=0` (read once; same-binary timing). Session 33 on an H100: every `gpu_attention --quick`
/// check ok, 8 heads at 8 x 8k 68.0-68.2 -> 66.5-66.8 us, at 8 x 1k 18.3-18.5 -> 16.9 (bench/REPORT.md).
fn combine_one_pass() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    super::attention::env_switch(&ON, "EYRIE_COMBINE_ONE_PASS")
}

/// The combine launch's threads a (row, head), in 128s: 4 above 8 slices (each thread's chain of loads a quarter
/// as long: 32 slices in one round of 8 loads in flight instead of four), else 1. `EYRIE_COMBINE_HALVES` (1, 2, 4
/// or 8, read once) replaces the 4, for same-binary timing.
pub fn combine_halves(splits: usize) -> usize {
    static OVERRIDE: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let many = OVERRIDE.get_or_init(|| {
        std::env::var("EYRIE_COMBINE_HALVES").ok().and_then(|v| v.parse().ok()).filter(|h| [1, 2, 4, 8].contains(h))
    });
    if splits > 8 { many.unwrap_or(4) } else { 1 }
}

/// What [`mla_attention_parts`](super::attention::mla_attention_parts) leaves: with one slice (`splits` 1) the
/// attention itself in `o` (the caller's `out`), else each slice's normalized output `o` `[splits, rows x heads, r]`
/// and its `(max, sum)` `ml` `[splits, rows x heads, 2]`, to be merged ([`mla_combine_kernel`], or
/// `mla::mla_output_kernel` with `merge`).
#[derive(Debug, Clone)]
pub struct AttentionParts {
    /// The output (one slice) or the slices' outputs.
    pub o: Handle,
    /// The slices' running maxima and sums.
    pub ml: Handle,
    /// Slices of each row.
    pub splits: usize,
}
