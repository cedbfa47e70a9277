//! Tree verification for speculative decoding (SpecInfer, Miao et al. arXiv:2305.09781; EAGLE-2, Li et al.
//! arXiv:2406.16858): one target forward over a token tree per sequence, on the absorbed MLA over the paged cache,
//! with a tree attention mask; then the accepted root-to-node path is compacted into consecutive cache positions.
//!
//! A tree of `T` nodes in topological order (node 0 = the root: the sequence's last token, not yet run; `parents[i]
//! < i` for the others) runs at RoPE positions `start + depth(i)` (`start` = tokens cached before) and writes its
//! latents to cache positions `start..start + T` in node order. Node `i` attends to every cached token and to its
//! own ancestors and itself among the nodes: siblings and cousins never see each other, so each root-to-node path
//! computes exactly what a chain forward of that path would. [`DeepseekV3::keep_tree_path`] then moves the
//! accepted path's latents to positions `start..start + path.len()` (the post-RoPE `k_pe` was computed at the
//! node's depth, which is its position on the path) and gives back the rest.

use burn::tensor::activation::softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor, TensorData};

use crate::deepseek_v3::{DeepseekV3, FeedForward};
use crate::error::{ModelError, Result};
use crate::kv_cache::{PagedMlaCache, SequenceCache};
use crate::mla::Mla;
use crate::rope::{RopeTables, RotaryEmbedding};

/// One sequence's token tree in a [`DeepseekV3::forward_tree_capture`] batch.
#[derive(Debug)]
pub struct TreeEntry<'a> {
    /// The sequence; it grows by `tokens.len()` (until [`DeepseekV3::keep_tree_path`] cuts it back).
    pub seq: &'a mut SequenceCache,
    /// Node tokens in topological order; node 0 is the root.
    pub tokens: &'a [u32],
    /// `parents[i] < i` for `i >= 1`; `parents[0]` is ignored.
    pub parents: &'a [usize],
}

/// Where one tree sits in the flattened batch.
struct TreeSpan<'a> {
    seq: &'a SequenceCache,
    row: usize,
    start: usize,
    /// `ancestor[i * T + j]`: node `j` is node `i` or one of its ancestors.
    ancestor: Vec<bool>,
    len: usize,
}

impl<B: Backend> DeepseekV3<B> {
    /// Runs each entry's token tree (see the module docs) in one step over `cache` and returns logits for every node
    /// `[total_nodes, vocab]` (node after node, tree after tree in batch order; row `i` of a tree is the target's
    /// distribution of the token after node `i`'s path) and the hidden states at `capture` ids for every node, as
    /// [`DeepseekV3::forward_batch_capture`] numbers them. Fails, changing nothing, on an empty batch or tree, a
    /// malformed parent list, a token outside the vocabulary, an out-of-range capture id or a full cache.
    pub fn forward_tree_capture(
        &self,
        batch: &mut [TreeEntry<'_>],
        cache: &mut PagedMlaCache<B>,
        capture: &[usize],
        device: &B::Device,
    ) -> Result<(Tensor<B, 2>, Vec<Tensor<B, 2>>)> {
        let num_layers = self.layers.len();
        if batch.is_empty() || batch.iter().any(|e| e.tokens.is_empty()) {
            return Err(ModelError::Input { message: "a tree step needs at least one node per sequence".into() });
        }
        for e in batch.iter() {
            if e.parents.len() != e.tokens.len() || (1..e.tokens.len()).any(|i| e.parents[i] >= i) {
                return Err(ModelError::Input {
                    message: "tree parents must list one parent per node, each before its child".into(),
                });
            }
        }
        if let Some(&bad) = capture.iter().find(|&&i| i > num_layers) {
            return Err(ModelError::Input {
                message: format!("hidden-state capture layer {bad} is out of range: valid ids are 0..={num_layers}"),
            });
        }
        let flat: Vec<u32> = batch.iter().flat_map(|e| e.tokens.iter().copied()).collect();
        let ids = self.token_tensor(&[&flat], device)?;
        cache.reserve_batch(batch.iter_mut().map(|e| (&mut *e.seq, e.tokens.len())))?;
        let n = flat.len();

        let half = self.rope.inv_freq.len();
        let (mut cos, mut sin) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
        let mut spans = Vec::with_capacity(batch.len());
        let mut row = 0;
        for e in batch.iter() {
            let t = e.tokens.len();
            let mut depth = vec![0usize; t];
            let mut ancestor = vec![false; t * t];
            for i in 0..t {
                if i > 0 {
                    depth[i] = depth[e.parents[i]] + 1;
                    let p = e.parents[i];
                    for j in 0..t {
                        ancestor[i * t + j] = ancestor[p * t + j];
                    }
                }
                ancestor[i * t + i] = true;
                let (c, s) = self.rope.host_tables(e.seq.len + depth[i], 1);
                cos.extend(c);
                sin.extend(s);
            }
            spans.push(TreeSpan { seq: &*e.seq, row, start: e.seq.len, ancestor, len: t });
            row += t;
        }
        let tables = RopeTables {
            cos: Tensor::from_data(TensorData::new(cos, [n, half]), device),
            sin: Tensor::from_data(TensorData::new(sin, [n, half]), device),
        };
        let mut captured: Vec<Option<Tensor<B, 2>>> = vec![None; num_layers + 1];
        // [N, d]
        // The residual stream as two terms `x + ffn`, summed by the next norm's launch (`forward_add`).
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
            let attn = layer.self_attn.forward_tree(normed, &self.rope, &tables, cache, i, &spans);
            let (h, normed) = layer.post_attention_layernorm.forward_add(input, attn);
            let f = match &layer.mlp {
                FeedForward::Dense(mlp) => mlp.forward(normed),
                FeedForward::Moe(moe) => moe.forward(normed),
            };
            (x, ffn) = (h, Some(f));
        }
        let normed = match ffn {
            Some(f) => self.norm.forward_add(x, f).1,
            None => self.norm.forward(x),
        };
        if capture.contains(&num_layers) {
            captured[num_layers] = Some(normed.clone());
        }
        for e in batch.iter_mut() {
            e.seq.len += e.tokens.len();
        }
        let hidden = capture.iter().map(|&i| captured[i].clone().expect("every capture id was recorded")).collect();
        Ok((self.lm_head.forward(normed), hidden))
    }

