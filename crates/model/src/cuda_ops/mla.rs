//! MLA on CUDA: attention over the paged latent cache (eyrie-quant's kernel), the query and value absorption around
//! it, and the cache writes (a step's rows, or its new latents straight from `kv_a_proj_with_mqa`).

use std::any::Any;

use burn::cubecl;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Shape, Tensor};
use cubecl::prelude::*;

use eyrie_quant::cuda::mla::{
    LATENT_WARPS, mla_latent_kernel, mla_output_kernel, mla_query_kernel, output_launch, output_merges, query_launch,
};

use super::{Cube, back, float, int, is_cuda};

/// The buffer of `t`, a device copy of `host` (u32 values as i32 bits) made earlier: used only when it is a CUDA
/// int tensor of 4-byte elements and `host.len()` elements; `None` otherwise (the caller uploads `host` itself).
fn uploaded<B: Backend>(t: Option<&Tensor<B, 1, Int>>, host_len: usize) -> Option<cubecl::server::Handle> {
    let t = t?;
    if t.dims()[0] != host_len || !matches!(t.dtype(), DType::I32 | DType::U32) {
        return None;
    }
    Some(int(t.clone())?.handle)
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
    super::warn_if_pool_not_dense(pool);
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
    let cfg = AttentionConfig::pick(n, h, max_len, r, rot, sms, smem)?;
    let meta = client.create_from_slice(u32::as_bytes(&rows.packed()));
    let out = client.empty(n * h * r * 4);
    mla_attention(&client, &qc.handle, &pc.handle, slots, rows, &meta, &out, h, r, rot, scale as f32, cfg).ok()?;
    let o = back::<B, 3>(Cube::new_contiguous(client, qc.device.clone(), Shape::new([n, h, r]), out, DType::F32))?;
    Some(o.swap_dims(0, 1))
}

