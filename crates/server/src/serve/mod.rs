//! `eyrie serve`: an OpenAI-compatible HTTP server over one model, in one process.
//!
//! Start-up: bind first (so `GET /health` answers 503 "loading" while the weights load), load the model on the
//! engine thread, run the warm-up steps (every decode width up to 16 sequences), then print the URL and answer requests. A load failure exits non-zero with
//! the reason. SIGINT/SIGTERM: stop accepting, let in-flight requests finish until `--shutdown-timeout`, cancel
//! the rest, join the engine thread (which frees the model and KV cache, GPU memory included) and exit 0.

mod app;
mod engine;
mod error;
mod metrics;
mod output;
mod protocol;
#[cfg(test)]
mod tests;
pub mod tiny;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use eyrie_model::DeepseekV3;
use eyrie_model::chat::{ChatError, ChatTemplate};
use eyrie_model::device::{DeviceChoice, ResolvedDevice};
use eyrie_model::parallel::{ParallelBackend, ParallelGroup, ShardSpec};
use eyrie_model::tokenizer::Tokenizer;

use crate::run_model::{ModelJob, dispatch, load_config};
pub use app::{AppState, app};
pub use engine::{Engine, EngineConfig, Message, Target};
pub use metrics::Metrics;

/// `eyrie serve` arguments (names as SGLang's where it has them).
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Model directory (config.json, safetensors, tokenizer, chat template). Absent: the embedded tiny model.
    #[arg(long)]
    pub model_path: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Where to run: auto, cpu or cuda[:N].
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// The model name clients send (default: the directory name, or `eyrie-tiny`).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Longest prompt + completion (default: the model's max_position_embeddings, at most --max-total-tokens).
    #[arg(long)]
    pub context_length: Option<usize>,
    /// Most requests decoded together.
    #[arg(long, default_value_t = 64)]
    pub max_running_requests: usize,
    /// Requests queued beyond the running ones before new ones get 503.
    #[arg(long, default_value_t = 1024)]
    pub max_queued_requests: usize,
    /// KV-cache capacity in tokens, over all sequences.
    #[arg(long, default_value_t = 65536)]
    pub max_total_tokens: usize,
    /// Most prompt tokens computed in one step.
    #[arg(long, default_value_t = 2048)]
    pub chunked_prefill_size: usize,
    /// Tokens per KV-cache block (the prefix cache shares whole blocks).
    #[arg(long, default_value_t = 16)]
    pub page_size: usize,
    /// Require `Authorization: Bearer KEY` on /v1 routes.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_timeout: f64,
    /// Tensor-parallel ways: attention heads, dense MLPs and shared experts split over this many devices
    /// (`cuda:N` .. `cuda:N+tp-1`, NCCL between them; threads on the CPU). One process drives them all.
    #[arg(long, default_value_t = 1)]
    pub tp_size: usize,
    /// Expert-parallel ways: routed experts split over this many devices (the group has max(tp, ep) ranks).
    #[arg(long, default_value_t = 1)]
    pub ep_size: usize,
    /// Run every step to its end before the next is queued (SGLang's flag). By default a step of greedy decode rows
    /// (no penalties, no logprobs) feeds its picks to the next step on the device and the next step is queued
    /// before the host reads them, so the device does not wait for the host between steps; outputs are the same.
    #[arg(long)]
    pub disable_overlap_schedule: bool,
    /// EAGLE-3 speculative decoding for every request (SGLang's flags).
    #[command(flatten)]
    pub speculative: crate::spec::SpeculativeArgs,
}

/// The checks of the arguments alone (before any file is read).
fn run_checks(args: &ServeArgs) -> Result<()> {
    for (name, v) in [
        ("--max-running-requests", args.max_running_requests),
        ("--max-total-tokens", args.max_total_tokens),
        ("--chunked-prefill-size", args.chunked_prefill_size),
        ("--page-size", args.page_size),
        ("--tp-size", args.tp_size),
        ("--ep-size", args.ep_size),
    ] {
        if v == 0 {
            bail!("{name} must be at least 1");
        }
    }
    if !(args.shutdown_timeout.is_finite() && args.shutdown_timeout >= 0.0) {
        bail!("--shutdown-timeout must be a number of seconds >= 0");
    }
    Ok(())
}

/// Runs the server until a signal stops it.
pub fn run(args: ServeArgs) -> Result<()> {
    run_checks(&args)?;
    let (dir, default_name) = match &args.model_path {
        Some(dir) => {
            let name = dir.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
            (dir.clone(), name)
        }
        None => (tiny::materialize().context("unpacking the embedded tiny model")?, tiny::NAME.to_string()),
    };
    let job = ServeJob { args: args.clone(), dir, name: args.served_model_name.clone().unwrap_or(default_name) };
    dispatch(args.device, job)
}

