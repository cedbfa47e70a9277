//! `bench decode`: decode steps of a full-width Kimi-K2 slice (hidden 7168, 64 MLA heads, 384 routed experts of
//! width 2048, top-8, vocabulary 163840; `--layers L`: layer 0 dense, the rest MoE) with synthetic weights made on
//! the GPUs (`eyrie_model::synthetic`), on one GPU or spread over `tp x ep` GPUs with NCCL
//! (`eyrie_model::parallel::ParallelGroup`, the server's code path). Issue 7's scaling benchmark.
//!
//! For each split and batch: every sequence is prefilled with `--context` tokens (chunks of 1024 tokens a sequence, at most 8192 rows a forward), then `--steps`
//! decode steps (one token per sequence) are timed one by one after `--warmup` untimed ones (kernel compilation and
//! matmul autotuning happen there); the median step is reported, with the mean and the slowest. Printed and written as
//! JSON (rewritten after every split; progress lines carry the seconds since start): ms per step, the share of rank 0's
//! step inside collectives, and the roofline: the bytes rank 0 must read per step over the copy bandwidth measured in
//! the same run on GPU 0. Those bytes: its dense weights (attention with its heads, its dense-MLP and shared-expert
//! slices, the router, `lm_head`; BF16 on CUDA, f32 on the CPU), the expected number of distinct routed experts it
//! holds, `E (1 - (1 - k/E)^batch) / ep` for uniform routing, at INT4's 0.5625 bytes a parameter (packed words + BF16
//! group scales, as the fused layout holds them on the GPU), and the latent cache. On CUDA decode steps run the routed
//! experts through the fused INT4 kernel, which reads exactly those bytes (prefill chunks too), the dense Linears
//! through the BF16-weight GEMV kernel (f32 activations; prefill chunks through the f32-precision cuBLAS GEMM), and
//! the absorbed attention (prefill chunks too) through the model's absorption kernels and the MLA attention kernel
//! over the paged cache (`eyrie_quant::cuda::attention`: f32, no score matrix in memory). Before the splits, the copy
//! bandwidth and a launch floor (us per dependent one-element op) are measured on GPU 0. A step ends as the engine's
//! greedy step does: the next token of every sequence picked where the logits are (`sampling::device_argmax`: one
//! launch, `batch` ids read back), or, without a device kernel (the CPU) or with `--read-logits` (sessions up to 18),
//! with the whole `[batch, vocab]` logits copied to the host (655 KB a sequence at Kimi's vocabulary).
//!
//! usage: bench_decode [--splits 1x1,2x1,1x2] [--layers 2] [--batch 1,8] [--context 1024] [--steps 8] [--warmup 3]
//!                     [--json PATH] [--budget-s 600] [--device cpu --config DIR] [--compare-host-router]
//!                     [--profile-steps N] [--read-logits] [--overlap]
//! (`--overlap`, one GPU: each batch also runs as an overlapped greedy chain, the engine's way to keep the GPU busy
//! across steps: step `t + 1` is queued with its tokens embedded from step `t`'s device argmax before the host
//! waits for step `t`'s ids (`ParallelGroup::forward_batch_fed`, `sampling::pending_argmax`); first checked
//! against a host-fed greedy chain on a second cache with the same prompts (same ids at every step, else an
//! error); reported as the median time between consecutive steps' ids reaching the host)
//! (`--profile-steps N`: N more steps a batch between cuProfilerStart/Stop, for
//! `ncu --profile-from-start off --metrics gpu__time_duration.sum --csv bench_decode ...`: per-kernel GPU times of
//! decode steps alone; `scripts/ncu_step_summary.py` sums them by kernel)
//! (`--compare-host-router`: each batch's steps timed again with the MoE routing read back to the host, as before
//! the device router, in the same process)
//! (`--device cpu --config fixtures/model/yarn_qlora`: the same code on the CPU backend with a small config and
//! threads for ranks, a smoke test of this program before it spends GPU time)
//! (a split `TxE` is tensor-parallel ways x expert-parallel ways; the group has max(T, E) GPUs, from GPU 0)

use std::time::{Duration, Instant};

