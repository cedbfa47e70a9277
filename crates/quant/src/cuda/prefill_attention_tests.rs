//! Tests of [`super`] (`cuda::prefill_attention`), in a file of their own.

use super::*;

const KIMI: MhaDims = MhaDims { nope: 128, rot: 64, vd: 128 };

#[test]
fn kimi_fits_sm120_and_the_h200() {
    assert_eq!(KIMI.shared_bytes(), 99_328);
    KIMI.check(101_376).unwrap();
    KIMI.check(232_448).unwrap();
    let e = KIMI.check(98_304).unwrap_err();
    assert!(e.contains("99328 bytes"), "{e}");
    assert!(MhaDims { nope: 16, rot: 8, vd: 16 }.check(232_448).unwrap_err().contains("vd 16"));
    assert!(MhaDims { nope: 6, rot: 8, vd: 64 }.check(232_448).unwrap_err().contains("nope 6"));
}

/// The MHA form equals the absorbed form over the same latents: keys `W_uk c` and values `W_uv c` (per head),
/// queries `q_nope`; the absorbed reference gets `q_nope W_uk` and returns latents, taken through `W_uv`.
#[test]
fn equals_the_absorbed_form() {
    use crate::cuda::attention::{PagedRows, mla_attention_reference};
    let dims = MhaDims { nope: 8, rot: 4, vd: 8 };
    let (heads, r, n, start) = (3usize, 16usize, 5usize, 4usize);
    let total = start + n;
    let mut st = crate::cuda::SplitMix64::new(7);
    let q = st.signed(n * heads * (dims.nope + dims.rot));
    let lat = st.signed(total * (r + dims.rot));
    let w = st.signed(heads * (dims.nope + dims.vd) * r); // kv_b_proj [H (nope + vd), r]
    let mut kv = vec![0.0f32; total * heads * (dims.nope + dims.vd)];
    for t in 0..total {
        for h in 0..heads {
            for j in 0..dims.nope + dims.vd {
                let row = &w[(h * (dims.nope + dims.vd) + j) * r..][..r];
                kv[(t * heads + h) * (dims.nope + dims.vd) + j] =
                    (0..r).map(|c| f64::from(row[c]) * f64::from(lat[t * (r + dims.rot) + c])).sum::<f64>() as f32;
            }
        }
    }
    let scale = 0.3;
    let got = mha_prefill_reference(&q, &kv, &lat, r + dims.rot, r, n, heads, dims, start, 0, total, scale);

    let mut qa = vec![0.0f32; n * heads * (r + dims.rot)];
    for i in 0..n {
        for h in 0..heads {
            let qr = &q[(i * heads + h) * (dims.nope + dims.rot)..];
            for c in 0..r {
                qa[(i * heads + h) * (r + dims.rot) + c] = (0..dims.nope)
                    .map(|j| f64::from(qr[j]) * f64::from(w[(h * (dims.nope + dims.vd) + j) * r + c]))
                    .sum::<f64>() as f32;
            }
            for j in 0..dims.rot {
                qa[(i * heads + h) * (r + dims.rot) + r + j] = qr[dims.nope + j];
            }
        }
    }
    let rows = PagedRows::contiguous_chunk(n, start);
    let o_lat = mla_attention_reference(&qa, &lat, &rows, heads, r, dims.rot, scale);
    for i in 0..n {
        for h in 0..heads {
            for c in 0..dims.vd {
                let wv = &w[(h * (dims.nope + dims.vd) + dims.nope + c) * r..][..r];
                let want: f64 = (0..r).map(|k| f64::from(o_lat[(i * heads + h) * r + k]) * f64::from(wv[k])).sum();
                let g = got[(i * heads + h) * dims.vd + c];
                assert!((f64::from(g) - want).abs() < 1e-4, "row {i} head {h} col {c}: {g} vs {want}");
            }
        }
    }
}

