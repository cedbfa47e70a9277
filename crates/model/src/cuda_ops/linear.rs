//! BF16-weight Linears on CUDA: decode widths through eyrie-quant's GEMV (and the SwiGLU GEMV for an MLP's gate and
//! up): on the CUDA cores up to [`gemv_max_tokens`] rows, on tensor cores (f32-exact, `dense_mma`) up to
//! [`mma_gemv_max_tokens`]; wider inputs through its f32-precision cuBLAS GEMM (a cuBLAS handle per thread and
//! device).

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, Tensor};
use eyrie_quant::cuda::dense::{GemvConfig, GemvJob, gemv_bf16, gemv_norm, gemv_pair, gemv_swiglu};
use eyrie_quant::cuda::dense_mma::{MMA_GEMV_MAX_TOKENS, MmaGemvConfig, gemv_mma};
use eyrie_quant::cuda::gemm::{Blas, gemm_f32_bf16w};

use super::{Cube, back, float, is_cuda};

/// Most tokens a step sends through the GEMV kernel by default; wider inputs (batched decode steps of 5 or more
/// sequences, verification, prefill chunks) take `gemm`. Measured on the H200 (bench/REPORT.md, session 10; a
/// 10-layer slice at 1k, ms a step GEMV / cuBLAS): 2 rows 4.4 / 8.1, 4 rows 5.7 / 5.7, 5 rows 8.9 / 7.9, 8 rows
/// 10.9 / 9.5, 16 rows 17.3 / 12.5: the GEMV is issue-bound in f32 above a few rows, cuBLAS reads the weights once.
pub const GEMV_MAX_TOKENS: usize = 4;

/// Most tokens a step sends through the GEMV kernel: [`GEMV_MAX_TOKENS`], or `EYRIE_GEMV_MAX_TOKENS` (read once; a
/// benchmark knob for finding the crossover again after either path changes).
pub fn gemv_max_tokens() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| match std::env::var("EYRIE_GEMV_MAX_TOKENS") {
        Err(std::env::VarError::NotPresent) => GEMV_MAX_TOKENS,
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => {
                eprintln!(
                    "eyrie: warning: EYRIE_GEMV_MAX_TOKENS={v:?} is not a positive integer; using {GEMV_MAX_TOKENS}"
                );
                GEMV_MAX_TOKENS
            }
        },
        Err(e) => {
            eprintln!("eyrie: warning: EYRIE_GEMV_MAX_TOKENS: {e}; using {GEMV_MAX_TOKENS}");
            GEMV_MAX_TOKENS
        }
    })
}

/// Most tokens a step sends through the tensor-core GEMV by default (above [`gemv_max_tokens`]); wider inputs take
/// `gemm`. Measured on the H200 (bench/REPORT.md, session 11; a 10-layer slice at 1k, ms a step, tensor-core GEMV /
/// cuBLAS): 6 rows 7.3 / 8.9, 8 rows 8.3 / 9.4, 12 rows 10.5 / 10.7, 16 rows 13.3 / 12.5.
pub const MMA_GEMV_DEFAULT_MAX_TOKENS: usize = 12;

/// Most tokens a step sends through the tensor-core GEMV (above [`gemv_max_tokens`]): [`MMA_GEMV_DEFAULT_MAX_TOKENS`],
/// or `EYRIE_MMA_GEMV_MAX_TOKENS` (read once; up to the kernel's [`MMA_GEMV_MAX_TOKENS`]; 0 turns the tensor-core
/// GEMV off: those widths take `gemm`).
pub fn mma_gemv_max_tokens() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| match std::env::var("EYRIE_MMA_GEMV_MAX_TOKENS") {
        Err(std::env::VarError::NotPresent) => MMA_GEMV_DEFAULT_MAX_TOKENS,
        Ok(v) => match v.parse::<usize>() {
            Ok(n) if n <= MMA_GEMV_MAX_TOKENS => n,
            _ => {
                eprintln!(
                    "eyrie: warning: EYRIE_MMA_GEMV_MAX_TOKENS={v:?} is not an integer in 0..={MMA_GEMV_MAX_TOKENS}; \
                     using {MMA_GEMV_DEFAULT_MAX_TOKENS}"
                );
                MMA_GEMV_DEFAULT_MAX_TOKENS
            }
        },
        Err(e) => {
            eprintln!("eyrie: warning: EYRIE_MMA_GEMV_MAX_TOKENS: {e}; using {MMA_GEMV_DEFAULT_MAX_TOKENS}");
            MMA_GEMV_DEFAULT_MAX_TOKENS
        }
    })
}

