//! GPU check and benchmark of the dense BF16-weight GEMV at Kimi-K2's dense Linear shapes, both kernels: the
//! CUDA-core one (`eyrie_quant::cuda::dense`) and the tensor-core one (`eyrie_quant::cuda::dense_mma`, also in its
//! gated SwiGLU form on the gate/up shapes) (issue 4); runs on a CUDA machine, built with `--features cuda`.
//!
//! ```text
//! gpu_gemv [--json FILE]
//! gpu_gemv --sweep [--n 1] [--json FILE]
//! gpu_gemv --normed [--json FILE]     # only the normed GEMV
//! ```
//!
//! `--sweep`: the launch shapes of the GEMVs a decode step runs at `n` tokens (the `q_a_proj` + `kv_a_proj_with_mqa`
//! pair, the normed `q_b_proj`, `o_proj`, the shared expert's gate/up + router pair, the shared down), each single
//! GEMV over every `GemvConfig` of 8 warps (rows a warp 1/2/4, k-split 1/2/4/8, stretches in flight 1-8), then each
//! pair over the best 4 x 4 of its two jobs; GPU time per call behind a copy (`BehindCopy`: no host gaps), each
//! result checked against the f64 reference first. Prints every shape's time, the model's current choice and the
//! best.
//!
//! Check: random never-zero BF16 weights and f32 activations, the kernel's `[n, rows]` against the f64 CPU
//! reference ([`gemv_reference`]) on up to 256 rows of each matrix, norm-wise `max |gpu - ref| / max |ref|` <=
//! 1e-5 (f32 accumulation over at most 18432 terms in another order: a few 1e-7; a wrong weight, row or token
//! shows as 1e-3 or more). Exit status 1 on a mismatch.
//!
//! Pairs (`gemv_pair`: two GEMVs of one input in one launch, as the model runs `q_a_proj` with
//! `kv_a_proj_with_mqa` and the shared expert's gate/up with the router at 1-4 tokens): each job's output must
//! equal its own launch's bit for bit (and the reference within the tolerance); both timed, the pair against the
//! two launches back to back.
//!
//! Normed (`gemv_norm`: `q_a_layernorm` inside `q_b_proj`'s GEMV, as the model runs it at 1-4 tokens): equal bit
//! for bit to the RMSNorm launch then the GEMV, within the tolerance of the f64 reference; timed against the two.
//!
//! Bench: microseconds per call (median of 9 runs of 20 back-to-back calls between device syncs; each call reads
//! another copy of the weights, 256 MB of copies in all, so the 60 MB L2 does not hold them), GB/s of the bytes
//! that must move (weights + activations + output) and their share of the copy bandwidth measured in the same run.

use std::time::Instant;

use anyhow::{Result, bail};
use burn::cubecl::cuda::{CudaDevice, CudaRuntime};
use burn::cubecl::prelude::*;
use eyrie_quant::cuda::SplitMix64;
use eyrie_quant::cuda::dense::{
    GemvConfig, GemvJob, gemv_bf16, gemv_norm, gemv_pair, gemv_reference, gemv_swiglu, swiglu_reference,
};
use eyrie_quant::cuda::dense_mma::{MmaGemvConfig, gemv_mma};
use eyrie_quant::cuda::norm::{RMS_NORM_WARPS, rms_norm_kernel};
use eyrie_quant::cuda::{BehindCopy, copy_bandwidth};

type R = CudaRuntime;

const TOL: f64 = 1e-5;

/// Kimi-K2's dense Linears as `(name, rows = out, k = in)`.
const SHAPES: [(&str, usize, usize); 11] = [
    ("q_a_proj", 1536, 7168),
    ("kv_a_proj_with_mqa", 576, 7168),
    ("q_b_proj", 12288, 1536),
    ("kv_b_proj", 16384, 512),
    ("o_proj", 7168, 8192),
    ("router", 384, 7168),
    ("shared gate/up", 2048, 7168),
    ("shared down", 7168, 2048),
    ("dense gate/up", 18432, 7168),
    ("dense down", 7168, 18432),
    ("lm_head", 163840, 7168),
];

const TOKENS: [usize; 7] = [1, 2, 4, 6, 8, 12, 16];

/// Median seconds of one call: 9 runs of 20 back-to-back calls between device syncs, call `i` on weight copy `i`.
fn time(client: &ComputeClient<R>, mut call: impl FnMut(usize) -> Result<()>) -> Result<f64> {
    let mut times = Vec::new();
    for _ in 0..9 {
        sync(client)?;
        let t = Instant::now();
        for i in 0..20 {
            call(i)?;
        }
        sync(client)?;
        times.push(t.elapsed().as_secs_f64() / 20.0);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[4])
}

