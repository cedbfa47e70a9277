//! Tensor and expert parallelism on real GPUs over NCCL (issue 7), the GPU counterpart of `tests/parallel.rs`:
//!
//! 1. the collectives' semantics on N GPUs (sums, gathers along both dimensions, an uneven all-to-all, and a
//!    shape mismatch that is an error on every rank instead of a hang);
//! 2. for each committed fixture and each N-way split its config allows (tp N, ep N, tp N x ep N; all-reduce and
//!    all-to-all expert dispatch): every rank loads its shard onto its own GPU, and the sharded logits (full
//!    forward, then a batched prefill + greedy decode over the paged cache) must be bit-identical on every rank,
//!    pick the unsharded GPU model's greedy token at every step, and stay within `max|a-b| / max|b| <= 2e-3` of
//!    the unsharded CPU model (CubeCL's TF32 matmuls put the unsharded GPU model ~1e-3 from the CPU; the table
//!    prints that floor beside each split). Routed INT4 experts run through the fused kernel on the GPU, which
//!    computes with compressed-tensors' BF16-rounded weights `bf16(q * scale)`, as the CPU model does;
//! 3. timing of the cached decode steps: ms per step unsharded (one GPU) and sharded (N GPUs), and the share of
//!    the sharded step spent in collectives (NcclCommunicator::collective_time).
//!
//! Prints a table and writes JSON. Exit status 1 when a check fails.
//!
//! usage: parallel_gpu [--gpus N] [--fixtures DIR] [--json PATH] [--steps S]
//! (run from the repository root; needs N >= 2 CUDA devices and libnccl.so on the library path)

use std::path::PathBuf;
use std::time::Instant;

use burn::backend::Cuda;
use burn::backend::cuda::CudaDevice;
use burn::tensor::{Tensor, TensorData};
use eyrie_model::DeepseekV3;
use eyrie_model::deepseek_v3::{BatchEntry, LogitRows};
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::parallel::{Communicator, ExpertDispatch, NcclCommunicator, ShardSpec, ShardedDeepseekV3};
use eyrie_model::sampling::argmax;

type B = Cuda;
type Error = Box<dyn std::error::Error + Send + Sync>;

/// CubeCL stages f32 matmul operands as TF32 (10-bit mantissa), so CUDA logits sit ~1e-3 from the CPU's
/// (bench/REPORT.md, GPU correctness) and a split that sums partial products in another order lands elsewhere in
/// that noise. The checks: every rank bit-identical; the same greedy token as the unsharded GPU model at every
/// step; logits within this bound of the CPU (f32, no TF32) unsharded model, the bound `eyrie score` CUDA vs CPU
/// meets.
const TOLERANCE: f32 = 2e-3;

fn host<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().expect("f32 after convert")
}

fn scaled_error(got: &[f32], want: &[f32]) -> f32 {
    if got.len() != want.len() {
        return f32::INFINITY;
    }
    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    diff / want.iter().map(|b| b.abs()).fold(0.0f32, f32::max).max(f32::MIN_POSITIVE)
}

/// Runs `f(comm)` on every rank of a new NCCL group over GPUs `0..n`, one thread each; results in rank order.
fn on_gpus<T: Send>(n: usize, f: impl Fn(NcclCommunicator) -> Result<T, Error> + Sync) -> Result<Vec<T>, Error> {
    let devices: Vec<usize> = (0..n).collect();
    let comms = NcclCommunicator::group(&devices)?;
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                scope.spawn(move || {
                    let rank = comm.rank();
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm))).unwrap_or_else(|panic| {
                        let text = panic
                            .downcast_ref::<String>()
                            .cloned()
                            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default();
                        Err(format!("rank {rank} panicked: {text}").into())
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().map_err(|_| Error::from("a rank thread panicked"))?).collect()
    })
}

