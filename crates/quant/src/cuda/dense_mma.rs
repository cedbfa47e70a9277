//! The BF16-weight GEMV on tensor cores at f32 precision, for 1 to 16 tokens (batched decode steps, verification):
//! `out [n, rows] = x [n, k] W^T` for `W` `[rows, k]` BF16 as a checkpoint stores it and f32 activations, and its
//! gated form `silu(x Wg^T) * (x Wu^T)` (an MLP's gate and up projections with the activation). The same math as
//! [`super::dense::gemv_bf16`] (every BF16 weight is an f32; f32 activations; f32 sums) with the weights read once
//! for all the tokens, where the CUDA-core GEMV is issue-bound in f32 above a few tokens (bench/REPORT.md, session
//! 10: 8 tokens took 3.3x the time of one for the same weight bytes).
//!
//! # Operands (as [`super::moe_mma`])
//!
//! - A (16 rows x 16 columns of `W`): the BF16 weights themselves, a packed pair one A register.
//! - B (16 columns x 8): the activations as three exact BF16 parts `x = hi + mid + lo`
//!   ([`super::gemm::split_bf16x3`]: each part the remainder of the previous one with its low 16 bits cut), one B
//!   column per part and token: column `3 t + p` is part `p` of token `t`, so one MMA covers 2 tokens and
//!   `ceil(3 tb / 8)` MMAs cover `tb`. Every product of two BF16s is exact in f32; a token's parts are added in f32
//!   at the end.
//! - Accumulation: each stretch of 128 columns (8 MMAs chained through the tensor core's accumulator) starts from
//!   zero and is added into f32 registers, so the tensor core's truncating adds never run long (`super::gemm`
//!   measured what long chains cost).
//!
//! # The K order is the lanes' own
//!
//! An MMA sums over its 16 K slots in any order, so the kernel chooses which matrix column each slot of each lane
//! is and gives B the same choice. Lane `(g, c)` (`g = lane / 4`, `c = lane % 4`) loads, for each 32-column
//! stretch `s` of a row, its 16-byte vector `4 s + c` (columns `32 s + 8 c .. + 8`) of rows `g` and `g + 8` of its
//! 16-row tile: one coalesced load each, no lane loading what another uses. MMA `u` (0, 1) of the stretch takes
//! words `2 u` and `2 u + 1` of each lane's vector as the lane's K slots `(2c, 2c + 1)` and `(2c + 8, 2c + 9)`:
//! columns `32 s + 8 c + 4 u + (0, 1)` and `+ (2, 3)`. B's lane `(g, c)` holds the same K slots of its column, which
//! are the same words of vector `4 s + c` of that column's part in the plain split layout (`[3, n, k]` BF16,
//! [`super::gemm::split_bf16x3_kernel`]): no permutation on either side.
//!
//! # Work split
//!
//! One warp task = `tiles` consecutive 16-row tiles (gated: a gate tile and the matching up tile), all sharing the
//! B registers. `ksplit` warps share a task, each taking every `ksplit`-th stretch of 128 columns (loaded in blocks
//! of `32 bv`), and add up through shared memory; `tasks` tasks a block. A warp loads its next block while it computes the current one (two register sets). B comes from global
//! memory (L1/L2-resident: every warp reads the same few KB of split activations).
//!
//! The CPU model of the index algebra is the test below; the GPU check against [`super::dense::gemv_reference`]
//! (f64) is `examples/gpu_gemv.rs`.

/// Most tokens one launch of [`gemv_mma`] takes.
pub const MMA_GEMV_MAX_TOKENS: usize = 16;

/// Launch shape of [`gemv_mma`] (kernel specialisations).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MmaGemvConfig {
    /// Most tokens of the launch: `ceil(3 tb / 8)` n tiles of 8 B columns (`tb` = the most the tiles hold).
    pub tb: usize,
    /// 16-row m tiles a warp task computes (sharing the B registers; gated: 1, the gate tile and its up tile).
    pub tiles: usize,
    /// Warp tasks a block.
    pub tasks: usize,
    /// Warps sharing a task, each taking every `ksplit`-th block of columns.
    pub ksplit: usize,
    /// 16-byte vectors a lane loads per row per block: blocks of `32 bv` columns.
    pub bv: usize,
    /// Gate and up (`silu(gate) * up`) instead of one matrix.
    pub gated: bool,
}

