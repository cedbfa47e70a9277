//! The model's own CUDA kernels under burn's CUDA backend: burn's CUDA tensors are CubeCL buffers
//! ([`Cube`]), so a generic `Tensor<B, _>` whose backend is CUDA is taken apart here and its buffers handed to
//! eyrie-quant's kernels. Every entry point returns `None` when `B` is not the CUDA backend or the inputs are
//! not the kind the kernel takes; the caller then runs its generic burn ops.

use std::any::Any;

use burn::cubecl;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Shape, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;
use cubecl::prelude::*;
use eyrie_quant::cuda::dense::{GemvConfig, gemv_bf16};

/// burn's CUDA tensor primitive (float and int alike).
pub(crate) type Cube = burn_cubecl::tensor::CubeTensor<cubecl::cuda::CudaRuntime>;

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
    let sms = client.properties().hardware.num_streaming_multiprocessors.unwrap_or(132) as usize;
    gemv_bf16(&client, &xc.handle, &wc.handle, &out, n, rows, k, GemvConfig::for_shape(n, rows, 2 * sms)).ok()?;
    back::<B, 2>(Cube::new_contiguous(client, xc.device.clone(), Shape::new([n, rows]), out, DType::F32))
}

/// RMSNorm of each row in one launch (the generic path is seven burn ops: square, mean, add, sqrt, reciprocal and
/// two products). One block of 8 warps per row; f32 throughout; the row's sum of squares in a different order
/// than burn's mean, so results differ from the generic path by f32 rounding only.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::manual_div_ceil)]
pub fn rms_norm_kernel<N: Size>(
    x: &Array<Vector<f32, N>>,
    w: &Array<Vector<f32, N>>,
    out: &mut Array<Vector<f32, N>>,
    eps: f32,
    #[comptime] width: usize,
    #[comptime] warps: usize,
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
            let a = x[row * wv + v];
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
            let a = x[row * wv + v];
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
    let [n, width] = x.dims();
    if !is_cuda::<B>() || n == 0 || width == 0 || !width.is_multiple_of(4) || weight.dims()[0] != width {
        return None;
    }
    if x.dtype() != DType::F32 || weight.dtype() != DType::F32 {
        return None;
    }
    let xc = float(x.clone())?;
    let wc = float(weight.clone())?;
    let client = xc.client.clone();
    let out = client.empty(n * width * 4);
    let warps = 8usize;
    // SAFETY: `x` and `out` hold `n * width` f32 and `weight` `width` (checked above, contiguous); the kernel reads
    // and writes only row `CUBE_POS_X < n`, vectors `< width / 4`.
    unsafe {
        rms_norm_kernel::launch_unchecked::<cubecl::cuda::CudaRuntime>(
            &client,
            CubeCount::Static(n as u32, 1, 1),
            CubeDim::new_2d(32, warps as u32),
            AddressType::from_len(n * width),
            4,
            ArrayArg::from_raw_parts(xc.handle.clone(), n * width / 4),
            ArrayArg::from_raw_parts(wc.handle.clone(), width / 4),
            ArrayArg::from_raw_parts(out.clone(), n * width / 4),
            eps as f32,
            width,
            warps,
        );
    }
    back::<B, 2>(Cube::new_contiguous(client, xc.device.clone(), Shape::new([n, width]), out, DType::F32))
}

