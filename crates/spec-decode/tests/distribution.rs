//! Rejection sampling is lossless: with temperature 1 on a 6-token vocabulary, the empirical joint distribution of
//! the first two tokens emitted by chain speculation (2 drafts per step from a Markov draft model q, verified
//! against a different Markov target p, both through `SamplingParams::probabilities` with top-k 4, so that each
//! gives zero mass to tokens the other proposes) matches the target's exact joint distribution by a chi-square test
//! at a fixed seed, and two deliberately wrong verifiers (resampling from p instead of the residual; accepting every
//! draft p allows) fail the same test. The same for tree verification: a depth-2 tree of the draft model's top-2
//! candidates per node (deterministic, q = 1), against the exact rule and a wrong one that does not remove a
//! rejected candidate's mass before trying its sibling.

use eyrie_model::sampling::{Sampler, SamplingParams};
use eyrie_spec_decode::verify::residual;
use eyrie_spec_decode::{ChainVerdict, TreeVerdict, verify_chain, verify_tree};

const V: usize = 6;
const SAMPLES: usize = 60_000;

fn params(seed: u64) -> SamplingParams {
    SamplingParams { temperature: Some(1.0), top_k: Some(4), seed, ..Default::default() }
}

/// Markov logits: the next token's logits given the previous token `prev`.
fn target_logits(prev: u32) -> Vec<f32> {
    (0..V).map(|t| (t as f32 * 1.7 + prev as f32 * 0.9).sin() * 1.5).collect()
}

fn draft_logits(prev: u32) -> Vec<f32> {
    (0..V).map(|t| (t as f32 * 0.8 + prev as f32 * 1.3).cos() * 1.2).collect()
}

type Verifier = fn(&[u32], &[Vec<f64>], &[Vec<f64>], &mut Sampler) -> ChainVerdict;

/// Draws `SAMPLES` speculative continuations of the token 0 and counts their first two tokens.
fn sample_pairs(verify: Verifier, seed: u64) -> Vec<u64> {
    let pp = params(seed);
    let mut sampler = Sampler::new(pp).unwrap();
    let mut counts = vec![0u64; V * V];
    for _ in 0..SAMPLES {
        let mut emitted: Vec<u32> = Vec::new();
        let mut prev = 0u32;
        while emitted.len() < 2 {
            let (mut drafts, mut q) = (Vec::new(), Vec::new());
            let mut last = prev;
            for _ in 0..2 {
                let probs = pp.probabilities(&draft_logits(last), &[]);
                last = sampler.draw(&probs);
                drafts.push(last);
                q.push(probs);
            }
            let mut p = Vec::new();
            let mut ctx = prev;
            for j in 0..=drafts.len() {
                p.push(pp.probabilities(&target_logits(ctx), &[]));
                if j < drafts.len() {
                    ctx = drafts[j];
                }
            }
            let verdict = verify(&drafts, &q, &p, &mut sampler);
            prev = *verdict.tokens.last().unwrap();
            emitted.extend(verdict.tokens);
        }
        counts[emitted[0] as usize * V + emitted[1] as usize] += 1;
    }
    counts
}

/// The target's exact joint distribution of the first two tokens after 0.
fn exact_pairs() -> Vec<f64> {
    let pp = params(0);
    let first = pp.probabilities(&target_logits(0), &[]);
    let mut joint = vec![0.0; V * V];
    for a in 0..V {
        let second = pp.probabilities(&target_logits(a as u32), &[]);
        for b in 0..V {
            joint[a * V + b] = first[a] * second[b];
        }
    }
    joint
}

/// Pearson's chi-square statistic and its degrees of freedom; an observation in a cell of zero probability makes
/// the statistic infinite.
fn chi_square(counts: &[u64], probs: &[f64]) -> (f64, usize) {
    let n: u64 = counts.iter().sum();
    let mut stat = 0.0;
    let mut cells = 0;
    for (&c, &p) in counts.iter().zip(probs) {
        let expected = p * n as f64;
        if expected == 0.0 {
            if c > 0 {
                return (f64::INFINITY, cells);
            }
            continue;
        }
        cells += 1;
        stat += (c as f64 - expected).powi(2) / expected;
    }
    (stat, cells - 1)
}

