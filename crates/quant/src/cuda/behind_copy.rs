//! GPU time for the benchmark programs: the device copy bandwidth (the ceiling every kernel is stated against) and
//! [`BehindCopy`], calls queued behind a long copy so that the host's enqueue is not what is timed, on CUDA events.

use burn::cubecl;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::gpu::arg;
use super::kernels::copy_kernel;

/// 16-byte vectors: four f32.
const VEC: usize = 4;

/// Device copy bandwidth, bytes read + written per second: the best of 6 copies of 1 GiB through [`copy_f32`],
/// each between device syncs (the ceiling the benchmarks state their kernels against).
///
/// # Errors
/// A message when a device sync fails.
pub fn copy_bandwidth<R: Runtime>(client: &ComputeClient<R>) -> Result<f64, String> {
    let floats = 1usize << 28;
    let (a, b) = (client.empty(floats * 4), client.empty(floats * 4));
    let sync = || cubecl::future::block_on(client.sync()).map_err(|e| format!("device sync: {e:?}"));
    let mut best = f64::INFINITY;
    for _ in 0..6 {
        sync()?;
        let t = std::time::Instant::now();
        copy_f32(client, &a, &b, floats);
        sync()?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(8.0 * floats as f64 / best)
}

/// GPU time per call, hidden from the host: a 2 GiB copy is queued first, then `iters` calls, medians of 7, divided
/// by `iters`. The host's enqueue of the calls (~5-10 us a launch through CubeCL, longer than short kernels, which a
/// wall clock over back-to-back calls would measure instead) runs while the GPU copies. The benchmark programs'
/// GPU-time columns.
///
/// On CUDA the time is the GPU's own, between CUDA events on CubeCL's stream: by default one recorded between the
/// copy and the first call and one after the last call. Before session 30 it was (an event before the copy to the one
/// after the calls) less the copy's time alone ([`Self::set_mid_event`]`(false)`, kept for comparisons), which in
/// this process carries a fixed ~45-120 us a sample when the calls follow CubeCL's copy kernel directly: CubeCL's
/// client queues tasks 32 at a time and its device thread takes them only when the batch is full or at a blocking
/// call, so the copy reached the stream ~31 tasks after the start event (not behind the driver's copy,
/// [`Self::set_driver_copy`], which bypasses that queue): F / iters too much on every call, 3-7 us at 16 calls
/// (bench/REPORT.md, session 30). The mid event's `get_resource` flushes the queue first. The event between costs ~10 us once a sample (the
/// first call starts cold, without programmatic dependent launch from the copy): ~0.6 us a call at 16 calls over the
/// slope between 8 and 32 calls, which is free of any cost paid once.
/// Elsewhere, and where the events cannot be made, the time is the host's clock from before the copy's enqueue to
/// the return of the device sync after the calls, less the copy's time alone.
#[derive(Debug)]
pub struct BehindCopy {
    src: Handle,
    dst: Handle,
    floats: usize,
    copy_s: f64,
    copy_host_s: f64,
    events: Option<cuda_events::Events>,
    mid: bool,
    driver_copy: bool,
    flush_after_copy: bool,
}

impl BehindCopy {
    /// Allocates the copy's two 2 GiB buffers and times the copy alone.
    ///
    /// # Errors
    /// A message when a device sync fails.
    pub fn new<R: Runtime>(client: &ComputeClient<R>) -> Result<Self, String> {
        let floats = 1usize << 29;
        let (src, dst) = (client.empty(floats * 4), client.empty(floats * 4));
        let events = cuda_events::Events::new(client, &src);
        let mut me = Self {
            src,
            dst,
            floats,
            copy_s: 0.0,
            copy_host_s: 0.0,
            events,
            mid: true,
            driver_copy: false,
            flush_after_copy: false,
        };
        (me.copy_s, me.copy_host_s, _) = me.median7(client, 0, |_| {})?;
        Ok(me)
    }

    /// With `on` (the default; CUDA events only) an event recorded between the copy and the calls, the GPU time the
    /// calls' alone (the last event less it); off, (copy + calls) less the copy's time alone, as before session 30.
    pub fn set_mid_event(&mut self, on: bool) {
        self.mid = on;
    }

    /// With `on` (CUDA events only), the copy in front is the driver's `cuMemcpyDtoDAsync` on CubeCL's stream instead
    /// of CubeCL's copy kernel, and the copy's time alone is measured anew that way (for comparisons: session 30's
    /// fixed cost a sample appeared behind the kernel).
    ///
    /// # Errors
    /// A message when a device sync fails while the copy is timed anew.
    pub fn set_driver_copy<R: Runtime>(&mut self, client: &ComputeClient<R>, on: bool) -> Result<(), String> {
        self.driver_copy = on && self.events.is_some();
        (self.copy_s, self.copy_host_s, _) = self.median7(client, 0, |_| {})?;
        Ok(())
    }

    /// With `on`, a `get_resource` round trip right after the copy's enqueue (it hands CubeCL's queued tasks to its
    /// device thread and records nothing on the stream), and the copy's time alone measured anew that way: with
    /// [`Self::set_mid_event`]`(false)`, the check that the old method's fixed cost is the copy waiting in CubeCL's
    /// client queue (session 30).
    ///
    /// # Errors
    /// A message when a device sync fails while the copy is timed anew.
    pub fn set_flush_after_copy<R: Runtime>(&mut self, client: &ComputeClient<R>, on: bool) -> Result<(), String> {
        self.flush_after_copy = on;
        (self.copy_s, self.copy_host_s, _) = self.median7(client, 0, |_| {})?;
        Ok(())
    }

    /// The copy in front of the calls: CubeCL's copy kernel, or the driver's (see [`Self::set_driver_copy`]).
    fn copy<R: Runtime>(&self, client: &ComputeClient<R>) -> Result<(), String> {
        match &self.events {
            Some(ev) if self.driver_copy => ev.copy_dtod(client, &self.src, &self.dst, self.floats * 4),
            _ => {
                copy_f32(client, &self.src, &self.dst, self.floats);
                Ok(())
            }
        }
    }

    /// Whether the times are the GPU's own (CUDA events) rather than the host's clock.
    pub fn gpu_clock(&self) -> bool {
        self.events.is_some()
    }

    /// Medians of 7 (copy + `iters` calls) in seconds, on the GPU's clock where there is one (else the host's)
    /// and on the host's, and the longest host enqueue of the calls.
    fn median7<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        iters: usize,
        mut f: impl FnMut(usize),
    ) -> Result<(f64, f64, f64), String> {
        let sync = || cubecl::future::block_on(client.sync()).map_err(|e| format!("device sync: {e:?}"));
        let (mut t, mut host, mut enqueue) = (Vec::with_capacity(7), Vec::with_capacity(7), 0.0f64);
        for r in 0..7 {
            sync()?;
            if let Some(ev) = &self.events {
                ev.record_start()?;
            }
            let t0 = std::time::Instant::now();
            self.copy(client)?;
            if self.flush_after_copy {
                client.get_resource(self.src.clone()).map_err(|e| format!("device memory: {e:?}"))?;
            }
            let mid = match &self.events {
                Some(ev) if self.mid && iters > 0 => {
                    ev.record_mark(client, &self.src, 0)?;
                    true
                }
                _ => false,
            };
            let t1 = std::time::Instant::now();
            for i in 0..iters {
                f(r * iters + i);
            }
            enqueue = enqueue.max(t1.elapsed().as_secs_f64());
            let gpu = match &self.events {
                Some(ev) => Some(ev.record_end(client, &self.src)?),
                None => None,
            };
            sync()?;
            let wall = t0.elapsed().as_secs_f64();
            host.push(wall);
            t.push(match (gpu, &self.events) {
                // The copy's time alone added back, so that callers subtract it as from the other figures.
                (Some(()), Some(ev)) if mid => ev.elapsed_s()? - ev.mark_s(0)? + self.copy_s,
                (Some(()), Some(ev)) => ev.elapsed_s()?,
                _ => wall,
            });
        }
        t.sort_by(f64::total_cmp);
        host.sort_by(f64::total_cmp);
        Ok((t[3], host[3], enqueue))
    }

    /// GPU microseconds per call of `f` (given the call's index) after `warm` untimed calls (enough that every
    /// kernel the timed calls launch has been compiled).
    ///
    /// # Errors
    /// A message when a device sync fails, or when the host's enqueue of the calls outlasted the copy (the time
    /// would then include the host's).
    pub fn time_us<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        warm: usize,
        iters: usize,
        f: impl FnMut(usize),
    ) -> Result<f64, String> {
        Ok(self.time_us_clocks(client, warm, iters, f)?.0)
    }

    /// [`Self::time_us`] and, from the same runs, the host clock's figure (device sync return less enqueue of the
    /// copy; equal to the first where there are no events).
    ///
    /// # Errors
    /// As [`Self::time_us`].
    pub fn time_us_clocks<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        warm: usize,
        iters: usize,
        mut f: impl FnMut(usize),
    ) -> Result<(f64, f64), String> {
        for i in 0..warm {
            f(i);
        }
        let (t, host, enqueue) = self.median7(client, iters, f)?;
        if enqueue > 0.9 * self.copy_s {
            return Err(format!(
                "host enqueue of {iters} calls took {:.0} us, the copy hiding it {:.0} us: use fewer calls",
                enqueue * 1e6,
                self.copy_s * 1e6
            ));
        }
        let per = |a: f64, b: f64| (a - b) * 1e6 / iters as f64;
        Ok((per(t, self.copy_s), per(host, self.copy_host_s)))
    }

    /// Where the GPU time of `iters` calls behind the copy goes, call by call: a CUDA event after the copy and after
    /// each call (each a break in programmatic dependent launch, so the calls here run a little slower than
    /// [`Self::time_us`]'s), medians of 7 after `warm` calls. Returns the copy's time in this run less the copy's
    /// alone, then each call's: microseconds, `iters + 1` values. `None` without CUDA events.
    ///
    /// # Errors
    /// A message when a device sync or an event fails.
    pub fn call_times<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        warm: usize,
        iters: usize,
        mut f: impl FnMut(usize),
    ) -> Result<Option<Vec<f64>>, String> {
        let Some(ev) = &self.events else { return Ok(None) };
        for i in 0..warm {
            f(i);
        }
        let sync = || cubecl::future::block_on(client.sync()).map_err(|e| format!("device sync: {e:?}"));
        let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(7); iters + 1];
        for r in 0..7 {
            sync()?;
            ev.record_start()?;
            self.copy(client)?;
            ev.record_mark(client, &self.src, 0)?;
            for i in 0..iters {
                f(r * iters + i);
                ev.record_mark(client, &self.src, i + 1)?;
            }
            sync()?;
            let mut last = 0.0;
            for (k, v) in samples.iter_mut().enumerate() {
                let t = ev.mark_s(k)?;
                v.push(if k == 0 { t - self.copy_s } else { t - last });
                last = t;
            }
        }
        Ok(Some(
            samples
                .into_iter()
                .map(|mut v| {
                    v.sort_by(f64::total_cmp);
                    v[3] * 1e6
                })
                .collect(),
        ))
    }
}

