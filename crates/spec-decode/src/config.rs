//! EAGLE-3 drafter configs in the two published layouts, read into one validated [`Eagle3Config`], and the
//! aux-layer convention that turns a config's `eagle_aux_hidden_state_layer_ids` into the target's capture ids.
//!
//! Layouts (config.json):
//! - HF / SpecForge (`architectures: ["LlamaForCausalLMEagle3"]`, SpecForge `specforge/modeling/draft/llama3_eagle.py`):
//!   a LlamaConfig at the top level (`hidden_size`, `intermediate_size`, `num_attention_heads`,
//!   `num_key_value_heads`, optional `head_dim`, `rms_norm_eps`, `rope_theta` or transformers 5's `rope_parameters`,
//!   optional `rope_scaling`, `vocab_size` = the target's vocabulary), `draft_vocab_size` (absent = the full
//!   vocabulary, no `d2t`), optional `target_hidden_size`, and
//!   `eagle_config: {eagle_aux_hidden_state_layer_ids: [...], use_aux_hidden_state: true}`.
//! - speculators (`speculators_model_type: "eagle3"`, `architectures: ["Eagle3Speculator"]`, vllm-project/speculators
//!   `src/speculators/models/eagle3/config.py`): the Llama fields under `transformer_layer_config`; at the top level
//!   `draft_vocab_size`, `norm_before_residual`, `norm_before_fc` (one RMSNorm over the concatenated aux states,
//!   tensor `input_norm.weight`), `fc_norm` (one RMSNorm per aux chunk, `fc_norm.{i}.weight`), `target_hidden_size`,
//!   `eagle_aux_hidden_state_layer_ids`.
//!
//! Aux ids: engines disagree on what id `i` names. vLLM captures the residual stream at the INPUT of layer `i`
//! (HF `hidden_states[i]`); SGLang (and SpecForge, which trains against SGLang or HF with the same +1) takes the
//! OUTPUT of layer `i`, i.e. the input of layer `i + 1`. [`AuxConvention`] names the two; eyrie-model's capture ids
//! are input-of-layer ids (see `DeepseekV3::forward_batch_capture`). When a config has no ids, both engines use
//! `[2, L/2, L-3]` in input-of-layer numbering, and so does [`Eagle3Config::capture_ids`].

use std::path::{Path, PathBuf};

use eyrie_model::ModelConfig;
use serde_json::Value;

use crate::error::{Result, SpecError};

/// Which published checkpoint layout a drafter uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftFormat {
    /// `LlamaForCausalLMEagle3` (EAGLE reference / SpecForge / SGLang): weights under `midlayer.*`.
    SpecForge,
    /// `Eagle3Speculator` (vllm-project/speculators): weights under `layers.0.*`.
    Speculators,
}

impl DraftFormat {
    /// The aux-id convention of the engine this format is trained for and served by: SGLang's output-of-layer
    /// numbering for SpecForge checkpoints, vLLM's input-of-layer numbering for speculators checkpoints.
    pub fn default_convention(self) -> AuxConvention {
        match self {
            Self::SpecForge => AuxConvention::OutputOfLayer,
            Self::Speculators => AuxConvention::InputOfLayer,
        }
    }
}

/// What an explicit aux layer id `i` in a drafter config names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuxConvention {
    /// The residual stream at the input of target layer `i` = HF `hidden_states[i]` (vLLM). Id `L` (the number of
    /// target layers) is HF's last entry, the final normed state.
    InputOfLayer,
    /// The output of target layer `i` = the input of layer `i + 1` (SGLang, SpecForge). Ids run `0..L-1`; the
    /// last layer's un-normed output is not captured by eyrie-model, so id `L - 1` is an error.
    OutputOfLayer,
}

/// RoPE of the drafter's attention (Llama's rotate-half layout).
#[derive(Debug, Clone, PartialEq)]
pub enum DraftRope {
    /// `inv_freq[i] = theta^(-2i/head_dim)`.
    Default,
    /// Positions divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3.1 frequency-dependent scaling (transformers' `_compute_llama3_parameters`).
    Llama3 {
        /// `factor`.
        factor: f64,
        /// `low_freq_factor`.
        low_freq_factor: f64,
        /// `high_freq_factor`.
        high_freq_factor: f64,
        /// `original_max_position_embeddings`.
        original_max_position_embeddings: f64,
    },
}