/// Reads `out` `[n, rows]` back and checks it against `want` `[n, checked rows]`: (norm-wise error, within [`TOL`]
/// and finite).
fn check(
    client: &ComputeClient<R>,
    out: &burn::cubecl::server::Handle,
    want: &[f32],
    n: usize,
    rows: usize,
    checked: &[usize],
) -> Result<(f64, bool)> {
    let got = f32::from_bytes(&client.read_one(out.clone()).map_err(|e| anyhow::anyhow!("read: {e:?}"))?).to_vec();
    let err = error(&got, want, n, rows, checked);
    Ok((err, err <= TOL && got.iter().all(|v| v.is_finite())))
}

/// Norm-wise error of `got` `[n, rows]` against `want` `[n, checked rows]`.
fn error(got: &[f32], want: &[f32], n: usize, rows: usize, checked: &[usize]) -> f64 {
    let (mut diff, mut scale) = (0.0f64, 0.0f64);
    for t in 0..n {
        for (j, &r) in checked.iter().enumerate() {
            let (g, e) = (f64::from(got[t * rows + r]), f64::from(want[t * checked.len() + j]));
            diff = diff.max((g - e).abs());
            scale = scale.max(e.abs());
        }
    }
    diff / scale.max(f64::MIN_POSITIVE)
}

fn sync(client: &ComputeClient<R>) -> Result<()> {
    burn::cubecl::future::block_on(client.sync()).map_err(|e| anyhow::anyhow!("device sync: {e:?}"))
}

