//! MLA attention of prefill chunks in its MHA form (DeepSeek-V2, arXiv:2405.04434, section 2.1): the latents of
//! every position a chunk sees are expanded once through `kv_b_proj` into per-head keys and values, and the chunk's
//! queries attend to them causally, flash-attention style (no score matrix in memory). Per head `h`, query row `i`
//! (position `start + i`) and key `t`:
//!
//! `o[i, h] = sum_{t <= start + i} softmax_t(scale * [q_nope | q_pe][i, h] . [k_nope[t, h] | k_pe[t]]) * v[t, h]`
//!
//! with `q` `nope + rot` wide (192 for Kimi-K2: 128 + 64), `k_pe` shared by the heads (the latent cache's RoPE part)
//! and `v` `vd` wide (128). Against the absorbed form that decode runs ([`super::attention`]: `r + rot = 576` wide
//! scores and `r = 512` wide values per head and key) this is `(576 + 512) / (192 + 128) = 3.4x` fewer
//! multiply-adds a (row, head, key); the expansion costs `2 r H (nope + vd)` flops a key, once per chunk, on the
//! tensor cores (the caller's f32-exact GEMM). Decode and verification rows keep the absorbed form: one or a few
//! rows cannot pay for expanding their whole context.
//!
//! Arithmetic: f32 on the CUDA cores throughout (no TF32, no BF16 operands), as the absorbed kernel; the two forms
//! are the same sums in another order (`q_nope . (W_uk c) = (q_nope W_uk) . c`), so they agree to f32 rounding.
//!
//! # Work split
//!
//! A block of 256 threads owns one head and a tile of [`Q_TILE`] query rows; it walks the keys the tile sees in
//! tiles of [`K_TILE`]. Thread `(ty, tx)` (`tid = 16 ty + tx`) computes the scores of rows `4 ty .. 4 ty + 4` and keys
//! `4 tx .. 4 tx + 4` (a 4 x 4 register tile: two 16-byte shared-memory loads feed 16 multiply-adds) and owns the
//! output of the same rows over value columns `4 (tx + 16 u) .. + 4`. Shared memory holds the queries transposed
//! (`[nope + rot][64 rows]`, loaded once), one buffer that is in turn each half of the key tile transposed
//! (`[(nope + rot) / 2][64 keys]`) and the value tile (`[64 keys][vd]`), and the tile's softmax weights transposed
//! (`[64 keys][64 rows]`, rows padded by one vector). The online softmax keeps each row's running max and sum;
//! a row's 16 threads are one half-warp, so its max and sum are four xor shuffles. For Kimi-K2's shapes the block
//! uses 99,328 bytes of shared memory: under SM120's 99 KiB a block, two blocks a multiprocessor on the H200.
//!
//! The positions a chunk sees may be split into segments (so the expanded keys of a long context need not be in
//! memory at once): each segment's launch writes its normalized output and its running max and sum per (row, head),
//! and [`super::attention::mla_combine_kernel`] merges the segments (log-sum-exp weights).
//!
//! The CPU reference is [`mha_prefill_reference`] (f64), always built and tested in CI; the GPU check against it is
//! `examples/gpu_attention.rs --prefill`.

/// Query rows a block owns.
pub const Q_TILE: usize = 64;
/// Keys a block loads at a time.
pub const K_TILE: usize = 64;
/// Threads a block.
pub const THREADS: usize = 256;

/// The head dimensions of the MHA form: query/key `nope + rot`, value `vd`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MhaDims {
    /// Non-rotary query/key part (per head).
    pub nope: usize,
    /// Rotary query/key part (the key's is shared by all heads).
    pub rot: usize,
    /// Value width (per head).
    pub vd: usize,
}

