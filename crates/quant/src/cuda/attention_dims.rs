//! The MLA decode attention with lanes over the latent's dimensions ("dim lanes"): the same attention, page tables,
//! slices and outputs as [`attention`](super::attention) (whose module docs give the math), another work split.
//!
//! In the key-lane kernel (`attention::gpu::mla_attention_kernel`) a lane scores one key against its warp's heads,
//! so every lane needs every query dimension: each 16-byte query load is a broadcast that feeds 4 FMAs of one key,
//! and a warp of few heads reads the whole latent tile for few FMAs (at 8 heads, a tensor-parallel rank's, the
//! shared-memory pipe saturates long before the FMA pipe: 27% of the bandwidth at 8 rows over 8k, session 17).
//!
//! Here a warp owns `hpw` heads (up to 8) and lane `l` owns the 4-float vectors `l + 32 j` of the latent: of the
//! queries (its dimensions only, read from shared memory for a group of keys at once) and of the values (the same
//! `c_kv` vectors, `r / 128` of them: `hpw * r / 32` accumulators a lane). A group of `32 / hpw` keys is scored as
//! 32 (key, head) partial dot products a lane, which a reduce-scatter over the warp (five shuffle rounds, halving
//! the values each round) leaves as one whole score a lane: lane `l` holds key `l / hpw`, head `l % hpw`. The online
//! softmax runs on those (a head's group maximum by shuffles; the accumulators are rescaled only when some head's
//! maximum grew, by the exact factor, so nothing is approximated), and the weights reach every lane by shuffles for
//! the value accumulation.
//!
//! A block has `wh` head warps (the block's `wh * hpw` heads) times `wk` key warps (each takes its own groups of
//! every stage, with its own running maximum and sum, merged through shared memory at the end). Latents arrive in
//! stages of `wk * sg * 32 / hpw` keys through `cp.async`, two stages in flight (one mbarrier each): the next stage's
//! copies are issued, and its page-table reads made, while the current one is computed. Output: as the key-lane
//! kernel's (`AttentionParts`: the normalized slice output and `(max, sum)` per (slice, row, head)), so the same merge
//! follows. f32 throughout (no TF32, no BF16); the CPU reference is
//! [`mla_attention_reference`](super::attention::mla_attention_reference).
//!
//! Grid `(head groups, slices, rows)`: the head groups of one slice are neighbours in launch order, so the blocks
//! that read the same latents run together (the second and later reads come from L2).

/// Shared memory of one block of [`gpu::mla_attention_dims_kernel`]: the block's queries (`wh * hpw` heads x `d`),
/// two stages of `wk * sg * 32 / hpw` latents (or, if larger and `wk > 1`, the key warps' accumulators for the final
/// merge, `wk * wh * hpw * r` floats, which reuse the stages' space), the key warps' maxima and sums, and two
/// mbarriers (16 bytes each with their alignment).
pub fn dims_shared_bytes(r: usize, rot: usize, wh: usize, wk: usize, hpw: usize, sg: usize) -> usize {
    let d = r + rot;
    let stages = 2 * wk * sg * (32 / hpw.max(1)) * d;
    let merge = if wk > 1 { wk * wh * hpw * r } else { 0 };
    4 * (wh * hpw * d + stages.max(merge) + wk * wh * hpw * 2) + 32
}

/// Heads a warp the dim-lane kernel takes: `32 / hpw` keys a group (a group is 32 (key, head) pairs).
pub const DIM_HEADS_PER_WARP: [usize; 4] = [1, 2, 4, 8];

