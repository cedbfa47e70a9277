//! The attention kernels' definitions for [`super::cuda_source`] (the key-lane, dim-lane, tensor-core and TF32
//! decode kernels, the combine, and the MHA-form prefill kernel): each builds the kernel's CubeCL expansion the way its
//! `#[cube(launch_unchecked)]` macro's `define()` does (see the parent module's docs).

use burn::cubecl;
use cubecl::ir::DeviceProperties;
use cubecl::prelude::*;

use super::{ARRAY, VEC, builder};
use crate::cuda::attention::{mla_attention_kernel, mla_combine_kernel};
use crate::cuda::attention_dims::{DimShape, mla_attention_dims_kernel};
use crate::cuda::attention_mma::{MmaShape, mla_attention_mma_kernel};
use crate::cuda::attention_tf32::{Tf32Shape, mla_attention_tf32_kernel};
use crate::cuda::prefill_attention::{MhaDims, mha_prefill_kernel};

/// `T`'s expansion.
type Ex<T> = <T as CubeType>::ExpandType;

/// The eleven launch arguments the three decode attention kernels share (`q, cache, meta, o_part, ml_part, n_rows,
/// heads, max_blocks, block_size, chunk, scale`), expanded in their order.
struct DecodeArgs<N: Size> {
    q: Ex<Array<Vector<f32, N>>>,
    cache: Ex<Array<Vector<f32, N>>>,
    meta: Ex<Array<u32>>,
    o_part: Ex<Array<Vector<f32, N>>>,
    ml_part: Ex<Array<f32>>,
    n_rows: Ex<u32>,
    heads: Ex<u32>,
    max_blocks: Ex<u32>,
    block_size: Ex<u32>,
    chunk: Ex<u32>,
    scale: Ex<f32>,
}

/// `$kernel`'s expansion into `$b` with the shared decode arguments `$x` (in their order), then the kernel's own
/// comptime arguments; `N` is the caller's vector size type.
macro_rules! expand_decode {
    ($kernel:ident, $b:ident, $x:ident, $($own:expr),+ $(,)?) => {
        $kernel::expand::<N>(
            &mut $b.scope,
            VEC,
            $x.q,
            $x.cache,
            $x.meta,
            $x.o_part,
            $x.ml_part,
            $x.n_rows,
            $x.heads,
            $x.max_blocks,
            $x.block_size,
            $x.chunk,
            $x.scale,
            $($own),+
        )
    };
}

/// A builder (32-bit indexing, vectors of [`VEC`] registered as `N`) and the decode kernels' shared arguments.
fn decode_args<N: Size + 'static>(props: &DeviceProperties) -> (KernelBuilder, DecodeArgs<N>) {
    let mut b = builder(props, AddressType::U32);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let q = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let cache = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let meta = <Array<u32> as LaunchArg>::expand(&a, &mut b);
    let o_part = <Array<Vector<f32, N>> as LaunchArg>::expand_output(&a, &mut b);
    let ml_part = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    let mut scalar = || <u32 as LaunchArg>::expand(&(), &mut b);
    let (n_rows, heads, max_blocks, block_size, chunk) = (scalar(), scalar(), scalar(), scalar(), scalar());
    let scale = <f32 as LaunchArg>::expand(&(), &mut b);
    let args = DecodeArgs { q, cache, meta, o_part, ml_part, n_rows, heads, max_blocks, block_size, chunk, scale };
    (b, args)
}

pub(super) fn define_mla_attention(
    r: usize,
    rot: usize,
    warps: usize,
    hpw: usize,
    props: &DeviceProperties,
) -> KernelDefinition {
    use mla_attention_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let (mut b, x) = decode_args::<N>(props);
    expand_decode!(mla_attention_kernel, b, x, r, rot, warps, hpw);
    let name = format!("mla_attention_kernel_n_{VEC}");
    b.build(
        KernelSettings::default().cube_dim(CubeDim::new_2d(32, warps as u32)).address_type(address).kernel_name(name),
    )
}

