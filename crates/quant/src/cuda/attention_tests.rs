//! Tests of [`super`] (`cuda::attention`), in a file of their own.

use super::*;

fn one_seq(lens: &[u32], blocks: &[u32], block_size: usize) -> PagedRows {
    PagedRows {
        row_seq: vec![0; lens.len()],
        row_len: lens.to_vec(),
        tables: blocks.to_vec(),
        max_blocks: blocks.len(),
        block_size,
    }
}

#[test]
fn one_position_returns_its_latent() {
    // r = 2, rot = 1; cache rows 0 and 1; the sequence lives in block 1 (block size 1).
    let cache = [9.0, 9.0, 9.0, 0.5, -2.0, 1.0];
    let rows = one_seq(&[1], &[1], 1);
    let out = mla_attention_reference(&[1.0, 2.0, 3.0, -1.0, 0.0, 4.0], &cache, &rows, 2, 2, 1, 0.3);
    assert_eq!(out, vec![0.5, -2.0, 0.5, -2.0]);
}

#[test]
fn equal_scores_average_and_causal_lengths_cut() {
    // Two positions with the same score (q . k_pe = 0, q_lat = 0): mean of the two; len 1 sees only the first.
    let cache = [1.0, 3.0, 0.0, 0.0, 5.0, -7.0, 0.0, 0.0];
    let rows = one_seq(&[2, 1], &[0, 1], 1);
    let q = [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0];
    let out = mla_attention_reference(&q, &cache, &rows, 1, 2, 2, 1.0);
    assert_eq!(out, vec![3.0, -2.0, 1.0, 3.0]);
}

#[test]
fn softmax_weights_follow_the_scores() {
    // r = 4, rot = 1. Scores 0 and ln 3 (scale 1): weights 1/4 and 3/4. Block size 2: positions 0 and 1 are
    // cache rows 0 and 1 of block 0; the table's other entries are never read at length 2.
    let mut cache = vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 3f32.ln()];
    cache.extend_from_slice(&[0.0; 10]);
    let rows = PagedRows { row_seq: vec![0], row_len: vec![2], tables: vec![0, 1, 7], max_blocks: 3, block_size: 2 };
    let out = mla_attention_reference(&[0.0, 0.0, 0.0, 0.0, 1.0], &cache, &rows, 1, 4, 1, 1.0);
    let want = [0.25, 0.0, 0.0, 0.75];
    assert!(out.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{out:?}");
}

#[test]
fn subsets_keep_the_tables_and_cut_the_rows() {
    let rows = PagedRows {
        row_seq: vec![0, 1, 1],
        row_len: vec![3, 1, 2],
        tables: vec![0, 1, 2, 0],
        max_blocks: 2,
        block_size: 2,
    };
    let part = rows.subset(1..3);
    assert_eq!((part.row_seq, part.row_len), (vec![1, 1], vec![1, 2]));
    assert_eq!(part.tables, rows.tables);
    let parts: Vec<PagedRows> = (0..3).step_by(2).map(|s| rows.subset(s..(s + 2).min(3))).collect();
    assert_eq!(parts.iter().map(PagedRows::rows).sum::<usize>(), 3);
    assert_eq!(parts[1].slot(0, 1), rows.slot(2, 1));
}

#[test]
fn validate_names_the_bad_row() {
    let rows =
        PagedRows { row_seq: vec![0, 1], row_len: vec![3, 1], tables: vec![0, 1, 2, 0], max_blocks: 2, block_size: 2 };
    assert!(rows.validate(6).is_ok());
    assert!(rows.validate(3).unwrap_err().contains("row 0: block 1"));
    let bad = PagedRows { row_len: vec![5, 1], ..rows.clone() };
    assert!(bad.validate(6).unwrap_err().contains("row 0: row_len 5"));
    let bad = PagedRows { row_seq: vec![0, 2], ..rows };
    assert!(bad.validate(6).unwrap_err().contains("row 1: row_seq 2"));
}

