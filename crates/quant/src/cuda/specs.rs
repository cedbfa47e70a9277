//! The kernel specialisations of the fused INT4 MoE: the comptime arguments each launch of [`super::gpu`] passes,
//! derived here once from a [`MoeConfig`], and the list of every specialisation the tuned launch shapes
//! ([`MoeConfig::for_tokens`]) can reach, which `cargo xtask kernels` compiles for a target architecture.

use burn::cubecl;
use cubecl::prelude::*;

use super::experts::MoeShape;
use super::gpu::{MmaShape, MoeConfig};

/// Largest number of tokens one step may route through the fused MoE (decode and verification widths).
pub const MAX_TOKENS: usize = 256;

/// Element type of an `expert_rows_kernel` activation input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Act {
    /// BF16 layer input (W4A16).
    Bf16,
    /// f32 layer input, or the f32 intermediate of the down projection.
    F32,
}

impl Act {
    /// The CubeCL storage type.
    pub fn storage_type(self) -> StorageType {
        match self {
            Self::Bf16 => half::bf16::as_type_native_unchecked().storage_type(),
            Self::F32 => f32::as_type_native_unchecked().storage_type(),
        }
    }

    /// The suffix CubeCL gives the kernel's entry point (`expert_rows_kernel_f_bf16_n_4`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F32 => "f32",
        }
    }
}

/// Comptime arguments of one `expert_rows_kernel` specialisation (see the kernel's documentation); the launcher
/// passes exactly these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExpertRowsSpec {
    /// Reduction width (columns of the weight rows).
    pub k: usize,
    /// Rows of one expert's matrix.
    pub rows: usize,
    /// Rows computed together by a warp (`gated`: gate and up, 2).
    pub rows_at_once: usize,
    /// INT4 group size.
    pub group: usize,
    /// Experts per token.
    pub topk: usize,
    /// Tokens per pass.
    pub tb: usize,
    /// Row groups per warp, one after the other.
    pub rows_per_warp: usize,
    /// Warps per block.
    pub warps: usize,
    /// SiLU(gate) * up output (the gate/up launch).
    pub gated: bool,
    /// Activation row `pair / topk` (the layer input) instead of `pair` (the intermediate).
    pub by_token: bool,
    /// Load the first rows before staging the activations.
    pub prefetch: bool,
    /// The experts in the tiled layout ([`MoeShape::tiled`]).
    pub tiled: bool,
    /// 32- or 64-bit indexing, from the largest buffer (the experts' packed words).
    pub address: AddressType,
}

/// Largest buffer of the experts in elements (picks 32- or 64-bit indexing).
fn experts_len(s: &MoeShape) -> usize {
    s.experts * 2 * s.inter * s.hidden / 8
}

impl ExpertRowsSpec {
    /// The gate/up launch (SiLU(gate) * up into the `[pairs, inter]` intermediate) for experts routed `tb` tokens
    /// per pass.
    pub fn gate_up(s: &MoeShape, topk: usize, cfg: &MoeConfig, tb: usize) -> Self {
        Self {
            k: s.hidden,
            rows: 2 * s.inter,
            rows_at_once: 2,
            group: s.group,
            topk,
            tb,
            rows_per_warp: cfg.rows_per_warp_13,
            warps: cfg.warps,
            gated: true,
            by_token: true,
            prefetch: cfg.prefetch,
            tiled: s.tiled(),
            address: AddressType::from_len(experts_len(s)),
        }
    }

    /// The down launch (`[pairs, inter]` f32 intermediate to `[pairs, hidden]`).
    pub fn down(s: &MoeShape, topk: usize, cfg: &MoeConfig, tb: usize) -> Self {
        Self {
            k: s.inter,
            rows: s.hidden,
            rows_at_once: cfg.rows_at_once_2,
            group: s.group,
            topk,
            tb,
            rows_per_warp: cfg.rows_per_warp_2,
            warps: cfg.warps,
            gated: false,
            by_token: false,
            prefetch: cfg.prefetch,
            tiled: s.tiled(),
            address: AddressType::from_len(experts_len(s)),
        }
    }

    /// Threads of a block: one warp per `y`.
    pub fn cube_dim(&self) -> CubeDim {
        CubeDim::new_2d(32, self.warps as u32)
    }

    /// Blocks along `x` (row tiles) for one active expert.
    pub fn row_tiles(&self) -> u32 {
        (self.rows / self.rows_at_once).div_ceil(self.warps * self.rows_per_warp) as u32
    }

    /// Shared memory of the staged activations, bytes: `tb` tokens of `k / 4` 16-byte vectors plus one padding
    /// vector per 32 columns (the kernel's `xs`).
    pub fn shared_bytes(&self) -> usize {
        self.tb * (self.k / 4 + self.k / 32) * 16
    }

    /// Short label with the activation type: `gate_up bf16 k7168 tb4 w8 rpw2 ra2` etc.
    pub fn label(&self, act: Act) -> String {
        format!(
            "{} {} k{} tb{} w{} rpw{} ra{}{}",
            if self.gated { "gate_up" } else { "down" },
            act.name(),
            self.k,
            self.tb,
            self.warps,
            self.rows_per_warp,
            self.rows_at_once,
            if self.prefetch { " pf" } else { "" }
        )
    }
}

