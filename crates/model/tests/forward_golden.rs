//! Golden tests of the DeepSeek-V3 forward pass against HF transformers (`scripts/fixtures_model.py`), on burn's
//! CPU backend `Flex` in f32.
//!
//! For each fixture model and each of its two prompts:
//! - logits `[n, vocab]` and every hidden state of transformers' `output_hidden_states` (`[n, d]`, the inputs of
//!   each layer and the final normed state) must match with `max_i |a_i - b_i| / max_i |b_i| <= 1e-4` per tensor
//!   (the error relative to the tensor's scale; a per-element relative error would be meaningless at values that
//!   cross zero);
//! - greedy generation of 32 tokens must equal transformers' `generate(do_sample=False)` token for token (the
//!   fixture script guarantees every greedy step and router decision has a margin of at least 5e-4).

mod common;

use common::{fixture, host, scaled_error};

use burn::backend::Flex;
use eyrie_model::error::ModelError;
use eyrie_model::quant::{Checkpoint, SafetensorsFile, SafetensorsWriter};
use eyrie_model::{DeepseekV3, ModelConfig};

const TOLERANCE: f32 = 1e-4;
const FIXTURES: [&str; 4] = ["yarn_qlora", "v2lite", "int4_experts", "kimi_k25"];

/// `max |a - b| / max |b|`.
fn check_fixture(name: &str) {
    let device = Default::default();
    let dir = fixture(name);
    let model = DeepseekV3::<Flex>::load(&dir, &device).unwrap_or_else(|e| panic!("{name}: {e}"));
    let reference = SafetensorsFile::open(dir.join("reference.safetensors")).unwrap();
    let layers = model.config.num_hidden_layers;
    let (mut worst_logits, mut worst_hidden) = (0.0f32, 0.0f32);
    for p in 0..2 {
        let ids: Vec<u32> =
            reference.tensor(&format!("tokens.{p}")).unwrap().to_i64_vec().unwrap().iter().map(|&t| t as u32).collect();
        let out = model.forward_with_hidden(model.token_tensor(&[&ids], &device).unwrap());
        let logits = reference.tensor(&format!("logits.{p}")).unwrap().to_f32_vec().unwrap();
        let err = scaled_error(&host(out.logits), &logits);
        assert!(err <= TOLERANCE, "{name} prompt {p}: logits error {err:e}");
        worst_logits = worst_logits.max(err);
        assert_eq!(out.hidden_states.len(), layers + 1);
        for (i, h) in out.hidden_states.into_iter().enumerate() {
            let want = reference.tensor(&format!("hidden.{p}.{i}")).unwrap().to_f32_vec().unwrap();
            let err = scaled_error(&host(h), &want);
            assert!(err <= TOLERANCE, "{name} prompt {p}: hidden_states[{i}] error {err:e}");
            worst_hidden = worst_hidden.max(err);
        }
        let want: Vec<u32> =
            reference.tensor(&format!("greedy.{p}")).unwrap().to_i64_vec().unwrap().iter().map(|&t| t as u32).collect();
        let got = model.generate_greedy(&ids, want.len(), &device).unwrap();
        assert_eq!(got, want, "{name} prompt {p}: greedy tokens differ");
    }
    println!("{name}: max scaled error logits {worst_logits:.2e}, hidden states {worst_hidden:.2e}; greedy 2x32 equal");
}

#[test]
fn yarn_qlora_matches_transformers() {
    check_fixture(FIXTURES[0]);
}

#[test]
fn v2lite_matches_transformers() {
    check_fixture(FIXTURES[1]);
}

#[test]
fn int4_experts_match_transformers_on_decompressed_weights() {
    check_fixture(FIXTURES[2]);
}

#[test]
fn kimi_k25_layout_matches_transformers() {
    check_fixture(FIXTURES[3]);
}

/// A copy of the v2lite fixture with extra tensors written to a second shard.
fn with_extra_shard(extra: &[&str]) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("v2lite").join(f), tmp.path().join(f)).unwrap();
    }
    let mut w = SafetensorsWriter::new();
    for name in extra {
        w.add_f32(*name, &[2], &[1.0, 2.0]).unwrap();
    }
    w.write(tmp.path().join("model-extra.safetensors")).unwrap();
    tmp
}