use burn::backend::Cuda;
use burn::backend::cuda::CudaDevice;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use eyrie_model::ModelConfig;
use eyrie_model::deepseek_v3::{BatchEntry, LogitRows};
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::parallel::{ParallelBackend, ParallelGroup, ShardSpec};

/// Seconds since the program started, for progress lines (a run cut off by a time limit still tells how far it
/// got).
fn t() -> f64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_secs_f64()
}
type Error = Box<dyn std::error::Error + Send + Sync>;

/// Says on stderr how much device memory CubeCL's pools hold on this thread's stream (in use / reserved), so a
/// run that runs out of device memory shows where the reservation grew.
fn memory_line<B: ParallelBackend>(device: &B::Device, what: &str) {
    if let Some((in_use, reserved)) = eyrie_model::cuda_ops::memory_usage::<B>(device) {
        eprintln!(
            "[{:.0} s] memory {what}: {:.2} GB in use, {:.2} GB reserved",
            t(),
            in_use as f64 / 1e9,
            reserved as f64 / 1e9
        );
    }
}

const BLOCK: usize = 64;
/// Prefill rows per forward (all sequences' chunks together): 1024 tokens per sequence, fewer when the batch is
/// large, so that a chunk's activations (queries of 64 heads x 576 f32 per row, the MoE's gathered rows) fit
/// beside 10 layers of weights.
const PREFILL_ROWS: usize = 8192;
/// Bytes a parameter of an INT4 expert on the device: half a byte of packed word, a BF16 scale per 32 (the
/// fused layout, `eyrie_model::fused_moe`).
const INT4_BYTES: f64 = 0.5 + 2.0 / 32.0;

/// Copy bandwidth on `device` (read + write bytes per second) of burn's elementwise kernel on 1 GiB.
fn copy_bandwidth<B: Backend>(device: &B::Device, n: usize) -> Result<f64, Error> {
    let x = Tensor::<B, 1>::ones([n], device);
    let mut best = f64::INFINITY;
    for _ in 0..6 {
        <B as Backend>::sync(device).map_err(|e| format!("{e:?}"))?;
        let started = Instant::now();
        let y = x.clone() * 1.5;
        <B as Backend>::sync(device).map_err(|e| format!("{e:?}"))?;
        best = best.min(started.elapsed().as_secs_f64());
        drop(y);
    }
    Ok(2.0 * 4.0 * n as f64 / best)
}

/// Microseconds per launch of a chain of 2000 dependent one-element burn ops (`y = y + 1`) between two syncs: the
/// floor one kernel launch costs in a step (host enqueue through burn and CubeCL, and the GPU's launch), against which
/// the launches per step (counted with `CUBECL_DEBUG_OPTION=profile`) give the step's launch overhead.
fn launch_floor_us<B: Backend>(device: &B::Device) -> Result<f64, Error> {
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let mut y = Tensor::<B, 1>::ones([1], device);
        <B as Backend>::sync(device).map_err(|e| format!("{e:?}"))?;
        let started = Instant::now();
        for _ in 0..2000 {
            y = y + 1.0;
        }
        <B as Backend>::sync(device).map_err(|e| format!("{e:?}"))?;
        best = best.min(started.elapsed().as_secs_f64() * 1e6 / 2000.0);
        drop(y);
    }
    Ok(best)
}

