//! MLA attention in its absorbed form over a paged latent cache (DeepSeek-V2, arXiv:2405.04434, appendix C): for
//! decode, verification and prefill chunks alike. Every query row `i` (one new token of one sequence, per head
//! `h`) is `q[i, h] = [q_lat (r) | q_pe (rot)]` (`q_lat = q_nope W_uk`); every cached position `t` of the row's
//! sequence is one latent `c[t] = [c_kv (r) | k_pe (rot)]`, shared by all heads. The row sees the first `len[i]`
//! positions of its sequence (causality: a new token at position `p` sees `p + 1`), and
//!
//! `o[i, h] = sum_t softmax_t(scale * q[i, h] . c[t]) * c_kv[t]`   (`[r]`, f32 throughout: no TF32, no BF16).
//!
//! Position `t` of a sequence lives in cache row `table[seq][t / block_size] * block_size + t % block_size`.
//!
//! Work split (flash decoding): grid `(splits, rows, head groups)`. A block of `warps` warps (up to 8) owns one
//! query row, `hpw * warps` heads (`hpw` = 1 (few heads only), 2, 4 or 8 a warp: fewer at small batches over
//! short contexts, where the grid is small and a warp's chain of dependent work sets the time) and one slice of the
//! row's positions, which it walks in tiles of 32:
//! the tile's cache rows are looked up in the page table while the previous tile is being scored, its latents are
//! gathered into shared memory with 16-byte loads all in flight together (each latent read once for all the
//! block's heads), lane `t` scores key `t` against the warp's heads (queries in shared memory as vectors of 4
//! heads, broadcast), an online softmax keeps each head's running max and sum, and each lane accumulates its
//! value vectors (`lane + 32 j`, `r` a multiple of 32) for the warp's heads in registers. Slices of one row are
//! merged by [`mla_combine_kernel`] (log-sum-exp weights) when the row was split; with one slice the block writes
//! the normalized output itself. The arithmetic is f32 on the CUDA cores (no tensor cores: TF32 or BF16 operands
//! would round the queries and latents), which bounds it by compute, not bandwidth (bench/REPORT.md).
//!
//! The CPU reference is [`mla_attention_reference`] (f64), always built and tested in CI.

/// Most query rows one launch of the attention takes (the grid's second dimension holds the rows: CUDA allows
/// 65535 there); longer steps (a long prompt in one forward) are launched in parts of this many rows.
pub const MAX_ROWS: usize = 65_535;

pub use super::paged_rows::PagedRows;

/// The attention of every query row (module docs), f64 accumulation: `q` `[rows, heads, r + rot]`, `cache`
/// `[slots, r + rot]` -> `[rows, heads, r]`.
pub fn mla_attention_reference(
    q: &[f32],
    cache: &[f32],
    rows: &PagedRows,
    heads: usize,
    r: usize,
    rot: usize,
    scale: f64,
) -> Vec<f32> {
    let d = r + rot;
    let mut out = vec![0.0f32; rows.rows() * heads * r];
    for row in 0..rows.rows() {
        let len = rows.row_len[row] as usize;
        let slots: Vec<usize> = (0..len).map(|t| rows.slot(row, t)).collect();
        for h in 0..heads {
            let qh = &q[(row * heads + h) * d..][..d];
            let scores: Vec<f64> = slots
                .iter()
                .map(|&s| {
                    scale * qh.iter().zip(&cache[s * d..][..d]).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>()
                })
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = weights.iter().sum();
            let o = &mut out[(row * heads + h) * r..][..r];
            for (c, o) in o.iter_mut().enumerate() {
                let v: f64 = slots.iter().zip(&weights).map(|(&s, w)| w * f64::from(cache[s * d + c])).sum();
                *o = (v / sum) as f32;
            }
        }
    }
    out
}

/// Shared memory of one block of [`gpu::mla_attention_kernel`] with `warps` warps of `hpw` heads each and latents
/// of width `d`: the block's queries (`hpw warps` heads x `d`), one tile of 32 latents (rows padded by one 16-byte
/// vector against bank conflicts), each warp's 32 x `hpw` softmax weights (in vectors of 4), the tile's 32 cache
/// rows, and the `cp.async` barrier (8 bytes, 16 with its alignment).
pub fn attention_shared_bytes(d: usize, warps: usize, hpw: usize) -> usize {
    4 * (d * hpw * warps + 32 * (d / 4 + 1) * 4 + warps * 32 * 4 * hpw.div_ceil(4) + 32) + 16
}

/// Heads a warp of the attention may own: fewer heads a warp is a shorter chain of dependent work a tile (the
/// batch-1 fixed cost), more heads a warp reads each latent tile into fewer blocks. One head a warp only where the
/// heads are few ([`FEW_HEADS`]: a block then holds all of a tensor-parallel rank's heads); with Kimi's 64 it was
/// never the fastest (session 13, `gpu_attention --small`), nor were 16-warp blocks.
pub const HEADS_PER_WARP: [usize; 4] = [1, 2, 4, 8];

/// At most this many heads (one tensor-parallel rank's share of Kimi's 64 from `--tp-size 4` on), one head a warp
/// at small batches over short contexts: at 8 heads 22.9-23.3 us against 27.7 with 2 at one row over 1k
/// (`gpu_attention --heads 8 --sweep`, session 17).
pub const FEW_HEADS: usize = 16;

