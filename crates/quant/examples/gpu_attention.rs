//! GPU check and benchmark of MLA attention over the paged latent cache (`eyrie_quant::cuda::attention`, issue 4);
//! runs on a CUDA machine, built with `--features cuda`.
//!
//! ```text
//! gpu_attention [--json FILE] [--quick] [--sweep] [--small] [--dims] [--mma] [--tf32] [--heads 64] [--profile BATCHxCONTEXT]
//! ```
//!
//! Check: random never-zero queries and latents, page tables of shuffled blocks, decode rows of several sequences
//! of uneven lengths and prefill/verification rows with causal lengths; the kernel's output against the f64 CPU
//! reference ([`mla_attention_reference`]), norm-wise `max |gpu - ref| / max |ref|` <= 1e-5 (f32 sums over at
//! most a few thousand positions in another order: ~1e-7; a wrong position, head or weight shows as 1e-2 or more).
//! Both with the launch shape the model uses and with every row in one slice. Exit status 1 on a mismatch.
//!
//! Bench: Kimi-K2's absorbed MLA (64 heads, latent 512 + rope 64, f32 cache, pages of 16 positions in shuffled
//! order) for decode batches 1..128 at context 1k and 8k: microseconds per layer by wall clock (median of 9 runs of
//! 10 back-to-back calls between syncs, each call on another layer's cache so that the L2 does not hold it) and in
//! GPU time (the same calls queued behind a 2 GiB copy, `BehindCopy`: at small batches the host's enqueue outlasts
//! the kernels) with the attention launch alone beside it (its slices unmerged: the combine launch's share by
//! difference; where the TF32 kernel runs, its other ring of stages at the same slices on a row of its own), GB/s of
//! the bytes that must move (the latents the rows see, the queries and the output) and their
//! share of the copy bandwidth measured in the same run, and TFLOP/s (2 x heads x positions x (576 + 512) per row),
//! the last three from the GPU time. `--heads N`:
//! the benchmarks and sweeps with N heads instead of 64 (8: one rank's share under `--tp-size 8`). `--dims`: the
//! dim-lane kernel's shapes (`attention_dims`) x slice lengths in GPU time beside the automatic launch, on one cache
//! a case (the same for every launch: at 1k and at one row over 8k it stays in L2, so the % of the copy bandwidth
//! there is the L2's, not DRAM's). `--mma`: the same sweep with the tensor-core kernel's shapes (`attention_mma`)
//! instead of the dim lanes', beside the automatic key-lane launch and the picked one. `--tf32`: the dim lanes' sweep
//! with the TF32 kernel's stage lengths (`attention_tf32`) x slice lengths added.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::cubecl::cuda::{CudaDevice, CudaRuntime};
use burn::cubecl::prelude::*;
use eyrie_quant::cuda::SplitMix64;
use eyrie_quant::cuda::attention::{
    AttentionConfig, FEW_HEADS, HEADS_PER_WARP, Lanes, PagedRows, attention_shared_bytes, mla_attention,
    mla_attention_parts, mla_attention_reference, write_rows,
};
use eyrie_quant::cuda::attention_dims::dims_refusal;
use eyrie_quant::cuda::attention_mma::{MMA_SHAPES, mma_refusal};
use eyrie_quant::cuda::attention_tf32::{TF32_SHAPES, Tf32Shape, tf32_refusal};
use eyrie_quant::cuda::{BehindCopy, copy_bandwidth};

type R = CudaRuntime;

const TOL: f64 = 1e-5;

/// GPU us a call of `calls` calls `f(i)` behind a copy (`BehindCopy`, 2 warm-up calls): `Ok(None)` where the timing
/// failed (the host's enqueue outlasting the copy), `Err` on the first launch error.
fn time_behind(
    behind: &BehindCopy,
    client: &ComputeClient<R>,
    calls: usize,
    mut f: impl FnMut(usize) -> Result<(), String>,
) -> Result<Option<f64>> {
    let mut err = None;
    let us = behind.time_us(client, 2, calls, |i| {
        if let Err(e) = f(i) {
            err.get_or_insert(e);
        }
    });
    match err {
        Some(e) => bail!(e),
        None => Ok(us.ok()),
    }
}

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

