//! Eyrie patch: a log of the driver calls that put work on a CUDA stream (kernel launches, copies, event records
//! and waits, stream-ordered allocations and frees, stream syncs), for finding what sits between two kernels of a
//! chain (any stream operation between them makes their edge a plain one for programmatic dependent launch) and
//! whether the device thread submits faster than the GPU runs.
//!
//! Off unless `EYRIE_TRACE_STREAM=FILE` is set (one relaxed load a call then). Each line: microseconds since the
//! first traced call (host clock, at the call), the stream, the operation and its details, tab-separated. At most
//! `EYRIE_TRACE_STREAM_MAX` lines (default 200000); the file is flushed at each stream sync.

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

struct Trace {
    start: Instant,
    out: std::io::BufWriter<std::fs::File>,
    lines: usize,
    max: usize,
}

fn trace() -> Option<&'static Mutex<Trace>> {
    static TRACE: OnceLock<Option<Mutex<Trace>>> = OnceLock::new();
    TRACE
        .get_or_init(|| {
            let path = std::env::var("EYRIE_TRACE_STREAM").ok()?;
            let file = std::fs::File::create(&path)
                .map_err(|e| eprintln!("EYRIE_TRACE_STREAM: cannot create {path}: {e}"))
                .ok()?;
            let max = std::env::var("EYRIE_TRACE_STREAM_MAX")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(200_000);
            Some(Mutex::new(Trace {
                start: Instant::now(),
                out: std::io::BufWriter::new(file),
                lines: 0,
                max,
            }))
        })
        .as_ref()
}

/// Logs one stream operation; `detail` is only called when the trace is on.
pub(crate) fn record(stream: *mut cudarc::driver::sys::CUstream_st, op: &str, detail: impl FnOnce() -> String) {
    let Some(t) = trace() else { return };
    let Ok(mut t) = t.lock() else { return };
    if t.lines >= t.max {
        return;
    }
    t.lines += 1;
    let us = t.start.elapsed().as_secs_f64() * 1e6;
    let mut line = String::with_capacity(96);
    let _ = write!(line, "{us:.1}\t{stream:p}\t{op}\t{}", detail());
    let _ = writeln!(t.out, "{line}");
    if op == "sync" {
        let _ = t.out.flush();
    }
}
