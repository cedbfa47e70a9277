//! `eyrie score` and `eyrie generate` end to end on the tiny golden models of `fixtures/model/` (built by HF
//! transformers, `scripts/fixtures_model.py`): logits and hidden states within `max|a-b| / max|b| <= 1e-4` of the
//! reference, greedy tokens equal to `generate(do_sample=False)`, prompts through a tokenizer and chat template,
//! seeded sampling, and clear errors (exit code 1, no panic) on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use eyrie_quant::SafetensorsFile;
use serde_json::Value;

const TOLERANCE: f32 = 1e-4;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/model").join(name)
}

fn eyrie(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_eyrie")).args(args).output().expect("the eyrie binary runs")
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// `max |a - b| / max |b|`.
fn scaled_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    let scale = want.iter().map(|b| b.abs()).fold(0.0f32, f32::max).max(f32::MIN_POSITIVE);
    diff / scale
}

fn ids(file: &SafetensorsFile, name: &str) -> Vec<u32> {
    file.tensor(name).unwrap().to_i64_vec().unwrap().iter().map(|&t| u32::try_from(t).unwrap()).collect()
}

fn csv(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// Runs `generate ... --json` and returns the parsed JSON line, checking it is the only stdout output.
fn generate_json(args: &[&str]) -> Value {
    let out = eyrie(&[&["generate", "--json", "--device", "cpu"], args].concat());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stdout.lines().count(), 1, "--json prints exactly one line: {stdout:?}");
    serde_json::from_str(stdout.trim()).expect("--json prints JSON")
}

