//! `TESSERA_CUDA_PROFILE=1`: the GPU time of every op, by op and input
//! shapes. Each op is bracketed by two CUDA events on its stream and the
//! times are read when the report is made, so nothing is synchronised
//! while the program runs: the times are the device's own, a view or a
//! host-only op costs ~0, and the run keeps its speed (apart from the
//! events and the bookkeeping). Work queued while a stream is captured
//! into a CUDA graph is not timed (events cannot time a capture).
//!
//! `TESSERA_CUDA_TIMELINE=DIR` also writes, at each report, every timed
//! op's start and end (ms since the first op timed after the last
//! [`reset`]) and its stream to `DIR/timeline-<pid>.tsv`: where streams
//! overlap (communication beside the backward, say) and where the device
//! sits idle, which per-op totals cannot show.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::{result as cu, sys};
use tessera::ir::kernel::{FusedKernel, Step};
use tessera::runtime::array::Array;

use crate::gpu::SendPtr;
use crate::CudaBackend;

/// Whether kernels are timed (`TESSERA_CUDA_PROFILE=1` or a timeline
/// directory): callers skip building what only [`timed`] reads otherwise.
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("TESSERA_CUDA_PROFILE").as_deref() == Ok("1") || timeline_dir().is_some()
    })
}

/// Where the timelines go (`TESSERA_CUDA_TIMELINE`), if anywhere.
fn timeline_dir() -> Option<&'static std::path::PathBuf> {
    static DIR: OnceLock<Option<std::path::PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| std::env::var_os("TESSERA_CUDA_TIMELINE").map(Into::into))
        .as_ref()
}

/// Timed ops whose events have not been read yet; read (waiting for the
/// device) once this many are pending, so the event count stays bounded.
const MAX_PENDING: usize = 8192;

/// One timed op queued and not yet read.
struct Pending {
    key: String,
    stream: usize,
    start: SendPtr<sys::CUevent>,
    end: SendPtr<sys::CUevent>,
    host_ms: f64,
}

#[derive(Default)]
struct State {
    /// The ops queued since the last resolution.
    pending: Vec<Pending>,
    /// The event the timeline's times count from: recorded before the
    /// first op timed after a reset (one process drives one device).
    origin: Option<SendPtr<sys::CUevent>>,
    /// The streams seen, in order of first use (the timeline's stream
    /// numbers).
    streams: Vec<usize>,
    /// (stream number, start ms, end ms, key) per op, with a timeline.
    timeline: Vec<(usize, f32, f32, String)>,
    /// Events free for reuse.
    free: Vec<SendPtr<sys::CUevent>>,
    /// key -> (calls, device ms, host ms).
    table: HashMap<String, (usize, f64, f64)>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

/// Runs `f`, timing it on the device when profiling is on.
pub(crate) fn timed<R>(
    backend: &CudaBackend,
    name: impl FnOnce() -> String,
    inputs: &[&Array],
    f: impl FnOnce() -> R,
) -> R {
    if !enabled() {
        return f();
    }
    backend.gpu.bind();
    let stream = backend.gpu.stream();
    if capturing(stream) {
        return f();
    }
    if timeline_dir().is_some() && origin_missing() {
        // Recorded outside the lock: `record` takes it.
        let origin = record(stream);
        let mut state = STATE.lock().expect("profile poisoned");
        state.get_or_insert_with(State::default).origin = origin;
    }
    let Some(start) = record(stream) else {
        return f();
    };
    let queueing = std::time::Instant::now();
    let r = f();
    let host_ms = queueing.elapsed().as_secs_f64() * 1e3;
    let Some(end) = record(stream) else {
        return r;
    };
    let key = format!("{} {}", name(), shapes(inputs));
    let mut state = STATE.lock().expect("profile poisoned");
    let state = state.get_or_insert_with(State::default);
    state.pending.push(Pending {
        key,
        stream: stream as usize,
        start,
        end,
        host_ms,
    });
    if state.pending.len() >= MAX_PENDING {
        resolve(state);
    }
    r
}

/// The first three inputs' dtypes and shapes (`s` marks a strided one).
fn shapes(inputs: &[&Array]) -> String {
    let shapes: Vec<String> = inputs
        .iter()
        .take(3)
        .map(|x| {
            format!(
                "{}{:?}{}",
                x.dtype(),
                x.shape(),
                if x.is_contiguous() { "" } else { "s" }
            )
        })
        .collect();
    shapes.join(" ")
}

/// A fused kernel's name: its distinct ops in order (at most 8).
pub(crate) fn fused_name(kernel: &FusedKernel) -> String {
    let mut ops: Vec<String> = Vec::new();
    for step in &kernel.steps {
        let op = match step {
            Step::Load(_) | Step::Const(_) => continue,
            Step::Unary(op, _) => op.name().to_string(),
            Step::Binary(op, ..) => op.name().to_string(),
            Step::Compare(op, ..) => op.name().to_string(),
            Step::Where(..) => "where".to_string(),
            Step::Round(dtype, _) => format!("round_{dtype}"),
        };
        if !ops.contains(&op) {
            ops.push(op);
        }
    }
    let more = if ops.len() > 8 { " …" } else { "" };
    ops.truncate(8);
    format!(
        "fused[{}{more}; {} steps -> {:?}]",
        ops.join(" "),
        kernel.steps.len(),
        kernel.shape
    )
}

fn capturing(stream: sys::CUstream) -> bool {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the stream is live; the status is a plain out value.
    let r = unsafe { sys::cuStreamIsCapturing(stream, &mut status) };
    r != sys::CUresult::CUDA_SUCCESS
        || status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
}

/// Whether the timeline has no origin yet (none since the last reset).
fn origin_missing() -> bool {
    let state = STATE.lock().expect("profile poisoned");
    state.as_ref().is_none_or(|s| s.origin.is_none())
}

/// Records an event (a reused one when free) on `stream`.
fn record(stream: sys::CUstream) -> Option<SendPtr<sys::CUevent>> {
    let reused = STATE
        .lock()
        .expect("profile poisoned")
        .as_mut()
        .and_then(|s| s.free.pop());
    let event = match reused {
        Some(e) => e,
        None => SendPtr(cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).ok()?),
    };
    // SAFETY: the event and the stream are live.
    unsafe { cu::event::record(event.0, stream) }.ok()?;
    Some(event)
}

