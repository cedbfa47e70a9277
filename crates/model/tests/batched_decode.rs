//! Batched decode of several sequences of different lengths ([`DeepseekV3::forward_batch`]) against running each
//! sequence alone ([`DeepseekV3::forward_cached`]) and against the full-form forward, on the committed fixtures
//! (`fixtures/model`, see `forward_golden.rs`) and burn's `Flex` CPU backend in f32.
//!
//! Four sequences of different prompt lengths (the fixtures' reference prompts, a prefix and a splice of them) share
//! one cache of 4-token blocks. Three prefill together in one mixed batch; then greedy decode steps run in batches
//! that sequences leave (one finishes early and is released mid-run) and join (one starts late, its prompt split in
//! two prefill chunks mixed into decode batches, between decode rows). So both attention paths run: the decode rows'
//! key-padded batch and the per-sequence prefill chunks, with rows put back in order. Steps alternate between all-rows
//! and last-row logits. Checks, with `max|a - b| / max|b|` per logit row:
//! - every row equals the same position of the sequence's one-by-one `forward_cached` run within 1e-5, and the
//!   greedy tokens are identical;
//! - every row equals the full-form forward of the whole sequence within 1e-4;
//! - released blocks return to the pool; a step the free blocks cannot cover is an error that changes nothing.

mod common;

use common::{argmax, fixture, host, ids, scaled_error};

use burn::backend::Flex;
use eyrie_model::DeepseekV3;
use eyrie_model::deepseek_v3::{BatchEntry, LogitRows};
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::quant::SafetensorsFile;

/// Batched vs one-by-one (same absorbed math, different row sets).
const SAME_PATH_TOLERANCE: f32 = 1e-5;
/// Absorbed vs full form (different association of the attention products).
const FULL_FORM_TOLERANCE: f32 = 1e-4;
const BLOCK_SIZE: usize = 4;
const NUM_BLOCKS: usize = 40;

/// One sequence of the scenario.
struct Plan {
    prompt: Vec<u32>,
    /// Prefill chunk sizes (summing to the prompt length).
    chunks: Vec<usize>,
    /// The batched step its first chunk enters.
    join: usize,
    /// Decode steps after the prefill (each feeds the previous greedy token).
    decode_steps: usize,
}

/// What one run of a sequence produced: logit rows by position (`None` where a last-row step skipped it) and the
/// greedy token after every forward.
struct Run {
    rows: Vec<Option<Vec<f32>>>,
    greedy: Vec<u32>,
}

fn plans(reference: &SafetensorsFile) -> Vec<Plan> {
    let (p0, p1) = (ids(reference, "tokens.0"), ids(reference, "tokens.1"));
    let splice: Vec<u32> = p0[3..].iter().chain(&p1[..4]).copied().collect();
    vec![
        Plan { prompt: p0.clone(), chunks: vec![p0.len()], join: 0, decode_steps: 10 },
        // Starts late, its prefill in two chunks mixed into decode batches (between decode rows, so the batched
        // decode attention's rows are put back in order around it).
        Plan { prompt: splice.clone(), chunks: vec![5, splice.len() - 5], join: 3, decode_steps: 8 },
        // Finishes early: released while the others go on.
        Plan { prompt: p1.clone(), chunks: vec![p1.len()], join: 0, decode_steps: 3 },
        Plan { prompt: p1[..5].to_vec(), chunks: vec![5], join: 0, decode_steps: 10 },
    ]
}

/// Each sequence alone: prefill, then one `forward_cached` per decode step.
fn one_by_one(model: &DeepseekV3<Flex>, plan: &Plan, cache: &mut PagedMlaCache<Flex>) -> Run {
    let device = Default::default();
    let vocab = model.config.vocab_size;
    let mut seq = SequenceCache::default();
    let logits = host(model.forward_cached(&plan.prompt, cache, &mut seq, &device).unwrap());
    let mut rows: Vec<Option<Vec<f32>>> = logits.chunks(vocab).map(|r| Some(r.to_vec())).collect();
    let mut greedy = vec![argmax(&logits[logits.len() - vocab..])];
    for _ in 0..plan.decode_steps {
        let logits = host(model.forward_cached(&[*greedy.last().unwrap()], cache, &mut seq, &device).unwrap());
        greedy.push(argmax(&logits));
        rows.push(Some(logits));
    }
    cache.release(seq);
    Run { rows, greedy }
}

