//! DeepSeek-V3 / MLA model definitions on burn, generic over the backend; KV cache; tokenizers and chat
//! templates; hidden-state capture for EAGLE-3.
//!
//! Today this crate holds the run-time device choice ([`device`]); the model itself arrives with issue 3.

pub mod chat;
pub mod device;
pub mod tokenizer;

pub use eyrie_quant as quant;