struct ServeJob {
    args: ServeArgs,
    dir: PathBuf,
    name: String,
}

impl ModelJob for ServeJob {
    type Output = ();

    fn run<B: ParallelBackend>(self, device: &B::Device, resolved: ResolvedDevice) -> Result<()> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the async runtime")?;
        runtime.block_on(serve::<B>(self, device.clone(), resolved))
    }
}

/// Reads what the HTTP side needs before any weight: config, tokenizer, chat template.
fn load_front(dir: &Path) -> Result<(eyrie_model::ModelConfig, Tokenizer, Option<ChatTemplate>)> {
    let config = load_config(dir)?;
    let tokenizer = Tokenizer::from_dir(dir).with_context(|| format!("loading the tokenizer in {}", dir.display()))?;
    let template = match ChatTemplate::from_dir(dir) {
        Ok(t) => Some(t),
        Err(ChatError::NoTemplate { .. }) => {
            eprintln!("eyrie: {} has no chat template: /v1/chat/completions will answer 400", dir.display());
            None
        }
        Err(e) => return Err(e).with_context(|| format!("loading the chat template in {}", dir.display())),
    };
    Ok((config, tokenizer, template))
}

/// A started engine and the state the HTTP side shares.
struct Launch {
    state: Arc<AppState>,
    tx: mpsc::Sender<Message>,
    engine_thread: std::thread::JoinHandle<()>,
    /// The load's outcome, once the warm-up steps ran.
    loaded: mpsc::Receiver<Result<()>>,
}

/// Reads the front (config, tokenizer, template), then starts the engine thread, which loads the weights.
fn launch<B: ParallelBackend>(dir: &Path, name: &str, args: &ServeArgs, device: B::Device) -> Result<Launch> {
    let (config, tokenizer, template) = load_front(dir)?;
    let spec_plan = args.speculative.resolve()?;
    let (tp, ep) = (args.tp_size, args.ep_size);
    if tp.max(ep) > 1 {
        if spec_plan.is_some() {
            bail!("--speculative-algorithm with --tp-size / --ep-size above 1 is not supported yet");
        }
        ShardSpec { rank: 0, tp, ep }.validate(&config).context("--tp-size / --ep-size")?;
    }
    let context_length = args
        .context_length
        .unwrap_or(config.max_position_embeddings)
        .min(config.max_position_embeddings)
        .min(args.max_total_tokens);
    let eos = {
        let mut eos = tokenizer.eos_token_ids().to_vec();
        if eos.is_empty() {
            eos = crate::generate::config_eos_ids(&config.raw.eos_token_id);
        }
        eos
    };
    let ready = Arc::new(AtomicBool::new(false));
    let metrics = Arc::new(Metrics::default());
    let (tx, rx) = mpsc::channel::<Message>();
    let state = Arc::new(AppState {
        served_model: name.to_string(),
        api_key: args.api_key.clone(),
        tokenizer: Arc::new(tokenizer),
        template,
        vocab_size: config.vocab_size,
        context_length,
        engine: Mutex::new(tx.clone()),
        ready: ready.clone(),
        shutting_down: Arc::new(AtomicBool::new(false)),
        metrics: metrics.clone(),
        max_in_flight: args.max_running_requests + args.max_queued_requests,
        in_flight: AtomicUsize::new(0),
        created: protocol::now_secs(),
        speculative: spec_plan.is_some(),
    });
    let engine_config = EngineConfig {
        max_running: args.max_running_requests,
        max_total_tokens: args.max_total_tokens,
        block_size: args.page_size,
        chunked_prefill: args.chunked_prefill_size,
        context_length,
        overlap: !args.disable_overlap_schedule,
    };
    let (loaded_tx, loaded) = mpsc::channel();
    let dir = dir.to_path_buf();
    let engine_thread = engine::spawn::<B, _>(
        move || {
            if tp.max(ep) > 1 {
                let blocks = engine_config.max_total_tokens.div_ceil(engine_config.block_size).max(1);
                eprintln!("eyrie: loading {} ranks (tp {tp}, ep {ep}) in parallel", tp.max(ep));
                let (group, device) = ParallelGroup::<B>::load(&dir, tp, ep, &device, blocks, engine_config.block_size)
                    .with_context(|| format!("loading the model in {} over tp {tp} x ep {ep}", dir.display()))?;
                return Engine::new(Target::Parallel(Box::new(group)), device, engine_config, eos, metrics, None);
            }
            let mut last = Instant::now();
            let model = DeepseekV3::<B>::load_with_progress(&dir, &device, |p| {
                if p.tensors_done == p.tensors_total || last.elapsed() >= Duration::from_secs(1) {
                    last = Instant::now();
                    let gb = |b: u64| b as f64 / 1e9;
                    let unit = if p.bytes_total >= 1_000_000_000 { "GB" } else { "MB" };
                    let scale = if unit == "GB" { 1.0 } else { 1e3 };
                    let eta = p.eta().map_or_else(String::new, |d| format!(", ETA {:.0} s", d.as_secs_f64()));
                    eprintln!(
                        "eyrie: loading {:.0}%: {:.2} of {:.2} {unit}, {} of {} tensors, {:.1} s{eta}",
                        100.0 * p.bytes_done as f64 / p.bytes_total.max(1) as f64,
                        gb(p.bytes_done) * scale,
                        gb(p.bytes_total) * scale,
                        p.tensors_done,
                        p.tensors_total,
                        p.elapsed.as_secs_f64()
                    );
                }
            })
            .with_context(|| format!("loading the model in {}", dir.display()))?;
            let spec = match spec_plan {
                None => None,
                Some(plan) => {
                    let drafter =
                        eyrie_spec_decode::Eagle3Drafter::load(&plan.draft_dir, &model, plan.convention, &device)
                            .with_context(|| format!("loading the EAGLE-3 drafter in {}", plan.draft_dir.display()))?;
                    eprintln!(
                        "eyrie: speculative decoding: EAGLE3 from {}, {} steps, topk {}, {} draft tokens",
                        plan.draft_dir.display(),
                        plan.num_steps,
                        plan.topk,
                        plan.num_draft_tokens
                    );
                    Some(
                        eyrie_spec_decode::SpecDecoder::new(drafter, plan.num_steps)
                            .with_tree(plan.topk, plan.num_draft_tokens),
                    )
                }
            };
            Engine::new(model, device, engine_config, eos, metrics, spec)
        },
        rx,
        ready,
        loaded_tx,
    )
    .context("starting the engine thread")?;
    Ok(Launch { state, tx, engine_thread, loaded })
}