fn tensor(values: Vec<f32>, shape: [usize; 2], device: &CudaDevice) -> Tensor<B, 2> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// Collective semantics on `n` GPUs; returns the failures.
fn check_collectives(n: usize) -> Result<Vec<String>, Error> {
    let out = on_gpus(n, |comm| {
        let device = comm.device();
        let rank = comm.rank();
        let r = rank as f32;
        let t = tensor(vec![r, 10.0 * r, 1.0, 2.0], [2, 2], &device);
        let say = |what: &str| {
            if rank == 0 {
                eprintln!("collectives: {what} ok");
            }
        };
        let _ = host(t.clone());
        say("upload and read");
        let reduced = comm.all_reduce_sum(t.clone())?;
        say("all_reduce_sum call");
        let sum = host(reduced);
        say("all_reduce_sum read");
        let rows = host(comm.all_gather(t.clone(), 0)?);
        say("all_gather dim 0");
        let cols = host(comm.all_gather(t, 1)?);
        say("all_gather dim 1");
        // Rank r sends r + 1 rows of value 100 r + d to rank d (uneven parts).
        let parts =
            (0..n).map(|d| tensor(vec![100.0 * r + d as f32; 2 * (rank + 1)], [rank + 1, 2], &device)).collect();
        let got: Vec<Vec<f32>> = comm.all_to_all(parts)?.into_iter().map(host).collect();
        say("all_to_all");
        let mismatch = comm.all_reduce_sum(tensor(vec![1.0; 2 + 2 * rank], [1 + rank, 2], &device)).is_err();
        let still = host(comm.all_reduce_sum(tensor(vec![1.0; 2], [1, 2], &device))?);
        say("mismatch");
        Ok((sum, rows, cols, got, mismatch, still))
    })?;
    let mut failures = Vec::new();
    let total: f32 = (0..n).map(|r| r as f32).sum();
    for (rank, (sum, rows, cols, got, mismatch, still)) in out.into_iter().enumerate() {
        let want_sum = vec![total, 10.0 * total, n as f32, 2.0 * n as f32];
        if sum != want_sum {
            failures.push(format!("rank {rank}: all_reduce_sum {sum:?}, want {want_sum:?}"));
        }
        let want_rows: Vec<f32> = (0..n).flat_map(|s| [s as f32, 10.0 * s as f32, 1.0, 2.0]).collect();
        if rows != want_rows {
            failures.push(format!("rank {rank}: all_gather dim 0 {rows:?}, want {want_rows:?}"));
        }
        let mut want_cols = Vec::new();
        for row in 0..2 {
            for s in 0..n {
                want_cols.extend(if row == 0 { [s as f32, 10.0 * s as f32] } else { [1.0, 2.0] });
            }
        }
        if cols != want_cols {
            failures.push(format!("rank {rank}: all_gather dim 1 {cols:?}, want {want_cols:?}"));
        }
        for (src, part) in got.iter().enumerate() {
            let m = src + 1;
            if part != &vec![100.0 * src as f32 + rank as f32; 2 * m] {
                failures.push(format!("rank {rank}: all_to_all part from {src} is {part:?}"));
            }
        }
        if !mismatch {
            failures.push(format!("rank {rank}: a shape mismatch was not an error"));
        }
        if still != vec![n as f32; 2] {
            failures.push(format!("rank {rank}: the group did not work after an error: {still:?}"));
        }
    }
    Ok(failures)
}

/// Two prompts of different lengths from a fixture's vocabulary (deterministic).
fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % vocab as u64) as u32
    };
    vec![(0..13).map(|_| next()).collect(), (0..6).map(|_| next()).collect()]
}

/// Batched prefill of `prompts` then greedy steps; the inputs of every step (teacher forcing for the shards).
/// Each step's inputs: one token list per sequence.
type Steps = Vec<Vec<Vec<u32>>>;

fn greedy_inputs(
    full: &DeepseekV3<B>,
    prompts: &[Vec<u32>],
    steps: usize,
    device: &CudaDevice,
) -> Result<(Steps, Vec<Vec<f32>>), Error> {
    let mut cache = PagedMlaCache::new(&full.config, 64, 4, device)?;
    let mut seqs = vec![SequenceCache::default(); prompts.len()];
    let mut inputs = prompts.to_vec();
    let (mut fed, mut logits) = (Vec::new(), Vec::new());
    for _ in 0..=steps {
        let mut batch: Vec<BatchEntry<'_>> =
            seqs.iter_mut().zip(&inputs).map(|(seq, tokens)| BatchEntry { seq, tokens }).collect();
        let l = host(full.forward_batch(&mut batch, &mut cache, LogitRows::Last, device)?);
        fed.push(inputs.clone());
        inputs = l.chunks_exact(full.config.vocab_size).map(|row| vec![argmax(row)]).collect();
        logits.push(l);
    }
    Ok((fed, logits))
}