/// The kernel's algorithm on the CPU, phase by phase between its barriers, thread by thread, with its index
/// algebra and f32 arithmetic in its order (shuffles as xor butterflies over the half-warp): what
/// `mha_prefill_kernel` computes, run without a GPU. `q`, `kv`, `kpe` flat f32 in the kernel's layouts.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
fn simulate(
    q: &[f32],
    kv: &[f32],
    kpe: &[f32],
    (n, heads, dims): (usize, usize, MhaDims),
    (start, key0, keys, seg, segments): (usize, usize, usize, usize, usize),
    (kpe_stride, kpe_off): (usize, usize),
    scale: f32,
    o_part: &mut [f32],
    ml_part: &mut [f32],
) {
    let MhaDims { nope, rot, vd } = dims;
    let (dq4, kc, kc4, nope4, dv4, kvw4, ov) =
        ((nope + rot) / 4, (nope + rot) / 2, (nope + rot) / 8, nope / 4, vd / 4, (nope + vd) / 4, vd / 64);
    assert_eq!(o_part.len(), segments * n * heads * vd);
    let vec4 = |a: &[f32], i: usize| -> [f32; 4] { [a[4 * i], a[4 * i + 1], a[4 * i + 2], a[4 * i + 3]] };
    let qtiles = n.div_ceil(64);
    for h in 0..heads {
        for qy in 0..qtiles {
            let q0 = (qtiles - 1 - qy) * 64;
            let last = (q0 + 63).min(n - 1);
            let see = start + last + 1;
            let kend = see.saturating_sub(key0).min(keys);
            let mut qs = vec![[0.0f32; 4]; (nope + rot) * 16];
            let mut kvs = vec![[0.0f32; 4]; ((nope + rot) / 2 * 16).max(64 * vd / 4)];
            let mut pt = vec![[0.0f32; 4]; 64 * 17];
            let transpose = |smem: &mut Vec<[f32; 4]>, a: [[f32; 4]; 4], base: usize, stride: usize| {
                for c in 0..4 {
                    smem[base + c * stride] = [a[0][c], a[1][c], a[2][c], a[3][c]];
                }
            };
            for tid in 0..THREADS {
                let (g, part) = (tid % 16, tid / 16);
                for it in 0..dq4.div_ceil(16) {
                    let d4 = it * 16 + part;
                    if d4 < dq4 {
                        let mut a = [[0.0f32; 4]; 4];
                        for (e, a) in a.iter_mut().enumerate() {
                            let row = q0 + 4 * g + e;
                            if row < n {
                                *a = vec4(q, (row * heads + h) * dq4 + d4);
                            }
                        }
                        transpose(&mut qs, a, 4 * d4 * 16 + g, 16);
                    }
                }
            }
            let mut o = vec![vec![0.0f32; 16 * ov]; THREADS];
            let mut m = vec![[-1.0e30f32; 4]; THREADS];
            let mut l = vec![[0.0f32; 4]; THREADS];
            for kt in 0..kend.div_ceil(64) {
                let k0 = kt * 64;
                let mut s = vec![[0.0f32; 16]; THREADS];
                for c in 0..2 {
                    for tid in 0..THREADS {
                        let (g, part) = (tid % 16, tid / 16);
                        for it in 0..kc4.div_ceil(16) {
                            let d4 = it * 16 + part;
                            if d4 < kc4 {
                                let gd4 = c * kc4 + d4;
                                let mut a = [[0.0f32; 4]; 4];
                                for (e, a) in a.iter_mut().enumerate() {
                                    let t = k0 + 4 * g + e;
                                    if t < kend {
                                        *a = if gd4 < nope4 {
                                            vec4(kv, (t * heads + h) * kvw4 + gd4)
                                        } else {
                                            vec4(kpe, t * kpe_stride + kpe_off + gd4 - nope4)
                                        };
                                    }
                                }
                                transpose(&mut kvs, a, 4 * d4 * 16 + g, 16);
                            }
                        }
                    }
                    for tid in 0..THREADS {
                        let (tx, ty) = (tid % 16, tid / 16);
                        for d in 0..kc {
                            let qa = qs[(c * kc + d) * 16 + ty];
                            let kb = kvs[d * 16 + tx];
                            for i in 0..4 {
                                for j in 0..4 {
                                    s[tid][4 * i + j] += qa[i] * kb[j];
                                }
                            }
                        }
                    }
                }
                // Softmax: per half-warp (16 threads of one ty), butterflies as the shuffles.
                for ty in 0..16 {
                    for i in 0..4 {
                        let rowpos = start + q0 + 4 * ty + i;
                        let masked = |tx: usize, j: usize| k0 + 4 * tx + j >= kend || key0 + k0 + 4 * tx + j > rowpos;
                        let mut mx = [0.0f32; 16];
                        for tx in 0..16 {
                            let tid = 16 * ty + tx;
                            mx[tx] = -1.0e30;
                            for j in 0..4 {
                                let mut sv = s[tid][4 * i + j] * scale;
                                if masked(tx, j) {
                                    sv = -1.0e30;
                                }
                                s[tid][4 * i + j] = sv;
                                mx[tx] = mx[tx].max(sv);
                            }
                        }
                        for off in [1, 2, 4, 8] {
                            let prev = mx;
                            for tx in 0..16 {
                                mx[tx] = prev[tx].max(prev[tx ^ off]);
                            }
                        }
                        let mut sum = [0.0f32; 16];
                        let mut alpha = [0.0f32; 16];
                        for tx in 0..16 {
                            let tid = 16 * ty + tx;
                            let m_new = m[tid][i].max(mx[tx]);
                            alpha[tx] = (m[tid][i] - m_new).exp();
                            for j in 0..4 {
                                let mut p = (s[tid][4 * i + j] - m_new).exp();
                                if masked(tx, j) {
                                    p = 0.0;
                                }
                                s[tid][4 * i + j] = p;
                                sum[tx] += p;
                            }
                            m[tid][i] = m_new;
                        }
                        for off in [1, 2, 4, 8] {
                            let prev = sum;
                            for tx in 0..16 {
                                sum[tx] = prev[tx] + prev[tx ^ off];
                            }
                        }
                        for tx in 0..16 {
                            let tid = 16 * ty + tx;
                            l[tid][i] = l[tid][i] * alpha[tx] + sum[tx];
                            for a in 0..4 * ov {
                                o[tid][i * 4 * ov + a] *= alpha[tx];
                            }
                        }
                    }
                }
                for tid in 0..THREADS {
                    let (tx, ty) = (tid % 16, tid / 16);
                    for j in 0..4 {
                        let st = &s[tid];
                        pt[(4 * tx + j) * 17 + ty] = [st[j], st[4 + j], st[8 + j], st[12 + j]];
                    }
                }
                for tid in 0..THREADS {
                    for it in 0..(64 * vd / 4).div_ceil(THREADS) {
                        let i = it * THREADS + tid;
                        if i < 64 * vd / 4 {
                            let (key, c4) = (i / dv4, i % dv4);
                            kvs[key * dv4 + c4] = if k0 + key < kend {
                                vec4(kv, ((k0 + key) * heads + h) * kvw4 + nope4 + c4)
                            } else {
                                [0.0; 4]
                            };
                        }
                    }
                }
                for tid in 0..THREADS {
                    let (tx, ty) = (tid % 16, tid / 16);
                    for t in 0..(kend - k0).min(64) {
                        let pv = pt[t * 17 + ty];
                        for u in 0..ov {
                            let vv = kvs[t * dv4 + tx + 16 * u];
                            for i in 0..4 {
                                for e in 0..4 {
                                    o[tid][(i * ov + u) * 4 + e] += pv[i] * vv[e];
                                }
                            }
                        }
                    }
                }
            }
            for tid in 0..THREADS {
                let (tx, ty) = (tid % 16, tid / 16);
                for i in 0..4 {
                    let row = q0 + 4 * ty + i;
                    if row < n {
                        let inv = if l[tid][i] > 0.0 { 1.0 / l[tid][i] } else { 0.0 };
                        let base = (seg * n + row) * heads + h;
                        for u in 0..ov {
                            for e in 0..4 {
                                o_part[(base * dv4 + tx + 16 * u) * 4 + e] = o[tid][(i * ov + u) * 4 + e] * inv;
                            }
                        }
                        if tx == 0 {
                            ml_part[base * 2] = m[tid][i];
                            ml_part[base * 2 + 1] = l[tid][i];
                        }
                    }
                }
            }
        }
    }
}

