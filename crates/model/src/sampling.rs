//! Host-side token sampling over one logits row: greedy (argmax), temperature scaling, top-p (nucleus) filtering
//! (Holtzman et al., arXiv:1904.09751), drawn from a seeded xoshiro256** generator so that a run is reproducible.
//!
//! Greedy when the temperature is absent or 0 (ties go to the lowest token id, as [`crate::DeepseekV3`]'s
//! `generate_greedy`). Otherwise `p = softmax(logits / T)` in f64; with `top_p < 1` only the smallest set of
//! most-probable tokens whose mass reaches `top_p` is kept (ties in probability broken by the lower id) and the draw
//! is renormalized over it.

use crate::error::{ModelError, Result};

/// How to pick the next token.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SamplingParams {
    /// Softmax temperature; `None` or `0` means greedy.
    pub temperature: Option<f32>,
    /// Nucleus mass in `(0, 1]`; `None` keeps every token.
    pub top_p: Option<f32>,
    /// Seed of the random generator (ignored when greedy).
    pub seed: u64,
}

impl SamplingParams {
    /// Whether these parameters pick the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_none_or(|t| t == 0.0)
    }

    /// Checks the ranges: temperature finite and `>= 0`, top-p in `(0, 1]`.
    pub fn validate(&self) -> Result<()> {
        if let Some(t) = self.temperature
            && !(t.is_finite() && t >= 0.0)
        {
            return Err(ModelError::Input { message: format!("temperature {t} must be a finite number >= 0") });
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(ModelError::Input { message: format!("top-p {p} must be in (0, 1]") });
        }
        Ok(())
    }
}

/// A sampler: the parameters plus the generator state.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: Xoshiro256,
}

impl Sampler {
    /// A sampler for validated `params`.
    pub fn new(params: SamplingParams) -> Result<Self> {
        params.validate()?;
        Ok(Self { params, rng: Xoshiro256::seed_from_u64(params.seed) })
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks a token id from one logits row `[vocab]` (non-empty). NaN logits are never picked unless all are NaN.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let temperature = match self.params.temperature {
            Some(t) if t > 0.0 => t,
            _ => return argmax(logits),
        };
        let probs = softmax(logits, temperature);
        let keep = nucleus(&probs, self.params.top_p.unwrap_or(1.0));
        let total: f64 = keep.iter().map(|&i| probs[i]).sum();
        let mut u = self.rng.next_f64() * total;
        for &i in &keep {
            u -= probs[i];
            if u < 0.0 {
                return i as u32;
            }
        }
        // Rounding left a sliver of mass: the last kept token takes it.
        keep.last().map_or_else(|| argmax(logits), |&i| i as u32)
    }
}

/// The index of the largest logit; ties go to the lowest index, NaN is skipped.
pub fn argmax(logits: &[f32]) -> u32 {
    logits
        .iter()
        .enumerate()
        .fold((0usize, f32::NEG_INFINITY), |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) })
        .0 as u32
}

/// `softmax(logits / temperature)` in f64 (NaN logits get probability 0).
pub fn softmax(logits: &[f32], temperature: f32) -> Vec<f64> {
    let t = f64::from(temperature);
    let max = logits.iter().filter(|v| !v.is_nan()).fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
    let mut probs: Vec<f64> = logits
        .iter()
        .map(|&v| if v.is_nan() || max == f64::NEG_INFINITY { 0.0 } else { ((f64::from(v) - max) / t).exp() })
        .collect();
    let sum: f64 = probs.iter().sum();
    if sum > 0.0 {
        probs.iter_mut().for_each(|p| *p /= sum);
    }
    probs
}

/// Indices of the smallest set of most-probable tokens whose total mass is `>= top_p`, most probable first (ties by
/// the lower index); always at least one. `top_p >= 1` keeps every token with non-zero probability.
pub fn nucleus(probs: &[f64], top_p: f32) -> Vec<usize> {
    let mut order: Vec<usize> = (0..probs.len()).filter(|&i| probs[i] > 0.0).collect();
    order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
    if top_p >= 1.0 {
        return order;
    }
    let target = f64::from(top_p);
    let mut mass = 0.0;
    let mut n = 0;
    for &i in &order {
        mass += probs[i];
        n += 1;
        if mass >= target {
            break;
        }
    }
    order.truncate(n.max(1));
    order
}