/// Compiles every attention specialisation the model can launch for `heads` heads over `pool` (a layer of the
/// paged latent cache, `[slots, r + rot]`) by launching each once on zero queries
/// (`eyrie_quant::cuda::attention::warm_up`; the pool is read, not written): a server's warm-up, so that the first
/// long context or wide batch does not wait for NVRTC. Returns the number of launch shapes, or `None` when `B` is
/// not CUDA or the pool not f32.
///
/// # Errors
/// The launcher's message when it refuses the sizes, or the device's when the launches fail.
pub fn warm_up_attention<B: Backend>(pool: &Tensor<B, 2>, heads: usize, r: usize) -> Option<Result<usize, String>> {
    let [slots, width] = pool.dims();
    if !is_cuda::<B>() || pool.dtype() != DType::F32 || width <= r {
        return None;
    }
    let pc = float(pool.clone())?;
    let client = pc.client.clone();
    let shapes = match eyrie_quant::cuda::attention::warm_up(&client, &pc.handle, slots, heads, r, width - r) {
        Ok(n) => n,
        Err(e) => return Some(Err(e)),
    };
    Some(
        cubecl::future::block_on(client.sync())
            .map(|_| shapes)
            .map_err(|e| format!("attention warm-up: device error {e:?}")),
    )
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

/// Shapes of the absorbed MLA (`Mla`'s dimensions).
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaDims {
    pub heads: usize,
    pub nope: usize,
    pub rot: usize,
    pub vd: usize,
    pub r: usize,
}

/// Absorbed MLA on CUDA from the query projection to `o_proj`'s input, in three launches: [`mla_query_kernel`]
/// (absorption of `q_nope` and RoPE of `q_pe`, f32-exact with the BF16 `kv_b_proj`), eyrie-quant's attention
/// kernel over the paged cache, [`mla_output_kernel`]. `q` `[N, H (nope + rot)]` f32, `kv_b` `[H (nope + vd), r]`
/// BF16, `cos`/`sin` `[N, rot / 2]`, `pool` `[slots, r + rot]` -> `[N, H vd]`; `None` (the caller runs its burn
/// ops) when not CUDA, other dtypes, or shapes the kernels do not take. `rows_dev`: `rows.packed()` already on
/// the device (a step's layers share it), uploaded here when `None` or not of that length.
#[allow(clippy::too_many_arguments)]
pub fn mla_absorbed<B: Backend>(
    q: &Tensor<B, 2>,
    kv_b: &Tensor<B, 2>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    interleave: bool,
    pool: &Tensor<B, 2>,
    rows: &eyrie_quant::cuda::attention::PagedRows,
    rows_dev: Option<&Tensor<B, 1, Int>>,
    scale: f64,
    dims: MlaDims,
) -> Option<Tensor<B, 2>> {
    use eyrie_quant::cuda::attention::{AttentionConfig, MAX_ROWS, mla_attention_parts};
    let MlaDims { heads, nope, rot, vd, r } = dims;
    let [n, qw] = q.dims();
    let [slots, width] = pool.dims();
    let half = rot / 2;
    let shapes_ok = n > 0
        && n <= MAX_ROWS
        && n == rows.rows()
        && qw == heads * (nope + rot)
        && kv_b.dims() == [heads * (nope + vd), r]
        && cos.dims() == [n, half]
        && sin.dims() == [n, half]
        && width == r + rot
        && r.is_multiple_of(128)
        && r / 4 >= half
        && rot.is_multiple_of(4)
        && nope.is_multiple_of(8)
        && vd.is_multiple_of(32);
    if !is_cuda::<B>() || !shapes_ok {
        return None;
    }
    let f32s = [q.dtype(), cos.dtype(), sin.dtype(), pool.dtype()];
    if kv_b.dtype() != DType::BF16 || f32s.iter().any(|d| *d != DType::F32) {
        return None;
    }
    let qc = float(q.clone())?;
    let wc = float(kv_b.clone())?;
    let cc = float(cos.clone())?;
    let sc = float(sin.clone())?;
    super::warn_if_pool_not_dense(pool);
    let pc = float(pool.clone())?;
    let client = qc.client.clone();
    type Cu = cubecl::cuda::CudaRuntime;

    // The queries [N, H, r + rot], the attention's output [N, H, r] and the result [N, H vd], reserved together.
    let [query, o_lat, out] =
        eyrie_quant::cuda::gpu::scratch(&client, [n * heads * (r + rot) * 4, n * heads * r * 4, n * heads * vd * 4]);

    // 1. Queries.
    let (tb, groups) = query_launch(n, nope);
    // SAFETY: shapes checked above (all contiguous); block (h, token tile) reads q rows < n, kv_b rows of head h
    // (4-byte words `(row * r / 4 + c) * 2 .. + 2`, c < r / 4), table rows < n, and writes out rows < n.
    unsafe {
        mla_query_kernel::launch_unchecked::<Cu>(
            &client,
            CubeCount::Static(heads as u32, n.div_ceil(tb) as u32, 1),
            CubeDim::new_2d((r / 4) as u32, groups as u32),
            AddressType::from_len((n * qw).max(heads * (nope + vd) * r / 2).max(n * heads * (r + rot))),
            2,
            ArrayArg::from_raw_parts(qc.handle.clone(), n * qw),
            ArrayArg::from_raw_parts(wc.handle.clone(), heads * (nope + vd) * r / 4),
            ArrayArg::from_raw_parts(cc.handle.clone(), n * half),
            ArrayArg::from_raw_parts(sc.handle.clone(), n * half),
            ArrayArg::from_raw_parts(query.clone(), n * heads * (r + rot)),
            n as u32,
            heads,
            nope,
            rot,
            vd,
            r,
            tb,
            groups,
            interleave,
        );
    }

    // 2. Attention over the paged cache -> o_lat [N, H, r].
    let props = client.properties();
    let sms = props.hardware.num_streaming_multiprocessors.unwrap_or(132) as usize;
    let smem = props.hardware.max_shared_memory_size;
    let max_len = rows.row_len.iter().copied().max().unwrap_or(0) as usize;
    let cfg = AttentionConfig::pick(n, heads, max_len, r, rot, sms, smem)?;
    let meta = match uploaded(rows_dev, rows.packed_len()) {
        Some(meta) => meta,
        None => client.create_from_slice(u32::as_bytes(&rows.packed())),
    };
    // Split rows of a one-row step are merged by the output launch itself (`merge`), not by a combine launch.
    let parts =
        mla_attention_parts(&client, &query, &pc.handle, slots, rows, &meta, &o_lat, heads, r, rot, scale as f32, cfg)
            .ok()?;
    let (tb, ra, warps) = output_launch(n, vd);
    let merge = parts.splits > 1 && output_merges((tb, ra, warps)) && output_merge_on();
    if !merge {
        // A launch shape that cannot merge: the separate combine (if split), into `o_lat`.
        eyrie_quant::cuda::attention::merge_parts(&client, &parts, n * heads, r, &o_lat);
    }
    let (src, src_len) = if merge { (parts.o, parts.splits * n * heads * r) } else { (o_lat, n * heads * r) };

    // 3. Output [N, H vd].
    // SAFETY: `src` holds [n, heads, r] (r % 8 == 0: whole 16-byte vectors), or with `merge` the slices [splits, n
    // heads, r] with `ml` [splits, n heads, 2] (as `mla_attention_parts` reserved them); kv_b [heads (nope + vd), r];
    // the grid covers heads * vd columns exactly (vd % (warps * ra) == 0), token indices are clamped and written
    // only < n; a merging block has one token and 8 warps (`output_merges`: at least the 128 threads the merge takes).
    unsafe {
        mla_output_kernel::launch_unchecked::<Cu>(
            &client,
            CubeCount::Static((heads * vd / (warps * ra)) as u32, n.div_ceil(tb) as u32, 1),
            CubeDim::new_2d(32, warps as u32),
            AddressType::from_len(src_len.max(heads * (nope + vd) * r / 2).max(n * heads * vd)),
            4,
            ArrayArg::from_raw_parts(src, src_len / 4),
            ArrayArg::from_raw_parts(parts.ml, parts.splits * n * heads * 2),
            ArrayArg::from_raw_parts(wc.handle.clone(), heads * (nope + vd) * r / 8),
            ArrayArg::from_raw_parts(out.clone(), n * heads * vd),
            n as u32,
            parts.splits as u32,
            heads,
            nope,
            vd,
            r,
            ra,
            tb,
            warps,
            merge,
        );
    }
    back::<B, 2>(Cube::new_contiguous(client, qc.device.clone(), Shape::new([n, heads * vd]), out, DType::F32))
}

/// Whether a one-row output launch merges the attention's slices itself: on unless `EYRIE_OUTPUT_MERGE=0` (read
/// once; then the combine launch merges them first), for same-binary comparisons.
fn output_merge_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("EYRIE_OUTPUT_MERGE").map_or(true, |v| v != "0"))
}

