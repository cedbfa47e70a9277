//! The DeepSeek-V3 decoder (arXiv:2412.19437; Kimi-K2 / K2.5 share it), as transformers'
//! `DeepseekV3ForCausalLM` (`models/deepseek_v3/modeling_deepseek_v3.py`, v5.24):
//! `embed -> L x [h = x + MLA(RMSNorm(x)); x = h + FFN(RMSNorm(h))] -> RMSNorm -> lm_head`, where FFN is a dense
//! SwiGLU MLP in layers `< first_k_dense_replace` and an MoE block after. No embedding or logit scaling.
//!
//! Compute is f32 on any burn backend. [`DeepseekV3::forward`] runs whole sequences from position 0 in MLA's full
//! form; [`DeepseekV3::forward_batch`] runs new tokens of several sequences (decode steps and prefill chunks mixed)
//! over a paged compressed KV cache in the absorbed form ([`crate::kv_cache`]), and [`DeepseekV3::forward_cached`]
//! is its batch of one.

use std::ops::Range;
use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use eyrie_quant::Checkpoint;

use crate::config::{LATENT_NORM_EPS, LayerKind, ModelConfig};
use crate::error::{ModelError, Result};
use crate::kv_cache::{PagedMlaCache, SeqSpan, SequenceCache};
use crate::linear::Linear;
use crate::mla::{Mla, QueryProjection};
use crate::mlp::{Expert, Mlp};
use crate::moe::{Moe, RouterParams};
use crate::rms_norm::RmsNorm;
use crate::rope::{RopeTables, RotaryEmbedding};
use crate::weights::{LoadProgress, WeightLoader, WeightSource};

/// The feed-forward half of a decoder layer.
#[derive(Debug, Clone)]
pub enum FeedForward<B: Backend> {
    /// A dense SwiGLU MLP.
    Dense(Mlp<B>),
    /// Routed + shared experts.
    Moe(Box<Moe<B>>),
}

/// One decoder layer.
#[derive(Debug, Clone)]
pub struct DecoderLayer<B: Backend> {
    /// Pre-attention norm.
    pub input_layernorm: RmsNorm<B>,
    /// Multi-head latent attention.
    pub self_attn: Mla<B>,
    /// Pre-FFN norm.
    pub post_attention_layernorm: RmsNorm<B>,
    /// Dense MLP or MoE.
    pub mlp: FeedForward<B>,
}

impl<B: Backend> DecoderLayer<B> {
    /// `[b, s, d] -> [b, s, d]`.
    pub fn forward(&self, x: Tensor<B, 3>, rope: &RotaryEmbedding, tables: &RopeTables<B>) -> Tensor<B, 3> {
        let [b, s, d] = x.dims();
        let h = x.clone() + self.self_attn.forward(self.input_layernorm.forward(x), rope, tables);
        // [b*s, d]
        let normed = self.post_attention_layernorm.forward(h.clone()).reshape([b * s, d]);
        let ffn = match &self.mlp {
            FeedForward::Dense(mlp) => mlp.forward(normed),
            FeedForward::Moe(moe) => moe.forward(normed),
        };
        h + ffn.reshape([b, s, d])
    }