/// xoshiro256** (Blackman and Vigna), seeded through splitmix64: small, fast, and the same on every platform.
#[derive(Debug, Clone)]
struct Xoshiro256 {
    s: [u64; 4],
}

impl Xoshiro256 {
    fn seed_from_u64(seed: u64) -> Self {
        let mut x = seed;
        let mut splitmix = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Self { s: [splitmix(), splitmix(), splitmix(), splitmix()] }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(temperature: Option<f32>, top_p: Option<f32>, seed: u64) -> Sampler {
        Sampler::new(SamplingParams { temperature, top_p, seed }).unwrap()
    }

    #[test]
    fn temperature_zero_or_absent_is_argmax() {
        let logits = [0.5, 3.0, -1.0, 3.0, 2.9];
        for t in [None, Some(0.0)] {
            let mut s = sampler(t, Some(0.1), 7);
            assert!(s.params().is_greedy());
            for _ in 0..10 {
                assert_eq!(s.sample(&logits), 1, "ties go to the lowest id");
            }
        }
        assert_eq!(argmax(&[f32::NAN, -2.0, -1.0]), 2);
    }

    #[test]
    fn top_p_keeps_the_smallest_set_reaching_the_mass() {
        let probs = [0.1, 0.4, 0.2, 0.3];
        assert_eq!(nucleus(&probs, 0.39), vec![1]);
        assert_eq!(nucleus(&probs, 0.41), vec![1, 3]);
        assert_eq!(nucleus(&probs, 0.7), vec![1, 3]);
        assert_eq!(nucleus(&probs, 0.71), vec![1, 3, 2]);
        assert_eq!(nucleus(&probs, 1.0), vec![1, 3, 2, 0]);
        assert_eq!(nucleus(&probs, 1e-6), vec![1]);
        // Ties in probability: the lower id first.
        assert_eq!(nucleus(&[0.25, 0.25, 0.5], 0.6), vec![2, 0]);
        // Sampling never leaves the nucleus.
        let logits: Vec<f32> = probs.iter().map(|p: &f64| p.ln() as f32).collect();
        let mut s = sampler(Some(1.0), Some(0.7), 3);
        for _ in 0..2000 {
            let t = s.sample(&logits);
            assert!(t == 1 || t == 3, "{t} is outside the top-0.7 nucleus");
        }
    }

    #[test]
    fn same_seed_gives_same_samples() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let draw = |seed| {
            let mut s = sampler(Some(0.8), Some(0.95), seed);
            (0..200).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
    }

    #[test]
    fn temperature_one_matches_softmax_chi_square() {
        let logits = [0.0f32, 1.0, -0.5, 2.0];
        let probs = softmax(&logits, 1.0);
        let n = 40_000;
        let mut counts = [0usize; 4];
        let mut s = sampler(Some(1.0), None, 2024);
        for _ in 0..n {
            counts[s.sample(&logits) as usize] += 1;
        }
        let chi2: f64 = counts
            .iter()
            .zip(&probs)
            .map(|(&c, &p)| {
                let expected = p * n as f64;
                (c as f64 - expected).powi(2) / expected
            })
            .sum();
        // 3 degrees of freedom: P(chi2 > 16.27) = 0.001.
        assert!(chi2 < 16.27, "chi-square {chi2:.2}, counts {counts:?}, probs {probs:?}");
        // Temperature sharpens: at T = 0.25 the top token dominates far more than at T = 1.
        let sharp = softmax(&logits, 0.25);
        assert!(sharp[3] > 0.95 && probs[3] < 0.65, "{sharp:?} {probs:?}");
    }

    #[test]
    fn bad_parameters_are_errors() {
        for (t, p) in [(Some(-1.0), None), (Some(f32::NAN), None), (None, Some(0.0)), (None, Some(1.5))] {
            assert!(Sampler::new(SamplingParams { temperature: t, top_p: p, seed: 0 }).is_err(), "{t:?} {p:?}");
        }
    }
}