/// The multiprocessors of `client`'s device.
fn sms_of<R: burn::cubecl::Runtime>(client: &burn::cubecl::prelude::ComputeClient<R>) -> usize {
    client.properties().hardware.num_streaming_multiprocessors.unwrap_or(132) as usize
}

/// `x` `[n, k]` f32 times `W^T` for `W` `[rows, k]` BF16 through eyrie-quant's GEMV kernels (CUDA cores up to
/// [`gemv_max_tokens`] rows, tensor cores up to [`mma_gemv_max_tokens`] where the shape allows), or `None` (not
/// CUDA, other dtypes, wider inputs, `k` not a multiple of 8).
pub(crate) fn gemv<B: Backend>(x: &Tensor<B, 2>, w: &Tensor<B, 2>) -> Option<Tensor<B, 2>> {
    let [n, k] = x.dims();
    let [rows, kw] = w.dims();
    if !is_cuda::<B>() || n == 0 || n > gemv_max_tokens().max(mma_gemv_max_tokens()) || kw != k || !k.is_multiple_of(8)
    {
        return None;
    }
    if w.dtype() != DType::BF16 || x.dtype() != DType::F32 {
        return None;
    }
    let xc = float(x.clone())?;
    let wc = float(w.clone())?;
    let client = xc.client.clone();
    let sms = sms_of(&client);
    // Above the CUDA-core GEMV's width: the tensor-core GEMV, or `None` (then `gemm`) for a shape it does not take.
    let mma = if n > gemv_max_tokens() { Some(MmaGemvConfig::new(n, rows, k, false, sms)?) } else { None };
    let out = client.empty(n * rows * 4);
    match mma {
        Some(cfg) => gemv_mma(&client, &xc.handle, &wc.handle, None, &out, n, rows, k, cfg).ok()?,
        None => {
            let cfg = GemvConfig::for_shape(n, rows, k, 2 * sms);
            gemv_bf16(&client, &xc.handle, &wc.handle, &out, n, rows, k, cfg).ok()?;
        }
    }
    back::<B, 2>(Cube::new_contiguous(client, xc.device.clone(), Shape::new([n, rows]), out, DType::F32))
}

/// `silu(x Wg^T) * (x Wu^T)` for `x` `[n, k]` f32 and BF16 `Wg`, `Wu` `[rows, k]` in one launch of eyrie-quant's
/// SwiGLU GEMV (an MLP's gate and up projections with the activation), or `None` as [`gemv`].
pub(crate) fn gemv_swiglu_pair<B: Backend>(
    x: &Tensor<B, 2>,
    wg: &Tensor<B, 2>,
    wu: &Tensor<B, 2>,
) -> Option<Tensor<B, 2>> {
    let [n, k] = x.dims();
    let [rows, kw] = wg.dims();
    let max = gemv_max_tokens().max(mma_gemv_max_tokens());
    if !is_cuda::<B>() || n == 0 || n > max || kw != k || !k.is_multiple_of(8) || wu.dims() != [rows, k] {
        return None;
    }
    if wg.dtype() != DType::BF16 || wu.dtype() != DType::BF16 || x.dtype() != DType::F32 {
        return None;
    }
    let xc = float(x.clone())?;
    let gc = float(wg.clone())?;
    let uc = float(wu.clone())?;
    let client = xc.client.clone();
    let sms = sms_of(&client);
    let mma = if n > gemv_max_tokens() { Some(MmaGemvConfig::new(n, rows, k, true, sms)?) } else { None };
    let out = client.empty(n * rows * 4);
    match mma {
        Some(cfg) => gemv_mma(&client, &xc.handle, &gc.handle, Some(&uc.handle), &out, n, rows, k, cfg).ok()?,
        None => {
            let cfg = GemvConfig::for_swiglu(n, rows, k, 2 * sms);
            gemv_swiglu(&client, &xc.handle, &gc.handle, &uc.handle, &out, n, rows, k, cfg).ok()?;
        }
    }
    back::<B, 2>(Cube::new_contiguous(client, xc.device.clone(), Shape::new([n, rows]), out, DType::F32))
}