/// The CPU (f32) unsharded model's cached-step logits on the inputs `fed`.
fn cpu_steps(dir: &PathBuf, fed: &[Vec<Vec<u32>>]) -> Result<Vec<Vec<f32>>, Error> {
    type C = burn::backend::Flex;
    let device = Default::default();
    let full = DeepseekV3::<C>::load(dir, &device)?;
    let mut cache = PagedMlaCache::<C>::new(&full.config, 64, 4, &device)?;
    let mut seqs = vec![SequenceCache::default(); fed[0].len()];
    let mut out = Vec::new();
    for inputs in fed {
        let mut batch: Vec<BatchEntry<'_>> =
            seqs.iter_mut().zip(inputs).map(|(seq, tokens)| BatchEntry { seq, tokens }).collect();
        let l = full.forward_batch(&mut batch, &mut cache, LogitRows::Last, &device)?;
        out.push(l.into_data().convert::<f32>().to_vec::<f32>().expect("f32 after convert"));
    }
    Ok(out)
}

/// Milliseconds per cached decode step of the unsharded model (batch of the two prompts), after a warm-up run.
fn unsharded_step_ms(full: &DeepseekV3<B>, fed: &[Vec<Vec<u32>>], device: &CudaDevice) -> Result<f64, Error> {
    let mut best = f64::INFINITY;
    for _ in 0..2 {
        let mut cache = PagedMlaCache::new(&full.config, 64, 4, device)?;
        let mut seqs = vec![SequenceCache::default(); fed[0].len()];
        let mut batch: Vec<BatchEntry<'_>> =
            seqs.iter_mut().zip(&fed[0]).map(|(seq, tokens)| BatchEntry { seq, tokens }).collect();
        full.forward_batch(&mut batch, &mut cache, LogitRows::Last, device)?;
        let started = Instant::now();
        for inputs in &fed[1..] {
            let mut batch: Vec<BatchEntry<'_>> =
                seqs.iter_mut().zip(inputs).map(|(seq, tokens)| BatchEntry { seq, tokens }).collect();
            let _ = host(full.forward_batch(&mut batch, &mut cache, LogitRows::Last, device)?);
        }
        best = best.min(started.elapsed().as_secs_f64() * 1e3 / (fed.len() - 1) as f64);
    }
    Ok(best)
}

struct SplitResult {
    fixture: String,
    tp: usize,
    ep: usize,
    dispatch: ExpertDispatch,
    /// Sharded GPU vs unsharded GPU.
    forward_error: f32,
    cached_error: f32,
    /// Sharded GPU vs unsharded CPU, and the unsharded GPU's own distance from the CPU (the TF32 floor).
    cpu_error: f32,
    gpu_floor: f32,
    greedy_equal: bool,
    ranks_identical: bool,
    unsharded_ms: f64,
    sharded_ms: f64,
    collective_share: f64,
    collective_calls_per_step: f64,
}

/// The unsharded model's results on GPU 0 for one fixture.
struct Reference {
    full: DeepseekV3<B>,
    want_forward: Vec<f32>,
    fed: Steps,
    want_cached: Vec<Vec<f32>>,
    /// The CPU model's cached-step logits on the same inputs.
    cpu_cached: Vec<Vec<f32>>,
    unsharded_ms: f64,
}

