//! Speculative decoding over a batch of sequences: chain drafting, one target forward that verifies every
//! sequence's chain, acceptance per sequence ([`crate::verify`]), rollback of the target and drafter caches.
//!
//! One [`SpecDecoder::step`] for sequences whose last token `x` the target has not run yet:
//! 1. per sequence, `num_steps` drafts `d_1..d_k`, each drawn from `q_j = probabilities(drafter logits, history)`;
//! 2. one `forward_batch_capture` of the target over `[x, d_1..d_k]` of every sequence ([`LogitRows::All`],
//!    the drafter's capture ids): row `j` gives `p_{j+1} = probabilities(target logits, history)`, the same
//!    processing as `q` (penalties counting the drafts before it);
//! 3. [`verify_chain`] per sequence: `a` accepted drafts plus one resampled or bonus token `y`;
//! 4. the target cache is cut back to the `1 + a` kept positions (`PagedMlaCache::truncate`), and the drafter is
//!    extended with `[x, d_1..d_a]`, `y` and their captured states (its draft-only rows dropped).
//!
//! Sequences accept different numbers of tokens; the next step again runs them all in one target forward.

use std::time::Instant;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use eyrie_model::DeepseekV3;
use eyrie_model::deepseek_v3::{BatchEntry, LogitRows};
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::sampling::{Sampler, SamplingParams};
use eyrie_model::tree_verify::TreeEntry;

use crate::drafter::{Drafter, ExtendInput};
use crate::error::{Result, SpecError};
use crate::stats::AcceptanceStats;
use crate::tree::{DraftTree, draft_tree};
use crate::verify::{verify_chain, verify_tree};

/// One sequence under speculative decoding.
#[derive(Debug)]
pub struct SpecSequence<S> {
    /// Its target KV cache (page table).
    pub cache: SequenceCache,
    /// The drafter's state for it.
    pub draft: S,
    /// Prompt then generated tokens; after [`SpecDecoder::prefill`] the last one has not been run by the target.
    pub tokens: Vec<u32>,
    /// Prompt length (tokens after it are the history penalties count).
    pub prompt_len: usize,
    /// Sampling parameters and random state.
    pub sampler: Sampler,
}

impl<S> SpecSequence<S> {
    /// The generated tokens so far.
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    fn params(&self) -> SamplingParams {
        *self.sampler.params()
    }
}

/// Chain speculative decoding with a [`Drafter`].
#[derive(Debug)]
pub struct SpecDecoder<D> {
    /// The drafter.
    pub drafter: D,
    /// Draft tokens per step (`--speculative-num-steps`), the tree depth with `topk > 1`; 0 decodes one token per
    /// step without drafting.
    pub num_steps: usize,
    /// Children per expanded node (`--speculative-eagle-topk`); 1 drafts a chain.
    pub topk: usize,
    /// Tree nodes verified per step, the root included (`--speculative-num-draft-tokens`; used when `topk > 1`).
    pub num_draft_tokens: usize,
    /// Statistics since creation (or the last [`SpecDecoder::take_stats`]).
    pub stats: AcceptanceStats,
}

/// The target forward of one batched step: logits `[N, vocab]` on the host and the captured states.
struct TargetRows<B: Backend> {
    logits: Vec<f32>,
    vocab: usize,
    captured: Vec<Tensor<B, 2>>,
}

impl<D> SpecDecoder<D> {
    /// A decoder drafting `num_steps` tokens per step.
    pub fn new(drafter: D, num_steps: usize) -> Self {
        Self { drafter, num_steps, topk: 1, num_draft_tokens: num_steps + 1, stats: AcceptanceStats::default() }
    }

    /// Tree drafting: depth `num_steps`, `topk` children per expanded node, `num_draft_tokens` nodes (root
    /// included) verified per step (SGLang's `--speculative-eagle-topk` / `--speculative-num-draft-tokens`).
    pub fn with_tree(mut self, topk: usize, num_draft_tokens: usize) -> Self {
        self.topk = topk;
        self.num_draft_tokens = num_draft_tokens;
        self
    }

    /// Returns the statistics and resets them.
    pub fn take_stats(&mut self) -> AcceptanceStats {
        std::mem::take(&mut self.stats)
    }

    /// A new sequence for `prompt` (non-empty) sampled with `params` (validated).
    pub fn new_sequence<B: Backend>(&mut self, prompt: &[u32], params: SamplingParams) -> Result<SpecSequence<D::State>>
    where
        D: Drafter<B>,
    {
        if prompt.is_empty() {
            return Err(SpecError::input("a prompt needs at least one token"));
        }
        Ok(SpecSequence {
            cache: SequenceCache::default(),
            draft: self.drafter.new_state(),
            tokens: prompt.to_vec(),
            prompt_len: prompt.len(),
            sampler: Sampler::new(params)?,
        })
    }

