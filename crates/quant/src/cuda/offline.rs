//! CUDA C++ source of each [`KernelSpec`] for a target architecture, made on the host without a GPU: the
//! kernel's CubeCL expansion is built into a `KernelDefinition` the way the `#[cube(launch_unchecked)]` macro's
//! `define()` does it, with the device properties cubecl-cuda would report for that architecture, then compiled
//! by cubecl-cuda's own C++ compiler. `cargo xtask kernels` compiles the result with NVRTC.
//!
//! The macro's `define()` needs a live `ComputeClient` (a CUDA device) only for the device properties, so this
//! module repeats its few lines (cubecl 0.10's expansion: register the `Size`/`Float` generics, the address type,
//! then each argument in order) with properties made here. A cubecl upgrade that changes the expansion breaks
//! the build of this file, not silently the result.

use burn::cubecl;
use cubecl::cuda::{CudaCompiler, CudaRuntime};
use cubecl::ir::features::Plane;
use cubecl::ir::{DeviceProperties, HardwareProperties, MemoryDeviceProperties, VectorSize};
use cubecl::prelude::*;
use cubecl::{Compiler, ExecutionMode};
use cubecl_cpp::shared::{CompilationOptions, CppSupportedFeatures};
use half::bf16;

use super::dense::{gemv_bf16_kernel, gemv_norm_kernel, gemv_pair_kernel, gemv_swiglu_kernel};
use super::gemm::{split_bf16x3_kernel, sum3_kernel};
use super::kernels::{combine_kernel, copy_kernel, expert_rows_kernel};
use super::mla::{mla_latent_kernel, mla_output_kernel, mla_query_kernel};
use super::moe_mma::{expert_mma_kernel, split_x3_kernel};
use super::moe_tiled::{split_rows_kernel, tile_list_kernel, tiled_expert_kernel};
use super::norm::rms_norm_kernel;
use super::resources::Arch;
use super::rope::rope_rows_kernel;
use super::router::{group_kernel, route_kernel};
use super::sampling::argmax_rows_kernel;
use super::specs::{Act, ExpertMmaSpec, ExpertRowsSpec, KernelSpec};

#[path = "offline_attention.rs"]
mod attention;
use attention::{
    define_mha_prefill, define_mla_attention, define_mla_attention_dims, define_mla_attention_mma,
    define_mla_attention_tf32, define_mla_combine,
};

/// 16-byte vectors of the kernels (the launcher's `VEC`).
const VEC: usize = 4;

/// One specialisation compiled to CUDA C++.
#[derive(Debug, Clone)]
pub struct CudaKernelSource {
    /// Entry point name in the source.
    pub entry: String,
    /// The CUDA C++ source NVRTC compiles.
    pub source: String,
    /// Dynamic shared memory the launch asks for (all of the kernel's shared memory), bytes.
    pub dynamic_smem: usize,
    /// Threads per block.
    pub threads: usize,
}

/// The device properties cubecl-cuda 0.10 reports for `arch` (`runtime.rs`, `DeviceService::init`), as far as
/// they affect the expansion of these kernels: supported types, plane (warp) operations, 32-lane warps, and the
/// per-block shared memory opt-in. The MMA tables and atomics the server also registers are left out: the MoE
/// kernels use neither.
pub fn device_properties(arch: Arch) -> DeviceProperties {
    let hardware = HardwareProperties {
        load_width: 128,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: 1024,
        max_shared_memory_size: arch.max_shared_per_block(),
        max_cube_count: (i32::MAX as u32, 65535, 65535),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: None,
        num_cpu_cores: None,
        num_tensor_cores: None,
        min_tensor_cores_dim: None,
        max_vector_size: VectorSize::MAX,
    };
    let memory = MemoryDeviceProperties { max_page_size: 1 << 32, alignment: 512 };
    let mut props = DeviceProperties::new(Default::default(), memory, hardware, cubecl::profile::TimingMethod::System);
    cubecl_cpp::register_supported_types(&mut props);
    if arch.version >= 70 {
        props.features.plane.insert(Plane::Sync);
    }
    props.features.memory_reinterpret = true;
    props.features.alignment = true;
    props.features.plane.insert(Plane::Ops);
    props.features.plane.insert(Plane::NonUniformControlFlow);
    props
}

