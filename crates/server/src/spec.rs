//! Speculative decoding on the command line: the SGLang-named `--speculative-*` flags that `eyrie generate` takes
//! ([`SpeculativeArgs`], resolved into a [`SpecPlan`]), and `eyrie spec check`, which measures a drafter's
//! acceptance under both aux-layer conventions ([`eyrie_spec_decode::check_conventions`]) and says which fits.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use burn::tensor::backend::Backend;
use eyrie_model::DeepseekV3;
use eyrie_model::device::{DeviceChoice, ResolvedDevice};
use eyrie_model::tokenizer::{Tokenizer, TokenizerError};
use eyrie_spec_decode::{
    AcceptanceStats, AuxConvention, ConventionCheck, DraftFormat, Eagle3Config, best_convention, check_conventions,
};

use crate::run_model::{ModelJob, dispatch, load_config, parse_tokens};

/// The aux-layer-id convention as a command-line value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ConventionArg {
    /// Id `i` = the residual stream entering target layer `i` (vLLM / speculators).
    InputOfLayer,
    /// Id `i` = the output of target layer `i` (SGLang / SpecForge).
    OutputOfLayer,
}

impl From<ConventionArg> for AuxConvention {
    fn from(c: ConventionArg) -> Self {
        match c {
            ConventionArg::InputOfLayer => AuxConvention::InputOfLayer,
            ConventionArg::OutputOfLayer => AuxConvention::OutputOfLayer,
        }
    }
}

/// The command-line name of a convention.
pub fn convention_name(c: AuxConvention) -> &'static str {
    match c {
        AuxConvention::InputOfLayer => "input-of-layer",
        AuxConvention::OutputOfLayer => "output-of-layer",
    }
}

fn format_name(f: DraftFormat) -> &'static str {
    match f {
        DraftFormat::SpecForge => "SpecForge / HF LlamaForCausalLMEagle3",
        DraftFormat::Speculators => "speculators Eagle3Speculator",
    }
}

/// `eyrie generate`'s speculative decoding flags (names and defaults as in SGLang).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SpeculativeArgs {
    /// Speculative decoding algorithm; EAGLE3 is the one supported (needs --speculative-draft-model-path).
    #[arg(long)]
    pub speculative_algorithm: Option<String>,
    /// The EAGLE-3 drafter's directory (config.json + safetensors, SpecForge or speculators layout).
    #[arg(long)]
    pub speculative_draft_model_path: Option<PathBuf>,
    /// Draft tokens per step (the tree depth with --speculative-eagle-topk > 1) [default: 3].
    #[arg(long)]
    pub speculative_num_steps: Option<usize>,
    /// Children per expanded tree node; 1 drafts a chain [default: 1].
    #[arg(long)]
    pub speculative_eagle_topk: Option<usize>,
    /// Tree nodes verified per step, the root included [default: num_steps + 1 with topk 1; required otherwise].
    #[arg(long)]
    pub speculative_num_draft_tokens: Option<usize>,
    /// How the drafter config's aux layer ids are read [default: the drafter format's engine convention:
    /// output-of-layer for SpecForge checkpoints, input-of-layer for speculators ones].
    #[arg(long, value_enum)]
    pub speculative_aux_convention: Option<ConventionArg>,
}

/// A validated speculative decoding setup.
#[derive(Debug, Clone, PartialEq)]
pub struct SpecPlan {
    /// The drafter directory.
    pub draft_dir: PathBuf,
    /// Draft tokens per step (tree depth).
    pub num_steps: usize,
    /// Children per expanded node (1 = chain).
    pub topk: usize,
    /// Nodes verified per step, the root included.
    pub num_draft_tokens: usize,
    /// How the aux layer ids are read.
    pub convention: AuxConvention,
}

