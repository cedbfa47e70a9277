//! Multi-head Latent Attention in its full (non-absorbed) form: DeepSeek-V2 (arXiv:2405.04434) section 2.1, as
//! transformers' `DeepseekV3Attention` with eager attention.
//!
//! - queries: `q = q_b_proj(RMSNorm_qa(q_a_proj(x)))`, or `q = q_proj(x)` without q_lora (DeepSeek-V2-Lite);
//!   per head `[q_nope (qk_nope) | q_pe (qk_rope)]`;
//! - keys/values: `kv_a_proj_with_mqa(x) = [c_kv (kv_lora_rank) | k_pe (qk_rope)]`, `c_kv <- RMSNorm_kva(c_kv)`,
//!   `kv_b_proj(c_kv)` per head `[k_nope (qk_nope) | v (v_head)]`; `k_pe` is one head shared by all;
//! - RoPE on `q_pe` and `k_pe` only; scores `scale * [q_nope | q_pe] . [k_nope | k_pe]`, causal, softmax in f32;
//!   `o_proj(concat_h sum_t p v)`.
//!
//! The absorbed form over the paged compressed KV cache lives in [`crate::kv_cache`] (it must equal this one).

use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Tensor};

use crate::linear::Linear;
use crate::rms_norm::RmsNorm;
use crate::rope::{RopeTables, RotaryEmbedding};

/// How queries are projected.
#[derive(Debug, Clone)]
pub enum QueryProjection<B: Backend> {
    /// Low-rank: `q_b_proj(q_a_layernorm(q_a_proj(x)))`.
    Lora {
        /// `[q_lora_rank, d]`.
        q_a_proj: Linear<B>,
        /// Over `q_lora_rank`.
        q_a_layernorm: RmsNorm<B>,
        /// `[H * qk_head_dim, q_lora_rank]`.
        q_b_proj: Linear<B>,
    },
    /// Plain `q_proj` `[H * qk_head_dim, d]` (`q_lora_rank: null`).
    Plain {
        /// The projection.
        q_proj: Linear<B>,
    },
}

impl<B: Backend> QueryProjection<B> {
    /// `[n, d] -> [n, H * qk_head_dim]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        match self {
            QueryProjection::Lora { q_a_proj, q_a_layernorm, q_b_proj } => {
                q_b_proj.forward(q_a_layernorm.forward(q_a_proj.forward(x)))
            }
            QueryProjection::Plain { q_proj } => q_proj.forward(x),
        }
    }
}

impl<B: Backend> Mla<B> {
    /// The queries `[n, H * qk_head_dim]` and `kv_a_proj_with_mqa(x)` `[n, kv_lora_rank + qk_rope]` of `x` `[n, d]`:
    /// on CUDA at decode widths `q_a_proj` (or `q_proj`) and `kv_a_proj_with_mqa` in one GEMV launch
    /// (`cuda_ops::gemv_pair_jobs`, the same results as two) and `q_a_layernorm` inside `q_b_proj`'s, else one after
    /// the other.
    pub fn project(&self, x: Tensor<B, 2>) -> (Tensor<B, 2>, Tensor<B, 2>) {
        #[cfg(feature = "cuda")]
        {
            let first = match &self.q {
                QueryProjection::Lora { q_a_proj, .. } => q_a_proj,
                QueryProjection::Plain { q_proj } => q_proj,
            };
            let a = crate::cuda_ops::PairJob { w: &first.weight, up: None };
            let b = crate::cuda_ops::PairJob { w: &self.kv_a_proj_with_mqa.weight, up: None };
            if let Some((a, kv_a)) = crate::cuda_ops::gemv_pair_jobs(&x, a, b) {
                // `q_a_layernorm` inside `q_b_proj`'s GEMV launch (`cuda_ops::gemv_normed`: the same values).
                let q = match &self.q {
                    QueryProjection::Lora { q_a_layernorm: norm, q_b_proj, .. } => {
                        crate::cuda_ops::gemv_normed(&a, &norm.weight, norm.eps, &q_b_proj.weight)
                            .unwrap_or_else(|| q_b_proj.forward(norm.forward(a)))
                    }
                    QueryProjection::Plain { .. } => a,
                };
                return (q, kv_a);
            }
        }
        (self.q.forward(x.clone()), self.kv_a_proj_with_mqa.forward(x))
    }
}

