//! Hidden-state capture on the batched path ([`DeepseekV3::forward_batch_capture`], the features EAGLE-3 drafts
//! from) against HF transformers' `output_hidden_states` in the committed fixtures (`fixtures/model`, see
//! `forward_golden.rs`: `hidden.{p}.{i}` is `hidden_states[i]`, the input of layer `i`, and `hidden.{p}.{L}` the
//! final normed state), on burn's `Flex` CPU backend in f32.
//!
//! The fixture's two prompts run as two sequences of one cache: both prefill all but their last few tokens in one
//! batch, then the remaining prompt tokens go in as forced decode steps (teacher forcing), both sequences per step,
//! so every captured row is at a known position. Capture ids `0..=L` (every layer input and the final normed state)
//! are gathered per prompt into `[n, d]` and must match the reference with `max|a - b| / max|b| <= 1e-4` per tensor;
//! the all-rows logits must too. Steps alternate all-rows and last-row logits (capture returns every new token's row
//! either way). Also: an out-of-range id is an error naming it and the valid range that changes nothing, and
//! `forward_batch` equals `forward_batch_capture`'s logits exactly.

mod common;

use burn::backend::Flex;
use eyrie_model::DeepseekV3;
use eyrie_model::deepseek_v3::{BatchEntry, LogitRows};
use eyrie_model::error::ModelError;
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::quant::SafetensorsFile;

use common::{fixture, host, ids, scaled_error};

const TOLERANCE: f32 = 1e-4;
const BLOCK_SIZE: usize = 4;
const NUM_BLOCKS: usize = 40;
/// Prompt tokens fed as single-token decode steps after the prefill.
const DECODE_STEPS: usize = 3;

/// `max |a - b| / max |b|`.
fn check_fixture(name: &str) {
    let device = Default::default();
    let dir = fixture(name);
    let model = DeepseekV3::<Flex>::load(&dir, &device).unwrap();
    let reference = SafetensorsFile::open(dir.join("reference.safetensors")).unwrap();
    let (d, vocab, layers) = (model.config.hidden_size, model.config.vocab_size, model.config.num_hidden_layers);
    let capture: Vec<usize> = (0..=layers).collect();
    let prompts = [ids(&reference, "tokens.0"), ids(&reference, "tokens.1")];
    for p in &prompts {
        assert!(p.len() > DECODE_STEPS, "{name}: prompt too short");
    }
    let mut cache = PagedMlaCache::<Flex>::new(&model.config, NUM_BLOCKS, BLOCK_SIZE, &device).unwrap();
    let mut seqs = [SequenceCache::default(), SequenceCache::default()];
    // hidden[p][c] = captured rows of prompt p at capture id capture[c], [n_p * d]; logits[p] likewise [n_p * vocab]
    // (only positions an all-rows step returned).
    let mut hidden: Vec<Vec<Vec<f32>>> =
        prompts.iter().map(|t| vec![vec![f32::NAN; t.len() * d]; capture.len()]).collect();
    let mut logits: Vec<Vec<Option<Vec<f32>>>> = prompts.iter().map(|t| vec![None; t.len()]).collect();
    let mut fed = [0usize; 2];

    for step in 0..=DECODE_STEPS {
        let inputs: Vec<&[u32]> = prompts
            .iter()
            .zip(&fed)
            .map(|(t, &f)| if step == 0 { &t[..t.len() - DECODE_STEPS] } else { &t[f..f + 1] })
            .collect();
        let rows = if step % 2 == 0 { LogitRows::All } else { LogitRows::Last };
        let (step_logits, step_hidden) = {
            let [a, b] = &mut seqs;
            let mut batch = [BatchEntry { seq: a, tokens: inputs[0] }, BatchEntry { seq: b, tokens: inputs[1] }];
            model.forward_batch_capture(&mut batch, &mut cache, rows, &capture, &device).unwrap()
        };
        let total: usize = inputs.iter().map(|t| t.len()).sum();
        assert_eq!(step_hidden.len(), capture.len());
        let step_logits = host(step_logits);
        let (mut row, mut logit_row) = (0, 0);
        for (p, input) in inputs.iter().enumerate() {
            let n = input.len();
            for (c, h) in step_hidden.iter().enumerate() {
                assert_eq!(h.dims(), [total, d]);
                let h = host(h.clone());
                hidden[p][c][fed[p] * d..(fed[p] + n) * d].copy_from_slice(&h[row * d..(row + n) * d]);
            }
            if rows == LogitRows::All {
                for k in 0..n {
                    let r = logit_row + k;
                    logits[p][fed[p] + k] = Some(step_logits[r * vocab..(r + 1) * vocab].to_vec());
                }
                logit_row += n;
            } else {
                logit_row += 1;
            }
            row += n;
            fed[p] += n;
            assert_eq!(seqs[p].len, fed[p]);
        }
        assert_eq!(logit_row * vocab, step_logits.len());
    }

    let (mut worst_hidden, mut worst_logits) = (0.0f32, 0.0f32);
    for (p, prompt) in prompts.iter().enumerate() {
        assert_eq!(fed[p], prompt.len());
        for (c, &i) in capture.iter().enumerate() {
            let want = reference.tensor(&format!("hidden.{p}.{i}")).unwrap().to_f32_vec().unwrap();
            let err = scaled_error(&hidden[p][c], &want);
            assert!(err <= TOLERANCE, "{name} prompt {p}: captured hidden_states[{i}] error {err:e}");
            worst_hidden = worst_hidden.max(err);
            if i > 0 {
                // Not vacuous: the neighbouring id's reference is far off (an off-by-one would fail above).
                let other = reference.tensor(&format!("hidden.{p}.{}", i - 1)).unwrap().to_f32_vec().unwrap();
                assert!(scaled_error(&hidden[p][c], &other) > 100.0 * TOLERANCE, "{name} prompt {p}: id {i}");
            }
        }
        let want = reference.tensor(&format!("logits.{p}")).unwrap().to_f32_vec().unwrap();
        for (pos, row) in logits[p].iter().enumerate() {
            let Some(row) = row else { continue };
            let err = scaled_error(row, &want[pos * vocab..(pos + 1) * vocab]);
            assert!(err <= TOLERANCE, "{name} prompt {p} position {pos}: logits error {err:e}");
            worst_logits = worst_logits.max(err);
        }
    }
    for seq in seqs {
        cache.release(seq);
    }
    assert_eq!(cache.free_blocks(), NUM_BLOCKS);
    println!("{name}: captured ids {capture:?}, max scaled error hidden {worst_hidden:.2e}, logits {worst_logits:.2e}");
}

