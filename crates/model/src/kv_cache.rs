//! A paged, compressed MLA KV cache and the absorbed decode form of MLA over it (DeepSeek-V2, arXiv:2405.04434,
//! section 2.1.2 "low-rank key-value joint compression"; the absorption as in DeepSeek-V3's `inference/model.py`
//! `attn_impl = "absorb"` and vLLM's MLA backends).
//!
//! Per token and layer the cache holds `kv_lora_rank + qk_rope_head_dim` values (576 for Kimi-K2): the NORMALIZED
//! latent `c_kv` and the POST-RoPE shared key `k_pe` (in [`crate::rope`]'s output layout). Storage is a pool of
//! fixed-size blocks per layer, `[num_blocks * block_size, 576]`; a [`SequenceCache`] owns a list of blocks (its
//! page table), so sequences grow without copying and give their blocks back when released.
//!
//! Absorbed attention: with `kv_b_proj.weight` viewed as `[H, nope + v, r]`, `W_UK[h] = rows 0..nope`,
//! `W_UV[h] = rows nope..nope+v`: `q_lat[h] = q_nope[h] W_UK[h]` (`[r]`);
//! `s_h(t) = scale * (q_lat[h] . c_kv(t) + q_pe[h] . k_pe(t))`; `o_lat[h] = sum_t p_h(t) c_kv(t)`;
//! `o_h = o_lat[h] W_UV[h]^T`; then `o_proj`. This is MQA with key width `r + rope` and value width `r`, equal to
//! the full form up to f32 reassociation (the golden tests check both against transformers).
//!
//! One sequence per call (batch 1); batching across sequences is a later step.

use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor, TensorData};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::mla::Mla;
use crate::rope::{RopeTables, RotaryEmbedding};

/// The page table and length of one sequence in a [`PagedMlaCache`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SequenceCache {
    /// Block ids in position order: position `p` lives in block `blocks[p / block_size]`, row `p % block_size`.
    pub blocks: Vec<usize>,
    /// Tokens cached so far.
    pub len: usize,
}

/// Compressed MLA latents of every layer, in fixed-size blocks shared by all sequences.
#[derive(Debug, Clone)]
pub struct PagedMlaCache<B: Backend> {
    /// Per layer `[num_blocks * block_size, kv_lora_rank + qk_rope_head_dim]`.
    pools: Vec<Tensor<B, 2>>,
    block_size: usize,
    num_blocks: usize,
    free: Vec<usize>,
}

impl<B: Backend> PagedMlaCache<B> {
    /// A cache of `num_blocks` blocks of `block_size` tokens for every layer of `config`.
    pub fn new(config: &ModelConfig, num_blocks: usize, block_size: usize, device: &B::Device) -> Result<Self> {
        if num_blocks == 0 || block_size == 0 {
            return Err(ModelError::Input {
                message: "a KV cache needs at least one block of at least one token".into(),
            });
        }
        let width = config.kv_a_dim();
        let pools =
            (0..config.num_hidden_layers).map(|_| Tensor::zeros([num_blocks * block_size, width], device)).collect();
        // Handed out from the end: block ids of one sequence are not contiguous in memory, as in a long-running
        // server; nothing may assume they are.
        let free = (0..num_blocks).collect();
        Ok(Self { pools, block_size, num_blocks, free })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks not owned by any sequence.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Makes room for `n` more tokens of `seq`, taking blocks from the free list.
    pub fn reserve(&mut self, seq: &mut SequenceCache, n: usize) -> Result<()> {
        let needed = (seq.len + n).div_ceil(self.block_size).saturating_sub(seq.blocks.len());
        if needed > self.free.len() {
            return Err(ModelError::Input {
                message: format!(
                    "KV cache full: {needed} more block(s) needed, {} of {} free",
                    self.free.len(),
                    self.num_blocks
                ),
            });
        }
        for _ in 0..needed {
            seq.blocks.push(self.free.pop().expect("checked above"));
        }
        Ok(())
    }

    /// Gives `seq`'s blocks back.
    pub fn release(&mut self, seq: SequenceCache) {
        self.free.extend(seq.blocks.into_iter().rev());
    }

    fn slot(&self, seq: &SequenceCache, pos: usize) -> usize {
        seq.blocks[pos / self.block_size] * self.block_size + pos % self.block_size
    }

    /// Writes latents `[n, r + rope]` of layer `layer` for positions `start..start + n` (reserved beforehand).
    pub fn write(&mut self, layer: usize, seq: &SequenceCache, start: usize, latents: Tensor<B, 2>) {
        let [n, width] = latents.dims();
        let mut pos = start;
        while pos < start + n {
            // The run of positions that stays inside one block is one contiguous row range of the pool.
            let run = (self.block_size - pos % self.block_size).min(start + n - pos);
            let row = self.slot(seq, pos);
            let values = latents.clone().narrow(0, pos - start, run);
            let pool = self.pools[layer].clone();
            self.pools[layer] = pool.slice_assign([row..row + run, 0..width], values);
            pos += run;
        }
    }

    /// The latents of layer `layer` for positions `0..len`, `[len, r + rope]`.
    pub fn read(&self, layer: usize, seq: &SequenceCache, len: usize) -> Tensor<B, 2> {
        let pool = &self.pools[layer];
        let slots: Vec<i64> = (0..len).map(|p| self.slot(seq, p) as i64).collect();
        let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(slots, [len]), &pool.device());
        pool.clone().select(0, idx)
    }
}

