//! Launching the fused INT4 MoE on a CubeCL runtime (CUDA in practice): expert weights uploaded once in the
//! [`KernelLayout`], routing uploaded per step or made on the device: on tensor cores (`moe_mma`) five launches a
//! layer (split of the input, gate/up, split of the intermediate, down, combine), on CUDA cores three.

use std::marker::PhantomData;

use burn::cubecl;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::experts::{KernelLayout, MoeShape, Routing};
use super::kernels::{WEIGHT_BIAS, combine_kernel, expert_rows_kernel};
use super::moe_mma::{expert_mma_kernel, split_x3_kernel};
use super::specs::{ExpertMmaSpec, ExpertRowsSpec, class_tbs, mma_class_tbs};

/// 16-byte vectors: four packed words, or four f32 activations.
const VEC: usize = 4;

/// Launch shape of the fused MoE (kernel specialisations; [`MoeConfig::for_tokens`] gives the tuned one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeConfig {
    /// Warps per block.
    pub warps: usize,
    /// Gate/up kernel: units (gate row + up row) per warp, one after the other.
    pub rows_per_warp_13: usize,
    /// Down kernel: row groups per warp, one after the other.
    pub rows_per_warp_2: usize,
    /// Down kernel: rows per warp computed together (2 or 4), so more loads are in flight.
    pub rows_at_once_2: usize,
    /// Largest tokens per pass (1, 2 or 4): experts with more tokens are handled in several passes.
    pub max_tb: usize,
    /// Start loading each warp's first rows before staging the activations; measured slower on the H200 except at
    /// 128 tokens (more registers held across the staging).
    pub prefetch: bool,
    /// Run the experts on tensor cores (`moe_mma`) with this launch shape, where the shape allows it
    /// ([`crate::cuda::specs::ExpertMmaSpec::fits`]); `None`: the CUDA-core kernels.
    pub mma: Option<MmaShape>,
    /// Tensor-core path: tokens per pass of the experts with 3 or more tokens (one of
    /// [`crate::cuda::specs::MMA_TBS`]; [`crate::cuda::specs::mma_class_tbs`]). Each pass reads the expert's
    /// weights once, so at prefill widths (~170 tokens an expert in an 8192-token chunk) it divides the weight
    /// traffic; the tensor-core kernel takes its activations from global memory, so shared memory does not cap it.
    pub mma_tb: usize,
    /// Run the experts as a tiled grouped GEMM (`moe_tiled`: 64 pairs of an expert a tile, weights read once a
    /// tile) where the shape allows it ([`crate::cuda::moe_tiled::tiled_fits`]), instead of `mma`'s passes of
    /// `mma_tb` tokens: prefill chunks with many tokens an expert.
    pub tiled_gemm: bool,
}

/// Tokens from which [`MoeConfig::for_tokens`] takes the tiled grouped GEMM (`moe_tiled`): its 64-pair tiles want
/// tens of tokens an expert. A Kimi-K2 layer (384 experts, top-8) on an H100 (`gpu_kernels prefill`,
/// bench/REPORT.md session 34), tiled against 16 tokens a pass: 1024 tokens 18.8 / 16.8 ms (~21 pairs an expert:
/// the tiles a third full, it loses), 2048 19.2 / 29.6, 4096 38.0 / 56.2, 8192 58.5 / 110.3.
pub const TILED_GEMM_MIN_TOKENS: usize = 2048;

/// Launch shape of the tensor-core expert kernels (`moe_mma::expert_mma_kernel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MmaShape {
    /// Gate/up: warp tasks (16 units each) per block.
    pub tasks_13: usize,
    /// Gate/up: warps sharing a task's columns.
    pub ksplit_13: usize,
    /// Down: 16-row tiles per warp task.
    pub tiles_2: usize,
    /// Down: warp tasks per block.
    pub tasks_2: usize,
    /// Down: warps sharing a task's columns.
    pub ksplit_2: usize,
}

impl MmaShape {
    /// The shape with these fields, in their order.
    pub fn new(tasks_13: usize, ksplit_13: usize, tiles_2: usize, tasks_2: usize, ksplit_2: usize) -> Self {
        Self { tasks_13, ksplit_13, tiles_2, tasks_2, ksplit_2 }
    }

    /// The launch shapes the benchmark sweeps (and `cargo xtask kernels` compiles).
    pub fn candidates() -> Vec<Self> {
        let m = |tasks_13, ksplit_13, tiles_2, tasks_2, ksplit_2| {
            Self::new(tasks_13, ksplit_13, tiles_2, tasks_2, ksplit_2)
        };
        vec![
            m(4, 2, 2, 4, 2),
            m(2, 4, 1, 8, 1),
            m(4, 1, 2, 4, 1),
            m(8, 1, 1, 8, 2),
            m(2, 2, 2, 2, 2),
            m(4, 3, 2, 4, 3),
            m(8, 3, 1, 1, 2),
            m(1, 4, 2, 2, 2),
        ]
    }
}