/// Tokens per pass the tensor-core kernels are built for (1 and 2 fill one MMA's 8 columns with 3 parts each; 8 and
/// 16 are the prefill widths' passes, [`MoeConfig::mma_tb`]).
pub const MMA_TBS: [usize; 5] = [1, 2, 4, 8, 16];

/// Tokens per pass of the three expert classes (1, 2 and 3+ routed tokens) under `cfg` (the CUDA-core kernels).
pub fn class_tbs(cfg: &MoeConfig) -> [usize; 3] {
    [1usize, 2, 4].map(|tb| tb.min(cfg.max_tb))
}

/// Tokens per pass of the three expert classes on the tensor-core path: 1, 2 and [`MoeConfig::mma_tb`].
pub fn mma_class_tbs(cfg: &MoeConfig) -> [usize; 3] {
    [1, 2, cfg.mma_tb]
}

/// Comptime arguments of one `moe_mma::expert_mma_kernel` specialisation (the kernel's documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExpertMmaSpec {
    /// Reduction width (a multiple of 128).
    pub k: usize,
    /// Rows of one expert's matrix.
    pub rows: usize,
    /// INT4 group size.
    pub group: usize,
    /// Experts per token.
    pub topk: usize,
    /// Tokens per pass.
    pub tb: usize,
    /// 16-row tiles of a warp's task (ungated; the gated launch always takes a gate and an up tile).
    pub tiles: usize,
    /// Warp tasks per block.
    pub tasks: usize,
    /// Warps sharing a task's columns.
    pub ksplit: usize,
    /// SiLU(gate) * up output (the gate/up launch).
    pub gated: bool,
    /// Activation row `pair / topk` (the layer input) instead of `pair` (the intermediate).
    pub by_token: bool,
    /// The experts in the tiled layout ([`MoeShape::tiled`]).
    pub tiled: bool,
    /// Gated: writes the down launch's input split and permuted (`split_x3_kernel`'s layout) instead of the f32
    /// intermediate (`crate::cuda::gpu::fused_split`).
    pub split_out: bool,
    /// The loads alone, folded into a meaningless output ([`crate::cuda::Stages::GateUpLoads`]; timing only).
    pub loads_only: bool,
    /// 32- or 64-bit indexing.
    pub address: AddressType,
}

impl ExpertMmaSpec {
    /// The gate/up launch for experts routed `tb` tokens per pass.
    pub fn gate_up(s: &MoeShape, topk: usize, m: &MmaShape, tb: usize) -> Self {
        Self {
            k: s.hidden,
            rows: 2 * s.inter,
            group: s.group,
            topk,
            tb,
            tiles: 2,
            tasks: m.tasks_13,
            ksplit: m.ksplit_13,
            gated: true,
            by_token: true,
            tiled: s.tiled(),
            split_out: true,
            loads_only: false,
            address: AddressType::from_len(experts_len(s)),
        }
    }

    /// The down launch (split-permuted `[pairs, 3, inter]` intermediate to `[pairs, hidden]`).
    pub fn down(s: &MoeShape, topk: usize, m: &MmaShape, tb: usize) -> Self {
        Self {
            k: s.inter,
            rows: s.hidden,
            group: s.group,
            topk,
            tb,
            tiles: m.tiles_2,
            tasks: m.tasks_2,
            ksplit: m.ksplit_2,
            gated: false,
            by_token: false,
            tiled: s.tiled(),
            split_out: false,
            loads_only: false,
            address: AddressType::from_len(experts_len(s)),
        }
    }

    /// Rows of the task dimension (`rows / 2` units gated) and the rows one task covers.
    fn task_rows(&self) -> (usize, usize) {
        if self.gated { (self.rows / 2, 16) } else { (self.rows, 16 * self.tiles) }
    }

    /// Whether the kernel takes this shape: `k` a multiple of 128, the task rows a multiple of a task.
    pub fn fits(&self) -> bool {
        let (rows, step) = self.task_rows();
        step > 0
            && self.k.is_multiple_of(128)
            && self.group.is_multiple_of(32)
            && rows.is_multiple_of(step)
            && self.tasks > 0
            && self.ksplit > 0
    }

    /// Threads of a block: one warp per `y`.
    pub fn cube_dim(&self) -> CubeDim {
        CubeDim::new_2d(32, (self.tasks * self.ksplit) as u32)
    }

    /// Shared memory of a block, bytes: the k-split warps' accumulators (`tasks x ksplit` warps of `mtiles x
    /// ntiles x 4` floats a lane), the kernel's `red`.
    pub fn shared_bytes(&self) -> usize {
        let mtiles = if self.gated { 2 } else { self.tiles };
        let nacc = mtiles * (3 * self.tb).div_ceil(8) * 4;
        if self.ksplit > 1 { self.tasks * self.ksplit * nacc * 32 * 4 } else { 4 }
    }

