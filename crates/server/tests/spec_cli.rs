//! `eyrie generate --speculative-*` and `eyrie spec check` end to end on the tiny random target
//! `fixtures/model/yarn_qlora` and the random EAGLE-3 drafters of `fixtures/spec/` made for it: speculative greedy
//! output (chain and tree, both drafter layouts) is token-identical to plain greedy output and to transformers'
//! `generate`, stops at end-of-sequence and `--max-tokens` like the plain path, reports its statistics in the JSON
//! line; `spec check` prints both conventions; bad flags and a drafter that does not fit exit 1 naming the problem.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use eyrie_quant::SafetensorsFile;
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn eyrie(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_eyrie")).args(args).output().expect("the eyrie binary runs")
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// `generate --json --device cpu` on yarn_qlora with `args`; the parsed JSON line.
fn generate_json(args: &[&str]) -> Value {
    let target = fixture("model/yarn_qlora");
    let out = eyrie(&[&["generate", "--json", "--device", "cpu", "--model", path_str(&target)], args].concat());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stdout.lines().count(), 1, "--json prints exactly one line: {stdout:?}");
    serde_json::from_str(stdout.trim()).expect("--json prints JSON")
}

fn json_ids(v: &Value) -> Vec<u32> {
    v["tokens"].as_array().expect("tokens array").iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

/// The first reference prompt and transformers' greedy continuation (32 tokens, eos disabled).
fn reference() -> (String, Vec<u32>) {
    let file = SafetensorsFile::open(fixture("model/yarn_qlora/reference.safetensors")).unwrap();
    let ids = |name: &str| -> Vec<u32> {
        file.tensor(name).unwrap().to_i64_vec().unwrap().iter().map(|&t| u32::try_from(t).unwrap()).collect()
    };
    let prompt = ids("tokens.0").iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    (prompt, ids("greedy.0"))
}

fn check_stats(v: &Value, num_steps: usize) {
    let s = &v["speculative"];
    assert_eq!(s["algorithm"], "EAGLE3", "{v}");
    assert!(s["steps"].as_u64().unwrap() > 0, "{s}");
    let rates = s["position_rates"].as_array().unwrap();
    assert!(!rates.is_empty() && rates.len() <= num_steps, "{s}");
    assert!(rates.iter().all(|r| (0.0..=1.0).contains(&r.as_f64().unwrap())), "{s}");
    assert!(s["mean_accepted_length"].as_f64().unwrap() >= 1.0, "{s}");
    assert!(s["tokens_per_s"].as_f64().unwrap() > 0.0, "{s}");
    assert!(s["draft_ms"].as_f64().unwrap() >= 0.0 && s["verify_ms"].as_f64().unwrap() > 0.0, "{s}");
}

#[test]
fn speculative_greedy_equals_plain_greedy() {
    let (prompt, want) = reference();
    let specforge = fixture("spec/specforge");
    let speculators = fixture("spec/speculators");
    let base = ["--tokens", prompt.as_str(), "--max-tokens", "13", "--ignore-eos"];
    let plain = generate_json(&base);
    assert_eq!(json_ids(&plain), want[..13], "plain greedy = transformers");
    assert!(plain.get("speculative").is_none(), "{plain}");

    let eagle = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path"];
    // Chain (SpecForge layout, its default output-of-layer convention), 3 steps.
    let chain = generate_json(&[&base[..], &eagle, &[path_str(&specforge), "--speculative-num-steps", "3"]].concat());
    assert_eq!(json_ids(&chain), want[..13], "chain");
    check_stats(&chain, 3);
    assert_eq!(chain["speculative"]["aux_convention"], "output-of-layer");
    // Tree (speculators layout, its default input-of-layer convention): depth 2, top-2, 5 nodes.
    let tree_flags =
        ["--speculative-num-steps", "2", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "5"];
    let tree = generate_json(&[&base[..], &eagle, &[path_str(&speculators)], &tree_flags].concat());
    assert_eq!(json_ids(&tree), want[..13], "tree");
    check_stats(&tree, 2);
    assert_eq!(tree["speculative"]["aux_convention"], "input-of-layer");
    assert_eq!(tree["speculative"]["capture_ids"], serde_json::json!([0, 1, 2]));

    // With end-of-sequence on: both paths stop at (and report) config.json's eos id 1, or at --max-tokens.
    let base = ["--tokens", prompt.as_str(), "--max-tokens", "32"];
    let stop = want.iter().position(|&t| t == 1).map_or(want.len(), |i| i + 1);
    assert_eq!(json_ids(&generate_json(&base)), want[..stop], "plain, eos on");
    let chain = generate_json(&[&base[..], &eagle, &[path_str(&specforge), "--speculative-num-steps", "1"]].concat());
    assert_eq!(json_ids(&chain), want[..stop], "chain, eos on");
}

#[test]
fn speculative_generate_streams_and_prints_statistics() {
    let (prompt, want) = reference();
    let specforge = fixture("spec/specforge");
    let target = fixture("model/yarn_qlora");
    let out = eyrie(&[
        "generate",
        "--device",
        "cpu",
        "--model",
        path_str(&target),
        "--tokens",
        &prompt,
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        path_str(&specforge),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let streamed: Vec<u32> = stdout.split_whitespace().map(|t| t.parse().unwrap()).collect();
    assert_eq!(streamed, want[..5], "ids streamed without a tokenizer");
    for needle in ["speculative:", "accept rate", "mean accepted length", "per position", "draft", "verify", "tokens/s"]
    {
        assert!(stderr.contains(needle), "stderr lacks {needle:?}: {stderr}");
    }
}

#[test]
fn spec_check_compares_both_conventions() {
    let target = fixture("model/yarn_qlora");
    let run = |drafter: &str| {
        let out = eyrie(&[
            "spec",
            "check",
            "--device",
            "cpu",
            "--model",
            path_str(&target),
            "--speculative-draft-model-path",
            path_str(&fixture(drafter)),
            "--num-steps",
            "2",
            "--max-tokens",
            "4",
        ]);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        stdout
    };
    // Ids [0, 1, 2] name the last layer's output under output-of-layer: only input-of-layer loads.
    let table = run("spec/speculators");
    for needle in ["speculators", "built-in", "input-of-layer", "output-of-layer", "[0, 1, 2]", "does not load"] {
        assert!(table.contains(needle), "no {needle:?} in:\n{table}");
    }
    assert!(table.contains("aux layer id 2"), "{table}");
    assert!(table.contains("best fit: input-of-layer"), "{table}");
    // No aux ids in the config: both conventions capture the same layers.
    let table = run("spec/specforge");
    assert!(table.contains("input-of-layer") && table.contains("output-of-layer"), "{table}");
    assert!(table.contains("best fit: either"), "{table}");
}

/// A copy of the SpecForge fixture drafter with one config field changed.
fn tampered(dir: &Path, key: &str, value: Value) -> PathBuf {
    let src = fixture("spec/specforge");
    let out = dir.join(key);
    std::fs::create_dir_all(&out).unwrap();
    std::fs::copy(src.join("model.safetensors"), out.join("model.safetensors")).unwrap();
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    config[key] = value;
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    out
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn assert_fails(args: &[&str], needles: &[&str]) {
    let out = eyrie(args);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{args:?} should exit 1: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "{args:?}: no {needle:?} in {stderr}");
    }
}

#[test]
fn mismatched_drafters_and_bad_flags_exit_1() {
    let target = fixture("model/yarn_qlora");
    let tmp = tempfile::tempdir().unwrap();
    let wrong_vocab = tampered(tmp.path(), "vocab_size", 300.into());
    let wrong_ids = tampered(tmp.path(), "eagle_aux_hidden_state_layer_ids", serde_json::json!([0, 1, 7]));
    let generate = |drafter: &Path, extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = ["generate", "--device", "cpu", "--model", path_str(&target), "--tokens", "1,2,3"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(
            ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", path_str(drafter)]
                .map(String::from),
        );
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };

    let args = generate(&wrong_vocab, &[]);
    assert_fails(&refs(&args), &["drafter does not match the target", "vocab_size", "300"]);
    let args = generate(&wrong_ids, &[]);
    assert_fails(&refs(&args), &["aux layer id 7"]);
    // The speculators fixture's id 2 is out of range when read as output-of-layer.
    let args = generate(&fixture("spec/speculators"), &["--speculative-aux-convention", "output-of-layer"]);
    assert_fails(&refs(&args), &["aux layer id 2"]);
    let mut args = generate(&fixture("spec/specforge"), &[]);
    args[8] = "MEDUSA".into();
    assert_fails(&refs(&args), &["MEDUSA", "only value accepted is EAGLE3"]);
    let args = generate(&fixture("spec/specforge"), &["--speculative-eagle-topk", "2"]);
    assert_fails(&refs(&args), &["--speculative-num-draft-tokens"]);

    // spec check: a drafter that loads under neither convention is an error, with the library's message.
    assert_fails(
        &[
            "spec",
            "check",
            "--device",
            "cpu",
            "--model",
            path_str(&target),
            "--speculative-draft-model-path",
            path_str(&wrong_vocab),
        ],
        &["drafter does not match the target", "vocab_size"],
    );
}
