//! Loading weights by checkpoint key (STYLE rule 3), with the bookkeeping that proves every checkpoint tensor is
//! consumed exactly once.
//!
//! Model code asks for tensors by their canonical DeepSeek-V3 name (`model.layers.0.self_attn.kv_b_proj`,
//! `lm_head.weight`); [`ModelConfig::weight_name`] is the one remap (Kimi-K2.5's `language_model.` prefix).
//! [`WeightLoader::finish`] then fails with [`ModelError::UnusedTensors`] listing every checkpoint tensor nobody
//! asked for, except the ones skipped on purpose ([`skip_reason`]): K2.5's vision tower and projector, and
//! DeepSeek's MTP layers `model.layers.{num_hidden_layers + i}.*`.

use std::collections::BTreeSet;

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use eyrie_quant::burn::dense_tensor;
use eyrie_quant::{Checkpoint, LinearWeight, QuantPlan, QuantScheme};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::linear::{Linear, StoredLinear};

/// Why a checkpoint tensor is deliberately not loaded, if it is one of those.
pub fn skip_reason(config: &ModelConfig, name: &str) -> Option<&'static str> {
    if !config.weight_prefix.is_empty() && (name.starts_with("vision_tower.") || name.starts_with("mm_projector.")) {
        return Some("vision encoder (text-only model)");
    }
    let layers = name.strip_prefix(&config.weight_name("model.layers."))?;
    let index: usize = layers.split('.').next()?.parse().ok()?;
    let mtp = config.num_hidden_layers..config.num_hidden_layers + config.num_nextn_predict_layers;
    mtp.contains(&index).then_some("multi-token-prediction layer")
}

/// Reads tensors for the model from one checkpoint and records which were used.
/// How far a model load has got, reported after each checkpoint tensor the model takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadProgress {
    /// Tensors taken so far and in all (skipped tensors excluded).
    pub tensors_done: usize,
    pub tensors_total: usize,
    /// Checkpoint bytes of those tensors.
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Since the load started.
    pub elapsed: std::time::Duration,
}

impl LoadProgress {
    /// The remaining time at the rate so far (by bytes), once some bytes are done.
    pub fn eta(&self) -> Option<std::time::Duration> {
        (self.bytes_done > 0).then(|| {
            let left = self.bytes_total.saturating_sub(self.bytes_done) as f64;
            std::time::Duration::from_secs_f64(self.elapsed.as_secs_f64() * left / self.bytes_done as f64)
        })
    }
}

/// A callback receiving [`LoadProgress`].
pub type ProgressFn<'a> = dyn FnMut(&LoadProgress) + 'a;

pub struct WeightLoader<'a> {
    ckpt: &'a Checkpoint,
    config: &'a ModelConfig,
    plan: Option<QuantPlan>,
    used: BTreeSet<String>,
    progress: Option<(&'a mut ProgressFn<'a>, LoadProgress, std::time::Instant)>,
}

impl std::fmt::Debug for WeightLoader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightLoader").field("checkpoint", &self.ckpt.root()).field("used", &self.used.len()).finish()
    }
}

impl<'a> WeightLoader<'a> {
    /// A loader for `ckpt` described by `config` (its quantization config, if any, gives INT4 group sizes).
    pub fn new(ckpt: &'a Checkpoint, config: &'a ModelConfig) -> Result<Self> {
        let plan = config.quantization()?.map(|q| q.plan()).transpose()?;
        Ok(Self { ckpt, config, plan, used: BTreeSet::new(), progress: None })
    }

    /// Reports progress to `callback` after each tensor taken.
    pub fn with_progress(mut self, callback: &'a mut ProgressFn<'a>) -> Self {
        let (mut tensors_total, mut bytes_total) = (0, 0);
        for name in self.ckpt.names().filter(|n| skip_reason(self.config, n).is_none()) {
            tensors_total += 1;
            bytes_total += self.ckpt.info(name).map_or(0, |i| i.nbytes());
        }
        let start =
            LoadProgress { tensors_done: 0, tensors_total, bytes_done: 0, bytes_total, elapsed: Default::default() };
        self.progress = Some((callback, start, std::time::Instant::now()));
        self
    }

