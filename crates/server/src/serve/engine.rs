//! The engine: one OS thread that owns the model and the paged KV cache and runs iteration-level continuous
//! batching (Orca, OSDI '22; vLLM's scheduler): every step it admits queued requests while KV blocks allow, builds
//! one batch of decode rows (one token per running sequence) plus prefill chunks (`--chunked-prefill-size` tokens
//! per step at most), runs one [`DeepseekV3::forward_batch`], samples every sequence whose input is complete, and
//! streams each token to its request's channel.
//!
//! Invariants:
//! - every admitted sequence's KV blocks are released exactly once: at finish, on cancellation (checked before
//!   each step: a client that disconnects frees its pages within one step), on preemption, or when its step fails;
//! - prompts start on the longest cached prefix of an earlier prompt (block granularity) and register their full
//!   blocks when they finish, so shared system prompts are computed once;
//! - when a step needs more blocks than are free, the most recently admitted sequence is preempted: its pages are
//!   freed and it re-enters the queue front with its generated tokens, to be recomputed (nothing already streamed
//!   changes: sampling resumes with the same generator state);
//! - a panic inside a step fails only that step's requests (their pages are freed); the engine keeps serving;
//! - with an EAGLE-3 drafter (`--speculative-*`), decode rows run through [`SpecDecoder::step`] (draft, one target
//!   forward over every sequence's draft, lossless acceptance, KV rollback) and prompts through
//!   [`SpecDecoder::prefill_chunks`]; a step may emit several tokens per sequence, each checked for stop conditions
//!   in order (tokens past a stop are dropped), and a preempted sequence resumes by recomputing prompt and output;
//! - with `--tp-size` / `--ep-size` the model is a [`ParallelGroup`]: this thread is rank 0 and owns the page
//!   tables; the other ranks run in the group's threads on their own devices and mirror every step's pages;
//! - overlap scheduling (SGLang's overlap scheduler, vLLM's async scheduling; off with
//!   `--disable-overlap-schedule`): a step whose rows are all greedy decode rows (no penalties, no logprobs; on CUDA
//!   with the device picks on) leaves its picks on the device ([`PendingPicks`]); before the host reads them, the
//!   next step of the same rows is queued with those picks embedded on the device
//!   ([`DeepseekV3::forward_batch_fed`]), so the device runs step `t + 1` while the host streams step `t`'s tokens.
//!   Only when every running sequence is such a row, in the same order, none ends by length at the pick in flight,
//!   and the blocks are free; otherwise the picks are read first and the step is planned as usual. A sequence that a
//!   stop token or a cancellation ends meanwhile drops its pick of the step already queued (the cache row that
//!   step writes is the stop token's own and lies in pages freed in stream order), so outputs are those of the
//!   plain schedule. In a tensor / expert parallel group every worker keeps its own picks of its (identical)
//!   logits and embeds them in the next step (`ParallelGroup::forward_batch_chained`).

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

use burn::tensor::backend::Backend;
use eyrie_model::DeepseekV3;
use eyrie_model::deepseek_v3::{BatchEntry, LogitRows};
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::parallel::ParallelGroup;
use eyrie_model::sampling::{PendingPicks, Sampler, SamplingParams, log_softmax, pending_argmax, top_n};
use eyrie_spec_decode::{Eagle3Drafter, Eagle3State, SpecDecoder, SpecSequence};
use tokio::sync::mpsc::UnboundedSender;

use super::metrics::{EngineGauges, Metrics};
use crate::run_model::to_host;
use crate::self_checks::panic_message;

// The warm-up and the device self-checks: `impl Engine` continued.
#[path = "engine_warm_up.rs"]
mod warm_up;

// Overlap scheduling's steps: `impl Engine` continued.
#[path = "engine_overlap.rs"]
mod overlap;

/// What a plain step's forward hands the picking: the last logits row of every planned sequence on the host, or,
/// when every row is greedy and the device picked, one token id a row.
enum StepLogits {
    /// `[rows, vocab]`, row-major.
    Rows(Vec<f32>),
    /// The argmax of each row.
    Ids(Vec<u32>),
}

/// Scheduler limits.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most sequences admitted at once.
    pub max_running: usize,
    /// KV-cache capacity in tokens (rounded up to whole blocks).
    pub max_total_tokens: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most prompt tokens computed in one step (decode rows come first).
    pub chunked_prefill: usize,
    /// Longest prompt + completion of one sequence.
    pub context_length: usize,
    /// Overlap scheduling (module docs): a step of greedy decode rows is queued before the previous step's picks
    /// are read, fed with them on the device.
    pub overlap: bool,
}

/// What one request asks of the engine.
#[derive(Debug, Clone)]
pub struct EngineParams {
    pub sampling: SamplingParams,
    /// Completion tokens at most (already capped by the context length).
    pub max_tokens: usize,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// `Some(k)`: each token's log-probability plus the `k` best alternatives.
    pub logprobs: Option<usize>,
}