/// Why the dim-lane kernel cannot run a shape, or `None` when it can: `r` a multiple of 128, `rot` of 4, `hpw` one of
/// [`DIM_HEADS_PER_WARP`], `1 <= sg <= wh * hpw` (every key of a stage has a copying thread), at most 1024
/// threads, and the block's shared memory within `smem`.
#[allow(clippy::too_many_arguments)]
pub fn dims_refusal(r: usize, rot: usize, wh: usize, wk: usize, hpw: usize, sg: usize, smem: usize) -> Option<String> {
    if r == 0 || !r.is_multiple_of(128) || !rot.is_multiple_of(4) {
        return Some(format!("dim lanes need r a multiple of 128 and rot of 4 (r {r}, rot {rot})"));
    }
    if !DIM_HEADS_PER_WARP.contains(&hpw) || wh == 0 || wk == 0 || wh * wk > 32 || sg == 0 || sg > wh * hpw {
        return Some(format!("dim lanes: head warps {wh}, key warps {wk}, heads a warp {hpw}, groups a stage {sg}"));
    }
    let bytes = dims_shared_bytes(r, rot, wh, wk, hpw, sg);
    if bytes > smem {
        return Some(format!("dim lanes: {bytes} bytes of shared memory a block, the device has {smem}"));
    }
    None
}

/// A launch shape of the dim-lane kernel: head warps, key warps, heads a warp, key groups a key warp a stage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DimShape {
    /// Head warps (the block's heads: `wh * hpw`).
    pub wh: usize,
    /// Key warps (over different keys of the same heads).
    pub wk: usize,
    /// Heads a warp.
    pub hpw: usize,
    /// Key groups a key warp a stage.
    pub sg: usize,
}

impl DimShape {
    /// The launch of this shape in `splits` slices of `chunk` positions.
    pub fn config(&self, splits: usize, chunk: usize) -> super::attention::AttentionConfig {
        super::attention::AttentionConfig {
            lanes: super::attention::Lanes::Dims { key_warps: self.wk, groups: self.sg },
            warps: self.wh,
            hpw: self.hpw,
            splits,
            chunk,
        }
    }
}

/// Few heads (at most [`FEW_HEADS`](super::attention::FEW_HEADS): a tensor-parallel rank's) over at least
/// [`WIDE_POSITIONS`] positions: one warp of 8 heads x 4 key warps, 92 KB a block (two a multiprocessor on the H200,
/// one on SM120). 8 heads, 8 rows over 8k: 133.1 us (key lanes) -> 82.7; 32 rows over 8k 472.6 -> 274.2 (session
/// 22, `gpu_attention --dims --heads 8`).
pub const FEW_HEADS_WIDE: DimShape = DimShape { wh: 1, wk: 4, hpw: 8, sg: 1 };
/// Few heads over fewer positions: two warps of 4 heads x 4 key warps (shorter chains a group, more blocks). 8 heads:
/// one row over 8k 46.0 -> 33.2 us, 8 rows over 1k 31.0 -> 28.2, 32 rows over 1k 78.2 -> 52.7.
pub const FEW_HEADS_NARROW: DimShape = DimShape { wh: 2, wk: 4, hpw: 4, sg: 1 };
/// More heads (Kimi's 64 on one GPU, 32 under `--tp-size 2`): 8 warps of 4 heads, two groups a stage, beyond
/// [`NARROW_POSITIONS`] positions (below them the key lanes are as fast). 64 heads: one row over 8k 79.0 -> 62.2 us,
/// 8 rows over 1k 74.7 -> 61.9, 8 rows over 8k 428.7 -> 356.5, 32 rows over 1k 232.2 -> 190.4.
pub const MANY_HEADS: DimShape = DimShape { wh: 8, wk: 1, hpw: 4, sg: 2 };
/// Every shape [`pick`] can return.
pub const PICKED: [DimShape; 3] = [FEW_HEADS_WIDE, FEW_HEADS_NARROW, MANY_HEADS];
/// Positions (rows x longest row) from which few heads take [`FEW_HEADS_WIDE`].
pub const WIDE_POSITIONS: usize = 65_536;
/// Positions up to which many heads keep the key-lane kernel.
pub const NARROW_POSITIONS: usize = 2048;

