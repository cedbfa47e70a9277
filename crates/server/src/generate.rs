//! `eyrie generate`: prompt -> tokens, one sequence, streamed to stdout.
//!
//! The prompt is prefilled and each new token decoded over the paged compressed MLA KV cache
//! ([`DeepseekV3::forward_cached`], the absorbed form), so a step costs one token's forward. Sampling (greedy,
//! temperature, top-p, seed) is [`eyrie_model::sampling`] on the host over the last logits row.
//!
//! With `--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR` (flags of [`crate::spec`]) the same
//! sequence runs through [`SpecDecoder`]: an EAGLE-3 drafter proposes a chain or tree per step and one target
//! forward verifies it, losslessly (greedy output is token-identical to the plain path). Tokens past an
//! end-of-sequence id or `--max-tokens` are cut, and the acceptance statistics go to stderr (or the JSON line).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use eyrie_model::DeepseekV3;
use eyrie_model::chat::{ChatMessage, ChatTemplate, RenderOptions};
use eyrie_model::device::{DeviceChoice, ResolvedDevice};
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::sampling::{Sampler, SamplingParams};
use eyrie_model::tokenizer::{Tokenizer, TokenizerError};
use eyrie_spec_decode::{AcceptanceStats, Eagle3Drafter, SpecDecoder};

use crate::run_model::{ModelJob, dispatch, load_config, parse_tokens, to_host};
use crate::spec::{SpecPlan, SpeculativeArgs, stats_json};

/// Tokens per KV-cache block.
const BLOCK_SIZE: usize = 16;

/// `eyrie generate` arguments.
#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Model directory (config.json + safetensors checkpoint; tokenizer and chat template when present).
    #[arg(long)]
    pub model: PathBuf,
    /// Prompt text (needs a tokenizer in the model directory).
    #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
    pub prompt: Option<String>,
    /// Render the prompt as one user message with the model's chat template (with the generation prompt).
    #[arg(long, requires = "prompt")]
    pub chat: bool,
    /// Prompt token ids, comma separated (e.g. `1,17,200`).
    #[arg(long)]
    pub tokens: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Sampling temperature; greedy when absent or 0.
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    /// Nucleus sampling mass in (0, 1].
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Do not stop at end-of-sequence ids (always generate --max-tokens tokens).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Where to run: auto, cpu or cuda[:N].
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
    /// Print only one JSON line at the end: `{"tokens": [...], "text": ...}` (text null without a tokenizer; plus
    /// `"speculative": {...}` statistics with --speculative-algorithm).
    #[arg(long)]
    pub json: bool,
    /// Speculative decoding (EAGLE-3).
    #[command(flatten)]
    pub speculative: SpeculativeArgs,
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let dir = args.model.as_path();
    let config = load_config(dir)?;
    let params =
        SamplingParams { temperature: args.temperature, top_p: args.top_p, seed: args.seed, ..Default::default() };
    Sampler::new(params)?;
    let spec = args.speculative.resolve()?;
    let tokenizer = match Tokenizer::from_dir(dir) {
        Ok(t) => Some(t),
        Err(TokenizerError::NoTokenizer { .. }) => None,
        Err(e) => return Err(e).with_context(|| format!("loading the tokenizer in {}", dir.display())),
    };
    let prompt = match (&args.tokens, &args.prompt) {
        (Some(tokens), _) => parse_tokens(tokens, config.vocab_size)?,
        (None, Some(text)) => encode_prompt(dir, tokenizer.as_ref(), text, args.chat, config.vocab_size)?,
        (None, None) => bail!("give --prompt TEXT or --tokens IDS"),
    };
    let eos = if args.ignore_eos { Vec::new() } else { eos_ids(tokenizer.as_ref(), &config.raw.eos_token_id) };

    let stdout = std::io::stdout();
    let mut decoder = tokenizer.as_ref().map(|t| t.stream_decoder(true));
    let mut on_token = |id: u32, is_eos: bool| -> Result<()> {
        if args.json || is_eos {
            return Ok(());
        }
        let mut out = stdout.lock();
        match decoder.as_mut() {
            Some(d) => write!(out, "{}", d.step(id)?)?,
            None => write!(out, "{id} ")?,
        }
        out.flush()?;
        Ok(())
    };
    let job = GenerateJob {
        dir,
        prompt: &prompt,
        max_tokens: args.max_tokens,
        params,
        spec: spec.as_ref(),
        eos: &eos,
        on_token: &mut on_token,
    };
    let started = Instant::now();
    let GenerateOutput { generated, device, decode_seconds, spec_stats } = dispatch(args.device, job)?;
    let seconds = started.elapsed().as_secs_f64();
    let tokens_per_s = if decode_seconds > 0.0 { generated.len() as f64 / decode_seconds } else { 0.0 };
    let spec_json = match (&spec, &spec_stats) {
        (Some(plan), Some((stats, capture_ids))) => Some(stats_json(plan, capture_ids, stats, tokens_per_s)),
        _ => None,
    };

    let mut out = stdout.lock();
    if args.json {
        // The end-of-sequence id is reported in `tokens` (as transformers' `generate` does) but not in `text`.
        let body = if ends_with_eos(&generated, &eos) { &generated[..generated.len() - 1] } else { &generated[..] };
        let text = match &tokenizer {
            Some(t) => Some(t.decode(body, true)?),
            None => None,
        };
        let mut line = serde_json::json!({ "tokens": generated, "text": text });
        if let Some(s) = spec_json {
            line["speculative"] = s;
        }
        writeln!(out, "{line}")?;
    } else {
        if let Some(d) = decoder.as_mut() {
            write!(out, "{}", d.flush()?)?;
        }
        writeln!(out)?;
    }
    out.flush()?;
    let stop = if ends_with_eos(&generated, &eos) { "end of sequence" } else { "max tokens" };
    eprintln!(
        "{} prompt + {} generated tokens on {device} in {seconds:.2} s (stopped at {stop})",
        prompt.len(),
        generated.len()
    );
    if let Some((stats, _)) = &spec_stats {
        eprintln!("{}", stats.summary());
        eprintln!("speculative: {tokens_per_s:.1} tokens/s over prefill + decode ({decode_seconds:.3} s)");
    }
    Ok(())
}

