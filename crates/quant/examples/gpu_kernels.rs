//! GPU check and benchmark of the fused INT4 MoE kernel (issue 4); runs on a CUDA machine, built with
//! `--features cuda` (`cargo xtask gpu-test` builds it into `.device-kern/`).
//!
//! ```text
//! gpu_kernels check                 # kernel vs CPU reference on random inputs; exit 1 on a mismatch
//! gpu_kernels bench --json FILE     # Kimi-K2 shapes, batch 1/8/32/128, vs the copy bandwidth of the same run
//!                   [--pool N]       # each routing's experts drawn from the layer's first N (default all 384)
//!                   [--no-sweep]     # the tuned launch shape (`MoeConfig::for_tokens`) only, no sweep
//! gpu_kernels prefill [--m 512,2048,8192] [--json FILE]  # prefill widths on tensor cores: tokens a pass of 3+-token experts
//! gpu_kernels stages [--m 1,8] [--full] [--stage gate_up|down] [--loads] [--json FILE]  # tensor-core launch shapes
//!                                                   # of gate/up and of down, each alone (`--loads`: and their loads alone)
//! gpu_kernels profile [--m 1] [--calls 20]  # the tuned layer `calls` times, untimed: for Nsight Compute's `-k`
//! ```
//!
//! Tolerance of `check`, norm-wise (`max |gpu - ref| / max |ref|`):
//! - against the bit-exact compressed-tensors dequantization (`Dequant::CompressedTensors`, `bf16(q * scale)`:
//!   the checkpoint's weights, which the kernel computes with; f64 accumulation): <= 1e-4. The kernel accumulates
//!   in f32 over 7168 + 2048 terms in another order and uses the device `exp`: errors of a few 1e-7 relative are
//!   expected; 1e-4 leaves a margin of 100 while any wrong nibble, scale, rounding, row or token shows as O(1e-3)
//!   or more;
//! - against the unrounded products (`Dequant::Exact`): <= 1e-2, since those differ from the checkpoint's BF16
//!   weights by up to 2^-9 relative each (~2e-3 of the output scale over a dot product). A kernel that stopped
//!   rounding would pass this one and fail the first.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::cubecl::cuda::{CudaDevice, CudaRuntime};
use burn::cubecl::prelude::*;
use burn::cubecl::server::Handle;
use eyrie_quant::cuda::{
    BehindCopy, Dequant, GpuExperts, GpuRouting, Mismatch, MmaShape, MoeConfig, MoeExperts, MoeShape, Routing,
    SplitMix64, Stages, copy_f32, moe_forward_with, moe_reference, set_fused_split,
};
use half::bf16;

type R = CudaRuntime;

const KIMI: MoeShape = MoeShape { hidden: 7168, inter: 2048, experts: 384, group: 32 };
const TOPK: usize = 8;
const TOL_CT: f32 = 1e-4;
const TOL_EXACT: f32 = 1e-2;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let json = args.iter().position(|a| a == "--json").and_then(|i| args.get(i + 1)).cloned();
    let check = args.iter().any(|a| a == "check");
    let bench = args.iter().any(|a| a == "bench");
    let prefill = args.iter().any(|a| a == "prefill");
    let stages = args.iter().any(|a| a == "stages");
    let profile = args.iter().any(|a| a == "profile");
    // `check --quick`: the cases without the 384-expert Kimi-K2 layer (whose generation and f64 references take
    // minutes): Kimi-K2's expert shape over 16 experts (groups 64, 128), the small shapes, the prefill passes.
    let quick = args.iter().any(|a| a == "--quick");
    if !check && !bench && !prefill && !stages && !profile {
        bail!(
            "usage: gpu_kernels [check [--quick]] [bench [--json FILE] [--m 1,8,32,128] [--pool N] [--routings N] [--calls 16[,32]] [--call-trace] [--subtract-copy] [--driver-copy] [--flush-after-copy] [--no-sweep]] [prefill [--m 512,2048,8192]] \
             [stages [--m 1,8] [--full] [--stage gate_up|down] [--loads]] [profile [--m 1] [--calls 20]]"
        );
    }
    let ms = usize_list(&args, "--m", "1,8", "a token count")?.unwrap_or_else(|| vec![1, 8, 32, 128]);
    if ms.contains(&0) {
        bail!("--m: token counts must be at least 1");
    }
    let pool: usize = match args.iter().position(|a| a == "--pool") {
        Some(i) => {
            let v = args.get(i + 1).context("--pool needs an expert count such as 64")?;
            v.parse().with_context(|| format!("--pool: {v:?} is not an expert count"))?
        }
        None => KIMI.experts,
    };
    if !(TOPK..=KIMI.experts).contains(&pool) {
        bail!("--pool: {pool} experts; it must be {TOPK} to {}", KIMI.experts);
    }
    // `bench`: the calls cycle over this many of the 16 routings (1: every call reads the same routing buffers, which
    // then stay in L2 as a routing the device router has just written does).
    let cycle: usize = match args.iter().position(|a| a == "--routings") {
        Some(i) => {
            let v = args.get(i + 1).context("--routings needs a count such as 1")?;
            v.parse().with_context(|| format!("--routings: {v:?} is not a count"))?
        }
        None => 16,
    };
    if !(1..=16).contains(&cycle) {
        bail!("--routings: {cycle}; it must be 1 to 16");
    }
    // `bench`: calls queued behind the copy a GPU-time sample (default 16). With two or more counts each stage is
    // timed at each, and the per-call slope between the first and the last is printed too: a cost paid once a sample
    // (the copy's hand-over to the first call, say) adds F / calls to the plain figure but nothing to the slope.
    // (`profile --calls N` is profile's own count.)
    let calls = if bench { usize_list(&args, "--calls", "8,32", "a call count")? } else { None };
    let calls = calls.unwrap_or_else(|| vec![16]);
    if calls.iter().any(|&c| !(1..=64).contains(&c)) || calls.windows(2).any(|w| w[0] >= w[1]) {
        bail!("--calls: {calls:?}; counts of 1 to 64, increasing");
    }
    let client = R::client(&CudaDevice::default());
    if check && quick && !bench && !prefill {
        if run_checks(&client, None)? {
            bail!("GPU results differ from the CPU reference beyond tolerance");
        }
        return Ok(());
    }
    let t0 = Instant::now();
    let kimi = MoeExperts::random(KIMI, 42)?;
    let gpu_kimi = GpuExperts::upload(&client, &kimi.kernel_layout());
    sync(&client)?;
    eprintln!("Kimi-K2 experts generated and uploaded in {:.1} s", t0.elapsed().as_secs_f64());
    let mut failed = false;
    if check {
        failed = run_checks(&client, Some((&kimi, &gpu_kimi)))?;
    }
    if bench {
        let sweep = !args.iter().any(|a| a == "--no-sweep");
        let trace = args.iter().any(|a| a == "--call-trace");
        let mid = !args.iter().any(|a| a == "--subtract-copy");
        let driver_copy = args.iter().any(|a| a == "--driver-copy");
        let flush_after_copy = args.iter().any(|a| a == "--flush-after-copy");
        run_bench(
            &client,
            &kimi,
            &gpu_kimi,
            json.as_deref(),
            &ms,
            &BenchOpts { pool, sweep, cycle, calls, call_trace: trace, mid_event: mid, driver_copy, flush_after_copy },
        )?;
    }
    if stages {
        let ms = if args.iter().any(|a| a == "--m") { ms.clone() } else { vec![1, 8] };
        let full = args.iter().any(|a| a == "--full");
        let only = args.iter().position(|a| a == "--stage").map(|i| args.get(i + 1).cloned().unwrap_or_default());
        if let Some(o) = &only
            && o != "gate_up"
            && o != "down"
        {
            bail!("--stage: {o:?} is neither gate_up nor down");
        }
        let loads = args.iter().any(|a| a == "--loads");
        run_stage_sweep(&client, &kimi, &gpu_kimi, &ms, json.as_deref(), full, only.as_deref(), loads)?;
    }
    if profile {
        let calls = match args.iter().position(|a| a == "--calls") {
            Some(i) => args.get(i + 1).context("--calls needs a count")?.parse().context("--calls: not a count")?,
            None => 20,
        };
        let ms = if args.iter().any(|a| a == "--m") { ms.clone() } else { vec![1] };
        for &m in &ms {
            let BenchInputs { x, out, routings, .. } = bench_inputs(&client, &KIMI, m, 3000, KIMI.experts)?;
            let cfg = MoeConfig::for_tokens(m);
            for j in 0..calls {
                moe_forward_with::<_, bf16>(&client, &gpu_kimi, &x, &routings[j % 16], &out, &cfg, Stages::All);
            }
            sync(&client)?;
            eprintln!("m = {m}: {calls} layers of {cfg:?}");
        }
    }
    if prefill {
        failed |= !check_prefill_tbs(&client)?;
        let ms = if args.iter().any(|a| a == "--m") { ms } else { vec![512, 2048, 8192] };
        run_prefill(&client, &gpu_kimi, &ms, json.as_deref())?;
    }
    if failed {
        bail!("GPU results differ from the CPU reference beyond tolerance");
    }
    Ok(())
}

