//! The absorbed MLA over the paged compressed KV cache against the full form and against HF transformers
//! (`fixtures/model`, see `forward_golden.rs`), on burn's `Flex` CPU backend in f32.
//!
//! For every fixture, both prompts run as two sequences sharing one cache with 4-token blocks (so every sequence
//! spans several non-contiguous blocks): prefill each, then decode 32 greedy tokens alternating between them.
//! Checks, with the metric `max|a - b| / max|b| <= 1e-4` per tensor:
//! - the prefill logits equal transformers' logits;
//! - every decode step's logits equal the full-form forward's last-position logits over the whole sequence;
//! - the greedy tokens equal transformers' `generate(do_sample=False)`;
//! - released blocks return to the pool.

mod common;

use common::{argmax, host, ids, scaled_error};
use std::path::Path;

use burn::backend::Flex;
use eyrie_model::DeepseekV3;
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::quant::SafetensorsFile;

const TOLERANCE: f32 = 1e-4;

fn check_fixture(name: &str) {
    let device = Default::default();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/model").join(name);
    let model = DeepseekV3::<Flex>::load(&dir, &device).unwrap();
    let reference = SafetensorsFile::open(dir.join("reference.safetensors")).unwrap();
    let vocab = model.config.vocab_size;
    let mut cache = PagedMlaCache::<Flex>::new(&model.config, 32, 4, &device).unwrap();
    let (mut worst_prefill, mut worst_decode) = (0.0f32, 0.0f32);

    let mut seqs: Vec<(SequenceCache, Vec<u32>, Vec<u32>, u32)> = Vec::new();
    for p in 0..2 {
        let prompt = ids(&reference, &format!("tokens.{p}"));
        let mut seq = SequenceCache::default();
        let logits = host(model.forward_cached(&prompt, &mut cache, &mut seq, &device).unwrap());
        let want = reference.tensor(&format!("logits.{p}")).unwrap().to_f32_vec().unwrap();
        let err = scaled_error(&logits, &want);
        assert!(err <= TOLERANCE, "{name} prompt {p}: prefill logits error {err:e}");
        worst_prefill = worst_prefill.max(err);
        let next = argmax(&logits[logits.len() - vocab..]);
        seqs.push((seq, prompt, Vec::new(), next));
    }
    for step in 0..32 {
        for (p, (seq, tokens, generated, next)) in seqs.iter_mut().enumerate() {
            generated.push(*next);
            tokens.push(*next);
            if step == 31 {
                continue;
            }
            let logits = host(model.forward_cached(&[*next], &mut cache, seq, &device).unwrap());
            assert_eq!(seq.len, tokens.len());
            // The full form over the whole sequence, last position.
            let full = model.forward(model.token_tensor(&[tokens], &device).unwrap());
            let full = host(full.narrow(1, tokens.len() - 1, 1).reshape([vocab]));
            let err = scaled_error(&logits, &full);
            assert!(err <= TOLERANCE, "{name} prompt {p} step {step}: absorbed vs full error {err:e}");
            worst_decode = worst_decode.max(err);
            *next = argmax(&logits);
        }
    }
    for (p, (seq, _, generated, _)) in seqs.into_iter().enumerate() {
        assert_eq!(generated, ids(&reference, &format!("greedy.{p}")), "{name} prompt {p}: greedy tokens differ");
        assert!(seq.blocks.len() >= 10, "{name}: a sequence of {} tokens spans several blocks", seq.len);
        cache.release(seq);
    }
    assert_eq!(cache.free_blocks(), 32);
    println!("{name}: prefill vs HF {worst_prefill:.2e}, absorbed decode vs full {worst_decode:.2e}; greedy equal");
}

#[test]
fn yarn_qlora_cached() {
    check_fixture("yarn_qlora");
}

#[test]
fn v2lite_cached() {
    check_fixture("v2lite");
}

#[test]
fn int4_experts_cached() {
    check_fixture("int4_experts");
}

#[test]
fn kimi_k25_cached() {
    check_fixture("kimi_k25");
}

#[test]
fn a_full_cache_is_an_error_not_a_panic() {
    let device = Default::default();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/model/v2lite");
    let model = DeepseekV3::<Flex>::load(&dir, &device).unwrap();
    let mut cache = PagedMlaCache::<Flex>::new(&model.config, 2, 4, &device).unwrap();
    let mut seq = SequenceCache::default();
    model.forward_cached(&[1, 2, 3, 4, 5, 6, 7, 8], &mut cache, &mut seq, &device).unwrap();
    let err = model.forward_cached(&[9], &mut cache, &mut seq, &device).unwrap_err();
    assert!(err.to_string().contains("KV cache full"), "{err}");
    assert_eq!(seq.len, 8);
}