impl Default for MoeConfig {
    fn default() -> Self {
        Self {
            warps: 8,
            rows_per_warp_13: 2,
            rows_per_warp_2: 2,
            rows_at_once_2: 4,
            max_tb: 4,
            prefetch: false,
            mma: None,
            mma_tb: 4,
            tiled_gemm: false,
        }
    }
}

impl MoeConfig {
    /// The fastest launch shape measured for `m` tokens at Kimi-K2 shapes on the H200 (`bench/kernels.json`).
    ///
    /// The experts run on tensor cores (`mma`) at every width: faster than the CUDA-core kernels by 1.2x at one
    /// token to 1.7x at 128 (bench/REPORT.md, session 8); the CUDA-core fields are the fallback for shapes the
    /// tensor-core kernel does not take ([`crate::cuda::specs::ExpertMmaSpec::fits`]).
    pub fn for_tokens(m: usize) -> Self {
        let d = Self::default();
        let mma = |tasks_13, ksplit_13, tiles_2, tasks_2, ksplit_2| {
            Some(MmaShape::new(tasks_13, ksplit_13, tiles_2, tasks_2, ksplit_2))
        };
        // The tensor-core shapes as measured with the tiled layout (session 15, bench/REPORT.md): 8 tokens 463 us
        // with (2, 2) against 477-538; 128 tokens 3440 us with k-split 1 against 3727-4130. One token, each stage's
        // shapes swept alone (session 16, `gpu_kernels stages`): gate/up in 24-warp blocks (8 tasks x k-split 3),
        // down in 2-warp blocks of one 16-row tile (its time is the same within 5% for every shape): the layer
        // 86.1 -> 80.0 us against session 15's (4, 3, 2, 4, 3) in the same run.
        match m {
            0 | 1 => Self { warps: 16, rows_per_warp_13: 1, rows_per_warp_2: 1, mma: mma(8, 3, 1, 1, 2), ..d },
            2..=16 => Self { mma: mma(2, 2, 2, 2, 2), ..d },
            17..=64 => Self { rows_per_warp_2: 4, rows_at_once_2: 2, mma: mma(4, 2, 2, 4, 2), ..d },
            // Tensor cores: 8 tokens a pass of the 3+-token experts up to 512 tokens, 16 above (prefill chunks): at
            // 8192 tokens 288 -> 140 -> 116 ms for 2 -> 8 -> 16 a pass, at 256 tokens 6.4 (4) / 6.6 (8) / 7.5 (16)
            // ms (`gpu_kernels prefill`, session 13).
            65..=512 => Self {
                rows_per_warp_2: 4,
                rows_at_once_2: 2,
                max_tb: 2,
                prefetch: true,
                mma: mma(4, 1, 2, 4, 1),
                mma_tb: 8,
                ..d
            },
            _ => Self {
                rows_per_warp_2: 4,
                rows_at_once_2: 2,
                max_tb: 2,
                prefetch: true,
                mma: mma(4, 2, 2, 4, 2),
                mma_tb: 16,
                tiled_gemm: m >= TILED_GEMM_MIN_TOKENS,
                ..d
            },
        }
    }

    /// This launch shape on the CUDA-core kernels only (benchmarks and checks compare the two paths).
    pub fn cuda_cores(self) -> Self {
        Self { mma: None, ..self }
    }
}

impl MoeConfig {
    /// This launch shape with fewer tokens per pass where a block would stage more activations than `limit`
    /// bytes of shared memory allow (the device's per-block opt-in limit: 227 KiB on an H200, 99 KiB on SM120,
    /// where 4 tokens of a 7168-wide input need 126 KiB; `docs/SM120.md`).
    pub fn fit_shared_memory(mut self, shape: &MoeShape, limit: usize) -> Self {
        let fits = |cfg: &Self| {
            ExpertRowsSpec::gate_up(shape, 1, cfg, cfg.max_tb).shared_bytes() <= limit
                && ExpertRowsSpec::down(shape, 1, cfg, cfg.max_tb).shared_bytes() <= limit
        };
        while self.max_tb > 1 && !fits(&self) {
            self.max_tb /= 2;
        }
        self
    }
}

/// Which launches [`moe_forward_with`] issues (all, or one alone for per-stage timing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stages {
    /// The whole layer.
    All,
    /// Gate + up + SiLU only.
    GateUp,
    /// Down only (on whatever the intermediate buffer holds).
    Down,
    /// Weighted combine only.
    Combine,
    /// The tensor-core gate/up launch's loads alone: its weights, scales and activations read as the kernel reads
    /// them, folded into a meaningless output instead of multiplied (timing only: how fast the loads alone go).
    GateUpLoads,
    /// The tensor-core down launch's loads alone, as `GateUpLoads`.
    DownLoads,
}

/// One MoE layer's experts on the device, in the [`KernelLayout`].
#[derive(Debug)]
pub struct GpuExperts<R: Runtime> {
    shape: MoeShape,
    w13: Handle,
    s13: Handle,
    w2: Handle,
    s2: Handle,
    _runtime: PhantomData<R>,
}

