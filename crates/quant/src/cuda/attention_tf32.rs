//! The MLA decode attention for few heads on TF32 tensor cores at f32 accuracy ("TF32 lanes"): the same attention,
//! page tables, slices and outputs as [`attention`](super::attention) (whose module docs give the math), its
//! products on `mma.m16n8k8` with TF32 operands and f32 accumulation.
//!
//! Why: at a tensor-parallel rank's 8 heads (Kimi's 64 under `--tp-size 8`) a latent element feeds 16 FMAs (8
//! heads x score and value) and the CUDA-core dim-lane kernel is instruction- and latency-bound at ~44% of the copy
//! bandwidth (sessions 22-24); the BF16 tensor-core kernels spend ~7.5 instructions splitting each f32 element into
//! three BF16 parts (session 24). Here an f32 operand `x` becomes two TF32 parts: `hi = x` with its low 13 bits
//! cleared and `lo = x - hi` (exact in f32) with its low 13 bits cleared (ptxas feeds the raw registers to the MMA,
//! which reads only their high 19 bits, so one `LOP3` and one `FADD` an element remain); a product is
//! `a_hi b_hi + a_hi b_lo + a_lo b_hi` (three MMAs; the left-out `a_lo b_lo` is below 2^-20 of it). The queries'
//! and the softmax weights' parts round to nearest (as `cvt.rna.tf32`) instead, since they are split once a slice and
//! once a stage. What is kept: each operand to ~2^-21 of itself (the latents) or ~2^-22 (queries, weights), every
//! product exact in the tensor core, sums in f32; `gpu_attention` checks every launch against the f64 CPU reference
//! beside the f32 CUDA-core kernels (same 1e-5 tolerance; bench/REPORT.md gives the errors of both).
//!
//! A block is `nw` warps (4 or 8) over one query row, 8 heads (grid x: head groups of 8) and one slice of positions:
//! - scores `S^T = C Q^T` (M = 16 positions, N = 8 heads, K = latent dimensions): warp `w` takes the 16-dimension
//!   chunks `w, w + nw, ..`; lane `(g, c)` (`g = lane / 4`, `c = lane % 4`) holds the queries of head `g` at
//!   dimensions `16 j + 4 c .. + 4` of its chunks in registers for the whole slice (k slots `c` / `c + 4` of the
//!   chunk's two k-steps are dimensions `4 c + 2 s` / `4 c + 2 s + 1`), and loads its A fragments as two 16-byte
//!   vectors a chunk (positions `sigma(g)` and `sigma(g) + 8`, `sigma = [0, 4, 1, 5, 2, 6, 3, 7]`); each product
//!   kind and k-step parity has an accumulator of its own (six short chains: the MMA's latency, not its rate,
//!   bounded one chain), the warps' partial scores go through shared memory and every warp adds them in the same
//!   order;
//! - the online softmax on the score fragments (a lane holds positions `sigma(g)`, `sigma(g) + 8` x heads `2 c`,
//!   `2 c + 1`: a head's maximum over the 8 lanes of equal `c`, three shuffles), exact rescale factors;
//! - `O^T += V^T P^T` (M = 16 value dimensions, N = 8 heads, K = 8 positions): warp `w` owns value dimensions `w r
//!   / nw ..` in groups of 64 whose m-tile `i` has rows `g` / `g + 8` = dimensions `8 g + 2 i` / `8 g + 2 i + 1`, so
//!   a lane's A fragments of 4 m-tiles are two 16-byte vectors a position (k slots `c` / `c + 4` = positions `p(c)`
//!   / `p(c) + 2` of the k-step, `p = [0, 1, 4, 5]`); P^T's fragments are gathered from the score fragments by 8
//!   shuffles; each stage's products go into zeroed fragments that are then added, with the softmax's rescale, to
//!   the f32 output (short accumulation chains: the tensor cores' adds truncate).
//!
//! Latents arrive `pt` positions a stage through `cp.async` (a ring of `ns` stages, 2 or 3, one mbarrier each), rows padded to `d + 4`
//! floats (`d` a multiple of 32): with `sigma` and `p`, every 16-byte fragment load of a warp falls on distinct banks
//! in each quarter-warp. Output: as the other kernels' (`AttentionParts`: the normalized slice output and `(max,
//! sum)` per (slice, row, head)), so the same merge follows.

/// Heads a block of the TF32 kernel (the MMA's N); more heads take more blocks (grid x).
pub const TF32_HEADS: usize = 8;

