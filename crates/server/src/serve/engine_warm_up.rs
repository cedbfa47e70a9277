//! The engine's warm-up (`Engine::warm_up`): every step shape serving will run, once, before the server says it is
//! ready; on CUDA first the device self-checks that turn on paths written without a GPU at hand; with EAGLE-3
//! whole speculative requests. A part of [`super`] (`impl Engine` continued), in a file of its own.

use super::*;

impl<B: Backend> Engine<B> {
    /// Runs the step shapes serving will run, so that the first requests do not pay for lazy initialisation: on
    /// CUDA a kernel specialisation compiles at its first launch (NVRTC, tens to hundreds of ms each) and each step
    /// width and context picks launch shapes of its own, so a server that warmed up one width compiled kernels in
    /// the middle of its first requests (the H200 serving sweep's first run: 3 s TTFT at p99, TPOT 35 ms at 64
    /// concurrent requests instead of 8, bench/REPORT.md). On CUDA: decode steps of every width from 1 to
    /// [`WARM_UP_WIDTHS`] one-token sequences (within the rows `--max-running-requests` sequences send a step, times
    /// the verified drafts with speculative decoding, and the free KV blocks; tokens from [`warm_up_tokens`]), then one prompt of a prefill chunk's length (`--chunked-prefill-size`, within the context
    /// and the free blocks), then every attention launch shape over the cache (long contexts pick other shapes than
    /// these steps do). Elsewhere (nothing compiles at run time): widths 1 and the widest, which still grows the
    /// allocator. With speculative decoding, whole requests through the engine's steps too
    /// ([`Self::warm_up_speculative`]: the drafter's launches). Nothing stays cached. Returns what it ran, for the
    /// startup log.
    pub fn warm_up(&mut self) -> anyhow::Result<String> {
        let started = Instant::now();
        let cuda = cfg!(feature = "cuda") && eyrie_model::device::is_cuda_backend::<B>();
        // First, so that the steps below compile the paths the checks turn on.
        #[cfg(feature = "cuda")]
        let checks = if cuda { Some(self.device_self_checks()) } else { None };
        #[cfg(not(feature = "cuda"))]
        let checks: Option<String> = None;
        let vocab = self.target.config().vocab_size;
        // Speculative decoding verifies `decode_width` rows a sequence: the target sees up to that many times the
        // running sequences' rows a step.
        let rows = self.config.max_running.saturating_mul(self.decode_width());
        let widest = rows.min(WARM_UP_WIDTHS).min(self.cache.free_blocks()).max(1);
        let widths: Vec<usize> = if cuda { (1..=widest).collect() } else { vec![1, widest] };
        for &n in &widths {
            let tokens = warm_up_tokens(n, vocab);
            let mut seqs = vec![SequenceCache::default(); n];
            let logits = {
                let mut batch: Vec<BatchEntry<'_>> =
                    seqs.iter_mut().zip(tokens.chunks(1)).map(|(seq, tokens)| BatchEntry { seq, tokens }).collect();
                self.target.forward_batch(&mut batch, &mut self.cache, LogitRows::Last, &self.device)
            };
            for seq in seqs {
                self.cache.release(seq);
            }
            to_host(logits?)?;
        }
        let mut done = format!("decode widths 1..={widest}");
        let prompt = self
            .config
            .chunked_prefill
            .min(self.config.context_length.saturating_sub(1))
            .min(self.cache.free_blocks() * self.cache.block_size());
        if cuda && prompt > widest {
            let tokens: Vec<u32> =
                (0..prompt).map(|i| ((i as u64 * 104_729 + 7) % vocab.max(1) as u64) as u32).collect();
            let mut seq = SequenceCache::default();
            let logits = {
                let mut batch = [BatchEntry { seq: &mut seq, tokens: &tokens }];
                self.target.forward_batch(&mut batch, &mut self.cache, LogitRows::Last, &self.device)
            };
            self.cache.release(seq);
            to_host(logits?)?;
            done += &format!(", a {prompt}-token prompt");
        }
        let shapes = match &mut self.target {
            #[cfg(feature = "cuda")]
            Target::Single(m) if cuda => {
                let (heads, r) = (m.config.num_heads, m.config.kv_lora_rank);
                self.cache.warm_up_attention(heads, r).transpose().map_err(|e| anyhow::anyhow!("warm-up: {e}"))?
            }
            // Every rank over its own cache (each device compiles its own kernels).
            Target::Parallel(g) if cuda => g.warm_up_attention(&self.cache)?,
            _ => None,
        };
        if let Some(shapes) = shapes {
            done += &format!(", {shapes} attention launch shapes");
        }
        if let Some(spec) = self.warm_up_speculative(cuda)? {
            done += &format!(", {spec}");
        }
        done += &format!(" in {:.1} s", started.elapsed().as_secs_f64());
        if let Some(checks) = checks {
            done += &format!("; {checks}");
        }
        // What the weights, the KV cache and the warm-up's widest steps hold on the device (this thread's stream,
        // which runs every step; with tp/ep, rank 0's device).
        #[cfg(feature = "cuda")]
        if let Some((used, reserved)) = eyrie_model::cuda_ops::memory_usage::<B>(&self.device) {
            done += &format!(
                "; device memory {:.2} GB in use, {:.2} GB reserved",
                used as f64 / 1e9,
                reserved as f64 / 1e9
            );
        }
        Ok(done)
    }