    /// Blocks along `x` for one active expert.
    pub fn row_tiles(&self) -> u32 {
        let (rows, step) = self.task_rows();
        (rows / step).div_ceil(self.tasks) as u32
    }

    /// Short label: `mma gate_up k7168 tb1 t2 x4 ks2` (` loads` for the loads alone).
    pub fn label(&self) -> String {
        format!(
            "mma {} k{} tb{} t{} x{} ks{}{}",
            if self.gated { "gate_up" } else { "down" },
            self.k,
            self.tb,
            self.tiles,
            self.tasks,
            self.ksplit,
            if self.loads_only { " loads" } else { "" }
        )
    }
}

/// Every (launch shape, tokens per pass) the launcher issues for 1..=[`MAX_TOKENS`] tokens, in order:
/// [`MoeConfig::for_tokens`]`(m)`, fitted to `smem_limit` bytes of shared memory a block
/// ([`MoeConfig::fit_shared_memory`], as `moe_forward` does for the device), with the classes of experts that `m`
/// tokens can fill (an expert gets at most `m` tokens, so class `c` needs `m > c`).
pub fn tuned_launches(shape: &MoeShape, smem_limit: usize) -> Vec<(MoeConfig, usize)> {
    let mut out: Vec<(MoeConfig, usize)> = Vec::new();
    for m in 1..=MAX_TOKENS {
        let cfg = MoeConfig::for_tokens(m).fit_shared_memory(shape, smem_limit);
        for (class, tb) in class_tbs(&cfg).into_iter().enumerate() {
            if m > class && !out.contains(&(cfg, tb)) {
                out.push((cfg, tb));
            }
        }
    }
    out
}