/// Random BF16 bits, magnitude in `[1/16, 1) / sqrt(k)`, random sign (never zero).
fn weights(rng: &mut SplitMix64, rows: usize, k: usize) -> Vec<u16> {
    let scale = 1.0 / (k as f32).sqrt();
    (0..rows * k)
        .map(|_| {
            let mag = (0.0625 + 0.9375 * rng.next_f32()) * scale;
            let v = if rng.next_u64() & 1 == 0 { mag } else { -mag };
            half::bf16::from_f32(v).to_bits()
        })
        .collect()
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().position(|a| a == "--json").and_then(|i| args.get(i + 1)).cloned();
    let client = R::client(&CudaDevice::default());
    let mut rng = SplitMix64::new(7);

    // Copy bandwidth of the same run (read + write bytes of 1 GiB).
    let copy_bw = copy_bandwidth(&client).map_err(anyhow::Error::msg)?;
    println!("copy bandwidth: {:.0} GB/s", copy_bw / 1e9);
    if args.iter().any(|a| a == "--normed") {
        let mut rows_json = Vec::new();
        let failed = normed(&client, &mut rng, copy_bw, &mut rows_json)?;
        if let Some(path) = json {
            let doc = serde_json::json!({"kernel": "eyrie_quant::cuda::dense normed GEMVs", "rows": rows_json});
            std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")?;
        }
        if failed {
            bail!("a normed GEMV differs from the norm launch + GEMV");
        }
        return Ok(());
    }
    if args.iter().any(|a| a == "--sweep") {
        let n = args.iter().position(|a| a == "--n").and_then(|i| args.get(i + 1)).map_or(Ok(1), |v| v.parse())?;
        let mut rows_json = Vec::new();
        let failed = sweep(&client, &mut rng, copy_bw, n, &mut rows_json)?;
        if let Some(path) = json {
            let doc = serde_json::json!({"sweep": "eyrie_quant::cuda::dense GEMV launch shapes", "n": n,
                "tolerance": TOL, "copy_bandwidth_gb_s": copy_bw / 1e9, "rows": rows_json});
            std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")?;
        }
        if failed {
            bail!("a swept GEMV shape differs from the CPU reference beyond tolerance");
        }
        return Ok(());
    }
    println!(
        "| matrix | rows x k | n | kernel | check (norm-wise) | us/call | GB/s | % of copy BW |\n|---|---|---|---|---|---|---|---|"
    );

    let mut failed = false;
    let mut rows_json = Vec::new();
    for (name, rows, k) in SHAPES {
        let w = weights(&mut rng, rows, k);
        let bytes_w = rows * k * 2;
        let copies = (256 << 20).div_ceil(bytes_w).max(1);
        let w_dev: Vec<_> = (0..copies).map(|_| client.create_from_slice(u16::as_bytes(&w))).collect();
        // Rows checked against the reference: up to 256, spread over the matrix.
        let step = rows.div_ceil(256);
        let checked: Vec<usize> = (0..rows).step_by(step).collect();
        let w_checked: Vec<u16> = checked.iter().flat_map(|&r| w[r * k..(r + 1) * k].iter().copied()).collect();
        for n in TOKENS {
            let x: Vec<f32> = rng.activations(n * k).iter().map(|v| v.to_f32()).collect();
            let x_dev = client.create_from_slice(f32::as_bytes(&x));
            let out = client.empty(n * rows * 4);
            // The shape the model uses (fewer rows per block for short matrices, 264 blocks = 2 x 132 SMs).
            let cfg = GemvConfig::for_shape(n, rows, k, 264);
            gemv_bf16(&client, &x_dev, &w_dev[0], &out, n, rows, k, cfg).map_err(anyhow::Error::msg)?;
            let want = gemv_reference(&x, &w_checked, n, checked.len(), k);
            let (err, ok) = check(&client, &out, &want, n, rows, &checked)?;
            failed |= !ok;
            let secs = time(&client, |i| {
                gemv_bf16(&client, &x_dev, &w_dev[i % copies], &out, n, rows, k, cfg).map_err(anyhow::Error::msg)
            })?;
            let moved = (bytes_w + n * k * 4 + n * rows * 4) as f64;
            let mut report = |kernel: &str, err: f64, ok: bool, secs: f64| {
                let gbs = moved / secs / 1e9;
                println!(
                    "| {name} | {rows} x {k} | {n} | {kernel} | {err:.1e} {} | {:.1} | {gbs:.0} | {:.0} |",
                    if ok { "ok" } else { "FAIL" },
                    secs * 1e6,
                    100.0 * moved / secs / copy_bw
                );
                rows_json.push(serde_json::json!({"matrix": name, "rows": rows, "k": k, "n": n, "kernel": kernel,
                    "error": err, "ok": ok, "us": secs * 1e6, "gb_s": gbs, "pct_copy_bw": 100.0 * moved / secs / copy_bw}));
            };
            report("cuda cores", err, ok, secs);

            // The tensor-core GEMV at the same shape.
            if let Some(mcfg) = MmaGemvConfig::new(n, rows, k, false, 132) {
                let out = client.empty(n * rows * 4);
                gemv_mma(&client, &x_dev, &w_dev[0], None, &out, n, rows, k, mcfg).map_err(anyhow::Error::msg)?;
                let (err, ok) = check(&client, &out, &want, n, rows, &checked)?;
                failed |= !ok;
                let secs = time(&client, |i| {
                    gemv_mma(&client, &x_dev, &w_dev[i % copies], None, &out, n, rows, k, mcfg)
                        .map_err(anyhow::Error::msg)
                })?;
                report(
                    &format!(
                        "tensor cores (bv {} tiles {} ksplit {} tasks {})",
                        mcfg.bv, mcfg.tiles, mcfg.ksplit, mcfg.tasks
                    ),
                    err,
                    ok,
                    secs,
                );
            }
            // Gated (SwiGLU: this matrix as the gate and a second one as the up projection) on the gate/up shapes.
            if name.ends_with("gate/up")
                && let Some(mcfg) = MmaGemvConfig::new(n, rows, k, true, 132)
            {
                let wu: Vec<u16> = w.iter().rev().copied().collect();
                let wu_dev = client.create_from_slice(u16::as_bytes(&wu));
                let wu_checked: Vec<u16> =
                    checked.iter().flat_map(|&r| wu[r * k..(r + 1) * k].iter().copied()).collect();
                let want = swiglu_reference(&x, &w_checked, &wu_checked, n, checked.len(), k);
                let out = client.empty(n * rows * 4);
                gemv_mma(&client, &x_dev, &w_dev[0], Some(&wu_dev), &out, n, rows, k, mcfg)
                    .map_err(anyhow::Error::msg)?;
                let (err, ok) = check(&client, &out, &want, n, rows, &checked)?;
                failed |= !ok;
                let secs = time(&client, |i| {
                    gemv_mma(&client, &x_dev, &w_dev[i % copies], Some(&wu_dev), &out, n, rows, k, mcfg)
                        .map_err(anyhow::Error::msg)
                })?;
                // Two matrices' bytes (the up copy is the same every call: its reads may hit the L2).
                let moved2 = (2 * bytes_w + n * k * 4 + n * rows * 4) as f64;
                let gbs = moved2 / secs / 1e9;
                println!(
                    "| {name} | 2 x {rows} x {k} | {n} | tensor cores, gated | {err:.1e} {} | {:.1} | {gbs:.0} | {:.0} |",
                    if ok { "ok" } else { "FAIL" },
                    secs * 1e6,
                    100.0 * moved2 / secs / copy_bw
                );
                rows_json.push(serde_json::json!({"matrix": name, "rows": rows, "k": k, "n": n,
                    "kernel": "tensor cores, gated", "error": err, "ok": ok, "us": secs * 1e6, "gb_s": gbs}));
            }
        }
    }
    failed |= pairs(&client, &mut rng, copy_bw, &mut rows_json)?;
    failed |= normed(&client, &mut rng, copy_bw, &mut rows_json)?;
    if let Some(path) = json {
        let doc = serde_json::json!({"kernel": "eyrie_quant::cuda::dense::gemv_bf16", "tolerance": TOL,
            "copy_bandwidth_gb_s": copy_bw / 1e9, "rows": rows_json});
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    if failed {
        bail!("GEMV results differ from the CPU reference beyond tolerance");
    }
    Ok(())
}

/// The model's GEMV pairs (`(name, rows, SwiGLU)` of job a, then job b; `k` 7168), at 1, 2 and 4 tokens: checks and
/// times `gemv_pair` against the two launches it replaces. Returns whether any check failed.
fn pairs(
    client: &ComputeClient<R>,
    rng: &mut SplitMix64,
    copy_bw: f64,
    rows_json: &mut Vec<serde_json::Value>,
) -> Result<bool> {
    const PAIRS: [[(&str, usize, bool); 2]; 2] = [
        [("q_a_proj", 1536, false), ("kv_a_proj_with_mqa", 576, false)],
        [("shared gate/up", 2048, true), ("router", 384, false)],
    ];
    let k = 7168;
    println!(
        "\n| pair | n | job a / job b (bit-identical to their own launches; vs reference) | two launches us | one \
         pair launch us | pair GB/s | % of copy BW |\n|---|---|---|---|---|---|---|"
    );
    let mut failed = false;
    for [a, b] in PAIRS {
        // Weights (gate then up for a SwiGLU job), copies enough that 256 MB of them defeat the L2.
        let mats = |rng: &mut SplitMix64, (_, rows, swiglu): (&str, usize, bool)| -> Vec<Vec<u16>> {
            (0..if swiglu { 2 } else { 1 }).map(|_| weights(rng, rows, k)).collect()
        };
        let (wa, wb) = (mats(rng, a), mats(rng, b));
        let bytes: usize = wa.iter().chain(&wb).map(|w| w.len() * 2).sum();
        let copies = (256 << 20).div_ceil(bytes).max(1);
        let upload = |ws: &[Vec<u16>]| -> Vec<Vec<_>> {
            (0..copies).map(|_| ws.iter().map(|w| client.create_from_slice(u16::as_bytes(w))).collect()).collect()
        };
        let (da, db) = (upload(&wa), upload(&wb));
        for n in [1usize, 2, 4] {
            let x: Vec<f32> = rng.activations(n * k).iter().map(|v| v.to_f32()).collect();
            let x_dev = client.create_from_slice(f32::as_bytes(&x));
            let cfg = |(_, rows, swiglu): (&str, usize, bool)| {
                if swiglu { GemvConfig::for_swiglu(n, rows, k, 264) } else { GemvConfig::for_shape(n, rows, k, 264) }
            };
            let (ca, cb) = (cfg(a), cfg(b));
            let single = |job: (&str, usize, bool), w: &[burn::cubecl::server::Handle], out, cfg| {
                if job.2 {
                    gemv_swiglu(client, &x_dev, &w[0], &w[1], out, n, job.1, k, cfg)
                } else {
                    gemv_bf16(client, &x_dev, &w[0], out, n, job.1, k, cfg)
                }
                .map_err(anyhow::Error::msg)
            };
            let pair = |i: usize, oa, ob| {
                let (ja, jb) = (pair_job(a, &da[i], oa, ca), pair_job(b, &db[i], ob, cb));
                gemv_pair(client, &x_dev, n, k, ja, jb).map_err(anyhow::Error::msg)
            };
            let (sa, sb) = (client.empty(n * a.1 * 4), client.empty(n * b.1 * 4));
            let (pa, pb) = (client.empty(n * a.1 * 4), client.empty(n * b.1 * 4));
            single(a, &da[0], &sa, ca)?;
            single(b, &db[0], &sb, cb)?;
            pair(0, &pa, &pb)?;
            let read = |h: &burn::cubecl::server::Handle| -> Result<Vec<u32>> {
                Ok(u32::from_bytes(&client.read_one(h.clone()).map_err(|e| anyhow::anyhow!("read: {e:?}"))?).to_vec())
            };
            let same = read(&sa)? == read(&pa)? && read(&sb)? == read(&pb)?;
            // Against the reference on every row (the short matrices of a pair are a few thousand rows).
            let reference = |(_, rows, swiglu): (&str, usize, bool), w: &[Vec<u16>]| {
                if swiglu {
                    swiglu_reference(&x, &w[0], &w[1], n, rows, k)
                } else {
                    gemv_reference(&x, &w[0], n, rows, k)
                }
            };
            let all = |rows: usize| (0..rows).collect::<Vec<_>>();
            let (ea, oka) = check(client, &pa, &reference(a, &wa), n, a.1, &all(a.1))?;
            let (eb, okb) = check(client, &pb, &reference(b, &wb), n, b.1, &all(b.1))?;
            let ok = same && oka && okb;
            failed |= !ok;
            let two = time(client, |i| {
                single(a, &da[i % copies], &sa, ca)?;
                single(b, &db[i % copies], &sb, cb)
            })?;
            let one = time(client, |i| pair(i % copies, &pa, &pb))?;
            let moved = (bytes + n * k * 4 + n * (a.1 + b.1) * 4) as f64;
            println!(
                "| {} + {} | {n} | {} {ea:.1e} / {eb:.1e} {} | {:.1} | {:.1} | {:.0} | {:.0} |",
                a.0,
                b.0,
                if same { "identical" } else { "DIFFERENT" },
                if ok { "ok" } else { "FAIL" },
                two * 1e6,
                one * 1e6,
                moved / one / 1e9,
                100.0 * moved / one / copy_bw
            );
            rows_json.push(serde_json::json!({"pair": [a.0, b.0], "n": n, "identical": same, "error_a": ea,
                "error_b": eb, "ok": ok, "two_launches_us": two * 1e6, "pair_us": one * 1e6,
                "pct_copy_bw": 100.0 * moved / one / copy_bw}));
        }
    }
    Ok(failed)
}

/// The RMSNorm of each row of `x` `[n, k]` (weight `g`, `eps`) in f64, rounded to f32 (the kernels' activations are
/// f32): the normed GEMV's reference input.
fn normed_reference(x: &[f32], g: &[f32], n: usize, k: usize, eps: f32) -> Vec<f32> {
    let mut xn = vec![0.0f32; n * k];
    for t in 0..n {
        let row = &x[t * k..(t + 1) * k];
        let ms = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / k as f64;
        let inv = 1.0 / (ms + f64::from(eps)).sqrt();
        for c in 0..k {
            xn[t * k + c] = (f64::from(row[c]) * inv * f64::from(g[c])) as f32;
        }
    }
    xn
}

/// A `gemv_pair` job of `(name, rows, SwiGLU)` over weights `w` (gate then up for SwiGLU).
fn pair_job<'a>(
    (_, rows, swiglu): (&str, usize, bool),
    w: &'a [burn::cubecl::server::Handle],
    out: &'a burn::cubecl::server::Handle,
    cfg: GemvConfig,
) -> GemvJob<'a> {
    GemvJob { w: &w[0], w_up: if swiglu { Some(&w[1]) } else { None }, out, rows, cfg }
}

