//! Tests of the kernel specialisation lists (`specs`).
use super::*;

const KIMI: MoeShape = MoeShape { hidden: 7168, inter: 2048, experts: 384, group: 32 };

/// On SM120 (99 KiB a block) the tuned shapes lose their 4-token passes at Kimi's width, and every launch
/// they make fits; on an H200 (227 KiB) nothing changes.
#[test]
fn launch_shapes_fit_the_device_shared_memory() {
    let (sm120, h200) = (101_376, 232_448);
    let mut capped = 0;
    for m in 1..=MAX_TOKENS {
        let cfg = MoeConfig::for_tokens(m);
        assert_eq!(cfg.fit_shared_memory(&KIMI, h200), cfg, "m {m}");
        let fit = cfg.fit_shared_memory(&KIMI, sm120);
        capped += usize::from(fit != cfg);
        for tb in class_tbs(&fit) {
            assert!(ExpertRowsSpec::gate_up(&KIMI, 8, &fit, tb).shared_bytes() <= sm120, "m {m} tb {tb}");
            assert!(ExpertRowsSpec::down(&KIMI, 8, &fit, tb).shared_bytes() <= sm120, "m {m} tb {tb}");
        }
    }
    assert!(capped > 0, "4-token passes of a 7168-wide input need 126 KiB: some shape must be capped");
}

/// The tensor-core shapes the launcher picks fit SM120's shared memory at every tokens-per-pass they run
/// (so SM120 runs them, not the CUDA-core fallback); `shared_bytes` is what ptxas reported for two of them
/// (`cargo xtask kernels --arch sm_90 --only mma`); a candidate too big for SM120 stays out of its specs.
#[test]
fn tensor_core_shapes_fit_the_device_shared_memory() {
    let sm120 = 101_376;
    for m in 1..=MAX_TOKENS {
        let cfg = MoeConfig::for_tokens(m);
        let mm = cfg.mma.expect("tensor cores at every width");
        for tb in mma_class_tbs(&cfg) {
            for spec in [ExpertMmaSpec::gate_up(&KIMI, 8, &mm, tb), ExpertMmaSpec::down(&KIMI, 8, &mm, tb)] {
                assert!(spec.shared_bytes() <= sm120, "m {m}: {} needs {}", spec.label(), spec.shared_bytes());
            }
        }
    }
    let wide = MmaShape::new(8, 3, 1, 1, 2);
    assert_eq!(ExpertMmaSpec::gate_up(&KIMI, 8, &wide, 1).shared_bytes(), 24_576);
    assert_eq!(ExpertMmaSpec::gate_up(&KIMI, 8, &wide, 16).shared_bytes(), 147_456);
    let specs = moe_kernel_specs(&KIMI, 8, sm120);
    assert!(!specs.contains(&KernelSpec::ExpertMma { spec: ExpertMmaSpec::gate_up(&KIMI, 8, &wide, 16) }));
    assert!(specs.contains(&KernelSpec::ExpertMma { spec: ExpertMmaSpec::gate_up(&KIMI, 8, &wide, 1) }));
}

