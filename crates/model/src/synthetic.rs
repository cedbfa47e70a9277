//! Models at real shapes without a checkpoint, for benchmarks: [`SyntheticWeights`] makes every weight on the
//! device from its name and shape, deterministically (the same values on every rank and every run of the same
//! backend), so a full-width Kimi-K2 slice can be timed on a GPU without writing or reading hundreds of GB.
//!
//! Values: norm weights 1, router bias 0, and `w[r, c] = sin(a r + b c + s) * sin(k (r + 1)(c + 1) + s) / sqrt(in)`
//! for matrices (`s` from the tensor's name): bounded, full rank in practice, scaled like a trained layer's so
//! activations neither vanish nor blow up over a few layers. Routed experts are INT4 (packed words from the same
//! pattern, group 32, BF16 scales), as Kimi-K2 stores them. The outputs mean nothing; the bytes moved and the
//! kernels run are the real model's.

use std::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, IntDType, Tensor};
use eyrie_quant::Dtype;
use eyrie_quant::burn::Int4Tensors;

use crate::config::ModelConfig;
use crate::deepseek_v3::DeepseekV3;
use crate::error::Result;
use crate::linear::{Linear, StoredLinear};
use crate::weights::WeightSource;

/// INT4 group size of synthetic experts (Kimi-K2's).
const GROUP: usize = 32;

/// Weights made from names and shapes (see the module docs).
#[derive(Debug, Default, Clone, Copy)]
pub struct SyntheticWeights;

/// A salt in `[0, 2 pi)` from a tensor name (FNV-1a).
fn salt(name: &str) -> f32 {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    (h % 1_000_003) as f32 / 1_000_003.0 * std::f32::consts::TAU
}

/// `[rows, cols]` of the module docs' pattern, times `scale`.
fn matrix<B: Backend>(name: &str, rows: usize, cols: usize, scale: f32, device: &B::Device) -> Tensor<B, 2> {
    let s = salt(name);
    let r = Tensor::<B, 1, Int>::arange(0..rows as i64, device).float().reshape([rows, 1]);
    let c = Tensor::<B, 1, Int>::arange(0..cols as i64, device).float().reshape([1, cols]);
    let smooth = (r.clone() * 0.754_877_7 + c.clone() * 0.569_840_3 + s).sin();
    let mixed = ((r + 1.0) * (c + 1.0) * 0.123_456_7 + s).sin();
    smooth * mixed * scale
}

impl WeightSource for SyntheticWeights {
    fn tensor<B: Backend, const D: usize>(
        &mut self,
        canonical: &str,
        shape: [usize; D],
        device: &B::Device,
    ) -> Result<Tensor<B, D>> {
        if canonical.ends_with("norm.weight") {
            return Ok(Tensor::ones(shape, device));
        }
        let n: usize = shape.iter().product();
        let cols = shape.last().copied().unwrap_or(1).max(1);
        Ok(matrix::<B>(canonical, n / cols, cols, 1.0, device).reshape(shape))
    }

    fn linear<B: Backend>(&mut self, canonical: &str, shape: [usize; 2], device: &B::Device) -> Result<Linear<B>> {
        let [out, inp] = shape;
        // Made as W^T `[in, out]` directly, the layout Linear keeps.
        // BF16 values, as a checkpoint's dense weights are.
        let w_t = matrix::<B>(canonical, inp, out, 1.0 / (inp as f32).sqrt(), device);
        Ok(Linear::from_weight(w_t.transpose().cast(FloatDType::BF16)))
    }