    /// After [`Self::forward_tree_capture`] appended a tree of `tree_len` nodes at `start`: keeps the nodes `path`
    /// (increasing node indices, starting with the root 0) at positions `start..start + path.len()`, in every layer,
    /// and drops the other nodes (whole blocks past the new end go back to the pool).
    pub fn keep_tree_path(
        &self,
        cache: &mut PagedMlaCache<B>,
        seq: &mut SequenceCache,
        start: usize,
        tree_len: usize,
        path: &[usize],
    ) -> Result<()> {
        if seq.len != start + tree_len
            || path.first() != Some(&0)
            || path.windows(2).any(|w| w[0] >= w[1])
            || path.last().is_some_and(|&l| l >= tree_len)
        {
            return Err(ModelError::Input {
                message: format!(
                    "a tree path must be increasing node indices from the root 0 of the {tree_len}-node tree at {start}"
                ),
            });
        }
        let moved = path.iter().enumerate().any(|(k, &node)| node != k);
        if moved {
            let device = self.embed_tokens.device();
            let rows: Vec<i64> = path.iter().map(|&node| (start + node) as i64).collect();
            let rows = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [path.len()]), &device);
            for layer in 0..self.layers.len() {
                let kept = cache.read(layer, seq, start + tree_len).select(0, rows.clone());
                cache.write(layer, seq, start, kept);
            }
        }
        cache.truncate(seq, start + path.len())
    }
}

impl<B: Backend> Mla<B> {
    /// Absorbed MLA over trees: as `forward_absorbed`, but node `i` of a tree attends to the cached tokens and to
    /// its ancestors and itself among the tree's nodes only.
    fn forward_tree(
        &self,
        x: Tensor<B, 2>,
        rope: &RotaryEmbedding,
        tables: &RopeTables<B>,
        cache: &mut PagedMlaCache<B>,
        layer: usize,
        spans: &[TreeSpan<'_>],
    ) -> Tensor<B, 2> {
        let [n, d] = x.dims();
        let (h, nope, rot, vd, r) =
            (self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank);
        let device = x.device();
        // [N, H*(nope+rot)] -> [1, H, N, nope+rot]
        let q = self.q.forward(x.clone()).reshape([1, n, h, nope + rot]).swap_dims(1, 2);
        let q_nope = q.clone().narrow(3, 0, nope).reshape([h, n, nope]);
        let q_pe = rope.apply(q.narrow(3, nope, rot), tables).reshape([h, n, rot]);
        let kv_a = self.kv_a_proj_with_mqa.forward(x);
        let c_kv = self.kv_a_layernorm.forward(kv_a.clone().narrow(1, 0, r));
        let k_pe = rope.apply(kv_a.narrow(1, r, rot).reshape([1, 1, n, rot]), tables).reshape([n, rot]);
        let latents = Tensor::cat(vec![c_kv, k_pe], 1);
        for span in spans {
            cache.write(layer, span.seq, span.start, latents.clone().narrow(0, span.row, span.len));
        }
        // kv_b_proj.weight [H*(nope+vd), r] -> [H, nope+vd, r]
        let w_kv_b = self.kv_b_proj.weight.clone().cast(burn::tensor::FloatDType::F32).reshape([h, nope + vd, r]);
        let w_uk = w_kv_b.clone().narrow(1, 0, nope);
        let w_uv = w_kv_b.narrow(1, nope, vd);
        // [H, N, r]
        let q_lat = q_nope.matmul(w_uk);
        let mut parts = Vec::with_capacity(spans.len());
        for span in spans {
            let (t, total) = (span.len, span.start + span.len);
            let all = cache.read(layer, span.seq, total);
            let c_all = all.clone().narrow(1, 0, r).reshape([1, total, r]);
            let pe_all = all.narrow(1, r, rot).reshape([1, total, rot]);
            let q_lat = q_lat.clone().narrow(1, span.row, t);
            let q_pe = q_pe.clone().narrow(1, span.row, t);
            // [H, t, total]
            let scores = (q_lat.matmul(c_all.clone().swap_dims(1, 2)) + q_pe.matmul(pe_all.swap_dims(1, 2)))
                .mul_scalar(self.softmax_scale);
            let mask: Vec<bool> = (0..t)
                .flat_map(|i| (0..total).map(move |k| k >= span.start && !span.ancestor[i * t + (k - span.start)]))
                .collect();
            let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(mask, [t, total]), &device)
                .unsqueeze::<3>()
                .expand([h, t, total]);
            let probs = softmax(scores.mask_fill(mask, f32::NEG_INFINITY), 2);
            parts.push(probs.matmul(c_all));
        }
        // [H, N, r] -> [H, N, vd] -> [N, H*vd]
        let o_lat = Tensor::cat(parts, 1);
        let o = o_lat.matmul(w_uv.swap_dims(1, 2)).swap_dims(0, 1).reshape([n, h * vd]);
        self.o_proj.forward(o).reshape([n, d])
    }
}
