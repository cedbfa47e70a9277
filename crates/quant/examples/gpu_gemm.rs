//! GPU check and benchmark of the f32-exact tensor-core GEMM for prefill widths (`eyrie_quant::cuda::gemm`, issue
//! 4) at Kimi-K2's dense Linear shapes, against cuBLAS and burn in the same run; runs on a CUDA machine with cuBLAS
//! on the library path, built with `--features cuda`.
//!
//! ```text
//! gpu_gemm [--json FILE] [--quick]
//! ```
//!
//! Check (every shape, n = 32 and 512; `--quick`: only those, no benchmark): random never-zero BF16 weights and
//! full-mantissa f32 activations; the split kernel's BF16 parts equal the CPU split bit for bit, and the GEMM's
//! `[n, rows]` (up to 16 tokens x 256 rows of it) is within `max |gpu - ref| / max |ref|` <= 1e-5 of the f64 CPU
//! reference (f32 accumulation over <= 18432 terms: ~1e-7; a lost split part shows as ~4e-3 (`hi` alone), a wrong
//! row or token as ~1). The errors of the alternatives are printed beside it on the same data: cuBLAS SGEMM (f32),
//! cuBLAS BF16 (activations rounded to BF16, what a BF16 engine computes) and burn's f32 matmul (TF32 on CUDA).
//! Exit status 1 on a mismatch.
//!
//! Bench: microseconds per call (median of 5 runs of 5 back-to-back calls between device syncs) for
//! - `eyrie`: `gemm_f32_bf16w` as the model calls it (split kernel, cuBLAS BF16 GEMMs on CubeCL's stream over
//!   the stacked `[3n, k]` parts in K-slices of `K_CHUNK`, sum kernel; no host wait);
//! - `cublas bf16`: one cuBLAS BF16 GEMM of `[n, k]` (the speed a BF16 engine gets; the peer of the 70% target);
//! - `cublas f32`: cuBLAS SGEMM on f32 copies (the peer at the same precision);
//! - `burn`: what the model did before, `x.matmul(W.cast(f32).transpose())` (per-call cast, TF32 matmul), at n =
//!   32, 512 and 8192 only (burn autotunes each new shape).
//!
//! TFLOP/s count `2 n rows k` (the useful work, not the three passes). A last table sweeps the K-slice (none, 4096
//! .. 512) at n = 512 and 8192 for three matrices: error and time.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::backend::Cuda;
use burn::cubecl::cuda::{CudaDevice, CudaRuntime};
use burn::cubecl::prelude::*;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};
use cudarc::cublas::sys;
use eyrie_quant::cuda::SplitMix64;
use eyrie_quant::cuda::dense::gemv_reference;
use eyrie_quant::cuda::gemm::{
    Blas, K_CHUNK, gemm_f32_bf16w, gemm_f32_bf16w_chunked, split_bf16x3_kernel, split_bf16x3_rows,
};

type R = CudaRuntime;

const TOL: f64 = 1e-5;

/// Kimi-K2's dense Linears at prefill as `(name, rows = out, k = in)`.
const SHAPES: [(&str, usize, usize); 8] = [
    ("q_a_proj", 1536, 7168),
    ("kv_a_proj_with_mqa", 576, 7168),
    ("q_b_proj", 12288, 1536),
    ("o_proj", 7168, 8192),
    ("shared gate/up", 2048, 7168),
    ("shared down", 7168, 2048),
    ("dense gate/up", 18432, 7168),
    ("dense down", 7168, 18432),
];

const TOKENS: [usize; 5] = [32, 128, 512, 2048, 8192];
const CHECKED: [usize; 2] = [32, 512];
const BURN_AT: [usize; 3] = [32, 512, 8192];
/// K-slices swept (error and time) at n = 512 and 8192 for the matrices of `SWEEP_K`; 0 = no slicing.
const K_CHUNKS: [usize; 5] = [0, 4096, 2048, 1024, 512];
const SWEEP_K: [&str; 3] = ["shared gate/up", "o_proj", "dense down"];

fn sync(client: &ComputeClient<R>) -> Result<()> {
    burn::cubecl::future::block_on(client.sync()).map_err(|e| anyhow::anyhow!("device sync: {e:?}"))
}

fn read_f32(client: &ComputeClient<R>, h: &burn::cubecl::server::Handle) -> Result<Vec<f32>> {
    Ok(f32::from_bytes(&client.read_one(h.clone()).map_err(|e| anyhow::anyhow!("read: {e:?}"))?).to_vec())
}

