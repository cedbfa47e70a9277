//! The MLA decode attention on tensor cores at f32 accuracy ("MMA lanes"): the same attention, page tables, slices
//! and outputs as [`attention`](super::attention) (whose module docs give the math), its products on `mma.sync`.
//!
//! With 64 heads the attention is compute-bound in f32 (61 flops a byte of latent; session 17), and both CUDA-core
//! kernels (lanes over keys or over dimensions) issue their f32 FMAs at 2 warps a scheduler. Here every product is
//! an `mma.m16n8k16` with BF16 operands and f32 accumulation, and f32 accuracy is kept by splitting each f32 operand
//! into three exact BF16 parts (truncations: the high 8 significant bits, then of the remainder twice; `x = x0 + x1 +
//! x2` exactly) and summing the six products whose part indices add up to at most 2 (`a0 b0`, `a0 b1`, `a1 b0`,
//! `a0 b2`, `a1 b1`, `a2 b0`; the three left out are below 2^-24 of the product), as `moe_mma` does. The
//! accumulation chains stay short: a score is four warps' sums of 9 k-steps added in f32, and each value tile's
//! products go into a zeroed fragment that is then added (with the softmax's rescale) to the f32 output.
//!
//! A block is `tiles` head tiles of 16 heads (one query row, one slice of positions), each tile 4 warps:
//! - scores `S = Q K^T` (M = 16 heads, N = 8 positions, K = latent dimensions): warp `kw` takes k-steps
//!   `kw * d / 64 ..` (its quarter of the `d = r + rot` dimensions; the queries' split parts of those k-steps stay
//!   in its registers for the whole slice), its partial scores go through shared memory and every warp of the tile
//!   adds the four in the same order (so all four hold the same scores);
//! - the online softmax on the score fragments (a lane holds heads `g`, `g + 8` x 4 positions: a row's maximum
//!   over the quad by two shuffles), exact rescale factors;
//! - `O += P V` (M = 16 heads, N = 8 value dimensions, K = 16 positions): warp `kw` owns value dimensions `kw * r
//!   / 4 ..`, P's fragments are the score fragments (split in three), V's the latents' first `r` dimensions.
//!
//! Latents arrive 16 positions a stage through `cp.async` (two stages, one mbarrier each), rows padded to 8 mod 32
//! floats; positions are permuted within each 8 (`perm8`) and value dimensions interleaved within each 32 (n-tile
//! `e` of a group holds dimensions `4 n + e`) so that every operand load (16-byte for the scores' B, 16-byte for
//! the values' B, one vector feeding four n-tiles) is free of bank conflicts and each lane ends with whole 4-float
//! vectors of output. Output: as the other kernels' (`AttentionParts`: the normalized slice output and `(max,
//! sum)` per (slice, row, head)).

/// A launch shape of the tensor-core kernel: head tiles of 16 heads a block, warps a head tile (its k-steps split
/// between them for the scores, its value dimensions for the output), positions a stage of latents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MmaShape {
    /// Head tiles of 16 heads a block.
    pub tiles: usize,
    /// Warps a head tile (4 or 8).
    pub wk: usize,
    /// Positions a stage (16 or 32).
    pub pt: usize,
}

impl MmaShape {
    /// The launch of this shape in `splits` slices of `chunk` positions.
    pub fn config(&self, splits: usize, chunk: usize) -> super::attention::AttentionConfig {
        super::attention::AttentionConfig {
            lanes: super::attention::Lanes::Mma { tiles: self.tiles, positions: self.pt },
            warps: self.tiles * self.wk,
            hpw: 16 / self.wk,
            splits,
            chunk,
        }
    }
}

/// The shapes `gpu_attention --mma` sweeps and checks.
pub const MMA_SHAPES: [MmaShape; 6] = [
    MmaShape { tiles: 1, wk: 4, pt: 16 },
    MmaShape { tiles: 2, wk: 4, pt: 16 },
    MmaShape { tiles: 1, wk: 8, pt: 16 },
    MmaShape { tiles: 1, wk: 4, pt: 32 },
    MmaShape { tiles: 2, wk: 4, pt: 32 },
    MmaShape { tiles: 1, wk: 8, pt: 32 },
];