/// Bytes rank 0 reads in one decode step (see the module docs).
fn bytes_per_step(c: &ModelConfig, spec: ShardSpec, batch: usize, context: usize, dense_bytes: f64) -> f64 {
    let (d, h) = (c.hidden_size as f64, c.num_heads as f64);
    let (tp, ep) = (spec.tp as f64, spec.ep as f64);
    let q_a = d * c.q_lora_rank.unwrap_or(0) as f64;
    let q_b = c.q_lora_rank.unwrap_or(0) as f64 * h * c.qk_head_dim() as f64 / tp;
    let kv_a = d * c.kv_a_dim() as f64;
    let kv_b = c.kv_lora_rank as f64 * h * (c.qk_nope_head_dim + c.v_head_dim) as f64 / tp;
    let o = h * c.v_head_dim as f64 * d / tp;
    let attn = q_a + q_b + kv_a + kv_b + o;
    let (e, k) = (c.n_routed_experts as f64, c.num_experts_per_tok as f64);
    let distinct = e * (1.0 - (1.0 - k / e).powi(batch as i32));
    // Dense parameters (read at `dense_bytes` each) and routed-expert bytes.
    let (mut dense, mut experts) = (0.0, 0.0);
    for layer in 0..c.num_hidden_layers {
        dense += attn;
        match c.layer_kind(layer) {
            eyrie_model::config::LayerKind::Dense => dense += 3.0 * d * c.intermediate_size as f64 / tp,
            eyrie_model::config::LayerKind::Moe => {
                dense += d * e + 3.0 * d * c.shared_intermediate_size() as f64 / tp;
                experts += distinct / ep * 3.0 * d * c.moe_intermediate_size as f64 * INT4_BYTES;
            }
        }
    }
    let world = spec.tp.max(spec.ep);
    let vocab_split = spec.tp > 1 && spec.tp == world;
    dense += c.vocab_size as f64 * d / if vocab_split { tp } else { 1.0 };
    // The f32 latent cache.
    let cache = 4.0 * (batch * context * c.kv_a_dim() * c.num_hidden_layers) as f64;
    dense * dense_bytes + experts + cache
}

struct Row {
    tp: usize,
    ep: usize,
    batch: usize,
    context: usize,
    /// Median step.
    ms: f64,
    mean_ms: f64,
    max_ms: f64,
    roofline_ms: f64,
    collective_share: Option<f64>,
    gb: f64,
    prefill_s: f64,
    /// Median step with the MoE routing read back to the host (`--compare-host-router`).
    host_router_ms: Option<f64>,
    /// Median time the host takes to queue a step (until `forward_batch` returns, before the logits are read):
    /// close to `ms`, the step is bound by the host's launches; well under it, by the GPU.
    enqueue_ms: f64,
    /// `--overlap`: median and mean step of the overlapped greedy chain.
    overlap_ms: Option<(f64, f64)>,
}

/// `--read-logits`: end each step with the whole logits rows copied to the host (the step before session 19)
/// instead of the device argmax.
static READ_LOGITS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `--compare-host-router`: each batch also timed with the MoE router on the host.
static COMPARE_HOST_ROUTER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// `--profile-steps N`: N more decode steps per batch, after the timed ones, between `cuProfilerStart` and
/// `cuProfilerStop` (queue drained before and after), for `ncu --profile-from-start off`: each kernel of a decode
/// step with its own GPU time, and nothing of the weight making, the prefill or the warm-up.
static PROFILE_STEPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// `--overlap`: each batch also timed as an overlapped greedy chain: step `t + 1` is queued (its tokens embedded
/// from step `t`'s device argmax, `forward_batch_fed`) before the host waits for step `t`'s ids, after a check that
/// such a chain picks the same ids as one fed from the host.
static OVERLAP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Steps of the overlap check (each chain, on its own cache).
const OVERLAP_CHECK_STEPS: usize = 6;

/// Prefills every sequence of `seqs` with its prompt, in chunks (as the timed runs' prefill).
fn prefill<B: ParallelBackend>(
    group: &mut ParallelGroup<B>,
    cache: &mut PagedMlaCache<B>,
    seqs: &mut [SequenceCache],
    prompts: &[Vec<u32>],
    what: &str,
    device: &B::Device,
) -> Result<(), Error> {
    let (batch, context) = (seqs.len(), prompts.first().map_or(0, Vec::len));
    let chunk = (PREFILL_ROWS / batch).clamp(64, 1024);
    for start in (0..context).step_by(chunk) {
        let end = (start + chunk).min(context);
        let mut entries: Vec<BatchEntry<'_>> =
            seqs.iter_mut().zip(prompts).map(|(seq, p)| BatchEntry { seq, tokens: &p[start..end] }).collect();
        let logits = group.forward_batch(&mut entries, cache, LogitRows::Last, device)?;
        let _ = logits.into_data();
        eprintln!("[{:.0} s] {what}: prefilled {end} of {context}", t());
    }
    Ok(())
}