/// A launch shape of the TF32 kernel: warps a block (the scores' k-steps and the values' dimensions split between
/// them), positions a stage of latents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tf32Shape {
    /// Warps a block (4 or 8).
    pub warps: usize,
    /// Positions a stage (16 or 32).
    pub pt: usize,
    /// Stages of latents in shared memory (2 or 3: a ring of three needs one block barrier a stage fewer).
    pub stages: usize,
}

impl Tf32Shape {
    /// The launch of this shape in `splits` slices of `chunk` positions.
    pub fn config(&self, splits: usize, chunk: usize) -> super::attention::AttentionConfig {
        super::attention::AttentionConfig {
            lanes: super::attention::Lanes::Tf32 { positions: self.pt, stages: self.stages },
            warps: self.warps,
            hpw: TF32_HEADS / self.warps,
            splits,
            chunk,
        }
    }
}

/// The shapes `gpu_attention --tf32` sweeps and checks.
pub const TF32_SHAPES: [Tf32Shape; 5] = [
    Tf32Shape { warps: 4, pt: 16, stages: 2 },
    Tf32Shape { warps: 4, pt: 16, stages: 3 },
    Tf32Shape { warps: 8, pt: 16, stages: 2 },
    Tf32Shape { warps: 4, pt: 32, stages: 2 },
    Tf32Shape { warps: 8, pt: 32, stages: 2 },
];

/// The shape [`pick`] takes: 4 warps, 16 positions a stage, two stages (76 KB of shared memory, 210 registers: two
/// blocks a multiprocessor on the H200). The fastest of [`TF32_SHAPES`] at every 8-head case of `gpu_attention
/// --tf32` but one row over 1k's (within 3% there; bench/REPORT.md, session 31): 8 warps (128 registers) were 4-16%
/// slower, 32-position stages 8-44%; a ring of three stages (113 KB, one block barrier a stage fewer) 0-2.4% slower
/// at the same slices (`gpu_attention --quick --heads 8`'s "other ring" rows).
pub const TF32_PICKED: Tf32Shape = Tf32Shape { warps: 4, pt: 16, stages: 2 };

/// Blocks of [`TF32_PICKED`] a multiprocessor: two (its registers allow no third on the H200; the sweep's best
/// launches were one wave of two a multiprocessor: 256 blocks at 8 rows over 8k 54.1 us, 344 blocks 75.6).
pub const TF32_BLOCKS_PER_SM: usize = 2;

/// At most this many slices a row: the merge of a (row, head) walks its slices, and one row over 8k was fastest in
/// 86 (23.0 us) against 256 (33.5 us; session 31's sweep).
pub const TF32_MAX_SLICES: usize = 96;

/// Floats of one latent row in shared memory: `d + 4` (with `d` a multiple of 32, rows 1 mod 8 16-byte units
/// apart: conflict-free fragment loads).
pub fn tf32_row_floats(d: usize) -> usize {
    d + 4
}

/// Shared memory of one block of [`gpu::mla_attention_tf32_kernel`]: `stages` stages of `pt` latent rows, the
/// warps' partial scores (`pt / 4` floats a lane) and three mbarriers.
pub fn tf32_shared_bytes(r: usize, rot: usize, s: Tf32Shape) -> usize {
    4 * (s.stages * s.pt * tf32_row_floats(r + rot) + s.warps * 32 * (s.pt / 4)) + 48
}

/// Why the TF32 kernel cannot run a shape, or `None` when it can: `r` a multiple of `64 warps` (each warp's value
/// dimensions in groups of 64), `r + rot` of 32 and its vectors of the copying threads a row (`32 warps / pt`), 4 or
/// 8 warps, 16 or 32 positions a stage, and the block's shared
/// memory within `smem`.
pub fn tf32_refusal(r: usize, rot: usize, s: Tf32Shape, smem: usize) -> Option<String> {
    if ![4, 8].contains(&s.warps) || ![16, 32].contains(&s.pt) || ![2, 3].contains(&s.stages) {
        return Some(format!(
            "TF32 attention: {} warps, {} positions a stage, {} stages (4 or 8, 16 or 32, 2 or 3)",
            s.warps, s.pt, s.stages
        ));
    }
    let tpk = 32 * s.warps / s.pt;
    if r == 0
        || !r.is_multiple_of(64 * s.warps)
        || !(r + rot).is_multiple_of(32)
        || !((r + rot) / 4).is_multiple_of(tpk)
    {
        return Some(format!(
            "TF32 attention needs r a multiple of {}, r + rot of 32 and (r + rot) / 4 of {tpk} (r {r}, rot {rot})",
            64 * s.warps
        ));
    }
    let bytes = tf32_shared_bytes(r, rot, s);
    if bytes > smem {
        return Some(format!("TF32 attention: {bytes} bytes of shared memory a block, the device has {smem}"));
    }
    None
}

