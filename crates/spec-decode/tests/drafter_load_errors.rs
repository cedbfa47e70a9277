//! Bad drafters never panic and never load silently: each mismatch with the target, each inconsistent vocabulary
//! map and each missing, misshapen or unused tensor is an error naming the field or tensor at fault. Built by
//! editing copies of the `fixtures/spec/specforge` drafter.

mod common;

use std::path::Path;

use burn::backend::Flex;
use eyrie_model::DeepseekV3;
use eyrie_model::quant::{Checkpoint, SafetensorsWriter};
use eyrie_spec_decode::{AuxConvention, Eagle3Config, Eagle3Drafter};
use serde_json::Value;

use common::fixture;

/// Writes a copy of the specforge drafter into `dir`, with `edit` applied to its config and `tensors` to its
/// tensor list (name, shape, f32 or i64 or bool values).
enum Data {
    F32(Vec<f32>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
}

fn copy_drafter(dir: &Path, edit: impl FnOnce(&mut Value), tensors: impl FnOnce(&mut Vec<(String, Vec<usize>, Data)>)) {
    let src = fixture("spec/specforge");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(dir.join("config.json"), serde_json::to_string(&config).unwrap()).unwrap();
    let ckpt = Checkpoint::open(&src).unwrap();
    let mut list = Vec::new();
    for name in ckpt.names() {
        let view = ckpt.tensor(name).unwrap();
        let data = match name {
            "d2t" => Data::I64(view.to_i64_vec().unwrap()),
            "t2d" => Data::Bool(view.to_bool_vec().unwrap()),
            _ => Data::F32(view.to_f32_vec().unwrap()),
        };
        list.push((name.to_owned(), view.shape.to_vec(), data));
    }
    tensors(&mut list);
    let mut w = SafetensorsWriter::new();
    for (name, shape, data) in list {
        match data {
            Data::F32(v) => w.add_f32(name, &shape, &v).unwrap(),
            Data::I64(v) => w.add_i64(name, &shape, &v).unwrap(),
            Data::Bool(v) => w.add_bool(name, &shape, &v).unwrap(),
        }
    }
    w.write(dir.join("model.safetensors")).unwrap();
}

fn load_error(edit: impl FnOnce(&mut Value), tensors: impl FnOnce(&mut Vec<(String, Vec<usize>, Data)>)) -> String {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let dir = tempfile::tempdir().unwrap();
    copy_drafter(dir.path(), edit, tensors);
    Eagle3Drafter::load(dir.path(), &target, AuxConvention::InputOfLayer, &device).unwrap_err().to_string()
}

fn tensor<'a>(list: &'a mut [(String, Vec<usize>, Data)], name: &str) -> &'a mut (String, Vec<usize>, Data) {
    list.iter_mut().find(|t| t.0 == name).unwrap()
}

#[test]
fn an_unedited_copy_loads() {
    let device = Default::default();
    let target = DeepseekV3::<Flex>::load(fixture("model/yarn_qlora"), &device).unwrap();
    let dir = tempfile::tempdir().unwrap();
    copy_drafter(dir.path(), |_| {}, |_| {});
    Eagle3Drafter::load(dir.path(), &target, AuxConvention::InputOfLayer, &device).unwrap();
}