/// Which kernel runs the attention: how its lanes split the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lanes {
    /// A lane a key ([`gpu::mla_attention_kernel`]): `warps` warps of `hpw` heads each over the same keys.
    Keys,
    /// A lane a stretch of the latent's dimensions ([`super::attention_dims`]): `warps` head warps of `hpw` heads
    /// each, times `key_warps` warps over different keys; `groups` groups of `32 / hpw` keys a key warp a stage.
    Dims {
        /// Warps over different keys of the same heads (merged at the block's end).
        key_warps: usize,
        /// Key groups a key warp takes from each stage of latents.
        groups: usize,
    },
    /// Tensor cores at f32 accuracy ([`super::attention_mma`]): `tiles` head tiles of 16 heads a block, `warps /
    /// tiles` warps each (`hpw` = 16 of them a tile), `positions` positions a stage.
    Mma {
        /// Head tiles of 16 heads a block (1 or 2).
        tiles: usize,
        /// Positions a stage of latents (16 or 32).
        positions: usize,
    },
    /// TF32 tensor cores at f32 accuracy for few heads ([`super::attention_tf32`]): `warps` warps (4 or 8) over 8
    /// heads a block (`hpw` = 8 / `warps`), `positions` positions a stage.
    Tf32 {
        /// Positions a stage of latents (16 or 32).
        positions: usize,
        /// Stages of latents in shared memory (2 or 3).
        stages: usize,
    },
}

/// Launch shape of the attention: the kernel, warps per block, heads per warp and slices per query row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionConfig {
    /// The kernel.
    pub lanes: Lanes,
    /// Warps per block (with [`Lanes::Dims`], head warps): 1 to 8.
    pub warps: usize,
    /// Heads per warp: one of [`HEADS_PER_WARP`].
    pub hpw: usize,
    /// Slices of each row's positions (each a multiple of 32 positions), merged by the combine kernel.
    pub splits: usize,
    /// Positions per slice (a multiple of 32).
    pub chunk: usize,
}

impl AttentionConfig {
    /// The key-lane kernel's shape ([`Lanes::Keys`]; [`Self::pick`] chooses between the kernels) for `rows` query
    /// rows of `heads` heads over at most `max_len` positions, latents of width `d`, on a device with `sms` multiprocessors and `smem` bytes of shared memory per block. Heads a warp: 8 (each
    /// latent tile read into the fewest blocks) when the rows' 32-position tiles give every multiprocessor at least
    /// 8 warp tasks, else 4 (at 6 tasks a multiprocessor) or 2, so short contexts at small batches still fill the
    /// GPU with short chains (the batch-1 fixed cost). Then as many warps as the heads fill (at most 8) and the shared memory allows, then
    /// enough slices (of at least 32 positions) to give every multiprocessor at most one wave of blocks (as many as
    /// its shared memory holds); fewer heads a warp when the heads would fill fewer than 4 warps; at 8 heads a warp,
    /// when even 32-position slices leave multiprocessors idle, half the warps a block and twice the blocks. Tuned
    /// on the H200 (`gpu_attention --sweep`, bench/REPORT.md): batch 1 at 1k 135 -> 69 us a layer, batch 8 at 1k
    /// 135 -> 98 us, batch 8 at 8k 596 -> 545 us, batch 32 at 1k 330 -> 298 us against the previous
    /// two-blocks-a-multiprocessor, 128-position-minimum choice.
    pub fn new(rows: usize, heads: usize, max_len: usize, d: usize, sms: usize, smem: usize) -> Option<Self> {
        if rows == 0 || max_len == 0 || heads == 0 {
            return None;
        }
        let tiles = max_len.div_ceil(32);
        let tasks = |hpw: usize| rows * tiles * heads.div_ceil(hpw);
        // 8 heads a warp at 8 warp tasks a multiprocessor, 4 at 6, else 2 (the H200 sweep's best or within 3% of it
        // at 1, 2, 4 and 8 rows over 1k and 1 and 8 rows over 8k: bench/REPORT.md, session 11; 4 at 4 tasks, as
        // then, gave one row over 1040 positions 4 heads a warp: 32.5 us of GPU time against 26.2 with 2, session
        // 13's GPU-timed sweep, `gpu_attention --small`).
        let mut hpw = if tasks(8) >= 8 * sms {
            8
        } else if tasks(4) >= 6 * sms {
            4
        } else {
            2
        };
        // Few heads (one tensor-parallel rank's share: 8 of Kimi's 64 under `--tp-size 8`): fewer heads a warp
        // until a block has 4 warps. At 8 heads, 8 heads in one warp a block took 386 us at 8 x 8k against 139 for
        // 2 heads x 4 warps (`gpu_attention --heads 8 --sweep`, session 17).
        while hpw > 2 && heads.div_ceil(hpw) < 4 {
            hpw /= 2;
        }
        // And at most 128 row tiles (1-4 rows over 1k): one head a warp, the shortest chains (at 8 rows over 1k two
        // heads a warp were faster: 30.9 us against 33.1).
        if heads <= FEW_HEADS && rows * tiles <= 128 {
            hpw = 1;
        }
        let mut warps = heads.div_ceil(hpw).clamp(1, 8);
        while warps > 1 && attention_shared_bytes(d, warps, hpw) > smem {
            warps -= 1;
        }
        if attention_shared_bytes(d, warps, hpw) > smem {
            return None;
        }
        let per_split = |warps: usize| rows * heads.div_ceil(hpw * warps);
        if hpw == 8 && warps >= 2 && per_split(warps) * tiles < sms {
            warps /= 2;
        }
        // At most one wave: a few blocks past a multiple of the multiprocessors cost a whole second wave (batch 32
        // at 1k: 5 slices = 160 blocks 498 us, 4 slices = 128 blocks 298 us). A wave is as many blocks a
        // multiprocessor as its shared memory holds: one for 64 heads (every shape of 8 warps or 8 heads a warp
        // takes over half of it), two for 8 heads in 4 warps (the 8-head sweep's best at 8 x 8k, 8 x 1k and 32 x 1k
        // was 256 blocks on 132 multiprocessors).
        let per_sm = (smem / attention_shared_bytes(d, warps, hpw)).max(1);
        let want = (sms * per_sm / per_split(warps)).clamp(1, tiles);
        let chunk = tiles.div_ceil(want) * 32;
        Some(Self { lanes: Lanes::Keys, warps, hpw, splits: max_len.div_ceil(chunk), chunk })
    }

