//! Helpers shared by the golden tests: fixture paths, the error metric, host copies of tensors.
// Each test binary uses a subset of these.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::tensor::Tensor;
use eyrie_model::quant::SafetensorsFile;

/// `fixtures/model/<name>`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/model").join(name)
}

/// The golden tests' metric: `max|got - want| / max|want|` over one tensor.
pub fn scaled_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    diff / want.iter().map(|b| b.abs()).fold(0.0f32, f32::max).max(f32::MIN_POSITIVE)
}

/// A tensor's values on the host, as f32.
pub fn host<const D: usize>(t: Tensor<Flex, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec::<f32>().unwrap()
}

/// Index of the largest value (the first one on ties), as a token id.
pub fn argmax(v: &[f32]) -> u32 {
    eyrie_model::sampling::argmax(v)
}

/// Token ids stored in a reference file (I64).
pub fn ids(reference: &SafetensorsFile, name: &str) -> Vec<u32> {
    reference.tensor(name).unwrap().to_i64_vec().unwrap().iter().map(|&t| t as u32).collect()
}
