//! Host-side token sampling over one logits row: greedy (argmax), OpenAI presence/frequency penalties, temperature,
//! top-k, top-p (nucleus; Holtzman et al., arXiv:1904.09751) and min-p filtering, drawn from a seeded xoshiro256**
//! generator so that a run is reproducible.
//!
//! One processing pipeline, [`SamplingParams::probabilities`], defines the distribution a token is drawn from; the
//! sampler draws from exactly that vector, and speculative verification (eyrie-spec-decode) computes its target and
//! draft distributions through the same function, so that rejection sampling preserves it. Steps, in order:
//! 1. penalties on the logits of tokens already generated (`history`): `l -= count * frequency + presence` (as
//!    OpenAI and vLLM, over the output tokens only);
//! 2. greedy when the temperature is absent or 0: a one-hot at the argmax (ties go to the lowest id, as
//!    [`crate::DeepseekV3`]'s `generate_greedy`);
//! 3. `p = softmax(l / T)` in f64;
//! 4. top-k: keep the `k` most probable (ties in probability broken by the lower id);
//! 5. top-p: of those, the smallest most-probable prefix whose mass (renormalized over the kept set) reaches `top_p`;
//! 6. min-p: of those, the tokens with `p >= min_p * max p`;
//! 7. renormalize over the kept set.

use crate::error::{ModelError, Result};

/// How to pick the next token.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SamplingParams {
    /// Softmax temperature; `None` or `0` means greedy.
    pub temperature: Option<f32>,
    /// Nucleus mass in `(0, 1]`; `None` keeps every token.
    pub top_p: Option<f32>,
    /// Keep only the `k` most probable tokens; `None` or `0` keeps every token.
    pub top_k: Option<usize>,
    /// Keep only tokens with `p >= min_p * max p`, in `[0, 1]`; `None` or `0` keeps every token.
    pub min_p: Option<f32>,
    /// Subtracted once from the logit of every token already generated, in `[-2, 2]` (OpenAI's range).
    pub presence_penalty: f32,
    /// Subtracted per occurrence from the logit of every token already generated, in `[-2, 2]`.
    pub frequency_penalty: f32,
    /// Seed of the random generator (ignored when greedy).
    pub seed: u64,
}