/// Random BF16 bits, magnitude in `[1/16, 1) / sqrt(k)`, random sign (never zero).
fn weights(rng: &mut SplitMix64, rows: usize, k: usize) -> Vec<u16> {
    let scale = 1.0 / (k as f32).sqrt();
    (0..rows * k)
        .map(|_| {
            let mag = (0.0625 + 0.9375 * rng.next_f32()) * scale;
            half::bf16::from_f32(if rng.next_u64() & 1 == 0 { mag } else { -mag }).to_bits()
        })
        .collect()
}

/// Random f32 with all 24 bits of mantissa in use, magnitude in `[1/16, 1)`, random sign (never zero).
fn activations(rng: &mut SplitMix64, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| {
            let mag = 0.0625 + 0.9375 * rng.next_f32();
            if rng.next_u64() & 1 == 0 { mag } else { -mag }
        })
        .collect()
}

/// Norm-wise error of `got` `[n, rows]` on the checked tokens and rows against `want` `[tokens, checked rows]`.
fn error(got: &[f32], want: &[f32], rows: usize, tokens: usize, checked: &[usize]) -> f64 {
    let (mut diff, mut scale) = (0.0f64, 0.0f64);
    for t in 0..tokens {
        for (j, &r) in checked.iter().enumerate() {
            let (g, e) = (f64::from(got[t * rows + r]), f64::from(want[t * checked.len() + j]));
            diff = diff.max(if g.is_finite() { (g - e).abs() } else { f64::INFINITY });
            scale = scale.max(e.abs());
        }
    }
    diff / scale.max(f64::MIN_POSITIVE)
}

/// Median seconds per call of `f` (5 runs of 5 calls between syncs of `wait`).
fn time(mut f: impl FnMut() -> Result<()>, wait: &dyn Fn() -> Result<()>) -> Result<f64> {
    f()?;
    wait()?;
    let mut times = Vec::new();
    for _ in 0..5 {
        wait()?;
        let t = Instant::now();
        for _ in 0..5 {
            f()?;
        }
        wait()?;
        times.push(t.elapsed().as_secs_f64() / 5.0);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[2])
}