/// A greedy chain of `steps` decode steps from `first` (one token a sequence), each step's picks read back.
/// Overlapped (`fed`): step `t + 1` is queued with step `t`'s ids on the device before the host waits for them
/// (`sampling::pending_argmax`); otherwise each step waits for its ids and feeds them from the host. Returns the picks of
/// every step and, overlapped, the wall time between consecutive steps' ids reaching the host (`steps - 1`
/// intervals: the chain's step time once the queue is full).
fn greedy_chain<B: ParallelBackend>(
    group: &mut ParallelGroup<B>,
    cache: &mut PagedMlaCache<B>,
    seqs: &mut [SequenceCache],
    first: &[u32],
    steps: usize,
    fed: bool,
    device: &B::Device,
) -> Result<(Vec<Vec<u32>>, Vec<f64>), Error> {
    let mut picks: Vec<Vec<u32>> = Vec::with_capacity(steps);
    let mut intervals = Vec::with_capacity(steps);
    let mut pending: Option<eyrie_model::sampling::PendingPicks<B>> = None;
    let mut last: Option<Instant> = None;
    for i in 0..steps {
        let host: Vec<[u32; 1]> = match (i, picks.last()) {
            (0, _) | (_, None) => first.iter().map(|&t| [t]).collect(),
            (_, Some(p)) => p.iter().map(|&t| [t]).collect(),
        };
        // Overlapped, the host tokens of step t + 1 are step t - 1's picks (placeholders: only their count is
        // used, the embedding reads the device ids).
        let mut entries: Vec<BatchEntry<'_>> =
            seqs.iter_mut().zip(&host).map(|(seq, t)| BatchEntry { seq, tokens: t }).collect();
        let ids = pending.as_ref().map(|p| p.ids.clone());
        let logits = group.forward_batch_fed(&mut entries, cache, LogitRows::Last, device, ids.as_ref())?;
        if fed {
            let next = eyrie_model::sampling::pending_argmax(&logits)?;
            if let Some(prev) = pending.replace(next) {
                picks.push(prev.wait()?);
                let now = Instant::now();
                if let Some(l) = last.replace(now) {
                    intervals.push((now - l).as_secs_f64() * 1e3);
                }
            }
        } else {
            picks.push(eyrie_model::sampling::pending_argmax(&logits)?.wait()?);
        }
    }
    if let Some(p) = pending.take() {
        picks.push(p.wait()?);
        let now = Instant::now();
        if let Some(l) = last.replace(now) {
            intervals.push((now - l).as_secs_f64() * 1e3);
        }
    }
    Ok((picks, intervals))
}

/// Brackets `f` with the CUDA profiler's start and stop (CUDA only; on the CPU backend it just runs `f`).
fn profiled<B: Backend>(f: impl FnOnce() -> Result<(), Error>) -> Result<(), Error> {
    let cuda = eyrie_model::fused_moe::is_cuda::<B>();
    // SAFETY: plain driver calls with no arguments; a failure is reported, never UB.
    if cuda && unsafe { cudarc::driver::sys::cuProfilerStart() } != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err("cuProfilerStart failed".into());
    }
    let done = f();
    if cuda {
        // SAFETY: as above.
        let _ = unsafe { cudarc::driver::sys::cuProfilerStop() };
    }
    done
}