/// Whether [`super::attention::AttentionConfig::pick`] may take the TF32 kernel: on unless `EYRIE_ATTENTION_TF32=0`
/// (read once), for same-binary comparisons with the CUDA-core kernels.
pub fn tf32_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    super::attention::env_switch(&ON, "EYRIE_ATTENTION_TF32")
}

/// The TF32 launch for `rows` query rows of `heads` heads over at most `max_len` positions (latents `r + rot`, a
/// device of `sms` multiprocessors and `smem` bytes of shared memory a block), or `None` where it does not run: more
/// heads than [`FEW_HEADS`](super::attention::FEW_HEADS) (the BF16 tensor-core kernel's), [`TF32_PICKED`], slices
/// for one wave of blocks (as many a multiprocessor as its shared memory holds, at most [`TF32_BLOCKS_PER_SM`]), at
/// most [`TF32_MAX_SLICES`], multiples of 32 positions: the best slice length of every case of session 31's sweep
/// but 8 rows over 1k's (32 positions, 15.9 us, against 64's 14.8).
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
    let s = TF32_PICKED;
    if rows == 0
        || heads == 0
        || heads > super::attention::FEW_HEADS
        || max_len == 0
        || !tf32_on()
        || tf32_refusal(r, rot, s, smem).is_some()
    {
        return None;
    }
    let per_sm = (smem / tf32_shared_bytes(r, rot, s)).clamp(1, TF32_BLOCKS_PER_SM);
    let per_split = rows * heads.div_ceil(TF32_HEADS);
    let (splits, chunk) = super::attention::one_wave_slices(sms, per_sm, per_split, max_len, 32, TF32_MAX_SLICES);
    Some(s.config(splits, chunk))
}

/// Every TF32 launch [`pick`] can return for latents `r + rot` on a device of `smem` bytes of shared memory a
/// block, each as one slice of 32 positions (the warm-up launches them; none unless [`tf32_on`]).
pub fn variants(r: usize, rot: usize, smem: usize) -> Vec<super::attention::AttentionConfig> {
    if !tf32_on() || tf32_refusal(r, rot, TF32_PICKED, smem).is_some() {
        return Vec::new();
    }
    vec![TF32_PICKED.config(1, 32)]
}

#[cfg(feature = "cuda")]
pub use gpu::mla_attention_tf32_kernel;