/// A validated EAGLE-3 drafter config.
#[derive(Debug, Clone, PartialEq)]
pub struct Eagle3Config {
    /// The file it was read from.
    pub path: PathBuf,
    /// The checkpoint layout.
    pub format: DraftFormat,
    /// Drafter hidden size `H`.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (GQA).
    pub num_kv_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// RMSNorm eps of every drafter norm.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling.
    pub rope: DraftRope,
    /// The target vocabulary size the config claims (`vocab_size`).
    pub vocab_size: usize,
    /// Rows of `lm_head`; equals `vocab_size` when the config has no `draft_vocab_size`.
    pub draft_vocab_size: usize,
    /// Width of each captured target state (`target_hidden_size`, else `hidden_size`).
    pub target_hidden_size: usize,
    /// `eagle_aux_hidden_state_layer_ids` as written (in the checkpoint's own convention), if any.
    pub aux_layer_ids: Option<Vec<i64>>,
    /// speculators: `hidden_norm` applied before the residual is taken.
    pub norm_before_residual: bool,
    /// speculators: one RMSNorm (`input_norm`) over the concatenated aux states before `fc`.
    pub norm_before_fc: bool,
    /// One RMSNorm per aux chunk (`fc_norm.{i}`) before `fc`.
    pub fc_norm: bool,
}

fn get<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}

struct Reader<'a> {
    path: &'a Path,
}

impl Reader<'_> {
    fn json_err(&self, field: &str, message: impl Into<String>) -> SpecError {
        SpecError::Json { path: self.path.to_path_buf(), field: Some(field.into()), message: message.into() }
    }

    fn usize(&self, v: &Value, prefix: &str, key: &str) -> Result<usize> {
        let field = format!("{prefix}{key}");
        let x = get(v, key)
            .ok_or_else(|| SpecError::MissingField { path: self.path.to_path_buf(), field: field.clone() })?;
        x.as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| self.json_err(&field, format!("expected a non-negative integer, found {x}")))
    }

    fn opt_usize(&self, v: &Value, prefix: &str, key: &str) -> Result<Option<usize>> {
        if get(v, key).is_none() {
            return Ok(None);
        }
        self.usize(v, prefix, key).map(Some)
    }

    fn opt_f64(&self, v: &Value, prefix: &str, key: &str) -> Result<Option<f64>> {
        match get(v, key) {
            None => Ok(None),
            Some(x) => x
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.json_err(&format!("{prefix}{key}"), format!("expected a number, found {x}"))),
        }
    }

    fn opt_bool(&self, v: &Value, prefix: &str, key: &str) -> Result<bool> {
        match get(v, key) {
            None => Ok(false),
            Some(x) => x
                .as_bool()
                .ok_or_else(|| self.json_err(&format!("{prefix}{key}"), format!("expected a boolean, found {x}"))),
        }
    }

    fn unsupported(&self, field: &str, value: &Value, reason: &str) -> SpecError {
        SpecError::Unsupported {
            path: self.path.to_path_buf(),
            field: field.into(),
            value: value.to_string(),
            reason: reason.into(),
        }
    }
}

