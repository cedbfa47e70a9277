//! DeepSeek-V3 / MLA model definitions on burn, generic over the backend; KV cache; tokenizers and chat
//! templates; hidden-state capture for EAGLE-3.
//!
//! The model: [`config`] (config.json -> [`config::ModelConfig`]), [`deepseek_v3`] (the decoder) built from
//! [`rms_norm`], [`rope`], [`mla`], [`mlp`], [`moe`] and [`linear`], loaded by [`weights`]; errors in [`error`];
//! the paged compressed MLA KV cache and absorbed decode in [`kv_cache`].
//! Also the run-time device choice ([`device`]).

pub mod block_pool;
pub mod chat;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda_ops;
pub mod deepseek_v3;
pub mod device;
pub mod error;
pub mod fused_moe;
pub mod kv_cache;
pub mod linear;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod parallel;
pub mod rms_norm;
pub mod rope;
pub mod sampling;
pub mod synthetic;
pub mod tokenizer;
pub mod tree_verify;
pub mod weights;

pub use config::ModelConfig;
pub use deepseek_v3::DeepseekV3;
pub use error::ModelError;
pub use eyrie_quant as quant;
