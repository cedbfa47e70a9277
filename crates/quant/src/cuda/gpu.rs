//! Launching the fused INT4 MoE on a CubeCL runtime (CUDA in practice): expert weights uploaded once in the
//! [`KernelLayout`], routing uploaded per step, three launches per layer.

use std::marker::PhantomData;

use burn::cubecl;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::experts::{KernelLayout, MoeShape, Routing};
use super::kernels::{combine_kernel, copy_kernel, expert_rows_kernel};

/// Warps per block in the expert kernels.
const WARPS: usize = 8;
/// Row pairs per warp: gate/up kernel (7168-wide rows) and down kernel (2048-wide rows, so more rows per warp to
/// keep enough loads in flight).
const ROWS_PER_WARP_13: usize = 2;
const ROWS_PER_WARP_2: usize = 4;
/// 16-byte vectors: four packed words, or four f32 activations.
const VEC: usize = 4;

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

    /// The layer's sizes.
    pub fn shape(&self) -> MoeShape {
        self.shape
    }
}

/// A step's routing on the device: the grouping of [`Routing`] and the routing weights (`[m, topk]`, f32).
#[derive(Debug)]
pub struct GpuRouting {
    m: usize,
    topk: usize,
    n_active: usize,
    max_tokens: usize,
    experts: Handle,
    offsets: Handle,
    pairs: Handle,
    weights: Handle,
}

impl GpuRouting {
    /// Uploads `routing` and the routing `weights` (`[m, topk]`).
    pub fn upload<R: Runtime>(client: &ComputeClient<R>, routing: &Routing, weights: &[f32]) -> Self {
        assert_eq!(weights.len(), routing.m * routing.topk, "routing weights are [m, topk]");
        Self {
            m: routing.m,
            topk: routing.topk,
            n_active: routing.experts.len(),
            max_tokens: routing.max_tokens,
            experts: client.create_from_slice(u32::as_bytes(&routing.experts)),
            offsets: client.create_from_slice(u32::as_bytes(&routing.offsets)),
            pairs: client.create_from_slice(u32::as_bytes(&routing.pairs)),
            weights: client.create_from_slice(f32::as_bytes(weights)),
        }
    }

    /// Tokens in the step.
    pub fn m(&self) -> usize {
        self.m
    }
}

/// Tokens per pass over an expert's rows (a kernel specialisation): 1, 2 or 4.
fn tokens_per_pass(max_tokens: usize) -> usize {
    match max_tokens {
        0 | 1 => 1,
        2 => 2,
        _ => 4,
    }
}

/// Array argument over a whole buffer of `len` elements.
///
/// # Safety
/// `len` elements of the kernel's element type must fit in `handle`.
unsafe fn arg<R: Runtime>(handle: &Handle, len: usize) -> ArrayArg<R> {
    // SAFETY: forwarded to the caller.
    unsafe { ArrayArg::from_raw_parts(handle.clone(), len) }
}

/// The fused MoE layer: `out[t] = sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`.
///
/// `x`: `[m, hidden]` BF16; `out`: `[m, hidden]` f32 (written, not accumulated). Three launches: gate+up with
/// SiLU*up for every (token, expert) pair grouped by expert, down for every pair, weighted combine per token.
pub fn moe_forward<R: Runtime>(
    client: &ComputeClient<R>,
    experts: &GpuExperts<R>,
    x: &Handle,
    routing: &GpuRouting,
    out: &Handle,
) {
    let s = experts.shape;
    let n_pairs = routing.m * routing.topk;
    if n_pairs == 0 {
        return;
    }
    let h = client.empty(n_pairs * s.inter * 4);
    let y = client.empty(n_pairs * s.hidden * 4);
    let tb = tokens_per_pass(routing.max_tokens);
    let address = AddressType::from_len(experts_len(&s));
    let blocks_13 = s.inter.div_ceil(WARPS * ROWS_PER_WARP_13) as u32;
    let blocks_2 = (s.hidden / 2).div_ceil(WARPS * ROWS_PER_WARP_2) as u32;
    let dim = CubeDim::new_2d(32, WARPS as u32);
    // SAFETY: every buffer is passed with its true length; the kernels index inside `[E, rows, k/32]` weights
    // (expert ids are checked by `Routing::new`), `[m, hidden]` / `[pairs, inter]` activations and the routing
    // arrays of `Routing`, whose offsets and pair indices are in range by construction.
    unsafe {
        expert_rows_kernel::launch_unchecked::<half::bf16, R>(
            client,
            CubeCount::Static(blocks_13, routing.n_active as u32, 1),
            dim,
            address,
            VEC,
            arg(x, routing.m * s.hidden),
            arg(&experts.w13, s.experts * 2 * s.inter * s.hidden / 32),
            arg(&experts.s13, s.experts * 2 * s.inter * s.hidden / s.group),
            arg(&routing.experts, routing.n_active),
            arg(&routing.offsets, routing.n_active + 1),
            arg(&routing.pairs, n_pairs),
            arg(&h, n_pairs * s.inter),
            s.hidden,
            2 * s.inter,
            s.group,
            routing.topk,
            tb,
            ROWS_PER_WARP_13,
            WARPS,
            true,
            true,
        );
        expert_rows_kernel::launch_unchecked::<f32, R>(
            client,
            CubeCount::Static(blocks_2, routing.n_active as u32, 1),
            dim,
            address,
            VEC,
            arg(&h, n_pairs * s.inter),
            arg(&experts.w2, s.experts * s.hidden * s.inter / 32),
            arg(&experts.s2, s.experts * s.hidden * s.inter / s.group),
            arg(&routing.experts, routing.n_active),
            arg(&routing.offsets, routing.n_active + 1),
            arg(&routing.pairs, n_pairs),
            arg(&y, n_pairs * s.hidden),
            s.inter,
            s.hidden,
            s.group,
            routing.topk,
            tb,
            ROWS_PER_WARP_2,
            WARPS,
            false,
            false,
        );
        let total = routing.m * s.hidden;
        combine_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(total.div_ceil(256) as u32, 1, 1),
            CubeDim::new_1d(256),
            AddressType::from_len(n_pairs * s.hidden),
            arg(&y, n_pairs * s.hidden),
            arg(&routing.weights, n_pairs),
            arg(out, total),
            s.hidden,
            routing.topk,
        );
    }
}

/// Largest buffer of the experts in elements (picks 32- or 64-bit indexing).
fn experts_len(s: &MoeShape) -> usize {
    s.experts * 2 * s.inter * s.hidden / 8
}

/// Copies `floats` f32 (a multiple of 1024) from `src` to `dst` on the device.
pub fn copy_f32<R: Runtime>(client: &ComputeClient<R>, src: &Handle, dst: &Handle, floats: usize) {
    assert!(floats.is_multiple_of(1024), "copy length must be a multiple of 1024 floats");
    let vectors = floats / VEC;
    let blocks = (vectors / 256) as u32;
    // SAFETY: the grid covers exactly `vectors` vectors, both buffers hold `floats` floats.
    unsafe {
        copy_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(blocks, 1, 1),
            CubeDim::new_1d(256),
            AddressType::from_len(floats),
            VEC,
            arg(src, vectors),
            arg(dst, vectors),
        );
    }
}