/// Writes the step's new latents into `pool` `[P, r + rot]` in place with [`mla_latent_kernel`] from the
/// `kv_a_proj_with_mqa` output `kv` `[N, r + rot]`, the `kv_a_layernorm` weight `[r]` and eps, the RoPE tables
/// `[N, rot / 2]` and each row's pool row `slots` (`slots_dev`: the same already on the device, or `None`).
///
/// # Errors
/// Nothing is written (the caller runs its burn ops) when not CUDA, other dtypes or shapes, `pool`'s columns not
/// dense, or a slot out of range; the message names the check that refused the inputs.
#[allow(clippy::too_many_arguments)]
pub fn mla_latent_write<B: Backend>(
    pool: &Tensor<B, 2>,
    kv: &Tensor<B, 2>,
    weight: &Tensor<B, 1>,
    eps: f64,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    interleave: bool,
    slots: &[u32],
    slots_dev: Option<&Tensor<B, 1, Int>>,
) -> Result<(), String> {
    let [n, width] = kv.dims();
    let [pool_rows, pool_width] = pool.dims();
    let r = weight.dims()[0];
    if !is_cuda::<B>() {
        return Err("not the CUDA backend".into());
    }
    if n == 0 || n != slots.len() || pool_width != width || r >= width {
        return Err(format!(
            "kv [{n}, {width}], {} slots, pool [{pool_rows}, {pool_width}], norm width {r}",
            slots.len()
        ));
    }
    let rot = width - r;
    if !rot.is_multiple_of(2) || cos.dims() != [n, rot / 2] || sin.dims() != [n, rot / 2] {
        return Err(format!("rot {rot}, tables {:?} / {:?}", cos.dims(), sin.dims()));
    }
    if let Some(s) = slots.iter().find(|&&s| s as usize >= pool_rows) {
        return Err(format!("slot {s} outside the pool's {pool_rows} rows"));
    }
    let f32s = [pool.dtype(), kv.dtype(), weight.dtype(), cos.dtype(), sin.dtype()];
    if f32s.iter().any(|d| *d != DType::F32) {
        return Err(format!("dtypes pool, kv, weight, cos, sin: {f32s:?}"));
    }
    // The pool's own buffer (never a contiguous copy of it: the write must land in the cache).
    let boxed: Box<dyn Any> = Box::new(pool.clone().into_primitive().tensor());
    let Ok(pc) = boxed.downcast::<Cube>() else { return Err("pool is not a CubeCL tensor".into()) };
    // Rows may be pitched (a `from_data` pool is), columns must be dense.
    let strides = pc.meta.strides();
    let row_stride = strides[0];
    let span = (pool_rows - 1) * row_stride + width;
    if strides[1] != 1 || row_stride < width || span * 4 > pc.handle.size() as usize {
        return Err(format!("pool strides {strides:?} for [{pool_rows}, {width}] in {} bytes", pc.handle.size()));
    }
    let (Some(kc), Some(wc), Some(cc), Some(sc)) =
        (float(kv.clone()), float(weight.clone()), float(cos.clone()), float(sin.clone()))
    else {
        return Err("an input is not a CubeCL tensor".into());
    };
    let client = pc.client.clone();
    let slots_dev = match uploaded(slots_dev, n) {
        Some(handle) => handle,
        None => client.create_from_slice(u32::as_bytes(slots)),
    };
    // SAFETY: shapes checked above (`kv`, tables, weight contiguous; pool rows `row_stride >= width` apart inside its
    // buffer); block `row < n` reads row `row` of `kv` and the tables, `weight` indices `< r`, and writes pool row
    // `slots[row] < pool_rows` (checked) at columns `< width`.
    unsafe {
        mla_latent_kernel::launch_unchecked::<cubecl::cuda::CudaRuntime>(
            &client,
            CubeCount::Static(n as u32, 1, 1),
            CubeDim::new_2d(32, LATENT_WARPS as u32),
            AddressType::from_len(span),
            ArrayArg::from_raw_parts(kc.handle.clone(), n * width),
            ArrayArg::from_raw_parts(wc.handle.clone(), r),
            ArrayArg::from_raw_parts(cc.handle.clone(), n * rot / 2),
            ArrayArg::from_raw_parts(sc.handle.clone(), n * rot / 2),
            ArrayArg::from_raw_parts(slots_dev, n),
            ArrayArg::from_raw_parts(pc.handle.clone(), span),
            eps as f32,
            row_stride as u32,
            r,
            rot,
            interleave,
        );
    }
    Ok(())
}