#[test]
fn config_fits_shared_memory_and_covers_the_positions() {
    let c = AttentionConfig::new(8, 64, 8192, 576, 132, 227 * 1024).unwrap();
    assert_eq!((c.warps, c.hpw), (8, 8));
    assert!(c.splits * c.chunk >= 8192 && c.chunk.is_multiple_of(32));
    assert!(8 * c.splits >= 120, "about every multiprocessor gets a block: {c:?}");
    // The H200 sweep's best shapes: batch 8 at 1k (16 slices of 64), batch 8 at 8k (16 of 512), batch 32 at 1k
    // (4 of 256: one wave of 128 blocks).
    assert_eq!(
        AttentionConfig::new(8, 64, 1024, 576, 132, 227 * 1024),
        Some(AttentionConfig { lanes: Lanes::Keys, warps: 8, hpw: 8, splits: 16, chunk: 64 })
    );
    assert_eq!(
        AttentionConfig::new(8, 64, 8192, 576, 132, 227 * 1024),
        Some(AttentionConfig { lanes: Lanes::Keys, warps: 8, hpw: 8, splits: 16, chunk: 512 })
    );
    assert_eq!(
        AttentionConfig::new(32, 64, 1024, 576, 132, 227 * 1024),
        Some(AttentionConfig { lanes: Lanes::Keys, warps: 8, hpw: 8, splits: 4, chunk: 256 })
    );
    // One row over a short context: 32-position slices, 2 heads a warp and 4 head groups of 8 warps (128
    // blocks of short chains).
    let c = AttentionConfig::new(1, 64, 1024, 576, 132, 227 * 1024).unwrap();
    assert_eq!(c, AttentionConfig { lanes: Lanes::Keys, warps: 8, hpw: 2, splits: 32, chunk: 32 });
    assert_eq!(c.blocks(1, 64), 128);
    // One more tile (a decode step past 1024 positions) keeps 2 heads a warp (GPU-timed: 26.2 us against 32.5
    // with 4, session 13).
    let c = AttentionConfig::new(1, 64, 1040, 576, 132, 227 * 1024).unwrap();
    assert_eq!((c.warps, c.hpw, c.chunk), (8, 2, 32));
    // Two and four rows over 1k: 4 heads a warp (the sweep's best shapes).
    assert_eq!(
        AttentionConfig::new(2, 64, 1024, 576, 132, 227 * 1024),
        Some(AttentionConfig { lanes: Lanes::Keys, warps: 8, hpw: 4, splits: 32, chunk: 32 })
    );
    assert_eq!(
        AttentionConfig::new(4, 64, 1024, 576, 132, 227 * 1024),
        Some(AttentionConfig { lanes: Lanes::Keys, warps: 8, hpw: 4, splits: 16, chunk: 64 })
    );
    // SM120: 99 KiB per block allows one warp of 8 heads with a 576-wide latent tile, more of fewer heads.
    let c = AttentionConfig::new(1, 64, 1000, 576, 188, 99 * 1024).unwrap();
    assert!(attention_shared_bytes(576, c.warps, c.hpw) <= 99 * 1024, "{c:?}");
    assert!(attention_shared_bytes(576, 1, 8) <= 99 * 1024);
    assert!(attention_shared_bytes(576, 2, 8) > 99 * 1024);
    for rows in [1, 2, 8, 32, 128] {
        for ctx in [1, 31, 1024, 8192] {
            let c = AttentionConfig::new(rows, 64, ctx, 576, 188, 99 * 1024).unwrap();
            assert!(attention_shared_bytes(576, c.warps, c.hpw) <= 99 * 1024, "{c:?}");
            assert!(c.splits * c.chunk >= ctx && c.chunk.is_multiple_of(32), "{c:?}");
        }
    }
    // A tensor-parallel rank's 8 heads: 2 heads a warp in 4-warp blocks, two blocks a multiprocessor (the 8-head
    // sweep's best shapes at 8 x 8k, 32 x 1k and 8 x 1k, session 17; 8 heads in one warp took 2.8x as long at 8k).
    let h8 = |rows, ctx| AttentionConfig::new(rows, 8, ctx, 576, 132, 227 * 1024);
    assert_eq!(h8(8, 8192), Some(AttentionConfig { lanes: Lanes::Keys, warps: 4, hpw: 2, splits: 32, chunk: 256 }));
    assert_eq!(h8(32, 1024), Some(AttentionConfig { lanes: Lanes::Keys, warps: 4, hpw: 2, splits: 8, chunk: 128 }));
    assert_eq!(h8(8, 1024), Some(AttentionConfig { lanes: Lanes::Keys, warps: 4, hpw: 2, splits: 32, chunk: 32 }));
    // 1-4 rows over 1k: one head a warp, 8 warps (22.9-23.3 us against 27.7 with 2 heads a warp at one row).
    assert_eq!(h8(1, 1024), Some(AttentionConfig { lanes: Lanes::Keys, warps: 8, hpw: 1, splits: 32, chunk: 32 }));
    assert_eq!(h8(4, 1024).map(|c| (c.warps, c.hpw)), Some((8, 1)));
    // Kimi's 64 heads never take one head a warp.
    for rows in [1, 2, 4, 8] {
        assert_ne!(AttentionConfig::new(rows, 64, 1024, 576, 132, 227 * 1024).unwrap().hpw, 1);
    }
    // 16 heads: 4 heads a warp, 4 warps.
    assert_eq!(AttentionConfig::new(8, 16, 8192, 576, 132, 227 * 1024).map(|c| (c.warps, c.hpw)), Some((4, 4)));
    // A prefill chunk of 1024 rows needs no split.
    assert_eq!(AttentionConfig::new(1024, 64, 1024, 576, 132, 227 * 1024).unwrap().splits, 1);
}

