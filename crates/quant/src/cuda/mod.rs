//! The engine's CUDA hot-path kernels (issue 4): fused INT4 W4A16 mixture-of-experts for decode and verification
//! widths (1..256 tokens), BF16-weight GEMV ([`dense`]), f32-exact tensor-core GEMM through cuBLAS for prefill
//! widths ([`gemm`]), MLA attention over the paged latent cache ([`attention`]) and, for prefill chunks, in its MHA
//! form ([`prefill_attention`]), and greedy picks over logits rows ([`sampling`]).
//!
//! - [`experts`]: the experts of one layer, their kernel layout (built once at load time) and the grouping of
//!   token-expert pairs by expert. Always built.
//! - [`dense_shapes`]: the GEMV's launch shapes (its rules, and the shapes measured best for Kimi-K2's matrices).
//!   Always built.
//! - [`reference`]: the CPU reference of the same math (f64 accumulation, `int4.rs` dequantization). Always built,
//!   tested in CI.
//! - `kernels` and [`gpu`] (feature `cuda`): the CubeCL kernels and their launches; [`specs`]: the kernel
//!   specialisations (comptime arguments) of those launches, all of them listed once.
//! - [`paged_rows`]: where each query row of the attention reads (page tables, lengths).
//! - [`attention_dims`]: the decode attention's second kernel, lanes over the latent's dimensions (its launch
//!   shapes always built, the kernel with feature `cuda`).
//! - [`attention_mma`]: the decode attention's third kernel, on tensor cores at f32 accuracy (its launch shapes
//!   always built, the kernel with feature `cuda`).
//! - [`attention_tf32`]: the decode attention's fourth kernel, for few heads (a tensor-parallel rank's), on TF32
//!   tensor cores at f32 accuracy (its launch shapes always built, the kernel with feature `cuda`).
//! - [`attention_merge`] (feature `cuda`): the merge of the attention's slices (the combine launch, and the merge the
//!   MLA output launch runs itself at one token).
//! - [`resources`]: ptxas resource reports and per-architecture block limits; [`offline`] (feature `cuda`): the
//!   CUDA C++ of each specialisation for a target architecture, made without a GPU (`cargo xtask kernels`).

pub mod attention;
pub mod attention_dims;
pub mod attention_mma;
pub mod attention_tf32;
pub mod dense;
pub mod dense_mma;
pub mod dense_shapes;
pub mod experts;
pub mod gemm;
pub mod paged_rows;
pub mod prefill_attention;
pub mod reference;
pub mod resources;
pub mod router;
pub mod sampling;

#[cfg(feature = "cuda")]
pub mod attention_merge;
#[cfg(feature = "cuda")]
pub mod behind_copy;
#[cfg(feature = "cuda")]
pub mod gpu;
#[cfg(feature = "cuda")]
mod kernels;
#[cfg(feature = "cuda")]
pub mod mla;
#[cfg(feature = "cuda")]
pub mod moe_mma;
#[cfg(feature = "cuda")]
pub mod moe_tiled;
#[cfg(feature = "cuda")]
pub mod norm;
#[cfg(feature = "cuda")]
pub mod offline;
#[cfg(feature = "cuda")]
pub mod rope;
#[cfg(feature = "cuda")]
pub mod specs;

pub use experts::{KernelLayout, MoeExperts, MoeShape, Routing, SplitMix64};
pub use reference::{Dequant, Mismatch, moe_reference};

#[cfg(feature = "cuda")]
pub use behind_copy::{BehindCopy, copy_bandwidth, copy_f32};
#[cfg(feature = "cuda")]
pub use gpu::{
    GpuExperts, GpuRouting, MmaShape, MoeConfig, RoutingReadback, Stages, fused_split, moe_forward, moe_forward_add,
    moe_forward_with, set_fused_split, set_tiled_gemm, tiled_gemm,
};