/// One kernel specialisation of the fused MoE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelSpec {
    /// `expert_rows_kernel` (gate/up or down) with activations of type `act`.
    ExpertRows {
        /// Activation element type (the kernel's generic `F`).
        act: Act,
        /// Comptime arguments.
        spec: ExpertRowsSpec,
    },
    /// `moe_mma::expert_mma_kernel` (gate/up or down on tensor cores).
    ExpertMma {
        /// Comptime arguments.
        spec: ExpertMmaSpec,
    },
    /// `moe_mma::split_x3_kernel` (split-permuted activations of width `k`).
    SplitX3 {
        /// Input element type.
        act: Act,
        /// Row width.
        k: usize,
    },
    /// `moe_tiled::tiled_expert_kernel` (the experts of prefill chunks as a tiled grouped GEMM).
    TiledExpert {
        /// Input width (hidden for gate/up, inter for down).
        k: usize,
        /// Matrix rows an expert (2 inter for gate/up, hidden for down).
        rows: usize,
        /// Quantization group.
        group: usize,
        /// Experts per token.
        topk: usize,
        /// Gate/up with SiLU and the intermediate's split.
        gated: bool,
        /// Tiled weight layout.
        tiled: bool,
        /// Indexing width.
        address: AddressType,
    },
    /// `moe_tiled::split_rows_kernel` (activations of width `k` as three BF16 parts, columns in order).
    SplitRows {
        /// Input element type.
        act: Act,
        /// Row width.
        k: usize,
    },
    /// `moe_tiled::tile_list_kernel` (a routing's 64-pair tiles).
    TileList,
    /// `combine_kernel` (weighted sum over a token's experts).
    Combine {
        /// Model width.
        hidden: usize,
        /// Experts per token.
        topk: usize,
        /// Adds the shared experts' output.
        add: bool,
        /// Indexing width for [`MAX_TOKENS`] tokens.
        address: AddressType,
    },
    /// `copy_kernel` (the bandwidth ceiling beside the benchmarks).
    Copy,
    /// `attention::mla_attention_kernel` (MLA over the paged latent cache).
    MlaAttention {
        /// Latent rank (value width).
        r: usize,
        /// Rotary width.
        rot: usize,
        /// Warps per block.
        warps: usize,
        /// Heads per warp.
        hpw: usize,
    },
    /// `attention_dims::mla_attention_dims_kernel` (the same attention, lanes over the latent's dimensions).
    MlaAttentionDims {
        /// Latent rank (value width).
        r: usize,
        /// Rotary width.
        rot: usize,
        /// The launch shape.
        shape: crate::cuda::attention_dims::DimShape,
    },
    /// `attention_mma::mla_attention_mma_kernel` (the same attention on tensor cores at f32 accuracy).
    MlaAttentionMma {
        /// Latent rank (value width).
        r: usize,
        /// Rotary width.
        rot: usize,
        /// The launch shape.
        shape: crate::cuda::attention_mma::MmaShape,
    },
    /// `attention_tf32::mla_attention_tf32_kernel` (the same attention for few heads on TF32 tensor cores at f32
    /// accuracy).
    MlaAttentionTf32 {
        /// Latent rank (value width).
        r: usize,
        /// Rotary width.
        rot: usize,
        /// The launch shape.
        shape: crate::cuda::attention_tf32::Tf32Shape,
    },
    /// `attention::mla_combine_kernel` (merge of a row's slices).
    MlaCombine {
        /// Latent rank (value width).
        r: usize,
        /// Threads a (row, head) in 128s (`attention_merge::combine_halves`).
        halves: usize,
        /// The merge in one round of loads (`attention_merge::merge_slices_one_pass`, the combine launch's default).
        one_pass: bool,
    },
    /// `sampling::argmax_rows_kernel` (greedy picks on the device).
    ArgmaxRows,
    /// `prefill_attention::mha_prefill_kernel` (MLA of prefill chunks in the MHA form).
    MhaPrefill {
        /// Head dimensions.
        dims: crate::cuda::prefill_attention::MhaDims,
    },
    /// `dense::gemv_bf16_kernel` (BF16-weight GEMV).
    Gemv {
        /// Input width.
        k: usize,
        /// Launch shape.
        cfg: crate::cuda::dense::GemvConfig,
    },
    /// `dense_mma::gemv_mma_kernel` (the BF16-weight GEMV on tensor cores, plain or gated).
    GemvMma {
        /// Input width.
        k: usize,
        /// Launch shape.
        cfg: crate::cuda::dense_mma::MmaGemvConfig,
    },
    /// `dense::gemv_swiglu_kernel` (an MLP's gate and up GEMVs with SiLU * up).
    GemvSwiglu {
        /// Input width.
        k: usize,
        /// Launch shape.
        cfg: crate::cuda::dense::GemvConfig,
    },
    /// `dense::gemv_norm_kernel` (a GEMV of the RMSNorm of its input).
    GemvNorm {
        /// Input width.
        k: usize,
        /// Launch shape (8 warps).
        cfg: crate::cuda::dense::GemvConfig,
    },
    /// `dense::gemv_pair_kernel` (two GEMV jobs of one input in one launch; `swiglu_*`: that job is a gate/up pair).
    GemvPair {
        /// Input width.
        k: usize,
        /// Job a's launch shape.
        a: crate::cuda::dense::GemvConfig,
        /// Job a is SwiGLU.
        swiglu_a: bool,
        /// Job b's launch shape (same warps and tokens a pass as `a`).
        b: crate::cuda::dense::GemvConfig,
        /// Job b is SwiGLU.
        swiglu_b: bool,
    },
    /// `gemm::split_bf16x3_kernel` (the prefill GEMM's exact split of its activations).
    SplitBf16x3,
    /// `gemm::sum3_kernel` (the prefill GEMM's sum of its three partial products).
    Sum3,
    /// `router::route_kernel` (`noaux_tc` top-k of one token a block).
    Route {
        /// Routed experts.
        experts: usize,
        /// Expert groups.
        n_group: usize,
        /// Groups kept.
        topk_group: usize,
        /// Experts per token.
        top_k: usize,
        /// Renormalised weights.
        norm: bool,
        /// Writes the one-token grouping too (a decode step of one sequence).
        grouped: bool,
        /// Also writes the MoE layer's input split of this hidden size (0: none).
        split_k: usize,
    },
    /// `router::group_kernel` (the pairs grouped by expert, one block).
    Group {
        /// Routed experts.
        experts: usize,
    },
    /// `norm::rms_norm_kernel` (RMSNorm of rows, optionally with the residual add).
    RmsNorm {
        /// Row width.
        width: usize,
        /// With the residual add.
        add: bool,
    },
    /// `rope::rope_rows_kernel` (RoPE of row groups).
    RopeRows {
        /// Rotated pairs per row (`rot / 2`).
        half: usize,
        /// Interleaved pairs (else rotate-half).
        interleave: bool,
    },
    /// `mla::mla_query_kernel` (query absorption + RoPE).
    MlaQuery {
        /// Heads (of a tensor-parallel rank).
        heads: usize,
        /// `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, `kv_lora_rank`.
        dims: (usize, usize, usize, usize),
        /// Tokens per block.
        tb: usize,
        /// Thread groups per block.
        groups: usize,
        /// Interleaved RoPE pairs.
        interleave: bool,
    },
    /// `mla::mla_output_kernel` (value absorption).
    MlaOutput {
        /// Heads (of a tensor-parallel rank).
        heads: usize,
        /// `qk_nope_head_dim`, `v_head_dim`, `kv_lora_rank`.
        dims: (usize, usize, usize),
        /// Rows per warp.
        ra: usize,
        /// Tokens per block.
        tb: usize,
        /// Warps per block.
        warps: usize,
        /// Merges the attention's slices first (`mla::output_merges`).
        merge: bool,
    },
    /// `mla::mla_latent_kernel` (kv_a norm + RoPE + the write into the cache).
    MlaLatent {
        /// `kv_lora_rank`.
        r: usize,
        /// `qk_rope_head_dim`.
        rot: usize,
        /// Interleaved RoPE pairs.
        interleave: bool,
    },
}