struct State {
    seq: SequenceCache,
    input: Vec<u32>,
    next_chunk: usize,
    fed: usize,
    decoded: usize,
    done: bool,
    run: Run,
}

/// All sequences through `forward_batch`, joining and leaving as planned.
fn batched(model: &DeepseekV3<Flex>, plans: &[Plan], cache: &mut PagedMlaCache<Flex>) -> Vec<Run> {
    let device = Default::default();
    let vocab = model.config.vocab_size;
    let mut states: Vec<State> = plans
        .iter()
        .map(|p| State {
            seq: SequenceCache::default(),
            input: Vec::new(),
            next_chunk: 0,
            fed: 0,
            decoded: 0,
            done: false,
            run: Run { rows: vec![None; p.prompt.len() + p.decode_steps], greedy: Vec::new() },
        })
        .collect();
    let mut step = 0;
    while states.iter().any(|s| !s.done) {
        // Pick this step's input of every active sequence.
        let mut members = Vec::new();
        for (i, (s, p)) in states.iter_mut().zip(plans).enumerate() {
            if s.done || step < p.join {
                continue;
            }
            s.input = if s.next_chunk < p.chunks.len() {
                let chunk = p.prompt[s.fed..s.fed + p.chunks[s.next_chunk]].to_vec();
                s.next_chunk += 1;
                chunk
            } else {
                vec![*s.run.greedy.last().unwrap()]
            };
            members.push(i);
        }
        if step == 0 {
            assert_eq!(members.len(), 3, "three prefills in the first batch");
        }
        let rows = if step % 2 == 0 { LogitRows::All } else { LogitRows::Last };
        let logits = {
            let mut batch: Vec<BatchEntry> = states
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| members.contains(i))
                .map(|(_, s)| BatchEntry { seq: &mut s.seq, tokens: &s.input })
                .collect();
            host(model.forward_batch(&mut batch, cache, rows, &device).unwrap())
        };
        let mut offset = 0;
        for &i in &members {
            let (s, p) = (&mut states[i], &plans[i]);
            let n = s.input.len();
            let taken = if rows == LogitRows::All { n } else { 1 };
            let mine = &logits[offset * vocab..(offset + taken) * vocab];
            offset += taken;
            for (k, row) in mine.chunks(vocab).enumerate() {
                s.run.rows[s.fed + n - taken + k] = Some(row.to_vec());
            }
            s.fed += n;
            assert_eq!(s.seq.len, s.fed);
            if s.fed > p.prompt.len() {
                s.decoded += 1;
            }
            if s.fed >= p.prompt.len() {
                s.run.greedy.push(argmax(&mine[mine.len() - vocab..]));
            }
            if s.decoded == p.decode_steps {
                s.done = true;
                let before = cache.free_blocks();
                let seq = std::mem::take(&mut s.seq);
                let blocks = seq.blocks.len();
                assert_eq!(blocks, s.fed.div_ceil(BLOCK_SIZE));
                cache.release(seq);
                assert_eq!(cache.free_blocks(), before + blocks, "releasing a sequence frees its blocks");
            }
        }
        assert_eq!(offset * vocab, logits.len());
        step += 1;
    }
    states.into_iter().map(|s| s.run).collect()
}

