//! Host memory: 64-byte aligned buffers from a caching pool, with the byte
//! accounting (current and peak) that eager and compiled execution share.
//!
//! Why a pool: a fresh large allocation is page-faulted in on first touch,
//! which costs more than the kernel that writes it. Freed buffers are kept,
//! keyed by size, and handed out again, as PyTorch's caching allocators do.
//!
//! # Out of memory
//!
//! Allocation is fallible: `RawBuffer::try_new` returns an
//! `ErrorKind::OutOfMemory` error naming the bytes asked for when the system
//! refuses them (never `handle_alloc_error`'s abort). Callers that return a
//! `Result` use it directly. Kernels allocate with the infallible
//! `Storage::new`, so that their code stays plain; a failure there is
//! raised (`raise`) and unwinds to the op boundary that runs the kernel
//! (`catching`: `cpu::eval`, the compiled executor's kernels, custom ops),
//! which returns it as the op's error, naming the op and its output type.
//! Outside any boundary it is an ordinary panic with the same message, as
//! the panicking API reports every error. Nothing is left half-done: the
//! storages a kernel made are dropped on the way out, and the thread-local
//! state of a planned run is restored by guards.

use std::alloc::{self, Layout as AllocLayout};
use std::cell::Cell;
use std::collections::HashMap;
use std::panic::{self, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::error::{Error, ErrorKind, Result};

const ALIGN: usize = 64;
/// Cached (free) bytes kept at most; beyond this, freed buffers go back to the OS.
const POOL_LIMIT_BYTES: usize = 4 << 30;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
static PEAK_BYTES: AtomicUsize = AtomicUsize::new(0);
/// The "host" pool's bytes: values offloaded from the device (on the CPU
/// backend, whose device memory is host memory too, a pool accounted
/// apart, so that what offloading saves shows in [`memory_stats`]).
static HOST_LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
static HOST_PEAK_BYTES: AtomicUsize = AtomicUsize::new(0);

struct Pool {
    free: HashMap<usize, Vec<SendPtr>>,
    cached_bytes: usize,
}

struct SendPtr(NonNull<u8>);
// SAFETY: the pool owns these blocks exclusively; they carry no thread affinity.
unsafe impl Send for SendPtr {}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

/// A block of at least one byte, 64-byte aligned, zero-filled when fresh.
pub(crate) struct RawBuffer {
    ptr: NonNull<u8>,
    /// The rounded size of the block (the pool's key).
    capacity: usize,
    /// The bytes the user asked for (what the accounting counts).
    len: usize,
    /// Accounted in the host pool ([`host_memory_stats`]), not the
    /// device's ([`memory_stats`]).
    host: bool,
}

// SAFETY: a RawBuffer is a uniquely owned heap block.
unsafe impl Send for RawBuffer {}
unsafe impl Sync for RawBuffer {}

fn round_up(bytes: usize) -> usize {
    bytes.max(1).div_ceil(ALIGN) * ALIGN
}

impl RawBuffer {
    /// A buffer of `len` bytes. Its contents are initialised (zeros, or the
    /// bytes of a previously freed buffer), so any bit pattern read from it is
    /// a valid value of every dtype we store (bools are bytes). Errors
    /// (`OutOfMemory`) when the system refuses the bytes, or when `len` is
    /// past [`crate::limits::MAX_BYTES`].
    pub(crate) fn try_new(len: usize) -> Result<RawBuffer> {
        if len > crate::limits::MAX_BYTES {
            return Err(out_of_memory(len));
        }
        let capacity = round_up(len);
        let reused = POOL.lock().ok().and_then(|mut guard| {
            let pool = guard.as_mut()?;
            let ptr = pool.free.get_mut(&capacity)?.pop()?;
            pool.cached_bytes -= capacity;
            Some(ptr.0)
        });
        let ptr = match reused {
            Some(ptr) => ptr,
            None => {
                let layout = AllocLayout::from_size_align(capacity, ALIGN)
                    .map_err(|_| out_of_memory(len))?;
                // SAFETY: layout has non-zero size.
                let p = unsafe { alloc::alloc_zeroed(layout) };
                // Cached blocks may be what stands in the way: give them
                // back and try once more.
                match NonNull::new(p) {
                    Some(p) => p,
                    None => {
                        empty_cache();
                        // SAFETY: as above.
                        NonNull::new(unsafe { alloc::alloc_zeroed(layout) })
                            .ok_or_else(|| out_of_memory(len))?
                    }
                }
            }
        };
        let live = LIVE_BYTES.fetch_add(len, Ordering::Relaxed) + len;
        PEAK_BYTES.fetch_max(live, Ordering::Relaxed);
        Ok(RawBuffer {
            ptr,
            capacity,
            len,
            host: false,
        })
    }

    /// A buffer of `len` bytes accounted in the host pool (offloaded
    /// values), not in [`memory_stats`].
    pub(crate) fn try_new_host(len: usize) -> Result<RawBuffer> {
        let mut b = RawBuffer::try_new(len)?;
        LIVE_BYTES.fetch_sub(len, Ordering::Relaxed);
        let live = HOST_LIVE_BYTES.fetch_add(len, Ordering::Relaxed) + len;
        HOST_PEAK_BYTES.fetch_max(live, Ordering::Relaxed);
        b.host = true;
        Ok(b)
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_host(&self) -> bool {
        self.host
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for RawBuffer {
    fn drop(&mut self) {
        match self.host {
            true => HOST_LIVE_BYTES.fetch_sub(self.len, Ordering::Relaxed),
            false => LIVE_BYTES.fetch_sub(self.len, Ordering::Relaxed),
        };
        if let Ok(mut guard) = POOL.lock() {
            let pool = guard.get_or_insert_with(|| Pool {
                free: HashMap::new(),
                cached_bytes: 0,
            });
            if pool.cached_bytes + self.capacity <= POOL_LIMIT_BYTES {
                pool.cached_bytes += self.capacity;
                pool.free
                    .entry(self.capacity)
                    .or_default()
                    .push(SendPtr(self.ptr));
                return;
            }
        }
        // SAFETY: allocated in `new` with this exact layout.
        unsafe {
            alloc::dealloc(
                self.ptr.as_ptr(),
                AllocLayout::from_size_align_unchecked(self.capacity, ALIGN),
            )
        }
    }
}

/// Bytes of tensor data alive now and the most alive at once since the last
/// [`reset_peak`], over every host buffer tessera allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryStats {
    pub live_bytes: usize,
    pub peak_bytes: usize,
}

pub fn memory_stats() -> MemoryStats {
    MemoryStats {
        live_bytes: LIVE_BYTES.load(Ordering::Relaxed),
        peak_bytes: PEAK_BYTES.load(Ordering::Relaxed),
    }
}

/// The host pool's bytes (values offloaded by compiled runs on the CPU
/// backend, see `Backend::offload`): apart from [`memory_stats`].
pub fn host_memory_stats() -> MemoryStats {
    MemoryStats {
        live_bytes: HOST_LIVE_BYTES.load(Ordering::Relaxed),
        peak_bytes: HOST_PEAK_BYTES.load(Ordering::Relaxed),
    }
}

/// Starts a new peak measurement from the bytes alive now (the host
/// pool's too).
pub fn reset_peak() {
    PEAK_BYTES.store(LIVE_BYTES.load(Ordering::Relaxed), Ordering::Relaxed);
    HOST_PEAK_BYTES.store(HOST_LIVE_BYTES.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Returns every cached free buffer to the operating system.
pub fn empty_cache() {
    if let Ok(mut guard) = POOL.lock() {
        if let Some(pool) = guard.as_mut() {
            for (cap, ptrs) in pool.free.drain() {
                for p in ptrs {
                    // SAFETY: every pooled block was allocated with (cap, ALIGN).
                    unsafe {
                        alloc::dealloc(
                            p.0.as_ptr(),
                            AllocLayout::from_size_align_unchecked(cap, ALIGN),
                        )
                    }
                }
            }
            pool.cached_bytes = 0;
        }
    }
}

/// The error for `bytes` the system would not give.
fn out_of_memory(bytes: usize) -> Error {
    Error::new(
        ErrorKind::OutOfMemory,
        format!(
            "out of memory: {bytes} bytes ({}) could not be allocated",
            human_bytes(bytes)
        ),
    )
}

/// `4.0 TB`, `512 B`: a byte count for people (decimal units).
pub(crate) fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 6] = ["kB", "MB", "GB", "TB", "PB", "EB"];
    if bytes < 1000 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1000.0;
    let mut unit = 0;
    while v >= 1000.0 && unit + 1 < UNITS.len() {
        v /= 1000.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// A failed allocation unwinding from a kernel to its op boundary.
struct Raised(Error);

thread_local! {
    /// How many [`catching`] boundaries enclose the code running on this
    /// thread.
    static BOUNDARIES: Cell<usize> = const { Cell::new(0) };
}

/// Reports `e`, an allocation failure inside a kernel that cannot return
/// it: unwinds to the enclosing [`catching`] boundary (silently: it becomes
/// that op's error), or, with none on this thread, panics with its message.
pub(crate) fn raise(e: Error) -> ! {
    if BOUNDARIES.with(Cell::get) > 0 {
        panic::resume_unwind(Box::new(Raised(e)))
    }
    panic!("{e}")
}

/// Runs `f`, an op's kernel: an allocation failure [`raise`]d inside it (on
/// this thread) is returned as the error; any other panic passes on.
pub(crate) fn catching<R>(f: impl FnOnce() -> R) -> Result<R> {
    struct Leave;
    impl Drop for Leave {
        fn drop(&mut self) {
            BOUNDARIES.with(|b| b.set(b.get() - 1));
        }
    }
    BOUNDARIES.with(|b| b.set(b.get() + 1));
    let leave = Leave;
    let result = panic::catch_unwind(AssertUnwindSafe(f));
    drop(leave);
    match result {
        Ok(r) => Ok(r),
        Err(payload) => match payload.downcast::<Raised>() {
            Ok(raised) => Err(raised.0),
            Err(other) => panic::resume_unwind(other),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_allocation_is_an_error_naming_the_bytes() {
        // More than any machine has, within the size limit (2^49 bytes).
        let bytes = 1usize << 49;
        let e = RawBuffer::try_new(bytes).err().expect("refused");
        assert_eq!(e.kind, ErrorKind::OutOfMemory);
        assert!(
            e.message.contains("562949953421312 bytes (562.9 TB)"),
            "{e}"
        );
        let e = RawBuffer::try_new(usize::MAX).err().expect("refused");
        assert!(e.message.contains(&usize::MAX.to_string()), "{e}");
    }

    #[test]
    fn a_raised_failure_becomes_the_boundarys_error_and_panics_outside() {
        let r: Result<()> = catching(|| {
            let _held = RawBuffer::try_new(1024).unwrap();
            raise(out_of_memory(7))
        });
        assert_eq!(r.unwrap_err().kind, ErrorKind::OutOfMemory);
        assert_eq!(BOUNDARIES.with(Cell::get), 0);
        // Other panics pass through a boundary.
        let other = panic::catch_unwind(|| catching(|| panic!("not an allocation")));
        assert!(other.is_err());
        // Outside a boundary: a panic with the message.
        let outside = panic::catch_unwind(|| raise(out_of_memory(7))).unwrap_err();
        let msg = outside.downcast_ref::<String>().expect("a message");
        assert!(msg.contains("out of memory: 7 bytes"), "{msg}");
        assert_eq!(human_bytes(999), "999 B");
        assert_eq!(human_bytes(4_000_000_000_000), "4.0 TB");
    }
}