impl<R: Runtime> GpuExperts<R> {
    /// Uploads the layout (one buffer per tensor).
    pub fn upload(client: &ComputeClient<R>, layout: &KernelLayout) -> Self {
        Self {
            shape: layout.shape,
            w13: client.create_from_slice(u32::as_bytes(&layout.w13)),
            s13: client.create_from_slice(half::bf16::as_bytes(&layout.s13)),
            w2: client.create_from_slice(u32::as_bytes(&layout.w2)),
            s2: client.create_from_slice(half::bf16::as_bytes(&layout.s2)),
            _runtime: PhantomData,
        }
    }

    /// Wraps buffers already on the device that hold the [`KernelLayout`] of `shape`: `w13` `[E, 2*inter,
    /// hidden/8]` and `w2` `[E, hidden, inter/8]` packed words (u32 or the same bits as i32), `s13` / `s2` their
    /// BF16 scales, all four in the tiled order where [`MoeShape::tiled`] holds (the kernels read them so). A model that keeps its experts on the device builds these there (concatenation and a cast)
    /// instead of uploading a host layout. Errors name the buffer whose size does not match `shape`.
    pub fn from_handles(shape: MoeShape, w13: Handle, s13: Handle, w2: Handle, s2: Handle) -> crate::Result<Self> {
        shape.validate()?;
        let params = shape.experts * shape.hidden * shape.inter;
        for (name, handle, bytes) in [
            ("w13", &w13, 2 * params / 2),
            ("s13", &s13, 2 * params / shape.group * 2),
            ("w2", &w2, params / 2),
            ("s2", &s2, params / shape.group * 2),
        ] {
            if (handle.size_in_used() as usize) < bytes {
                return Err(crate::QuantError::invalid(
                    name,
                    format!("holds {} bytes, the layout of {shape:?} needs {bytes}", handle.size_in_used()),
                ));
            }
        }
        Ok(Self { shape, w13, s13, w2, s2, _runtime: PhantomData })
    }

    /// The layer's sizes.
    pub fn shape(&self) -> MoeShape {
        self.shape
    }
}

/// A step's routing on the device: the grouping of [`Routing`] and the routing weights (`[m, topk]`, f32), either
/// uploaded from the host ([`GpuRouting::upload`]) or made on the device ([`super::router::route_on_device`]).
#[derive(Debug)]
pub struct GpuRouting {
    m: usize,
    topk: usize,
    /// Length of `experts` (the slots the kernels may read: `bounds[3]` of them are written).
    slots: usize,
    /// Grid height of each class's launches (0: the class is empty, no launch).
    grid: [u32; 3],
    /// The expert ids per pair, when the device chose them (`[m, topk]`).
    ids: Option<Handle>,
    experts: Handle,
    offsets: Handle,
    pairs: Handle,
    weights: Handle,
    /// `[4]` class bounds of `experts` (u32).
    bounds: Handle,
    /// The layer input's BF16x3 split (`[m, 3, hidden / 2]` words) and `hidden`, when the device router wrote it
    /// (`route_on_device` with a split): the tensor-core path then skips its own split launch.
    x_split: Option<(Handle, usize)>,
}

/// What a [`GpuRouting`] holds, read back to the host (checks and tests).
#[derive(Debug, Clone, PartialEq)]
pub struct RoutingReadback {
    /// Expert per pair `[m, topk]` when the device chose them.
    pub ids: Option<Vec<u32>>,
    /// Routing weights `[m, topk]`.
    pub weights: Vec<f32>,
    /// Active experts by class (`bounds[3]` of them).
    pub experts: Vec<u32>,
    /// `experts.len() + 1` offsets into `pairs`.
    pub offsets: Vec<u32>,
    /// Pair indices grouped by expert.
    pub pairs: Vec<u32>,
    /// Class bounds of `experts`.
    pub bounds: [u32; 4],
}

impl GpuRouting {
    /// Uploads `routing` and the routing `weights` (`[m, topk]`).
    pub fn upload<R: Runtime>(client: &ComputeClient<R>, routing: &Routing, weights: &[f32]) -> Self {
        assert_eq!(weights.len(), routing.m * routing.topk, "routing weights are [m, topk]");
        let b = routing.class_bounds;
        let bounds: [u32; 4] = b.map(|v| v as u32);
        Self {
            m: routing.m,
            topk: routing.topk,
            slots: routing.experts.len(),
            grid: [0, 1, 2].map(|c| (b[c + 1] - b[c]) as u32),
            ids: None,
            experts: client.create_from_slice(u32::as_bytes(&routing.experts)),
            offsets: client.create_from_slice(u32::as_bytes(&routing.offsets)),
            pairs: client.create_from_slice(u32::as_bytes(&routing.pairs)),
            weights: client.create_from_slice(f32::as_bytes(weights)),
            bounds: client.create_from_slice(u32::as_bytes(&bounds)),
            x_split: None,
        }
    }