/// One MLA block's weights and sizes.
#[derive(Debug, Clone)]
pub struct Mla<B: Backend> {
    /// Query projection.
    pub q: QueryProjection<B>,
    /// `[kv_lora_rank + qk_rope, d]`.
    pub kv_a_proj_with_mqa: Linear<B>,
    /// Over `kv_lora_rank`.
    pub kv_a_layernorm: RmsNorm<B>,
    /// `[H * (qk_nope + v_head), kv_lora_rank]`.
    pub kv_b_proj: Linear<B>,
    /// `[d, H * v_head]`.
    pub o_proj: Linear<B>,
    /// Heads H.
    pub num_heads: usize,
    /// Non-rotary q/k head part.
    pub qk_nope_head_dim: usize,
    /// Rotary q/k head part.
    pub qk_rope_head_dim: usize,
    /// Value head size.
    pub v_head_dim: usize,
    /// KV latent rank.
    pub kv_lora_rank: usize,
    /// Softmax scale (incl. YaRN's mscale^2).
    pub softmax_scale: f64,
}

impl<B: Backend> Mla<B> {
    /// Causal self-attention over `x` `[b, s, d]` at positions `tables` (`s` rows) -> `[b, s, d]`.
    pub fn forward(&self, x: Tensor<B, 3>, rope: &RotaryEmbedding, tables: &RopeTables<B>) -> Tensor<B, 3> {
        let [b, s, d] = x.dims();
        let (h, nope, rot, vd, r) =
            (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank);
        let x = x.reshape([b * s, d]);

        // [b*s, H*(nope+rot)] -> [b, H, s, nope+rot]
        let q = self.q.forward(x.clone()).reshape([b, s, h, nope + rot]).swap_dims(1, 2);
        let q_nope = q.clone().narrow(3, 0, nope);
        let q_pe = rope.apply(q.narrow(3, nope, rot), tables);

        // [b*s, r + rot]
        let kv_a = self.kv_a_proj_with_mqa.forward(x);
        let c_kv = self.kv_a_layernorm.forward(kv_a.clone().narrow(1, 0, r));
        // [b, 1, s, rot], shared by all heads
        let k_pe = rope.apply(kv_a.narrow(1, r, rot).reshape([b, 1, s, rot]), tables);
        // [b*s, H*(nope+vd)] -> [b, H, s, nope+vd]
        let kv = self.kv_b_proj.forward(c_kv).reshape([b, s, h, nope + vd]).swap_dims(1, 2);
        let k_nope = kv.clone().narrow(3, 0, nope);
        let v = kv.narrow(3, nope, vd);

        // [b, H, s, nope+rot]
        let q = Tensor::cat(vec![q_nope, q_pe], 3);
        let k = Tensor::cat(vec![k_nope, k_pe.expand([b, h, s, rot])], 3);
        // [b, H, s, s]
        let scores = q.matmul(k.swap_dims(2, 3)).mul_scalar(self.softmax_scale);
        let future = Tensor::<B, 2, Bool>::tril_mask([s, s], 0, &scores.device()).unsqueeze::<4>().expand([b, h, s, s]);
        let probs = softmax(scores.mask_fill(future, f32::NEG_INFINITY), 3);
        // [b, H, s, vd] -> [b, s, H*vd]
        let o = probs.matmul(v).swap_dims(1, 2).reshape([b * s, h * vd]);
        self.o_proj.forward(o).reshape([b, s, d])
    }
}