impl SamplingParams {
    /// Whether these parameters pick the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_none_or(|t| t == 0.0)
    }

    /// Whether the history of generated tokens changes the distribution.
    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Checks the ranges: temperature finite and `>= 0`, top-p in `(0, 1]`, min-p in `[0, 1]`, penalties in
    /// `[-2, 2]`. The error names the parameter.
    pub fn validate(&self) -> Result<()> {
        if let Some(t) = self.temperature
            && !(t.is_finite() && t >= 0.0)
        {
            return Err(ModelError::Input { message: format!("temperature {t} must be a finite number >= 0") });
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(ModelError::Input { message: format!("top_p {p} must be in (0, 1]") });
        }
        if let Some(p) = self.min_p
            && !(0.0..=1.0).contains(&p)
        {
            return Err(ModelError::Input { message: format!("min_p {p} must be in [0, 1]") });
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(ModelError::Input { message: format!("{name} {v} must be in [-2, 2]") });
            }
        }
        Ok(())
    }

    /// Applies the presence and frequency penalties for the tokens in `history` to `logits` in place (ids outside
    /// the row are ignored).
    pub fn apply_penalties(&self, logits: &mut [f32], history: &[u32]) {
        if !self.has_penalties() || history.is_empty() {
            return;
        }
        let mut counts = std::collections::HashMap::<u32, u32>::new();
        for &t in history {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= c as f32 * self.frequency_penalty + self.presence_penalty;
            }
        }
    }

    /// The distribution the next token is drawn from, over the whole row (zeros outside the kept set; sums to 1),
    /// after every step of the module's pipeline; `history` is the tokens generated so far (for the penalties).
    /// Greedy parameters give a one-hot vector at the (penalized) argmax.
    pub fn probabilities(&self, logits: &[f32], history: &[u32]) -> Vec<f64> {
        let penalized;
        let logits = if self.has_penalties() && !history.is_empty() {
            let mut l = logits.to_vec();
            self.apply_penalties(&mut l, history);
            penalized = l;
            &penalized[..]
        } else {
            logits
        };
        let mut out = vec![0.0; logits.len()];
        let temperature = match self.temperature {
            Some(t) if t > 0.0 => t,
            _ => {
                if let Some(p) = out.get_mut(argmax(logits) as usize) {
                    *p = 1.0;
                }
                return out;
            }
        };
        let probs = softmax(logits, temperature);
        let filtered = self.top_k.is_some_and(|k| k > 0)
            || self.top_p.is_some_and(|p| p < 1.0)
            || self.min_p.is_some_and(|p| p > 0.0);
        if !filtered {
            // Every token with p > 0 is kept: renormalize in index order (the zeros add nothing), no index list.
            let total: f64 = probs.iter().sum();
            if total > 0.0 {
                for (o, &p) in out.iter_mut().zip(&probs) {
                    if p > 0.0 {
                        *o = p / total;
                    }
                }
            } else if let Some(p) = out.get_mut(argmax(logits) as usize) {
                *p = 1.0;
            }
            return out;
        }
        let keep = self.kept(&probs);
        let total: f64 = keep.iter().map(|&i| probs[i]).sum();
        if total > 0.0 {
            for &i in &keep {
                out[i] = probs[i] / total;
            }
        } else if let Some(p) = out.get_mut(argmax(logits) as usize) {
            *p = 1.0;
        }
        out
    }

    /// Indices kept by top-k, top-p and min-p (as a set: the order is unspecified); at least one when any
    /// probability is > 0. Never sorts the whole vocabulary (a sort of Kimi's 163840 probabilities took ~10 ms on
    /// the host, every sampled token of every sequence): top-k selects in linear time, top-p sorts one band of
    /// probabilities ([`keep_top_mass`]), min-p compares with the largest kept probability.
    fn kept(&self, probs: &[f64]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..probs.len()).filter(|&i| probs[i] > 0.0).collect();
        if let Some(k) = self.top_k.filter(|&k| k > 0 && k < order.len()) {
            order.select_nth_unstable_by(k - 1, |a, b| by_prob(probs, a, b));
            order.truncate(k);
        }
        if let Some(top_p) = self.top_p.filter(|&p| p < 1.0) {
            let total: f64 = order.iter().map(|&i| probs[i]).sum();
            keep_top_mass(&mut order, probs, f64::from(top_p) * total);
        }
        if let Some(min_p) = self.min_p.filter(|&p| p > 0.0) {
            let top = order.iter().map(|&i| probs[i]).fold(0.0, f64::max);
            let floor = f64::from(min_p) * top;
            order.retain(|&i| probs[i] >= floor);
        }
        order
    }
}

