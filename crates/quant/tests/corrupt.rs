//! Corrupt and inconsistent checkpoints: each defect gives its own error variant, naming the file and tensor.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use eyrie_quant::write::{INDEX_FILE, write_index};
use eyrie_quant::{Checkpoint, Dtype, QuantError, SafetensorsFile, SafetensorsWriter};

/// A valid two-tensor shard: `a` (F32 [4], bytes 0..16) then `b` (F32 [8], bytes 16..48).
fn two_tensors() -> SafetensorsWriter {
    let mut w = SafetensorsWriter::new();
    w.add_f32("a", &[4], &[1.0, 2.0, 3.0, 4.0]).expect("add a");
    w.add_f32("b", &[2, 4], &[0.5; 8]).expect("add b");
    w
}

/// Writes a file whose header JSON is exactly `header` (no padding), followed by `data`.
fn write_raw(path: &Path, header: &str, data: &[u8]) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    std::fs::write(path, bytes).expect("write raw");
}

/// Asserts that the error message names each of `parts`.
fn assert_names(err: &QuantError, parts: &[&str]) {
    let msg = err.to_string();
    for part in parts {
        assert!(msg.contains(part), "message {msg:?} does not name {part:?}");
    }
}

fn shard(dir: &Path, name: &str, tensors: &[(&str, f32)]) -> PathBuf {
    let mut w = SafetensorsWriter::new();
    for &(t, v) in tensors {
        w.add_f32(t, &[2], &[v, v]).expect("add");
    }
    let path = dir.join(name);
    w.write(&path).expect("write shard");
    path
}

fn index(dir: &Path, map: &[(&str, &str)]) {
    let map: BTreeMap<String, String> = map.iter().map(|&(t, s)| (t.to_owned(), s.to_owned())).collect();
    write_index(dir, &map, 0).expect("write index");
}

#[test]
fn truncated_shard() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cut.safetensors");
    let bytes = two_tensors().to_bytes();
    std::fs::write(&path, &bytes[..bytes.len() - 10]).expect("write");
    let err = SafetensorsFile::open(&path).expect_err("truncated");
    let QuantError::Truncated { what, needed, actual, .. } = &err else { panic!("expected Truncated, got {err:?}") };
    assert!(what.contains("\"b\""), "{what}");
    assert_eq!((*needed, *actual), (bytes.len() as u64, bytes.len() as u64 - 10));
    assert_names(&err, &["cut.safetensors", "\"b\""]);
    // The same defect seen through a checkpoint directory.
    let err = Checkpoint::open(dir.path()).expect_err("truncated checkpoint");
    assert!(matches!(err, QuantError::Truncated { .. }), "{err:?}");
}

#[test]
fn header_length_larger_than_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("long.safetensors");
    let mut bytes = two_tensors().to_bytes();
    let claimed = bytes.len() as u64;
    bytes[..8].copy_from_slice(&claimed.to_le_bytes());
    std::fs::write(&path, &bytes).expect("write");
    let err = SafetensorsFile::open(&path).expect_err("long header");
    assert!(matches!(&err, QuantError::Truncated { what, .. } if what == "header"), "{err:?}");
    assert_names(&err, &["long.safetensors", "header"]);
}

#[test]
fn header_not_json() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("garbage.safetensors");
    write_raw(&path, "this is not JSON", &[]);
    let err = SafetensorsFile::open(&path).expect_err("not json");
    assert!(matches!(err, QuantError::Json { field: None, .. }), "{err:?}");
    assert_names(&err, &["garbage.safetensors", "malformed JSON"]);
}

#[test]
fn unknown_dtype() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("q.safetensors");
    write_raw(&path, r#"{"blk.0.q":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,2]}}"#, &[0, 0]);
    let err = SafetensorsFile::open(&path).expect_err("unknown dtype");
    assert!(
        matches!(&err, QuantError::UnknownDtype { tensor, dtype, .. } if tensor == "blk.0.q" && dtype == "Q4_K"),
        "{err:?}"
    );
    assert_names(&err, &["q.safetensors", "blk.0.q", "Q4_K"]);
}

#[test]
fn byte_count_mismatch() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("count.safetensors");
    write_raw(&path, r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#, &[0; 8]);
    let err = SafetensorsFile::open(&path).expect_err("byte count");
    assert!(matches!(&err, QuantError::BadHeader { tensor: Some(t), .. } if t == "w"), "{err:?}");
    assert_names(&err, &["count.safetensors", "\"w\"", "12"]);
}

#[test]
fn overlapping_offsets() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("overlap.safetensors");
    let header = r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    write_raw(&path, header, &[0; 12]);
    let err = SafetensorsFile::open(&path).expect_err("overlap");
    assert!(matches!(&err, QuantError::BadHeader { tensor: Some(t), .. } if t == "y"), "{err:?}");
    assert_names(&err, &["overlap.safetensors", "\"y\"", "\"x\"", "overlap"]);
}

#[test]
fn wrong_dtype_requested() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.safetensors");
    two_tensors().write(&path).expect("write");
    let file = SafetensorsFile::open(&path).expect("open");
    let view = file.tensor("a").expect("a");
    let err = view.expect_dtype(&[Dtype::BF16]).expect_err("dtype");
    assert!(matches!(&err, QuantError::DtypeMismatch { found: Dtype::F32, tensor, .. } if tensor == "a"), "{err:?}");
    assert_names(&err, &["m.safetensors", "\"a\"", "BF16", "F32"]);
    assert!(matches!(view.to_bf16_vec(), Err(QuantError::DtypeMismatch { .. })));
}

