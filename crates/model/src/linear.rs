//! A bias-free Linear layer, `y = x W^T`, whose weight comes from a checkpoint's [`LinearWeight`]: dense (BF16,
//! F16, F32), compressed-tensors INT4, or FP8 with block scales.
//!
//! The weight `W` `[out, in]` is held in f32, except on CUDA where a BF16 weight stays BF16 (every BF16 value is
//! an f32, so nothing changes but the bytes: half of them): decode widths (up to
//! [`crate::cuda_ops::GEMV_MAX_TOKENS`] rows) run eyrie-quant's GEMV kernel over the BF16 rows with f32
//! activations and accumulation, batched decode and verification widths (up to
//! [`crate::cuda_ops::mma_gemv_max_tokens`]) its f32-exact tensor-core GEMV, wider inputs (larger batches, prefill
//! chunks) eyrie-quant's f32-exact tensor-core GEMM through cuBLAS ([`eyrie_quant::cuda::gemm`]; burn's matmul on an f32 copy when cuBLAS is missing). INT4 is uploaded packed and
//! dequantized on the device ([`Int4Tensors::dequantize`], bit-exact with compressed-tensors), FP8 is
//! dequantized on the host. Routed experts keep INT4 packed ([`StoredLinear`], and on CUDA `crate::fused_moe`).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use eyrie_quant::LinearWeight;
use eyrie_quant::burn::{Int4Tensors, dense_tensor};

use crate::error::Result;

/// A Linear layer `[.., in] -> [.., out]` without bias.
#[derive(Debug, Clone)]
pub struct Linear<B: Backend> {
    /// `W` `[out, in]`: f32, or BF16 on CUDA (see the module docs); contiguous on CUDA.
    pub weight: Tensor<B, 2>,
}

impl<B: Backend> Linear<B> {
    /// Wraps a weight `W` of shape `[out, in]`: kept BF16 on CUDA when it is BF16, f32 otherwise.
    pub fn from_weight(weight: Tensor<B, 2>) -> Self {
        let keep_bf16 = weight.dtype() == DType::BF16 && crate::fused_moe::is_cuda::<B>();
        let weight = if keep_bf16 { weight } else { weight.cast(FloatDType::F32) };
        #[cfg(feature = "cuda")]
        let weight = crate::cuda_ops::contiguous(weight);
        Self { weight }
    }

    /// Uploads a checkpoint weight to `device` (see the module docs for what each kind becomes).
    pub fn load(weight: &LinearWeight<'_>, device: &B::Device) -> Result<Self> {
        let w: Tensor<B, 2> = match weight {
            LinearWeight::Dense(view) => dense_tensor::<B, 2>(view, device)?,
            LinearWeight::Int4(packed) => Int4Tensors::<B>::upload(packed, device).dequantize(),
            LinearWeight::Fp8Block { .. } => {
                let [out, inp] = weight.shape();
                Tensor::from_data(TensorData::new(weight.dequantize_f32()?, [out, inp]), device)
            }
        };
        Ok(Self::from_weight(w))
    }

    /// `W^T` `[in, out]` in f32.
    pub fn weight_t(&self) -> Tensor<B, 2> {
        self.weight.clone().cast(FloatDType::F32).transpose()
    }

    /// `[in]` and `[out]`.
    pub fn dims(&self) -> [usize; 2] {
        let [out, inp] = self.weight.dims();
        [inp, out]
    }

    /// `[n, in] -> [n, out]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        #[cfg(feature = "cuda")]
        if let Some(y) = crate::cuda_ops::gemv(&x, &self.weight) {
            return y;
        }
        #[cfg(feature = "cuda")]
        if let Some(y) = crate::cuda_ops::gemm(&x, &self.weight) {
            return y;
        }
        x.matmul(self.weight_t())
    }
}

/// A Linear kept on the device as the checkpoint stores it: dense (f32), or INT4 (the packed words and scales,
/// 0.625 bytes a parameter instead of 4, dequantized at each use with the same ops and result as
/// [`Linear::load`]). Routed experts are held this way, so a model loads in about its checkpoint's size.
#[derive(Debug, Clone)]
pub enum StoredLinear<B: Backend> {
    /// Dense f32 `W^T`.
    Dense(Linear<B>),
    /// Packed INT4 parts.
    Int4(Box<Int4Tensors<B>>),
}