/// The sampling order of indices: higher probability first, ties by the lower index.
fn by_prob(probs: &[f64], a: &usize, b: &usize) -> std::cmp::Ordering {
    probs[*b].total_cmp(&probs[*a]).then(a.cmp(b))
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

    /// Picks a token id from one logits row `[vocab]` (non-empty) with no generation history. NaN logits are never
    /// picked unless all are NaN.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        self.sample_after(logits, &[])
    }

    /// Picks a token id from one logits row, the penalties counting the generated tokens `history`.
    pub fn sample_after(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        if self.params.is_greedy() && !self.params.has_penalties() {
            return argmax(logits);
        }
        let probs = self.params.probabilities(logits, history);
        self.draw(&probs)
    }

    /// Draws an index from `probs` (non-negative, summing to about 1) with one uniform number; greedy (one-hot)
    /// vectors cost no randomness. Rounding slivers go to the last index with non-zero probability.
    pub fn draw(&mut self, probs: &[f64]) -> u32 {
        let mut last = 0;
        let nonzero = probs.iter().filter(|&&p| p > 0.0).count();
        if nonzero == 1 {
            return probs.iter().position(|&p| p > 0.0).unwrap_or(0) as u32;
        }
        let mut u = self.rng.next_f64();
        for (i, &p) in probs.iter().enumerate() {
            if p > 0.0 {
                last = i;
                u -= p;
                if u < 0.0 {
                    return i as u32;
                }
            }
        }
        last as u32
    }

    /// One uniform number in `[0, 1)` from the sampler's generator (the acceptance test of speculative sampling).
    pub fn uniform(&mut self) -> f64 {
        self.rng.next_f64()
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

/// Set by [`enable_device_argmax`]: greedy steps pick on the device.
static DEVICE_ARGMAX: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Lets greedy steps pick on the device ([`device_argmax`]) unless `EYRIE_DEVICE_ARGMAX` decides; the server calls
/// it after [`check_device_argmax`] passed on its device.
pub fn enable_device_argmax() {
    DEVICE_ARGMAX.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a greedy step may pick on the device: `EYRIE_DEVICE_ARGMAX` when set (read once; `1` on, anything else
/// off), else what [`enable_device_argmax`] set (off until then).
pub fn device_argmax_enabled() -> bool {
    static ENV: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    ENV.get_or_init(|| std::env::var("EYRIE_DEVICE_ARGMAX").ok().map(|v| v == "1"))
        .unwrap_or_else(|| DEVICE_ARGMAX.load(std::sync::atomic::Ordering::Relaxed))
}

/// Whether `EYRIE_DEVICE_ARGMAX` is set (then the server's self-check does not switch the device picks).
pub fn device_argmax_env_set() -> bool {
    std::env::var_os("EYRIE_DEVICE_ARGMAX").is_some()
}

/// A device self-check of [`device_argmax`] at a vocabulary of `vocab` (the server's warm-up runs it before turning
/// the device picks on): 6 rows of random logits with the maximum tied far apart, NaN, `+inf`, all `-inf`; the ids
/// must equal [`argmax`]'s on the host.
///
/// # Errors
/// The backend has no device path (not CUDA, or `vocab` not a multiple of 4), the device's error, or an id that
/// differs (named by row).
pub fn check_device_argmax<B: burn::tensor::backend::Backend>(
    device: &B::Device,
    vocab: usize,
) -> std::result::Result<(), String> {
    let rows = 6usize;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut v: Vec<f32> = (0..rows * vocab)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 * 20.0 - 10.0
        })
        .collect();
    for (r, row) in v.chunks_mut(vocab).enumerate() {
        match r {
            1 => {
                for i in [vocab - 1, vocab / 3, 5.min(vocab - 1)] {
                    row[i] = 11.0;
                }
            }
            2 => {
                row.iter_mut().step_by(3).for_each(|x| *x = f32::NAN);
                row[vocab / 2] = f32::INFINITY;
            }
            3 => row.iter_mut().for_each(|x| *x = f32::NEG_INFINITY),
            _ => {}
        }
    }
    let want: Vec<u32> = v.chunks(vocab).map(argmax).collect();
    let t = burn::tensor::Tensor::<B, 2>::from_data(burn::tensor::TensorData::new(v, [rows, vocab]), device);
    let got = device_argmax(&t).ok_or_else(|| format!("no device path for a vocabulary of {vocab}"))??;
    if let Some(r) = (0..rows).find(|&r| got.get(r) != want.get(r)) {
        return Err(format!("row {r}: the device picked {:?}, the host {}", got.get(r), want[r]));
    }
    Ok(())
}

/// The greedy pick ([`argmax`]) of every row of `logits` `[rows, vocab]` computed where the logits are, when the
/// backend has a kernel for it (CUDA: `cuda_ops::argmax_rows`, one launch, `rows` ids read back instead of the whole
/// rows); `None` elsewhere (the caller copies the rows and picks on the host).
///
/// # Errors
/// The device's message when the launch or the readback fails.
pub fn device_argmax<B: burn::tensor::backend::Backend>(
    logits: &burn::tensor::Tensor<B, 2>,
) -> Option<std::result::Result<Vec<u32>, String>> {
    #[cfg(feature = "cuda")]
    {
        crate::cuda_ops::argmax_rows(logits)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = logits;
        None
    }
}

/// The greedy picks of a step, launched and queued for the host but not yet waited for ([`pending_argmax`]): the
/// next step can embed [`Self::ids`] on the device (`forward_batch_fed`) before the host reads them, so the host
/// queues step `t + 1` while the device still runs step `t` (an overlapped greedy chain).
pub struct PendingPicks<B: burn::tensor::backend::Backend> {
    /// The picks on the device, `[rows]` int, [`argmax`]'s rule.
    pub ids: burn::tensor::Tensor<B, 1, burn::tensor::Int>,
    #[cfg(feature = "cuda")]
    device: Option<crate::cuda_ops::PendingIds<B>>,
}

impl<B: burn::tensor::backend::Backend> std::fmt::Debug for PendingPicks<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingPicks").field("rows", &self.ids.dims()[0]).finish_non_exhaustive()
    }
}