/// The shape [`pick`] takes: one head tile of 4 warps, 16 positions a stage (79 KB of shared memory and 255
/// registers: two blocks a multiprocessor on the H200). The fastest of [`MMA_SHAPES`] at every Kimi-shaped case of
/// `gpu_attention --mma` (64 heads, batch 1 / 8 / 32 over 1k / 8k; session 23): 8 warps a tile (174 registers, one
/// block) and 32-position stages were 5-30% slower.
pub const MMA_PICKED: MmaShape = MmaShape { tiles: 1, wk: 4, pt: 16 };

/// Floats of one latent row in shared memory: `d` padded to 8 mod 32 (conflict-free fragment loads).
pub fn mma_row_floats(d: usize) -> usize {
    d + (40 - d % 32) % 32
}

/// Shared memory of one block of [`gpu::mla_attention_mma_kernel`]: two stages of `pt` latent rows, the warps'
/// partial scores (`pt / 2` floats a lane) and two mbarriers.
pub fn mma_shared_bytes(r: usize, rot: usize, s: MmaShape) -> usize {
    4 * (2 * s.pt * mma_row_floats(r + rot) + s.tiles * s.wk * 32 * (s.pt / 2)) + 32
}

/// Why the tensor-core kernel cannot run a shape, or `None` when it can: `r` a multiple of `32 wk` (the warps'
/// 32-dimension value groups), `r + rot` of 16 (k-steps), `rot` of 4, 4 or 8 warps a tile, 16 or 32 positions a
/// stage, 1 or 2 tiles and at most 8 warps a block, and the block's shared memory within `smem`.
pub fn mma_refusal(r: usize, rot: usize, s: MmaShape, smem: usize) -> Option<String> {
    if r == 0 || !r.is_multiple_of(32 * s.wk) || !(r + rot).is_multiple_of(16) || !rot.is_multiple_of(4) {
        return Some(format!(
            "tensor-core attention needs r a multiple of {} and r + rot of 16 (r {r}, rot {rot})",
            32 * s.wk
        ));
    }
    if ![4, 8].contains(&s.wk) || ![16, 32].contains(&s.pt) || ![1, 2].contains(&s.tiles) || s.tiles * s.wk > 8 {
        return Some(format!(
            "tensor-core attention: {} head tiles x {} warps, {} positions a stage",
            s.tiles, s.wk, s.pt
        ));
    }
    let bytes = mma_shared_bytes(r, rot, s);
    if bytes > smem {
        return Some(format!("tensor-core attention: {bytes} bytes of shared memory a block, the device has {smem}"));
    }
    None
}

/// Whether [`super::attention::AttentionConfig::pick`] may take the tensor-core kernel: on unless
/// `EYRIE_ATTENTION_MMA=0` (read once), for same-binary comparisons with the CUDA-core kernels.
pub fn mma_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    super::attention::env_switch(&ON, "EYRIE_ATTENTION_MMA")
}

/// The tensor-core launch for `rows` query rows of `heads` heads over at most `max_len` positions (latents `r +
/// rot`, a device of `sms` multiprocessors and `smem` bytes of shared memory a block), or `None` where it does not
/// run: more heads than [`FEW_HEADS`](super::attention::FEW_HEADS) (a 16-head tile half empty loses to the dim
/// lanes at a tensor-parallel rank's 8 heads: 8 rows over 8k 105.8 us against 82.6), [`MMA_PICKED`], slices for
/// one wave of blocks (as many a multiprocessor as its shared memory holds), multiples of 32 positions: the best
/// slice length of every case of session 23's sweep.
#[allow(clippy::too_many_arguments)]
pub fn pick(
    rows: usize,
    heads: usize,
    max_len: usize,
    r: usize,
    rot: usize,
    sms: usize,
    smem: usize,
) -> Option<super::attention::AttentionConfig> {
    let s = MMA_PICKED;
    if rows == 0
        || heads <= super::attention::FEW_HEADS
        || max_len == 0
        || !mma_on()
        || mma_refusal(r, rot, s, smem).is_some()
    {
        return None;
    }
    let per_sm = (smem / mma_shared_bytes(r, rot, s)).max(1);
    let per_split = rows * heads.div_ceil(16 * s.tiles);
    let (splits, chunk) = super::attention::one_wave_slices(sms, per_sm, per_split, max_len, 32, usize::MAX);
    Some(s.config(splits, chunk))
}

