//! Speculative decoding benchmark (`cargo xtask bench spec`): tokens/s of greedy decoding with and without
//! speculation, mean accepted length and per-position acceptance, on a fixture target on the CPU (burn `Flex`), or
//! on CUDA device 0 when built with `--features cuda` (the GPU machine: build here, carry the binary, pass
//! `--model` and `--drafter`).
//!
//! Rows, all on the same prompts, one sequence at a time, every output checked token for token against plain
//! greedy decoding:
//! - `plain`: the baseline, one target forward per token over the paged MLA cache.
//! - `self`: the target drafting for itself ([`SelfDrafter`]): acceptance 1.0, the upper bound of what a drafter
//!   can reach (its speed is not: the drafter costs as much as the target).
//! - `eagle3`: the random EAGLE-3 fixture drafter (`fixtures/spec/specforge`): acceptance ~0, the lower bound, i.e.
//!   the pure overhead of drafting and verifying.
//!
//! Each as a chain (`--num-steps`) and as a tree (top-2). The models are tiny and random, so the times say how much
//! the machinery costs per step, not what a trained drafter gains on a real model.
//!
//! Prints a table and writes JSON (`--json PATH`).

use std::path::{Path, PathBuf};
use std::time::Instant;

#[cfg(not(feature = "cuda"))]
use burn::backend::Flex;
use eyrie_model::DeepseekV3;
use eyrie_model::kv_cache::{PagedMlaCache, SequenceCache};
use eyrie_model::sampling::{SamplingParams, argmax};
use eyrie_spec_decode::{AcceptanceStats, DraftFormat, Drafter, Eagle3Drafter, SelfDrafter, SpecDecoder};
use serde_json::{Value, json};

#[cfg(not(feature = "cuda"))]
type B = Flex;
#[cfg(feature = "cuda")]
type B = burn::backend::Cuda;
#[cfg(not(feature = "cuda"))]
const DEVICE: &str = "cpu (burn Flex)";
#[cfg(feature = "cuda")]
const DEVICE: &str = "cuda:0 (burn Cuda)";
type Error = Box<dyn std::error::Error>;

const BLOCK: usize = 16;

struct Args {
    json: Option<PathBuf>,
    model: PathBuf,
    drafter: PathBuf,
    prompts: usize,
    new_tokens: usize,
    num_steps: usize,
    reps: usize,
}

fn fixture(rel: &str) -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    root.canonicalize().unwrap_or(root).join(rel)
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        json: None,
        model: fixture("model/yarn_qlora"),
        drafter: fixture("spec/specforge"),
        prompts: 4,
        new_tokens: 64,
        num_steps: 3,
        reps: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{k} needs a value"));
        let num = |v: String| v.parse::<usize>().map_err(|e| format!("{k}: {e}"));
        match k.as_str() {
            "--json" => a.json = Some(PathBuf::from(val()?)),
            "--model" => a.model = PathBuf::from(val()?),
            "--drafter" => a.drafter = PathBuf::from(val()?),
            "--prompts" => a.prompts = num(val()?)?,
            "--new-tokens" => a.new_tokens = num(val()?)?,
            "--num-steps" => a.num_steps = num(val()?)?,
            "--reps" => a.reps = num(val()?)?,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if a.prompts == 0 || a.new_tokens == 0 || a.num_steps == 0 || a.reps == 0 {
        return Err("--prompts, --new-tokens, --num-steps and --reps must be positive".into());
    }
    Ok(a)
}

/// Deterministic prompts of 8..=15 tokens.
fn prompts(n: usize, vocab: usize) -> Vec<Vec<u32>> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n).map(|_| (0..8 + next() % 8).map(|_| (next() % vocab as u64) as u32).collect()).collect()
}