/// The compilation options cubecl-cuda 0.10 uses on `arch` with CUDA bindings of version `cuda_version`
/// (12080 for 12.8).
fn compilation_options(arch: Arch, cuda_version: u32) -> CompilationOptions {
    CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            fast_math: true,
            grid_constants: arch.version >= 70,
            fast_tanh: arch.version >= 75 && cuda_version >= 12080,
            clusters: arch.version >= 90,
            elect_sync: arch.version >= 90,
        },
    }
}

/// A kernel builder primed as the macro's `define()` primes it.
fn builder(props: &DeviceProperties, address: AddressType) -> KernelBuilder {
    let mut builder = KernelBuilder::default();
    builder.runtime_properties(CudaRuntime::target_properties());
    builder.device_properties(props);
    address.register(&mut builder.scope);
    builder
}

/// Compilation argument of an array bound to its own buffer (never in place), as every launch here binds them.
const ARRAY: ArrayCompilationArg = ArrayCompilationArg { inplace: None };

fn define_expert_rows(act_ty: Act, s: &ExpertRowsSpec, props: &DeviceProperties) -> KernelDefinition {
    use expert_rows_kernel::{_F, _N};
    type F = DynamicScalar<_F>;
    type N = DynamicSize<_N>;
    let mut b = builder(props, s.address);
    b.scope.register_size::<N>(VEC);
    b.scope.register_type::<F>(act_ty.storage_type());
    let a = ARRAY;
    let act = <Array<F> as LaunchArg>::expand(&a, &mut b);
    let words = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let scales = <Array<bf16> as LaunchArg>::expand(&a, &mut b);
    let experts = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let offsets = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let pairs = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    let bounds = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let class = <u32 as LaunchArg>::expand(&(), &mut b);
    expert_rows_kernel::expand::<F, N>(
        &mut b.scope,
        VEC,
        act,
        words,
        scales,
        experts,
        offsets,
        pairs,
        out,
        bounds,
        class,
        s.k,
        s.rows,
        s.rows_at_once,
        s.group,
        s.topk,
        s.tb,
        s.rows_per_warp,
        s.warps,
        s.gated,
        s.by_token,
        s.prefetch,
        s.tiled,
    );
    let name = format!("expert_rows_kernel_f_{}_n_{VEC}", act_ty.name());
    b.build(KernelSettings::default().cube_dim(s.cube_dim()).address_type(s.address).kernel_name(name))
}

fn define_expert_mma(s: &ExpertMmaSpec, props: &DeviceProperties) -> KernelDefinition {
    use expert_mma_kernel::_N;
    type N = DynamicSize<_N>;
    let mut b = builder(props, s.address);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let xs = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let words = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let scales = <Array<bf16> as LaunchArg>::expand(&a, &mut b);
    let experts = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let offsets = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let pairs = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    let hs_out = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let bounds = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let class = <u32 as LaunchArg>::expand(&(), &mut b);
    let bias = <u32 as LaunchArg>::expand(&(), &mut b);
    expert_mma_kernel::expand::<N>(
        &mut b.scope,
        VEC,
        xs,
        words,
        scales,
        experts,
        offsets,
        pairs,
        out,
        hs_out,
        bounds,
        class,
        bias,
        s.k,
        s.rows,
        s.group,
        s.topk,
        s.tb,
        s.tiles,
        s.tasks,
        s.ksplit,
        s.gated,
        s.by_token,
        s.tiled,
        s.split_out,
        s.loads_only,
    );
    let name = format!("expert_mma_kernel_n_{VEC}");
    b.build(KernelSettings::default().cube_dim(s.cube_dim()).address_type(s.address).kernel_name(name))
}