impl MhaDims {
    /// Shared memory of one block (bytes): queries `[nope + rot][64]`, the key-half / value buffer, the weights
    /// `[64][64 + 4]`.
    pub fn shared_bytes(&self) -> usize {
        let dq = self.nope + self.rot;
        4 * (dq * Q_TILE + (dq / 2 * K_TILE).max(K_TILE * self.vd) + K_TILE * (Q_TILE + 4))
    }

    /// Whether the kernel takes these dimensions on a device of `smem` bytes of shared memory a block: `nope`,
    /// `rot` multiples of 4 with `nope + rot` a multiple of 8, `vd` a multiple of 64 (each thread owns `vd / 16`
    /// output columns of 4 rows), and the block's shared memory within `smem`.
    ///
    /// # Errors
    /// A message naming the dimension or the shared memory that does not fit.
    pub fn check(&self, smem: usize) -> Result<(), String> {
        let (nope, rot, vd) = (self.nope, self.rot, self.vd);
        if nope == 0 || !nope.is_multiple_of(4) || !rot.is_multiple_of(4) || !(nope + rot).is_multiple_of(8) {
            return Err(format!(
                "MHA prefill attention: nope {nope}, rot {rot}: need multiples of 4 with nope + rot a multiple of 8"
            ));
        }
        if vd == 0 || !vd.is_multiple_of(64) {
            return Err(format!("MHA prefill attention: vd {vd}: need a multiple of 64"));
        }
        let bytes = self.shared_bytes();
        if bytes > smem {
            return Err(format!(
                "MHA prefill attention: {bytes} bytes of shared memory a block, the device has {smem}"
            ));
        }
        Ok(())
    }
}

/// The attention of one chunk over one segment of keys, on the CPU in f64 (the kernel's reference):
///
/// - `q` `[n, heads, nope + rot]`: query row `i` is at position `start + i` (RoPE already applied);
/// - `kv` `[keys, heads, nope + vd]`: per key of the segment and head, `k_nope` then `v`;
/// - `kpe` `[keys, kpe_width]`: per key, its shared `k_pe` at columns `kpe_col .. kpe_col + rot`;
/// - key `t` of the segment is at position `key0 + t`; row `i` sees the keys at positions `<= start + i`.
///
/// Returns `[n, heads, vd]`, normalized; a row that sees no key of the segment gets zeros.
#[allow(clippy::too_many_arguments)]
pub fn mha_prefill_reference(
    q: &[f32],
    kv: &[f32],
    kpe: &[f32],
    kpe_width: usize,
    kpe_col: usize,
    n: usize,
    heads: usize,
    dims: MhaDims,
    start: usize,
    key0: usize,
    keys: usize,
    scale: f64,
) -> Vec<f32> {
    let MhaDims { nope, rot, vd } = dims;
    let (dq, kw) = (nope + rot, nope + vd);
    let mut out = vec![0.0f32; n * heads * vd];
    for i in 0..n {
        let see = (start + i + 1).saturating_sub(key0).min(keys);
        for h in 0..heads {
            let qr = &q[(i * heads + h) * dq..][..dq];
            let scores: Vec<f64> = (0..see)
                .map(|t| {
                    let k = &kv[(t * heads + h) * kw..][..nope];
                    let pe = &kpe[t * kpe_width + kpe_col..][..rot];
                    let s: f64 = (0..nope).map(|j| f64::from(qr[j]) * f64::from(k[j])).sum::<f64>()
                        + (0..rot).map(|j| f64::from(qr[nope + j]) * f64::from(pe[j])).sum::<f64>();
                    s * scale
                })
                .collect();
            let Some(mx) = scores.iter().copied().reduce(f64::max) else { continue };
            let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let sum: f64 = w.iter().sum();
            for c in 0..vd {
                let acc: f64 = (0..see).map(|t| w[t] * f64::from(kv[(t * heads + h) * kw + nope + c])).sum();
                out[(i * heads + h) * vd + c] = (acc / sum) as f32;
            }
        }
    }
    out
}

#[cfg(feature = "cuda")]
pub use gpu::{combine_segments, mha_prefill_attention, mha_prefill_kernel};

