//! Dense GEMM at prefill widths with f32 activations and BF16 weights, on tensor cores at f32 precision:
//! `out[t, r] = sum_c x[t, c] * W[r, c]` for `W` `[rows, k]` BF16 as the checkpoint stores it and `x` `[n, k]` f32.
//!
//! Tensor cores multiply BF16 (or TF32) operands, not f32. Rounding the activations to BF16 (what a BF16 engine does)
//! or TF32 (what burn's f32 matmul does on CUDA) would lose 16 or 13 of their 24 bits. Instead each activation is
//! split into three BF16s, `x = hi + mid + lo` **exactly** ([`split_bf16x3`]: `hi` is `x` with its low 16 bits
//! cut, `mid` the same of the remainder `x - hi`, `lo` what is left, at most 8 significant bits). The weights are
//! BF16 already, so `x W^T = hi W^T + mid W^T + lo W^T` holds exactly, and each of the three products is a BF16
//! GEMM with f32 accumulation (every product of two BF16s is exact in f32). The three are one cuBLAS call over the
//! stacked `[3n, k]` activations (the weights are read once), then `out = (lo + mid) + hi` per element, at three
//! times the tensor-core work of a plain BF16 GEMM instead of the f32 FMA rate (~1/15 of it on an H200).
//!
//! Precision: the only rounding is the f32 accumulation, but the tensor cores' adds truncate instead of rounding to
//! nearest, so their error grows with the length they accumulate over. The cuBLAS calls therefore run over K-slices
//! of [`K_CHUNK`] columns, each added into the result by the GEMM's epilogue (an ordinary f32 add). Measured against
//! an f64 reference at Kimi-K2's shapes (bench/REPORT.md): within a few 1e-6 norm-wise, beside cuBLAS SGEMM's ~1e-6,
//! burn's TF32 matmul's ~2e-4 and a BF16 GEMM's ~1.5e-3.
//!
//! The split is exact for finite `x` with `|x| >= 2^-110` (smaller values lose bits below BF16's subnormal step,
//! 2^-133, an absolute error under 1e-40); a non-finite `x` gives NaN in its row.
//!
//! cuBLAS runs on CubeCL's own stream of the calling thread: eyrie's patched cubecl-cuda (`vendor/cubecl-cuda`)
//! names a buffer's stream in its device resource, and the resource lookups that give cuBLAS its pointers go
//! through CubeCL's server in queue order, so every launch before the call is on that stream when cuBLAS enqueues
//! after it, and every launch after the call follows it. No device synchronization: the host does not wait for
//! the GPU (before the patch it drained the queue before each call and waited for cuBLAS after, which made batched
//! decode steps above the GEMV's width host-bound). Decode-width calls reuse a workspace held by the [`Blas`]
//! handle for the split activations and partial products (its pointer looked up once), so they cost one server
//! round trip (the weight's pointer) and reserve nothing; a prefill-sized call reserves its own buffers and ends
//! with a flush of CubeCL's queue (a round trip), which is when CubeCL's storage frees device memory its pools
//! gave back.
//!
//! The CPU references are [`split_bf16x3`] and [`crate::cuda::dense::gemv_reference`] (f64 accumulation), always
//! built and tested in CI.

/// `x` as three BF16s (raw bits) whose f32 sum is exactly `x` (module docs: finite `x`, `|x| >= 2^-110`): each part
/// is the previous remainder with its low 16 bits cut (round toward zero), so every remainder is an exact f32.
pub fn split_bf16x3(x: f32) -> [u16; 3] {
    let hi = (x.to_bits() >> 16) as u16;
    let r = x - bf16_value(hi);
    let mid = (r.to_bits() >> 16) as u16;
    let lo = ((r - bf16_value(mid)).to_bits() >> 16) as u16;
    [hi, mid, lo]
}