/// Plain greedy decoding of each prompt; (outputs, seconds).
fn plain(target: &DeepseekV3<B>, prompts: &[Vec<u32>], n: usize) -> Result<(Vec<Vec<u32>>, f64), Error> {
    let device = Default::default();
    let vocab = target.config.vocab_size;
    let t = Instant::now();
    let mut outs = Vec::new();
    for prompt in prompts {
        let mut cache = PagedMlaCache::new(&target.config, (prompt.len() + n).div_ceil(BLOCK) + 1, BLOCK, &device)?;
        let mut seq = SequenceCache::default();
        let mut out = Vec::with_capacity(n);
        let mut input = prompt.clone();
        while out.len() < n {
            let logits = target.forward_cached(&input, &mut cache, &mut seq, &device)?;
            let rows = input.len();
            let row = logits
                .narrow(0, rows - 1, 1)
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .map_err(|e| format!("{e:?}"))?;
            let id = argmax(&row[..vocab]);
            out.push(id);
            input = vec![id];
        }
        cache.release(seq);
        outs.push(out);
    }
    Ok((outs, t.elapsed().as_secs_f64()))
}

/// Speculative greedy decoding of each prompt; (outputs cut to `n`, seconds, statistics).
fn speculative<D: Drafter<B>>(
    target: &DeepseekV3<B>,
    dec: &mut SpecDecoder<D>,
    prompts: &[Vec<u32>],
    n: usize,
) -> Result<(Vec<Vec<u32>>, f64, AcceptanceStats), Error> {
    let device = Default::default();
    dec.take_stats();
    let span = dec.num_draft_tokens.max(dec.num_steps + 1);
    let t = Instant::now();
    let mut outs = Vec::new();
    for prompt in prompts {
        let blocks = (prompt.len() + n + span).div_ceil(BLOCK) + 1;
        let mut cache = PagedMlaCache::new(&target.config, blocks, BLOCK, &device)?;
        let mut seq = dec.new_sequence(prompt, SamplingParams::default())?;
        dec.prefill(target, &mut cache, &mut [&mut seq], &device)?;
        while seq.generated().len() < n {
            dec.step(target, &mut cache, &mut [&mut seq], &device)?;
        }
        outs.push(seq.generated()[..n].to_vec());
        dec.release(&mut cache, seq);
    }
    Ok((outs, t.elapsed().as_secs_f64(), dec.take_stats()))
}

struct Row {
    name: String,
    drafter: &'static str,
    shape: String,
    seconds: f64,
    stats: Option<AcceptanceStats>,
    exact: bool,
}