#[test]
fn wrong_shape() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.safetensors");
    two_tensors().write(&path).expect("write");
    let ck = Checkpoint::open(&path).expect("open");
    let view = ck.tensor("b").expect("b");
    let err = view.expect_shape(&[4, 2]).expect_err("shape");
    assert!(matches!(&err, QuantError::ShapeMismatch { found, .. } if found == &[2, 4]), "{err:?}");
    assert_names(&err, &["m.safetensors", "\"b\"", "[4, 2]", "[2, 4]"]);
    assert!(matches!(view.expect_rank(1), Err(QuantError::ShapeMismatch { .. })));
}

#[test]
fn missing_tensor_lookup() {
    let dir = tempfile::tempdir().expect("tempdir");
    shard(dir.path(), "model.safetensors", &[("present", 1.0)]);
    let ck = Checkpoint::open(dir.path()).expect("open");
    let err = ck.tensor("model.absent.weight").expect_err("missing");
    assert!(matches!(&err, QuantError::MissingTensor { tensor, .. } if tensor == "model.absent.weight"), "{err:?}");
    let dir_name = dir.path().file_name().and_then(|n| n.to_str()).expect("dir name");
    assert_names(&err, &[dir_name, "model.absent.weight"]);
}

#[test]
fn index_pointing_to_missing_shard() {
    let dir = tempfile::tempdir().expect("tempdir");
    shard(dir.path(), "model-00001-of-00002.safetensors", &[("a", 1.0)]);
    index(dir.path(), &[("a", "model-00001-of-00002.safetensors"), ("b", "model-00002-of-00002.safetensors")]);
    let err = Checkpoint::open(dir.path()).expect_err("missing shard");
    assert!(
        matches!(&err, QuantError::MissingShard { tensor, shard, .. }
            if tensor == "b" && shard == "model-00002-of-00002.safetensors"),
        "{err:?}"
    );
    assert_names(&err, &[INDEX_FILE, "model-00002-of-00002.safetensors", "\"b\""]);
}

#[test]
fn index_json_malformed() {
    let dir = tempfile::tempdir().expect("tempdir");
    shard(dir.path(), "model.safetensors", &[("a", 1.0)]);
    for text in [r#"{"weight_map": {"a": "model.safetensors""#, r#"{"metadata": {}}"#, r#"{"weight_map": {"a": 3}}"#] {
        std::fs::write(dir.path().join(INDEX_FILE), text).expect("write index");
        let err = Checkpoint::open(dir.path()).expect_err(text);
        assert!(matches!(err, QuantError::Json { .. }), "{text}: {err:?}");
        assert_names(&err, &[INDEX_FILE]);
    }
}

#[test]
fn index_maps_a_tensor_the_shard_lacks() {
    let dir = tempfile::tempdir().expect("tempdir");
    shard(dir.path(), "s1.safetensors", &[("a", 1.0)]);
    index(dir.path(), &[("a", "s1.safetensors"), ("ghost", "s1.safetensors")]);
    let err = Checkpoint::open(dir.path()).expect_err("ghost");
    assert!(matches!(&err, QuantError::MissingTensor { tensor, .. } if tensor == "ghost"), "{err:?}");
    assert_names(&err, &["s1.safetensors", "\"ghost\""]);
}

#[test]
fn shard_tensor_absent_from_index() {
    let dir = tempfile::tempdir().expect("tempdir");
    shard(dir.path(), "s1.safetensors", &[("a", 1.0), ("extra", 2.0)]);
    index(dir.path(), &[("a", "s1.safetensors")]);
    let err = Checkpoint::open(dir.path()).expect_err("unindexed");
    assert!(matches!(err, QuantError::Invalid { .. }), "{err:?}");
    assert_names(&err, &["s1.safetensors", "\"extra\"", "weight_map"]);
}

#[test]
fn duplicate_tensor_across_shards_without_index() {
    let dir = tempfile::tempdir().expect("tempdir");
    shard(dir.path(), "one.safetensors", &[("a", 1.0), ("dup", 2.0)]);
    shard(dir.path(), "two.safetensors", &[("b", 1.0), ("dup", 3.0)]);
    let err = Checkpoint::open(dir.path()).expect_err("duplicate");
    assert!(matches!(&err, QuantError::DuplicateTensor { tensor, .. } if tensor == "dup"), "{err:?}");
    assert_names(&err, &["one.safetensors", "two.safetensors", "\"dup\""]);
}

#[test]
fn duplicate_tensor_across_shards_with_index() {
    let dir = tempfile::tempdir().expect("tempdir");
    shard(dir.path(), "one.safetensors", &[("a", 1.0), ("dup", 2.0)]);
    shard(dir.path(), "two.safetensors", &[("b", 1.0), ("dup", 3.0)]);
    index(dir.path(), &[("a", "one.safetensors"), ("b", "two.safetensors"), ("dup", "one.safetensors")]);
    let err = Checkpoint::open(dir.path()).expect_err("duplicate");
    assert!(matches!(&err, QuantError::DuplicateTensor { tensor, .. } if tensor == "dup"), "{err:?}");
    assert_names(&err, &["one.safetensors", "two.safetensors", "\"dup\""]);
}

#[test]
fn empty_dir() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("config.json"), "{}").expect("write");
    std::fs::create_dir(dir.path().join("sub.safetensors")).expect("a directory is not a shard");
    let err = Checkpoint::open(dir.path()).expect_err("empty");
    assert!(matches!(err, QuantError::NoCheckpoint { .. }), "{err:?}");
    let dir_name = dir.path().file_name().and_then(|n| n.to_str()).expect("dir name");
    assert_names(&err, &[dir_name]);
}
