//! How a DeepSeek-V3 model splits over a parallel group: which slice of each weight a rank holds ([`ShardSpec`])
//! and the slicing itself, on the existing building blocks ([`Mla`], [`Mlp`], [`Moe`], [`Linear`]).
//!
//! Layout (Megatron-style tensor parallelism over `tp` ranks, expert parallelism over `ep` ranks):
//! - attention: heads split contiguously, rank `t` of `tp` holding heads `t*H/tp ..`: `q_b_proj` (or `q_proj`) and
//!   `kv_b_proj` rows by head, `o_proj` columns by head; `q_a_proj`, `kv_a_proj_with_mqa` and both latent norms
//!   replicated. Each rank's [`Mla`] is an ordinary one with `H/tp` heads, so its forward is the unchanged MLA
//!   math and its `o_proj` output is a partial sum, all-reduced. With MLA the latent `c_kv` / `k_pe` is shared by
//!   all heads, so a rank's compressed KV cache holds the same latents as the unsharded model's (only the absorbed
//!   per-head `W_UK` / `W_UV` slices differ): TP divides attention compute and weights, not the latent cache.
//! - dense MLP and the shared experts: column / row parallel: `gate_proj` / `up_proj` rows split, `down_proj`
//!   columns split, all-reduce after.
//! - routed experts: contiguous ranges, rank `e` of `ep` holding experts `e*E/ep ..`; the router (`gate`, its bias)
//!   is replicated, so every rank makes the same routing decisions; each rank runs its experts on the tokens
//!   routed to them and the partial outputs are combined by the same all-reduce as the shared expert's (the
//!   simplest correct EP; an all-to-all token dispatch is the optimization).
//! - embeddings and the final norm replicated; `lm_head` vocab-split (rows by token id, logits all-gathered) when
//!   `tp` is the whole group and divides the vocabulary, replicated otherwise.
//!
//! The group has `world = max(tp, ep)` ranks and both must divide it (so `tp == ep`, or one of them is 1, or e.g.
//! `tp = 2, ep = 4`). A part split `k < world` ways is held by rank `r` as shard `r % k`, and only ranks `< k` add
//! it to the all-reduce (the others contribute zeros): a stand-in for sub-group communicators.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use eyrie_quant::LinearWeight;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::linear::{Linear, StoredLinear};
use crate::mla::{Mla, QueryProjection};
use crate::mlp::Mlp;
use crate::moe::Moe;
use crate::weights::{WeightLoader, WeightSource};

/// A rank's place in a tensor x expert parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardSpec {
    /// This rank, `0..world()`.
    pub rank: usize,
    /// Tensor-parallel ways (attention heads, dense MLP, shared experts).
    pub tp: usize,
    /// Expert-parallel ways (routed experts).
    pub ep: usize,
}

impl ShardSpec {
    /// Ranks in the group: `max(tp, ep)`.
    pub fn world(&self) -> usize {
        self.tp.max(self.ep)
    }

    /// This rank's tensor-parallel shard, `rank % tp`.
    pub fn tp_rank(&self) -> usize {
        self.rank % self.tp
    }

    /// This rank's expert-parallel shard, `rank % ep`.
    pub fn ep_rank(&self) -> usize {
        self.rank % self.ep
    }

    /// Whether this rank adds its tensor-parallel partial sums to the all-reduce.
    pub fn tp_contributes(&self) -> bool {
        self.rank < self.tp
    }

    /// Whether this rank adds its routed experts' output to the all-reduce.
    pub fn ep_contributes(&self) -> bool {
        self.rank < self.ep
    }

    /// The routed experts this rank holds, `first..first + count`, out of `n_experts`.
    pub fn experts(&self, n_experts: usize) -> std::ops::Range<usize> {
        let per = n_experts / self.ep;
        self.ep_rank() * per..(self.ep_rank() + 1) * per
    }

    /// Whether `lm_head` is split by vocabulary over the group: tp is the whole group and divides `vocab`.
    pub fn vocab_split(&self, vocab: usize) -> bool {
        self.tp > 1 && self.tp == self.world() && vocab.is_multiple_of(self.tp)
    }