    /// The launch for `rows` query rows of `heads` heads over at most `max_len` positions, latents of `r + rot`:
    /// the tensor-core kernel for more than [`FEW_HEADS`] heads ([`super::attention_mma::pick`]), else the dim-lane
    /// kernel where it is the faster one ([`super::attention_dims::pick`]), else the key-lane shape of [`Self::new`].
    pub fn pick(
        rows: usize,
        heads: usize,
        max_len: usize,
        r: usize,
        rot: usize,
        sms: usize,
        smem: usize,
    ) -> Option<Self> {
        super::attention_mma::pick(rows, heads, max_len, r, rot, sms, smem)
            .or_else(|| super::attention_tf32::pick(rows, heads, max_len, r, rot, sms, smem))
            .or_else(|| super::attention_dims::pick(rows, heads, max_len, r, rot, sms, smem))
            .or_else(|| Self::new(rows, heads, max_len, r + rot, sms, smem))
    }

    /// Blocks of one launch for `rows` query rows of `heads` heads.
    pub fn blocks(&self, rows: usize, heads: usize) -> usize {
        self.splits * rows * heads.div_ceil(self.hpw * self.warps)
    }

    /// Every (warps, heads a warp) that [`Self::new`] can pick for `heads` heads of latents of width `d` on a device
    /// of `smem` bytes of shared memory a block, over all rows and lengths, each as one slice of 32 positions: each
    /// is a kernel specialisation of its own, compiled at its first launch, so a server's warm-up launches them all
    /// ([`gpu::warm_up`]) instead of finding out which one a long context or a wide batch picks mid-serving.
    pub fn variants(heads: usize, d: usize, smem: usize) -> Vec<Self> {
        let mut out = Vec::new();
        for hpw in HEADS_PER_WARP {
            if hpw == 1 && heads > FEW_HEADS {
                continue;
            }
            let mut warps = heads.div_ceil(hpw).clamp(1, 8);
            while warps > 1 && attention_shared_bytes(d, warps, hpw) > smem {
                warps -= 1;
            }
            if heads == 0 || attention_shared_bytes(d, warps, hpw) > smem {
                continue;
            }
            out.push(Self { lanes: Lanes::Keys, warps, hpw, splits: 1, chunk: 32 });
            if hpw == 8 && warps >= 2 {
                out.push(Self { lanes: Lanes::Keys, warps: warps / 2, hpw, splits: 1, chunk: 32 });
            }
        }
        out
    }
}

/// The slices of a launch of one wave (the dim-lane, tensor-core and TF32 kernels' rule): as many blocks as `sms`
/// multiprocessors of `per_sm` blocks each hold, `per_split` blocks a slice (rows x head groups), at most `max_slices`
/// slices and at least `multiple` positions a slice, each slice a multiple of `multiple` positions. Returns `(splits,
/// chunk)` covering `max_len` (at least 1) positions.
pub(crate) fn one_wave_slices(
    sms: usize,
    per_sm: usize,
    per_split: usize,
    max_len: usize,
    multiple: usize,
    max_slices: usize,
) -> (usize, usize) {
    let want = (sms * per_sm / per_split.max(1)).clamp(1, max_len.div_ceil(multiple).min(max_slices).max(1));
    let chunk = max_len.div_ceil(want).next_multiple_of(multiple);
    (max_len.div_ceil(chunk), chunk)
}

/// An on/off switch read once from the environment variable `var` (on unless it is `0`), cached in `cell`: the
/// kernels' `EYRIE_ATTENTION_*` switches for same-binary comparisons.
pub(crate) fn env_switch(cell: &'static std::sync::OnceLock<bool>, var: &str) -> bool {
    *cell.get_or_init(|| std::env::var(var).map_or(true, |v| v != "0"))
}

#[cfg(feature = "cuda")]
pub use super::attention_merge::{AttentionParts, merge_parts, merge_slices, mla_combine_kernel};
#[cfg(feature = "cuda")]
pub use gpu::{mla_attention, mla_attention_kernel, mla_attention_parts, warm_up, write_rows, write_rows_kernel};