fn main() -> Result<(), Error> {
    let args = parse_args()?;
    let device = Default::default();
    let target = DeepseekV3::<B>::load(&args.model, &device)?;
    let prompts = prompts(args.prompts, target.config.vocab_size);
    let n = args.new_tokens;
    let total = (prompts.len() * n) as f64;
    let best = |times: Vec<f64>| times.into_iter().fold(f64::INFINITY, f64::min);

    // Warm-up, then the best of `reps` runs per row.
    let (want, _) = plain(&target, &prompts, n)?;
    let mut plain_times = Vec::new();
    for _ in 0..args.reps {
        plain_times.push(plain(&target, &prompts, n)?.1);
    }
    let mut rows = vec![Row {
        name: "plain".into(),
        drafter: "-",
        shape: "-".into(),
        seconds: best(plain_times),
        stats: None,
        exact: true,
    }];

    let k = args.num_steps;
    // (topk, num_draft_tokens): a chain of k, then a top-2 tree of depth k with 2k nodes.
    let shapes = [(1, k + 1), (2, 2 * k)];
    let convention = DraftFormat::SpecForge.default_convention();
    for (topk, nodes) in shapes {
        let shape = if topk == 1 { format!("chain {k}") } else { format!("tree d{k} k{topk} n{nodes}") };
        let max_blocks = prompts.iter().map(|p| (p.len() + n + nodes + k + 1).div_ceil(BLOCK) + 1).sum::<usize>();
        let mut dec = SpecDecoder::new(SelfDrafter::new(target.clone(), max_blocks * 8, BLOCK, &device)?, k)
            .with_tree(topk, nodes);
        rows.push(measure(&target, &mut dec, &prompts, n, &want, args.reps, "self", &shape)?);
        let drafter = Eagle3Drafter::load(&args.drafter, &target, convention, &device)?;
        let mut dec = SpecDecoder::new(drafter, k).with_tree(topk, nodes);
        rows.push(measure(&target, &mut dec, &prompts, n, &want, args.reps, "eagle3", &shape)?);
    }

    let base = total / rows[0].seconds;
    println!(
        "speculative decoding, {DEVICE}, target {}, {} prompts x {n} new tokens, greedy, batch 1, best of {}",
        args.model.display(),
        prompts.len(),
        args.reps
    );
    println!(
        "{:<8} {:<16} {:>9} {:>8} {:>8} {:>8} {:>10} {:>10}  {:<22} exact",
        "drafter", "shape", "tok/s", "speedup", "accept", "acc len", "draft ms", "verify ms", "per position"
    );
    let mut json_rows = Vec::new();
    for r in &rows {
        let tps = total / r.seconds;
        let (rate, len, pos, draft, verify) = match &r.stats {
            Some(s) => (
                s.acceptance_rate(),
                s.mean_accepted_length(),
                s.position_rates(),
                s.draft_time.as_secs_f64() * 1e3,
                s.verify_time.as_secs_f64() * 1e3,
            ),
            None => (f64::NAN, 1.0, Vec::new(), 0.0, 0.0),
        };
        let pos_s = pos.iter().map(|r| format!("{r:.2}")).collect::<Vec<_>>().join(", ");
        let rate_s = if rate.is_nan() { "-".to_string() } else { format!("{rate:.3}") };
        println!(
            "{:<8} {:<16} {tps:>9.1} {:>7.2}x {rate_s:>8} {len:>8.2} {draft:>10.1} {verify:>10.1}  [{pos_s:<20}] {}",
            r.drafter,
            r.shape,
            tps / base,
            if r.exact { "yes" } else { "NO" }
        );
        json_rows.push(json!({
            "name": r.name,
            "drafter": r.drafter,
            "shape": r.shape,
            "tokens_per_s": tps,
            "speedup": tps / base,
            "acceptance_rate": r.stats.as_ref().map(|_| rate),
            "mean_accepted_length": len,
            "position_rates": pos,
            "draft_ms": draft,
            "verify_ms": verify,
            "seconds": r.seconds,
            "exact": r.exact,
        }));
    }
    if let Some(path) = &args.json {
        let doc: Value = json!({
            "bench": "spec",
            "device": DEVICE,
            "target": args.model.display().to_string(),
            "drafter": args.drafter.display().to_string(),
            "prompts": prompts.len(),
            "new_tokens": n,
            "num_steps": k,
            "reps": args.reps,
            "note": "tiny random models: machinery cost per step, not a trained drafter's gain",
            "rows": json_rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")?;
        println!("wrote {}", path.display());
    }
    if rows.iter().any(|r| !r.exact) {
        return Err("speculative output differs from plain greedy decoding".into());
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn measure<D: Drafter<B>>(
    target: &DeepseekV3<B>,
    dec: &mut SpecDecoder<D>,
    prompts: &[Vec<u32>],
    n: usize,
    want: &[Vec<u32>],
    reps: usize,
    drafter: &'static str,
    shape: &str,
) -> Result<Row, Error> {
    let (outs, _, _) = speculative(target, dec, prompts, n)?;
    let mut exact = outs == want;
    let mut best: Option<(f64, AcceptanceStats)> = None;
    for _ in 0..reps {
        let (outs, seconds, stats) = speculative(target, dec, prompts, n)?;
        exact &= outs == want;
        if best.as_ref().is_none_or(|(s, _)| seconds < *s) {
            best = Some((seconds, stats));
        }
    }
    let (seconds, stats) = best.expect("reps > 0");
    Ok(Row { name: format!("{drafter} {shape}"), drafter, shape: shape.into(), seconds, stats: Some(stats), exact })
}