impl KernelSpec {
    /// Threads per block of the launch.
    pub fn cube_dim(&self) -> CubeDim {
        match self {
            Self::ExpertRows { spec, .. } => spec.cube_dim(),
            Self::ExpertMma { spec } => spec.cube_dim(),
            Self::SplitX3 { .. } | Self::SplitRows { .. } => CubeDim::new_1d(256),
            Self::TiledExpert { .. } => CubeDim::new_1d(crate::cuda::moe_tiled::BN as u32),
            Self::TileList => CubeDim::new_1d(crate::cuda::moe_tiled::LIST_THREADS as u32),
            Self::Combine { .. } | Self::Copy => CubeDim::new_1d(256),
            Self::MlaAttention { warps, .. } => CubeDim::new_2d(32, *warps as u32),
            Self::MlaAttentionDims { shape, .. } => CubeDim::new_2d(32, (shape.wh * shape.wk) as u32),
            Self::MlaAttentionMma { shape, .. } => CubeDim::new_2d(32, (shape.tiles * shape.wk) as u32),
            Self::MlaAttentionTf32 { shape, .. } => CubeDim::new_2d(32, shape.warps as u32),
            Self::MlaCombine { halves, .. } => CubeDim::new_1d((128 * halves) as u32),
            Self::MhaPrefill { .. } => CubeDim::new_1d(crate::cuda::prefill_attention::THREADS as u32),
            Self::ArgmaxRows => CubeDim::new_1d(crate::cuda::sampling::ARGMAX_THREADS as u32),
            Self::Gemv { cfg, .. }
            | Self::GemvSwiglu { cfg, .. }
            | Self::GemvNorm { cfg, .. }
            | Self::GemvPair { a: cfg, .. } => CubeDim::new_2d(32, cfg.warps as u32),
            Self::GemvMma { cfg, .. } => CubeDim::new_2d(32, (cfg.tasks * cfg.ksplit) as u32),
            Self::SplitBf16x3 | Self::Sum3 => CubeDim::new_1d(256),
            Self::Route { .. } => CubeDim::new_1d(crate::cuda::router::ROUTE_THREADS as u32),
            Self::Group { experts } => CubeDim::new_1d(experts.next_power_of_two().max(32) as u32),
            Self::RmsNorm { .. } => CubeDim::new_2d(32, crate::cuda::norm::RMS_NORM_WARPS as u32),
            Self::RopeRows { .. } => CubeDim::new_1d(256),
            Self::MlaQuery { dims, groups, .. } => CubeDim::new_2d((dims.3 / 4) as u32, *groups as u32),
            Self::MlaOutput { warps, .. } => CubeDim::new_2d(32, *warps as u32),
            Self::MlaLatent { .. } => CubeDim::new_2d(32, crate::cuda::mla::LATENT_WARPS as u32),
        }
    }

    /// Short label for tables.
    pub fn label(&self) -> String {
        match self {
            Self::ExpertRows { act, spec } => spec.label(*act),
            Self::ExpertMma { spec } => spec.label(),
            Self::SplitX3 { act, k } => format!("split_x3 {} k{k}", act.name()),
            Self::TiledExpert { k, rows, group, topk, gated, tiled, .. } => format!(
                "moe_tiled {} k{k} rows{rows} g{group} top{topk}{}",
                if *gated { "gate/up" } else { "down" },
                if *tiled { " tiled" } else { "" }
            ),
            Self::SplitRows { act, k } => format!("split_rows {} k{k}", act.name()),
            Self::TileList => "tile_list".into(),
            Self::Combine { hidden, topk, add, .. } => {
                format!("combine hidden{hidden} topk{topk}{}", if *add { " +shared" } else { "" })
            }
            Self::Copy => "copy f32x4".into(),
            Self::MlaAttention { r, rot, warps, hpw } => format!("mla_attention r{r} rot{rot} warps{warps} hpw{hpw}"),
            Self::MlaAttentionDims { r, rot, shape: s } => {
                format!("mla_attention_dims r{r} rot{rot} wh{} wk{} hpw{} sg{}", s.wh, s.wk, s.hpw, s.sg)
            }
            Self::MlaAttentionMma { r, rot, shape: s } => {
                format!("mla_attention_mma r{r} rot{rot} tiles{} wk{} pt{}", s.tiles, s.wk, s.pt)
            }
            Self::MlaAttentionTf32 { r, rot, shape: s } => {
                format!("mla_attention_tf32 r{r} rot{rot} w{} pt{} s{}", s.warps, s.pt, s.stages)
            }
            Self::MlaCombine { r, halves, one_pass } => {
                format!("mla_combine r{r} x{halves}{}", if *one_pass { " one-pass" } else { "" })
            }
            Self::MhaPrefill { dims } => format!("mha_prefill nope{} rot{} vd{}", dims.nope, dims.rot, dims.vd),
            Self::ArgmaxRows => "argmax_rows".into(),
            Self::Gemv { k, cfg } => {
                let c = cfg;
                format!(
                    "gemv_bf16 k{k} warps{} rows{} tb{} ksplit{} unroll{}",
                    c.warps, c.rows_at_once, c.tb, c.ksplit, c.unroll
                )
            }
            Self::GemvSwiglu { k, cfg } => {
                let c = cfg;
                format!(
                    "gemv_swiglu k{k} warps{} rows{} tb{} ksplit{} unroll{}",
                    c.warps, c.rows_at_once, c.tb, c.ksplit, c.unroll
                )
            }
            Self::GemvNorm { k, cfg: c } => format!(
                "gemv_norm k{k} warps{} rows{} tb{} ksplit{} unroll{}",
                c.warps, c.rows_at_once, c.tb, c.ksplit, c.unroll
            ),
            Self::GemvPair { k, a, swiglu_a, b, swiglu_b } => {
                let job = |c: &crate::cuda::dense::GemvConfig, swiglu: bool| {
                    format!(
                        "{} rows{} ksplit{} unroll{}",
                        if swiglu { "swiglu" } else { "plain" },
                        c.rows_at_once,
                        c.ksplit,
                        c.unroll
                    )
                };
                format!("gemv_pair k{k} warps{} tb{} a {} b {}", a.warps, a.tb, job(a, *swiglu_a), job(b, *swiglu_b))
            }
            Self::GemvMma { k, cfg } => {
                let c = cfg;
                format!(
                    "gemv_mma k{k} tb{} tiles{} tasks{} ksplit{} bv{}{}",
                    c.tb,
                    c.tiles,
                    c.tasks,
                    c.ksplit,
                    c.bv,
                    if c.gated { " gated" } else { "" }
                )
            }
            Self::SplitBf16x3 => "split_bf16x3".into(),
            Self::Sum3 => "sum3 f32x4".into(),
            Self::Route { experts, n_group, topk_group, top_k, norm, grouped, split_k } => format!(
                "route e{experts} groups{n_group}/{topk_group} top{top_k} norm{}{}{}",
                u8::from(*norm),
                if *grouped { " grouped" } else { "" },
                if *split_k > 0 { format!(" split{split_k}") } else { String::new() }
            ),
            Self::Group { experts } => format!("group e{experts}"),
            Self::RmsNorm { width, add } => format!("rms_norm w{width}{}", if *add { " +res" } else { "" }),
            Self::RopeRows { half, interleave } => format!("rope_rows half{half} il{}", u8::from(*interleave)),
            Self::MlaQuery { heads, tb, groups, interleave, .. } => {
                format!("mla_query h{heads} tb{tb} g{groups} il{}", u8::from(*interleave))
            }
            Self::MlaOutput { heads, ra, tb, warps, merge, .. } => {
                format!("mla_output h{heads} ra{ra} tb{tb} w{warps}{}", if *merge { " +merge" } else { "" })
            }
            Self::MlaLatent { r, rot, interleave } => format!("mla_latent r{r} rot{rot} il{}", u8::from(*interleave)),
        }
    }
}