    /// A routing the device router wrote into these buffers (`experts` of `slots` entries).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn from_device(
        m: usize,
        topk: usize,
        slots: usize,
        grid: [u32; 3],
        ids: Handle,
        experts: Handle,
        offsets: Handle,
        pairs: Handle,
        weights: Handle,
        bounds: Handle,
        x_split: Option<(Handle, usize)>,
    ) -> Self {
        Self { m, topk, slots, grid, ids: Some(ids), experts, offsets, pairs, weights, bounds, x_split }
    }

    /// Tokens in the step.
    pub fn m(&self) -> usize {
        self.m
    }

    /// Grid height of each class's launches.
    pub fn grid(&self) -> [u32; 3] {
        self.grid
    }

    /// Reads everything back (drains the queue: checks and tests only).
    ///
    /// # Errors
    /// A message when a read fails.
    pub fn read_back<R: Runtime>(&self, client: &ComputeClient<R>) -> Result<RoutingReadback, String> {
        let read = |h: &Handle| -> Result<Vec<u32>, String> {
            let bytes = client.read_one(h.clone()).map_err(|e| format!("read: {e:?}"))?;
            Ok(u32::from_bytes(&bytes).to_vec())
        };
        let b = read(&self.bounds)?;
        let bounds = [b[0], b[1], b[2], b[3]];
        let n = bounds[3] as usize;
        let pairs = self.m * self.topk;
        let weights = {
            let bytes = client.read_one(self.weights.clone()).map_err(|e| format!("read: {e:?}"))?;
            f32::from_bytes(&bytes)[..pairs].to_vec()
        };
        Ok(RoutingReadback {
            ids: match &self.ids {
                Some(h) => Some(read(h)?[..pairs].to_vec()),
                None => None,
            },
            weights,
            experts: read(&self.experts)?[..n].to_vec(),
            offsets: read(&self.offsets)?[..n + 1].to_vec(),
            pairs: read(&self.pairs)?[..pairs].to_vec(),
            bounds,
        })
    }
}

/// Largest total that [`scratch`] reserves as one allocation; larger sets are reserved buffer by buffer.
pub const SCRATCH_MAX_BYTES: usize = 64 << 20;

/// `N` device buffers of `bytes[i]` bytes each, reserved in one request to the CubeCL server. Every `client.empty`
/// is a task of its own on the server thread's queue, which at batch 1 is what a decode step waits on (the GPU
/// work of a launch is often shorter than the host's handling of it), so a launch's scratch buffers are reserved
/// together. The buffers are one allocation (each starts on the runtime's 512-byte alignment), given back when the
/// last of the handles drops. Only up to [`SCRATCH_MAX_BYTES`] in all: prefill-sized sets (GBs at 8192 rows) are
/// reserved one by one as before, where the tasks cost nothing next to the work, because one multi-GB allocation a
/// launch made an 8k x 8 prefill run out of device memory in CubeCL's pool (bench/REPORT.md, session 10).
pub fn scratch<R: Runtime, const N: usize>(client: &ComputeClient<R>, bytes: [usize; N]) -> [Handle; N] {
    use cubecl::server::{MemoryLayoutDescriptor, MemoryLayoutStrategy};
    if bytes.iter().sum::<usize>() > SCRATCH_MAX_BYTES {
        return bytes.map(|b| client.empty(b.max(4)));
    }
    let descriptors = bytes
        .iter()
        .map(|&b| MemoryLayoutDescriptor::new(MemoryLayoutStrategy::Contiguous, [b.max(4)].into(), 1))
        .collect();
    let mut layouts = client.empty_tensors(descriptors).into_iter().map(|layout| layout.memory);
    std::array::from_fn(|_| layouts.next().expect("one layout per descriptor"))
}

/// Array argument over a whole buffer of `len` elements.
///
/// # Safety
/// `len` elements of the kernel's element type must fit in `handle`.
pub(super) unsafe fn arg<R: Runtime>(handle: &Handle, len: usize) -> ArrayArg<R> {
    // SAFETY: forwarded to the caller.
    unsafe { ArrayArg::from_raw_parts(handle.clone(), len) }
}

/// The fused MoE layer: `out[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`.
///
/// `x`: `[m, hidden]` activations of type `A` (BF16 as W4A16 kernels take them, or f32); `out`: `[m, hidden]` f32 (written, not accumulated). Launches: gate+up with SiLU*up
/// for every (token, expert) pair grouped by expert, down for every pair (each one launch per non-empty class of
/// experts by routed-token count), then the weighted combine per token.
pub fn moe_forward<R: Runtime, A: Float>(
    client: &ComputeClient<R>,
    experts: &GpuExperts<R>,
    x: &Handle,
    routing: &GpuRouting,
    out: &Handle,
) {
    let cfg = tuned_config(client, experts, routing);
    moe_forward_inner::<R, A>(client, experts, x, routing, out, &cfg, Stages::All, None);
}