#[test]
fn variants_cover_every_shape_new_picks() {
    // H200 and SM120 shared memory, Kimi's 64 heads and a tensor-parallel rank's 32, 16 and 8, the tiny model's 4.
    for (sms, smem) in [(132, 227 * 1024), (188, 99 * 1024)] {
        for heads in [64, 32, 16, 8, 4] {
            let variants = AttentionConfig::variants(heads, 576, smem);
            assert!(!variants.is_empty() && variants.len() <= 5, "{heads} heads: {variants:?}");
            for rows in [1, 2, 3, 4, 8, 16, 17, 33, 64, 128, 256, 2048] {
                for len in [1, 31, 64, 500, 1024, 4096, 8192, 65536] {
                    let c = AttentionConfig::new(rows, heads, len, 576, sms, smem).unwrap();
                    assert!(
                        variants.iter().any(|v| (v.warps, v.hpw) == (c.warps, c.hpw)),
                        "{heads} heads, {rows} rows over {len}: {c:?} not in {variants:?}"
                    );
                }
            }
        }
    }
    assert!(AttentionConfig::variants(0, 576, 227 * 1024).is_empty());
}

#[test]
fn the_dim_lanes_are_picked_where_the_h200_measured_them_faster() {
    use crate::cuda::attention_dims::{FEW_HEADS_NARROW, FEW_HEADS_WIDE, MANY_HEADS, dims_shared_bytes};
    // The dim lanes' own pick (few heads take the TF32 kernel first since session 31: `the_tf32_kernel_is_picked_
    // for_few_heads`; the dim lanes are its fallback where it is off or refused).
    let h200 = |rows, heads, ctx| {
        crate::cuda::attention_dims::pick(rows, heads, ctx, 512, 64, 132, 227 * 1024)
            .or_else(|| AttentionConfig::pick(rows, heads, ctx, 512, 64, 132, 227 * 1024))
            .unwrap()
    };
    let dims = |c: AttentionConfig| match c.lanes {
        Lanes::Dims { key_warps, groups } => {
            Some(crate::cuda::attention_dims::DimShape { wh: c.warps, wk: key_warps, hpw: c.hpw, sg: groups })
        }
        Lanes::Keys | Lanes::Mma { .. } | Lanes::Tf32 { .. } => None,
    };
    // Session 22's sweep (`gpu_attention --dims`): the best shape and slice length of each case.
    let c = h200(8, 8, 8192);
    assert_eq!((dims(c), c.chunk, c.splits), (Some(FEW_HEADS_WIDE), 256, 32));
    let c = h200(32, 8, 8192);
    assert_eq!((dims(c), c.chunk), (Some(FEW_HEADS_WIDE), 1024));
    let c = h200(8, 8, 1024);
    assert_eq!((dims(c), c.chunk), (Some(FEW_HEADS_NARROW), 64));
    let c = h200(32, 8, 1024);
    assert_eq!((dims(c), c.chunk), (Some(FEW_HEADS_NARROW), 256));
    // 64 heads take the tensor cores since session 23 (`the_tensor_cores_are_picked_for_many_heads`); the dim lanes'
    // many-heads shape stays the pick where those are off or refused.
    let _ = MANY_HEADS;
    let small = AttentionConfig::pick(8, 8, 8192, 64, 8, 132, 227 * 1024).unwrap();
    assert_eq!(small, AttentionConfig::new(8, 8, 8192, 72, 132, 227 * 1024).unwrap());
    // SM120 (99 KB a block): few heads take the 92 KB shape at any size, 64 heads the tensor cores (79 KB).
    let sm120 = |rows, heads, ctx| AttentionConfig::pick(rows, heads, ctx, 512, 64, 188, 99 * 1024).unwrap();
    let sm120_dims = crate::cuda::attention_dims::pick(1, 8, 1024, 512, 64, 188, 99 * 1024).unwrap();
    assert_eq!(dims(sm120_dims), Some(FEW_HEADS_WIDE));
    assert!(matches!(sm120(8, 64, 8192).lanes, Lanes::Mma { .. }));
    assert!(dims_shared_bytes(512, 64, 1, 4, 8, 1) <= 99 * 1024);
    // Every pick covers its rows' positions in slices of whole 64s, and a thousand rows take one slice.
    for (rows, heads, ctx) in [(1, 8, 1000), (3, 16, 70_000), (8, 32, 8191), (128, 64, 8192), (1024, 64, 1024)] {
        let c = h200(rows, heads, ctx);
        assert!(c.splits * c.chunk >= ctx && (c.splits - 1) * c.chunk < ctx, "{c:?}");
        if dims(c).is_some() {
            assert!(c.chunk.is_multiple_of(64), "{c:?}");
        }
    }
    assert_eq!(h200(1024, 64, 1024).splits, 1);
}