    fn missing(&self, name: String) -> ModelError {
        ModelError::MissingTensor { checkpoint: self.ckpt.root().to_path_buf(), tensor: name }
    }

    fn consume(&mut self, name: &str) -> Result<()> {
        if !self.ckpt.contains(name) {
            return Err(self.missing(name.to_owned()));
        }
        if !self.used.insert(name.to_owned()) {
            return Err(ModelError::UnsupportedWeight {
                checkpoint: self.ckpt.root().to_path_buf(),
                tensor: name.to_owned(),
                message: "requested twice by the model (loader bug)".into(),
            });
        }
        if let Some((callback, p, started)) = &mut self.progress {
            p.tensors_done += 1;
            p.bytes_done += self.ckpt.info(name).map_or(0, |i| i.nbytes());
            p.elapsed = started.elapsed();
            callback(p);
        }
        Ok(())
    }

    fn check_shape(&self, name: &str, expected: &[usize], found: &[usize]) -> Result<()> {
        if expected == found {
            Ok(())
        } else {
            Err(ModelError::TensorShape {
                checkpoint: self.ckpt.root().to_path_buf(),
                tensor: name.to_owned(),
                expected: expected.to_vec(),
                found: found.to_vec(),
            })
        }
    }

    /// The float tensor `canonical` (e.g. `model.norm.weight`) of the given shape, as f32 on `device`.
    pub fn tensor<B: Backend, const D: usize>(
        &mut self,
        canonical: &str,
        shape: [usize; D],
        device: &B::Device,
    ) -> Result<Tensor<B, D>> {
        let name = self.config.weight_name(canonical);
        self.consume(&name)?;
        let view = self.ckpt.tensor(&name)?;
        self.check_shape(&name, &shape, view.shape)?;
        Ok(dense_tensor::<B, D>(&view, device)?.cast(FloatDType::F32))
    }

    /// The float vector `canonical` of length `len`, on the host in f32.
    pub fn host_vector(&mut self, canonical: &str, len: usize) -> Result<Vec<f32>> {
        let name = self.config.weight_name(canonical);
        self.consume(&name)?;
        let view = self.ckpt.tensor(&name)?;
        self.check_shape(&name, &[len], view.shape)?;
        Ok(view.to_f32_vec()?)
    }

    /// The Linear stored under `canonical` (`model.layers.1.mlp.experts.0.gate_proj`) with weight `[out, in]`,
    /// dense, INT4 or FP8 (whichever tensors the checkpoint has).
    pub fn linear<B: Backend>(&mut self, canonical: &str, shape: [usize; 2], device: &B::Device) -> Result<Linear<B>> {
        let (_, weight) = self.linear_weight(canonical, shape)?;
        Linear::load(&weight, device)
    }

    /// The checkpoint weight of the Linear `canonical` (its tensors consumed, its shape checked against
    /// `[out, in]`) and its checkpoint name.
    pub(crate) fn linear_weight(&mut self, canonical: &str, shape: [usize; 2]) -> Result<(String, LinearWeight<'a>)> {
        let name = self.config.weight_name(canonical);
        let group = match self.plan.as_ref().and_then(|p| p.scheme_for(&name, "Linear")) {
            Some(QuantScheme::Int4Group { group_size, .. }) => Some(group_size.columns(shape[1])),
            _ => None,
        };
        for p in &self.linear_parts(&name) {
            self.consume(p)?;
        }
        let weight = LinearWeight::load(self.ckpt, &name, group)?;
        self.check_shape(&format!("{name}.weight"), &shape, &weight.shape())?;
        Ok((name, weight))
    }

    /// The checkpoint tensors a Linear named `name` (checkpoint spelling) is stored in: dense, INT4
    /// (compressed-tensors parts) or FP8 (weight + block scales).
    fn linear_parts(&self, name: &str) -> Vec<String> {
        if self.ckpt.contains(&format!("{name}.weight_packed")) {
            ["weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"]
                .iter()
                .map(|p| format!("{name}.{p}"))
                .filter(|t| t.ends_with("weight_packed") || t.ends_with("weight_scale") || self.ckpt.contains(t))
                .collect()
        } else if self.ckpt.contains(&format!("{name}.weight_scale_inv")) {
            vec![format!("{name}.weight"), format!("{name}.weight_scale_inv")]
        } else {
            vec![format!("{name}.weight")]
        }
    }