/// `q_b_proj` (12288 x 1536) of `q_a_layernorm`'s output at 1, 2 and 4 tokens: `gemv_norm` against the RMSNorm
/// launch then `gemv_bf16` (bit for bit) and the f64 reference (the norm in f64 too), both timed. Returns whether
/// any check failed.
fn normed(
    client: &ComputeClient<R>,
    rng: &mut SplitMix64,
    copy_bw: f64,
    rows_json: &mut Vec<serde_json::Value>,
) -> Result<bool> {
    let (rows, k, eps) = (12288usize, 1536usize, 1e-6f32);
    let w = weights(rng, rows, k);
    let copies = (256 << 20).div_ceil(rows * k * 2).max(1);
    let w_dev: Vec<_> = (0..copies).map(|_| client.create_from_slice(u16::as_bytes(&w))).collect();
    let g: Vec<f32> = (0..k).map(|_| 0.5 + rng.next_f32()).collect();
    let g_dev = client.create_from_slice(f32::as_bytes(&g));
    println!(
        "\n| normed GEMV | n | vs norm + GEMV launches; vs reference | two launches us | one launch us | GB/s | % of copy BW |\n|---|---|---|---|---|---|---|"
    );
    let mut failed = false;
    for n in [1usize, 2, 4] {
        let x: Vec<f32> = rng.activations(n * k).iter().map(|v| v.to_f32() * 3.0).collect();
        let x_dev = client.create_from_slice(f32::as_bytes(&x));
        let cfg = GemvConfig::for_shape(n, rows, k, 264);
        let (normed_dev, two, one) = (client.empty(n * k * 4), client.empty(n * rows * 4), client.empty(n * rows * 4));
        let separate = |i: usize| -> Result<()> {
            // SAFETY: x and normed hold [n, k] f32, g [k]; one block a row reads and writes row CUBE_POS_X < n.
            unsafe {
                rms_norm_kernel::launch_unchecked::<R>(
                    client,
                    CubeCount::Static(n as u32, 1, 1),
                    CubeDim::new_2d(32, RMS_NORM_WARPS as u32),
                    AddressType::U32,
                    4,
                    ArrayArg::from_raw_parts(x_dev.clone(), n * k / 4),
                    ArrayArg::from_raw_parts(x_dev.clone(), n * k / 4),
                    ArrayArg::from_raw_parts(g_dev.clone(), k / 4),
                    ArrayArg::from_raw_parts(normed_dev.clone(), n * k / 4),
                    ArrayArg::from_raw_parts(normed_dev.clone(), n * k / 4),
                    eps,
                    k,
                    RMS_NORM_WARPS,
                    false,
                );
            }
            gemv_bf16(client, &normed_dev, &w_dev[i], &two, n, rows, k, cfg).map_err(anyhow::Error::msg)
        };
        let fused = |i: usize| {
            gemv_norm(client, &x_dev, &g_dev, &w_dev[i], &one, (n, rows, k), eps, cfg).map_err(anyhow::Error::msg)
        };
        separate(0)?;
        fused(0)?;
        let read = |h: &burn::cubecl::server::Handle| -> Result<Vec<u32>> {
            Ok(u32::from_bytes(&client.read_one(h.clone()).map_err(|e| anyhow::anyhow!("read: {e:?}"))?).to_vec())
        };
        let same = read(&two)? == read(&one)?;
        let xn = normed_reference(&x, &g, n, k, eps);
        let checked: Vec<usize> = (0..rows).step_by(rows.div_ceil(256)).collect();
        let w_checked: Vec<u16> = checked.iter().flat_map(|&r| w[r * k..(r + 1) * k].iter().copied()).collect();
        let want = gemv_reference(&xn, &w_checked, n, checked.len(), k);
        let (err, ok) = check(client, &one, &want, n, rows, &checked)?;
        let ok = ok && same;
        failed |= !ok;
        let t_two = time(client, |i| separate(i % copies))?;
        let t_one = time(client, |i| fused(i % copies))?;
        let moved = (rows * k * 2 + n * k * 4 + k * 4 + n * rows * 4) as f64;
        println!(
            "| q_a_layernorm + q_b_proj | {n} | {} {err:.1e} {} | {:.1} | {:.1} | {:.0} | {:.0} |",
            if same { "identical" } else { "DIFFERENT" },
            if ok { "ok" } else { "FAIL" },
            t_two * 1e6,
            t_one * 1e6,
            moved / t_one / 1e9,
            100.0 * moved / t_one / copy_bw
        );
        rows_json.push(serde_json::json!({"normed": "q_a_layernorm + q_b_proj", "n": n, "identical": same,
            "error": err, "ok": ok, "two_launches_us": t_two * 1e6, "one_launch_us": t_one * 1e6,
            "pct_copy_bw": 100.0 * moved / t_one / copy_bw}));
    }
    Ok(failed)
}