#[cfg(feature = "cuda")]
pub(crate) mod gpu {
    use burn::cubecl;
    use cubecl::prelude::barrier::{Barrier, copy_async};
    use cubecl::prelude::*;
    use cubecl::server::Handle;

    use super::{AttentionConfig, AttentionParts, PagedRows, merge_parts};

    /// A vector of four f32 zeros (built element by element: NVRTC refuses CubeCL's cast of a literal).
    #[cube]
    pub(crate) fn zeros4<N: Size>() -> Vector<f32, N> {
        let mut z = Vector::<f32, N>::empty();
        z[0] = f32::new(0.0);
        z[1] = f32::new(0.0);
        z[2] = f32::new(0.0);
        z[3] = f32::new(0.0);
        z
    }

    /// Where block slice `split` of query row `row` reads, from the packed [`PagedRows`](super::PagedRows) `meta`
    /// of `n_rows` rows: `(table0, k_begin, k_end)`, the row's page table's first word and its positions `k_begin ..
    /// k_end` (slices of `chunk`, cut at the row's length; empty past it). Shared by the three attention kernels.
    #[cube]
    pub(crate) fn row_slice(
        meta: &Array<u32>,
        row: usize,
        n_rows: usize,
        split: usize,
        chunk: u32,
        max_blocks: u32,
    ) -> (usize, usize, usize) {
        let seq = meta[row] as usize;
        let len = meta[n_rows + row] as usize;
        let table0 = 2 * n_rows + seq * max_blocks as usize;
        let k_begin = split * chunk as usize;
        let mut k_end = k_begin + chunk as usize;
        if k_end > len {
            k_end = len;
        }
        if k_end < k_begin {
            k_end = k_begin;
        }
        (table0, k_begin, k_end)
    }

    /// The cache row of position `pos` of the row whose page table starts at `meta[table0]` (pages of `block_size`).
    #[cube]
    pub(crate) fn cache_row(meta: &Array<u32>, table0: usize, pos: usize, block_size: u32) -> u32 {
        let bs = block_size as usize;
        meta[table0 + pos / bs] * block_size + (pos % bs) as u32
    }

