//! DeepSeek-V3 / Kimi-K2 model configuration, in two steps (STYLE rule 2): [`DeepseekV3Config`] mirrors
//! config.json key for key; [`ModelConfig`] is the validated runtime form with derived sizes as methods.
//!
//! The semantics follow transformers' `DeepseekV3Config` (`configuration_deepseek_v3.py`) and
//! `modeling_rope_utils.py` (v5.24), which are the reference for the golden tests:
//! - a missing optional key takes transformers' class default (listed on each field);
//! - RoPE parameters come from `rope_scaling` if present and non-empty, else `rope_parameters` (transformers'
//!   `convert_rope_params_to_dict`); `rope_theta` inside that dict wins over the top-level `rope_theta`, which
//!   wins over 10000; the type is `rope_type`, else `type`, else `default`;
//! - Kimi-K2.5 (`KimiK25ForConditionalGeneration`, model_type `kimi_k25`) nests the language model's config
//!   under `text_config`, and its weights live under `language_model.` ([`ModelConfig::weight_prefix`]).
//!
//! Unsupported values are errors naming the field: other rope types, `scoring_func` other than sigmoid,
//! `topk_method` other than noaux_tc, activations other than silu, attention biases, GQA/MQA head counts.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::{ModelError, Result};

/// transformers' default `rope_theta` when neither config key has one.
const DEFAULT_ROPE_THETA: f64 = 10_000.0;
/// The eps transformers gives `q_a_layernorm` and `kv_a_layernorm` (it does not pass `rms_norm_eps` to them).
pub const LATENT_NORM_EPS: f64 = 1e-6;

/// config.json of a DeepSeek-V3-architecture model (model_type `deepseek_v3` or `kimi_k2`), key for key.
///
/// Optional keys carry transformers' default in their doc. Keys not listed here are kept in `extra`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeepseekV3Config {
    /// `["DeepseekV3ForCausalLM"]` for a plain checkpoint.
    #[serde(default)]
    pub architectures: Option<Vec<String>>,
    /// `deepseek_v3` or `kimi_k2`.
    #[serde(default)]
    pub model_type: Option<String>,
    /// Vocabulary size (rows of `embed_tokens` and `lm_head`).
    pub vocab_size: usize,
    /// Residual stream width d.
    pub hidden_size: usize,
    /// Intermediate size of the dense MLP layers.
    pub intermediate_size: usize,
    /// Intermediate size of one routed expert (and, times `n_shared_experts`, of the shared expert).
    pub moe_intermediate_size: usize,
    /// Number of decoder layers (not counting MTP layers).
    pub num_hidden_layers: usize,
    /// Attention heads H.
    pub num_attention_heads: usize,
    /// Must equal `num_attention_heads` (MLA); default: `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Shared experts per MoE layer; default 1.
    #[serde(default)]
    pub n_shared_experts: Option<usize>,
    /// Routed experts per MoE layer E; default 256.
    #[serde(default)]
    pub n_routed_experts: Option<usize>,
    /// Multiplier of the routing weights; default 2.5.
    #[serde(default)]
    pub routed_scaling_factor: Option<f64>,
    /// Rank of the compressed KV latent c_kv.
    pub kv_lora_rank: usize,
    /// Rank of the query latent; `null` means a plain `q_proj` (DeepSeek-V2-Lite style). Default 1536.
    #[serde(default = "default_q_lora_rank")]
    pub q_lora_rank: Option<usize>,
    /// Rotary part of the q/k head.
    pub qk_rope_head_dim: usize,
    /// Value head size.
    pub v_head_dim: usize,
    /// Non-rotary part of the q/k head.
    pub qk_nope_head_dim: usize,
    /// Expert groups; default 8.
    #[serde(default)]
    pub n_group: Option<usize>,
    /// Groups kept per token; default 4.
    #[serde(default)]
    pub topk_group: Option<usize>,
    /// Routed experts per token k; default 8.
    #[serde(default)]
    pub num_experts_per_tok: Option<usize>,
    /// Layers `0..first_k_dense_replace` use a dense MLP, the rest MoE; default 3.
    #[serde(default)]
    pub first_k_dense_replace: Option<usize>,
    /// DeepSeek's MoE layer frequency; transformers ignores it, we accept only 1.
    #[serde(default)]
    pub moe_layer_freq: Option<usize>,
    /// Renormalize the top-k weights; default true.
    #[serde(default)]
    pub norm_topk_prob: Option<bool>,
    /// Router score function; transformers always uses `sigmoid`, so only that (or absence) is accepted.
    #[serde(default)]
    pub scoring_func: Option<String>,
    /// Router selection method; transformers always uses `noaux_tc`, so only that (or absence) is accepted.
    #[serde(default)]
    pub topk_method: Option<String>,
    /// MLP activation; default `silu` (the only one accepted).
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// Maximum positions; default 4096.
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    /// Top-level `original_max_position_embeddings`; when present transformers prefers it over the rope dict's.
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// eps of every RMSNorm except `q_a_layernorm` / `kv_a_layernorm` (see [`LATENT_NORM_EPS`]); default 1e-6.
    #[serde(default)]
    pub rms_norm_eps: Option<f64>,
    /// RoPE base (published configs); default 10000.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE scaling as published configs write it (`{"type": "yarn", ...}`).
    #[serde(default)]
    pub rope_scaling: Option<RopeParameters>,
    /// RoPE parameters as current transformers writes them (`{"rope_type": "yarn", "rope_theta": ..., ...}`).
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    /// Rotate interleaved pairs (DeepSeek's weight layout); default true.
    #[serde(default)]
    pub rope_interleave: Option<bool>,
    /// Biases on q_a/kv_a/o projections; default false (the only value accepted).
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// `lm_head` shares `embed_tokens`' weight; default false.
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    /// DeepSeek MTP layers stored after the last layer (`model.layers.{num_hidden_layers + i}.*`); default 1.
    #[serde(default)]
    pub num_nextn_predict_layers: Option<usize>,
    /// BOS id.
    #[serde(default)]
    pub bos_token_id: Option<Value>,
    /// EOS id or ids.
    #[serde(default)]
    pub eos_token_id: Option<Value>,
    /// PAD id.
    #[serde(default)]
    pub pad_token_id: Option<Value>,
    /// compressed-tensors / FP8 `quantization_config`, read by [`eyrie_quant::QuantizationConfig`].
    #[serde(default)]
    pub quantization_config: Option<Value>,
    /// Every other key (`torch_dtype`, `auto_map`, `initializer_range`, HF's derived `head_dim`, ...).
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