/// Every kernel specialisation the launcher can issue for experts of `shape` with `topk` experts per token, over
/// all tuned launch shapes on a device of `smem_limit` bytes of shared memory a block and both activation types of
/// the gate/up launch; no duplicates.
pub fn moe_kernel_specs(shape: &MoeShape, topk: usize, smem_limit: usize) -> Vec<KernelSpec> {
    let mut out: Vec<KernelSpec> = Vec::new();
    let mut push = |k: KernelSpec| {
        if !out.contains(&k) {
            out.push(k);
        }
    };
    for act in [Act::Bf16, Act::F32] {
        for (cfg, tb) in tuned_launches(shape, smem_limit) {
            push(KernelSpec::ExpertRows { act, spec: ExpertRowsSpec::gate_up(shape, topk, &cfg, tb) });
        }
    }
    for (cfg, tb) in tuned_launches(shape, smem_limit) {
        push(KernelSpec::ExpertRows { act: Act::F32, spec: ExpertRowsSpec::down(shape, topk, &cfg, tb) });
    }
    // The tensor-core kernels: every candidate launch shape (the benchmark's sweep) at every tokens-per-pass whose
    // block fits the device's shared memory (the launcher takes the CUDA-core kernels for the others).
    for m in MmaShape::candidates() {
        for tb in MMA_TBS {
            for spec in [ExpertMmaSpec::gate_up(shape, topk, &m, tb), ExpertMmaSpec::down(shape, topk, &m, tb)] {
                if spec.fits() && spec.shared_bytes() <= smem_limit {
                    push(KernelSpec::ExpertMma { spec });
                }
            }
        }
    }
    // The loads-alone timing launches (`Stages::GateUpLoads` / `DownLoads`) of the one-token shape.
    if let Some(mm) = MoeConfig::for_tokens(1).mma {
        for mut spec in [ExpertMmaSpec::gate_up(shape, topk, &mm, 1), ExpertMmaSpec::down(shape, topk, &mm, 1)] {
            spec.loads_only = true;
            if spec.fits() && spec.shared_bytes() <= smem_limit {
                push(KernelSpec::ExpertMma { spec });
            }
        }
    }
    for act in [Act::Bf16, Act::F32] {
        push(KernelSpec::SplitX3 { act, k: shape.hidden });
    }
    push(KernelSpec::SplitX3 { act: Act::F32, k: shape.inter });
    // The tiled grouped GEMM of prefill chunks (`MoeConfig::tiled_gemm`), where the shape allows it.
    if crate::cuda::moe_tiled::tiled_fits(shape, smem_limit) {
        let pairs = crate::cuda::moe_tiled::SPEC_PAIRS;
        let address = crate::cuda::moe_tiled::tiled_address(shape, pairs / topk, pairs);
        let s = shape;
        for (k, rows, gated) in [(s.hidden, 2 * s.inter, true), (s.inter, s.hidden, false)] {
            push(KernelSpec::TiledExpert { k, rows, group: s.group, topk, gated, tiled: s.tiled(), address });
        }
        for act in [Act::Bf16, Act::F32] {
            push(KernelSpec::SplitRows { act, k: shape.hidden });
        }
        push(KernelSpec::TileList);
    }
    let address = AddressType::from_len(MAX_TOKENS * topk * shape.hidden);
    for add in [false, true] {
        push(KernelSpec::Combine { hidden: shape.hidden, topk, add, address });
    }
    push(KernelSpec::Copy);
    out
}