#[test]
fn attention_specs_fit_the_device() {
    let h200 = attention_and_dense_specs(512, 64, &[7168], 232_448);
    for hpw in [2, 4, 8] {
        assert!(h200.contains(&KernelSpec::MlaAttention { r: 512, rot: 64, warps: 8, hpw }));
    }
    let sm120 = attention_and_dense_specs(512, 64, &[7168], 101_376);
    assert!(sm120.contains(&KernelSpec::MlaAttention { r: 512, rot: 64, warps: 1, hpw: 8 }));
    assert!(!sm120.iter().any(|s| matches!(s, KernelSpec::MlaAttention { warps: 2.., hpw: 8, .. })));
    // Every shape the launcher picks on SM120 and the H200 is in the list.
    let spec_of = |c: crate::cuda::attention::AttentionConfig| match c.lanes {
        crate::cuda::attention::Lanes::Keys => KernelSpec::MlaAttention { r: 512, rot: 64, warps: c.warps, hpw: c.hpw },
        crate::cuda::attention::Lanes::Dims { key_warps, groups } => KernelSpec::MlaAttentionDims {
            r: 512,
            rot: 64,
            shape: crate::cuda::attention_dims::DimShape { wh: c.warps, wk: key_warps, hpw: c.hpw, sg: groups },
        },
        crate::cuda::attention::Lanes::Mma { tiles, positions } => KernelSpec::MlaAttentionMma {
            r: 512,
            rot: 64,
            shape: crate::cuda::attention_mma::MmaShape { tiles, wk: c.warps / tiles, pt: positions },
        },
        crate::cuda::attention::Lanes::Tf32 { positions, stages } => KernelSpec::MlaAttentionTf32 {
            r: 512,
            rot: 64,
            shape: crate::cuda::attention_tf32::Tf32Shape { warps: c.warps, pt: positions, stages },
        },
    };
    for (rows, ctx) in [(1, 64), (1, 1024), (1, 8192), (8, 1024), (8, 8192), (32, 1024), (1024, 1024)] {
        for heads in [8, 16, 32, 64, 128] {
            let c = crate::cuda::attention::AttentionConfig::pick(rows, heads, ctx, 512, 64, 188, 101_376).unwrap();
            assert!(sm120.contains(&spec_of(c)), "{rows} rows x {ctx}, {heads} heads: {c:?}");
            let c = crate::cuda::attention::AttentionConfig::pick(rows, heads, ctx, 512, 64, 132, 232_448).unwrap();
            assert!(h200.contains(&spec_of(c)), "{rows} rows x {ctx}, {heads} heads: {c:?}");
        }
    }
    // The dim lanes' shapes: all three on the H200, the 92 KB one on SM120.
    assert_eq!(h200.iter().filter(|s| matches!(s, KernelSpec::MlaAttentionDims { .. })).count(), 3);
    let dims120: Vec<_> = sm120.iter().filter(|s| matches!(s, KernelSpec::MlaAttentionDims { .. })).collect();
    assert_eq!(
        dims120,
        [&KernelSpec::MlaAttentionDims { r: 512, rot: 64, shape: crate::cuda::attention_dims::FEW_HEADS_WIDE }]
    );
    assert!(sm120.iter().filter(|s| matches!(s, KernelSpec::Gemv { .. })).count() >= 4);
    for specs in [&h200, &sm120] {
        assert!(specs.iter().any(|s| matches!(s, KernelSpec::MhaPrefill { .. })));
        assert!(specs.contains(&KernelSpec::MlaCombine { r: 128, halves: 1, one_pass: false }));
    }
}

#[test]
fn mla_specs_cover_every_launch_the_model_picks() {
    let specs = mla_and_norm_specs(&KIMI_NORM_WIDTHS);
    for heads in [64, 32, 16, 8] {
        for n in 1..=300 {
            let (tb, groups) = crate::cuda::mla::query_launch(n, 128);
            for interleave in [false, true] {
                let q = KernelSpec::MlaQuery { heads, dims: (128, 64, 128, 512), tb, groups, interleave };
                assert!(specs.contains(&q), "{q:?}");
            }
            let (tb, ra, warps) = crate::cuda::mla::output_launch(n, 128);
            for merge in [false, true] {
                let o = KernelSpec::MlaOutput { heads, dims: (128, 128, 512), ra, tb, warps, merge };
                let merges = crate::cuda::mla::output_merges((tb, ra, warps));
                assert_eq!(specs.contains(&o), !merge || merges, "{o:?}");
            }
            // One row (a batch-1 decode step) merges the attention's slices in the output launch.
            assert_eq!(n == 1, crate::cuda::mla::output_merges((tb, ra, warps)), "{n} rows");
        }
    }
    assert!(specs.contains(&KernelSpec::RmsNorm { width: 7168, add: true }));
    assert!(specs.contains(&KernelSpec::MlaLatent { r: 512, rot: 64, interleave: true }));
}

#[test]
fn mma_specs_take_the_shapes_the_kernel_can() {
    let m = MmaShape::new(2, 2, 2, 4, 2);
    let g = ExpertMmaSpec::gate_up(&KIMI, 8, &m, 1);
    let d = ExpertMmaSpec::down(&KIMI, 8, &m, 1);
    assert!(g.fits() && d.fits());
    // 2048 units of 16 per task, 2 tasks a block; 7168 rows of 32 per task, 4 tasks a block.
    assert_eq!((g.row_tiles(), d.row_tiles()), (64, 56));
    assert_eq!((g.cube_dim().y, d.cube_dim().y), (4, 8));
    // The fixtures' 64-wide models (k not a multiple of 128) and rows that are not whole tiles take the
    // CUDA-core kernels.
    let tiny = MoeShape { hidden: 64, inter: 32, experts: 8, group: 32 };
    assert!(!ExpertMmaSpec::gate_up(&tiny, 2, &m, 1).fits());
    let odd = MoeShape { hidden: 1024, inter: 136, experts: 8, group: 32 };
    assert!(!ExpertMmaSpec::gate_up(&odd, 2, &m, 1).fits());
    assert!(!ExpertMmaSpec::down(&odd, 2, &m, 1).fits());
    let zero = MmaShape { tiles_2: 0, ..m };
    assert!(!ExpertMmaSpec::down(&KIMI, 8, &zero, 1).fits());
}