/// A token's log-probability under the model's raw distribution, and the best alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence or stop token.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// The client went away or the server is shutting down.
    Cancelled,
}

/// What the engine sends back for a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token {
        id: u32,
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        reason: FinishReason,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    /// The step failed (an internal error; logged by the engine).
    Failed(String),
}

/// A request handed to the engine.
#[derive(Debug)]
pub struct Submission {
    pub prompt: Vec<u32>,
    pub params: EngineParams,
    pub events: UnboundedSender<Event>,
    /// Set by the HTTP side when the client disconnects or a stop string ended the text.
    pub cancel: Arc<AtomicBool>,
}

pub enum Message {
    Submit(Box<Submission>),
    /// Stop admitting; finish running and queued requests until `deadline`, then cancel the rest and exit.
    Shutdown {
        deadline: Instant,
    },
}

/// Which running sequences a step feeds, and how many tokens each.
type Plan = Vec<(usize, usize)>;

/// The drafter-backed decoder of speculative mode.
pub type Speculator<B> = SpecDecoder<Eagle3Drafter<B>>;

/// A plain step of greedy decode rows queued on the device whose picks the host has not read yet (overlap
/// scheduling, see the module docs).
struct InFlight<B: Backend> {
    /// The sequences of its rows, in row order ([`Seq::id`]).
    rows: Vec<u64>,
    picks: PendingPicks<B>,
}

/// One admitted or queued sequence.
struct Seq<B: Backend> {
    /// Unique while the engine runs (rows of a step in flight name their sequences by it).
    id: u64,
    /// Prompt then generated tokens (while a speculative sequence runs, its `spec.tokens` are current instead).
    tokens: Vec<u32>,
    prompt_len: usize,
    cache: Option<SequenceCache>,
    sampler: Sampler,
    params: EngineParams,
    events: UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
    arrived: Instant,
    last_token: Option<Instant>,
    cached_tokens: usize,
    /// Tokens sent to the client.
    emitted: usize,
    /// Prompt tokens counted in the metrics once.
    counted: bool,
    /// Speculative mode, while admitted: tokens, cache and sampler live here.
    spec: Option<SpecSequence<Eagle3State<B>>>,
    /// Speculative mode: prefilled since admission (the drafter is primed).
    primed: bool,
}

impl<B: Backend> Seq<B> {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn computed(&self) -> usize {
        match &self.spec {
            Some(sp) => sp.cache.len,
            None => self.cache.as_ref().map_or(0, |c| c.len),
        }
    }

    fn total(&self) -> usize {
        self.spec.as_ref().map_or(self.tokens.len(), |sp| sp.tokens.len())
    }

    fn blocks(&self) -> usize {
        match &self.spec {
            Some(sp) => sp.cache.blocks.len(),
            None => self.cache.as_ref().map_or(0, |c| c.blocks.len()),
        }
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed) || self.events.is_closed()
    }
}

/// The model the engine runs: on one device, or spread over a tensor x expert parallel group.
#[derive(Debug)]
pub enum Target<B: Backend> {
    Single(Box<DeepseekV3<B>>),
    Parallel(Box<ParallelGroup<B>>),
}

impl<B: Backend> From<DeepseekV3<B>> for Target<B> {
    fn from(model: DeepseekV3<B>) -> Self {
        Target::Single(Box::new(model))
    }
}

impl<B: Backend> Target<B> {
    fn config(&self) -> &eyrie_model::ModelConfig {
        match self {
            Target::Single(m) => &m.config,
            Target::Parallel(g) => g.config(),
        }
    }