/// Copies `floats` f32 (a multiple of 1024) from `src` to `dst` on the device.
pub fn copy_f32<R: Runtime>(client: &ComputeClient<R>, src: &Handle, dst: &Handle, floats: usize) {
    assert!(floats.is_multiple_of(1024), "copy length must be a multiple of 1024 floats");
    let vectors = floats / VEC;
    let blocks = (vectors / 256) as u32;
    // SAFETY: the grid covers exactly `vectors` vectors, both buffers hold `floats` floats.
    unsafe {
        copy_kernel::launch_unchecked::<R>(
            client,
            CubeCount::Static(blocks, 1, 1),
            CubeDim::new_1d(256),
            AddressType::from_len(floats),
            VEC,
            arg(src, vectors),
            arg(dst, vectors),
        );
    }
}

/// CUDA events on CubeCL's stream for [`BehindCopy`] (the CUDA runtime only: other runtimes get `None`).
mod cuda_events {
    use burn::cubecl;
    use cubecl::cuda::CudaRuntime;
    use cubecl::prelude::*;
    use cubecl::server::Handle;
    use cudarc::driver::{result, sys};

    /// Two events of the context that owns CubeCL's stream, and that stream.
    #[derive(Debug)]
    pub(super) struct Events {
        ctx: sys::CUcontext,
        stream: sys::CUstream,
        start: sys::CUevent,
        end: sys::CUevent,
        /// Events recorded between calls by [`super::BehindCopy::call_times`], made on first use.
        marks: std::cell::RefCell<Vec<sys::CUevent>>,
    }