#[test]
fn kimi_specialisations_cover_every_tuned_shape() {
    let specs = moe_kernel_specs(&KIMI, 8, 232_448);
    let rows: Vec<(Act, ExpertRowsSpec)> = specs
        .iter()
        .filter_map(|s| match s {
            KernelSpec::ExpertRows { act, spec } => Some((*act, *spec)),
            _ => None,
        })
        .collect();
    for m in [1, 2, 3, 8, 32, 128, 256] {
        let cfg = MoeConfig::for_tokens(m);
        for tb in class_tbs(&cfg).into_iter().take(m) {
            for act in [Act::Bf16, Act::F32] {
                assert!(rows.contains(&(act, ExpertRowsSpec::gate_up(&KIMI, 8, &cfg, tb))), "m {m} tb {tb}");
            }
            assert!(rows.contains(&(Act::F32, ExpertRowsSpec::down(&KIMI, 8, &cfg, tb))), "m {m} tb {tb}");
        }
        // The tensor-core path the tuned shape takes at Kimi's shape (its own tokens per pass).
        let mm = cfg.mma.expect("every tuned shape runs on tensor cores");
        for tb in mma_class_tbs(&cfg).into_iter().take(m) {
            assert!(MMA_TBS.contains(&tb), "m {m} tb {tb}");
            for spec in [ExpertMmaSpec::gate_up(&KIMI, 8, &mm, tb), ExpertMmaSpec::down(&KIMI, 8, &mm, tb)] {
                assert!(spec.fits(), "m {m} tb {tb}");
                assert!(specs.contains(&KernelSpec::ExpertMma { spec }), "m {m} tb {tb}: {spec:?}");
            }
        }
    }
    // Prefill widths: experts with 3+ tokens take 8 or 16 a pass on tensor cores (4-8x fewer reads of their
    // weights than the CUDA-core kernels' 2), and those shapes are listed too.
    assert_eq!(mma_class_tbs(&MoeConfig::for_tokens(512)), [1, 2, 8]);
    assert_eq!(mma_class_tbs(&MoeConfig::for_tokens(8192)), [1, 2, 16]);
    let mm = MoeConfig::for_tokens(8192).mma.unwrap();
    for spec in [ExpertMmaSpec::gate_up(&KIMI, 8, &mm, 16), ExpertMmaSpec::down(&KIMI, 8, &mm, 16)] {
        assert!(specs.contains(&KernelSpec::ExpertMma { spec }), "{spec:?}");
    }
    for (act, k) in [(Act::Bf16, 7168), (Act::F32, 7168), (Act::F32, 2048)] {
        assert!(specs.contains(&KernelSpec::SplitX3 { act, k }));
    }
    // One token fills only 1-token experts: its 16-warp shape never runs with 2 or 4 tokens per pass.
    let one = MoeConfig::for_tokens(1);
    assert!(!rows.iter().any(|(_, r)| r.warps == one.warps && r.tb > 1));
    assert!(rows.iter().all(|(_, r)| r.address == AddressType::U32));
    assert_eq!(specs.iter().filter(|s| matches!(s, KernelSpec::Combine { .. })).count(), 2);
    // gate/up at hidden 7168 with 4 tokens per pass stages 126 KiB of activations.
    let big = rows.iter().map(|(_, r)| r.shared_bytes()).max().unwrap();
    assert_eq!(big, 129_024);
}

