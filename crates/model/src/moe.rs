//! DeepSeek-V3's Mixture-of-Experts block (arXiv:2412.19437 section 2.1.2): the auxiliary-loss-free `noaux_tc`
//! router and sparse expert dispatch, as transformers' `DeepseekV3TopkRouter` / `DeepseekV3MoE`.
//!
//! Router, per token (f32): `s = sigmoid(x W_gate^T)`; selection scores `s' = s + e_score_correction_bias` (the bias
//! only selects); group score = sum of the top-2 `s'` of each of `n_group` groups; the `topk_group` best groups are
//! kept and the other experts' `s'` set to -inf (transformers 5.24 masks with -inf; older versions used 0.0);
//! `idx = topk(s', k)`; weights `w = s[idx]` (unbiased), `w /= sum(w) + 1e-20` if `norm_topk_prob`, then
//! `w *= routed_scaling_factor`.
//!
//! Dispatch: the scores go to the host, the routing is decided there ([`route`], plain Rust), and each selected
//! expert runs once on exactly the tokens routed to it (gather with `select`, SwiGLU, scale by the weight,
//! scatter-add with `select_assign`). Unselected experts cost nothing. The shared expert runs on every token.

use burn::tensor::activation::sigmoid;
use burn::tensor::backend::Backend;
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData};

use crate::linear::Linear;
use crate::mlp::{Expert, Mlp};

/// The router's hyperparameters.
#[derive(Debug, Clone, PartialEq)]
pub struct RouterParams {
    /// Experts per token k.
    pub top_k: usize,
    /// Expert groups.
    pub n_group: usize,
    /// Groups kept per token.
    pub topk_group: usize,
    /// Renormalize the k weights.
    pub norm_topk_prob: bool,
    /// Multiplier of the weights.
    pub routed_scaling_factor: f32,
}

/// The routing of `n` tokens: `experts[t * k + j]` with weight `weights[t * k + j]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Selected expert ids, `[n, k]` row-major, best selection score first.
    pub experts: Vec<usize>,
    /// Their weights.
    pub weights: Vec<f32>,
}

/// `noaux_tc` routing on the host. `scores` are the sigmoid scores `[n, E]` row-major, `bias` the
/// `e_score_correction_bias` `[E]`. Ties go to the lower expert (or group) index.
pub fn route(scores: &[f32], bias: &[f32], p: &RouterParams) -> Routing {
    let e = bias.len();
    let per_group = e / p.n_group;
    let n = scores.len() / e;
    let desc = |v: &[f32]| {
        let mut order: Vec<usize> = (0..v.len()).collect();
        order.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
        order
    };
    let mut experts = Vec::with_capacity(n * p.top_k);
    let mut weights = Vec::with_capacity(n * p.top_k);
    for row in scores.chunks_exact(e) {
        let mut choice: Vec<f32> = row.iter().zip(bias).map(|(s, b)| s + b).collect();
        // Group score: the sum of each group's two best selection scores.
        let group_scores: Vec<f32> = choice
            .chunks_exact(per_group)
            .map(|g| {
                let o = desc(g);
                g[o[0]] + g[o[1]]
            })
            .collect();
        let kept = &desc(&group_scores)[..p.topk_group];
        for (g, chunk) in choice.chunks_exact_mut(per_group).enumerate() {
            if !kept.contains(&g) {
                chunk.fill(f32::NEG_INFINITY);
            }
        }
        let idx = &desc(&choice)[..p.top_k];
        let mut w: Vec<f32> = idx.iter().map(|&i| row[i]).collect();
        if p.norm_topk_prob {
            let denom = w.iter().sum::<f32>() + 1e-20;
            w.iter_mut().for_each(|x| *x /= denom);
        }
        w.iter_mut().for_each(|x| *x *= p.routed_scaling_factor);
        experts.extend_from_slice(idx);
        weights.extend(w);
    }
    Routing { experts, weights }
}