/// One GEMV of the sweep: `(name, rows, k, kind)`.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Plain,
    Swiglu,
    Normed,
}

/// Every launch shape of 8 warps the GEMV kernels take for `k` (`sets` matrices a warp loads: 2 for SwiGLU): rows a
/// warp 1, 2, 4; k-split 1-8 while each warp keeps a stretch of 512 bytes; stretches in flight 1-8, at most 16 loads
/// in flight a lane.
fn candidates(n: usize, k: usize, sets: usize) -> Vec<GemvConfig> {
    let tb = GemvConfig::for_tokens(n).tb;
    let stretches = (k / 8).div_ceil(32);
    let mut out = Vec::new();
    for rows_at_once in [1, 2, 4] {
        for ksplit in [1, 2, 4, 8] {
            for unroll in [1, 2, 4, 8] {
                if ksplit > stretches || unroll > stretches.div_ceil(ksplit) || rows_at_once * unroll * sets > 16 {
                    continue;
                }
                out.push(GemvConfig { warps: 8, rows_at_once, tb, ksplit, unroll });
            }
        }
    }
    out
}

/// The model's shape for one job: `for_swiglu` for SwiGLU, else `for_shape` (264 blocks = 2 x 132 SMs).
fn current(n: usize, rows: usize, k: usize, kind: Kind) -> GemvConfig {
    if kind == Kind::Swiglu { GemvConfig::for_swiglu(n, rows, k, 264) } else { GemvConfig::for_shape(n, rows, k, 264) }
}