/// Rows a span (one sequence's new tokens in a step) needs for its attention to run in the MHA form
/// ([`mla_mha_prefill`]) instead of the absorbed one, once the form is on ([`enable_mha_prefill`]). Expected
/// crossover from the flop counts (not yet measured: the kernel was written in session 14 without GPU time): the
/// expansion of the whole context costs `2 r H (nope + vd)` flops a key on cuBLAS, the attention saves
/// `2 H (1088 - 320)` a row and key on the CUDA cores, so the MHA form pays from a few dozen rows; 128 leaves room.
pub const MHA_PREFILL_MIN_ROWS: usize = 128;

/// The rows [`mha_prefill_min_rows`] returns without the environment variable: 0 while the MHA form is off.
static MHA_AUTO: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Turns the MHA form on for spans of `min_rows` rows or more (0: off), unless `EYRIE_MHA_PREFILL_MIN_ROWS` decides.
/// The server calls it after [`check_mha_prefill`] passed on its device.
pub fn enable_mha_prefill(min_rows: usize) {
    MHA_AUTO.store(min_rows, std::sync::atomic::Ordering::Relaxed);
}

/// Rows a span needs for the MHA form, or `None` when the form is off: `EYRIE_MHA_PREFILL_MIN_ROWS` when set (read
/// once; a positive number of rows, or 0 for off), else what [`enable_mha_prefill`] set (off until then: a process
/// that runs no device self-check, a benchmark or `eyrie generate`, keeps the absorbed form unless told).
pub fn mha_prefill_min_rows() -> Option<usize> {
    static ENV: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let env = *ENV.get_or_init(|| match std::env::var("EYRIE_MHA_PREFILL_MIN_ROWS") {
        Err(std::env::VarError::NotPresent) => None,
        Ok(v) => match v.parse::<usize>() {
            Ok(n) => Some(n),
            Err(_) => {
                eprintln!("eyrie: warning: EYRIE_MHA_PREFILL_MIN_ROWS={v:?} is not a non-negative integer; ignored");
                None
            }
        },
        Err(e) => {
            eprintln!("eyrie: warning: EYRIE_MHA_PREFILL_MIN_ROWS: {e}; ignored");
            None
        }
    });
    let rows = env.unwrap_or_else(|| MHA_AUTO.load(std::sync::atomic::Ordering::Relaxed));
    (rows > 0).then_some(rows)
}

