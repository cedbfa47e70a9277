//! The EAGLE-3 drafter (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
//! Training-Time Test", arXiv:2503.01840) on burn, generic over the backend, as SpecForge's
//! `specforge/modeling/draft/llama3_eagle.py` (`LlamaForCausalLMEagle3`: `LlamaDecoderLayer.forward`,
//! `LlamaAttention`, `LlamaMLP`, `LlamaRMSNorm`) and vllm-project/speculators'
//! `src/speculators/models/eagle3/{core,model_definitions}.py` (`Eagle3DraftModel`, `Eagle3FirstLayerMixin`);
//! serving as in SGLang's / vLLM's `llama_eagle3.py`.
//!
//! One row of the drafter: a token id `x` (target vocabulary) and a hidden state `g` of width `H`:
//! - from the target: `g = fc(a)`, `a = [h_low; h_mid; h_high]` the three captured target states `[3 * Ht]`
//!   (speculators variants: `a = input_norm(a)` over the concatenation (`norm_before_fc`), or each chunk
//!   normed by `fc_norm.{i}`), `fc` without bias (`[H, 3 Ht]`);
//! - while chaining draft steps: `g` = the drafter's own previous pre-norm output (no `fc`).
//!
//! The decoder layer (`midlayer` / `layers.0`): `residual = g` (`norm_before_residual`: `hidden_norm(g)`);
//! `z = [input_layernorm(embed(x)); hidden_norm(g)]` `[2H]`; `q/k/v = z W_{q,k,v}^T` (inputs `2H` wide, GQA heads,
//! Llama rotate-half RoPE at the row's position, keys and values kept in a per-sequence cache);
//! `attn = softmax(q k^T / sqrt(head_dim) + causal) v`; `h = residual + o_proj(attn)`;
//! `out = h + down(silu(gate(n)) * up(n))`, `n = post_attention_layernorm(h)`. Then `out` is the state fed back to the
//! next chain step, and the logits are `lm_head(norm(out))` over the draft vocabulary, mapped to the target
//! vocabulary by `target = draft + d2t[draft]` (other target ids get `-inf`).
//!
//! Alignment (EAGLE's shift by one): the row at position `p` pairs the target's state at position `p` with the token
//! at position `p + 1`, and predicts the token at `p + 2`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, FloatDType, Int, Tensor, TensorData};
use eyrie_model::DeepseekV3;
use eyrie_model::ModelConfig;
use eyrie_model::linear::Linear;
use eyrie_model::mlp::Mlp;
use eyrie_model::quant::Checkpoint;
use eyrie_model::quant::burn::dense_tensor;
use eyrie_model::rms_norm::RmsNorm;
use eyrie_model::rope::{RopeTables, RotaryEmbedding};

use crate::config::{AuxConvention, Eagle3Config};
use crate::error::{Result, SpecError};

/// Tensors a drafter checkpoint may hold that serving does not use.
const SKIPPED: &[&str] = &["verifier_lm_head.weight", "verifier_norm.weight"];

/// A loaded EAGLE-3 drafter.
#[derive(Debug, Clone)]
pub struct Eagle3Drafter<B: Backend> {
    /// The drafter's config.
    pub config: Eagle3Config,
    /// Target capture ids (input-of-layer numbering) of the three aux states, in `fc`'s input order.
    pub capture_ids: Vec<usize>,
    /// `[vocab, H]`: the drafter's own `embed_tokens.weight`, or the target's.
    embed_tokens: Tensor<B, 2>,
    input_norm: Option<RmsNorm<B>>,
    fc_norm: Vec<RmsNorm<B>>,
    fc: Linear<B>,
    input_layernorm: RmsNorm<B>,
    hidden_norm: RmsNorm<B>,
    post_attention_layernorm: RmsNorm<B>,
    q_proj: Linear<B>,
    k_proj: Linear<B>,
    v_proj: Linear<B>,
    o_proj: Linear<B>,
    mlp: Mlp<B>,
    norm: RmsNorm<B>,
    lm_head: Linear<B>,
    /// Draft id -> target id.
    d2t: Vec<u32>,
    rope: RotaryEmbedding,
}

