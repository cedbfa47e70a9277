//! The paged cache's block reuse on a real model (fixture `yarn_qlora`, burn's `Flex` CPU backend in f32):
//! - prefix caching: a prompt that starts on another finished prompt's cached blocks
//!   ([`PagedMlaCache::start_with_prefix`]) gives the same logits and greedy continuation as computing it from
//!   scratch, and computes only the tokens past the shared blocks;
//! - truncation (speculative-decoding rollback): feeding tokens, cutting them off again with
//!   [`PagedMlaCache::truncate`] and feeding others gives the same logits as never having fed the first ones;
//! - accounting: after every sequence is released all blocks are available again.

mod common;

use common::{argmax, fixture, host, ids, scaled_error};

use burn::backend::Flex;
use eyrie_model::DeepseekV3;
use eyrie_model::deepseek_v3::{BatchEntry, LogitRows};
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::quant::SafetensorsFile;

/// The same absorbed math over the same cached values, different step boundaries.
const TOLERANCE: f32 = 1e-5;
const BLOCK_SIZE: usize = 4;

fn step(
    model: &DeepseekV3<Flex>,
    cache: &mut PagedMlaCache<Flex>,
    seq: &mut SequenceCache,
    tokens: &[u32],
) -> Vec<f32> {
    let device = Default::default();
    let mut batch = [BatchEntry { seq, tokens }];
    host(model.forward_batch(&mut batch, cache, LogitRows::Last, &device).unwrap())
}

/// Greedy-decodes `n` tokens after `first_logits`, returning the tokens.
fn decode(
    model: &DeepseekV3<Flex>,
    cache: &mut PagedMlaCache<Flex>,
    seq: &mut SequenceCache,
    first_logits: &[f32],
    n: usize,
) -> Vec<u32> {
    let mut out = vec![argmax(first_logits)];
    for _ in 1..n {
        let logits = step(model, cache, seq, &[*out.last().unwrap()]);
        out.push(argmax(&logits));
    }
    out
}

#[test]
fn prefix_reuse_and_truncation_equal_recomputation() {
    let device = Default::default();
    let model = DeepseekV3::<Flex>::load(fixture("yarn_qlora"), &device).unwrap();
    let reference = SafetensorsFile::open(fixture("yarn_qlora").join("reference.safetensors")).unwrap();
    let base: Vec<u32> = [ids(&reference, "tokens.0"), ids(&reference, "tokens.1")].concat();
    assert!(base.len() > 2 * BLOCK_SIZE, "the prompt must span full blocks");
    let mut cache = PagedMlaCache::<Flex>::new(&model.config, 64, BLOCK_SIZE, &device).unwrap();
    let total = cache.free_blocks();

    // A: the base prompt, registered for reuse, then released.
    let mut a = SequenceCache::default();
    let a_logits = step(&model, &mut cache, &mut a, &base);
    cache.register_prefix(&a, &base);
    cache.release(a);
    assert_eq!(cache.free_blocks(), total, "cached blocks count as available");

    // B: the base prompt's first 2 blocks plus other tokens; from scratch vs on the cached prefix.
    let shared = 2 * BLOCK_SIZE;
    let prompt_b: Vec<u32> = base[..shared].iter().chain(&[5, 9, 2]).copied().collect();
    let mut scratch = SequenceCache::default();
    let mut scratch_cache = PagedMlaCache::<Flex>::new(&model.config, 64, BLOCK_SIZE, &device).unwrap();
    let want = step(&model, &mut scratch_cache, &mut scratch, &prompt_b);
    let want_tokens = decode(&model, &mut scratch_cache, &mut scratch, &want, 6);

    let mut b = cache.start_with_prefix(&prompt_b);
    assert_eq!(b.len, shared, "two full blocks of the prompt were cached");
    assert_eq!(cache.block_pool().prefix_hit_tokens(), shared as u64);
    let rest = prompt_b[b.len..].to_vec();
    let got = step(&model, &mut cache, &mut b, &rest);
    let err = scaled_error(&got, &want);
    assert!(err <= TOLERANCE, "prefix-cached logits differ from recomputation by {err:e}");
    assert_eq!(decode(&model, &mut cache, &mut b, &got, 6), want_tokens);

    // The exact base prompt: everything but its last token's block run is reused, and its logits equal A's.
    let mut c = cache.start_with_prefix(&base);
    assert_eq!(c.len, (base.len() - 1) / BLOCK_SIZE * BLOCK_SIZE);
    let rest = base[c.len..].to_vec();
    let c_logits = step(&model, &mut cache, &mut c, &rest);
    let err = scaled_error(&c_logits, &a_logits);
    assert!(err <= TOLERANCE, "{err:e}");
    // A shared block's contents must never change: a cut inside one is refused and changes nothing.
    assert!(cache.truncate(&mut c, BLOCK_SIZE + 1).is_err());
    let beyond = c.len + 1;
    assert!(cache.truncate(&mut c, beyond).is_err(), "cannot grow by truncating");

    // Truncation: feed 5 speculative tokens past the prompt, roll back 4 of them, feed others.
    let mut d = SequenceCache::default();
    let _ = step(&model, &mut cache, &mut d, &prompt_b);
    let _ = step(&model, &mut cache, &mut d, &[1, 2, 3, 4, 5]);
    cache.truncate(&mut d, prompt_b.len() + 1).unwrap();
    assert_eq!(d.len, prompt_b.len() + 1);
    assert_eq!(d.blocks.len(), d.len.div_ceil(BLOCK_SIZE), "blocks past the end went back");
    let rolled = step(&model, &mut cache, &mut d, &[7, 8]);
    let mut e = SequenceCache::default();
    let straight: Vec<u32> = prompt_b.iter().chain(&[1, 7, 8]).copied().collect();
    let want = step(&model, &mut scratch_cache, &mut e, &straight);
    let err = scaled_error(&rolled, &want);
    assert!(err <= TOLERANCE, "logits after rollback differ by {err:e}");

    for seq in [b, c, d] {
        cache.release(seq);
    }
    assert_eq!(cache.free_blocks(), total, "every block is available again");
    assert!(cache.block_pool().cached() > 0, "finished prompts stay cached until evicted");
}
