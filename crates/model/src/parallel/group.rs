//! One process driving a whole tensor x expert parallel group ([`ParallelGroup`]): rank 0 runs in the caller's
//! thread (the server's engine thread) and owns the KV-cache bookkeeping; ranks 1.. run in worker threads the
//! group owns, each with its shard, its device and its own latent cache of the same geometry.
//!
//! A batched step: rank 0 validates the batch and reserves its pages (so nothing that can fail on bad input
//! happens after the workers start), sends every worker the batch with rank 0's page tables, and all ranks run
//! [`ShardedDeepseekV3::forward_batch`] together; the workers write their latents at the same page ids, so every
//! rank's cache holds the same tokens at the same places and rank 0's prefix cache, truncation and eviction stay
//! valid for all. Rank 0 returns the logits.
//!
//! Failure: a rank whose step fails (or panics) leaves the group: its communicator is dropped, so the other
//! ranks' collectives fail instead of waiting for it, and the group answers every later step with the first
//! failure. Dropping the group stops and joins the workers.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use super::comm::{Communicator, LocalCommunicator};
use super::model::ShardedDeepseekV3;
use super::shard::ShardSpec;
use crate::config::ModelConfig;
use crate::deepseek_v3::{BatchEntry, LogitRows};
use crate::error::{ModelError, Result};
use crate::kv_cache::{PagedMlaCache, SequenceCache};

/// A communicator of any kind, as the group holds them.
pub type BoxedCommunicator<B> = Box<dyn Communicator<B> + Send>;

impl<B: Backend> Communicator<B> for BoxedCommunicator<B> {
    fn rank(&self) -> usize {
        (**self).rank()
    }

    fn world_size(&self) -> usize {
        (**self).world_size()
    }

    fn all_reduce_sum(&self, t: Tensor<B, 2>) -> Result<Tensor<B, 2>> {
        (**self).all_reduce_sum(t)
    }

    fn all_gather(&self, t: Tensor<B, 2>, dim: usize) -> Result<Tensor<B, 2>> {
        (**self).all_gather(t, dim)
    }

    fn all_to_all(&self, parts: Vec<Tensor<B, 2>>) -> Result<Vec<Tensor<B, 2>>> {
        (**self).all_to_all(parts)
    }

    fn time_in_collectives(&self) -> Option<(u64, std::time::Duration)> {
        (**self).time_in_collectives()
    }
}

/// Backends a [`ParallelGroup`] can span: how to make a group's communicators and rank devices.
pub trait ParallelBackend: Backend {
    /// `world` communicators in rank order with each rank's device, rank 0 on `first`.
    fn group(world: usize, first: &Self::Device) -> Result<Vec<(BoxedCommunicator<Self>, Self::Device)>>;
}

/// The CPU: every rank on the one CPU device, exchanging through host memory.
impl ParallelBackend for burn::backend::Flex {
    fn group(world: usize, first: &Self::Device) -> Result<Vec<(BoxedCommunicator<Self>, Self::Device)>> {
        Ok(LocalCommunicator::group(world)
            .into_iter()
            .map(|c| (Box::new(c) as BoxedCommunicator<Self>, *first))
            .collect())
    }
}

/// CUDA: rank `r` on device `first + r`, NCCL between them.
#[cfg(feature = "cuda")]
impl ParallelBackend for burn::backend::Cuda {
    fn group(world: usize, first: &Self::Device) -> Result<Vec<(BoxedCommunicator<Self>, Self::Device)>> {
        #[cfg(feature = "nccl")]
        {
            let devices: Vec<usize> = (first.index..first.index + world).collect();
            Ok(super::nccl::NcclCommunicator::group(&devices)?
                .into_iter()
                .map(|c| {
                    let device = c.device();
                    (Box::new(c) as BoxedCommunicator<Self>, device)
                })
                .collect())
        }
        #[cfg(not(feature = "nccl"))]
        {
            let _ = (world, first);
            Err(ModelError::Collective {
                op: "init",
                rank: 0,
                message: "this build has no NCCL support (feature `nccl` of eyrie-model)".into(),
            })
        }
    }
}

/// What a worker is asked to do.
enum Job {
    /// A step as the workers get it: rank 0's page tables after reservation, and the new tokens; `fed`: embed the
    /// picks the worker kept from its previous step instead of the tokens; `keep`: keep this step's picks (the
    /// argmax of its logits) on the worker's device (see [`ParallelGroup::forward_batch_chained`]).
    Step { entries: Vec<(SequenceCache, Vec<u32>)>, rows: LogitRows, fed: bool, keep: bool },
    /// Every attention launch shape once over the rank's cache ([`ParallelGroup::warm_up_attention`]).
    WarmUpAttention,
}