/// Most rows [`gemv_normed`] takes (eyrie-quant's `NORMED_GEMV_MAX_TOKENS`: each block takes its rows' norms one
/// after another, so at 4 rows the normed launch is slower than the norm launch and the GEMV).
const GEMV_NORMED_MAX_TOKENS: usize = eyrie_quant::cuda::dense::NORMED_GEMV_MAX_TOKENS;

/// `RMSNorm(x) W^T` (the norm's weight `g` `[k]` f32 and `eps`; `W` `[rows, k]` BF16) in one launch of eyrie-quant's
/// `gemv_norm` (the same values as the norm launch then [`gemv`]), at up to [`GEMV_NORMED_MAX_TOKENS`] rows; else
/// `None`.
pub(crate) fn gemv_normed<B: Backend>(
    x: &Tensor<B, 2>,
    g: &Tensor<B, 1>,
    eps: f64,
    w: &Tensor<B, 2>,
) -> Option<Tensor<B, 2>> {
    let [n, k] = x.dims();
    let [rows, kw] = w.dims();
    let max = GEMV_NORMED_MAX_TOKENS.min(gemv_max_tokens());
    if !is_cuda::<B>() || n == 0 || n > max || kw != k || !k.is_multiple_of(8) || g.dims() != [k] {
        return None;
    }
    if w.dtype() != DType::BF16 || x.dtype() != DType::F32 || g.dtype() != DType::F32 {
        return None;
    }
    let (xc, gc, wc) = (float(x.clone())?, float(g.clone())?, float(w.clone())?);
    let client = xc.client.clone();
    let cfg = GemvConfig::for_shape(n, rows, k, 2 * sms_of(&client));
    let out = client.empty(n * rows * 4);
    gemv_norm(&client, &xc.handle, &gc.handle, &wc.handle, &out, (n, rows, k), eps as f32, cfg).ok()?;
    back::<B, 2>(Cube::new_contiguous(client, xc.device.clone(), Shape::new([n, rows]), out, DType::F32))
}

/// One GEMV of [`gemv_pair`]: `x W^T` (`up` `None`), or `silu(x W^T) * (x U^T)` (`up` the up projection: an MLP's
/// gate/up pair), BF16 `[rows, k]` weights.
pub(crate) struct PairJob<'a, B: Backend> {
    /// `W` (the gate projection for SwiGLU).
    pub w: &'a Tensor<B, 2>,
    /// The up projection, or `None`.
    pub up: Option<&'a Tensor<B, 2>>,
}