fn define_split_x3(act_ty: Act, k: usize, props: &DeviceProperties) -> KernelDefinition {
    use split_x3_kernel::_F;
    type F = DynamicScalar<_F>;
    let address = AddressType::U32;
    let mut b = builder(props, address);
    b.scope.register_type::<F>(act_ty.storage_type());
    let a = ARRAY;
    let x = <Array<F> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let rows = <u32 as LaunchArg>::expand(&(), &mut b);
    split_x3_kernel::expand::<F>(&mut b.scope, x, out, rows, k);
    let name = format!("split_x3_kernel_f_{}", act_ty.name());
    b.build(KernelSettings::default().cube_dim(CubeDim::new_1d(256)).address_type(address).kernel_name(name))
}

fn define_tiled_expert(
    [k, rows, group, topk]: [usize; 4],
    gated: bool,
    tiled: bool,
    address: AddressType,
    props: &DeviceProperties,
) -> KernelDefinition {
    use tiled_expert_kernel::_N;
    type N = DynamicSize<_N>;
    let mut b = builder(props, address);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let xs = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let words = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let scales = <Array<bf16> as LaunchArg>::expand(&a, &mut b);
    let experts = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let pairs = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let tiles = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let split_out = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let out = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    tiled_expert_kernel::expand::<N>(
        &mut b.scope,
        VEC,
        xs,
        words,
        scales,
        experts,
        pairs,
        tiles,
        split_out,
        out,
        k,
        rows,
        group,
        topk,
        gated,
        tiled,
    );
    let name = format!("tiled_expert_kernel_n_{VEC}");
    let dim = CubeDim::new_1d(super::moe_tiled::BN as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name(name))
}

fn define_split_rows(act_ty: Act, k: usize, props: &DeviceProperties) -> KernelDefinition {
    use split_rows_kernel::_F;
    type F = DynamicScalar<_F>;
    let address = AddressType::U32;
    let mut b = builder(props, address);
    b.scope.register_type::<F>(act_ty.storage_type());
    let a = ARRAY;
    let x = <Array<F> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let words = <u32 as LaunchArg>::expand(&(), &mut b);
    split_rows_kernel::expand::<F>(&mut b.scope, x, out, words, k);
    let name = format!("split_rows_kernel_f_{}", act_ty.name());
    b.build(KernelSettings::default().cube_dim(CubeDim::new_1d(256)).address_type(address).kernel_name(name))
}

fn define_tile_list(props: &DeviceProperties) -> KernelDefinition {
    let address = AddressType::U32;
    let mut b = builder(props, address);
    let a = ARRAY;
    let offsets = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let bounds = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let tiles = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    tile_list_kernel::expand(&mut b.scope, offsets, bounds, tiles, super::moe_tiled::BM);
    let dim = CubeDim::new_1d(super::moe_tiled::LIST_THREADS as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name("tile_list_kernel"))
}

fn define_combine(
    hidden: usize,
    topk: usize,
    add: bool,
    address: AddressType,
    props: &DeviceProperties,
) -> KernelDefinition {
    let mut b = builder(props, address);
    let a = ARRAY;
    let y = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let weights = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let addend = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    combine_kernel::expand(&mut b.scope, y, weights, addend, out, hidden, topk, add);
    b.build(
        KernelSettings::default().cube_dim(CubeDim::new_1d(256)).address_type(address).kernel_name("combine_kernel"),
    )
}

fn define_copy(props: &DeviceProperties) -> KernelDefinition {
    use copy_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let mut b = builder(props, address);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let input = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let output = <Array<Vector<f32, N>> as LaunchArg>::expand_output(&a, &mut b);
    copy_kernel::expand::<N>(&mut b.scope, VEC, input, output);
    let name = format!("copy_kernel_n_{VEC}");
    b.build(KernelSettings::default().cube_dim(CubeDim::new_1d(256)).address_type(address).kernel_name(name))
}

