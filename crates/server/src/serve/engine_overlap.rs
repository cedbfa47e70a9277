//! The engine's overlap scheduling (module docs of [`super`]): which steps may leave their greedy picks on the
//! device, queuing the next step fed with them before they are read (`follow`), and reading them (`land`). A part
//! of [`super`] (`impl Engine` continued), in a file of its own.

use super::*;

impl<B: Backend> Engine<B> {
    /// Whether `seq`'s picks can be greedy ones made where the logits are: greedy, no penalties, no logprobs.
    pub(super) fn greedy(seq: &Seq<B>) -> bool {
        let p = seq.sampler.params();
        p.is_greedy() && !p.has_penalties() && seq.params.logprobs.is_none()
    }

    /// Whether a step's greedy picks may stay on the device for the next step (overlap scheduling): asked for, and
    /// on CUDA the device picks switched on (they passed the warm-up's self-check).
    pub(super) fn overlap_allowed(&self) -> bool {
        self.config.overlap
            && self.spec.is_none()
            && (!eyrie_model::device::is_cuda_backend::<B>() || eyrie_model::sampling::device_argmax_enabled())
    }

    /// Runs `plan` (decode rows of one token each) with its greedy picks left on the device: the tokens embedded
    /// are `fed`'s ids when given (the previous step's picks, not yet on the host: each row's entry then carries
    /// its last host token as a placeholder), else the rows' last tokens.
    pub(super) fn queue(
        &mut self,
        plan: &[(usize, usize)],
        fed: Option<&PendingPicks<B>>,
    ) -> Result<PendingPicks<B>, String> {
        let outcome = catch_unwind(AssertUnwindSafe(|| -> anyhow::Result<PendingPicks<B>> {
            let mut caches: Vec<SequenceCache> =
                plan.iter().map(|&(i, _)| self.running[i].cache.take().unwrap_or_default()).collect();
            let result = {
                let mut batch: Vec<BatchEntry<'_>> = plan
                    .iter()
                    .zip(caches.iter_mut())
                    .map(|(&(i, _), seq)| {
                        let tokens = &self.running[i].tokens;
                        BatchEntry { tokens: &tokens[tokens.len().saturating_sub(1)..], seq }
                    })
                    .collect();
                let ids = fed.map(|f| &f.ids);
                self.target.forward_chained(&mut batch, &mut self.cache, &self.device, ids)
            };
            for (&(i, _), c) in plan.iter().zip(caches) {
                self.running[i].cache = Some(c);
            }
            pending_argmax(&result?).map_err(|e| anyhow::anyhow!("greedy picks on the device: {e}"))
        }));
        match outcome {
            Ok(Ok(picks)) => Ok(picks),
            Ok(Err(e)) => Err(format!("{e:#}")),
            Err(panic) => Err(format!("panic: {}", panic_message(&*panic))),
        }
    }

    /// The step to queue behind `fl` before its picks are read (see [`Self::step`]): `None` when the next step
    /// would not be the same rows; `Some(Err((rows, why)))` when queueing failed (those rows' requests fail).
    #[allow(clippy::type_complexity)]
    pub(super) fn follow(&mut self, fl: &InFlight<B>) -> Option<Result<InFlight<B>, (Vec<u64>, String)>> {
        if !self.overlap_allowed() || self.running.len() != fl.rows.len() {
            return None;
        }
        let (max_ctx, bs) = (self.config.context_length, self.config.block_size);
        let same = self.running.iter().zip(&fl.rows).all(|(seq, &id)| {
            // Its in-flight token is its last (the cache holds every token), and the pick coming back will not end
            // it by length (so the step queued now is not wasted on it; a stop token can still end it).
            seq.id == id
                && !seq.cancelled()
                && Self::greedy(seq)
                && seq.computed() == seq.total()
                && seq.generated() + 1 < seq.params.max_tokens
                && seq.tokens.len() + 1 < max_ctx
        });
        if !same {
            return None;
        }
        let need: usize =
            self.running.iter().map(|seq| (seq.computed() + 1).div_ceil(bs).saturating_sub(seq.blocks())).sum();
        if need > self.cache.free_blocks() {
            return None;
        }
        let plan: Vec<(usize, usize)> = (0..self.running.len()).map(|i| (i, 1)).collect();
        Metrics::add(&self.metrics.steps, 1);
        Metrics::add(&self.metrics.overlapped_steps, 1);
        Some(
            self.queue(&plan, Some(&fl.picks))
                .map(|picks| InFlight { rows: fl.rows.clone(), picks })
                .map_err(|why| (fl.rows.clone(), why)),
        )
    }

    /// Reads an in-flight step's picks and hands each to its sequence, if it still runs (a sequence cancelled or
    /// ended meanwhile drops its pick); a failed step fails the requests of its rows that still run.
    pub(super) fn land(&mut self, fl: InFlight<B>) {
        let picked = fl.picks.wait().and_then(|ids| {
            if ids.len() == fl.rows.len() {
                Ok(ids)
            } else {
                Err(format!("{} greedy picks for {} rows", ids.len(), fl.rows.len()))
            }
        });
        let ids = match picked {
            Ok(ids) => ids,
            Err(why) => {
                let plan: Vec<(usize, usize)> = self
                    .running
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| fl.rows.contains(&s.id))
                    .map(|(i, _)| (i, 1))
                    .collect();
                return self.fail_step(&plan, &why);
            }
        };
        let now = Instant::now();
        let mut finished = Vec::new();
        for (seq_id, id) in fl.rows.iter().zip(ids) {
            let Some(i) = self.running.iter().position(|s| s.id == *seq_id) else {
                continue;
            };
            if let Some(reason) = self.accept(i, id, None, now) {
                finished.push((i, reason));
            }
        }
        finished.sort_unstable_by_key(|&(i, _)| i);
        for &(i, reason) in finished.iter().rev() {
            let seq = self.running.remove(i);
            finish(&mut self.cache, &mut self.spec, &self.metrics, seq, reason);
        }
    }
}