/// The chi-square critical value at significance 1e-3 (Wilson-Hilferty approximation).
fn critical(df: usize) -> f64 {
    let (k, z) = (df as f64, 3.09);
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

fn passes(verify: Verifier, seed: u64) -> (bool, f64, f64) {
    let (stat, df) = chi_square(&sample_pairs(verify, seed), &exact_pairs());
    let crit = critical(df);
    (stat <= crit, stat, crit)
}

/// Wrong: on rejection resample from p itself (over-represents the rejected draft's alternatives).
fn resample_from_p(drafts: &[u32], q: &[Vec<f64>], p: &[Vec<f64>], s: &mut Sampler) -> ChainVerdict {
    let mut tokens = Vec::new();
    for (j, &d) in drafts.iter().enumerate() {
        let (pd, qd) = (p[j][d as usize], q[j][d as usize]);
        if s.uniform() < (pd / qd).min(1.0) {
            tokens.push(d);
        } else {
            tokens.push(s.draw(&p[j]));
            return ChainVerdict { accepted: j, tokens };
        }
    }
    tokens.push(s.draw(&p[drafts.len()]));
    ChainVerdict { accepted: drafts.len(), tokens }
}

/// Wrong: accept any draft the target gives positive probability (no p/q test), residual otherwise.
fn accept_on_support(drafts: &[u32], q: &[Vec<f64>], p: &[Vec<f64>], s: &mut Sampler) -> ChainVerdict {
    let mut tokens = Vec::new();
    for (j, &d) in drafts.iter().enumerate() {
        if p[j][d as usize] > 0.0 {
            tokens.push(d);
        } else {
            tokens.push(s.draw(&residual(&p[j], &q[j])));
            return ChainVerdict { accepted: j, tokens };
        }
    }
    tokens.push(s.draw(&p[drafts.len()]));
    ChainVerdict { accepted: drafts.len(), tokens }
}

#[test]
fn speculative_samples_follow_the_target_distribution() {
    // The supports differ: some drafts have p = 0 (always rejected) and some target tokens have q = 0 (reachable
    // only through the residual), so both branches of the rule matter.
    let pp = params(0);
    let (p, q) = (pp.probabilities(&target_logits(0), &[]), pp.probabilities(&draft_logits(0), &[]));
    assert!((0..V).any(|t| p[t] == 0.0 && q[t] > 0.0) && (0..V).any(|t| q[t] == 0.0 && p[t] > 0.0));

    let (ok, stat, crit) = passes(verify_chain, 7);
    println!("verify_chain: chi2 {stat:.1} (critical {crit:.1})");
    assert!(ok, "the exact verifier fails the chi-square test: {stat} > {crit}");
}

#[test]
fn wrong_verifiers_fail_the_test() {
    for (name, v) in [("resample from p", resample_from_p as Verifier), ("accept on support", accept_on_support)] {
        let (ok, stat, crit) = passes(v, 7);
        println!("{name}: chi2 {stat:.1} (critical {crit:.1})");
        assert!(!ok, "the wrong verifier '{name}' passed the chi-square test ({stat} <= {crit}): the test is too weak");
    }
}

type TreeVerifier = fn(&[u32], &[usize], &[Vec<f64>], &mut Sampler) -> TreeVerdict;

/// The two most probable draft tokens after `prev` (ties to the lower id).
fn top2(prev: u32) -> [u32; 2] {
    let q = params(0).probabilities(&draft_logits(prev), &[]);
    let mut ids: Vec<usize> = (0..V).collect();
    ids.sort_by(|&a, &b| q[b].total_cmp(&q[a]).then(a.cmp(&b)));
    [ids[0] as u32, ids[1] as u32]
}

/// Like [`sample_pairs`] with trees: root `prev`, its top-2 draft children, and the top-2 children of each.
fn sample_pairs_tree(verify: TreeVerifier, seed: u64) -> Vec<u64> {
    let pp = params(seed);
    let mut sampler = Sampler::new(pp).unwrap();
    let mut counts = vec![0u64; V * V];
    for _ in 0..SAMPLES {
        let mut emitted: Vec<u32> = Vec::new();
        let mut prev = 0u32;
        while emitted.len() < 2 {
            let mut tokens = vec![prev];
            let mut parents = vec![0];
            for c in top2(prev) {
                tokens.push(c);
                parents.push(0);
            }
            for parent in [1, 2] {
                for c in top2(tokens[parent]) {
                    tokens.push(c);
                    parents.push(parent);
                }
            }
            // The target's distribution after each node depends on the node's token (Markov).
            let p: Vec<Vec<f64>> = tokens.iter().map(|&t| pp.probabilities(&target_logits(t), &[])).collect();
            let verdict = verify(&tokens, &parents, &p, &mut sampler);
            prev = *verdict.tokens.last().unwrap();
            emitted.extend(verdict.tokens);
        }
        counts[emitted[0] as usize * V + emitted[1] as usize] += 1;
    }
    counts
}

/// Wrong: a rejected candidate keeps its mass when the sibling is tried and in the final draw.
fn no_renormalization(tokens: &[u32], parents: &[usize], p: &[Vec<f64>], s: &mut Sampler) -> TreeVerdict {
    let mut path = vec![0];
    let mut emitted = Vec::new();
    let mut cur = 0;
    'descend: loop {
        for child in (cur + 1..tokens.len()).filter(|&c| parents[c] == cur) {
            if s.uniform() < p[cur][tokens[child] as usize] {
                path.push(child);
                emitted.push(tokens[child]);
                cur = child;
                continue 'descend;
            }
        }
        emitted.push(s.draw(&p[cur]));
        return TreeVerdict { path, tokens: emitted };
    }
}

fn tree_passes(verify: TreeVerifier, seed: u64) -> (bool, f64, f64) {
    let (stat, df) = chi_square(&sample_pairs_tree(verify, seed), &exact_pairs());
    let crit = critical(df);
    (stat <= crit, stat, crit)
}

#[test]
fn tree_verification_follows_the_target_distribution_and_a_wrong_rule_fails() {
    let (ok, stat, crit) = tree_passes(verify_tree, 11);
    println!("verify_tree: chi2 {stat:.1} (critical {crit:.1})");
    assert!(ok, "the exact tree verifier fails the chi-square test: {stat} > {crit}");
    let (ok, stat, crit) = tree_passes(no_renormalization, 11);
    println!("no renormalization: chi2 {stat:.1} (critical {crit:.1})");
    assert!(!ok, "the wrong tree verifier passed the chi-square test ({stat} <= {crit})");
}