fn define_argmax_rows(props: &DeviceProperties) -> KernelDefinition {
    use argmax_rows_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let mut b = builder(props, address);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let logits = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let vecs = <u32 as LaunchArg>::expand(&(), &mut b);
    argmax_rows_kernel::expand::<N>(&mut b.scope, VEC, logits, out, vecs);
    let name = format!("argmax_rows_kernel_n_{VEC}");
    let dim = CubeDim::new_1d(super::sampling::ARGMAX_THREADS as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name(name))
}

fn define_gemv(k: usize, cfg: &super::dense::GemvConfig, props: &DeviceProperties) -> KernelDefinition {
    use gemv_bf16_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let mut b = builder(props, address);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let x = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let w = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    let tokens = <u32 as LaunchArg>::expand(&(), &mut b);
    let rows = <u32 as LaunchArg>::expand(&(), &mut b);
    let c = cfg;
    gemv_bf16_kernel::expand::<N>(
        &mut b.scope,
        VEC,
        x,
        w,
        out,
        tokens,
        rows,
        k,
        c.rows_at_once,
        c.tb,
        c.warps,
        c.ksplit,
        c.unroll,
    );
    let name = format!("gemv_bf16_kernel_n_{VEC}");
    b.build(
        KernelSettings::default()
            .cube_dim(CubeDim::new_2d(32, cfg.warps as u32))
            .address_type(address)
            .kernel_name(name),
    )
}

fn define_gemv_mma(k: usize, cfg: &super::dense_mma::MmaGemvConfig, props: &DeviceProperties) -> KernelDefinition {
    use super::dense_mma::gemv_mma_kernel;
    use gemv_mma_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let mut b = builder(props, address);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let xs = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let w = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let wu = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    let tokens = <u32 as LaunchArg>::expand(&(), &mut b);
    let rows = <u32 as LaunchArg>::expand(&(), &mut b);
    let c = cfg;
    gemv_mma_kernel::expand::<N>(
        &mut b.scope,
        VEC,
        xs,
        w,
        wu,
        out,
        tokens,
        rows,
        k,
        c.tb,
        c.tiles,
        c.tasks,
        c.ksplit,
        c.bv,
        c.gated,
    );
    let name = format!("gemv_mma_kernel_n_{VEC}");
    b.build(
        KernelSettings::default()
            .cube_dim(CubeDim::new_2d(32, (cfg.tasks * cfg.ksplit) as u32))
            .address_type(address)
            .kernel_name(name),
    )
}

fn define_gemv_norm(k: usize, cfg: &super::dense::GemvConfig, props: &DeviceProperties) -> KernelDefinition {
    use gemv_norm_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let mut b = builder(props, address);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let x = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let g = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let w = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    let tokens = <u32 as LaunchArg>::expand(&(), &mut b);
    let rows = <u32 as LaunchArg>::expand(&(), &mut b);
    let eps = <f32 as LaunchArg>::expand(&(), &mut b);
    let c = cfg;
    gemv_norm_kernel::expand::<N>(
        &mut b.scope,
        VEC,
        x,
        g,
        w,
        out,
        tokens,
        rows,
        eps,
        k,
        c.rows_at_once,
        c.tb,
        c.warps,
        c.ksplit,
        c.unroll,
    );
    let name = format!("gemv_norm_kernel_n_{VEC}");
    b.build(
        KernelSettings::default()
            .cube_dim(CubeDim::new_2d(32, cfg.warps as u32))
            .address_type(address)
            .kernel_name(name),
    )
}