fn default_q_lora_rank() -> Option<usize> {
    Some(1536)
}

/// `rope_scaling` / `rope_parameters`: one flat dict (per-layer-type nesting is not used by DeepSeek-V3).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RopeParameters {
    /// Current transformers' type key (`default`, `yarn`, ...).
    #[serde(default)]
    pub rope_type: Option<String>,
    /// Published configs' type key.
    #[serde(default, rename = "type")]
    pub type_: Option<String>,
    /// RoPE base, inside the dict in current transformers.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// YaRN context extension factor s.
    #[serde(default)]
    pub factor: Option<f64>,
    /// YaRN's pretraining context L0.
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
    /// YaRN extrapolation boundary (rotations); `null`/0 means 32.
    #[serde(default)]
    pub beta_fast: Option<f64>,
    /// YaRN interpolation boundary (rotations); `null`/0 means 1.
    #[serde(default)]
    pub beta_slow: Option<f64>,
    /// YaRN mscale (cos/sin multiplier numerator).
    #[serde(default)]
    pub mscale: Option<f64>,
    /// YaRN mscale_all_dim (cos/sin denominator, and the softmax scale's mscale^2 term).
    #[serde(default)]
    pub mscale_all_dim: Option<f64>,
    /// Explicit cos/sin multiplier (overrides the mscale formula).
    #[serde(default)]
    pub attention_factor: Option<f64>,
    /// Round the YaRN correction range to whole dims; default true.
    #[serde(default)]
    pub truncate: Option<bool>,
    /// Unknown keys (rejected at validation if they would change the math).
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// The RoPE variant in use.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// YaRN (Peng et al. 2023, arXiv:2309.00071) as transformers' `_compute_yarn_parameters`.
    Yarn {
        /// Context extension factor s.
        factor: f64,
        /// Pretraining context L0.
        original_max_position_embeddings: usize,
        /// Extrapolation boundary (rotations).
        beta_fast: f64,
        /// Interpolation boundary (rotations).
        beta_slow: f64,
        /// `mscale`, if given and non-zero.
        mscale: Option<f64>,
        /// `mscale_all_dim`, if given and non-zero.
        mscale_all_dim: Option<f64>,
        /// Explicit `attention_factor`.
        attention_factor: Option<f64>,
        /// Round the correction range (default true).
        truncate: bool,
    },
}

