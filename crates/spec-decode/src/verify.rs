//! Lossless verification of a drafted chain (Leviathan et al., "Fast Inference from Transformers via Speculative
//! Decoding", arXiv:2211.17192, Algorithm 1; Chen et al., arXiv:2302.01318), on the host over probability vectors.
//!
//! For drafts `d_1..d_k` drawn from `q_1..q_k` and the target's distributions `p_1..p_{k+1}` at the same positions
//! (both from `SamplingParams::probabilities`, the same processing for both): draft `d_j` is accepted with probability
//! `min(1, p_j(d_j) / q_j(d_j))`; at the first rejection the token is drawn from the residual
//! `max(0, p_j - q_j)` normalized and the chain stops; when all `k` are accepted a bonus token is drawn from
//! `p_{k+1}`. Every emitted token is then distributed exactly as the target would have sampled it.
//!
//! Greedy decoding is the same rule on one-hot vectors: accept iff `d_j` is the target's argmax, otherwise emit
//! the argmax. No random number is drawn when the outcome is certain (ratio >= 1 or 0, one-hot draws), so greedy
//! verification consumes no randomness.

use eyrie_model::sampling::Sampler;

/// The outcome of verifying one chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainVerdict {
    /// Drafts accepted (a prefix of the chain).
    pub accepted: usize,
    /// The tokens to emit: the accepted drafts, then the resampled or bonus token (`accepted + 1` tokens).
    pub tokens: Vec<u32>,
}

/// Verifies drafts `drafts[j]` drawn from `q[j]` against the target's `p[j]` (`p` has one more row, for the bonus
/// token), drawing randomness from `sampler`. Rows are probability vectors over the same vocabulary.
///
/// # Panics
/// When `q` does not have one row per draft or `p` one more (a caller bug, not user input).
pub fn verify_chain(drafts: &[u32], q: &[Vec<f64>], p: &[Vec<f64>], sampler: &mut Sampler) -> ChainVerdict {
    assert_eq!(q.len(), drafts.len(), "one draft distribution per draft");
    assert_eq!(p.len(), drafts.len() + 1, "one target distribution per draft, plus the bonus row");
    let mut tokens = Vec::with_capacity(drafts.len() + 1);
    for (j, &d) in drafts.iter().enumerate() {
        let (pj, qj) = (&p[j], &q[j]);
        let (pd, qd) = (pj.get(d as usize).copied().unwrap_or(0.0), qj.get(d as usize).copied().unwrap_or(0.0));
        let accept = if pd <= 0.0 {
            false
        } else if qd <= 0.0 || pd >= qd {
            true
        } else {
            sampler.uniform() < pd / qd
        };
        if accept {
            tokens.push(d);
            continue;
        }
        let residual = residual(pj, qj);
        tokens.push(sampler.draw(&residual));
        return ChainVerdict { accepted: j, tokens };
    }
    tokens.push(sampler.draw(&p[drafts.len()]));
    ChainVerdict { accepted: drafts.len(), tokens }
}

/// `max(0, p - q)` normalized; `p` itself when the difference has no mass (then `p <= q` everywhere, which with
/// both summing to one means `p == q` up to rounding, and a rejection was a rounding event).
pub fn residual(p: &[f64], q: &[f64]) -> Vec<f64> {
    let mut r: Vec<f64> = p.iter().zip(q).map(|(&a, &b)| (a - b).max(0.0)).collect();
    let total: f64 = r.iter().sum();
    if total > 0.0 {
        r.iter_mut().for_each(|x| *x /= total);
        r
    } else {
        p.to_vec()
    }
}

/// The outcome of verifying one token tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeVerdict {
    /// Accepted node indices from the root (node 0, always kept) down.
    pub path: Vec<usize>,
    /// The tokens to emit: the accepted nodes' tokens (the root excluded), then the resampled or bonus token.
    pub tokens: Vec<u32>,
}