fn define_gemv_pair(
    k: usize,
    (a, swiglu_a): (&super::dense::GemvConfig, bool),
    (b, swiglu_b): (&super::dense::GemvConfig, bool),
    props: &DeviceProperties,
) -> KernelDefinition {
    use gemv_pair_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let mut bld = builder(props, address);
    bld.scope.register_size::<N>(VEC);
    let arr = ARRAY;
    let x = <Array<Vector<f32, N>> as LaunchArg>::expand(&arr, &mut bld);
    let wa = <Array<Vector<u32, N>> as LaunchArg>::expand(&arr, &mut bld);
    let wa_up = <Array<Vector<u32, N>> as LaunchArg>::expand(&arr, &mut bld);
    let out_a = <Array<f32> as LaunchArg>::expand_output(&arr, &mut bld);
    let wb = <Array<Vector<u32, N>> as LaunchArg>::expand(&arr, &mut bld);
    let wb_up = <Array<Vector<u32, N>> as LaunchArg>::expand(&arr, &mut bld);
    let out_b = <Array<f32> as LaunchArg>::expand_output(&arr, &mut bld);
    let tokens = <u32 as LaunchArg>::expand(&(), &mut bld);
    let rows_a = <u32 as LaunchArg>::expand(&(), &mut bld);
    let rows_b = <u32 as LaunchArg>::expand(&(), &mut bld);
    let blocks_a = <u32 as LaunchArg>::expand(&(), &mut bld);
    let sets = |swiglu: bool| if swiglu { 2usize } else { 1 };
    gemv_pair_kernel::expand::<N>(
        &mut bld.scope,
        VEC,
        x,
        wa,
        wa_up,
        out_a,
        wb,
        wb_up,
        out_b,
        tokens,
        rows_a,
        rows_b,
        blocks_a,
        k,
        a.tb,
        a.warps,
        a.rows_at_once,
        a.ksplit,
        a.unroll,
        sets(swiglu_a),
        b.rows_at_once,
        b.ksplit,
        b.unroll,
        sets(swiglu_b),
    );
    let name = format!("gemv_pair_kernel_n_{VEC}");
    bld.build(
        KernelSettings::default().cube_dim(CubeDim::new_2d(32, a.warps as u32)).address_type(address).kernel_name(name),
    )
}

fn define_gemv_swiglu(k: usize, cfg: &super::dense::GemvConfig, props: &DeviceProperties) -> KernelDefinition {
    use gemv_swiglu_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let mut b = builder(props, address);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let x = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let wg = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let wu = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    let tokens = <u32 as LaunchArg>::expand(&(), &mut b);
    let rows = <u32 as LaunchArg>::expand(&(), &mut b);
    gemv_swiglu_kernel::expand::<N>(
        &mut b.scope,
        VEC,
        x,
        wg,
        wu,
        out,
        tokens,
        rows,
        k,
        cfg.rows_at_once,
        cfg.tb,
        cfg.warps,
        cfg.ksplit,
        cfg.unroll,
    );
    let name = format!("gemv_swiglu_kernel_n_{VEC}");
    b.build(
        KernelSettings::default()
            .cube_dim(CubeDim::new_2d(32, cfg.warps as u32))
            .address_type(address)
            .kernel_name(name),
    )
}

fn define_split_bf16x3(props: &DeviceProperties) -> KernelDefinition {
    let address = AddressType::U32;
    let mut b = builder(props, address);
    let a = ARRAY;
    let x = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let words = <u32 as LaunchArg>::expand(&(), &mut b);
    split_bf16x3_kernel::expand(&mut b.scope, x, out, words);
    b.build(
        KernelSettings::default()
            .cube_dim(CubeDim::new_1d(256))
            .address_type(address)
            .kernel_name("split_bf16x3_kernel"),
    )
}

fn define_sum3(props: &DeviceProperties) -> KernelDefinition {
    use sum3_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let mut b = builder(props, address);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let c = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<Vector<f32, N>> as LaunchArg>::expand_output(&a, &mut b);
    let len = <u32 as LaunchArg>::expand(&(), &mut b);
    sum3_kernel::expand::<N>(&mut b.scope, VEC, c, out, len);
    let name = format!("sum3_kernel_n_{VEC}");
    b.build(KernelSettings::default().cube_dim(CubeDim::new_1d(256)).address_type(address).kernel_name(name))
}

