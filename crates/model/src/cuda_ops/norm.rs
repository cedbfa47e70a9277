//! RMSNorm in one launch, optionally with the residual add fused.

use burn::cubecl;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor};
use cubecl::prelude::*;

use super::{Cube, back, float, is_cuda};

/// RMSNorm of each row in one launch (the generic path is seven burn ops: square, mean, add, sqrt, reciprocal and
/// two products); with `add`, of `x + res` (the residual stream's update, written to `sum`), in the same launch. One
/// block of 8 warps per row; f32 throughout; the row's sum of squares in a different order than burn's mean, so
/// results differ from the generic path by f32 rounding only.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::manual_div_ceil, clippy::too_many_arguments)]
pub fn rms_norm_kernel<N: Size>(
    x: &Array<Vector<f32, N>>,
    res: &Array<Vector<f32, N>>,
    w: &Array<Vector<f32, N>>,
    sum: &mut Array<Vector<f32, N>>,
    out: &mut Array<Vector<f32, N>>,
    eps: f32,
    #[comptime] width: usize,
    #[comptime] warps: usize,
    #[comptime] add: bool,
) {
    let row = CUBE_POS_X as usize;
    let tid = UNIT_POS as usize;
    let lane = UNIT_POS_X as usize;
    let warp = UNIT_POS_Y as usize;
    let wv = comptime!(width / 4);
    let threads = comptime!(32 * warps);
    let mut ss = f32::new(0.0);
    for i in 0..comptime!((width / 4).div_ceil(32 * warps)) {
        let v = tid + i * threads;
        if v < wv {
            let mut a = x[row * wv + v];
            if add {
                a += res[row * wv + v];
                sum[row * wv + v] = a;
            }
            ss += a[0] * a[0] + a[1] * a[1] + a[2] * a[2] + a[3] * a[3];
        }
    }
    let s = plane_sum(ss);
    let mut part = SharedMemory::<f32>::new(warps);
    if lane == 0 {
        part[warp] = s;
    }
    sync_cube();
    let mut total = f32::new(0.0);
    #[unroll]
    for q in 0..warps {
        total += part[q];
    }
    let inv = f32::new(1.0) / (total / f32::new(comptime!(width as f32)) + eps).sqrt();
    for i in 0..comptime!((width / 4).div_ceil(32 * warps)) {
        let v = tid + i * threads;
        if v < wv {
            // (This thread wrote `sum[row, v]` itself in the first pass.)
            let mut a = x[row * wv + v];
            if add {
                a = sum[row * wv + v];
            }
            let g = w[v];
            let mut o = Vector::<f32, N>::empty();
            o[0] = a[0] * inv * g[0];
            o[1] = a[1] * inv * g[1];
            o[2] = a[2] * inv * g[2];
            o[3] = a[3] * inv * g[3];
            out[row * wv + v] = o;
        }
    }
}

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
    let out = client.empty(n * width * 4);
    // Without a residual, `res` and `sum` are never touched: `x`'s and `out`'s buffers stand in for them.
    let (res_h, sum) = match &rc {
        Some(r) => (r.handle.clone(), client.empty(n * width * 4)),
        None => (xc.handle.clone(), out.clone()),
    };
    let warps = 8usize;
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
