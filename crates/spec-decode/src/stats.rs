//! Acceptance statistics of speculative decoding: what the server exports as metrics and `eyrie generate` prints.

use std::time::Duration;

use serde::Serialize;

/// Counters over speculative steps (one step = one sequence verified once).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AcceptanceStats {
    /// Sequence-steps verified.
    pub steps: u64,
    /// Draft tokens proposed.
    pub drafted: u64,
    /// Draft tokens accepted.
    pub accepted: u64,
    /// Tokens emitted (accepted drafts plus one resampled or bonus token per step).
    pub emitted: u64,
    /// `position_drafted[j]`: steps whose draft at chain position `j` (0-based) was verified, i.e. all drafts
    /// before it were accepted.
    pub position_drafted: Vec<u64>,
    /// `position_accepted[j]`: steps whose draft at position `j` was accepted.
    pub position_accepted: Vec<u64>,
    /// Wall time spent drafting (all drafter calls).
    pub draft_time: Duration,
    /// Wall time spent in target verification forwards and acceptance.
    pub verify_time: Duration,
}

impl AcceptanceStats {
    /// Records one sequence-step that proposed `drafted` tokens and accepted the first `accepted`.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        self.steps += 1;
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        self.emitted += accepted as u64 + 1;
        if self.position_drafted.len() < drafted {
            self.position_drafted.resize(drafted, 0);
            self.position_accepted.resize(drafted, 0);
        }
        for j in 0..drafted.min(accepted + 1) {
            self.position_drafted[j] += 1;
            if j < accepted {
                self.position_accepted[j] += 1;
            }
        }
    }

    /// Accepted / drafted (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        ratio(self.accepted, self.drafted)
    }

    /// Mean tokens emitted per verification step, the bonus token included (SGLang's "accept length"); 1 means
    /// no draft was ever accepted.
    pub fn mean_accepted_length(&self) -> f64 {
        ratio(self.emitted, self.steps)
    }

    /// Per chain position `j`, the acceptance rate of drafts at `j` given that the drafts before it were accepted
    /// (their product up to `j` is the chance a step emits more than `j` drafts).
    pub fn position_rates(&self) -> Vec<f64> {
        self.position_drafted.iter().zip(&self.position_accepted).map(|(&d, &a)| ratio(a, d)).collect()
    }

    /// Adds `other`'s counts and times.
    pub fn merge(&mut self, other: &AcceptanceStats) {
        self.steps += other.steps;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
        self.emitted += other.emitted;
        let n = self.position_drafted.len().max(other.position_drafted.len());
        self.position_drafted.resize(n, 0);
        self.position_accepted.resize(n, 0);
        for (j, (&d, &a)) in other.position_drafted.iter().zip(&other.position_accepted).enumerate() {
            self.position_drafted[j] += d;
            self.position_accepted[j] += a;
        }
        self.draft_time += other.draft_time;
        self.verify_time += other.verify_time;
    }

    /// One line for logs and `eyrie generate`.
    pub fn summary(&self) -> String {
        let rates: Vec<String> = self.position_rates().iter().map(|r| format!("{r:.2}")).collect();
        format!(
            "speculative: {} steps, accept rate {:.3}, mean accepted length {:.2}, per position [{}], draft {:.1} ms, \
             verify {:.1} ms",
            self.steps,
            self.acceptance_rate(),
            self.mean_accepted_length(),
            rates.join(", "),
            self.draft_time.as_secs_f64() * 1e3,
            self.verify_time.as_secs_f64() * 1e3
        )
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_positions_and_lengths() {
        let mut s = AcceptanceStats::default();
        s.record(3, 1);
        s.record(3, 3);
        s.record(2, 0);
        assert_eq!((s.steps, s.drafted, s.accepted, s.emitted), (3, 8, 4, 7));
        assert_eq!(s.position_rates(), vec![2.0 / 3.0, 0.5, 1.0]);
        assert!((s.mean_accepted_length() - 7.0 / 3.0).abs() < 1e-12);
        let mut t = AcceptanceStats::default();
        t.merge(&s);
        t.merge(&s);
        assert_eq!(t.position_drafted, vec![6, 4, 2]);
    }
}