#[allow(clippy::too_many_arguments)]
fn define_route(
    experts: usize,
    n_group: usize,
    topk_group: usize,
    top_k: usize,
    norm: bool,
    (grouped, split_k): (bool, usize),
    props: &DeviceProperties,
) -> KernelDefinition {
    let address = AddressType::U32;
    let mut b = builder(props, address);
    let a = ARRAY;
    let logits = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let bias = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let ids = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let weights = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    let experts_out = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let offsets = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let pairs = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let bounds = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let x = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let x_split = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let scale = <f32 as LaunchArg>::expand(&(), &mut b);
    let tokens = <u32 as LaunchArg>::expand(&(), &mut b);
    route_kernel::expand(
        &mut b.scope,
        logits,
        bias,
        ids,
        weights,
        experts_out,
        offsets,
        pairs,
        bounds,
        x,
        x_split,
        scale,
        tokens,
        experts,
        n_group,
        topk_group,
        top_k,
        norm,
        grouped,
        split_k,
    );
    let dim = CubeDim::new_1d(super::router::ROUTE_THREADS as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name("route_kernel"))
}

fn define_group(experts: usize, props: &DeviceProperties) -> KernelDefinition {
    let address = AddressType::U32;
    let threads = experts.next_power_of_two().max(32);
    let mut b = builder(props, address);
    let a = ARRAY;
    let ids = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let experts_out = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let offsets = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let pairs = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let bounds = <Array<u32> as LaunchArg>::expand_output(&a, &mut b);
    let n_pairs = <u32 as LaunchArg>::expand(&(), &mut b);
    group_kernel::expand(&mut b.scope, ids, experts_out, offsets, pairs, bounds, n_pairs, experts, threads);
    let dim = CubeDim::new_1d(threads as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name("group_kernel"))
}

fn define_rms_norm(width: usize, add: bool, props: &DeviceProperties) -> KernelDefinition {
    use rms_norm_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let warps = super::norm::RMS_NORM_WARPS;
    let mut b = builder(props, address);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let x = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let res = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let w = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let sum = <Array<Vector<f32, N>> as LaunchArg>::expand_output(&a, &mut b);
    let out = <Array<Vector<f32, N>> as LaunchArg>::expand_output(&a, &mut b);
    let eps = <f32 as LaunchArg>::expand(&(), &mut b);
    rms_norm_kernel::expand::<N>(&mut b.scope, VEC, x, res, w, sum, out, eps, width, warps, add);
    let name = format!("rms_norm_kernel_n_{VEC}");
    let dim = CubeDim::new_2d(32, warps as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name(name))
}

fn define_rope_rows(half: usize, interleave: bool, props: &DeviceProperties) -> KernelDefinition {
    let address = AddressType::U32;
    let mut b = builder(props, address);
    let a = ARRAY;
    let x = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let cos = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let sin = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    let pairs = <u32 as LaunchArg>::expand(&(), &mut b);
    let cols = <u32 as LaunchArg>::expand(&(), &mut b);
    let off = <u32 as LaunchArg>::expand(&(), &mut b);
    let group = <u32 as LaunchArg>::expand(&(), &mut b);
    rope_rows_kernel::expand(&mut b.scope, x, cos, sin, out, pairs, cols, off, group, half, interleave);
    let dim = CubeDim::new_1d(256);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name("rope_rows_kernel"))
}

