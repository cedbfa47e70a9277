//! RMSNorm (Zhang & Sennrich 2019, arXiv:1910.07467) as transformers' `DeepseekV3RMSNorm`:
//! `y = w * (x / sqrt(mean(x^2) + eps))`, computed in f32.
//!
//! eps: transformers builds `q_a_layernorm` and `kv_a_layernorm` with its default 1e-6 and every other norm with
//! `rms_norm_eps` (see [`crate::config::LATENT_NORM_EPS`]); the golden tests match that choice.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// One RMSNorm: a weight of the normalized width and an eps.
#[derive(Debug, Clone)]
pub struct RmsNorm<B: Backend> {
    /// `[width]`.
    pub weight: Tensor<B, 1>,
    /// Added to the mean square.
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    /// A norm with the given weight and eps.
    pub fn new(weight: Tensor<B, 1>, eps: f64) -> Self {
        Self { weight, eps }
    }

    /// Normalizes the last dimension: `[.., width] -> [.., width]`.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        #[cfg(feature = "cuda")]
        {
            // On CUDA one kernel does the whole norm (`crate::cuda_ops::rms_norm`).
            let dims = x.dims();
            let width = dims[D - 1];
            let rows = dims.iter().product::<usize>() / width.max(1);
            if let Some(y) = crate::cuda_ops::rms_norm(&x.clone().reshape([rows, width]), &self.weight, self.eps) {
                return y.reshape(dims);
            }
        }
        // [.., 1]
        let variance = x.clone().powi_scalar(2).mean_dim(D - 1);
        let normed = x * variance.add_scalar(self.eps).sqrt().recip();
        // [width] -> [1, .., 1, width], broadcast over the leading dims.
        normed * self.weight.clone().unsqueeze::<D>()
    }

    /// The residual update and its norm: `h = x + res` and `forward(h)`, `[n, width]` each; on CUDA one launch.
    pub fn forward_add(&self, x: Tensor<B, 2>, res: Tensor<B, 2>) -> (Tensor<B, 2>, Tensor<B, 2>) {
        #[cfg(feature = "cuda")]
        if let Some(pair) = crate::cuda_ops::add_rms_norm(&x, &res, &self.weight, self.eps) {
            return pair;
        }
        let h = x + res;
        (h.clone(), self.forward(h))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    #[test]
    fn matches_a_scalar_reference() {
        let device = Default::default();
        let x: Vec<f32> = (0..12).map(|i| (i as f32 - 5.5) * 0.3).collect();
        let w: Vec<f32> = (0..4).map(|i| 1.0 + 0.1 * i as f32).collect();
        let norm = RmsNorm::<Flex>::new(Tensor::from_data(TensorData::new(w.clone(), [4]), &device), 1e-5);
        let y = norm.forward(Tensor::<Flex, 2>::from_data(TensorData::new(x.clone(), [3, 4]), &device));
        let y = y.into_data().to_vec::<f32>().unwrap();
        for r in 0..3 {
            let row = &x[r * 4..r * 4 + 4];
            let ms = row.iter().map(|v| v * v).sum::<f32>() / 4.0;
            for c in 0..4 {
                let want = w[c] * row[c] / (ms + 1e-5).sqrt();
                assert!((y[r * 4 + c] - want).abs() <= 1e-6 * want.abs().max(1.0), "{r},{c}");
            }
        }
    }
}