    /// Gives a finished sequence's target blocks and drafter state back.
    pub fn release<B: Backend>(&mut self, cache: &mut PagedMlaCache<B>, seq: SpecSequence<D::State>)
    where
        D: Drafter<B>,
    {
        cache.release(seq.cache);
        self.drafter.release(seq.draft);
    }

    /// Runs the rest of each new sequence's prompt through the target in one batched forward, samples each one's
    /// first token (appended to its `tokens` and returned) and primes the drafter. [`Self::prefill_chunks`] without
    /// a chunk limit.
    pub fn prefill<B: Backend>(
        &mut self,
        target: &DeepseekV3<B>,
        cache: &mut PagedMlaCache<B>,
        seqs: &mut [&mut SpecSequence<D::State>],
        device: &B::Device,
    ) -> Result<Vec<u32>>
    where
        D: Drafter<B>,
    {
        let limits = vec![usize::MAX; seqs.len()];
        let first = self.prefill_chunks(target, cache, seqs, &limits, device)?;
        Ok(first.into_iter().map(|t| t.expect("an unlimited chunk finishes the prompt")).collect())
    }

    /// One chunk of prefill: sequence `i` runs its next `min(max_tokens[i], tokens left)` tokens not yet in the
    /// target cache (its prompt; or, for a sequence resumed after preemption, its prompt and generated tokens, the
    /// penalties still counting only the generated ones) (from `cache.len`, which may start past 0 when the prompt's
    /// prefix came from the prefix cache: the drafter then only sees the part run here, which can lower
    /// acceptance but never changes the output) in one batched target forward, and the drafter takes their
    /// captured states. A sequence whose prompt this chunk finishes gets its first token sampled (appended to its
    /// `tokens`, returned as `Some`); the others return `None`.
    pub fn prefill_chunks<B: Backend>(
        &mut self,
        target: &DeepseekV3<B>,
        cache: &mut PagedMlaCache<B>,
        seqs: &mut [&mut SpecSequence<D::State>],
        max_tokens: &[usize],
        device: &B::Device,
    ) -> Result<Vec<Option<u32>>>
    where
        D: Drafter<B>,
    {
        if max_tokens.len() != seqs.len() || max_tokens.contains(&0) {
            return Err(SpecError::input("prefill needs a positive chunk limit per sequence"));
        }
        if seqs.iter().any(|s| s.cache.len >= s.tokens.len()) {
            return Err(SpecError::input("prefill takes sequences with tokens the target has not run yet"));
        }
        let chunks: Vec<Vec<u32>> = seqs
            .iter()
            .zip(max_tokens)
            .map(|(s, &m)| {
                let end = s.tokens.len().min(s.cache.len.saturating_add(m));
                s.tokens[s.cache.len..end].to_vec()
            })
            .collect();
        let rows = self.target_forward(target, cache, seqs, &chunks, LogitRows::Last, device)?;
        let mut first = Vec::with_capacity(seqs.len());
        let mut nexts = Vec::with_capacity(seqs.len());
        for (i, seq) in seqs.iter_mut().enumerate() {
            if seq.cache.len == seq.tokens.len() {
                let probs = seq.params().probabilities(rows.row(i), seq.generated());
                let token = seq.sampler.draw(&probs);
                seq.tokens.push(token);
                first.push(Some(token));
                nexts.push(token);
            } else {
                first.push(None);
                nexts.push(seq.tokens[seq.cache.len]);
            }
        }
        // The captured rows are every chunk token, chunk after chunk: what the drafter takes.
        let t = Instant::now();
        let inputs: Vec<ExtendInput<'_>> =
            chunks.iter().zip(&nexts).map(|(c, &next)| ExtendInput { processed: c, next }).collect();
        let mut states: Vec<&mut D::State> = seqs.iter_mut().map(|s| &mut s.draft).collect();
        self.drafter.extend_batch(&mut states, &inputs, &rows.captured)?;
        self.stats.draft_time += t.elapsed();
        Ok(first)
    }