    /// One block: one query row, `hpw * warps` heads, one slice of positions (module docs).
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::too_many_arguments, clippy::manual_div_ceil, clippy::collapsible_if)]
    pub fn mla_attention_kernel<N: Size>(
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
        #[comptime] warps: usize,
        #[comptime] hpw: usize,
    ) {
        let lane = UNIT_POS_X as usize;
        let warp = UNIT_POS_Y as usize;
        let tid = UNIT_POS as usize;
        let split = CUBE_POS_X as usize;
        let row = CUBE_POS_Y as usize;
        let n_rows = n_rows as usize;
        let heads = heads as usize;
        // 4-float vectors per latent, per latent row in shared memory (one vector of padding: the score loop's
        // 16-byte loads of 32 different rows are then free of bank conflicts), value vectors per lane.
        let dv = comptime!((r + rot) / 4);
        let kstv = comptime!((r + rot) / 4 + 1);
        let rjv = comptime!(r.div_ceil(128));
        let full = comptime!(r.is_multiple_of(128));
        let threads = comptime!(32 * warps);
        let h0 = CUBE_POS_Z as usize * comptime!(hpw * warps);
        // Softmax weights a key: vectors of 4 heads.
        let pvn = comptime!(hpw.div_ceil(4));
        // Accumulators a head: the lane's value vectors of 4.
        let hs = comptime!(4 * r.div_ceil(128));

        let (table0, k_begin, k_end) = row_slice(meta, row, n_rows, split, chunk, max_blocks);

        // Queries of the block's heads, `[hpw warps heads][d / 4]` vectors, copied with `cp.async` (16 bytes each,
        // all in flight at once, no registers held; the block's heads are one contiguous stretch of `q`); heads
        // past the end are 0. The copies complete at the first tile's barrier.
        let barrier = Barrier::shared(comptime!(32 * warps) as u32, tid == 0);
        let mut qs = SharedMemory::<Vector<f32, N>>::new(comptime!(hpw * warps * ((r + rot) / 4)));
        let q0 = (row * heads + h0) * dv;
        for it in 0..comptime!((hpw * warps * ((r + rot) / 4)).div_ceil(32 * warps)) {
            let i = it * threads + tid;
            if i < comptime!(hpw * warps * ((r + rot) / 4)) {
                if h0 + i / dv < heads {
                    copy_async::<Vector<f32, N>>(&q.slice(q0 + i, q0 + i + 1), &mut qs.slice_mut(i, i + 1), 4u32);
                } else {
                    qs[i] = zeros4::<N>();
                }
            }
        }
        let mut ks = SharedMemory::<Vector<f32, N>>::new(comptime!(32 * ((r + rot) / 4 + 1)));
        let mut ps = SharedMemory::<Vector<f32, N>>::new(comptime!(warps * 32 * hpw.div_ceil(4)));
        let mut slots = SharedMemory::<u32>::new(32usize);

        let mut acc = Array::<f32>::new(comptime!(hpw * 4 * r.div_ceil(128)));
        #[unroll]
        for a in 0..comptime!(hpw * 4 * r.div_ceil(128)) {
            acc[a] = f32::new(0.0);
        }
        let mut m = Array::<f32>::new(hpw);
        let mut l = Array::<f32>::new(hpw);
        let mut s = Array::<f32>::new(hpw);
        // Weights of the lane's key for the warp's heads, padded to whole vectors of 4 with zeros.
        let mut p = Array::<f32>::new(comptime!(4 * hpw.div_ceil(4)));
        let mut w = Array::<f32>::new(comptime!(4 * hpw.div_ceil(4)));
        #[unroll]
        for h in 0..comptime!(4 * hpw.div_ceil(4)) {
            p[h] = f32::new(0.0);
        }
        #[unroll]
        for h in 0..hpw {
            m[h] = f32::new(-1.0e30);
            l[h] = f32::new(0.0);
        }

        // The cache row of the first tile's position `tid` (threads < 32); later tiles' rows are fetched while the
        // current tile is scored, so the page-table read is off the critical path.
        let mut next_slot = 0u32;
        if tid < 32 {
            let pos = k_begin + tid;
            if pos < k_end {
                next_slot = cache_row(meta, table0, pos, block_size);
            }
        }
        let n_tiles = (k_end - k_begin + 31) / 32;
        for tile in 0..n_tiles {
            let t0 = k_begin + tile * 32;
            // The previous tile's readers are done (and, the first time, the queries are in place).
            sync_cube();
            if tid < 32 {
                slots[tid] = next_slot;
            }
            sync_cube();
            // The tile's latents with `cp.async` (16 bytes each, all of a thread's copies in flight together and no
            // registers held: loads through registers in batches of 9 left this stage latency-bound, ~30% of a
            // one-tile block's time under Nsight Compute); positions past the slice are 0. (Not unrolled: an
            // issued copy holds nothing, so the loop never waits.)
            for it in 0..comptime!((32 * (r + rot) / 4).div_ceil(32 * warps)) {
                let i = it * threads + tid;
                if i < comptime!(32 * (r + rot) / 4) {
                    let key = i / dv;
                    let c4 = i % dv;
                    let dst = key * kstv + c4;
                    if t0 + key < k_end {
                        let src = slots[key] as usize * dv + c4;
                        copy_async::<Vector<f32, N>>(&cache.slice(src, src + 1), &mut ks.slice_mut(dst, dst + 1), 4u32);
                    } else {
                        ks[dst] = zeros4::<N>();
                    }
                }
            }
            if tid < 32 {
                let pos = t0 + 32 + tid;
                if pos < k_end {
                    next_slot = cache_row(meta, table0, pos, block_size);
                }
            }
            // Every thread's copies (and, the first time, the queries) have landed and every thread has arrived.
            barrier.commit_copy_async();
            barrier.arrive_and_wait();

            // Lane = key: scores against the warp's heads.
            #[unroll]
            for h in 0..hpw {
                s[h] = f32::new(0.0);
            }
            for c4 in 0..dv {
                let kv = ks[lane * kstv + c4];
                let qw = warp * hpw * dv + c4;
                // Head by head, each head's 4 products added in dimension order (as the CPU reference does).
                #[unroll]
                for h in 0..hpw {
                    let qv = qs[qw + h * dv];
                    #[unroll]
                    for e in 0..4usize {
                        s[h] += qv[e] * kv[e];
                    }
                }
            }
            let valid = t0 + lane < k_end;
            #[unroll]
            for h in 0..hpw {
                let mut sv = s[h] * scale;
                if !valid {
                    sv = f32::new(-1.0e30);
                }
                let m_new = f32::max(m[h], plane_max(sv));
                let alpha = (m[h] - m_new).exp();
                let mut pv = (sv - m_new).exp();
                if !valid {
                    pv = f32::new(0.0);
                }
                l[h] = l[h] * alpha + plane_sum(pv);
                m[h] = m_new;
                p[h] = pv;
                #[unroll]
                for j in 0..hs {
                    acc[h * hs + j] *= alpha;
                }
            }
            // The lane's key's weights for the warp's heads, 4 heads a vector (heads past `hpw` weigh 0).
            #[unroll]
            for v in 0..pvn {
                let mut pv = Vector::<f32, N>::empty();
                #[unroll]
                for e in 0..4usize {
                    pv[e] = p[4 * v + e];
                }
                ps[(warp * 32 + lane) * pvn + v] = pv;
            }
            sync_plane();

            // Lane = value vectors lane + 32 j (dimensions 4 (lane + 32 j) ..+4): every key of the tile for the
            // warp's heads.
            for t in 0..32usize {
                #[unroll]
                for v in 0..pvn {
                    let pv = ps[(warp * 32 + t) * pvn + v];
                    #[unroll]
                    for e in 0..4usize {
                        w[4 * v + e] = pv[e];
                    }
                }
                #[unroll]
                for j in 0..rjv {
                    let mut v = Vector::<f32, N>::empty();
                    if full {
                        v = ks[t * kstv + lane + 32 * j];
                    } else {
                        v[0] = f32::new(0.0);
                        v[1] = f32::new(0.0);
                        v[2] = f32::new(0.0);
                        v[3] = f32::new(0.0);
                        if lane + 32 * j < comptime!(r / 4) {
                            v = ks[t * kstv + lane + 32 * j];
                        }
                    }
                    #[unroll]
                    for e in 0..4usize {
                        let a = 4 * j + e;
                        #[unroll]
                        for h in 0..hpw {
                            acc[h * hs + a] += w[h] * v[e];
                        }
                    }
                }
            }
        }

        let base = (split * n_rows + row) * heads;
        #[unroll]
        for h in 0..hpw {
            let head = h0 + warp * hpw + h;
            if head < heads {
                let mut inv = f32::new(0.0);
                if l[h] > f32::new(0.0) {
                    inv = f32::new(1.0) / l[h];
                }
                #[unroll]
                for j in 0..rjv {
                    if lane + 32 * j < comptime!(r / 4) {
                        let a = h * hs + 4 * j;
                        let mut o = Vector::<f32, N>::empty();
                        o[0] = acc[a] * inv;
                        o[1] = acc[a + 1] * inv;
                        o[2] = acc[a + 2] * inv;
                        o[3] = acc[a + 3] * inv;
                        o_part[(base + head) * comptime!(r / 4) + lane + 32 * j] = o;
                    }
                }
                if lane == 0 {
                    ml_part[(base + head) * 2] = m[h];
                    ml_part[(base + head) * 2 + 1] = l[h];
                }
            }
        }
    }

    /// `pool[slots[i]] = rows[i]` for each row `i` (`CUBE_POS_X`), 4-float vectors: the new latents of a step
    /// written into their cache rows in place, one launch for every sequence of the step.
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::manual_div_ceil)]
    pub fn write_rows_kernel<N: Size>(
        rows: &Array<Vector<f32, N>>,
        slots: &Array<u32>,
        pool: &mut Array<Vector<f32, N>>,
        #[comptime] width: usize,
    ) {
        let i = CUBE_POS_X as usize;
        let wv = comptime!(width / 4);
        let slot = slots[i] as usize;
        for it in 0..comptime!((width / 4).div_ceil(128)) {
            let v = it * 128 + UNIT_POS as usize;
            if v < wv {
                pool[slot * wv + v] = rows[i * wv + v];
            }
        }
    }

    /// Writes `rows` `[n, width]` f32 into rows `slots` of `pool` `[pool_rows, width]` f32, in place (the buffer
    /// is written whoever else holds it). `width` a multiple of 4.
    ///
    /// # Errors
    /// A message naming the parameter when a size does not fit or a slot lies outside the pool (nothing is
    /// launched then).
    pub fn write_rows<R: Runtime>(
        client: &ComputeClient<R>,
        rows: &Handle,
        slots: &[u32],
        pool: &Handle,
        pool_rows: usize,
        width: usize,
    ) -> Result<(), String> {
        let n = slots.len();
        if n == 0 {
            return Ok(());
        }
        if !width.is_multiple_of(4) {
            return Err(format!("write_rows: width {width} is not a multiple of 4"));
        }
        if let Some((i, s)) = slots.iter().enumerate().find(|(_, s)| **s as usize >= pool_rows) {
            return Err(format!("write_rows: slot {s} of row {i} lies outside the pool's {pool_rows} rows"));
        }
        for (name, h, bytes) in [("rows", rows, n * width * 4), ("pool", pool, pool_rows * width * 4)] {
            if (h.size_in_used() as usize) < bytes {
                return Err(format!("write_rows: {name} holds {} bytes, needs {bytes}", h.size_in_used()));
            }
        }
        let slots_dev = client.create_from_slice(u32::as_bytes(slots));
        // SAFETY: sizes and slots checked above; block i reads row i and writes row slots[i] < pool_rows.
        unsafe {
            write_rows_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(n as u32, 1, 1),
                CubeDim::new_1d(128),
                AddressType::from_len(pool_rows * width),
                4,
                ArrayArg::from_raw_parts(rows.clone(), n * width / 4),
                ArrayArg::from_raw_parts(slots_dev, n),
                ArrayArg::from_raw_parts(pool.clone(), pool_rows * width / 4),
                width,
            );
        }
        Ok(())
    }

    /// Launches every attention specialisation [`AttentionConfig::new`] can pick for `heads` heads over `cache`
    /// (`[slots, r + rot]` f32, at least 64 rows: the pool the model will read, so that the launches index it as
    /// the model's do), each over one query row of zeros that sees the pool's first 64 rows in two slices (so the
    /// combine compiles too), then the first of them in 9 slices (the combine of many slices): a warm-up, so that no
    /// kernel compiles at the first long context or wide batch.
    /// Nothing is written to `cache`. Returns the number of launch shapes ([`AttentionConfig::variants`]).
    ///
    /// # Errors
    /// As [`mla_attention`] (a size it refuses), or fewer than 64 cache rows.
    pub fn warm_up<R: Runtime>(
        client: &ComputeClient<R>,
        cache: &Handle,
        slots: usize,
        heads: usize,
        r: usize,
        rot: usize,
    ) -> Result<usize, String> {
        let (d, len) = (r + rot, 64usize);
        if slots < len {
            return Err(format!("attention warm-up: a cache of {slots} rows, at least {len} needed"));
        }
        let smem = client.properties().hardware.max_shared_memory_size;
        let rows =
            PagedRows { row_seq: vec![0], row_len: vec![len as u32], tables: vec![0], max_blocks: 1, block_size: len };
        let q = client.create_from_slice(u32::as_bytes(&vec![0u32; heads * d]));
        let meta = client.create_from_slice(u32::as_bytes(&rows.packed()));
        let out = client.empty(heads * r * 4);
        let mut variants = AttentionConfig::variants(heads, d, smem);
        variants.extend(crate::cuda::attention_dims::variants(r, rot, smem));
        if heads > super::FEW_HEADS {
            variants.extend(crate::cuda::attention_mma::variants(r, rot, smem));
        } else {
            variants.extend(crate::cuda::attention_tf32::variants(r, rot, smem));
        }
        for cfg in &variants {
            let cfg = AttentionConfig { splits: 2, ..*cfg };
            mla_attention(client, &q, cache, slots, &rows, &meta, &out, heads, r, rot, 1.0, cfg)?;
        }
        // And the combine of many slices (`attention_merge::combine_halves`): 9 slices of 32, the last 7 empty.
        if let Some(cfg) = variants.first() {
            let cfg = AttentionConfig { splits: 9, chunk: 32, ..*cfg };
            mla_attention(client, &q, cache, slots, &rows, &meta, &out, heads, r, rot, 1.0, cfg)?;
        }
        Ok(variants.len())
    }

    /// `out` `[rows, heads, r]` f32 = the attention of every query row (module docs of
    /// `eyrie_quant::cuda::attention`): `q` `[rows, heads, r + rot]` f32, `cache` `[slots, r + rot]` f32, `meta`
    /// the u32 buffer of [`PagedRows::packed`] for `rows`. Two launches when rows are split (the attention, then
    /// [`mla_combine_kernel`]), one otherwise.
    ///
    /// # Errors
    /// A message naming the parameter when a size does not fit or the page tables point outside the cache
    /// (nothing is launched then).
    #[allow(clippy::too_many_arguments)]
    pub fn mla_attention<R: Runtime>(
        client: &ComputeClient<R>,
        q: &Handle,
        cache: &Handle,
        slots: usize,
        rows: &PagedRows,
        meta: &Handle,
        out: &Handle,
        heads: usize,
        r: usize,
        rot: usize,
        scale: f32,
        cfg: AttentionConfig,
    ) -> Result<(), String> {
        let parts = mla_attention_parts(client, q, cache, slots, rows, meta, out, heads, r, rot, scale, cfg)?;
        merge_parts(client, &parts, rows.rows() * heads, r, out);
        Ok(())
    }

    /// [`mla_attention`]'s first launch alone: the attention kernel, its slices left unmerged (see
    /// [`AttentionParts`]); `out` is written only when `cfg` has one slice.
    ///
    /// # Errors
    /// As [`mla_attention`].
    #[allow(clippy::too_many_arguments)]
    pub fn mla_attention_parts<R: Runtime>(
        client: &ComputeClient<R>,
        q: &Handle,
        cache: &Handle,
        slots: usize,
        rows: &PagedRows,
        meta: &Handle,
        out: &Handle,
        heads: usize,
        r: usize,
        rot: usize,
        scale: f32,
        cfg: AttentionConfig,
    ) -> Result<AttentionParts, String> {
        let d = r + rot;
        let n = rows.rows();
        if n == 0 || heads == 0 || r == 0 || !r.is_multiple_of(32) || !rot.is_multiple_of(4) {
            return Err(format!(
                "mla_attention: rows {n}, heads {heads}, r {r}, rot {rot}: need rows, heads >= 1, r a multiple of 32 \
                 and rot of 4"
            ));
        }
        if n > super::MAX_ROWS {
            return Err(format!(
                "mla_attention: {n} query rows in one launch, at most {} (launch in parts)",
                super::MAX_ROWS
            ));
        }
        if !(1..=8).contains(&cfg.warps)
            || !super::HEADS_PER_WARP.contains(&cfg.hpw)
            || cfg.splits == 0
            || cfg.chunk == 0
            || !cfg.chunk.is_multiple_of(32)
        {
            return Err(format!("mla_attention: launch shape {cfg:?}"));
        }
        if let super::Lanes::Dims { key_warps, groups } = cfg.lanes {
            let smem = client.properties().hardware.max_shared_memory_size;
            if let Some(why) =
                crate::cuda::attention_dims::dims_refusal(r, rot, cfg.warps, key_warps, cfg.hpw, groups, smem)
            {
                return Err(format!("mla_attention: {why}"));
            }
        }
        if let super::Lanes::Mma { tiles, positions } = cfg.lanes {
            let smem = client.properties().hardware.max_shared_memory_size;
            let shape = crate::cuda::attention_mma::MmaShape { tiles, wk: cfg.warps / tiles.max(1), pt: positions };
            if let Some(why) = crate::cuda::attention_mma::mma_refusal(r, rot, shape, smem) {
                return Err(format!("mla_attention: {why}"));
            }
            if shape.config(cfg.splits, cfg.chunk) != cfg || !cfg.chunk.is_multiple_of(positions) {
                return Err(format!("mla_attention: launch shape {cfg:?} (tensor cores: 16 heads a tile)"));
            }
        }
        if let super::Lanes::Tf32 { positions, stages } = cfg.lanes {
            let smem = client.properties().hardware.max_shared_memory_size;
            let shape = crate::cuda::attention_tf32::Tf32Shape { warps: cfg.warps, pt: positions, stages };
            if let Some(why) = crate::cuda::attention_tf32::tf32_refusal(r, rot, shape, smem) {
                return Err(format!("mla_attention: {why}"));
            }
            if shape.config(cfg.splits, cfg.chunk) != cfg || !cfg.chunk.is_multiple_of(positions) {
                return Err(format!("mla_attention: launch shape {cfg:?} (TF32: 8 heads a block)"));
            }
        }
        rows.validate(slots).map_err(|e| format!("mla_attention: {e}"))?;
        let max_len = rows.row_len.iter().copied().max().unwrap_or(0) as usize;
        if cfg.splits * cfg.chunk < max_len {
            return Err(format!(
                "mla_attention: {} slices of {} positions do not cover {max_len}",
                cfg.splits, cfg.chunk
            ));
        }
        let meta_len = rows.packed_len();
        let sizes = [
            ("q", q, n * heads * d * 4),
            ("cache", cache, slots * d * 4),
            ("meta", meta, meta_len * 4),
            ("out", out, n * heads * r * 4),
        ];
        for (name, h, bytes) in sizes {
            if (h.size_in_used() as usize) < bytes {
                return Err(format!("mla_attention: {name} holds {} bytes, needs {bytes}", h.size_in_used()));
            }
        }
        let pairs = n * heads;
        // Partial outputs (only with several slices) and each slice's running max and sum, reserved together.
        let (o_part, o_len, ml_part) = if cfg.splits == 1 {
            let [ml_part] = crate::cuda::gpu::scratch(client, [pairs * 2 * 4]);
            (out.clone(), pairs * r, ml_part)
        } else {
            let [o_part, ml_part] =
                crate::cuda::gpu::scratch(client, [cfg.splits * pairs * r * 4, cfg.splits * pairs * 2 * 4]);
            (o_part, cfg.splits * pairs * r, ml_part)
        };
        let groups = heads.div_ceil(cfg.hpw * cfg.warps) as u32;
        let address = AddressType::from_len((slots * d).max(o_len).max(n * heads * d));
        let (rows_u, heads_u, chunk_u) = (n as u32, heads as u32, cfg.chunk as u32);
        let (max_blocks, block_size) = (rows.max_blocks as u32, rows.block_size as u32);
        // SAFETY: sizes and page tables checked above (`validate`: every block a row reads is inside the cache);
        // the kernels read `q` rows `< n` and heads `< heads`, positions `< row_len` through the tables, and write
        // `o_part`/`ml_part` at `(split, row, head < heads)`.
        unsafe {
            let q = ArrayArg::from_raw_parts(q.clone(), n * heads * d / 4);
            let cache = ArrayArg::from_raw_parts(cache.clone(), slots * d / 4);
            let meta = ArrayArg::from_raw_parts(meta.clone(), meta_len);
            let o_arg = ArrayArg::from_raw_parts(o_part.clone(), o_len / 4);
            let ml_arg = ArrayArg::from_raw_parts(ml_part.clone(), cfg.splits * pairs * 2);
            use crate::cuda::attention_dims::mla_attention_dims_kernel;
            use crate::cuda::attention_mma::mla_attention_mma_kernel;
            use crate::cuda::attention_tf32::mla_attention_tf32_kernel;
            // `$kernel` launched with the three decode kernels' shared arguments (in their order), then its own.
            macro_rules! launch_decode {
                ($kernel:ident, $count:expr, $dim:expr, $($own:expr),+ $(,)?) => {
                    $kernel::launch_unchecked::<R>(
                        client, $count, $dim, address, 4, q, cache, meta, o_arg, ml_arg, rows_u, heads_u, max_blocks,
                        block_size, chunk_u, scale, $($own),+
                    )
                };
            }
            match cfg.lanes {
                super::Lanes::Keys => launch_decode!(
                    mla_attention_kernel,
                    CubeCount::Static(cfg.splits as u32, rows_u, groups),
                    CubeDim::new_2d(32, cfg.warps as u32),
                    r,
                    rot,
                    cfg.warps,
                    cfg.hpw
                ),
                super::Lanes::Dims { key_warps, groups: sg } => {
                    launch_decode!(
                        mla_attention_dims_kernel,
                        CubeCount::Static(groups, cfg.splits as u32, rows_u),
                        CubeDim::new_2d(32, (cfg.warps * key_warps) as u32),
                        r,
                        rot,
                        cfg.warps,
                        key_warps,
                        cfg.hpw,
                        sg
                    )
                }
                super::Lanes::Mma { tiles, positions } => {
                    launch_decode!(
                        mla_attention_mma_kernel,
                        CubeCount::Static(groups, cfg.splits as u32, rows_u),
                        CubeDim::new_2d(32, cfg.warps as u32),
                        r,
                        rot,
                        tiles,
                        cfg.warps / tiles,
                        positions
                    )
                }
                super::Lanes::Tf32 { positions, stages } => {
                    launch_decode!(
                        mla_attention_tf32_kernel,
                        CubeCount::Static(groups, cfg.splits as u32, rows_u),
                        CubeDim::new_2d(32, cfg.warps as u32),
                        r,
                        rot,
                        cfg.warps,
                        positions,
                        stages
                    )
                }
            }
        }
        Ok(AttentionParts { o: o_part, ml: ml_part, splits: cfg.splits })
    }
}

#[cfg(test)]
#[path = "attention_tests.rs"]
mod tests;
