//! Property tests: random tensors spread over random shard counts, written with the writer and an index, are found
//! by [`Checkpoint`] exactly once, in the right shard, with identical bytes, whether opened through the index or not.

use std::collections::BTreeMap;
use std::path::Path;

use eyrie_quant::write::{INDEX_FILE, write_index};
use eyrie_quant::{Checkpoint, Dtype, SafetensorsWriter};
use proptest::prelude::*;

const DTYPES: [Dtype; 15] = [
    Dtype::BOOL,
    Dtype::U8,
    Dtype::I8,
    Dtype::I16,
    Dtype::U16,
    Dtype::I32,
    Dtype::U32,
    Dtype::I64,
    Dtype::U64,
    Dtype::F16,
    Dtype::BF16,
    Dtype::F32,
    Dtype::F64,
    Dtype::F8_E4M3,
    Dtype::F8_E5M2,
];

/// One generated tensor: dtype, shape, shard choice (taken modulo the shard count) and a byte seed.
#[derive(Debug, Clone)]
struct Spec {
    dtype: Dtype,
    shape: Vec<usize>,
    shard: usize,
    seed: u64,
}

fn spec() -> impl Strategy<Value = Spec> {
    (0..DTYPES.len(), proptest::collection::vec(0usize..5, 0..4), any::<usize>(), any::<u64>())
        .prop_map(|(d, shape, shard, seed)| Spec { dtype: DTYPES[d], shape, shard, seed })
}

/// Tensor names that look like checkpoint keys and share prefixes often.
fn name() -> impl Strategy<Value = String> {
    "(model|lm_head|mtp)(\\.layers\\.[0-9]{1,2})?(\\.(mlp|self_attn|experts\\.[0-9]))?\\.(weight|bias|weight_scale|weight_packed)"
}

/// Deterministic pseudo-random bytes (splitmix64).
fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut state = seed;
    (0..len)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            (z ^ (z >> 31)) as u8
        })
        .collect()
}

/// Shard file names with inconsistent zero padding, as in published checkpoints.
fn shard_name(i: usize, n: usize) -> String {
    if i.is_multiple_of(2) {
        format!("model-{:05}-of-{:06}.safetensors", i + 1, n)
    } else {
        format!("model-{}-of-{}.safetensors", i + 1, n)
    }
}

/// What was written for one tensor.
#[derive(Debug)]
struct Written {
    dtype: Dtype,
    shape: Vec<usize>,
    shard: String,
    data: Vec<u8>,
}

/// Checks that `ck` holds exactly `expected`.
fn check(ck: &Checkpoint, expected: &BTreeMap<String, Written>) {
    assert_eq!(ck.len(), expected.len());
    assert!(ck.names().eq(expected.keys().map(String::as_str)), "names differ");
    let mut total = 0u64;
    for (name, Written { dtype, shape, shard, data }) in expected {
        let view = ck.tensor(name).expect("tensor present");
        assert_eq!(view.name, name);
        assert_eq!(view.dtype, *dtype);
        assert_eq!(view.shape, shape.as_slice());
        assert_eq!(view.data, data.as_slice());
        assert_eq!(ck.shard_path(name).and_then(Path::file_name).and_then(|f| f.to_str()), Some(shard.as_str()));
        let info = ck.info(name).expect("info present");
        assert_eq!(info.nbytes(), data.len() as u64);
        total += data.len() as u64;
    }
    assert_eq!(ck.total_bytes(), total);
    // Every tensor is found exactly once across the shards.
    let held: usize = ck.shards().iter().map(|s| s.len()).sum();
    assert_eq!(held, expected.len());
    for prefix in ["model.layers.1", "lm_head.", "mtp", "zzz", ""] {
        let want: Vec<&str> = expected.keys().map(String::as_str).filter(|n| n.starts_with(prefix)).collect();
        let got: Vec<&str> = ck.names_with_prefix(prefix).collect();
        assert_eq!(got, want, "prefix {prefix:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn written_checkpoints_open_exactly(
        tensors in proptest::collection::btree_map(name(), spec(), 1..40),
        shard_count in 1usize..8,
    ) {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut writers: Vec<SafetensorsWriter> = (0..shard_count).map(|_| SafetensorsWriter::new()).collect();
        let mut weight_map = BTreeMap::new();
        let mut expected = BTreeMap::new();
        for (name, s) in &tensors {
            let shard = s.shard % shard_count;
            let numel: usize = s.shape.iter().product();
            let data = bytes(s.seed, numel * s.dtype.size());
            writers[shard].add(name.clone(), s.dtype, &s.shape, data.clone()).expect("add");
            let file = shard_name(shard, shard_count);
            weight_map.insert(name.clone(), file.clone());
            expected.insert(name.clone(), Written { dtype: s.dtype, shape: s.shape.clone(), shard: file, data });
        }
        for (i, w) in writers.iter().enumerate() {
            // Shards that received no tensor are not in the index; write them anyway as strays to be ignored.
            w.write(dir.path().join(shard_name(i, shard_count))).expect("write shard");
        }
        let total: u64 = writers.iter().map(SafetensorsWriter::data_len).sum();
        write_index(dir.path(), &weight_map, total).expect("write index");

        let ck = Checkpoint::open(dir.path()).expect("open with index");
        check(&ck, &expected);
        prop_assert_eq!(ck.total_bytes(), total);
        drop(ck);

        std::fs::remove_file(dir.path().join(INDEX_FILE)).expect("remove index");
        let ck = Checkpoint::open(dir.path()).expect("open without index");
        check(&ck, &expected);
    }
}
