//! The drafter interface speculative decoding drives ([`Drafter`]), its EAGLE-3 implementation, and
//! [`SelfDrafter`], which drafts with the target model itself (its drafts are exactly the target's own choices,
//! so greedy acceptance is 100%: the test that the verification machinery loses nothing).
//!
//! Protocol per sequence: [`Drafter::extend`] with what the target just computed and kept (the tokens it ran, the
//! token that follows them, and their captured hidden states); then [`Drafter::logits`] gives the distribution of
//! the next token, [`Drafter::push`] feeds a drafted token and moves one position on, and so on for a chain. The
//! next `extend` drops every draft-only position first.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use eyrie_model::DeepseekV3;
use eyrie_model::deepseek_v3::{BatchEntry, LogitRows};
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};

use crate::eagle3::{Eagle3Drafter, Eagle3State, row_values};
use crate::error::{Result, SpecError};

/// One sequence's part of [`Drafter::extend_batch`].
#[derive(Debug, Clone, Copy)]
pub struct ExtendInput<'a> {
    /// The tokens the target ran and kept.
    pub processed: &'a [u32],
    /// The token after them.
    pub next: u32,
}

/// A draft model behind speculative decoding.
pub trait Drafter<B: Backend> {
    /// Per-sequence state (the drafter's own KV cache and its last outputs).
    type State;

    /// Target capture ids (input-of-layer numbering, see `DeepseekV3::forward_batch_capture`) whose hidden states
    /// [`Drafter::extend`] needs, in order; empty when it needs none.
    fn capture_ids(&self) -> &[usize];

    /// A state for a new sequence.
    fn new_state(&mut self) -> Self::State;

    /// Feeds the tokens the target just ran and kept for this sequence, `processed` (positions
    /// `committed..committed + n`), the token after the last of them, `next` (sampled, accepted or the bonus), and
    /// one `[n, target_hidden]` tensor of their hidden states per capture id. Drops draft-only positions first.
    /// Afterwards [`Drafter::logits`] is the distribution of the token after `next`.
    fn extend(
        &mut self,
        state: &mut Self::State,
        processed: &[u32],
        next: u32,
        features: &[Tensor<B, 2>],
    ) -> Result<()>;

    /// [`Drafter::extend`] for several sequences at once: `inputs[i]` for `states[i]`, and `features` (one tensor
    /// per capture id) holding every sequence's rows, sequence after sequence (`inputs[i].processed.len()` rows
    /// each). The default runs the sequences one by one; drafters that batch override it.
    fn extend_batch(
        &mut self,
        states: &mut [&mut Self::State],
        inputs: &[ExtendInput<'_>],
        features: &[Tensor<B, 2>],
    ) -> Result<()> {
        let mut row = 0;
        for (state, input) in states.iter_mut().zip(inputs) {
            let n = input.processed.len();
            let rows: Vec<Tensor<B, 2>> = features.iter().map(|f| f.clone().narrow(0, row, n)).collect();
            self.extend(state, input.processed, input.next, &rows)?;
            row += n;
        }
        Ok(())
    }

    /// [`Drafter::push`] for several sequences at once (`tokens[i]` for `states[i]`). The default runs them one by
    /// one; drafters that batch override it.
    fn push_batch(&mut self, states: &mut [&mut Self::State], tokens: &[u32]) -> Result<()> {
        for (state, &t) in states.iter_mut().zip(tokens) {
            self.push(state, t)?;
        }
        Ok(())
    }

    /// Logits over the TARGET vocabulary of the next draft position.
    fn logits(&self, state: &Self::State) -> Result<Vec<f32>>;

    /// Feeds a drafted token (target vocabulary); [`Drafter::logits`] then describes the position after it.
    fn push(&mut self, state: &mut Self::State, token: u32) -> Result<()>;

    /// An independent copy of `state` (tree drafting expands several branches from one state); release it when
    /// done.
    fn fork(&mut self, state: &Self::State) -> Result<Self::State>;

    /// Frees what the state holds (cache blocks).
    fn release(&mut self, state: Self::State) {
        drop(state);
    }
}

impl<B: Backend> Drafter<B> for Eagle3Drafter<B> {
    type State = Eagle3State<B>;

    fn capture_ids(&self) -> &[usize] {
        &self.capture_ids
    }

    fn new_state(&mut self) -> Self::State {
        Eagle3Drafter::new_state(self)
    }