/// Page tables for sequences of `lens` positions over a cache of `slots` rows: every sequence gets its blocks from
/// one shuffled list of all blocks. Returns the tables (padded) and `max_blocks`.
fn tables(rng: &mut SplitMix64, lens: &[usize], block_size: usize, slots: usize) -> (Vec<u32>, usize) {
    let max_blocks = lens.iter().map(|l| l.div_ceil(block_size)).max().unwrap_or(1).max(1);
    let mut free: Vec<u32> = (0..(slots / block_size) as u32).collect();
    for i in (1..free.len()).rev() {
        free.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut t = Vec::with_capacity(lens.len() * max_blocks);
    let mut next = 0;
    for &len in lens {
        let n = len.div_ceil(block_size);
        t.extend_from_slice(&free[next..next + n]);
        t.extend(std::iter::repeat_n(0, max_blocks - n));
        next += n;
    }
    (t, max_blocks)
}

struct Case {
    name: &'static str,
    heads: usize,
    r: usize,
    rot: usize,
    block_size: usize,
    /// Sequence lengths (after this step).
    lens: Vec<usize>,
    /// New tokens per sequence this step (its last `new` positions are query rows).
    new: Vec<usize>,
}

fn rows_of(case: &Case, tables: Vec<u32>, max_blocks: usize) -> PagedRows {
    let mut row_seq = Vec::new();
    let mut row_len = Vec::new();
    for (s, (&len, &new)) in case.lens.iter().zip(&case.new).enumerate() {
        for i in 0..new {
            row_seq.push(s as u32);
            row_len.push((len - new + i + 1) as u32);
        }
    }
    PagedRows { row_seq, row_len, tables, max_blocks, block_size: case.block_size }
}

/// The dim-lane kernel's shapes the check runs and the sweep times: (head warps, key warps, heads a warp, key
/// groups a key warp a stage).
const DIM_SHAPES: [(usize, usize, usize, usize); 12] = [
    (1, 4, 8, 1),
    (1, 8, 8, 1),
    (1, 4, 8, 2),
    (2, 2, 8, 1),
    (2, 4, 8, 1),
    (4, 1, 8, 1),
    (4, 2, 8, 1),
    (8, 1, 8, 1),
    (8, 1, 8, 2),
    (2, 4, 4, 1),
    (4, 2, 4, 1),
    (8, 1, 4, 2),
];

/// A launch shape in words: the kernel, warps, heads a warp, slices.
fn shape_label(cfg: &AttentionConfig) -> String {
    match cfg.lanes {
        Lanes::Keys => format!("keys: {} warps x {} heads, {} slices", cfg.warps, cfg.hpw, cfg.splits),
        Lanes::Dims { key_warps, groups } => format!(
            "dims: {} x {key_warps} warps x {} heads, {groups} groups, {} slices",
            cfg.warps, cfg.hpw, cfg.splits
        ),
        Lanes::Mma { tiles, positions } => format!(
            "tensor cores: {tiles} head tiles x {} warps, {positions} positions a stage, {} slices",
            cfg.warps / tiles,
            cfg.splits
        ),
        Lanes::Tf32 { positions, stages } => format!(
            "TF32 tensor cores: {} warps, {positions} positions a stage, {stages} stages, {} slices",
            cfg.warps, cfg.splits
        ),
    }
}

fn check(
    client: &ComputeClient<R>,
    rng: &mut SplitMix64,
    case: &Case,
    out_json: &mut Vec<serde_json::Value>,
) -> Result<bool> {
    let d = case.r + case.rot;
    let total: usize = case.lens.iter().map(|l| l.div_ceil(case.block_size) * case.block_size).sum();
    let slots = total + 4 * case.block_size;
    let (t, max_blocks) = tables(rng, &case.lens, case.block_size, slots);
    let rows = rows_of(case, t, max_blocks);
    let n = rows.rows();
    let q = values(rng, n * case.heads * d, 1.0);
    let cache = values(rng, slots * d, 1.0);
    let scale = 1.0 / (d as f32).sqrt();
    let want = mla_attention_reference(&q, &cache, &rows, case.heads, case.r, case.rot, f64::from(scale));
    let q_dev = client.create_from_slice(f32::as_bytes(&q));
    let c_dev = client.create_from_slice(f32::as_bytes(&cache));
    let meta = client.create_from_slice(u32::as_bytes(&rows.packed()));
    let max_len = rows.row_len.iter().copied().max().unwrap_or(1) as usize;
    let smem = client.properties().hardware.max_shared_memory_size;
    let auto = AttentionConfig::pick(n, case.heads, max_len, case.r, case.rot, 132, smem)
        .ok_or_else(|| anyhow::anyhow!("{}: no launch shape fits", case.name))?;
    let keys = AttentionConfig::new(n, case.heads, max_len, d, 132, smem)
        .ok_or_else(|| anyhow::anyhow!("{}: no key-lane shape fits", case.name))?;
    let one = AttentionConfig { splits: 1, chunk: max_len.div_ceil(32) * 32, ..auto };
    // The model's launch (`pick`) and the key-lane kernel's every heads-a-warp variant, at the automatic slices.
    let mut launches = vec![("auto".to_string(), auto), ("one slice".to_string(), one)];
    if keys != auto {
        launches.push(("key lanes".to_string(), keys));
    }
    for hpw in HEADS_PER_WARP {
        if hpw != keys.hpw && attention_shared_bytes(d, keys.warps, hpw) <= smem {
            launches.push((format!("{hpw} heads a warp"), AttentionConfig { hpw, ..keys }));
        }
    }
    // The dim-lane kernel's shapes (where it takes the latent: `r` a multiple of 128), at the automatic slices and
    // at one slice.
    for (wh, wk, hpw, sg) in DIM_SHAPES {
        if dims_refusal(case.r, case.rot, wh, wk, hpw, sg, smem).is_none() && wh * hpw <= case.heads.next_multiple_of(8)
        {
            let lanes = Lanes::Dims { key_warps: wk, groups: sg };
            let cfg = AttentionConfig { lanes, warps: wh, hpw, ..auto };
            launches.push((format!("dims {wh}x{wk} warps, {hpw} heads, {sg} groups"), cfg));
            launches.push((
                format!("dims {wh}x{wk} warps, {hpw} heads, {sg} groups, one slice"),
                AttentionConfig { splits: 1, chunk: one.chunk, ..cfg },
            ));
        }
    }
    // The tensor-core kernel's shapes (where it takes the latent), at the automatic slices and at one slice.
    for shape in MMA_SHAPES {
        if mma_refusal(case.r, case.rot, shape, smem).is_none() && 16 * shape.tiles <= case.heads.next_multiple_of(16) {
            let chunk = auto.chunk.next_multiple_of(shape.pt);
            let cfg = shape.config(max_len.div_ceil(chunk), chunk);
            launches.push((format!("tensor cores {shape:?}"), cfg));
            let chunk = max_len.next_multiple_of(32);
            launches.push((format!("tensor cores {shape:?}, one slice"), shape.config(1, chunk)));
        }
    }
    // The TF32 kernel's stage lengths (where it takes the latent), at the automatic slices and at one slice.
    for shape in TF32_SHAPES {
        if tf32_refusal(case.r, case.rot, shape, smem).is_none() {
            let chunk = auto.chunk.next_multiple_of(shape.pt);
            launches.push((format!("TF32 {shape:?}"), shape.config(max_len.div_ceil(chunk), chunk)));
            let chunk = max_len.next_multiple_of(32);
            launches.push((format!("TF32 {shape:?}, one slice"), shape.config(1, chunk)));
        }
    }
    let mut all_ok = true;
    for (label, cfg) in launches {
        let out = client.empty(n * case.heads * case.r * 4);
        mla_attention(client, &q_dev, &c_dev, slots, &rows, &meta, &out, case.heads, case.r, case.rot, scale, cfg)
            .map_err(anyhow::Error::msg)?;
        let got = f32::from_bytes(&client.read_one(out).map_err(|e| anyhow::anyhow!("read: {e:?}"))?).to_vec();
        let (mut diff, mut big) = (0.0f64, 0.0f64);
        for (g, w) in got.iter().zip(&want) {
            diff = diff.max((f64::from(*g) - f64::from(*w)).abs());
            big = big.max(f64::from(*w).abs());
        }
        let err = diff / big.max(f64::MIN_POSITIVE);
        let ok = err <= TOL && got.iter().all(|v| v.is_finite());
        all_ok &= ok;
        println!(
            "| {} | {} | {} x ({} + {}) | {:?} | {} | {label}: {} warps x {} heads, {} slices of {} | {err:.1e} {} |",
            case.name,
            case.heads,
            case.r,
            case.r,
            case.rot,
            case.lens,
            n,
            cfg.warps,
            cfg.hpw,
            cfg.splits,
            cfg.chunk,
            if ok { "ok" } else { "FAIL" }
        );
        out_json.push(serde_json::json!({"case": case.name, "heads": case.heads, "r": case.r, "rot": case.rot,
            "lens": case.lens, "new": case.new, "rows": n, "launch": label, "warps": cfg.warps, "heads_per_warp": cfg.hpw, "splits": cfg.splits,
            "error": err, "ok": ok}));
    }
    Ok(all_ok)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().position(|a| a == "--json").and_then(|i| args.get(i + 1)).cloned();
    let quick = args.iter().any(|a| a == "--quick");
    let sweep = args.iter().any(|a| a == "--sweep");
    let small = args.iter().any(|a| a == "--small");
    let mma = args.iter().any(|a| a == "--mma");
    let tf32 = args.iter().any(|a| a == "--tf32");
    let dims = args.iter().any(|a| a == "--dims") || mma || tf32;
    let heads: usize = match args.iter().position(|a| a == "--heads") {
        Some(i) => args.get(i + 1).context("--heads needs a count")?.parse().context("--heads: not a count")?,
        None => 64,
    };
    if heads == 0 {
        bail!("--heads: at least 1");
    }
    let client = R::client(&CudaDevice::default());
    let sms = client.properties().hardware.num_streaming_multiprocessors.unwrap_or(132) as usize;
    let smem = client.properties().hardware.max_shared_memory_size;
    let mut rng = SplitMix64::new(11);

    println!("| case | heads | latent | sequence lengths | query rows | launch | error (norm-wise) |");
    println!("|---|---|---|---|---|---|---|");
    let kimi = |name, heads, lens: Vec<usize>, new: Vec<usize>| Case {
        name,
        heads,
        r: 512,
        rot: 64,
        block_size: 16,
        lens,
        new,
    };
    let cases = vec![
        Case {
            name: "tiny fixture shape",
            heads: 4,
            r: 32,
            rot: 16,
            block_size: 4,
            lens: vec![1, 37, 70],
            new: vec![1, 1, 5],
        },
        Case {
            name: "heads not a multiple of 8",
            heads: 12,
            r: 64,
            rot: 8,
            block_size: 3,
            lens: vec![5, 33],
            new: vec![5, 2],
        },
        kimi("Kimi decode", 64, vec![1000, 1031, 7, 1100, 64, 65, 999, 1024], vec![1; 8]),
        kimi("Kimi decode, tp 2", 32, vec![700, 33, 1025], vec![1; 3]),
        kimi("Kimi decode, tp 8", 8, vec![300, 2], vec![1; 2]),
        kimi("Kimi prefill chunk + decode", 64, vec![1024, 500], vec![64, 1]),
        kimi("Kimi verify (4 drafted)", 64, vec![2000, 1500], vec![5, 5]),
    ];
    // `--profile BATCHxCONTEXT`: one launch of the picked shape at that size, nothing else (for Nsight Compute).
    if let Some(spec) = args.iter().position(|a| a == "--profile").and_then(|i| args.get(i + 1)) {
        let (b, c) = spec.split_once('x').context("--profile BATCHxCONTEXT")?;
        let (batch, ctx): (usize, usize) = (b.parse()?, c.parse()?);
        let (r, rot, bs) = (512usize, 64usize, 16usize);
        let d = r + rot;
        let lens = vec![ctx; batch];
        let slots = batch * ctx.div_ceil(bs) * bs;
        let case = Case { name: "profile", heads, r, rot, block_size: bs, lens: lens.clone(), new: vec![1; batch] };
        let (t, max_blocks) = tables(&mut rng, &lens, bs, slots);
        let rows = rows_of(&case, t, max_blocks);
        let q_dev = client.create_from_slice(f32::as_bytes(&values(&mut rng, batch * heads * d, 1.0)));
        let cache = client.create_from_slice(f32::as_bytes(&values(&mut rng, slots * d, 1.0)));
        let meta = client.create_from_slice(u32::as_bytes(&rows.packed()));
        let out = client.empty(batch * heads * r * 4);
        let cfg = AttentionConfig::pick(batch, heads, ctx, r, rot, sms, smem).context("no launch shape fits")?;
        println!("profile: {batch} x {ctx}, {heads} heads: {}", shape_label(&cfg));
        for _ in 0..2 {
            mla_attention(&client, &q_dev, &cache, slots, &rows, &meta, &out, heads, r, rot, 0.07, cfg)
                .map_err(anyhow::Error::msg)?;
        }
        return sync(&client);
    }
    let mut check_json = Vec::new();
    let mut failed = false;

    // The cache write: rows scattered into a pool in place, bit for bit.
    let (pool_rows, width, n) = (4096usize, 576usize, 37usize);
    let pool0 = values(&mut rng, pool_rows * width, 1.0);
    let new_rows = values(&mut rng, n * width, 1.0);
    let slots: Vec<u32> = (0..n).map(|i| ((i * 997 + 13) % pool_rows) as u32).collect();
    let pool_dev = client.create_from_slice(f32::as_bytes(&pool0));
    let rows_dev = client.create_from_slice(f32::as_bytes(&new_rows));
    write_rows(&client, &rows_dev, &slots, &pool_dev, pool_rows, width).map_err(anyhow::Error::msg)?;
    let got = f32::from_bytes(&client.read_one(pool_dev).map_err(|e| anyhow::anyhow!("read: {e:?}"))?).to_vec();
    let mut want = pool0;
    for (i, &s) in slots.iter().enumerate() {
        want[s as usize * width..][..width].copy_from_slice(&new_rows[i * width..][..width]);
    }
    let write_ok = got == want;
    failed |= !write_ok;
    println!(
        "| cache write | - | {width} | - | {n} rows into {pool_rows} | write_rows | {} |",
        if write_ok { "exact ok" } else { "FAIL" }
    );
    check_json.push(serde_json::json!({"case": "write_rows", "rows": n, "pool_rows": pool_rows, "ok": write_ok}));
    for case in &cases {
        failed |= !check(&client, &mut rng, case, &mut check_json)?;
    }

    // Copy bandwidth of the same run (read + write bytes of 1 GiB).
    let copy_bw = copy_bandwidth(&client).map_err(anyhow::Error::msg)?;
    println!("\ncopy bandwidth: {:.0} GB/s", copy_bw / 1e9);
    println!("{heads} heads");
    let behind = BehindCopy::new(&client).map_err(anyhow::Error::msg)?;
    println!(
        "| batch | context | cache MB read | launch | us/layer (wall) | GPU us/layer (behind a copy) | GPU us, attention launch alone | GB/s (GPU) | % of copy BW (GPU) | TFLOP/s (GPU) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let (r, rot, bs) = (512usize, 64usize, 16usize);
    let d = r + rot;
    let batches: &[usize] = if quick { &[1, 8] } else { &[1, 8, 32, 128] };
    let mut bench_json = Vec::new();
    for &ctx in &[1024usize, 8192] {
        for &batch in batches {
            let lens = vec![ctx; batch];
            let slots = batch * ctx.div_ceil(bs) * bs;
            let per_layer = slots * d * 4;
            let copies = (512usize << 20).div_ceil(per_layer).clamp(1, 16);
            let case = Case { name: "bench", heads, r, rot, block_size: bs, lens: lens.clone(), new: vec![1; batch] };
            let (t, max_blocks) = tables(&mut rng, &lens, bs, slots);
            let rows = rows_of(&case, t, max_blocks);
            let q = values(&mut rng, batch * heads * d, 1.0);
            let q_dev = client.create_from_slice(f32::as_bytes(&q));
            let layer = values(&mut rng, slots * d, 1.0);
            let caches: Vec<_> = (0..copies).map(|_| client.create_from_slice(f32::as_bytes(&layer))).collect();
            let meta = client.create_from_slice(u32::as_bytes(&rows.packed()));
            let out = client.empty(batch * heads * r * 4);
            let cfg = AttentionConfig::pick(batch, heads, ctx, r, rot, sms, smem)
                .ok_or_else(|| anyhow::anyhow!("no launch shape fits"))?;
            let scale = 1.0 / (192f32).sqrt();
            // Call `i` of launch `c` runs on layer `i`'s cache (of `copies`); `parts`: the attention launch alone.
            let call_with = |i: usize, c: AttentionConfig, parts: bool| {
                let cache = &caches[i % copies];
                if parts {
                    mla_attention_parts(&client, &q_dev, cache, slots, &rows, &meta, &out, heads, r, rot, scale, c)
                        .map(|_| ())
                } else {
                    mla_attention(&client, &q_dev, cache, slots, &rows, &meta, &out, heads, r, rot, scale, c)
                }
            };
            let call = |i: usize| call_with(i, cfg, false);
            let mut times = Vec::new();
            for rep in 0..10 {
                sync(&client)?;
                let t = Instant::now();
                for i in 0..10 {
                    call(i).map_err(anyhow::Error::msg)?;
                }
                sync(&client)?;
                if rep > 0 {
                    times.push(t.elapsed().as_secs_f64() / 10.0);
                }
            }
            times.sort_by(f64::total_cmp);
            let secs = times[times.len() / 2];
            // The GPU's own time: 10 calls behind a copy; where the host's enqueue of 10 long calls outlasts the
            // copy (it blocks once the launch queue is full), 2 calls; where even those do, the wall-clock time
            // (the kernels then outlast the host by far).
            let mut launch_err = None;
            let mut gpu_time = |n: usize| {
                behind.time_us(&client, 2, n, |i| {
                    if let Err(e) = call(i) {
                        launch_err.get_or_insert(e);
                    }
                })
            };
            // Which timing stands in the GPU column: behind the copy (10 or 2 calls), or the wall clock.
            let (gpu_us, gpu_timing) = match gpu_time(10) {
                Ok(us) => (us, "behind a copy, 10 calls"),
                Err(_) => match gpu_time(2) {
                    Ok(us) => (us, "behind a copy, 2 calls"),
                    Err(_) => (secs * 1e6, "wall clock"),
                },
            };
            let mark = if gpu_timing == "wall clock" { " (wall)" } else { "" };
            if let Some(e) = launch_err {
                bail!(e);
            }
            // The attention launch alone (its slices left unmerged): what the combine launch adds, by difference.
            let parts_us = if cfg.splits > 1 {
                time_behind(&behind, &client, 10, |i| call_with(i, cfg, true))?
            } else {
                Some(gpu_us)
            };
            let parts_txt = parts_us.map_or("-".to_string(), |u| format!("{u:.1}"));
            let gpu_secs = gpu_us * 1e-6;
            let cache_bytes = (batch * ctx * d * 4) as f64;
            let moved = cache_bytes + (batch * heads * (d + r) * 4) as f64;
            let flops = 2.0 * (batch * ctx * heads * (d + r)) as f64;
            let gbs = moved / gpu_secs / 1e9;
            let pct = 100.0 * moved / gpu_secs / copy_bw;
            println!(
                "| {batch} | {ctx} | {:.1} | {} | {:.1} | {gpu_us:.1}{mark} | {parts_txt} | {gbs:.0} | {pct:.1} | {:.1} |",
                cache_bytes / 1e6,
                shape_label(&cfg),
                secs * 1e6,
                flops / gpu_secs / 1e12
            );
            bench_json.push(
                serde_json::json!({"batch": batch, "context": ctx, "heads": heads, "cache_bytes": cache_bytes,
                "bytes_moved": moved, "us": secs * 1e6, "gpu_us": gpu_us, "gpu_us_attention_alone": parts_us, "gpu_timing": gpu_timing, "gb_s_gpu": gbs, "pct_copy_bw_gpu": pct,
                "pct_copy_bw_wall": 100.0 * moved / secs / copy_bw, "tflops_gpu": flops / gpu_secs / 1e12,
                "warps": cfg.warps, "heads_per_warp": cfg.hpw, "lanes": format!("{:?}", cfg.lanes), "splits": cfg.splits, "chunk": cfg.chunk}),
            );
            // The TF32 kernel's other ring (2 or 3 stages) at the same slices, in the same process, for comparison.
            if let Lanes::Tf32 { positions, stages } = cfg.lanes {
                let other = Tf32Shape { warps: cfg.warps, pt: positions, stages: 5 - stages };
                if tf32_refusal(r, rot, other, smem).is_none() {
                    let alt = other.config(cfg.splits, cfg.chunk);
                    let alt_us = time_behind(&behind, &client, 10, |i| call_with(i, alt, false))?
                        .context("the other ring: the host's enqueue outlasted the copy")?;
                    println!(
                        "| {batch} | {ctx} | {:.1} | {} (the other ring) | - | {alt_us:.1} | - | {:.0} | {:.1} | - |",
                        cache_bytes / 1e6,
                        shape_label(&alt),
                        moved / (alt_us * 1e-6) / 1e9,
                        100.0 * moved / (alt_us * 1e-6) / copy_bw
                    );
                    bench_json.push(serde_json::json!({"batch": batch, "context": ctx, "heads": heads,
                        "gpu_us": alt_us, "other_ring": true, "lanes": format!("{:?}", alt.lanes),
                        "pct_copy_bw_gpu": 100.0 * moved / (alt_us * 1e-6) / copy_bw, "splits": alt.splits, "chunk": alt.chunk}));
                }
            }
        }
    }
    // Launch shapes at decode batches (`--sweep`): every heads a warp x warps x slice length that fits, to tune
    // `AttentionConfig::new` (the auto choice is marked).
    let mut sweep_json = Vec::new();
    if sweep {
        println!("\nlaunch-shape sweep: us per layer (auto choice marked *)");
        println!(
            "| batch | context | heads a warp | warps | positions a slice | slices | blocks | us/layer |\n|---|---|---|---|---|---|---|---|"
        );
        for (ctx, batch) in [(1024usize, 1usize), (1024, 2), (1024, 4), (1024, 8), (8192, 1), (8192, 8), (1024, 32)] {
            let lens = vec![ctx; batch];
            let slots = batch * ctx.div_ceil(bs) * bs;
            let case = Case { name: "sweep", heads, r, rot, block_size: bs, lens: lens.clone(), new: vec![1; batch] };
            let (t, max_blocks) = tables(&mut rng, &lens, bs, slots);
            let rows = rows_of(&case, t, max_blocks);
            let q_dev = client.create_from_slice(f32::as_bytes(&values(&mut rng, batch * heads * d, 1.0)));
            let cache = client.create_from_slice(f32::as_bytes(&values(&mut rng, slots * d, 1.0)));
            let meta = client.create_from_slice(u32::as_bytes(&rows.packed()));
            let out = client.empty(batch * heads * r * 4);
            let auto = AttentionConfig::new(batch, heads, ctx, d, sms, smem);
            // One head a warp too where the heads are few (a tensor-parallel rank's: a block of 8 warps then holds
            // all 8 heads of a rank under `--tp-size 8`).
            let hpws = HEADS_PER_WARP.iter().filter(|&&h| h > 1 || heads <= FEW_HEADS);
            for (hpw, warps) in hpws.flat_map(|&h| [1usize, 2, 4, 8].map(|w| (h, w))) {
                if attention_shared_bytes(d, warps, hpw) > smem || hpw * warps > heads.next_multiple_of(hpw) {
                    continue;
                }
                for chunk in [32usize, 64, 128, 256, 512, 1024, 2048] {
                    if chunk > ctx.next_multiple_of(32) {
                        continue;
                    }
                    let cfg = AttentionConfig { lanes: Lanes::Keys, warps, hpw, splits: ctx.div_ceil(chunk), chunk };
                    let run = || {
                        mla_attention(&client, &q_dev, &cache, slots, &rows, &meta, &out, heads, r, rot, 0.07, cfg)
                            .map_err(anyhow::Error::msg)
                    };
                    run()?;
                    let mut times = Vec::new();
                    for _ in 0..7 {
                        sync(&client)?;
                        let t = Instant::now();
                        for _ in 0..10 {
                            run()?;
                        }
                        sync(&client)?;
                        times.push(t.elapsed().as_secs_f64() / 10.0);
                    }
                    times.sort_by(f64::total_cmp);
                    let us = times[3] * 1e6;
                    let blocks = cfg.blocks(batch, heads);
                    let mark = if auto == Some(cfg) { "*" } else { "" };
                    println!(
                        "| {batch} | {ctx} | {hpw} | {warps} | {chunk} | {} | {blocks} | {us:.1}{mark} |",
                        cfg.splits
                    );
                    sweep_json.push(serde_json::json!({"batch": batch, "context": ctx, "heads_per_warp": hpw,
                        "warps": warps, "chunk": chunk,
                        "splits": cfg.splits, "blocks": blocks, "us": us, "auto": auto == Some(cfg)}));
                }
            }
        }
    }
    // Small batches (`--small`): GPU time of every heads a warp x 4 or 8 warps x slice length at 1 and 2 rows,
    // measured behind a 2 GiB copy so the host's enqueue (longer than the kernels there) is hidden: (copy + 10
    // calls) - copy, medians of 7.
    if small {
        println!("\nsmall batches, GPU time behind a copy: us per layer (auto choice marked *)");
        println!(
            "| batch | context | heads a warp | warps | positions a slice | slices | blocks | GPU us/layer |\n|---|---|---|---|---|---|---|---|"
        );
        for (ctx, batch) in [(1024usize, 1usize), (1040, 1), (1024, 2), (4096, 1)] {
            let lens = vec![ctx; batch];
            let slots = batch * ctx.div_ceil(bs) * bs;
            let case = Case { name: "small", heads, r, rot, block_size: bs, lens: lens.clone(), new: vec![1; batch] };
            let (t, max_blocks) = tables(&mut rng, &lens, bs, slots);
            let rows = rows_of(&case, t, max_blocks);
            let q_dev = client.create_from_slice(f32::as_bytes(&values(&mut rng, batch * heads * d, 1.0)));
            let cache = client.create_from_slice(f32::as_bytes(&values(&mut rng, slots * d, 1.0)));
            let meta = client.create_from_slice(u32::as_bytes(&rows.packed()));
            let out = client.empty(batch * heads * r * 4);
            let auto = AttentionConfig::new(batch, heads, ctx, d, sms, smem);
            for (hpw, warps) in HEADS_PER_WARP.iter().flat_map(|&h| [4usize, 8].map(|w| (h, w))) {
                if attention_shared_bytes(d, warps, hpw) > smem || hpw * warps > heads {
                    continue;
                }
                for chunk in [32usize, 64, 128] {
                    let cfg = AttentionConfig { lanes: Lanes::Keys, warps, hpw, splits: ctx.div_ceil(chunk), chunk };
                    let run = || {
                        mla_attention(&client, &q_dev, &cache, slots, &rows, &meta, &out, heads, r, rot, 0.07, cfg)
                            .map_err(anyhow::Error::msg)
                    };
                    run()?;
                    let mut launch_err = None;
                    let us = behind
                        .time_us(&client, 0, 10, |_| {
                            if let Err(e) = run() {
                                launch_err.get_or_insert(e);
                            }
                        })
                        .map_err(anyhow::Error::msg)?;
                    if let Some(e) = launch_err {
                        return Err(e);
                    }
                    let blocks = cfg.blocks(batch, heads);
                    let mark = if auto == Some(cfg) { "*" } else { "" };
                    println!(
                        "| {batch} | {ctx} | {hpw} | {warps} | {chunk} | {} | {blocks} | {us:.1}{mark} |",
                        cfg.splits
                    );
                    sweep_json.push(serde_json::json!({"small": true, "batch": batch, "context": ctx,
                        "heads_per_warp": hpw, "warps": warps, "chunk": chunk, "splits": cfg.splits,
                        "blocks": blocks, "gpu_us": us, "auto": auto == Some(cfg)}));
                }
            }
        }
    }
    // The dim-lane kernel (`--dims`): GPU time behind a copy of every shape in `DIM_SHAPES` x slice length, beside
    // the automatic key-lane launch on the same inputs.
    if dims {
        println!("\ndim lanes, GPU time behind a copy: us per layer ({heads} heads; auto = the key-lane launch)");
        println!(
            "| batch | context | kernel | head warps x key warps | heads a warp | groups | positions a slice | blocks | GPU us/layer | % of copy BW |\n|---|---|---|---|---|---|---|---|---|---|"
        );
        for (ctx, batch) in [(1024usize, 1usize), (8192, 1), (1024, 8), (8192, 8), (1024, 32), (8192, 32)] {
            let lens = vec![ctx; batch];
            let slots = batch * ctx.div_ceil(bs) * bs;
            let case = Case { name: "dims", heads, r, rot, block_size: bs, lens: lens.clone(), new: vec![1; batch] };
            let (t, max_blocks) = tables(&mut rng, &lens, bs, slots);
            let rows = rows_of(&case, t, max_blocks);
            let q_dev = client.create_from_slice(f32::as_bytes(&values(&mut rng, batch * heads * d, 1.0)));
            let cache = client.create_from_slice(f32::as_bytes(&values(&mut rng, slots * d, 1.0)));
            let meta = client.create_from_slice(u32::as_bytes(&rows.packed()));
            let out = client.empty(batch * heads * r * 4);
            let moved = (batch * ctx * d * 4 + batch * heads * (d + r) * 4) as f64;
            let auto = AttentionConfig::new(batch, heads, ctx, d, sms, smem)
                .ok_or_else(|| anyhow::anyhow!("no launch shape fits"))?;
            let picked = AttentionConfig::pick(batch, heads, ctx, r, rot, sms, smem);
            let mut candidates = vec![auto];
            for shape in MMA_SHAPES {
                if !mma || mma_refusal(r, rot, shape, smem).is_some() || 16 * shape.tiles > heads.next_multiple_of(16) {
                    continue;
                }
                for chunk in [32usize, 64, 128, 256, 512, 1024, 2048, 4096] {
                    if chunk <= ctx {
                        candidates.push(shape.config(ctx.div_ceil(chunk), chunk));
                    }
                }
            }
            for shape in TF32_SHAPES {
                if !tf32 || tf32_refusal(r, rot, shape, smem).is_some() {
                    continue;
                }
                for chunk in [32usize, 64, 96, 128, 192, 256, 384, 512, 1024] {
                    if chunk <= ctx && chunk.is_multiple_of(shape.pt) {
                        candidates.push(shape.config(ctx.div_ceil(chunk), chunk));
                    }
                }
            }
            for (wh, wk, hpw, sg) in DIM_SHAPES {
                if mma || dims_refusal(r, rot, wh, wk, hpw, sg, smem).is_some() || wh * hpw > heads.next_multiple_of(8)
                {
                    continue;
                }
                for chunk in [64usize, 128, 256, 512, 1024, 2048, 4096] {
                    if chunk <= ctx {
                        let lanes = Lanes::Dims { key_warps: wk, groups: sg };
                        candidates.push(AttentionConfig { lanes, warps: wh, hpw, splits: ctx.div_ceil(chunk), chunk });
                    }
                }
            }
            if let Some(p) = picked.filter(|p| !candidates.contains(p)) {
                candidates.push(p);
            }
            let mut best: Option<(f64, AttentionConfig)> = None;
            let mut auto_us = 0.0;
            for cfg in candidates {
                let run = || {
                    mla_attention(&client, &q_dev, &cache, slots, &rows, &meta, &out, heads, r, rot, 0.07, cfg)
                        .map_err(anyhow::Error::msg)
                };
                run()?;
                let mut launch_err = None;
                let mut gpu_time = |calls: usize| {
                    behind.time_us(&client, 0, calls, |_| {
                        if let Err(e) = run() {
                            launch_err.get_or_insert(e);
                        }
                    })
                };
                // Long launches: where the host's enqueue of 10 outlasts the copy, 2 calls.
                let us = match gpu_time(10) {
                    Ok(us) => us,
                    Err(_) => gpu_time(2).map_err(anyhow::Error::msg)?,
                };
                if let Some(e) = launch_err {
                    return Err(e);
                }
                let picked_mark = if picked == Some(cfg) { " (picked)" } else { "" };
                let (kernel, shape, groups) = match cfg.lanes {
                    Lanes::Keys => ("keys (auto)", format!("{}", cfg.warps), "-".to_string()),
                    Lanes::Dims { key_warps, groups } => {
                        ("dims", format!("{} x {key_warps}", cfg.warps), groups.to_string())
                    }
                    Lanes::Mma { tiles, positions } => {
                        ("tensor cores", format!("{tiles} tiles x {}", cfg.warps / tiles), positions.to_string())
                    }
                    Lanes::Tf32 { positions, stages } => {
                        ("TF32", format!("{}", cfg.warps), format!("{positions} x {stages} stages"))
                    }
                };
                if cfg == auto {
                    auto_us = us;
                } else if best.is_none_or(|(b, _)| us < b) {
                    best = Some((us, cfg));
                }
                println!(
                    "| {batch} | {ctx} | {kernel}{picked_mark} | {shape} | {} | {groups} | {} | {} | {us:.1} | {:.1} |",
                    cfg.hpw,
                    cfg.chunk,
                    cfg.blocks(batch, heads),
                    100.0 * moved / (us * 1e-6) / copy_bw
                );
                sweep_json.push(serde_json::json!({"dims": true, "batch": batch, "context": ctx, "heads": heads,
                    "kernel": kernel, "warps": cfg.warps, "heads_per_warp": cfg.hpw, "lanes": format!("{:?}", cfg.lanes),
                    "chunk": cfg.chunk, "splits": cfg.splits, "gpu_us": us,
                    "pct_copy_bw": 100.0 * moved / (us * 1e-6) / copy_bw}));
            }
            if let Some((us, cfg)) = best {
                println!(
                    "best dims at {batch} x {ctx}: {us:.1} us ({cfg:?}) against the key lanes' {auto_us:.1} us: {:.2}x",
                    auto_us / us
                );
            }
        }
    }
    if let Some(path) = json {
        let doc = serde_json::json!({"kernel": "eyrie_quant::cuda::attention::mla_attention", "tolerance": TOL,
            "copy_bandwidth_gb_s": copy_bw / 1e9, "check": check_json, "bench": bench_json, "sweep": sweep_json});
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    if failed {
        bail!("attention results differ from the CPU reference beyond tolerance");
    }
    Ok(())
}
