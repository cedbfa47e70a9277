//! The CPU reference of the fused INT4 MoE (`eyrie_quant::cuda::moe_reference`) against a naive dense
//! composition: every expert dequantized whole (`PackedInt4::dequantize_f32`), every expert evaluated for every
//! token, unselected ones weighted zero. Random, never-zero inputs; group sizes 32, 64 and 128. No GPU needed.

use eyrie_quant::cuda::{Dequant, Mismatch, MoeExperts, MoeShape, SplitMix64, moe_reference};

/// `y = W x` with `W` dense `[rows, cols]`, f32 accumulation.
fn matvec(w: &[f32], x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..rows).map(|r| w[r * cols..(r + 1) * cols].iter().zip(x).map(|(a, b)| a * b).sum()).collect()
}

fn naive(ex: &MoeExperts, x: &[f32], ids: &[u32], weights: &[f32], topk: usize) -> Vec<f32> {
    let s = ex.shape();
    let m = x.len() / s.hidden;
    let dense: Vec<[Vec<f32>; 3]> = (0..s.experts)
        .map(|e| [ex.gate(e).dequantize_f32(), ex.up(e).dequantize_f32(), ex.down(e).dequantize_f32()])
        .collect();
    let mut out = vec![0f32; m * s.hidden];
    for t in 0..m {
        let xt = &x[t * s.hidden..(t + 1) * s.hidden];
        for (e, [g, u, d]) in dense.iter().enumerate() {
            let w: f32 = (0..topk).filter(|&k| ids[t * topk + k] as usize == e).map(|k| weights[t * topk + k]).sum();
            let g = matvec(g, xt, s.inter, s.hidden);
            let u = matvec(u, xt, s.inter, s.hidden);
            let h: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| g / (1.0 + (-g).exp()) * u).collect();
            let y = matvec(d, &h, s.hidden, s.inter);
            for (o, y) in out[t * s.hidden..(t + 1) * s.hidden].iter_mut().zip(y) {
                *o += w * y;
            }
        }
    }
    out
}

fn case(shape: MoeShape, m: usize, topk: usize, seed: u64) {
    let ex = MoeExperts::random(shape, seed).unwrap();
    let mut rng = SplitMix64::new(seed + 1);
    let x: Vec<f32> = rng.activations(m * shape.hidden).iter().map(|v| v.to_f32()).collect();
    assert!(x.iter().all(|&v| v != 0.0));
    let (ids, weights) = rng.routing(m, topk, shape.experts);
    let want = naive(&ex, &x, &ids, &weights, topk);
    let got = moe_reference(&ex, &x, &ids, &weights, topk, Dequant::CompressedTensors).unwrap();
    let mm = Mismatch::of(&got, &want);
    // The naive path accumulates in f32 over <= 256 terms twice: a few 1e-7 relative to the largest output.
    assert!(mm.rel_to_max < 1e-5, "{shape:?} m={m}: {mm:?}");
    assert!(want.iter().any(|&v| v.abs() > 1e-3), "outputs must not vanish");

    // The exact-product variant differs by the BF16 rounding of each dequantized weight (<= 2^-8 relative).
    let exact = moe_reference(&ex, &x, &ids, &weights, topk, Dequant::Exact).unwrap();
    let mm = Mismatch::of(&exact, &got);
    assert!(mm.rel_to_max > 0.0 && mm.rel_to_max < 1e-2, "{shape:?} m={m}: exact vs rounded {mm:?}");
}

#[test]
fn reference_equals_naive_dense_composition_group_32() {
    case(MoeShape { hidden: 256, inter: 128, experts: 8, group: 32 }, 5, 3, 11);
}

#[test]
fn reference_equals_naive_dense_composition_group_64_and_128() {
    case(MoeShape { hidden: 256, inter: 128, experts: 6, group: 64 }, 3, 2, 12);
    case(MoeShape { hidden: 384, inter: 128, experts: 5, group: 128 }, 4, 4, 13);
}

#[test]
fn reference_rejects_bad_routing() {
    let shape = MoeShape { hidden: 64, inter: 32, experts: 4, group: 32 };
    let ex = MoeExperts::random(shape, 1).unwrap();
    let x = vec![0.5f32; 64];
    assert!(moe_reference(&ex, &x, &[0, 0], &[0.5, 0.5], 2, Dequant::Exact).is_err());
    assert!(moe_reference(&ex, &x, &[0, 9], &[0.5, 0.5], 2, Dequant::Exact).is_err());
    assert!(moe_reference(&ex, &x, &[0, 1], &[0.5], 2, Dequant::Exact).is_err());
}