/// What the feed-forward block of a layer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// A dense SwiGLU MLP of `intermediate_size`.
    Dense,
    /// Routed experts plus shared experts.
    Moe,
}

/// The validated runtime configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// The parsed config.json (the text config for K2.5).
    pub raw: DeepseekV3Config,
    /// The whole config.json as JSON (for the quantization config, which K2.5 may keep at the top level).
    pub json: Value,
    /// The file it came from.
    pub path: PathBuf,
    /// Prefix of every weight name: `""`, or `"language_model."` for Kimi-K2.5.
    pub weight_prefix: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual width d.
    pub hidden_size: usize,
    /// Dense MLP intermediate size.
    pub intermediate_size: usize,
    /// Routed expert intermediate size.
    pub moe_intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Heads H.
    pub num_heads: usize,
    /// Query latent rank, `None` for a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// KV latent rank.
    pub kv_lora_rank: usize,
    /// Non-rotary q/k head part.
    pub qk_nope_head_dim: usize,
    /// Rotary q/k head part.
    pub qk_rope_head_dim: usize,
    /// Value head size.
    pub v_head_dim: usize,
    /// Routed experts E.
    pub n_routed_experts: usize,
    /// Shared experts.
    pub n_shared_experts: usize,
    /// Experts per token k.
    pub num_experts_per_tok: usize,
    /// Expert groups.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Layers before the first MoE layer.
    pub first_k_dense_replace: usize,
    /// Renormalize top-k weights.
    pub norm_topk_prob: bool,
    /// Multiplier of routing weights.
    pub routed_scaling_factor: f64,
    /// eps of the block and final norms.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE variant.
    pub rope_scaling: RopeScaling,
    /// Interleaved-pair RoPE layout.
    pub rope_interleave: bool,
    /// Maximum positions.
    pub max_position_embeddings: usize,
    /// `lm_head` tied to the embedding.
    pub tie_word_embeddings: bool,
    /// MTP layers stored after the decoder layers (skipped by the loader).
    pub num_nextn_predict_layers: usize,
}

fn json_err(path: &Path, field: Option<&str>, e: impl std::fmt::Display) -> ModelError {
    ModelError::Json { path: path.to_path_buf(), field: field.map(str::to_owned), message: e.to_string() }
}

