//! The MoE router on the device: DeepSeek-V3's `noaux_tc` top-k ([`route_kernel`], one block per token) and the
//! grouping of the token-expert pairs by expert ([`group_kernel`], one block), so a layer's fused MoE runs without
//! reading its routing back to the host (a read drains the whole queue every MoE layer, and the host can then
//! never run ahead of the GPU).
//!
//! The math is transformers' `DeepseekV3TopkRouter` (and `eyrie_model::moe::route`, the host reference the GPU
//! check compares against): `s = sigmoid(logit)`; selection scores `s + bias`; group score = sum of the two best
//! selection scores of the group; the `topk_group` best groups are kept, the others' scores set to -inf; the
//! `top_k` best selection scores are the experts (ties to the lower index, as a stable descending sort gives);
//! weights `s[e]`, divided by their sum + 1e-20 when `norm`, times the scaling factor (in that order, so the f32
//! rounding matches the host's).
//!
//! The grouping is [`super::Routing::new`]'s, on the device: experts by class (1 token, 2 tokens, 3 or more),
//! ascending within a class, each expert's pairs ascending. The host does not learn the class sizes; it sizes each
//! class's launch by an estimate ([`class_grid`]) and the MoE kernels loop over the slots the device wrote
//! (`expert_rows_kernel`'s `bounds`), so any estimate is correct and a good one wastes no blocks.

/// The router's sizes and hyperparameters (the kernels' specialisation, and the scaling factor).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterSpec {
    /// Routed experts `E` (at most [`MAX_DEVICE_EXPERTS`]).
    pub experts: usize,
    /// Expert groups (dividing `experts`; 1 = no group selection).
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the `top_k` weights.
    pub norm_topk_prob: bool,
    /// Multiplier of the weights.
    pub routed_scaling_factor: f32,
}

/// Most routed experts the device router takes (the grouping holds one thread per expert in one block).
pub const MAX_DEVICE_EXPERTS: usize = 1024;

/// Threads of a [`route_kernel`] block. Group scores and the one-token grouping take a thread each, so `n_group`
/// and `top_k` are at most this. (One warp measured slower: 8.4 -> 17.8 us a token on the H200, bench/REPORT.md.)
pub const ROUTE_THREADS: usize = 128;

/// Pair ids staged in shared memory at a time by [`group_kernel`].
pub const GROUP_CHUNK: usize = 4096;

impl RouterSpec {
    /// Checks what the kernels need: `1 <= top_k <= experts <= MAX_DEVICE_EXPERTS`, `n_group` dividing `experts`
    /// with at least 2 experts a group when there are several, `1 <= topk_group <= n_group`, and enough experts in
    /// the kept groups for `top_k`. Errors name the field.
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |field: &str, why: String| Err(crate::QuantError::invalid(field, why));
        if self.experts == 0 || self.experts > MAX_DEVICE_EXPERTS {
            return bad(
                "n_routed_experts",
                format!("{}: the device router takes 1..={MAX_DEVICE_EXPERTS}", self.experts),
            );
        }
        if self.n_group == 0 || !self.experts.is_multiple_of(self.n_group) {
            return bad("n_group", format!("{} does not divide {} experts", self.n_group, self.experts));
        }
        if self.n_group > 1 && self.experts / self.n_group < 2 {
            return bad(
                "n_group",
                format!("{} groups of {} experts: a group score needs two", self.n_group, self.experts),
            );
        }
        if self.n_group > ROUTE_THREADS {
            return bad("n_group", format!("{}: the device router takes at most {ROUTE_THREADS} groups", self.n_group));
        }
        if self.top_k > ROUTE_THREADS {
            return bad(
                "num_experts_per_tok",
                format!("{}: the device router takes at most {ROUTE_THREADS}", self.top_k),
            );
        }
        if self.topk_group == 0 || self.topk_group > self.n_group {
            return bad("topk_group", format!("{} with {} groups", self.topk_group, self.n_group));
        }
        if self.top_k == 0 || self.top_k > self.topk_group * (self.experts / self.n_group) {
            return bad("num_experts_per_tok", format!("{} with {} kept groups", self.top_k, self.topk_group));
        }
        Ok(())
    }

    /// Threads of a [`group_kernel`] block: one per expert, a power of two for its scans.
    pub fn group_threads(&self) -> usize {
        self.experts.next_power_of_two().max(32)
    }
}