#[cfg(feature = "cuda")]
mod gpu {
    use burn::cubecl;
    use cubecl::prelude::*;
    use cubecl::server::Handle;

    use super::{MhaDims, Q_TILE, THREADS};
    use crate::cuda::attention::gpu::zeros4;

    /// Four 16-byte vectors (rows) transposed into four (columns): `out[c][e] = in[e][c]`, column `c` stored at
    /// `smem[base + c * stride]`.
    #[cube]
    fn store_transposed<N: Size>(
        smem: &mut SharedMemory<Vector<f32, N>>,
        a0: Vector<f32, N>,
        a1: Vector<f32, N>,
        a2: Vector<f32, N>,
        a3: Vector<f32, N>,
        base: usize,
        stride: usize,
    ) {
        #[unroll]
        for c in 0..4usize {
            let mut t = Vector::<f32, N>::empty();
            t[0] = a0[c];
            t[1] = a1[c];
            t[2] = a2[c];
            t[3] = a3[c];
            smem[base + c * stride] = t;
        }
    }

    /// One block: head `CUBE_POS_X`, query tile `CUBE_POS_Y` counted from the last (the longest rows start first),
    /// over the keys of one segment (module docs).
    ///
    /// - `q` `[n, heads, (nope + rot) / 4]` vectors; `kv` `[keys, heads, (nope + vd) / 4]`; `kpe`: key `t`'s
    ///   `k_pe` at vectors `kpe_off + t * kpe_stride ..`;
    /// - `o_part` `[segments, n, heads, vd / 4]` (this launch writes segment `seg`), `ml_part`
    ///   `[segments, n, heads, 2]` (running max and sum).
    #[cube(launch_unchecked, address_type = "dynamic")]
    #[allow(clippy::too_many_arguments, clippy::manual_div_ceil, clippy::collapsible_if)]
    pub fn mha_prefill_kernel<N: Size>(
        q: &Array<Vector<f32, N>>,
        kv: &Array<Vector<f32, N>>,
        kpe: &Array<Vector<f32, N>>,
        o_part: &mut Array<Vector<f32, N>>,
        ml_part: &mut Array<f32>,
        n_rows: u32,
        heads: u32,
        start: u32,
        key0: u32,
        keys: u32,
        seg: u32,
        kpe_stride: u32,
        kpe_off: u32,
        scale: f32,
        #[comptime] nope: usize,
        #[comptime] rot: usize,
        #[comptime] vd: usize,
    ) {
        let tid = UNIT_POS as usize;
        let tx = tid % 16;
        let ty = tid / 16;
        let n = n_rows as usize;
        let heads = heads as usize;
        let h = CUBE_POS_X as usize;
        let qtiles = (n + 63) / 64;
        let q0 = (qtiles - 1 - CUBE_POS_Y as usize) * 64;
        let dq4 = comptime!((nope + rot) / 4);
        let kc = comptime!((nope + rot) / 2);
        let kc4 = comptime!((nope + rot) / 8);
        let nope4 = comptime!(nope / 4);
        let dv4 = comptime!(vd / 4);
        let kvw4 = comptime!((nope + vd) / 4);
        let ov = comptime!(vd / 64);
        let kpe_stride = kpe_stride as usize;
        let kpe_off = kpe_off as usize;
        let start = start as usize;
        let key0 = key0 as usize;

        // Keys of the segment the tile's last row sees (the rows before it see a prefix of them).
        let mut last = q0 + 63;
        if last >= n {
            last = n - 1;
        }
        let see = start + last + 1;
        let mut kend = 0usize;
        if see > key0 {
            kend = see - key0;
        }
        if kend > keys as usize {
            kend = keys as usize;
        }

        let mut qs = SharedMemory::<Vector<f32, N>>::new(comptime!((nope + rot) * 16));
        let mut kvs = SharedMemory::<Vector<f32, N>>::new(comptime!(((nope + rot) / 2 * 16).max(64 * vd / 4)));
        let mut pt = SharedMemory::<Vector<f32, N>>::new(comptime!(64usize * 17));

        // Queries transposed: thread (part, g) loads dimensions 4 d4 .. + 4 of rows 4 g .. + 4 and stores them as
        // four vectors of 4 rows (rows past `n` are 0).
        let g = tid % 16;
        let part = tid / 16;
        for it in 0..comptime!(((nope + rot) / 4).div_ceil(16)) {
            let d4 = it * 16 + part;
            if d4 < dq4 {
                let r0 = q0 + 4 * g;
                let mut a0 = zeros4::<N>();
                let mut a1 = zeros4::<N>();
                let mut a2 = zeros4::<N>();
                let mut a3 = zeros4::<N>();
                if r0 < n {
                    a0 = q[(r0 * heads + h) * dq4 + d4];
                }
                if r0 + 1 < n {
                    a1 = q[((r0 + 1) * heads + h) * dq4 + d4];
                }
                if r0 + 2 < n {
                    a2 = q[((r0 + 2) * heads + h) * dq4 + d4];
                }
                if r0 + 3 < n {
                    a3 = q[((r0 + 3) * heads + h) * dq4 + d4];
                }
                store_transposed::<N>(&mut qs, a0, a1, a2, a3, 4 * d4 * 16 + g, 16usize);
            }
        }

        let mut o = Array::<f32>::new(comptime!(16 * (vd / 64)));
        #[unroll]
        for a in 0..comptime!(16 * (vd / 64)) {
            o[a] = f32::new(0.0);
        }
        let mut m = Array::<f32>::new(4usize);
        let mut l = Array::<f32>::new(4usize);
        #[unroll]
        for i in 0..4usize {
            m[i] = f32::new(-1.0e30);
            l[i] = f32::new(0.0);
        }
        let mut s = Array::<f32>::new(16usize);

        let ntiles = (kend + 63) / 64;
        for kt in 0..ntiles {
            let k0 = kt * 64;
            #[unroll]
            for a in 0..16usize {
                s[a] = f32::new(0.0);
            }
            // Scores over the two halves of the query/key dimensions.
            #[unroll]
            for c in 0..2usize {
                // The previous readers of the buffer (and, the first time, the queries' writers) are done.
                sync_cube();
                for it in 0..comptime!(((nope + rot) / 8).div_ceil(16)) {
                    let d4 = it * 16 + part;
                    if d4 < kc4 {
                        let gd4 = c * kc4 + d4;
                        let t0 = k0 + 4 * g;
                        let mut a0 = zeros4::<N>();
                        let mut a1 = zeros4::<N>();
                        let mut a2 = zeros4::<N>();
                        let mut a3 = zeros4::<N>();
                        if gd4 < nope4 {
                            if t0 < kend {
                                a0 = kv[(t0 * heads + h) * kvw4 + gd4];
                            }
                            if t0 + 1 < kend {
                                a1 = kv[((t0 + 1) * heads + h) * kvw4 + gd4];
                            }
                            if t0 + 2 < kend {
                                a2 = kv[((t0 + 2) * heads + h) * kvw4 + gd4];
                            }
                            if t0 + 3 < kend {
                                a3 = kv[((t0 + 3) * heads + h) * kvw4 + gd4];
                            }
                        } else {
                            let pe = kpe_off + gd4 - nope4;
                            if t0 < kend {
                                a0 = kpe[t0 * kpe_stride + pe];
                            }
                            if t0 + 1 < kend {
                                a1 = kpe[(t0 + 1) * kpe_stride + pe];
                            }
                            if t0 + 2 < kend {
                                a2 = kpe[(t0 + 2) * kpe_stride + pe];
                            }
                            if t0 + 3 < kend {
                                a3 = kpe[(t0 + 3) * kpe_stride + pe];
                            }
                        }
                        store_transposed::<N>(&mut kvs, a0, a1, a2, a3, 4 * d4 * 16 + g, 16usize);
                    }
                }
                sync_cube();
                for d4 in 0..kc4 {
                    #[unroll]
                    for u in 0..4usize {
                        let d = 4 * d4 + u;
                        let qa = qs[(c * kc + d) * 16 + ty];
                        let kb = kvs[d * 16 + tx];
                        #[unroll]
                        for i in 0..4usize {
                            #[unroll]
                            for j in 0..4usize {
                                s[4 * i + j] += qa[i] * kb[j];
                            }
                        }
                    }
                }
            }

            // Online softmax: a row's 16 threads are lanes `16 (ty % 2) .. + 16` of one warp.
            let kp = key0 + k0 + 4 * tx;
            #[unroll]
            for i in 0..4usize {
                let rowpos = start + q0 + 4 * ty + i;
                let mut mx = f32::new(-1.0e30);
                #[unroll]
                for j in 0..4usize {
                    let mut sv = s[4 * i + j] * scale;
                    if k0 + 4 * tx + j >= kend || kp + j > rowpos {
                        sv = f32::new(-1.0e30);
                    }
                    s[4 * i + j] = sv;
                    mx = f32::max(mx, sv);
                }
                mx = f32::max(mx, plane_shuffle_xor(mx, 1u32));
                mx = f32::max(mx, plane_shuffle_xor(mx, 2u32));
                mx = f32::max(mx, plane_shuffle_xor(mx, 4u32));
                mx = f32::max(mx, plane_shuffle_xor(mx, 8u32));
                let m_new = f32::max(m[i], mx);
                let alpha = (m[i] - m_new).exp();
                let mut sum = f32::new(0.0);
                #[unroll]
                for j in 0..4usize {
                    let mut p = (s[4 * i + j] - m_new).exp();
                    if k0 + 4 * tx + j >= kend || kp + j > rowpos {
                        p = f32::new(0.0);
                    }
                    s[4 * i + j] = p;
                    sum += p;
                }
                sum += plane_shuffle_xor(sum, 1u32);
                sum += plane_shuffle_xor(sum, 2u32);
                sum += plane_shuffle_xor(sum, 4u32);
                sum += plane_shuffle_xor(sum, 8u32);
                l[i] = l[i] * alpha + sum;
                m[i] = m_new;
                #[unroll]
                for a in 0..comptime!(4 * (vd / 64)) {
                    o[i * comptime!(4 * (vd / 64)) + a] *= alpha;
                }
            }
            // The weights transposed: key-major, 4 rows a vector.
            #[unroll]
            for j in 0..4usize {
                let mut t = Vector::<f32, N>::empty();
                t[0] = s[j];
                t[1] = s[4 + j];
                t[2] = s[8 + j];
                t[3] = s[12 + j];
                pt[(4 * tx + j) * 17 + ty] = t;
            }
            // Every thread is done with the key half; the weights are in place.
            sync_cube();
            for it in 0..comptime!((64 * vd / 4).div_ceil(THREADS)) {
                let i = it * comptime!(THREADS) + tid;
                if i < comptime!(64 * vd / 4) {
                    let key = i / dv4;
                    let c4 = i % dv4;
                    let mut v = zeros4::<N>();
                    if k0 + key < kend {
                        v = kv[((k0 + key) * heads + h) * kvw4 + nope4 + c4];
                    }
                    kvs[key * dv4 + c4] = v;
                }
            }
            sync_cube();
            let mut tk = kend - k0;
            if tk > 64 {
                tk = 64usize;
            }
            for t in 0..tk {
                let pv = pt[t * 17 + ty];
                #[unroll]
                for u in 0..ov {
                    let vv = kvs[t * dv4 + tx + 16 * u];
                    #[unroll]
                    for i in 0..4usize {
                        #[unroll]
                        for e in 0..4usize {
                            o[(i * ov + u) * 4 + e] += pv[i] * vv[e];
                        }
                    }
                }
            }
        }

        #[unroll]
        for i in 0..4usize {
            let row = q0 + 4 * ty + i;
            if row < n {
                let mut inv = f32::new(0.0);
                if l[i] > f32::new(0.0) {
                    inv = f32::new(1.0) / l[i];
                }
                let base = (seg as usize * n + row) * heads + h;
                #[unroll]
                for u in 0..ov {
                    let mut t = Vector::<f32, N>::empty();
                    #[unroll]
                    for e in 0..4usize {
                        t[e] = o[(i * ov + u) * 4 + e] * inv;
                    }
                    o_part[base * dv4 + tx + 16 * u] = t;
                }
                if tx == 0 {
                    ml_part[base * 2] = m[i];
                    ml_part[base * 2 + 1] = l[i];
                }
            }
        }
    }