    fn forward_batch(
        &mut self,
        batch: &mut [BatchEntry<'_>],
        cache: &mut PagedMlaCache<B>,
        rows: LogitRows,
        device: &B::Device,
    ) -> eyrie_model::error::Result<burn::tensor::Tensor<B, 2>> {
        match self {
            Target::Single(m) => m.forward_batch(batch, cache, rows, device),
            Target::Parallel(g) => g.forward_batch(batch, cache, rows, device),
        }
    }

    /// [`Self::forward_batch`] as a step of an overlapped greedy chain: `fed`'s ids (the previous chained step's
    /// picks) embedded instead of the entries' tokens when given; a group's workers keep their own picks of this
    /// step and embed them in the next (`ParallelGroup::forward_batch_chained`).
    fn forward_chained(
        &mut self,
        batch: &mut [BatchEntry<'_>],
        cache: &mut PagedMlaCache<B>,
        device: &B::Device,
        fed: Option<&burn::tensor::Tensor<B, 1, burn::tensor::Int>>,
    ) -> eyrie_model::error::Result<burn::tensor::Tensor<B, 2>> {
        match self {
            Target::Single(m) => m.forward_batch_fed(batch, cache, LogitRows::Last, device, fed),
            Target::Parallel(g) => g.forward_batch_chained(batch, cache, LogitRows::Last, device, fed),
        }
    }
}

/// Widest decode step the warm-up runs on CUDA (within `--max-running-requests` and the free KV blocks): every
/// width up to here may pick launch shapes of its own (the GEMV kernels up to 16 rows, the fused MoE's shape
/// classes at 1, 2-16, 17-64 and more tokens, the absorption kernels', the attention's), and eyrie-quant's MoE
/// takes at most this many tokens a step in its decode shapes (`MAX_TOKENS`).
pub const WARM_UP_WIDTHS: usize = 256;

/// The warm-up's tokens for a step of `n` one-token sequences: rows 0-2 share one token and rows 3-4 another, the
/// rest are distinct, so the fused MoE sees experts with 3+, 2 and 1 tokens (its three shape classes) at every
/// width from 6 on; below, as many distinct ones as fit.
pub fn warm_up_tokens(n: usize, vocab: usize) -> Vec<u32> {
    let vocab = vocab.max(1) as u64;
    let token = |i: usize| ((i as u64 * 7919 + 11) % vocab) as u32;
    (0..n)
        .map(|i| match (n, i) {
            (0..=5, _) => token(i),
            (_, 0..=2) => token(0),
            (_, 3 | 4) => token(3),
            _ => token(i),
        })
        .collect()
}

/// The state the engine thread owns.
pub struct Engine<B: Backend> {
    target: Target<B>,
    cache: PagedMlaCache<B>,
    device: B::Device,
    config: EngineConfig,
    eos: Vec<u32>,
    waiting: VecDeque<Seq<B>>,
    running: Vec<Seq<B>>,
    metrics: Arc<Metrics>,
    spec: Option<Speculator<B>>,
    /// The step whose picks are still on the device (overlap scheduling).
    inflight: Option<InFlight<B>>,
    next_id: u64,
}

impl<B: Backend> Engine<B> {
    /// An engine over a loaded model, with a KV cache of `config.max_total_tokens`.
    pub fn new(
        model: impl Into<Target<B>>,
        device: B::Device,
        config: EngineConfig,
        eos: Vec<u32>,
        metrics: Arc<Metrics>,
        spec: Option<Speculator<B>>,
    ) -> anyhow::Result<Self> {
        let blocks = config.max_total_tokens.div_ceil(config.block_size).max(1);
        let target = model.into();
        if matches!(target, Target::Parallel(_)) && spec.is_some() {
            anyhow::bail!("speculative decoding with --tp-size / --ep-size above 1 is not supported yet");
        }
        let cache = PagedMlaCache::<B>::new(target.config(), blocks, config.block_size, &device)?;
        let (waiting, running) = (VecDeque::new(), Vec::new());
        Ok(Self { target, cache, device, config, eos, waiting, running, metrics, spec, inflight: None, next_id: 0 })
    }

    /// Tokens a decode row of one sequence adds to the cache in one step (the verified drafts plus the root).
    fn decode_width(&self) -> usize {
        match &self.spec {
            None => 1,
            Some(d) if d.topk > 1 => d.num_draft_tokens,
            Some(d) => d.num_steps + 1,
        }
    }

    /// Runs until a shutdown's deadline passes with everything finished, or every sender is gone.
    pub fn run(mut self, rx: Receiver<Message>) {
        self.publish();
        let mut shutdown: Option<Instant> = None;
        loop {
            let idle = self.waiting.is_empty() && self.running.is_empty() && self.inflight.is_none();
            if idle && shutdown.is_some() {
                break;
            }
            // Block only when there is nothing to do.
            let first = if idle {
                match rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(m) => Some(m),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            } else {
                None
            };
            for msg in first.into_iter().chain(std::iter::from_fn(|| rx.try_recv().ok())) {
                match msg {
                    Message::Submit(s) if shutdown.is_none() => self.enqueue(*s),
                    Message::Submit(s) => {
                        let _ = s.events.send(Event::Failed("the server is shutting down".into()));
                    }
                    Message::Shutdown { deadline } => shutdown = Some(deadline),
                }
            }
            if let Some(deadline) = shutdown
                && Instant::now() >= deadline
            {
                for seq in self.waiting.drain(..).chain(self.running.drain(..)).collect::<Vec<_>>() {
                    finish(&mut self.cache, &mut self.spec, &self.metrics, seq, FinishReason::Cancelled);
                }
            }
            self.reap_cancelled();
            self.admit();
            if !self.running.is_empty() || self.inflight.is_some() {
                self.step();
            }
            self.publish();
        }
        if let Some(fl) = self.inflight.take() {
            let _ = fl.picks.wait();
        }
        self.publish();
    }

    fn enqueue(&mut self, s: Submission) {
        let sampler = match Sampler::new(s.params.sampling) {
            Ok(sampler) => sampler,
            Err(e) => {
                let _ = s.events.send(Event::Failed(e.to_string()));
                return;
            }
        };
        self.next_id += 1;
        self.waiting.push_back(Seq {
            id: self.next_id,
            prompt_len: s.prompt.len(),
            tokens: s.prompt,
            cache: None,
            sampler,
            params: s.params,
            events: s.events,
            cancel: s.cancel,
            arrived: Instant::now(),
            last_token: None,
            cached_tokens: 0,
            emitted: 0,
            counted: false,
            spec: None,
            primed: false,
        });
    }

    fn reap_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancelled() {
                let seq = self.running.remove(i);
                finish(&mut self.cache, &mut self.spec, &self.metrics, seq, FinishReason::Cancelled);
            } else {
                i += 1;
            }
        }
        let (keep, gone): (VecDeque<Seq<B>>, VecDeque<Seq<B>>) = self.waiting.drain(..).partition(|s| !s.cancelled());
        self.waiting = keep;
        for seq in gone {
            finish(&mut self.cache, &mut self.spec, &self.metrics, seq, FinishReason::Cancelled);
        }
    }

