//! Host memory: 64-byte aligned buffers from a caching pool, with the byte
//! accounting (current and peak) that eager and compiled execution share.
//!
//! Why a pool: a fresh large allocation is page-faulted in on first touch,
//! which costs more than the kernel that writes it. Freed buffers are kept,
//! keyed by size, and handed out again, as PyTorch's caching allocators do.

use std::alloc::{self, Layout as AllocLayout};
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

const ALIGN: usize = 64;
/// Cached (free) bytes kept at most; beyond this, freed buffers go back to the OS.
const POOL_LIMIT_BYTES: usize = 4 << 30;

static LIVE_BYTES: AtomicUsize = AtomicUsize::new(0);
static PEAK_BYTES: AtomicUsize = AtomicUsize::new(0);

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
    /// a valid value of every dtype we store (bools are bytes).
    pub(crate) fn new(len: usize) -> RawBuffer {
        let capacity = round_up(len);
        let reused = POOL.lock().ok().and_then(|mut guard| {
            let pool = guard.as_mut()?;
            let ptr = pool.free.get_mut(&capacity)?.pop()?;
            pool.cached_bytes -= capacity;
            Some(ptr.0)
        });
        let ptr = reused.unwrap_or_else(|| {
            let layout =
                AllocLayout::from_size_align(capacity, ALIGN).expect("allocation size overflows");
            // SAFETY: layout has non-zero size.
            let p = unsafe { alloc::alloc_zeroed(layout) };
            NonNull::new(p).unwrap_or_else(|| alloc::handle_alloc_error(layout))
        });
        let live = LIVE_BYTES.fetch_add(len, Ordering::Relaxed) + len;
        PEAK_BYTES.fetch_max(live, Ordering::Relaxed);
        RawBuffer { ptr, capacity, len }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for RawBuffer {
    fn drop(&mut self) {
        LIVE_BYTES.fetch_sub(self.len, Ordering::Relaxed);
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

/// Starts a new peak measurement from the bytes alive now.
pub fn reset_peak() {
    PEAK_BYTES.store(LIVE_BYTES.load(Ordering::Relaxed), Ordering::Relaxed);
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