impl<B: Backend> StoredLinear<B> {
    /// Uploads a checkpoint weight: INT4 stays packed, other kinds become a dense [`Linear`].
    pub fn load(weight: &LinearWeight<'_>, device: &B::Device) -> Result<Self> {
        Ok(match weight {
            LinearWeight::Int4(packed) => StoredLinear::Int4(Box::new(Int4Tensors::upload(packed, device))),
            other => StoredLinear::Dense(Linear::load(other, device)?),
        })
    }

    /// `[in]` and `[out]`.
    pub fn dims(&self) -> [usize; 2] {
        match self {
            StoredLinear::Dense(l) => l.dims(),
            StoredLinear::Int4(w) => [w.shape[1], w.shape[0]],
        }
    }

    /// `[n, in] -> [n, out]`; bit for bit what the dense [`Linear`] of the same checkpoint weight gives.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        match self {
            StoredLinear::Dense(l) => l.forward(x),
            StoredLinear::Int4(w) => Linear::from_weight(w.dequantize()).forward(x),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use eyrie_quant::{Checkpoint, Dtype, PackedInt4, SafetensorsWriter};

    /// Every storage kind loads to exactly the f32 weight `LinearWeight::dequantize_f32` gives, and `forward`
    /// computes `x W^T`; [`StoredLinear`] keeps INT4 packed and gives the same outputs.
    #[test]
    fn every_weight_kind_loads_to_its_dequantized_values() {
        let device = Default::default();
        let (out, inp) = (130, 64);
        let w: Vec<f32> = (0..out * inp).map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 512.0).collect();
        let mut wr = SafetensorsWriter::new();
        wr.add_bf16("dense.weight", &[out, inp], &w.iter().map(|&v| half::bf16::from_f32(v)).collect::<Vec<_>>())
            .unwrap();
        // FP8 E4M3 bytes (any byte but the NaN codes 0x7f / 0xff is a finite value) with 128x128 block scales.
        let fp8: Vec<u8> = (0..out * inp).map(|i| (i * 37 % 251) as u8 & 0x7e).collect();
        wr.add("fp8.weight", Dtype::F8_E4M3, &[out, inp], fp8).unwrap();
        wr.add_f32("fp8.weight_scale_inv", &[2, 1], &[0.5, 3.0]).unwrap();
        let q = PackedInt4::quantize_minmax(&w, out, inp, 32, true, Dtype::BF16).unwrap();
        wr.add_u32_as_i32("int4.weight_packed", &[out, inp / 8], q.packed()).unwrap();
        let scales: Vec<half::bf16> = q.scales().iter().map(|&s| half::bf16::from_f32(s)).collect();
        wr.add_bf16("int4.weight_scale", &[out, inp / 32], &scales).unwrap();
        wr.add_i64("int4.weight_shape", &[2], &[out as i64, inp as i64]).unwrap();
        let dir = tempfile::tempdir().unwrap();
        wr.write(dir.path().join("model.safetensors")).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();

        let x: Vec<f32> = (0..3 * inp).map(|i| (i % 11) as f32 - 5.0).collect();
        for (prefix, kind) in [("dense", "Dense"), ("fp8", "Fp8Block"), ("int4", "Int4")] {
            let weight = LinearWeight::load(&ckpt, prefix, Some(32)).unwrap();
            assert_eq!(format!("{:?}", weight.kind()), kind);
            let want = weight.dequantize_f32().unwrap();
            let linear = Linear::<Flex>::load(&weight, &device).unwrap();
            assert_eq!(linear.dims(), [inp, out]);
            let got = linear.weight.clone().into_data().to_vec::<f32>().unwrap();
            assert_eq!(got, want, "{prefix}");
            let xt = Tensor::<Flex, 2>::from_data(TensorData::new(x.clone(), [3, inp]), &device);
            let y = linear.forward(xt.clone()).into_data().to_vec::<f32>().unwrap();
            // Kept as stored: INT4 stays packed (and only INT4), with the same output bit for bit.
            let stored = StoredLinear::<Flex>::load(&weight, &device).unwrap();
            assert_eq!(matches!(stored, StoredLinear::Int4(_)), kind == "Int4", "{prefix}");
            assert_eq!(stored.dims(), [inp, out]);
            assert_eq!(stored.forward(xt).into_data().to_vec::<f32>().unwrap(), y, "{prefix}");
            for r in 0..3 {
                for o in (0..out).step_by(17) {
                    let dot: f64 = (0..inp).map(|i| f64::from(x[r * inp + i]) * f64::from(want[o * inp + i])).sum();
                    assert!((f64::from(y[r * out + o]) - dot).abs() <= 1e-4 * dot.abs().max(1.0), "{prefix} {r},{o}");
                }
            }
        }
    }
}