/// Grid heights of the three class launches of the MoE kernels for `m` tokens of `top_k` experts among `experts`
/// when the class sizes are only known on the device: the most experts a class can hold (an expert takes a
/// token at most once, so class `c` needs `m > c` and holds at most `pairs / (c + 1)`), capped near the count
/// expected of independent uniform routing (Poisson with `lambda = pairs / experts`) with a 25% margin. A class
/// with more experts than its grid has them looped over by the same blocks; a class with fewer leaves blocks that
/// exit at once.
pub fn class_grid(m: usize, top_k: usize, experts: usize) -> [u32; 3] {
    let pairs = m * top_k;
    let lambda = pairs as f64 / experts as f64;
    let p0 = (-lambda).exp();
    let p = [p0 * lambda, p0 * lambda * lambda / 2.0, 1.0 - p0 * (1.0 + lambda + lambda * lambda / 2.0)];
    let mut out = [0u32; 3];
    for c in 0..3 {
        if m > c {
            let cap = experts.min(pairs / (c + 1));
            let expect = (1.25 * experts as f64 * p[c].max(0.0)).ceil() as usize + 2;
            out[c] = cap.min(expect) as u32;
        }
    }
    out
}

#[cfg(feature = "cuda")]
pub use gpu::{group_kernel, route_kernel, route_on_device};

// Kernel code is CubeCL, not Rust: nested `if`s of comptime and runtime conditions, branches kept apart for
// reading and `usize` builtins are expanded as written.
#[cfg(feature = "cuda")]
#[allow(
    clippy::collapsible_if,
    clippy::collapsible_else_if,
    clippy::if_same_then_else,
    clippy::unnecessary_cast,
    clippy::manual_div_ceil
)]
mod gpu {
    use burn::cubecl;
    use cubecl::prelude::*;
    use cubecl::server::Handle;

    use super::{GROUP_CHUNK, ROUTE_THREADS, RouterSpec, class_grid};
    use crate::cuda::GpuRouting;
    use crate::cuda::moe_mma::split_x3_word;

    /// Whether candidate `(ov, oi)` beats `(mv, mi)`: `invalid` marks no candidate; a higher score wins, a tie goes
    /// to the lower index.
    #[cube]
    fn beats(ov: f32, oi: u32, mv: f32, mi: u32, invalid: u32) -> bool {
        let mut win = false;
        if oi != invalid {
            if mi == invalid {
                win = true;
            } else if ov > mv {
                win = true;
            } else if ov == mv && oi < mi {
                win = true;
            }
        }
        win
    }