/// The tuned launch shape for `routing`'s token count, fitted to the device's shared memory.
fn tuned_config<R: Runtime>(client: &ComputeClient<R>, experts: &GpuExperts<R>, routing: &GpuRouting) -> MoeConfig {
    let limit = client.properties().hardware.max_shared_memory_size;
    let cfg = MoeConfig::for_tokens(routing.m).fit_shared_memory(&experts.shape, limit);
    MoeConfig { tiled_gemm: cfg.tiled_gemm && tiled_gemm(), ..cfg }
}

/// [`moe_forward`] plus `addend` (`[m, hidden]` f32, e.g. the shared experts' output) added by the combine:
/// `out = combine + addend`, the same f32 result as adding it afterwards, one launch fewer.
pub fn moe_forward_add<R: Runtime, A: Float>(
    client: &ComputeClient<R>,
    experts: &GpuExperts<R>,
    x: &Handle,
    routing: &GpuRouting,
    addend: &Handle,
    out: &Handle,
) {
    let cfg = tuned_config(client, experts, routing);
    moe_forward_inner::<R, A>(client, experts, x, routing, out, &cfg, Stages::All, Some(addend));
}

/// [`moe_forward`] with an explicit launch shape, or only some of its launches (benchmarks).
pub fn moe_forward_with<R: Runtime, A: Float>(
    client: &ComputeClient<R>,
    experts: &GpuExperts<R>,
    x: &Handle,
    routing: &GpuRouting,
    out: &Handle,
    cfg: &MoeConfig,
    stages: Stages,
) {
    moe_forward_inner::<R, A>(client, experts, x, routing, out, cfg, stages, None);
}

#[allow(clippy::too_many_arguments)]
fn moe_forward_inner<R: Runtime, A: Float>(
    client: &ComputeClient<R>,
    experts: &GpuExperts<R>,
    x: &Handle,
    routing: &GpuRouting,
    out: &Handle,
    cfg: &MoeConfig,
    stages: Stages,
    addend: Option<&Handle>,
) {
    let s = experts.shape;
    let n_pairs = routing.m * routing.topk;
    if n_pairs == 0 {
        return;
    }
    assert!(matches!(cfg.rows_at_once_2, 2 | 4) && matches!(cfg.max_tb, 1 | 2 | 4) && cfg.warps > 0);
    if cfg.tiled_gemm
        && matches!(stages, Stages::All | Stages::GateUp | Stages::Down | Stages::Combine)
        && super::moe_tiled::tiled_fits(&s, client.properties().hardware.max_shared_memory_size)
        && super::moe_tiled::tiled_launchable(&s, routing.m, n_pairs, routing.slots)
    {
        let [y] = scratch(client, [n_pairs * s.hidden * 4]);
        tiled_experts::<R, A>(client, experts, x, routing, &y, stages);
        combine(client, &s, routing, &y, out, stages, addend);
        return;
    }
    if let Some(mm) = cfg.mma
        && mma_fits(&s, routing.topk, &mm, cfg, client.properties().hardware.max_shared_memory_size)
    {
        // The intermediate (f32, only when the gate/up launch does not write its split), the experts' outputs
        // and the two BF16x3 splits (input, intermediate).
        let fused = fused_split();
        let h_bytes = if fused { 4 } else { n_pairs * s.inter * 4 };
        // The input's split from the device router, when it wrote one of this `x` (f32, the hidden size).
        let pre_split = routing
            .x_split
            .as_ref()
            .filter(|(_, k)| *k == s.hidden && std::any::TypeId::of::<A>() == std::any::TypeId::of::<f32>())
            .map(|(h, _)| h);
        let xs_bytes = if pre_split.is_some() { 4 } else { routing.m * 3 * s.hidden * 2 };
        let [h, y, xs, hs] = scratch(client, [h_bytes, n_pairs * s.hidden * 4, xs_bytes, n_pairs * 3 * s.inter * 2]);
        let xs = pre_split.unwrap_or(&xs);
        let bufs = [&h, &y, xs, &hs];
        mma_experts::<R, A>(client, experts, x, routing, bufs, cfg, &mm, stages, fused, pre_split.is_none());
        combine(client, &s, routing, &y, out, stages, addend);
        return;
    }
    let [h, y] = scratch(client, [n_pairs * s.inter * 4, n_pairs * s.hidden * 4]);
    // The comptime arguments of each launch come from `specs`, which also lists them for `cargo xtask kernels`.
    for (class, tb) in class_tbs(cfg).into_iter().enumerate() {
        let grid = routing.grid[class];
        if grid == 0 {
            continue;
        }
        let k = ExpertRowsSpec::gate_up(&s, routing.topk, cfg, tb);
        let count = CubeCount::Static(k.row_tiles(), grid, 1);
        // SAFETY: every buffer is passed with its true length; the kernels index inside `[E, rows, k/32]` weights
        // (expert ids are checked by `Routing::new` or chosen among the layer's experts by the device router),
        // `[m, hidden]` / `[pairs, inter]` activations and the routing arrays, whose slots (below `bounds[3] <=
        // slots`), offsets and pair indices are in range by construction.
        unsafe {
            if matches!(stages, Stages::All | Stages::GateUp) {
                expert_rows_kernel::launch_unchecked::<A, R>(
                    client,
                    count,
                    k.cube_dim(),
                    k.address,
                    VEC,
                    arg(x, routing.m * s.hidden),
                    arg(&experts.w13, s.experts * 2 * s.inter * s.hidden / 32),
                    arg(&experts.s13, s.experts * 2 * s.inter * s.hidden / s.group),
                    arg(&routing.experts, routing.slots),
                    arg(&routing.offsets, routing.slots + 1),
                    arg(&routing.pairs, n_pairs),
                    arg(&h, n_pairs * s.inter),
                    arg(&routing.bounds, 4),
                    class as u32,
                    k.k,
                    k.rows,
                    k.rows_at_once,
                    k.group,
                    k.topk,
                    k.tb,
                    k.rows_per_warp,
                    k.warps,
                    k.gated,
                    k.by_token,
                    k.prefetch,
                    k.tiled,
                );
            }
        }
    }
    for (class, tb) in class_tbs(cfg).into_iter().enumerate() {
        let grid = routing.grid[class];
        if grid == 0 || !matches!(stages, Stages::All | Stages::Down) {
            continue;
        }
        let k = ExpertRowsSpec::down(&s, routing.topk, cfg, tb);
        // SAFETY: as above.
        unsafe {
            expert_rows_kernel::launch_unchecked::<f32, R>(
                client,
                CubeCount::Static(k.row_tiles(), grid, 1),
                k.cube_dim(),
                k.address,
                VEC,
                arg(&h, n_pairs * s.inter),
                arg(&experts.w2, s.experts * s.hidden * s.inter / 32),
                arg(&experts.s2, s.experts * s.hidden * s.inter / s.group),
                arg(&routing.experts, routing.slots),
                arg(&routing.offsets, routing.slots + 1),
                arg(&routing.pairs, n_pairs),
                arg(&y, n_pairs * s.hidden),
                arg(&routing.bounds, 4),
                class as u32,
                k.k,
                k.rows,
                k.rows_at_once,
                k.group,
                k.topk,
                k.tb,
                k.rows_per_warp,
                k.warps,
                k.gated,
                k.by_token,
                k.prefetch,
                k.tiled,
            );
        }
    }
    combine(client, &s, routing, &y, out, stages, addend);
}