/// One MoE block: router, routed experts, shared expert.
#[derive(Debug, Clone)]
pub struct Moe<B: Backend> {
    /// `mlp.gate.weight` `[E, d]`.
    pub gate: Linear<B>,
    /// `mlp.gate.e_score_correction_bias` `[E]`, kept on the host where routing happens.
    pub e_score_correction_bias: Vec<f32>,
    /// `mlp.experts.{e}`.
    pub experts: Vec<Expert<B>>,
    /// `mlp.shared_experts` (intermediate `moe_intermediate_size * n_shared_experts`).
    pub shared_experts: Mlp<B>,
    /// Router hyperparameters.
    pub params: RouterParams,
}

impl<B: Backend> Moe<B> {
    /// The routing of `x` `[n, d]` (one host read of the `[n, E]` scores).
    pub fn routing(&self, x: Tensor<B, 2>) -> Routing {
        // [n, E]
        let scores = sigmoid(self.gate.forward(x));
        let host = scores.into_data().convert::<f32>().to_vec::<f32>().expect("f32 data after convert");
        route(&host, &self.e_score_correction_bias, &self.params)
    }

    /// `[n, d] -> [n, d]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let [n, d] = x.dims();
        let device = x.device();
        let routing = self.routing(x.clone());
        let k = self.params.top_k;
        // Tokens and weights per expert, in token order.
        let mut per_expert: Vec<(Vec<i64>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); self.experts.len()];
        for (slot, (&e, &w)) in routing.experts.iter().zip(&routing.weights).enumerate() {
            per_expert[e].0.push((slot / k) as i64);
            per_expert[e].1.push(w);
        }
        let mut out = Tensor::<B, 2>::zeros([n, d], &device);
        for (expert, (tokens, weights)) in self.experts.iter().zip(per_expert) {
            if tokens.is_empty() {
                continue;
            }
            let m = tokens.len();
            let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(tokens, [m]), &device);
            // [m, d]
            let xe = x.clone().select(0, idx.clone());
            let w = Tensor::<B, 2>::from_data(TensorData::new(weights, [m, 1]), &device);
            let ye = expert.forward(xe) * w;
            out = out.select_assign(0, idx, ye, IndexingUpdateOp::Add);
        }
        out + self.shared_experts.forward(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(top_k: usize, n_group: usize, topk_group: usize, norm: bool) -> RouterParams {
        RouterParams { top_k, n_group, topk_group, norm_topk_prob: norm, routed_scaling_factor: 2.5 }
    }

    #[test]
    fn bias_selects_but_does_not_weigh() {
        let scores = [0.9, 0.8, 0.1, 0.2];
        let bias = [0.0, 0.0, 1.0, 0.0];
        let r = route(&scores, &bias, &params(2, 1, 1, false));
        assert_eq!(r.experts, vec![2, 0]);
        assert_eq!(r.weights, vec![0.1 * 2.5, 0.9 * 2.5]);
        let r = route(&scores, &bias, &params(2, 1, 1, true));
        let s = 0.1f32 + 0.9 + 1e-20;
        assert_eq!(r.weights, vec![0.1 / s * 2.5, 0.9 / s * 2.5]);
    }

    #[test]
    fn groups_are_ranked_by_their_top_two_sum_and_masked() {
        // 4 groups of 2. Group 0 has the single best expert but a weak partner; groups 1 and 2 win on the sum.
        let scores = [0.99, 0.0, 0.6, 0.6, 0.5, 0.55, 0.3, 0.3];
        let bias = [0.0; 8];
        let r = route(&scores, &bias, &params(2, 4, 2, false));
        assert_eq!(r.experts, vec![2, 3]);
        let r = route(&scores, &bias, &params(3, 4, 2, false));
        assert_eq!(r.experts, vec![2, 3, 5]);
        // One group: plain top-k.
        let r = route(&scores, &bias, &params(2, 1, 1, false));
        assert_eq!(r.experts, vec![0, 2]);
        // Two tokens.
        let two: Vec<f32> = scores.iter().chain(scores.iter().rev()).copied().collect();
        let r = route(&two, &bias, &params(1, 4, 2, false));
        assert_eq!(r.experts, vec![2, 4]);
    }
}
