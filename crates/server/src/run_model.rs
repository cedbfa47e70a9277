//! What `generate` and `score` share: device dispatch (the model code is written once, generic over the burn
//! backend, and run on `Flex` for `cpu` or `Cuda` for `cuda:N`), `--tokens` parsing, and reading tensors back.

use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use eyrie_model::ModelConfig;
use eyrie_model::device::{DeviceChoice, ResolvedDevice};
use eyrie_model::parallel::ParallelBackend;

/// Work that runs on any burn backend.
pub trait ModelJob {
    /// What the job returns to the host.
    type Output;

    /// Runs on `device` of backend `B` (`resolved` names it for messages). Every backend the dispatch picks can
    /// also span a tensor x expert parallel group.
    fn run<B: ParallelBackend>(self, device: &B::Device, resolved: ResolvedDevice) -> Result<Self::Output>;
}

/// Resolves `choice` and runs `job` on the matching backend.
pub fn dispatch<J: ModelJob>(choice: DeviceChoice, job: J) -> Result<J::Output> {
    match choice.resolve()? {
        ResolvedDevice::Cpu => job.run::<burn::backend::Flex>(&Default::default(), ResolvedDevice::Cpu),
        ResolvedDevice::Cuda(index) => run_cuda(index, job),
    }
}

#[cfg(feature = "cuda")]
fn run_cuda<J: ModelJob>(index: usize, job: J) -> Result<J::Output> {
    use burn::backend::Cuda;
    use burn::backend::cuda::CudaDevice;

    job.run::<Cuda>(&CudaDevice::new(index), ResolvedDevice::Cuda(index))
}

#[cfg(not(feature = "cuda"))]
fn run_cuda<J: ModelJob>(_: usize, _: J) -> Result<J::Output> {
    bail!("this binary was built without CUDA support")
}

/// The model's config.json (read before any weight, so that bad input fails fast).
pub fn load_config(dir: &Path) -> Result<ModelConfig> {
    ModelConfig::from_dir(dir).with_context(|| format!("reading the model config in {}", dir.display()))
}

/// Parses `--tokens 1,2,3` (commas and/or whitespace) and checks every id against the vocabulary; errors name the
/// offending token and its 0-based position.
pub fn parse_tokens(text: &str, vocab_size: usize) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for (pos, item) in text.split(|c: char| c == ',' || c.is_whitespace()).filter(|s| !s.is_empty()).enumerate() {
        let id: u32 = item
            .parse()
            .map_err(|_| anyhow!("--tokens: {item:?} at position {pos} is not a token id (a non-negative integer)"))?;
        if id as usize >= vocab_size {
            bail!("--tokens: token id {id} at position {pos} is outside the vocabulary (size {vocab_size})");
        }
        ids.push(id);
    }
    if ids.is_empty() {
        bail!("--tokens: no token ids given (expected e.g. --tokens 1,2,3)");
    }
    Ok(ids)
}

/// A tensor's values on the host, in row-major order.
pub fn to_host<B: Backend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>> {
    t.into_data().convert::<f32>().to_vec::<f32>().map_err(|e| anyhow!("reading a tensor back from the device: {e:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_checks_token_lists() {
        assert_eq!(parse_tokens("1,2, 3", 10).unwrap(), vec![1, 2, 3]);
        assert_eq!(parse_tokens(" 4 5 ", 10).unwrap(), vec![4, 5]);
        let e = parse_tokens("1,x,3", 10).unwrap_err().to_string();
        assert!(e.contains("\"x\"") && e.contains("position 1"), "{e}");
        let e = parse_tokens("1,2,10", 10).unwrap_err().to_string();
        assert!(e.contains("10") && e.contains("position 2") && e.contains("size 10"), "{e}");
        assert!(parse_tokens("-1", 10).is_err());
        assert!(parse_tokens(" , ", 10).is_err());
    }
}