/// Where the tensor-core expert kernels wait for their predecessor (programmatic dependent launch, sm_90+), in the
/// source the device compiles (`offline::cuda_source` applies cubecl-cuda's rewrite): gate/up, whose routing the
/// launch before it writes, at its entry; down after its first weight and scale loads and before its first load of
/// the activations (gate/up's output), once more before it ends, its entry only letting the next launch be
/// scheduled. Below sm_90 no PDL instruction at all.
#[test]
fn expert_kernels_wait_for_their_predecessor_where_they_may() {
    use crate::cuda::offline::cuda_source;
    use crate::cuda::resources::Arch;
    const WAIT: &str = "griddepcontrol.wait";
    const TRIGGER: &str = "griddepcontrol.launch_dependents";
    let mm = MoeConfig::for_tokens(1).mma.expect("one token runs on tensor cores");
    let source = |spec: ExpertMmaSpec, version: u32| {
        let s = cuda_source(&KernelSpec::ExpertMma { spec }, Arch { version }, 12080).expect("compiles").source;
        // The kernel's body: from the first brace after `__global__`.
        let entry = s.find("__global__").expect("an entry point");
        s[entry + s[entry..].find('{').expect("a body")..].to_string()
    };
    let first = |body: &str, what: &str| body.find(what).unwrap_or_else(|| panic!("no {what}"));
    let gate_up = source(ExpertMmaSpec::gate_up(&KIMI, 8, &mm, 1), 90);
    assert_eq!(gate_up.matches(WAIT).count(), 1);
    assert!(first(&gate_up, WAIT) < first(&gate_up, TRIGGER), "gate/up waits first");
    assert!(first(&gate_up, TRIGGER) < first(&gate_up, "buffer_"), "both before any buffer access");
    for tb in [1, 2] {
        let down = source(ExpertMmaSpec::down(&KIMI, 8, &mm, tb), 90);
        // Buffers in argument order: 0 the activations, 1 the weight words, 2 the scales.
        assert_eq!(down.matches(WAIT).count(), 2, "tb {tb}");
        assert!(first(&down, TRIGGER) < first(&down, WAIT), "tb {tb}");
        assert!(first(&down, "buffer_1[") < first(&down, WAIT), "tb {tb}: weights before the wait");
        assert!(first(&down, "buffer_2[") < first(&down, WAIT), "tb {tb}: scales before the wait");
        assert!(first(&down, WAIT) < first(&down, "buffer_0["), "tb {tb}: activations after it");
        assert!(!down.contains("EYRIE_PDL_WAIT"), "tb {tb}: every marker replaced");
        assert!(down.rfind(WAIT) > down.rfind("buffer_6["), "tb {tb}: the second wait after the last output write");
    }
    for spec in [ExpertMmaSpec::gate_up(&KIMI, 8, &mm, 1), ExpertMmaSpec::down(&KIMI, 8, &mm, 1)] {
        assert!(!source(spec, 80).contains("griddepcontrol"), "{spec:?}");
    }
}

/// The tiled grouped GEMM of prefill chunks: listed (both GEMMs at the address of the widest chunk, both input
/// types' splits, the tile list) on the H200 and on SM120 for Kimi's shape, taken from `TILED_GEMM_MIN_TOKENS`,
/// not listed where the shape does not split into its blocks; the tile count bound holds for uneven routings.
#[test]
fn tiled_prefill_specs_cover_its_launches() {
    use crate::cuda::gpu::TILED_GEMM_MIN_TOKENS;
    use crate::cuda::moe_tiled::{BM, SPEC_PAIRS, max_tiles, tiled_address, tiled_fits};
    for limit in [232_448, 101_376] {
        let specs = moe_kernel_specs(&KIMI, 8, limit);
        let address = tiled_address(&KIMI, SPEC_PAIRS / 8, SPEC_PAIRS);
        for (k, rows, gated) in [(7168, 4096, true), (2048, 7168, false)] {
            let t = KernelSpec::TiledExpert { k, rows, group: 32, topk: 8, gated, tiled: KIMI.tiled(), address };
            assert!(specs.contains(&t), "{t:?} at {limit}");
        }
        for act in [Act::Bf16, Act::F32] {
            assert!(specs.contains(&KernelSpec::SplitRows { act, k: 7168 }));
        }
        assert!(specs.contains(&KernelSpec::TileList));
    }
    assert!(MoeConfig::for_tokens(TILED_GEMM_MIN_TOKENS).tiled_gemm);
    assert!(!MoeConfig::for_tokens(TILED_GEMM_MIN_TOKENS - 1).tiled_gemm);
    assert!(!MoeConfig::for_tokens(1).tiled_gemm);
    let odd = MoeShape { hidden: 1024, inter: 96, experts: 8, group: 32 };
    assert!(!tiled_fits(&odd, 232_448));
    assert!(!moe_kernel_specs(&odd, 2, 232_448).iter().any(|s| matches!(s, KernelSpec::TiledExpert { .. })));
    // The widest chunk the model sends launches; a grid taller than 65535 tiles does not (the passes take it).
    assert!(crate::cuda::moe_tiled::tiled_launchable(&KIMI, 8192, SPEC_PAIRS, 384));
    assert!(!crate::cuda::moe_tiled::tiled_launchable(&KIMI, 1 << 20, 8 << 20, 384));
    // Tiles of up to BM pairs an expert: never more than `max_tiles` (the grid height the launcher reserves).
    let mut rng = crate::cuda::SplitMix64::new(3);
    for _ in 0..200 {
        let slots = 1 + (rng.next_u64() % 384) as usize;
        let counts: Vec<usize> = (0..slots).map(|_| 1 + (rng.next_u64() % 300) as usize).collect();
        let pairs: usize = counts.iter().sum();
        let tiles: usize = counts.iter().map(|c| c.div_ceil(BM)).sum();
        assert!(tiles <= max_tiles(pairs, slots), "{tiles} tiles of {pairs} pairs over {slots} slots");
    }
}