fn json_ids(v: &Value) -> Vec<u32> {
    v["tokens"].as_array().expect("tokens array").iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

fn check_score(name: &str) {
    let dir = fixture(name);
    let reference = SafetensorsFile::open(dir.join("reference.safetensors")).unwrap();
    let layers = serde_json::from_str::<Value>(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
        ["num_hidden_layers"]
        .as_u64()
        .unwrap() as usize;
    let tmp = tempfile::tempdir().unwrap();
    let (mut worst_logits, mut worst_hidden) = (0.0f32, 0.0f32);
    for p in 0..2 {
        let tokens = ids(&reference, &format!("tokens.{p}"));
        let out_path = tmp.path().join(format!("score{p}.safetensors"));
        let out = eyrie(&[
            "score",
            "--model",
            path_str(&dir),
            "--tokens",
            &csv(&tokens),
            "--out",
            path_str(&out_path),
            "--device",
            "cpu",
        ]);
        assert!(out.status.success(), "{}", text(&out).1);
        let got = SafetensorsFile::open(&out_path).unwrap();
        assert_eq!(ids(&got, "tokens"), tokens);
        assert_eq!(got.len(), layers + 3, "tokens, logits, {layers} layer inputs and hidden.final");
        let logits = got.tensor("logits").unwrap();
        logits.expect_shape(&[tokens.len(), 256]).unwrap();
        let err = scaled_error(
            &logits.to_f32_vec().unwrap(),
            &reference.tensor(&format!("logits.{p}")).unwrap().to_f32_vec().unwrap(),
        );
        assert!(err <= TOLERANCE, "{name} prompt {p}: logits error {err:e}");
        worst_logits = worst_logits.max(err);
        for i in 0..=layers {
            let key = if i < layers { format!("hidden.{i}") } else { "hidden.final".to_string() };
            let h = got.tensor(&key).unwrap();
            h.expect_shape(&[tokens.len(), 64]).unwrap();
            let want = reference.tensor(&format!("hidden.{p}.{i}")).unwrap().to_f32_vec().unwrap();
            let err = scaled_error(&h.to_f32_vec().unwrap(), &want);
            assert!(err <= TOLERANCE, "{name} prompt {p}: {key} error {err:e}");
            worst_hidden = worst_hidden.max(err);
        }
    }
    println!("{name}: eyrie score max scaled error logits {worst_logits:.2e}, hidden states {worst_hidden:.2e}");
}

fn check_greedy(name: &str) {
    let dir = fixture(name);
    let reference = SafetensorsFile::open(dir.join("reference.safetensors")).unwrap();
    for p in 0..2 {
        let tokens = csv(&ids(&reference, &format!("tokens.{p}")));
        let want = ids(&reference, &format!("greedy.{p}"));
        // The reference was generated with eos disabled.
        let base = ["--model", path_str(&dir), "--tokens", &tokens, "--max-tokens", "32"];
        let v = generate_json(&[&base[..], &["--ignore-eos"]].concat());
        assert_eq!(json_ids(&v), want, "{name} prompt {p}: greedy tokens differ");
        assert_eq!(v["text"], Value::Null, "no tokenizer, no text");
        // With eos on, generation stops at (and reports) config.json's eos_token_id 1.
        let stop = want.iter().position(|&t| t == 1).map_or(want.len(), |i| i + 1);
        let v = generate_json(&base);
        assert_eq!(json_ids(&v), want[..stop], "{name} prompt {p}: stop at eos");
    }
}

#[test]
fn score_yarn_qlora_matches_transformers() {
    check_score("yarn_qlora");
}

#[test]
fn score_int4_experts_matches_transformers() {
    check_score("int4_experts");
}

#[test]
fn generate_greedy_yarn_qlora_matches_transformers() {
    check_greedy("yarn_qlora");
}

#[test]
fn generate_greedy_kimi_k25_matches_transformers() {
    check_greedy("kimi_k25");
}

#[test]
fn generate_streams_ids_without_a_tokenizer() {
    let dir = fixture("yarn_qlora");
    let out =
        eyrie(&["generate", "--model", path_str(&dir), "--tokens", "5,250,64", "--max-tokens", "5", "--device", "cpu"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let streamed: Vec<u32> = stdout.split_whitespace().map(|t| t.parse().unwrap()).collect();
    let v = generate_json(&["--model", path_str(&dir), "--tokens", "5,250,64", "--max-tokens", "5"]);
    assert_eq!(streamed, json_ids(&v));
    assert_eq!(streamed.len(), 5);
}

#[test]
fn seeded_sampling_is_reproducible() {
    let dir = fixture("yarn_qlora");
    let run = |seed: &str| {
        json_ids(&generate_json(&[
            "--model",
            path_str(&dir),
            "--tokens",
            "1,17,200",
            "--max-tokens",
            "16",
            "--ignore-eos",
            "--temperature",
            "1.5",
            "--top-p",
            "0.95",
            "--seed",
            seed,
        ]))
    };
    let (a, b, c) = (run("7"), run("7"), run("8"));
    assert_eq!(a, b, "same seed, same tokens");
    assert_eq!(a.len(), 16);
    assert_ne!(a, c, "another seed, other tokens");
    // Temperature 0 is greedy.
    let greedy = |t: &[&str]| {
        json_ids(&generate_json(
            &[&["--model", path_str(&dir), "--tokens", "1,17,200", "--max-tokens", "8", "--ignore-eos"][..], t]
                .concat(),
        ))
    };
    assert_eq!(greedy(&["--temperature", "0", "--seed", "3"]), greedy(&[]));
}

/// A byte-level `tokenizer.json` whose id for byte `b` is `b` (GPT-2's byte-to-unicode alphabet, no merges), so
/// the fixture models' 256-token vocabulary is the byte alphabet.
fn byte_tokenizer_json() -> String {
    let printable: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut chars = vec![0u32; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        chars[b as usize] = if printable.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
    }
    let vocab: serde_json::Map<String, Value> =
        (0..256).map(|b| (char::from_u32(chars[b]).unwrap().to_string(), Value::from(b))).collect();
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": []}
    })
    .to_string()
}

#[test]
fn generate_from_a_prompt_and_a_chat_template() {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture("yarn_qlora")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    std::fs::write(tmp.path().join("tokenizer.json"), byte_tokenizer_json()).unwrap();
    std::fs::write(
        tmp.path().join("chat_template.jinja"),
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
    )
    .unwrap();
    let dir = path_str(tmp.path());
    let as_ids = |s: &str| csv(&s.bytes().map(u32::from).collect::<Vec<_>>());
    let common = ["--model", dir, "--max-tokens", "12", "--ignore-eos"];

    // A plain prompt is its bytes; the JSON text is the generated bytes, lossily decoded.
    let v = generate_json(&[&common[..], &["--prompt", "Hi!"]].concat());
    let w = generate_json(&[&common[..], &["--tokens", &as_ids("Hi!")]].concat());
    assert_eq!(v, w, "a prompt and its token ids give the same output");
    let bytes: Vec<u8> = json_ids(&v).iter().map(|&t| t as u8).collect();
    assert_eq!(v["text"].as_str().unwrap(), String::from_utf8_lossy(&bytes));

    // The streamed text equals the decoded whole.
    let out = eyrie(&[&["generate", "--device", "cpu"], &common[..], &["--prompt", "Hi!"]].concat());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert_eq!(stdout, format!("{}\n", v["text"].as_str().unwrap()));

    // --chat renders one user turn plus the generation prompt.
    let v = generate_json(&[&common[..], &["--prompt", "Hi!", "--chat"]].concat());
    let w = generate_json(&[&common[..], &["--tokens", &as_ids("user: Hi!\nassistant:")]].concat());
    assert_eq!(v, w, "--chat renders the template");
}

fn assert_clean_failure(out: &Output, needles: &[&str]) {
    let (stdout, stderr) = text(out);
    assert_eq!(out.status.code(), Some(1), "stdout {stdout:?} stderr {stderr:?}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{n:?} not in {stderr:?}");
    }
}

#[test]
fn bad_input_is_a_clear_error() {
    let fx = fixture("yarn_qlora");
    let dir = path_str(&fx);
    let tmp = tempfile::tempdir().unwrap();
    let out_file = tmp.path().join("x.safetensors");
    let out_file = path_str(&out_file);
    for cmd in [
        vec!["generate", "--model", dir, "--device", "cpu", "--tokens"],
        vec!["score", "--model", dir, "--device", "cpu", "--out", out_file, "--tokens"],
    ] {
        let out = eyrie(&[&cmd[..], &["1,17,abc"]].concat());
        assert_clean_failure(&out, &["\"abc\"", "position 2"]);
        let out = eyrie(&[&cmd[..], &["1,256,3"]].concat());
        assert_clean_failure(&out, &["256", "position 1", "vocabulary"]);
        let out = eyrie(&[&cmd[..], &["3,-4"]].concat());
        assert_clean_failure(&out, &["\"-4\"", "position 1"]);
    }
    assert!(!Path::new(out_file).exists(), "no output on error");
    let out = eyrie(&["generate", "--model", dir, "--prompt", "hello", "--device", "cpu"]);
    assert_clean_failure(&out, &["--prompt needs a tokenizer", dir]);
    let out = eyrie(&["generate", "--model", dir, "--tokens", "1", "--temperature", "-1", "--device", "cpu"]);
    assert_clean_failure(&out, &["temperature"]);
}