fn shape_label(c: &GemvConfig) -> String {
    format!("rows {} ksplit {} unroll {}", c.rows_at_once, c.ksplit, c.unroll)
}

/// `--sweep` (module docs). Returns whether any check failed.
fn sweep(
    client: &ComputeClient<R>,
    rng: &mut SplitMix64,
    copy_bw: f64,
    n: usize,
    rows_json: &mut Vec<serde_json::Value>,
) -> Result<bool> {
    const JOBS: [(&str, usize, usize, Kind); 7] = [
        ("q_a_proj", 1536, 7168, Kind::Plain),
        ("kv_a_proj_with_mqa", 576, 7168, Kind::Plain),
        ("q_b_proj (normed)", 12288, 1536, Kind::Normed),
        ("o_proj", 7168, 8192, Kind::Plain),
        ("shared gate/up", 2048, 7168, Kind::Swiglu),
        ("router", 384, 7168, Kind::Plain),
        ("shared down", 7168, 2048, Kind::Plain),
    ];
    let behind = BehindCopy::new(client).map_err(anyhow::Error::msg)?;
    let mut failed = false;
    let mut best: Vec<Vec<(f64, GemvConfig)>> = Vec::new();
    let mut uploads = Vec::new();
    println!("\n| GEMV | rows x k | n | shape | blocks | GPU us | % of copy BW | |\n|---|---|---|---|---|---|---|---|");
    for (name, rows, k, kind) in JOBS {
        let sets = if kind == Kind::Swiglu { 2 } else { 1 };
        let mats: Vec<Vec<u16>> = (0..sets).map(|_| weights(rng, rows, k)).collect();
        let bytes = sets * rows * k * 2;
        let copies = (256 << 20).div_ceil(bytes).max(2);
        let w_dev: Vec<Vec<_>> =
            (0..copies).map(|_| mats.iter().map(|w| client.create_from_slice(u16::as_bytes(w))).collect()).collect();
        let x: Vec<f32> = rng.activations(n * k).iter().map(|v| v.to_f32() * 3.0).collect();
        let x_dev = client.create_from_slice(f32::as_bytes(&x));
        let g: Vec<f32> = (0..k).map(|_| 0.5 + rng.next_f32()).collect();
        let g_dev = client.create_from_slice(f32::as_bytes(&g));
        let eps = 1e-6f32;
        let checked: Vec<usize> = (0..rows).step_by(rows.div_ceil(256)).collect();
        let pick =
            |w: &[u16]| -> Vec<u16> { checked.iter().flat_map(|&r| w[r * k..(r + 1) * k].iter().copied()).collect() };
        let want = match kind {
            Kind::Plain => gemv_reference(&x, &pick(&mats[0]), n, checked.len(), k),
            Kind::Swiglu => swiglu_reference(&x, &pick(&mats[0]), &pick(&mats[1]), n, checked.len(), k),
            Kind::Normed => gemv_reference(&normed_reference(&x, &g, n, k, eps), &pick(&mats[0]), n, checked.len(), k),
        };
        let out = client.empty(n * rows * 4);
        let call = |i: usize, cfg: GemvConfig| -> Result<()> {
            let w = &w_dev[i % copies];
            match kind {
                Kind::Plain => gemv_bf16(client, &x_dev, &w[0], &out, n, rows, k, cfg),
                Kind::Swiglu => gemv_swiglu(client, &x_dev, &w[0], &w[1], &out, n, rows, k, cfg),
                Kind::Normed => gemv_norm(client, &x_dev, &g_dev, &w[0], &out, (n, rows, k), eps, cfg),
            }
            .map_err(anyhow::Error::msg)
        };
        let now = current(n, rows, k, kind);
        let mut timed = Vec::new();
        for cfg in candidates(n, k, sets) {
            call(0, cfg)?;
            let (err, ok) = check(client, &out, &want, n, rows, &checked)?;
            failed |= !ok;
            let us = behind
                .time_us(client, 2, 16, |i| {
                    let _ = call(i, cfg);
                })
                .map_err(anyhow::Error::msg)?;
            let moved = (bytes + n * k * 4 + n * rows * 4) as f64;
            let pct = 100.0 * moved / (us * 1e-6) / copy_bw;
            let blocks = rows.div_ceil(cfg.warps / cfg.ksplit * cfg.rows_at_once);
            let mark = if cfg == now { "model's" } else { "" };
            println!(
                "| {name} | {rows} x {k} | {n} | {} | {blocks} | {us:.1} | {pct:.0} | {mark}{} |",
                shape_label(&cfg),
                if ok { "" } else { " FAIL" }
            );
            rows_json.push(serde_json::json!({"gemv": name, "rows": rows, "k": k, "n": n, "rows_at_once":
                cfg.rows_at_once, "ksplit": cfg.ksplit, "unroll": cfg.unroll, "blocks": blocks, "gpu_us": us,
                "pct_copy_bw": pct, "error": err, "ok": ok, "model": cfg == now}));
            timed.push((us, cfg));
        }
        timed.sort_by(|a, b| a.0.total_cmp(&b.0));
        let cur = timed.iter().find(|(_, c)| *c == now).map_or(f64::NAN, |t| t.0);
        println!(
            "| **{name}** | | {n} | best {} | | **{:.1}** | | model's {} {cur:.1} |",
            shape_label(&timed[0].1),
            timed[0].0,
            shape_label(&now)
        );
        best.push(timed.clone());
        uploads.push((w_dev, x_dev, copies));
    }

    // Pairs: q_a + kv_a (jobs 0, 1), shared gate/up + router (4, 5), each job's best 4 (and the model's).
    println!("\n| pair | n | job a shape | job b shape | blocks | GPU us | |\n|---|---|---|---|---|---|---|");
    for (ia, ib) in [(0usize, 1usize), (4, 5)] {
        let (na, ra, k, kind_a) = JOBS[ia];
        let (nb, rb, _, kind_b) = JOBS[ib];
        let top = |i: usize, rows: usize, kind: Kind| {
            let mut v: Vec<GemvConfig> = best[i].iter().take(4).map(|t| t.1).collect();
            let now = current(n, rows, k, kind);
            if !v.contains(&now) {
                v.push(now);
            }
            v
        };
        let (wa, xa, ca) = &uploads[ia];
        let (wb, _, cb) = &uploads[ib];
        let (oa, ob) = (client.empty(n * ra * 4), client.empty(n * rb * 4));
        let now = (current(n, ra, k, kind_a), current(n, rb, k, kind_b));
        let mut timed = Vec::new();
        for a in top(ia, ra, kind_a) {
            for b in top(ib, rb, kind_b) {
                let us = behind
                    .time_us(client, 2, 16, |i| {
                        let ja = pair_job((na, ra, kind_a == Kind::Swiglu), &wa[i % ca], &oa, a);
                        let jb = pair_job((nb, rb, kind_b == Kind::Swiglu), &wb[i % cb], &ob, b);
                        let _ = gemv_pair(client, xa, n, k, ja, jb);
                    })
                    .map_err(anyhow::Error::msg)?;
                let blocks = ra.div_ceil(8 / a.ksplit * a.rows_at_once) + rb.div_ceil(8 / b.ksplit * b.rows_at_once);
                let mark = if (a, b) == now { "model's" } else { "" };
                println!(
                    "| {na} + {nb} | {n} | {} | {} | {blocks} | {us:.1} | {mark} |",
                    shape_label(&a),
                    shape_label(&b)
                );
                rows_json.push(serde_json::json!({"pair": [na, nb], "n": n, "a": shape_label(&a), "b":
                    shape_label(&b), "blocks": blocks, "gpu_us": us, "model": (a, b) == now}));
                timed.push((us, a, b));
            }
        }
        timed.sort_by(|x, y| x.0.total_cmp(&y.0));
        let cur = timed.iter().find(|t| (t.1, t.2) == now).map_or(f64::NAN, |t| t.0);
        println!(
            "| **{na} + {nb}** | {n} | best {} | {} | | **{:.1}** | model's {cur:.1} |",
            shape_label(&timed[0].1),
            shape_label(&timed[0].2),
            timed[0].0
        );
    }
    Ok(failed)
}