/// Every tensor-core launch [`pick`] can return for latents `r + rot` on a device of `smem` bytes of shared memory a
/// block, each as one slice of 32 positions (the warm-up launches them; none unless [`mma_on`]).
pub fn variants(r: usize, rot: usize, smem: usize) -> Vec<super::attention::AttentionConfig> {
    if !mma_on() || mma_refusal(r, rot, MMA_PICKED, smem).is_some() {
        return Vec::new();
    }
    vec![MMA_PICKED.config(1, 32)]
}

#[cfg(feature = "cuda")]
pub use gpu::mla_attention_mma_kernel;

#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use burn::cubecl;
    use cubecl::prelude::barrier::{Barrier, copy_async};
    use cubecl::prelude::*;
    use half::bf16;

    use crate::cuda::attention::gpu::{cache_row, row_slice, zeros4};
    use crate::cuda::moe_mma::mma_into;

    /// Position `x` (0..8) of an 8-position n-tile as the lane of index `x` reads it: `[0, 2, 1, 3, 6, 4, 7, 5]`.
    /// With rows 8 mod 32 floats apart, the scores' 16-byte loads (rows `perm8(g)`, a quarter-warp = two rows) and
    /// the values' (rows `perm8(2c)` for the quad's four `c`) fall on distinct banks.
    #[cube]
    fn perm8(x: usize) -> usize {
        let low = x & 3usize;
        let swapped = ((low & 1usize) << 1usize) | (low >> 1usize);
        (x & 4usize) | (swapped ^ ((x >> 1usize) & 2usize))
    }

    /// The three exact BF16 parts of `x` and of `y`, paired into words: `out[at + p * stride]` = part `p` of `x`
    /// (low half, the lower k index) and of `y` (high half).
    #[cube]
    fn split_pair(x: f32, y: f32, out: &mut Array<u32>, at: usize, #[comptime] stride: usize) {
        let mask = 0xffff_0000u32;
        let xh = u32::reinterpret(x) & mask;
        let yh = u32::reinterpret(y) & mask;
        let xr = x - f32::reinterpret(xh);
        let yr = y - f32::reinterpret(yh);
        let xm = u32::reinterpret(xr) & mask;
        let ym = u32::reinterpret(yr) & mask;
        let xl = u32::reinterpret(xr - f32::reinterpret(xm)) & mask;
        let yl = u32::reinterpret(yr - f32::reinterpret(ym)) & mask;
        out[at] = (xh >> 16u32) | yh;
        out[at + stride] = (xm >> 16u32) | ym;
        out[at + 2 * stride] = (xl >> 16u32) | yl;
    }

    /// One MMA of A words `a[ab..ab + 4]` and B words `b[bb..bb + 2]` into `acc[at..at + 4]`.
    #[cube]
    fn mma_part(a: &Array<u32>, ab: usize, b: &Array<u32>, bb: usize, acc: &mut Array<f32>, at: usize) {
        let mut ra = Array::<Vector<bf16, Const<2>>>::new(4usize);
        let mut rb = Array::<Vector<bf16, Const<2>>>::new(2usize);
        #[unroll]
        for i in 0..4usize {
            let w = a[ab + i];
            ra[i] = Vector::<bf16, Const<2>>::reinterpret(w);
        }
        #[unroll]
        for i in 0..2usize {
            let w = b[bb + i];
            rb[i] = Vector::<bf16, Const<2>>::reinterpret(w);
        }
        mma_into(&ra, &rb, acc, at);
    }

    /// The six products of split operands (part indices summing to at most 2), smallest first: the five small ones
    /// into `low[at..at + 4]`, `a0 b0` into `high[at..at + 4]` (two accumulators: shorter chains). A part `p` at
    /// `a[ab + p * sa..]`, B part `p` at `b[bb + p * sb..]`.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn mma6(
        a: &Array<u32>,
        ab: usize,
        #[comptime] sa: usize,
        b: &Array<u32>,
        bb: usize,
        #[comptime] sb: usize,
        low: &mut Array<f32>,
        high: &mut Array<f32>,
        at: usize,
    ) {
        mma_part(a, ab + 2 * sa, b, bb, low, at);
        mma_part(a, ab + sa, b, bb + sb, low, at);
        mma_part(a, ab, b, bb + 2 * sb, low, at);
        mma_part(a, ab + sa, b, bb, low, at);
        mma_part(a, ab, b, bb + sb, low, at);
        mma_part(a, ab, b, bb, high, at);
    }

    /// Issues the `cp.async` copies of one stage (16 positions from `t0`) into `ks` at `dst0`: thread `tid` copies
    /// vectors `sub, sub + tpk, ..` of position `my_key` from cache row `slot`; positions past `k_end` are zeros.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn copy_stage<N: Size>(
        cache: &Array<Vector<f32, N>>,
        ks: &mut SharedMemory<Vector<f32, N>>,
        dst0: usize,
        valid: bool,
        slot: u32,
        my_key: usize,
        sub: usize,
        #[comptime] tpk: usize,
        #[comptime] dv: usize,
        #[comptime] rowv: usize,
    ) {
        #[unroll]
        for k in 0..comptime!(dv.div_ceil(tpk)) {
            let c4 = sub + tpk * k;
            if c4 < dv {
                let dst = dst0 + my_key * rowv + c4;
                if valid {
                    let src = slot as usize * dv + c4;
                    copy_async::<Vector<f32, N>>(&cache.slice(src, src + 1), &mut ks.slice_mut(dst, dst + 1), 4u32);
                } else {
                    ks[dst] = zeros4::<N>();
                }
            }
        }
    }

    /// One block: one query row, `16 * tiles` heads, one slice of positions (module docs).
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::too_many_arguments, clippy::manual_div_ceil, clippy::collapsible_if)]
    pub fn mla_attention_mma_kernel<N: Size>(
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
        #[comptime] tiles: usize,
        #[comptime] wk: usize,
        #[comptime] pt: usize,
    ) {
        let lane = UNIT_POS_X as usize;
        let warp = UNIT_POS_Y as usize;
        let tid = UNIT_POS as usize;
        let tile = warp / wk;
        let kw = warp % wk;
        let g = lane / 4;
        let c = lane % 4;
        let split = CUBE_POS_Y as usize;
        let row = CUBE_POS_Z as usize;
        let n_rows = n_rows as usize;
        let heads = heads as usize;
        // Vectors a latent, a shared-memory row, a stage; k-steps in all and a warp at most; score n-tiles and value
        // k-steps a stage; 32-dimension value groups a warp; threads; copying threads a position.
        let dv = comptime!((r + rot) / 4);
        let rowv = comptime!(crate::cuda::attention_mma::mma_row_floats(r + rot) / 4);
        let stage_v = comptime!(pt * crate::cuda::attention_mma::mma_row_floats(r + rot) / 4);
        let ksteps = comptime!((r + rot) / 16);
        let kq = comptime!(((r + rot) / 16).div_ceil(wk));
        let ntn = comptime!(pt / 8);
        let kpn = comptime!(pt / 16);
        let nj = comptime!(r / (32 * wk));
        let threads = comptime!(32 * tiles * wk);
        let tpk = comptime!(32 * tiles * wk / pt);
        let h0 = CUBE_POS_X as usize * comptime!(16 * tiles) + tile * 16;
        let hg = h0 + g;
        let hg8 = h0 + g + 8;

        let (table0, k_begin, k_end) = row_slice(meta, row, n_rows, split, chunk, max_blocks);
        let n_stages = (k_end - k_begin + pt - 1) / pt;

        let b0 = Barrier::shared(threads as u32, tid == 0);
        let b1 = Barrier::shared(threads as u32, tid == 0);
        let mut ks = SharedMemory::<Vector<f32, N>>::new(comptime!(
            2 * pt * crate::cuda::attention_mma::mma_row_floats(r + rot) / 4
        ));
        let mut sx = SharedMemory::<Vector<f32, N>>::new(comptime!(tiles * wk * 32 * (pt / 8)));
        // The barriers are initialized before anyone commits to them.
        sync_cube();

        // Stage 0's copies (one page-table read a thread a stage, made one stage ahead).
        let my_key = tid / tpk;
        let sub = tid % tpk;
        let mut slot = 0u32;
        if k_begin + my_key < k_end {
            let pos = k_begin + my_key;
            slot = cache_row(meta, table0, pos, block_size);
        }
        if n_stages > 0 {
            copy_stage::<N>(cache, &mut ks, 0usize, k_begin + my_key < k_end, slot, my_key, sub, tpk, dv, rowv);
            let pos = k_begin + pt + my_key;
            if pos < k_end {
                slot = cache_row(meta, table0, pos, block_size);
            }
        }
        b0.commit_copy_async();
        if n_stages == 0 {
            b0.arrive_and_wait();
        }

        // The queries' A fragments of the warp's k-steps (`kw + wk i`), split in three, for the whole slice: word
        // `(i * 3 + part) * 4 + reg`, regs = (head g, dims 4c, 4c + 1), (g + 8, the same), (g, 4c + 2, 4c + 3),
        // (g + 8, the same) of the k-step (the MMA's k slots 2c, 2c + 1, 2c + 8, 2c + 9).
        let mut aq = Array::<u32>::new(comptime!(12 * ((r + rot) / 16).div_ceil(wk)));
        #[unroll]
        for i in 0..kq {
            let kk = kw + wk * i;
            let mut x = zeros4::<N>();
            let mut y = zeros4::<N>();
            if kk < ksteps {
                if hg < heads {
                    x = q[(row * heads + hg) * dv + kk * 4 + c];
                }
                if hg8 < heads {
                    y = q[(row * heads + hg8) * dv + kk * 4 + c];
                }
            }
            split_pair(x[0usize], x[1usize], &mut aq, i * 12usize, 4usize);
            split_pair(y[0usize], y[1usize], &mut aq, i * 12usize + 1usize, 4usize);
            split_pair(x[2usize], x[3usize], &mut aq, i * 12usize + 2usize, 4usize);
            split_pair(y[2usize], y[3usize], &mut aq, i * 12usize + 3usize, 4usize);
        }

        // The lane's positions in an n-tile: the B row it loads (perm8(g)) and its score columns 2c, 2c + 1.
        let pg = perm8(g);
        let p0 = perm8(2 * c);
        let p1 = perm8(2 * c + 1);
        let vb = kw * comptime!(r / wk);

        // Output fragments: n-tile (group jg, e) at `(jg * 4 + e) * 4`: heads g, g (dims 8c + e, 8c + 4 + e of the
        // group), g + 8, g + 8. Running maxima and the lane's share of the sums of heads g and g + 8.
        let mut o = Array::<f32>::new(comptime!(16 * (r / (32 * wk))));
        #[unroll]
        for a in 0..comptime!(16 * (r / (32 * wk))) {
            o[a] = f32::new(0.0);
        }
        let mut m0 = f32::new(-1.0e30);
        let mut m1 = f32::new(-1.0e30);
        let mut l0 = f32::new(0.0);
        let mut l1 = f32::new(0.0);
        let mut s = Array::<f32>::new(comptime!(pt / 2));
        let mut sh = Array::<f32>::new(comptime!(pt / 2));
        let mut bq = Array::<u32>::new(6usize);
        let mut pa = Array::<u32>::new(comptime!(12 * (pt / 16)));
        let mut bv = Array::<u32>::new(6usize);
        let mut tmp = Array::<f32>::new(4usize);
        let mut tmh = Array::<f32>::new(4usize);

        for st in 0..n_stages {
            let t0 = k_begin + st * pt;
            let cur = (st % 2) * stage_v;
            // The next stage's copies into the other buffer (its readers finished at the previous stage's end).
            if st + 1 < n_stages {
                let nxt = ((st + 1) % 2) * stage_v;
                copy_stage::<N>(cache, &mut ks, nxt, t0 + pt + my_key < k_end, slot, my_key, sub, tpk, dv, rowv);
                let pos = t0 + 2 * pt + my_key;
                if pos < k_end {
                    slot = cache_row(meta, table0, pos, block_size);
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

            // The warp's partial scores: n-tile nt (positions t0 + 8 nt + perm8(n)) at s[4 nt..] (the five small
            // products) and sh[4 nt..] (the high parts' product).
            #[unroll]
            for x in 0..comptime!(pt / 2) {
                s[x] = f32::new(0.0);
                sh[x] = f32::new(0.0);
            }
            #[unroll]
            for i in 0..kq {
                let kk = kw + wk * i;
                if kk < ksteps {
                    #[unroll]
                    for nt in 0..ntn {
                        let v = ks[cur + (nt * 8 + pg) * rowv + kk * 4 + c];
                        split_pair(v[0usize], v[1usize], &mut bq, 0usize, 2usize);
                        split_pair(v[2usize], v[3usize], &mut bq, 1usize, 2usize);
                        mma6(&aq, i * 12, 4usize, &bq, 0usize, 2usize, &mut s, &mut sh, nt * 4);
                    }
                }
            }
            // The tile's partial sums, added in the same order by each of its warps.
            let me = ((tile * wk + kw) * 32 + lane) * comptime!(pt / 8);
            #[unroll]
            for nt in 0..ntn {
                let mut w = Vector::<f32, N>::empty();
                #[unroll]
                for e in 0..4usize {
                    w[e] = s[4 * nt + e] + sh[4 * nt + e];
                }
                sx[me + nt] = w;
            }
            sync_cube();
            #[unroll]
            for x in 0..comptime!(pt / 2) {
                s[x] = f32::new(0.0);
            }
            #[unroll]
            for k in 0..wk {
                let at = ((tile * wk + k) * 32 + lane) * comptime!(pt / 8);
                #[unroll]
                for nt in 0..ntn {
                    let u = sx[at + nt];
                    #[unroll]
                    for e in 0..4usize {
                        s[4 * nt + e] += u[e];
                    }
                }
            }

            // Online softmax: s[4 nt + 0 / 1] = head g at positions 8 nt + p0 / p1, s[4 nt + 2 / 3] = head g + 8.
            let mut x0 = f32::new(-1.0e30);
            let mut x1 = f32::new(-1.0e30);
            #[unroll]
            for nt in 0..ntn {
                let v0 = t0 + nt * 8 + p0 < k_end;
                let v1 = t0 + nt * 8 + p1 < k_end;
                s[4 * nt] = select(v0, s[4 * nt] * scale, f32::new(-1.0e30));
                s[4 * nt + 1] = select(v1, s[4 * nt + 1] * scale, f32::new(-1.0e30));
                s[4 * nt + 2] = select(v0, s[4 * nt + 2] * scale, f32::new(-1.0e30));
                s[4 * nt + 3] = select(v1, s[4 * nt + 3] * scale, f32::new(-1.0e30));
                x0 = f32::max(x0, f32::max(s[4 * nt], s[4 * nt + 1]));
                x1 = f32::max(x1, f32::max(s[4 * nt + 2], s[4 * nt + 3]));
            }
            x0 = f32::max(x0, plane_shuffle_xor(x0, 1u32));
            x0 = f32::max(x0, plane_shuffle_xor(x0, 2u32));
            x1 = f32::max(x1, plane_shuffle_xor(x1, 1u32));
            x1 = f32::max(x1, plane_shuffle_xor(x1, 2u32));
            let n0 = f32::max(m0, x0);
            let n1 = f32::max(m1, x1);
            let alpha0 = (m0 - n0).exp();
            let alpha1 = (m1 - n1).exp();
            m0 = n0;
            m1 = n1;
            let mut r0 = f32::new(0.0);
            let mut r1 = f32::new(0.0);
            #[unroll]
            for nt in 0..ntn {
                let v0 = t0 + nt * 8 + p0 < k_end;
                let v1 = t0 + nt * 8 + p1 < k_end;
                s[4 * nt] = select(v0, (s[4 * nt] - n0).exp(), f32::new(0.0));
                s[4 * nt + 1] = select(v1, (s[4 * nt + 1] - n0).exp(), f32::new(0.0));
                s[4 * nt + 2] = select(v0, (s[4 * nt + 2] - n1).exp(), f32::new(0.0));
                s[4 * nt + 3] = select(v1, (s[4 * nt + 3] - n1).exp(), f32::new(0.0));
                r0 += s[4 * nt] + s[4 * nt + 1];
                r1 += s[4 * nt + 2] + s[4 * nt + 3];
            }
            l0 = l0 * alpha0 + r0;
            l1 = l1 * alpha1 + r1;
            // P's A fragments of value k-step kp (positions 16 kp ..): k slots 2c, 2c + 1 = positions p0, p1 of
            // n-tile 2 kp; 2c + 8, 2c + 9 = the same of n-tile 2 kp + 1.
            #[unroll]
            for kp in 0..kpn {
                split_pair(s[8 * kp], s[8 * kp + 1], &mut pa, kp * 12usize, 4usize);
                split_pair(s[8 * kp + 2], s[8 * kp + 3], &mut pa, kp * 12usize + 1usize, 4usize);
                split_pair(s[8 * kp + 4], s[8 * kp + 5], &mut pa, kp * 12usize + 2usize, 4usize);
                split_pair(s[8 * kp + 6], s[8 * kp + 7], &mut pa, kp * 12usize + 3usize, 4usize);
            }

            // O = O alpha + P V over the warp's value dimensions: vector g of group jg in the four rows a lane's k
            // slots name feeds the group's four n-tiles (n-tile e: dimensions 4 n + e).
            #[unroll]
            for jg in 0..nj {
                let col = vb / 4 + 8 * jg + g;
                let mut vv = Array::<Vector<f32, N>>::new(comptime!(4 * (pt / 16)));
                #[unroll]
                for kp in 0..kpn {
                    vv[4 * kp] = ks[cur + (16 * kp + p0) * rowv + col];
                    vv[4 * kp + 1] = ks[cur + (16 * kp + p1) * rowv + col];
                    vv[4 * kp + 2] = ks[cur + (16 * kp + 8 + p0) * rowv + col];
                    vv[4 * kp + 3] = ks[cur + (16 * kp + 8 + p1) * rowv + col];
                }
                #[unroll]
                for e in 0..4usize {
                    #[unroll]
                    for x in 0..4usize {
                        tmp[x] = f32::new(0.0);
                        tmh[x] = f32::new(0.0);
                    }
                    #[unroll]
                    for kp in 0..kpn {
                        let v0 = vv[4 * kp];
                        let v1 = vv[4 * kp + 1];
                        let v2 = vv[4 * kp + 2];
                        let v3 = vv[4 * kp + 3];
                        split_pair(v0[e], v1[e], &mut bv, 0usize, 2usize);
                        split_pair(v2[e], v3[e], &mut bv, 1usize, 2usize);
                        mma6(&pa, kp * 12, 4usize, &bv, 0usize, 2usize, &mut tmp, &mut tmh, 0usize);
                    }
                    let at = (jg * 4 + e) * 4;
                    o[at] = o[at] * alpha0 + (tmp[0] + tmh[0]);
                    o[at + 1] = o[at + 1] * alpha0 + (tmp[1] + tmh[1]);
                    o[at + 2] = o[at + 2] * alpha1 + (tmp[2] + tmh[2]);
                    o[at + 3] = o[at + 3] * alpha1 + (tmp[3] + tmh[3]);
                }
            }
            // Every warp is done with this stage's buffer and the partial scores before they are overwritten.
            sync_cube();
        }

        // The heads' sums over the quad; outputs normalized, as whole vectors (dims 8c .. 8c + 8 of each group).
        l0 += plane_shuffle_xor(l0, 1u32);
        l0 += plane_shuffle_xor(l0, 2u32);
        l1 += plane_shuffle_xor(l1, 1u32);
        l1 += plane_shuffle_xor(l1, 2u32);
        let inv0 = select(l0 > f32::new(0.0), f32::new(1.0) / l0, f32::new(0.0));
        let inv1 = select(l1 > f32::new(0.0), f32::new(1.0) / l1, f32::new(0.0));
        let base = (split * n_rows + row) * heads;
        #[unroll]
        for jg in 0..nj {
            let mut a = Vector::<f32, N>::empty();
            let mut b = Vector::<f32, N>::empty();
            let mut a8 = Vector::<f32, N>::empty();
            let mut b8 = Vector::<f32, N>::empty();
            #[unroll]
            for e in 0..4usize {
                let at = (jg * 4 + e) * 4;
                a[e] = o[at] * inv0;
                b[e] = o[at + 1] * inv0;
                a8[e] = o[at + 2] * inv1;
                b8[e] = o[at + 3] * inv1;
            }
            let v = vb / 4 + 8 * jg + 2 * c;
            if hg < heads {
                o_part[(base + hg) * comptime!(r / 4) + v] = a;
                o_part[(base + hg) * comptime!(r / 4) + v + 1] = b;
            }
            if hg8 < heads {
                o_part[(base + hg8) * comptime!(r / 4) + v] = a8;
                o_part[(base + hg8) * comptime!(r / 4) + v + 1] = b8;
            }
        }
        if kw == 0 && c == 0 {
            if hg < heads {
                ml_part[(base + hg) * 2] = m0;
                ml_part[(base + hg) * 2 + 1] = l0;
            }
            if hg8 < heads {
                ml_part[(base + hg8) * 2] = m1;
                ml_part[(base + hg8) * 2 + 1] = l1;
            }
        }
    }
}