impl SpeculativeArgs {
    /// None when no speculative flag is given; otherwise the checked plan (reads the drafter's config.json for the
    /// default convention), or an error naming the flag at fault.
    pub fn resolve(&self) -> Result<Option<SpecPlan>> {
        let Some(algorithm) = &self.speculative_algorithm else {
            let any = self.speculative_draft_model_path.is_some()
                || self.speculative_num_steps.is_some()
                || self.speculative_eagle_topk.is_some()
                || self.speculative_num_draft_tokens.is_some()
                || self.speculative_aux_convention.is_some();
            if any {
                bail!("the --speculative-* flags need --speculative-algorithm EAGLE3");
            }
            return Ok(None);
        };
        if !algorithm.eq_ignore_ascii_case("EAGLE3") {
            bail!("--speculative-algorithm {algorithm:?} is not supported: the only value accepted is EAGLE3");
        }
        let Some(draft_dir) = self.speculative_draft_model_path.clone() else {
            bail!("--speculative-algorithm EAGLE3 needs --speculative-draft-model-path DIR (the EAGLE-3 drafter)");
        };
        let num_steps = self.speculative_num_steps.unwrap_or(3);
        if num_steps == 0 {
            bail!("--speculative-num-steps must be at least 1");
        }
        let topk = self.speculative_eagle_topk.unwrap_or(1);
        if topk == 0 {
            bail!("--speculative-eagle-topk must be at least 1");
        }
        let num_draft_tokens = match (topk, self.speculative_num_draft_tokens) {
            (1, None) => num_steps + 1,
            (1, Some(t)) if t != num_steps + 1 => bail!(
                "--speculative-num-draft-tokens {t} with --speculative-eagle-topk 1 (a chain) must be \
                 --speculative-num-steps + 1 = {}",
                num_steps + 1
            ),
            (_, None) => bail!("--speculative-eagle-topk {topk} (tree drafting) needs --speculative-num-draft-tokens"),
            (_, Some(t)) => {
                // EAGLE-2 expansion: topk children of the root, then topk children of each of the topk best nodes.
                let most = 1 + topk + (num_steps - 1) * topk * topk;
                if !(2..=most).contains(&t) {
                    bail!(
                        "--speculative-num-draft-tokens {t} is out of range for a tree of depth {num_steps} and topk \
                         {topk}: expected 2..={most} (the root included)"
                    );
                }
                t
            }
        };
        let convention = match self.speculative_aux_convention {
            Some(c) => c.into(),
            None => Eagle3Config::from_dir(&draft_dir)
                .with_context(|| format!("reading the drafter config in {}", draft_dir.display()))?
                .format
                .default_convention(),
        };
        Ok(Some(SpecPlan { draft_dir, num_steps, topk, num_draft_tokens, convention }))
    }
}

/// The statistics as a JSON object (`eyrie generate --json`'s `"speculative"`), times in milliseconds.
pub fn stats_json(
    plan: &SpecPlan,
    capture_ids: &[usize],
    stats: &AcceptanceStats,
    tokens_per_s: f64,
) -> serde_json::Value {
    serde_json::json!({
        "algorithm": "EAGLE3",
        "num_steps": plan.num_steps,
        "topk": plan.topk,
        "num_draft_tokens": plan.num_draft_tokens,
        "aux_convention": convention_name(plan.convention),
        "capture_ids": capture_ids,
        "steps": stats.steps,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "emitted": stats.emitted,
        "acceptance_rate": stats.acceptance_rate(),
        "mean_accepted_length": stats.mean_accepted_length(),
        "position_rates": stats.position_rates(),
        "draft_ms": stats.draft_time.as_secs_f64() * 1e3,
        "verify_ms": stats.verify_time.as_secs_f64() * 1e3,
        "tokens_per_s": tokens_per_s,
    })
}

/// `eyrie spec` subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum SpecCommand {
    /// Measure a drafter's greedy acceptance under both aux-layer-id conventions and say which one fits.
    Check(CheckArgs),
}

/// `eyrie spec check` arguments.
#[derive(Debug, clap::Args)]
pub struct CheckArgs {
    /// Target model directory.
    #[arg(long)]
    pub model: PathBuf,
    /// The EAGLE-3 drafter's directory.
    #[arg(long)]
    pub speculative_draft_model_path: PathBuf,
    /// A prompt text (repeatable; needs a tokenizer). Built-in prompts when neither --prompt nor --tokens is given.
    #[arg(long)]
    pub prompt: Vec<String>,
    /// A prompt as token ids, comma separated (repeatable).
    #[arg(long)]
    pub tokens: Vec<String>,
    /// Draft tokens per step.
    #[arg(long, default_value_t = 3)]
    pub num_steps: usize,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Where to run: auto, cpu or cuda[:N].
    #[arg(long, default_value = "auto")]
    pub device: DeviceChoice,
}