fn sync(client: &ComputeClient<R>) -> Result<()> {
    burn::cubecl::future::block_on(client.sync()).map_err(|e| anyhow::anyhow!("device sync: {e:?}"))
}

/// What one forward of [`forward`] ran on: the activations as f32, the routing (ids, weights) and the active experts.
type Inputs = (Vec<f32>, Vec<u32>, Vec<f32>, usize);

/// One forward of `m` random tokens (from `seed`, BF16 activations): the layer's output and its inputs.
fn forward(
    client: &ComputeClient<R>,
    ex: &MoeExperts,
    gpu: &GpuExperts<R>,
    m: usize,
    topk: usize,
    seed: u64,
    cfg: &MoeConfig,
) -> Result<(Vec<f32>, Inputs)> {
    forward_as(client, ex, gpu, m, topk, seed, cfg, false)
}

/// [`forward`], with f32 activations when `f32_x` (not BF16 values: all three parts of their split are non-zero).
#[allow(clippy::too_many_arguments)]
fn forward_as(
    client: &ComputeClient<R>,
    ex: &MoeExperts,
    gpu: &GpuExperts<R>,
    m: usize,
    topk: usize,
    seed: u64,
    cfg: &MoeConfig,
    f32_x: bool,
) -> Result<(Vec<f32>, Inputs)> {
    let s = ex.shape();
    let mut rng = SplitMix64::new(seed);
    let (xf, x_dev) = if f32_x {
        let x = rng.signed(m * s.hidden);
        let dev = client.create_from_slice(f32::as_bytes(&x));
        (x, dev)
    } else {
        let x = rng.activations(m * s.hidden);
        (x.iter().map(|v| v.to_f32()).collect(), client.create_from_slice(bf16::as_bytes(&x)))
    };
    let (ids, weights) = rng.routing(m, topk, s.experts);
    let routing = Routing::new(&ids, m, topk, s.experts)?;
    let r_dev = GpuRouting::upload(client, &routing, &weights);
    let out = client.empty(m * s.hidden * 4);
    if f32_x {
        moe_forward_with::<_, f32>(client, gpu, &x_dev, &r_dev, &out, cfg, Stages::All);
    } else {
        moe_forward_with::<_, bf16>(client, gpu, &x_dev, &r_dev, &out, cfg, Stages::All);
    }
    let bytes = client.read_one(out).map_err(|e| anyhow::anyhow!("read: {e:?}"))?;
    Ok((f32::from_bytes(&bytes).to_vec(), (xf, ids, weights, routing.experts.len())))
}

/// A forward of [`forward`] against both references.
fn compare(ex: &MoeExperts, run: (Vec<f32>, Inputs), topk: usize) -> Result<(Mismatch, Mismatch, usize)> {
    let (got, (xf, ids, weights, active)) = run;
    let exact = moe_reference(ex, &xf, &ids, &weights, topk, Dequant::Exact)?;
    let ct = moe_reference(ex, &xf, &ids, &weights, topk, Dequant::CompressedTensors)?;
    Ok((Mismatch::of(&got, &exact), Mismatch::of(&got, &ct), active))
}