    /// Routed experts as INT4 (group 32, BF16 scales, symmetric), as Kimi-K2's checkpoints store them: packed
    /// words from the pattern, scales `1 / (4 sqrt(in))`, so the dequantized weights (q in -8..7) have about the
    /// dense synthetic weights' spread. Widths that are not multiples of 32 stay dense.
    fn stored_linear<B: Backend>(
        &mut self,
        canonical: &str,
        shape: [usize; 2],
        device: &B::Device,
    ) -> Result<StoredLinear<B>> {
        let [out, inp] = shape;
        if !inp.is_multiple_of(GROUP) {
            return Ok(StoredLinear::Dense(self.linear(canonical, shape, device)?));
        }
        // Bit patterns in [-2^31, 2^31). An f32 holds 24 significant bits, so the low nibbles of most words are 0
        // (q = -8 in ~91% of first nibbles; scripts/hf_slice_peer.py prints the histogram): less varied than a
        // real checkpoint's weights, the same bytes and kernels.
        let packed = matrix::<B>(canonical, out, inp / 8, 2_147_483_520.0, device).int().cast(IntDType::I32);
        // A BF16 value, as a checkpoint's BF16 scales are (the fused experts hold them as BF16).
        let scale = burn::tensor::bf16::from_f32(1.0 / (4.0 * (inp as f32).sqrt())).to_f32();
        let scales = Tensor::<B, 2>::ones([out, inp / GROUP], device) * scale;
        Ok(StoredLinear::Int4(Box::new(Int4Tensors {
            packed,
            scales,
            zero_points: None,
            shape,
            group_size: GROUP,
            scale_dtype: Dtype::BF16,
        })))
    }

    fn host_vector(&mut self, _canonical: &str, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn skip_linear(&mut self, _canonical: &str) -> Result<()> {
        Ok(())
    }

    fn finish(self) -> Result<()> {
        Ok(())
    }
}

/// Kimi-K2's config (K2-Thinking / K2.5 text model: hidden 7168, 64 MLA heads, 384 routed experts of width 2048,
/// top-8, one shared expert, vocabulary 163840, YaRN factor 64) with `layers` layers: layer 0 dense, the others
/// MoE. The shapes of a full-width "Kimi-K2 slice" for benchmarks.
pub fn kimi_k2_config(layers: usize) -> Result<ModelConfig> {
    let json = serde_json::json!({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "hidden_size": 7168, "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 64,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "n_routed_experts": 384, "num_experts_per_tok": 8,
        "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827, "norm_topk_prob": true,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 1, "vocab_size": 163840,
        "max_position_embeddings": 262144, "rope_theta": 50000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
        "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 1.0, "beta_slow": 1.0},
        "bos_token_id": 163584, "eos_token_id": 163585, "hidden_act": "silu", "torch_dtype": "bfloat16"
    });
    ModelConfig::from_json(json, std::path::Path::new("<Kimi-K2 config>"))
}

impl<B: Backend> DeepseekV3<B> {
    /// A model of `config`'s shapes with [`SyntheticWeights`] on `device`, holding the routed experts in `experts`
    /// only (all of them: `0..n_routed_experts`; a subset is only a source for
    /// [`crate::parallel::ShardedDeepseekV3::synthetic`]).
    pub fn synthetic(config: &ModelConfig, device: &B::Device, experts: Range<usize>) -> Result<Self> {
        Self::build(config, SyntheticWeights, device, Some(experts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kimi_k2_config_has_kimi_shapes() {
        let c = kimi_k2_config(3).unwrap();
        assert_eq!((c.hidden_size, c.num_heads, c.n_routed_experts, c.vocab_size), (7168, 64, 384, 163840));
        assert_eq!((c.qk_head_dim(), c.kv_a_dim(), c.num_hidden_layers), (192, 576, 3));
    }

    #[test]
    fn synthetic_weights_are_deterministic_bounded_and_not_constant() {
        let device = Default::default();
        let a = matrix::<burn::backend::Flex>("x.weight", 64, 48, 0.5, &device);
        let b = matrix::<burn::backend::Flex>("x.weight", 64, 48, 0.5, &device);
        let c = matrix::<burn::backend::Flex>("y.weight", 64, 48, 0.5, &device);
        let host = |t: Tensor<burn::backend::Flex, 2>| t.into_data().to_vec::<f32>().unwrap();
        let (a, b, c) = (host(a), host(b), host(c));
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert!(a.iter().all(|v| v.abs() <= 0.5));
        let mean = a.iter().sum::<f32>() / a.len() as f32;
        let var = a.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / a.len() as f32;
        assert!(var > 0.01, "variance {var}");
    }
}