/// Absorbed MLA attention over layer `pool` `[slots, r + rot]` of the paged latent cache through eyrie-quant's
/// attention kernel: `q_lat` `[H, N, r]` and `q_pe` `[H, N, rot]` of the step's `N` query rows, which read the
/// cache as `rows` says -> `o_lat` `[H, N, r]`; or `None` (not CUDA, not f32, `r` not a multiple of 32 or `rot` of
/// 4, or the kernel refused the sizes), and the caller runs its burn ops. No score matrix is materialized.
pub(crate) fn mla_attention<B: Backend>(
    q_lat: &Tensor<B, 3>,
    q_pe: &Tensor<B, 3>,
    pool: &Tensor<B, 2>,
    rows: &eyrie_quant::cuda::attention::PagedRows,
    scale: f64,
) -> Option<Tensor<B, 3>> {
    use eyrie_quant::cuda::attention::{AttentionConfig, MAX_ROWS, mla_attention};
    let [h, n, r] = q_lat.dims();
    let rot = q_pe.dims()[2];
    let [slots, width] = pool.dims();
    if !is_cuda::<B>()
        || n == 0
        || n != rows.rows()
        || width != r + rot
        || !r.is_multiple_of(32)
        || !rot.is_multiple_of(4)
    {
        return None;
    }
    if q_lat.dtype() != DType::F32 || q_pe.dtype() != DType::F32 || pool.dtype() != DType::F32 {
        return None;
    }
    // [H, N, r + rot] -> [N, H, r + rot], made contiguous by `float`.
    let q = Tensor::cat(vec![q_lat.clone(), q_pe.clone()], 2).swap_dims(0, 1);
    let qc = float(q)?;
    let pc = float(pool.clone())?;
    let client = qc.client.clone();
    let props = client.properties();
    let sms = props.hardware.num_streaming_multiprocessors.unwrap_or(132) as usize;
    let smem = props.hardware.max_shared_memory_size;
    let max_len = rows.row_len.iter().copied().max().unwrap_or(0) as usize;
    if n > MAX_ROWS {
        // A launch takes at most MAX_ROWS rows: attend in parts (each row depends only on the cache and itself).
        let q = back::<B, 3>(qc)?;
        let mut parts = Vec::with_capacity(n.div_ceil(MAX_ROWS));
        for start in (0..n).step_by(MAX_ROWS) {
            let end = (start + MAX_ROWS).min(n);
            let q_part = q.clone().narrow(0, start, end - start);
            let (q_lat, q_pe) = (q_part.clone().narrow(2, 0, r), q_part.narrow(2, r, rot));
            let part = rows.subset(start..end);
            // (The bare name is eyrie-quant's launcher inside this function.)
            parts.push(crate::cuda_ops::mla_attention(
                &q_lat.swap_dims(0, 1),
                &q_pe.swap_dims(0, 1),
                pool,
                &part,
                scale,
            )?);
        }
        return Some(Tensor::cat(parts, 1));
    }
    let cfg = AttentionConfig::new(n, h, max_len, width, sms, smem)?;
    let meta = client.create_from_slice(u32::as_bytes(&rows.packed()));
    let out = client.empty(n * h * r * 4);
    mla_attention(&client, &qc.handle, &pc.handle, slots, rows, &meta, &out, h, r, rot, scale as f32, cfg).ok()?;
    let o = back::<B, 3>(Cube::new_contiguous(client, qc.device.clone(), Shape::new([n, h, r]), out, DType::F32))?;
    Some(o.swap_dims(0, 1))
}

/// Writes `rows` `[n, width]` into rows `slots` of `pool` in place through eyrie-quant's `write_rows` kernel (one
/// launch), or returns false (not CUDA, not f32, `pool` not contiguous, a size refused) and writes nothing.
pub(crate) fn write_rows<B: Backend>(pool: &Tensor<B, 2>, rows: Tensor<B, 2>, slots: &[u32]) -> bool {
    let [pool_rows, width] = pool.dims();
    if !is_cuda::<B>()
        || rows.dims() != [slots.len(), width]
        || pool.dtype() != DType::F32
        || rows.dtype() != DType::F32
    {
        return false;
    }
    // The pool's own buffer (never a contiguous copy of it: the write must land in the cache).
    let boxed: Box<dyn Any> = Box::new(pool.clone().into_primitive().tensor());
    let Ok(pc) = boxed.downcast::<Cube>() else { return false };
    if !pc.is_contiguous() {
        return false;
    }
    let Some(rc) = float(rows) else { return false };
    eyrie_quant::cuda::attention::write_rows(&pc.client, &rc.handle, slots, &pc.handle, pool_rows, width).is_ok()
}

/// RoPE of columns `off..off + d` of each row of `x` `[rows, cols]` (row `i` at position row `i / group` of the
/// tables), written as `[x1 cos - x2 sin | x2 cos + x1 sin]` into `out` `[rows, d]` (`rope::RotaryEmbedding`'s
/// layout). One thread per rotated pair.
#[cube(launch_unchecked, address_type = "dynamic")]
#[allow(clippy::too_many_arguments)]
pub fn rope_rows_kernel(
    x: &Array<f32>,
    cos: &Array<f32>,
    sin: &Array<f32>,
    out: &mut Array<f32>,
    pairs: u32,
    cols: u32,
    off: u32,
    group: u32,
    #[comptime] half: usize,
    #[comptime] interleave: bool,
) {
    let idx = ABSOLUTE_POS;
    if idx < pairs as usize {
        let row = idx / half;
        let i = idx % half;
        let tok = row / group as usize;
        let base = row * cols as usize + off as usize;
        let mut a = x[base + i];
        let mut b = x[base + half + i];
        if interleave {
            a = x[base + 2 * i];
            b = x[base + 2 * i + 1];
        }
        let c = cos[tok * half + i];
        let s = sin[tok * half + i];
        out[row * 2 * half + i] = a * c - b * s;
        out[row * 2 * half + half + i] = b * c + a * s;
    }
}

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