/// Every check; `kimi`: the 384-expert Kimi-K2 layer's cases too (`None`: `check --quick`).
fn run_checks(client: &ComputeClient<R>, kimi: Option<(&MoeExperts, &GpuExperts<R>)>) -> Result<bool> {
    println!("fused INT4 MoE, GPU vs CPU reference (norm-wise tolerance: CT {TOL_CT:e}, exact products {TOL_EXACT:e})");
    println!(
        "| shape (hidden x inter, experts, group) | m | topk | active | max abs (CT) | rel (CT) | max rel (CT, |ref| >= 0.1 max) | rel (exact products) | ok |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut failed = false;
    let mut report = |s: MoeShape, m: usize, topk: usize, r: (Mismatch, Mismatch, usize)| {
        let (exact, ct, active) = r;
        let ok = ct.rel_to_max <= TOL_CT && exact.rel_to_max <= TOL_EXACT;
        failed |= !ok;
        println!(
            "| {}x{}, {}, g{} | {m} | {topk} | {active} | {:.3e} | {:.3e} | {:.3e} | {:.3e} | {} |",
            s.hidden,
            s.inter,
            s.experts,
            s.group,
            ct.max_abs,
            ct.rel_to_max,
            ct.max_rel,
            exact.rel_to_max,
            if ok { "ok" } else { "FAIL" }
        );
    };
    for (i, m) in [1usize, 8, 32, 128].into_iter().enumerate() {
        let Some((kimi, gpu_kimi)) = kimi else { break };
        report(
            KIMI,
            m,
            TOPK,
            compare(kimi, forward(client, kimi, gpu_kimi, m, TOPK, 100 + i as u64, &MoeConfig::default())?, TOPK)?,
        );
    }
    // Another launch shape: one unit per warp, two down rows at once, at most two tokens per pass.
    let alt = MoeConfig {
        warps: 4,
        rows_per_warp_13: 1,
        rows_per_warp_2: 1,
        rows_at_once_2: 2,
        max_tb: 2,
        prefetch: false,
        mma: None,
        mma_tb: 2,
        tiled_gemm: false,
    };
    if let Some((kimi, gpu_kimi)) = kimi {
        report(KIMI, 64, TOPK, compare(kimi, forward(client, kimi, gpu_kimi, 64, TOPK, 150, &alt)?, TOPK)?);
    }
    let others = [
        (MoeShape { hidden: 7168, inter: 2048, experts: 16, group: 64 }, 8, TOPK),
        (MoeShape { hidden: 7168, inter: 2048, experts: 16, group: 128 }, 8, TOPK),
        // Rows shorter than a warp's 32 vectors (lane guards), odd token counts, top-2.
        (MoeShape { hidden: 256, inter: 128, experts: 8, group: 32 }, 3, 2),
        (MoeShape { hidden: 1024, inter: 512, experts: 4, group: 128 }, 37, 3),
    ];
    for (i, (shape, m, topk)) in others.into_iter().enumerate() {
        let ex = MoeExperts::random(shape, 7 + i as u64)?;
        let gpu = GpuExperts::upload(client, &ex.kernel_layout());
        report(
            shape,
            m,
            topk,
            compare(&ex, forward(client, &ex, &gpu, m, topk, 200 + i as u64, &MoeConfig::default())?, topk)?,
        );
    }
    // Prefill widths (eyrie-model sends up to 65536 pairs through the kernel): 512 tokens of top-8 over 16 experts,
    // ~256 tokens an expert, with the launch shape the model picks for 512 tokens (a smaller shape keeps the f64
    // reference quick).
    let wide = MoeShape { hidden: 1024, inter: 512, experts: 16, group: 32 };
    let ex = MoeExperts::random(wide, 31)?;
    let gpu = GpuExperts::upload(client, &ex.kernel_layout());
    report(
        wide,
        512,
        TOPK,
        compare(&ex, forward(client, &ex, &gpu, 512, TOPK, 300, &MoeConfig::for_tokens(512).cuda_cores())?, TOPK)?,
    );

    // The tensor-core path (`moe_mma`): every candidate launch shape at least once (6 candidates: indices 0..4 for
    // Kimi's widths, 5, 0, 1, 2 for the other shapes, 5 for the wide one), the same shapes and widths.
    println!("tensor-core expert kernels (moe_mma):");
    let cands = MmaShape::candidates();
    for (i, m) in [1usize, 8, 32, 128, 64].into_iter().enumerate() {
        let Some((kimi, gpu_kimi)) = kimi else { break };
        let cfg = MoeConfig { mma: Some(cands[i % cands.len()]), ..MoeConfig::for_tokens(m) };
        report(KIMI, m, TOPK, compare(kimi, forward(client, kimi, gpu_kimi, m, TOPK, 400 + i as u64, &cfg)?, TOPK)?);
    }
    for (i, (shape, m, topk)) in others.into_iter().enumerate() {
        let ex = MoeExperts::random(shape, 7 + i as u64)?;
        let gpu = GpuExperts::upload(client, &ex.kernel_layout());
        let cfg = MoeConfig { mma: Some(cands[(i + 5) % cands.len()]), ..MoeConfig::default() };
        report(shape, m, topk, compare(&ex, forward(client, &ex, &gpu, m, topk, 500 + i as u64, &cfg)?, topk)?);
    }
    if kimi.is_none() {
        // Without the Kimi-K2 cases above, every candidate launch shape on Kimi-K2's expert shape.
        let (shape, m, topk) = others[0];
        let ex = MoeExperts::random(shape, 7)?;
        let gpu = GpuExperts::upload(client, &ex.kernel_layout());
        for (i, mm) in cands.iter().enumerate() {
            let cfg = MoeConfig { mma: Some(*mm), ..MoeConfig::for_tokens(m) };
            report(shape, m, topk, compare(&ex, forward(client, &ex, &gpu, m, topk, 700 + i as u64, &cfg)?, topk)?);
        }
    }
    // The gate/up launch writing the down launch's split input (`fused_split`, the default) against the separate
    // split launch: the same bits, at one token (its tuned shape) and with every candidate shape at 8 tokens.
    let mut split_differs = false;
    {
        let (shape, _, topk) = others[0];
        let ex = MoeExperts::random(shape, 7)?;
        let gpu = GpuExperts::upload(client, &ex.kernel_layout());
        let mut cases = vec![(1usize, MoeConfig::for_tokens(1))];
        cases.extend(cands.iter().map(|mm| (8usize, MoeConfig { mma: Some(*mm), ..MoeConfig::for_tokens(8) })));
        for (i, (m, cfg)) in cases.into_iter().enumerate() {
            let mut outs = Vec::new();
            for fused in [true, false] {
                set_fused_split(fused);
                outs.push(forward(client, &ex, &gpu, m, topk, 800 + i as u64, &cfg)?.0);
            }
            set_fused_split(true);
            let same = outs[0].iter().zip(&outs[1]).all(|(a, b)| a.to_bits() == b.to_bits());
            split_differs |= !same;
            println!(
                "| fused intermediate split == separate split launch, {:?} | {m} | {topk} | - | - | - | - | - | {} |",
                cfg.mma,
                if same { "ok (bit-identical)" } else { "FAIL (bits differ)" }
            );
        }
    }
    let cfg = MoeConfig { mma: Some(cands[cands.len() - 1]), ..MoeConfig::for_tokens(512) };
    let ex = MoeExperts::random(wide, 31)?;
    let gpu = GpuExperts::upload(client, &ex.kernel_layout());
    report(wide, 512, TOPK, compare(&ex, forward(client, &ex, &gpu, 512, TOPK, 600, &cfg)?, TOPK)?);
    failed |= !check_prefill_tbs(client)?;
    Ok(failed || split_differs)
}

/// The tensor-core path at a prefill width (512 tokens of top-8 over 16 experts of 1024 x 512: ~256 tokens an
/// expert) with every tokens-a-pass of the 3+-token experts ([`MoeConfig::mma_tb`]); true when all are within
/// tolerance.
fn check_prefill_tbs(client: &ComputeClient<R>) -> Result<bool> {
    let wide = MoeShape { hidden: 1024, inter: 512, experts: 16, group: 32 };
    let ex = MoeExperts::random(wide, 31)?;
    let gpu = GpuExperts::upload(client, &ex.kernel_layout());
    let mut ok = true;
    for tb in eyrie_quant::cuda::specs::MMA_TBS {
        let cfg = MoeConfig { mma_tb: tb, tiled_gemm: false, ..MoeConfig::for_tokens(512) };
        let (exact, ct, active) = compare(&ex, forward(client, &ex, &gpu, 512, TOPK, 700 + tb as u64, &cfg)?, TOPK)?;
        let pass = ct.rel_to_max <= TOL_CT && exact.rel_to_max <= TOL_EXACT;
        ok &= pass;
        println!(
            "| prefill check, {tb} tokens a pass | 512 | {active} experts | rel (CT) {:.3e} | rel (exact) {:.3e} | {} |",
            ct.rel_to_max,
            exact.rel_to_max,
            if pass { "ok" } else { "FAIL" }
        );
    }
    // The tiled grouped GEMM (`moe_tiled`): 64-pair tiles, so ~256 pairs an expert fill four and the last tiles of
    // uneven experts are partial; both weight layouts (this shape is tiled; 1152 x 320 is row-major, groups of 32
    // and 64).
    let cases = [
        (wide, 512usize),
        (MoeShape { hidden: 1024, inter: 512, experts: 16, group: 64 }, 300),
        (MoeShape { hidden: 1152, inter: 320, experts: 12, group: 32 }, 200),
    ];
    for (i, (shape, m)) in cases.into_iter().enumerate() {
        let ex = MoeExperts::random(shape, 41 + i as u64)?;
        let gpu = GpuExperts::upload(client, &ex.kernel_layout());
        let cfg = MoeConfig { tiled_gemm: true, ..MoeConfig::for_tokens(m) };
        for f32_x in [false, true] {
            let seed = 800 + i as u64;
            let run = forward_as(client, &ex, &gpu, m, TOPK, seed, &cfg, f32_x)?;
            let (exact, ct, active) = compare(&ex, run, TOPK)?;
            let pass = ct.rel_to_max <= TOL_CT && exact.rel_to_max <= TOL_EXACT;
            ok &= pass;
            println!(
                "| prefill check, tiled GEMM {}x{} group {} (tiled layout {}), {} input | {m} | {active} experts | rel (CT) {:.3e} | rel (exact) {:.3e} | {} |",
                shape.hidden,
                shape.inter,
                shape.group,
                shape.tiled(),
                if f32_x { "f32" } else { "bf16" },
                ct.rel_to_max,
                exact.rel_to_max,
                if pass { "ok" } else { "FAIL" }
            );
        }
    }
    Ok(ok)
}

/// Prefill widths on the tensor-core path: the tuned shape for `m` tokens with each tokens-per-pass of the experts
/// that have 3 or more tokens (`MoeConfig::mma_tb`), Kimi-K2's shape, uniform random routing (~`8 m / 384` tokens
/// an expert). Prints ms per layer and TFLOP/s of useful work (`2 m topk 3 hidden inter`).
fn run_prefill(client: &ComputeClient<R>, gpu: &GpuExperts<R>, ms: &[usize], json: Option<&str>) -> Result<()> {
    let s = KIMI;
    let mut rows = Vec::new();
    println!("| m | tokens a pass (3+ tokens) | ms per layer | TFLOP/s (useful) | config |");
    println!("|---|---|---|---|---|");
    for (i, &m) in ms.iter().enumerate() {
        let mut rng = SplitMix64::new(2000 + i as u64);
        let x = client.create_from_slice(bf16::as_bytes(&rng.activations(m * s.hidden)));
        let out = client.empty(m * s.hidden * 4);
        let routings: Vec<_> = (0..2)
            .map(|_| {
                let (ids, weights) = rng.routing(m, TOPK, s.experts);
                Routing::new(&ids, m, TOPK, s.experts).map(|r| GpuRouting::upload(client, &r, &weights))
            })
            .collect::<Result<_, _>>()?;
        for tb in [2usize, 4, 8, 16, 0] {
            // 0: the tiled grouped GEMM (`moe_tiled`).
            let cfg = MoeConfig { mma_tb: tb.max(2), tiled_gemm: tb == 0, ..MoeConfig::for_tokens(m) };
            let us = time_us(client, 2, 3, 2, |j| {
                moe_forward_with::<_, bf16>(client, gpu, &x, &routings[j % 2], &out, &cfg, Stages::All)
            })?;
            let flops = 2.0 * (m * TOPK * 3 * s.hidden * s.inter) as f64;
            println!("| {m} | {tb} | {:.2} | {:.1} | {cfg:?} |", us / 1e3, flops / us / 1e6);
            rows.push(serde_json::json!({"m": m, "mma_tb": tb, "ms": us / 1e3, "useful_tflops": flops / us / 1e6,
                "config": format!("{cfg:?}")}));
        }
        drop::<(Handle, Handle)>((x, out));
    }
    if let Some(path) = json {
        let doc = serde_json::json!({
            "what": "fused INT4 MoE layer at prefill widths on tensor cores, by tokens a pass of the 3+-token experts",
            "shape": {"hidden": s.hidden, "inter": s.inter, "experts": s.experts, "group": s.group, "topk": TOPK},
            "timing": "wall clock over 2 calls between device syncs, median of 3, 2 uniform random routings cycled",
            "rows": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?).with_context(|| format!("writing {path}"))?;
    }
    Ok(())
}

/// Launch shapes tried per batch size; the fastest is reported (all compute the same result): the CUDA-core
/// shapes, then the tuned shape with each tensor-core launch shape.
fn sweep(m: usize) -> Vec<MoeConfig> {
    let mut v = cuda_core_sweep(m);
    for mm in MmaShape::candidates() {
        v.push(MoeConfig { mma: Some(mm), ..MoeConfig::for_tokens(m) });
    }
    v
}

/// The CUDA-core kernels' launch shapes tried per batch size.
fn cuda_core_sweep(m: usize) -> Vec<MoeConfig> {
    let c = |warps, rows_per_warp_13, rows_per_warp_2, rows_at_once_2, max_tb, prefetch| MoeConfig {
        warps,
        rows_per_warp_13,
        rows_per_warp_2,
        rows_at_once_2,
        max_tb,
        prefetch,
        mma: None,
        mma_tb: 4,
        tiled_gemm: false,
    };
    match m {
        0 | 1 => vec![
            c(16, 1, 1, 4, 4, true),
            c(16, 1, 1, 4, 4, false),
            c(8, 2, 2, 4, 4, true),
            c(8, 1, 1, 4, 4, true),
            c(8, 2, 4, 2, 4, true),
            c(16, 2, 2, 4, 4, true),
            c(8, 4, 4, 4, 4, true),
            c(4, 2, 2, 4, 4, true),
        ],
        2..=16 => vec![
            c(8, 2, 2, 4, 4, true),
            c(8, 2, 2, 4, 4, false),
            c(8, 2, 4, 2, 4, true),
            c(16, 1, 1, 4, 4, true),
            c(8, 4, 4, 4, 4, true),
            c(8, 2, 2, 4, 2, true),
        ],
        17..=64 => vec![
            c(8, 2, 4, 2, 4, true),
            c(8, 2, 4, 2, 4, false),
            c(8, 2, 2, 4, 2, true),
            c(8, 2, 2, 4, 4, true),
            c(16, 1, 1, 4, 2, true),
        ],
        _ => vec![
            c(8, 2, 2, 4, 2, true),
            c(8, 2, 2, 4, 2, false),
            c(8, 2, 4, 2, 2, true),
            c(16, 1, 1, 4, 2, true),
            c(8, 2, 2, 4, 4, true),
        ],
    }
}

/// A benchmark's device inputs for `m` tokens: activations, an output buffer and 16 random routings, cycled so
/// that consecutive calls touch different experts and the 60 MB L2 cannot help; with each routing's active experts
/// and the most tokens an expert gets.
struct BenchInputs {
    x: Handle,
    out: Handle,
    routings: Vec<GpuRouting>,
    active: Vec<usize>,
    max_tokens: usize,
}

/// `pool`: the routings' experts are drawn from the first `pool` of the layer's.
fn bench_inputs(client: &ComputeClient<R>, s: &MoeShape, m: usize, seed: u64, pool: usize) -> Result<BenchInputs> {
    let mut rng = SplitMix64::new(seed);
    let x = client.create_from_slice(bf16::as_bytes(&rng.activations(m * s.hidden)));
    let out = client.empty(m * s.hidden * 4);
    let (mut routings, mut active, mut max_tokens) = (Vec::new(), Vec::new(), 0);
    for _ in 0..16 {
        let (ids, weights) = rng.routing(m, TOPK, pool);
        let r = Routing::new(&ids, m, TOPK, s.experts)?;
        active.push(r.experts.len());
        max_tokens = max_tokens.max(r.max_tokens);
        routings.push(GpuRouting::upload(client, &r, &weights));
    }
    Ok(BenchInputs { x, out, routings, active, max_tokens })
}

/// The comma-separated counts after `flag` (`example` shows the form, `what` names one), or `None` without it.
fn usize_list(args: &[String], flag: &str, example: &str, what: &str) -> Result<Option<Vec<usize>>> {
    let Some(i) = args.iter().position(|a| a == flag) else { return Ok(None) };
    let list = args.get(i + 1).with_context(|| format!("{flag} needs a list such as {example}"))?;
    list.split(',')
        .map(|v| v.parse().with_context(|| format!("{flag}: {v:?} is not {what}")))
        .collect::<Result<_>>()
        .map(Some)
}

/// A stage's GPU time behind the copy: us a call at the first count of `--calls` on the events and on the host's
/// clock, us a call at each count timed, and the slope between the first and last of those.
type Behind = (f64, f64, Vec<(usize, f64)>, Option<f64>);

/// Median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Median time per call of `f` in microseconds: `reps` timed batches of `iters` calls after `warm` calls, each
/// batch ended by a device sync.
fn time_us(client: &ComputeClient<R>, warm: usize, reps: usize, iters: usize, mut f: impl FnMut(usize)) -> Result<f64> {
    for i in 0..warm {
        f(i);
    }
    sync(client)?;
    let mut times = Vec::with_capacity(reps);
    for r in 0..reps {
        let t = Instant::now();
        for i in 0..iters {
            f(r * iters + i);
        }
        sync(client)?;
        times.push(t.elapsed().as_secs_f64() * 1e6 / iters as f64);
    }
    Ok(median(&mut times))
}

/// `bench`'s options (see `main`'s usage line).
struct BenchOpts {
    /// The routings' experts come from the layer's first `pool`.
    pool: usize,
    /// Time a sweep of launch shapes and report the fastest (`--no-sweep`: the engine's own, `MoeConfig::for_tokens`).
    sweep: bool,
    /// The calls cycle over this many of the 16 routings.
    cycle: usize,
    /// Calls behind the copy a GPU-time sample; with two or more, the per-call slope too.
    calls: Vec<usize>,
    /// `--call-trace`: an event after every call.
    call_trace: bool,
    /// The GPU time from an event after the copy (`--subtract-copy` turns it off).
    mid_event: bool,
    /// `--driver-copy`: the driver's copy in front.
    driver_copy: bool,
    /// `--flush-after-copy`: CubeCL's queue flushed after the copy's enqueue.
    flush_after_copy: bool,
}

fn run_bench(
    client: &ComputeClient<R>,
    kimi: &MoeExperts,
    gpu: &GpuExperts<R>,
    json: Option<&str>,
    ms: &[usize],
    opts: &BenchOpts,
) -> Result<()> {
    let &BenchOpts {
        pool,
        sweep: sweep_shapes,
        cycle,
        ref calls,
        call_trace,
        mid_event,
        driver_copy,
        flush_after_copy,
    } = opts;
    let s = kimi.shape();
    if pool < s.experts {
        println!("routings drawn from the layer's first {pool} of {} experts", s.experts);
    }
    if cycle < 16 {
        println!("the calls cycle over {cycle} of the 16 routings");
    }
    // Copy bandwidth: 1 GiB read + 1 GiB written per copy.
    let floats = 1usize << 28;
    let src = client.empty(floats * 4);
    let dst = client.empty(floats * 4);
    copy_f32(client, &src, &dst, floats);
    let copy_us = time_us(client, 3, 7, 10, |_| copy_f32(client, &src, &dst, floats))?;
    let copy_gbs = 2.0 * (floats * 4) as f64 / copy_us / 1e3;
    drop((src, dst));
    println!("device-to-device copy (CubeCL kernel, 1 GiB, read + write bytes): {copy_gbs:.0} GB/s");

    let mut behind = BehindCopy::new(client).map_err(anyhow::Error::msg)?;
    if !mid_event {
        // `--subtract-copy`: the GPU-time columns as before session 30, (copy + calls - copy alone) / calls.
        behind.set_mid_event(false);
        println!("GPU times as (copy + calls - copy alone) / calls (--subtract-copy)");
    }
    if driver_copy {
        // `--driver-copy`: the copy in front is cuMemcpyDtoDAsync, not CubeCL's copy kernel.
        behind.set_driver_copy(client, true).map_err(anyhow::Error::msg)?;
        println!("the calls queue behind the driver's device-to-device copy (--driver-copy)");
    }
    if flush_after_copy {
        // `--flush-after-copy`: CubeCL's queue handed to its device thread right after the copy's enqueue.
        behind.set_flush_after_copy(client, true).map_err(anyhow::Error::msg)?;
        println!("CubeCL's queue flushed after the copy's enqueue (--flush-after-copy)");
    }
    println!(
        "| m | active experts | us (wall) | GPU us (behind a copy) | bytes moved (MB) | GB/s (GPU) | % of copy BW (GPU; wall) | tokens/expert (max) |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for (i, &m) in ms.iter().enumerate() {
        let BenchInputs { x, out, routings, active, max_tokens } = bench_inputs(client, &s, m, 1000 + i as u64, pool)?;
        let fwd = |cfg: &MoeConfig, stages: Stages, j: usize| {
            moe_forward_with::<_, bf16>(client, gpu, &x, &routings[j % cycle], &out, cfg, stages)
        };
        let mut best = (f64::INFINITY, MoeConfig::for_tokens(m));
        for cfg in if sweep_shapes { sweep(m) } else { Vec::new() } {
            let us = time_us(client, 8, 5, 16, |j| fwd(&cfg, Stages::All, j))?;
            eprintln!("  m={m} {cfg:?}: {us:.1} us");
            if us < best.0 {
                best = (us, cfg);
            }
        }
        let cfg = best.1;
        // The intermediate's split fused into the gate/up launch (default) against its own launch, alternated.
        let mut ab = [f64::INFINITY; 2];
        for k in 0..4 {
            set_fused_split(k % 2 == 0);
            let t = time_us(client, 8, 9, 32, |j| fwd(&cfg, Stages::All, j))?;
            ab[k % 2] = ab[k % 2].min(t);
        }
        set_fused_split(true);
        eprintln!("  m={m} fused split {:.1} us, separate split launch {:.1} us", ab[0], ab[1]);
        println!("(m = {m}: intermediate split fused into gate/up {:.1} us, as its own launch {:.1} us)", ab[0], ab[1]);
        let us = time_us(client, 16, 9, 32, |j| fwd(&cfg, Stages::All, j))?;
        // `calls[0]` calls behind the copy, or a half / a quarter of them where the host's enqueue outlasts it (32
        // tokens and up with the default launch shape: `BehindCopy` refuses such a time).
        let behind_at = |st: Stages, n: usize| -> Result<(f64, f64, usize)> {
            let mut last = String::new();
            for c in [n, n / 2, n / 4] {
                if c == 0 {
                    break;
                }
                match behind.time_us_clocks(client, 16, c, |j| fwd(&cfg, st, j)) {
                    Ok((gpu, host)) => return Ok((gpu, host, c)),
                    Err(e) => last = e,
                }
            }
            Err(anyhow::Error::msg(last))
        };
        // Every count of `calls` for one stage: the first count's figures, and the per-call slope between the first
        // and the last count actually timed (None with one count, or where both fell back to the same).
        let behind_us = |st: Stages| -> Result<Behind> {
            let (gpu, host, c0) = behind_at(st, calls[0])?;
            let mut by = vec![(c0, gpu)];
            for &n in &calls[1..] {
                let (g, _, c) = behind_at(st, n)?;
                if c > by.last().map_or(0, |b| b.0) {
                    by.push((c, g));
                }
            }
            let slope = (by.len() > 1).then(|| {
                let ((a, ua), (b, ub)) = (by[0], by[by.len() - 1]);
                (ub * b as f64 - ua * a as f64) / (b - a) as f64
            });
            Ok((gpu, host, by, slope))
        };
        let (gpu_us, host_clock_us, gpu_by_calls, gpu_slope) = behind_us(Stages::All)?;
        if behind.gpu_clock() {
            println!(
                "(m = {m}: GPU us on CUDA events {gpu_us:.1}; the same runs on the host clock, to the device sync's \
                 return, {host_clock_us:.1})"
            );
        }
        let stages_timed: Vec<Behind> =
            [Stages::GateUp, Stages::Down, Stages::Combine].into_iter().map(behind_us).collect::<Result<_>>()?;
        let stage_us: Vec<f64> = stages_timed.iter().map(|t| t.0).collect();
        if let Some(slope) = gpu_slope {
            let fmt = |by: &[(usize, f64)], sl: Option<f64>| {
                let at: Vec<String> = by.iter().map(|(c, u)| format!("{u:.1} at {c}")).collect();
                format!("{}; slope {}", at.join(", "), fmt_us(sl))
            };
            println!(
                "(m = {m}: GPU us a call by calls behind the copy, and the slope between the first and last count \
                 (a call's cost without what a sample pays once): layer {}; gate/up {}; down {}; combine {})",
                fmt(&gpu_by_calls, Some(slope)),
                fmt(&stages_timed[0].2, stages_timed[0].3),
                fmt(&stages_timed[1].2, stages_timed[1].3),
                fmt(&stages_timed[2].2, stages_timed[2].3)
            );
        }
        // `--call-trace`: an event after the copy and after each layer call (the last count of `--calls`).
        let traced = if call_trace {
            let n = calls[calls.len() - 1];
            let t = behind.call_times(client, 16, n, |j| fwd(&cfg, Stages::All, j)).map_err(anyhow::Error::msg)?;
            if let Some(t) = &t {
                let each: Vec<String> = t[1..].iter().map(|u| format!("{u:.1}")).collect();
                println!(
                    "(m = {m}: call trace, an event after the copy and after each of {n} layer calls, GPU us: the copy \
                     {:+.1} against its time alone; the calls {})",
                    t[0],
                    each.join(" ")
                );
            }
            t
        } else {
            None
        };
        let mean_active = active.iter().sum::<usize>() as f64 / active.len() as f64;
        // Bytes that must move: the routed experts' packed weights and scales, the input and the output.
        let bytes = mean_active * s.expert_bytes() as f64 + (m * s.hidden * (2 + 4)) as f64;
        let gbs = bytes / us / 1e3;
        let gpu_gbs = bytes / gpu_us / 1e3;
        println!(
            "| {m} | {mean_active:.1} | {us:.1} | {gpu_us:.1} | {:.1} | {gpu_gbs:.0} | {:.1}; {:.1} | {max_tokens} |",
            bytes / 1e6,
            100.0 * gpu_gbs / copy_gbs,
            100.0 * gbs / copy_gbs
        );
        rows.push(serde_json::json!({
            "m": m, "topk": TOPK, "active_experts_mean": mean_active, "us": us, "bytes": bytes,
            "gb_per_s": gbs, "pct_copy_bw": 100.0 * gbs / copy_gbs, "max_tokens_per_expert": max_tokens,
            "gpu_us": gpu_us, "gpu_host_clock_us": host_clock_us, "gpu_gb_per_s": gpu_gbs, "gpu_pct_copy_bw": 100.0 * gpu_gbs / copy_gbs,
            "roofline_us": bytes / (copy_gbs * 1e3),
            "config": format!("{cfg:?}"),
            "gpu_stage_us": {"gate_up": stage_us[0], "down": stage_us[1], "combine": stage_us[2]},
            "fused_split_us": ab[0], "separate_split_us": ab[1],
            "gpu_us_by_calls": gpu_by_calls.iter().map(|(c, u)| serde_json::json!({"calls": c, "us": u})).collect::<Vec<_>>(),
            "gpu_slope_us": gpu_slope,
            "call_trace_us": traced,
            "gpu_stage_slope_us": {"gate_up": stages_timed[0].3, "down": stages_timed[1].3, "combine": stages_timed[2].3},
        }));
        drop::<(Handle, Handle)>((x, out));
    }
    if let Some(path) = json {
        let doc = serde_json::json!({
            "what": "fused INT4 W4A16 MoE layer (eyrie-quant CubeCL kernels: gate+up+SiLU, down, combine)",
            "shape": {"hidden": s.hidden, "inter": s.inter, "experts": s.experts, "group": s.group, "topk": TOPK},
            "timing": "us: wall clock over 32 calls between device syncs, median of 9 batches, routings_cycled of 16 routings cycled; launch shape: fastest of a sweep (config). gpu_us, gpu_stage_us: calls (--calls, first count; default 16) queued behind a 2 GiB copy (a half or a quarter as many where the host's enqueue outlasts it), medians of 7 (the GPU's own time, host enqueue hidden; on CUDA between a CUDA event after the copy and one after the calls, / calls (subtract_copy: before the copy, less the copy alone, as before session 30); gpu_host_clock_us the same runs to the device sync's return); gpu_us_by_calls, gpu_slope_us, gpu_stage_slope_us with two or more --calls counts: each count's figure and the per-call slope between the first and the last ((us_b * b - us_a * a) / (b - a): what a call costs without a cost paid once a sample)",
            "gpu_clock": if behind.gpu_clock() { "cuda events" } else { "host" },
            "subtract_copy": !mid_event,
            "driver_copy": driver_copy,
            "flush_after_copy": flush_after_copy,
            "routings_cycled": cycle, "expert_pool": pool,
            "copy_gb_per_s": copy_gbs,
            "rows": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?).with_context(|| format!("writing {path}"))?;
    }
    Ok(())
}

/// A time for a table cell, `-` when not measured.
fn fmt_us(us: Option<f64>) -> String {
    us.map_or_else(|| "-".to_string(), |v| format!("{v:.1}"))
}

/// Whether every launch of `mm` at the classes of `base` fits the kernel and `smem_limit` bytes of shared memory.
fn fits_tbs(s: &MoeShape, base: &MoeConfig, mm: &MmaShape, smem_limit: usize) -> bool {
    eyrie_quant::cuda::specs::mma_class_tbs(base).into_iter().all(|tb| {
        [
            eyrie_quant::cuda::specs::ExpertMmaSpec::gate_up(s, TOPK, mm, tb),
            eyrie_quant::cuda::specs::ExpertMmaSpec::down(s, TOPK, mm, tb),
        ]
        .iter()
        .all(|spec| spec.fits() && spec.shared_bytes() <= smem_limit)
    })
}

/// `stages`: the tensor-core launch shapes of gate/up (tasks x k-split) and of down (tiles x tasks x k-split), each
/// stage timed alone (gate/up with the input's split and, by default, the intermediate's, which it writes itself;
/// down alone), from the launch shape of `MoeConfig::for_tokens(m)`, then the whole layer with the best of each
/// against that shape, in the same run; every time is the GPU's ([`BehindCopy`]: at one token the host's enqueue of
/// a launch outlasts the down kernel, so wall-clock times of back-to-back calls were the host's). `full`: up to 32 warps a block and 4 tiles a task; otherwise the 18 + 24
/// shapes that mattered at one token in session 16. For choosing `MoeConfig::for_tokens` stage by stage (the
/// `bench` sweep tries whole shapes only).
#[allow(clippy::too_many_arguments)]
fn run_stage_sweep(
    client: &ComputeClient<R>,
    kimi: &MoeExperts,
    gpu: &GpuExperts<R>,
    ms: &[usize],
    json: Option<&str>,
    full: bool,
    only: Option<&str>,
    loads: bool,
) -> Result<()> {
    let s = kimi.shape();
    let smem_limit = client.properties().hardware.max_shared_memory_size;
    let mut out = Vec::new();
    let behind = BehindCopy::new(client).map_err(anyhow::Error::msg)?;
    for (i, &m) in ms.iter().enumerate() {
        let BenchInputs { x, out: y, routings, .. } = bench_inputs(client, &s, m, 2000 + i as u64, s.experts)?;
        let base = MoeConfig::for_tokens(m);
        let Some(base_mm) = base.mma else { bail!("m = {m}: the tuned shape is not a tensor-core shape") };
        let fwd = |cfg: &MoeConfig, st: Stages, j: usize| {
            moe_forward_with::<_, bf16>(client, gpu, &x, &routings[j % 16], &y, cfg, st)
        };
        // A shape whose enqueue outlasts the copy once (a kernel compiled late, the host descheduled) is timed
        // again; twice, it is left out of the table.
        let time = |mm: MmaShape, st: Stages| -> Result<f64> {
            let cfg = MoeConfig { mma: Some(mm), ..base };
            behind
                .time_us(client, 16, 16, |j| fwd(&cfg, st, j))
                .or_else(|_| behind.time_us(client, 16, 16, |j| fwd(&cfg, st, j)))
                .or_else(|e| {
                    println!("| {mm:?}: not timed ({e}) |");
                    Ok(f64::INFINITY)
                })
        };
        println!(
            "\nm = {m}: gate/up alone (with the input's split; it writes the intermediate split unless EYRIE_MOE_FUSED_SPLIT=0), tuned shape {base_mm:?}"
        );
        println!("| tasks | k-split | warps | GPU us | loads alone, GPU us |\n|---|---|---|---|---|");
        let mut best13 = (f64::INFINITY, base_mm);
        let mut rows13 = Vec::new();
        for tasks in [1usize, 2, 4, 8] {
            for ksplit in [1usize, 2, 3, 4, 6, 8] {
                if only == Some("down") || tasks * ksplit > if full { 32 } else { 24 } || (!full && ksplit == 8) {
                    continue;
                }
                let mm = MmaShape { tasks_13: tasks, ksplit_13: ksplit, ..base_mm };
                if !fits_tbs(&s, &base, &mm, smem_limit) {
                    continue;
                }
                let us = time(mm, Stages::GateUp)?;
                let lo = if loads { Some(time(mm, Stages::GateUpLoads)?) } else { None };
                println!("| {tasks} | {ksplit} | {} | {us:.1} | {} |", tasks * ksplit, fmt_us(lo));
                rows13.push(serde_json::json!({"tasks": tasks, "ksplit": ksplit, "us": us, "loads_us": lo}));
                if us < best13.0 {
                    best13 = (us, mm);
                }
            }
        }
        println!("\nm = {m}: down alone (plus the intermediate's split launch when EYRIE_MOE_FUSED_SPLIT=0)");
        println!("| tiles | tasks | k-split | warps | GPU us | loads alone, GPU us |\n|---|---|---|---|---|---|");
        let mut best2 = (f64::INFINITY, base_mm);
        let mut rows2 = Vec::new();
        for tiles in [1usize, 2, 4] {
            for tasks in [1usize, 2, 4, 8] {
                for ksplit in [1usize, 2, 3, 4, 6, 8] {
                    // Without `--full`: the part of the grid that session 16 found within 5% of the best at one
                    // token (down took the same time for every shape up to 16 warps).
                    if only == Some("gate_up")
                        || tasks * ksplit > if full { 32 } else { 16 }
                        || (!full && (tiles == 4 || tasks == 8 || ksplit > 4))
                    {
                        continue;
                    }
                    let mm = MmaShape { tiles_2: tiles, tasks_2: tasks, ksplit_2: ksplit, ..base_mm };
                    if !fits_tbs(&s, &base, &mm, smem_limit) {
                        continue;
                    }
                    let us = time(mm, Stages::Down)?;
                    let lo = if loads { Some(time(mm, Stages::DownLoads)?) } else { None };
                    println!("| {tiles} | {tasks} | {ksplit} | {} | {us:.1} | {} |", tasks * ksplit, fmt_us(lo));
                    rows2.push(
                        serde_json::json!({"tiles": tiles, "tasks": tasks, "ksplit": ksplit, "us": us, "loads_us": lo}),
                    );
                    if us < best2.0 {
                        best2 = (us, mm);
                    }
                }
            }
        }
        let best =
            MmaShape { tiles_2: best2.1.tiles_2, tasks_2: best2.1.tasks_2, ksplit_2: best2.1.ksplit_2, ..best13.1 };
        // The whole layer, tuned shape and the stage-wise best, alternated twice (the machine drifts).
        let mut whole = [0.0f64; 4];
        for (k, mm) in [base_mm, best, base_mm, best].into_iter().enumerate() {
            whole[k] = time(mm, Stages::All)?;
        }
        let (tuned_us, best_us) = (whole[0].min(whole[2]), whole[1].min(whole[3]));
        println!(
            "\nm = {m}: whole layer (GPU us), tuned {base_mm:?} {tuned_us:.1} us; stage-wise best {best:?} {best_us:.1} us"
        );
        out.push(serde_json::json!({"m": m, "tuned": format!("{base_mm:?}"), "tuned_us": tuned_us,
            "best": format!("{best:?}"), "best_us": best_us, "gate_up": rows13, "down": rows2}));
    }
    if let Some(path) = json {
        let doc = serde_json::json!({
            "what": "fused INT4 MoE, tensor-core launch shapes per stage (Kimi-K2 shapes, tiled experts)",
            "timing": "GPU time: 16 calls queued behind a 2 GiB copy, (copy + calls - copy) / 16, medians of 7, 16 routings cycled",
            "rows": out,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?).with_context(|| format!("writing {path}"))?;
    }
    Ok(())
}