impl<B: Backend> Mla<B> {
    /// Absorbed MLA for `x` `[n, d]`, new tokens at positions `start..start + n` of `seq` (already reserved),
    /// attending causally to everything cached before them and to each other. Appends their latents to layer
    /// `layer` of `cache` and returns `[n, d]`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_absorbed(
        &self,
        x: Tensor<B, 2>,
        rope: &RotaryEmbedding,
        tables: &RopeTables<B>,
        cache: &mut PagedMlaCache<B>,
        layer: usize,
        seq: &SequenceCache,
        start: usize,
    ) -> Tensor<B, 2> {
        let [n, d] = x.dims();
        let (h, nope, rot, vd, r) =
            (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank);
        let device = x.device();

        // [n, H*(nope+rot)] -> [1, H, n, nope+rot]
        let q = self.q.forward(x.clone()).reshape([1, n, h, nope + rot]).swap_dims(1, 2);
        // [H, n, nope]
        let q_nope = q.clone().narrow(3, 0, nope).reshape([h, n, nope]);
        // [H, n, rot]
        let q_pe = rope.apply(q.narrow(3, nope, rot), tables).reshape([h, n, rot]);

        // New latents: normalized c_kv and post-RoPE k_pe, [n, r + rot].
        let kv_a = self.kv_a_proj_with_mqa.forward(x);
        let c_kv = self.kv_a_layernorm.forward(kv_a.clone().narrow(1, 0, r));
        let k_pe = rope.apply(kv_a.narrow(1, r, rot).reshape([1, 1, n, rot]), tables).reshape([n, rot]);
        cache.write(layer, seq, start, Tensor::cat(vec![c_kv, k_pe], 1));

        let total = start + n;
        // [T, r + rot] -> c_kv [1, T, r], k_pe [1, T, rot]
        let latents = cache.read(layer, seq, total);
        let c_all = latents.clone().narrow(1, 0, r).reshape([1, total, r]);
        let pe_all = latents.narrow(1, r, rot).reshape([1, total, rot]);

        // kv_b_proj.weight [H*(nope+vd), r] -> [H, nope+vd, r]
        let w_kv_b = self.kv_b_proj.weight_t.clone().transpose().reshape([h, nope + vd, r]);
        let w_uk = w_kv_b.clone().narrow(1, 0, nope); // [H, nope, r]
        let w_uv = w_kv_b.narrow(1, nope, vd); // [H, vd, r]

        // [H, n, r]
        let q_lat = q_nope.matmul(w_uk);
        // [H, n, T]
        let scores = (q_lat.matmul(c_all.clone().swap_dims(1, 2)) + q_pe.matmul(pe_all.swap_dims(1, 2)))
            .mul_scalar(self.softmax_scale);
        // Query i (position start + i) sees keys t <= start + i.
        let mask: Vec<bool> = (0..n).flat_map(|i| (0..total).map(move |t| t > start + i)).collect();
        let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(mask, [n, total]), &device)
            .unsqueeze::<3>()
            .expand([h, n, total]);
        let probs = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 2);
        // [H, n, r] -> [H, n, vd] -> [n, H*vd]
        let o_lat = probs.matmul(c_all);
        let o = o_lat.matmul(w_uv.swap_dims(1, 2)).swap_dims(0, 1).reshape([n, h * vd]);
        self.o_proj.forward(o).reshape([n, d])
    }
}