    /// One segment's launch of [`mha_prefill_kernel`] (module docs): `q` `[n, heads, nope + rot]` f32, `kv`
    /// `[keys, heads, nope + vd]` f32, `kpe` `[kpe_rows, kpe_width]` f32 whose row `kpe_row0 + t` holds key `t`'s
    /// `k_pe` at column `kpe_col`; writes segment `seg` of `o_part` `[segments, n, heads, vd]` and `ml_part`
    /// `[segments, n, heads, 2]`. Query row `i` is at position `start + i`, key `t` at `key0 + t`.
    ///
    /// # Errors
    /// A message naming the parameter when a size does not fit or the dimensions are not the kernel's (nothing is
    /// launched then).
    #[allow(clippy::too_many_arguments)]
    pub fn mha_prefill_attention<R: Runtime>(
        client: &ComputeClient<R>,
        q: &Handle,
        kv: &Handle,
        kpe: &Handle,
        (kpe_rows, kpe_width, kpe_col, kpe_row0): (usize, usize, usize, usize),
        o_part: &Handle,
        ml_part: &Handle,
        (segments, seg): (usize, usize),
        n: usize,
        heads: usize,
        dims: MhaDims,
        (start, key0, keys): (usize, usize, usize),
        scale: f32,
    ) -> Result<(), String> {
        let smem = client.properties().hardware.max_shared_memory_size;
        dims.check(smem)?;
        let MhaDims { nope, rot, vd } = dims;
        let dq = nope + rot;
        if n == 0 || heads == 0 || keys == 0 {
            return Err(format!("MHA prefill attention: rows {n}, heads {heads}, keys {keys}: need each >= 1"));
        }
        if n.div_ceil(Q_TILE) > 65_535 || heads > 65_535 {
            return Err(format!("MHA prefill attention: {n} rows, {heads} heads: at most 65535 tiles of each"));
        }
        if seg >= segments {
            return Err(format!("MHA prefill attention: segment {seg} of {segments}"));
        }
        if !kpe_width.is_multiple_of(4) || !kpe_col.is_multiple_of(4) || kpe_col + rot > kpe_width {
            return Err(format!(
                "MHA prefill attention: k_pe at column {kpe_col} of {kpe_width}: need multiples of 4 and {rot} columns"
            ));
        }
        if kpe_row0 + keys > kpe_rows {
            return Err(format!("MHA prefill attention: keys {kpe_row0}..{} of {kpe_rows} k_pe rows", kpe_row0 + keys));
        }
        let u32_max = u32::MAX as usize;
        if start + n > u32_max || key0 + keys > u32_max || (kpe_row0 * kpe_width + kpe_col) / 4 > u32_max {
            return Err(format!("MHA prefill attention: positions {start} + {n}, keys {key0} + {keys}: beyond u32"));
        }
        let sizes = [
            ("q", q, n * heads * dq * 4),
            ("kv", kv, keys * heads * (nope + vd) * 4),
            ("kpe", kpe, kpe_rows * kpe_width * 4),
            ("o_part", o_part, segments * n * heads * vd * 4),
            ("ml_part", ml_part, segments * n * heads * 2 * 4),
        ];
        for (name, h, bytes) in sizes {
            if (h.size_in_used() as usize) < bytes {
                return Err(format!("MHA prefill attention: {name} holds {} bytes, needs {bytes}", h.size_in_used()));
            }
        }
        let longest =
            (n * heads * dq).max(keys * heads * (nope + vd)).max(kpe_rows * kpe_width).max(segments * n * heads * vd);
        // SAFETY: sizes checked above; a block reads rows `< n` of head `< heads` of `q`, keys `< keys` of `kv` and
        // `kpe` rows `kpe_row0 + t < kpe_rows` at columns `< kpe_col + rot <= kpe_width`, and writes segment `seg`
        // of `o_part` / `ml_part` at rows `< n`.
        unsafe {
            mha_prefill_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(heads as u32, n.div_ceil(Q_TILE) as u32, 1),
                CubeDim::new_1d(THREADS as u32),
                AddressType::from_len(longest),
                4,
                ArrayArg::from_raw_parts(q.clone(), n * heads * dq / 4),
                ArrayArg::from_raw_parts(kv.clone(), keys * heads * (nope + vd) / 4),
                ArrayArg::from_raw_parts(kpe.clone(), kpe_rows * kpe_width / 4),
                ArrayArg::from_raw_parts(o_part.clone(), segments * n * heads * vd / 4),
                ArrayArg::from_raw_parts(ml_part.clone(), segments * n * heads * 2),
                n as u32,
                heads as u32,
                start as u32,
                key0 as u32,
                keys as u32,
                seg as u32,
                (kpe_width / 4) as u32,
                ((kpe_row0 * kpe_width + kpe_col) / 4) as u32,
                scale,
                nope,
                rot,
                vd,
            );
        }
        Ok(())
    }
    /// Merges the `segments` segments of [`mha_prefill_attention`]'s `o_part` / `ml_part` for `pairs` (row, head)
    /// pairs into `out` `[pairs, vd]` (log-sum-exp weights: [`super::super::attention::mla_combine_kernel`]).
    ///
    /// # Errors
    /// A message naming the buffer that is too small (nothing is launched then).
    pub fn combine_segments<R: Runtime>(
        client: &ComputeClient<R>,
        o_part: &Handle,
        ml_part: &Handle,
        out: &Handle,
        pairs: usize,
        segments: usize,
        vd: usize,
    ) -> Result<(), String> {
        if pairs == 0 || segments == 0 || vd == 0 || !vd.is_multiple_of(4) || pairs > u32::MAX as usize {
            return Err(format!("MHA prefill combine: pairs {pairs}, segments {segments}, vd {vd}"));
        }
        let sizes = [
            ("o_part", o_part, segments * pairs * vd * 4),
            ("ml_part", ml_part, segments * pairs * 2 * 4),
            ("out", out, pairs * vd * 4),
        ];
        for (name, h, bytes) in sizes {
            if (h.size_in_used() as usize) < bytes {
                return Err(format!("MHA prefill combine: {name} holds {} bytes, needs {bytes}", h.size_in_used()));
            }
        }
        // SAFETY: sizes checked above; block `rh < pairs` reads segment entries `(s, rh)` and writes row `rh`.
        unsafe {
            crate::cuda::attention::mla_combine_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(pairs as u32, 1, 1),
                CubeDim::new_1d(128),
                AddressType::from_len(segments * pairs * vd),
                4,
                ArrayArg::from_raw_parts(o_part.clone(), segments * pairs * vd / 4),
                ArrayArg::from_raw_parts(ml_part.clone(), segments * pairs * 2),
                ArrayArg::from_raw_parts(out.clone(), pairs * vd / 4),
                pairs as u32,
                segments as u32,
                vd,
                1usize,
                false,
            );
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "prefill_attention_tests.rs"]
mod tests;