    /// Checks the split against `config`: every split size divides what it splits (heads, intermediate sizes,
    /// routed experts), `tp` and `ep` divide the world, `rank` is in it.
    pub fn validate(&self, config: &ModelConfig) -> Result<()> {
        let bad = |field: &str, message: String| ModelError::InvalidConfig {
            path: config.path.clone(),
            field: field.to_owned(),
            message,
        };
        let (tp, ep) = (self.tp, self.ep);
        if tp == 0 || ep == 0 {
            return Err(bad("tp/ep", format!("parallel sizes must be at least 1 (tp {tp}, ep {ep})")));
        }
        let world = self.world();
        if !world.is_multiple_of(tp) || !world.is_multiple_of(ep) {
            return Err(bad("tp/ep", format!("tp {tp} and ep {ep} must both divide the group size {world}")));
        }
        if self.rank >= world {
            return Err(bad("rank", format!("rank {} outside a group of {world}", self.rank)));
        }
        let has_moe = (0..config.num_hidden_layers).any(|i| config.layer_kind(i) == crate::config::LayerKind::Moe);
        let checks = [
            ("num_attention_heads", config.num_heads, tp),
            ("intermediate_size", config.intermediate_size, tp),
            ("n_shared_experts", if has_moe { config.shared_intermediate_size() } else { 0 }, tp),
            ("n_routed_experts", if has_moe { config.n_routed_experts } else { 0 }, ep),
        ];
        for (field, size, ways) in checks {
            if !size.is_multiple_of(ways) {
                return Err(bad(field, format!("{size} does not split {ways} ways")));
            }
        }
        Ok(())
    }
}

/// Rows `start..start + len` of `W` (`[out, in]`): the output slice.
pub(crate) fn rows<B: Backend>(l: &Linear<B>, start: usize, len: usize) -> Linear<B> {
    // weight [out, in]
    Linear::from_weight(l.weight.clone().narrow(0, start, len))
}

/// Columns `start..start + len` of `W` (`[out, in]`): the input slice.
fn cols<B: Backend>(l: &Linear<B>, start: usize, len: usize) -> Linear<B> {
    Linear::from_weight(l.weight.clone().narrow(1, start, len))
}

/// Tensor-parallel shard `part` of `ways` of a SwiGLU MLP: `gate_proj` / `up_proj` rows, `down_proj` columns.
/// Its forward is a partial sum of the full MLP's.
pub fn shard_mlp<B: Backend>(mlp: &Mlp<B>, part: usize, ways: usize) -> Mlp<B> {
    // [in, out] of gate_proj: [d, inter]
    let per = mlp.gate_proj.dims()[1] / ways;
    Mlp {
        gate_proj: rows(&mlp.gate_proj, part * per, per),
        up_proj: rows(&mlp.up_proj, part * per, per),
        down_proj: cols(&mlp.down_proj, part * per, per),
    }
}

/// Tensor-parallel shard `part` of `ways` of an MLA block: heads `part*H/ways ..` (see the module docs). Its
/// forward is a partial sum of the full block's.
pub fn shard_mla<B: Backend>(mla: &Mla<B>, part: usize, ways: usize) -> Mla<B> {
    let heads = mla.num_heads / ways;
    let first = part * heads;
    let qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
    let kv = mla.qk_nope_head_dim + mla.v_head_dim;
    let q = match &mla.q {
        QueryProjection::Lora { q_a_proj, q_a_layernorm, q_b_proj } => QueryProjection::Lora {
            q_a_proj: q_a_proj.clone(),
            q_a_layernorm: q_a_layernorm.clone(),
            q_b_proj: rows(q_b_proj, first * qk, heads * qk),
        },
        QueryProjection::Plain { q_proj } => QueryProjection::Plain { q_proj: rows(q_proj, first * qk, heads * qk) },
    };
    Mla {
        q,
        kv_a_proj_with_mqa: mla.kv_a_proj_with_mqa.clone(),
        kv_a_layernorm: mla.kv_a_layernorm.clone(),
        kv_b_proj: rows(&mla.kv_b_proj, first * kv, heads * kv),
        o_proj: cols(&mla.o_proj, first * mla.v_head_dim, heads * mla.v_head_dim),
        num_heads: heads,
        ..mla.clone()
    }
}