fn ptr(client: &ComputeClient<R>, h: &burn::cubecl::server::Handle) -> Result<u64> {
    // The pool keeps the buffer while `h` lives; the resource guard is only needed for the pointer's lookup.
    Ok(client.get_resource(h.clone()).map_err(|e| anyhow::anyhow!("device pointer: {e:?}"))?.resource().ptr)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().position(|a| a == "--json").and_then(|i| args.get(i + 1)).cloned();
    let quick = args.iter().any(|a| a == "--quick");
    let device = CudaDevice::default();
    let client = R::client(&device);
    let blas = Blas::new(0).map_err(anyhow::Error::msg).context("gpu_gemm needs cuBLAS")?;
    let mut rng = SplitMix64::new(11);
    let wait_client = || sync(&client);
    let wait_blas = || blas.synchronize().map_err(anyhow::Error::msg);

    // The split kernel alone, bit for bit against the CPU split (values of every magnitude class we feed it).
    {
        let mut x = activations(&mut rng, 4096);
        for (i, v) in x.iter_mut().enumerate().take(512) {
            *v *= 2f32.powi((i % 200) as i32 - 100);
        }
        let xd = client.create_from_slice(f32::as_bytes(&x));
        let out = client.empty(3 * x.len() * 2);
        let words = x.len() / 2;
        // SAFETY: x holds 2 * words f32, out 3 * words words.
        unsafe {
            split_bf16x3_kernel::launch_unchecked::<R>(
                &client,
                CubeCount::Static(words.div_ceil(256) as u32, 1, 1),
                CubeDim::new_1d(256),
                AddressType::U32,
                ArrayArg::from_raw_parts(xd, 2 * words),
                ArrayArg::from_raw_parts(out.clone(), 3 * words),
                words as u32,
            );
        }
        let got = u16::from_bytes(&client.read_one(out).map_err(|e| anyhow::anyhow!("read: {e:?}"))?).to_vec();
        let want = split_bf16x3_rows(&x);
        let bad = got.iter().zip(&want).filter(|(g, w)| g != w).count();
        println!("split kernel: {} of {} BF16 parts differ from the CPU split", bad, want.len());
        if bad > 0 {
            bail!("the split kernel differs from the CPU split");
        }
    }

    println!(
        "\n| matrix | rows x k | n | error eyrie | error cublas f32 | error cublas bf16 | error burn | eyrie us | TFLOP/s | cublas bf16 us | TFLOP/s | eyrie % of bf16 | cublas f32 us | burn us |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut failed = false;
    let mut out_json = Vec::new();
    let mut sweep = Vec::new();
    let tokens: &[usize] = if quick { &CHECKED } else { &TOKENS };
    for (name, rows, k) in SHAPES {
        let w = weights(&mut rng, rows, k);
        let w_dev = client.create_from_slice(u16::as_bytes(&w));
        let w_f32: Vec<f32> = w.iter().map(|&b| f32::from_bits(u32::from(b) << 16)).collect();
        let w32_dev = client.create_from_slice(f32::as_bytes(&w_f32));
        let w_burn: Tensor<Cuda, 2> = Tensor::from_data(
            TensorData::new(w.iter().map(|&b| half::bf16::from_bits(b)).collect::<Vec<_>>(), [rows, k]),
            (&device, DType::BF16),
        );
        let step = rows.div_ceil(256);
        let checked: Vec<usize> = (0..rows).step_by(step).collect();
        let w_checked: Vec<u16> = checked.iter().flat_map(|&r| w[r * k..(r + 1) * k].iter().copied()).collect();
        for &n in tokens {
            let x = activations(&mut rng, n * k);
            let x_dev = client.create_from_slice(f32::as_bytes(&x));
            let x_bf16: Vec<u16> = x.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            let xb_dev = client.create_from_slice(u16::as_bytes(&x_bf16));
            let out = client.empty(n * rows * 4);
            let out_peer = client.empty(n * rows * 4);
            let x_burn: Tensor<Cuda, 2> = Tensor::from_data(TensorData::new(x.clone(), [n, k]), &device);
            let eyrie = || gemm_f32_bf16w(&client, &blas, &x_dev, &w_dev, &out, n, rows, k).map_err(anyhow::Error::msg);
            let (wp, xp, xbp, pp, w32p) = (
                ptr(&client, &w_dev)?,
                ptr(&client, &x_dev)?,
                ptr(&client, &xb_dev)?,
                ptr(&client, &out_peer)?,
                ptr(&client, &w32_dev)?,
            );
            sync(&client)?;
            // SAFETY: the buffers hold [rows, k] / [n, k] / [n, rows] of their types and live to the end of this
            // iteration; every timing ends with a sync of the cuBLAS stream (the handle's own: `eyrie` leaves it on
            // CubeCL's, so the peers set it back first).
            let bf16 = || unsafe {
                blas.set_stream(None).map_err(anyhow::Error::msg)?;
                blas.gemm_nt(
                    wp,
                    xbp,
                    pp,
                    (rows, n, k, k),
                    0.0,
                    sys::cudaDataType::CUDA_R_16BF,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                )
                .map_err(anyhow::Error::msg)
            };
            // SAFETY: as for `bf16`, with the f32 copies.
            let f32_peer = || unsafe {
                blas.set_stream(None).map_err(anyhow::Error::msg)?;
                blas.gemm_nt(
                    w32p,
                    xp,
                    pp,
                    (rows, n, k, k),
                    0.0,
                    sys::cudaDataType::CUDA_R_32F,
                    sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                )
                .map_err(anyhow::Error::msg)
            };
            let burn_mm = || -> Result<Tensor<Cuda, 2>> {
                Ok(x_burn.clone().matmul(w_burn.clone().cast(FloatDType::F32).transpose()))
            };

            let check = CHECKED.contains(&n);
            let mut errors = [f64::NAN; 4];
            if check {
                let t = n.min(16);
                let want = gemv_reference(&x[..t * k], &w_checked, t, checked.len(), k);
                eyrie()?;
                errors[0] = error(&read_f32(&client, &out)?, &want, rows, t, &checked);
                f32_peer()?;
                wait_blas()?;
                errors[1] = error(&read_f32(&client, &out_peer)?, &want, rows, t, &checked);
                bf16()?;
                wait_blas()?;
                errors[2] = error(&read_f32(&client, &out_peer)?, &want, rows, t, &checked);
                let b = burn_mm()?.into_data().to_vec::<f32>().map_err(|e| anyhow::anyhow!("{e:?}"))?;
                errors[3] = error(&b, &want, rows, t, &checked);
                let ok = errors[0] <= TOL;
                failed |= !ok;
                if !ok {
                    println!("FAIL: {name} n {n}: eyrie error {:.1e} > {TOL:.0e}", errors[0]);
                }
            }
            let flops = 2.0 * (n * rows * k) as f64;
            let (mut t_eyrie, mut t_bf16, mut t_f32, mut t_burn) = (f64::NAN, f64::NAN, f64::NAN, f64::NAN);
            if !quick {
                t_eyrie = time(eyrie, &wait_client)?;
                t_bf16 = time(bf16, &wait_blas)?;
                t_f32 = time(f32_peer, &wait_blas)?;
                if BURN_AT.contains(&n) {
                    t_burn = time(|| burn_mm().map(drop), &|| {
                        <Cuda as burn::tensor::backend::Backend>::sync(&device).map_err(|e| anyhow::anyhow!("{e:?}"))
                    })?;
                }
            }
            if !quick && SWEEP_K.contains(&name) && (n == 512 || n == 8192) {
                let t = n.min(16);
                let want = gemv_reference(&x[..t * k], &w_checked, t, checked.len(), k);
                for kc in K_CHUNKS {
                    let kc = if kc == 0 { k } else { kc };
                    let f = || {
                        gemm_f32_bf16w_chunked(&client, &blas, &x_dev, &w_dev, &out, (n, rows, k), kc)
                            .map_err(anyhow::Error::msg)
                    };
                    f()?;
                    let err = error(&read_f32(&client, &out)?, &want, rows, t, &checked);
                    let secs = time(f, &wait_client)?;
                    sweep.push((name, rows, k, n, kc, err, secs));
                }
            }
            let e = |v: f64| if v.is_nan() { "-".to_string() } else { format!("{v:.1e}") };
            let us = |v: f64| if v.is_nan() { "-".to_string() } else { format!("{:.0}", v * 1e6) };
            let tf = |v: f64| if v.is_nan() { "-".to_string() } else { format!("{:.0}", flops / v / 1e12) };
            println!(
                "| {name} | {rows} x {k} | {n} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                e(errors[0]),
                e(errors[1]),
                e(errors[2]),
                e(errors[3]),
                us(t_eyrie),
                tf(t_eyrie),
                us(t_bf16),
                tf(t_bf16),
                if t_eyrie.is_nan() { "-".to_string() } else { format!("{:.0}%", 100.0 * t_bf16 / t_eyrie) },
                us(t_f32),
                us(t_burn)
            );
            let num = |v: f64| if v.is_nan() { serde_json::Value::Null } else { serde_json::json!(v) };
            out_json.push(serde_json::json!({"matrix": name, "rows": rows, "k": k, "n": n,
                "error_eyrie": num(errors[0]), "error_cublas_f32": num(errors[1]), "error_cublas_bf16": num(errors[2]),
                "error_burn": num(errors[3]), "us_eyrie": num(t_eyrie * 1e6), "us_cublas_bf16": num(t_bf16 * 1e6),
                "us_cublas_f32": num(t_f32 * 1e6), "us_burn": num(t_burn * 1e6),
                "tflops_eyrie": num(flops / t_eyrie / 1e12), "tflops_cublas_bf16": num(flops / t_bf16 / 1e12)}));
            if let Some(path) = &json {
                let doc = serde_json::json!({"kernel": "eyrie_quant::cuda::gemm::gemm_f32_bf16w", "tolerance": TOL,
                    "rows": out_json});
                std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")?;
            }
        }
    }
    if !sweep.is_empty() {
        println!("\nK-slices of the cuBLAS calls (default {K_CHUNK}): error vs f64 and time");
        println!("| matrix | rows x k | n | K-slice | error | us |\n|---|---|---|---|---|---|");
        let mut rows_json = Vec::new();
        for (name, rows, k, n, kc, err, secs) in &sweep {
            println!("| {name} | {rows} x {k} | {n} | {kc} | {err:.1e} | {:.0} |", secs * 1e6);
            rows_json.push(serde_json::json!({"matrix": name, "rows": rows, "k": k, "n": n, "k_chunk": kc,
                "error": err, "us": secs * 1e6}));
        }
        if let Some(path) = &json {
            let doc = serde_json::json!({"kernel": "eyrie_quant::cuda::gemm::gemm_f32_bf16w", "tolerance": TOL,
                "k_chunk": K_CHUNK, "rows": out_json, "k_chunk_sweep": rows_json});
            std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")?;
        }
    }
    if failed {
        bail!("GEMM results differ from the CPU reference beyond tolerance");
    }
    Ok(())
}