    /// Admits queued sequences in arrival order while there is room for their whole remaining prompt plus one
    /// token (so an admitted prompt never waits for blocks mid-prefill unless decode growth preempts it).
    fn admit(&mut self) {
        let bs = self.config.block_size;
        while self.running.len() < self.config.max_running {
            let Some(front) = self.waiting.front_mut() else { break };
            let cache = self.cache.start_with_prefix(&front.tokens);
            let need = (front.tokens.len() + 1).div_ceil(bs).saturating_sub(cache.blocks.len());
            if need > self.cache.free_blocks() && !self.running.is_empty() {
                self.cache.release(cache);
                break;
            }
            if need > self.cache.free_blocks() {
                // Alone and still too big: it can never run.
                self.cache.release(cache);
                let Some(seq) = self.waiting.pop_front() else { break };
                let _ = seq.events.send(Event::Failed(format!(
                    "the sequence needs {} KV-cache tokens but the cache holds {} (raise --max-total-tokens)",
                    seq.tokens.len() + 1,
                    self.cache.num_blocks() * bs
                )));
                Metrics::add(&self.metrics.requests_server_error, 1);
                continue;
            }
            let Some(mut seq) = self.waiting.pop_front() else { break };
            if !seq.counted {
                seq.counted = true;
                Metrics::add(&self.metrics.prompt_tokens, seq.prompt_len as u64);
                seq.cached_tokens = cache.len;
            }
            Metrics::add(&self.metrics.prefix_cache_hit_tokens, cache.len as u64);
            match &mut self.spec {
                None => seq.cache = Some(cache),
                Some(dec) => match dec.new_sequence::<B>(&seq.tokens, seq.params.sampling) {
                    Ok(mut sp) => {
                        sp.cache = cache;
                        sp.prompt_len = seq.prompt_len;
                        sp.sampler = seq.sampler.clone();
                        seq.spec = Some(sp);
                        seq.primed = false;
                    }
                    Err(e) => {
                        self.cache.release(cache);
                        let _ = seq.events.send(Event::Failed(e.to_string()));
                        Metrics::add(&self.metrics.requests_server_error, 1);
                        continue;
                    }
                },
            }
            self.running.push(seq);
        }
    }

    /// The tokens each running sequence feeds this step: decode rows first, then prefill chunks in admission
    /// order within the chunked-prefill budget. Preempts the newest sequences while the step's blocks are not free.
    fn plan(&mut self) -> Vec<(usize, usize)> {
        let width = self.decode_width();
        loop {
            let mut plan = Vec::with_capacity(self.running.len());
            let mut budget = self.config.chunked_prefill;
            // A decode row: every token but the last was run (speculative: and the drafter is primed).
            let decoding = |seq: &Seq<B>| {
                let left = seq.total() - seq.computed();
                if seq.spec.is_some() { seq.primed && left == 1 } else { left == 1 }
            };
            for (i, seq) in self.running.iter().enumerate() {
                if decoding(seq) {
                    plan.push((i, width));
                }
            }
            for (i, seq) in self.running.iter().enumerate() {
                let left = seq.total() - seq.computed();
                if !decoding(seq) && left > 0 && budget > 0 {
                    let n = left.min(budget);
                    budget -= n;
                    plan.push((i, n));
                }
            }
            let bs = self.config.block_size;
            let need: usize = plan
                .iter()
                .map(|&(i, n)| {
                    let seq = &self.running[i];
                    (seq.computed() + n).div_ceil(bs).saturating_sub(seq.blocks())
                })
                .sum();
            if need <= self.cache.free_blocks() || self.running.len() <= 1 {
                plan.sort_unstable();
                return plan;
            }
            // Preempt the most recently admitted sequence: free its pages, recompute it later.
            if let Some(mut seq) = self.running.pop() {
                park(&mut self.cache, &mut self.spec, &mut seq, true);
                Metrics::add(&self.metrics.preemptions, 1);
                self.waiting.push_front(seq);
            }
        }
    }