impl MmaGemvConfig {
    /// The launch shape for `n` tokens (1 to [`MMA_GEMV_MAX_TOKENS`]) of a `[rows, k]` matrix (`k` a multiple of
    /// 128, `rows` of 16) on a device of `sms` multiprocessors, or `None` when the kernel does not take the shape.
    /// Blocks of 128 columns a lane-load at up to 5 tokens (2 n tiles), 64 columns and two m tiles a task sharing B
    /// at up to 10, 32 columns and two m tiles above (the B operands come from L1 and would cost more load
    /// instructions than the weights otherwise: session 11's first kernel, one m tile and 32 columns at 16 tokens, ran
    /// at 18-27% of the bandwidth); gated: 64 columns up to 10 tokens, 32 above. Then k-split warps (up to 8, each
    /// keeping 4 or more blocks of 128 columns) until about 16 warps a multiprocessor have a task.
    pub fn new(n: usize, rows: usize, k: usize, gated: bool, sms: usize) -> Option<Self> {
        if n == 0
            || n > MMA_GEMV_MAX_TOKENS
            || k == 0
            || !k.is_multiple_of(128)
            || rows == 0
            || !rows.is_multiple_of(16)
        {
            return None;
        }
        let ntiles = (3 * n).div_ceil(8);
        let tb = 8 * ntiles / 3;
        let (bv, mut tiles) = match (gated, ntiles) {
            (false, 1..=2) => (4, 1),
            (false, 3..=4) => (2, 2),
            (false, _) => (1, 2),
            (true, 1..=4) => (2, 1),
            (true, _) => (1, 1),
        };
        if !rows.is_multiple_of(16 * tiles) {
            tiles = 1;
        }
        let task_count = rows / (16 * tiles);
        let superblocks = k / 128;
        let mut ksplit = 1;
        while ksplit < 8 && task_count * ksplit < 16 * sms && superblocks >= 8 * ksplit {
            ksplit *= 2;
        }
        let tasks = (8 / ksplit).min(task_count).max(1);
        Some(Self { tb, tiles, tasks, ksplit, bv, gated })
    }

    /// B tiles of 8 columns (3 a token).
    pub fn ntiles(&self) -> usize {
        (3 * self.tb).div_ceil(8)
    }

    /// Rows of one warp task.
    pub fn task_rows(&self) -> usize {
        16 * self.tiles
    }

    /// Blocks of a launch over `rows` rows.
    pub fn blocks(&self, rows: usize) -> usize {
        (rows / self.task_rows()).div_ceil(self.tasks)
    }

    /// Shared memory of a block: the k-split warps' accumulators.
    pub fn shared_bytes(&self) -> usize {
        let mtiles = if self.gated { 2 } else { self.tiles };
        if self.ksplit > 1 { 4 * self.tasks * self.ksplit * mtiles * self.ntiles() * 4 * 32 } else { 4 }
    }
}

#[cfg(feature = "cuda")]
pub use gpu::{gemv_mma, gemv_mma_kernel};

#[cfg(feature = "cuda")]
mod gpu {
    use burn::cubecl;
    use cubecl::prelude::*;
    use cubecl::server::Handle;
    use half::bf16;

    use super::MmaGemvConfig;
    use crate::cuda::moe_mma::{ksplit_reduce, mma_into, token_sum};

    /// Loads block `blk` for one lane: the A vectors of rows `g`, `g + 8` of each m tile (`wrow[2 mt + h]`: the
    /// rows' first vectors; gated: m tile 0 from `w`, 1 from `wu`), and the B vectors of the lane's column in each n
    /// tile (zeros where the lane has no column).
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn load_block<N: Size>(
        xs: &Array<Vector<u32, N>>,
        w: &Array<Vector<u32, N>>,
        wu: &Array<Vector<u32, N>>,
        wrow: &Array<usize>,
        xrow: &Array<usize>,
        xok: &Array<u32>,
        wa: &mut Array<Vector<u32, N>>,
        xb: &mut Array<Vector<u32, N>>,
        blk: usize,
        c: usize,
        #[comptime] ntiles: usize,
        #[comptime] mtiles: usize,
        #[comptime] bv: usize,
        #[comptime] gated: bool,
    ) {
        let v0 = blk * comptime!(4 * bv) + c;
        #[unroll]
        for mt in 0..mtiles {
            #[unroll]
            for h in 0..2usize {
                #[unroll]
                for b in 0..bv {
                    let idx = wrow[2 * mt + h] + v0 + 4 * b;
                    if gated {
                        if mt == 0 {
                            wa[(2 * mt + h) * bv + b] = w[idx];
                        } else {
                            wa[(2 * mt + h) * bv + b] = wu[idx];
                        }
                    } else {
                        wa[(2 * mt + h) * bv + b] = w[idx];
                    }
                }
            }
        }
        #[unroll]
        for nt in 0..ntiles {
            #[unroll]
            for b in 0..bv {
                let mut z = Vector::<u32, N>::empty();
                z[0] = u32::new(0);
                z[1] = u32::new(0);
                z[2] = u32::new(0);
                z[3] = u32::new(0);
                if xok[nt] == 1 {
                    z = xs[xrow[nt] + v0 + 4 * b];
                }
                xb[nt * bv + b] = z;
            }
        }
    }

