//! Routed experts held as one buffer per tensor kind (the layout of `eyrie_quant::cuda::KernelLayout`), so the
//! fused INT4 MoE kernel (`eyrie_quant::cuda::moe_forward`) runs a layer's selected experts in a few launches (on
//! tensor cores: split of the input, gate/up, split of the intermediate, down, combine).
//!
//! [`FusedExperts`] is built on the device from a block's [`Expert`]s (concatenation, and the BF16 scales cast
//! back to BF16, which is exact because they are BF16 values), and replaces them: the INT4 bytes are held once.
//! It is made only where the kernel can run (the CUDA backend, symmetric INT4 with BF16 scales and a group that
//! is a multiple of 32 dividing both widths; [`FusedExperts::from_experts`] says no otherwise).
//!
//! Which path a step takes ([`FusedExperts::run`]):
//! - the kernel, on CUDA, for up to [`KERNEL_MAX_PAIRS`] token-expert pairs (decode, verification and prefill
//!   chunks of up to 8192 tokens).
//!   Activations stay f32 (no BF16 rounding of the inputs); the kernel computes with the checkpoint's weights
//!   exactly as compressed-tensors decompresses them, `bf16(q * scale)`, so it does the CPU path's math up to
//!   f32 summation order (`bench/REPORT.md`, fused INT4 MoE correctness);
//!   The routing is chosen and grouped on the device ([`DeviceRouter`], `eyrie_quant::cuda::router`) when the
//!   block's router fits it, so the layer never waits for a host read;
//! - otherwise (wider steps, or a backend without the kernel) each selected expert is dequantized from the
//!   fused buffers, bit for bit the weights [`Expert::forward`] uses, and runs on its rows as before.

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, IndexingUpdateOp, Int, Tensor, TensorData};
use eyrie_quant::Dtype;
use eyrie_quant::burn::Int4Tensors;
use eyrie_quant::cuda::MoeShape;
use eyrie_quant::cuda::router::RouterSpec;

use crate::linear::StoredLinear;
use crate::mlp::Expert;

/// Largest number of (token, expert) pairs a step sends through the kernel: 8192 tokens of top-8, a whole prefill
/// chunk. It was tuned for decode widths (1..256 tokens) but takes any count (an expert's tokens go 1, 2 or 4 a
/// pass over its weights), and at prefill widths it beats dequantizing each expert for a matmul by far (a 10-layer
/// Kimi-K2 slice prefilled 8k tokens in 60 s that way, bench/REPORT.md; the tensor-core kernels run a 3000-token
/// block 2.5x faster than that). Its scratch is `pairs x (inter + hidden)` f32, plus on the tensor-core path the
/// three BF16 parts of the intermediate and of the input (`6 pairs x inter + 6 tokens x hidden` bytes): 3.6 GB at
/// this limit for Kimi-K2, freed to CubeCL's pool after the layer; wider steps take the dequantize-and-matmul path.
pub const KERNEL_MAX_PAIRS: usize = 65_536;