fn ends_with_eos(generated: &[u32], eos: &[u32]) -> bool {
    generated.last().is_some_and(|t| eos.contains(t))
}

/// Tokenizes `text` (as a chat user turn when `chat`), with a clear error when the directory has no tokenizer.
fn encode_prompt(
    dir: &Path,
    tokenizer: Option<&Tokenizer>,
    text: &str,
    chat: bool,
    vocab_size: usize,
) -> Result<Vec<u32>> {
    let Some(tokenizer) = tokenizer else {
        bail!(
            "--prompt needs a tokenizer, but {} has neither tiktoken.model nor tokenizer.json; pass --tokens instead",
            dir.display()
        );
    };
    let ids = if chat {
        let template =
            ChatTemplate::from_dir(dir).with_context(|| format!("--chat: no chat template in {}", dir.display()))?;
        let rendered = template.render(&[ChatMessage::new("user", text)], None, true, &RenderOptions::default())?;
        tokenizer.encode(&rendered, true)?
    } else {
        tokenizer.encode(text, false)?
    };
    if ids.is_empty() {
        bail!("--prompt: the prompt encodes to no tokens");
    }
    if let Some((pos, id)) = ids.iter().enumerate().find(|(_, id)| **id as usize >= vocab_size) {
        bail!("--prompt: token id {id} at position {pos} is outside the model's vocabulary (size {vocab_size})");
    }
    Ok(ids)
}

/// End-of-sequence ids: the tokenizer's, else config.json's `eos_token_id` (a number or a list).
fn eos_ids(tokenizer: Option<&Tokenizer>, config_eos: &Option<serde_json::Value>) -> Vec<u32> {
    if let Some(t) = tokenizer
        && !t.eos_token_ids().is_empty()
    {
        return t.eos_token_ids().to_vec();
    }
    config_eos_ids(config_eos)
}

/// config.json's `eos_token_id` (a number or a list) as ids.
pub fn config_eos_ids(config_eos: &Option<serde_json::Value>) -> Vec<u32> {
    match config_eos {
        Some(serde_json::Value::Number(n)) => n.as_u64().map(|v| v as u32).into_iter().collect(),
        Some(serde_json::Value::Array(items)) => items.iter().filter_map(|v| v.as_u64()).map(|v| v as u32).collect(),
        _ => Vec::new(),
    }
}

struct GenerateJob<'a> {
    dir: &'a Path,
    prompt: &'a [u32],
    max_tokens: usize,
    /// Validated sampling parameters.
    params: SamplingParams,
    /// Speculative decoding, when asked for.
    spec: Option<&'a SpecPlan>,
    eos: &'a [u32],
    /// Called with each new id and whether it ends the sequence.
    on_token: &'a mut dyn FnMut(u32, bool) -> Result<()>,
}