    /// `noaux_tc` routing of one token per block (see the module docs): `logits` `[m, experts]` f32 (the gate's
    /// output, before the sigmoid), `bias` `[experts]` f32; writes `ids` and `weights` `[m, top_k]`, best first.
    ///
    /// With `grouped` (one token, one block) it also writes what [`group_kernel`] would: the token's `top_k`
    /// distinct experts are all one-token experts, so `experts_out` is them ascending, slot `i` holds pair
    /// `pairs_out[i]` (the expert's position in the token's list), `offsets` `0..=top_k` and `bounds`
    /// `[0, top_k, top_k, top_k]`; a decode step of one sequence then routes in one launch instead of two. Without
    /// it those four arrays are not touched.
    ///
    /// With `split_k` (the hidden size; 0: none) the launch also writes the MoE layer's input split (what
    /// `moe_mma::split_x3_kernel` writes for `x` `[tokens, split_k]` f32 into `x_split`), in blocks `tokens ..`
    /// beside the routing blocks `0 .. tokens`, so the layer does not wait for a launch of its own (session 26: a
    /// separate split launch costs ~4-6 us of GPU time at one token).
    #[cube(launch_unchecked)]
    #[allow(clippy::too_many_arguments)]
    pub fn route_kernel(
        logits: &Array<f32>,
        bias: &Array<f32>,
        ids: &mut Array<u32>,
        weights: &mut Array<f32>,
        experts_out: &mut Array<u32>,
        offsets: &mut Array<u32>,
        pairs_out: &mut Array<u32>,
        bounds: &mut Array<u32>,
        x: &Array<f32>,
        x_split: &mut Array<u32>,
        scale: f32,
        tokens: u32,
        #[comptime] experts: usize,
        #[comptime] n_group: usize,
        #[comptime] topk_group: usize,
        #[comptime] top_k: usize,
        #[comptime] norm: bool,
        #[comptime] grouped: bool,
        #[comptime] split_k: usize,
    ) {
        // Block-uniform: a block routes a token or splits words, never both (the routing's barriers stay whole).
        if comptime!(split_k > 0) && CUBE_POS >= tokens as usize {
            let idx = (CUBE_POS - tokens as usize) * comptime!(ROUTE_THREADS) + UNIT_POS as usize;
            if idx < tokens as usize * comptime!(split_k / 2) {
                split_x3_word::<f32>(x, x_split, idx, split_k);
            }
        } else {
            route_token(
                logits,
                bias,
                ids,
                weights,
                experts_out,
                offsets,
                pairs_out,
                bounds,
                scale,
                experts,
                n_group,
                topk_group,
                top_k,
                norm,
                grouped,
            );
        }
    }