/// Reads drafter tensors by name and records which were used.
struct Loader<'a> {
    ckpt: &'a Checkpoint,
    root: PathBuf,
    used: BTreeSet<String>,
}

impl Loader<'_> {
    fn view(&mut self, name: &str, shape: &[usize], hint: &str) -> Result<eyrie_model::quant::TensorView<'_>> {
        if !self.ckpt.contains(name) {
            return Err(SpecError::MissingTensor {
                checkpoint: self.root.clone(),
                tensor: name.into(),
                hint: hint.into(),
            });
        }
        self.used.insert(name.to_owned());
        let view = self.ckpt.tensor(name)?;
        if view.shape != shape {
            return Err(SpecError::TensorShape {
                checkpoint: self.root.clone(),
                tensor: name.into(),
                expected: shape.to_vec(),
                found: view.shape.to_vec(),
            });
        }
        Ok(view)
    }

    fn tensor<B: Backend, const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        device: &B::Device,
    ) -> Result<Tensor<B, D>> {
        let view = self.view(name, &shape, "")?;
        Ok(dense_tensor::<B, D>(&view, device)?.cast(FloatDType::F32))
    }

    fn linear<B: Backend>(&mut self, name: &str, shape: [usize; 2], device: &B::Device) -> Result<Linear<B>> {
        if self.ckpt.contains(&format!("{name}.bias")) {
            return Err(SpecError::Unsupported {
                path: self.root.clone(),
                field: format!("{name}.bias"),
                value: "present".into(),
                reason: "drafter projections with a bias are not supported".into(),
            });
        }
        Ok(Linear::from_weight(self.tensor(&format!("{name}.weight"), shape, device)?))
    }

    fn norm<B: Backend>(&mut self, name: &str, width: usize, eps: f64, device: &B::Device) -> Result<RmsNorm<B>> {
        Ok(RmsNorm::new(self.tensor(&format!("{name}.weight"), [width], device)?, eps))
    }
}

impl<B: Backend> Eagle3Drafter<B> {
    /// Loads the drafter in `dir` (config.json + safetensors, either layout) for `target`, whose embedding it
    /// borrows when the checkpoint has none; `convention` says how to read the config's aux layer ids (see
    /// [`AuxConvention`]; [`crate::DraftFormat::default_convention`] is what the checkpoint's engine uses).
    pub fn load(
        dir: impl AsRef<Path>,
        target: &DeepseekV3<B>,
        convention: AuxConvention,
        device: &B::Device,
    ) -> Result<Self> {
        Self::load_with_embedding(dir, &target.config, Some(&target.embed_tokens), convention, device)
    }

