//! Greedy exactness: speculative decoding emits exactly the tokens of plain greedy decoding, for many prompts and
//! lengths, chain lengths 1..4 and batch sizes 1..8, with the tiny random target `fixtures/model/yarn_qlora` and
//! (a) the random EAGLE-3 drafter `fixtures/spec/specforge` (low acceptance: most steps reject, sequences in one
//! batch accept different numbers of tokens), (b) the self-drafter, whose greedy acceptance must be 100%, (c) a
//! self-drafter whose proposals are spoiled at pseudo-random positions (partial acceptance, different per sequence).
//! The same with tree drafting (top-k expansion, a tree-masked target forward, path compaction in the cache).
//! Plus sampled decoding (temperature, top-p, penalties) through the same machinery.

mod common;

use burn::backend::Flex;
use burn::tensor::Tensor;
use eyrie_model::DeepseekV3;
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::sampling::{SamplingParams, argmax};
use eyrie_spec_decode::{DraftFormat, Drafter, Eagle3Drafter, Result, SelfDrafter, SpecDecoder};

use common::{fixture, host};

const NEW_TOKENS: usize = 10;

/// Deterministic prompts of varied lengths (1..=9) over the 256-token vocabulary.
fn prompts(n: usize, salt: u64) -> Vec<Vec<u32>> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ salt;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n).map(|_| (0..1 + next() % 9).map(|_| (next() % 256) as u32).collect()).collect()
}

/// Plain greedy decoding over the KV cache, one sequence at a time: the reference.
fn plain_greedy(target: &DeepseekV3<Flex>, prompt: &[u32], n: usize) -> Vec<u32> {
    let device = Default::default();
    let mut cache = PagedMlaCache::new(&target.config, 16, 4, &device).unwrap();
    let mut seq = SequenceCache::default();
    let mut out = Vec::new();
    let mut input = prompt.to_vec();
    while out.len() < n {
        let logits = host(target.forward_cached(&input, &mut cache, &mut seq, &device).unwrap());
        let vocab = target.config.vocab_size;
        let t = argmax(&logits[logits.len() - vocab..]);
        out.push(t);
        input = vec![t];
    }
    out
}

/// Speculative greedy decoding of `prompts` as one batch; returns each sequence's first `n` generated tokens.
fn speculative<D: Drafter<Flex>>(
    target: &DeepseekV3<Flex>,
    dec: &mut SpecDecoder<D>,
    prompts: &[Vec<u32>],
    n: usize,
) -> Vec<Vec<u32>> {
    let device = Default::default();
    let mut cache = PagedMlaCache::new(&target.config, 64, 4, &device).unwrap();
    let mut seqs: Vec<_> = prompts.iter().map(|p| dec.new_sequence(p, SamplingParams::default()).unwrap()).collect();
    {
        let mut refs: Vec<_> = seqs.iter_mut().collect();
        dec.prefill(target, &mut cache, &mut refs, &device).unwrap();
    }
    while seqs.iter().any(|s| s.generated().len() < n) {
        // Finished sequences leave the batch; the others go on together.
        let mut refs: Vec<_> = seqs.iter_mut().filter(|s| s.generated().len() < n).collect();
        dec.step(target, &mut cache, &mut refs, &device).unwrap();
        for s in &refs {
            // The target cache holds every token but the last.
            assert_eq!(s.cache.len + 1, s.tokens.len());
        }
    }
    let out = seqs.iter().map(|s| s.generated()[..n].to_vec()).collect();
    for s in seqs {
        dec.release(&mut cache, s);
    }
    assert_eq!(cache.free_blocks(), 64, "every target block is returned");
    out
}

#[test]
fn eagle3_drafter_output_equals_plain_greedy() {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let convention = DraftFormat::SpecForge.default_convention();
    let drafter = Eagle3Drafter::load(fixture("spec/specforge"), &target, convention, &device).unwrap();
    let mut dec = SpecDecoder::new(drafter, 1);
    for batch in 1..=8 {
        dec.num_steps = 1 + batch % 4;
        let prompts = prompts(batch, batch as u64);
        let got = speculative(&target, &mut dec, &prompts, NEW_TOKENS);
        for (p, g) in prompts.iter().zip(&got) {
            assert_eq!(
                g,
                &plain_greedy(&target, p, NEW_TOKENS),
                "batch {batch}, {} steps, prompt {p:?}",
                dec.num_steps
            );
        }
    }
    let stats = dec.take_stats();
    println!("{}", stats.summary());
    assert!(stats.steps > 0 && stats.drafted > 0);
}