#[test]
fn the_tensor_cores_are_picked_for_many_heads() {
    use crate::cuda::attention_mma::{MMA_PICKED, mma_shared_bytes};
    let h200 = |rows, heads, ctx| AttentionConfig::pick(rows, heads, ctx, 512, 64, 132, 227 * 1024).unwrap();
    // Session 23's sweep (`gpu_attention --mma`, 64 heads): the picked shape's best slice length at each case.
    for (rows, ctx, chunk) in [(1, 1024, 32), (1, 8192, 128), (8, 1024, 128), (8, 8192, 1024), (32, 1024, 512)] {
        let c = h200(rows, 64, ctx);
        assert_eq!(c, MMA_PICKED.config(ctx.div_ceil(chunk), chunk), "{rows} x {ctx}");
        assert_eq!(c.blocks(rows, 64), rows * 4 * c.splits);
    }
    // 32 heads too (`--tp-size 2`); 16 and fewer take the TF32 kernel (half a tile of 16 heads would be padding).
    assert!(matches!(h200(3, 32, 1025).lanes, Lanes::Mma { tiles: 1, positions: 16 }));
    assert!(matches!(h200(8, 16, 8192).lanes, Lanes::Tf32 { positions: 16, stages: 2 }));
    assert!(matches!(h200(8, 8, 8192).lanes, Lanes::Tf32 { positions: 16, stages: 2 }));
    // A latent the kernel refuses (r not a multiple of 128) falls back to the CUDA-core kernels.
    let small = AttentionConfig::pick(8, 64, 8192, 64, 8, 132, 227 * 1024).unwrap();
    assert!(!matches!(small.lanes, Lanes::Mma { .. }));
    // Two blocks a multiprocessor on the H200, one on SM120 (99 KB); refused where a block does not fit.
    assert_eq!(mma_shared_bytes(512, 64, MMA_PICKED), 78_880);
    assert!(crate::cuda::attention_mma::pick(1, 64, 8192, 512, 64, 132, 64 * 1024).is_none());
    let c = crate::cuda::attention_mma::pick(1, 64, 8192, 512, 64, 188, 99 * 1024).unwrap();
    assert!((94..=188).contains(&c.blocks(1, 64)), "{c:?}");
}