/// Whether the tensor-core gate/up launch writes the down launch's split input itself (`ExpertMmaSpec::split_out`),
/// saving the intermediate's `split_x3` launch; `EYRIE_MOE_FUSED_SPLIT=0` (or [`set_fused_split`]) keeps the
/// separate launch, for same-binary comparisons. Both give the same bits.
pub fn fused_split() -> bool {
    switch(&FUSED_SPLIT, "EYRIE_MOE_FUSED_SPLIT")
}

/// A process-wide switch: `flag`'s setting (0 off, 1 on), or, not set yet, on unless the environment variable
/// `var` is `0` (then remembered).
fn switch(flag: &std::sync::atomic::AtomicU8, var: &str) -> bool {
    use std::sync::atomic::Ordering;
    match flag.load(Ordering::Relaxed) {
        0 => false,
        1 => true,
        _ => {
            let on = std::env::var(var).map_or(true, |v| v != "0");
            flag.store(u8::from(on), Ordering::Relaxed);
            on
        }
    }
}

/// Sets [`fused_split`] for the process.
pub fn set_fused_split(on: bool) {
    FUSED_SPLIT.store(u8::from(on), std::sync::atomic::Ordering::Relaxed);
}

/// [`fused_split`]: 0 off, 1 on, 2 not read from the environment yet.
static FUSED_SPLIT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(2);

/// Whether [`moe_forward`] may take the tiled grouped GEMM (`moe_tiled`) where its tuned shape asks for it (prefill
/// chunks of [`TILED_GEMM_MIN_TOKENS`] or more): on unless `EYRIE_MOE_TILED_GEMM=0` (or [`set_tiled_gemm`]), which
/// keeps the 16-tokens-a-pass kernels, for same-binary comparisons (`gpu_ops` checks one against the other).
pub fn tiled_gemm() -> bool {
    switch(&TILED_GEMM, "EYRIE_MOE_TILED_GEMM")
}

/// Sets [`tiled_gemm`] for the process.
pub fn set_tiled_gemm(on: bool) {
    TILED_GEMM.store(u8::from(on), std::sync::atomic::Ordering::Relaxed);
}

/// [`tiled_gemm`]: 0 off, 1 on, 2 not read from the environment yet.
static TILED_GEMM: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(2);