impl ModelConfig {
    /// Reads and validates `dir/config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let path = dir.as_ref().join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Io { path: path.clone(), source })?;
        Self::from_json_str(&text, &path)
    }

    /// Parses and validates config.json text; `path` is only used in errors.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let json: Value = serde_json::from_str(text).map_err(|e| json_err(path, None, e))?;
        Self::from_json(json, path)
    }

    /// Validates a parsed config.json (a DeepSeek-V3 config, or a K2.5 wrapper with `text_config`).
    pub fn from_json(json: Value, path: &Path) -> Result<Self> {
        let top_type = json.get("model_type").and_then(Value::as_str).unwrap_or_default().to_owned();
        let is_k25 = top_type == "kimi_k25"
            || json
                .get("architectures")
                .and_then(Value::as_array)
                .is_some_and(|a| a.iter().any(|v| v.as_str() == Some("KimiK25ForConditionalGeneration")));
        let (text, ctx, weight_prefix) = if is_k25 {
            let text = json
                .get("text_config")
                .filter(|v| !v.is_null())
                .ok_or_else(|| ModelError::MissingField { path: path.to_path_buf(), field: "text_config".into() })?;
            (text.clone(), "text_config.", "language_model.")
        } else if json.get("text_config").is_some_and(|v| !v.is_null()) {
            return Err(ModelError::Unsupported {
                path: path.to_path_buf(),
                field: "model_type".into(),
                value: format!("{top_type:?}"),
                reason: "a config with text_config is only understood for Kimi-K2.5 (kimi_k25)".into(),
            });
        } else {
            (json.clone(), "", "")
        };
        let raw: DeepseekV3Config = serde_path_to_error::deserialize(text.clone()).map_err(|e| {
            let at = e.path().to_string();
            let msg = e.into_inner().to_string();
            // serde names a missing field as "missing field `x`".
            match msg.strip_prefix("missing field `").and_then(|r| r.split('`').next()) {
                Some(f) => ModelError::MissingField { path: path.to_path_buf(), field: format!("{ctx}{f}") },
                None => {
                    let field = if at == "." { ctx.trim_end_matches('.').to_string() } else { format!("{ctx}{at}") };
                    json_err(path, Some(field.as_str()).filter(|s| !s.is_empty()), msg)
                }
            }
        })?;
        Self::validate(raw, json, path, ctx, weight_prefix)
    }

    fn validate(raw: DeepseekV3Config, json: Value, path: &Path, ctx: &str, prefix: &str) -> Result<Self> {
        let unsupported = |field: &str, value: String, reason: &str| ModelError::Unsupported {
            path: path.to_path_buf(),
            field: format!("{ctx}{field}"),
            value,
            reason: reason.to_owned(),
        };
        let invalid = |field: &str, message: String| ModelError::InvalidConfig {
            path: path.to_path_buf(),
            field: format!("{ctx}{field}"),
            message,
        };

        if let Some(t) = raw.model_type.as_deref()
            && !matches!(t, "deepseek_v3" | "kimi_k2")
        {
            return Err(unsupported("model_type", format!("{t:?}"), "expected deepseek_v3 or kimi_k2"));
        }
        let act = raw.hidden_act.as_deref().unwrap_or("silu");
        if act != "silu" {
            return Err(unsupported("hidden_act", format!("{act:?}"), "only silu is implemented"));
        }
        if let Some(f) = raw.scoring_func.as_deref()
            && f != "sigmoid"
        {
            return Err(unsupported(
                "scoring_func",
                format!("{f:?}"),
                "only sigmoid (DeepSeek-V3 routing) is implemented",
            ));
        }
        if let Some(m) = raw.topk_method.as_deref()
            && m != "noaux_tc"
        {
            return Err(unsupported(
                "topk_method",
                format!("{m:?}"),
                "only noaux_tc (DeepSeek-V3 routing) is implemented",
            ));
        }
        if raw.attention_bias == Some(true) {
            return Err(unsupported("attention_bias", "true".into(), "MLA projections without bias only"));
        }
        if let Some(f) = raw.moe_layer_freq
            && f != 1
        {
            return Err(unsupported("moe_layer_freq", f.to_string(), "every layer after first_k_dense_replace is MoE"));
        }
        for (field, v) in [
            ("vocab_size", raw.vocab_size),
            ("hidden_size", raw.hidden_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", raw.num_attention_heads),
            ("kv_lora_rank", raw.kv_lora_rank),
            ("qk_rope_head_dim", raw.qk_rope_head_dim),
            ("v_head_dim", raw.v_head_dim),
        ] {
            if v == 0 {
                return Err(invalid(field, "must be positive".into()));
            }
        }
        if !raw.qk_rope_head_dim.is_multiple_of(2) {
            return Err(invalid("qk_rope_head_dim", format!("{} is odd; RoPE rotates pairs", raw.qk_rope_head_dim)));
        }
        if let Some(kv) = raw.num_key_value_heads
            && kv != raw.num_attention_heads
        {
            return Err(unsupported(
                "num_key_value_heads",
                kv.to_string(),
                &format!("MLA needs it equal to num_attention_heads ({})", raw.num_attention_heads),
            ));
        }
        if raw.q_lora_rank == Some(0) {
            return Err(invalid("q_lora_rank", "must be positive or null".into()));
        }

        let n_routed_experts = raw.n_routed_experts.unwrap_or(256);
        let num_experts_per_tok = raw.num_experts_per_tok.unwrap_or(8);
        let n_group = raw.n_group.unwrap_or(8);
        let topk_group = raw.topk_group.unwrap_or(4);
        let first_k_dense_replace = raw.first_k_dense_replace.unwrap_or(3);
        let has_moe = first_k_dense_replace < raw.num_hidden_layers;
        if has_moe {
            if n_routed_experts == 0 {
                return Err(invalid("n_routed_experts", "must be positive when MoE layers exist".into()));
            }
            if num_experts_per_tok == 0 || num_experts_per_tok > n_routed_experts {
                return Err(invalid(
                    "num_experts_per_tok",
                    format!("{num_experts_per_tok} is not in 1..={n_routed_experts} (n_routed_experts)"),
                ));
            }
            if n_group == 0 || !n_routed_experts.is_multiple_of(n_group) {
                return Err(invalid(
                    "n_group",
                    format!("{n_group} does not divide n_routed_experts {n_routed_experts}"),
                ));
            }
            if n_routed_experts / n_group < 2 {
                return Err(invalid("n_group", "each group needs at least 2 experts (group score = top-2 sum)".into()));
            }
            if topk_group == 0 || topk_group > n_group {
                return Err(invalid("topk_group", format!("{topk_group} is not in 1..={n_group} (n_group)")));
            }
            if num_experts_per_tok > topk_group * (n_routed_experts / n_group) {
                return Err(invalid(
                    "num_experts_per_tok",
                    format!("{num_experts_per_tok} exceeds the experts in topk_group {topk_group} groups"),
                ));
            }
        }

        let max_position_embeddings = raw.max_position_embeddings.unwrap_or(4096);
        let (rope_theta, rope_scaling) = resolve_rope(&raw, max_position_embeddings, &unsupported, &invalid)?;

        Ok(Self {
            weight_prefix: prefix.to_owned(),
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            moe_intermediate_size: raw.moe_intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            q_lora_rank: raw.q_lora_rank,
            kv_lora_rank: raw.kv_lora_rank,
            qk_nope_head_dim: raw.qk_nope_head_dim,
            qk_rope_head_dim: raw.qk_rope_head_dim,
            v_head_dim: raw.v_head_dim,
            n_routed_experts,
            n_shared_experts: raw.n_shared_experts.unwrap_or(1),
            num_experts_per_tok,
            n_group,
            topk_group,
            first_k_dense_replace,
            norm_topk_prob: raw.norm_topk_prob.unwrap_or(true),
            routed_scaling_factor: raw.routed_scaling_factor.unwrap_or(2.5),
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            rope_interleave: raw.rope_interleave.unwrap_or(true),
            max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            num_nextn_predict_layers: raw.num_nextn_predict_layers.unwrap_or(1),
            raw,
            json,
            path: path.to_path_buf(),
        })
    }

    /// q/k head size: `qk_nope_head_dim + qk_rope_head_dim` (192 for DeepSeek-V3 / Kimi-K2).
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Output width of `kv_a_proj_with_mqa`: `kv_lora_rank + qk_rope_head_dim` (576).
    pub fn kv_a_dim(&self) -> usize {
        self.kv_lora_rank + self.qk_rope_head_dim
    }

    /// Shared expert intermediate size: `moe_intermediate_size * n_shared_experts`.
    pub fn shared_intermediate_size(&self) -> usize {
        self.moe_intermediate_size * self.n_shared_experts
    }

    /// The feed-forward kind of layer `layer` (transformers: MoE iff `layer >= first_k_dense_replace`).
    pub fn layer_kind(&self, layer: usize) -> LayerKind {
        if layer >= self.first_k_dense_replace { LayerKind::Moe } else { LayerKind::Dense }
    }

    /// Attention softmax scale: `qk_head_dim^-1/2`, times `m(factor, mscale_all_dim)^2` under YaRN when
    /// `mscale_all_dim` is non-zero (transformers' `yarn_apply_mscale`).
    pub fn softmax_scale(&self) -> f64 {
        let base = (self.qk_head_dim() as f64).powf(-0.5);
        match self.rope_scaling {
            RopeScaling::Yarn { factor, mscale_all_dim: Some(all), .. } => {
                let m = yarn_get_mscale(factor, all);
                base * m * m
            }
            _ => base,
        }
    }

    /// The cos/sin multiplier of RoPE (YaRN's `attention_factor`; 1 for plain RoPE).
    pub fn rope_attention_factor(&self) -> f64 {
        match self.rope_scaling {
            RopeScaling::Default => 1.0,
            RopeScaling::Yarn { factor, mscale, mscale_all_dim, attention_factor, .. } => attention_factor
                .unwrap_or_else(|| match (mscale, mscale_all_dim) {
                    (Some(m), Some(all)) => yarn_get_mscale(factor, m) / yarn_get_mscale(factor, all),
                    _ => yarn_get_mscale(factor, 1.0),
                }),
        }
    }

    /// RoPE inverse frequencies, `qk_rope_head_dim / 2` values in f32, computed with transformers' f32 operation
    /// order (`_compute_default_rope_parameters` / `_compute_yarn_parameters`).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let dim = self.qk_rope_head_dim;
        let base = self.rope_theta as f32;
        // pos_freqs = base ** (arange(0, dim, 2).float() / dim), in f32.
        let pos_freqs: Vec<f32> = (0..dim / 2).map(|i| base.powf((2 * i) as f32 / dim as f32)).collect();
        match self.rope_scaling {
            RopeScaling::Default => pos_freqs.iter().map(|p| 1.0 / p).collect(),
            RopeScaling::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, truncate, .. } => {
                let correction_dim = |rot: f64| {
                    dim as f64 * (original_max_position_embeddings as f64 / (rot * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * self.rope_theta.ln())
                };
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0);
                let mut high = high.min((dim - 1) as f64);
                if low == high {
                    high += 0.001;
                }
                let factor = factor as f32;
                pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| {
                        let extrapolation = 1.0 / p;
                        let interpolation = 1.0 / (factor * p);
                        let ramp = ((i as f32 - low as f32) / (high as f32 - low as f32)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
                    })
                    .collect()
            }
        }
    }

    /// Checkpoint name of the model-relative weight `name` (`model.layers.0.input_layernorm.weight`,
    /// `lm_head.weight`): the one place the K2.5 `language_model.` prefix is applied.
    pub fn weight_name(&self, name: &str) -> String {
        format!("{}{name}", self.weight_prefix)
    }

    /// The quantization config, looked up as `eyrie-quant` does (top level, else `text_config`).
    pub fn quantization(&self) -> Result<Option<eyrie_quant::QuantizationConfig>> {
        eyrie_quant::QuantizationConfig::from_model_config(&self.json).map_err(ModelError::from)
    }
}