#[test]
fn target_mismatches_name_the_field() {
    let e = load_error(|c| c["vocab_size"] = 300.into(), |_| {});
    assert!(e.contains("vocab_size") && e.contains("300") && e.contains("256"), "{e}");
    let e = load_error(|c| c["target_hidden_size"] = 128.into(), |_| {});
    assert!(e.contains("target_hidden_size") && e.contains("128"), "{e}");
    let e =
        load_error(|c| c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([0, 1, 4]), |_| {});
    assert!(e.contains("aux layer id 4") && e.contains("0..=3"), "{e}");
    let e = load_error(|c| c["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([0, 1]), |_| {});
    assert!(e.contains("exactly three"), "{e}");
    let e = load_error(|c| c["architectures"] = serde_json::json!(["LlamaForCausalLM"]), |_| {});
    assert!(e.contains("not an EAGLE-3 drafter"), "{e}");
}

#[test]
fn inconsistent_vocabulary_maps_are_errors() {
    // Two draft ids onto one target id.
    let e = load_error(
        |_| {},
        |l| {
            if let Data::I64(d2t) = &mut tensor(l, "d2t").2 {
                d2t[1] = d2t[0] - 1;
            }
        },
    );
    assert!(e.contains("d2t") && e.contains("draft id 1") && e.contains("already mapped"), "{e}");
    // Mapping outside the vocabulary.
    let e = load_error(
        |_| {},
        |l| {
            if let Data::I64(d2t) = &mut tensor(l, "d2t").2 {
                d2t[63] = 1000;
            }
        },
    );
    assert!(e.contains("d2t") && e.contains("outside 0..256"), "{e}");
    // t2d disagreeing with d2t.
    let e = load_error(
        |_| {},
        |l| {
            if let Data::Bool(t2d) = &mut tensor(l, "t2d").2 {
                let i = t2d.iter().position(|&b| !b).unwrap();
                t2d[i] = true;
            }
        },
    );
    assert!(e.contains("t2d["), "{e}");
    // A draft vocabulary without a map.
    let e = load_error(|_| {}, |l| l.retain(|t| t.0 != "d2t"));
    assert!(e.contains("\"d2t\" not found") && e.contains("draft_vocab_size 64"), "{e}");
}

#[test]
fn missing_misshapen_and_unused_tensors_are_errors() {
    let e = load_error(|_| {}, |l| l.retain(|t| t.0 != "midlayer.hidden_norm.weight"));
    assert!(e.contains("midlayer.hidden_norm.weight") && e.contains("not found"), "{e}");
    let e = load_error(
        |_| {},
        |l| {
            let t = tensor(l, "fc.weight");
            t.1 = vec![64, 128];
            if let Data::F32(v) = &mut t.2 {
                v.truncate(64 * 128);
            }
        },
    );
    assert!(e.contains("fc.weight") && e.contains("[64, 128]") && e.contains("[64, 192]"), "{e}");
    let e = load_error(|_| {}, |l| l.push(("midlayer.extra.weight".into(), vec![2], Data::F32(vec![0.0; 2]))));
    assert!(e.contains("not used by the drafter") && e.contains("midlayer.extra.weight"), "{e}");
    // A drafter of another width without its own embedding cannot borrow the target's.
    let e = load_error(
        |c| {
            c["hidden_size"] = 32.into();
            c["target_hidden_size"] = 64.into();
        },
        |_| {},
    );
    assert!(e.contains("hidden_size") && e.contains("embed_tokens"), "{e}");
}

#[test]
fn config_parsing_reads_both_layouts_and_conventions() {
    let target = eyrie_model::ModelConfig::from_dir(fixture("model/yarn_qlora")).unwrap();
    let c = Eagle3Config::from_dir(fixture("spec/speculators")).unwrap();
    assert_eq!((c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.draft_vocab_size), (64, 4, 2, 16, 64));
    assert!(c.norm_before_residual && c.norm_before_fc && !c.fc_norm);
    assert_eq!(c.capture_ids(&target, AuxConvention::InputOfLayer).unwrap(), vec![0, 1, 2]);
    let mut c2 = c.clone();
    c2.aux_layer_ids = Some(vec![0, 1, 1]);
    assert_eq!(c2.capture_ids(&target, AuxConvention::OutputOfLayer).unwrap(), vec![1, 2, 2]);
    let full = Eagle3Config::from_dir(fixture("spec/speculators_fcnorm")).unwrap();
    assert_eq!(full.draft_vocab_size, 256);
    let sf = Eagle3Config::from_dir(fixture("spec/specforge")).unwrap();
    assert_eq!(sf.aux_layer_ids, None);
    assert_eq!(sf.capture_ids(&target, AuxConvention::OutputOfLayer).unwrap(), vec![2, 1, 0]);
}
