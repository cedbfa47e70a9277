//! Conversion of checkpoint weights into burn tensors on a given device (feature `burn`).
//!
//! Dense tensors keep their checkpoint dtype where the backend supports it (BF16, F16, F32) or are widened to f32.
//! INT4 weights are uploaded as their packed parts ([`Int4Tensors`]) and dequantized on the device with plain
//! tensor ops; the result equals [`PackedInt4::dequantize_f32`] bit for bit (the product `(q - zp) * scale` is exact
//! in f32, then rounded once to the scale dtype), which `tests` below check on the CPU backend and
//! `eyrie dequant --device cuda` checks on the GPU.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, ElementConversion, FloatDType, Int, Tensor, TensorData};
use half::f16;

use crate::{Dtype, PackedInt4, QuantError, Result, TensorView};

/// Uploads a dense floating-point checkpoint tensor of rank `D`, keeping BF16/F16/F32 as they are; other float
/// dtypes (F64, FP8) are converted to f32 on the host first.
pub fn dense_tensor<B: Backend, const D: usize>(view: &TensorView<'_>, device: &B::Device) -> Result<Tensor<B, D>> {
    view.expect_rank(D)?;
    let shape = view.shape.to_vec();
    let data = match view.dtype {
        Dtype::BF16 => TensorData::new(view.to_bf16_vec()?, shape),
        Dtype::F16 => TensorData::new(view.to_f16_vec()?, shape),
        Dtype::F32 | Dtype::F64 | Dtype::F8_E4M3 | Dtype::F8_E5M2 => TensorData::new(view.to_f32_vec()?, shape),
        other => {
            return Err(QuantError::DtypeMismatch {
                path: view.path.to_path_buf(),
                tensor: view.name.to_string(),
                expected: "a float dtype (BF16, F16, F32, F64, F8_E4M3, F8_E5M2)".into(),
                found: other,
            });
        }
    };
    let dtype = data.dtype;
    Ok(Tensor::from_data(data, (device, dtype)))
}

/// Uploads an integer checkpoint tensor (I8..I64, U8..U32, BOOL) as an `Int` tensor of rank `D` (values widened to
/// i64 on the host, then stored in the backend's int dtype).
pub fn int_tensor<B: Backend, const D: usize>(view: &TensorView<'_>, device: &B::Device) -> Result<Tensor<B, D, Int>> {
    view.expect_rank(D)?;
    let values = if view.dtype == Dtype::BOOL {
        view.to_bool_vec()?.into_iter().map(i64::from).collect()
    } else {
        view.to_i64_vec()?
    };
    Ok(Tensor::from_data(TensorData::new(values, view.shape.to_vec()), device))
}

/// The packed parts of an INT4 weight on a device: the layout fused kernels read directly.
#[derive(Debug, Clone)]
pub struct Int4Tensors<B: Backend> {
    /// `[out, ceil(in/8)]`, the u32 words stored as i32 bit patterns (LSB-first nibbles, `u = q + 8`).
    pub packed: Tensor<B, 2, Int>,
    /// `[out, ceil(in/group)]` in f32 (exact copies of the scale-dtype values).
    pub scales: Tensor<B, 2>,
    /// `[out, ceil(in/group)]` signed zero points, asymmetric schemes only.
    pub zero_points: Option<Tensor<B, 2, Int>>,
    /// Original `[out, in]`.
    pub shape: [usize; 2],
    /// Input columns per scale.
    pub group_size: usize,
    /// The dtype the scales were stored in; dequantized values are rounded to it.
    pub scale_dtype: Dtype,
}

impl<B: Backend> Int4Tensors<B> {
    /// Uploads `w`'s packed words, scales and zero points to `device`.
    pub fn upload(w: &PackedInt4, device: &B::Device) -> Self {
        let (out, cols, groups) = (w.out_features(), w.packed_row_words(), w.n_groups());
        let words: Vec<i32> = w.packed().iter().map(|&u| u as i32).collect();
        let packed = Tensor::from_data(TensorData::new(words, [out, cols]), (device, DType::I32));
        let scales = Tensor::from_data(TensorData::new(w.scales().to_vec(), [out, groups]), (device, DType::F32));
        let zero_points = w.zero_points().map(|zp| {
            let zp: Vec<i32> = zp.iter().map(|&z| i32::from(z)).collect();
            Tensor::from_data(TensorData::new(zp, [out, groups]), (device, DType::I32))
        });
        Self {
            packed,
            scales,
            zero_points,
            shape: [w.out_features(), w.in_features()],
            group_size: w.group_size(),
            scale_dtype: w.scale_dtype(),
        }
    }