#[allow(clippy::too_many_arguments)]
fn define_mla_query(
    heads: usize,
    (nope, rot, vd, r): (usize, usize, usize, usize),
    tb: usize,
    groups: usize,
    interleave: bool,
    props: &DeviceProperties,
) -> KernelDefinition {
    use mla_query_kernel::_N;
    type N = DynamicSize<_N>;
    // The launcher reads the BF16 weight pairs as 8-byte vectors of two words.
    const W_VEC: usize = 2;
    let address = AddressType::U32;
    let mut b = builder(props, address);
    b.scope.register_size::<N>(W_VEC);
    let a = ARRAY;
    let q = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let w = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let cos = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let sin = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    let tokens = <u32 as LaunchArg>::expand(&(), &mut b);
    mla_query_kernel::expand::<N>(
        &mut b.scope,
        W_VEC,
        q,
        w,
        cos,
        sin,
        out,
        tokens,
        heads,
        nope,
        rot,
        vd,
        r,
        tb,
        groups,
        interleave,
    );
    let name = format!("mla_query_kernel_n_{W_VEC}");
    let dim = CubeDim::new_2d((r / 4) as u32, groups as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name(name))
}

fn define_mla_output(
    heads: usize,
    (nope, vd, r): (usize, usize, usize),
    (ra, tb, warps): (usize, usize, usize),
    merge: bool,
    props: &DeviceProperties,
) -> KernelDefinition {
    use mla_output_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let mut b = builder(props, address);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let o_lat = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let ml_part = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let w = <Array<Vector<u32, N>> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    let tokens = <u32 as LaunchArg>::expand(&(), &mut b);
    let splits = <u32 as LaunchArg>::expand(&(), &mut b);
    mla_output_kernel::expand::<N>(
        &mut b.scope,
        VEC,
        o_lat,
        ml_part,
        w,
        out,
        tokens,
        splits,
        heads,
        nope,
        vd,
        r,
        ra,
        tb,
        warps,
        merge,
    );
    let name = format!("mla_output_kernel_n_{VEC}");
    let dim = CubeDim::new_2d(32, warps as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name(name))
}

fn define_mla_latent(r: usize, rot: usize, interleave: bool, props: &DeviceProperties) -> KernelDefinition {
    let address = AddressType::U32;
    let mut b = builder(props, address);
    let a = ARRAY;
    let kv = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let w = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let cos = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let sin = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let slots = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let pool = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    let eps = <f32 as LaunchArg>::expand(&(), &mut b);
    let row_stride = <u32 as LaunchArg>::expand(&(), &mut b);
    mla_latent_kernel::expand(&mut b.scope, kv, w, cos, sin, slots, pool, eps, row_stride, r, rot, interleave);
    let dim = CubeDim::new_2d(32, super::mla::LATENT_WARPS as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name("mla_latent_kernel"))
}