/// The combine kernel's merge on the CPU (`attention::mla_combine_kernel`: slices in order, weights
/// `l exp(m - max m)`, empty slices weigh 0).
fn combine(o_part: &[f32], ml_part: &[f32], pairs: usize, segments: usize, vd: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; pairs * vd];
    for rh in 0..pairs {
        let live = |s: usize| ml_part[(s * pairs + rh) * 2 + 1] > 0.0;
        let mx = (0..segments).filter(|&s| live(s)).map(|s| ml_part[(s * pairs + rh) * 2]).fold(-1.0e30f32, f32::max);
        let w: Vec<f32> = (0..segments)
            .map(|s| {
                if live(s) {
                    ml_part[(s * pairs + rh) * 2 + 1] * (ml_part[(s * pairs + rh) * 2] - mx).exp()
                } else {
                    0.0
                }
            })
            .collect();
        let den: f32 = w.iter().sum();
        for c in 0..vd {
            let acc: f32 = (0..segments).map(|s| w[s] * o_part[(s * pairs + rh) * vd + c]).sum();
            out[rh * vd + c] = if den > 0.0 { acc / den } else { 0.0 };
        }
    }
    out
}

/// The kernel's algorithm (simulated on the CPU) against the f64 reference: partial query tiles, a cached
/// prefix, `k_pe` inside a wider row, the prefix in segments merged as the combine kernel does, Kimi-K2's head
/// dimensions and a smaller set (1e-5 norm-wise, as the GPU check).
#[test]
fn the_kernels_algorithm_matches_the_reference() {
    let small = MhaDims { nope: 64, rot: 32, vd: 64 };
    // (dims, heads, n, start, segments)
    let cases: [(MhaDims, usize, usize, usize, &[usize]); 4] = [
        (KIMI, 2, 70, 0, &[70]),
        (KIMI, 1, 65, 100, &[100, 65]),
        (small, 2, 130, 37, &[64, 40, 63]),
        (small, 1, 1, 90, &[91]),
    ];
    let mut st = crate::cuda::SplitMix64::new(3);
    for (dims, heads, n, start, segs) in cases {
        let MhaDims { nope, rot, vd } = dims;
        let keys = start + n;
        assert_eq!(segs.iter().sum::<usize>(), keys);
        let (kpe_width, kpe_col) = (8 + rot, 8);
        let q = st.signed(n * heads * (nope + rot));
        let kv = st.signed(keys * heads * (nope + vd));
        let kpe = st.signed(keys * kpe_width);
        let scale = 1.0 / ((nope + rot) as f32).sqrt();
        let want =
            mha_prefill_reference(&q, &kv, &kpe, kpe_width, kpe_col, n, heads, dims, start, 0, keys, f64::from(scale));
        let segments = segs.len();
        let mut o_part = vec![f32::NAN; segments * n * heads * vd];
        let mut ml_part = vec![f32::NAN; segments * n * heads * 2];
        let mut key0 = 0;
        for (seg, &len) in segs.iter().enumerate() {
            let w = heads * (nope + vd);
            simulate(
                &q,
                &kv[key0 * w..(key0 + len) * w],
                &kpe,
                (n, heads, dims),
                (start, key0, len, seg, segments),
                (kpe_width / 4, (key0 * kpe_width + kpe_col) / 4),
                scale,
                &mut o_part,
                &mut ml_part,
            );
            key0 += len;
        }
        let got = if segments == 1 { o_part } else { combine(&o_part, &ml_part, n * heads, segments, vd) };
        let e = crate::cuda::Mismatch::of(&got, &want).rel_to_max;
        assert!(e <= 1e-5, "{dims:?} n {n} start {start} segments {segs:?}: {e}");
    }
}

