//! The model's own CUDA kernels under burn's CUDA backend: burn's CUDA tensors are CubeCL buffers
//! (`Cube`), so a generic `Tensor<B, _>` whose backend is CUDA is taken apart here and its buffers handed to
//! eyrie-quant's kernels. Every entry point returns `None` when `B` is not the CUDA backend or the inputs are
//! not the kind the kernel takes; the caller then runs its generic burn ops.
//!
//! By concept: [`linear`] (BF16 Linears: GEMV, SwiGLU GEMV, the cuBLAS prefill GEMM), [`norm`] (RMSNorm, with the
//! residual add), [`rope`] (RoPE of row groups), [`mla`] (attention over the paged cache, the absorption, the cache
//! writes, the MHA form of prefill chunks), [`argmax_rows`] (greedy picks); this module holds the tensor <-> buffer
//! plumbing they share. The kernels themselves are eyrie-quant's (`eyrie_quant::cuda::{dense, gemm, attention,
//! prefill_attention, mla, norm, rope, sampling}`), so `cargo xtask kernels` compiles every one of them for each
//! target architecture; these modules launch them on burn's tensors.

use std::any::Any;

use burn::cubecl;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorPrimitive};
use burn_cubecl::kernel::into_contiguous;

pub mod linear;
pub mod mla;
pub mod norm;
pub mod rope;

pub use eyrie_quant::cuda::mla::{mla_latent_kernel, mla_output_kernel, mla_query_kernel};
pub use eyrie_quant::cuda::norm::rms_norm_kernel;
pub use eyrie_quant::cuda::rope::rope_rows_kernel;
pub use linear::{GEMV_MAX_TOKENS, gemv_max_tokens, mma_gemv_max_tokens};
pub(crate) use linear::{PairJob, gemm, gemv, gemv_normed, gemv_pair_jobs, gemv_swiglu_pair};
pub use mla::{
    MHA_PREFILL_MIN_ROWS, MHA_SEGMENT_BYTES, MlaDims, check_mha_prefill, enable_mha_prefill, mha_prefill_env_set,
    mha_prefill_min_rows, mla_absorbed, mla_latent_write, mla_mha_prefill, warm_up_attention,
};
pub(crate) use mla::{mla_attention, write_rows};
pub(crate) use norm::{add_rms_norm, rms_norm};
pub(crate) use rope::rope_rows;

/// burn's CUDA tensor primitive (float and int alike).
pub(crate) type Cube = burn_cubecl::tensor::CubeTensor<cubecl::cuda::CudaRuntime>;

/// Whether `B` is burn's CUDA backend.
pub(crate) fn is_cuda<B: Backend>() -> bool {
    std::any::TypeId::of::<B::FloatTensorPrimitive>() == std::any::TypeId::of::<Cube>()
}

/// `t`'s buffer, contiguous (copied only when it is not).
pub(crate) fn float<B: Backend, const D: usize>(t: Tensor<B, D>) -> Option<Cube> {
    let boxed: Box<dyn Any> = Box::new(t.into_primitive().tensor());
    boxed.downcast::<Cube>().ok().map(|c| {
        if !c.is_contiguous() {
            warn_big_copy(&c);
        }
        into_contiguous(*c)
    })
}

/// With `EYRIE_WARN_COPIES` set (a diagnostic): says on stderr, once a shape and with a backtrace when
/// `RUST_BACKTRACE` is set, that a buffer of 256 MiB or more is being copied to make it dense. Load-time copies are
/// expected (the fused experts' rows are made dense once); one during decode steps means a weight or pool reaches a
/// kernel non-dense and is copied at every call (a step's time, and device memory until CubeCL's next flush).
fn warn_big_copy(c: &Cube) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*ON.get_or_init(|| std::env::var_os("EYRIE_WARN_COPIES").is_some()) {
        return;
    }
    let bytes = c.meta.shape.iter().product::<usize>() * c.dtype.size();
    if bytes < 256 << 20 {
        return;
    }
    static SEEN: std::sync::Mutex<Vec<Vec<usize>>> = std::sync::Mutex::new(Vec::new());
    let shape: Vec<usize> = c.meta.shape.iter().copied().collect();
    let Ok(mut seen) = SEEN.lock() else { return };
    if seen.contains(&shape) {
        return;
    }
    seen.push(shape.clone());
    eprintln!(
        "eyrie: warning: copying a non-dense {:?} {shape:?} buffer ({bytes} bytes, strides {:?}) to make it \
         dense\n{}",
        c.dtype,
        c.meta.strides,
        std::backtrace::Backtrace::capture()
    );
}