struct GenerateOutput {
    generated: Vec<u32>,
    device: ResolvedDevice,
    /// Prefill and decode time (model and drafter loading excluded).
    decode_seconds: f64,
    /// With speculation: the statistics and the target layers captured for the drafter.
    spec_stats: Option<(AcceptanceStats, Vec<usize>)>,
}

impl ModelJob for GenerateJob<'_> {
    type Output = GenerateOutput;

    fn run<B: Backend>(self, device: &B::Device, resolved: ResolvedDevice) -> Result<Self::Output> {
        let model = DeepseekV3::<B>::load(self.dir, device)
            .with_context(|| format!("loading the model in {}", self.dir.display()))?;
        // The prompt is one prefill span: on CUDA its attention may take the MHA form (2.4-3.7x faster from 256
        // rows on the H200) once the form's check passes on this device.
        #[cfg(feature = "cuda")]
        if eyrie_model::device::is_cuda_backend::<B>() {
            eprintln!("eyrie: device self-check: {}", crate::self_checks::mha_prefill::<B>(device, &model.config));
        }
        if let Some(plan) = self.spec {
            return self.run_speculative(&model, plan, device, resolved);
        }
        let started = Instant::now();
        let mut sampler = Sampler::new(self.params)?;
        let vocab = model.config.vocab_size;
        let blocks = (self.prompt.len() + self.max_tokens).div_ceil(BLOCK_SIZE).max(1);
        let mut cache = PagedMlaCache::<B>::new(&model.config, blocks, BLOCK_SIZE, device)?;
        let mut seq = SequenceCache::default();
        let mut generated = Vec::with_capacity(self.max_tokens);
        let mut input: Vec<u32> = self.prompt.to_vec();
        while generated.len() < self.max_tokens {
            // [n, vocab] -> last row [vocab]
            let logits = model.forward_cached(&input, &mut cache, &mut seq, device)?;
            let n = input.len();
            let row = to_host(logits.narrow(0, n - 1, 1).reshape([vocab]))?;
            let id = sampler.sample(&row);
            generated.push(id);
            let is_eos = self.eos.contains(&id);
            (self.on_token)(id, is_eos)?;
            if is_eos {
                break;
            }
            input = vec![id];
        }
        cache.release(seq);
        let decode_seconds = started.elapsed().as_secs_f64();
        Ok(GenerateOutput { generated, device: resolved, decode_seconds, spec_stats: None })
    }
}

impl GenerateJob<'_> {
    /// The sequence through [`SpecDecoder`]: prefill (first token), then steps of 1..=num_steps+1 tokens each,
    /// emitted one by one until an end-of-sequence id or `max_tokens` (the rest of a step's tokens are cut).
    fn run_speculative<B: Backend>(
        self,
        model: &DeepseekV3<B>,
        plan: &SpecPlan,
        device: &B::Device,
        resolved: ResolvedDevice,
    ) -> Result<GenerateOutput> {
        let dir = &plan.draft_dir;
        let drafter = Eagle3Drafter::load(dir, model, plan.convention, device)
            .with_context(|| format!("loading the EAGLE-3 drafter in {}", dir.display()))?;
        let capture_ids = drafter.capture_ids.clone();
        let mut dec = SpecDecoder::new(drafter, plan.num_steps);
        if plan.topk > 1 {
            dec = dec.with_tree(plan.topk, plan.num_draft_tokens);
        }
        // A step writes up to `span` positions past the committed ones before rollback.
        let span = plan.num_draft_tokens.max(plan.num_steps + 1);
        let blocks = (self.prompt.len() + self.max_tokens + span).div_ceil(BLOCK_SIZE) + 1;
        let mut cache = PagedMlaCache::<B>::new(&model.config, blocks, BLOCK_SIZE, device)?;
        let started = Instant::now();
        let mut seq = dec.new_sequence(self.prompt, self.params)?;
        let mut generated = Vec::with_capacity(self.max_tokens);
        if self.max_tokens > 0 {
            let mut new_tokens = dec.prefill(model, &mut cache, &mut [&mut seq], device)?;
            'decode: loop {
                for id in new_tokens {
                    generated.push(id);
                    let is_eos = self.eos.contains(&id);
                    (self.on_token)(id, is_eos)?;
                    if is_eos || generated.len() >= self.max_tokens {
                        break 'decode;
                    }
                }
                new_tokens = dec.step(model, &mut cache, &mut [&mut seq], device)?.swap_remove(0);
            }
        }
        dec.release(&mut cache, seq);
        let decode_seconds = started.elapsed().as_secs_f64();
        Ok(GenerateOutput {
            generated,
            device: resolved,
            decode_seconds,
            spec_stats: Some((dec.take_stats(), capture_ids)),
        })
    }
}
