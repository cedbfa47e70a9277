//! `eyrie score`: one full-form forward over given token ids, writing logits and every hidden state (as
//! transformers' `output_hidden_states`) to a safetensors file, for comparisons against a reference.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use burn::tensor::backend::Backend;
use eyrie_model::DeepseekV3;
use eyrie_model::device::{DeviceChoice, ResolvedDevice};
use eyrie_quant::SafetensorsWriter;

use crate::run_model::{ModelJob, dispatch, load_config, parse_tokens, to_host};

/// `eyrie score` arguments.
#[derive(Debug, clap::Args)]
pub struct ScoreArgs {
    /// Model directory (config.json + safetensors checkpoint).
    #[arg(long)]
    pub model: PathBuf,
    /// Token ids, comma separated (e.g. `1,17,200`).
    #[arg(long)]
    pub tokens: String,
    /// Output .safetensors file: `tokens` (I64 [n]), `logits` (F32 [n, vocab]), `hidden.{i}` (F32 [n, hidden]) for
    /// the input of every layer i, and `hidden.final` (the final normed state).
    #[arg(long)]
    pub out: PathBuf,
    /// Where to run: auto, cpu or cuda[:N].
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
}

pub fn run(args: ScoreArgs) -> Result<()> {
    let config = load_config(&args.model)?;
    let tokens = parse_tokens(&args.tokens, config.vocab_size)?;
    let job = ScoreJob { dir: &args.model, tokens: &tokens };
    let (tensors, device) = dispatch(args.device, job)?;
    let mut w = SafetensorsWriter::new();
    w.metadata("source", args.model.display().to_string());
    w.metadata("device", device.to_string());
    let ids: Vec<i64> = tokens.iter().map(|&t| i64::from(t)).collect();
    w.add_i64("tokens", &[ids.len()], &ids)?;
    for (name, shape, values) in &tensors {
        w.add_f32(name.as_str(), shape, values)?;
    }
    w.write(&args.out).with_context(|| format!("writing {}", args.out.display()))?;
    eprintln!(
        "scored {} tokens on {device}; wrote {} tensors to {}",
        tokens.len(),
        tensors.len() + 1,
        args.out.display()
    );
    Ok(())
}

struct ScoreJob<'a> {
    dir: &'a Path,
    tokens: &'a [u32],
}

/// Named F32 tensors `(name, shape, values)`.
type Named = Vec<(String, Vec<usize>, Vec<f32>)>;

impl ModelJob for ScoreJob<'_> {
    type Output = (Named, ResolvedDevice);

    fn run<B: Backend>(self, device: &B::Device, resolved: ResolvedDevice) -> Result<Self::Output> {
        let model = DeepseekV3::<B>::load(self.dir, device)
            .with_context(|| format!("loading the model in {}", self.dir.display()))?;
        let (n, vocab, d, layers) =
            (self.tokens.len(), model.config.vocab_size, model.config.hidden_size, model.config.num_hidden_layers);
        let out = model.forward_with_hidden(model.token_tensor(&[self.tokens], device)?);
        let mut tensors = Vec::with_capacity(layers + 2);
        // [1, n, vocab] -> [n, vocab]
        tensors.push(("logits".to_string(), vec![n, vocab], to_host(out.logits)?));
        for (i, h) in out.hidden_states.into_iter().enumerate() {
            // [1, n, d] -> [n, d]; entry `layers` is the final normed state.
            let name = if i < layers { format!("hidden.{i}") } else { "hidden.final".to_string() };
            tensors.push((name, vec![n, d], to_host(h)?));
        }
        Ok((tensors, resolved))
    }
}