    /// The same layer over the absorbed, cached attention: `x` `[N, d]` are the new tokens of the sequences in
    /// `spans`, flattened (see [`SeqSpan`]) -> `[N, d]`.
    pub fn forward_cached(
        &self,
        x: Tensor<B, 2>,
        rope: &RotaryEmbedding,
        tables: &RopeTables<B>,
        cache: &mut PagedMlaCache<B>,
        layer: usize,
        spans: &[SeqSpan<'_>],
    ) -> Tensor<B, 2> {
        let normed = self.input_layernorm.forward(x.clone());
        let (h, ffn) = self.forward_cached_parts(x, normed, rope, tables, cache, layer, spans);
        h + ffn
    }

    /// [`Self::forward_cached`] from the layer input `x` and its `input_layernorm` output `normed`, returning the
    /// two terms of the output `(h, ffn)` (the output is `h + ffn`) unsummed, so the caller can fuse the sum into
    /// the next norm ([`RmsNorm::forward_add`]: one launch fewer a layer on CUDA, the same f32 sum).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_cached_parts(
        &self,
        x: Tensor<B, 2>,
        normed: Tensor<B, 2>,
        rope: &RotaryEmbedding,
        tables: &RopeTables<B>,
        cache: &mut PagedMlaCache<B>,
        layer: usize,
        spans: &[SeqSpan<'_>],
    ) -> (Tensor<B, 2>, Tensor<B, 2>) {
        let attn = self.self_attn.forward_absorbed(normed, rope, tables, cache, layer, spans);
        let (h, normed) = self.post_attention_layernorm.forward_add(x, attn);
        let ffn = match &self.mlp {
            FeedForward::Dense(mlp) => mlp.forward(normed),
            FeedForward::Moe(moe) => moe.forward(normed),
        };
        (h, ffn)
    }
}

/// One sequence's part of a batched step ([`DeepseekV3::forward_batch`]): its cache and its new tokens.
#[derive(Debug)]
pub struct BatchEntry<'a> {
    /// The sequence; its new tokens go at positions `seq.len..`, and it grows by `tokens.len()`.
    pub seq: &'a mut SequenceCache,
    /// New tokens: one for a decode step, several for a prefill chunk (at least one).
    pub tokens: &'a [u32],
}

/// Which logit rows a batched step returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// Every new token's, `[total_new, vocab]`, sequence after sequence in batch order.
    All,
    /// Only each sequence's last new token's, `[batch, vocab]` in batch order (what sampling needs).
    Last,
}

/// Logits plus the hidden states transformers reports with `output_hidden_states=True`.
#[derive(Debug, Clone)]
pub struct ForwardOutput<B: Backend> {
    /// `[b, s, vocab]`.
    pub logits: Tensor<B, 3>,
    /// `num_hidden_layers + 1` entries of `[b, s, d]`: entry `i < L` is the residual stream at the INPUT of layer
    /// `i` (entry 0 = the embeddings); entry `L` is the final normed state (`model.norm` output, what `lm_head`
    /// reads), as transformers' `hidden_states`.
    pub hidden_states: Vec<Tensor<B, 3>>,
}

/// The model.
#[derive(Debug, Clone)]
pub struct DeepseekV3<B: Backend> {
    /// The validated config.
    pub config: ModelConfig,
    /// `model.embed_tokens.weight` `[vocab, d]`.
    pub embed_tokens: Tensor<B, 2>,
    /// Decoder layers.
    pub layers: Vec<DecoderLayer<B>>,
    /// Final norm.
    pub norm: RmsNorm<B>,
    /// `lm_head` `[vocab, d]` (the embedding when tied).
    pub lm_head: Linear<B>,
    /// RoPE parameters.
    pub rope: RotaryEmbedding,
}

impl<B: Backend> DeepseekV3<B> {
    /// Loads config.json and the checkpoint in `dir` onto `device`.
    pub fn load(dir: impl AsRef<Path>, device: &B::Device) -> Result<Self> {
        let config = ModelConfig::from_dir(dir.as_ref())?;
        let ckpt = Checkpoint::open(dir.as_ref())?;
        Self::from_checkpoint(config, &ckpt, device)
    }

    /// Builds the model from an open checkpoint; fails if any checkpoint tensor is left unused (see
    /// [`crate::weights`]).
    pub fn from_checkpoint(config: ModelConfig, ckpt: &Checkpoint, device: &B::Device) -> Result<Self> {
        Self::build(&config, WeightLoader::new(ckpt, &config)?, device, None)
    }

    /// [`Self::load`] reporting progress (tensors, bytes, elapsed; [`LoadProgress::eta`]) after each tensor.
    pub fn load_with_progress(
        dir: impl AsRef<Path>,
        device: &B::Device,
        mut progress: impl FnMut(&LoadProgress),
    ) -> Result<Self> {
        let config = ModelConfig::from_dir(dir.as_ref())?;
        let ckpt = Checkpoint::open(dir.as_ref())?;
        let loader = WeightLoader::new(&ckpt, &config)?.with_progress(&mut progress);
        Self::build(&config, loader, device, None)
    }

