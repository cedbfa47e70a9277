//! RMSNorm in one launch, optionally with the residual add fused.

use burn::cubecl;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor};
use cubecl::prelude::*;

use eyrie_quant::cuda::norm::{RMS_NORM_WARPS, rms_norm_kernel};

use super::{Cube, back, float, is_cuda};

/// RMSNorm of `x` `[n, width]` (f32) with weight `[width]` (f32) in one launch, or `None` (not CUDA, other dtypes,
/// `width` not a multiple of 4, no rows).
pub(crate) fn rms_norm<B: Backend>(x: &Tensor<B, 2>, weight: &Tensor<B, 1>, eps: f64) -> Option<Tensor<B, 2>> {
    rms_norm_launch(x, None, weight, eps).map(|(_, y)| y)
}

/// `h = x + res` and the RMSNorm of `h`, both `[n, width]`, in one launch; `None` as [`rms_norm`] (or `res` of
/// another shape or dtype).
pub(crate) fn add_rms_norm<B: Backend>(
    x: &Tensor<B, 2>,
    res: &Tensor<B, 2>,
    weight: &Tensor<B, 1>,
    eps: f64,
) -> Option<(Tensor<B, 2>, Tensor<B, 2>)> {
    if res.dims() != x.dims() || res.dtype() != DType::F32 {
        return None;
    }
    let (h, y) = rms_norm_launch(x, Some(res), weight, eps)?;
    Some((h?, y))
}

/// The launch of [`rms_norm_kernel`]: `(x + res, normed)` with `res`, `(None, normed)` without.
fn rms_norm_launch<B: Backend>(
    x: &Tensor<B, 2>,
    res: Option<&Tensor<B, 2>>,
    weight: &Tensor<B, 1>,
    eps: f64,
) -> Option<(Option<Tensor<B, 2>>, Tensor<B, 2>)> {
    let [n, width] = x.dims();
    if !is_cuda::<B>() || n == 0 || width == 0 || !width.is_multiple_of(4) || weight.dims()[0] != width {
        return None;
    }
    if x.dtype() != DType::F32 || weight.dtype() != DType::F32 {
        return None;
    }
    let xc = float(x.clone())?;
    let wc = float(weight.clone())?;
    let rc = match res {
        Some(r) => Some(float(r.clone())?),
        None => None,
    };
    let client = xc.client.clone();
    // Without a residual, `res` and `sum` are never touched: `x`'s and `out`'s buffers stand in for them. With
    // one, the sum and the normed rows are reserved together.
    let (res_h, sum, out) = match &rc {
        Some(r) => {
            let [sum, out] = eyrie_quant::cuda::gpu::scratch(&client, [n * width * 4, n * width * 4]);
            (r.handle.clone(), sum, out)
        }
        None => {
            let out = client.empty(n * width * 4);
            (xc.handle.clone(), out.clone(), out)
        }
    };
    let warps = RMS_NORM_WARPS;
    // SAFETY: `x`, `res`, `sum` and `out` hold `n * width` f32 and `weight` `width` (checked above, contiguous); the
    // kernel reads and writes only row `CUBE_POS_X < n`, vectors `< width / 4`.
    unsafe {
        rms_norm_kernel::launch_unchecked::<cubecl::cuda::CudaRuntime>(
            &client,
            CubeCount::Static(n as u32, 1, 1),
            CubeDim::new_2d(32, warps as u32),
            AddressType::from_len(n * width),
            4,
            ArrayArg::from_raw_parts(xc.handle.clone(), n * width / 4),
            ArrayArg::from_raw_parts(res_h, n * width / 4),
            ArrayArg::from_raw_parts(wc.handle.clone(), width / 4),
            ArrayArg::from_raw_parts(sum.clone(), n * width / 4),
            ArrayArg::from_raw_parts(out.clone(), n * width / 4),
            eps as f32,
            width,
            warps,
            rc.is_some(),
        );
    }
    let shape = || Shape::new([n, width]);
    let y = back::<B, 2>(Cube::new_contiguous(client.clone(), xc.device.clone(), shape(), out, DType::F32))?;
    let h = match rc {
        Some(_) => Some(back::<B, 2>(Cube::new_contiguous(client, xc.device.clone(), shape(), sum, DType::F32))?),
        None => None,
    };
    Some((h, y))
}
