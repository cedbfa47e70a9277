//! `eyrie`: the command-line entry point: serve a model over the OpenAI API, inspect and dequantize checkpoints,
//! generate and score with a model.

mod dequant;
mod generate;
mod inspect;
mod run_model;
mod score;
mod self_checks;
mod serve;
mod spec;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use eyrie_model::device::DeviceChoice;

/// Eyrie: an inference engine for DeepSeek-V3-architecture MoE models (Kimi-K2 / K2.5 INT4).
#[derive(Debug, Parser)]
#[command(name = "eyrie", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a model over an OpenAI-compatible HTTP API (the embedded tiny model when no --model-path is given).
    Serve(serve::ServeArgs),
    /// Print a checkpoint's architecture, layers, shards and tensor bytes by dtype and by quantization.
    Inspect {
        /// Checkpoint directory (with model.safetensors.index.json or *.safetensors) or one .safetensors file.
        dir: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Write the dequantized bf16 weight of one Linear to a .safetensors file.
    Dequant {
        /// Checkpoint directory or file.
        dir: PathBuf,
        /// The Linear's module name (e.g. `model.layers.1.mlp.experts.0.gate_proj`); a trailing `.weight` or
        /// `.weight_packed` is accepted.
        #[arg(long)]
        tensor: String,
        /// Output .safetensors file; the weight is stored as `<module>.weight` (BF16).
        #[arg(long)]
        out: PathBuf,
        /// Where to dequantize: cpu (the reference), cuda[:N] (burn tensor ops on the GPU, checked bit for bit
        /// against the CPU reference), or auto.
        #[arg(long, default_value = "cpu")]
        device: DeviceChoice,
    },
    /// Generate tokens from a prompt (text or token ids), streamed to stdout.
    Generate(generate::GenerateArgs),
    /// Write the logits and every hidden state of one forward over token ids to a .safetensors file.
    Score(score::ScoreArgs),
    /// Speculative decoding tools (`spec check`: which aux-layer convention fits an EAGLE-3 drafter).
    Spec {
        #[command(subcommand)]
        command: spec::SpecCommand,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect { dir, json } => inspect::run(&dir, json),
        Command::Dequant { dir, tensor, out, device } => dequant::run(&dir, &tensor, &out, device),
        Command::Generate(args) => generate::run(args),
        Command::Score(args) => score::run(args),
        Command::Spec { command } => spec::run(command),
        Command::Serve(args) => serve::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
