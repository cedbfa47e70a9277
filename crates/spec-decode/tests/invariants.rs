//! Property tests of the acceptance rules and the tree builder: whatever the distributions, a chain verdict emits
//! its accepted prefix plus one token, every emitted token has target probability > 0 at its position, and greedy
//! (one-hot) verification draws no randomness; a drafted tree is topologically ordered, ancestor-closed, within its
//! node budget and depth, with distinct siblings.

use burn::backend::Flex;
use burn::tensor::Tensor;
use eyrie_model::sampling::{Sampler, SamplingParams};
use eyrie_spec_decode::{Drafter, Result, draft_tree, verify_chain, verify_tree};
use proptest::prelude::*;

fn normalize(v: Vec<f64>) -> Vec<f64> {
    let s: f64 = v.iter().sum();
    v.into_iter().map(|x| x / s).collect()
}

/// A probability vector over `n` tokens with some exact zeros.
fn dist(n: usize) -> impl Strategy<Value = Vec<f64>> {
    prop::collection::vec(prop_oneof![Just(0.0), 0.01f64..1.0], n)
        .prop_filter("some mass", |v| v.iter().any(|&x| x > 0.0))
        .prop_map(normalize)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn chain_verdicts_are_well_formed(
        k in 0usize..4,
        rows in prop::collection::vec((dist(5), dist(5)), 5),
        seed in any::<u64>(),
    ) {
        let p: Vec<Vec<f64>> = rows.iter().take(k + 1).map(|r| r.0.clone()).collect();
        let q: Vec<Vec<f64>> = rows.iter().take(k).map(|r| r.1.clone()).collect();
        let mut s = Sampler::new(SamplingParams { temperature: Some(1.0), seed, ..Default::default() }).unwrap();
        let drafts: Vec<u32> = q.iter().map(|qj| s.draw(qj)).collect();
        let v = verify_chain(&drafts, &q, &p, &mut s);
        prop_assert_eq!(v.tokens.len(), v.accepted + 1);
        prop_assert_eq!(&v.tokens[..v.accepted], &drafts[..v.accepted]);
        for (j, &t) in v.tokens.iter().enumerate() {
            prop_assert!(p[j][t as usize] > 0.0, "token {} at {} has p = 0", t, j);
        }
    }

    #[test]
    fn greedy_verification_draws_nothing(argmaxes in prop::collection::vec(0u32..5, 4), drafts in prop::collection::vec(0u32..5, 3)) {
        let one_hot = |i: u32| (0..5).map(|t| if t == i { 1.0 } else { 0.0 }).collect::<Vec<f64>>();
        let p: Vec<Vec<f64>> = argmaxes.iter().map(|&a| one_hot(a)).collect();
        let q: Vec<Vec<f64>> = drafts.iter().map(|&d| one_hot(d)).collect();
        let mut s = Sampler::new(SamplingParams { temperature: Some(1.0), seed: 3, ..Default::default() }).unwrap();
        let mut untouched = s.clone();
        let v = verify_chain(&drafts, &q, &p, &mut s);
        let accepted = drafts.iter().zip(&argmaxes).take_while(|(d, a)| d == a).count();
        prop_assert_eq!(v.accepted, accepted);
        prop_assert_eq!(v.tokens[accepted], argmaxes[accepted]);
        prop_assert_eq!(s.uniform(), untouched.uniform(), "greedy verification consumed randomness");
    }

    #[test]
    fn tree_verdicts_follow_edges(parents_seed in prop::collection::vec(0usize..100, 1..8), rows in prop::collection::vec(dist(5), 8), tokens in prop::collection::vec(0u32..5, 8), seed in any::<u64>()) {
        let n = parents_seed.len();
        let parents: Vec<usize> = (0..n).map(|i| if i == 0 { 0 } else { parents_seed[i] % i }).collect();
        let mut s = Sampler::new(SamplingParams { temperature: Some(1.0), seed, ..Default::default() }).unwrap();
        let v = verify_tree(&tokens[..n], &parents, &rows[..n], &mut s);
        prop_assert_eq!(v.path[0], 0);
        prop_assert_eq!(v.tokens.len(), v.path.len());
        for w in v.path.windows(2) {
            prop_assert_eq!(parents[w[1]], w[0]);
        }
        for (k, &t) in v.tokens.iter().enumerate() {
            prop_assert!(rows[v.path[k]][t as usize] > 0.0);
        }
    }

    #[test]
    fn drafted_trees_are_well_formed(depth in 1usize..4, topk in 1usize..4, budget in 1usize..10, salt in 0u32..50) {
        let mut d = Markov { salt };
        let mut state = vec![7u32];
        let tree = draft_tree::<Flex, _>(&mut d, &mut state, 7, depth, topk, budget).unwrap();
        prop_assert_eq!(state, vec![7u32], "the caller's state is left as it was");
        let n = tree.tokens.len();
        prop_assert!(n >= 1 && n <= budget.max(1));
        prop_assert_eq!(tree.tokens[0], 7);
        for i in 1..n {
            prop_assert!(tree.parents[i] < i);
            prop_assert_eq!(tree.depths[i], tree.depths[tree.parents[i]] + 1);
            prop_assert!(tree.depths[i] <= depth);
            for j in 1..i {
                if tree.parents[j] == tree.parents[i] {
                    prop_assert_ne!(tree.tokens[j], tree.tokens[i], "siblings must differ");
                }
            }
        }
    }
}

/// A host-only drafter whose logits depend on the last token (state = tokens fed since the root).
struct Markov {
    salt: u32,
}

impl Drafter<Flex> for Markov {
    type State = Vec<u32>;

    fn capture_ids(&self) -> &[usize] {
        &[]
    }

    fn new_state(&mut self) -> Self::State {
        Vec::new()
    }

    fn extend(&mut self, _: &mut Self::State, _: &[u32], _: u32, _: &[Tensor<Flex, 2>]) -> Result<()> {
        Ok(())
    }

    fn logits(&self, state: &Self::State) -> Result<Vec<f32>> {
        let last = *state.last().unwrap_or(&0);
        Ok((0..16u32).map(|t| ((t * 7 + last * 3 + self.salt) % 11) as f32 * 0.3).collect())
    }

    fn push(&mut self, state: &mut Self::State, token: u32) -> Result<()> {
        state.push(token);
        Ok(())
    }

    fn fork(&mut self, state: &Self::State) -> Result<Self::State> {
        Ok(state.clone())
    }
}