/// A rank's MoE block: the replicated router, its routed experts `first_expert..first_expert + n_experts()`
/// (as `moe.experts` or `moe.fused`) and its tensor-parallel shard of the shared experts (as `moe.shared_experts`).
#[derive(Debug, Clone)]
pub struct ShardedMoe<B: Backend> {
    /// Router, local experts, shared-expert shard.
    pub moe: Moe<B>,
    /// Global id of the first local expert.
    pub first_expert: usize,
}

/// `spec`'s shard of an MoE block whose `experts` are all routed experts, or (`experts_local`) already just
/// this rank's.
pub fn shard_moe<B: Backend>(moe: &Moe<B>, spec: &ShardSpec, experts_local: bool) -> ShardedMoe<B> {
    shard_moe_as(moe, spec, Held { experts: experts_local, tp_slices: false })
}

/// What a rank's model already holds as its own shard when it is sharded (a rank's load reads only its part).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Held {
    /// Only this rank's routed experts.
    pub experts: bool,
    /// Only this rank's tensor-parallel slices (heads, MLP and shared-expert columns / rows, vocabulary).
    pub tp_slices: bool,
}

/// [`shard_moe`] of a block holding what `held` says.
pub(crate) fn shard_moe_as<B: Backend>(moe: &Moe<B>, spec: &ShardSpec, held: Held) -> ShardedMoe<B> {
    let experts_local = held.experts;
    let n_experts = if experts_local { moe.n_experts() * spec.ep } else { moe.n_experts() };
    let range = spec.experts(n_experts);
    let (experts, fused) = match (&moe.fused, experts_local) {
        (_, true) => (moe.experts.clone(), moe.fused.clone()),
        (Some(f), false) => (Vec::new(), Some(f.narrow(range.clone()))),
        (None, false) => (moe.experts[range.clone()].to_vec(), None),
    };
    // The device router chooses among all experts: only a rank holding them all uses it.
    let all = range.start == 0 && range.len() == n_experts;
    ShardedMoe {
        first_expert: range.start,
        moe: Moe {
            device_router: if all { moe.device_router.clone() } else { None },
            gate: moe.gate.clone(),
            e_score_correction_bias: moe.e_score_correction_bias.clone(),
            experts,
            fused,
            shared_experts: if held.tp_slices {
                moe.shared_experts.clone()
            } else {
                shard_mlp(&moe.shared_experts, spec.tp_rank(), spec.tp)
            },
            params: moe.params.clone(),
        },
    }
}

/// Which part of a Linear's weight `W` (`[out, in]`) a rank keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Slice {
    /// Rows `start..start + len` (output features).
    Rows(usize, usize),
    /// Columns `start..start + len` (input features).
    Cols(usize, usize),
}

/// A checkpoint source that hands out only this rank's tensor-parallel slices ([`ShardSpec`]'s layout, the same
/// as [`shard_mla`] / [`shard_mlp`] / the vocabulary split cut from a whole model): a dense or FP8 weight is read
/// on the host and only its slice goes to the device; an INT4 one is uploaded packed and sliced after
/// dequantization. Everything else passes through to the checkpoint loader (routed experts: `stored_linear`).
pub(crate) struct TpSlices<'a> {
    inner: WeightLoader<'a>,
    spec: ShardSpec,
    heads: usize,
    qk: usize,
    kv: usize,
    v: usize,
    vocab_split: bool,
}

impl<'a> TpSlices<'a> {
    pub(crate) fn new(inner: WeightLoader<'a>, config: &ModelConfig, spec: ShardSpec) -> Self {
        Self {
            inner,
            spec,
            heads: config.num_heads / spec.tp,
            qk: config.qk_head_dim(),
            kv: config.qk_nope_head_dim + config.v_head_dim,
            v: config.v_head_dim,
            vocab_split: spec.vocab_split(config.vocab_size),
        }
    }