    /// One speculative step for every sequence (each already prefilled): drafts, verifies all chains in one target
    /// forward, and returns each sequence's new tokens (1 to `num_steps + 1`, also appended to its `tokens`).
    pub fn step<B: Backend>(
        &mut self,
        target: &DeepseekV3<B>,
        cache: &mut PagedMlaCache<B>,
        seqs: &mut [&mut SpecSequence<D::State>],
        device: &B::Device,
    ) -> Result<Vec<Vec<u32>>>
    where
        D: Drafter<B>,
    {
        if seqs.iter().any(|s| s.tokens.len() <= s.prompt_len || s.cache.len + 1 != s.tokens.len()) {
            return Err(SpecError::input(
                "step takes prefilled sequences (every token but the last run by the target)",
            ));
        }
        if self.topk > 1 && self.num_steps > 0 {
            return self.step_tree(target, cache, seqs, device);
        }
        // 1. Drafting.
        let t = Instant::now();
        let mut chains: Vec<Vec<u32>> =
            seqs.iter().map(|s| vec![*s.tokens.last().expect("checked non-empty")]).collect();
        let mut histories: Vec<Vec<u32>> = seqs.iter().map(|s| s.generated().to_vec()).collect();
        let mut qs: Vec<Vec<Vec<f64>>> = vec![Vec::with_capacity(self.num_steps); seqs.len()];
        for j in 0..self.num_steps {
            if j > 0 {
                // Every sequence's previous draft through the drafter in one pass.
                let tokens: Vec<u32> = chains.iter().map(|c| c[j]).collect();
                let mut states: Vec<&mut D::State> = seqs.iter_mut().map(|s| &mut s.draft).collect();
                self.drafter.push_batch(&mut states, &tokens)?;
            }
            for (i, seq) in seqs.iter_mut().enumerate() {
                let probs = seq.params().probabilities(&self.drafter.logits(&seq.draft)?, &histories[i]);
                let d = seq.sampler.draw(&probs);
                chains[i].push(d);
                histories[i].push(d);
                qs[i].push(probs);
            }
        }
        self.stats.draft_time += t.elapsed();

        // 2. One target forward over every chain.
        let t = Instant::now();
        let starts: Vec<usize> = seqs.iter().map(|s| s.cache.len).collect();
        let rows = self.target_forward(target, cache, seqs, &chains, LogitRows::All, device)?;

        // 3-4. Acceptance, rollback, then the drafter extended with every sequence's kept rows in one pass.
        let mut out: Vec<Vec<u32>> = Vec::with_capacity(seqs.len());
        let mut row = 0;
        let mut keep_rows: Vec<i64> = Vec::new();
        for (i, seq) in seqs.iter_mut().enumerate() {
            let chain = &chains[i];
            let k = chain.len() - 1;
            let params = seq.params();
            let mut history = seq.generated().to_vec();
            let mut p = Vec::with_capacity(k + 1);
            for j in 0..=k {
                p.push(params.probabilities(rows.row(row + j), &history));
                if j < k {
                    history.push(chain[j + 1]);
                }
            }
            let verdict = verify_chain(&chain[1..], &qs[i], &p, &mut seq.sampler);
            let kept = 1 + verdict.accepted;
            cache.truncate(&mut seq.cache, starts[i] + kept)?;
            keep_rows.extend((row..row + kept).map(|r| r as i64));
            self.stats.record(k, verdict.accepted);
            seq.tokens.extend_from_slice(&verdict.tokens);
            row += chain.len();
            out.push(verdict.tokens);
        }
        let t_draft = Instant::now();
        let inputs: Vec<ExtendInput<'_>> = chains
            .iter()
            .zip(&out)
            .map(|(chain, new)| ExtendInput {
                processed: &chain[..new.len()],
                next: *new.last().expect("a verdict emits at least one token"),
            })
            .collect();
        let features = select_rows(&rows.captured, keep_rows, device);
        let mut states: Vec<&mut D::State> = seqs.iter_mut().map(|s| &mut s.draft).collect();
        self.drafter.extend_batch(&mut states, &inputs, &features)?;
        let draft_time = t_draft.elapsed();
        self.stats.verify_time += t.elapsed() - draft_time;
        self.stats.draft_time += draft_time;
        Ok(out)
    }