    /// [`route_kernel`]'s routing of token `CUBE_POS` (every thread of the block calls it).
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn route_token(
        logits: &Array<f32>,
        bias: &Array<f32>,
        ids: &mut Array<u32>,
        weights: &mut Array<f32>,
        experts_out: &mut Array<u32>,
        offsets: &mut Array<u32>,
        pairs_out: &mut Array<u32>,
        bounds: &mut Array<u32>,
        scale: f32,
        #[comptime] experts: usize,
        #[comptime] n_group: usize,
        #[comptime] topk_group: usize,
        #[comptime] top_k: usize,
        #[comptime] norm: bool,
        #[comptime] grouped: bool,
    ) {
        let t = CUBE_POS as usize;
        let tid = UNIT_POS as usize;
        let threads = comptime!(ROUTE_THREADS);
        let per_thread = comptime!(experts.div_ceil(ROUTE_THREADS));
        let invalid = u32::new(comptime!(experts as i64));
        let mut s = SharedMemory::<f32>::new(experts);
        let mut c = SharedMemory::<f32>::new(experts);
        let mut taken = SharedMemory::<u32>::new(experts);
        let mut chosen = SharedMemory::<u32>::new(top_k);

        #[unroll]
        for i in 0..per_thread {
            let e = i * threads + tid;
            if e < experts {
                let x = logits[t * experts + e];
                let sv = f32::new(1.0) / (f32::new(1.0) + (-x).exp());
                s[e] = sv;
                c[e] = sv + bias[e];
                taken[e] = 0;
            }
        }
        sync_cube();

        if comptime!(n_group > 1) {
            let per_group = comptime!(experts / n_group);
            let mut gs = SharedMemory::<f32>::new(n_group);
            let mut keep = SharedMemory::<u32>::new(n_group);
            if tid < n_group {
                // The group's two best selection scores (a tie for the best counts twice, as a sorted list has it).
                let mut b1 = f32::new(-f32::MAX);
                let mut b2 = f32::new(-f32::MAX);
                for j in 0..per_group {
                    let v = c[tid * per_group + j];
                    if v > b1 {
                        b2 = b1;
                        b1 = v;
                    } else if v > b2 {
                        b2 = v;
                    }
                }
                gs[tid] = b1 + b2;
                keep[tid] = 0;
            }
            sync_cube();
            if tid == 0 {
                for _r in 0..topk_group {
                    let mut bg = u32::new(comptime!(n_group as i64));
                    let mut bv = f32::new(-f32::MAX);
                    for g in 0..n_group {
                        if keep[g] == 0 {
                            if beats(gs[g], g as u32, bv, bg, u32::new(comptime!(n_group as i64))) {
                                bg = g as u32;
                                bv = gs[g];
                            }
                        }
                    }
                    keep[bg as usize] = 1;
                }
            }
            sync_cube();
            #[unroll]
            for i in 0..per_thread {
                let e = i * threads + tid;
                if e < experts {
                    if keep[e / per_group] == 0 {
                        c[e] = f32::new(-f32::MAX);
                    }
                }
            }
            sync_cube();
        }

        // Each round's argmax: a thread's best over its experts, the warp's by a butterfly of xor shuffles (every
        // lane ends with it), then every thread takes the best of the warps' (written to a buffer that alternates
        // by round, so one barrier a round suffices). `beats` is a total order (score, then lower index), so any
        // reduction order picks the same expert as a sorted list.
        let warps = comptime!(ROUTE_THREADS / 32);
        let mut warp_v = SharedMemory::<f32>::new(2 * warps);
        let mut warp_i = SharedMemory::<u32>::new(2 * warps);
        let lane = tid % 32;
        let warp = tid / 32;
        for r in 0..top_k {
            let mut bv = f32::new(-f32::MAX);
            let mut bi = invalid;
            #[unroll]
            for i in 0..per_thread {
                let e = i * threads + tid;
                if e < experts {
                    if taken[e] == 0 {
                        if beats(c[e], e as u32, bv, bi, invalid) {
                            bv = c[e];
                            bi = e as u32;
                        }
                    }
                }
            }
            #[unroll]
            for step in 0..5u32 {
                let ov = plane_shuffle_xor(bv, 16u32 >> step);
                let oi = plane_shuffle_xor(bi, 16u32 >> step);
                if beats(ov, oi, bv, bi, invalid) {
                    bv = ov;
                    bi = oi;
                }
            }
            let buf = (r % 2) * warps;
            if lane == 0 {
                warp_v[buf + warp] = bv;
                warp_i[buf + warp] = bi;
            }
            sync_cube();
            let mut wv = warp_v[buf];
            let mut wi = warp_i[buf];
            #[unroll]
            for w in 1..warps {
                if beats(warp_v[buf + w], warp_i[buf + w], wv, wi, invalid) {
                    wv = warp_v[buf + w];
                    wi = warp_i[buf + w];
                }
            }
            // `taken[e]` is read and written only by the thread owning expert `e`.
            if wi != invalid && (wi as usize) % threads == tid {
                taken[wi as usize] = 1;
            }
            if tid == 0 {
                chosen[r] = wi;
            }
        }

        if tid == 0 {
            let mut sum = f32::new(0.0);
            #[unroll]
            for j in 0..top_k {
                sum += s[chosen[j] as usize];
            }
            let denom = sum + f32::new(1e-20);
            #[unroll]
            for j in 0..top_k {
                let e = chosen[j];
                let mut w = s[e as usize];
                if norm {
                    w /= denom;
                }
                ids[t * top_k + j] = e;
                weights[t * top_k + j] = w * scale;
            }
        }
        if grouped {
            // `chosen` is thread 0's (its last entry written after the last round's barrier).
            sync_cube();
            if tid < top_k {
                let e = chosen[tid];
                let mut rank = u32::new(0);
                #[unroll]
                for q in 0..top_k {
                    if chosen[q] < e {
                        rank += 1;
                    }
                }
                experts_out[rank as usize] = e;
                pairs_out[rank as usize] = tid as u32;
                offsets[tid + 1] = tid as u32 + 1;
            }
            if tid == 0 {
                offsets[0] = 0;
                bounds[0] = 0;
                bounds[1] = u32::new(comptime!(top_k as i64));
                bounds[2] = u32::new(comptime!(top_k as i64));
                bounds[3] = u32::new(comptime!(top_k as i64));
            }
        }
    }