    /// [`Self::load`] from the target's config and (optional) embedding `[vocab, hidden]`.
    pub fn load_with_embedding(
        dir: impl AsRef<Path>,
        target: &ModelConfig,
        target_embedding: Option<&Tensor<B, 2>>,
        convention: AuxConvention,
        device: &B::Device,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let config = Eagle3Config::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        let has_embedding = ckpt.contains("embed_tokens.weight");
        config.check_target(target, has_embedding)?;
        let capture_ids = config.capture_ids(target, convention)?;
        let c = &config;
        let (h, ht, eps) = (c.hidden_size, c.target_hidden_size, c.rms_norm_eps);
        let mut w = Loader { ckpt: &ckpt, root: dir.to_path_buf(), used: BTreeSet::new() };

        let embed_tokens = if has_embedding {
            w.tensor("embed_tokens.weight", [c.vocab_size, h], device)?
        } else {
            let Some(e) = target_embedding else {
                return Err(SpecError::MissingTensor {
                    checkpoint: dir.to_path_buf(),
                    tensor: "embed_tokens.weight".into(),
                    hint: "and no target embedding was given".into(),
                });
            };
            e.clone()
        };
        let layer = if ckpt.contains("midlayer.input_layernorm.weight") { "midlayer" } else { "layers.0" };
        let input_norm = if c.norm_before_fc { Some(w.norm("input_norm", 3 * ht, eps, device)?) } else { None };
        let fc_norm = if c.fc_norm {
            (0..3).map(|i| w.norm(&format!("fc_norm.{i}"), ht, eps, device)).collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let d2t = load_vocab_maps(&mut w, c)?;
        let drafter = Self {
            capture_ids,
            embed_tokens,
            input_norm,
            fc_norm,
            fc: w.linear("fc", [h, 3 * ht], device)?,
            input_layernorm: w.norm(&format!("{layer}.input_layernorm"), h, eps, device)?,
            hidden_norm: w.norm(&format!("{layer}.hidden_norm"), h, eps, device)?,
            post_attention_layernorm: w.norm(&format!("{layer}.post_attention_layernorm"), h, eps, device)?,
            q_proj: w.linear(&format!("{layer}.self_attn.q_proj"), [nh * hd, 2 * h], device)?,
            k_proj: w.linear(&format!("{layer}.self_attn.k_proj"), [nkv * hd, 2 * h], device)?,
            v_proj: w.linear(&format!("{layer}.self_attn.v_proj"), [nkv * hd, 2 * h], device)?,
            o_proj: w.linear(&format!("{layer}.self_attn.o_proj"), [h, nh * hd], device)?,
            mlp: Mlp {
                gate_proj: w.linear(&format!("{layer}.mlp.gate_proj"), [c.intermediate_size, h], device)?,
                up_proj: w.linear(&format!("{layer}.mlp.up_proj"), [c.intermediate_size, h], device)?,
                down_proj: w.linear(&format!("{layer}.mlp.down_proj"), [h, c.intermediate_size], device)?,
            },
            norm: w.norm("norm", h, eps, device)?,
            lm_head: w.linear("lm_head", [c.draft_vocab_size, h], device)?,
            d2t,
            rope: RotaryEmbedding { inv_freq: c.rope_inv_freq(), attention_factor: 1.0, interleave: false },
            config: config.clone(),
        };
        let unused: Vec<String> =
            ckpt.names().filter(|n| !w.used.contains(*n) && !SKIPPED.contains(n)).map(str::to_owned).collect();
        if !unused.is_empty() {
            return Err(SpecError::UnusedTensors { checkpoint: dir.to_path_buf(), tensors: unused });
        }
        Ok(drafter)
    }

    /// Draft id -> target id (`d2t` applied), `[draft_vocab_size]`.
    pub fn draft_to_target(&self) -> &[u32] {
        &self.d2t
    }

    /// A fresh per-sequence state (empty KV cache).
    pub fn new_state(&self) -> Eagle3State<B> {
        Eagle3State { k: None, v: None, len: 0, committed: 0, last_hidden: None, next_logits: None }
    }

    /// Target rows -> drafter input states: `features` `[n, 3 * Ht]` (the three captures concatenated in
    /// [`Self::capture_ids`] order) -> `g` `[n, H]`.
    pub fn fuse(&self, features: Tensor<B, 2>) -> Tensor<B, 2> {
        let ht = self.config.target_hidden_size;
        let a = match &self.input_norm {
            Some(norm) => norm.forward(features),
            None => features,
        };
        let a = if self.fc_norm.is_empty() {
            a
        } else {
            Tensor::cat(
                self.fc_norm.iter().enumerate().map(|(i, n)| n.forward(a.clone().narrow(1, i * ht, ht))).collect(),
                1,
            )
        };
        self.fc.forward(a)
    }

    /// The decoder layer over `n` new rows of one sequence at positions `state.len..`: token ids `tokens` (target
    /// vocabulary) and hidden states `g` `[n, H]`. Appends their keys/values to `state` and returns the pre-norm
    /// outputs `[n, H]`. [`Self::layer_batch`] with one sequence.
    pub fn layer(&self, state: &mut Eagle3State<B>, tokens: &[u32], g: Tensor<B, 2>) -> Result<Tensor<B, 2>> {
        self.layer_batch(&mut [state], &[tokens], g)
    }

    /// The decoder layer over new rows of several sequences at once: sequence `i` brings `tokens[i]` (at its
    /// positions `states[i].len..`), and `g` `[N, H]` holds every row, sequence after sequence. Projections, norms
    /// and the MLP run once over all `N` rows; attention runs per sequence over its own cache. Returns `[N, H]`.
    pub fn layer_batch(
        &self,
        states: &mut [&mut Eagle3State<B>],
        tokens: &[&[u32]],
        g: Tensor<B, 2>,
    ) -> Result<Tensor<B, 2>> {
        let c = &self.config;
        let [n, h] = g.dims();
        let flat: Vec<u32> = tokens.iter().flat_map(|t| t.iter().copied()).collect();
        if states.len() != tokens.len() || n != flat.len() || tokens.iter().any(|t| t.is_empty()) {
            return Err(SpecError::input(format!(
                "{n} draft rows for {} tokens of {} sequences ({} states; every sequence needs a row)",
                flat.len(),
                tokens.len(),
                states.len()
            )));
        }
        if let Some(&bad) = flat.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(SpecError::input(format!("token id {bad} is outside the vocabulary (size {})", c.vocab_size)));
        }
        let device = g.device();
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let ids: Vec<i64> = flat.iter().map(|&t| i64::from(t)).collect();
        // [N, H]
        let emb =
            self.embed_tokens.clone().select(0, Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [n]), &device));
        let normed_hidden = self.hidden_norm.forward(g.clone());
        let residual = if c.norm_before_residual { normed_hidden.clone() } else { g };
        // [N, 2H]
        let z = Tensor::cat(vec![self.input_layernorm.forward(emb), normed_hidden], 1);
        // RoPE tables with each row at its own position.
        let half = self.rope.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
        for (state, t) in states.iter().zip(tokens) {
            let (co, si) = self.rope.host_tables(state.len, t.len());
            cos.extend(co);
            sin.extend(si);
        }
        let tables = RopeTables {
            cos: Tensor::from_data(TensorData::new(cos, [n, half]), &device),
            sin: Tensor::from_data(TensorData::new(sin, [n, half]), &device),
        };
        // [N, heads*hd] -> [1, heads, N, hd]
        let q = self.rope.apply(self.q_proj.forward(z.clone()).reshape([1, n, nh, hd]).swap_dims(1, 2), &tables);
        let k = self.rope.apply(self.k_proj.forward(z.clone()).reshape([1, n, nkv, hd]).swap_dims(1, 2), &tables);
        let v = self.v_proj.forward(z).reshape([1, n, nkv, hd]).swap_dims(1, 2);
        // [heads, N, hd]
        let (q, k, v) = (q.reshape([nh, n, hd]), k.reshape([nkv, n, hd]), v.reshape([nkv, n, hd]));
        let mut parts = Vec::with_capacity(states.len());
        let mut row = 0;
        for (state, t) in states.iter_mut().zip(tokens) {
            let len = t.len();
            parts.push(self.attend(
                state,
                q.clone().narrow(1, row, len),
                k.clone().narrow(1, row, len),
                v.clone().narrow(1, row, len),
            ));
            row += len;
        }
        // [N, nh*hd]
        let attn = Tensor::cat(parts, 0);
        let hs = residual + self.o_proj.forward(attn);
        let out = hs.clone() + self.mlp.forward(self.post_attention_layernorm.forward(hs));
        debug_assert_eq!(out.dims(), [n, h]);
        Ok(out)
    }

    /// Appends `k`, `v` `[kv_heads, n, hd]` (post-RoPE) to `state` and attends `q` `[heads, n, hd]` causally over
    /// its whole cache -> `[n, heads * hd]`.
    fn attend(&self, state: &mut Eagle3State<B>, q: Tensor<B, 3>, k: Tensor<B, 3>, v: Tensor<B, 3>) -> Tensor<B, 2> {
        let (nh, nkv, hd) = (self.config.num_heads, self.config.num_kv_heads, self.config.head_dim);
        let [_, n, _] = q.dims();
        let device = q.device();
        let start = state.len;
        state.append(k, v);
        let total = state.len;
        let k_all = state.k.clone().expect("appended").narrow(1, 0, total);
        let v_all = state.v.clone().expect("appended").narrow(1, 0, total);
        // GQA: kv head j serves query heads j*g..(j+1)*g, as HF's repeat_kv. [nh, T, hd]
        let group = nh / nkv;
        let k_rep = k_all.unsqueeze_dim::<4>(1).repeat_dim(1, group).reshape([nh, total, hd]);
        let v_rep = v_all.unsqueeze_dim::<4>(1).repeat_dim(1, group).reshape([nh, total, hd]);
        // [nh, n, T]
        let scores = q.matmul(k_rep.swap_dims(1, 2)).mul_scalar(1.0 / (hd as f64).sqrt());
        // Row i (position start + i) sees keys t <= start + i.
        let mask: Vec<bool> = (0..n).flat_map(|i| (0..total).map(move |t| t > start + i)).collect();
        let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(mask, [n, total]), &device)
            .unsqueeze::<3>()
            .expand([nh, n, total]);
        let probs = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 2);
        // [nh, n, hd] -> [n, nh*hd]
        probs.matmul(v_rep).swap_dims(0, 1).reshape([n, nh * hd])
    }

    /// Draft-vocabulary logits `[n, draft_vocab]` of pre-norm outputs `[n, H]`.
    pub fn draft_logits(&self, out: Tensor<B, 2>) -> Tensor<B, 2> {
        self.lm_head.forward(self.norm.forward(out))
    }

    /// One row of draft logits mapped to the target vocabulary (`-inf` where no draft id maps).
    pub fn to_target_logits(&self, draft_row: &[f32]) -> Vec<f32> {
        let mut out = vec![f32::NEG_INFINITY; self.config.vocab_size];
        for (d, &l) in draft_row.iter().enumerate() {
            out[self.d2t[d] as usize] = l;
        }
        out
    }

    /// Runs rows that come from the target, after dropping the state's draft-only rows: `features` `[n, 3 Ht]`
    /// (captured at positions `state.committed()..`) paired with `tokens`, the token after each of those positions.
    /// Returns the pre-norm outputs `[n, H]`; the last row's logits become the first draft distribution
    /// ([`Eagle3State::next_logits`]). [`Self::extend_batch`] with one sequence.
    pub fn extend(&self, state: &mut Eagle3State<B>, tokens: &[u32], features: Tensor<B, 2>) -> Result<Tensor<B, 2>> {
        self.extend_batch(&mut [state], &[tokens], features)
    }

    /// [`Self::extend`] for several sequences in one pass: `features` holds every sequence's rows, sequence after
    /// sequence (`tokens[i].len()` rows each).
    pub fn extend_batch(
        &self,
        states: &mut [&mut Eagle3State<B>],
        tokens: &[&[u32]],
        features: Tensor<B, 2>,
    ) -> Result<Tensor<B, 2>> {
        let [n, width] = features.dims();
        if width != 3 * self.config.target_hidden_size {
            return Err(SpecError::input(format!(
                "drafter features are {width} wide, expected 3 x {}",
                self.config.target_hidden_size
            )));
        }
        if n != tokens.iter().map(|t| t.len()).sum::<usize>() {
            return Err(SpecError::input(format!(
                "{n} feature rows for {} tokens",
                tokens.iter().map(|t| t.len()).sum::<usize>()
            )));
        }
        for state in states.iter_mut() {
            state.truncate(state.committed);
        }
        let out = self.layer_batch(states, tokens, self.fuse(features))?;
        for state in states.iter_mut() {
            state.committed = state.len;
        }
        self.remember_last(states, tokens.iter().map(|t| t.len()), out.clone())?;
        Ok(out)
    }

    /// One chain step: feeds `token` (the draft just chosen, target vocabulary) with the drafter's own last
    /// pre-norm state at the next position; afterwards [`Eagle3State::next_logits`] holds the next draft
    /// distribution. The row is draft-only: the next [`Self::extend`] drops it. [`Self::step_batch`] with one
    /// sequence.
    pub fn step(&self, state: &mut Eagle3State<B>, token: u32) -> Result<()> {
        self.step_batch(&mut [state], &[token])
    }

    /// One chain step of several sequences in one pass (`tokens[i]` for `states[i]`).
    pub fn step_batch(&self, states: &mut [&mut Eagle3State<B>], tokens: &[u32]) -> Result<()> {
        let mut g = Vec::with_capacity(states.len());
        for state in states.iter() {
            g.push(state.last_hidden.clone().ok_or_else(|| SpecError::input("a draft step needs a preceding extend"))?);
        }
        if g.is_empty() {
            return Ok(());
        }
        let rows: Vec<&[u32]> = tokens.chunks(1).collect();
        let out = self.layer_batch(states, &rows, Tensor::cat(g, 0))?;
        self.remember_last(states, std::iter::repeat_n(1, tokens.len()), out)
    }

    /// Keeps each sequence's last output row and its target-vocabulary logits (one `lm_head` pass for all).
    fn remember_last(
        &self,
        states: &mut [&mut Eagle3State<B>],
        lens: impl Iterator<Item = usize>,
        out: Tensor<B, 2>,
    ) -> Result<()> {
        let mut last = Vec::with_capacity(states.len());
        let mut row = 0;
        for len in lens {
            row += len;
            last.push((row - 1) as i64);
        }
        let s = last.len();
        let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(last, [s]), &out.device());
        // [S, H]
        let last = out.select(0, idx);
        let logits = row_values(self.draft_logits(last.clone()))?;
        let dv = self.config.draft_vocab_size;
        for (i, state) in states.iter_mut().enumerate() {
            state.next_logits = Some(self.to_target_logits(&logits[i * dv..(i + 1) * dv]));
            state.last_hidden = Some(last.clone().narrow(0, i, 1));
        }
        Ok(())
    }
}