fn run_split(
    dir: &PathBuf,
    name: &str,
    n: usize,
    (tp, ep, dispatch): (usize, usize, ExpertDispatch),
    reference: &Reference,
) -> Result<SplitResult, Error> {
    let Reference { full, want_forward, fed, want_cached, cpu_cached, unsharded_ms } = reference;
    let unsharded_ms = *unsharded_ms;
    let rows = &fed[0];
    let out = on_gpus(n, |comm| {
        let device = comm.device();
        let rank = comm.rank();
        let shard = ShardedDeepseekV3 { dispatch, ..ShardedDeepseekV3::<B>::load(dir, rank, tp, ep, &device)? };
        if rank == 0 {
            eprintln!("{name} tp {tp} ep {ep} {dispatch:?}: shards loaded");
        }
        // Full-form forward of the first prompt.
        let tokens = full.token_tensor(&[rows[0].as_slice()], &device)?;
        let forward = host(shard.forward(tokens, &comm)?);
        // Cached steps, twice: the first compiles kernels, the second is timed.
        let mut cached = Vec::new();
        let mut step_ms = f64::INFINITY;
        let mut share = 0.0;
        let mut calls_per_step = 0.0;
        for round in 0..2 {
            let mut cache = PagedMlaCache::new(&full.config, 64, 4, &device)?;
            let mut seqs = vec![SequenceCache::default(); rows.len()];
            let mut started = Instant::now();
            let (mut calls0, mut busy0) = comm.collective_time();
            for (i, inputs) in fed.iter().enumerate() {
                if i == 1 {
                    started = Instant::now();
                    (calls0, busy0) = comm.collective_time();
                }
                let mut batch: Vec<BatchEntry<'_>> =
                    seqs.iter_mut().zip(inputs).map(|(seq, tokens)| BatchEntry { seq, tokens }).collect();
                let l = host(shard.forward_batch(&mut batch, &mut cache, LogitRows::Last, &comm, &device)?);
                if round == 0 {
                    cached.push(l);
                }
            }
            let elapsed = started.elapsed();
            let (calls, busy) = comm.collective_time();
            let steps = (fed.len() - 1) as f64;
            if round == 1 {
                step_ms = elapsed.as_secs_f64() * 1e3 / steps;
                share = (busy - busy0).as_secs_f64() / elapsed.as_secs_f64();
                calls_per_step = (calls - calls0) as f64 / steps;
            }
        }
        Ok((forward, cached, step_ms, share, calls_per_step))
    })?;
    let ranks_identical = out.iter().all(|o| o.0 == out[0].0 && o.1 == out[0].1);
    let forward_error = scaled_error(&out[0].0, want_forward);
    let max_error =
        |a: &[Vec<f32>], b: &[Vec<f32>]| a.iter().zip(b).map(|(g, w)| scaled_error(g, w)).fold(0.0f32, f32::max);
    let cached_error = max_error(&out[0].1, want_cached);
    let cpu_error = max_error(&out[0].1, cpu_cached);
    let gpu_floor = max_error(want_cached, cpu_cached);
    let vocab = full.config.vocab_size;
    let tokens = |steps: &[Vec<f32>]| steps.iter().flat_map(|l| l.chunks_exact(vocab).map(argmax)).collect::<Vec<_>>();
    let greedy_equal = tokens(&out[0].1) == tokens(want_cached);
    let slowest = out.iter().map(|o| o.2).fold(0.0, f64::max);
    let share = out.iter().map(|o| o.3).sum::<f64>() / n as f64;
    Ok(SplitResult {
        fixture: name.to_string(),
        tp,
        ep,
        dispatch,
        forward_error,
        cached_error,
        cpu_error,
        gpu_floor,
        greedy_equal,
        ranks_identical,
        unsharded_ms,
        sharded_ms: slowest,
        collective_share: share,
        collective_calls_per_step: out[0].4,
    })
}

fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let (mut gpus, mut fixtures, mut json, mut steps) = (2usize, PathBuf::from("fixtures/model"), None, 8usize);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| Error::from(format!("{a} needs a value")));
        match a.as_str() {
            "--gpus" => gpus = value()?.parse()?,
            "--fixtures" => fixtures = PathBuf::from(value()?),
            "--json" => json = Some(PathBuf::from(value()?)),
            "--steps" => steps = value()?.parse()?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if gpus < 2 {
        return Err("--gpus: at least 2".into());
    }
    let mut failures = check_collectives(gpus).unwrap_or_else(|e| vec![format!("collectives: {e}")]);
    println!("collectives on {gpus} GPUs: {}", if failures.is_empty() { "ok".into() } else { failures.join("; ") });

    let device0 = CudaDevice::new(0);
    let mut results = Vec::new();
    for name in ["yarn_qlora", "v2lite", "int4_experts"] {
        let dir = fixtures.join(name);
        let full = DeepseekV3::<B>::load(&dir, &device0)?;
        let prompts = prompts(full.config.vocab_size);
        let want_forward = host(full.forward(full.token_tensor(&[prompts[0].as_slice()], &device0)?));
        let (fed, want_cached) = greedy_inputs(&full, &prompts, steps, &device0)?;
        let unsharded_ms = unsharded_step_ms(&full, &fed, &device0)?;
        let cpu_cached = cpu_steps(&dir, &fed)?;
        let reference = Reference { full, want_forward, fed, want_cached, cpu_cached, unsharded_ms };
        for (tp, ep) in [(gpus, 1), (1, gpus), (gpus, gpus)] {
            let spec = ShardSpec { rank: 0, tp, ep };
            if spec.validate(&reference.full.config).is_err() {
                println!("{name}: tp {tp} ep {ep} does not divide this config; skipped");
                continue;
            }
            let dispatches: &[ExpertDispatch] = if ep > 1 {
                &[ExpertDispatch::AllReduce, ExpertDispatch::AllToAll]
            } else {
                &[ExpertDispatch::AllReduce]
            };
            for &dispatch in dispatches {
                let r = match run_split(&dir, name, gpus, (tp, ep, dispatch), &reference) {
                    Ok(r) => r,
                    Err(e) => {
                        failures.push(format!("{name} tp {tp} ep {ep} {dispatch:?}: {e}"));
                        continue;
                    }
                };
                if !r.ranks_identical {
                    failures.push(format!("{name} tp {tp} ep {ep} {dispatch:?}: ranks' logits differ"));
                }
                if !r.greedy_equal {
                    failures.push(format!("{name} tp {tp} ep {ep} {dispatch:?}: a greedy token differs"));
                }
                if r.cpu_error > TOLERANCE {
                    failures.push(format!(
                        "{name} tp {tp} ep {ep} {dispatch:?}: error vs the CPU model {:.1e} > {TOLERANCE:e}",
                        r.cpu_error
                    ));
                }
                results.push(r);
            }
        }
    }
    println!(
        "\n| fixture | tp | ep | dispatch | vs 1-GPU forward | vs 1-GPU cached | vs CPU cached (1-GPU vs CPU) | greedy equal | ranks equal | 1 GPU ms/step | {gpus} GPUs ms/step | collectives share | collectives/step |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &results {
        println!(
            "| {} | {} | {} | {:?} | {:.1e} | {:.1e} | {:.1e} ({:.1e}) | {} | {} | {:.2} | {:.2} | {:.0}% | {:.0} |",
            r.fixture,
            r.tp,
            r.ep,
            r.dispatch,
            r.forward_error,
            r.cached_error,
            r.cpu_error,
            r.gpu_floor,
            r.greedy_equal,
            r.ranks_identical,
            r.unsharded_ms,
            r.sharded_ms,
            100.0 * r.collective_share,
            r.collective_calls_per_step
        );
    }
    if let Some(path) = json {
        let splits: Vec<serde_json::Value> = results
            .iter()
            .map(|r| {
                serde_json::json!({
                    "fixture": r.fixture, "tp": r.tp, "ep": r.ep, "dispatch": format!("{:?}", r.dispatch),
                    "forward_error": r.forward_error, "cached_error": r.cached_error, "cpu_error": r.cpu_error,
                    "gpu_vs_cpu_floor": r.gpu_floor, "greedy_equal": r.greedy_equal,
                    "ranks_identical": r.ranks_identical, "unsharded_ms_per_step": r.unsharded_ms,
                    "sharded_ms_per_step": r.sharded_ms, "collective_share": r.collective_share,
                    "collectives_per_step": r.collective_calls_per_step,
                })
            })
            .collect();
        let doc = serde_json::json!({"gpus": gpus, "tolerance": TOLERANCE, "decode_steps": steps,
            "failures": failures, "splits": splits});
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    if failures.is_empty() {
        println!("\nall checks passed");
        Ok(())
    } else {
        for f in &failures {
            eprintln!("FAILED: {f}");
        }
        std::process::exit(1)
    }
}