#[test]
fn self_drafter_is_exact_and_accepts_everything() {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let drafter = SelfDrafter::new(target.clone(), 64, 4, &device).unwrap();
    let mut dec = SpecDecoder::new(drafter, 3);
    for (batch, steps) in [(1, 3), (3, 2), (5, 4)] {
        dec.num_steps = steps;
        let prompts = prompts(batch, 100 + batch as u64);
        let got = speculative(&target, &mut dec, &prompts, NEW_TOKENS);
        for (p, g) in prompts.iter().zip(&got) {
            assert_eq!(g, &plain_greedy(&target, p, NEW_TOKENS), "batch {batch}, prompt {p:?}");
        }
    }
    let stats = dec.take_stats();
    println!("{}", stats.summary());
    assert_eq!(stats.accepted, stats.drafted, "greedy self-drafting must accept every draft: {}", stats.summary());
}

/// A self-drafter whose proposal is spoiled (the argmax moved to another token) at pseudo-random chain positions.
struct Spoiled(SelfDrafter<Flex>);

impl Drafter<Flex> for Spoiled {
    type State = (<SelfDrafter<Flex> as Drafter<Flex>>::State, u64);

    fn capture_ids(&self) -> &[usize] {
        &[]
    }

    fn new_state(&mut self) -> Self::State {
        (self.0.new_state(), 0)
    }

    fn extend(
        &mut self,
        state: &mut Self::State,
        processed: &[u32],
        next: u32,
        features: &[Tensor<Flex, 2>],
    ) -> Result<()> {
        state.1 = state.1.wrapping_mul(6364136223846793005).wrapping_add(u64::from(next) + 1);
        self.0.extend(&mut state.0, processed, next, features)
    }

    fn logits(&self, state: &Self::State) -> Result<Vec<f32>> {
        let mut logits = self.0.logits(&state.0)?;
        if (state.1 >> 33) % 3 == 0 {
            let best = argmax(&logits) as usize;
            let (other, top) = ((best + 1) % logits.len(), logits[best]);
            logits[other] = top + 1.0;
        }
        Ok(logits)
    }

    fn push(&mut self, state: &mut Self::State, token: u32) -> Result<()> {
        state.1 = state.1.wrapping_mul(6364136223846793005).wrapping_add(u64::from(token) + 1);
        self.0.push(&mut state.0, token)
    }

    fn fork(&mut self, state: &Self::State) -> Result<Self::State> {
        Ok((self.0.fork(&state.0)?, state.1))
    }

    fn release(&mut self, state: Self::State) {
        self.0.release(state.0);
    }
}

#[test]
fn partially_accepting_drafter_output_equals_plain_greedy() {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let mut dec = SpecDecoder::new(Spoiled(SelfDrafter::new(target.clone(), 64, 4, &device).unwrap()), 4);
    for (batch, steps) in [(2, 4), (4, 3), (8, 2)] {
        dec.num_steps = steps;
        let prompts = prompts(batch, 200 + batch as u64);
        let got = speculative(&target, &mut dec, &prompts, NEW_TOKENS);
        for (p, g) in prompts.iter().zip(&got) {
            assert_eq!(g, &plain_greedy(&target, p, NEW_TOKENS), "batch {batch}, prompt {p:?}");
        }
    }
    let stats = dec.take_stats();
    println!("{}", stats.summary());
    let rate = stats.acceptance_rate();
    assert!(rate > 0.2 && rate < 0.95, "partial acceptance expected: {}", stats.summary());
}

#[test]
fn sampled_decoding_runs_with_penalties_and_the_self_drafter_accepts_nearly_everything() {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let mut cache = PagedMlaCache::new(&target.config, 64, 4, &device).unwrap();
    let mut dec = SpecDecoder::new(SelfDrafter::new(target.clone(), 64, 4, &device).unwrap(), 3);
    let params = |seed| SamplingParams {
        temperature: Some(0.8),
        top_p: Some(0.95),
        presence_penalty: 0.5,
        frequency_penalty: 0.3,
        seed,
        ..Default::default()
    };
    let mut seqs: Vec<_> =
        prompts(4, 300).iter().enumerate().map(|(i, p)| dec.new_sequence(p, params(i as u64)).unwrap()).collect();
    let mut refs: Vec<_> = seqs.iter_mut().collect();
    dec.prefill(&target, &mut cache, &mut refs, &device).unwrap();
    for _ in 0..4 {
        for new in dec.step(&target, &mut cache, &mut refs, &device).unwrap() {
            assert!(!new.is_empty() && new.len() <= 4 && new.iter().all(|&t| t < 256));
        }
    }
    let stats = dec.take_stats();
    println!("{}", stats.summary());
    // p and q come from the same model through the same processing; they differ only by f32 rounding between
    // batch shapes, so rejections are (near) impossible.
    assert!(stats.acceptance_rate() > 0.9, "{}", stats.summary());
}

