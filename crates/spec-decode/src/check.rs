//! `eyrie spec check`: which aux-layer convention fits a drafter. Loads it under each [`AuxConvention`], decodes a
//! few prompts greedily with speculation, and compares acceptance; a drafter read under the wrong convention fuses
//! the wrong target layers and its acceptance collapses (the failure mode behind the ~15% acceptance seen on vLLM
//! with MLA targets).

use std::path::Path;

use burn::tensor::backend::Backend;
use eyrie_model::DeepseekV3;
use eyrie_model::kv_cache::PagedMlaCache;
use eyrie_model::sampling::SamplingParams;

use crate::config::AuxConvention;
use crate::decoder::SpecDecoder;
use crate::eagle3::Eagle3Drafter;
use crate::error::{Result, SpecError};
use crate::stats::AcceptanceStats;

/// The outcome for one convention.
#[derive(Debug, Clone)]
pub struct ConventionCheck {
    /// The convention tried.
    pub convention: AuxConvention,
    /// The target capture ids it gives, or why the drafter does not load under it.
    pub capture_ids: std::result::Result<Vec<usize>, String>,
    /// Acceptance over the prompts (None when it did not load).
    pub stats: Option<AcceptanceStats>,
}

/// Measures greedy acceptance of the drafter in `dir` under both conventions: each prompt decoded for
/// `new_tokens` tokens with `num_steps`-token chains. Errors other than the drafter failing to load under a
/// convention (a bad prompt, a full cache) are returned.
pub fn check_conventions<B: Backend>(
    dir: impl AsRef<Path>,
    target: &DeepseekV3<B>,
    prompts: &[Vec<u32>],
    num_steps: usize,
    new_tokens: usize,
    device: &B::Device,
) -> Result<Vec<ConventionCheck>> {
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(SpecError::input("spec check needs at least one non-empty prompt"));
    }
    let mut out = Vec::with_capacity(2);
    for convention in [AuxConvention::InputOfLayer, AuxConvention::OutputOfLayer] {
        let drafter = match Eagle3Drafter::load(dir.as_ref(), target, convention, device) {
            Ok(d) => d,
            Err(e @ SpecError::TargetMismatch { .. }) => {
                out.push(ConventionCheck { convention, capture_ids: Err(e.to_string()), stats: None });
                continue;
            }
            Err(e) => return Err(e),
        };
        let capture_ids = drafter.capture_ids.clone();
        let mut dec = SpecDecoder::new(drafter, num_steps);
        const BLOCK: usize = 16;
        let blocks = prompts.iter().map(|p| (p.len() + new_tokens + num_steps + 1).div_ceil(BLOCK)).sum::<usize>();
        let mut cache = PagedMlaCache::new(&target.config, blocks, BLOCK, device)?;
        for prompt in prompts {
            let mut seq = dec.new_sequence(prompt, SamplingParams::default())?;
            dec.prefill(target, &mut cache, &mut [&mut seq], device)?;
            while seq.generated().len() < new_tokens {
                dec.step(target, &mut cache, &mut [&mut seq], device)?;
            }
            dec.release(&mut cache, seq);
        }
        out.push(ConventionCheck { convention, capture_ids: Ok(capture_ids), stats: Some(dec.take_stats()) });
    }
    Ok(out)
}

/// The convention whose drafter accepted the most (None when neither loaded or both accept equally, e.g. when
/// the config names no aux ids and both conventions give the same layers).
pub fn best_convention(checks: &[ConventionCheck]) -> Option<AuxConvention> {
    let rated: Vec<(AuxConvention, f64)> =
        checks.iter().filter_map(|c| c.stats.as_ref().map(|s| (c.convention, s.acceptance_rate()))).collect();
    match rated.as_slice() {
        [(c, _)] => Some(*c),
        [(a, ra), (b, rb)] if ra != rb => Some(if ra > rb { *a } else { *b }),
        _ => None,
    }
}