/// Causality and segments: a row sees exactly the keys at positions up to its own; a segment past a row's
/// position leaves it zeros; merging two segments by their softmax mass gives the whole.
#[test]
fn causal_rows_and_segments() {
    let dims = MhaDims { nope: 4, rot: 4, vd: 4 };
    let (heads, n, start) = (2usize, 3usize, 2usize);
    let keys = start + n;
    let mut st = crate::cuda::SplitMix64::new(11);
    let q = st.signed(n * heads * 8);
    let mut kv = st.signed(keys * heads * 8);
    let kpe = st.signed(keys * 4);
    let whole = mha_prefill_reference(&q, &kv, &kpe, 4, 0, n, heads, dims, start, 0, keys, 1.0);
    // Changing the last key changes only the last row.
    for h in 0..heads {
        kv[((keys - 1) * heads + h) * 8 + 4] += 5.0;
    }
    let changed = mha_prefill_reference(&q, &kv, &kpe, 4, 0, n, heads, dims, start, 0, keys, 1.0);
    assert_eq!(whole[..(n - 1) * heads * 4], changed[..(n - 1) * heads * 4]);
    assert_ne!(whole[(n - 1) * heads * 4..], changed[(n - 1) * heads * 4..]);
    // Row 0 (position 2) sees no key of a segment starting at position 3.
    let tail = mha_prefill_reference(&q, &kv[3 * heads * 8..], &kpe[3 * 4..], 4, 0, n, heads, dims, start, 3, 2, 1.0);
    assert!(tail[..heads * 4].iter().all(|&x| x == 0.0));
    // One key: the row's output is that key's value.
    let one = mha_prefill_reference(&q, &kv, &kpe, 4, 0, 1, heads, dims, 0, 0, keys, 1.0);
    for h in 0..heads {
        assert_eq!(one[h * 4..h * 4 + 4], kv[h * 8 + 4..h * 8 + 8]);
    }
}