/// Two GEMVs of one input `x` `[n, k]` f32 in one launch of eyrie-quant's `gemv_pair` (each job's result equals its
/// own launch's, bit for bit): at the CUDA-core GEMV's widths (up to [`gemv_max_tokens`] rows; up to 8 where both
/// jobs have measured shapes, `GemvConfig::tuned`) with BF16 weights, else `None` (the caller runs the two as it
/// did).
pub(crate) fn gemv_pair_jobs<B: Backend>(
    x: &Tensor<B, 2>,
    a: PairJob<'_, B>,
    b: PairJob<'_, B>,
) -> Option<(Tensor<B, 2>, Tensor<B, 2>)> {
    let [n, k] = x.dims();
    if !is_cuda::<B>() || n == 0 || !k.is_multiple_of(8) || x.dtype() != DType::F32 {
        return None;
    }
    let fits = |j: &PairJob<'_, B>| {
        let [rows, kw] = j.w.dims();
        let up_fits = j.up.is_none_or(|u| u.dims() == [rows, k] && u.dtype() == DType::BF16);
        (kw == k && j.w.dtype() == DType::BF16 && up_fits).then_some(rows)
    };
    let (rows_a, rows_b) = (fits(&a)?, fits(&b)?);
    // At the CUDA-core GEMV's widths; wider (5-8 rows) only where both jobs have measured shapes there
    // (`GemvConfig::tuned`: the pair on the CUDA cores against the two tensor-core launches, bench/REPORT.md
    // session 20).
    let tuned = |rows: usize, j: &PairJob<'_, B>| GemvConfig::tuned(n, rows, k, j.up.is_some()).is_some();
    if n > gemv_max_tokens() && !(tuned(rows_a, &a) && tuned(rows_b, &b)) {
        return None;
    }
    let xc = float(x.clone())?;
    let client = xc.client.clone();
    let sms = sms_of(&client);
    let handles = |j: &PairJob<'_, B>| -> Option<(Cube, Option<Cube>)> {
        Some((
            float(j.w.clone())?,
            match j.up {
                Some(u) => Some(float(u.clone())?),
                None => None,
            },
        ))
    };
    let (wa, ua) = handles(&a)?;
    let (wb, ub) = handles(&b)?;
    let cfg = |rows: usize, swiglu: bool| {
        if swiglu { GemvConfig::for_swiglu(n, rows, k, 2 * sms) } else { GemvConfig::for_shape(n, rows, k, 2 * sms) }
    };
    let (out_a, out_b) = (client.empty(n * rows_a * 4), client.empty(n * rows_b * 4));
    let job_a = GemvJob {
        w: &wa.handle,
        w_up: ua.as_ref().map(|u| &u.handle),
        out: &out_a,
        rows: rows_a,
        cfg: cfg(rows_a, ua.is_some()),
    };
    let job_b = GemvJob {
        w: &wb.handle,
        w_up: ub.as_ref().map(|u| &u.handle),
        out: &out_b,
        rows: rows_b,
        cfg: cfg(rows_b, ub.is_some()),
    };
    gemv_pair(&client, &xc.handle, n, k, job_a, job_b).ok()?;
    let device = xc.device.clone();
    let ya =
        back::<B, 2>(Cube::new_contiguous(client.clone(), device.clone(), Shape::new([n, rows_a]), out_a, DType::F32))?;
    let yb = back::<B, 2>(Cube::new_contiguous(client, device, Shape::new([n, rows_b]), out_b, DType::F32))?;
    Some((ya, yb))
}

thread_local! {
    /// This thread's cuBLAS handle per CUDA device (`None`: cuBLAS could not be had there; said once on stderr).
    static BLAS: std::cell::RefCell<std::collections::HashMap<usize, Option<std::rc::Rc<Blas>>>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// This thread's cuBLAS handle for CUDA device `ordinal`, made on first use.
fn blas(ordinal: usize) -> Option<std::rc::Rc<Blas>> {
    BLAS.with(|cache| {
        cache
            .borrow_mut()
            .entry(ordinal)
            .or_insert_with(|| match Blas::new(ordinal) {
                Ok(b) => Some(std::rc::Rc::new(b)),
                Err(e) => {
                    eprintln!(
                        "eyrie: no cuBLAS on CUDA device {ordinal} ({e}); prefill-width matmuls fall back to burn's \
                         matmul (TF32, slower)"
                    );
                    None
                }
            })
            .clone()
    })
}

/// `x` `[n, k]` f32 times `W^T` for `W` `[rows, k]` BF16 with more than [`GEMV_MAX_TOKENS`] rows (prefill chunks):
/// eyrie-quant's f32-exact tensor-core GEMM through cuBLAS ([`gemm_f32_bf16w`]), or `None` (not CUDA, other dtypes,
/// `k` odd, cuBLAS missing or failing: the reason is on stderr).
pub(crate) fn gemm<B: Backend>(x: &Tensor<B, 2>, w: &Tensor<B, 2>) -> Option<Tensor<B, 2>> {
    let [n, k] = x.dims();
    let [rows, kw] = w.dims();
    if !is_cuda::<B>() || n <= gemv_max_tokens() || kw != k || !k.is_multiple_of(2) || rows == 0 {
        return None;
    }
    if w.dtype() != DType::BF16 || x.dtype() != DType::F32 {
        return None;
    }
    let xc = float(x.clone())?;
    let wc = float(w.clone())?;
    let blas = blas(xc.device.index)?;
    let client = xc.client.clone();
    let out = client.empty(n * rows * 4);
    if let Err(e) = gemm_f32_bf16w(&client, &blas, &xc.handle, &wc.handle, &out, n, rows, k) {
        eprintln!("eyrie: cuBLAS GEMM [{n}, {k}] x [{rows}, {k}]^T failed ({e}); using burn's matmul");
        return None;
    }
    back::<B, 2>(Cube::new_contiguous(client, xc.device.clone(), Shape::new([n, rows]), out, DType::F32))
}