/// An int tensor's buffer, contiguous.
pub(crate) fn int<B: Backend, const D: usize>(t: Tensor<B, D, Int>) -> Option<Cube> {
    let boxed: Box<dyn Any> = Box::new(t.into_primitive());
    boxed.downcast::<Cube>().ok().map(|c| into_contiguous(*c))
}

/// Whether `t` is a CUDA tensor whose buffer is dense (row-major, no pitch): [`float`] would not copy it.
pub(crate) fn is_dense<B: Backend, const D: usize>(t: &Tensor<B, D>) -> bool {
    let boxed: Box<dyn Any> = Box::new(t.clone().into_primitive().tensor());
    boxed.downcast::<Cube>().is_ok_and(|c| c.is_contiguous())
}

/// Warns once that a KV pool handed to the attention is not dense (it is then copied whole at every call; the
/// cache makes its pools dense at creation, so this means a pool was made some other way).
pub(crate) fn warn_if_pool_not_dense<B: Backend>(pool: &Tensor<B, 2>) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if !is_dense(pool) {
        WARNED.call_once(|| {
            eprintln!(
                "eyrie: warning: a KV pool of shape {:?} is not dense (pitched rows); the attention copies it whole \
                 at every call",
                pool.dims()
            )
        });
    }
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

/// CubeCL's device memory on `device` as this thread's stream sees it: `(bytes in use, bytes reserved)` (reserved:
/// the pages its pools hold, which it does not give back to the driver until a cleanup), or `None` when `B` is not
/// the CUDA backend. A diagnostic for benchmarks and logs (one server round trip).
pub fn memory_usage<B: Backend>(device: &B::Device) -> Option<(u64, u64)> {
    if !is_cuda::<B>() {
        return None;
    }
    let probe = float(Tensor::<B, 1>::zeros([1], device))?;
    let usage = probe.client.memory_usage().ok()?;
    Some((usage.bytes_in_use, usage.bytes_reserved))
}

/// A greedy pick of every row launched on the device with its readback queued, not yet waited for
/// ([`argmax_rows_pending`]): the next step can embed [`Self::ids`] on the device before the host has the ids, so
/// the host queues step `t + 1` while the GPU still runs step `t` (and reads step `t`'s ids during step `t + 1`).
pub struct PendingIds<B: Backend> {
    /// The picks on the device, `[rows]` int (the kernel's u32 ids, all below the vocabulary size).
    pub ids: Tensor<B, 1, Int>,
    read: std::pin::Pin<Box<dyn Future<Output = Result<Vec<u32>, String>> + Send>>,
}

impl<B: Backend> std::fmt::Debug for PendingIds<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingIds").field("rows", &self.ids.dims()[0]).finish_non_exhaustive()
    }
}

impl<B: Backend> PendingIds<B> {
    /// Waits for the readback (queued behind the pick's launch when it was made) and returns the ids.
    ///
    /// # Errors
    /// The device's message when the step or the readback failed.
    pub fn wait(self) -> Result<Vec<u32>, String> {
        cubecl::reader::read_sync(self.read)
    }
}

/// A clone of `client` that lives as long as the process, one a device (kept the first time a device asks): CubeCL's
/// `read_async` returns a future that borrows its client, and a pending readback outlives the call that queued it.
fn lasting_client(
    client: &cubecl::client::ComputeClient<cubecl::cuda::CudaRuntime>,
    device: &cubecl::cuda::CudaDevice,
) -> &'static cubecl::client::ComputeClient<cubecl::cuda::CudaRuntime> {
    type Kept = Vec<(cubecl::cuda::CudaDevice, &'static cubecl::client::ComputeClient<cubecl::cuda::CudaRuntime>)>;
    static KEPT: std::sync::Mutex<Kept> = std::sync::Mutex::new(Vec::new());
    let mut kept = KEPT.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, c)) = kept.iter().find(|(d, _)| d == device) {
        return c;
    }
    let c: &'static _ = Box::leak(Box::new(client.clone()));
    kept.push((device.clone(), c));
    c
}