/// Whether `EYRIE_MHA_PREFILL_MIN_ROWS` is set (then the server's self-check does not switch the form).
pub fn mha_prefill_env_set() -> bool {
    std::env::var_os("EYRIE_MHA_PREFILL_MIN_ROWS").is_some()
}

/// A device self-check of the MHA form (the server's warm-up runs it before turning the form on): random queries,
/// latents, RoPE tables and a BF16 `kv_b_proj` at `dims`' head dimensions (8 heads), a 150-row chunk after 100
/// cached positions (three query tiles, the last partial), in one segment and in segments of 128 keys, through
/// [`mla_mha_prefill`] against [`mla_absorbed`] on the same inputs (the path the model runs otherwise, checked
/// against transformers). Returns the larger norm-wise difference `max |mha - absorbed| / max |absorbed|`.
///
/// # Errors
/// Not CUDA, dimensions the kernel does not take, a kernel that refused its inputs, or a difference above 1e-5.
pub fn check_mha_prefill<B: Backend>(device: &B::Device, dims: MlaDims) -> Result<f64, String> {
    use burn::tensor::TensorData;
    use eyrie_quant::cuda::attention::PagedRows;
    let MlaDims { nope, rot, vd, r, .. } = dims;
    let dims = MlaDims { heads: 8, ..dims };
    let heads = dims.heads;
    if !is_cuda::<B>() {
        return Err("not the CUDA backend".into());
    }
    eyrie_quant::cuda::prefill_attention::MhaDims { nope, rot, vd }
        .check(usize::MAX)
        .map_err(|e| e.trim_start_matches("MHA prefill attention: ").to_string())?;
    let (n, start, half) = (150usize, 100usize, rot / 2);
    let keys = start + n;
    let mut rng = eyrie_quant::cuda::SplitMix64::new(0x5eed_c0de);
    let mut rand = |len: usize, s: f32| -> Vec<f32> { (0..len).map(|_| (rng.next_f32() - 0.5) * s).collect() };
    let t2 = |v: Vec<f32>, shape: [usize; 2]| Tensor::<B, 2>::from_data(TensorData::new(v, shape), device);
    let q = t2(rand(n * heads * (nope + rot), 2.0), [n, heads * (nope + rot)]);
    let lat = t2(rand(keys * (r + rot), 2.0), [keys, r + rot]);
    let cos = t2(rand(n * half, 2.0), [n, half]);
    let sin = t2(rand(n * half, 2.0), [n, half]);
    let w = t2(rand(heads * (nope + vd) * r, 0.25), [heads * (nope + vd), r]).cast(burn::tensor::FloatDType::BF16);
    let scale = 1.0 / ((nope + rot) as f64).sqrt();
    let rows = PagedRows::contiguous_chunk(n, start);
    let host = |t: Tensor<B, 2>| -> Result<Vec<f32>, String> {
        t.into_data().to_vec::<f32>().map_err(|e| format!("readback: {e:?}"))
    };
    let want = host(
        mla_absorbed(&q, &w, &cos, &sin, false, &lat, &rows, None, scale, dims)
            .ok_or("the absorbed form refused the inputs")?,
    )?;
    let mut worst = 0.0f64;
    for segment in [0usize, 128] {
        // The expansion as the model runs it: `kv_b_proj`'s Linear.
        let kv_b = crate::linear::Linear::from_weight(w.clone());
        let expand = |c: Tensor<B, 2>| kv_b.forward(c);
        let got = host(
            mla_mha_prefill(&q, &cos, &sin, false, &lat, expand, start, scale, dims, segment)
                .ok_or("the MHA form refused the inputs")?,
        )?;
        if got.len() != want.len() {
            return Err(format!("{} outputs, the absorbed form gave {}", got.len(), want.len()));
        }
        worst = worst.max(f64::from(eyrie_quant::cuda::Mismatch::of(&got, &want).rel_to_max));
    }
    if worst > 1e-5 {
        return Err(format!("differs from the absorbed form by {worst:.1e} (tolerance 1e-5)"));
    }
    Ok(worst)
}

