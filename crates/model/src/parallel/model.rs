//! One rank's part of a tensor / expert parallel DeepSeek-V3 ([`ShardedDeepseekV3`]) and its full-form forward,
//! calling the [`Communicator`] where the split needs it (layout in [`super::shard`]).
//!
//! Per layer: `h = x + all_reduce(MLA_shard(RMSNorm(x)))`, `x = h + all_reduce(FFN_shard(RMSNorm(h)))`, where the
//! FFN shard is the dense MLP's column/row-parallel slice, or the routed experts this rank holds (on the tokens the
//! replicated router sends to them) plus the shared experts' slice. Every rank ends each layer with the same
//! residual stream (the all-reduce adds in rank order and gives every rank the same values), so the replicated
//! router decides the same on every rank and every rank returns the same logits.

use std::path::Path;

use burn::tensor::backend::Backend;
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData};

use super::comm::Communicator;
use super::shard::{Held, ShardSpec, ShardedMoe, TpSlices, rows, shard_mla, shard_mlp, shard_moe_as};
use crate::config::ModelConfig;
use crate::deepseek_v3::{BatchEntry, DeepseekV3, FeedForward, LogitRows, batch_rope_tables, batch_spans};
use crate::error::{ModelError, Result};
use crate::kv_cache::PagedMlaCache;
use crate::linear::Linear;
use crate::mla::Mla;
use crate::mlp::Mlp;
use crate::quant::Checkpoint;
use crate::rms_norm::RmsNorm;
use crate::rope::RotaryEmbedding;
use crate::weights::WeightLoader;

/// How tokens reach the routed experts of other ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertDispatch {
    /// Every rank has every token (the attention all-reduce gives each rank the whole residual stream), so each
    /// runs its experts on all tokens routed to them; one all-reduce sums the ranks' outputs with the shared
    /// experts'. The simplest correct EP.
    #[default]
    AllReduce,
    /// Rank `r` routes only its `1/world` share of the token rows and sends each (token, expert) row to the rank
    /// holding the expert (all-to-all); that rank runs it and sends the weighted output back (all-to-all); one
    /// all-reduce then merges the row shares and the shared experts' partial sums. What DP attention + EP
    /// deployments do; the rows travel through the host in this version.
    AllToAll,
}

/// A rank's feed-forward block.
#[derive(Debug, Clone)]
pub enum ShardedFeedForward<B: Backend> {
    /// The rank's slice of the dense MLP.
    Dense(Mlp<B>),
    /// Router, local experts, shared-expert slice.
    Moe(Box<ShardedMoe<B>>),
}

/// A rank's decoder layer: replicated norms, head-sliced MLA, sliced FFN.
#[derive(Debug, Clone)]
pub struct ShardedLayer<B: Backend> {
    /// Pre-attention norm (replicated).
    pub input_layernorm: RmsNorm<B>,
    /// This rank's heads.
    pub self_attn: Mla<B>,
    /// Pre-FFN norm (replicated).
    pub post_attention_layernorm: RmsNorm<B>,
    /// This rank's FFN slice.
    pub mlp: ShardedFeedForward<B>,
}

/// One rank of a tensor x expert parallel DeepSeek-V3 (see [`super::shard`] for the layout).
#[derive(Debug, Clone)]
pub struct ShardedDeepseekV3<B: Backend> {
    /// The validated config of the whole model.
    pub config: ModelConfig,
    /// This rank's place in the group.
    pub spec: ShardSpec,
    /// `[vocab, d]`, replicated.
    pub embed_tokens: Tensor<B, 2>,
    /// This rank's layers.
    pub layers: Vec<ShardedLayer<B>>,
    /// Final norm, replicated.
    pub norm: RmsNorm<B>,
    /// `lm_head`: this rank's vocabulary slice when `vocab_split`, else the whole `[vocab, d]`.
    pub lm_head: Linear<B>,
    /// Whether `lm_head` is split by vocabulary over the group (tp ranks = the whole group, dividing the
    /// vocabulary): each rank computes its `vocab / tp` logit columns and an all-gather joins them.
    pub vocab_split: bool,
    /// RoPE parameters.
    pub rope: RotaryEmbedding,
    /// How routed experts get their tokens (all-reduce unless set).
    pub dispatch: ExpertDispatch,
}