    fn extend(
        &mut self,
        state: &mut Self::State,
        processed: &[u32],
        next: u32,
        features: &[Tensor<B, 2>],
    ) -> Result<()> {
        if processed.is_empty() {
            return Err(SpecError::input("extend needs at least one processed token"));
        }
        if features.len() != 3 {
            return Err(SpecError::input(format!("EAGLE-3 needs 3 captured states, got {}", features.len())));
        }
        // EAGLE's shift: the state at position p goes with the token at p + 1.
        let mut shifted = processed[1..].to_vec();
        shifted.push(next);
        Eagle3Drafter::extend(self, state, &shifted, Tensor::cat(features.to_vec(), 1))?;
        Ok(())
    }

    fn logits(&self, state: &Self::State) -> Result<Vec<f32>> {
        state
            .next_logits()
            .map(<[f32]>::to_vec)
            .ok_or_else(|| SpecError::input("drafter state has no logits before extend"))
    }

    fn push(&mut self, state: &mut Self::State, token: u32) -> Result<()> {
        self.step(state, token)
    }

    fn fork(&mut self, state: &Self::State) -> Result<Self::State> {
        Ok(state.clone())
    }
}

/// Drafts with the target model itself over its own paged cache: proposals equal the target's own choices.
#[derive(Debug)]
pub struct SelfDrafter<B: Backend> {
    model: DeepseekV3<B>,
    cache: PagedMlaCache<B>,
    device: B::Device,
}

/// [`SelfDrafter`]'s per-sequence state.
#[derive(Debug, Clone, Default)]
pub struct SelfDraftState {
    seq: SequenceCache,
    /// Every token run, committed then draft-only.
    tokens: Vec<u32>,
    committed: usize,
    logits: Option<Vec<f32>>,
}

impl<B: Backend> SelfDrafter<B> {
    /// A self-drafter running `model` over its own cache of `num_blocks` blocks of `block_size` tokens.
    pub fn new(model: DeepseekV3<B>, num_blocks: usize, block_size: usize, device: &B::Device) -> Result<Self> {
        let cache = PagedMlaCache::new(&model.config, num_blocks, block_size, device)?;
        Ok(Self { model, cache, device: device.clone() })
    }

    fn run(&mut self, state: &mut SelfDraftState, tokens: &[u32]) -> Result<()> {
        let logits = self.model.forward_batch(
            &mut [BatchEntry { seq: &mut state.seq, tokens }],
            &mut self.cache,
            LogitRows::Last,
            &self.device,
        )?;
        state.logits = Some(row_values(logits)?);
        Ok(())
    }
}

impl<B: Backend> Drafter<B> for SelfDrafter<B> {
    type State = SelfDraftState;

    fn capture_ids(&self) -> &[usize] {
        &[]
    }

    fn new_state(&mut self) -> Self::State {
        SelfDraftState::default()
    }

    fn extend(
        &mut self,
        state: &mut Self::State,
        processed: &[u32],
        next: u32,
        _features: &[Tensor<B, 2>],
    ) -> Result<()> {
        self.cache.truncate(&mut state.seq, state.committed)?;
        state.tokens.truncate(state.committed);
        let mut tokens = processed.to_vec();
        tokens.push(next);
        self.run(state, &tokens)?;
        state.tokens.extend_from_slice(&tokens);
        // `next` has not been run by the target yet: its row is draft-only.
        state.committed += processed.len();
        Ok(())
    }

    fn logits(&self, state: &Self::State) -> Result<Vec<f32>> {
        state.logits.clone().ok_or_else(|| SpecError::input("drafter state has no logits before extend"))
    }

    fn push(&mut self, state: &mut Self::State, token: u32) -> Result<()> {
        self.run(state, &[token])?;
        state.tokens.push(token);
        Ok(())
    }

    fn fork(&mut self, state: &Self::State) -> Result<Self::State> {
        // Paged blocks cannot be shared between writers: the copy re-runs the tokens into blocks of its own.
        let mut copy =
            SelfDraftState { tokens: state.tokens.clone(), committed: state.committed, ..Default::default() };
        if !copy.tokens.is_empty() {
            let tokens = copy.tokens.clone();
            self.run(&mut copy, &tokens)?;
        }
        Ok(copy)
    }

    fn release(&mut self, state: Self::State) {
        self.cache.release(state.seq);
    }
}