    /// Dequantizes on the device: `W[o, i] = (q[o, i] - zp[o, i/g]) * scale[o, i/g]`, returned in the scale dtype
    /// (BF16, F16 or F32) as the reference library does.
    pub fn dequantize(&self) -> Tensor<B, 2> {
        let [out, inp] = self.shape;
        let words = self.packed.dims()[1];
        // [out, words] -> [out, words, 8] nibbles, then [out, words*8] -> [out, in].
        let nibbles: Vec<Tensor<B, 2, Int>> = (0..8)
            .map(|j| self.packed.clone().bitwise_right_shift_scalar((4 * j).elem()).bitwise_and_scalar(0xF.elem()))
            .collect();
        let q = Tensor::stack::<3>(nibbles, 2).reshape([out, words * 8]).narrow(1, 0, inp).sub_scalar(8);
        let groups = self.scales.dims()[1];
        let expand = |t: Tensor<B, 2>| -> Tensor<B, 2> {
            t.unsqueeze_dim::<3>(2)
                .repeat_dim(2, self.group_size)
                .reshape([out, groups * self.group_size])
                .narrow(1, 0, inp)
        };
        let mut centered = q.float().cast(FloatDType::F32);
        if let Some(zp) = &self.zero_points {
            centered = centered - expand(zp.clone().float().cast(FloatDType::F32));
        }
        // Exact in f32: |q - zp| <= 15 times a scale of at most 11 significant bits (24 for F32 scales).
        let w = centered * expand(self.scales.clone());
        match self.scale_dtype {
            Dtype::BF16 => w.cast(FloatDType::BF16),
            Dtype::F16 => w.cast(FloatDType::F16),
            _ => w,
        }
    }
}

/// Host-side helper: the reference dequantization as `TensorData` in the scale dtype.
pub fn dequantized_data(w: &PackedInt4) -> TensorData {
    let shape = [w.out_features(), w.in_features()];
    match w.scale_dtype() {
        Dtype::BF16 => TensorData::new(w.dequantize_bf16(), shape),
        Dtype::F16 => TensorData::new(w.dequantize_f32().into_iter().map(f16::from_f32).collect::<Vec<f16>>(), shape),
        _ => TensorData::new(w.dequantize_f32(), shape),
    }
}

/// Uploads the host-dequantized weight (the CPU reference path).
pub fn dequantized_tensor<B: Backend>(w: &PackedInt4, device: &B::Device) -> Tensor<B, 2> {
    let data = dequantized_data(w);
    let dtype = data.dtype;
    Tensor::from_data(data, (device, dtype))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use half::bf16;

    fn sample(out: usize, inp: usize, group: usize, symmetric: bool, dtype: Dtype) -> PackedInt4 {
        // Deterministic, never-zero weights with varied magnitudes.
        let w: Vec<f32> =
            (0..out * inp).map(|i| ((i * 7919 % 1013) as f32 - 506.5) * 1e-3 * (1 + i % 5) as f32).collect();
        PackedInt4::quantize_minmax(&w, out, inp, group, symmetric, dtype).expect("valid sample dims")
    }

    fn bits(data: TensorData) -> Vec<u32> {
        match data.dtype {
            DType::BF16 => data.to_vec::<bf16>().unwrap().iter().map(|x| u32::from(x.to_bits())).collect(),
            DType::F16 => data.to_vec::<f16>().unwrap().iter().map(|x| u32::from(x.to_bits())).collect(),
            _ => data.to_vec::<f32>().unwrap().iter().map(|x| x.to_bits()).collect(),
        }
    }

    #[test]
    fn device_dequant_is_bit_exact_with_host_reference() {
        let device = Default::default();
        for (out, inp, group, sym, dt) in [
            (16, 64, 32, true, Dtype::BF16),
            (9, 100, 32, true, Dtype::BF16),
            (12, 200, 64, false, Dtype::BF16),
            (8, 96, 32, false, Dtype::F16),
            (5, 48, 16, true, Dtype::F32),
        ] {
            let w = sample(out, inp, group, sym, dt);
            let dev = Int4Tensors::<Flex>::upload(&w, &device).dequantize();
            assert_eq!(dev.dims(), [out, inp]);
            let expected = dequantized_data(&w);
            assert_eq!(bits(dev.into_data()), bits(expected), "case {out}x{inp} g{group} sym={sym} {dt}");
        }
    }
}