/// Kimi-K2's MLA latent: rank 512, rotary 64.
pub const KIMI_MLA: (usize, usize) = (512, 64);

/// Kimi-K2's dense Linear input widths (hidden, q_lora, kv_lora, heads x v_head, shared-expert and dense-MLP
/// inner widths).
pub const KIMI_DENSE_K: [usize; 6] = [7168, 1536, 512, 8192, 2048, 18432];

/// Every attention specialisation the launcher can issue for latents of `r + rot` on a device of `smem_limit`
/// bytes of shared memory a block (1 to 8 warps, as the heads of a tensor-parallel rank fill them), and the
/// combine; then every GEMV and SwiGLU-GEMV specialisation for inputs of the widths `ks` (all token-pass widths and
/// the block shapes `GemvConfig::for_shape` picks), and the prefill GEMM's split and sum kernels.
pub fn attention_and_dense_specs(r: usize, rot: usize, ks: &[usize], smem_limit: usize) -> Vec<KernelSpec> {
    use crate::cuda::attention::{HEADS_PER_WARP, attention_shared_bytes};
    use crate::cuda::dense::GemvConfig;
    let mut out = Vec::new();
    for hpw in HEADS_PER_WARP {
        for warps in 1..=8 {
            if attention_shared_bytes(r + rot, warps, hpw) <= smem_limit {
                out.push(KernelSpec::MlaAttention { r, rot, warps, hpw });
            }
        }
    }
    for shape in crate::cuda::attention_dims::PICKED {
        if crate::cuda::attention_dims::dims_refusal(r, rot, shape.wh, shape.wk, shape.hpw, shape.sg, smem_limit)
            .is_none()
        {
            out.push(KernelSpec::MlaAttentionDims { r, rot, shape });
        }
    }
    let shape = crate::cuda::attention_mma::MMA_PICKED;
    if crate::cuda::attention_mma::mma_refusal(r, rot, shape, smem_limit).is_none() {
        out.push(KernelSpec::MlaAttentionMma { r, rot, shape });
    }
    let shape = crate::cuda::attention_tf32::TF32_PICKED;
    if crate::cuda::attention_tf32::tf32_refusal(r, rot, shape, smem_limit).is_none() {
        out.push(KernelSpec::MlaAttentionTf32 { r, rot, shape });
    }
    for halves in [1, 4] {
        for one_pass in [false, true] {
            out.push(KernelSpec::MlaCombine { r, halves, one_pass });
        }
    }
    // The prefill chunks' MHA form at Kimi-K2's head dimensions (its value width merges segments), where it fits.
    let mha = crate::cuda::prefill_attention::MhaDims { nope: 128, rot, vd: 128 };
    if mha.check(smem_limit).is_ok() {
        out.push(KernelSpec::MhaPrefill { dims: mha });
        out.push(KernelSpec::MlaCombine { r: mha.vd, halves: 1, one_pass: false });
    }
    for &k in ks {
        for n in 1..=16 {
            for rows in [384, 576, 1536, 2048, 7168, 12288, 16384] {
                let cfg = GemvConfig::for_shape(n, rows, k, 264);
                let swiglu = GemvConfig::for_swiglu(n, rows, k, 264);
                for spec in [KernelSpec::Gemv { k, cfg }, KernelSpec::GemvSwiglu { k, cfg: swiglu }] {
                    if !out.contains(&spec) {
                        out.push(spec);
                    }
                }
                for gated in [false, true] {
                    if let Some(cfg) = crate::cuda::dense_mma::MmaGemvConfig::new(n, rows, k, gated, 132) {
                        let spec = KernelSpec::GemvMma { k, cfg };
                        if !out.contains(&spec) {
                            out.push(spec);
                        }
                    }
                }
            }
        }
    }
    // The model's normed GEMV (`q_a_layernorm` into `q_b_proj`: k = q_lora_rank: Kimi's 1536, and 512)
    // at the widths it takes (1-2 rows), over a tensor-parallel rank's share of the 64 heads' 12288 rows.
    for k in [1536, 512] {
        for n in 1..=2 {
            for rows in [12288, 6144, 3072, 1536] {
                let spec = KernelSpec::GemvNorm { k, cfg: GemvConfig::for_shape(n, rows, k, 264) };
                if !out.contains(&spec) {
                    out.push(spec);
                }
            }
        }
    }
    // The model's GEMV pairs at the CUDA-core GEMV's widths (`cuda_ops::gemv_pair_jobs`): `q_a_proj` with
    // `kv_a_proj_with_mqa`, the shared expert's gate/up with the router (Kimi-K2's rows).
    for &k in ks {
        for n in 1..=8 {
            for (a, swiglu_a, b, swiglu_b) in [(1536, false, 576, false), (2048, true, 384, false)] {
                // Above 4 rows only the measured shapes (`GemvConfig::tuned`) pair up.
                if n > 4 && GemvConfig::tuned(n, a, k, swiglu_a).is_none() {
                    continue;
                }
                let cfg = |rows, swiglu| {
                    if swiglu {
                        GemvConfig::for_swiglu(n, rows, k, 264)
                    } else {
                        GemvConfig::for_shape(n, rows, k, 264)
                    }
                };
                let spec = KernelSpec::GemvPair { k, a: cfg(a, swiglu_a), swiglu_a, b: cfg(b, swiglu_b), swiglu_b };
                if !out.contains(&spec) {
                    out.push(spec);
                }
            }
        }
    }
    out.push(KernelSpec::SplitBf16x3);
    out.push(KernelSpec::Sum3);
    out
}

