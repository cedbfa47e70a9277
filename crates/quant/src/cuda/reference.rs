//! CPU reference of the fused INT4 MoE: `out[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`,
//! `e = ids[t,k]`, computed only for the routed experts, with f64 accumulation (a better truth than the f32
//! kernel it checks). Weights come from [`PackedInt4`] dequantization (`int4.rs`).

use rayon::prelude::*;

use super::experts::{MoeExperts, Routing};
use crate::{PackedInt4, QuantError, Result};

/// How the reference turns INT4 values into weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dequant {
    /// Bit-exact compressed-tensors decompression: `bf16((q - 8) * scale)`, the product rounded once to BF16
    /// ([`PackedInt4::dequantize_rows_into`]): the checkpoint's weights, what the GPU kernel computes with.
    CompressedTensors,
    /// The unrounded product `(q - 8) * scale` (exact in f32): a control, so a check can tell a kernel that
    /// rounds from one that does not (the two differ by ~2e-3 of the output's norm).
    Exact,
}

/// Rows dequantized per work item.
const ROW_CHUNK: usize = 32;

/// Dequantizes `rows` of `w` into `out` (`[rows.len(), in]`).
fn dequant_rows(w: &PackedInt4, rows: std::ops::Range<usize>, out: &mut [f32], mode: Dequant) -> Result<()> {
    match mode {
        Dequant::CompressedTensors => w.dequantize_rows_into(rows, out),
        Dequant::Exact => {
            let (inp, group, rw, ng) = (w.in_features(), w.group_size(), w.packed_row_words(), w.n_groups());
            for (r, o) in rows.zip(out.chunks_exact_mut(inp)) {
                let words = &w.packed()[r * rw..(r + 1) * rw];
                let scales = &w.scales()[r * ng..(r + 1) * ng];
                for (c, v) in o.iter_mut().enumerate() {
                    let u = (words[c / 8] >> (4 * (c % 8))) & 0xF;
                    *v = (u as i32 - 8) as f32 * scales[c / group];
                }
            }
            Ok(())
        }
    }
}

/// `y[j][r] = sum_c x_j[c] * w[r, c]` for the tokens `xs` (each `[in]`), in f64; rows in parallel chunks.
fn gemv_rows(w: &PackedInt4, xs: &[&[f32]], mode: Dequant) -> Result<Vec<Vec<f64>>> {
    let (rows, inp) = (w.out_features(), w.in_features());
    let chunks: Vec<Vec<Vec<f64>>> = (0..rows.div_ceil(ROW_CHUNK))
        .into_par_iter()
        .map(|c| {
            let r = c * ROW_CHUNK..((c + 1) * ROW_CHUNK).min(rows);
            let mut buf = vec![0f32; r.len() * inp];
            dequant_rows(w, r.clone(), &mut buf, mode)?;
            Ok(xs
                .iter()
                .map(|x| {
                    buf.chunks_exact(inp)
                        .map(|row| row.iter().zip(*x).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum())
                        .collect()
                })
                .collect())
        })
        .collect::<Result<_>>()?;
    let mut out = vec![Vec::with_capacity(rows); xs.len()];
    for chunk in chunks {
        for (o, part) in out.iter_mut().zip(chunk) {
            o.extend(part);
        }
    }
    Ok(out)
}

/// SiLU in f64.
pub fn silu(g: f64) -> f64 {
    g / (1.0 + (-g).exp())
}

/// The MoE layer on the CPU: `x` is `[m, hidden]` (BF16 activations widened to f32), `ids` and `weights`
/// `[m, topk]`; returns `[m, hidden]`.
pub fn moe_reference(
    experts: &MoeExperts,
    x: &[f32],
    ids: &[u32],
    weights: &[f32],
    topk: usize,
    mode: Dequant,
) -> Result<Vec<f32>> {
    let s = experts.shape();
    if topk == 0 || !x.len().is_multiple_of(s.hidden) {
        return Err(QuantError::invalid("x", format!("{} values is not [m, {}]", x.len(), s.hidden)));
    }
    let m = x.len() / s.hidden;
    if weights.len() != m * topk {
        return Err(QuantError::invalid("weights", format!("has {} values, expected [{m}, {topk}]", weights.len())));
    }
    let routing = Routing::new(ids, m, topk, s.experts)?;
    let mut out = vec![0f64; m * s.hidden];
    for (slot, &e) in routing.experts.iter().enumerate() {
        let e = e as usize;
        let pairs = &routing.pairs[routing.offsets[slot] as usize..routing.offsets[slot + 1] as usize];
        let xs: Vec<&[f32]> = pairs.iter().map(|&p| &x[(p as usize / topk) * s.hidden..][..s.hidden]).collect();
        let g = gemv_rows(experts.gate(e), &xs, mode)?;
        let u = gemv_rows(experts.up(e), &xs, mode)?;
        // The intermediate is handed on in f32, as the kernel does.
        let h: Vec<Vec<f32>> =
            g.iter().zip(&u).map(|(g, u)| g.iter().zip(u).map(|(&g, &u)| (silu(g) * u) as f32).collect()).collect();
        let hs: Vec<&[f32]> = h.iter().map(Vec::as_slice).collect();
        let y = gemv_rows(experts.down(e), &hs, mode)?;
        for (&p, y) in pairs.iter().zip(y) {
            let t = p as usize / topk;
            let w = f64::from(weights[p as usize]);
            out[t * s.hidden..][..s.hidden].iter_mut().zip(y).for_each(|(o, y)| *o += w * y);
        }
    }
    Ok(out.into_iter().map(|v| v as f32).collect())
}

/// Comparison of a result with a reference: the largest absolute difference, and that difference over the
/// largest reference magnitude (a norm-wise relative error, meaningful where single outputs are near zero).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Mismatch {
    /// `max |got - want|`.
    pub max_abs: f32,
    /// `max |got - want| / max |want|`.
    pub rel_to_max: f32,
    /// `max |got - want| / |want|` over outputs with `|want| >= 0.1 * max |want|`.
    pub max_rel: f32,
}

impl Mismatch {
    /// Compares `got` with `want` (same length; NaN counts as infinitely wrong).
    pub fn of(got: &[f32], want: &[f32]) -> Self {
        assert_eq!(got.len(), want.len(), "compared buffers differ in length");
        let max_want = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        let mut max_abs = 0f32;
        let mut max_rel = 0f32;
        for (&g, &w) in got.iter().zip(want) {
            let d = if g.is_nan() { f32::INFINITY } else { (g - w).abs() };
            max_abs = max_abs.max(d);
            if w.abs() >= 0.1 * max_want {
                max_rel = max_rel.max(d / w.abs());
            }
        }
        Self { max_abs, rel_to_max: if max_want > 0.0 { max_abs / max_want } else { max_abs }, max_rel }
    }
}