    /// The token of each row of `plan` whose sequence has its whole prompt in the cache (`None` for a row still in
    /// prefill), with its log-probabilities when the request asked for them. Rows are picked on threads when more
    /// than one picks: a non-greedy pick computes an f64 softmax over the vocabulary (~1.5-3 ms of host time for
    /// Kimi's 163840 tokens), so a batch of 32 sampled serially cost tens of milliseconds a step. Each sequence
    /// has its own generator, so the picks are the same whatever the threads.
    fn pick_rows(
        &mut self,
        plan: &[(usize, usize)],
        logits: &[f32],
        vocab: usize,
    ) -> Vec<Option<(u32, Option<TokenLogprobs>)>> {
        type Job<'a> = (usize, &'a mut Sampler, &'a [u32], Option<usize>);
        let mut jobs: Vec<Job<'_>> = Vec::with_capacity(plan.len());
        let mut rows = plan.iter().map(|&(i, _)| i).enumerate().peekable();
        for (i, seq) in self.running.iter_mut().enumerate() {
            // `plan` is sorted by sequence index (`plan()`), so one walk pairs them.
            while rows.peek().is_some_and(|&(_, r)| r < i) {
                rows.next();
            }
            let Some(&(row, _)) = rows.peek().filter(|&&(_, r)| r == i) else {
                continue;
            };
            if seq.computed() < seq.tokens.len() {
                continue; // mid-prefill
            }
            let Seq { tokens, prompt_len, sampler, params, .. } = seq;
            jobs.push((row, sampler, &tokens[*prompt_len..], params.logprobs));
        }
        let pick = |(row, sampler, history, logprobs): &mut Job<'_>| {
            let values = &logits[*row * vocab..(*row + 1) * vocab];
            let id = sampler.sample_after(values, history);
            let lp = logprobs.map(|k| {
                let lp = log_softmax(values);
                TokenLogprobs { logprob: lp[id as usize], top: top_n(&lp, k) }
            });
            (*row, id, lp)
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(jobs.len());
        let picked: Vec<(usize, u32, Option<TokenLogprobs>)> = if threads <= 1 {
            jobs.iter_mut().map(pick).collect()
        } else {
            let per = jobs.len().div_ceil(threads);
            std::thread::scope(|s| {
                let handles: Vec<_> = jobs
                    .chunks_mut(per)
                    .map(|chunk| s.spawn(|| chunk.iter_mut().map(pick).collect::<Vec<_>>()))
                    .collect();
                handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
            })
        };
        let mut out: Vec<Option<(u32, Option<TokenLogprobs>)>> = vec![None; plan.len()];
        for (row, id, lp) in picked {
            out[row] = Some((id, lp));
        }
        out
    }