/// Verifies a token tree whose candidates were chosen deterministically (the drafter's top-k): `tokens[i]` with
/// `parents[i] < i` (node 0 = the root, the last emitted token), `p[i]` the target's distribution of the token
/// after node `i`'s path. At each node the children are tried in node order (SpecInfer / EAGLE's multi-candidate
/// rule with `q = 1`): child `x` is accepted with probability `r(x)`, `r` starting as `p` of the node; a rejected
/// `x` gets `r(x) = 0` and `r` is renormalized; when no child is accepted, a token is drawn from `r`. Emitted
/// tokens follow the target's distribution exactly; with one-hot `p` (greedy) it accepts the argmax child and
/// draws no randomness.
///
/// # Panics
/// When `parents` or `p` do not have one entry per node (a caller bug).
pub fn verify_tree(tokens: &[u32], parents: &[usize], p: &[Vec<f64>], sampler: &mut Sampler) -> TreeVerdict {
    assert!(parents.len() == tokens.len() && p.len() == tokens.len() && !tokens.is_empty(), "one entry per node");
    let mut path = vec![0];
    let mut emitted = Vec::new();
    let mut cur = 0;
    'descend: loop {
        let mut r = p[cur].clone();
        for child in (cur + 1..tokens.len()).filter(|&c| parents[c] == cur) {
            let x = tokens[child] as usize;
            let rx = r.get(x).copied().unwrap_or(0.0);
            if rx <= 0.0 {
                continue;
            }
            if rx >= 1.0 || sampler.uniform() < rx {
                path.push(child);
                emitted.push(tokens[child]);
                cur = child;
                continue 'descend;
            }
            r[x] = 0.0;
            let total: f64 = r.iter().sum();
            if total > 0.0 {
                r.iter_mut().for_each(|v| *v /= total);
            }
        }
        emitted.push(sampler.draw(&r));
        return TreeVerdict { path, tokens: emitted };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use eyrie_model::sampling::SamplingParams;

    fn one_hot(n: usize, i: usize) -> Vec<f64> {
        let mut v = vec![0.0; n];
        v[i] = 1.0;
        v
    }

    #[test]
    fn greedy_accepts_the_argmax_prefix_and_emits_the_target_choice() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        let p = vec![one_hot(5, 1), one_hot(5, 2), one_hot(5, 4)];
        let q = vec![one_hot(5, 1), one_hot(5, 3)];
        let v = verify_chain(&[1, 3], &q, &p, &mut s);
        assert_eq!(v, ChainVerdict { accepted: 1, tokens: vec![1, 2] });
        let v = verify_chain(&[1, 2], &[one_hot(5, 1), one_hot(5, 2)], &p, &mut s);
        assert_eq!(v, ChainVerdict { accepted: 2, tokens: vec![1, 2, 4] });
    }

    #[test]
    fn greedy_tree_follows_the_argmax_branch() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        // root -> {1: a=2, 2: b=3}; 2 -> {3: c=4}; target argmax: after root 3, after node 2 -> 0, after 3 -> 1.
        let tokens = [9, 2, 3, 4];
        let parents = [0, 0, 0, 2];
        let p = vec![one_hot(5, 3), one_hot(5, 0), one_hot(5, 0), one_hot(5, 1)];
        let v = verify_tree(&tokens, &parents, &p, &mut s);
        assert_eq!(v, TreeVerdict { path: vec![0, 2], tokens: vec![3, 0] });
        let p = vec![one_hot(5, 3), one_hot(5, 0), one_hot(5, 4), one_hot(5, 1)];
        assert_eq!(
            verify_tree(&tokens, &parents, &p, &mut s),
            TreeVerdict { path: vec![0, 2, 3], tokens: vec![3, 4, 1] }
        );
    }

    #[test]
    fn residual_is_the_normalized_positive_part() {
        let r = residual(&[0.5, 0.3, 0.2], &[0.2, 0.6, 0.2]);
        assert!((r[0] - 1.0).abs() < 1e-12 && r[1] == 0.0 && r[2] == 0.0);
        assert_eq!(residual(&[0.5, 0.5], &[0.5, 0.5]), vec![0.5, 0.5]);
    }
}