async fn serve<B: ParallelBackend>(job: ServeJob, device: B::Device, resolved: ResolvedDevice) -> Result<()> {
    let args = job.args;
    // Fail fast on a bad directory before binding.
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    let started = Instant::now();
    eprintln!("eyrie: loading {} on {resolved} ...", job.dir.display());
    let Launch { state, tx, engine_thread, loaded: loaded_rx } = launch::<B>(&job.dir, &job.name, &args, device)?;
    let context_length = state.context_length;
    let shutting_down = state.shutting_down.clone();
    let router = app(state.clone());
    let shutdown_flag = shutting_down.clone();
    let server = tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(async move {
                shutdown_signal().await;
                shutdown_flag.store(true, Ordering::SeqCst);
            })
            .await
    });
    // Wait for the load without blocking the runtime (health answers "loading" meanwhile).
    let load = tokio::task::spawn_blocking(move || loaded_rx.recv()).await.context("waiting for the engine")?;
    match load {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return Err(e),
        Err(_) => bail!("the engine thread stopped while loading the model"),
    }
    eprintln!(
        "eyrie: model `{}` loaded and warmed up in {:.1} s; context {context_length} tokens, KV cache {} tokens",
        job.name,
        started.elapsed().as_secs_f64(),
        args.max_total_tokens
    );
    println!("eyrie: serving `{}` at http://{addr} (OpenAI API under http://{addr}/v1)", job.name);

    // Runs until a signal: then the listener closes and in-flight requests get the shutdown deadline.
    let signalled = async {
        while !shutting_down.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let engine_alive = async {
        while !engine_thread.is_finished() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::select! {
        () = signalled => {}
        () = engine_alive => bail!("the engine thread stopped unexpectedly"),
    }
    eprintln!("eyrie: shutting down: no new requests; in-flight ones get {} s", args.shutdown_timeout);
    let deadline = Instant::now() + Duration::from_secs_f64(args.shutdown_timeout);
    let _ = tx.send(Message::Shutdown { deadline });
    drop(tx);
    // The engine finishes or cancels everything by the deadline; streams then end and the server returns.
    let engine_done = tokio::task::spawn_blocking(move || engine_thread.join()).await;
    if !matches!(engine_done, Ok(Ok(()))) {
        eprintln!("eyrie: the engine thread ended abnormally");
    }
    match tokio::time::timeout(Duration::from_secs(5), server).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => eprintln!("eyrie: server error while stopping: {e}"),
        _ => eprintln!("eyrie: connections still open after the engine stopped; closing them"),
    }
    eprintln!("eyrie: stopped");
    Ok(())
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