    impl Events {
        /// The events, or `None` when `client` is not CUDA's or the driver refuses (the host clock is used then).
        pub(super) fn new<R: Runtime>(client: &ComputeClient<R>, buf: &Handle) -> Option<Self> {
            let client = (client as &dyn std::any::Any).downcast_ref::<ComputeClient<CudaRuntime>>()?;
            let stream = client.get_resource(buf.clone()).ok()?.resource().stream;
            let mut ctx: sys::CUcontext = std::ptr::null_mut();
            // SAFETY: CubeCL's live stream; `ctx` receives its context.
            if unsafe { sys::cuStreamGetCtx(stream, &mut ctx) } != sys::CUresult::CUDA_SUCCESS {
                return None;
            }
            // SAFETY: a live context.
            unsafe { result::ctx::set_current(ctx) }.ok()?;
            let start = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ok()?;
            let Ok(end) = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT) else {
                // SAFETY: made above, destroyed once.
                let _ = unsafe { result::event::destroy(start) };
                return None;
            };
            Some(Self { ctx, stream, start, end, marks: std::cell::RefCell::new(Vec::new()) })
        }

        fn current(&self) -> Result<(), String> {
            // SAFETY: the stream's live context.
            unsafe { result::ctx::set_current(self.ctx) }.map_err(|e| format!("CUDA context: {e}"))
        }