#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use burn::cubecl;
    use cubecl::cmma::MmaDefinition;
    use cubecl::prelude::barrier::{Barrier, copy_async};
    use cubecl::prelude::*;

    use crate::cuda::attention::gpu::{cache_row, row_slice, zeros4};

    /// `x` with its low 13 bits cleared: a TF32 value (truncated), as the MMA reads it.
    #[cube]
    fn tf32_trunc(x: f32) -> f32 {
        f32::reinterpret(u32::reinterpret(x) & 0xffff_e000u32)
    }

    /// `x` rounded to the nearest TF32 value, ties away from zero (`cvt.rna.tf32.f32`: a half unit of the 13
    /// cleared bits added to the magnitude's bits).
    #[cube]
    fn tf32_round(x: f32) -> f32 {
        f32::reinterpret((u32::reinterpret(x) + 0x1000u32) & 0xffff_e000u32)
    }

    /// One `mma.m16n8k8` (TF32 operands, f32 accumulation) of A `(a0, a1, a2, a3)` and B `(b0, b1)` (values already
    /// TF32) into `acc[at..at + 4]`.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn mma_tf32(a0: f32, a1: f32, a2: f32, a3: f32, b0: f32, b1: f32, acc: &mut Array<f32>, at: usize) {
        let def = MmaDefinition::<tf32, tf32, f32>::new(16usize, 8usize, 8usize);
        let mut ra = Array::<Vector<tf32, Const<1>>>::new(4usize);
        let mut rb = Array::<Vector<tf32, Const<1>>>::new(2usize);
        ra[0] = Vector::<tf32, Const<1>>::reinterpret(a0);
        ra[1] = Vector::<tf32, Const<1>>::reinterpret(a1);
        ra[2] = Vector::<tf32, Const<1>>::reinterpret(a2);
        ra[3] = Vector::<tf32, Const<1>>::reinterpret(a3);
        rb[0] = Vector::<tf32, Const<1>>::reinterpret(b0);
        rb[1] = Vector::<tf32, Const<1>>::reinterpret(b1);
        let mut rc = Array::<Vector<f32, Const<2>>>::new(2usize);
        let mut c0v = Vector::<f32, Const<2>>::empty();
        c0v[0] = acc[at];
        c0v[1] = acc[at + 1];
        let mut c1v = Vector::<f32, Const<2>>::empty();
        c1v[0] = acc[at + 2];
        c1v[1] = acc[at + 3];
        rc[0] = c0v;
        rc[1] = c1v;
        def.execute_inplace(&ra, &rb, &mut rc);
        let d0 = rc[0];
        let d1 = rc[1];
        acc[at] = d0[0];
        acc[at + 1] = d0[1];
        acc[at + 2] = d1[0];
        acc[at + 3] = d1[1];
    }

    /// The TF32 parts of an f32 A operand: `(hi, lo)`, `hi` = `x` truncated, `lo` = `x - hi` truncated.
    #[cube]
    fn split_trunc(x: f32) -> (f32, f32) {
        let hi = tf32_trunc(x);
        (hi, tf32_trunc(x - hi))
    }

    /// The three products of an f32 A fragment `a` (split here) and a B fragment given as its TF32 parts `(b0h,
    /// b1h)`, `(b0l, b1l)`: `a_lo b_hi` into `acc[at0..]`, `a_hi b_lo` into `acc[at1..]`, `a_hi b_hi` into
    /// `acc[at2..]` (separate accumulators where the caller wants short chains).
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn mma3(
        a0: f32,
        a1: f32,
        a2: f32,
        a3: f32,
        b0h: f32,
        b1h: f32,
        b0l: f32,
        b1l: f32,
        acc: &mut Array<f32>,
        at0: usize,
        at1: usize,
        at2: usize,
    ) {
        let (h0, l0) = split_trunc(a0);
        let (h1, l1) = split_trunc(a1);
        let (h2, l2) = split_trunc(a2);
        let (h3, l3) = split_trunc(a3);
        mma_tf32(l0, l1, l2, l3, b0h, b1h, acc, at0);
        mma_tf32(h0, h1, h2, h3, b0l, b1l, acc, at1);
        mma_tf32(h0, h1, h2, h3, b0h, b1h, acc, at2);
    }

    /// One 16-dimension chunk of the warp's partial scores: the lane's latent vectors at `ks[at + 16 m rowv]` and 8
    /// rows further (m-tile `m`'s rows `sigma(g)`, `sigma(g) + 8`), the queries' parts of the warp's chunk `i` from
    /// `qh` / `ql`, two k-steps of three products each into their own accumulators of `sp`.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn score_chunk<N: Size>(
        ks: &SharedMemory<Vector<f32, N>>,
        at: usize,
        qh: &Array<f32>,
        ql: &Array<f32>,
        #[comptime] i: usize,
        sp: &mut Array<f32>,
        #[comptime] rowv: usize,
        #[comptime] mt: usize,
    ) {
        #[unroll]
        for m in 0..mt {
            let xa = ks[at + 16 * m * rowv];
            let xc = ks[at + (16 * m + 8) * rowv];
            #[unroll]
            for kk in 0..2usize {
                let acc = (m * 2 + kk) * 12;
                mma3(
                    xa[2 * kk],
                    xc[2 * kk],
                    xa[2 * kk + 1],
                    xc[2 * kk + 1],
                    qh[4 * i + 2 * kk],
                    qh[4 * i + 2 * kk + 1],
                    ql[4 * i + 2 * kk],
                    ql[4 * i + 2 * kk + 1],
                    sp,
                    acc,
                    acc + 4,
                    acc + 8,
                );
            }
        }
    }

    /// Issues the `cp.async` copies of stage row `my_key` (cache row `slot`) into `ks` at `dst0`: this thread's
    /// vectors `sub, sub + tpk, ..` (`dv` a multiple of `tpk`: no bounds to test); zeros where the position is past
    /// the slice (`valid` false).
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn copy_row<N: Size>(
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
        let dst = dst0 + my_key * rowv + sub;
        if valid {
            let src = slot as usize * dv + sub;
            #[unroll]
            for k in 0..comptime!(dv / tpk) {
                let a = src + tpk * k;
                let b = dst + tpk * k;
                copy_async::<Vector<f32, N>>(&cache.slice(a, a + 1), &mut ks.slice_mut(b, b + 1), 4u32);
            }
        } else {
            #[unroll]
            for k in 0..comptime!(dv / tpk) {
                ks[dst + tpk * k] = zeros4::<N>();
            }
        }
    }

    /// `sigma(x)` for `x` in 0..8: the stage row of m-tile row `x` (`[0, 4, 1, 5, 2, 6, 3, 7]`).
    #[cube]
    fn sigma(x: usize) -> usize {
        ((x & 1usize) << 2usize) | (x >> 1usize)
    }

    /// One block: one query row, 8 heads, one slice of positions (module docs).
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::too_many_arguments, clippy::manual_div_ceil, clippy::collapsible_if)]
    pub fn mla_attention_tf32_kernel<N: Size>(
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
        #[comptime] nw: usize,
        #[comptime] pt: usize,
        #[comptime] ns: usize,
    ) {
        let lane = UNIT_POS_X as usize;
        let warp = UNIT_POS_Y as usize;
        let tid = UNIT_POS as usize;
        let g = lane / 4;
        let c = lane % 4;
        let split = CUBE_POS_Y as usize;
        let row = CUBE_POS_Z as usize;
        let n_rows = n_rows as usize;
        let heads = heads as usize;
        let h0 = CUBE_POS_X as usize * 8;
        // Vectors a latent, a shared-memory row, a stage; 16-dimension chunks in all and a warp at most; position
        // m-tiles a stage; 64-dimension value groups a warp; threads; copying threads a position.
        let dv = comptime!((r + rot) / 4);
        let rowv = comptime!(crate::cuda::attention_tf32::tf32_row_floats(r + rot) / 4);
        let stage_v = comptime!(pt * crate::cuda::attention_tf32::tf32_row_floats(r + rot) / 4);
        let nch = comptime!((r + rot) / 16);
        let kq = comptime!(((r + rot) / 16).div_ceil(nw));
        let mt = comptime!(pt / 16);
        let nj = comptime!(r / (64 * nw));
        let threads = comptime!(32 * nw);
        let tpk = comptime!(32 * nw / pt);

        let (table0, k_begin, k_end) = row_slice(meta, row, n_rows, split, chunk, max_blocks);
        let n_stages = (k_end - k_begin + pt - 1) / pt;

        let b0 = Barrier::shared(threads as u32, tid == 0);
        let b1 = Barrier::shared(threads as u32, tid == 0);
        let b2 = Barrier::shared(threads as u32, tid == 0);
        let mut ks = SharedMemory::<Vector<f32, N>>::new(comptime!(
            ns * pt * crate::cuda::attention_tf32::tf32_row_floats(r + rot) / 4
        ));
        let mut sx = SharedMemory::<Vector<f32, N>>::new(comptime!(nw * 32 * (pt / 16)));
        // The barriers are initialized before anyone commits to them.
        sync_cube();

        // Stage 0's copies (one page-table read a thread a stage, made one stage ahead).
        let my_key = tid / tpk;
        let sub = tid % tpk;
        let mut slot = 0u32;
        if k_begin + my_key < k_end {
            slot = cache_row(meta, table0, k_begin + my_key, block_size);
        }
        if n_stages > 0 {
            copy_row::<N>(cache, &mut ks, 0usize, k_begin + my_key < k_end, slot, my_key, sub, tpk, dv, rowv);
            let pos = k_begin + pt + my_key;
            if pos < k_end {
                slot = cache_row(meta, table0, pos, block_size);
            }
        }
        b0.commit_copy_async();
        if n_stages == 0 {
            b0.arrive_and_wait();
        }

        // The queries of head h0 + g at dimensions 16 j + 4 c .. + 4 of the warp's chunks j = warp + nw i, as TF32
        // parts (rounded): qh / ql[4 i + e].
        let hg = h0 + g;
        let mut qh = Array::<f32>::new(comptime!(4 * ((r + rot) / 16).div_ceil(nw)));
        let mut ql = Array::<f32>::new(comptime!(4 * ((r + rot) / 16).div_ceil(nw)));
        #[unroll]
        for i in 0..kq {
            let j = warp + nw * i;
            let mut v = zeros4::<N>();
            if j < nch && hg < heads {
                v = q[(row * heads + hg) * dv + 4 * j + c];
            }
            #[unroll]
            for e in 0..4usize {
                let hi = tf32_round(v[e]);
                qh[4 * i + e] = hi;
                ql[4 * i + e] = tf32_round(v[e] - hi);
            }
        }

        let sg = sigma(g);
        // The lane's value k slots: positions p(c) and p(c) + 2 of each 8, and the lanes holding their weights.
        let pc = (c & 1usize) | ((c & 2usize) << 1usize);
        let src_a = (4 * (((pc & 3usize) << 1usize) | (pc >> 2usize)) + g / 2) as u32;
        let pc2 = pc + 2;
        let src_b = (4 * (((pc2 & 3usize) << 1usize) | (pc2 >> 2usize)) + g / 2) as u32;
        let odd = g % 2 == 1;
        let vb = warp * comptime!(r / nw);

        // Output fragments: group jg, m-tile i at (jg * 4 + i) * 4: (dim 8 g + 2 i, head 2 c), (the same dim, head
        // 2 c + 1), (dim 8 g + 2 i + 1, head 2 c), (the same, 2 c + 1) of the group. Running maxima and the lane's
        // share of the sums of heads 2 c and 2 c + 1.
        let mut o = Array::<f32>::new(comptime!(16 * (r / (64 * nw))));
        #[unroll]
        for a in 0..comptime!(16 * (r / (64 * nw))) {
            o[a] = f32::new(0.0);
        }
        let mut m0 = f32::new(-1.0e30);
        let mut m1 = f32::new(-1.0e30);
        let mut l0 = f32::new(0.0);
        let mut l1 = f32::new(0.0);
        let mut s = Array::<f32>::new(comptime!(4 * (pt / 16)));
        // The warp's partial scores of m-tile m, k-step parity kk, product p (a_lo b_hi, a_hi b_lo, a_hi b_hi) at
        // sp[((m * 2 + kk) * 3 + p) * 4..]: six chains of a chunk's length each instead of one.
        let mut sp = Array::<f32>::new(comptime!(24 * (pt / 16)));
        let mut va = Array::<f32>::new(16usize);
        // P^T's B fragments of value k-step kv (positions 8 kv ..): parts hi (pb[4 kv], pb[4 kv + 1]) and lo
        // (pb[4 kv + 2], pb[4 kv + 3]).
        let mut pb = Array::<f32>::new(comptime!(8 * (pt / 16)));
        let mut tmp = Array::<f32>::new(16usize);

        for st in 0..n_stages {
            let t0 = k_begin + st * pt;
            let cur = (st % ns) * stage_v;
            // The next stage's copies into the next buffer of the ring. Its readers are done: with two buffers
            // they finished at the previous stage's end (its block barrier); with three, at stage st - 2, before
            // every thread arrived at stage st - 1's barrier, which this thread has passed.
            if st + 1 < n_stages {
                let nb = (st + 1) % ns;
                copy_row::<N>(cache, &mut ks, nb * stage_v, t0 + pt + my_key < k_end, slot, my_key, sub, tpk, dv, rowv);
                let pos = t0 + 2 * pt + my_key;
                if pos < k_end {
                    slot = cache_row(meta, table0, pos, block_size);
                }
                if nb == 0 {
                    b0.commit_copy_async();
                } else if nb == 1 {
                    b1.commit_copy_async();
                } else {
                    b2.commit_copy_async();
                }
            }
            let cb = st % ns;
            if cb == 0 {
                b0.arrive_and_wait();
            } else if cb == 1 {
                b1.arrive_and_wait();
            } else {
                b2.arrive_and_wait();
            }

            // The warp's partial scores.
            #[unroll]
            for x in 0..comptime!(24 * (pt / 16)) {
                sp[x] = f32::new(0.0);
            }
            let lane_at = cur + sg * rowv + c;
            #[unroll]
            for i in 0..comptime!((r + rot) / 16 / nw) {
                score_chunk::<N>(&ks, lane_at + 4 * (warp + nw * i), &qh, &ql, i, &mut sp, rowv, mt);
            }
            if comptime!(!((r + rot) / 16).is_multiple_of(nw)) {
                if warp < comptime!((r + rot) / 16 % nw) {
                    let i = comptime!((r + rot) / 16 / nw);
                    score_chunk::<N>(&ks, lane_at + 4 * (warp + nw * i), &qh, &ql, i, &mut sp, rowv, mt);
                }
            }
            // The block's sums of the warps' partials (each warp's six chains added smallest first), added in the
            // same order by each warp.
            #[unroll]
            for m in 0..mt {
                let mut w = Vector::<f32, N>::empty();
                #[unroll]
                for e in 0..4usize {
                    let b = m * 24 + e;
                    w[e] = ((sp[b] + sp[b + 12]) + (sp[b + 4] + sp[b + 16])) + (sp[b + 8] + sp[b + 20]);
                }
                sx[(warp * 32 + lane) * mt + m] = w;
            }
            sync_cube();
            #[unroll]
            for x in 0..comptime!(4 * (pt / 16)) {
                s[x] = f32::new(0.0);
            }
            #[unroll]
            for k in 0..nw {
                #[unroll]
                for m in 0..mt {
                    let u = sx[(k * 32 + lane) * mt + m];
                    #[unroll]
                    for e in 0..4usize {
                        s[4 * m + e] += u[e];
                    }
                }
            }

            // Online softmax: s[4 m + 0 / 1] = position 16 m + sigma(g), heads 2 c / 2 c + 1; s[4 m + 2 / 3] = the
            // position 8 further.
            let mut x0 = f32::new(-1.0e30);
            let mut x1 = f32::new(-1.0e30);
            #[unroll]
            for m in 0..mt {
                let v0 = t0 + 16 * m + sg < k_end;
                let v1 = t0 + 16 * m + sg + 8 < k_end;
                s[4 * m] = select(v0, s[4 * m] * scale, f32::new(-1.0e30));
                s[4 * m + 1] = select(v0, s[4 * m + 1] * scale, f32::new(-1.0e30));
                s[4 * m + 2] = select(v1, s[4 * m + 2] * scale, f32::new(-1.0e30));
                s[4 * m + 3] = select(v1, s[4 * m + 3] * scale, f32::new(-1.0e30));
                x0 = f32::max(x0, f32::max(s[4 * m], s[4 * m + 2]));
                x1 = f32::max(x1, f32::max(s[4 * m + 1], s[4 * m + 3]));
            }
            x0 = f32::max(x0, plane_shuffle_xor(x0, 4u32));
            x0 = f32::max(x0, plane_shuffle_xor(x0, 8u32));
            x0 = f32::max(x0, plane_shuffle_xor(x0, 16u32));
            x1 = f32::max(x1, plane_shuffle_xor(x1, 4u32));
            x1 = f32::max(x1, plane_shuffle_xor(x1, 8u32));
            x1 = f32::max(x1, plane_shuffle_xor(x1, 16u32));
            let n0 = f32::max(m0, x0);
            let n1 = f32::max(m1, x1);
            let alpha0 = (m0 - n0).exp();
            let alpha1 = (m1 - n1).exp();
            m0 = n0;
            m1 = n1;
            let mut r0 = f32::new(0.0);
            let mut r1 = f32::new(0.0);
            #[unroll]
            for m in 0..mt {
                let v0 = t0 + 16 * m + sg < k_end;
                let v1 = t0 + 16 * m + sg + 8 < k_end;
                s[4 * m] = select(v0, (s[4 * m] - n0).exp(), f32::new(0.0));
                s[4 * m + 1] = select(v0, (s[4 * m + 1] - n1).exp(), f32::new(0.0));
                s[4 * m + 2] = select(v1, (s[4 * m + 2] - n0).exp(), f32::new(0.0));
                s[4 * m + 3] = select(v1, (s[4 * m + 3] - n1).exp(), f32::new(0.0));
                r0 += s[4 * m] + s[4 * m + 2];
                r1 += s[4 * m + 1] + s[4 * m + 3];
            }
            l0 = l0 * alpha0 + r0;
            l1 = l1 * alpha1 + r1;
            // P^T's B fragments (k slot c = position p(c), c + 4 = p(c) + 2 of the k-step; column = head g): the
            // weight of (position x, head h) is element (h % 2) + 2 (x / 8 % 2) of m-tile x / 16 in lane 4
            // sigma^-1(x % 8) + h / 2.
            #[unroll]
            for m in 0..mt {
                let a0 = plane_shuffle(s[4 * m], src_a);
                let a1 = plane_shuffle(s[4 * m + 1], src_a);
                let a2 = plane_shuffle(s[4 * m + 2], src_a);
                let a3 = plane_shuffle(s[4 * m + 3], src_a);
                let c0 = plane_shuffle(s[4 * m], src_b);
                let c1 = plane_shuffle(s[4 * m + 1], src_b);
                let c2 = plane_shuffle(s[4 * m + 2], src_b);
                let c3 = plane_shuffle(s[4 * m + 3], src_b);
                let w0 = select(odd, a1, a0);
                let w1 = select(odd, c1, c0);
                let w2 = select(odd, a3, a2);
                let w3 = select(odd, c3, c2);
                let h0w = tf32_round(w0);
                let h1w = tf32_round(w1);
                let h2w = tf32_round(w2);
                let h3w = tf32_round(w3);
                pb[8 * m] = h0w;
                pb[8 * m + 1] = h1w;
                pb[8 * m + 2] = tf32_round(w0 - h0w);
                pb[8 * m + 3] = tf32_round(w1 - h1w);
                pb[8 * m + 4] = h2w;
                pb[8 * m + 5] = h3w;
                pb[8 * m + 6] = tf32_round(w2 - h2w);
                pb[8 * m + 7] = tf32_round(w3 - h3w);
            }

            // O = O alpha + P V over the warp's value dimensions.
            #[unroll]
            for jg in 0..nj {
                let col = (vb + 64 * jg + 8 * g) / 4;
                #[unroll]
                for x in 0..16usize {
                    tmp[x] = f32::new(0.0);
                }
                #[unroll]
                for kv in 0..comptime!(2 * (pt / 16)) {
                    let ra = cur + (8 * kv + pc) * rowv + col;
                    let rb = cur + (8 * kv + pc + 2) * rowv + col;
                    let v0 = ks[ra];
                    let v1 = ks[ra + 1];
                    let w0 = ks[rb];
                    let w1 = ks[rb + 1];
                    // m-tile i's A fragment at va[4 i..]: (dim 8 g + 2 i, 8 g + 2 i + 1) x (positions p, p + 2).
                    #[unroll]
                    for i in 0..2usize {
                        va[4 * i] = v0[2 * i];
                        va[4 * i + 1] = v0[2 * i + 1];
                        va[4 * i + 2] = w0[2 * i];
                        va[4 * i + 3] = w0[2 * i + 1];
                        va[4 * i + 8] = v1[2 * i];
                        va[4 * i + 9] = v1[2 * i + 1];
                        va[4 * i + 10] = w1[2 * i];
                        va[4 * i + 11] = w1[2 * i + 1];
                    }
                    let bh0 = pb[4 * kv];
                    let bh1 = pb[4 * kv + 1];
                    let bl0 = pb[4 * kv + 2];
                    let bl1 = pb[4 * kv + 3];
                    #[unroll]
                    for i in 0..4usize {
                        mma3(
                            va[4 * i],
                            va[4 * i + 1],
                            va[4 * i + 2],
                            va[4 * i + 3],
                            bh0,
                            bh1,
                            bl0,
                            bl1,
                            &mut tmp,
                            4 * i,
                            4 * i,
                            4 * i,
                        );
                    }
                }
                #[unroll]
                for i in 0..4usize {
                    let at = (jg * 4 + i) * 4;
                    o[at] = o[at] * alpha0 + tmp[4 * i];
                    o[at + 1] = o[at + 1] * alpha1 + tmp[4 * i + 1];
                    o[at + 2] = o[at + 2] * alpha0 + tmp[4 * i + 2];
                    o[at + 3] = o[at + 3] * alpha1 + tmp[4 * i + 3];
                }
            }
            // With two buffers: every warp is done with this stage's buffer and the partial scores before they are
            // overwritten (with three, the next stage's barrier orders both: the comment at the copies).
            if comptime!(ns == 2) {
                sync_cube();
            }
        }

        // The heads' sums over the 8 lanes of equal c; outputs normalized, as whole vectors (dims 8 g .. 8 g + 8
        // of each group).
        l0 += plane_shuffle_xor(l0, 4u32);
        l0 += plane_shuffle_xor(l0, 8u32);
        l0 += plane_shuffle_xor(l0, 16u32);
        l1 += plane_shuffle_xor(l1, 4u32);
        l1 += plane_shuffle_xor(l1, 8u32);
        l1 += plane_shuffle_xor(l1, 16u32);
        let inv0 = select(l0 > f32::new(0.0), f32::new(1.0) / l0, f32::new(0.0));
        let inv1 = select(l1 > f32::new(0.0), f32::new(1.0) / l1, f32::new(0.0));
        let base = (split * n_rows + row) * heads;
        let ha = h0 + 2 * c;
        let hb = ha + 1;
        #[unroll]
        for jg in 0..nj {
            let mut a = Vector::<f32, N>::empty();
            let mut a2 = Vector::<f32, N>::empty();
            let mut b = Vector::<f32, N>::empty();
            let mut b2 = Vector::<f32, N>::empty();
            #[unroll]
            for i in 0..2usize {
                let at = (jg * 4 + i) * 4;
                let at2 = (jg * 4 + i + 2) * 4;
                a[2 * i] = o[at] * inv0;
                a[2 * i + 1] = o[at + 2] * inv0;
                a2[2 * i] = o[at2] * inv0;
                a2[2 * i + 1] = o[at2 + 2] * inv0;
                b[2 * i] = o[at + 1] * inv1;
                b[2 * i + 1] = o[at + 3] * inv1;
                b2[2 * i] = o[at2 + 1] * inv1;
                b2[2 * i + 1] = o[at2 + 3] * inv1;
            }
            let v = (vb + 64 * jg + 8 * g) / 4;
            if ha < heads {
                o_part[(base + ha) * comptime!(r / 4) + v] = a;
                o_part[(base + ha) * comptime!(r / 4) + v + 1] = a2;
            }
            if hb < heads {
                o_part[(base + hb) * comptime!(r / 4) + v] = b;
                o_part[(base + hb) * comptime!(r / 4) + v + 1] = b2;
            }
        }
        if warp == 0 && g == 0 {
            if ha < heads {
                ml_part[(base + ha) * 2] = m0;
                ml_part[(base + ha) * 2 + 1] = l0;
            }
            if hb < heads {
                ml_part[(base + hb) * 2] = m1;
                ml_part[(base + hb) * 2 + 1] = l1;
            }
        }
    }
}