#[test]
fn yarn_qlora_capture_matches_transformers_hidden_states() {
    check_fixture("yarn_qlora");
}

#[test]
fn int4_experts_capture_matches_transformers_hidden_states() {
    check_fixture("int4_experts");
}

#[test]
fn out_of_range_capture_is_an_error_that_changes_nothing() {
    let device = Default::default();
    let model = DeepseekV3::<Flex>::load(fixture("yarn_qlora"), &device).unwrap();
    let layers = model.config.num_hidden_layers;
    let mut cache = PagedMlaCache::<Flex>::new(&model.config, NUM_BLOCKS, BLOCK_SIZE, &device).unwrap();
    let mut a = SequenceCache::default();
    model.forward_cached(&[1, 2, 3], &mut cache, &mut a, &device).unwrap();
    let (a_before, free_before) = (a.clone(), cache.free_blocks());
    for bad in [layers + 1, usize::MAX] {
        let err = model
            .forward_batch_capture(
                &mut [BatchEntry { seq: &mut a, tokens: &[4, 5, 6] }],
                &mut cache,
                LogitRows::All,
                &[0, bad],
                &device,
            )
            .unwrap_err();
        assert!(matches!(err, ModelError::Input { .. }), "{err}");
        let text = err.to_string();
        assert!(text.contains(&format!("layer {bad}")) && text.contains(&format!("0..={layers}")), "{text}");
        assert_eq!((&a, cache.free_blocks()), (&a_before, free_before), "a failed step changes nothing");
    }

    // The same step through both entry points: identical logits; an empty capture list returns no tensors;
    // repeated ids are allowed.
    let (mut b, mut x, mut y) = (SequenceCache::default(), SequenceCache::default(), SequenceCache::default());
    model.forward_cached(&[1, 2, 3], &mut cache, &mut b, &device).unwrap();
    model.forward_cached(&[1, 2, 3], &mut cache, &mut x, &device).unwrap();
    model.forward_cached(&[1, 2, 3], &mut cache, &mut y, &device).unwrap();
    for rows in [LogitRows::All, LogitRows::Last] {
        let plain = host(
            model
                .forward_batch(
                    &mut [BatchEntry { seq: &mut x, tokens: &[4, 5] }, BatchEntry { seq: &mut a, tokens: &[7] }],
                    &mut cache,
                    rows,
                    &device,
                )
                .unwrap(),
        );
        let (captured, hidden) = model
            .forward_batch_capture(
                &mut [BatchEntry { seq: &mut y, tokens: &[4, 5] }, BatchEntry { seq: &mut b, tokens: &[7] }],
                &mut cache,
                rows,
                &[layers, 1, layers],
                &device,
            )
            .unwrap();
        assert_eq!(plain, host(captured), "{rows:?}: capture must not change the logits");
        assert_eq!(hidden.len(), 3);
        assert_eq!(host(hidden[0].clone()), host(hidden[2].clone()));
        assert!(hidden.iter().all(|h| h.dims() == [3, model.config.hidden_size]));
        let (_, none) = model
            .forward_batch_capture(
                &mut [BatchEntry { seq: &mut y, tokens: &[6] }],
                &mut cache,
                LogitRows::Last,
                &[],
                &device,
            )
            .unwrap();
        assert!(none.is_empty());
        model
            .forward_batch(&mut [BatchEntry { seq: &mut x, tokens: &[6] }], &mut cache, LogitRows::Last, &device)
            .unwrap();
    }
}