/// [`argmax_rows`] without the wait: the pick is launched, its `rows` ids are queued for the host (a copy and a
/// fence on the stream, in order behind the step) and also kept on the device as an int tensor. `None` where
/// [`argmax_rows`] is `None`.
///
/// # Errors
/// The launcher's message.
pub fn argmax_rows_pending<B: Backend>(logits: &Tensor<B, 2>) -> Option<Result<PendingIds<B>, String>> {
    let (lc, out, rows) = match argmax_launch(logits)? {
        Ok(v) => v,
        Err(e) => return Some(Err(e)),
    };
    let client = lc.client.clone();
    // The readback is queued now (the client submits the copy and its fence to the device thread at once); only its
    // wait is deferred. The future borrows the client it came from, hence the device's lasting one.
    let read = lasting_client(&client, &lc.device).read_async(vec![out.clone()]);
    let read = Box::pin(async move {
        let bytes = read.await.map_err(|e| format!("argmax readback: {e:?}"))?;
        let bytes = bytes.first().ok_or("argmax readback: no buffer came back")?;
        Ok(bytes.chunks_exact(4).take(rows).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    });
    let ids = ids_tensor::<B>(&lc, out, rows)?;
    Some(Ok(PendingIds { ids, read }))
}

/// [`argmax_rows`]' picks left on the device as an int tensor `[rows]`, nothing read back (a tensor-parallel
/// worker's copy of the picks, for its next step to embed). `None` where [`argmax_rows`] is `None`.
///
/// # Errors
/// The launcher's message.
pub fn argmax_rows_ids<B: Backend>(logits: &Tensor<B, 2>) -> Option<Result<Tensor<B, 1, Int>, String>> {
    match argmax_launch(logits)? {
        Ok((lc, out, rows)) => ids_tensor::<B>(&lc, out, rows).map(Ok),
        Err(e) => Some(Err(e)),
    }
}

/// Launches the argmax of every row of `logits` into a new `[rows]` u32 buffer: `(the logits' buffer, the ids'
/// buffer, rows)`; `None` where [`argmax_rows`] is `None`.
fn argmax_launch<B: Backend>(logits: &Tensor<B, 2>) -> Option<Result<(Cube, cubecl::server::Handle, usize), String>> {
    let [rows, vocab] = logits.dims();
    if !is_cuda::<B>() || logits.dtype() != burn::tensor::DType::F32 || rows == 0 || !vocab.is_multiple_of(4) {
        return None;
    }
    let lc = float(logits.clone())?;
    let out = lc.client.empty(rows * 4);
    if let Err(e) = eyrie_quant::cuda::sampling::argmax_rows(&lc.client, &lc.handle, rows, vocab, &out) {
        return Some(Err(e));
    }
    Some(Ok((lc, out, rows)))
}

/// The argmax kernel's `[rows]` u32 ids as an int tensor of `B` on the logits' device: the ids are below 2^31 (the
/// kernel's sentinel becomes 0), so their bits are the same i32 values.
fn ids_tensor<B: Backend>(like: &Cube, out: cubecl::server::Handle, rows: usize) -> Option<Tensor<B, 1, Int>> {
    let ids = burn_cubecl::tensor::CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        burn::tensor::Shape::new([rows]),
        out,
        burn::tensor::DType::I32,
    );
    let boxed: Box<dyn Any> = Box::new(ids);
    let prim = boxed.downcast::<B::IntTensorPrimitive>().ok()?;
    Some(Tensor::from_primitive(*prim))
}

/// The argmax of each row of `logits` `[rows, vocab]` on the device (eyrie-quant's `cuda::sampling::argmax_rows`,
/// the host `sampling::argmax`'s rule), read back as `rows` ids: a greedy step's picks without copying the logits
/// to the host. `None` when `B` is not CUDA, the logits are not f32 or `vocab` is not a multiple of 4 (the caller
/// picks on the host).
///
/// # Errors
/// The launcher's or the device's message.
pub fn argmax_rows<B: Backend>(logits: &Tensor<B, 2>) -> Option<Result<Vec<u32>, String>> {
    let [rows, vocab] = logits.dims();
    if !is_cuda::<B>() || logits.dtype() != burn::tensor::DType::F32 || rows == 0 || !vocab.is_multiple_of(4) {
        return None;
    }
    let lc = float(logits.clone())?;
    let client = lc.client.clone();
    let out = client.empty(rows * 4);
    if let Err(e) = eyrie_quant::cuda::sampling::argmax_rows(&client, &lc.handle, rows, vocab, &out) {
        return Some(Err(e));
    }
    Some(
        client
            .read_one(out)
            .map(|bytes| bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
            .map_err(|e| format!("argmax readback: {e:?}")),
    )
}
