//! RoPE of row groups in one launch.

use burn::cubecl;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor};
use cubecl::prelude::*;

use eyrie_quant::cuda::rope::rope_rows_kernel;

use super::{Cube, back, float, is_cuda};

/// [`rope_rows_kernel`] over `x` `[rows, cols]` f32 with `cos`/`sin` `[rows / group, d / 2]` f32 -> `[rows, d]`, or
/// `None` (not CUDA, other dtypes or shapes).
pub(crate) fn rope_rows<B: Backend>(
    x: &Tensor<B, 2>,
    off: usize,
    d: usize,
    group: usize,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    interleave: bool,
) -> Option<Tensor<B, 2>> {
    let [rows, cols] = x.dims();
    let half = d / 2;
    if !is_cuda::<B>() || rows == 0 || group == 0 || d == 0 || !d.is_multiple_of(2) || off + d > cols {
        return None;
    }
    if cos.dims() != [rows / group, half] || sin.dims() != [rows / group, half] || !rows.is_multiple_of(group) {
        return None;
    }
    if x.dtype() != DType::F32 || cos.dtype() != DType::F32 || sin.dtype() != DType::F32 {
        return None;
    }
    let xc = float(x.clone())?;
    let cc = float(cos.clone())?;
    let sc = float(sin.clone())?;
    let client = xc.client.clone();
    let out = client.empty(rows * d * 4);
    let pairs = rows * half;
    // SAFETY: shapes checked above (contiguous); thread `idx < pairs` reads row `idx / half < rows` at columns
    // `off..off + d <= cols`, table row `< rows / group`, and writes `out[row, ..d]`.
    unsafe {
        rope_rows_kernel::launch_unchecked::<cubecl::cuda::CudaRuntime>(
            &client,
            CubeCount::Static(pairs.div_ceil(256) as u32, 1, 1),
            CubeDim::new_1d(256),
            AddressType::from_len(rows * cols),
            ArrayArg::from_raw_parts(xc.handle.clone(), rows * cols),
            ArrayArg::from_raw_parts(cc.handle.clone(), rows / group * half),
            ArrayArg::from_raw_parts(sc.handle.clone(), rows / group * half),
            ArrayArg::from_raw_parts(out.clone(), rows * d),
            pairs as u32,
            cols as u32,
            off as u32,
            group as u32,
            half,
            interleave,
        );
    }
    back::<B, 2>(Cube::new_contiguous(client, xc.device.clone(), Shape::new([rows, d]), out, DType::F32))
}