#[test]
fn the_tf32_kernel_is_picked_for_few_heads() {
    use crate::cuda::attention_tf32::{TF32_PICKED, Tf32Shape, tf32_refusal, tf32_shared_bytes};
    let h200 = |rows, heads, ctx| AttentionConfig::pick(rows, heads, ctx, 512, 64, 132, 227 * 1024).unwrap();
    // Session 31's sweep (`gpu_attention --tf32 --heads 8`): the picked shape's best slice length at each case (8
    // rows over 1k: 32 picked, 64 measured best, 15.9 against 14.8 us).
    for (rows, ctx, chunk) in
        [(1, 1024, 32), (1, 8192, 96), (8, 1024, 32), (8, 8192, 256), (32, 1024, 128), (32, 8192, 1024)]
    {
        let c = h200(rows, 8, ctx);
        assert_eq!(c, TF32_PICKED.config(ctx.div_ceil(chunk), chunk), "{rows} x {ctx}");
        assert_eq!(c.blocks(rows, 8), rows * c.splits);
    }
    // 16 heads (`--tp-size 4`) take two head groups a slice; 17 and more the BF16 tensor cores.
    let c = h200(8, 16, 8192);
    assert_eq!((c.lanes, c.blocks(8, 16)), (Lanes::Tf32 { positions: 16, stages: 2 }, 8 * 2 * c.splits));
    assert!(matches!(h200(8, 24, 8192).lanes, Lanes::Mma { .. }));
    // A latent it refuses (r not a multiple of 256) falls back to the CUDA-core kernels; SM120 (99 KB) takes it.
    assert!(!matches!(AttentionConfig::pick(8, 8, 8192, 128, 64, 132, 227 * 1024).unwrap().lanes, Lanes::Tf32 { .. }));
    assert!(matches!(
        AttentionConfig::pick(8, 8, 8192, 512, 64, 188, 99 * 1024).unwrap().lanes,
        Lanes::Tf32 { positions: 16, stages: 2 }
    ));
    assert_eq!(tf32_shared_bytes(512, 64, TF32_PICKED), 76_336);
    let ring3 = Tf32Shape { stages: 3, ..TF32_PICKED };
    assert_eq!(tf32_shared_bytes(512, 64, ring3), 113_456);
    assert!(tf32_refusal(512, 64, ring3, 99 * 1024).unwrap().contains("113456 bytes of shared memory"));
    assert!(tf32_refusal(512, 64, TF32_PICKED, 64 * 1024).unwrap().contains("76336 bytes of shared memory"));
    assert!(
        tf32_refusal(256, 64, Tf32Shape { warps: 8, pt: 16, stages: 2 }, 227 * 1024)
            .unwrap()
            .contains("multiple of 512")
    );
    assert!(tf32_refusal(512, 64, Tf32Shape { warps: 2, pt: 16, stages: 2 }, 227 * 1024).unwrap().contains("2 warps"));
    // Every pick covers its rows' positions, in at most 96 slices.
    for (rows, heads, ctx) in [(1, 8, 1000), (3, 16, 70_000), (8, 8, 8191), (128, 8, 8192), (1, 1, 65)] {
        let c = h200(rows, heads, ctx);
        assert!(c.splits * c.chunk >= ctx && (c.splits - 1) * c.chunk < ctx && c.splits <= 96, "{c:?}");
    }
}

#[test]
fn the_tensor_core_refusals_name_what_does_not_fit() {
    use crate::cuda::attention_mma::{MmaShape, mma_refusal};
    let ok = MmaShape { tiles: 1, wk: 4, pt: 16 };
    assert!(mma_refusal(512, 64, ok, 227 * 1024).is_none());
    assert!(mma_refusal(64, 8, ok, 227 * 1024).unwrap().contains("r a multiple of 128"));
    assert!(mma_refusal(512, 60, ok, 227 * 1024).unwrap().contains("r + rot of 16"));
    let bad = MmaShape { tiles: 1, wk: 16, pt: 16 };
    assert!(mma_refusal(512, 64, bad, 227 * 1024).unwrap().contains("1 head tiles x 16 warps"));
    assert!(mma_refusal(512, 64, ok, 64 * 1024).unwrap().contains("78880 bytes of shared memory"));
}