/// The f32 value of BF16 bits.
pub fn bf16_value(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// The stacked split of `x` `[n, k]` as the GPU writes it: `[3, n, k]` BF16 bits (all `hi`, then all `mid`, then
/// all `lo`).
pub fn split_bf16x3_rows(x: &[f32]) -> Vec<u16> {
    let len = x.len();
    let mut out = vec![0u16; 3 * len];
    for (i, &v) in x.iter().enumerate() {
        let [hi, mid, lo] = split_bf16x3(v);
        out[i] = hi;
        out[len + i] = mid;
        out[2 * len + i] = lo;
    }
    out
}

/// K-slice of [`gemm_f32_bf16w`]'s cuBLAS calls (bench/REPORT.md, prefill GEMM: the error against an f64 reference
/// grows with the length the tensor cores accumulate over, their adds truncate).
pub const K_CHUNK: usize = 2048;

#[cfg(feature = "cuda")]
pub(crate) use gpu::launch_split_bf16x3;
#[cfg(feature = "cuda")]
pub use gpu::{Blas, gemm_f32_bf16w, gemm_f32_bf16w_chunked, split_bf16x3_kernel, sum3_kernel};

#[cfg(feature = "cuda")]
mod gpu {
    use std::sync::Arc;

    use burn::cubecl;
    use burn::cubecl::cuda::CudaRuntime;
    use cubecl::prelude::*;
    use cubecl::server::Handle;
    use cudarc::cublas::{result as cublas, sys};
    use cudarc::driver::{CudaContext, CudaStream};

    use super::K_CHUNK;

    /// Stacked split of `x` (module docs): thread `i` reads `x[2i], x[2i + 1]` and writes one word (two BF16s) in
    /// each of the three slabs of `out` (`words` words each).
    #[cube(launch_unchecked, address_type = "dynamic")]
    pub fn split_bf16x3_kernel(x: &Array<f32>, out: &mut Array<u32>, words: u32) {
        let i = ABSOLUTE_POS;
        let words = words as usize;
        if i < words {
            let a = x[2 * i];
            let b = x[2 * i + 1];
            let a_hi = u32::reinterpret(a) >> 16u32;
            let b_hi = u32::reinterpret(b) >> 16u32;
            let a_r = a - f32::reinterpret(a_hi << 16u32);
            let b_r = b - f32::reinterpret(b_hi << 16u32);
            let a_mid = u32::reinterpret(a_r) >> 16u32;
            let b_mid = u32::reinterpret(b_r) >> 16u32;
            let a_lo = u32::reinterpret(a_r - f32::reinterpret(a_mid << 16u32)) >> 16u32;
            let b_lo = u32::reinterpret(b_r - f32::reinterpret(b_mid << 16u32)) >> 16u32;
            out[i] = a_hi | (b_hi << 16u32);
            out[words + i] = a_mid | (b_mid << 16u32);
            out[2 * words + i] = a_lo | (b_lo << 16u32);
        }
    }

    /// Launches [`split_bf16x3_kernel`] over `words` words of `x` (`2 words` f32) into `split` (`3 words` words).
    ///
    /// # Safety
    /// `x` must hold `2 words` f32 and `split` `3 words` words.
    pub(crate) unsafe fn launch_split_bf16x3<R: Runtime>(
        client: &ComputeClient<R>,
        x: &Handle,
        split: &Handle,
        words: usize,
    ) {
        // SAFETY: the caller's sizes; the kernel writes index < words of each slab only.
        unsafe {
            split_bf16x3_kernel::launch_unchecked::<R>(
                client,
                CubeCount::Static(words.div_ceil(256) as u32, 1, 1),
                CubeDim::new_1d(256),
                AddressType::from_len(3 * words),
                ArrayArg::from_raw_parts(x.clone(), 2 * words),
                ArrayArg::from_raw_parts(split.clone(), 3 * words),
                words as u32,
            );
        }
    }

    /// `out[i] = (c[2 len + i] + c[len + i]) + c[i]` over vectors: the three partial products, smallest first.
    #[cube(launch_unchecked, address_type = "dynamic")]
    pub fn sum3_kernel<N: Size>(c: &Array<Vector<f32, N>>, out: &mut Array<Vector<f32, N>>, len: u32) {
        let i = ABSOLUTE_POS;
        let len = len as usize;
        if i < len {
            out[i] = (c[2 * len + i] + c[len + i]) + c[i];
        }
    }

    /// A cuBLAS handle on its own stream of one CUDA device (CubeCL's primary context). cuBLAS is loaded at run
    /// time (`libcublas.so`, `.so.13`, ...: cudarc's dynamic loading); a machine without it gets an error, not a
    /// panic. Not `Send`: keep one per thread (cuBLAS handles are not to be shared between threads unlocked).
    pub struct Blas {
        context: Arc<CudaContext>,
        stream: Arc<CudaStream>,
        handle: sys::cublasHandle_t,
        ordinal: usize,
        /// The stream cuBLAS is on now (`set_stream` is a no-op when it does not change).
        current: std::cell::Cell<usize>,
        /// Decode-width calls' split activations and partial products (see [`gemm_f32_bf16w`]).
        workspace: std::cell::RefCell<Option<Workspace>>,
    }

    /// A buffer reserved once on CubeCL's stream of the thread that owns the [`Blas`], reused by every call that
    /// fits (every use is on that one stream, in order), with its device pointer and stream looked up once.
    struct Workspace {
        handle: Handle,
        ptr: u64,
        stream: cudarc::driver::sys::CUstream,
        bytes: usize,
    }

    impl std::fmt::Debug for Blas {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("Blas").field("ordinal", &self.ordinal).finish_non_exhaustive()
        }
    }

    impl Blas {
        /// A handle for CUDA device `ordinal`.
        ///
        /// # Errors
        /// cuBLAS not found on the library path, or the device, stream or handle could not be made.
        pub fn new(ordinal: usize) -> Result<Self, String> {
            // SAFETY: only tries to load the library.
            if !unsafe { sys::is_culib_present() } {
                let names = cudarc::get_lib_name_candidates("cublas");
                return Err(format!(
                    "cuBLAS is not on the library path (looked for {}); add its directory (e.g. \
                     /usr/local/cuda/lib64) to LD_LIBRARY_PATH",
                    names.join(", ")
                ));
            }
            let context = CudaContext::new(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e}"))?;
            let stream = context.new_stream().map_err(|e| format!("CUDA device {ordinal}: a stream: {e}"))?;
            context.bind_to_thread().map_err(|e| format!("CUDA device {ordinal}: {e}"))?;
            let handle = cublas::create_handle().map_err(|e| format!("cuBLAS handle on device {ordinal}: {e:?}"))?;
            // SAFETY: a live handle and a live stream of the same context.
            if let Err(e) = unsafe { cublas::set_stream(handle, stream.cu_stream() as _) } {
                // SAFETY: made above, freed once.
                let _ = unsafe { cublas::destroy_handle(handle) };
                return Err(format!("cuBLAS stream on device {ordinal}: {e:?}"));
            }
            let current = std::cell::Cell::new(stream.cu_stream() as usize);
            Ok(Self { context, stream, handle, ordinal, current, workspace: std::cell::RefCell::new(None) })
        }

        /// The CUDA device this handle works on.
        pub fn ordinal(&self) -> usize {
            self.ordinal
        }

        fn bind(&self) -> Result<(), String> {
            self.context.bind_to_thread().map_err(|e| format!("CUDA device {}: {e}", self.ordinal))
        }

        /// Enqueues this handle's next calls on `stream` (a live stream of its device, e.g. CubeCL's: see
        /// [`gemm_f32_bf16w`]), or on its own stream again with `None`.
        ///
        /// # Errors
        /// cuBLAS refused the stream.
        pub fn set_stream(&self, stream: Option<cudarc::driver::sys::CUstream>) -> Result<(), String> {
            let stream = stream.unwrap_or_else(|| self.stream.cu_stream());
            if self.current.get() == stream as usize {
                return Ok(());
            }
            // SAFETY: a live handle; the caller's stream is a live stream of the same context.
            unsafe { cublas::set_stream(self.handle, stream as _) }
                .map_err(|e| format!("cuBLAS stream on device {}: {e:?}", self.ordinal))?;
            self.current.set(stream as usize);
            Ok(())
        }

        /// This handle's workspace of at least `bytes` (grown to the next power of two when short: one reservation
        /// and one pointer lookup then), as `(buffer, device pointer, CubeCL's stream)`.
        fn workspace(
            &self,
            client: &ComputeClient<CudaRuntime>,
            bytes: usize,
        ) -> Result<(Handle, u64, cudarc::driver::sys::CUstream), String> {
            let mut ws = self.workspace.borrow_mut();
            if ws.as_ref().is_none_or(|w| w.bytes < bytes) {
                let bytes = bytes.next_power_of_two();
                let handle = client.empty(bytes);
                let (ptr, stream) = {
                    let (ptr, stream, _guard) = device_ptr(client, &handle, "gemm_f32_bf16w: workspace")?;
                    (ptr, stream)
                };
                *ws = Some(Workspace { handle, ptr, stream, bytes });
            }
            let w = ws.as_ref().expect("set above");
            Ok((w.handle.clone(), w.ptr, w.stream))
        }

        /// Waits for this handle's stream.
        ///
        /// # Errors
        /// The stream failed (a fault in a cuBLAS kernel).
        pub fn synchronize(&self) -> Result<(), String> {
            self.stream.synchronize().map_err(|e| format!("cuBLAS stream on device {}: {e}", self.ordinal))
        }

        /// Enqueues `c` `[n, m]` f32 (row-major) `= a_rows` `[n, k]` times `W^T` `+ beta c`, `W` `[m, k]`,
        /// rows `ld` elements apart in both (`ld >= k`: a K-slice of wider matrices), both of type `ab`
        /// (`CUDA_R_16BF` or `CUDA_R_32F`), f32 accumulation (`compute`: `CUBLAS_COMPUTE_32F` is exact f32 for f32
        /// operands; `CUBLAS_COMPUTE_32F_FAST_TF32` rounds them to TF32). Does not wait.
        ///
        /// # Safety
        /// The pointers hold the sizes above on this handle's device and stay valid until the stream is
        /// synchronised.
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn gemm_nt(
            &self,
            w: u64,
            a_rows: u64,
            c: u64,
            (m, n, k, ld): (usize, usize, usize, usize),
            beta: f32,
            ab: sys::cudaDataType,
            compute: sys::cublasComputeType_t,
        ) -> Result<(), String> {
            if ld < k {
                return Err(format!("cuBLAS GEMM: row stride {ld} < k = {k}"));
            }
            let dims = [("m", m), ("n", n), ("k", k), ("ld", ld)];
            for (name, v) in dims {
                if v == 0 || v > i32::MAX as usize {
                    return Err(format!("cuBLAS GEMM: {name} = {v} is outside 1..=2^31-1"));
                }
            }
            self.bind()?;
            let alpha = 1.0f32;
            // Column-major view: C^T [m, n] = W [m, k] (stored as k x m, transposed) times X^T [k, n].
            // SAFETY: per the caller's contract; host scalars (the default pointer mode).
            unsafe {
                cublas::gemm_ex(
                    self.handle,
                    sys::cublasOperation_t::CUBLAS_OP_T,
                    sys::cublasOperation_t::CUBLAS_OP_N,
                    m as i32,
                    n as i32,
                    k as i32,
                    (&raw const alpha).cast(),
                    w as *const _,
                    ab,
                    ld as i32,
                    a_rows as *const _,
                    ab,
                    ld as i32,
                    (&raw const beta).cast(),
                    c as *mut _,
                    sys::cudaDataType::CUDA_R_32F,
                    m as i32,
                    compute,
                    sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| format!("cuBLAS GEMM [{n}, {k}] x [{m}, {k}]^T: {e:?}"))
        }
    }

    impl Drop for Blas {
        fn drop(&mut self) {
            let _ = self.context.bind_to_thread();
            let _ = self.stream.synchronize();
            // SAFETY: made in `new`, destroyed once, here.
            let _ = unsafe { cublas::destroy_handle(self.handle) };
        }
    }

    /// The device pointer of `h` and the CUDA stream whose storage holds it (eyrie's cubecl-cuda patch), with the
    /// resource guard. A server round trip: every task queued before it has been run (launches enqueued) on return.
    fn device_ptr(
        client: &ComputeClient<CudaRuntime>,
        h: &Handle,
        what: &str,
    ) -> Result<(u64, cudarc::driver::sys::CUstream, impl Sized), String> {
        let resource = client.get_resource(h.clone()).map_err(|e| format!("{what}: device memory: {e:?}"))?;
        Ok((resource.resource().ptr, resource.resource().stream, resource))
    }

    /// `out` `[n, rows]` f32 `= x` `[n, k]` f32 times `W^T`, `W` `[rows, k]` BF16 (contiguous, row-major), on
    /// tensor cores at f32 precision (module docs), in K-slices of [`K_CHUNK`]. `k` even; `blas` on the device of
    /// `client`. Everything is enqueued on CubeCL's stream of the calling thread (module docs); nothing waits for
    /// the device. `blas` is left on that stream.
    ///
    /// # Errors
    /// A message naming the parameter when a size does not fit (nothing is launched then), or the device's or
    /// cuBLAS's error.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_f32_bf16w(
        client: &ComputeClient<CudaRuntime>,
        blas: &Blas,
        x: &Handle,
        w: &Handle,
        out: &Handle,
        n: usize,
        rows: usize,
        k: usize,
    ) -> Result<(), String> {
        gemm_f32_bf16w_chunked(client, blas, x, w, out, (n, rows, k), K_CHUNK)
    }

    /// [`gemm_f32_bf16w`] with K-slices of `k_chunk` (rounded up to even; `k` or more: one GEMM over all of `k`).
    ///
    /// # Errors
    /// As [`gemm_f32_bf16w`].
    pub fn gemm_f32_bf16w_chunked(
        client: &ComputeClient<CudaRuntime>,
        blas: &Blas,
        x: &Handle,
        w: &Handle,
        out: &Handle,
        (n, rows, k): (usize, usize, usize),
        k_chunk: usize,
    ) -> Result<(), String> {
        if n == 0 || rows == 0 || k == 0 || !k.is_multiple_of(2) {
            return Err(format!("gemm_f32_bf16w: n {n}, rows {rows}, k {k}: need all >= 1 and k even"));
        }
        if 3 * n > i32::MAX as usize || rows > i32::MAX as usize || k > i32::MAX as usize {
            return Err(format!("gemm_f32_bf16w: n {n}, rows {rows}, k {k}: too large for one cuBLAS call"));
        }
        let sizes = [("x", x, n * k * 4), ("w", w, rows * k * 2), ("out", out, n * rows * 4)];
        for (name, h, bytes) in sizes {
            if (h.size_in_used() as usize) < bytes {
                return Err(format!("gemm_f32_bf16w: {name} holds {} bytes, needs {bytes}", h.size_in_used()));
            }
        }
        let words = n * k / 2;
        let (split_bytes, partial_bytes) = (3 * n * k * 2, 3 * n * rows * 4);
        // Decode widths: the thread's workspace (no reservation, no pointer lookups); prefill widths: buffers of
        // their own, freed after the call.
        let split_at = split_bytes.next_multiple_of(512);
        let small = split_at + partial_bytes <= crate::cuda::gpu::SCRATCH_MAX_BYTES;
        let (split, partial, known) = if small {
            let (ws, ptr, stream) = blas.workspace(client, split_at + partial_bytes)?;
            (ws.clone(), ws.offset_start(split_at as u64), Some((ptr, ptr + split_at as u64, stream)))
        } else {
            (client.empty(split_bytes), client.empty(partial_bytes), None)
        };
        // SAFETY: `x` holds 2 * words f32 and `split` 3 * words words (checked/allocated above); the kernel writes
        // index < words of each slab only.
        unsafe {
            launch_split_bf16x3::<CudaRuntime>(client, x, &split, words);
        }
        {
            // The lookup of W is a server round trip: the split kernel above is enqueued on CubeCL's stream when it
            // returns, so cuBLAS, enqueued next on that stream, runs after it.
            let (wp, _, _w) = device_ptr(client, w, "gemm_f32_bf16w: W")?;
            let mut guards = Vec::new();
            let (sp, pp, stream) = match known {
                Some(k) => k,
                None => {
                    let (pp, _, p) = device_ptr(client, &partial, "gemm_f32_bf16w: partial products")?;
                    // `split` was reserved just above on this thread's stream: its stream is the one CubeCL
                    // launches this thread's work on.
                    let (sp, stream, s) = device_ptr(client, &split, "gemm_f32_bf16w: split activations")?;
                    guards.push(p);
                    guards.push(s);
                    (sp, pp, stream)
                }
            };
            blas.set_stream(Some(stream))?;
            // K-slices, each added to the partial products by the GEMM's epilogue (an f32 add that rounds to
            // nearest): the tensor cores' own accumulation (which truncates) then runs over one slice only.
            let kc = k_chunk.max(2).next_multiple_of(2).min(k);
            for (i, k0) in (0..k).step_by(kc).enumerate() {
                let len = kc.min(k - k0);
                let beta = if i == 0 { 0.0 } else { 1.0 };
                // SAFETY: W [rows, k] BF16, split [3n, k] BF16, partial [3n, rows] f32, on CubeCL's stream: a buffer
                // freed after this call is reused only by work enqueued after it on the same stream; the slice's
                // first column `k0 + len <= k` (2 bytes an element).
                unsafe {
                    blas.gemm_nt(
                        wp + 2 * k0 as u64,
                        sp + 2 * k0 as u64,
                        pp,
                        (rows, 3 * n, len, k),
                        beta,
                        sys::cudaDataType::CUDA_R_16BF,
                        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    )?;
                }
            }
        }
        let len = n * rows;
        let vec = if len.is_multiple_of(4) { 4 } else { 1 };
        let vectors = len / vec;
        if vectors > u32::MAX as usize {
            return Err(format!("gemm_f32_bf16w: output of {len} values is too large"));
        }
        // SAFETY: `partial` holds 3 * len f32 and `out` len (checked above); the kernel writes index < vectors only.
        unsafe {
            sum3_kernel::launch_unchecked::<CudaRuntime>(
                client,
                CubeCount::Static(vectors.div_ceil(256) as u32, 1, 1),
                CubeDim::new_1d(256),
                AddressType::from_len(3 * len),
                vec,
                ArrayArg::from_raw_parts(partial, 3 * vectors),
                ArrayArg::from_raw_parts(out.clone(), vectors),
                vectors as u32,
            );
        }
        // CubeCL's storage frees device memory its pools give back only when its queue is flushed (a sync used to
        // do it here): flush after prefill-sized calls, where the round trip (no GPU wait) costs nothing next to
        // the GEMM; at decode widths it would cost a step ~60 us a call (batch 32: 18.8 -> 23.2 ms a step).
        if !small {
            client.flush().map_err(|e| format!("gemm_f32_bf16w: flushing CubeCL's queue: {e:?}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sum(parts: [u16; 3]) -> f32 {
        // The GPU adds the partial products smallest first; for the parts themselves any order is exact.
        (bf16_value(parts[2]) + bf16_value(parts[1])) + bf16_value(parts[0])
    }

    #[test]
    fn the_three_parts_add_up_to_the_value() {
        for v in [1.0f32, -1.0, 0.0, -0.0, 1.0 + f32::EPSILON, std::f32::consts::PI, -1e-30, 3.0e38, f32::MAX, 1e-33] {
            let parts = split_bf16x3(v);
            assert_eq!(sum(parts), v, "{v:e}: {parts:?}");
        }
        // Every part carries at most 8 significant bits (it is a BF16), and the parts shrink.
        let [hi, mid, lo] = split_bf16x3(1.0 + f32::EPSILON * 4_194_303.0);
        assert!(bf16_value(hi).abs() > bf16_value(mid).abs() && bf16_value(mid).abs() > bf16_value(lo).abs());
    }

    #[test]
    fn non_finite_inputs_give_nan_or_themselves() {
        for v in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let s = sum(split_bf16x3(v));
            assert!(s.is_nan() || s == v, "{v}: {s}");
        }
    }

    #[test]
    fn stacked_split_is_three_slabs() {
        let x = [1.5f32, -2.0e-3, 7.25e5, 1.0 / 3.0];
        let s = split_bf16x3_rows(&x);
        for (i, &v) in x.iter().enumerate() {
            assert_eq!(sum([s[i], s[4 + i], s[8 + i]]), v);
        }
    }

    #[test]
    fn split_products_reproduce_the_f64_dot_product() {
        // x W^T from the three BF16 parts (f64 sums of exact products) equals the f32-input f64 reference bit for
        // bit: the split loses nothing.
        let (n, rows, k) = (3, 5, 64);
        let x: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1013) as f32 - 506.3) / 97.1).collect();
        let w: Vec<u16> =
            (0..rows * k).map(|i| ((((i * 104_729 % 2039) as f32 - 1019.5) / 700.0).to_bits() >> 16) as u16).collect();
        let want = crate::cuda::dense::gemv_reference(&x, &w, n, rows, k);
        let s = split_bf16x3_rows(&x);
        for t in 0..n {
            for r in 0..rows {
                let mut acc = 0.0f64;
                for part in 0..3 {
                    for c in 0..k {
                        acc += f64::from(bf16_value(s[part * n * k + t * k + c])) * f64::from(bf16_value(w[r * k + c]));
                    }
                }
                assert_eq!(acc as f32, want[t * rows + r], "t {t} r {r}");
            }
        }
    }

    proptest! {
        #[test]
        fn any_normal_f32_splits_exactly(bits in 0u32..u32::MAX) {
            let v = f32::from_bits(bits);
            prop_assume!(v.is_finite() && (v == 0.0 || v.abs() >= 2f32.powi(-110)));
            prop_assert_eq!(sum(split_bf16x3(v)), v);
        }
    }
}