#[allow(clippy::too_many_arguments)]
fn run_split<B: ParallelBackend>(
    first: &B::Device,
    config: &ModelConfig,
    (tp, ep): (usize, usize),
    batches: &[usize],
    context: usize,
    (warmup, steps): (usize, usize),
    bandwidth: f64,
    deadline: Instant,
) -> Result<Vec<Row>, Error> {
    let max_batch = batches.iter().copied().max().unwrap_or(1);
    let compare = COMPARE_HOST_ROUTER.load(std::sync::atomic::Ordering::Relaxed);
    let profile = PROFILE_STEPS.load(std::sync::atomic::Ordering::Relaxed);
    let overlap = OVERLAP.load(std::sync::atomic::Ordering::Relaxed);
    let more = if overlap { steps + 1 } else { 0 };
    let blocks =
        max_batch * (context + warmup + steps * (1 + usize::from(compare)) + profile + more + 1).div_ceil(BLOCK) + 1;
    let started = Instant::now();
    eprintln!("[{:.0} s] split {tp}x{ep}: making the weights", t());
    let (mut group, device) = ParallelGroup::<B>::synthetic(config, tp, ep, first, blocks, BLOCK)?;
    eprintln!("[{:.0} s] split {tp}x{ep}: weights made in {:.1} s", t(), started.elapsed().as_secs_f64());
    memory_line::<B>(&device, "after the weights");
    let vocab = config.vocab_size;
    let mut rows = Vec::new();
    for &batch in batches {
        if Instant::now() >= deadline {
            eprintln!("split {tp}x{ep}: out of time before batch {batch}");
            break;
        }
        let mut cache = PagedMlaCache::<B>::new(config, blocks, BLOCK, &device)?;
        let mut seqs = vec![SequenceCache::default(); batch];
        let prompts: Vec<Vec<u32>> =
            (0..batch).map(|s| (0..context).map(|t| ((s * 7919 + t * 104_729) % vocab) as u32).collect()).collect();
        let prefill_started = Instant::now();
        let what = format!("split {tp}x{ep} batch {batch}");
        prefill(&mut group, &mut cache, &mut seqs, &prompts, &what, &device)?;
        let prefill_s = prefill_started.elapsed().as_secs_f64();
        memory_line::<B>(&device, &format!("batch {batch} after prefill"));
        // Returns the host's enqueue time: until the step's last launch is queued, before the logits are read.
        let mut step = |group: &mut ParallelGroup<B>, i: usize| -> Result<f64, Error> {
            let start = Instant::now();
            let tokens: Vec<[u32; 1]> = (0..batch).map(|s| [((s * 31 + i * 17) % vocab) as u32]).collect();
            let mut entries: Vec<BatchEntry<'_>> =
                seqs.iter_mut().zip(&tokens).map(|(seq, t)| BatchEntry { seq, tokens: t }).collect();
            let logits = group.forward_batch(&mut entries, &mut cache, LogitRows::Last, &device)?;
            let enqueue = start.elapsed().as_secs_f64() * 1e3;
            let picked = if READ_LOGITS.load(std::sync::atomic::Ordering::Relaxed) {
                None
            } else {
                eyrie_model::sampling::device_argmax(&logits)
            };
            match picked {
                Some(ids) => {
                    ids.map_err(|e| format!("device argmax: {e}"))?;
                }
                None => {
                    let _ = logits.into_data();
                }
            }
            Ok(enqueue)
        };
        for i in 0..warmup {
            step(&mut group, i)?;
            eprintln!("[{:.0} s] split {tp}x{ep} batch {batch}: warm-up step {i} done", t());
        }
        let before = group.time_in_collectives();
        let timed = Instant::now();
        let mut each = Vec::with_capacity(steps);
        let mut enqueue = Vec::with_capacity(steps);
        for i in 0..steps {
            let one = Instant::now();
            enqueue.push(step(&mut group, warmup + i)?);
            each.push(one.elapsed().as_secs_f64() * 1e3);
        }
        let elapsed = timed.elapsed();
        each.sort_by(f64::total_cmp);
        enqueue.sort_by(f64::total_cmp);
        let share = match (before, group.time_in_collectives()) {
            (Some((_, a)), Some((_, b))) => Some((b - a).as_secs_f64() / elapsed.as_secs_f64()),
            _ => None,
        };
        let host_router_ms = if compare {
            eyrie_model::fused_moe::set_host_router(true);
            let mut host = Vec::with_capacity(steps);
            for i in 0..steps {
                let one = Instant::now();
                let done = step(&mut group, warmup + steps + i);
                host.push(one.elapsed().as_secs_f64() * 1e3);
                if let Err(e) = done {
                    eyrie_model::fused_moe::set_host_router(false);
                    return Err(e);
                }
            }
            eyrie_model::fused_moe::set_host_router(false);
            host.sort_by(f64::total_cmp);
            Some(host[steps / 2])
        } else {
            None
        };
        let profile_steps = PROFILE_STEPS.load(std::sync::atomic::Ordering::Relaxed);
        if profile_steps > 0 {
            let first_step = warmup + steps * (1 + usize::from(compare));
            profiled::<B>(|| {
                for i in 0..profile_steps {
                    step(&mut group, first_step + i)?;
                }
                Ok(())
            })?;
            eprintln!("[{:.0} s] split {tp}x{ep} batch {batch}: {profile_steps} profiled steps done", t());
        }
        let overlap_ms = if overlap && tp * ep == 1 {
            // The check: two fresh caches with the same prompts (their first 256 tokens), one chain fed from the
            // device and overlapped, one fed from the host; their picks must be the same ids at every step.
            let short: Vec<Vec<u32>> = prompts.iter().map(|p| p[..p.len().min(256)].to_vec()).collect();
            let first: Vec<u32> = (0..batch).map(|s| ((s * 13 + 5) % vocab) as u32).collect();
            let n = OVERLAP_CHECK_STEPS;
            let mut chains = Vec::new();
            for fed in [false, true] {
                let check_blocks = batch * (256 + n + 1).div_ceil(BLOCK) + 1;
                let mut check_cache = PagedMlaCache::<B>::new(config, check_blocks, BLOCK, &device)?;
                let mut check_seqs = vec![SequenceCache::default(); batch];
                let label = format!("{what} (overlap check)");
                prefill(&mut group, &mut check_cache, &mut check_seqs, &short, &label, &device)?;
                chains.push(greedy_chain(&mut group, &mut check_cache, &mut check_seqs, &first, n, fed, &device)?.0);
            }
            let (host_fed, device_fed) = (&chains[0], &chains[1]);
            if host_fed != device_fed {
                return Err(format!(
                    "{what}: the overlapped chain picked {device_fed:?}, the host-fed chain {host_fed:?}"
                )
                .into());
            }
            eprintln!("[{:.0} s] {what}: overlapped chain picks = host-fed chain picks over {n} steps", t());
            let start = first;
            let timed = Instant::now();
            let (_, mut intervals) = greedy_chain(&mut group, &mut cache, &mut seqs, &start, steps + 1, true, &device)?;
            let total = timed.elapsed().as_secs_f64() * 1e3;
            intervals.sort_by(f64::total_cmp);
            let median = intervals.get(intervals.len() / 2).copied().unwrap_or(f64::NAN);
            // The mean over the whole chain, its first (unoverlapped) step included, per step after the first.
            let mean = total / (steps + 1) as f64;
            eprintln!("[{:.0} s] {what}: overlapped {median:.3} ms/step median, {mean:.3} mean", t());
            Some((median, mean))
        } else {
            None
        };
        let spec = ShardSpec { rank: 0, tp, ep };
        // Dense weights: BF16 on CUDA (the synthetic ones are BF16 values, as a checkpoint's), f32 on the CPU.
        let dense_bytes = if eyrie_model::fused_moe::is_cuda::<B>() { 2.0 } else { 4.0 };
        let bytes = bytes_per_step(config, spec, batch, context + warmup + steps / 2, dense_bytes);
        let row = Row {
            tp,
            ep,
            batch,
            context,
            ms: each[steps / 2],
            mean_ms: elapsed.as_secs_f64() * 1e3 / steps as f64,
            max_ms: each[steps - 1],
            roofline_ms: bytes / bandwidth * 1e3,
            collective_share: share,
            gb: bytes / 1e9,
            prefill_s,
            host_router_ms,
            enqueue_ms: enqueue[steps / 2],
            overlap_ms,
        };
        eprintln!(
            "[{:.0} s] split {tp}x{ep} batch {batch}: {:.1} ms/step median, {:.1} mean, {:.1} max (roofline {:.2} ms), prefill {:.1} s",
            t(),
            row.ms,
            row.mean_ms,
            row.max_ms,
            row.roofline_ms,
            prefill_s
        );
        memory_line::<B>(&device, &format!("batch {batch} after the steps"));
        rows.push(row);
    }
    drop(group);
    // Rank 0's memory back to the device (the workers give theirs back as they exit).
    B::memory_cleanup(&device);
    Ok(rows)
}