    /// The slice of the Linear `canonical` of full shape `[out, in]` this rank keeps (`None`: all of it).
    fn slice(&self, canonical: &str, [out, inp]: [usize; 2]) -> Option<Slice> {
        let (part, ways) = (self.spec.tp_rank(), self.spec.tp);
        if ways == 1 || canonical.contains(".mlp.experts.") {
            return None;
        }
        let first = part * self.heads;
        let ends = |suffix: &str| canonical.ends_with(suffix);
        if ends("self_attn.q_b_proj") || ends("self_attn.q_proj") {
            Some(Slice::Rows(first * self.qk, self.heads * self.qk))
        } else if ends("self_attn.kv_b_proj") {
            Some(Slice::Rows(first * self.kv, self.heads * self.kv))
        } else if ends("self_attn.o_proj") {
            Some(Slice::Cols(first * self.v, self.heads * self.v))
        } else if ends("mlp.gate_proj")
            || ends("mlp.up_proj")
            || ends("shared_experts.gate_proj")
            || ends("shared_experts.up_proj")
        {
            Some(Slice::Rows(part * out / ways, out / ways))
        } else if ends("mlp.down_proj") || ends("shared_experts.down_proj") {
            Some(Slice::Cols(part * inp / ways, inp / ways))
        } else if canonical == "lm_head" && self.vocab_split {
            Some(Slice::Rows(part * out / ways, out / ways))
        } else {
            None
        }
    }
}

impl WeightSource for TpSlices<'_> {
    fn tensor<B: Backend, const D: usize>(
        &mut self,
        canonical: &str,
        shape: [usize; D],
        device: &B::Device,
    ) -> Result<Tensor<B, D>> {
        self.inner.tensor(canonical, shape, device)
    }

    fn linear<B: Backend>(&mut self, canonical: &str, shape: [usize; 2], device: &B::Device) -> Result<Linear<B>> {
        let Some(slice) = self.slice(canonical, shape) else {
            return self.inner.linear(canonical, shape, device);
        };
        let (_, weight) = self.inner.linear_weight(canonical, shape)?;
        if matches!(weight, LinearWeight::Int4(_)) {
            let full = Linear::load(&weight, device)?;
            return Ok(match slice {
                Slice::Rows(start, len) => rows(&full, start, len),
                Slice::Cols(start, len) => cols(&full, start, len),
            });
        }
        let [out, inp] = shape;
        let w = weight.dequantize_f32()?;
        let (kept, dims) = match slice {
            Slice::Rows(start, len) => (w[start * inp..(start + len) * inp].to_vec(), [len, inp]),
            Slice::Cols(start, len) => {
                (w.chunks_exact(inp).flat_map(|row| row[start..start + len].iter().copied()).collect(), [out, len])
            }
        };
        Ok(Linear::from_weight(Tensor::from_data(TensorData::new(kept, dims), device)))
    }

    fn stored_linear<B: Backend>(
        &mut self,
        canonical: &str,
        shape: [usize; 2],
        device: &B::Device,
    ) -> Result<StoredLinear<B>> {
        self.inner.stored_linear(canonical, shape, device)
    }

    fn host_vector(&mut self, canonical: &str, len: usize) -> Result<Vec<f32>> {
        self.inner.host_vector(canonical, len)
    }

    fn skip_linear(&mut self, canonical: &str) -> Result<()> {
        self.inner.skip_linear(canonical)
    }

    fn finish(self) -> Result<()> {
        self.inner.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_map_to_shards() {
        let s = ShardSpec { rank: 3, tp: 2, ep: 4 };
        assert_eq!((s.world(), s.tp_rank(), s.ep_rank()), (4, 1, 3));
        assert!(!s.tp_contributes() && s.ep_contributes());
        assert_eq!(s.experts(8), 6..8);
        let s = ShardSpec { rank: 0, tp: 4, ep: 1 };
        assert_eq!((s.world(), s.experts(8)), (4, 0..8));
        assert!(s.tp_contributes() && s.ep_contributes());
    }
}