impl<B: Backend> ShardedDeepseekV3<B> {
    /// Loads rank `rank`'s shard of the checkpoint in `dir` for `tp`-way tensor and `ep`-way expert parallelism
    /// onto `device`, putting only the rank's part there: routed experts of other ranks are never read (their
    /// tensors are still accounted for, as [`DeepseekV3::load`] checks every tensor is), and tensor-parallel
    /// weights are cut to the rank's slice before upload (see [`super::shard`]'s `TpSlices`).
    pub fn load(dir: impl AsRef<Path>, rank: usize, tp: usize, ep: usize, device: &B::Device) -> Result<Self> {
        let config = ModelConfig::from_dir(dir.as_ref())?;
        let spec = ShardSpec { rank, tp, ep };
        spec.validate(&config)?;
        let experts = spec.experts(config.n_routed_experts);
        let ckpt = Checkpoint::open(dir.as_ref())?;
        let source = TpSlices::new(WeightLoader::new(&ckpt, &config)?, &config, spec);
        let partial = DeepseekV3::build(&config, source, device, Some(experts))?;
        Self::shard(&partial, spec, Held { experts: true, tp_slices: true })
    }

    /// Rank `spec.rank`'s shard of a model of `config`'s shapes with synthetic weights (benchmarks; see
    /// [`crate::synthetic`]), made on `device` with only this rank's routed experts.
    pub fn synthetic(config: &ModelConfig, spec: ShardSpec, device: &B::Device) -> Result<Self> {
        spec.validate(config)?;
        let partial = DeepseekV3::synthetic(config, device, spec.experts(config.n_routed_experts))?;
        Self::shard(&partial, spec, Held { experts: true, tp_slices: false })
    }

    /// `spec`'s shard of a loaded model.
    pub fn from_full(full: &DeepseekV3<B>, spec: ShardSpec) -> Result<Self> {
        Self::shard(full, spec, Held::default())
    }

    /// `spec`'s shard of `model`, which holds the whole model or (`held`) only this rank's experts and / or
    /// tensor-parallel slices.
    fn shard(model: &DeepseekV3<B>, spec: ShardSpec, held: Held) -> Result<Self> {
        let full = model;
        spec.validate(&full.config)?;
        let vocab_split = spec.vocab_split(full.config.vocab_size);
        let mla = |m: &Mla<B>| {
            if held.tp_slices {
                Mla { num_heads: m.num_heads / spec.tp, ..m.clone() }
            } else {
                shard_mla(m, spec.tp_rank(), spec.tp)
            }
        };
        let mlp = |m: &Mlp<B>| if held.tp_slices { m.clone() } else { shard_mlp(m, spec.tp_rank(), spec.tp) };
        let layers = full
            .layers
            .iter()
            .map(|l| ShardedLayer {
                input_layernorm: l.input_layernorm.clone(),
                self_attn: mla(&l.self_attn),
                post_attention_layernorm: l.post_attention_layernorm.clone(),
                mlp: match &l.mlp {
                    FeedForward::Dense(m) => ShardedFeedForward::Dense(mlp(m)),
                    FeedForward::Moe(moe) => ShardedFeedForward::Moe(Box::new(shard_moe_as(moe, &spec, held))),
                },
            })
            .collect();
        Ok(Self {
            config: full.config.clone(),
            spec,
            embed_tokens: full.embed_tokens.clone(),
            layers,
            norm: full.norm.clone(),
            // A sliced load slices `lm_head` too, unless it is the (replicated) tied embedding.
            lm_head: if vocab_split && full.lm_head.dims()[1] == full.config.vocab_size {
                let per = full.config.vocab_size / spec.tp;
                rows(&full.lm_head, spec.tp_rank() * per, per)
            } else {
                full.lm_head.clone()
            },
            vocab_split,
            rope: full.rope.clone(),
            dispatch: ExpertDispatch::default(),
        })
    }