/// Built-in prompts of `eyrie spec check` (as byte values modulo the vocabulary when the model has no tokenizer).
const DEFAULT_PROMPTS: &[&str] = &[
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Explain in one paragraph why the sky is blue.",
    "List three prime numbers greater than 100:",
];

pub fn run(command: SpecCommand) -> Result<()> {
    match command {
        SpecCommand::Check(args) => check(args),
    }
}

fn check(args: CheckArgs) -> Result<()> {
    let dir = args.model.as_path();
    let config = load_config(dir)?;
    let draft_dir = args.speculative_draft_model_path.as_path();
    let draft_config = Eagle3Config::from_dir(draft_dir)
        .with_context(|| format!("reading the drafter config in {}", draft_dir.display()))?;
    if args.num_steps == 0 || args.max_tokens == 0 {
        bail!("--num-steps and --max-tokens must be at least 1");
    }
    let tokenizer = match Tokenizer::from_dir(dir) {
        Ok(t) => Some(t),
        Err(TokenizerError::NoTokenizer { .. }) => None,
        Err(e) => return Err(e).with_context(|| format!("loading the tokenizer in {}", dir.display())),
    };
    let mut prompts: Vec<Vec<u32>> = Vec::new();
    for text in &args.prompt {
        let Some(t) = &tokenizer else {
            bail!("--prompt needs a tokenizer, but {} has none; pass --tokens instead", dir.display());
        };
        let ids = t.encode(text, false)?;
        if ids.is_empty() {
            bail!("--prompt {text:?} encodes to no tokens");
        }
        prompts.push(ids);
    }
    for ids in &args.tokens {
        prompts.push(parse_tokens(ids, config.vocab_size)?);
    }
    let source = if !prompts.is_empty() {
        "given"
    } else if let Some(t) = &tokenizer {
        for text in DEFAULT_PROMPTS {
            prompts.push(t.encode(text, false)?);
        }
        "built-in"
    } else {
        for text in DEFAULT_PROMPTS {
            prompts.push(text.bytes().map(|b| u32::from(b) % config.vocab_size as u32).collect());
        }
        "built-in, as byte ids (the model has no tokenizer)"
    };

    let job = CheckJob { dir, draft_dir, prompts: &prompts, num_steps: args.num_steps, max_tokens: args.max_tokens };
    let (checks, device) = dispatch(args.device, job)?;
    if checks.iter().all(|c| c.capture_ids.is_err()) {
        let mut reasons: Vec<&str> =
            checks.iter().filter_map(|c| c.capture_ids.as_ref().err().map(String::as_str)).collect();
        reasons.dedup();
        bail!("the drafter loads under neither aux-layer convention: {}", reasons.join("; "));
    }
    print!("{}", report(&draft_config, &checks, prompts.len(), source, &args, device));
    Ok(())
}

/// The printed table: the drafter's config, acceptance per convention, the verdict.
fn report(
    c: &Eagle3Config,
    checks: &[ConventionCheck],
    n_prompts: usize,
    source: &str,
    args: &CheckArgs,
    device: ResolvedDevice,
) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "drafter {} ({} layout)", args.speculative_draft_model_path.display(), format_name(c.format));
    let _ = writeln!(
        s,
        "  hidden {}, {} heads / {} kv heads x {}, intermediate {}, draft vocab {} of {}, target hidden {}",
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.intermediate_size,
        c.draft_vocab_size,
        c.vocab_size,
        c.target_hidden_size
    );
    let ids = match &c.aux_layer_ids {
        Some(ids) => format!("{ids:?}"),
        None => "none (default [2, L/2, L-3])".into(),
    };
    let _ = writeln!(
        s,
        "  aux layer ids {ids}; its format's default convention: {}",
        convention_name(c.format.default_convention())
    );
    let _ = writeln!(
        s,
        "target {}; {n_prompts} prompts ({source}), {} tokens each, {}-token chains, greedy, on {device}",
        args.model.display(),
        args.max_tokens,
        args.num_steps
    );
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "{:<16} {:<14} {:>6} {:>12} {:>12}  per position",
        "convention", "capture ids", "steps", "accept rate", "accept len"
    );
    for check in checks {
        let name = convention_name(check.convention);
        match (&check.capture_ids, &check.stats) {
            (Ok(ids), Some(st)) => {
                let rates: Vec<String> = st.position_rates().iter().map(|r| format!("{r:.2}")).collect();
                let _ = writeln!(
                    s,
                    "{name:<16} {:<14} {:>6} {:>12.3} {:>12.2}  [{}]",
                    format!("{ids:?}"),
                    st.steps,
                    st.acceptance_rate(),
                    st.mean_accepted_length(),
                    rates.join(", ")
                );
            }
            (Err(e), _) => {
                let _ = writeln!(s, "{name:<16} does not load: {e}");
            }
            (Ok(ids), None) => {
                let _ = writeln!(s, "{name:<16} {:<14} (no statistics)", format!("{ids:?}"));
            }
        }
    }
    let _ = writeln!(s);
    let same_ids = checks.len() == 2 && checks[0].capture_ids.is_ok() && checks[0].capture_ids == checks[1].capture_ids;
    let verdict = match best_convention(checks) {
        Some(best) => format!("best fit: {}", convention_name(best)),
        None if same_ids => "best fit: either (both conventions capture the same target layers)".into(),
        None => "best fit: undecided (equal acceptance; try more prompts or --max-tokens)".into(),
    };
    let _ = writeln!(s, "{verdict}");
    s
}