    /// The device self-checks ([`crate::self_checks`]) that turn on the MHA form of prefill attention and greedy
    /// picks on the device where they pass. Returns the startup log's words.
    #[cfg(feature = "cuda")]
    fn device_self_checks(&self) -> String {
        let c = self.target.config();
        let mha = crate::self_checks::mha_prefill::<B>(&self.device, c);
        let argmax = crate::self_checks::device_argmax::<B>(&self.device, c.vocab_size);
        format!("device self-checks: {mha}; {argmax}")
    }

    /// Speculative mode's part of [`Self::warm_up`]: whole requests (8-token prompts, 8 greedy tokens) through the
    /// engine's own steps, so the drafter's launches (its widths up to 16 rows have kernels of their own) and the
    /// speculative glue compile too: 1 to 16 concurrent requests and `--max-running-requests` on CUDA, one
    /// elsewhere. Their metrics go to a scratch copy and their prefixes are forgotten after.
    ///
    /// # Errors
    /// A warm-up request that failed, or requests that did not finish.
    fn warm_up_speculative(&mut self, cuda: bool) -> anyhow::Result<Option<String>> {
        if self.spec.is_none() {
            return Ok(None);
        }
        let max = self.config.max_running.max(1);
        let mut widths: Vec<usize> = if cuda { (1..=max.min(16)).collect() } else { vec![1] };
        if cuda && max > 16 {
            widths.push(max);
        }
        let vocab = self.target.config().vocab_size;
        let real = std::mem::replace(&mut self.metrics, Arc::new(Metrics::default()));
        let mut stuck = false;
        // Kept to the end: a failed request's message is the warm-up's error.
        let mut receivers = Vec::new();
        for &n in &widths {
            let tokens = warm_up_tokens(n + 8, vocab);
            for i in 0..n {
                let (events, rx) = tokio::sync::mpsc::unbounded_channel();
                receivers.push(rx);
                let params = EngineParams {
                    sampling: SamplingParams::default(),
                    max_tokens: 8,
                    stop_token_ids: Vec::new(),
                    ignore_eos: true,
                    logprobs: None,
                };
                let prompt = tokens[i..i + 8].to_vec();
                self.enqueue(Submission { prompt, params, events, cancel: Arc::new(AtomicBool::new(false)) });
            }
            // Each request needs its prefill and at most 8 steps; far more means something is wrong.
            for _ in 0..64 * (n + 8) {
                if self.waiting.is_empty() && self.running.is_empty() {
                    break;
                }
                self.admit();
                if !self.running.is_empty() {
                    self.step();
                }
            }
            stuck |= !(self.waiting.is_empty() && self.running.is_empty());
            if stuck {
                break;
            }
        }
        for seq in self.waiting.drain(..).chain(self.running.drain(..)).collect::<Vec<_>>() {
            finish(&mut self.cache, &mut self.spec, &self.metrics, seq, FinishReason::Cancelled);
        }
        let failed = self.metrics.requests_server_error.load(Ordering::Relaxed);
        let ok = self.metrics.requests_ok.load(Ordering::Relaxed);
        self.metrics = real;
        self.cache.clear_prefix_cache();
        let first_error = receivers.iter_mut().find_map(|rx| {
            std::iter::from_fn(|| rx.try_recv().ok()).find_map(|e| match e {
                Event::Failed(message) => Some(message),
                _ => None,
            })
        });
        if stuck || failed > 0 {
            anyhow::bail!(
                "speculative warm-up: {failed} of {} requests failed{}{}",
                failed + ok,
                first_error.map(|m| format!(" (first: {m})")).unwrap_or_default(),
                if stuck { "; requests still running after their step budget" } else { "" }
            );
        }
        Ok(Some(format!("{ok} speculative requests at 1..={} concurrent", widths.last().copied().unwrap_or(1))))
    }
}