    /// Logits `[b, s, vocab]` for `tokens` `[b, s]` (ids `< vocab_size`, as [`DeepseekV3::token_tensor`] makes
    /// them), the same on every rank. Every rank of `comm`'s group calls this with the same tokens.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>, comm: &impl Communicator<B>) -> Result<Tensor<B, 3>> {
        self.check_comm(comm)?;
        let [b, s] = tokens.dims();
        let (d, n) = (self.config.hidden_size, b * s);
        let device = tokens.device();
        // [b*s] -> [n, d]
        let mut x = self.embed_tokens.clone().select(0, tokens.reshape([n]));
        let tables = self.rope.tables::<B>(0, s, &device);
        let mut ffn = None;
        for layer in &self.layers {
            let (h, f) = self.layer_step(layer, x, ffn, comm, |normed| {
                layer.self_attn.forward(normed.reshape([b, s, d]), &self.rope, &tables).reshape([n, d])
            })?;
            (x, ffn) = (h, Some(f));
        }
        let logits = self.logits(x, ffn, comm)?;
        Ok(logits.reshape([b, s, self.config.vocab_size]))
    }

    /// One batched step over the paged latent cache, as [`DeepseekV3::forward_batch`] (same arguments, same
    /// validation, same result) with this rank's shard: every rank of `comm`'s group calls it with the same
    /// batch, each with its own `cache` and sequences (the same allocations happen on every rank, so their page
    /// tables agree). With MLA every rank caches the full latents (see [`super::shard`]).
    pub fn forward_batch(
        &self,
        batch: &mut [BatchEntry<'_>],
        cache: &mut PagedMlaCache<B>,
        rows: LogitRows,
        comm: &impl Communicator<B>,
        device: &B::Device,
    ) -> Result<Tensor<B, 2>> {
        self.forward_batch_fed(batch, cache, rows, comm, device, None)
    }

    /// [`Self::forward_batch`] whose embedding reads the step's token ids from `fed` (`[N]` int on the device, the
    /// batch's tokens in order, e.g. the previous step's [`crate::cuda_ops::PendingIds::ids`]) instead of
    /// uploading the entries' tokens: the host can queue this step before it has read the previous step's picks.
    /// The entries' token counts still place the rows (their values are checked but not embedded). `None` is
    /// [`Self::forward_batch`].
    ///
    /// # Errors
    /// As [`Self::forward_batch`], and `fed` not holding one id per token of the batch.
    pub fn forward_batch_fed(
        &self,
        batch: &mut [BatchEntry<'_>],
        cache: &mut PagedMlaCache<B>,
        rows: LogitRows,
        comm: &impl Communicator<B>,
        device: &B::Device,
        fed: Option<&Tensor<B, 1, Int>>,
    ) -> Result<Tensor<B, 2>> {
        self.check_comm(comm)?;
        if batch.is_empty() || batch.iter().any(|e| e.tokens.is_empty()) {
            return Err(ModelError::Input { message: "a batched step needs at least one token per sequence".into() });
        }
        let flat: Vec<u32> = batch.iter().flat_map(|e| e.tokens.iter().copied()).collect();
        let vocab = self.config.vocab_size;
        if let Some(&bad) = flat.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::Input {
                message: format!("token id {bad} is outside the vocabulary (size {vocab})"),
            });
        }
        let n = flat.len();
        crate::deepseek_v3::check_fed(fed, n)?;
        cache.reserve_batch(batch.iter_mut().map(|e| (&mut *e.seq, e.tokens.len())))?;
        let spans = batch_spans(batch);
        let tables = batch_rope_tables(&self.rope, &spans, device);
        let ids = match fed {
            Some(f) => f.clone(),
            None => {
                let ids: Vec<i64> = flat.iter().map(|&t| i64::from(t)).collect();
                Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [n]), device)
            }
        };
        // [N, d]
        let mut x = self.embed_tokens.clone().select(0, ids);
        // The residual stream travels as the two terms `x + ffn` of the previous layer (see `layer_step`).
        let mut ffn = None;
        for (i, layer) in self.layers.iter().enumerate() {
            let cache = &mut *cache;
            let (h, f) = self.layer_step(layer, x, ffn, comm, |normed| {
                layer.self_attn.forward_absorbed(normed, &self.rope, &tables, cache, i, &spans)
            })?;
            (x, ffn) = (h, Some(f));
        }
        // Decode steps (one new token a sequence, rows in batch order): the last rows are all the rows.
        let last_is_all = spans.iter().enumerate().all(|(i, s)| s.len == 1 && s.row == i);
        let logits = if rows == LogitRows::All || last_is_all {
            self.logits(x, ffn, comm)?
        } else {
            let x = match ffn {
                Some(f) => x + f,
                None => x,
            };
            let last: Vec<i64> = spans.iter().map(|s| (s.row + s.len - 1) as i64).collect();
            self.logits(x.select(0, Tensor::from_data(TensorData::new(last, [spans.len()]), device)), None, comm)?
        };
        for e in batch.iter_mut() {
            e.seq.len += e.tokens.len();
        }
        Ok(logits)
    }

    fn check_comm(&self, comm: &impl Communicator<B>) -> Result<()> {
        if comm.rank() != self.spec.rank || comm.world_size() != self.spec.world() {
            return Err(ModelError::Input {
                message: format!(
                    "communicator rank {} of {} does not match the shard's rank {} of {}",
                    comm.rank(),
                    comm.world_size(),
                    self.spec.rank,
                    self.spec.world()
                ),
            });
        }
        Ok(())
    }

    /// One decoder layer on the input `x + ffn` (`[n, d]`; `ffn` the previous layer's second term, `None` for
    /// the first layer): `attention` maps the normed rows to this rank's partial attention output `[n, d]`
    /// (full-form or cached); the partial sums are all-reduced. Returns the output's two terms `(h, ffn)`,
    /// unsummed: the next layer's input norm adds them in its own launch ([`RmsNorm::forward_add`]).
    fn layer_step(
        &self,
        layer: &ShardedLayer<B>,
        x: Tensor<B, 2>,
        ffn: Option<Tensor<B, 2>>,
        comm: &impl Communicator<B>,
        attention: impl FnOnce(Tensor<B, 2>) -> Tensor<B, 2>,
    ) -> Result<(Tensor<B, 2>, Tensor<B, 2>)> {
        let [n, d] = x.dims();
        let device = x.device();
        let (x, normed) = match ffn {
            Some(f) => layer.input_layernorm.forward_add(x, f),
            None => (x.clone(), layer.input_layernorm.forward(x)),
        };
        // [n, d] partial over this rank's heads. A rank without a tp shard of its own (tp < world) still runs
        // the attention when it caches (its cache must hold the latents), but adds zeros.
        let mut attn = attention(normed);
        if self.spec.tp > 1 && !self.spec.tp_contributes() {
            attn = Tensor::zeros([n, d], &device);
        }
        let attn = if self.spec.tp > 1 { comm.all_reduce_sum(attn)? } else { attn };
        // [n, d] each
        let (h, normed) = layer.post_attention_layernorm.forward_add(x, attn);
        let ffn = match &layer.mlp {
            ShardedFeedForward::Dense(mlp) => {
                if self.spec.tp == 1 {
                    mlp.forward(normed)
                } else if self.spec.tp_contributes() {
                    comm.all_reduce_sum(mlp.forward(normed))?
                } else {
                    comm.all_reduce_sum(Tensor::zeros([n, d], &device))?
                }
            }
            ShardedFeedForward::Moe(moe) => self.moe_forward(moe, normed, comm)?,
        };
        Ok((h, ffn))
    }

    /// Final norm and `lm_head` of `x + ffn` `[m, d]` -> `[m, vocab]` (vocabulary slices gathered).
    fn logits(&self, x: Tensor<B, 2>, ffn: Option<Tensor<B, 2>>, comm: &impl Communicator<B>) -> Result<Tensor<B, 2>> {
        let normed = match ffn {
            Some(f) => self.norm.forward_add(x, f).1,
            None => self.norm.forward(x),
        };
        let logits = self.lm_head.forward(normed);
        if self.vocab_split { comm.all_gather(logits, 1) } else { Ok(logits) }
    }

    /// The MoE block: this rank's routed experts on the tokens routed to them (see [`ExpertDispatch`]) plus
    /// this rank's shared-expert slice, one all-reduce of their sum. `x` `[n, d]` -> `[n, d]`.
    fn moe_forward(
        &self,
        sharded: &ShardedMoe<B>,
        x: Tensor<B, 2>,
        comm: &impl Communicator<B>,
    ) -> Result<Tensor<B, 2>> {
        let spec = &self.spec;
        let [n, d] = x.dims();
        let moe = &sharded.moe;
        // This rank's shared-expert slice, added by the routed experts' combine where they run on the device.
        // With the router's logits where both come from one launch (`Moe::shared_and_logits`).
        let (mut shared, logits) = if spec.tp_contributes() {
            let (shared, logits) = moe.shared_and_logits(x.clone());
            (Some(shared), logits)
        } else {
            (None, None)
        };
        let mut out = if spec.ep > 1 && self.dispatch == ExpertDispatch::AllToAll {
            self.routed_all_to_all(sharded, x.clone(), comm)?
        } else if spec.ep_contributes()
            && sharded.first_expert == 0
            && let Some(routed) = moe.routed_on_device_with(x.clone(), logits, shared.as_ref())
        {
            // This rank holds every expert (its device router is set only then): routed on the device.
            shared = None;
            routed
        } else if spec.ep_contributes() {
            let routing = moe.routing(x.clone());
            let k = moe.params.top_k;
            let slots = routing.experts.iter().zip(&routing.weights).enumerate().map(|(s, (&e, &w))| (s / k, e, w));
            run_local_experts(sharded, x.clone(), slots, k)
        } else {
            Tensor::zeros([n, d], &x.device())
        };
        if let Some(shared) = shared {
            out = out + shared;
        }
        if spec.world() > 1 { comm.all_reduce_sum(out) } else { Ok(out) }
    }

    /// [`ExpertDispatch::AllToAll`]: this rank's share of the rows is routed here, each (token, expert) row goes
    /// to the expert's rank as `[x (d) | expert id | weight]` (a part with no rows carries one row of expert id
    /// -1, so no part is empty), and the weighted outputs come back in the order sent. Returns `[n, d]` holding
    /// the routed output of this rank's rows, zeros elsewhere.
    fn routed_all_to_all(
        &self,
        sharded: &ShardedMoe<B>,
        x: Tensor<B, 2>,
        comm: &impl Communicator<B>,
    ) -> Result<Tensor<B, 2>> {
        let (world, rank) = (self.spec.world(), self.spec.rank);
        let [n, d] = x.dims();
        let device = x.device();
        let moe = &sharded.moe;
        let (k, per_rank) = (moe.params.top_k, moe.n_experts());
        // This rank's rows: start..start + len.
        let (start, len) = (rank * n / world, (rank + 1) * n / world - rank * n / world);
        let mut rows: Vec<Vec<f32>> = vec![Vec::new(); world];
        let mut tokens: Vec<Vec<i64>> = vec![Vec::new(); world];
        if len > 0 {
            let own = x.clone().narrow(0, start, len);
            let routing = moe.routing(own.clone());
            let own = host_rows(own)?;
            for (slot, (&e, &w)) in routing.experts.iter().zip(&routing.weights).enumerate() {
                let (dest, t) = (e / per_rank, slot / k);
                rows[dest].extend_from_slice(&own[t * d..(t + 1) * d]);
                rows[dest].extend([e as f32, w]);
                tokens[dest].push((start + t) as i64);
            }
        }
        let parts = rows
            .into_iter()
            .map(|mut r| {
                if r.is_empty() {
                    r = vec![0.0; d + 2];
                    r[d] = -1.0;
                }
                let m = r.len() / (d + 2);
                Tensor::from_data(TensorData::new(r, [m, d + 2]), &device)
            })
            .collect();
        // Received rows from every rank, run through the local experts, in the order received.
        let received = comm.all_to_all(parts)?;
        let counts: Vec<usize> = received.iter().map(|p| p.dims()[0]).collect();
        let all = Tensor::cat(received, 0);
        let meta = host_rows(all.clone().narrow(1, d, 2))?;
        let slots =
            meta.chunks_exact(2).enumerate().filter(|(_, m)| m[0] >= 0.0).map(|(i, m)| (i, m[0] as usize, m[1]));
        let done = run_local_experts(sharded, all.narrow(1, 0, d), slots, 0);
        let mut back = Vec::with_capacity(world);
        let mut row = 0;
        for c in counts {
            back.push(done.clone().narrow(0, row, c));
            row += c;
        }
        // The outputs of this rank's rows, in the order sent.
        let mut out = Tensor::<B, 2>::zeros([n, d], &device);
        for (part, toks) in comm.all_to_all(back)?.into_iter().zip(tokens) {
            if toks.is_empty() {
                continue;
            }
            let m = toks.len();
            let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(toks, [m]), &device);
            out = out.select_assign(0, idx, part, IndexingUpdateOp::Add);
        }
        Ok(out)
    }
}