    /// With a step in flight: queues the next one behind it, fed with its picks on the device, when that step would
    /// be the same rows (every running sequence, in the same order, each decoding greedily and not at its last
    /// token, with the blocks free); then reads the in-flight picks. Otherwise reads them and runs a plain step.
    fn step(&mut self) {
        if let Some(fl) = self.inflight.take() {
            let next = self.follow(&fl);
            self.land(fl);
            match next {
                Some(Ok(next)) => {
                    self.inflight = Some(next);
                    return;
                }
                Some(Err((rows, why))) => {
                    let plan: Vec<(usize, usize)> = self
                        .running
                        .iter()
                        .enumerate()
                        .filter(|(_, s)| rows.contains(&s.id))
                        .map(|(i, _)| (i, 1))
                        .collect();
                    return self.fail_step(&plan, &why);
                }
                None => {}
            }
            if self.running.is_empty() {
                return;
            }
        }
        let plan = self.plan();
        if plan.is_empty() {
            return;
        }
        if self.spec.is_some() {
            return self.step_speculative(&plan);
        }
        let vocab = self.target.config().vocab_size;
        // Every row greedy, without penalties or logprobs: the picks can be made where the logits are (a launch and
        // one id a row read back instead of the rows; `EYRIE_DEVICE_ARGMAX=1`, off by default until checked on a
        // GPU).
        let all_greedy = plan.iter().all(|&(i, _)| Self::greedy(&self.running[i]));
        let device_greedy = eyrie_model::sampling::device_argmax_enabled() && all_greedy;
        // Every row a decode row (its one token the last of its sequence): the picks can stay on the device, read at
        // the next step, which may be queued fed with them first.
        let overlap = all_greedy
            && self.overlap_allowed()
            && plan.iter().all(|&(i, n)| n == 1 && self.running[i].computed() + 1 == self.running[i].total());
        if overlap {
            let rows: Vec<u64> = plan.iter().map(|&(i, _)| self.running[i].id).collect();
            match self.queue(&plan, None) {
                Ok(picks) => self.inflight = Some(InFlight { rows, picks }),
                Err(why) => self.fail_step(&plan, &why),
            }
            Metrics::add(&self.metrics.steps, 1);
            return;
        }
        let outcome = catch_unwind(AssertUnwindSafe(|| -> anyhow::Result<StepLogits> {
            let mut caches: Vec<SequenceCache> =
                plan.iter().map(|&(i, _)| self.running[i].cache.take().unwrap_or_default()).collect();
            let result = {
                let mut batch: Vec<BatchEntry<'_>> = plan
                    .iter()
                    .zip(caches.iter_mut())
                    .map(|(&(i, n), seq)| {
                        let start = seq.len;
                        BatchEntry { tokens: &self.running[i].tokens[start..start + n], seq }
                    })
                    .collect();
                self.target.forward_batch(&mut batch, &mut self.cache, LogitRows::Last, &self.device)
            };
            for (&(i, _), c) in plan.iter().zip(caches) {
                self.running[i].cache = Some(c);
            }
            let logits = result?;
            if device_greedy && let Some(ids) = eyrie_model::sampling::device_argmax(&logits) {
                return ids.map(StepLogits::Ids).map_err(|e| anyhow::anyhow!("greedy picks on the device: {e}"));
            }
            Ok(StepLogits::Rows(to_host(logits)?))
        }));
        Metrics::add(&self.metrics.steps, 1);
        let mut picks = match outcome {
            Ok(Ok(StepLogits::Rows(l))) if l.len() == plan.len() * vocab => self.pick_rows(&plan, &l, vocab),
            Ok(Ok(StepLogits::Ids(ids))) if ids.len() == plan.len() => plan
                .iter()
                .zip(ids)
                .map(|(&(i, _), id)| {
                    let seq = &self.running[i];
                    // Mid-prefill rows pick nothing (as `pick_rows`).
                    (seq.computed() >= seq.tokens.len()).then_some((id, None))
                })
                .collect(),
            Ok(Ok(StepLogits::Rows(l))) => {
                return self.fail_step(&plan, &format!("logits of {} values for {} rows", l.len(), plan.len()));
            }
            Ok(Ok(StepLogits::Ids(ids))) => {
                return self.fail_step(&plan, &format!("{} greedy picks for {} rows", ids.len(), plan.len()));
            }
            Ok(Err(e)) => return self.fail_step(&plan, &format!("{e:#}")),
            Err(panic) => return self.fail_step(&plan, &format!("panic: {}", panic_message(&*panic))),
        };
        let now = Instant::now();
        let mut finished = Vec::new();
        for (row, &(i, _)) in plan.iter().enumerate() {
            let Some((id, logprobs)) = picks[row].take() else {
                continue; // mid-prefill
            };
            if let Some(reason) = self.accept(i, id, logprobs, now) {
                finished.push((i, reason));
            }
        }
        for &(i, reason) in finished.iter().rev() {
            let seq = self.running.remove(i);
            finish(&mut self.cache, &mut self.spec, &self.metrics, seq, reason);
        }
    }