pub(super) fn define_mla_attention_dims(
    r: usize,
    rot: usize,
    shape: DimShape,
    props: &DeviceProperties,
) -> KernelDefinition {
    use mla_attention_dims_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let (mut b, x) = decode_args::<N>(props);
    expand_decode!(mla_attention_dims_kernel, b, x, r, rot, shape.wh, shape.wk, shape.hpw, shape.sg);
    let name = format!("mla_attention_dims_kernel_n_{VEC}");
    let dim = CubeDim::new_2d(32, (shape.wh * shape.wk) as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name(name))
}

pub(super) fn define_mla_attention_mma(
    r: usize,
    rot: usize,
    shape: MmaShape,
    props: &DeviceProperties,
) -> KernelDefinition {
    use mla_attention_mma_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let (mut b, x) = decode_args::<N>(props);
    expand_decode!(mla_attention_mma_kernel, b, x, r, rot, shape.tiles, shape.wk, shape.pt);
    let name = format!("mla_attention_mma_kernel_n_{VEC}");
    let dim = CubeDim::new_2d(32, (shape.tiles * shape.wk) as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name(name))
}

pub(super) fn define_mla_attention_tf32(
    r: usize,
    rot: usize,
    shape: Tf32Shape,
    props: &DeviceProperties,
) -> KernelDefinition {
    use mla_attention_tf32_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let (mut b, x) = decode_args::<N>(props);
    expand_decode!(mla_attention_tf32_kernel, b, x, r, rot, shape.warps, shape.pt, shape.stages);
    let name = format!("mla_attention_tf32_kernel_n_{VEC}");
    let dim = CubeDim::new_2d(32, shape.warps as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name(name))
}

pub(super) fn define_mla_combine(
    r: usize,
    halves: usize,
    one_pass: bool,
    props: &DeviceProperties,
) -> KernelDefinition {
    use mla_combine_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let mut b = builder(props, address);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let o_part = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let ml_part = <Array<f32> as LaunchArg>::expand(&a, &mut b);
    let out = <Array<Vector<f32, N>> as LaunchArg>::expand_output(&a, &mut b);
    let pairs = <u32 as LaunchArg>::expand(&(), &mut b);
    let splits = <u32 as LaunchArg>::expand(&(), &mut b);
    mla_combine_kernel::expand::<N>(&mut b.scope, VEC, o_part, ml_part, out, pairs, splits, r, halves, one_pass);
    let name = format!("mla_combine_kernel_n_{VEC}");
    let dim = CubeDim::new_1d((128 * halves) as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name(name))
}

pub(super) fn define_mha_prefill(dims: MhaDims, props: &DeviceProperties) -> KernelDefinition {
    use mha_prefill_kernel::_N;
    type N = DynamicSize<_N>;
    let address = AddressType::U32;
    let mut b = builder(props, address);
    b.scope.register_size::<N>(VEC);
    let a = ARRAY;
    let q = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let kv = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let kpe = <Array<Vector<f32, N>> as LaunchArg>::expand(&a, &mut b);
    let o_part = <Array<Vector<f32, N>> as LaunchArg>::expand_output(&a, &mut b);
    let ml_part = <Array<f32> as LaunchArg>::expand_output(&a, &mut b);
    let mut scalar = || <u32 as LaunchArg>::expand(&(), &mut b);
    let (n_rows, heads, start, key0, keys, seg, kpe_stride, kpe_off) =
        (scalar(), scalar(), scalar(), scalar(), scalar(), scalar(), scalar(), scalar());
    let scale = <f32 as LaunchArg>::expand(&(), &mut b);
    mha_prefill_kernel::expand::<N>(
        &mut b.scope,
        VEC,
        q,
        kv,
        kpe,
        o_part,
        ml_part,
        n_rows,
        heads,
        start,
        key0,
        keys,
        seg,
        kpe_stride,
        kpe_off,
        scale,
        dims.nope,
        dims.rot,
        dims.vd,
    );
    let name = format!("mha_prefill_kernel_n_{VEC}");
    let dim = CubeDim::new_1d(crate::cuda::prefill_attention::THREADS as u32);
    b.build(KernelSettings::default().cube_dim(dim).address_type(address).kernel_name(name))
}