/// Per-sequence drafter state: its own KV cache (post-RoPE keys and values in contiguous buffers whose capacity
/// doubles when full, so appending is amortized O(new rows) and rollback only moves the length) and the last
/// output.
#[derive(Debug, Clone)]
pub struct Eagle3State<B: Backend> {
    /// `[kv_heads, capacity, head_dim]`; rows `0..len` are valid.
    k: Option<Tensor<B, 3>>,
    v: Option<Tensor<B, 3>>,
    len: usize,
    committed: usize,
    last_hidden: Option<Tensor<B, 2>>,
    next_logits: Option<Vec<f32>>,
}

impl<B: Backend> Eagle3State<B> {
    /// Rows cached (target-backed and draft-only).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Rows backed by target features (the length after the last extend).
    pub fn committed(&self) -> usize {
        self.committed
    }

    /// Target-vocabulary logits for the next draft token (after [`Eagle3Drafter::extend`] or a step).
    pub fn next_logits(&self) -> Option<&[f32]> {
        self.next_logits.as_deref()
    }

    /// The pre-norm output `[1, H]` of the last row run (the hidden state the next chain step is fed).
    pub fn last_hidden(&self) -> Option<&Tensor<B, 2>> {
        self.last_hidden.as_ref()
    }

    /// Keeps the first `len` cached rows (the buffers stay allocated).
    pub fn truncate(&mut self, len: usize) {
        if len >= self.len {
            return;
        }
        self.len = len;
        self.committed = self.committed.min(len);
    }