/// Whether the fused path routes on the host even where the device router can (benchmarks compare the two; also
/// `EYRIE_MOE_HOST_ROUTER=1` at start-up).
static HOST_ROUTER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes the fused path route on the host (`true`) or on the device where it can (`false`, the default unless
/// `EYRIE_MOE_HOST_ROUTER=1` is set).
pub fn set_host_router(host: bool) {
    HOST_ROUTER.store(host, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the device router's launch also splits the layer's input for the tensor-core experts (default), sparing
/// the layer its own split launch; off, the layer splits it itself (checks compare the two: bit-identical).
static ROUTE_SPLIT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Sets [`ROUTE_SPLIT`]: whether the device router's launch writes the input's split (`true`, the default).
pub fn set_route_split(on: bool) {
    ROUTE_SPLIT.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the fused path routes on the host (see [`set_host_router`]).
pub fn host_router() -> bool {
    static ENV: std::sync::Once = std::sync::Once::new();
    ENV.call_once(|| match std::env::var("EYRIE_MOE_HOST_ROUTER").as_deref() {
        Ok("1") => set_host_router(true),
        Ok("0") | Err(std::env::VarError::NotPresent) => {}
        Ok(other) => eprintln!("eyrie: warning: EYRIE_MOE_HOST_ROUTER={other:?} is not 0 or 1; routing on the device"),
        Err(e) => eprintln!("eyrie: warning: EYRIE_MOE_HOST_ROUTER: {e}; routing on the device"),
    });
    HOST_ROUTER.load(std::sync::atomic::Ordering::Relaxed)
}

/// The router on the device (`eyrie_quant::cuda::router`): the kernels' spec and `e_score_correction_bias` held
/// there, so a step's routing is chosen and grouped by two kernels and never read back to the host.
#[derive(Debug, Clone)]
pub struct DeviceRouter<B: Backend> {
    /// Sizes and hyperparameters (validated).
    pub spec: RouterSpec,
    /// `e_score_correction_bias` `[E]`, f32.
    pub bias: Tensor<B, 1>,
}

impl<B: Backend> DeviceRouter<B> {
    /// The device router of a block with these hyperparameters and bias, or `None` where its kernels cannot run
    /// it (not the CUDA backend, more experts than the grouping takes, a group layout it does not take).
    pub fn new(params: &crate::moe::RouterParams, bias: &[f32], device: &B::Device) -> Option<Self> {
        if !is_cuda::<B>() {
            return None;
        }
        let spec = RouterSpec {
            experts: bias.len(),
            n_group: params.n_group,
            topk_group: params.topk_group,
            top_k: params.top_k,
            norm_topk_prob: params.norm_topk_prob,
            routed_scaling_factor: params.routed_scaling_factor,
        };
        spec.validate().ok()?;
        let bias = Tensor::from_data(TensorData::new(bias.to_vec(), [bias.len()]), device);
        Some(Self { spec, bias })
    }
}

/// One MoE block's routed experts in the kernel layout (see the module docs): where `shape.tiled()` (Kimi-K2's
/// shapes), each matrix's words and scales are in the tiled order of `eyrie_quant::cuda::KernelLayout`, made here
/// on the device by a permutation; [`FusedExperts::expert`] permutes an expert back for the per-expert path.
#[derive(Debug, Clone)]
pub struct FusedExperts<B: Backend> {
    /// Sizes.
    pub shape: MoeShape,
    /// `[E * 2 * inter, hidden / 8]` packed words (i32 bits), per expert its `gate_proj` rows then `up_proj` rows
    /// (tiled where `shape.tiled()`, as all four buffers).
    pub w13: Tensor<B, 2, Int>,
    /// `[E * 2 * inter, hidden / group]` BF16 scales.
    pub s13: Tensor<B, 2>,
    /// `[E * hidden, inter / 8]` packed words of `down_proj`.
    pub w2: Tensor<B, 2, Int>,
    /// `[E * hidden, inter / group]` BF16 scales.
    pub s2: Tensor<B, 2>,
}

impl<B: Backend> FusedExperts<B> {
    /// The fused layout of `experts`, or `None` when the kernel cannot take them (any expert not symmetric INT4
    /// with BF16 scales, a group that is not a multiple of 32 dividing both widths, differing shapes, none).
    pub fn from_experts(experts: &[Expert<B>]) -> Option<Self> {
        let int4 = |l: &StoredLinear<B>| match l {
            StoredLinear::Int4(w) if w.zero_points.is_none() && w.scale_dtype == Dtype::BF16 => Some((**w).clone()),
            _ => None,
        };
        let first = experts.first()?;
        let g = int4(&first.gate_proj)?;
        let shape = MoeShape { hidden: g.shape[1], inter: g.shape[0], experts: experts.len(), group: g.group_size };
        shape.validate().ok()?;
        let (mut w13, mut s13, mut w2, mut s2) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for e in experts {
            let (gate, up, down) = (int4(&e.gate_proj)?, int4(&e.up_proj)?, int4(&e.down_proj)?);
            let unit = [shape.inter, shape.hidden];
            if gate.shape != unit || up.shape != unit || down.shape != [shape.hidden, shape.inter] {
                return None;
            }
            if [&gate, &up, &down].iter().any(|w| w.group_size != shape.group) {
                return None;
            }
            w13.extend([gate.packed, up.packed]);
            s13.extend([gate.scales, up.scales]);
            w2.push(down.packed);
            s2.push(down.scales);
        }
        let (mut w13, mut s13) = (Tensor::cat(w13, 0), Tensor::cat(s13, 0).cast(FloatDType::BF16));
        let (mut w2, mut s2) = (Tensor::cat(w2, 0), Tensor::cat(s2, 0).cast(FloatDType::BF16));
        if shape.tiled() {
            (w13, s13) = (tile_words(w13, shape.hidden), tile_scales(s13));
            (w2, s2) = (tile_words(w2, shape.inter), tile_scales(s2));
        }
        Some(Self { shape, w13, s13, w2, s2 }.contiguous())
    }

    /// The buffers laid out densely once, here, so that no step copies them (the kernel reads dense buffers; a
    /// step found a layer's 1.4 GB `w2` not dense and copied it every time: 0.68 ms a layer on an H200).
    fn contiguous(self) -> Self {
        #[cfg(feature = "cuda")]
        {
            use crate::cuda_ops::{contiguous, contiguous_int};
            Self {
                shape: self.shape,
                w13: contiguous_int(self.w13),
                s13: contiguous(self.s13),
                w2: contiguous_int(self.w2),
                s2: contiguous(self.s2),
            }
        }
        #[cfg(not(feature = "cuda"))]
        self
    }

    /// Experts `range` only (a rank's share under expert parallelism).
    pub fn narrow(&self, range: std::ops::Range<usize>) -> Self {
        let s = self.shape;
        let n = range.len();
        Self {
            shape: MoeShape { experts: n, ..s },
            w13: self.w13.clone().narrow(0, range.start * 2 * s.inter, n * 2 * s.inter),
            s13: self.s13.clone().narrow(0, range.start * 2 * s.inter, n * 2 * s.inter),
            w2: self.w2.clone().narrow(0, range.start * s.hidden, n * s.hidden),
            s2: self.s2.clone().narrow(0, range.start * s.hidden, n * s.hidden),
        }
        .contiguous()
    }

    /// Expert `e` as the [`Expert`] it was made from (the same packed words and scales, so the same outputs).
    pub fn expert(&self, e: usize) -> Expert<B> {
        let s = self.shape;
        let part = |w: &Tensor<B, 2, Int>, sc: &Tensor<B, 2>, row: usize, out: usize, inp: usize| {
            let (mut packed, mut scales) = (w.clone().narrow(0, row, out), sc.clone().narrow(0, row, out));
            if s.tiled() {
                // A matrix's rows are whole tiles (`row` and `out` are multiples of 128).
                (packed, scales) = (untile_words(packed, inp), untile_scales(scales));
            }
            StoredLinear::Int4(Box::new(Int4Tensors {
                packed,
                scales: scales.cast(FloatDType::F32),
                zero_points: None,
                shape: [out, inp],
                group_size: s.group,
                scale_dtype: Dtype::BF16,
            }))
        };
        let r13 = e * 2 * s.inter;
        Expert {
            gate_proj: part(&self.w13, &self.s13, r13, s.inter, s.hidden),
            up_proj: part(&self.w13, &self.s13, r13 + s.inter, s.inter, s.hidden),
            down_proj: part(&self.w2, &self.s2, e * s.hidden, s.hidden, s.inter),
        }
    }

    /// The routed experts on rows of `x` `[n, d]`: `slots` are `(row, expert, weight)` with `expert` an index
    /// into these experts; returns `[n, d]`, each row the weighted sum of its slots' expert outputs (zero for a
    /// row without slots). `top_k`: slots per token when `slots` is a whole routing in order (slot `i` on row
    /// `i / top_k`), which lets the kernel read `x` in place.
    pub fn run(&self, x: Tensor<B, 2>, slots: &[(usize, usize, f32)], top_k: usize) -> Tensor<B, 2> {
        #[cfg(feature = "cuda")]
        if slots.len() <= KERNEL_MAX_PAIRS
            && let Some(out) = kernel::run(self, x.clone(), slots, top_k)
        {
            return out;
        }
        let _ = top_k;
        run_each(x, slots, self.shape.experts, |e| self.expert(e))
    }
}

impl<B: Backend> FusedExperts<B> {
    /// The routed experts on `x` `[n, d]` with the routing chosen on the device from the gate's `logits` `[n, E]`
    /// (`router`: these experts' router): `[n, d]`, each row the weighted sum of its experts' outputs, without a
    /// host read, plus `plus` (`[n, d]` f32) when given, added by the combine launch. `None` where the kernels
    /// cannot take it (not CUDA, not f32, more than [`KERNEL_MAX_PAIRS`] pairs, the host router forced): the
    /// caller routes on the host.
    pub fn run_routed_on_device(
        &self,
        x: Tensor<B, 2>,
        logits: Tensor<B, 2>,
        router: &DeviceRouter<B>,
        plus: Option<&Tensor<B, 2>>,
    ) -> Option<Tensor<B, 2>> {
        #[cfg(feature = "cuda")]
        if !host_router() {
            return kernel::run_routed(self, x, logits, router, plus);
        }
        let _ = (x, logits, router, plus);
        None
    }
}

/// Row-major packed words `[rows, k / 8]` (rows a multiple of 16, `k` of 128) in the kernels' tiled layout
/// (`eyrie_quant::cuda::experts::tiled_vector`): row `16 T + 8 h + g`, word `16 i + 4 c + w` goes to
/// `(((T nblk + i) 2 + h) 32 + 4 g + c) 4 + w`, i.e. the axes `[T, h, g, i, c, w]` in the order `[T, i, h, g, c, w]`.
pub(crate) fn tile_words<B: Backend>(w: Tensor<B, 2, Int>, k: usize) -> Tensor<B, 2, Int> {
    let [rows, kw] = w.dims();
    w.reshape([rows / 16, 2, 8, k / 128, 4, 4]).permute([0, 3, 1, 2, 4, 5]).reshape([rows, kw])
}

/// The inverse of [`tile_words`].
pub(crate) fn untile_words<B: Backend>(w: Tensor<B, 2, Int>, k: usize) -> Tensor<B, 2, Int> {
    let [rows, kw] = w.dims();
    w.reshape([rows / 16, k / 128, 2, 8, 4, 4]).permute([0, 2, 3, 1, 4, 5]).reshape([rows, kw])
}

/// Row-major scales `[rows, ng]` in the tiled layout (`eyrie_quant::cuda::experts::tiled_scale`: `[T, group, row
/// % 16]`).
pub(crate) fn tile_scales<B: Backend>(s: Tensor<B, 2>) -> Tensor<B, 2> {
    let [rows, ng] = s.dims();
    s.reshape([rows / 16, 16, ng]).swap_dims(1, 2).reshape([rows, ng])
}

/// The inverse of [`tile_scales`].
pub(crate) fn untile_scales<B: Backend>(s: Tensor<B, 2>) -> Tensor<B, 2> {
    let [rows, ng] = s.dims();
    s.reshape([rows / 16, ng, 16]).swap_dims(1, 2).reshape([rows, ng])
}

/// Each selected expert once, on exactly its rows (gather, SwiGLU, scale by the weight, scatter-add), as
/// `Moe::forward` has always done. `expert(e)` gives expert `e` of `n_experts`.
pub(crate) fn run_each<B: Backend, X: std::borrow::Borrow<Expert<B>>>(
    x: Tensor<B, 2>,
    slots: &[(usize, usize, f32)],
    n_experts: usize,
    expert: impl Fn(usize) -> X,
) -> Tensor<B, 2> {
    let device = x.device();
    // Rows and weights per expert, in slot order.
    let mut per_expert: Vec<(Vec<i64>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); n_experts];
    for &(row, e, w) in slots {
        per_expert[e].0.push(row as i64);
        per_expert[e].1.push(w);
    }
    let mut out = Tensor::<B, 2>::zeros(x.dims(), &device);
    for (e, (rows, weights)) in per_expert.into_iter().enumerate() {
        if rows.is_empty() {
            continue;
        }
        let m = rows.len();
        let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [m]), &device);
        // [m, d]
        let xe = x.clone().select(0, idx.clone());
        let w = Tensor::<B, 2>::from_data(TensorData::new(weights, [m, 1]), &device);
        let ye = expert(e).borrow().forward(xe) * w;
        out = out.select_assign(0, idx, ye, IndexingUpdateOp::Add);
    }
    out
}

/// Whether `B` is burn's CUDA backend (where the kernel runs).
pub fn is_cuda<B: Backend>() -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::cuda_ops::is_cuda::<B>()
    }
    #[cfg(not(feature = "cuda"))]
    false
}

