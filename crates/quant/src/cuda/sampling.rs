//! Greedy picks on the device: the argmax of each logits row in one launch, so that a greedy decode step reads back
//! one token id a sequence instead of its whole logits row (Kimi-K2's vocabulary: 163840 f32, 640 KiB a row; 84 MB a
//! step at 128 sequences, over PCIe). The semantics are eyrie-model's host `sampling::argmax`, which
//! [`argmax_reference`] repeats: the index of the largest value, ties to the lowest index, NaN skipped, index 0 when
//! no value exceeds `-inf` (all `-inf` or NaN).
//!
//! One block of [`ARGMAX_THREADS`] threads a row: thread `t` reads 16-byte vectors `t, t + 1024, ...` four at a time
//! (four loads in flight before any compare), keeps its best (value, index) with a strict `>` (its indices rise, so
//! ties keep the lowest), then a warp's 32 bests merge by xor shuffles and the 32 warps' through shared memory.
//! An index sentinel (`2^31 - 1`) marks "nothing yet" so that no `-inf` literal is needed: a value is taken first
//! when it is `>= f32::MIN` (finite or `+inf`), then only when greater.
//!
//! The CPU reference is always built and tested in CI; the GPU check against it is eyrie-model's `gpu_ops`.

/// Threads of one argmax block (one row).
pub const ARGMAX_THREADS: usize = 1024;

/// The host's greedy pick over one logits row (eyrie-model's `sampling::argmax`): the index of the largest value,
/// ties to the lowest index, NaN skipped, 0 when no value exceeds `-inf`.
pub fn argmax_reference(row: &[f32]) -> u32 {
    row.iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) })
        .0 as u32
}

/// The kernel's rule on the CPU, thread by thread and merge by merge (what [`gpu::argmax_rows_kernel`] computes):
/// for checking the rule itself against [`argmax_reference`] without a GPU.
pub fn argmax_as_the_kernel(row: &[f32]) -> u32 {
    const SENT: u32 = i32::MAX as u32;
    let take_first = |v: f32| v >= f32::MIN;
    let merge = |(bv, bi): (f32, u32), (ov, oi): (f32, u32)| {
        if oi != SENT && (bi == SENT || ov > bv || (ov == bv && oi < bi)) { (ov, oi) } else { (bv, bi) }
    };
    let vecs = row.len() / 4;
    let mut best = vec![(f32::MIN, SENT); ARGMAX_THREADS];
    for (t, b) in best.iter_mut().enumerate() {
        let mut v4 = t;
        while v4 < vecs {
            for e in 0..4 {
                let (i, v) = (4 * v4 + e, row[4 * v4 + e]);
                if (b.1 == SENT && take_first(v)) || (b.1 != SENT && v > b.0) {
                    *b = (v, i as u32);
                }
            }
            v4 += ARGMAX_THREADS;
        }
    }
    // Warps: xor butterflies; then warp 0 over the warps' bests.
    let mut warps = Vec::with_capacity(ARGMAX_THREADS / 32);
    for w in best.chunks(32) {
        let mut lanes = w.to_vec();
        for off in [16, 8, 4, 2, 1] {
            let prev = lanes.clone();
            for (l, lane) in lanes.iter_mut().enumerate() {
                *lane = merge(prev[l], prev[l ^ off]);
            }
        }
        warps.push(lanes[0]);
    }
    let mut lanes = warps;
    for off in [16, 8, 4, 2, 1] {
        let prev = lanes.clone();
        for (l, lane) in lanes.iter_mut().enumerate() {
            *lane = merge(prev[l], prev[l ^ off]);
        }
    }
    if lanes[0].1 == SENT { 0 } else { lanes[0].1 }
}

#[cfg(feature = "cuda")]
pub use gpu::{argmax_rows, argmax_rows_kernel};

#[cfg(feature = "cuda")]
mod gpu {
    use burn::cubecl;
    use cubecl::prelude::*;
    use cubecl::server::Handle;

    use super::ARGMAX_THREADS;

    /// Merges another (value, index) into a best (module docs): taken when it holds something and the best holds
    /// nothing, or is greater, or equal at a lower index.
    #[cube]
    fn merge(bv: &mut f32, bi: &mut u32, ov: f32, oi: u32) {
        let sent = u32::new(2_147_483_647);
        if oi != sent && (*bi == sent || ov > *bv || (ov == *bv && oi < *bi)) {
            *bv = ov;
            *bi = oi;
        }
    }

    /// The warp's best of its lanes' (xor butterflies over 16, 8, 4, 2, 1 lanes: every lane ends with it).
    #[cube]
    fn warp_best(bv: &mut f32, bi: &mut u32) {
        let ov = plane_shuffle_xor(*bv, 16u32);
        let oi = plane_shuffle_xor(*bi, 16u32);
        merge(bv, bi, ov, oi);
        let ov = plane_shuffle_xor(*bv, 8u32);
        let oi = plane_shuffle_xor(*bi, 8u32);
        merge(bv, bi, ov, oi);
        let ov = plane_shuffle_xor(*bv, 4u32);
        let oi = plane_shuffle_xor(*bi, 4u32);
        merge(bv, bi, ov, oi);
        let ov = plane_shuffle_xor(*bv, 2u32);
        let oi = plane_shuffle_xor(*bi, 2u32);
        merge(bv, bi, ov, oi);
        let ov = plane_shuffle_xor(*bv, 1u32);
        let oi = plane_shuffle_xor(*bi, 1u32);
        merge(bv, bi, ov, oi);
    }

