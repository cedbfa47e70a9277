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
//! Batches: the new tokens of several sequences (each at its own position, decode and prefill chunks mixed) run
//! as one flattened row set through every projection. In the attention, the decode steps (one new token each) of
//! a batch run together over their caches gathered into one key-padded, masked tensor; prefill chunks (several
//! new tokens) run one sequence at a time.

use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor, TensorData};

use crate::block_pool::BlockPool;
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
    /// A `[1, width]` tensor that stands in for a pool while it is being written, so the pool's buffer has one
    /// owner and the write happens in place (burn copies the whole tensor when another handle shares it).
    spare: Tensor<B, 2>,
    block_size: usize,
    blocks: BlockPool,
    /// The current step's attention rows and new-token slots on the device (CUDA only): uploaded by the step's
    /// first layer, reused by the others.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    step: Option<StepMeta<B>>,
}

/// A step's attention rows ([`PagedMlaCache::paged_rows`]) and its new tokens' pool rows
/// ([`PagedMlaCache::span_slots`]), each also on the device: every layer of a step reads the same ones, so they
/// are uploaded once a step instead of twice a layer (each upload is a task of its own on CubeCL's server thread).
/// A cached entry is reused only when both are equal to the ones being asked for, so it can never be stale.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct StepMeta<B: Backend> {
    pub(crate) rows: eyrie_quant::cuda::attention::PagedRows,
    pub(crate) slots: Vec<u32>,
    /// `rows.packed()` as i32 bits.
    pub(crate) rows_dev: Tensor<B, 1, Int>,
    /// `slots` as i32 bits.
    pub(crate) slots_dev: Tensor<B, 1, Int>,
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
        // Dense buffers, one layer at a time: on CUDA burn allocates a 2-D tensor pitched (rows padded to 512 bytes:
        // a 576-float latent row takes 2560 bytes, not 2304), and a pitched pool was copied whole, into a dense
        // buffer, by every attention call: every layer of every step, O(pool) whatever the context (bench/REPORT.md).
        let pools = (0..config.num_hidden_layers)
            .map(|_| {
                let pool = Tensor::zeros([num_blocks * block_size, width], device);
                #[cfg(feature = "cuda")]
                let pool = crate::cuda_ops::contiguous(pool);
                pool
            })
            .collect();
        let spare = Tensor::zeros([1, width], device);
        Ok(Self { pools, spare, block_size, blocks: BlockPool::new(num_blocks, block_size), step: None })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks a reservation can take now: not held by any sequence (free, or kept only by the prefix cache).
    pub fn free_blocks(&self) -> usize {
        self.blocks.available()
    }

    /// On CUDA, launches every attention specialisation the model can pick for `heads` heads of latent rank `r`
    /// (`kv_lora_rank`) over this cache's layer-0 pool once (`cuda_ops::warm_up_attention`: reads the pool, writes nothing), so that no attention kernel
    /// compiles mid-serving; the number of launch shapes, or `None` elsewhere.
    ///
    /// # Errors
    /// The launcher's or the device's message.
    #[cfg(feature = "cuda")]
    pub fn warm_up_attention(&self, heads: usize, r: usize) -> Option<Result<usize, String>> {
        crate::cuda_ops::warm_up_attention(self.pools.first()?, heads, r)
    }

    /// Forgets every cached prefix ([`BlockPool::clear_prefix_cache`]): cached blocks become free.
    pub fn clear_prefix_cache(&mut self) {
        self.blocks.clear_prefix_cache();
    }

    /// All blocks.
    pub fn num_blocks(&self) -> usize {
        self.blocks.num_blocks()
    }

    /// The block manager (reference counts, prefix cache, statistics).
    pub fn block_pool(&self) -> &BlockPool {
        &self.blocks
    }

    /// Makes room for `n` more tokens of `seq`, taking blocks from the free list.
    pub fn reserve(&mut self, seq: &mut SequenceCache, n: usize) -> Result<()> {
        self.reserve_batch([(seq, n)])
    }

    /// Makes room for `n` more tokens of each `(seq, n)`, all or nothing: when the free blocks do not cover the
    /// whole batch, nothing is taken and the error says how many were missing.
    pub fn reserve_batch<'s>(&mut self, batch: impl IntoIterator<Item = (&'s mut SequenceCache, usize)>) -> Result<()> {
        let batch: Vec<(&mut SequenceCache, usize)> = batch.into_iter().collect();
        let needed: usize = batch.iter().map(|(seq, n)| self.blocks_needed(seq, *n)).sum();
        let Some(mut taken) = self.blocks.allocate(needed) else {
            return Err(ModelError::Input {
                message: format!(
                    "KV cache full: {needed} more block(s) needed, {} of {} free",
                    self.blocks.available(),
                    self.blocks.num_blocks()
                ),
            });
        };
        for (seq, n) in batch {
            let k = self.blocks_needed(seq, n);
            seq.blocks.extend(taken.drain(..k));
        }
        Ok(())
    }

    fn blocks_needed(&self, seq: &SequenceCache, n: usize) -> usize {
        (seq.len + n).div_ceil(self.block_size).saturating_sub(seq.blocks.len())
    }

    /// Gives `seq`'s blocks back (blocks registered in the prefix cache stay cached until evicted).
    pub fn release(&mut self, seq: SequenceCache) {
        for b in seq.blocks.into_iter().rev() {
            self.blocks.release(b);
        }
    }

    /// Drops the positions `len..` of `seq` (speculative-decoding rollback): blocks wholly past the new end go back
    /// to the pool. Fails, changing nothing, when `len` is beyond the sequence or the cut falls inside a block shared
    /// through the prefix cache (whose contents must not change).
    pub fn truncate(&mut self, seq: &mut SequenceCache, len: usize) -> Result<()> {
        if len > seq.len {
            return Err(ModelError::Input {
                message: format!("cannot truncate a sequence of {} tokens to {len}", seq.len),
            });
        }
        let keep = len.div_ceil(self.block_size);
        if !len.is_multiple_of(self.block_size) && self.blocks.is_shared(seq.blocks[keep - 1]) {
            return Err(ModelError::Input {
                message: format!("cannot truncate to {len}: position {len} lies in a block shared by the prefix cache"),
            });
        }
        for b in seq.blocks.drain(keep..).rev() {
            self.blocks.release(b);
        }
        seq.len = len;
        Ok(())
    }

    /// Starts a sequence for `prompt` on the longest cached prefix of it (whole blocks, leaving at least the last
    /// prompt token to compute so that the step that finishes the prompt yields its logits). The returned sequence
    /// holds the shared blocks and reports their tokens as cached; feed it `prompt[seq.len..]`.
    pub fn start_with_prefix(&mut self, prompt: &[u32]) -> SequenceCache {
        let blocks = self.blocks.match_prefix(prompt, prompt.len().saturating_sub(1));
        let len = blocks.len() * self.block_size;
        SequenceCache { blocks, len }
    }

    /// Offers the full blocks of `seq` to later prompts; `tokens` are the sequence's tokens (at least its first
    /// `seq.len`; only those positions count).
    pub fn register_prefix(&mut self, seq: &SequenceCache, tokens: &[u32]) {
        let n = seq.len.min(tokens.len());
        self.blocks.register(&seq.blocks, &tokens[..n]);
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
            // Taken out (not cloned), so `slice_assign` owns the only handle and writes in place.
            let pool = std::mem::replace(&mut self.pools[layer], self.spare.clone());
            self.pools[layer] = pool.slice_assign([row..row + run, 0..width], values);
            pos += run;
        }
    }

    /// Where each new token of `spans` reads (for the attention kernel): its sequence's blocks and the positions
    /// it sees, `start + i + 1` for the span's `i`-th new token.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn paged_rows(&self, spans: &[SeqSpan<'_>]) -> eyrie_quant::cuda::attention::PagedRows {
        let max_blocks = spans.iter().map(|s| (s.start + s.len).div_ceil(self.block_size)).max().unwrap_or(1).max(1);
        let rows: usize = spans.iter().map(|s| s.len).sum();
        let (mut row_seq, mut row_len) = (vec![0u32; rows], vec![0u32; rows]);
        let mut tables = Vec::with_capacity(spans.len() * max_blocks);
        for (i, span) in spans.iter().enumerate() {
            for j in 0..span.len {
                row_seq[span.row + j] = i as u32;
                row_len[span.row + j] = (span.start + j + 1) as u32;
            }
            let used = (span.start + span.len).div_ceil(self.block_size);
            tables.extend(span.seq.blocks[..used].iter().map(|&b| b as u32));
            tables.extend(std::iter::repeat_n(0, max_blocks - used));
        }
        eyrie_quant::cuda::attention::PagedRows { row_seq, row_len, tables, max_blocks, block_size: self.block_size }
    }

    /// The step's [`StepMeta`] for `spans` covering `rows` new rows, uploaded only when it differs from the last
    /// one asked for; `None` when the spans do not cover every row exactly once.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn step_meta(&mut self, spans: &[SeqSpan<'_>], rows: usize) -> Option<StepMeta<B>> {
        let paged = self.paged_rows(spans);
        let slots = self.span_slots(spans, rows)?;
        if let Some(step) = &self.step
            && step.slots == slots
            && step.rows == paged
        {
            return Some(step.clone());
        }
        let device = self.spare.device();
        let upload = |v: &[u32]| {
            let bits: Vec<i32> = v.iter().map(|&x| x as i32).collect();
            Tensor::<B, 1, Int>::from_data(TensorData::new(bits, [v.len()]), &device)
        };
        let step = StepMeta { rows_dev: upload(&paged.packed()), slots_dev: upload(&slots), rows: paged, slots };
        self.step = Some(step.clone());
        Some(step)
    }

    /// Writes the new latents `[N, r + rope]` of every span (rows `span.row..span.row + span.len`) into layer
    /// `layer`: on CUDA one in-place scatter launch for all of them, elsewhere [`Self::write`] per span.
    pub fn write_spans(&mut self, layer: usize, spans: &[SeqSpan<'_>], latents: Tensor<B, 2>) {
        #[cfg(feature = "cuda")]
        if let Some(slots) = self.span_slots(spans, latents.dims()[0])
            && crate::cuda_ops::write_rows(&self.pools[layer], latents.clone(), &slots)
        {
            return;
        }
        for span in spans {
            self.write(layer, span.seq, span.start, latents.clone().narrow(0, span.row, span.len));
        }
    }

    /// The pool row of each of the `rows` rows of a step's spans, or `None` when the spans do not cover every row
    /// exactly once.
    pub fn span_slots(&self, spans: &[SeqSpan<'_>], rows: usize) -> Option<Vec<u32>> {
        let mut slots = vec![0u32; rows];
        let mut covered = 0;
        for span in spans {
            for j in 0..span.len {
                *slots.get_mut(span.row + j)? = self.slot(span.seq, span.start + j) as u32;
                covered += 1;
            }
        }
        (covered == rows).then_some(slots)
    }

    /// Writes a step's new latents from the `kv_a_proj_with_mqa` output `kv_a` `[N, r + rope]`: `norm` (the
    /// `kv_a_layernorm`) of the first `r` columns, RoPE of the rest, into layer `layer` at the spans' positions. On
    /// CUDA one launch (`cuda_ops::mla_latent_write`); elsewhere the norm, RoPE, a concatenation and
    /// [`Self::write_spans`].
    /// `step` (from [`Self::step_meta`]): the step's slots already on the device, or `None` (uploaded here).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write_new_latents(
        &mut self,
        layer: usize,
        spans: &[SeqSpan<'_>],
        kv_a: Tensor<B, 2>,
        norm: &crate::rms_norm::RmsNorm<B>,
        rope: &RotaryEmbedding,
        tables: &RopeTables<B>,
        step: Option<&StepMeta<B>>,
    ) {
        let width = kv_a.dims()[1];
        let r = norm.weight.dims()[0];
        #[cfg(feature = "cuda")]
        {
            let slots = match step {
                Some(step) => Some((step.slots.clone(), Some(&step.slots_dev))),
                None => self.span_slots(spans, kv_a.dims()[0]).map(|s| (s, None)),
            };
            if let Some((slots, slots_dev)) = slots
                && crate::cuda_ops::mla_latent_write(
                    &self.pools[layer],
                    &kv_a,
                    &norm.weight,
                    norm.eps,
                    &tables.cos,
                    &tables.sin,
                    rope.interleave,
                    &slots,
                    slots_dev,
                )
                .is_ok()
            {
                return;
            }
        }
        #[cfg(not(feature = "cuda"))]
        let _ = step;
        let c_kv = norm.forward(kv_a.clone().narrow(1, 0, r));
        let k_pe = rope.apply_rows(kv_a, r, width - r, 1, tables);
        self.write_spans(layer, spans, Tensor::cat(vec![c_kv, k_pe], 1));
    }

    /// The latents of layer `layer` for positions `0..len`, `[len, r + rope]`.
    pub fn read(&self, layer: usize, seq: &SequenceCache, len: usize) -> Tensor<B, 2> {
        let pool = &self.pools[layer];
        let slots: Vec<i64> = (0..len).map(|p| self.slot(seq, p) as i64).collect();
        let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(slots, [len]), &pool.device());
        pool.clone().select(0, idx)
    }
}

