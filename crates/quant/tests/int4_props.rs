//! Property tests of the pack-quantized INT4 format ([`eyrie_quant::int4`]), after compressed-tensors
//! `compressors/pack_quantized/helpers.py` (`pack_to_int32` / `unpack_from_int32`) and
//! `quantization/lifecycle/forward_helpers.py` (`_dequantize`); layout in `kimi-k2-formats.md` section 1.

use eyrie_quant::Dtype;
use eyrie_quant::int4::{PackedInt4, pack_word};
use half::{bf16, f16};
use proptest::prelude::*;

/// A random INT4 weight: shape, group size, signed values, scales exact in the scale dtype, optional zero points.
#[derive(Debug, Clone)]
struct Case {
    out: usize,
    inp: usize,
    group: usize,
    q: Vec<i8>,
    scales: Vec<f32>,
    dtype: Dtype,
    zero_points: Option<Vec<i8>>,
}

impl Case {
    fn n_groups(&self) -> usize {
        self.inp.div_ceil(self.group)
    }

    fn build(&self) -> PackedInt4 {
        PackedInt4::pack(
            &self.q,
            self.out,
            self.inp,
            self.group,
            self.scales.clone(),
            self.dtype,
            self.zero_points.clone(),
        )
        .expect("valid case")
    }
}