struct CheckJob<'a> {
    dir: &'a Path,
    draft_dir: &'a Path,
    prompts: &'a [Vec<u32>],
    num_steps: usize,
    max_tokens: usize,
}

impl ModelJob for CheckJob<'_> {
    type Output = (Vec<ConventionCheck>, ResolvedDevice);

    fn run<B: Backend>(self, device: &B::Device, resolved: ResolvedDevice) -> Result<Self::Output> {
        let target = DeepseekV3::<B>::load(self.dir, device)
            .with_context(|| format!("loading the model in {}", self.dir.display()))?;
        let checks = check_conventions(self.draft_dir, &target, self.prompts, self.num_steps, self.max_tokens, device)?;
        Ok((checks, resolved))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(algorithm: Option<&str>, dir: Option<&str>) -> SpeculativeArgs {
        SpeculativeArgs {
            speculative_algorithm: algorithm.map(str::to_owned),
            speculative_draft_model_path: dir.map(PathBuf::from),
            speculative_aux_convention: Some(ConventionArg::InputOfLayer),
            ..Default::default()
        }
    }

    #[test]
    fn flags_resolve_with_sglang_defaults_and_clear_errors() {
        assert_eq!(SpeculativeArgs::default().resolve().unwrap(), None);
        let plan = args(Some("EAGLE3"), Some("/d")).resolve().unwrap().unwrap();
        assert_eq!((plan.num_steps, plan.topk, plan.num_draft_tokens), (3, 1, 4));
        assert_eq!(plan.convention, AuxConvention::InputOfLayer);

        let e = args(Some("EAGLE"), Some("/d")).resolve().unwrap_err().to_string();
        assert!(e.contains("only value accepted is EAGLE3"), "{e}");
        let e = args(Some("EAGLE3"), None).resolve().unwrap_err().to_string();
        assert!(e.contains("--speculative-draft-model-path"), "{e}");
        let e = args(None, Some("/d")).resolve().unwrap_err().to_string();
        assert!(e.contains("need --speculative-algorithm EAGLE3"), "{e}");

        let mut a = args(Some("EAGLE3"), Some("/d"));
        a.speculative_eagle_topk = Some(2);
        assert!(a.resolve().unwrap_err().to_string().contains("needs --speculative-num-draft-tokens"));
        a.speculative_num_draft_tokens = Some(8);
        assert_eq!(a.resolve().unwrap().unwrap().num_draft_tokens, 8);
        a.speculative_num_draft_tokens = Some(12);
        assert!(a.resolve().unwrap_err().to_string().contains("expected 2..=11"));
        a.speculative_eagle_topk = Some(1);
        a.speculative_num_draft_tokens = Some(5);
        assert!(a.resolve().unwrap_err().to_string().contains("must be --speculative-num-steps + 1 = 4"));
        a.speculative_num_draft_tokens = None;
        a.speculative_num_steps = Some(0);
        assert!(a.resolve().unwrap_err().to_string().contains("at least 1"));
    }
}