    /// Appends `k`, `v` `[kv_heads, n, head_dim]` at rows `len..len + n`, growing the buffers when needed.
    fn append(&mut self, k: Tensor<B, 3>, v: Tensor<B, 3>) {
        let [kv, n, hd] = k.dims();
        let (len, need) = (self.len, self.len + n);
        let cap = self.k.as_ref().map_or(0, |t| t.dims()[1]);
        if need > cap {
            let new_cap = need.max(2 * cap).max(64);
            let device = k.device();
            let grow = |old: Option<Tensor<B, 3>>| {
                let fresh = Tensor::<B, 3>::zeros([kv, new_cap, hd], &device);
                match old {
                    Some(o) if len > 0 => fresh.slice_assign([0..kv, 0..len, 0..hd], o.narrow(1, 0, len)),
                    _ => fresh,
                }
            };
            self.k = Some(grow(self.k.take()));
            self.v = Some(grow(self.v.take()));
        }
        let range = [0..kv, len..need, 0..hd];
        self.k = self.k.take().map(|t| t.slice_assign(range.clone(), k));
        self.v = self.v.take().map(|t| t.slice_assign(range, v));
        self.len = need;
    }
}

/// The values of a `[1, width]` tensor.
pub(crate) fn row_values<B: Backend>(t: Tensor<B, 2>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| SpecError::input(format!("reading a tensor back to the host: {e:?}")))
}

