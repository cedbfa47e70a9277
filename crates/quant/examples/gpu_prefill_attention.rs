//! GPU check and benchmark of the MHA-form prefill attention (`eyrie_quant::cuda::prefill_attention`, issue 4
//! deliverable 2); runs on a CUDA machine, built with `--features cuda`.
//!
//! ```text
//! gpu_prefill_attention [--json FILE] [--quick]
//! ```
//!
//! Check: random never-zero queries, keys, values and `k_pe`, chunks with and without a cached prefix, partial query
//! tiles, a prefix split into segments merged by the combine kernel, Kimi-K2's head dimensions and another set; the
//! kernel's output against the f64 CPU reference ([`mha_prefill_reference`]), norm-wise `max |gpu - ref| / max
//! |ref|` <= 1e-5 (f32 sums over at most a few thousand keys in another order: ~1e-7; a wrong key, head or weight
//! shows as 1e-2 or more). Exit status 1 on a mismatch.
//!
//! Bench: Kimi-K2's attention (64 heads, q/k 128 + 64, v 128; latents 512 + 64) for prefill chunks of `n` rows
//! after `start` cached positions: the MHA form (the keys' expansion through `kv_b_proj` by the f32-exact cuBLAS
//! GEMM, then the kernel) against the absorbed kernel the chunks ran before (`attention::mla_attention` over the
//! same latents, its query and value absorption not counted), microseconds (median of 5 runs between syncs) and
//! TFLOP/s of each form's useful work: `2 x heads x (causal row-key pairs) x (192 + 128)` for the MHA form,
//! `x (576 + 512)` for the absorbed one. The peer (PyTorch SDPA on the same shapes, f32) is
//! `scripts/prefill_attention_peer.py`, run in the same device session.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::cubecl::cuda::{CudaDevice, CudaRuntime};
use burn::cubecl::prelude::*;
use eyrie_quant::cuda::attention::{AttentionConfig, PagedRows, mla_attention};
use eyrie_quant::cuda::gemm::{Blas, gemm_f32_bf16w};
use eyrie_quant::cuda::prefill_attention::{MhaDims, combine_segments, mha_prefill_attention, mha_prefill_reference};
use eyrie_quant::cuda::{Mismatch, SplitMix64};

type R = CudaRuntime;

const TOL: f64 = 1e-5;

fn sync(client: &ComputeClient<R>) -> Result<()> {
    burn::cubecl::future::block_on(client.sync()).map_err(|e| anyhow::anyhow!("device sync: {e:?}"))
}

/// Never-zero values of magnitude `[1/16, 1) * scale`, random sign.
fn values(rng: &mut SplitMix64, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let mag = (0.0625 + 0.9375 * rng.next_f32()) * scale;
            if rng.next_u64() & 1 == 0 { mag } else { -mag }
        })
        .collect()
}

fn read(client: &ComputeClient<R>, h: &burn::cubecl::server::Handle) -> Result<Vec<f32>> {
    let bytes = client.read_one(h.clone()).map_err(|e| anyhow::anyhow!("read: {e:?}"))?;
    Ok(f32::from_bytes(&bytes).to_vec())
}

struct Case {
    name: &'static str,
    heads: usize,
    dims: MhaDims,
    /// Query rows of the chunk.
    n: usize,
    /// Cached positions before the chunk.
    start: usize,
    /// Key segments (lengths, summing to `start + n`).
    segments: Vec<usize>,
}

