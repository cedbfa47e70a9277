//! Server metrics in the Prometheus text exposition format (`GET /metrics`): request counters by outcome, prompt
//! and generated token counters, time-to-first-token and inter-token-latency histograms, queue depth, running
//! requests, KV-cache blocks used and free, prefix-cache hits and speculative acceptance per draft position.
//! Names follow vLLM's (`eyrie:` prefix instead of `vllm:`).

use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds (seconds) of the latency histogram buckets.
const TTFT_BUCKETS: &[f64] = &[0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0];
const ITL_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0];

/// A cumulative histogram.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self { bounds, counts: vec![0; bounds.len()], sum: 0.0, count: 0 }
    }

    fn observe(&mut self, v: f64) {
        for (b, c) in self.bounds.iter().zip(&mut self.counts) {
            if v <= *b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            self.count, self.sum, self.count
        );
    }
}

/// Gauges the engine publishes after every step.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EngineGauges {
    pub waiting: usize,
    pub running: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    pub kv_blocks_cached: usize,
    pub block_size: usize,
}

/// All metrics; shared between the engine thread and the HTTP handlers.
#[derive(Debug)]
pub struct Metrics {
    pub requests_ok: AtomicU64,
    pub requests_client_error: AtomicU64,
    pub requests_server_error: AtomicU64,
    pub requests_cancelled: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generation_tokens: AtomicU64,
    pub prefix_cache_hit_tokens: AtomicU64,
    pub preemptions: AtomicU64,
    pub steps: AtomicU64,
    /// Steps queued before the previous step's picks were read (overlap scheduling).
    pub overlapped_steps: AtomicU64,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
    gauges: Mutex<EngineGauges>,
    /// Per draft position: (proposed, accepted).
    spec: Mutex<Vec<(u64, u64)>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            requests_ok: AtomicU64::new(0),
            requests_client_error: AtomicU64::new(0),
            requests_server_error: AtomicU64::new(0),
            requests_cancelled: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            prefix_cache_hit_tokens: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            steps: AtomicU64::new(0),
            overlapped_steps: AtomicU64::new(0),
            ttft: Mutex::new(Histogram::new(TTFT_BUCKETS)),
            itl: Mutex::new(Histogram::new(ITL_BUCKETS)),
            gauges: Mutex::new(EngineGauges::default()),
            spec: Mutex::new(Vec::new()),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding a metrics lock leaves plain numbers behind: keep using them.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Metrics {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn observe_ttft(&self, seconds: f64) {
        lock(&self.ttft).observe(seconds);
    }

    pub fn observe_itl(&self, seconds: f64) {
        lock(&self.itl).observe(seconds);
    }

    pub fn set_gauges(&self, g: EngineGauges) {
        *lock(&self.gauges) = g;
    }

    pub fn gauges(&self) -> EngineGauges {
        *lock(&self.gauges)
    }

    /// Adds speculative statistics: per draft position, how many drafts were verified (all before them accepted)
    /// and how many were accepted.
    pub fn observe_speculation(&self, drafted: &[u64], accepted: &[u64]) {
        let mut spec = lock(&self.spec);
        if spec.len() < drafted.len() {
            spec.resize(drafted.len(), (0, 0));
        }
        for (i, slot) in spec.iter_mut().enumerate() {
            slot.0 += drafted.get(i).copied().unwrap_or(0);
            slot.1 += accepted.get(i).copied().unwrap_or(0);
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self, model: &str) -> String {
        let mut out = String::new();
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let _ = writeln!(
            out,
            "# HELP eyrie:requests_total Finished requests by outcome.\n# TYPE eyrie:requests_total counter"
        );
        for (outcome, c) in [
            ("ok", &self.requests_ok),
            ("client_error", &self.requests_client_error),
            ("server_error", &self.requests_server_error),
            ("cancelled", &self.requests_cancelled),
        ] {
            let _ = writeln!(out, "eyrie:requests_total{{model=\"{model}\",outcome=\"{outcome}\"}} {}", get(c));
        }
        for (name, help, c) in [
            ("eyrie:prompt_tokens_total", "Prompt tokens of admitted requests.", &self.prompt_tokens),
            ("eyrie:generation_tokens_total", "Generated tokens.", &self.generation_tokens),
            (
                "eyrie:prefix_cache_hit_tokens_total",
                "Prompt tokens served from the prefix cache.",
                &self.prefix_cache_hit_tokens,
            ),
            (
                "eyrie:preemptions_total",
                "Requests preempted (pages freed, recomputed later) for lack of KV blocks.",
                &self.preemptions,
            ),
            ("eyrie:engine_steps_total", "Batched forward steps.", &self.steps),
            (
                "eyrie:overlapped_steps_total",
                "Steps queued on the device before the previous step's greedy picks were read (overlap scheduling).",
                &self.overlapped_steps,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", get(c));
        }
        let g = self.gauges();
        for (name, help, v) in [
            ("eyrie:num_requests_waiting", "Requests queued, not yet admitted.", g.waiting),
            ("eyrie:num_requests_running", "Requests admitted (prefilling or decoding).", g.running),
            ("eyrie:kv_cache_blocks_total", "KV-cache blocks.", g.kv_blocks_total),
            ("eyrie:kv_cache_blocks_used", "KV-cache blocks held by running requests.", g.kv_blocks_used),
            (
                "eyrie:kv_cache_blocks_free",
                "KV-cache blocks not held (free or prefix-cached).",
                g.kv_blocks_total - g.kv_blocks_used,
            ),
            ("eyrie:kv_cache_blocks_prefix_cached", "Free blocks kept for prefix reuse.", g.kv_blocks_cached),
            ("eyrie:kv_cache_block_size", "Tokens per KV-cache block.", g.block_size),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        lock(&self.ttft).render(&mut out, "eyrie:time_to_first_token_seconds", "Time from arrival to the first token.");
        lock(&self.itl).render(&mut out, "eyrie:inter_token_latency_seconds", "Time between consecutive tokens.");
        let spec = lock(&self.spec);
        let _ = writeln!(
            out,
            "# HELP eyrie:spec_decode_acceptance_rate Accepted / verified draft tokens per draft position.\n\
             # TYPE eyrie:spec_decode_acceptance_rate gauge"
        );
        for (i, (proposed, accepted)) in spec.iter().enumerate() {
            let rate = if *proposed == 0 { 0.0 } else { *accepted as f64 / *proposed as f64 };
            let _ = writeln!(out, "eyrie:spec_decode_acceptance_rate{{position=\"{i}\"}} {rate}");
        }
        let (drafted, accepted): (u64, u64) = spec.iter().fold((0, 0), |(d, a), (x, y)| (d + x, a + y));
        let _ = writeln!(
            out,
            "# HELP eyrie:spec_decode_draft_tokens_total Draft tokens verified.\n# TYPE eyrie:spec_decode_draft_tokens_total counter\n\
             eyrie:spec_decode_draft_tokens_total {drafted}\n\
             # HELP eyrie:spec_decode_accepted_tokens_total Draft tokens accepted.\n# TYPE eyrie:spec_decode_accepted_tokens_total counter\n\
             eyrie:spec_decode_accepted_tokens_total {accepted}"
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_histograms_and_gauges() {
        let m = Metrics::default();
        Metrics::add(&m.requests_ok, 2);
        Metrics::add(&m.generation_tokens, 10);
        m.observe_ttft(0.015);
        m.observe_itl(0.003);
        m.set_gauges(EngineGauges {
            waiting: 1,
            running: 2,
            kv_blocks_total: 10,
            kv_blocks_used: 4,
            kv_blocks_cached: 3,
            block_size: 16,
        });
        m.observe_speculation(&[2, 1, 1], &[1, 1, 0]);
        let text = m.render("tiny");
        for line in [
            "eyrie:requests_total{model=\"tiny\",outcome=\"ok\"} 2",
            "eyrie:generation_tokens_total 10",
            "eyrie:time_to_first_token_seconds_bucket{le=\"0.01\"} 0",
            "eyrie:time_to_first_token_seconds_bucket{le=\"0.02\"} 1",
            "eyrie:time_to_first_token_seconds_count 1",
            "eyrie:kv_cache_blocks_free 6",
            "eyrie:num_requests_running 2",
            "eyrie:spec_decode_acceptance_rate{position=\"0\"} 0.5",
            "eyrie:spec_decode_acceptance_rate{position=\"2\"} 0",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line:?} in\n{text}");
        }
    }
}