/// The dim-lane launch for `rows` query rows of `heads` heads over at most `max_len` positions of latents `r + rot`
/// on a device of `sms` multiprocessors and `smem` bytes of shared memory a block, or `None` where the key-lane
/// kernel is the one to run (`r` not a multiple of 128, many heads over few positions, no picked shape fits, or
/// `EYRIE_ATTENTION_DIMS=0`).
/// Slices: enough to give each multiprocessor one wave of blocks (as many as its shared memory holds), each a
/// multiple of 64 positions.
pub fn pick(
    rows: usize,
    heads: usize,
    max_len: usize,
    r: usize,
    rot: usize,
    sms: usize,
    smem: usize,
) -> Option<super::attention::AttentionConfig> {
    if rows == 0 || heads == 0 || max_len == 0 || !dim_lanes_on() {
        return None;
    }
    let positions = rows * max_len;
    let shapes: &[DimShape] = if heads <= super::attention::FEW_HEADS {
        if positions >= WIDE_POSITIONS { &[FEW_HEADS_WIDE] } else { &[FEW_HEADS_NARROW, FEW_HEADS_WIDE] }
    } else if positions > NARROW_POSITIONS {
        &[MANY_HEADS]
    } else {
        &[]
    };
    let s = *shapes.iter().find(|s| dims_refusal(r, rot, s.wh, s.wk, s.hpw, s.sg, smem).is_none())?;
    let per_sm = (smem / dims_shared_bytes(r, rot, s.wh, s.wk, s.hpw, s.sg)).max(1);
    let per_split = rows * heads.div_ceil(s.wh * s.hpw);
    let (splits, chunk) = super::attention::one_wave_slices(sms, per_sm, per_split, max_len, 64, usize::MAX);
    Some(s.config(splits, chunk))
}

/// Whether [`pick`] picks the dim lanes at all: on unless `EYRIE_ATTENTION_DIMS=0` (read once), for same-binary
/// comparisons with the key-lane kernel alone.
pub fn dim_lanes_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    super::attention::env_switch(&ON, "EYRIE_ATTENTION_DIMS")
}

/// Every dim-lane launch [`pick`] can return for latents `r + rot` on a device of `smem` bytes of shared memory a
/// block, each as one slice of 32 positions (the warm-up launches them all: `attention::warm_up`).
pub fn variants(r: usize, rot: usize, smem: usize) -> Vec<super::attention::AttentionConfig> {
    PICKED
        .iter()
        .filter(|s| dims_refusal(r, rot, s.wh, s.wk, s.hpw, s.sg, smem).is_none())
        .map(|s| s.config(1, 32))
        .collect()
}

#[cfg(feature = "cuda")]
pub use gpu::mla_attention_dims_kernel;