impl Eagle3Config {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let path = dir.as_ref().join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| SpecError::Io { path: path.clone(), source })?;
        Self::from_json_str(&text, &path)
    }

    /// Parses a drafter config.json (either layout; see the module docs). `path` is for error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let json: Value = serde_json::from_str(text).map_err(|e| SpecError::Json {
            path: path.to_path_buf(),
            field: None,
            message: e.to_string(),
        })?;
        let r = Reader { path };
        let archs: Vec<&str> = get(&json, "architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let speculators = get(&json, "speculators_model_type").is_some() || archs.contains(&"Eagle3Speculator");
        let (format, llama, prefix) = if speculators {
            if let Some(t) = get(&json, "speculators_model_type")
                && t.as_str() != Some("eagle3")
            {
                return Err(r.unsupported(
                    "speculators_model_type",
                    t,
                    "only \"eagle3\" speculators are EAGLE-3 drafters",
                ));
            }
            let tl = get(&json, "transformer_layer_config").ok_or_else(|| SpecError::MissingField {
                path: path.to_path_buf(),
                field: "transformer_layer_config".into(),
            })?;
            (DraftFormat::Speculators, tl, "transformer_layer_config.")
        } else if archs.iter().any(|a| a.contains("Eagle3")) {
            (DraftFormat::SpecForge, &json, "")
        } else {
            return Err(r.unsupported(
                "architectures",
                get(&json, "architectures").unwrap_or(&Value::Null),
                "not an EAGLE-3 drafter: expected LlamaForCausalLMEagle3 (SpecForge) or Eagle3Speculator (speculators)",
            ));
        };

        let hidden_size = r.usize(llama, prefix, "hidden_size")?;
        let num_heads = r.usize(llama, prefix, "num_attention_heads")?;
        let num_kv_heads = r.opt_usize(llama, prefix, "num_key_value_heads")?.unwrap_or(num_heads);
        let head_dim = match r.opt_usize(llama, prefix, "head_dim")? {
            Some(d) => d,
            None if num_heads > 0 => hidden_size / num_heads,
            None => 0,
        };
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 || head_dim == 0 || head_dim % 2 != 0 {
            return Err(SpecError::Unsupported {
                path: path.to_path_buf(),
                field: format!("{prefix}num_attention_heads"),
                value: format!("{num_heads} heads, {num_kv_heads} kv heads, head_dim {head_dim}"),
                reason: "heads must be a positive multiple of kv heads and head_dim a positive even number".into(),
            });
        }
        if let Some(n) = r.opt_usize(llama, prefix, "num_hidden_layers")?
            && n != 1
        {
            return Err(r.unsupported(
                &format!("{prefix}num_hidden_layers"),
                &n.into(),
                "EAGLE-3 drafters have one decoder layer",
            ));
        }
        if let Some(act) = get(llama, "hidden_act")
            && act.as_str() != Some("silu")
        {
            return Err(r.unsupported(&format!("{prefix}hidden_act"), act, "only silu (SwiGLU) MLPs are supported"));
        }
        for key in ["attention_bias", "mlp_bias"] {
            if r.opt_bool(llama, prefix, key)? {
                return Err(r.unsupported(
                    &format!("{prefix}{key}"),
                    &true.into(),
                    "drafters with biased projections are not supported",
                ));
            }
        }
        let rms_norm_eps = r.opt_f64(llama, prefix, "rms_norm_eps")?.unwrap_or(1e-6);
        let params = get(llama, "rope_parameters");
        let rope_theta = match r.opt_f64(llama, prefix, "rope_theta")? {
            Some(t) => t,
            None => match params {
                Some(p) => r.opt_f64(p, &format!("{prefix}rope_parameters."), "rope_theta")?.unwrap_or(10000.0),
                None => 10000.0,
            },
        };
        let scaling = get(llama, "rope_scaling").or(params);
        let rope = match scaling {
            None => DraftRope::Default,
            Some(s) => {
                let sp = format!("{prefix}rope_scaling.");
                let kind = get(s, "rope_type").or_else(|| get(s, "type")).and_then(Value::as_str).unwrap_or("default");
                let num = |key: &str| -> Result<f64> {
                    r.opt_f64(s, &sp, key)?.ok_or_else(|| SpecError::MissingField {
                        path: path.to_path_buf(),
                        field: format!("{sp}{key}"),
                    })
                };
                match kind {
                    "default" => DraftRope::Default,
                    "linear" => DraftRope::Linear { factor: num("factor")? },
                    "llama3" => DraftRope::Llama3 {
                        factor: num("factor")?,
                        low_freq_factor: num("low_freq_factor")?,
                        high_freq_factor: num("high_freq_factor")?,
                        original_max_position_embeddings: num("original_max_position_embeddings")?,
                    },
                    other => {
                        return Err(r.unsupported(
                            &format!("{sp}rope_type"),
                            &other.into(),
                            "supported drafter RoPE types: default, linear, llama3",
                        ));
                    }
                }
            }
        };
        let vocab_size = r.usize(llama, prefix, "vocab_size")?;
        let draft_vocab_size = r.opt_usize(&json, "", "draft_vocab_size")?.unwrap_or(vocab_size);
        if draft_vocab_size == 0 || draft_vocab_size > vocab_size {
            return Err(SpecError::Unsupported {
                path: path.to_path_buf(),
                field: "draft_vocab_size".into(),
                value: draft_vocab_size.to_string(),
                reason: format!("must be in 1..={vocab_size} (vocab_size)"),
            });
        }
        let target_hidden_size = r.opt_usize(&json, "", "target_hidden_size")?.unwrap_or(hidden_size);
        let (ids_value, ids_field) = match format {
            DraftFormat::SpecForge => {
                let eagle = get(&json, "eagle_config");
                if let Some(e) = eagle
                    && let Some(u) = get(e, "use_aux_hidden_state")
                    && u.as_bool() == Some(false)
                {
                    return Err(r.unsupported(
                        "eagle_config.use_aux_hidden_state",
                        u,
                        "EAGLE-3 drafters fuse three aux hidden states; use_aux_hidden_state false is EAGLE-1/2",
                    ));
                }
                (
                    eagle
                        .and_then(|e| get(e, "eagle_aux_hidden_state_layer_ids"))
                        .or_else(|| get(&json, "eagle_aux_hidden_state_layer_ids")),
                    "eagle_config.eagle_aux_hidden_state_layer_ids",
                )
            }
            DraftFormat::Speculators => {
                (get(&json, "eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids")
            }
        };
        let aux_layer_ids = match ids_value {
            None => None,
            Some(v) => {
                let ids: Option<Vec<i64>> = v.as_array().map(|a| a.iter().map(Value::as_i64).collect()).unwrap_or(None);
                let ids =
                    ids.ok_or_else(|| r.json_err(ids_field, format!("expected a list of integers, found {v}")))?;
                if ids.len() != 3 {
                    return Err(r.unsupported(ids_field, v, "EAGLE-3 fuses exactly three aux hidden states"));
                }
                Some(ids)
            }
        };
        let norm_output = r.opt_bool(&json, "", "norm_output")?;
        if norm_output {
            return Err(r.unsupported(
                "norm_output",
                &true.into(),
                "norm_output drafters are not supported yet (their layer math is not verified against a reference)",
            ));
        }
        Ok(Self {
            path: path.to_path_buf(),
            format,
            hidden_size,
            intermediate_size: r.usize(llama, prefix, "intermediate_size")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope,
            vocab_size,
            draft_vocab_size,
            target_hidden_size,
            aux_layer_ids,
            norm_before_residual: r.opt_bool(&json, "", "norm_before_residual")?,
            norm_before_fc: r.opt_bool(&json, "", "norm_before_fc")?,
            fc_norm: r.opt_bool(&json, "", "fc_norm")?,
        })
    }

    /// The inverse frequencies `[head_dim / 2]` of the drafter's RoPE (as transformers' `ROPE_INIT_FUNCTIONS`).
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim as f64;
        let base: Vec<f64> = (0..self.head_dim / 2).map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d)).collect();
        let scaled: Vec<f64> = match self.rope {
            DraftRope::Default => base,
            DraftRope::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            DraftRope::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let low_wavelen = original_max_position_embeddings / low_freq_factor;
                let high_wavelen = original_max_position_embeddings / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen > low_wavelen {
                            f / factor
                        } else if wavelen < high_wavelen {
                            f
                        } else {
                            let smooth = (original_max_position_embeddings / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        };
        scaled.into_iter().map(|f| f as f32).collect()
    }

    /// The target capture ids (eyrie-model's input-of-layer numbering, see `DeepseekV3::forward_batch_capture`)
    /// for this drafter's aux layers read under `convention`, checked against the target's layer count. Without
    /// ids in the config: `[2, L/2, L-3]` (both engines' default, already input-of-layer).
    pub fn capture_ids(&self, target: &ModelConfig, convention: AuxConvention) -> Result<Vec<usize>> {
        let l = target.num_hidden_layers as i64;
        let mismatch = |message: String| SpecError::TargetMismatch {
            path: self.path.clone(),
            field: "eagle_aux_hidden_state_layer_ids".into(),
            message,
        };
        let Some(ids) = &self.aux_layer_ids else {
            if l < 3 {
                return Err(mismatch(format!(
                    "the config names no aux layers and the default [2, L/2, L-3] needs a target of at least 3 layers \
                     (it has {l})"
                )));
            }
            return Ok(vec![2, (l / 2) as usize, (l - 3) as usize]);
        };
        ids.iter()
            .map(|&id| {
                let (capture, range) = match convention {
                    AuxConvention::InputOfLayer => {
                        (id, format!("0..={l} (input of layer i; {l} = final normed state)"))
                    }
                    AuxConvention::OutputOfLayer => (id + 1, format!("0..={} (output of layer i)", l - 2)),
                };
                let valid = match convention {
                    AuxConvention::InputOfLayer => (0..=l).contains(&id),
                    AuxConvention::OutputOfLayer => (0..=l - 2).contains(&id),
                };
                if valid {
                    Ok(capture as usize)
                } else {
                    Err(mismatch(format!(
                        "aux layer id {id} is out of range for a {l}-layer target under {convention:?}: valid ids are \
                         {range}"
                    )))
                }
            })
            .collect()
    }

    /// Checks the sizes against the target: `target_hidden_size` and `vocab_size` must equal the target's, and a
    /// drafter that borrows the target's embedding (`has_embedding == false`) must have the target's hidden size.
    pub fn check_target(&self, target: &ModelConfig, has_embedding: bool) -> Result<()> {
        let mismatch = |field: &str, message: String| SpecError::TargetMismatch {
            path: self.path.clone(),
            field: field.into(),
            message,
        };
        if self.target_hidden_size != target.hidden_size {
            return Err(mismatch(
                "target_hidden_size",
                format!(
                    "the drafter fuses target states of width {} (target_hidden_size, else hidden_size) but the target's \
                     hidden_size is {}",
                    self.target_hidden_size, target.hidden_size
                ),
            ));
        }
        if self.vocab_size != target.vocab_size {
            return Err(mismatch(
                "vocab_size",
                format!("drafter vocab_size {} != target vocab_size {}", self.vocab_size, target.vocab_size),
            ));
        }
        if !has_embedding && self.hidden_size != target.hidden_size {
            return Err(mismatch(
                "hidden_size",
                format!(
                    "the checkpoint has no embed_tokens.weight, so the drafter embeds with the target's embedding of \
                     width {}, but its hidden_size is {}",
                    target.hidden_size, self.hidden_size
                ),
            ));
        }
        Ok(())
    }
}
