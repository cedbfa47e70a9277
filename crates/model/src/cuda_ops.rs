//! The model's own CUDA kernels under burn's CUDA backend: burn's CUDA tensors are CubeCL buffers
//! ([`Cube`]), so a generic `Tensor<B, _>` whose backend is CUDA is taken apart here and its buffers handed to
//! eyrie-quant's kernels. Every entry point returns `None` when `B` is not the CUDA backend or the inputs are
//! not the kind the kernel takes; the caller then runs its generic burn ops.

use std::any::Any;

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Shape, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use eyrie_quant::cuda::dense::{GemvConfig, gemv_bf16};

/// burn's CUDA tensor primitive (float and int alike).
pub(crate) type Cube = burn_cubecl::tensor::CubeTensor<burn::cubecl::cuda::CudaRuntime>;

/// Whether `B` is burn's CUDA backend.
pub(crate) fn is_cuda<B: Backend>() -> bool {
    std::any::TypeId::of::<B::FloatTensorPrimitive>() == std::any::TypeId::of::<Cube>()
}

/// `t`'s buffer, contiguous (copied only when it is not).
pub(crate) fn float<B: Backend, const D: usize>(t: Tensor<B, D>) -> Option<Cube> {
    let boxed: Box<dyn Any> = Box::new(t.into_primitive().tensor());
    boxed.downcast::<Cube>().ok().map(|c| into_contiguous(*c))
}

/// An int tensor's buffer, contiguous.
pub(crate) fn int<B: Backend, const D: usize>(t: Tensor<B, D, Int>) -> Option<Cube> {
    let boxed: Box<dyn Any> = Box::new(t.into_primitive());
    boxed.downcast::<Cube>().ok().map(|c| into_contiguous(*c))
}

/// A CUDA buffer as a float tensor of `B` (which must be the CUDA backend).
pub(crate) fn back<B: Backend, const D: usize>(c: Cube) -> Option<Tensor<B, D>> {
    let boxed: Box<dyn Any> = Box::new(c);
    let prim = boxed.downcast::<B::FloatTensorPrimitive>().ok()?;
    Some(Tensor::from_primitive(TensorPrimitive::Float(*prim)))
}

/// `t` with a contiguous buffer on CUDA (a transposed or narrowed view is copied once); unchanged elsewhere.
pub(crate) fn contiguous<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    if !is_cuda::<B>() {
        return t;
    }
    match float::<B, D>(t.clone()).and_then(back::<B, D>) {
        Some(c) => c,
        None => t,
    }
}

/// An int tensor with a contiguous buffer on CUDA; unchanged elsewhere.
pub(crate) fn contiguous_int<B: Backend, const D: usize>(t: Tensor<B, D, Int>) -> Tensor<B, D, Int> {
    if !is_cuda::<B>() {
        return t;
    }
    let Some(c) = int::<B, D>(t.clone()) else { return t };
    let boxed: Box<dyn Any> = Box::new(c);
    match boxed.downcast::<B::IntTensorPrimitive>() {
        Ok(prim) => Tensor::from_primitive(*prim),
        Err(_) => t,
    }
}

/// Most tokens a step sends through the GEMV kernel; wider inputs (prefill chunks) take burn's matmul.
pub const GEMV_MAX_TOKENS: usize = 16;

/// `x` `[n, k]` f32 times `W^T` for `W` `[rows, k]` BF16 through eyrie-quant's GEMV kernel, or `None` (not CUDA,
/// other dtypes, more than [`GEMV_MAX_TOKENS`] rows, `k` not a multiple of 8).
pub(crate) fn gemv<B: Backend>(x: &Tensor<B, 2>, w: &Tensor<B, 2>) -> Option<Tensor<B, 2>> {
    let [n, k] = x.dims();
    let [rows, kw] = w.dims();
    if !is_cuda::<B>() || n == 0 || n > GEMV_MAX_TOKENS || kw != k || !k.is_multiple_of(8) {
        return None;
    }
    if w.dtype() != DType::BF16 || x.dtype() != DType::F32 {
        return None;
    }
    let xc = float(x.clone())?;
    let wc = float(w.clone())?;
    let client = xc.client.clone();
    let out = client.empty(n * rows * 4);
    gemv_bf16(&client, &xc.handle, &wc.handle, &out, n, rows, k, GemvConfig::for_tokens(n)).ok()?;
    back::<B, 2>(Cube::new_contiguous(client, xc.device.clone(), Shape::new([n, rows]), out, DType::F32))
}