/// This rank's routed experts on `x` `[m, d]`: `slots` are `(row, global expert id, weight)` for the experts this
/// rank holds (others are skipped); each expert runs once on its rows, as [`crate::moe::Moe::forward`] does (or
/// through the fused kernel). `top_k`: slots per row when `slots` is a whole routing in order, else 0.
/// Returns `[m, d]`, the weighted expert outputs summed per row.
fn run_local_experts<B: Backend>(
    sharded: &ShardedMoe<B>,
    x: Tensor<B, 2>,
    slots: impl Iterator<Item = (usize, usize, f32)>,
    top_k: usize,
) -> Tensor<B, 2> {
    let moe = &sharded.moe;
    let local = sharded.first_expert..sharded.first_expert + moe.n_experts();
    let all: Vec<(usize, usize, f32)> = slots.collect();
    let total = all.len();
    let mine: Vec<(usize, usize, f32)> =
        all.into_iter().filter(|(_, e, _)| local.contains(e)).map(|(r, e, w)| (r, e - local.start, w)).collect();
    // A whole routing stays whole only when every slot is local (one rank holding every expert).
    let top_k = if mine.len() == total { top_k } else { 0 };
    moe.routed(x, &mine, top_k)
}

/// A tensor's values on the host, row-major.
fn host_rows<B: Backend>(t: Tensor<B, 2>) -> Result<Vec<f32>> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| ModelError::Input { message: format!("cannot read a tensor to the host: {e:?}") })
}
