//! `cargo xtask bench sampling`: host time to pick one token from a Kimi-K2-sized logits row (163840 entries)
//! with the sampler the server runs for every sequence of every step (`eyrie_model::sampling`), per parameter set,
//! beside two floors measured in the same run: one argmax pass over the row, and the f64 softmax every non-greedy
//! pick computes (the distribution must be computed over the whole vocabulary).
//!
//! usage: bench_sampling [--json PATH] [--vocab N] [--reps N]
//! Rows: a peaked distribution (one token near 0.5, a long tail) and a flat one (high entropy), each the median of
//! `--reps` picks (a pick = `Sampler::sample_after`, the server's call).

use std::time::Instant;

use eyrie_model::sampling::{Sampler, SamplingParams, argmax, softmax};

type Error = Box<dyn std::error::Error>;

/// Median of `reps` timings of `f`, microseconds.
fn median_us(reps: usize, mut f: impl FnMut() -> u64) -> (f64, u64) {
    let mut times = Vec::with_capacity(reps);
    let mut sink = 0u64;
    for _ in 0..reps {
        let t = Instant::now();
        sink = sink.wrapping_add(f());
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    times.sort_by(f64::total_cmp);
    (times[reps / 2], sink)
}

/// Logits with a long tail: `scale` times a uniform in [-1, 1) per token (splitmix64), plus `peak` on token 7.
fn logits(vocab: usize, scale: f32, peak: f32, seed: u64) -> Vec<f32> {
    let mut x = seed;
    (0..vocab)
        .map(|i| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            let u = ((z ^ (z >> 31)) >> 11) as f32 / (1u64 << 53) as f32;
            scale * (2.0 * u - 1.0) + if i == 7 { peak } else { 0.0 }
        })
        .collect()
}

fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let (mut json, mut vocab, mut reps) = (None, 163_840usize, 31usize);
    while let Some(a) = args.next() {
        let mut value = || args.next().ok_or_else(|| Error::from(format!("{a} needs a value")));
        match a.as_str() {
            "--json" => json = Some(value()?),
            "--vocab" => vocab = value()?.parse().map_err(|e| format!("--vocab: {e}"))?,
            "--reps" => reps = value()?.parse().map_err(|e| format!("--reps: {e}"))?,
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if vocab == 0 || reps == 0 {
        return Err("--vocab and --reps must be at least 1".into());
    }
    let t = |temperature: f32| Some(temperature);
    let sets: [(&str, SamplingParams); 7] = [
        ("greedy", SamplingParams::default()),
        ("T 0.7", SamplingParams { temperature: t(0.7), ..Default::default() }),
        ("T 0.7, top-p 0.9", SamplingParams { temperature: t(0.7), top_p: Some(0.9), ..Default::default() }),
        ("T 1.0, top-p 0.95", SamplingParams { temperature: t(1.0), top_p: Some(0.95), ..Default::default() }),
        ("T 0.7, top-k 50", SamplingParams { temperature: t(0.7), top_k: Some(50), ..Default::default() }),
        ("T 0.7, min-p 0.05", SamplingParams { temperature: t(0.7), min_p: Some(0.05), ..Default::default() }),
        (
            "T 0.8, top-k 100, top-p 0.9, min-p 0.02",
            SamplingParams {
                temperature: t(0.8),
                top_k: Some(100),
                top_p: Some(0.9),
                min_p: Some(0.02),
                ..Default::default()
            },
        ),
    ];
    let rows = [("peaked", logits(vocab, 4.0, 14.0, 1)), ("flat", logits(vocab, 1.0, 0.0, 2))];
    let mut out = Vec::new();
    println!("vocabulary {vocab}, median of {reps} picks a cell (us per pick, one thread)");
    println!("| parameters | {} |", rows.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(" | "));
    println!("|---|{}", "---|".repeat(rows.len()));
    let floors: Vec<(f64, f64)> = rows
        .iter()
        .map(|(_, l)| {
            let (am, _) = median_us(reps, || u64::from(argmax(l)));
            let (sm, _) = median_us(reps, || softmax(l, 0.7).len() as u64);
            (am, sm)
        })
        .collect();
    println!(
        "| floor: one argmax pass | {} |",
        floors.iter().map(|f| format!("{:.0}", f.0)).collect::<Vec<_>>().join(" | ")
    );
    println!(
        "| floor: f64 softmax | {} |",
        floors.iter().map(|f| format!("{:.0}", f.1)).collect::<Vec<_>>().join(" | ")
    );
    for (name, params) in sets {
        let mut cells = Vec::new();
        for (row, l) in &rows {
            let mut s = Sampler::new(params)?;
            let (us, _) = median_us(reps, || u64::from(s.sample_after(l, &[])));
            cells.push(format!("{us:.0}"));
            out.push(serde_json::json!({"parameters": name, "row": row, "us_per_pick": us}));
        }
        println!("| {name} | {} |", cells.join(" | "));
    }
    if let Some(path) = json {
        let doc = serde_json::json!({
            "what": "host time per sampled token (eyrie_model::sampling::Sampler::sample_after), one thread",
            "vocab": vocab, "reps": reps,
            "floors_us": rows.iter().zip(&floors).map(|((r, _), f)| serde_json::json!({"row": r, "argmax": f.0, "softmax_f64": f.1})).collect::<Vec<_>>(),
            "rows": out,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")?;
    }
    Ok(())
}