    /// `out [n, rows] = x W^T` (or `silu(x Wg^T) * (x Wu^T)` when `gated`) on tensor cores (module docs).
    ///
    /// - `xs`: the split activations `[3, n, k]` BF16 as 16-byte vectors (part `p` of token `t` at vector
    ///   `(p n + t) k / 8`).
    /// - `w` (`wu`): `[rows, k]` BF16 as 16-byte vectors (`wu` is read only when `gated`).
    /// - `out`: `[n, rows]` f32.
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::too_many_arguments, clippy::manual_div_ceil, clippy::collapsible_if)]
    pub fn gemv_mma_kernel<N: Size>(
        xs: &Array<Vector<u32, N>>,
        w: &Array<Vector<u32, N>>,
        wu: &Array<Vector<u32, N>>,
        out: &mut Array<f32>,
        tokens: u32,
        rows: u32,
        #[comptime] k: usize,
        #[comptime] tb: usize,
        #[comptime] tiles: usize,
        #[comptime] tasks: usize,
        #[comptime] ksplit: usize,
        #[comptime] bv: usize,
        #[comptime] gated: bool,
    ) {
        let lane = UNIT_POS_X as usize;
        let warp = UNIT_POS_Y as usize;
        let g = lane / 4;
        let c = lane % 4;
        let n = tokens as usize;
        let rows = rows as usize;

        let kv = comptime!(k / 8);
        let nblk = comptime!(k / (32 * bv));
        // Blocks a tensor-core chain: 128 columns.
        let fl = comptime!(4 / bv);
        let nsb = comptime!(k / 128);
        let ntiles = comptime!((3 * tb).div_ceil(8));
        let mtiles = comptime!(if gated { 2 } else { tiles });
        let nacc = comptime!(mtiles * (3 * tb).div_ceil(8) * 4);
        let nwa = comptime!(2 * mtiles * bv);
        let nxb = comptime!((3 * tb).div_ceil(8) * bv);

        let mut red = SharedMemory::<f32>::new(comptime!(if ksplit > 1 { tasks * ksplit * nacc * 32 } else { 1 }));

        let task = CUBE_POS_X as usize * tasks + warp / ksplit;
        let part = warp % ksplit;
        let j0 = task * comptime!(16 * if gated { 1 } else { tiles });
        let active = j0 < rows;

        // This lane's B column in each n tile: part `col % 3` of token `col / 3`, or none (zeros).
        let mut xrow = Array::<usize>::new(comptime!((3 * tb).div_ceil(8)));
        let mut xok = Array::<u32>::new(comptime!((3 * tb).div_ceil(8)));
        #[unroll]
        for nt in 0..ntiles {
            let col = 8 * nt + g;
            let t = col / 3;
            xok[nt] = u32::new(0);
            xrow[nt] = 0;
            if col < comptime!(3 * tb) && t < n {
                xok[nt] = u32::new(1);
                xrow[nt] = ((col % 3) * n + t) * kv;
            }
        }
        // This lane's weight rows (their first vectors): `g` and `g + 8` of each m tile (gated: the same rows of
        // the gate and the up matrix).
        let mut wrow = Array::<usize>::new(comptime!(2 * if gated { 2 } else { tiles }));
        #[unroll]
        for mt in 0..mtiles {
            let mut r0 = j0 + 16 * mt;
            if gated {
                r0 = j0;
            }
            wrow[2 * mt] = (r0 + g) * kv;
            wrow[2 * mt + 1] = (r0 + g + 8) * kv;
        }

        let mut acc = Array::<f32>::new(comptime!(mtiles * (3 * tb).div_ceil(8) * 4));
        #[unroll]
        for a in 0..nacc {
            acc[a] = f32::new(0.0);
        }

        if active {
            // Software pipeline: block i's operands are in (wa, xb) while block i + ksplit's load; the last block
            // reloads itself (a clamped index keeps every load in range and the loop free of branches).
            let mut wa = Array::<Vector<u32, N>>::new(comptime!(2 * mtiles * bv));
            let mut xb = Array::<Vector<u32, N>>::new(comptime!((3 * tb).div_ceil(8) * bv));
            let mut wn = Array::<Vector<u32, N>>::new(comptime!(2 * mtiles * bv));
            let mut xn = Array::<Vector<u32, N>>::new(comptime!((3 * tb).div_ceil(8) * bv));
            // The warp's blocks: superblocks (128 columns, `fl` blocks, one tensor-core chain) part, part +
            // ksplit, ...
            let mut first = part * fl;
            if first >= nblk {
                first = nblk - 1;
            }
            load_block::<N>(xs, w, wu, &wrow, &xrow, &xok, &mut wa, &mut xb, first, c, ntiles, mtiles, bv, gated);
            let mut sb = part;
            while sb < nsb {
                // This superblock's MMAs per (m tile, n tile), from a zero accumulator.
                let mut blk = Array::<f32>::new(comptime!(mtiles * (3 * tb).div_ceil(8) * 4));
                #[unroll]
                for a in 0..nacc {
                    blk[a] = f32::new(0.0);
                }
                #[unroll]
                for f in 0..fl {
                    let mut next = sb * fl + f + 1;
                    if f == fl - 1 {
                        next = (sb + ksplit) * fl;
                    }
                    if next >= nblk {
                        next = nblk - 1;
                    }
                    load_block::<N>(
                        xs, w, wu, &wrow, &xrow, &xok, &mut wn, &mut xn, next, c, ntiles, mtiles, bv, gated,
                    );
                    #[unroll]
                    for b in 0..bv {
                        #[unroll]
                        for u in 0..2usize {
                            #[unroll]
                            for mt in 0..mtiles {
                                let mut ra = Array::<Vector<bf16, Const<2>>>::new(4usize);
                                let lo = wa[(2 * mt) * bv + b];
                                let hi = wa[(2 * mt + 1) * bv + b];
                                ra[0] = Vector::<bf16, Const<2>>::reinterpret(lo[2 * u]);
                                ra[1] = Vector::<bf16, Const<2>>::reinterpret(hi[2 * u]);
                                ra[2] = Vector::<bf16, Const<2>>::reinterpret(lo[2 * u + 1]);
                                ra[3] = Vector::<bf16, Const<2>>::reinterpret(hi[2 * u + 1]);
                                #[unroll]
                                for nt in 0..ntiles {
                                    let xv = xb[nt * bv + b];
                                    let mut rb = Array::<Vector<bf16, Const<2>>>::new(2usize);
                                    rb[0] = Vector::<bf16, Const<2>>::reinterpret(xv[2 * u]);
                                    rb[1] = Vector::<bf16, Const<2>>::reinterpret(xv[2 * u + 1]);
                                    mma_into(&ra, &rb, &mut blk, (mt * ntiles + nt) * 4);
                                }
                            }
                        }
                    }
                    #[unroll]
                    for q in 0..nwa {
                        wa[q] = wn[q];
                    }
                    #[unroll]
                    for q in 0..nxb {
                        xb[q] = xn[q];
                    }
                }
                #[unroll]
                for a in 0..nacc {
                    acc[a] += blk[a];
                }
                sb += ksplit;
            }
        }

        // The k-split warps of a task add up through shared memory (every warp reaches both barriers).
        if ksplit > 1 {
            ksplit_reduce(&mut acc, &mut red, warp, lane, part, nacc, ksplit);
        }

        if active && part == 0 {
            // Lane (g, c) holds columns 2c, 2c + 1 of each n tile for rows g (h = 0) and g + 8 (h = 1); a token's
            // three parts are spread over the quad: sum the lane's share, then across the quad.
            #[unroll]
            for t in 0..tb {
                if t < n {
                    #[unroll]
                    for h in 0..2usize {
                        let mut vals = Array::<f32>::new(comptime!(if gated { 2 } else { tiles }));
                        #[unroll]
                        for mt in 0..mtiles {
                            vals[mt] = token_sum(&acc, t, h, mt, c, ntiles);
                        }
                        if c == 0 {
                            let r = j0 + g + 8 * h;
                            if gated {
                                let a = vals[0];
                                out[t * rows + r] = a / (f32::new(1.0) + (-a).exp()) * vals[1];
                            } else {
                                #[unroll]
                                for mt in 0..mtiles {
                                    out[t * rows + r + 16 * mt] = vals[mt];
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// `out [n, rows] = x [n, k] W^T` (`wu` `None`), or `silu(x Wg^T) * (x Wu^T)` with `w` = `Wg` and `wu` = `Wu`,
    /// on tensor cores (module docs): the split of `x` into three BF16 parts (one launch,
    /// [`crate::cuda::gemm::split_bf16x3_kernel`], into a scratch buffer), then one launch of [`gemv_mma_kernel`].
    /// `x` f32 `[n, k]`, `w`/`wu` BF16 `[rows, k]`, `out` f32 `[n, rows]`, all dense. Refused (nothing launched):
    /// sizes that the buffers do not hold, `n` above `cfg.tb`, `k` not a multiple of 128, `rows` not of 16, a
    /// gated config without `wu` or the reverse.
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_mma<R: Runtime>(
        client: &ComputeClient<R>,
        x: &Handle,
        w: &Handle,
        wu: Option<&Handle>,
        out: &Handle,
        n: usize,
        rows: usize,
        k: usize,
        cfg: MmaGemvConfig,
    ) -> Result<(), String> {
        let tr = cfg.task_rows();
        if n == 0 || n > cfg.tb || !k.is_multiple_of(128) || k == 0 || rows == 0 || !rows.is_multiple_of(tr) {
            return Err(format!(
                "gemv_mma: n {n}, rows {rows}, k {k}: need 1 <= n <= tb {}, k a multiple of 128, rows of {tr}",
                cfg.tb
            ));
        }
        if cfg.gated && cfg.tiles != 1 {
            return Err(format!(
                "gemv_mma: gated with {} m tiles a task (one: the gate tile and its up tile)",
                cfg.tiles
            ));
        }
        if cfg.gated != wu.is_some() {
            return Err(format!("gemv_mma: gated {} but up weights given: {}", cfg.gated, wu.is_some()));
        }
        if ![1, 2, 4].contains(&cfg.bv) || ![1, 2, 4, 8].contains(&cfg.ksplit) || cfg.tasks == 0 || cfg.tiles == 0 {
            return Err(format!("gemv_mma: launch shape {cfg:?}"));
        }
        let mut sizes = vec![("x", x, n * k * 4), ("W", w, rows * k * 2), ("out", out, n * rows * 4)];
        if let Some(u) = wu {
            sizes.push(("Wu", u, rows * k * 2));
        }
        for (name, h, bytes) in sizes {
            if (h.size_in_used() as usize) < bytes {
                return Err(format!("gemv_mma: {name} holds {} bytes, needs {bytes}", h.size_in_used()));
            }
        }
        let words = n * k / 2;
        let [split] = crate::cuda::gpu::scratch(client, [3 * words * 4]);
        let address = AddressType::from_len((3 * words).max(rows * k / 2).max(n * rows));
        let wu = wu.unwrap_or(w);
        // SAFETY: sizes checked above; the split writes `3 words` words, the GEMV reads rows `< rows` of `W`/`Wu`
        // (`rows` a multiple of 16: every task's tile is whole), vectors `< 3 n k / 8` of the split and writes `out`
        // at `[t < n, r < rows]`.
        unsafe {
            crate::cuda::gemm::launch_split_bf16x3::<R>(client, x, &split, words);
            gemv_mma_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(cfg.blocks(rows) as u32, 1, 1),
                CubeDim::new_2d(32, (cfg.tasks * cfg.ksplit) as u32),
                address,
                4,
                ArrayArg::from_raw_parts(split.clone(), 3 * words / 4),
                ArrayArg::from_raw_parts(w.clone(), rows * k / 8),
                ArrayArg::from_raw_parts(wu.clone(), rows * k / 8),
                ArrayArg::from_raw_parts(out.clone(), n * rows),
                n as u32,
                rows as u32,
                k,
                cfg.tb,
                cfg.tiles,
                cfg.tasks,
                cfg.ksplit,
                cfg.bv,
                cfg.gated,
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The kernel's K order and work split, modelled on the CPU: every lane's A and B registers for every MMA of
    //! every block, exact products of the split parts, a token's parts summed; against the plain f64 dot product.
    use super::*;
    use crate::cuda::SplitMix64;
    use crate::cuda::gemm::{bf16_value, split_bf16x3};

    #[test]
    fn lanes_pair_every_weight_with_its_own_column() {
        let (rows, k, n) = (32usize, 256usize, 5usize);
        let mut rng = SplitMix64::new(5);
        let w: Vec<u16> = (0..rows * k).map(|_| half::bf16::from_f32(rng.next_f32() - 0.5).to_bits()).collect();
        let x: Vec<f32> = (0..n * k).map(|_| rng.next_f32() - 0.5).collect();
        // The split layout: [3, n, k] BF16.
        let split: Vec<u16> = (0..3).flat_map(|p| x.iter().map(move |&v| split_bf16x3(v)[p])).collect();
        let cfg = MmaGemvConfig::new(n, rows, k, false, 132).unwrap();
        let ntiles = cfg.ntiles();
        for bv in [1, 2, 4] {
            let nblk = k / (32 * bv);
            for j0 in (0..rows).step_by(16) {
                // out[t][r] accumulated per lane: (g, c) holds rows g, g+8 and columns 2c, 2c+1 of each n tile.
                let mut got = vec![0f64; n * rows];
                let mut seen = vec![0u32; rows * k];
                for blk in 0..nblk {
                    for b in 0..bv {
                        for u in 0..2 {
                            // One MMA per n tile: D[m][col] += sum over K slots A[m][slot] B[slot][col].
                            for nt in 0..ntiles {
                                for m in 0..16 {
                                    for col8 in 0..8 {
                                        let col = 8 * nt + col8;
                                        let (t, p) = (col / 3, col % 3);
                                        for c in 0..4 {
                                            // Lane (g, c)'s vector of this stretch: columns 8 (4 s + c) ..+8.
                                            let v0 = (blk * 4 * bv + 4 * b + c) * 8;
                                            // K slots (2c, 2c+1): word 2u; (2c+8, 2c+9): word 2u + 1.
                                            for word in [2 * u, 2 * u + 1] {
                                                for e in 0..2 {
                                                    let kcol = v0 + 2 * word + e;
                                                    if nt == 0 && col8 == 0 {
                                                        seen[(j0 + m) * k + kcol] += 1;
                                                    }
                                                    if col < 3 * cfg.tb && t < n {
                                                        let a = f64::from(bf16_value(w[(j0 + m) * k + kcol]));
                                                        let bb = f64::from(bf16_value(split[(p * n + t) * k + kcol]));
                                                        got[t * rows + j0 + m] += a * bb;
                                                    }
                                                }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
                for r in j0..j0 + 16 {
                    assert!((0..k).all(|kc| seen[r * k + kc] == 1), "bv {bv} row {r}: every column once");
                    for t in 0..n {
                        let want: f64 =
                            (0..k).map(|kc| f64::from(bf16_value(w[r * k + kc])) * f64::from(x[t * k + kc])).sum();
                        let g = got[t * rows + r];
                        assert!((g - want).abs() <= 1e-12 * want.abs().max(1.0), "bv {bv} row {r} token {t}");
                    }
                }
            }
        }
    }

    #[test]
    fn shapes_take_every_width_and_refuse_what_the_kernel_cannot() {
        for n in 1..=MMA_GEMV_MAX_TOKENS {
            for (rows, k) in [(384, 7168), (576, 7168), (1536, 7168), (7168, 8192), (163_840, 7168), (2048, 7168)] {
                for gated in [false, true] {
                    let c = MmaGemvConfig::new(n, rows, k, gated, 132).unwrap();
                    assert!(c.tb >= n && 3 * c.tb <= 8 * c.ntiles(), "{c:?}");
                    assert!(k / (32 * c.bv) >= c.ksplit, "{c:?}");
                    assert!(c.tasks * c.ksplit <= 8 && c.blocks(rows) * c.tasks * c.task_rows() >= rows, "{c:?}");
                    assert!(rows.is_multiple_of(c.task_rows()) && (!gated || c.tiles == 1), "{c:?}");
                    assert!(k / 128 >= c.ksplit, "{c:?}");
                    assert!(c.shared_bytes() <= 48 * 1024, "{c:?}");
                }
            }
        }
        assert!(MmaGemvConfig::new(0, 384, 7168, false, 132).is_none());
        assert!(MmaGemvConfig::new(17, 384, 7168, false, 132).is_none());
        assert!(MmaGemvConfig::new(4, 384, 7000, false, 132).is_none());
        assert!(MmaGemvConfig::new(4, 385, 7168, false, 132).is_none());
    }
}