/// Where one sequence's new tokens sit in a flattened batch: rows `row..row + len` of the batch are its positions
/// `start..start + len` (already reserved in `seq`, which still reports the old length `start`).
#[derive(Debug, Clone, Copy)]
pub struct SeqSpan<'a> {
    /// The sequence's page table.
    pub seq: &'a SequenceCache,
    /// First row of the sequence in the flattened batch.
    pub row: usize,
    /// Position of the first new token (= tokens cached before this step).
    pub start: usize,
    /// New tokens of this sequence.
    pub len: usize,
}

/// The spans of fewer than `min` new rows, renumbered from row 0 in their order, and the step rows they hold
/// (the first entries of the order in which `Mla::attend_prefill_mha` computes the rows: the short spans' rows
/// together, then each long span's).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn short_spans<'a>(spans: &[SeqSpan<'a>], min: usize) -> (Vec<SeqSpan<'a>>, Vec<usize>) {
    let mut order = Vec::new();
    let mut short = Vec::new();
    for span in spans.iter().filter(|span| span.len < min) {
        short.push(SeqSpan { row: order.len(), ..*span });
        order.extend(span.row..span.row + span.len);
    }
    (short, order)
}

/// `back[row]` = the index at which `order` holds `row` (`order` a permutation of `0..order.len()`): the gather
/// that puts rows computed in `order` back in step order.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn inverse(order: &[usize]) -> Vec<usize> {
    let mut back = vec![0usize; order.len()];
    for (i, &row) in order.iter().enumerate() {
        back[row] = i;
    }
    back
}