    /// Block-wide inclusive prefix sum of `v` over `threads` (a power of two) threads, in `scan`; every thread
    /// gets its own prefix. The caller reads anything else of `scan` (the total at `threads - 1`) before a
    /// `sync_cube` and the next scan.
    #[cube]
    fn inclusive_scan(scan: &mut SharedMemory<u32>, tid: usize, v: u32, #[comptime] threads: usize) -> u32 {
        scan[tid] = v;
        sync_cube();
        #[unroll]
        for step in 0..comptime!(threads.trailing_zeros()) {
            let off = comptime!(1usize << step);
            let mut add = u32::new(0);
            if tid >= off {
                add = scan[tid - off];
            }
            sync_cube();
            scan[tid] += add;
            sync_cube();
        }
        scan[tid]
    }

    /// Groups the `n_pairs` token-expert pairs of `ids` (`[m, top_k]`, pair `p = t * top_k + j`) by expert as
    /// [`crate::cuda::Routing::new`] does, in one block of `threads` threads (thread `e` owns expert `e`):
    /// `experts_out` `[experts]` (the active experts by class, ascending in a class), `offsets` `[experts + 1]`
    /// into `pairs_out` `[n_pairs]`, and `bounds` `[4]` (class `c`'s slots are `bounds[c]..bounds[c + 1]`).
    /// Slots past the active experts are not written.
    #[cube(launch_unchecked)]
    #[allow(clippy::too_many_arguments)]
    pub fn group_kernel(
        ids: &Array<u32>,
        experts_out: &mut Array<u32>,
        offsets: &mut Array<u32>,
        pairs_out: &mut Array<u32>,
        bounds: &mut Array<u32>,
        n_pairs: u32,
        #[comptime] experts: usize,
        #[comptime] threads: usize,
    ) {
        let tid = UNIT_POS as usize;
        let chunk_len = comptime!(GROUP_CHUNK);
        let loads = comptime!(GROUP_CHUNK / threads);
        let mut chunk = SharedMemory::<u32>::new(chunk_len);
        let mut scan = SharedMemory::<u32>::new(threads);
        let mut by_pos = SharedMemory::<u32>::new(threads);
        let total = n_pairs as usize;
        let n_chunks = (total + chunk_len - 1) / chunk_len;
        let me = tid as u32;

        // Tokens routed to expert `tid`.
        let mut count = u32::new(0);
        for ch in 0..n_chunks {
            let base = ch * chunk_len;
            #[unroll]
            for i in 0..loads {
                let j = i * threads + tid;
                if base + j < total {
                    chunk[j] = ids[base + j];
                }
            }
            sync_cube();
            let mut len = total - base;
            if len > chunk_len {
                len = chunk_len;
            }
            if tid < experts {
                for j in 0..len {
                    if chunk[j] == me {
                        count += 1;
                    }
                }
            }
            sync_cube();
        }

        // Class 0: one token, 1: two, 2: three or more; rank in the class by expert index.
        let active = tid < experts && count > 0;
        let mut class = u32::new(3);
        if active {
            class = 2;
            if count == 1 {
                class = 0;
            } else if count == 2 {
                class = 1;
            }
        }
        // Slot of this expert: the experts of the classes before its own, then its rank in its class; the class
        // bounds are the running totals.
        let mut pos = u32::new(0);
        let mut before = u32::new(0);
        #[unroll]
        for c in 0..3u32 {
            let mut ind = u32::new(0);
            if class == c {
                ind = 1;
            }
            let rank = inclusive_scan(&mut scan, tid, ind, threads);
            let total = scan[threads - 1];
            sync_cube();
            if class == c {
                pos = before + rank - 1;
            }
            before += total;
            if tid == 0 {
                bounds[c as usize + 1] = before;
            }
        }
        by_pos[tid] = 0;
        sync_cube();
        if active {
            by_pos[pos as usize] = count;
            experts_out[pos as usize] = me;
        }
        sync_cube();
        // Offsets: the prefix sum of the counts in slot order.
        let slot_count = by_pos[tid];
        let incl = inclusive_scan(&mut scan, tid, slot_count, threads);
        sync_cube();
        if tid < experts {
            offsets[tid + 1] = incl;
        }
        if tid == 0 {
            offsets[0] = 0;
            bounds[0] = 0;
        }
        // This expert's first pair: the exclusive prefix at its slot.
        by_pos[tid] = incl - slot_count;
        sync_cube();
        let mut cursor = u32::new(0);
        if active {
            cursor = by_pos[pos as usize];
        }

        // Its pairs, ascending.
        for ch in 0..n_chunks {
            let base = ch * chunk_len;
            #[unroll]
            for i in 0..loads {
                let j = i * threads + tid;
                if base + j < total {
                    chunk[j] = ids[base + j];
                }
            }
            sync_cube();
            let mut len = total - base;
            if len > chunk_len {
                len = chunk_len;
            }
            if active {
                for j in 0..len {
                    if chunk[j] == me {
                        pairs_out[cursor as usize] = (base + j) as u32;
                        cursor += 1;
                    }
                }
            }
            sync_cube();
        }
    }