    /// Accounts for the Linear stored under `canonical` without reading it: what a rank does with the routed
    /// experts another rank holds. Its tensors must exist (a missing one is the same error as for [`Self::linear`]);
    /// they count as done for the progress report and as used for [`Self::finish`].
    pub fn skip_linear(&mut self, canonical: &str) -> Result<()> {
        let name = self.config.weight_name(canonical);
        for p in &self.linear_parts(&name) {
            self.consume(p)?;
        }
        Ok(())
    }

    /// Ends loading: an error listing every checkpoint tensor that was neither used nor deliberately skipped.
    pub fn finish(self) -> Result<()> {
        let unused: Vec<String> = self
            .ckpt
            .names()
            .filter(|n| !self.used.contains(*n) && skip_reason(self.config, n).is_none())
            .map(str::to_owned)
            .collect();
        if unused.is_empty() {
            Ok(())
        } else {
            Err(ModelError::UnusedTensors { checkpoint: self.ckpt.root().to_path_buf(), tensors: unused })
        }
    }
}

/// Where a model's weights come from, as [`crate::DeepseekV3`]'s builder asks for them: a checkpoint
/// ([`WeightLoader`]) or made up on the device ([`crate::synthetic::SyntheticWeights`], for benchmarks at real
/// shapes without a checkpoint).
pub trait WeightSource {
    /// A float tensor (norm weights, embeddings) of `shape`, f32 on `device`.
    fn tensor<B: Backend, const D: usize>(
        &mut self,
        canonical: &str,
        shape: [usize; D],
        device: &B::Device,
    ) -> Result<Tensor<B, D>>;
    /// A Linear with weight `[out, in]`.
    fn linear<B: Backend>(&mut self, canonical: &str, shape: [usize; 2], device: &B::Device) -> Result<Linear<B>>;
    /// A Linear kept as stored (INT4 stays packed; see [`StoredLinear`]).
    fn stored_linear<B: Backend>(
        &mut self,
        canonical: &str,
        shape: [usize; 2],
        device: &B::Device,
    ) -> Result<StoredLinear<B>>;
    /// A float vector on the host.
    fn host_vector(&mut self, canonical: &str, len: usize) -> Result<Vec<f32>>;
    /// Passes over a Linear the model does not hold (another rank's expert).
    fn skip_linear(&mut self, canonical: &str) -> Result<()>;
    /// Ends the build (a checkpoint checks that every tensor was used).
    fn finish(self) -> Result<()>;
}

impl WeightSource for WeightLoader<'_> {
    fn tensor<B: Backend, const D: usize>(
        &mut self,
        canonical: &str,
        shape: [usize; D],
        device: &B::Device,
    ) -> Result<Tensor<B, D>> {
        WeightLoader::tensor(self, canonical, shape, device)
    }

    fn linear<B: Backend>(&mut self, canonical: &str, shape: [usize; 2], device: &B::Device) -> Result<Linear<B>> {
        WeightLoader::linear(self, canonical, shape, device)
    }

    fn stored_linear<B: Backend>(
        &mut self,
        canonical: &str,
        shape: [usize; 2],
        device: &B::Device,
    ) -> Result<StoredLinear<B>> {
        let (_, weight) = self.linear_weight(canonical, shape)?;
        StoredLinear::load(&weight, device)
    }

    fn host_vector(&mut self, canonical: &str, len: usize) -> Result<Vec<f32>> {
        WeightLoader::host_vector(self, canonical, len)
    }

    fn skip_linear(&mut self, canonical: &str) -> Result<()> {
        WeightLoader::skip_linear(self, canonical)
    }

    fn finish(self) -> Result<()> {
        WeightLoader::finish(self)
    }
}