/// What every split of one invocation shares.
struct Run<'a> {
    config: &'a ModelConfig,
    batches: &'a [usize],
    context: usize,
    warmup: usize,
    steps: usize,
    deadline: Instant,
}

impl Run<'_> {
    /// Measures the copy bandwidth on `first` (`n` f32), then every split; rows and failures.
    #[allow(clippy::type_complexity)]
    fn all<B: ParallelBackend>(
        &self,
        first: &B::Device,
        splits: &[(usize, usize)],
        n: usize,
    ) -> Result<(f64, (Vec<Row>, Vec<String>)), Error> {
        let bandwidth = copy_bandwidth::<B>(first, n)?;
        eprintln!("[{:.0} s] copy bandwidth on the first device: {:.0} GB/s", t(), bandwidth / 1e9);
        let floor = launch_floor_us::<B>(first)?;
        let _ = LAUNCH_US.set(floor);
        eprintln!("[{:.0} s] launch floor: {floor:.1} us per dependent one-element op", t());
        let (mut rows, mut failures) = (Vec::new(), Vec::new());
        for &split in splits {
            if Instant::now() >= self.deadline {
                failures.push(format!("{}x{}: not run, out of time", split.0, split.1));
                continue;
            }
            let (c, b) = (self.config, self.batches);
            match run_split::<B>(first, c, split, b, self.context, (self.warmup, self.steps), bandwidth, self.deadline)
            {
                Ok(r) => rows.extend(r),
                Err(e) => failures.push(format!("{}x{}: {e}", split.0, split.1)),
            }
            // After every split, so that a run cut off by a time limit keeps what it measured.
            if let Some(path) = JSON.get() {
                write_json(path, self.config.num_hidden_layers, self.steps, bandwidth, &rows, &failures)?;
            }
        }
        Ok((bandwidth, (rows, failures)))
    }
}