fn check_fixture(name: &str) {
    let device = Default::default();
    let dir = fixture(name);
    let model = DeepseekV3::<Flex>::load(&dir, &device).unwrap();
    let reference = SafetensorsFile::open(dir.join("reference.safetensors")).unwrap();
    let vocab = model.config.vocab_size;
    let plans = plans(&reference);
    let mut cache = PagedMlaCache::<Flex>::new(&model.config, NUM_BLOCKS, BLOCK_SIZE, &device).unwrap();

    let alone: Vec<Run> = plans.iter().map(|p| one_by_one(&model, p, &mut cache)).collect();
    assert_eq!(cache.free_blocks(), NUM_BLOCKS);
    let together = batched(&model, &plans, &mut cache);
    assert_eq!(cache.free_blocks(), NUM_BLOCKS, "{name}: every block returned");

    let (mut worst_same, mut worst_full, mut compared) = (0.0f32, 0.0f32, 0);
    for (i, ((plan, a), b)) in plans.iter().zip(&alone).zip(&together).enumerate() {
        assert_eq!(b.greedy, a.greedy, "{name} sequence {i}: greedy tokens differ");
        assert_eq!(b.greedy.len(), plan.decode_steps + 1);
        // The whole sequence as fed: prompt and every greedy token but the last.
        let tokens: Vec<u32> = plan.prompt.iter().chain(&a.greedy[..plan.decode_steps]).copied().collect();
        let full = host(model.forward(model.token_tensor(&[&tokens], &device).unwrap()));
        for (pos, row) in b.rows.iter().enumerate() {
            let Some(row) = row else { continue };
            let alone_row = a.rows[pos].as_ref().unwrap();
            let err = scaled_error(row, alone_row);
            assert!(err <= SAME_PATH_TOLERANCE, "{name} sequence {i} position {pos}: batched vs alone {err:e}");
            worst_same = worst_same.max(err);
            let err = scaled_error(row, &full[pos * vocab..(pos + 1) * vocab]);
            assert!(err <= FULL_FORM_TOLERANCE, "{name} sequence {i} position {pos}: batched vs full {err:e}");
            worst_full = worst_full.max(err);
            compared += 1;
        }
        // Every decode step's row is there (all-rows or last-row steps both return it).
        assert!(b.rows[plan.prompt.len()..].iter().all(Option::is_some));
    }
    println!(
        "{name}: {compared} rows; batched vs one-by-one {worst_same:.2e}, batched vs full form {worst_full:.2e}; \
         greedy equal"
    );
}

#[test]
fn yarn_qlora_batched_equals_one_by_one() {
    check_fixture("yarn_qlora");
}

#[test]
fn int4_experts_batched_equals_one_by_one() {
    check_fixture("int4_experts");
}

#[test]
fn v2lite_batched_equals_one_by_one() {
    check_fixture("v2lite");
}

#[test]
fn kimi_k25_batched_equals_one_by_one() {
    check_fixture("kimi_k25");
}

#[test]
fn a_step_the_cache_cannot_hold_is_an_error_that_changes_nothing() {
    let device = Default::default();
    let model = DeepseekV3::<Flex>::load(fixture("v2lite"), &device).unwrap();
    let mut cache = PagedMlaCache::<Flex>::new(&model.config, 3, BLOCK_SIZE, &device).unwrap();
    let (mut a, mut b) = (SequenceCache::default(), SequenceCache::default());
    model.forward_cached(&[1, 2, 3, 4, 5], &mut cache, &mut a, &device).unwrap();
    assert_eq!(cache.free_blocks(), 1);
    // Each of the two would fit alone (one block each), not both together.
    let (a_before, b_before) = (a.clone(), b.clone());
    let err = model
        .forward_batch(
            &mut [BatchEntry { seq: &mut a, tokens: &[6, 7, 8, 9] }, BatchEntry { seq: &mut b, tokens: &[1] }],
            &mut cache,
            LogitRows::Last,
            &device,
        )
        .unwrap_err();
    assert!(err.to_string().contains("KV cache full"), "{err}");
    assert_eq!((&a, &b, cache.free_blocks()), (&a_before, &b_before, 1), "a failed step takes no block");

    // Bad input fails before anything is reserved.
    let vocab = model.config.vocab_size as u32;
    for tokens in [&[][..], &[vocab][..]] {
        let err = model
            .forward_batch(&mut [BatchEntry { seq: &mut b, tokens }], &mut cache, LogitRows::All, &device)
            .unwrap_err();
        assert!(err.to_string().contains("token"), "{err}");
        assert_eq!((&b, cache.free_blocks()), (&b_before, 1));
    }
    assert!(model.forward_batch(&mut [], &mut cache, LogitRows::All, &device).is_err());

    // Releasing the finished sequence makes room for the other.
    cache.release(a);
    assert_eq!(cache.free_blocks(), 3);
    let logits = model
        .forward_batch(&mut [BatchEntry { seq: &mut b, tokens: &[1, 2] }], &mut cache, LogitRows::Last, &device)
        .unwrap();
    assert_eq!(logits.dims(), [1, model.config.vocab_size]);
    assert_eq!((b.len, cache.free_blocks()), (2, 2));
    cache.release(b);
    assert_eq!(cache.free_blocks(), 3);
}
