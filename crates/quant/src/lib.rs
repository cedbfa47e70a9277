//! compressed-tensors INT4 (`pack-quantized`) formats and sharded safetensors loading.
//!
//! A small library with no knowledge of models, burn modules or HTTP: it reads checkpoints and quantized
//! weights and hands back plain buffers (or, behind the `burn` feature, burn tensors).
//!
//! - [`safetensors`]: one memory-mapped `.safetensors` file, header parsed and validated, tensors read lazily.
//! - [`checkpoint`]: a whole checkpoint directory (index + shards or one file), opened in parallel.
//! - [`config`]: the `quantization_config` of config.json (compressed-tensors and FP8 block).
//! - [`int4`]: [`PackedInt4`], the pack-quantized INT4 weight: pack, unpack, dequantize.
//! - [`fp8`]: FP8 E4M3 decoding and the 128x128 block dequantization of the FP8 Kimi-K2 release.
//! - [`linear`]: [`LinearWeight`], a Linear's weight as found in a checkpoint (dense, INT4 or FP8 block).
//! - [`write`](mod@write): a minimal safetensors writer for fixtures, tools and tests.

pub mod checkpoint;
pub mod config;
/// Fused INT4 MoE: kernels (feature `cuda`) and their CPU reference (always built).
pub mod cuda;
mod dtype;
mod error;
pub mod fp8;
pub mod int4;
pub mod linear;
pub mod safetensors;
pub mod write;

#[cfg(feature = "burn")]
pub mod burn;

pub use dtype::Dtype;
pub use error::{QuantError, Result};
// Re-exports of module items (one line per module):
pub use checkpoint::Checkpoint;
pub use config::{GroupSize, QuantPlan, QuantScheme, QuantizationConfig};
pub use fp8::{dequant_block_fp8, e4m3_to_f32};
pub use int4::PackedInt4;
pub use linear::{LinearKind, LinearWeight};
pub use safetensors::{SafetensorsFile, TensorInfo, TensorView};
pub use write::SafetensorsWriter;