/// Waits for the pending ops and books their times (and their places on
/// the timeline, when one is kept).
fn resolve(state: &mut State) {
    for p in std::mem::take(&mut state.pending) {
        // SAFETY: both events were recorded and are not destroyed.
        let ms = unsafe {
            cu::event::synchronize(p.end.0)
                .ok()
                .and_then(|_| cu::event::elapsed(p.start.0, p.end.0).ok())
        };
        if let Some(ms) = ms {
            let e = state.table.entry(p.key.clone()).or_default();
            e.0 += 1;
            e.1 += ms as f64;
            e.2 += p.host_ms;
            place(state, &p);
        }
        state.free.extend([p.start, p.end]);
    }
}

/// Puts a completed op on the timeline, when one is kept.
fn place(state: &mut State, p: &Pending) {
    let Some(origin) = &state.origin else {
        return;
    };
    // SAFETY: the origin was recorded before `p` was queued; all three
    // events are complete (`p.end` was waited for).
    let times = unsafe {
        cu::event::elapsed(origin.0, p.start.0)
            .ok()
            .zip(cu::event::elapsed(origin.0, p.end.0).ok())
    };
    let Some((t0, t1)) = times else {
        return;
    };
    let stream = match state.streams.iter().position(|&s| s == p.stream) {
        Some(i) => i,
        None => {
            state.streams.push(p.stream);
            state.streams.len() - 1
        }
    };
    state.timeline.push((stream, t0, t1, p.key.clone()));
}

/// Appends the timeline kept so far to `DIR/timeline-<pid>.tsv` (then
/// clears it); the error, if the file cannot be written.
fn write_timeline(state: &mut State) -> Option<String> {
    let dir = timeline_dir()?;
    let rows = std::mem::take(&mut state.timeline);
    let path = dir.join(format!("timeline-{}.tsv", std::process::id()));
    let mut text = String::new();
    if !path.exists() {
        text.push_str("stream\tstart_ms\tend_ms\top\n");
    }
    for (stream, t0, t1, key) in rows {
        text.push_str(&format!("{stream}\t{t0:.4}\t{t1:.4}\t{key}\n"));
    }
    let written = std::fs::create_dir_all(dir).and_then(|_| {
        use std::io::Write;
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)?
            .write_all(text.as_bytes())
    });
    written.err().map(|e| {
        format!(
            "the timeline could not be written to {}: {e}\n",
            path.display()
        )
    })
}

/// Host waits for the device (stream synchronisations, downloads; uploads,
/// which may wait inside the driver for pageable memory;
/// explicit waits) and allocations from the driver, counted while
/// profiling: a wait in the middle of a step drains the device's queue,
/// and a step that waits little but takes as long as the host's queueing
/// is bound by the host.
static WAITS: Mutex<(usize, f64, usize)> = Mutex::new((0, 0.0, 0));