/// Whether every launch of the tensor-core path takes `shape` under `mm`.
fn mma_fits(shape: &MoeShape, topk: usize, mm: &MmaShape, cfg: &MoeConfig, smem_limit: usize) -> bool {
    crate::cuda::specs::MMA_TBS.contains(&cfg.mma_tb)
        && mma_class_tbs(cfg).into_iter().all(|tb| {
            [ExpertMmaSpec::gate_up(shape, topk, mm, tb), ExpertMmaSpec::down(shape, topk, mm, tb)]
                .iter()
                .all(|spec| spec.fits() && spec.shared_bytes() <= smem_limit)
        })
}

/// `split_x3_kernel` of `rows` rows of width `k` from `x` (type `A`) into `out` (`[rows, 3, k / 2]` words).
fn split_x3<R: Runtime, A: Float>(client: &ComputeClient<R>, x: &Handle, out: &Handle, rows: usize, k: usize) {
    let words = rows * k / 2;
    // SAFETY: `x` holds `rows * k` values and `out` `3 * words` words; one thread per word of a part, guarded.
    unsafe {
        split_x3_kernel::launch_unchecked::<A, R>(
            client,
            CubeCount::Static(words.div_ceil(256) as u32, 1, 1),
            CubeDim::new_1d(256),
            AddressType::from_len(3 * words),
            arg(x, rows * k),
            arg(out, 3 * words),
            rows as u32,
            k,
        );
    }
}

/// The experts on tensor cores: split the input (`split_input`; otherwise `xs` holds it already), gate/up (one
/// launch per class; `fused`: it writes the split intermediate), split the intermediate (unless `fused`), down.
#[allow(clippy::too_many_arguments)]
fn mma_experts<R: Runtime, A: Float>(
    client: &ComputeClient<R>,
    experts: &GpuExperts<R>,
    x: &Handle,
    routing: &GpuRouting,
    [h, y, xs, hs]: [&Handle; 4],
    cfg: &MoeConfig,
    mm: &MmaShape,
    stages: Stages,
    fused: bool,
    split_input: bool,
) {
    let s = experts.shape;
    let n_pairs = routing.m * routing.topk;
    let hs_len = n_pairs * 3 * s.inter / 2;
    let launch = |spec: ExpertMmaSpec,
                  class: usize,
                  input: &Handle,
                  input_len: usize,
                  w: &Handle,
                  sc: &Handle,
                  o: &Handle,
                  o_len: usize| {
        let grid = routing.grid[class];
        if grid == 0 {
            return;
        }
        let words_len = s.experts * spec.rows * spec.k / 32;
        // SAFETY: every buffer is passed with its true length (in 16-byte vectors for `input` and `w`); indices
        // stay inside them by construction, as for `expert_rows_kernel` above.
        unsafe {
            expert_mma_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(spec.row_tiles(), grid, 1),
                spec.cube_dim(),
                spec.address,
                VEC,
                arg(input, input_len),
                arg(w, words_len),
                arg(sc, s.experts * spec.rows * spec.k / s.group),
                arg(&routing.experts, routing.slots),
                arg(&routing.offsets, routing.slots + 1),
                arg(&routing.pairs, n_pairs),
                arg(o, o_len),
                arg(hs, hs_len),
                arg(&routing.bounds, 4),
                class as u32,
                WEIGHT_BIAS,
                spec.k,
                spec.rows,
                spec.group,
                spec.topk,
                spec.tb,
                spec.tiles,
                spec.tasks,
                spec.ksplit,
                spec.gated,
                spec.by_token,
                spec.tiled,
                spec.split_out,
                spec.loads_only,
            );
        }
    };
    if matches!(stages, Stages::All | Stages::GateUp | Stages::GateUpLoads) {
        if split_input {
            split_x3::<R, A>(client, x, xs, routing.m, s.hidden);
        }
        for (class, tb) in mma_class_tbs(cfg).into_iter().enumerate() {
            let spec = ExpertMmaSpec {
                split_out: fused,
                loads_only: stages == Stages::GateUpLoads,
                ..ExpertMmaSpec::gate_up(&s, routing.topk, mm, tb)
            };
            // Fused: the launch writes `hs` (its `out` is passed unwritten: `y`, the right type and large enough).
            let (o, o_len) = if fused { (y, n_pairs * s.hidden) } else { (h, n_pairs * s.inter) };
            launch(spec, class, xs, routing.m * 3 * s.hidden / 8, &experts.w13, &experts.s13, o, o_len);
        }
    }
    if matches!(stages, Stages::All | Stages::Down | Stages::DownLoads) {
        if !fused {
            split_x3::<R, f32>(client, h, hs, n_pairs, s.inter);
        }
        for (class, tb) in mma_class_tbs(cfg).into_iter().enumerate() {
            let spec = ExpertMmaSpec {
                loads_only: stages == Stages::DownLoads,
                ..ExpertMmaSpec::down(&s, routing.topk, mm, tb)
            };
            launch(spec, class, hs, n_pairs * 3 * s.inter / 8, &experts.w2, &experts.s2, y, n_pairs * s.hidden);
        }
    }
}