    /// [`Self::step`] with tree drafting: a token tree per sequence, one tree-masked target forward over all of
    /// them, [`verify_tree`], and the accepted path compacted in the target cache.
    fn step_tree<B: Backend>(
        &mut self,
        target: &DeepseekV3<B>,
        cache: &mut PagedMlaCache<B>,
        seqs: &mut [&mut SpecSequence<D::State>],
        device: &B::Device,
    ) -> Result<Vec<Vec<u32>>>
    where
        D: Drafter<B>,
    {
        let t = Instant::now();
        let mut trees: Vec<DraftTree> = Vec::with_capacity(seqs.len());
        for seq in seqs.iter_mut() {
            let root = *seq.tokens.last().expect("checked non-empty");
            trees.push(draft_tree(
                &mut self.drafter,
                &mut seq.draft,
                root,
                self.num_steps,
                self.topk,
                self.num_draft_tokens,
            )?);
        }
        self.stats.draft_time += t.elapsed();

        let t = Instant::now();
        let starts: Vec<usize> = seqs.iter().map(|s| s.cache.len).collect();
        let (logits, captured) = {
            let mut batch: Vec<TreeEntry<'_>> = seqs
                .iter_mut()
                .zip(&trees)
                .map(|(s, tree)| TreeEntry { seq: &mut s.cache, tokens: &tree.tokens, parents: &tree.parents })
                .collect();
            target.forward_tree_capture(&mut batch, cache, self.drafter.capture_ids(), device)?
        };
        let [_, vocab] = logits.dims();
        let logits = crate::eagle3::row_values(logits)?;
        let mut out: Vec<Vec<u32>> = Vec::with_capacity(seqs.len());
        let mut processed: Vec<Vec<u32>> = Vec::with_capacity(seqs.len());
        let mut row = 0;
        let mut keep_rows: Vec<i64> = Vec::new();
        for (i, seq) in seqs.iter_mut().enumerate() {
            let tree = &trees[i];
            let params = seq.params();
            let generated = seq.generated().to_vec();
            // p of node j: the history is the generated tokens plus the path below the root down to j.
            let mut p = Vec::with_capacity(tree.tokens.len());
            for j in 0..tree.tokens.len() {
                let mut path = Vec::new();
                let mut node = j;
                while node != 0 {
                    path.push(tree.tokens[node]);
                    node = tree.parents[node];
                }
                let history: Vec<u32> = generated.iter().copied().chain(path.into_iter().rev()).collect();
                p.push(params.probabilities(&logits[(row + j) * vocab..(row + j + 1) * vocab], &history));
            }
            let verdict = verify_tree(&tree.tokens, &tree.parents, &p, &mut seq.sampler);
            target.keep_tree_path(cache, &mut seq.cache, starts[i], tree.tokens.len(), &verdict.path)?;
            processed.push(verdict.path.iter().map(|&n| tree.tokens[n]).collect::<Vec<u32>>());
            keep_rows.extend(verdict.path.iter().map(|&n| (row + n) as i64));
            self.stats.record(tree.depth(), verdict.path.len() - 1);
            seq.tokens.extend_from_slice(&verdict.tokens);
            row += tree.tokens.len();
            out.push(verdict.tokens);
        }
        let t_draft = Instant::now();
        let inputs: Vec<ExtendInput<'_>> = processed
            .iter()
            .zip(&out)
            .map(|(p, new)| ExtendInput {
                processed: p,
                next: *new.last().expect("a verdict emits at least one token"),
            })
            .collect();
        let features = select_rows(&captured, keep_rows, device);
        let mut states: Vec<&mut D::State> = seqs.iter_mut().map(|s| &mut s.draft).collect();
        self.drafter.extend_batch(&mut states, &inputs, &features)?;
        let draft_time = t_draft.elapsed();
        self.stats.verify_time += t.elapsed() - draft_time;
        self.stats.draft_time += draft_time;
        Ok(out)
    }

    fn target_forward<B: Backend>(
        &self,
        target: &DeepseekV3<B>,
        cache: &mut PagedMlaCache<B>,
        seqs: &mut [&mut SpecSequence<D::State>],
        tokens: &[Vec<u32>],
        rows: LogitRows,
        device: &B::Device,
    ) -> Result<TargetRows<B>>
    where
        D: Drafter<B>,
    {
        if seqs.is_empty() {
            return Err(SpecError::input("an empty batch"));
        }
        let mut batch: Vec<BatchEntry<'_>> =
            seqs.iter_mut().zip(tokens).map(|(s, t)| BatchEntry { seq: &mut s.cache, tokens: t }).collect();
        let (logits, captured) =
            target.forward_batch_capture(&mut batch, cache, rows, self.drafter.capture_ids(), device)?;
        let [_, vocab] = logits.dims();
        let logits = crate::eagle3::row_values(logits)?;
        Ok(TargetRows { logits, vocab, captured })
    }
}

/// Rows `rows` of each captured tensor.
fn select_rows<B: Backend>(captured: &[Tensor<B, 2>], rows: Vec<i64>, device: &B::Device) -> Vec<Tensor<B, 2>> {
    let n = rows.len();
    let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [n]), device);
    captured.iter().map(|c| c.clone().select(0, idx.clone())).collect()
}

impl<B: Backend> TargetRows<B> {
    fn row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.vocab..(i + 1) * self.vocab]
    }
}