/// Times one host wait (while profiling) from `start` to drop.
pub(crate) struct Wait(Option<std::time::Instant>);

impl Wait {
    pub(crate) fn start() -> Wait {
        Wait(enabled().then(std::time::Instant::now))
    }
}

impl Drop for Wait {
    fn drop(&mut self) {
        if let Some(t) = self.0 {
            let mut w = WAITS.lock().expect("profile poisoned");
            w.0 += 1;
            w.1 += t.elapsed().as_secs_f64() * 1e3;
        }
    }
}

/// What a driver call timed by [`in_driver`] queues.
#[derive(Clone, Copy)]
pub(crate) enum Queued {
    /// `cuLaunchKernel` of a generated kernel.
    Kernel = 0,
    /// An NCCL collective (a group's calls and its end).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    Collective = 1,
}

/// (calls, host ms) inside the driver calls of each [`Queued`] kind while
/// profiling. Queueing work should take a few µs; a call that takes much
/// longer waited for room in the device's queue (the device is behind)
/// or for another rank (NCCL), time the host could not spend dispatching.
static DRIVER: Mutex<[(usize, f64); 2]> = Mutex::new([(0, 0.0); 2]);

/// Runs `f`, a driver call that queues work, timing it while profiling.
pub(crate) fn in_driver<R>(what: Queued, f: impl FnOnce() -> R) -> R {
    if !enabled() {
        return f();
    }
    let t = std::time::Instant::now();
    let r = f();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let mut d = DRIVER.lock().expect("profile poisoned");
    d[what as usize].0 += 1;
    d[what as usize].1 += ms;
    r
}

/// Memoised launches found (hits) and generated (misses) while profiling.
static MEMO: Mutex<(usize, usize)> = Mutex::new((0, 0));

/// Counts a memoised launch's lookup while profiling.
pub(crate) fn count_memo(hit: bool) {
    if enabled() {
        let mut m = MEMO.lock().expect("profile poisoned");
        match hit {
            true => m.0 += 1,
            false => m.1 += 1,
        }
    }
}

/// Runs a driver allocation, counting it while profiling.
pub(crate) fn count_driver_alloc<R>(f: impl FnOnce() -> R) -> R {
    if enabled() {
        WAITS.lock().expect("profile poisoned").2 += 1;
    }
    f()
}

/// Forgets what was timed so far (after warm-up steps, say).
pub fn reset() {
    if let Some(state) = STATE.lock().expect("profile poisoned").as_mut() {
        resolve(state);
        state.table.clear();
        state.timeline.clear();
        if let Some(origin) = state.origin.take() {
            state.free.push(origin);
        }
    }
    *WAITS.lock().expect("profile poisoned") = (0, 0.0, 0);
    *MEMO.lock().expect("profile poisoned") = (0, 0);
    *DRIVER.lock().expect("profile poisoned") = [(0, 0.0); 2];
}

/// The `top` most expensive entries since the last report (then cleared),
/// with the total and the number of ops; empty when profiling is off.
pub fn report(top: usize) -> String {
    let mut guard = STATE.lock().expect("profile poisoned");
    let Some(state) = guard.as_mut() else {
        return String::new();
    };
    resolve(state);
    let mut rows: Vec<(String, (usize, f64, f64))> = state.table.drain().collect();
    rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    let total: f64 = rows.iter().map(|r| r.1 .1).sum();
    let host: f64 = rows.iter().map(|r| r.1 .2).sum();
    let calls: usize = rows.iter().map(|r| r.1 .0).sum();
    let (waits, waited, allocs) =
        std::mem::replace(&mut *WAITS.lock().expect("profile poisoned"), (0, 0.0, 0));
    let (hits, misses) = std::mem::take(&mut *MEMO.lock().expect("profile poisoned"));
    let [(launches, launching), (collectives, collecting)] =
        std::mem::take(&mut *DRIVER.lock().expect("profile poisoned"));
    let mut s = format!(
        "GPU op time (CUDA events), {calls} ops, total {total:.1} ms (the host queueing them: {host:.1} ms); \
         the host waited for the device \
         {waits} times, {waited:.1} ms; {allocs} allocations from the driver; memoised launches \
         {hits} found, {misses} generated; inside cuLaunchKernel {launches} times, \
         {launching:.1} ms; inside NCCL calls {collectives} times, {collecting:.1} ms\n"
    );
    if let Some(error) = write_timeline(state) {
        s.push_str(&error);
    }
    for (key, (n, ms, host)) in rows.into_iter().take(top) {
        s.push_str(&format!(
            "{ms:>10.3} ms {n:>6}x  (host {host:>7.3} ms)  {key}\n"
        ));
    }
    s
}