/// The experts as a tiled grouped GEMM (`moe_tiled`, module docs there): the input's split, the routing's tile
/// list, gate/up with SiLU and the intermediate's split, down into `y` `[pairs, hidden]` (by pair index).
fn tiled_experts<R: Runtime, A: Float>(
    client: &ComputeClient<R>,
    experts: &GpuExperts<R>,
    x: &Handle,
    routing: &GpuRouting,
    y: &Handle,
    stages: Stages,
) {
    use super::moe_tiled::{BM, BN, LIST_THREADS, max_tiles, split_rows_kernel, tile_list_kernel, tiled_expert_kernel};
    let s = experts.shape;
    let n_pairs = routing.m * routing.topk;
    let ntiles = max_tiles(n_pairs, routing.slots);
    let xs_len = routing.m * 3 * s.hidden / 2;
    let hs_len = n_pairs * 3 * s.inter / 2;
    let tiles_len = 1 + 3 * ntiles;
    let [xs, hs, tiles, dummy] = scratch(client, [xs_len * 4, hs_len * 4, tiles_len * 4, 16]);
    let w13_len = s.experts * 2 * s.inter * s.hidden / 32;
    let w2_len = s.experts * s.hidden * s.inter / 32;
    let address = super::moe_tiled::tiled_address(&s, routing.m, n_pairs);
    let gate_up = matches!(stages, Stages::All | Stages::GateUp);
    let down = matches!(stages, Stages::All | Stages::Down);
    // SAFETY: every buffer is passed with its true length (16-byte vectors for the splits and the words); the
    // tile list holds at most `ntiles` tiles (`max_tiles`), each of positions inside `pairs` (the routing's
    // offsets) and of a slot below `bounds[3] <= slots <= MAX_SLOTS` (`tiled_fits`: experts <= MAX_SLOTS); tokens
    // `pairs[q] / topk < m`, expert ids below `E` (as for the other launches); blocks past the list's count exit.
    unsafe {
        if gate_up || down {
            tile_list_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(1, 1, 1),
                CubeDim::new_1d(LIST_THREADS as u32),
                arg(&routing.offsets, routing.slots + 1),
                arg(&routing.bounds, 4),
                arg(&tiles, tiles_len),
                BM,
            );
        }
        if gate_up {
            split_rows_kernel::launch_unchecked::<A, R>(
                client,
                CubeCount::Static((xs_len / 3).div_ceil(256) as u32, 1, 1),
                CubeDim::new_1d(256),
                AddressType::from_len(xs_len),
                arg(x, routing.m * s.hidden),
                arg(&xs, xs_len),
                (xs_len / 3) as u32,
                s.hidden,
            );
            tiled_expert_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static((s.inter / 64) as u32, ntiles as u32, 1),
                CubeDim::new_1d(BN as u32),
                address,
                VEC,
                arg(&xs, xs_len / 4),
                arg(&experts.w13, w13_len),
                arg(&experts.s13, s.experts * 2 * s.inter * s.hidden / s.group),
                arg(&routing.experts, routing.slots),
                arg(&routing.pairs, n_pairs),
                arg(&tiles, tiles_len),
                arg(&hs, hs_len),
                arg(&dummy, 4),
                s.hidden,
                2 * s.inter,
                s.group,
                routing.topk,
                true,
                s.tiled(),
            );
        }
        if down {
            tiled_expert_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static((s.hidden / BN) as u32, ntiles as u32, 1),
                CubeDim::new_1d(BN as u32),
                address,
                VEC,
                arg(&hs, hs_len / 4),
                arg(&experts.w2, w2_len),
                arg(&experts.s2, s.experts * s.hidden * s.inter / s.group),
                arg(&routing.experts, routing.slots),
                arg(&routing.pairs, n_pairs),
                arg(&tiles, tiles_len),
                arg(&dummy, 4),
                arg(y, n_pairs * s.hidden),
                s.inter,
                s.hidden,
                s.group,
                routing.topk,
                false,
                s.tiled(),
            );
        }
    }
}

/// The weighted combine of the experts' outputs `y` into `out`, plus `addend` (`[m, hidden]` f32) when given.
fn combine<R: Runtime>(
    client: &ComputeClient<R>,
    s: &MoeShape,
    routing: &GpuRouting,
    y: &Handle,
    out: &Handle,
    stages: Stages,
    addend: Option<&Handle>,
) {
    let n_pairs = routing.m * routing.topk;
    if matches!(stages, Stages::All | Stages::Combine) {
        let total = routing.m * s.hidden;
        // SAFETY: `y` is `[pairs, hidden]`, `weights` `[pairs]`, `out` and `addend` (the caller's contract; `out`
        // stands in, unread, without one) `[m, hidden]`; one thread per output.
        unsafe {
            combine_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(total.div_ceil(256) as u32, 1, 1),
                CubeDim::new_1d(256),
                AddressType::from_len(n_pairs * s.hidden),
                arg(y, n_pairs * s.hidden),
                arg(&routing.weights, n_pairs),
                arg(addend.unwrap_or(out), total),
                arg(out, total),
                s.hidden,
                routing.topk,
                addend.is_some(),
            );
        }
    }
}