impl<B: burn::tensor::backend::Backend> PendingPicks<B> {
    /// Waits for the picks and returns them, one id a row.
    ///
    /// # Errors
    /// The device's message when the step or the readback failed.
    pub fn wait(self) -> std::result::Result<Vec<u32>, String> {
        #[cfg(feature = "cuda")]
        if let Some(d) = self.device {
            return d.wait();
        }
        let data = self.ids.into_data();
        let ids = data.convert::<i64>().to_vec::<i64>().map_err(|e| format!("greedy picks: {e:?}"))?;
        Ok(ids.into_iter().map(|i| i as u32).collect())
    }
}

/// [`argmax`] of every row of `logits` `[rows, vocab]`, left on the device with its readback queued
/// ([`PendingPicks`]): on CUDA the device kernel ([`device_argmax`]'s, its ids copied to the host behind it on the
/// stream); elsewhere burn's `argmax` over the logits with NaN as `-inf` (ties to the lowest index, as [`argmax`]),
/// read when waited for.
///
/// # Errors
/// The launcher's message.
pub fn pending_argmax<B: burn::tensor::backend::Backend>(
    logits: &burn::tensor::Tensor<B, 2>,
) -> std::result::Result<PendingPicks<B>, String> {
    #[cfg(feature = "cuda")]
    if let Some(p) = crate::cuda_ops::argmax_rows_pending(logits) {
        let p = p?;
        return Ok(PendingPicks { ids: p.ids.clone(), device: Some(p) });
    }
    let [rows, _] = logits.dims();
    let clean = logits.clone().mask_fill(logits.clone().is_nan(), f32::NEG_INFINITY);
    Ok(PendingPicks {
        ids: clean.argmax(1).reshape([rows]),
        #[cfg(feature = "cuda")]
        device: None,
    })
}

/// [`pending_argmax`]'s ids alone, nothing queued for the host: the picks a tensor-parallel worker keeps on its
/// device for its next step of an overlapped greedy chain (its logits, hence its picks, are rank 0's).
///
/// # Errors
/// The launcher's message.
pub fn argmax_ids<B: burn::tensor::backend::Backend>(
    logits: &burn::tensor::Tensor<B, 2>,
) -> std::result::Result<burn::tensor::Tensor<B, 1, burn::tensor::Int>, String> {
    #[cfg(feature = "cuda")]
    if let Some(ids) = crate::cuda_ops::argmax_rows_ids(logits) {
        return ids;
    }
    let [rows, _] = logits.dims();
    let clean = logits.clone().mask_fill(logits.clone().is_nan(), f32::NEG_INFINITY);
    Ok(clean.argmax(1).reshape([rows]))
}

/// `log_softmax(logits)` in f64 precision, returned as f32 (NaN logits get `-inf`): the log-probabilities the
/// OpenAI API reports (of the model's raw distribution, before penalties and filtering, as vLLM's default).
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().filter(|v| !v.is_nan()).fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
    let sum: f64 = logits.iter().filter(|v| !v.is_nan()).map(|&v| (f64::from(v) - max).exp()).sum();
    let lse = max + sum.ln();
    logits.iter().map(|&v| if v.is_nan() { f32::NEG_INFINITY } else { (f64::from(v) - lse) as f32 }).collect()
}