/// On CUDA, launches every attention shape of this rank's heads once over its cache (each device compiles its own
/// kernels); the number of shapes, or `None` elsewhere.
fn warm_up_rank<B: Backend>(cache: &PagedMlaCache<B>, config: &ModelConfig, spec: ShardSpec) -> Result<Option<usize>> {
    #[cfg(feature = "cuda")]
    if let Some(shapes) = cache.warm_up_attention(config.num_heads / spec.tp.max(1), config.kv_lora_rank) {
        return shapes.map(Some).map_err(|message| ModelError::Collective { op: "warm-up", rank: spec.rank, message });
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (cache, config, spec);
    Ok(None)
}

struct Worker {
    rank: usize,
    jobs: Option<Sender<Job>>,
    done: Receiver<Result<()>>,
    thread: Option<JoinHandle<()>>,
}

/// A tensor x expert parallel model spread over the devices of one process (see the module docs).
pub struct ParallelGroup<B: Backend> {
    shard: ShardedDeepseekV3<B>,
    comm: Option<BoxedCommunicator<B>>,
    workers: Vec<Worker>,
    /// The first failure; the group refuses every step after it.
    broken: Option<String>,
    /// Rows of the picks every worker kept from the last step ([`Self::forward_batch_chained`]); `None` after any
    /// other step.
    kept: Option<usize>,
}

impl<B: Backend> std::fmt::Debug for ParallelGroup<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParallelGroup")
            .field("spec", &self.shard.spec)
            .field("workers", &self.workers.len())
            .field("broken", &self.broken)
            .finish_non_exhaustive()
    }
}

/// Where the ranks get their weights.
#[derive(Debug, Clone)]
enum Source {
    /// A checkpoint directory.
    Dir(PathBuf),
    /// Synthetic weights of this config's shapes (benchmarks).
    Synthetic(Box<ModelConfig>),
}

impl Source {
    fn shard<B: Backend>(&self, spec: ShardSpec, device: &B::Device) -> Result<ShardedDeepseekV3<B>> {
        match self {
            Source::Dir(dir) => ShardedDeepseekV3::load(dir, spec.rank, spec.tp, spec.ep, device),
            Source::Synthetic(config) => ShardedDeepseekV3::synthetic(config, spec, device),
        }
    }
}

