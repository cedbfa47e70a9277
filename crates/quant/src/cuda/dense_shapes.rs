//! Launch shapes of the CUDA-core GEMV kernels of [`dense`](super::dense) (each shape is a kernel specialisation): the
//! rules [`GemvConfig::for_shape`] / [`GemvConfig::for_swiglu`] apply to any matrix, and [`GemvConfig::tuned`] holds the
//! shapes a GPU sweep measured best for Kimi-K2's decode GEMVs (`examples/gpu_gemv.rs --sweep`, bench/REPORT.md
//! session 20). Pure host code: built and tested without the `cuda` feature too.

/// Launch shape of [`gemv_bf16`](super::dense::gemv_bf16) (kernel specialisations).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GemvConfig {
    /// Warps per block.
    pub warps: usize,
    /// Rows each warp computes together (loads in flight per lane).
    pub rows_at_once: usize,
    /// Tokens per pass (1, 2, 4 or 8); more tokens take several passes over the weights.
    pub tb: usize,
    /// Warps of a block that share each group of rows, each taking every `ksplit`-th 512-byte stretch of the
    /// row (`warps` a multiple of it); their sums meet in shared memory.
    pub ksplit: usize,
    /// Stretches a warp loads together before using them (`rows_at_once * unroll` 16-byte loads in flight
    /// per lane).
    pub unroll: usize,
}

impl GemvConfig {
    /// The launch shape for `n` tokens.
    pub fn for_tokens(n: usize) -> Self {
        let tb = match n {
            0 | 1 => 1,
            2 => 2,
            3 | 4 => 4,
            _ => 8,
        };
        Self { warps: 8, rows_at_once: if tb >= 8 { 2 } else { 4 }, tb, ksplit: 1, unroll: 1 }
    }

    /// [`Self::for_tokens`] reshaped for short matrices at up to 4 tokens, so that at least `blocks` blocks of
    /// 8 warps run (twice the SMs: 264 on an H200) with about 8 loads in flight a lane: first fewer rows a warp,
    /// then the warps of a block split each row's `k` (`ksplit`, up to 8, while every warp keeps 2 or more
    /// stretches of 512 bytes), each loading up to 8 / `rows_at_once` stretches before using them. A 576-row
    /// matrix of `k` 7168 (`kv_a_proj`) had 288 blocks of 2 warps, one row and one load in flight each
    /// (latency-bound: 17 us for 8 MB under Nsight Compute); it gets 288 blocks of 8 warps, 4 to a row, 7
    /// loads in flight. Matrices that fill the device at 4 rows a warp (`o_proj`, `lm_head`: 90-110% of
    /// the copy bandwidth already) and 8-16 tokens keep [`Self::for_tokens`].
    pub fn for_shape(n: usize, rows: usize, k: usize, blocks: usize) -> Self {
        if let Some(c) = Self::tuned(n, rows, k, false) {
            return c;
        }
        let mut c = Self::for_tokens(n);
        if n > 4 {
            return c;
        }
        let count = |c: &Self| rows.div_ceil((c.warps / c.ksplit) * c.rows_at_once);
        let stretches = (k / 8).div_ceil(32);
        if count(&c) >= blocks {
            return c;
        }
        while c.rows_at_once > 1 && count(&c) < blocks {
            c.rows_at_once /= 2;
        }
        while c.ksplit < c.warps && count(&c) < blocks && stretches >= 4 * c.ksplit {
            c.ksplit *= 2;
        }
        // Several stretches in flight only at one row a warp: with 2 rows (the 7168-row matrices) 4 stretches
        // made `o_proj` 36 -> 41 us at one token and 53 -> 78 us at four (bench/REPORT.md).
        if c.rows_at_once == 1 {
            c.unroll = 8.min(stretches.div_ceil(c.ksplit));
        }
        c
    }

    /// The shapes measured best on the H200 for Kimi-K2's decode GEMVs (`gpu_gemv --sweep`, every shape of 8
    /// warps timed on the GPU behind a copy, bench/REPORT.md session 20; within a pair the pair's best):
    /// `(rows, k, SwiGLU)` -> (rows a warp, k-split, stretches in flight), at one token and at 5-8 tokens (one
    /// pass of 8; only the pairs' matrices: wider single GEMVs take the tensor-core GEMV). Other shapes (a
    /// tensor-parallel rank's rows, other models, other widths) take the rules of [`Self::for_shape`].
    pub fn tuned(n: usize, rows: usize, k: usize, swiglu: bool) -> Option<Self> {
        type Entry = ((usize, usize, bool), (usize, usize, usize));
        const ONE_TOKEN: [Entry; 7] = [
            // `q_a_proj` and `kv_a_proj_with_mqa` (their pair: 19.6 -> 13.8 us).
            ((1536, 7168, false), (1, 4, 1)),
            ((576, 7168, false), (1, 8, 2)),
            // `q_b_proj` (normed: 16.8 -> 14.8 us).
            ((12288, 1536, false), (2, 1, 1)),
            // `o_proj` (36.3 -> 32.4 us).
            ((7168, 8192, false), (2, 8, 1)),
            // The shared expert's gate/up and the router (their pair: 23.0 -> 22.1 us), its down (13.1 -> 12.3).
            ((2048, 7168, true), (1, 2, 1)),
            ((384, 7168, false), (2, 8, 4)),
            ((7168, 2048, false), (2, 1, 2)),
        ];
        const EIGHT_TOKENS: [Entry; 4] = [
            // The pairs at 8 tokens: 71.6 -> 31.7 us and 71.4 -> 53.6 us against the rules' shapes.
            ((1536, 7168, false), (2, 4, 1)),
            ((576, 7168, false), (4, 8, 2)),
            ((2048, 7168, true), (2, 1, 1)),
            ((384, 7168, false), (4, 8, 4)),
        ];
        let (table, tb): (&[Entry], usize) = match n {
            1 => (&ONE_TOKEN, 1),
            5..=8 => (&EIGHT_TOKENS, 8),
            _ => return None,
        };
        if !tuned_shapes() {
            return None;
        }
        let &(_, (rows_at_once, ksplit, unroll)) = table.iter().find(|(key, _)| *key == (rows, k, swiglu))?;
        Some(Self { warps: 8, rows_at_once, tb, ksplit, unroll })
    }