/// The launch floor measured on the first device (`launch_floor_us`).
static LAUNCH_US: std::sync::OnceLock<f64> = std::sync::OnceLock::new();

/// Where the JSON goes (set once from `--json`).
static JSON: std::sync::OnceLock<String> = std::sync::OnceLock::new();

fn write_json(
    path: &str,
    layers: usize,
    steps: usize,
    bandwidth: f64,
    rows: &[Row],
    failures: &[String],
) -> Result<(), Error> {
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({"tp": r.tp, "ep": r.ep, "gpus": r.tp.max(r.ep), "batch": r.batch,
                "context": r.context, "ms_per_step": r.ms, "mean_ms": r.mean_ms, "max_ms": r.max_ms, "rank0_gb_per_step": r.gb,
                "roofline_ms": r.roofline_ms, "collective_share": r.collective_share, "prefill_s": r.prefill_s,
                "host_router_ms_per_step": r.host_router_ms, "host_enqueue_ms": r.enqueue_ms,
                "overlapped_ms_per_step": r.overlap_ms.map(|o| o.0), "overlapped_mean_ms": r.overlap_ms.map(|o| o.1)})
        })
        .collect();
    let doc = serde_json::json!({"model": "Kimi-K2 slice, synthetic weights (INT4 routed experts; dense weights BF16 values, held BF16 on CUDA)", "layers": layers,
        "steps": steps, "copy_bandwidth_gb_s": bandwidth / 1e9, "launch_floor_us": LAUNCH_US.get(),
        "step_ends_with": step_end(), "rows": rows,
        "failures": failures});
    std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")?;
    Ok(())
}

/// How a timed step ends (in the table's caption and the JSON).
fn step_end() -> &'static str {
    if READ_LOGITS.load(std::sync::atomic::Ordering::Relaxed) {
        "the logits rows read back (--read-logits)"
    } else {
        "the device argmax (ids read back; the logits rows where there is no device kernel)"
    }
}

fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let (mut splits, mut layers, mut batches) = ("1x1,2x1,1x2".to_string(), 2usize, vec![1usize, 8]);
    let (mut context, mut steps, mut json, mut budget) = (1024usize, 8usize, None, Duration::from_secs(600));
    let mut warmup = 3usize;
    let (mut cpu, mut config_dir) = (false, None::<String>);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| Error::from(format!("{a} needs a value")));
        match a.as_str() {
            "--splits" => splits = value()?,
            "--layers" => layers = value()?.parse()?,
            "--batch" => batches = value()?.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--context" => context = value()?.parse()?,
            "--steps" => steps = value()?.parse()?,
            "--warmup" => warmup = value()?.parse()?,
            "--json" => json = Some(value()?),
            "--budget-s" => budget = Duration::from_secs(value()?.parse()?),
            "--device" => cpu = value()? == "cpu",
            "--config" => config_dir = Some(value()?),
            "--compare-host-router" => COMPARE_HOST_ROUTER.store(true, std::sync::atomic::Ordering::Relaxed),
            "--read-logits" => READ_LOGITS.store(true, std::sync::atomic::Ordering::Relaxed),
            "--overlap" => OVERLAP.store(true, std::sync::atomic::Ordering::Relaxed),
            "--profile-steps" => PROFILE_STEPS.store(value()?.parse()?, std::sync::atomic::Ordering::Relaxed),
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let deadline = Instant::now() + budget;
    if let Some(path) = &json {
        let _ = JSON.set(path.clone());
    }
    let splits: Vec<(usize, usize)> = splits
        .split(',')
        .map(|s| {
            let (t, e) = s.split_once('x').ok_or_else(|| format!("--splits: {s:?} is not TxE"))?;
            Ok::<_, Error>((t.parse()?, e.parse()?))
        })
        .collect::<Result<_, _>>()?;
    if layers < 2 || steps == 0 || context == 0 {
        return Err("--layers >= 2 (one dense, then MoE), --steps and --context >= 1".into());
    }
    let config = match &config_dir {
        None => eyrie_model::synthetic::kimi_k2_config(layers)?,
        Some(dir) => ModelConfig::from_dir(dir)?,
    };
    t();
    let run = Run { config: &config, batches: &batches, context, warmup, steps, deadline };
    let (bandwidth, outcomes) = if cpu {
        run.all::<burn::backend::Flex>(&Default::default(), &splits, 1 << 24)?
    } else {
        run.all::<Cuda>(&CudaDevice::new(0), &splits, 1 << 28)?
    };
    let (rows, failures) = outcomes;
    println!(
        "\n{} layers, hidden {}, {} routed experts (INT4), dense weights BF16 on CUDA, context {context}, {warmup} warm-up and {steps} timed steps (median shown), each ending with {}; copy bandwidth {:.0} GB/s; launch floor {:.1} us",
        config.num_hidden_layers,
        config.hidden_size,
        config.n_routed_experts,
        step_end(),
        bandwidth / 1e9,
        LAUNCH_US.get().copied().unwrap_or(f64::NAN)
    );
    println!(
        "| tp | ep | GPUs | batch | ms/step | rank-0 bytes/step | roofline ms | x roofline | in collectives | prefill s | host enqueue ms | host-router ms/step | overlapped ms/step (x roofline) |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!(
            "| {} | {} | {} | {} | {:.3} | {:.1} GB | {:.3} | {:.3} | {} | {:.1} | {:.1} | {} | {} |",
            r.tp,
            r.ep,
            r.tp.max(r.ep),
            r.batch,
            r.ms,
            r.gb,
            r.roofline_ms,
            r.ms / r.roofline_ms,
            r.collective_share.map_or("-".into(), |s| format!("{:.0}%", 100.0 * s)),
            r.prefill_s,
            r.enqueue_ms,
            r.host_router_ms.map_or("-".into(), |v| format!("{v:.1}")),
            r.overlap_ms.map_or("-".into(), |(m, _)| format!("{m:.3} ({:.3})", m / r.roofline_ms))
        );
    }
    for f in &failures {
        eprintln!("FAILED: {f}");
    }
    if let Some(path) = &json {
        write_json(path, config.num_hidden_layers, steps, bandwidth, &rows, &failures)?;
    }
    if failures.is_empty() { Ok(()) } else { std::process::exit(1) }
}