        /// Records the start on the stream (CubeCL's queue is empty: called right after a device sync).
        pub(super) fn record_start(&self) -> Result<(), String> {
            self.current()?;
            // SAFETY: live event and stream of the current context.
            unsafe { result::event::record(self.start, self.stream) }.map_err(|e| format!("CUDA event: {e}"))
        }

        /// Records the end after everything enqueued so far: a resource lookup is a round trip through CubeCL's
        /// queue, so every launch before it is on the stream when it returns.
        pub(super) fn record_end<R: Runtime>(&self, client: &ComputeClient<R>, buf: &Handle) -> Result<(), String> {
            client.get_resource(buf.clone()).map_err(|e| format!("device memory: {e:?}"))?;
            self.current()?;
            // SAFETY: live event and stream of the current context.
            unsafe { result::event::record(self.end, self.stream) }.map_err(|e| format!("CUDA event: {e}"))
        }

        /// `bytes` from `src` to `dst` by the driver's copy on the stream, after everything enqueued so far.
        pub(super) fn copy_dtod<R: Runtime>(
            &self,
            client: &ComputeClient<R>,
            src: &Handle,
            dst: &Handle,
            bytes: usize,
        ) -> Result<(), String> {
            let client = (client as &dyn std::any::Any)
                .downcast_ref::<ComputeClient<CudaRuntime>>()
                .ok_or("the driver's copy needs the CUDA runtime")?;
            let ptr = |h: &Handle| {
                client.get_resource(h.clone()).map(|r| r.resource().ptr).map_err(|e| format!("device memory: {e:?}"))
            };
            let (s, d) = (ptr(src)?, ptr(dst)?);
            self.current()?;
            // SAFETY: both buffers hold `bytes` (the caller's), live on the current context; the stream orders the copy.
            unsafe { result::memcpy_dtod_async(d, s, bytes, self.stream) }.map_err(|e| format!("CUDA copy: {e}"))
        }

        /// Records mark `i` after everything enqueued so far (as [`Self::record_end`]), making marks up to `i`.
        pub(super) fn record_mark<R: Runtime>(
            &self,
            client: &ComputeClient<R>,
            buf: &Handle,
            i: usize,
        ) -> Result<(), String> {
            client.get_resource(buf.clone()).map_err(|e| format!("device memory: {e:?}"))?;
            self.current()?;
            let mut marks = self.marks.borrow_mut();
            while marks.len() <= i {
                marks.push(
                    result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                        .map_err(|e| format!("CUDA event: {e}"))?,
                );
            }
            // SAFETY: live event and stream of the current context.
            unsafe { result::event::record(marks[i], self.stream) }.map_err(|e| format!("CUDA event: {e}"))
        }

        /// Seconds from the start to mark `i` (recorded; waits for it).
        pub(super) fn mark_s(&self, i: usize) -> Result<f64, String> {
            self.current()?;
            let marks = self.marks.borrow();
            let mark = *marks.get(i).ok_or_else(|| format!("CUDA event: mark {i} was never recorded"))?;
            // SAFETY: both recorded on one stream of the current context.
            let ms = unsafe {
                result::event::synchronize(mark).map_err(|e| format!("CUDA event: {e}"))?;
                result::event::elapsed(self.start, mark).map_err(|e| format!("CUDA event: {e}"))?
            };
            Ok(f64::from(ms) * 1e-3)
        }

        /// Seconds between the two events (waits for the end).
        pub(super) fn elapsed_s(&self) -> Result<f64, String> {
            self.current()?;
            // SAFETY: both recorded on one stream of the current context.
            let ms = unsafe {
                result::event::synchronize(self.end).map_err(|e| format!("CUDA event: {e}"))?;
                result::event::elapsed(self.start, self.end).map_err(|e| format!("CUDA event: {e}"))?
            };
            Ok(f64::from(ms) * 1e-3)
        }
    }

    impl Drop for Events {
        fn drop(&mut self) {
            if self.current().is_ok() {
                // SAFETY: made in `new`, destroyed once here.
                unsafe {
                    let _ = result::event::destroy(self.start);
                    let _ = result::event::destroy(self.end);
                    for &m in self.marks.borrow().iter() {
                        let _ = result::event::destroy(m);
                    }
                }
            }
        }
    }
}