    /// [`Self::for_shape`] for [`gemv_swiglu`](super::dense::gemv_swiglu), which loads two matrices' rows: half the stretches at once.
    pub fn for_swiglu(n: usize, rows: usize, k: usize, blocks: usize) -> Self {
        if let Some(c) = Self::tuned(n, rows, k, true) {
            return c;
        }
        let mut c = Self::for_shape(n, rows, k, blocks);
        c.unroll = c.unroll.div_ceil(2);
        c
    }
}

/// Whether [`GemvConfig::tuned`] gives its measured shapes: on unless `EYRIE_GEMV_TUNED=0` (read once), for
/// same-binary comparisons with the rules of [`GemvConfig::for_shape`] alone.
pub fn tuned_shapes() -> bool {
    use std::sync::atomic::Ordering;
    match TUNED.load(Ordering::Relaxed) {
        0 => false,
        1 => true,
        _ => {
            let on = std::env::var("EYRIE_GEMV_TUNED").map_or(true, |v| v != "0");
            TUNED.store(u8::from(on), Ordering::Relaxed);
            on
        }
    }
}

/// [`tuned_shapes`]: 0 off, 1 on, 2 not read from the environment yet.
static TUNED: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(2);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_matrices_get_smaller_blocks_only_at_few_tokens() {
        // The rules (two tokens: one token of Kimi's shapes takes the measured table, below).
        for (rows, k) in [(1536, 7168), (576, 7168), (384, 7168), (2048, 7168), (7168, 2048)] {
            let c = GemvConfig::for_shape(2, rows, k, 264);
            let blocks = rows.div_ceil(c.warps / c.ksplit * c.rows_at_once);
            assert!(blocks >= 264 || c.ksplit == 8, "{rows}x{k}: {c:?}");
            assert!(c.warps.is_multiple_of(c.ksplit), "{c:?}");
            // Every warp keeps at least 2 stretches of 512 bytes; at one row a warp several are in flight.
            assert!((k / 8).div_ceil(32) >= 2 * c.ksplit, "{rows}x{k}: {c:?}");
            assert!(c.rows_at_once * c.unroll >= 4 || c.unroll == 1, "{rows}x{k}: {c:?}");
            assert!(c.rows_at_once == 1 || c.unroll == 1, "{rows}x{k}: {c:?}");
            let sw = GemvConfig::for_swiglu(2, rows, k, 264);
            assert_eq!(sw, GemvConfig { unroll: c.unroll.div_ceil(2), ..c });
        }
        let kv_a = GemvConfig::for_shape(2, 576, 7168, 264);
        assert_eq!((kv_a.rows_at_once, kv_a.ksplit, kv_a.unroll), (1, 4, 7), "{kv_a:?}");
        assert_eq!(GemvConfig::for_shape(8, 1536, 7168 + 8, 264), GemvConfig::for_tokens(8));
        assert_eq!(GemvConfig::for_shape(1, 163_840, 7168, 264), GemvConfig::for_tokens(1));
        // o_proj: 224 blocks of 4 rows a warp -> 2 rows, one stretch at a time (as before the k-split).
        let o = GemvConfig::for_shape(4, 7168, 8192, 264);
        assert_eq!(o, GemvConfig { rows_at_once: 2, ..GemvConfig::for_tokens(4) });
    }

    #[test]
    fn one_token_takes_the_measured_shapes_of_kimis_gemvs() {
        let shape = |c: GemvConfig| (c.warps, c.rows_at_once, c.tb, c.ksplit, c.unroll);
        assert_eq!(shape(GemvConfig::for_shape(1, 576, 7168, 264)), (8, 1, 1, 8, 2));
        assert_eq!(shape(GemvConfig::for_shape(1, 7168, 8192, 264)), (8, 2, 1, 8, 1));
        // SwiGLU's entry is its own; the plain GEMV of the same matrix keeps the rules.
        assert_eq!(shape(GemvConfig::for_swiglu(1, 2048, 7168, 264)), (8, 1, 1, 2, 1));
        assert_eq!(GemvConfig::tuned(1, 2048, 7168, false), None);
        // Eight tokens: the pairs' matrices only.
        assert_eq!(shape(GemvConfig::for_shape(8, 576, 7168, 264)), (8, 4, 8, 8, 2));
        assert_eq!(GemvConfig::tuned(6, 12288, 1536, false), None);
        // Other widths and a tensor-parallel rank's rows take the rules.
        assert_eq!(GemvConfig::tuned(2, 576, 7168, false), None);
        assert_eq!(GemvConfig::tuned(1, 768, 7168, false), None);
        for (rows, k, swiglu) in [(1536, 7168, false), (12288, 1536, false), (384, 7168, false), (7168, 2048, false)] {
            let c = GemvConfig::tuned(1, rows, k, swiglu).expect("a tuned shape");
            assert!(c.warps.is_multiple_of(c.ksplit) && c.ksplit <= (k / 8).div_ceil(32), "{c:?}");
        }
    }
}
