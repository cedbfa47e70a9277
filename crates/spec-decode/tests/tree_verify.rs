//! eyrie-model's tree verification (`DeepseekV3::forward_tree_capture`, `keep_tree_path`) against chain forwards:
//! every node's logits and captured hidden states equal those of a plain cached forward of its root-to-node path
//! (the tree mask hides siblings and cousins), and after keeping a path that skips nodes, the next decode step
//! equals the one of a sequence that only ever saw that path. Two trees of different shapes in one batch.

mod common;

use burn::backend::Flex;
use eyrie_model::DeepseekV3;
use eyrie_model::deepseek_v3::{BatchEntry, LogitRows};
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::tree_verify::TreeEntry;

use common::{fixture, host, scaled_error};

/// Logits `[vocab]` of the last token and the captured rows of a plain cached run of `tokens` from scratch.
fn chain(target: &DeepseekV3<Flex>, tokens: &[u32], capture: &[usize]) -> (Vec<f32>, Vec<Vec<f32>>) {
    let device = Default::default();
    let mut cache = PagedMlaCache::new(&target.config, 32, 4, &device).unwrap();
    let mut seq = SequenceCache::default();
    let (logits, hidden) = target
        .forward_batch_capture(
            &mut [BatchEntry { seq: &mut seq, tokens }],
            &mut cache,
            LogitRows::Last,
            capture,
            &device,
        )
        .unwrap();
    let d = target.config.hidden_size;
    let n = tokens.len();
    (host(logits), hidden.into_iter().map(|h| host(h)[(n - 1) * d..].to_vec()).collect())
}

#[test]
fn tree_nodes_equal_their_chains_and_kept_paths_decode_like_chains() {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let (vocab, d) = (target.config.vocab_size, target.config.hidden_size);
    let capture = [0, 2, 3];
    let prompts: [&[u32]; 2] = [&[1, 17, 200, 45, 99], &[5, 250, 64]];
    // Tree A: root 7 -> {10, 11}; 10 -> {12}; 11 -> {13, 14}; 13 -> {15}. Tree B: root 3 -> {4}; 4 -> {5, 6}.
    let trees: [(&[u32], &[usize]); 2] =
        [(&[7, 10, 11, 12, 13, 14, 15], &[0, 0, 0, 1, 2, 2, 4]), (&[3, 4, 5, 6], &[0, 0, 1, 1])];
    let mut cache = PagedMlaCache::new(&target.config, 64, 4, &device).unwrap();
    let mut seqs = [SequenceCache::default(), SequenceCache::default()];
    for (seq, p) in seqs.iter_mut().zip(prompts) {
        target.forward_cached(p, &mut cache, seq, &device).unwrap();
    }
    let starts: Vec<usize> = seqs.iter().map(|s| s.len).collect();
    let (logits, hidden) = {
        let [a, b] = &mut seqs;
        let mut batch = [
            TreeEntry { seq: a, tokens: trees[0].0, parents: trees[0].1 },
            TreeEntry { seq: b, tokens: trees[1].0, parents: trees[1].1 },
        ];
        target.forward_tree_capture(&mut batch, &mut cache, &capture, &device).unwrap()
    };
    let (logits, hidden): (Vec<f32>, Vec<Vec<f32>>) = (host(logits), hidden.into_iter().map(host).collect());
    let mut row = 0;
    let mut worst = 0.0f32;
    for (t, (tokens, parents)) in trees.iter().enumerate() {
        for node in 0..tokens.len() {
            let mut path = vec![tokens[node]];
            let mut n = node;
            while n != 0 {
                n = parents[n];
                path.push(tokens[n]);
            }
            path.reverse();
            let full: Vec<u32> = prompts[t].iter().copied().chain(path).collect();
            let (want_logits, want_hidden) = chain(&target, &full, &capture);
            let r = row + node;
            let e = scaled_error(&logits[r * vocab..(r + 1) * vocab], &want_logits);
            assert!(e <= 1e-5, "tree {t} node {node}: logits error {e:e}");
            worst = worst.max(e);
            for (c, want) in want_hidden.iter().enumerate() {
                let e = scaled_error(&hidden[c][r * d..(r + 1) * d], want);
                assert!(e <= 1e-5, "tree {t} node {node} capture {}: error {e:e}", capture[c]);
            }
        }
        row += tokens.len();
    }
    println!("tree vs chain: max scaled logit error {worst:e}");

    // Keep root -> 11 -> 13 -> 15 of tree A and root -> 4 -> 6 of tree B, then decode one more token each.
    let paths: [&[usize]; 2] = [&[0, 2, 4, 6], &[0, 1, 3]];
    for (t, seq) in seqs.iter_mut().enumerate() {
        target.keep_tree_path(&mut cache, seq, starts[t], trees[t].0.len(), paths[t]).unwrap();
        assert_eq!(seq.len, starts[t] + paths[t].len());
        let next = 42;
        let got = host(target.forward_cached(&[next], &mut cache, seq, &device).unwrap());
        let full: Vec<u32> =
            prompts[t].iter().copied().chain(paths[t].iter().map(|&n| trees[t].0[n])).chain([next]).collect();
        let (want, _) = chain(&target, &full, &[]);
        let e = scaled_error(&got, &want);
        assert!(e <= 1e-5, "tree {t}: decode after the kept path: error {e:e}");
    }
    for seq in seqs {
        cache.release(seq);
    }
    assert_eq!(cache.free_blocks(), 64);
}

#[test]
fn malformed_trees_are_errors_that_take_no_block() {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let mut cache = PagedMlaCache::new(&target.config, 8, 4, &device).unwrap();
    let mut seq = SequenceCache::default();
    for parents in [&[0usize, 1][..], &[0][..]] {
        let mut batch = [TreeEntry { seq: &mut seq, tokens: &[1, 2], parents }];
        let err = target.forward_tree_capture(&mut batch, &mut cache, &[], &device).unwrap_err().to_string();
        assert!(err.contains("parent"), "{err}");
    }
    assert_eq!(cache.free_blocks(), 8);
}