#[test]
fn unused_checkpoint_tensors_are_an_error_listing_them() {
    let device = Default::default();
    // v2lite has 2 layers and num_nextn_predict_layers 0: layer 2 is not an MTP layer, so it is not skipped.
    let tmp = with_extra_shard(&["model.layers.2.enorm.weight", "vision_tower.x", "model.norm.bias"]);
    match DeepseekV3::<Flex>::load(tmp.path(), &device).unwrap_err() {
        ModelError::UnusedTensors { tensors, .. } => {
            assert_eq!(tensors, ["model.layers.2.enorm.weight", "model.norm.bias", "vision_tower.x"]);
        }
        e => panic!("{e}"),
    }
}

#[test]
fn every_fixture_tensor_is_consumed_or_skipped_on_purpose() {
    // The loads above succeed only if nothing is left over; here check that the skips are exactly the MTP layer
    // (yarn_qlora) and the vision tensors (kimi_k25), so a skip rule cannot hide real weights.
    for (name, want) in [
        (
            "yarn_qlora",
            vec!["model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight", "model.layers.3.hnorm.weight"],
        ),
        (
            "kimi_k25",
            vec![
                "mm_projector.proj.0.weight",
                "vision_tower.encoder.blocks.0.norm0.weight",
                "vision_tower.patch_embed.proj.weight",
            ],
        ),
        ("v2lite", vec![]),
        ("int4_experts", vec![]),
    ] {
        let dir = fixture(name);
        let config = ModelConfig::from_dir(&dir).unwrap();
        let ckpt = Checkpoint::open(&dir).unwrap();
        let skipped: Vec<&str> =
            ckpt.names().filter(|n| eyrie_model::weights::skip_reason(&config, n).is_some()).collect();
        assert_eq!(skipped, want, "{name}");
    }
}

#[test]
fn missing_and_misshapen_tensors_are_named() {
    let device = Default::default();
    let dir = fixture("v2lite");
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
    // A config asking for one more layer than the checkpoint has.
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["num_hidden_layers"] = 3.into();
    let config = ModelConfig::from_json(json, &dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    match DeepseekV3::<Flex>::from_checkpoint(config, &ckpt, &device).unwrap_err() {
        ModelError::MissingTensor { tensor, .. } => assert!(tensor.starts_with("model.layers.2."), "{tensor}"),
        e => panic!("{e}"),
    }
    // A config whose hidden size disagrees with the weights.
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["vocab_size"] = 300.into();
    let config = ModelConfig::from_json(json, &dir.join("config.json")).unwrap();
    match DeepseekV3::<Flex>::from_checkpoint(config, &ckpt, &device).unwrap_err() {
        ModelError::TensorShape { tensor, expected, found, .. } => {
            assert_eq!((tensor.as_str(), expected, found), ("model.embed_tokens.weight", vec![300, 64], vec![256, 64]));
        }
        e => panic!("{e}"),
    }
    // Token ids outside the vocabulary are an input error, not a panic.
    let model = DeepseekV3::<Flex>::load(&dir, &device).unwrap();
    assert!(matches!(model.token_tensor(&[&[1, 256]], &device), Err(ModelError::Input { .. })));
    assert!(matches!(model.token_tensor(&[&[]], &device), Err(ModelError::Input { .. })));
}

#[test]
fn a_batch_equals_its_rows_run_alone() {
    let device = Default::default();
    let dir = fixture("yarn_qlora");
    let model = DeepseekV3::<Flex>::load(&dir, &device).unwrap();
    let reference = SafetensorsFile::open(dir.join("reference.safetensors")).unwrap();
    let row = |p: usize| -> Vec<u32> {
        reference.tensor(&format!("tokens.{p}")).unwrap().to_i64_vec().unwrap().iter().map(|&t| t as u32).collect()
    };
    let (a, b) = (row(0), row(1)[..7].to_vec());
    let batch = host(model.forward(model.token_tensor(&[&a, &b], &device).unwrap()));
    let vocab = model.config.vocab_size;
    for (i, r) in [a, b].iter().enumerate() {
        let alone = host(model.forward(model.token_tensor(&[r], &device).unwrap()));
        let part = &batch[i * 7 * vocab..(i + 1) * 7 * vocab];
        let err = scaled_error(part, &alone);
        assert!(err <= 1e-5, "row {i}: {err:e}");
    }
}