    /// Routes `m` tokens on the device: `logits` `[m, spec.experts]` f32 (the gate's output), `bias`
    /// `[spec.experts]` f32 (`e_score_correction_bias`). Two launches (route, group), one for a single token; nothing
    /// is read back.
    ///
    /// `split`: the MoE layer's input `x` (`[m, hidden]` f32) and `hidden`; the route launch then also writes the
    /// input's BF16x3 split, which the routing carries and [`crate::cuda::moe_forward`] uses instead of its own
    /// split launch (pass the same `x` to both).
    ///
    /// # Errors
    /// `spec` fails [`RouterSpec::validate`], `m` is 0, or `hidden` is not a positive multiple of 32.
    pub fn route_on_device<R: Runtime>(
        client: &ComputeClient<R>,
        spec: &RouterSpec,
        logits: &Handle,
        bias: &Handle,
        m: usize,
        split: Option<(&Handle, usize)>,
    ) -> crate::Result<GpuRouting> {
        spec.validate()?;
        if m == 0 {
            return Err(crate::QuantError::invalid("m", "no tokens to route".to_string()));
        }
        if let Some((_, hidden)) = split
            && (hidden == 0 || hidden % 32 != 0)
        {
            return Err(crate::QuantError::invalid("hidden", format!("{hidden}: the split takes a multiple of 32")));
        }
        let (e, k) = (spec.experts, spec.top_k);
        let pairs = m * k;
        // One request to the server for all six (`crate::cuda::gpu::scratch`).
        let [ids, weights, experts, offsets, pair_ids, bounds] =
            crate::cuda::gpu::scratch(client, [pairs * 4, pairs * 4, e * 4, (e + 1) * 4, pairs * 4, 4 * 4]);
        let threads = spec.group_threads();
        // One token: the route kernel writes the grouping itself (its experts are distinct, all one-token).
        let grouped = m == 1;
        let split_k = split.map_or(0, |(_, hidden)| hidden);
        let split_words = m * split_k / 2;
        // Without a split the kernel's `x` and `x_split` are never touched (`split_k` 0 compiles that branch out):
        // `logits` stands in for the input and a one-word buffer for the output (not an alias of another output).
        let x_split = client.empty(3 * split_words.max(1) * 4);
        let (x_arg, x_len) = split.map_or((logits, m * e), |(x, _)| (x, m * split_k));
        let xs_len = 3 * split_words.max(1);
        let split_blocks = split_words.div_ceil(ROUTE_THREADS);
        // SAFETY: `logits` holds `[m, E]` and `bias` `[E]` f32 (the caller's contract, sizes checked by the
        // kernels' array lengths); every output is allocated above at the size the kernels write: ids/weights/pairs
        // `m * k`, experts `E`, offsets `E + 1`, bounds 4 (the grouped route writes `k <= E` experts and pairs and
        // `k + 1` offsets). Expert ids written are `< E` (each block picks among its `E` scores), so the grouping's
        // per-expert threads cover them all. With a split, `x` holds `[m, split_k]` f32 (the caller's contract) and
        // `x_split` is allocated above at the `3 * m * split_k / 2` words the split blocks write (guarded).
        unsafe {
            route_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static((m + split_blocks) as u32, 1, 1),
                CubeDim::new_1d(ROUTE_THREADS as u32),
                ArrayArg::from_raw_parts(logits.clone(), m * e),
                ArrayArg::from_raw_parts(bias.clone(), e),
                ArrayArg::from_raw_parts(ids.clone(), pairs),
                ArrayArg::from_raw_parts(weights.clone(), pairs),
                ArrayArg::from_raw_parts(experts.clone(), e),
                ArrayArg::from_raw_parts(offsets.clone(), e + 1),
                ArrayArg::from_raw_parts(pair_ids.clone(), pairs),
                ArrayArg::from_raw_parts(bounds.clone(), 4),
                ArrayArg::from_raw_parts(x_arg.clone(), x_len),
                ArrayArg::from_raw_parts(x_split.clone(), xs_len),
                spec.routed_scaling_factor,
                m as u32,
                e,
                spec.n_group,
                spec.topk_group,
                k,
                spec.norm_topk_prob,
                grouped,
                split_k,
            );
        }
        let x_split = split.map(|_| (x_split, split_k));
        if grouped {
            return Ok(GpuRouting::from_device(
                m,
                k,
                e,
                class_grid(m, k, e),
                ids,
                experts,
                offsets,
                pair_ids,
                weights,
                bounds,
                x_split,
            ));
        }
        // SAFETY: as above.
        unsafe {
            group_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(threads as u32),
                ArrayArg::from_raw_parts(ids.clone(), pairs),
                ArrayArg::from_raw_parts(experts.clone(), e),
                ArrayArg::from_raw_parts(offsets.clone(), e + 1),
                ArrayArg::from_raw_parts(pair_ids.clone(), pairs),
                ArrayArg::from_raw_parts(bounds.clone(), 4),
                pairs as u32,
                e,
                threads,
            );
        }
        Ok(GpuRouting::from_device(
            m,
            k,
            e,
            class_grid(m, k, e),
            ids,
            experts,
            offsets,
            pair_ids,
            weights,
            bounds,
            x_split,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(experts: usize, n_group: usize, topk_group: usize, top_k: usize) -> RouterSpec {
        RouterSpec { experts, n_group, topk_group, top_k, norm_topk_prob: true, routed_scaling_factor: 2.827 }
    }

    #[test]
    fn specs_the_kernels_cannot_take_are_refused_by_field() {
        assert!(spec(384, 1, 1, 8).validate().is_ok());
        assert!(spec(256, 8, 4, 8).validate().is_ok());
        let field = |s: RouterSpec| s.validate().unwrap_err().to_string();
        assert!(field(spec(2048, 1, 1, 8)).contains("n_routed_experts"));
        assert!(field(spec(384, 5, 1, 8)).contains("n_group"));
        assert!(field(spec(8, 8, 1, 1)).contains("n_group"));
        assert!(field(spec(256, 8, 9, 8)).contains("topk_group"));
        assert!(field(spec(16, 8, 1, 3)).contains("num_experts_per_tok"));
        assert!(field(spec(1024, 256, 1, 8)).contains("n_group"));
        assert!(field(spec(1024, 1, 1, 129)).contains("num_experts_per_tok"));
        assert_eq!(spec(384, 1, 1, 8).group_threads(), 512);
        assert_eq!(spec(8, 1, 1, 2).group_threads(), 32);
    }

    #[test]
    fn class_grids_cover_what_a_class_can_hold() {
        // One token: its experts are all 1-token experts, exactly top_k of them.
        assert_eq!(class_grid(1, 8, 384), [8, 0, 0]);
        // Two tokens: no expert can have 3.
        assert_eq!(class_grid(2, 8, 384)[2], 0);
        for m in [3, 8, 32, 128, 1024, 8192] {
            let g = class_grid(m, 8, 384);
            let pairs = m * 8;
            for (c, &n) in g.iter().enumerate() {
                assert!(n >= 1 && n as usize <= 384.min(pairs / (c + 1)), "m {m} class {c}: {n}");
            }
        }
        // A long prefill: every expert has many tokens.
        assert_eq!(class_grid(8192, 8, 384)[2], 384);
        // Batch 8: about 54 experts with one token, 4.5 with two.
        let g = class_grid(8, 8, 384);
        assert!((54..=64).contains(&g[0]) && (6..=8).contains(&g[1]), "{g:?}");
    }
}
