//! The SwiGLU feed-forward block of DeepSeek-V3 (dense layers, each routed expert, the shared expert):
//! `down(silu(gate(x)) * up(x))`, as transformers' `DeepseekV3MLP`.

use burn::tensor::Tensor;
use burn::tensor::activation::silu;
use burn::tensor::backend::Backend;

use crate::linear::{Linear, StoredLinear};

/// `gate_proj`, `up_proj` (`[inter, d]`) and `down_proj` (`[d, inter]`).
#[derive(Debug, Clone)]
pub struct Mlp<B: Backend> {
    /// Gate projection.
    pub gate_proj: Linear<B>,
    /// Up projection.
    pub up_proj: Linear<B>,
    /// Down projection.
    pub down_proj: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    /// `[n, d] -> [n, d]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        // On CUDA at decode widths: gate, up and the activation in one launch (`cuda_ops::gemv_swiglu_pair`).
        #[cfg(feature = "cuda")]
        if let Some(h) = crate::cuda_ops::gemv_swiglu_pair(&x, &self.gate_proj.weight, &self.up_proj.weight) {
            return self.down_proj.forward(h);
        }
        // [n, inter]
        let h = silu(self.gate_proj.forward(x.clone())) * self.up_proj.forward(x);
        self.down_proj.forward(h)
    }
}

/// A routed expert: the same SwiGLU block with its projections kept as stored ([`StoredLinear`]: INT4 stays
/// packed on the device).
#[derive(Debug, Clone)]
pub struct Expert<B: Backend> {
    /// Gate projection `[inter, d]`.
    pub gate_proj: StoredLinear<B>,
    /// Up projection `[inter, d]`.
    pub up_proj: StoredLinear<B>,
    /// Down projection `[d, inter]`.
    pub down_proj: StoredLinear<B>,
}

impl<B: Backend> Expert<B> {
    /// `[n, d] -> [n, d]`, as [`Mlp::forward`].
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let h = silu(self.gate_proj.forward(x.clone())) * self.up_proj.forward(x);
        self.down_proj.forward(h)
    }
}
