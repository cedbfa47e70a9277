//! Helpers shared by the spec-decode tests: fixture paths, the error metric, host copies of tensors.
// Each test binary uses a subset of these.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use burn::backend::Flex;
use burn::tensor::{Tensor, TensorData};
use eyrie_model::quant::SafetensorsFile;

/// `fixtures/<rel>` from the repository root.
pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(rel)
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

/// An F32 reference tensor's values.
pub fn values(reference: &SafetensorsFile, name: &str) -> Vec<f32> {
    reference.tensor(name).unwrap().to_f32_vec().unwrap()
}

/// An F32 reference matrix as a tensor.
pub fn matrix(reference: &SafetensorsFile, name: &str) -> Tensor<Flex, 2> {
    let view = reference.tensor(name).unwrap();
    let shape = [view.shape[0], view.shape[1]];
    Tensor::from_data(TensorData::new(view.to_f32_vec().unwrap(), shape), &Default::default())
}

/// Token ids stored in a reference file (I64).
pub fn ids(reference: &SafetensorsFile, name: &str) -> Vec<u32> {
    reference.tensor(name).unwrap().to_i64_vec().unwrap().iter().map(|&t| t as u32).collect()
}