/// Compiles `spec` to CUDA C++ for `arch`, as cubecl-cuda would on a device of that architecture with CUDA
/// bindings of version `cuda_version` (unchecked launches, as the launcher's).
pub fn cuda_source(spec: &KernelSpec, arch: Arch, cuda_version: u32) -> Result<CudaKernelSource, String> {
    let props = device_properties(arch);
    let (def, address) = match spec {
        KernelSpec::ExpertRows { act, spec } => (define_expert_rows(*act, spec, &props), spec.address),
        KernelSpec::ExpertMma { spec } => (define_expert_mma(spec, &props), spec.address),
        KernelSpec::SplitX3 { act, k } => (define_split_x3(*act, *k, &props), AddressType::U32),
        KernelSpec::TiledExpert { k, rows, group, topk, gated, tiled, address } => {
            (define_tiled_expert([*k, *rows, *group, *topk], *gated, *tiled, *address, &props), *address)
        }
        KernelSpec::SplitRows { act, k } => (define_split_rows(*act, *k, &props), AddressType::U32),
        KernelSpec::TileList => (define_tile_list(&props), AddressType::U32),
        KernelSpec::Combine { hidden, topk, add, address } => {
            (define_combine(*hidden, *topk, *add, *address, &props), *address)
        }
        KernelSpec::Copy => (define_copy(&props), AddressType::U32),
        KernelSpec::MlaAttention { r, rot, warps, hpw } => {
            (define_mla_attention(*r, *rot, *warps, *hpw, &props), AddressType::U32)
        }
        KernelSpec::MlaAttentionDims { r, rot, shape } => {
            (define_mla_attention_dims(*r, *rot, *shape, &props), AddressType::U32)
        }
        KernelSpec::MlaAttentionMma { r, rot, shape } => {
            (define_mla_attention_mma(*r, *rot, *shape, &props), AddressType::U32)
        }
        KernelSpec::MlaAttentionTf32 { r, rot, shape } => {
            (define_mla_attention_tf32(*r, *rot, *shape, &props), AddressType::U32)
        }
        KernelSpec::MlaCombine { r, halves, one_pass } => {
            (define_mla_combine(*r, *halves, *one_pass, &props), AddressType::U32)
        }
        KernelSpec::MhaPrefill { dims } => (define_mha_prefill(*dims, &props), AddressType::U32),
        KernelSpec::ArgmaxRows => (define_argmax_rows(&props), AddressType::U32),
        KernelSpec::Gemv { k, cfg } => (define_gemv(*k, cfg, &props), AddressType::U32),
        KernelSpec::GemvSwiglu { k, cfg } => (define_gemv_swiglu(*k, cfg, &props), AddressType::U32),
        KernelSpec::GemvMma { k, cfg } => (define_gemv_mma(*k, cfg, &props), AddressType::U32),
        KernelSpec::GemvNorm { k, cfg } => (define_gemv_norm(*k, cfg, &props), AddressType::U32),
        KernelSpec::GemvPair { k, a, swiglu_a, b, swiglu_b } => {
            (define_gemv_pair(*k, (a, *swiglu_a), (b, *swiglu_b), &props), AddressType::U32)
        }
        KernelSpec::SplitBf16x3 => (define_split_bf16x3(&props), AddressType::U32),
        KernelSpec::Sum3 => (define_sum3(&props), AddressType::U32),
        KernelSpec::Route { experts, n_group, topk_group, top_k, norm, grouped, split_k } => (
            define_route(*experts, *n_group, *topk_group, *top_k, *norm, (*grouped, *split_k), &props),
            AddressType::U32,
        ),
        KernelSpec::Group { experts } => (define_group(*experts, &props), AddressType::U32),
        KernelSpec::RmsNorm { width, add } => (define_rms_norm(*width, *add, &props), AddressType::U32),
        KernelSpec::RopeRows { half, interleave } => (define_rope_rows(*half, *interleave, &props), AddressType::U32),
        KernelSpec::MlaQuery { heads, dims, tb, groups, interleave } => {
            (define_mla_query(*heads, *dims, *tb, *groups, *interleave, &props), AddressType::U32)
        }
        KernelSpec::MlaOutput { heads, dims, ra, tb, warps, merge } => {
            (define_mla_output(*heads, *dims, (*ra, *tb, *warps), *merge, &props), AddressType::U32)
        }
        KernelSpec::MlaLatent { r, rot, interleave } => {
            (define_mla_latent(*r, *rot, *interleave, &props), AddressType::U32)
        }
    };
    let entry = def.options.kernel_name.clone();
    let dim = def.cube_dim;
    let mut compiler = CudaCompiler::default();
    let repr = compiler
        .compile(def, &compilation_options(arch, cuda_version), ExecutionMode::Unchecked, address.unsigned_type())
        .map_err(|e| format!("{}: CubeCL compilation failed: {e:?}", spec.label()))?;
    Ok(CudaKernelSource {
        entry,
        dynamic_smem: repr.shared_memory_size(),
        // As cubecl-cuda rewrites it for the device (markers, the PDL prologue from sm_90).
        source: cubecl::cuda::eyrie_source_rewrite(&repr.to_string(), arch.version >= 90),
        threads: (dim.x * dim.y * dim.z) as usize,
    })
}