impl<B: Backend> Mla<B> {
    /// Absorbed MLA for `x` `[N, d]`, the new tokens of several sequences flattened (see [`SeqSpan`]); `tables`
    /// holds each row's own position (`N` rows). Every new token attends causally to its own sequence only: all
    /// that sequence's cached tokens and the new ones before it. Appends the new latents to layer `layer` of
    /// `cache` and returns `[N, d]`. Projections run once over all `N` rows; see the module docs for the
    /// attention.
    pub fn forward_absorbed(
        &self,
        x: Tensor<B, 2>,
        rope: &RotaryEmbedding,
        tables: &RopeTables<B>,
        cache: &mut PagedMlaCache<B>,
        layer: usize,
        spans: &[SeqSpan<'_>],
    ) -> Tensor<B, 2> {
        let [n, d] = x.dims();
        let (h, nope, rot, vd, r) =
            (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank);
        let device = x.device();

        // [N, H*(nope+rot)] and [N, r + rot] (the new latents before their norm and RoPE).
        let (q_rows, kv_a) = self.project(x);

        // New latents: normalized c_kv and post-RoPE k_pe, [N, r + rot], into the cache.
        // On CUDA the step's rows and slots go to the device once a step (the first layer's call uploads them).
        #[cfg(feature = "cuda")]
        let step = if crate::cuda_ops::is_cuda::<B>() { cache.step_meta(spans, n) } else { None };
        #[cfg(not(feature = "cuda"))]
        let step: Option<StepMeta<B>> = None;
        cache.write_new_latents(layer, spans, kv_a, &self.kv_a_layernorm, rope, tables, step.as_ref());

        // On CUDA with the MHA form on (`cuda_ops::mha_prefill_min_rows`), prefill chunks that long attend in the
        // MHA form (the other rows of the step in the absorbed form).
        #[cfg(feature = "cuda")]
        if let Some(o) = self.attend_prefill_mha(&q_rows, rope, tables, cache, layer, spans) {
            return self.o_proj.forward(o).reshape([n, d]);
        }

        // On CUDA: absorption, RoPE, attention and the value absorption in three launches, f32-exact with the BF16
        // kv_b_proj (no cast of it, no TF32 matmul).
        #[cfg(feature = "cuda")]
        let paged = match &step {
            Some(step) => step.rows.clone(),
            None => cache.paged_rows(spans),
        };
        #[cfg(feature = "cuda")]
        if let Some(o) = crate::cuda_ops::mla_absorbed(
            &q_rows,
            &self.kv_b_proj.weight,
            &tables.cos,
            &tables.sin,
            rope.interleave,
            &cache.pools[layer],
            &paged,
            step.as_ref().map(|s| &s.rows_dev),
            self.softmax_scale,
            crate::cuda_ops::MlaDims { heads: h, nope, rot, vd, r },
        ) {
            return self.o_proj.forward(o).reshape([n, d]);
        }

        // [N, H*(nope+rot)] -> [1, H, N, nope+rot]
        let q = q_rows.clone().reshape([1, n, h, nope + rot]).swap_dims(1, 2);
        // [H, N, nope]
        let q_nope = q.narrow(3, 0, nope).reshape([h, n, nope]);
        // [N*H, rot] -> [H, N, rot]
        let q_pe = rope
            .apply_rows(q_rows.reshape([n * h, nope + rot]), nope, rot, h, tables)
            .reshape([n, h, rot])
            .swap_dims(0, 1);

        // kv_b_proj.weight [H*(nope+vd), r] -> [H, nope+vd, r]
        let w_kv_b = self.kv_b_proj.weight.clone().cast(burn::tensor::FloatDType::F32).reshape([h, nope + vd, r]);
        let w_uk = w_kv_b.clone().narrow(1, 0, nope); // [H, nope, r]
        let w_uv = w_kv_b.narrow(1, nope, vd); // [H, vd, r]

        // [H, N, r]
        let q_lat = q_nope.matmul(w_uk);
        #[cfg(feature = "cuda")]
        if let Some(o_lat) = crate::cuda_ops::mla_attention(
            &q_lat,
            &q_pe,
            &cache.pools[layer],
            &cache.paged_rows(spans),
            self.softmax_scale,
        ) {
            // [H, N, r] -> [H, N, vd] -> [N, H*vd]
            let o = o_lat.matmul(w_uv.swap_dims(1, 2)).swap_dims(0, 1).reshape([n, h * vd]);
            return self.o_proj.forward(o).reshape([n, d]);
        }
        // [H, N, r]: decode steps (one new token) of two or more sequences together, each other span alone; the
        // parts come back in group order and are put back in row order.
        let decodes: Vec<&SeqSpan<'_>> = spans.iter().filter(|span| span.len == 1).collect();
        let batch_decodes = decodes.len() > 1;
        let mut order: Vec<usize> = Vec::with_capacity(n);
        let mut parts: Vec<Tensor<B, 3>> = Vec::with_capacity(spans.len());
        if batch_decodes {
            let rows: Vec<i64> = decodes.iter().map(|span| span.row as i64).collect();
            let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [decodes.len()]), &device);
            parts.push(self.attend_decodes(
                q_lat.clone().select(1, rows.clone()),
                q_pe.clone().select(1, rows),
                cache,
                layer,
                &decodes,
                &device,
            ));
            order.extend(decodes.iter().map(|span| span.row));
        }
        for span in spans.iter().filter(|span| !batch_decodes || span.len > 1) {
            let q_lat = q_lat.clone().narrow(1, span.row, span.len);
            let q_pe = q_pe.clone().narrow(1, span.row, span.len);
            parts.push(self.attend_cached(q_lat, q_pe, cache, layer, span, &device));
            order.extend(span.row..span.row + span.len);
        }
        let o_lat = Tensor::cat(parts, 1);
        let o_lat = if order.iter().enumerate().all(|(i, &row)| i == row) {
            o_lat
        } else {
            // order[i] = the row held at index i; gather index `back[row]` = where that row is.
            let mut back = vec![0i64; n];
            for (i, &row) in order.iter().enumerate() {
                back[row] = i as i64;
            }
            o_lat.select(1, Tensor::<B, 1, Int>::from_data(TensorData::new(back, [n]), &device))
        };
        // [H, N, r] -> [H, N, vd] -> [N, H*vd]
        let o = o_lat.matmul(w_uv.swap_dims(1, 2)).swap_dims(0, 1).reshape([n, h * vd]);
        self.o_proj.forward(o).reshape([n, d])
    }

    /// On CUDA, when the MHA form is on and a span of the step has [`crate::cuda_ops::mha_prefill_min_rows`] new
    /// rows or more: each such
    /// span's attention in the MHA form (`cuda_ops::mla_mha_prefill`: its latents expanded through `kv_b_proj`,
    /// 3.4x fewer multiply-adds a row and key than the absorbed form), the other rows of the step together in the
    /// absorbed form, put back in row order -> `[N, H vd]` (the input of `o_proj`). `None` when no span is that
    /// long or a kernel refused its inputs (the caller runs the absorbed form for every row).
    #[cfg(feature = "cuda")]
    fn attend_prefill_mha(
        &self,
        q_rows: &Tensor<B, 2>,
        rope: &RotaryEmbedding,
        tables: &RopeTables<B>,
        cache: &PagedMlaCache<B>,
        layer: usize,
        spans: &[SeqSpan<'_>],
    ) -> Option<Tensor<B, 2>> {
        let min = crate::cuda_ops::mha_prefill_min_rows()?;
        if !crate::cuda_ops::is_cuda::<B>() || !spans.iter().any(|span| span.len >= min) {
            return None;
        }
        let (h, nope, rot, vd, r) =
            (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank);
        let dims = crate::cuda_ops::MlaDims { heads: h, nope, rot, vd, r };
        let n = q_rows.dims()[0];
        let device = q_rows.device();
        let index = |rows: &[usize]| {
            let v: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
            Tensor::<B, 1, Int>::from_data(TensorData::new(v, [rows.len()]), &device)
        };
        let (short, mut order) = short_spans(spans, min);
        let mut parts: Vec<Tensor<B, 2>> = Vec::with_capacity(spans.len());
        if !short.is_empty() {
            let idx = index(&order);
            let o = crate::cuda_ops::mla_absorbed(
                &q_rows.clone().select(0, idx.clone()),
                &self.kv_b_proj.weight,
                &tables.cos.clone().select(0, idx.clone()),
                &tables.sin.clone().select(0, idx),
                rope.interleave,
                &cache.pools[layer],
                &cache.paged_rows(&short),
                None,
                self.softmax_scale,
                dims,
            )?;
            parts.push(o);
        }
        for span in spans.iter().filter(|span| span.len >= min) {
            let o = crate::cuda_ops::mla_mha_prefill(
                &q_rows.clone().narrow(0, span.row, span.len),
                &tables.cos.clone().narrow(0, span.row, span.len),
                &tables.sin.clone().narrow(0, span.row, span.len),
                rope.interleave,
                &cache.read(layer, span.seq, span.start + span.len),
                |c| self.kv_b_proj.forward(c),
                span.start,
                self.softmax_scale,
                dims,
                0,
            )?;
            parts.push(o);
            order.extend(span.row..span.row + span.len);
        }
        if order.len() != n {
            return None;
        }
        let o = Tensor::cat(parts, 0);
        if order.iter().enumerate().all(|(i, &row)| i == row) {
            return Some(o);
        }
        Some(o.select(0, index(&inverse(&order))))
    }

    /// Decode steps of several sequences (one new token each) as one key-padded batched attention: `q_lat`
    /// `[H, S, r]` and `q_pe` `[H, S, rot]`, one query per span, over each sequence's cached latents (gathered into
    /// `[S, T_max, r + rot]`, positions past a sequence's length masked) -> `o_lat` `[H, S, r]`.
    fn attend_decodes(
        &self,
        q_lat: Tensor<B, 3>,
        q_pe: Tensor<B, 3>,
        cache: &PagedMlaCache<B>,
        layer: usize,
        spans: &[&SeqSpan<'_>],
        device: &B::Device,
    ) -> Tensor<B, 3> {
        let (h, rot, r) = (self.num_heads, self.qk_rope_head_dim, self.kv_lora_rank);
        let s = spans.len();
        let t_max = spans.iter().map(|span| span.start + 1).max().unwrap_or(0);
        // Padding reads slot 0 (any valid row); its scores are masked.
        let slots: Vec<i64> = spans
            .iter()
            .flat_map(|span| (0..t_max).map(move |p| if p <= span.start { cache.slot(span.seq, p) as i64 } else { 0 }))
            .collect();
        let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(slots, [s * t_max]), device);
        // [S*T, r + rot] -> c_kv [S, T, r], k_pe [S, T, rot]
        let latents = cache.pools[layer].clone().select(0, idx).reshape([s, t_max, r + rot]);
        let c_all = latents.clone().narrow(2, 0, r);
        let pe_all = latents.narrow(2, r, rot);
        // [H, S, *] -> [S, H, *]; scores [S, H, T]
        let scores = (q_lat.swap_dims(0, 1).matmul(c_all.clone().swap_dims(1, 2))
            + q_pe.swap_dims(0, 1).matmul(pe_all.swap_dims(1, 2)))
        .mul_scalar(self.softmax_scale);
        // The query of span i (position start_i) sees keys t <= start_i.
        let mask: Vec<bool> = spans.iter().flat_map(|span| (0..t_max).map(move |t| t > span.start)).collect();
        let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(mask, [s, t_max]), device)
            .unsqueeze_dim::<3>(1)
            .expand([s, h, t_max]);
        let probs = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 2);
        // [S, H, r] -> [H, S, r]
        probs.matmul(c_all).swap_dims(0, 1)
    }

    /// One sequence's absorbed attention: `q_lat` `[H, n, r]` and `q_pe` `[H, n, rot]` of its `n` new tokens over
    /// its cached latents (the new ones included) -> `o_lat` `[H, n, r]`.
    fn attend_cached(
        &self,
        q_lat: Tensor<B, 3>,
        q_pe: Tensor<B, 3>,
        cache: &PagedMlaCache<B>,
        layer: usize,
        span: &SeqSpan<'_>,
        device: &B::Device,
    ) -> Tensor<B, 3> {
        let (h, rot, r) = (self.num_heads, self.qk_rope_head_dim, self.kv_lora_rank);
        let (n, start) = (span.len, span.start);
        let total = start + n;
        // [T, r + rot] -> c_kv [1, T, r], k_pe [1, T, rot]
        let latents = cache.read(layer, span.seq, total);
        let c_all = latents.clone().narrow(1, 0, r).reshape([1, total, r]);
        let pe_all = latents.narrow(1, r, rot).reshape([1, total, rot]);
        // [H, n, T]
        let scores = (q_lat.matmul(c_all.clone().swap_dims(1, 2)) + q_pe.matmul(pe_all.swap_dims(1, 2)))
            .mul_scalar(self.softmax_scale);
        // Query i (position start + i) sees keys t <= start + i.
        let mask: Vec<bool> = (0..n).flat_map(|i| (0..total).map(move |t| t > start + i)).collect();
        let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(mask, [n, total]), device)
            .unsqueeze::<3>()
            .expand([h, n, total]);
        let probs = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 2);
        // [H, n, r]
        probs.matmul(c_all)
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{Tensor, TensorData};
    use eyrie_quant::cuda::attention::mla_attention_reference;

    use super::*;
    use crate::linear::Linear;
    use crate::mla::QueryProjection;

    /// A one-layer cache on the CPU backend over `pool` `[num_blocks * bs, width]`.
    pub(super) fn flex_cache(pool: Tensor<Flex, 2>, bs: usize, num_blocks: usize) -> PagedMlaCache<Flex> {
        let width = pool.dims()[1];
        let spare = Tensor::zeros([1, width], &pool.device());
        PagedMlaCache { pools: vec![pool], spare, step: None, block_size: bs, blocks: BlockPool::new(num_blocks, bs) }
    }

    /// The CUDA attention kernel computes `mla_attention_reference` over `paged_rows`: that must be what the burn
    /// path computes (decode rows batched, a prefill chunk alone), page tables and causal limits included.
    #[test]
    fn paged_rows_and_the_kernel_reference_match_the_burn_attention() {
        let dev = Default::default();
        let (h, r, rot, bs, num_blocks) = (3usize, 8usize, 4usize, 4usize, 12usize);
        let width = r + rot;
        let mut st = eyrie_quant::cuda::SplitMix64::new(7);
        let pool = st.signed(num_blocks * bs * width);
        let cache = flex_cache(
            Tensor::from_data(TensorData::new(pool.clone(), [num_blocks * bs, width]), &dev),
            bs,
            num_blocks,
        );
        // Blocks already reserved for the new tokens; `len` is still the old length.
        let seqs = [
            SequenceCache { blocks: vec![7, 2], len: 5 },
            SequenceCache { blocks: vec![0, 5, 9], len: 8 },
            SequenceCache { blocks: vec![11, 3], len: 5 },
        ];
        let spans = [
            SeqSpan { seq: &seqs[0], row: 0, start: 5, len: 1 },
            SeqSpan { seq: &seqs[1], row: 1, start: 8, len: 1 },
            SeqSpan { seq: &seqs[2], row: 2, start: 5, len: 3 },
        ];
        let n = 5;
        let zeros = |o, i| Linear::<Flex>::from_weight(Tensor::zeros([o, i], &dev));
        let mla = Mla::<Flex> {
            q: QueryProjection::Plain { q_proj: zeros(1, 1) },
            kv_a_proj_with_mqa: zeros(1, 1),
            kv_a_layernorm: crate::rms_norm::RmsNorm::new(Tensor::ones([r], &dev), 1e-6),
            kv_b_proj: zeros(1, 1),
            o_proj: zeros(1, 1),
            num_heads: h,
            qk_nope_head_dim: 2,
            qk_rope_head_dim: rot,
            v_head_dim: 2,
            kv_lora_rank: r,
            softmax_scale: 0.37,
        };
        let q_lat = st.signed(h * n * r);
        let q_pe = st.signed(h * n * rot);
        let q_lat_t = Tensor::<Flex, 3>::from_data(TensorData::new(q_lat.clone(), [h, n, r]), &dev);
        let q_pe_t = Tensor::<Flex, 3>::from_data(TensorData::new(q_pe.clone(), [h, n, rot]), &dev);
        // burn: the two decodes batched (rows 0, 1), the chunk alone (rows 2..5) -> [H, N, r].
        let decodes = [&spans[0], &spans[1]];
        let a = mla.attend_decodes(
            q_lat_t.clone().narrow(1, 0, 2),
            q_pe_t.clone().narrow(1, 0, 2),
            &cache,
            0,
            &decodes,
            &dev,
        );
        let b = mla.attend_cached(q_lat_t.narrow(1, 2, 3), q_pe_t.narrow(1, 2, 3), &cache, 0, &spans[2], &dev);
        let burn_out: Vec<f32> = Tensor::cat(vec![a, b], 1).into_data().to_vec().unwrap();

        let rows = cache.paged_rows(&spans);
        assert_eq!(rows.row_seq, vec![0, 1, 2, 2, 2]);
        assert_eq!(rows.row_len, vec![6, 9, 6, 7, 8]);
        // q as the kernel takes it: [N, H, r + rot].
        let mut q = vec![0.0f32; n * h * width];
        for (hh, i) in (0..h).flat_map(|hh| (0..n).map(move |i| (hh, i))) {
            q[(i * h + hh) * width..][..r].copy_from_slice(&q_lat[(hh * n + i) * r..][..r]);
            q[(i * h + hh) * width + r..][..rot].copy_from_slice(&q_pe[(hh * n + i) * rot..][..rot]);
        }
        let want = mla_attention_reference(&q, &pool, &rows, h, r, rot, 0.37);
        for (hh, i, c) in (0..h).flat_map(|hh| (0..n).flat_map(move |i| (0..r).map(move |c| (hh, i, c)))) {
            let (got, exp) = (burn_out[(hh * n + i) * r + c], want[(i * h + hh) * r + c]);
            assert!((got - exp).abs() < 1e-5, "head {hh} row {i} dim {c}: burn {got} vs reference {exp}");
        }
    }

    /// A step's uploaded rows and slots (`step_meta`) hold exactly `paged_rows` / `span_slots` of the spans asked
    /// for: every layer of a step gets the same upload, and the next step (positions moved on, or other sequences)
    /// never gets the previous one's.
    /// A step of a decode row, a long prefill chunk, another decode row and a short chunk: the short spans are
    /// renumbered from 0 in order, the order lists their rows and then the long span's, and the inverse gather
    /// puts every row back in place.
    #[test]
    fn short_spans_and_their_order_put_rows_back() {
        let seq = SequenceCache { blocks: vec![0, 1, 2], len: 0 };
        let spans = [
            SeqSpan { seq: &seq, row: 0, start: 10, len: 1 },
            SeqSpan { seq: &seq, row: 1, start: 0, len: 200 },
            SeqSpan { seq: &seq, row: 201, start: 5, len: 1 },
            SeqSpan { seq: &seq, row: 202, start: 3, len: 7 },
        ];
        let (short, mut order) = short_spans(&spans, 64);
        assert_eq!(
            short.iter().map(|s| (s.row, s.start, s.len)).collect::<Vec<_>>(),
            [(0, 10, 1), (1, 5, 1), (2, 3, 7)]
        );
        assert_eq!(order[..9], [0, 201, 202, 203, 204, 205, 206, 207, 208]);
        order.extend(1..201);
        let back = inverse(&order);
        for (row, &at) in back.iter().enumerate() {
            assert_eq!(order[at], row);
        }
        assert_eq!(short_spans(&spans, 1).0.len(), 0);
    }

    #[test]
    fn step_meta_is_the_spans_own_and_never_stale() {
        let dev = Default::default();
        let (bs, num_blocks, width) = (4usize, 12usize, 6usize);
        let mut cache = flex_cache(Tensor::zeros([num_blocks * bs, width], &dev), bs, num_blocks);
        let ints = |t: &Tensor<Flex, 1, Int>| -> Vec<u32> {
            t.clone().into_data().convert::<i64>().to_vec::<i64>().unwrap().iter().map(|&v| v as u32).collect()
        };
        let check = |cache: &mut PagedMlaCache<Flex>, spans: &[SeqSpan<'_>], rows: usize| {
            let step = cache.step_meta(spans, rows).expect("spans cover every row");
            let want_rows = cache.paged_rows(spans);
            let want_slots = cache.span_slots(spans, rows).unwrap();
            assert_eq!(step.rows, want_rows);
            assert_eq!(step.slots, want_slots);
            assert_eq!(ints(&step.rows_dev), want_rows.packed());
            assert_eq!(ints(&step.slots_dev), want_slots);
            step
        };
        let seqs = [SequenceCache { blocks: vec![7, 2], len: 5 }, SequenceCache { blocks: vec![0, 5, 9], len: 8 }];
        let step_a =
            [SeqSpan { seq: &seqs[0], row: 0, start: 5, len: 1 }, SeqSpan { seq: &seqs[1], row: 1, start: 8, len: 1 }];
        let first = check(&mut cache, &step_a, 2);
        // Another layer of the same step: the same content.
        let again = check(&mut cache, &step_a, 2);
        assert_eq!(ints(&again.rows_dev), ints(&first.rows_dev));
        // The next step: one position further in each sequence.
        let step_b =
            [SeqSpan { seq: &seqs[0], row: 0, start: 6, len: 1 }, SeqSpan { seq: &seqs[1], row: 1, start: 9, len: 1 }];
        let next = check(&mut cache, &step_b, 2);
        assert_ne!(next.slots, first.slots);
        // Same lengths, other page tables (another pair of sequences at the same positions).
        let others = [SequenceCache { blocks: vec![3, 11], len: 5 }, SequenceCache { blocks: vec![1, 4, 6], len: 8 }];
        let step_c = [
            SeqSpan { seq: &others[0], row: 0, start: 6, len: 1 },
            SeqSpan { seq: &others[1], row: 1, start: 9, len: 1 },
        ];
        let moved = check(&mut cache, &step_c, 2);
        assert_ne!(moved.rows.tables, next.rows.tables);
        // Spans that leave a row uncovered have no step meta.
        assert!(cache.step_meta(&step_c[..1], 2).is_none());
    }
}
#[cfg(test)]
mod in_place {
    use super::tests::flex_cache;
    use super::*;
    use burn::backend::Flex;