/// The `n` largest entries of `values` as `(index, value)`, largest first (ties by the lower index).
pub fn top_n(values: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut order: Vec<usize> = (0..values.len()).filter(|&i| !values[i].is_nan()).collect();
    let cmp = |a: &usize, b: &usize| values[*b].total_cmp(&values[*a]).then(a.cmp(b));
    if n > 0 && n < order.len() {
        order.select_nth_unstable_by(n - 1, cmp);
        order.truncate(n);
    }
    order.sort_by(cmp);
    order.truncate(n);
    order.into_iter().map(|i| (i as u32, values[i])).collect()
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
    if top_p >= 1.0 {
        order.sort_by(|a, b| by_prob(probs, a, b));
        return order;
    }
    keep_top_mass(&mut order, probs, f64::from(top_p));
    order.sort_by(|a, b| by_prob(probs, a, b));
    order
}

/// Leaves in `order` the shortest most-probable prefix (in the order [`by_prob`]) whose mass reaches `target`, as a
/// set (the order is unspecified); at least one index, all of them when the target is never reached. The same set
/// as sorting everything and cutting, without the sort of the whole vocabulary: one pass files every probability
/// in a bucket of its size (eighth-octave buckets below the largest, so a bucket holds a narrow band), the
/// buckets' masses locate the bucket where the prefix ends, everything in larger buckets is kept as it is, and only
/// that one bucket is sorted and cut. (A flat distribution's nucleus can hold most of the vocabulary; sorting it
/// whole took ~10 ms for Kimi's 163840 tokens.) Masses are summed in another order than a full sort's, so a cut
/// that lands within rounding of `target` may differ by that one token.
fn keep_top_mass(order: &mut Vec<usize>, probs: &[f64], target: f64) {
    const SMALL: usize = 256;
    const BUCKETS: usize = 512;
    if order.len() <= SMALL {
        order.sort_by(|a, b| by_prob(probs, a, b));
        cut_at_mass(order, probs, 0, 0.0, target);
        return;
    }
    // Exponent and the top 3 mantissa bits: monotone in a positive f64, 8 buckets an octave.
    let key = |i: usize| (probs[i].to_bits() >> 49) as usize;
    let top = order.iter().map(|&i| key(i)).max().unwrap_or(0);
    let bucket = |i: usize| (top - key(i)).min(BUCKETS - 1);
    let mut mass = [0.0f64; BUCKETS];
    for &i in order.iter() {
        mass[bucket(i)] += probs[i];
    }
    let mut cum = 0.0;
    let mut edge = BUCKETS;
    for (b, m) in mass.iter().enumerate() {
        if cum + m >= target {
            edge = b;
            break;
        }
        cum += m;
    }
    if edge == BUCKETS {
        return;
    }
    // Larger buckets first (kept whole), then the edge bucket and everything below it, sorted: the cut lands in the
    // edge bucket unless rounding carries it further.
    let mut kept: Vec<usize> = order.iter().copied().filter(|&i| bucket(i) < edge).collect();
    let above = kept.len();
    let mass_above: f64 = kept.iter().map(|&i| probs[i]).sum();
    let mut rest: Vec<usize> = order.iter().copied().filter(|&i| bucket(i) == edge).collect();
    rest.sort_by(|a, b| by_prob(probs, a, b));
    kept.extend(rest);
    if !cut_at_mass(&mut kept, probs, above, mass_above, target) {
        let mut lower: Vec<usize> = order.iter().copied().filter(|&i| bucket(i) > edge).collect();
        lower.sort_by(|a, b| by_prob(probs, a, b));
        let (from, mass_so_far) = (kept.len(), kept.iter().map(|&i| probs[i]).sum());
        kept.extend(lower);
        cut_at_mass(&mut kept, probs, from, mass_so_far, target);
    }
    *order = kept;
}