impl<B: ParallelBackend> ParallelGroup<B> {
    /// [`Self::load`] with synthetic weights of `config`'s shapes (see [`crate::synthetic`]): a full-width model
    /// on real devices without a checkpoint, for benchmarks.
    pub fn synthetic(
        config: &ModelConfig,
        tp: usize,
        ep: usize,
        first: &B::Device,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<(Self, B::Device)> {
        Self::start(Source::Synthetic(Box::new(config.clone())), config, tp, ep, first, num_blocks, block_size)
    }

    /// Loads every rank's shard of the checkpoint in `dir` for `tp`-way tensor and `ep`-way expert parallelism,
    /// all ranks at once, each onto its own device (rank 0 on `first`, the others as [`ParallelBackend::group`]
    /// places them); each worker gets a latent cache of `num_blocks` x `block_size` tokens (rank 0's cache is the
    /// caller's, of the same geometry). Returns the group and rank 0's device.
    pub fn load(
        dir: impl AsRef<Path>,
        tp: usize,
        ep: usize,
        first: &B::Device,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<(Self, B::Device)> {
        let dir = dir.as_ref().to_path_buf();
        let config = ModelConfig::from_dir(&dir)?;
        Self::start(Source::Dir(dir), &config, tp, ep, first, num_blocks, block_size)
    }

    fn start(
        source: Source,
        config: &ModelConfig,
        tp: usize,
        ep: usize,
        first: &B::Device,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<(Self, B::Device)> {
        let spec0 = ShardSpec { rank: 0, tp, ep };
        spec0.validate(config)?;
        let members = B::group(spec0.world(), first)?;
        if members.len() != spec0.world() {
            return Err(ModelError::Collective {
                op: "init",
                rank: 0,
                message: format!("{} communicators made for a group of {}", members.len(), spec0.world()),
            });
        }
        let mut members = members.into_iter();
        let Some((comm0, device0)) = members.next() else {
            return Err(ModelError::Collective { op: "init", rank: 0, message: "a group without rank 0".into() });
        };
        let workers = members
            .enumerate()
            .map(|(i, (comm, device))| {
                spawn_worker::<B>(WorkerSetup {
                    source: source.clone(),
                    spec: ShardSpec { rank: i + 1, tp, ep },
                    comm,
                    device,
                    num_blocks,
                    block_size,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let shard = source.shard(spec0, &device0);
        let mut group = Self { shard: shard?, comm: Some(comm0), workers, broken: None, kept: None };
        // Every worker reports its load.
        for w in &mut group.workers {
            let outcome = w.done.recv().unwrap_or_else(|_| Err(worker_gone(w.rank)));
            if let Err(e) = outcome {
                return Err(ModelError::Collective {
                    op: "load",
                    rank: w.rank,
                    message: format!("rank {} could not load its shard: {e}", w.rank),
                });
            }
        }
        Ok((group, device0))
    }
}

impl<B: Backend> ParallelGroup<B> {
    /// The whole model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.shard.config
    }

    /// Rank 0's collectives so far and the time spent in them (NCCL measures it; `None` otherwise).
    pub fn time_in_collectives(&self) -> Option<(u64, std::time::Duration)> {
        self.comm.as_ref().and_then(|c| c.time_in_collectives())
    }

    /// The group's layout (rank 0's spec).
    pub fn spec(&self) -> ShardSpec {
        self.shard.spec
    }

    /// One batched step of the whole group, as [`crate::DeepseekV3::forward_batch`] (same arguments, validation
    /// and result; `cache` is rank 0's, whose pages the workers mirror).
    pub fn forward_batch(
        &mut self,
        batch: &mut [BatchEntry<'_>],
        cache: &mut PagedMlaCache<B>,
        rows: LogitRows,
        device: &B::Device,
    ) -> Result<Tensor<B, 2>> {
        self.forward_batch_fed(batch, cache, rows, device, None)
    }

    /// [`Self::forward_batch`] embedding the token ids `fed` holds on rank 0's device (see
    /// [`ShardedDeepseekV3::forward_batch_fed`]): a one-rank group only (the workers get their tokens from the host;
    /// a greedy chain over more ranks is [`Self::forward_batch_chained`]).
    ///
    /// # Errors
    /// As [`Self::forward_batch`]; `fed` given to a group of more than one rank, or of the wrong length.
    pub fn forward_batch_fed(
        &mut self,
        batch: &mut [BatchEntry<'_>],
        cache: &mut PagedMlaCache<B>,
        rows: LogitRows,
        device: &B::Device,
        fed: Option<&Tensor<B, 1, Int>>,
    ) -> Result<Tensor<B, 2>> {
        if fed.is_some() && !self.workers.is_empty() {
            return Err(ModelError::Input {
                message: format!(
                    "token ids fed from the device need a one-rank group (or forward_batch_chained); this one has {} \
                     ranks",
                    self.workers.len() + 1
                ),
            });
        }
        self.step(batch, cache, rows, device, fed, false)
    }

    /// A step of an overlapped greedy chain over a group of any size: each worker takes the argmax of its own
    /// logits (rank 0's, bit for bit: every rank ends the step with the same logits) and keeps the ids on its
    /// device; with `fed` (rank 0's picks of the previous chained step, on its device), rank 0 embeds `fed` and
    /// every worker the ids it kept, so no rank waits for the host between the steps. Rank 0's own picks are the
    /// caller's (`sampling::pending_argmax` of the logits returned).
    ///
    /// # Errors
    /// As [`Self::forward_batch`]; `fed` of the wrong length, or given when the previous step was not a chained step
    /// of that many rows (nothing runs then).
    pub fn forward_batch_chained(
        &mut self,
        batch: &mut [BatchEntry<'_>],
        cache: &mut PagedMlaCache<B>,
        rows: LogitRows,
        device: &B::Device,
        fed: Option<&Tensor<B, 1, Int>>,
    ) -> Result<Tensor<B, 2>> {
        if let Some(f) = fed
            && !self.workers.is_empty()
            && self.kept != Some(f.dims()[0])
        {
            return Err(ModelError::Input {
                message: format!(
                    "fed token ids of {} rows, but the workers hold {} from the previous step",
                    f.dims()[0],
                    self.kept.map_or("no picks".to_string(), |k| format!("picks of {k} rows"))
                ),
            });
        }
        self.step(batch, cache, rows, device, fed, true)
    }

    fn step(
        &mut self,
        batch: &mut [BatchEntry<'_>],
        cache: &mut PagedMlaCache<B>,
        rows: LogitRows,
        device: &B::Device,
        fed: Option<&Tensor<B, 1, Int>>,
        keep: bool,
    ) -> Result<Tensor<B, 2>> {
        if let Some(why) = &self.broken {
            return Err(ModelError::Collective {
                op: "step",
                rank: 0,
                message: format!("the parallel group stopped after a failure: {why}"),
            });
        }
        // Everything that can fail on the input fails here, before any rank starts.
        if batch.is_empty() || batch.iter().any(|e| e.tokens.is_empty()) {
            return Err(ModelError::Input { message: "a batched step needs at least one token per sequence".into() });
        }
        let vocab = self.shard.config.vocab_size;
        if let Some(&bad) = batch.iter().flat_map(|e| e.tokens.iter()).find(|&&t| t as usize >= vocab) {
            return Err(ModelError::Input {
                message: format!("token id {bad} is outside the vocabulary (size {vocab})"),
            });
        }
        let n: usize = batch.iter().map(|e| e.tokens.len()).sum();
        crate::deepseek_v3::check_fed(fed, n)?;
        cache.reserve_batch(batch.iter_mut().map(|e| (&mut *e.seq, e.tokens.len())))?;
        let entries: Vec<(SequenceCache, Vec<u32>)> =
            batch.iter().map(|e| (e.seq.clone(), e.tokens.to_vec())).collect();
        let mut failure = None;
        for w in &self.workers {
            let job = Job::Step { entries: entries.clone(), rows, fed: fed.is_some(), keep };
            let sent = w.jobs.as_ref().is_some_and(|j| j.send(job).is_ok());
            if !sent {
                failure.get_or_insert_with(|| worker_gone(w.rank).to_string());
            }
        }
        let mine = match &failure {
            Some(why) => Err(ModelError::Collective { op: "step", rank: 0, message: why.clone() }),
            None => match self.comm.as_ref() {
                Some(comm) => {
                    let shard = &self.shard;
                    catch_unwind(AssertUnwindSafe(|| shard.forward_batch_fed(batch, cache, rows, comm, device, fed)))
                        .unwrap_or_else(|_| {
                            Err(ModelError::Collective { op: "step", rank: 0, message: "rank 0 panicked".into() })
                        })
                }
                None => {
                    Err(ModelError::Collective { op: "step", rank: 0, message: "rank 0 has left the group".into() })
                }
            },
        };
        if let Err(e) = &mine {
            failure.get_or_insert_with(|| format!("rank 0: {e}"));
            // Leave the group so that no worker waits for rank 0 in a collective.
            self.comm = None;
        }
        self.kept = None;
        self.join_workers("step", failure)?;
        let logits = mine?;
        if keep {
            self.kept = Some(logits.dims()[0]);
        }
        Ok(logits)
    }
}

impl<B: Backend> ParallelGroup<B> {
    /// Launches every attention shape of each rank's heads once, on every rank over its own cache (`cache` is rank
    /// 0's, as in [`Self::forward_batch`]): a server's warm-up on CUDA, where each device compiles its own kernels
    /// at their first launch. Returns rank 0's number of shapes, `None` on backends that compile nothing.
    ///
    /// # Errors
    /// A rank's launcher or device error; the group then refuses later steps, as after a failed step.
    pub fn warm_up_attention(&mut self, cache: &PagedMlaCache<B>) -> Result<Option<usize>> {
        if let Some(why) = &self.broken {
            return Err(ModelError::Collective {
                op: "warm-up",
                rank: 0,
                message: format!("the parallel group stopped after a failure: {why}"),
            });
        }
        let mut failure = None;
        for w in &self.workers {
            if w.jobs.as_ref().is_none_or(|j| j.send(Job::WarmUpAttention).is_err()) {
                failure.get_or_insert_with(|| worker_gone(w.rank).to_string());
            }
        }
        let mine = warm_up_rank(cache, &self.shard.config, self.shard.spec);
        if let Err(e) = &mine {
            failure.get_or_insert_with(|| format!("rank 0: {e}"));
        }
        self.join_workers("warm-up", failure)?;
        mine
    }

    /// Waits for every worker that was sent a job; on the first failure (`failure`, or a worker's) breaks the
    /// group (rank 0 leaves, the job channels close) so that later calls are refused, and returns it as `op`'s.
    fn join_workers(&mut self, op: &'static str, mut failure: Option<String>) -> Result<()> {
        for w in &self.workers {
            if w.jobs.is_none() {
                continue;
            }
            match w.done.recv() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    failure.get_or_insert_with(|| format!("rank {}: {e}", w.rank));
                }
                Err(_) => {
                    failure.get_or_insert_with(|| worker_gone(w.rank).to_string());
                }
            }
        }
        if let Some(why) = failure {
            self.comm = None;
            for w in &mut self.workers {
                w.jobs = None;
            }
            self.broken = Some(why.clone());
            return Err(ModelError::Collective { op, rank: 0, message: why });
        }
        Ok(())
    }
}

impl<B: Backend> Drop for ParallelGroup<B> {
    fn drop(&mut self) {
        // Rank 0 leaves first, so a worker inside a collective fails instead of waiting; closing the job
        // channels ends the workers' loops.
        self.comm = None;
        for w in &mut self.workers {
            w.jobs = None;
        }
        for w in &mut self.workers {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

fn worker_gone(rank: usize) -> ModelError {
    ModelError::Collective { op: "step", rank, message: format!("rank {rank}'s thread ended (it panicked or left)") }
}

struct WorkerSetup<B: Backend> {
    source: Source,
    spec: ShardSpec,
    comm: BoxedCommunicator<B>,
    device: B::Device,
    num_blocks: usize,
    block_size: usize,
}

fn spawn_worker<B: Backend>(setup: WorkerSetup<B>) -> Result<Worker> {
    let rank = setup.spec.rank;
    let (jobs, job_rx) = channel::<Job>();
    let (done_tx, done) = channel::<Result<()>>();
    let thread = std::thread::Builder::new()
        .name(format!("eyrie-rank-{rank}"))
        .spawn(move || worker_loop(setup, job_rx, done_tx))
        .map_err(|e| ModelError::Collective {
            op: "load",
            rank,
            message: format!("cannot start rank {rank}'s thread: {e}"),
        })?;
    Ok(Worker { rank, jobs: Some(jobs), done, thread: Some(thread) })
}

fn worker_loop<B: Backend>(setup: WorkerSetup<B>, jobs: Receiver<Job>, done: Sender<Result<()>>) {
    let device = setup.device.clone();
    worker_steps(setup, jobs, done);
    // The shard and its cache are gone: give the device memory they used back (CubeCL keeps freed buffers in
    // its pools otherwise, and a later group on the same GPU may need the room in other sizes).
    B::memory_cleanup(&device);
}

fn worker_steps<B: Backend>(setup: WorkerSetup<B>, jobs: Receiver<Job>, done: Sender<Result<()>>) {
    let WorkerSetup { source, spec, comm, device, num_blocks, block_size } = setup;
    let loaded = catch_unwind(AssertUnwindSafe(|| -> Result<_> {
        let shard = source.shard::<B>(spec, &device)?;
        let cache = PagedMlaCache::<B>::new(&shard.config, num_blocks, block_size, &device)?;
        Ok((shard, cache))
    }));
    let (shard, mut cache) = match loaded {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            drop(comm);
            let _ = done.send(Err(e));
            return;
        }
        Err(_) => {
            drop(comm);
            let _ = done.send(Err(ModelError::Collective {
                op: "load",
                rank: spec.rank,
                message: "panicked while loading".into(),
            }));
            return;
        }
    };
    if done.send(Ok(())).is_err() {
        return;
    }
    // The picks of the last step, when it was asked to keep them (`Job::Step::keep`).
    let mut kept: Option<Tensor<B, 1, Int>> = None;
    while let Ok(job) = jobs.recv() {
        let outcome = catch_unwind(AssertUnwindSafe(|| match job {
            Job::Step { mut entries, rows, fed, keep } => {
                let mut batch: Vec<BatchEntry<'_>> =
                    entries.iter_mut().map(|(seq, tokens)| BatchEntry { seq, tokens }).collect();
                let ids = kept.take();
                if fed && ids.is_none() {
                    return Err(ModelError::Input { message: "fed picks, but this rank kept none".into() });
                }
                let logits = shard.forward_batch_fed(
                    &mut batch,
                    &mut cache,
                    rows,
                    &comm,
                    &device,
                    ids.as_ref().filter(|_| fed),
                )?;
                if keep {
                    let ids = crate::sampling::argmax_ids(&logits).map_err(|message| ModelError::Collective {
                        op: "step",
                        rank: spec.rank,
                        message,
                    })?;
                    kept = Some(ids);
                }
                Ok(())
            }
            Job::WarmUpAttention => warm_up_rank(&cache, &shard.config, spec).map(|_| ()),
        }))
        .unwrap_or_else(|_| {
            Err(ModelError::Collective { op: "step", rank: spec.rank, message: "panicked during a step".into() })
        });
        let failed = outcome.is_err();
        if done.send(outcome).is_err() || failed {
            // Leave the group: the other ranks' collectives fail instead of waiting for this one.
            return;
        }
    }
}
