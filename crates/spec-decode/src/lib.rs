//! eyrie-spec-decode: EAGLE-3 speculative decoding that is lossless on DeepSeek-V3 / MLA targets.
//!
//! - [`config`]: drafter config.json in the SpecForge (`LlamaForCausalLMEagle3`) and speculators
//!   (`Eagle3Speculator`) layouts, validated against the target; the aux-layer-id convention ([`AuxConvention`]).
//! - [`eagle3`]: the EAGLE-3 drafter on burn ([`Eagle3Drafter`]) with its own per-sequence KV cache.
//! - [`drafter`]: the [`Drafter`] interface, implemented by [`Eagle3Drafter`] and by [`SelfDrafter`] (the target
//!   drafting for itself).
//! - [`tree`]: tree drafting (top-k expansion by cumulative draft log-probability, best nodes kept).
//! - [`verify`]: lossless acceptance of chains (greedy, and rejection sampling with residual resampling and a bonus
//!   token) and of trees (multi-candidate rejection with deterministic candidates).
//! - [`decoder`]: [`SpecDecoder`] (prefill, chain or tree drafting, one batched target verification, rollback).
//! - [`check`]: `eyrie spec check`: acceptance under both aux-id conventions ([`check_conventions`]).
//! - [`stats`]: acceptance statistics ([`AcceptanceStats`]).
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use burn::backend::Flex;
//! use eyrie_model::DeepseekV3;
//! use eyrie_model::kv_cache::PagedMlaCache;
//! use eyrie_model::sampling::SamplingParams;
//! use eyrie_spec_decode::{DraftFormat, Eagle3Drafter, SpecDecoder};
//!
//! let device = Default::default();
//! let target = DeepseekV3::<Flex>::load("/models/Kimi-K2.5", &device)?;
//! let convention = DraftFormat::SpecForge.default_convention();
//! let drafter = Eagle3Drafter::load("/models/kimi-eagle3", &target, convention, &device)?;
//! let mut cache = PagedMlaCache::new(&target.config, 1024, 16, &device)?;
//! let mut dec = SpecDecoder::new(drafter, 3);
//! let mut seq = dec.new_sequence(&[1, 17, 200], SamplingParams::default())?;
//! dec.prefill(&target, &mut cache, &mut [&mut seq], &device)?;
//! while seq.generated().len() < 64 {
//!     dec.step(&target, &mut cache, &mut [&mut seq], &device)?;
//! }
//! println!("{}", dec.stats.summary());
//! # Ok(()) }
//! ```

pub mod check;
pub mod config;
pub mod decoder;
pub mod drafter;
pub mod eagle3;
pub mod error;
pub mod stats;
pub mod tree;
pub mod verify;

pub use check::{ConventionCheck, best_convention, check_conventions};
pub use config::{AuxConvention, DraftFormat, Eagle3Config};
pub use decoder::{SpecDecoder, SpecSequence};
pub use drafter::{Drafter, ExtendInput, SelfDrafter};
pub use eagle3::{Eagle3Drafter, Eagle3State};
pub use error::{Result, SpecError};
pub use stats::AcceptanceStats;
pub use tree::{DraftTree, draft_tree};
pub use verify::{ChainVerdict, TreeVerdict, verify_chain, verify_tree};
