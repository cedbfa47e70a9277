//! The `eyrie` binary end to end on the committed compressed-tensors fixture: `inspect` and `dequant`, including
//! their errors on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use eyrie_quant::Checkpoint;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/quant")
}

fn eyrie(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_eyrie")).args(args).output().expect("the eyrie binary runs")
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn inspect_reports_architecture_quantization_and_bytes() {
    let fx = fixture();
    let out = eyrie(&["inspect", fx.to_str().expect("utf-8 path")]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("DeepseekV3ForCausalLM"), "{stdout}");
    assert!(stdout.contains("int4 pack-quantized, group 32, symmetric"), "{stdout}");
    assert!(stdout.contains("shards      2"), "{stdout}");

    let out = eyrie(&["inspect", fx.to_str().expect("utf-8 path"), "--json"]);
    assert!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("inspect --json prints JSON");
    let ckpt = Checkpoint::open(&fx).expect("fixture opens");
    assert_eq!(json["tensors"], ckpt.len());
    assert_eq!(json["bytes"], ckpt.total_bytes());
    assert_eq!(json["by_quantization"]["int4 pack-quantized linears"]["count"], 6);
    // Every tensor is counted exactly once across the quantization groups.
    let counted: u64 = json["by_quantization"]
        .as_object()
        .expect("object")
        .values()
        .map(|t| t["bytes"].as_u64().expect("bytes"))
        .sum();
    assert_eq!(counted, ckpt.total_bytes());
}

#[test]
fn dequant_matches_the_reference_library_bit_for_bit() {
    let fx = fixture();
    let expected = Checkpoint::open(fx.join("expected.safetensors")).expect("expected outputs open");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut checked = 0;
    for name in expected.names().filter(|n| n.ends_with(".weight")) {
        let module = name.trim_end_matches(".weight");
        let out_path = dir.path().join(format!("{module}.safetensors"));
        // Accept the module name with a `.weight_packed` suffix too, as users paste tensor names.
        let out = eyrie(&[
            "dequant",
            fx.to_str().expect("utf-8 path"),
            "--tensor",
            &format!("{module}.weight_packed"),
            "--out",
            out_path.to_str().expect("utf-8 path"),
        ]);
        assert!(out.status.success(), "{module}: {}", text(&out).1);
        let got = Checkpoint::open(&out_path).expect("written file opens");
        let got = got.tensor(name).expect("weight written under <module>.weight");
        let want = expected.tensor(name).expect("expected tensor");
        assert_eq!(got.shape, want.shape, "{module}");
        assert_eq!(got.data, want.data, "{module}: bf16 bits differ from compressed-tensors' decompression");
        checked += 1;
    }
    assert_eq!(checked, 6);
}

#[test]
fn bad_input_gives_a_clear_error_and_exit_code() {
    let fx = fixture();
    let dir = tempfile::tempdir().expect("tempdir");
    let out_path = dir.path().join("w.safetensors");
    let out = eyrie(&[
        "dequant",
        fx.to_str().expect("utf-8 path"),
        "--tensor",
        "model.layers.9.mlp.experts.0.gate_proj",
        "--out",
        out_path.to_str().expect("utf-8 path"),
    ]);
    assert!(!out.status.success());
    assert!(text(&out).1.contains("model.layers.9.mlp.experts.0.gate_proj"), "{}", text(&out).1);
    assert!(!out_path.exists(), "nothing written on error");

    let out = eyrie(&["inspect", dir.path().to_str().expect("utf-8 path")]);
    assert!(!out.status.success());
    assert!(text(&out).1.contains("no model.safetensors.index.json"), "{}", text(&out).1);

    let out = eyrie(&["dequant", fx.to_str().expect("utf-8 path"), "--tensor", "x", "--out", "y", "--device", "tpu"]);
    assert!(!out.status.success());
    assert!(text(&out).1.contains("--device"), "{}", text(&out).1);
}