    /// `experts`: the routed experts to load (all when `None`).
    ///
    /// The weights are allocated in exact-size buffers of their own (CubeCL's persistent mode), and the load's
    /// temporaries (staging, dequantization, copies made dense) are given back to the device at the end: made in
    /// CubeCL's default pools, a full-width model's load left a third of its size reserved but unused, pages of
    /// sizes later steps could not use (a 10-layer Kimi-K2 slice: 96 GB in use, 134 GB reserved), and a later
    /// prefill ran out of device memory.
    pub(crate) fn build(
        config: &ModelConfig,
        w: impl WeightSource,
        device: &B::Device,
        experts: Option<Range<usize>>,
    ) -> Result<Self> {
        let model =
            crate::device::persistent_allocations::<B, _>(device, || Self::build_in(config, w, device, experts));
        B::memory_cleanup(device);
        model
    }

    fn build_in(
        config: &ModelConfig,
        mut w: impl WeightSource,
        device: &B::Device,
        experts: Option<Range<usize>>,
    ) -> Result<Self> {
        let c = config;
        let d = c.hidden_size;
        let embed_tokens = w.tensor::<B, 2>("model.embed_tokens.weight", [c.vocab_size, d], device)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let experts = experts.clone().unwrap_or(0..c.n_routed_experts);
            layers.push(load_layer(&mut w, c, i, device, experts)?);
        }
        let norm = RmsNorm::new(w.tensor("model.norm.weight", [d], device)?, c.rms_norm_eps);
        let lm_head = if c.tie_word_embeddings {
            Linear::from_weight(embed_tokens.clone())
        } else {
            w.linear("lm_head", [c.vocab_size, d], device)?
        };
        w.finish()?;
        let rope = RotaryEmbedding::new(c);
        Ok(Self { config: config.clone(), embed_tokens, layers, norm, lm_head, rope })
    }

    /// Token ids as a `[batch, seq]` tensor, checked against the vocabulary (rows must be non-empty and of equal
    /// length).
    pub fn token_tensor(&self, rows: &[&[u32]], device: &B::Device) -> Result<Tensor<B, 2, Int>> {
        let seq = rows.first().map_or(0, |r| r.len());
        if seq == 0 || rows.iter().any(|r| r.len() != seq) {
            return Err(ModelError::Input { message: "token rows must be non-empty and of equal length".into() });
        }
        let mut ids = Vec::with_capacity(rows.len() * seq);
        for &t in rows.iter().flat_map(|r| r.iter()) {
            if t as usize >= self.config.vocab_size {
                return Err(ModelError::Input {
                    message: format!("token id {t} is outside the vocabulary (size {})", self.config.vocab_size),
                });
            }
            ids.push(i64::from(t));
        }
        Ok(Tensor::from_data(TensorData::new(ids, [rows.len(), seq]), device))
    }

    /// Logits `[b, s, vocab]` for `tokens` `[b, s]` (ids must be `< vocab_size`; see [`Self::token_tensor`]).
    pub fn forward(&self, tokens: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        self.run(tokens, false).logits
    }

    /// Logits and every hidden state (see [`ForwardOutput`]).
    pub fn forward_with_hidden(&self, tokens: Tensor<B, 2, Int>) -> ForwardOutput<B> {
        self.run(tokens, true)
    }

    fn run(&self, tokens: Tensor<B, 2, Int>, keep_hidden: bool) -> ForwardOutput<B> {
        let [b, s] = tokens.dims();
        let d = self.config.hidden_size;
        let device = tokens.device();
        // [b*s] -> [b*s, d] -> [b, s, d]
        let mut x = self.embed_tokens.clone().select(0, tokens.reshape([b * s])).reshape([b, s, d]);
        let tables = self.rope.tables::<B>(0, s, &device);
        let mut hidden_states = Vec::with_capacity(if keep_hidden { self.layers.len() + 1 } else { 0 });
        for layer in &self.layers {
            if keep_hidden {
                hidden_states.push(x.clone());
            }
            x = layer.forward(x, &self.rope, &tables);
        }
        let x = self.norm.forward(x);
        if keep_hidden {
            hidden_states.push(x.clone());
        }
        let logits = self.lm_head.forward(x.reshape([b * s, d])).reshape([b, s, self.config.vocab_size]);
        ForwardOutput { logits, hidden_states }
    }

    /// Runs `tokens` (new tokens of `seq`, appended after its `seq.len` cached ones) through the absorbed MLA over
    /// `cache` and returns their logits `[n, vocab]`; `seq` grows by `n`. A prefill is the first call on an empty
    /// `seq`, a decode step a call with one token. A batch of one [`Self::forward_batch`].
    pub fn forward_cached(
        &self,
        tokens: &[u32],
        cache: &mut PagedMlaCache<B>,
        seq: &mut SequenceCache,
        device: &B::Device,
    ) -> Result<Tensor<B, 2>> {
        self.forward_batch(&mut [BatchEntry { seq, tokens }], cache, LogitRows::All, device)
    }

    /// One forward step of several sequences sharing `cache`, as a continuous-batching scheduler calls it: each
    /// entry brings its own new tokens (a decode token, a prefill chunk, or a mix across entries) at its own
    /// position (its cache length). The new tokens of all entries run as one `[total_new, d]` row set through
    /// embedding, norms, projections, MoE and `lm_head`; attention is per sequence over its own cached tokens only,
    /// causal within its new tokens. Each sequence's latents go to its own pages and it grows by its token count.
    ///
    /// Returns logits as `rows` asks. Fails, changing nothing, on an empty batch or entry, a token outside the
    /// vocabulary, or when the cache has too few free blocks for the whole step. [`Self::forward_batch_capture`]
    /// with nothing to capture.
    pub fn forward_batch(
        &self,
        batch: &mut [BatchEntry<'_>],
        cache: &mut PagedMlaCache<B>,
        rows: LogitRows,
        device: &B::Device,
    ) -> Result<Tensor<B, 2>> {
        Ok(self.forward_batch_capture(batch, cache, rows, &[], device)?.0)
    }

    /// [`Self::forward_batch`] that also returns hidden states of every new token at the layers in `capture` (the
    /// target-model features EAGLE-3 drafts from), the same step with the same numerics.
    ///
    /// Capture id `i < num_hidden_layers` is the residual stream at the **input of layer i = HF
    /// `hidden_states[i]`** (`output_hidden_states=True`; id 0 = the token embeddings). Equivalently it is the
    /// **output of layer i-1**: SGLang numbers explicitly configured EAGLE-3 aux layers
    /// (`eagle_aux_hidden_state_layer_ids`) by the layer whose output they take and adds 1 internally, so its id `l`
    /// is id `l + 1` here; its default list `[2, L/2, L-3]` (Kimi-K2, L = 61: `[2, 30, 58]`) is already in
    /// input-of-layer numbering and means the same ids here. Id `num_hidden_layers` is HF's last `hidden_states`
    /// entry: the final normed state (the `model.norm` output that `lm_head` reads), not the un-normed output of the
    /// last layer.
    ///
    /// Returns the logits as `rows` asks and one `[total_new, hidden_size]` tensor per entry of `capture`, in
    /// `capture`'s order (ids may repeat), rows sequence after sequence in batch order as [`LogitRows::All`]
    /// (every new token, whatever `rows` is). Fails, changing nothing, where [`Self::forward_batch`] does and on a
    /// capture id above `num_hidden_layers`.
    pub fn forward_batch_capture(
        &self,
        batch: &mut [BatchEntry<'_>],
        cache: &mut PagedMlaCache<B>,
        rows: LogitRows,
        capture: &[usize],
        device: &B::Device,
    ) -> Result<(Tensor<B, 2>, Vec<Tensor<B, 2>>)> {
        self.forward_batch_capture_fed(batch, cache, rows, capture, device, None)
    }

    /// [`Self::forward_batch`] whose embedding reads the step's token ids from `fed` (`[N]` int on the device: the
    /// batch's tokens in order, e.g. the previous step's greedy picks, [`crate::sampling::PendingPicks::ids`])
    /// instead of uploading the entries' tokens, so a step can be queued before the host has read the previous
    /// step's picks. The entries' token counts still place the rows; their values are checked, not embedded.
    ///
    /// # Errors
    /// As [`Self::forward_batch`], and `fed` not holding one id per token of the batch.
    pub fn forward_batch_fed(
        &self,
        batch: &mut [BatchEntry<'_>],
        cache: &mut PagedMlaCache<B>,
        rows: LogitRows,
        device: &B::Device,
        fed: Option<&Tensor<B, 1, Int>>,
    ) -> Result<Tensor<B, 2>> {
        Ok(self.forward_batch_capture_fed(batch, cache, rows, &[], device, fed)?.0)
    }

    fn forward_batch_capture_fed(
        &self,
        batch: &mut [BatchEntry<'_>],
        cache: &mut PagedMlaCache<B>,
        rows: LogitRows,
        capture: &[usize],
        device: &B::Device,
        fed: Option<&Tensor<B, 1, Int>>,
    ) -> Result<(Tensor<B, 2>, Vec<Tensor<B, 2>>)> {
        if batch.is_empty() || batch.iter().any(|e| e.tokens.is_empty()) {
            return Err(ModelError::Input { message: "a batched step needs at least one token per sequence".into() });
        }
        let num_layers = self.layers.len();
        if let Some(&bad) = capture.iter().find(|&&i| i > num_layers) {
            return Err(ModelError::Input {
                message: format!(
                    "hidden-state capture layer {bad} is out of range: valid ids are 0..={num_layers} (0..{num_layers} \
                     = input of that layer, {num_layers} = final normed state)"
                ),
            });
        }
        let flat: Vec<u32> = batch.iter().flat_map(|e| e.tokens.iter().copied()).collect();
        let (n, d) = (flat.len(), self.config.hidden_size);
        let ids = match fed {
            None => self.token_tensor(&[&flat], device)?,
            Some(f) => {
                let vocab = self.config.vocab_size;
                check_fed(Some(f), n)?;
                if let Some(&bad) = flat.iter().find(|&&t| t as usize >= vocab) {
                    return Err(ModelError::Input {
                        message: format!("token id {bad} is outside the vocabulary (size {vocab})"),
                    });
                }
                f.clone().reshape([1, n])
            }
        };
        cache.reserve_batch(batch.iter_mut().map(|e| (&mut *e.seq, e.tokens.len())))?;

        let spans = batch_spans(batch);
        let tables = batch_rope_tables(&self.rope, &spans, device);
        // captured[i] = the state at capture id i (input of layer i, or the final normed state at i = L).
        let mut captured: Vec<Option<Tensor<B, 2>>> = vec![None; if capture.is_empty() { 0 } else { num_layers + 1 }];
        // [N, d]: the residual stream is carried as two terms `x + ffn` (the previous layer's `(h, ffn)`), whose
        // sum each layer's input norm computes in the same launch (`forward_add`).
        let mut x = self.embed_tokens.clone().select(0, ids.reshape([n]));
        let mut ffn: Option<Tensor<B, 2>> = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let (input, normed) = match ffn.take() {
                Some(f) => layer.input_layernorm.forward_add(x, f),
                None => (x.clone(), layer.input_layernorm.forward(x)),
            };
            if capture.contains(&i) {
                captured[i] = Some(input.clone());
            }
            let (h, f) = layer.forward_cached_parts(input, normed, &self.rope, &tables, cache, i, &spans);
            (x, ffn) = (h, Some(f));
        }
        debug_assert_eq!(x.dims(), [n, d]);
        // Decode steps (one new token a sequence, rows in batch order): the last rows are all the rows.
        let last_is_all = spans.iter().enumerate().all(|(i, s)| s.len == 1 && s.row == i);
        let normed = if rows == LogitRows::All || last_is_all {
            let normed = match ffn {
                Some(f) => self.norm.forward_add(x, f).1,
                None => self.norm.forward(x),
            };
            if capture.contains(&num_layers) {
                captured[num_layers] = Some(normed.clone());
            }
            normed
        } else {
            // [N, d] -> [batch, d]
            let x = match ffn {
                Some(f) => x + f,
                None => x,
            };
            if capture.contains(&num_layers) {
                // Every row's final normed state; the logits below still norm only the selected rows.
                captured[num_layers] = Some(self.norm.forward(x.clone()));
            }
            let last: Vec<i64> = spans.iter().map(|s| (s.row + s.len - 1) as i64).collect();
            self.norm.forward(x.select(0, Tensor::from_data(TensorData::new(last, [spans.len()]), device)))
        };
        for e in batch.iter_mut() {
            e.seq.len += e.tokens.len();
        }
        let hidden = capture.iter().map(|&i| captured[i].clone().expect("every capture id was recorded")).collect();
        Ok((self.lm_head.forward(normed), hidden))
    }

    /// Greedy decoding of `n` tokens after `prompt` (no end-of-sequence stop), re-running the full forward at each
    /// step (there is no KV cache yet). Ties go to the lowest token id.
    pub fn generate_greedy(&self, prompt: &[u32], n: usize, device: &B::Device) -> Result<Vec<u32>> {
        let mut seq = prompt.to_vec();
        for _ in 0..n {
            let tokens = self.token_tensor(&[&seq], device)?;
            let s = seq.len();
            // [1, 1, vocab] -> [vocab]
            let last = self.forward(tokens).narrow(1, s - 1, 1).reshape([self.config.vocab_size]);
            let values = last.into_data().convert::<f32>().to_vec::<f32>().expect("f32 data after convert");
            let best = values
                .iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) })
                .0;
            seq.push(best as u32);
        }
        Ok(seq[prompt.len()..].to_vec())
    }
}