#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use burn::cubecl;
    use cubecl::prelude::barrier::{Barrier, copy_async};
    use cubecl::prelude::*;

    use crate::cuda::attention::gpu::{cache_row, row_slice, zeros4};

    /// One round of the warp's reduce-scatter: the first `2 * half` values of `part`, summed with the partner lane's
    /// (`lane ^ half`), leave `half` values: the upper half's where the lane's bit `half` is set, else the lower's.
    #[cube]
    fn scatter_round(part: &mut Array<f32>, lane: usize, #[comptime] half: usize) {
        let up = (lane & half) != 0;
        #[unroll]
        for i in 0..half {
            let lo = part[i];
            let hi = part[i + half];
            let keep = select(up, hi, lo);
            let send = select(up, lo, hi);
            part[i] = keep + plane_shuffle_xor(send, half as u32);
        }
    }

    /// Adds vector `c4` of each of the group's `g` keys (shared memory from `kbase`, `dv` vectors a key) dotted
    /// with vector `c4` of each of the warp's `hpw` queries (from `qbase`) into `part[key * hpw + head]`.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn score_round<N: Size>(
        part: &mut Array<f32>,
        kf: &mut Array<f32>,
        ks: &SharedMemory<Vector<f32, N>>,
        qs: &SharedMemory<Vector<f32, N>>,
        kbase: usize,
        qbase: usize,
        dv: usize,
        c4: usize,
        #[comptime] g: usize,
        #[comptime] hpw: usize,
    ) {
        #[unroll]
        for gk in 0..g {
            let kv = ks[kbase + gk * dv + c4];
            #[unroll]
            for e in 0..4usize {
                kf[4 * gk + e] = kv[e];
            }
        }
        #[unroll]
        for h in 0..hpw {
            let qv = qs[qbase + h * dv + c4];
            #[unroll]
            for gk in 0..g {
                #[unroll]
                for e in 0..4usize {
                    part[gk * hpw + h] += qv[e] * kf[4 * gk + e];
                }
            }
        }
    }

    /// `x` combined over the lanes that hold the same head (lanes equal modulo `hpw`): the maximum or the sum.
    #[cube]
    fn over_keys(x: f32, #[comptime] hpw: usize, #[comptime] max: bool) -> f32 {
        let mut v = x;
        // Masks hpw, 2 hpw, .. 16: the lanes that differ in the key bits of the lane index.
        if comptime!(hpw <= 1) {
            v = combine(v, plane_shuffle_xor(v, 1u32), max);
        }
        if comptime!(hpw <= 2) {
            v = combine(v, plane_shuffle_xor(v, 2u32), max);
        }
        if comptime!(hpw <= 4) {
            v = combine(v, plane_shuffle_xor(v, 4u32), max);
        }
        if comptime!(hpw <= 8) {
            v = combine(v, plane_shuffle_xor(v, 8u32), max);
        }
        v = combine(v, plane_shuffle_xor(v, 16u32), max);
        v
    }

    /// `max(a, b)` or `a + b`.
    #[cube]
    fn combine(a: f32, b: f32, #[comptime] max: bool) -> f32 {
        if comptime!(max) { f32::max(a, b) } else { a + b }
    }

    /// One block: one query row, `wh * hpw` heads, one slice of positions (module docs).
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::too_many_arguments, clippy::manual_div_ceil, clippy::collapsible_if)]
    pub fn mla_attention_dims_kernel<N: Size>(
        q: &Array<Vector<f32, N>>,
        cache: &Array<Vector<f32, N>>,
        meta: &Array<u32>,
        o_part: &mut Array<Vector<f32, N>>,
        ml_part: &mut Array<f32>,
        n_rows: u32,
        heads: u32,
        max_blocks: u32,
        block_size: u32,
        chunk: u32,
        scale: f32,
        #[comptime] r: usize,
        #[comptime] rot: usize,
        #[comptime] wh: usize,
        #[comptime] wk: usize,
        #[comptime] hpw: usize,
        #[comptime] sg: usize,
    ) {
        let lane = UNIT_POS_X as usize;
        let warp = UNIT_POS_Y as usize;
        let tid = UNIT_POS as usize;
        let head_warp = warp % wh;
        let key_warp = warp / wh;
        let split = CUBE_POS_Y as usize;
        let row = CUBE_POS_Z as usize;
        let n_rows = n_rows as usize;
        let heads = heads as usize;
        // Vectors a latent, value vectors a lane, keys a group, accumulators a head, keys a stage, threads, heads a block.
        let dv = comptime!((r + rot) / 4);
        let rq = comptime!(r / 128);
        let g = comptime!(32 / hpw);
        let hs = comptime!(r / 32);
        let stage = comptime!(wk * sg * (32 / hpw));
        let threads = comptime!(32 * wh * wk);
        let bh = comptime!(wh * hpw);
        let h0 = CUBE_POS_X as usize * bh;

        let (table0, k_begin, k_end) = row_slice(meta, row, n_rows, split, chunk, max_blocks);
        let n_stages = (k_end - k_begin + stage - 1) / stage;

        let b0 = Barrier::shared(threads as u32, tid == 0);
        let b1 = Barrier::shared(threads as u32, tid == 0);
        let mut qs = SharedMemory::<Vector<f32, N>>::new(comptime!(wh * hpw * ((r + rot) / 4)));
        let ring = comptime!(2 * wk * sg * (32 / hpw) * ((r + rot) / 4));
        let merge = comptime!(if wk > 1 { wk * wh * hpw * r / 4 } else { 0 });
        let mut ks = SharedMemory::<Vector<f32, N>>::new(comptime!(if ring > merge { ring } else { merge }));
        let mut mls = SharedMemory::<f32>::new(comptime!(wk * wh * hpw * 2));

        // Queries of the block's heads with `cp.async` (heads past the end are 0); they complete with stage 0.
        let q0 = (row * heads + h0) * dv;
        for it in 0..comptime!((wh * hpw * ((r + rot) / 4)).div_ceil(32 * wh * wk)) {
            let i = it * threads + tid;
            if i < comptime!(wh * hpw * ((r + rot) / 4)) {
                if h0 + i / dv < heads {
                    copy_async::<Vector<f32, N>>(&q.slice(q0 + i, q0 + i + 1), &mut qs.slice_mut(i, i + 1), 4u32);
                } else {
                    qs[i] = zeros4::<N>();
                }
            }
        }
        // The barriers are initialized before anyone commits to them.
        sync_cube();

        // Copies of a stage: thread `tid` copies vectors `sub, sub + tpk, ..` of key `tid / tpk` (one page-table
        // read a thread a stage, made one stage ahead).
        let tpk = comptime!((32 * wh * wk) / (wk * sg * (32 / hpw)));
        let my_key = tid / tpk;
        let sub = tid % tpk;
        let mut slot = 0u32;
        if my_key < stage {
            let pos = k_begin + my_key;
            if pos < k_end {
                slot = cache_row(meta, table0, pos, block_size);
            }
        }
        if n_stages > 0 {
            if my_key < stage {
                let valid = k_begin + my_key < k_end;
                for k in 0..comptime!(((r + rot) / 4).div_ceil((32 * wh * wk) / (wk * sg * (32 / hpw)))) {
                    let c4 = sub + tpk * k;
                    if c4 < dv {
                        let dst = my_key * dv + c4;
                        if valid {
                            let src = slot as usize * dv + c4;
                            copy_async::<Vector<f32, N>>(
                                &cache.slice(src, src + 1),
                                &mut ks.slice_mut(dst, dst + 1),
                                4u32,
                            );
                        } else {
                            ks[dst] = zeros4::<N>();
                        }
                    }
                }
            }
            if my_key < stage {
                let pos = k_begin + stage + my_key;
                if pos < k_end {
                    slot = cache_row(meta, table0, pos, block_size);
                }
            }
        }
        b0.commit_copy_async();
        if n_stages == 0 {
            b0.arrive_and_wait();
        }

        let mut acc = Array::<f32>::new(comptime!(hpw * (r / 32)));
        #[unroll]
        for a in 0..comptime!(hpw * (r / 32)) {
            acc[a] = f32::new(0.0);
        }
        // The lane's head (`lane % hpw`): its running maximum; the sum of the lane's own weights.
        let mut m = f32::new(-1.0e30);
        let mut l = f32::new(0.0);
        let mut part = Array::<f32>::new(32usize);
        let mut kf = Array::<f32>::new(comptime!(4 * (32 / hpw)));
        let mut w = Array::<f32>::new(hpw);

        for st in 0..n_stages {
            let t0 = k_begin + st * stage;
            let cur = (st % 2) * comptime!(wk * sg * (32 / hpw) * ((r + rot) / 4));
            // The next stage's copies into the other buffer (its readers finished at the previous stage's end).
            if st + 1 < n_stages {
                let nxt = ((st + 1) % 2) * comptime!(wk * sg * (32 / hpw) * ((r + rot) / 4));
                if my_key < stage {
                    let valid = t0 + stage + my_key < k_end;
                    for k in 0..comptime!(((r + rot) / 4).div_ceil((32 * wh * wk) / (wk * sg * (32 / hpw)))) {
                        let c4 = sub + tpk * k;
                        if c4 < dv {
                            let dst = nxt + my_key * dv + c4;
                            if valid {
                                let src = slot as usize * dv + c4;
                                copy_async::<Vector<f32, N>>(
                                    &cache.slice(src, src + 1),
                                    &mut ks.slice_mut(dst, dst + 1),
                                    4u32,
                                );
                            } else {
                                ks[dst] = zeros4::<N>();
                            }
                        }
                    }
                    let pos = t0 + 2 * stage + my_key;
                    if pos < k_end {
                        slot = cache_row(meta, table0, pos, block_size);
                    }
                }
                if st % 2 == 0 {
                    b1.commit_copy_async();
                } else {
                    b0.commit_copy_async();
                }
            }
            if st % 2 == 0 {
                b0.arrive_and_wait();
            } else {
                b1.arrive_and_wait();
            }

            for gi in 0..sg {
                // The group's first key within the stage.
                let kb = (key_warp * sg + gi) * g;
                #[unroll]
                for x in 0..32usize {
                    part[x] = f32::new(0.0);
                }
                // Partial scores over the lane's dimensions: (key, head) at `key * hpw + head`; the rounds where
                // every lane has a vector, then the partial one.
                let kbase = cur + kb * dv;
                let qbase = head_warp * hpw * dv;
                // (Unrolled: ptxas hoists the rounds' loads and takes 255 registers, 24 bytes of spill at 8 heads a
                // warp; as runtime loops 238 / 182 registers and no spill, but 9% more instructions and 4-8% slower
                // under Nsight Compute, session 22.)
                #[unroll]
                for j in 0..comptime!((r + rot) / 128) {
                    score_round::<N>(&mut part, &mut kf, &ks, &qs, kbase, qbase, dv, lane + 32 * j, g, hpw);
                }
                if comptime!(!((r + rot) / 4).is_multiple_of(32)) {
                    let c4 = lane + 32 * comptime!((r + rot) / 128);
                    if c4 < dv {
                        score_round::<N>(&mut part, &mut kf, &ks, &qs, kbase, qbase, dv, c4, g, hpw);
                    }
                }
                scatter_round(&mut part, lane, 16usize);
                scatter_round(&mut part, lane, 8usize);
                scatter_round(&mut part, lane, 4usize);
                scatter_round(&mut part, lane, 2usize);
                scatter_round(&mut part, lane, 1usize);
                // Lane = (key lane / hpw, head lane % hpw).
                let valid = t0 + kb + lane / hpw < k_end;
                let mut s = part[0] * scale;
                if !valid {
                    s = f32::new(-1.0e30);
                }
                let m_new = f32::max(m, over_keys(s, hpw, true));
                if plane_any(m_new > m) {
                    let alpha = (m - m_new).exp();
                    l *= alpha;
                    #[unroll]
                    for h in 0..hpw {
                        let a = plane_shuffle(alpha, h as u32);
                        #[unroll]
                        for x in 0..hs {
                            acc[h * hs + x] *= a;
                        }
                    }
                    m = m_new;
                }
                let mut p = (s - m).exp();
                if !valid {
                    p = f32::new(0.0);
                }
                l += p;
                // Values: every key of the group for the warp's heads.
                #[unroll]
                for gk in 0..g {
                    #[unroll]
                    for h in 0..hpw {
                        w[h] = plane_shuffle(p, (gk * hpw + h) as u32);
                    }
                    #[unroll]
                    for jj in 0..rq {
                        let v = ks[cur + (kb + gk) * dv + lane + 32 * jj];
                        #[unroll]
                        for e in 0..4usize {
                            #[unroll]
                            for h in 0..hpw {
                                acc[h * hs + 4 * jj + e] += w[h] * v[e];
                            }
                        }
                    }
                }
            }
            // Every warp is done with this stage's buffer before the next iteration's copies overwrite it.
            sync_cube();
        }

        // Each head's sum over the lanes of its keys, then in every lane the warp's maxima and sums a head.
        let l_head = over_keys(l, hpw, false);
        let base = (split * n_rows + row) * heads;
        if comptime!(wk == 1) {
            #[unroll]
            for h in 0..hpw {
                let head = h0 + head_warp * hpw + h;
                let mh = plane_shuffle(m, h as u32);
                let lh = plane_shuffle(l_head, h as u32);
                if head < heads {
                    let mut inv = f32::new(0.0);
                    if lh > f32::new(0.0) {
                        inv = f32::new(1.0) / lh;
                    }
                    #[unroll]
                    for jj in 0..rq {
                        let a = h * hs + 4 * jj;
                        let mut o = Vector::<f32, N>::empty();
                        o[0] = acc[a] * inv;
                        o[1] = acc[a + 1] * inv;
                        o[2] = acc[a + 2] * inv;
                        o[3] = acc[a + 3] * inv;
                        o_part[(base + head) * comptime!(r / 4) + lane + 32 * jj] = o;
                    }
                    if lane == 0 {
                        ml_part[(base + head) * 2] = mh;
                        ml_part[(base + head) * 2 + 1] = lh;
                    }
                }
            }
        } else {
            // The key warps' states through shared memory (the stages' space is free: the loop ended on a barrier),
            // merged by key warp 0 with log-sum-exp weights.
            let me = key_warp * wh + head_warp;
            #[unroll]
            for h in 0..hpw {
                let mh = plane_shuffle(m, h as u32);
                let lh = plane_shuffle(l_head, h as u32);
                if lane == 0 {
                    mls[(me * hpw + h) * 2] = mh;
                    mls[(me * hpw + h) * 2 + 1] = lh;
                }
                if key_warp > 0 {
                    #[unroll]
                    for jj in 0..rq {
                        let a = h * hs + 4 * jj;
                        let mut o = Vector::<f32, N>::empty();
                        o[0] = acc[a];
                        o[1] = acc[a + 1];
                        o[2] = acc[a + 2];
                        o[3] = acc[a + 3];
                        ks[(me * hpw + h) * comptime!(r / 4) + lane + 32 * jj] = o;
                    }
                }
            }
            sync_cube();
            if key_warp == 0 {
                #[unroll]
                for h in 0..hpw {
                    let head = h0 + head_warp * hpw + h;
                    let mut mx = f32::new(-1.0e30);
                    for k in 0..wk {
                        let i = ((k * wh + head_warp) * hpw + h) * 2;
                        if mls[i + 1] > f32::new(0.0) {
                            mx = f32::max(mx, mls[i]);
                        }
                    }
                    // Key warp 0's own weight, then the others'.
                    let i0 = (head_warp * hpw + h) * 2;
                    let mut w0 = f32::new(0.0);
                    if mls[i0 + 1] > f32::new(0.0) {
                        w0 = (mls[i0] - mx).exp();
                    }
                    let mut den = w0 * mls[i0 + 1];
                    #[unroll]
                    for x in 0..hs {
                        acc[h * hs + x] *= w0;
                    }
                    for k in 1..wk {
                        let i = ((k * wh + head_warp) * hpw + h) * 2;
                        let mut wt = f32::new(0.0);
                        if mls[i + 1] > f32::new(0.0) {
                            wt = (mls[i] - mx).exp();
                        }
                        den += wt * mls[i + 1];
                        #[unroll]
                        for jj in 0..rq {
                            let v = ks[((k * wh + head_warp) * hpw + h) * comptime!(r / 4) + lane + 32 * jj];
                            #[unroll]
                            for e in 0..4usize {
                                acc[h * hs + 4 * jj + e] += wt * v[e];
                            }
                        }
                    }
                    if head < heads {
                        let mut inv = f32::new(0.0);
                        if den > f32::new(0.0) {
                            inv = f32::new(1.0) / den;
                        }
                        #[unroll]
                        for jj in 0..rq {
                            let a = h * hs + 4 * jj;
                            let mut o = Vector::<f32, N>::empty();
                            o[0] = acc[a] * inv;
                            o[1] = acc[a + 1] * inv;
                            o[2] = acc[a + 2] * inv;
                            o[3] = acc[a + 3] * inv;
                            o_part[(base + head) * comptime!(r / 4) + lane + 32 * jj] = o;
                        }
                        if lane == 0 {
                            ml_part[(base + head) * 2] = mx;
                            ml_part[(base + head) * 2 + 1] = den;
                        }
                    }
                }
            }
        }
    }
}
