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
//! scatter-add with `select_assign`), or, on CUDA, the fused INT4 kernel runs the layer's selected experts in
//! a few launches ([`crate::fused_moe`]). Unselected experts cost nothing. The shared expert runs on every token.
//!
//! On CUDA with fused experts the routing is chosen on the device instead ([`Moe::routed_on_device`]:
//! `eyrie_quant::cuda::router`'s top-k and grouping kernels, the same math and tie-breaking as [`route`]), so a
//! layer never waits for the host.

use burn::tensor::Tensor;
use burn::tensor::activation::sigmoid;
use burn::tensor::backend::Backend;

use crate::fused_moe::{DeviceRouter, FusedExperts, KERNEL_MAX_PAIRS, run_each};
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
    /// `mlp.experts.{e}`, one by one; empty when `fused` holds them.
    pub experts: Vec<Expert<B>>,
    /// The routed experts in the fused kernel's layout, instead of `experts` (see [`Moe::fuse`]).
    pub fused: Option<FusedExperts<B>>,
    /// `mlp.shared_experts` (intermediate `moe_intermediate_size * n_shared_experts`).
    pub shared_experts: Mlp<B>,
    /// Router hyperparameters.
    pub params: RouterParams,
    /// The router on the device, with the fused experts on CUDA (see [`Moe::fuse`]); `None` routes on the host.
    pub device_router: Option<DeviceRouter<B>>,
}

impl<B: Backend> Moe<B> {
    /// The routing of `x` `[n, d]` (one host read of the `[n, E]` scores).
    pub fn routing(&self, x: Tensor<B, 2>) -> Routing {
        // [n, E]
        let scores = sigmoid(self.gate.forward(x));
        let host = scores.into_data().convert::<f32>().to_vec::<f32>().expect("f32 data after convert");
        route(&host, &self.e_score_correction_bias, &self.params)
    }

    /// Routed experts in the block.
    pub fn n_experts(&self) -> usize {
        self.fused.as_ref().map_or(self.experts.len(), |f| f.shape.experts)
    }

    /// Moves the routed experts into the fused kernel's layout when the kernel can run them (the CUDA backend,
    /// INT4 experts it takes; see [`crate::fused_moe`]); `force` does it on any backend (tests of the layout).
    /// Returns whether they are fused.
    pub fn fuse(&mut self, force: bool) -> bool {
        if self.fused.is_none()
            && (force || crate::fused_moe::is_cuda::<B>())
            && let Some(f) = FusedExperts::from_experts(&self.experts)
        {
            self.device_router = DeviceRouter::new(&self.params, &self.e_score_correction_bias, &f.w13.device());
            self.fused = Some(f);
            self.experts = Vec::new();
        }
        self.fused.is_some()
    }

    /// The routed experts on every row of `x` `[n, d]` with the routing chosen and grouped on the device (no host
    /// read: the queue is not drained), plus `plus` (`[n, d]`, e.g. the shared expert's output, added by the
    /// experts' combine launch: the same f32 sum), or `None` where that path cannot run (no device router, too many
    /// pairs, the host router forced). The shared expert is not included unless passed as `plus`.
    pub fn routed_on_device(&self, x: Tensor<B, 2>, plus: Option<&Tensor<B, 2>>) -> Option<Tensor<B, 2>> {
        self.routed_on_device_with(x, None, plus)
    }

    /// [`Self::routed_on_device`] with the router's logits `x W_gate^T` already computed (`logits`, e.g. by
    /// [`Self::shared_and_logits`]), or computed here when `None`.
    pub fn routed_on_device_with(
        &self,
        x: Tensor<B, 2>,
        logits: Option<Tensor<B, 2>>,
        plus: Option<&Tensor<B, 2>>,
    ) -> Option<Tensor<B, 2>> {
        let (fused, router) = (self.fused.as_ref()?, self.device_router.as_ref()?);
        if x.dims()[0] * self.params.top_k > KERNEL_MAX_PAIRS || crate::fused_moe::host_router() {
            return None;
        }
        let logits = logits.unwrap_or_else(|| self.gate.forward(x.clone()));
        fused.run_routed_on_device(x, logits, router, plus)
    }

    /// The shared expert's output on `x` `[n, d]`, and the router's logits `[n, E]` when this block routes on the
    /// device and they came with it: on CUDA at decode widths the shared expert's gate/up (with SiLU * up) and the
    /// router share one GEMV launch (`cuda_ops::gemv_pair_jobs`; the same results as separate launches). `None`
    /// logits: compute them where needed ([`Self::routed_on_device_with`] does).
    pub fn shared_and_logits(&self, x: Tensor<B, 2>) -> (Tensor<B, 2>, Option<Tensor<B, 2>>) {
        #[cfg(feature = "cuda")]
        if self.device_router.is_some()
            && !crate::fused_moe::host_router()
            && let Some((h, logits)) = crate::cuda_ops::gemv_pair_jobs(
                &x,
                crate::cuda_ops::PairJob {
                    w: &self.shared_experts.gate_proj.weight,
                    up: Some(&self.shared_experts.up_proj.weight),
                },
                crate::cuda_ops::PairJob { w: &self.gate.weight, up: None },
            )
        {
            return (self.shared_experts.down_proj.forward(h), Some(logits));
        }
        (self.shared_experts.forward(x), None)
    }

    /// The routed experts on rows of `x` `[n, d]`: `slots` are `(row, expert, weight)`, `expert` an index into
    /// this block's experts; `[n, d]` weighted sums per row. `top_k`: slots per row when `slots` is a whole
    /// routing in order (0 otherwise).
    pub fn routed(&self, x: Tensor<B, 2>, slots: &[(usize, usize, f32)], top_k: usize) -> Tensor<B, 2> {
        match &self.fused {
            Some(f) => f.run(x, slots, top_k),
            None => run_each(x, slots, self.experts.len(), |e| &self.experts[e]),
        }
    }

    /// `[n, d] -> [n, d]`.
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let (shared, logits) = self.shared_and_logits(x.clone());
        if let Some(out) = self.routed_on_device_with(x.clone(), logits, Some(&shared)) {
            return out;
        }
        let routing = self.routing(x.clone());
        let k = self.params.top_k;
        let slots: Vec<(usize, usize, f32)> =
            routing.experts.iter().zip(&routing.weights).enumerate().map(|(s, (&e, &w))| (s / k, e, w)).collect();
        self.routed(x, &slots, k) + shared
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