/// `d2t` (draft id -> target id offset) and `t2d` (target id -> in the draft vocabulary), checked against each
/// other: every draft id maps into the target vocabulary, no two draft ids map to the same target id, and `t2d`
/// (when present) marks exactly the mapped ids. Returns the absolute draft -> target table.
fn load_vocab_maps(w: &mut Loader<'_>, c: &Eagle3Config) -> Result<Vec<u32>> {
    let (v, dv) = (c.vocab_size, c.draft_vocab_size);
    let root = w.root.clone();
    let err = |tensor: &str, message: String| SpecError::VocabMap {
        checkpoint: root.clone(),
        tensor: tensor.into(),
        message,
    };
    let has_d2t = w.ckpt.contains("d2t");
    let offsets: Vec<i64> = if has_d2t {
        w.view("d2t", &[dv], "")?.to_i64_vec()?
    } else if dv == v {
        vec![0; dv]
    } else {
        return Err(SpecError::MissingTensor {
            checkpoint: w.root.clone(),
            tensor: "d2t".into(),
            hint: format!("draft_vocab_size {dv} < vocab_size {v} needs a draft-to-target map"),
        });
    };
    let mut seen = vec![false; v];
    let mut d2t = Vec::with_capacity(dv);
    for (d, &off) in offsets.iter().enumerate() {
        let t = d as i64 + off;
        if !(0..v as i64).contains(&t) {
            return Err(err("d2t", format!("draft id {d} maps to target id {t}, outside 0..{v}")));
        }
        if std::mem::replace(&mut seen[t as usize], true) {
            return Err(err("d2t", format!("draft id {d} maps to target id {t}, already mapped by a lower draft id")));
        }
        d2t.push(t as u32);
    }
    if w.ckpt.contains("t2d") {
        let t2d = w.view("t2d", &[v], "")?.to_bool_vec()?;
        if let Some(t) = (0..v).find(|&t| t2d[t] != seen[t]) {
            return Err(err(
                "t2d",
                format!(
                    "t2d[{t}] = {} but d2t {} target id {t}",
                    t2d[t],
                    if seen[t] { "maps a draft id to" } else { "maps no draft id to" }
                ),
            ));
        }
    }
    Ok(d2t)
}