/// DeepSeek / transformers `yarn_get_mscale`: `1` if `s <= 1`, else `0.1 * mscale * ln(s) + 1`.
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 { 1.0 } else { 0.1 * mscale * scale.ln() + 1.0 }
}

type FieldErr<'a> = dyn Fn(&str, String, &str) -> ModelError + 'a;
type InvalidErr<'a> = dyn Fn(&str, String) -> ModelError + 'a;

/// transformers' RoPE parameter resolution (see the module docs).
fn resolve_rope(
    raw: &DeepseekV3Config,
    max_position_embeddings: usize,
    unsupported: &FieldErr<'_>,
    invalid: &InvalidErr<'_>,
) -> Result<(f64, RopeScaling)> {
    let non_empty = |p: &Option<RopeParameters>| p.clone().filter(|p| *p != RopeParameters::default());
    let (field, params) = match (non_empty(&raw.rope_scaling), non_empty(&raw.rope_parameters)) {
        (Some(p), _) => ("rope_scaling", p),
        (None, Some(p)) => ("rope_parameters", p),
        (None, None) => ("rope_parameters", RopeParameters::default()),
    };
    let theta = params.rope_theta.or(raw.rope_theta).unwrap_or(DEFAULT_ROPE_THETA);
    if theta.is_nan() || theta <= 1.0 {
        return Err(invalid("rope_theta", format!("{theta} must be > 1")));
    }
    if let Some(k) = params.extra.keys().find(|k| k.as_str() != "partial_rotary_factor") {
        return Err(unsupported(&format!("{field}.{k}"), format!("{:?}", params.extra[k]), "unknown RoPE parameter"));
    }
    if let Some(p) = params.extra.get("partial_rotary_factor")
        && p.as_f64() != Some(1.0)
    {
        return Err(unsupported(&format!("{field}.partial_rotary_factor"), p.to_string(), "only 1.0 is implemented"));
    }
    let (type_field, rope_type) = match (&params.rope_type, &params.type_) {
        (Some(t), _) => ("rope_type", t.as_str()),
        (None, Some(t)) => ("type", t.as_str()),
        (None, None) => ("rope_type", "default"),
    };
    let scaling = match rope_type {
        "default" => RopeScaling::Default,
        "yarn" => {
            let original = raw
                .original_max_position_embeddings
                .or(params.original_max_position_embeddings)
                .unwrap_or(max_position_embeddings);
            let factor = params.factor.ok_or_else(|| {
                invalid(&format!("{field}.factor"), "required for yarn (transformers' validation)".into())
            })?;
            if factor.is_nan() || factor < 1.0 {
                return Err(invalid(&format!("{field}.factor"), format!("{factor} must be >= 1")));
            }
            if original == 0 {
                return Err(invalid(&format!("{field}.original_max_position_embeddings"), "must be positive".into()));
            }
            let or_default = |v: Option<f64>, d: f64| v.filter(|&x| x != 0.0).unwrap_or(d);
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: or_default(params.beta_fast, 32.0),
                beta_slow: or_default(params.beta_slow, 1.0),
                mscale: params.mscale.filter(|&m| m != 0.0),
                mscale_all_dim: params.mscale_all_dim.filter(|&m| m != 0.0),
                attention_factor: params.attention_factor,
                truncate: params.truncate.unwrap_or(true),
            }
        }
        other => {
            return Err(unsupported(
                &format!("{field}.{type_field}"),
                format!("{other:?}"),
                "only default and yarn RoPE are implemented",
            ));
        }
    };
    Ok((theta, scaling))
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