/// The device router's specialisations of `spec` (its top-k and its grouping), without and with the MoE input's
/// split of width `hidden` (the model asks for it).
pub fn router_specs(spec: &crate::cuda::router::RouterSpec, hidden: usize) -> Vec<KernelSpec> {
    let route = |grouped, split_k| KernelSpec::Route {
        experts: spec.experts,
        n_group: spec.n_group,
        topk_group: spec.topk_group,
        top_k: spec.top_k,
        norm: spec.norm_topk_prob,
        grouped,
        split_k,
    };
    let mut out: Vec<KernelSpec> = [0, hidden].iter().flat_map(|&k| [route(false, k), route(true, k)]).collect();
    out.push(KernelSpec::Group { experts: spec.experts });
    out
}

/// Every specialisation eyrie-model launches of the MLA and norm kernels (`cuda::{mla, norm, rope}`) for a model
/// of Kimi-K2's attention shapes (`nope` 128, `rot` 64, `vd` 128, `r` 512) at 64 heads and the 32, 16 and 8 heads a
/// tensor-parallel rank of 2, 4 or 8 holds, both RoPE layouts, decode and verification widths up to 32 rows and
/// prefill (the launch shapes of `mla::query_launch` / `mla::output_launch`), and the norm widths `norm_widths`.
pub fn mla_and_norm_specs(norm_widths: &[usize]) -> Vec<KernelSpec> {
    let (nope, rot, vd, r) = (128, 64, 128, 512);
    let mut out = Vec::new();
    let mut push = |k: KernelSpec| {
        if !out.contains(&k) {
            out.push(k);
        }
    };
    for &width in norm_widths {
        for add in [false, true] {
            push(KernelSpec::RmsNorm { width, add });
        }
    }
    push(KernelSpec::ArgmaxRows);
    for interleave in [false, true] {
        push(KernelSpec::RopeRows { half: rot / 2, interleave });
        push(KernelSpec::MlaLatent { r, rot, interleave });
        for heads in [64, 32, 16, 8] {
            for n in [1, 2, 3, 4, 8, 16, 17, 32] {
                let (tb, groups) = crate::cuda::mla::query_launch(n, nope);
                push(KernelSpec::MlaQuery { heads, dims: (nope, rot, vd, r), tb, groups, interleave });
            }
        }
    }
    for heads in [64, 32, 16, 8] {
        for n in [1, 2, 3, 4, 8, 16] {
            let (tb, ra, warps) = crate::cuda::mla::output_launch(n, vd);
            for merge in [false, true] {
                if !merge || crate::cuda::mla::output_merges((tb, ra, warps)) {
                    push(KernelSpec::MlaOutput { heads, dims: (nope, vd, r), ra, tb, warps, merge });
                }
            }
        }
    }
    out
}

/// Kimi-K2's norm widths that run the RMSNorm kernel: hidden, q_lora, kv_lora.
pub const KIMI_NORM_WIDTHS: [usize; 3] = [7168, 1536, 512];

/// Kimi-K2's router (384 experts, one group, top-8) and DeepSeek-V3's (256 experts, 8 groups of which 4 are kept,
/// top-8).
pub const ROUTERS: [crate::cuda::router::RouterSpec; 2] = [
    crate::cuda::router::RouterSpec {
        experts: 384,
        n_group: 1,
        topk_group: 1,
        top_k: 8,
        norm_topk_prob: true,
        routed_scaling_factor: 2.827,
    },
    crate::cuda::router::RouterSpec {
        experts: 256,
        n_group: 8,
        topk_group: 4,
        top_k: 8,
        norm_topk_prob: true,
        routed_scaling_factor: 2.5,
    },
];

#[cfg(test)]
#[path = "specs_tests.rs"]
mod tests;