    /// `out[row]` = the argmax of row `CUBE_POS_X` of `logits` `[rows, 4 vecs]` (module docs); 1024 threads.
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::manual_div_ceil)]
    pub fn argmax_rows_kernel<N: Size>(logits: &Array<Vector<f32, N>>, out: &mut Array<u32>, vecs: u32) {
        let row = CUBE_POS_X as usize;
        let tid = UNIT_POS as usize;
        let lane = tid % 32;
        let warp = tid / 32;
        let vecs = vecs as usize;
        let sent = u32::new(2_147_483_647);
        let lowest = f32::new(-3.402_823_5e38);
        let mut bv = f32::new(-3.402_823_5e38);
        let mut bi = u32::new(2_147_483_647);
        let threads = comptime!(ARGMAX_THREADS);
        let per_pass = comptime!(4 * ARGMAX_THREADS);
        for pass in 0..(vecs + per_pass - 1) / per_pass {
            let mut got = Array::<Vector<f32, N>>::new(4usize);
            #[unroll]
            for u in 0..4usize {
                let v4 = (pass * 4 + u) * threads + tid;
                if v4 < vecs {
                    got[u] = logits[row * vecs + v4];
                }
            }
            #[unroll]
            for u in 0..4usize {
                let v4 = (pass * 4 + u) * threads + tid;
                if v4 < vecs {
                    let g = got[u];
                    #[unroll]
                    for e in 0..4usize {
                        let v = g[e];
                        if (bi == sent && v >= lowest) || (bi != sent && v > bv) {
                            bv = v;
                            bi = (4 * v4 + e) as u32;
                        }
                    }
                }
            }
        }
        warp_best(&mut bv, &mut bi);
        let mut sv = SharedMemory::<f32>::new(comptime!(ARGMAX_THREADS / 32));
        let mut si = SharedMemory::<u32>::new(comptime!(ARGMAX_THREADS / 32));
        if lane == 0 {
            sv[warp] = bv;
            si[warp] = bi;
        }
        sync_cube();
        if warp == 0 {
            bv = sv[lane];
            bi = si[lane];
            warp_best(&mut bv, &mut bi);
            if lane == 0 {
                if bi == sent {
                    bi = u32::new(0);
                }
                out[row] = bi;
            }
        }
    }

    /// `out` `[rows]` u32 = the argmax of each row of `logits` `[rows, vocab]` f32 (module docs), one launch.
    ///
    /// # Errors
    /// A message naming the parameter when a size does not fit (`vocab` must be a multiple of 4; nothing is
    /// launched then).
    pub fn argmax_rows<R: Runtime>(
        client: &ComputeClient<R>,
        logits: &Handle,
        rows: usize,
        vocab: usize,
        out: &Handle,
    ) -> Result<(), String> {
        if rows == 0 || vocab == 0 || !vocab.is_multiple_of(4) || rows > u32::MAX as usize {
            return Err(format!("argmax_rows: rows {rows}, vocab {vocab}: need rows >= 1 and vocab a multiple of 4"));
        }
        if vocab >= i32::MAX as usize {
            return Err(format!(
                "argmax_rows: vocab {vocab}: at most 2^31 - 2 (the kernel's index sentinel is 2^31 - 1)"
            ));
        }
        for (name, h, bytes) in [("logits", logits, rows * vocab * 4), ("out", out, rows * 4)] {
            if (h.size_in_used() as usize) < bytes {
                return Err(format!("argmax_rows: {name} holds {} bytes, needs {bytes}", h.size_in_used()));
            }
        }
        // SAFETY: sizes checked above; block `row < rows` reads vectors `< vocab / 4` of its row and writes
        // `out[row]`.
        unsafe {
            argmax_rows_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(rows as u32, 1, 1),
                CubeDim::new_1d(ARGMAX_THREADS as u32),
                AddressType::from_len(rows * vocab),
                4,
                ArrayArg::from_raw_parts(logits.clone(), rows * vocab / 4),
                ArrayArg::from_raw_parts(out.clone(), rows),
                (vocab / 4) as u32,
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::SplitMix64;

    /// The kernel's rule (simulated) picks what the host picks: random rows of several lengths, ties spread over
    /// threads and warps, NaN and infinities, all `-inf`, all NaN, a single `f32::MIN`.
    #[test]
    fn the_kernels_rule_is_the_hosts_argmax() {
        let mut rng = SplitMix64::new(5);
        let mut rows: Vec<Vec<f32>> = Vec::new();
        for len in [4usize, 8, 1024, 4096 + 12, 163_840] {
            rows.push((0..len).map(|_| rng.next_f32() * 10.0 - 5.0).collect());
        }
        // Ties of the maximum in different threads and warps (the lowest index must win).
        let mut tie = vec![0.0f32; 16_384];
        for i in [9_000usize, 70, 5_000, 16_383] {
            tie[i] = 3.0;
        }
        rows.push(tie);
        let mut nan = vec![f32::NAN; 2048];
        nan[1500] = -7.0;
        nan[3] = -9.0;
        rows.push(nan);
        rows.push(vec![f32::NAN; 64]);
        rows.push(vec![f32::NEG_INFINITY; 64]);
        let mut inf = vec![1.0f32; 4096];
        inf[2049] = f32::INFINITY;
        inf[4095] = f32::INFINITY;
        rows.push(inf);
        let mut min = vec![f32::NEG_INFINITY; 256];
        min[200] = f32::MIN;
        rows.push(min);
        for (k, row) in rows.iter().enumerate() {
            assert_eq!(argmax_as_the_kernel(row), argmax_reference(row), "row {k} of {}", row.len());
        }
        assert_eq!(argmax_reference(&rows[5]), 70);
        assert_eq!(argmax_reference(&rows[6]), 1500);
        assert_eq!(argmax_reference(&rows[7]), 0);
        assert_eq!(argmax_reference(&rows[9]), 2049);
        assert_eq!(argmax_reference(&rows[10]), 200);
    }
}