/// Adds `probs` of `order[from..]` in order to `mass` and truncates `order` after the first index where the sum
/// reaches `target` (keeping at least one); whether it did.
fn cut_at_mass(order: &mut Vec<usize>, probs: &[f64], from: usize, mut mass: f64, target: f64) -> bool {
    for n in from..order.len() {
        mass += probs[order[n]];
        if mass >= target {
            order.truncate(n + 1);
            return true;
        }
    }
    order.truncate(order.len().max(1));
    false
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
        Sampler::new(SamplingParams { temperature, top_p, seed, ..Default::default() }).unwrap()
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

    /// The filters as first written: sort every kept index, then cut (the reference for the selection-based
    /// [`SamplingParams::kept`]).
    fn kept_by_full_sort(params: &SamplingParams, probs: &[f64]) -> Vec<usize> {
        let mut order: Vec<usize> = (0..probs.len()).filter(|&i| probs[i] > 0.0).collect();
        let cmp = |a: &usize, b: &usize| probs[*b].total_cmp(&probs[*a]).then(a.cmp(b));
        if let Some(k) = params.top_k.filter(|&k| k > 0 && k < order.len()) {
            order.sort_by(cmp);
            order.truncate(k);
        }
        order.sort_by(cmp);
        if let Some(top_p) = params.top_p.filter(|&p| p < 1.0) {
            let total: f64 = order.iter().map(|&i| probs[i]).sum();
            let (mut mass, mut n) = (0.0, 0);
            for &i in &order {
                mass += probs[i];
                n += 1;
                if mass >= f64::from(top_p) * total {
                    break;
                }
            }
            order.truncate(n.max(1));
        }
        if let Some(min_p) = params.min_p.filter(|&p| p > 0.0)
            && let Some(&top) = order.first()
        {
            order.retain(|&i| probs[i] >= f64::from(min_p) * probs[top]);
        }
        order
    }

    #[test]
    fn selection_filters_keep_what_a_full_sort_keeps() {
        // Peaked and flat distributions over a vocabulary larger than the first candidate prefix (256), with ties,
        // so the prefix has to grow; every combination of the filters.
        let mut rng = Xoshiro256::seed_from_u64(11);
        for case in 0..24 {
            let vocab = 3000 + 97 * case;
            let spread = [0.5f64, 4.0, 12.0][case % 3];
            let logits: Vec<f32> =
                (0..vocab).map(|i| if i % 50 == 7 { 1.5 } else { (spread * (rng.next_f64() - 0.5)) as f32 }).collect();
            let probs = softmax(&logits, 1.0);
            for (top_k, top_p, min_p) in [
                (None, None, None),
                (None, Some(0.9), None),
                (None, Some(0.999), None),
                (None, Some(0.2), None),
                (Some(40), None, None),
                (Some(1000), Some(0.95), None),
                (None, None, Some(0.05)),
                (Some(500), Some(0.8), Some(0.01)),
            ] {
                let params = SamplingParams { temperature: Some(1.0), top_k, top_p, min_p, ..Default::default() };
                let mut fast = params.kept(&probs);
                let slow = kept_by_full_sort(&params, &probs);
                fast.sort_unstable();
                let mut slow_set = slow.clone();
                slow_set.sort_unstable();
                assert_eq!(
                    fast,
                    slow_set,
                    "case {case}, {top_k:?} {top_p:?} {min_p:?}: {} vs {}",
                    fast.len(),
                    slow.len()
                );
            }
            for top_p in [0.3f32, 0.9, 0.99] {
                let full = {
                    let mut o: Vec<usize> = (0..vocab).filter(|&i| probs[i] > 0.0).collect();
                    o.sort_by(|a, b| by_prob(&probs, a, b));
                    let target = f64::from(top_p);
                    let (mut mass, mut n) = (0.0, 0);
                    for &i in &o {
                        mass += probs[i];
                        n += 1;
                        if mass >= target {
                            break;
                        }
                    }
                    o.truncate(n.max(1));
                    o
                };
                assert_eq!(nucleus(&probs, top_p), full, "case {case}, top_p {top_p}");
            }
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
            assert!(
                Sampler::new(SamplingParams { temperature: t, top_p: p, ..Default::default() }).is_err(),
                "{t:?} {p:?}"
            );
        }
    }
    #[test]
    fn bad_filters_and_penalties_name_the_parameter() {
        let cases: [(SamplingParams, &str); 3] = [
            (SamplingParams { min_p: Some(1.5), ..Default::default() }, "min_p"),
            (SamplingParams { presence_penalty: 2.5, ..Default::default() }, "presence_penalty"),
            (SamplingParams { frequency_penalty: -3.0, ..Default::default() }, "frequency_penalty"),
        ];
        for (params, name) in cases {
            let err = Sampler::new(params).unwrap_err().to_string();
            assert!(err.contains(name), "{err}");
        }
    }

    #[test]
    fn top_k_min_p_and_top_p_compose() {
        // probs 0.4, 0.3, 0.2, 0.1 at T = 1.
        let logits: Vec<f32> = [0.4f64, 0.3, 0.2, 0.1].iter().map(|p| p.ln() as f32).collect();
        let probs = |params: SamplingParams| params.probabilities(&logits, &[]);
        let base = SamplingParams { temperature: Some(1.0), ..Default::default() };
        let close = |a: &[f64], b: &[f64]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6);
        assert!(close(&probs(base), &[0.4, 0.3, 0.2, 0.1]));
        assert!(close(&probs(SamplingParams { top_k: Some(2), ..base }), &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0]));
        assert!(close(&probs(SamplingParams { top_k: Some(0), ..base }), &[0.4, 0.3, 0.2, 0.1]));
        // min-p 0.45: keep p >= 0.18.
        assert!(close(&probs(SamplingParams { min_p: Some(0.45), ..base }), &[4.0 / 9.0, 3.0 / 9.0, 2.0 / 9.0, 0.0]));
        // top-p after top-k renormalizes: top-3 masses 4/9, 3/9, 2/9; 0.7 of that needs the first two.
        assert!(close(
            &probs(SamplingParams { top_k: Some(3), top_p: Some(0.7), ..base }),
            &[4.0 / 7.0, 3.0 / 7.0, 0.0, 0.0]
        ));
        // Greedy is one-hot.
        assert!(close(&probs(SamplingParams::default()), &[1.0, 0.0, 0.0, 0.0]));
    }

    #[test]
    fn penalties_follow_openai() {
        let params = SamplingParams { presence_penalty: 0.5, frequency_penalty: 0.25, ..Default::default() };
        let mut logits = vec![1.0f32, 1.0, 1.0, 1.0];
        params.apply_penalties(&mut logits, &[2, 2, 0, 99]);
        assert_eq!(logits, vec![1.0 - 0.75, 1.0, 1.0 - 1.0, 1.0]);
        // Greedy with penalties moves off a repeated token.
        let mut s = Sampler::new(params).unwrap();
        assert_eq!(s.sample_after(&[2.0, 1.9, 0.0], &[0]), 1);
        assert_eq!(s.sample_after(&[2.0, 1.9, 0.0], &[]), 0);
    }

    #[test]
    fn draw_follows_the_distribution_and_log_softmax_normalizes() {
        let probs = [0.0, 0.5, 0.0, 0.25, 0.25];
        let mut s = sampler(Some(1.0), None, 9);
        let n = 40_000;
        let mut counts = [0usize; 5];
        for _ in 0..n {
            counts[s.draw(&probs) as usize] += 1;
        }
        assert_eq!(counts[0] + counts[2], 0);
        let chi2: f64 =
            [1, 3, 4].iter().map(|&i| (counts[i] as f64 - probs[i] * n as f64).powi(2) / (probs[i] * n as f64)).sum();
        // 2 degrees of freedom: P(chi2 > 13.8) = 0.001.
        assert!(chi2 < 13.8, "{chi2} {counts:?}");
        let lp = log_softmax(&[1.0, 2.0, f32::NAN, 0.5]);
        let total: f64 = lp.iter().map(|&l| f64::from(l).exp()).sum();
        assert!((total - 1.0).abs() < 1e-6 && lp[2] == f32::NEG_INFINITY);
        assert_eq!(top_n(&[0.1, 0.7, 0.7, f32::NAN, 0.2], 3), vec![(1, 0.7), (2, 0.7), (4, 0.2)]);
        assert_eq!(top_n(&[0.1], 5), vec![(0, 0.1)]);
    }
}