#[cfg(feature = "cuda")]
mod kernel {
    //! The kernel path: burn's CUDA tensors are CubeCL buffers; their handles go to `eyrie_quant::cuda`.

    use burn::tensor::backend::Backend;
    use burn::tensor::{DType, Int, Shape, Tensor, TensorData};
    use eyrie_quant::cuda::router::route_on_device;
    use eyrie_quant::cuda::{GpuExperts, GpuRouting, Routing, moe_forward, moe_forward_add};

    use super::{DeviceRouter, FusedExperts, KERNEL_MAX_PAIRS};
    use crate::cuda_ops::{Cube, back, float, int};

    /// The experts' buffers as eyrie-quant's kernels take them (the same device memory, no copy: the buffers are
    /// dense since [`FusedExperts::from_experts`]).
    fn gpu_experts<B: Backend>(f: &FusedExperts<B>) -> Option<GpuExperts<burn::cubecl::cuda::CudaRuntime>> {
        GpuExperts::from_handles(
            f.shape,
            int(f.w13.clone())?.handle,
            float(f.s13.clone())?.handle,
            int(f.w2.clone())?.handle,
            float(f.s2.clone())?.handle,
        )
        .ok()
    }

    /// The layer with the device router (see [`FusedExperts::run_routed_on_device`]).
    pub(super) fn run_routed<B: Backend>(
        f: &FusedExperts<B>,
        x: Tensor<B, 2>,
        logits: Tensor<B, 2>,
        router: &DeviceRouter<B>,
        plus: Option<&Tensor<B, 2>>,
    ) -> Option<Tensor<B, 2>> {
        let [n, d] = x.dims();
        let spec = &router.spec;
        if !super::is_cuda::<B>()
            || n == 0
            || n * spec.top_k > KERNEL_MAX_PAIRS
            || spec.experts != f.shape.experts
            || logits.dims() != [n, spec.experts]
            || plus.is_some_and(|p| p.dims() != [n, d])
        {
            return None;
        }
        let (xc, lc, bc) = (float(x)?, float(logits)?, float(router.bias.clone())?);
        let pc = match plus {
            Some(p) => Some(float(p.clone())?),
            None => None,
        };
        let dtypes = [Some(xc.dtype), Some(lc.dtype), Some(bc.dtype), pc.as_ref().map(|p| p.dtype)];
        if dtypes.iter().flatten().any(|t| *t != DType::F32) {
            return None;
        }
        let client = xc.client.clone();
        let experts = gpu_experts(f)?;
        let split = super::ROUTE_SPLIT.load(std::sync::atomic::Ordering::Relaxed).then_some((&xc.handle, d));
        let routing = route_on_device(&client, spec, &lc.handle, &bc.handle, n, split).ok()?;
        let out = client.empty(n * d * 4);
        match &pc {
            Some(p) => moe_forward_add::<_, f32>(&client, &experts, &xc.handle, &routing, &p.handle, &out),
            None => moe_forward::<_, f32>(&client, &experts, &xc.handle, &routing, &out),
        }
        back::<B, 2>(Cube::new_contiguous(client, xc.device.clone(), Shape::new([n, d]), out, DType::F32))
    }