/// Device-fed token ids (`forward_batch_fed`) must hold one id per token of the batch: an `Input` error otherwise.
pub(crate) fn check_fed<B: Backend>(fed: Option<&Tensor<B, 1, Int>>, n: usize) -> Result<()> {
    match fed {
        Some(f) if f.dims() != [n] => {
            Err(ModelError::Input { message: format!("fed token ids: shape {:?}, the batch has {n} tokens", f.dims()) })
        }
        _ => Ok(()),
    }
}

fn load_layer<B: Backend>(
    w: &mut impl WeightSource,
    c: &ModelConfig,
    i: usize,
    device: &B::Device,
    keep: Range<usize>,
) -> Result<DecoderLayer<B>> {
    let p = format!("model.layers.{i}");
    let d = c.hidden_size;
    let h = c.num_heads;
    let q = match c.q_lora_rank {
        Some(r) => QueryProjection::Lora {
            q_a_proj: w.linear(&format!("{p}.self_attn.q_a_proj"), [r, d], device)?,
            q_a_layernorm: RmsNorm::new(
                w.tensor(&format!("{p}.self_attn.q_a_layernorm.weight"), [r], device)?,
                LATENT_NORM_EPS,
            ),
            q_b_proj: w.linear(&format!("{p}.self_attn.q_b_proj"), [h * c.qk_head_dim(), r], device)?,
        },
        None => QueryProjection::Plain {
            q_proj: w.linear(&format!("{p}.self_attn.q_proj"), [h * c.qk_head_dim(), d], device)?,
        },
    };
    let r = c.kv_lora_rank;
    let self_attn = Mla {
        q,
        kv_a_proj_with_mqa: w.linear(&format!("{p}.self_attn.kv_a_proj_with_mqa"), [c.kv_a_dim(), d], device)?,
        kv_a_layernorm: RmsNorm::new(
            w.tensor(&format!("{p}.self_attn.kv_a_layernorm.weight"), [r], device)?,
            LATENT_NORM_EPS,
        ),
        kv_b_proj: w.linear(
            &format!("{p}.self_attn.kv_b_proj"),
            [h * (c.qk_nope_head_dim + c.v_head_dim), r],
            device,
        )?,
        o_proj: w.linear(&format!("{p}.self_attn.o_proj"), [d, h * c.v_head_dim], device)?,
        num_heads: h,
        qk_nope_head_dim: c.qk_nope_head_dim,
        qk_rope_head_dim: c.qk_rope_head_dim,
        v_head_dim: c.v_head_dim,
        kv_lora_rank: r,
        softmax_scale: c.softmax_scale(),
    };
    fn mlp<B: Backend>(
        w: &mut impl WeightSource,
        prefix: &str,
        inter: usize,
        d: usize,
        device: &B::Device,
    ) -> Result<Mlp<B>> {
        Ok(Mlp {
            gate_proj: w.linear(&format!("{prefix}.gate_proj"), [inter, d], device)?,
            up_proj: w.linear(&format!("{prefix}.up_proj"), [inter, d], device)?,
            down_proj: w.linear(&format!("{prefix}.down_proj"), [d, inter], device)?,
        })
    }
    let ffn = match c.layer_kind(i) {
        LayerKind::Dense => FeedForward::Dense(mlp(w, &format!("{p}.mlp"), c.intermediate_size, d, device)?),
        LayerKind::Moe => {
            let e = c.n_routed_experts;
            let gate = w.linear(&format!("{p}.mlp.gate"), [e, d], device)?;
            let e_score_correction_bias = w.host_vector(&format!("{p}.mlp.gate.e_score_correction_bias"), e)?;
            let mut experts = Vec::with_capacity(keep.len());
            for j in 0..e {
                let prefix = format!("{p}.mlp.experts.{j}");
                if keep.contains(&j) {
                    let inter = c.moe_intermediate_size;
                    experts.push(Expert {
                        gate_proj: w.stored_linear(&format!("{prefix}.gate_proj"), [inter, d], device)?,
                        up_proj: w.stored_linear(&format!("{prefix}.up_proj"), [inter, d], device)?,
                        down_proj: w.stored_linear(&format!("{prefix}.down_proj"), [d, inter], device)?,
                    });
                } else {
                    for part in ["gate_proj", "up_proj", "down_proj"] {
                        w.skip_linear(&format!("{prefix}.{part}"))?;
                    }
                }
            }
            let shared_experts = mlp(w, &format!("{p}.mlp.shared_experts"), c.shared_intermediate_size(), d, device)?;
            let params = RouterParams {
                top_k: c.num_experts_per_tok,
                n_group: c.n_group,
                topk_group: c.topk_group,
                norm_topk_prob: c.norm_topk_prob,
                routed_scaling_factor: c.routed_scaling_factor as f32,
            };
            let mut moe = Moe {
                gate,
                e_score_correction_bias,
                experts,
                shared_experts,
                params,
                fused: None,
                device_router: None,
            };
            // On CUDA the routed experts move into the fused kernel's layout (held once, not twice).
            moe.fuse(false);
            FeedForward::Moe(Box::new(moe))
        }
    };
    Ok(DecoderLayer {
        input_layernorm: RmsNorm::new(w.tensor(&format!("{p}.input_layernorm.weight"), [d], device)?, c.rms_norm_eps),
        self_attn,
        post_attention_layernorm: RmsNorm::new(
            w.tensor(&format!("{p}.post_attention_layernorm.weight"), [d], device)?,
            c.rms_norm_eps,
        ),
        mlp: ffn,
    })
}

/// Where each entry's new tokens sit in the flattened batch (their pages already reserved).
pub(crate) fn batch_spans<'a>(batch: &'a [BatchEntry<'_>]) -> Vec<SeqSpan<'a>> {
    let mut row = 0;
    batch
        .iter()
        .map(|e| {
            let span = SeqSpan { seq: &*e.seq, row, start: e.seq.len, len: e.tokens.len() };
            row += e.tokens.len();
            span
        })
        .collect()
}

/// RoPE tables with one row per flattened new token of `spans`, at that token's own position.
pub(crate) fn batch_rope_tables<B: Backend>(
    rope: &RotaryEmbedding,
    spans: &[SeqSpan<'_>],
    device: &B::Device,
) -> RopeTables<B> {
    let half = rope.inv_freq.len();
    let n: usize = spans.iter().map(|s| s.len).sum();
    let (mut cos, mut sin) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
    for span in spans {
        let (c, s) = rope.host_tables(span.start, span.len);
        cos.extend(c);
        sin.extend(s);
    }
    RopeTables {
        cos: Tensor::from_data(TensorData::new(cos, [n, half]), device),
        sin: Tensor::from_data(TensorData::new(sin, [n, half]), device),
    }
}