    /// Running sequence `i`'s next token: streamed, appended, checked for the stop conditions (returned when one
    /// holds; the caller ends the sequence).
    fn accept(&mut self, i: usize, id: u32, logprobs: Option<TokenLogprobs>, now: Instant) -> Option<FinishReason> {
        let seq = &mut self.running[i];
        if seq.generated() == 0 {
            // The prompt is in the cache: offer its full blocks to later prompts now.
            if let Some(c) = &seq.cache {
                self.cache.register_prefix(c, &seq.tokens);
            }
        }
        match seq.last_token {
            None => self.metrics.observe_ttft(now.duration_since(seq.arrived).as_secs_f64()),
            Some(t) => self.metrics.observe_itl(now.duration_since(t).as_secs_f64()),
        }
        seq.last_token = Some(now);
        seq.tokens.push(id);
        seq.emitted += 1;
        Metrics::add(&self.metrics.generation_tokens, 1);
        let _ = seq.events.send(Event::Token { id, logprobs });
        let stop = (!seq.params.ignore_eos && self.eos.contains(&id)) || seq.params.stop_token_ids.contains(&id);
        if stop {
            Some(FinishReason::Stop)
        } else if seq.generated() >= seq.params.max_tokens || seq.tokens.len() >= self.config.context_length {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// A step in speculative mode: prompt chunks through [`SpecDecoder::prefill_chunks`] (one target forward),
    /// decode rows through [`SpecDecoder::step`] (drafting, one target forward over all drafts, verification).
    fn step_speculative(&mut self, plan: &[(usize, usize)]) {
        let (prefill, decode): (Plan, Plan) = plan.iter().partition(|&&(i, _)| !self.running[i].primed);
        let mut finished: Vec<(usize, FinishReason)> = Vec::new();
        let mut failed: Vec<(usize, usize)> = Vec::new();
        let mut why = String::new();
        let now = Instant::now();
        if !prefill.is_empty() {
            let limits: Vec<usize> = prefill.iter().map(|&(_, n)| n).collect();
            let outcome = self.run_spec(&prefill, |dec, model, cache, seqs, device| {
                dec.prefill_chunks(model, cache, seqs, &limits, device)
                    .map(|v| v.into_iter().map(|t| t.into_iter().collect::<Vec<u32>>()).collect::<Vec<_>>())
            });
            match outcome {
                Ok(firsts) => {
                    for (&(i, _), first) in prefill.iter().zip(firsts) {
                        if first.is_empty() {
                            continue; // mid-prompt
                        }
                        let seq = &mut self.running[i];
                        seq.primed = true;
                        if let Some(sp) = &seq.spec {
                            self.cache.register_prefix(&sp.cache, &sp.tokens);
                        }
                        if let Some(reason) = emit(&self.metrics, &self.eos, &self.config, seq, &first, now) {
                            finished.push((i, reason));
                        }
                    }
                }
                Err(e) => {
                    why = e;
                    failed.extend(&prefill);
                }
            }
        }
        if !decode.is_empty() {
            let outcome =
                self.run_spec(&decode, |dec, model, cache, seqs, device| dec.step(model, cache, seqs, device));
            match outcome {
                Ok(news) => {
                    for (&(i, _), new) in decode.iter().zip(news) {
                        if let Some(reason) =
                            emit(&self.metrics, &self.eos, &self.config, &mut self.running[i], &new, now)
                        {
                            finished.push((i, reason));
                        }
                    }
                }
                Err(e) => {
                    why = e;
                    failed.extend(&decode);
                }
            }
            if let Some(dec) = self.spec.as_mut() {
                let stats = dec.take_stats();
                self.metrics.observe_speculation(&stats.position_drafted, &stats.position_accepted);
            }
        }
        Metrics::add(&self.metrics.steps, 1);
        // Remove from the highest index down so the others keep their places.
        let mut gone: Vec<(usize, Option<FinishReason>)> = finished.into_iter().map(|(i, r)| (i, Some(r))).collect();
        gone.extend(failed.iter().map(|&(i, _)| (i, None)));
        gone.sort_unstable_by_key(|g| std::cmp::Reverse(g.0));
        gone.dedup_by_key(|g| g.0);
        for (i, reason) in gone {
            match reason {
                Some(reason) => {
                    let seq = self.running.remove(i);
                    finish(&mut self.cache, &mut self.spec, &self.metrics, seq, reason);
                }
                None => self.fail_step(&[(i, 0)], &why),
            }
        }
    }

    /// Runs one speculative call over the sequences of `part` with panics caught; `Err` carries the reason.
    fn run_spec<T>(
        &mut self,
        part: &[(usize, usize)],
        call: impl FnOnce(
            &mut Speculator<B>,
            &DeepseekV3<B>,
            &mut PagedMlaCache<B>,
            &mut [&mut SpecSequence<Eagle3State<B>>],
            &B::Device,
        ) -> eyrie_spec_decode::Result<T>,
    ) -> Result<T, String> {
        let Some(dec) = self.spec.as_mut() else { return Err("no speculative decoder".into()) };
        let mut mask = vec![false; self.running.len()];
        for &(i, _) in part {
            mask[i] = true;
        }
        let mut seqs: Vec<&mut SpecSequence<Eagle3State<B>>> =
            self.running.iter_mut().zip(&mask).filter(|(_, m)| **m).filter_map(|(s, _)| s.spec.as_mut()).collect();
        if seqs.len() != part.len() {
            return Err("a speculative sequence lost its state".into());
        }
        let Target::Single(model) = &self.target else {
            return Err("speculative decoding needs the model on one device".into());
        };
        let (cache, device) = (&mut self.cache, &self.device);
        match catch_unwind(AssertUnwindSafe(|| call(dec, model, cache, &mut seqs, device))) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(e.to_string()),
            Err(panic) => Err(format!("panic: {}", panic_message(&*panic))),
        }
    }

    fn fail_step(&mut self, plan: &[(usize, usize)], why: &str) {
        eprintln!("eyrie: a batched step of {} sequence(s) failed: {why}", plan.len());
        for &(i, _) in plan.iter().rev() {
            let mut seq = self.running.remove(i);
            if let Some(cache) = seq.cache.take() {
                self.cache.release(cache);
            }
            if let (Some(sp), Some(dec)) = (seq.spec.take(), self.spec.as_mut()) {
                dec.release(&mut self.cache, sp);
            }
            let _ = seq.events.send(Event::Failed(why.to_string()));
            Metrics::add(&self.metrics.requests_server_error, 1);
        }
    }

    fn publish(&self) {
        let pool = self.cache.block_pool();
        self.metrics.set_gauges(EngineGauges {
            waiting: self.waiting.len(),
            running: self.running.len(),
            kv_blocks_total: pool.num_blocks(),
            kv_blocks_used: pool.held(),
            kv_blocks_cached: pool.cached(),
            block_size: pool.block_size(),
        });
    }
}

/// Sends a speculative step's new tokens in order, stopping at the first stop condition (later tokens are dropped);
/// returns why the sequence ended, if it did.
fn emit<B: Backend>(
    metrics: &Metrics,
    eos: &[u32],
    config: &EngineConfig,
    seq: &mut Seq<B>,
    tokens: &[u32],
    now: Instant,
) -> Option<FinishReason> {
    for &id in tokens {
        match seq.last_token {
            None => metrics.observe_ttft(now.duration_since(seq.arrived).as_secs_f64()),
            Some(t) => metrics.observe_itl(now.duration_since(t).as_secs_f64()),
        }
        seq.last_token = Some(now);
        seq.emitted += 1;
        Metrics::add(&metrics.generation_tokens, 1);
        let _ = seq.events.send(Event::Token { id, logprobs: None });
        if (!seq.params.ignore_eos && eos.contains(&id)) || seq.params.stop_token_ids.contains(&id) {
            return Some(FinishReason::Stop);
        }
        if seq.emitted >= seq.params.max_tokens || seq.prompt_len + seq.emitted >= config.context_length {
            return Some(FinishReason::Length);
        }
    }
    None
}

/// Takes a sequence out of the cache: registers its committed blocks for reuse (unless `register` is off) and
/// frees its pages; in speculative mode its tokens (cut to what was sent) and sampler come back from the
/// speculative state and the drafter state is released.
fn park<B: Backend>(cache: &mut PagedMlaCache<B>, spec: &mut Option<Speculator<B>>, seq: &mut Seq<B>, register: bool) {
    if let Some(c) = seq.cache.take() {
        if register {
            cache.register_prefix(&c, &seq.tokens);
        }
        cache.release(c);
    }
    if let Some(sp) = seq.spec.take() {
        if register {
            cache.register_prefix(&sp.cache, &sp.tokens);
        }
        seq.tokens = sp.tokens[..seq.prompt_len + seq.emitted].to_vec();
        seq.sampler = sp.sampler.clone();
        match spec.as_mut() {
            Some(dec) => dec.release(cache, sp),
            None => cache.release(sp.cache),
        }
    }
}

/// Ends a sequence: registers its committed blocks for reuse, frees its pages, tells the client.
fn finish<B: Backend>(
    cache: &mut PagedMlaCache<B>,
    spec: &mut Option<Speculator<B>>,
    metrics: &Metrics,
    mut seq: Seq<B>,
    reason: FinishReason,
) {
    park(cache, spec, &mut seq, reason != FinishReason::Cancelled);
    let counter = if reason == FinishReason::Cancelled { &metrics.requests_cancelled } else { &metrics.requests_ok };
    Metrics::add(counter, 1);
    let _ = seq.events.send(Event::Finished {
        reason,
        prompt_tokens: seq.prompt_len,
        completion_tokens: seq.emitted,
        cached_tokens: seq.cached_tokens,
    });
}

/// Spawns the engine thread: loads with `load`, warms up, then serves `rx`. `ready` is set once the warm-up steps
/// ran; the returned handle's result is the load error, if loading failed.
pub fn spawn<B: Backend, F>(
    load: F,
    rx: Receiver<Message>,
    ready: Arc<AtomicBool>,
    loaded: Sender<anyhow::Result<()>>,
) -> std::io::Result<std::thread::JoinHandle<()>>
where
    F: FnOnce() -> anyhow::Result<Engine<B>> + Send + 'static,
{
    std::thread::Builder::new().name("eyrie-engine".into()).spawn(move || {
        let engine = catch_unwind(AssertUnwindSafe(|| {
            let mut engine = load()?;
            eprintln!(
                "eyrie: warming up (every step shape serving will launch, so no kernel compiles mid-request) ..."
            );
            let warmed = engine.warm_up()?;
            eprintln!("eyrie: warm-up: {warmed}");
            anyhow::Ok(engine)
        }));
        let engine = match engine {
            Ok(Ok(e)) => e,
            Ok(Err(e)) => {
                let _ = loaded.send(Err(e));
                return;
            }
            Err(_) => {
                let _ = loaded.send(Err(anyhow::anyhow!("the engine panicked while loading the model")));
                return;
            }
        };
        // Gauges (KV blocks, ...) are right before anyone is told the engine is up.
        engine.publish();
        ready.store(true, Ordering::SeqCst);
        let _ = loaded.send(Ok(()));
        engine.run(rx);
        ready.store(false, Ordering::SeqCst);
    })
}