    /// The address of `t`'s buffer on burn's CPU backend.
    fn buffer(t: &Tensor<Flex, 2>) -> usize {
        let prim = t.clone().into_primitive().tensor();
        prim.storage::<f32>().as_ptr() as usize
    }

    /// On the CPU backend a cache write lands in the pool's own buffer: burn-flex 0.21 copied the whole pool at
    /// every `slice_assign` (its copy-on-write saw two owners), 71% of a CPU decode step; the vendored burn-flex
    /// (Cargo.toml's `[patch.crates-io]`) writes in place. A copy would show as a new buffer address.
    #[test]
    fn cache_writes_do_not_copy_the_pool() {
        let dev = Default::default();
        let (bs, num_blocks, width) = (4usize, 8usize, 6usize);
        let mut cache = flex_cache(Tensor::zeros([num_blocks * bs, width], &dev), bs, num_blocks);
        let seq = SequenceCache { blocks: vec![3, 1], len: 0 };
        // The first write may move the pool out of a shared zero buffer; every later one must not move it.
        cache.write(0, &seq, 0, Tensor::ones([1, width], &dev));
        // One row a write, each one `slice_assign` (two copies in a row could land back at the first address).
        for pos in 1..6 {
            let before = buffer(&cache.pools[0]);
            let row = (pos * width..(pos + 1) * width).map(|v| v as f32).collect::<Vec<_>>();
            cache.write(0, &seq, pos, Tensor::from_data(TensorData::new(row, [1, width]), &dev));
            assert_eq!(buffer(&cache.pools[0]), before, "write at position {pos}: the pool was copied");
        }
        // And the values are where the page table says (positions 1..6: block 3 rows 1..4, block 1 rows 0..2).
        let pool = cache.pools[0].clone().into_data().to_vec::<f32>().unwrap();
        assert_eq!(pool[(3 * bs) * width], 1.0);
        assert_eq!(pool[(3 * bs + 1) * width], width as f32);
        assert_eq!(pool[(bs + 1) * width + 2], (5 * width + 2) as f32);
    }
}