/// Most bytes of expanded keys and values one segment of [`mla_mha_prefill`] holds at once (longer contexts are
/// expanded and attended segment by segment, merged by their softmax mass).
pub const MHA_SEGMENT_BYTES: usize = 1 << 30;

/// MLA of one sequence's prefill chunk in the MHA form on CUDA (`eyrie_quant::cuda::prefill_attention`): `q`
/// `[n, H (nope + rot)]` the chunk's query rows (before RoPE; row `i` at position `start + i`), `cos`/`sin`
/// `[n, rot / 2]` their RoPE tables, `latents` `[start + n, r + rot]` the sequence's cached latents (the chunk's
/// included), `expand` the `kv_b_proj` Linear (`[k, r] -> [k, H (nope + vd)]`) -> `[n, H vd]`, the input of
/// `o_proj`. The keys are expanded and attended in segments of `segment_keys` keys (rounded down to a multiple of
/// 64), or with 0 of at most [`MHA_SEGMENT_BYTES`]. `None` (the caller
/// runs the absorbed form) when not CUDA, other dtypes, or dimensions the kernel does not take.
#[allow(clippy::too_many_arguments)]
pub fn mla_mha_prefill<B: Backend>(
    q: &Tensor<B, 2>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    interleave: bool,
    latents: &Tensor<B, 2>,
    expand: impl Fn(Tensor<B, 2>) -> Tensor<B, 2>,
    start: usize,
    scale: f64,
    dims: MlaDims,
    segment_keys: usize,
) -> Option<Tensor<B, 2>> {
    use eyrie_quant::cuda::prefill_attention::{MhaDims, combine_segments, mha_prefill_attention};
    let MlaDims { heads, nope, rot, vd, r } = dims;
    let [n, qw] = q.dims();
    let [keys, width] = latents.dims();
    let mha = MhaDims { nope, rot, vd };
    if !is_cuda::<B>() || n == 0 || qw != heads * (nope + rot) || width != r + rot || keys != start + n {
        return None;
    }
    if [q.dtype(), cos.dtype(), sin.dtype(), latents.dtype()].iter().any(|d| *d != DType::F32) {
        return None;
    }
    let lc = float(latents.clone())?;
    let client = lc.client.clone();
    mha.check(client.properties().hardware.max_shared_memory_size).ok()?;
    // Queries with RoPE on their rotary part, [n H, nope + rot].
    let rows = q.clone().reshape([n * heads, nope + rot]);
    let q_pe = super::rope_rows(&rows, nope, rot, heads, cos, sin, interleave)?;
    let qc = float(Tensor::cat(vec![rows.narrow(1, 0, nope), q_pe], 1))?;

    let key_bytes = heads * (nope + vd) * 4;
    let per_segment = match segment_keys {
        0 => MHA_SEGMENT_BYTES / key_bytes,
        k => k,
    } / 64
        * 64;
    let per_segment = per_segment.max(64);
    let segments = keys.div_ceil(per_segment);
    let pairs = n * heads;
    let out = client.empty(pairs * vd * 4);
    let (o_part, ml_part) = if segments == 1 {
        (out.clone(), client.empty(pairs * 2 * 4))
    } else {
        (client.empty(segments * pairs * vd * 4), client.empty(segments * pairs * 2 * 4))
    };
    for seg in 0..segments {
        let key0 = seg * per_segment;
        let len = per_segment.min(keys - key0);
        let kv = expand(latents.clone().narrow(0, key0, len).narrow(1, 0, r));
        if kv.dims() != [len, heads * (nope + vd)] || kv.dtype() != DType::F32 {
            return None;
        }
        let kc = float(kv)?;
        let launched = mha_prefill_attention(
            &client,
            &qc.handle,
            &kc.handle,
            &lc.handle,
            (keys, width, r, key0),
            &o_part,
            &ml_part,
            (segments, seg),
            n,
            heads,
            mha,
            (start, key0, len),
            scale as f32,
        );
        if let Err(e) = launched {
            eprintln!("eyrie: MHA prefill attention refused its inputs ({e}); using the absorbed form");
            return None;
        }
    }
    if segments > 1
        && let Err(e) = combine_segments(&client, &o_part, &ml_part, &out, pairs, segments, vd)
    {
        eprintln!("eyrie: MHA prefill combine refused its inputs ({e}); using the absorbed form");
        return None;
    }
    back::<B, 2>(Cube::new_contiguous(client, qc.device.clone(), Shape::new([n, heads * vd]), out, DType::F32))
}