#[test]
fn tree_drafting_output_equals_plain_greedy() {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let convention = DraftFormat::SpecForge.default_convention();
    let eagle = Eagle3Drafter::load(fixture("spec/specforge"), &target, convention, &device).unwrap();
    let mut dec = SpecDecoder::new(eagle, 3).with_tree(2, 6);
    for batch in [1, 3, 8] {
        let prompts = prompts(batch, 400 + batch as u64);
        let got = speculative(&target, &mut dec, &prompts, NEW_TOKENS);
        for (p, g) in prompts.iter().zip(&got) {
            assert_eq!(g, &plain_greedy(&target, p, NEW_TOKENS), "eagle tree, batch {batch}, prompt {p:?}");
        }
    }
    println!("eagle3 tree: {}", dec.take_stats().summary());

    // The self-drafter's tree always holds the target's argmax path: every depth is accepted.
    let mut dec = SpecDecoder::new(SelfDrafter::new(target.clone(), 256, 4, &device).unwrap(), 3).with_tree(2, 6);
    for batch in [1, 4] {
        let prompts = prompts(batch, 500 + batch as u64);
        let got = speculative(&target, &mut dec, &prompts, NEW_TOKENS);
        for (p, g) in prompts.iter().zip(&got) {
            assert_eq!(g, &plain_greedy(&target, p, NEW_TOKENS), "self tree, batch {batch}, prompt {p:?}");
        }
    }
    let stats = dec.take_stats();
    println!("self tree: {}", stats.summary());
    assert_eq!(stats.accepted, stats.drafted, "{}", stats.summary());

    // Spoiled self-drafter: the argmax sometimes sits in the second branch, sometimes nowhere.
    let spoiled = Spoiled(SelfDrafter::new(target.clone(), 256, 4, &device).unwrap());
    let mut dec = SpecDecoder::new(spoiled, 3).with_tree(2, 5);
    for batch in [2, 5] {
        let prompts = prompts(batch, 600 + batch as u64);
        let got = speculative(&target, &mut dec, &prompts, NEW_TOKENS);
        for (p, g) in prompts.iter().zip(&got) {
            assert_eq!(g, &plain_greedy(&target, p, NEW_TOKENS), "spoiled tree, batch {batch}, prompt {p:?}");
        }
    }
    let stats = dec.take_stats();
    println!("spoiled tree: {}", stats.summary());
    assert!(stats.accepted > 0 && stats.accepted < stats.drafted, "{}", stats.summary());
}

#[test]
fn chunked_and_prefix_cached_prefills_keep_greedy_output() {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let convention = DraftFormat::SpecForge.default_convention();
    let drafter = Eagle3Drafter::load(fixture("spec/specforge"), &target, convention, &device).unwrap();
    let mut dec = SpecDecoder::new(drafter, 3);
    let prompt: Vec<u32> = vec![1, 17, 200, 45, 99, 3, 128, 7, 9];
    let want = plain_greedy(&target, &prompt, NEW_TOKENS);
    let mut cache = PagedMlaCache::new(&target.config, 64, 4, &device).unwrap();

    // The whole prompt at once, then in chunks of 4: the same tokens and the same drafter (same acceptance).
    let mut runs = Vec::new();
    for chunk in [usize::MAX, 4] {
        let mut seq = dec.new_sequence(&prompt, SamplingParams::default()).unwrap();
        let mut first = None;
        while first.is_none() {
            first = dec.prefill_chunks(&target, &mut cache, &mut [&mut seq], &[chunk], &device).unwrap()[0];
        }
        while seq.generated().len() < NEW_TOKENS {
            dec.step(&target, &mut cache, &mut [&mut seq], &device).unwrap();
        }
        assert_eq!(&seq.generated()[..NEW_TOKENS], &want[..], "chunk {chunk}");
        runs.push(dec.take_stats());
        dec.release(&mut cache, seq);
    }
    assert_eq!((runs[0].steps, runs[0].accepted), (runs[1].steps, runs[1].accepted));

    // A prompt whose first 8 tokens are in the prefix cache: the target skips them, the drafter never sees them.
    let mut seq = dec.new_sequence(&prompt, SamplingParams::default()).unwrap();
    dec.prefill(&target, &mut cache, &mut [&mut seq], &device).unwrap();
    cache.register_prefix(&seq.cache, &seq.tokens);
    dec.release(&mut cache, seq);
    let mut seq = dec.new_sequence(&prompt, SamplingParams::default()).unwrap();
    seq.cache = cache.start_with_prefix(&prompt);
    assert_eq!(seq.cache.len, 8);
    dec.prefill(&target, &mut cache, &mut [&mut seq], &device).unwrap();
    while seq.generated().len() < NEW_TOKENS {
        dec.step(&target, &mut cache, &mut [&mut seq], &device).unwrap();
    }
    assert_eq!(&seq.generated()[..NEW_TOKENS], &want[..]);
    dec.release(&mut cache, seq);
}