fn check(client: &ComputeClient<R>, rng: &mut SplitMix64, case: &Case) -> Result<(f64, bool)> {
    let MhaDims { nope, rot, vd } = case.dims;
    let (heads, n, start) = (case.heads, case.n, case.start);
    let keys = start + n;
    assert_eq!(case.segments.iter().sum::<usize>(), keys, "{}: segments", case.name);
    // k_pe inside a wider latent row, as the cache holds it: [keys, 32 + rot], k_pe at column 32.
    let (kpe_width, kpe_col) = (32 + rot, 32);
    let q = values(rng, n * heads * (nope + rot), 1.0);
    let kv = values(rng, keys * heads * (nope + vd), 1.0);
    let kpe = values(rng, keys * kpe_width, 1.0);
    let scale = 1.0 / ((nope + rot) as f32).sqrt();
    let want =
        mha_prefill_reference(&q, &kv, &kpe, kpe_width, kpe_col, n, heads, case.dims, start, 0, keys, f64::from(scale));
    let q_dev = client.create_from_slice(f32::as_bytes(&q));
    let kpe_dev = client.create_from_slice(f32::as_bytes(&kpe));
    let segs = case.segments.len();
    let o_part = client.empty(segs * n * heads * vd * 4);
    let ml_part = client.empty(segs * n * heads * 2 * 4);
    let mut key0 = 0;
    for (seg, &len) in case.segments.iter().enumerate() {
        // Each segment's keys in a buffer of their own, as the model expands them.
        let w = heads * (nope + vd);
        let kv_dev = client.create_from_slice(f32::as_bytes(&kv[key0 * w..(key0 + len) * w]));
        mha_prefill_attention(
            client,
            &q_dev,
            &kv_dev,
            &kpe_dev,
            (keys, kpe_width, kpe_col, key0),
            &o_part,
            &ml_part,
            (segs, seg),
            n,
            heads,
            case.dims,
            (start, key0, len),
            scale,
        )
        .map_err(anyhow::Error::msg)?;
        key0 += len;
    }
    let out = if segs == 1 {
        o_part
    } else {
        let out = client.empty(n * heads * vd * 4);
        combine_segments(client, &o_part, &ml_part, &out, n * heads, segs, vd).map_err(anyhow::Error::msg)?;
        out
    };
    let got = read(client, &out)?;
    if got.len() < want.len() {
        bail!("{}: {} outputs read back, {} expected", case.name, got.len(), want.len());
    }
    let e = f64::from(Mismatch::of(&got[..want.len()], &want).rel_to_max);
    Ok((e, e <= TOL))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Microseconds of `f` (median of `reps` runs, each synced).
fn time(client: &ComputeClient<R>, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    sync(client)?;
    let mut t = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        sync(client)?;
        t.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    Ok(median(t))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().position(|a| a == "--json").and_then(|i| args.get(i + 1)).cloned();
    let quick = args.iter().any(|a| a == "--quick");
    let client = R::client(&CudaDevice::new(0));
    let mut rng = SplitMix64::new(0x9e37_79b9_7f4a_7c15);
    let kimi = MhaDims { nope: 128, rot: 64, vd: 128 };
    let other = MhaDims { nope: 64, rot: 32, vd: 64 };

    println!("## Check against the f64 reference (tolerance {TOL:.0e})\n");
    println!("| case | heads | n | prefix | segments | error | ok |");
    println!("|---|---|---|---|---|---|---|");
    let cases = [
        Case { name: "kimi, partial tiles, no prefix", heads: 8, dims: kimi, n: 130, start: 0, segments: vec![130] },
        Case { name: "kimi, prefix", heads: 16, dims: kimi, n: 70, start: 200, segments: vec![270] },
        Case {
            name: "kimi, prefix in 3 segments",
            heads: 16,
            dims: kimi,
            n: 70,
            start: 200,
            segments: vec![100, 64, 106],
        },
        Case { name: "kimi, 64 heads, one tile", heads: 64, dims: kimi, n: 64, start: 700, segments: vec![764] },
        Case { name: "kimi, one row", heads: 4, dims: kimi, n: 1, start: 77, segments: vec![78] },
        Case { name: "nope 64 rot 32 vd 64", heads: 4, dims: other, n: 90, start: 37, segments: vec![60, 67] },
    ];
    let mut failed = false;
    let mut check_json = Vec::new();
    for case in &cases {
        let (e, ok) = check(&client, &mut rng, case)?;
        failed |= !ok;
        println!(
            "| {} | {} | {} | {} | {} | {e:.1e} | {ok} |",
            case.name,
            case.heads,
            case.n,
            case.start,
            case.segments.len()
        );
        check_json.push(serde_json::json!({"case": case.name, "heads": case.heads, "n": case.n,
            "start": case.start, "segments": case.segments, "error": e, "ok": ok}));
    }

    // Bench: Kimi-K2's shapes.
    let (heads, r, rot) = (64usize, 512usize, 64usize);
    let d = r + rot;
    let blas = Blas::new(0).map_err(anyhow::Error::msg).context("the bench needs cuBLAS")?;
    let smem = client.properties().hardware.max_shared_memory_size;
    let sms = client.properties().hardware.num_streaming_multiprocessors.unwrap_or(132) as usize;
    let shapes: &[(usize, usize)] = if quick {
        &[(1024, 0), (64, 960)]
    } else {
        &[(64, 960), (256, 768), (1024, 0), (2048, 0), (2048, 6144), (64, 8128), (256, 7936), (8192, 0)]
    };
    println!("\n## Kimi-K2 prefill chunks (64 heads), microseconds a layer\n");
    println!(
        "| rows | prefix | expand us | MHA kernel us | MHA total us | MHA TFLOP/s (kernel) | absorbed us | absorbed TFLOP/s | absorbed / MHA total |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut bench_json = Vec::new();
    for &(n, start) in shapes {
        let keys = start + n;
        let pairs: f64 = (0..n).map(|i| (start + i + 1) as f64).sum();
        let lat = values(&mut rng, keys * d, 1.0);
        let c: Vec<f32> = (0..keys).flat_map(|t| lat[t * d..t * d + r].to_vec()).collect();
        let w: Vec<u16> = (0..heads * (kimi.nope + kimi.vd) * r)
            .map(|_| half::bf16::from_f32(values(&mut rng, 1, 0.05)[0]).to_bits())
            .collect();
        let q = values(&mut rng, n * heads * (kimi.nope + rot), 1.0);
        let qa = values(&mut rng, n * heads * d, 0.1);
        let lat_dev = client.create_from_slice(f32::as_bytes(&lat));
        let c_dev = client.create_from_slice(f32::as_bytes(&c));
        let w_dev = client.create_from_slice(u16::as_bytes(&w));
        let q_dev = client.create_from_slice(f32::as_bytes(&q));
        let qa_dev = client.create_from_slice(f32::as_bytes(&qa));
        let kv_dev = client.empty(keys * heads * (kimi.nope + kimi.vd) * 4);
        let o_dev = client.empty(n * heads * kimi.vd * 4);
        let ml_dev = client.empty(n * heads * 2 * 4);
        let scale = 1.0 / ((kimi.nope + rot) as f32).sqrt();
        let reps = if n * keys > 4 << 20 { 3 } else { 5 };
        let expand = || {
            gemm_f32_bf16w(&client, &blas, &c_dev, &w_dev, &kv_dev, keys, heads * (kimi.nope + kimi.vd), r)
                .map_err(anyhow::Error::msg)
        };
        let attend = || {
            mha_prefill_attention(
                &client,
                &q_dev,
                &kv_dev,
                &lat_dev,
                (keys, d, r, 0),
                &o_dev,
                &ml_dev,
                (1, 0),
                n,
                heads,
                kimi,
                (start, 0, keys),
                scale,
            )
            .map_err(anyhow::Error::msg)
        };
        let expand_us = time(&client, reps, expand)?;
        let kernel_us = time(&client, reps, attend)?;
        let total_us = time(&client, reps, || {
            expand()?;
            attend()
        })?;
        // The absorbed kernel over the same latents (one sequence in one block of the pool).
        let rows = PagedRows::contiguous_chunk(n, start);
        let meta = client.create_from_slice(u32::as_bytes(&rows.packed()));
        let out_abs = client.empty(n * heads * r * 4);
        let cfg = AttentionConfig::new(n, heads, keys, d, sms, smem)
            .ok_or_else(|| anyhow::anyhow!("absorbed attention: no launch shape for {n} rows over {keys}"))?;
        let absorbed_us = time(&client, reps, || {
            mla_attention(&client, &qa_dev, &lat_dev, keys, &rows, &meta, &out_abs, heads, r, rot, scale, cfg)
                .map_err(anyhow::Error::msg)
        })?;
        let mha_tflops = 2.0 * heads as f64 * pairs * (kimi.nope + rot + kimi.vd) as f64 / kernel_us / 1e6;
        let abs_tflops = 2.0 * heads as f64 * pairs * (d + r) as f64 / absorbed_us / 1e6;
        println!(
            "| {n} | {start} | {expand_us:.0} | {kernel_us:.0} | {total_us:.0} | {mha_tflops:.1} | {absorbed_us:.0} | {abs_tflops:.1} | {:.2}x |",
            absorbed_us / total_us
        );
        bench_json.push(serde_json::json!({"rows": n, "prefix": start, "heads": heads, "expand_us": expand_us,
            "mha_kernel_us": kernel_us, "mha_total_us": total_us, "mha_kernel_tflops": mha_tflops,
            "absorbed_us": absorbed_us, "absorbed_tflops": abs_tflops, "speedup": absorbed_us / total_us}));
    }
    if let Some(path) = json {
        let doc = serde_json::json!({"kernel": "eyrie_quant::cuda::prefill_attention::mha_prefill_attention",
            "tolerance": TOL, "check": check_json, "bench": bench_json});
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    if failed {
        bail!("the MHA prefill attention differs from the reference beyond {TOL:.0e}");
    }
    Ok(())
}
