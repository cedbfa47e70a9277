//! Tree drafting (EAGLE-2, Li et al. arXiv:2406.16858; SGLang's `--speculative-eagle-topk` /
//! `--speculative-num-draft-tokens`): expand a token tree from the drafter's distributions and keep its most
//! probable nodes.
//!
//! Depth 1 holds the root's top-`topk` tokens; at each further depth the `topk` best nodes of the previous depth
//! (by cumulative draft log-probability) are expanded with their own top-`topk` tokens, up to `depth` levels. The
//! `num_draft_tokens - 1` best nodes of all levels (each with its parent, which scores at least as high) form the
//! tree, with the root in front. Candidates are chosen deterministically, so [`crate::verify::verify_tree`]'s rule
//! (q = 1) keeps the target distribution.

use burn::tensor::backend::Backend;

use crate::drafter::Drafter;
use crate::error::{Result, SpecError};

/// A drafted token tree in topological order.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftTree {
    /// Node tokens; node 0 is the root (the last emitted token).
    pub tokens: Vec<u32>,
    /// `parents[i] < i` for `i >= 1`; `parents[0] = 0`.
    pub parents: Vec<usize>,
    /// Depth of each node (root 0).
    pub depths: Vec<usize>,
}

impl DraftTree {
    /// The deepest level.
    pub fn depth(&self) -> usize {
        self.depths.iter().copied().max().unwrap_or(0)
    }
}

/// Log-softmax in f64 of one logits row.
fn log_probs(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().filter(|v| v.is_finite()).fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
    let lse = max + logits.iter().filter(|v| v.is_finite()).map(|&v| (f64::from(v) - max).exp()).sum::<f64>().ln();
    logits.iter().map(|&v| if v.is_finite() { f64::from(v) - lse } else { f64::NEG_INFINITY }).collect()
}

/// The `k` best finite entries, best first, ties to the lower id.
fn top_k(values: &[f64], k: usize) -> Vec<(u32, f64)> {
    let mut ids: Vec<usize> = (0..values.len()).filter(|&i| values[i].is_finite()).collect();
    ids.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    ids.into_iter().take(k).map(|i| (i as u32, values[i])).collect()
}

struct Candidate {
    token: u32,
    parent: usize,
    score: f64,
    depth: usize,
}

/// Drafts a tree after `root` from `state` (positioned after an extend: its logits are the root's children's),
/// leaving `state` as it was. `num_draft_tokens` counts the root.
pub fn draft_tree<B: Backend, D: Drafter<B>>(
    drafter: &mut D,
    state: &mut D::State,
    root: u32,
    depth: usize,
    topk: usize,
    num_draft_tokens: usize,
) -> Result<DraftTree> {
    if topk == 0 || num_draft_tokens == 0 {
        return Err(SpecError::input("tree drafting needs topk >= 1 and num_draft_tokens >= 1"));
    }
    // Node 0 is the root; candidate i + 1 is cands[i].
    let mut cands: Vec<Candidate> = Vec::new();
    // (node id, its state, score) for the nodes to expand at the next level; the root uses `state` itself.
    let mut frontier: Vec<(usize, Option<D::State>, f64)> = vec![(0, None, 0.0)];
    let mut forks: Vec<D::State> = Vec::new();
    for level in 1..=depth {
        let mut level_nodes = Vec::new();
        for (node, fork, score) in &frontier {
            let logits = match fork {
                Some(s) => drafter.logits(s)?,
                None => drafter.logits(state)?,
            };
            for (token, lp) in top_k(&log_probs(&logits), topk) {
                cands.push(Candidate { token, parent: *node, score: score + lp, depth: level });
                level_nodes.push(cands.len());
            }
        }
        if level == depth {
            break;
        }
        level_nodes.sort_by(|&a, &b| cands[b - 1].score.total_cmp(&cands[a - 1].score).then(a.cmp(&b)));
        let mut next = Vec::with_capacity(topk);
        for &node in level_nodes.iter().take(topk) {
            let c = &cands[node - 1];
            let parent_state = frontier.iter().find(|f| f.0 == c.parent).expect("the parent is in the frontier");
            let mut s = match &parent_state.1 {
                Some(p) => drafter.fork(p)?,
                None => drafter.fork(state)?,
            };
            drafter.push(&mut s, c.token)?;
            next.push((node, Some(s), c.score));
        }
        forks.extend(std::mem::take(&mut frontier).into_iter().filter_map(|f| f.1));
        frontier = next;
    }
    forks.extend(frontier.into_iter().filter_map(|f| f.1));
    for s in forks {
        drafter.release(s);
    }

    // The best nodes whose parents are kept (parents score >= children and come first among equals).
    let mut order: Vec<usize> = (1..=cands.len()).collect();
    order.sort_by(|&a, &b| cands[b - 1].score.total_cmp(&cands[a - 1].score).then(a.cmp(&b)));
    let mut kept = vec![false; cands.len() + 1];
    kept[0] = true;
    let mut count = 1;
    for node in order {
        if count >= num_draft_tokens {
            break;
        }
        if kept[cands[node - 1].parent] {
            kept[node] = true;
            count += 1;
        }
    }
    let mut new_id = vec![usize::MAX; cands.len() + 1];
    new_id[0] = 0;
    let mut tree = DraftTree { tokens: vec![root], parents: vec![0], depths: vec![0] };
    for node in 1..=cands.len() {
        if kept[node] {
            let c = &cands[node - 1];
            new_id[node] = tree.tokens.len();
            tree.tokens.push(c.token);
            tree.parents.push(new_id[c.parent]);
            tree.depths.push(c.depth);
        }
    }
    Ok(tree)
}