    /// `None` when this is not the CUDA backend or the activations are not f32 (the caller then takes the
    /// generic path).
    pub(super) fn run<B: Backend>(
        f: &FusedExperts<B>,
        x: Tensor<B, 2>,
        slots: &[(usize, usize, f32)],
        top_k: usize,
    ) -> Option<Tensor<B, 2>> {
        let [n, d] = x.dims();
        if !super::is_cuda::<B>() || slots.is_empty() {
            return None;
        }
        let device = x.device();
        // A whole routing in order reads `x` in place; any other slot list reads its rows gathered, one "token"
        // per slot.
        let whole = top_k > 0 && slots.len() == n * top_k && slots.iter().enumerate().all(|(i, s)| s.0 == i / top_k);
        let (xs, m, k, rows) = if whole {
            (x, n, top_k, None)
        } else {
            let rows: Vec<i64> = slots.iter().map(|s| s.0 as i64).collect();
            let idx = Tensor::<B, 1, Int>::from_data(TensorData::new(rows, [slots.len()]), &device);
            (x.select(0, idx.clone()), slots.len(), 1, Some(idx))
        };
        let ids: Vec<u32> = slots.iter().map(|s| s.1 as u32).collect();
        let weights: Vec<f32> = slots.iter().map(|s| s.2).collect();
        let routing = Routing::new(&ids, m, k, f.shape.experts).ok()?;
        let xc = float(xs)?;
        if xc.dtype != DType::F32 {
            return None;
        }
        let client = xc.client.clone();
        let experts = gpu_experts(f)?;
        let groute = GpuRouting::upload(&client, &routing, &weights);
        let out = client.empty(m * d * 4);
        moe_forward::<_, f32>(&client, &experts, &xc.handle, &groute, &out);
        let out = Cube::new_contiguous(client, xc.device.clone(), Shape::new([m, d]), out, DType::F32);
        let out = back::<B, 2>(out)?;
        Some(match rows {
            None => out,
            Some(idx) => {
                Tensor::<B, 2>::zeros([n, d], &device).select_assign(0, idx, out, burn::tensor::IndexingUpdateOp::Add)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;
    use burn::tensor::{Int, Tensor, TensorData};
    use eyrie_quant::Dtype;
    use eyrie_quant::burn::Int4Tensors;
    use eyrie_quant::cuda::SplitMix64;
    use eyrie_quant::cuda::experts::{tile_scales, tile_words};

    use super::FusedExperts;
    use crate::linear::StoredLinear;
    use crate::mlp::Expert;

    fn int4(rng: &mut SplitMix64, out: usize, inp: usize) -> StoredLinear<Flex> {
        let device = Default::default();
        let words: Vec<i32> = (0..out * inp / 8).map(|_| rng.next_u64() as u32 as i32).collect();
        // Distinct BF16 scales, so a misplaced scale shows.
        let scales: Vec<f32> =
            (0..out * inp / 32).map(|_| half::bf16::from_f32(0.01 + rng.next_f32()).to_f32()).collect();
        StoredLinear::Int4(Box::new(Int4Tensors {
            packed: Tensor::<Flex, 2, Int>::from_data(TensorData::new(words, [out, inp / 8]), &device),
            scales: Tensor::from_data(TensorData::new(scales, [out, inp / 32]), &device),
            zero_points: None,
            shape: [out, inp],
            group_size: 32,
            scale_dtype: Dtype::BF16,
        }))
    }

    fn parts(l: &StoredLinear<Flex>) -> (Vec<u32>, Vec<f32>) {
        let StoredLinear::Int4(w) = l else { panic!("an INT4 linear") };
        let words = w.packed.clone().into_data().iter::<i64>().map(|v| v as u32).collect();
        (words, w.scales.clone().into_data().iter::<f32>().collect())
    }

    /// The device permutation (burn ops) puts every word and scale where eyrie-quant's kernels look for them
    /// (`tile_words` / `tile_scales`, whose index algebra eyrie-quant's tests pin to the kernels' loads), and
    /// `expert` gives back each expert's checkpoint tensors exactly.
    #[test]
    fn tiled_layout_matches_the_kernels_and_round_trips() {
        let (hidden, inter) = (256, 128);
        let mut rng = SplitMix64::new(5);
        let experts: Vec<Expert<Flex>> = (0..2)
            .map(|_| Expert {
                gate_proj: int4(&mut rng, inter, hidden),
                up_proj: int4(&mut rng, inter, hidden),
                down_proj: int4(&mut rng, hidden, inter),
            })
            .collect();
        let f = FusedExperts::from_experts(&experts).expect("INT4 experts with BF16 scales fuse");
        assert!(f.shape.tiled());
        let (mut w13, mut s13, mut w2, mut s2) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let push = |w: &mut Vec<u32>, s: &mut Vec<half::bf16>, l: &StoredLinear<Flex>| {
            let (words, scales) = parts(l);
            w.extend(words);
            s.extend(scales.into_iter().map(half::bf16::from_f32));
        };
        for e in &experts {
            push(&mut w13, &mut s13, &e.gate_proj);
            push(&mut w13, &mut s13, &e.up_proj);
            push(&mut w2, &mut s2, &e.down_proj);
        }
        let got_words =
            |t: &Tensor<Flex, 2, Int>| t.clone().into_data().iter::<i64>().map(|v| v as u32).collect::<Vec<_>>();
        let got_scales =
            |t: &Tensor<Flex, 2>| t.clone().into_data().iter::<f32>().map(half::bf16::from_f32).collect::<Vec<_>>();
        assert_eq!(got_words(&f.w13), tile_words(&w13, hidden));
        assert_eq!(got_words(&f.w2), tile_words(&w2, inter));
        assert_eq!(got_scales(&f.s13), tile_scales(&s13, hidden / 32));
        assert_eq!(got_scales(&f.s2), tile_scales(&s2, inter / 32));
        for (e, want) in experts.iter().enumerate() {
            let got = f.expert(e);
            assert_eq!(parts(&got.gate_proj), parts(&want.gate_proj), "expert {e} gate");
            assert_eq!(parts(&got.up_proj), parts(&want.up_proj), "expert {e} up");
            assert_eq!(parts(&got.down_proj), parts(&want.down_proj), "expert {e} down");
        }
    }
}