fn round_to(x: f32, dtype: Dtype) -> f32 {
    match dtype {
        Dtype::BF16 => bf16::from_f32(x).to_f32(),
        Dtype::F16 => f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// `(q - zp) * scale` computed exactly in f64 and rounded once to the scale dtype: an independent statement of
/// compressed-tensors' `_dequantize` arithmetic.
fn reference(q: i8, zp: i8, scale: f32, dtype: Dtype) -> f32 {
    let exact = f64::from(i32::from(q) - i32::from(zp)) * f64::from(scale);
    match dtype {
        Dtype::BF16 => bf16::from_f64(exact).to_f32(),
        Dtype::F16 => f16::from_f64(exact).to_f32(),
        _ => exact as f32,
    }
}

fn scale_strategy(dtype: Dtype) -> impl Strategy<Value = f32> {
    // Positive scales over many binades, rounded to the dtype (as stored in the checkpoint).
    (1u32..=0xFFFF, -20i32..4).prop_map(move |(m, e)| round_to((1.0 + m as f32 / 65536.0) * 2f32.powi(e), dtype))
}

fn case_strategy() -> impl Strategy<Value = Case> {
    let group = prop_oneof![Just(8usize), Just(32), Just(64), Just(128), 1usize..=40];
    let dtype = prop_oneof![Just(Dtype::BF16), Just(Dtype::F16), Just(Dtype::F32)];
    (1usize..=12, 1usize..=300, group, dtype, any::<bool>()).prop_flat_map(|(out, inp, group, dtype, asym)| {
        let n = out * inp.div_ceil(group);
        (
            proptest::collection::vec(-8i8..=7, out * inp),
            proptest::collection::vec(scale_strategy(dtype), n),
            proptest::collection::vec(-8i8..=7, n),
        )
            .prop_map(move |(q, scales, zp)| Case {
                out,
                inp,
                group,
                q,
                scales,
                dtype,
                zero_points: asym.then_some(zp),
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn pack_then_unpack_is_identity(case in case_strategy()) {
        let w = case.build();
        prop_assert_eq!(w.packed().len(), case.out * case.inp.div_ceil(8));
        prop_assert_eq!(w.packed_row_words(), case.inp.div_ceil(8));
        prop_assert_eq!(w.n_groups(), case.n_groups());
        prop_assert_eq!(w.unpack(), case.q.clone());
        // The tail of each row is padded with u = 0 nibbles.
        let tail = case.inp % 8;
        if tail != 0 {
            for row in 0..case.out {
                let last = w.packed()[row * w.packed_row_words() + w.packed_row_words() - 1];
                prop_assert_eq!(last >> (4 * tail), 0);
            }
        }
        // Rebuilding from the raw parts (as a checkpoint loader does) gives the same weight.
        let again = PackedInt4::new(
            case.out, case.inp, case.group, w.packed().to_vec(), case.scales.clone(), case.dtype,
            case.zero_points.clone(),
        ).unwrap();
        prop_assert_eq!(again, w);
    }

    #[test]
    fn dequantize_is_the_formula_rounded_once(case in case_strategy()) {
        let w = case.build();
        let got = w.dequantize_f32();
        let n_groups = case.n_groups();
        for o in 0..case.out {
            for i in 0..case.inp {
                let g = o * n_groups + i / case.group;
                let zp = case.zero_points.as_ref().map_or(0, |z| z[g]);
                let expected = reference(case.q[o * case.inp + i], zp, case.scales[g], case.dtype);
                prop_assert_eq!(got[o * case.inp + i].to_bits(), expected.to_bits(), "({}, {})", o, i);
            }
        }
        let bf = w.dequantize_bf16();
        for (b, f) in bf.iter().zip(&got) {
            prop_assert_eq!(b.to_bits(), bf16::from_f32(*f).to_bits());
        }
    }

    #[test]
    fn row_ranges_agree_with_the_whole(case in case_strategy(), a in 0usize..12, b in 0usize..12) {
        let w = case.build();
        let (start, end) = (a.min(b).min(case.out), a.max(b).min(case.out));
        let mut part = vec![0.0f32; (end - start) * case.inp];
        w.dequantize_rows_into(start..end, &mut part).unwrap();
        let whole = w.dequantize_f32();
        prop_assert_eq!(&part[..], &whole[start * case.inp..end * case.inp]);
    }

    #[test]
    fn zero_point_packing_round_trips(out in 1usize..=40, n_groups in 1usize..=20, seed in any::<u64>()) {
        let zp: Vec<i8> = (0..out * n_groups)
            .map(|k| ((seed.rotate_left(k as u32 % 64) ^ k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 60) as i8 - 8)
            .collect();
        let words = PackedInt4::pack_zero_points(&zp, out, n_groups).unwrap();
        prop_assert_eq!(words.len(), out.div_ceil(8) * n_groups);
        prop_assert_eq!(PackedInt4::from_packed_zero_points(&words, out, n_groups).unwrap(), zp.clone());
        // Column g of the word grid holds group g of 8 consecutive rows, row 8k + j in nibble j.
        for (row, chunk) in zp.chunks(n_groups).enumerate() {
            for (g, &z) in chunk.iter().enumerate() {
                let word = words[(row / 8) * n_groups + g];
                prop_assert_eq!(((word >> (4 * (row % 8))) & 0xF) as i8 - 8, z);
            }
        }
        let w = PackedInt4::pack(&vec![0; out * n_groups], out, n_groups, 1, vec![1.0; out * n_groups], Dtype::F32, Some(zp))
            .unwrap();
        prop_assert_eq!(w.packed_zero_points(), Some(words));
    }

    #[test]
    fn quantize_minmax_error_is_bounded(
        out in 1usize..=6,
        inp in 1usize..=200,
        group in prop_oneof![Just(8usize), Just(32), Just(64), Just(128)],
        symmetric in any::<bool>(),
        seed in any::<u32>(),
    ) {
        let weight: Vec<f32> = (0..out * inp)
            .map(|k| (((k as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let w = PackedInt4::quantize_minmax(&weight, out, inp, group, symmetric, Dtype::F32).unwrap();
        prop_assert_eq!(w.is_symmetric(), symmetric);
        let deq = w.dequantize_f32();
        let n_groups = w.n_groups();
        for o in 0..out {
            for i in 0..inp {
                let s = w.scales()[o * n_groups + i / group];
                // Symmetric: w/s is in [-7.5, 7.5]; asymmetric: w/s + zp is in [-8 + d, 7 + d] with |d| <= 1/2 (the
                // rounded zero point). Either way rounding and the clamp to [-8, 7] cost at most s/2.
                let bound = 0.5 * s * (1.0 + 1e-5) + 1e-7;
                let err = (weight[o * inp + i] - deq[o * inp + i]).abs();
                prop_assert!(err <= bound, "({}, {}): err {} > {}", o, i, err, bound);
            }
        }
    }
}

#[test]
fn reference_doc_example() {
    // kimi-k2-formats.md section 1: signed [1,-2,3,-4,5,-6,7,-8] -> u [9,6,11,4,13,2,15,0] -> 0x0F2D4B69.
    let q = [1i8, -2, 3, -4, 5, -6, 7, -8];
    assert_eq!(pack_word(&q), 0x0F2D_4B69);
    let w = PackedInt4::pack(&q, 1, 8, 8, vec![0.5], Dtype::BF16, None).unwrap();
    assert_eq!(w.packed(), &[0x0F2D_4B69]);
    // Read as i32 the word is positive (top nibble u = 0); a top nibble >= 8 makes the stored i32 negative.
    assert_eq!(0x0F2D_4B69u32 as i32, 254_626_665);
    assert_eq!(w.unpack(), q);
    assert_eq!(w.dequantize_f32(), vec![0.5, -1.0, 1.5, -2.0, 2.5, -3.0, 3.5, -4.0]);
}
