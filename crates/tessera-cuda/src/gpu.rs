//! The GPU: its context and streams, the caching allocator with tessera's
//! live/peak accounting, host<->device copies, kernel launches, and the
//! capture of queued work into CUDA graphs.
//!
//! Work goes to the current lane's stream; lane 0, the main stream, unless
//! the executor spreads a step over lanes ([`Gpu::fork`] .. [`Gpu::join`],
//! events for the dependencies). On one stream the cache is safe without
//! events: a block freed while a queued kernel still reads it is handed out
//! again only to work queued after that kernel. Between a fork and its join
//! the blocks freed are held back and cached only at the join, after which
//! every lane's work is ordered before anything queued later.
//!
//! While work is captured ([`Gpu::begin_capture`]), blocks freed go to the
//! capture's own pool, from which the capture's allocations are served
//! first; the graph keeps them (its replays write them) and gives them back
//! to the cache when dropped.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as cu, sys};
use tessera::runtime::cpu::MemoryStats;
use tessera::runtime::device::DeviceMemory;

use crate::codegen::{Launch, ENTRY};
use crate::compiler::{self, Program};
use crate::driver_error;
use crate::kernel_errors::KernelErrors;
use crate::pool::{Block, BlockCache, ExternalAllocator};

/// Blocks are rounded to this many bytes (as PyTorch's allocator does), so
/// that tensors of nearby sizes share cached blocks.
const ROUND: usize = 512;

/// The cache of free blocks (`pool.rs`), with the host bytes a capture's
/// uploads read, under one lock.
#[derive(Default)]
struct Pool {
    blocks: BlockCache,
    /// While capturing: the host bytes of the uploads recorded (see
    /// [`Gpu::upload`]).
    capture_uploads: Vec<PinnedBytes>,
}

/// Page-locked host memory holding the bytes of an upload recorded in a
/// graph: its copy node reads them on every replay, so they live as long
/// as the graph.
struct PinnedBytes(SendPtr<*mut c_void>);

impl PinnedBytes {
    fn copy_of(bytes: &[u8]) -> Result<PinnedBytes, String> {
        // SAFETY: a fresh allocation of bytes.len() bytes, filled below.
        let host = unsafe { cu::malloc_host(bytes.len(), 0) }
            .map_err(|e| driver_error("pinned host allocation", e))?;
        // SAFETY: `host` holds bytes.len() bytes and overlaps nothing.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), host as *mut u8, bytes.len()) };
        Ok(PinnedBytes(SendPtr(host)))
    }

    fn bytes(&self, len: usize) -> &[u8] {
        // SAFETY: allocated with at least `len` bytes in copy_of.
        unsafe { std::slice::from_raw_parts(self.0 .0 as *const u8, len) }
    }
}

impl Drop for PinnedBytes {
    fn drop(&mut self) {
        // SAFETY: from cuMemHostAlloc in copy_of; the graph reading it is
        // destroyed first (cuMemFreeHost waits for work in flight).
        unsafe {
            let _ = cu::free_host(self.0 .0);
        }
    }
}

/// Device memory accounting and the cache of free blocks.
pub struct Allocator {
    pool: Mutex<Pool>,
    live: AtomicUsize,
    peak: AtomicUsize,
    /// Blocks an external allocator lent (see [`Gpu::set_external`]) and
    /// blocks given back to it, since the process started.
    lent: AtomicU64,
    returned: AtomicU64,
}

impl Allocator {
    /// The pool, locked.
    fn pool(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().expect("pool poisoned")
    }

    /// Gives external blocks back to their lender, outside the pool's lock
    /// (the lender may take locks of its own).
    fn give_back(&self, blocks: Vec<Block>) {
        for b in blocks {
            self.returned.fetch_add(1, Ordering::Relaxed);
            b.give_back();
        }
    }
}

/// The caching allocator's counters (`CudaBackend::allocator_stats`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Bytes of tessera's live device tensors, now and at most since the
    /// last peak reset.
    pub live_bytes: usize,
    pub peak_bytes: usize,
    /// Bytes of free blocks tessera keeps for reuse.
    pub cached_bytes: usize,
    /// The external allocator new blocks come from (None: the driver).
    pub external: Option<String>,
    /// Blocks lent by external allocators, and given back, so far.
    pub external_allocs: u64,
    pub external_frees: u64,
}

pub(crate) struct SendPtr<T>(pub(crate) T);
// SAFETY: CUDA handles (function, stream, context) may be used from any
// thread once the context is current there (see `Gpu::bind`).
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

/// Lanes (streams) a step may use unless `TESSERA_CUDA_LANES` says.
const DEFAULT_LANES: usize = 4;

/// The device, one context, its lanes.
pub struct Gpu {
    context: SendPtr<sys::CUcontext>,
    /// The stream of copies between device and host memory that overlap
    /// compute (offloads and prefetches, see [`Gpu::offload_start`]).
    copy_stream: SendPtr<sys::CUstream>,
    /// Events for copies in flight, reused.
    copy_events: Arc<Mutex<Vec<SendPtr<sys::CUevent>>>>,
    /// Page-locked host memory for offloaded values.
    pub pinned: Arc<Mutex<PinnedPool>>,
    /// Events by slot (see [`Gpu::record`]): a kernel whose value a kernel
    /// on another lane reads.
    slots: Mutex<Vec<SendPtr<sys::CUevent>>>,
    /// Lane i's stream; lane 0 is the main stream.
    streams: Vec<SendPtr<sys::CUstream>>,
    /// Lane i's event, recorded at forks (lane 0) and joins (the others).
    events: Vec<SendPtr<sys::CUevent>>,
    /// The lane work goes to now.
    lane: AtomicUsize,
    /// The lanes of the step in progress (0: none).
    forked: AtomicUsize,
    /// `sm_90` on Hopper.
    pub target: String,
    pub sms: u32,
    pub name: String,
    pub alloc: Arc<Allocator>,
    /// Launches by what generated them (see [`Gpu::launch_memoised`]).
    memo: Mutex<HashMap<Vec<u64>, Arc<Memoised>>>,
    /// The record kernels write the errors they find to.
    pub errors: KernelErrors,
    /// Synchronisations so far (see [`Gpu::host_waits`]).
    host_waits: AtomicU64,
    /// The event that orders a foreign call's stream with the main stream
    /// (see [`Gpu::begin_foreign_call`]); the lock keeps each record and
    /// its wait together.
    foreign_event: Mutex<SendPtr<sys::CUevent>>,
}

/// A generated launch with its loaded kernel.
struct Memoised {
    /// Generated on stand-in addresses.
    launch: Launch,
    slots: Vec<AddressSlot>,
    function: SendPtr<sys::CUfunction>,
}

/// An argument word that holds an address: (word, address index, offset
/// the generator added to it).
type AddressSlot = (usize, usize, u64);

/// The most launches [`Gpu::launch_memoised`] keeps; past it the memo starts
/// over (eager calls on ever new shapes would otherwise grow it forever).
const MEMO_ENTRIES: usize = 1 << 13;

/// The low address bits a generator may read (alignment checks: at most a
/// 16-byte vector); kept in stand-ins and keys.
const ALIGN_BITS: u64 = 0xfff;

/// The most addresses a memoised launch takes (a stand-in's index field).
const MAX_ADDRESSES: usize = 0xff;

/// Stand-in `i` for address `ptr` in the set tagged `tag`: the tag in the
/// top byte, the index in the next, `ptr`'s low bits at the bottom (an
/// offset the generator adds below 2^48 leaves tag and index alone).
fn stand_in(tag: u64, i: usize, ptr: u64) -> u64 {
    (tag << 56) | ((i as u64) << 48) | (ptr & ALIGN_BITS)
}

/// The argument words that hold an address, found by generating with two
/// sets of stand-ins: the words that differ (the same offset past stand-in
/// i in both); `None` when the two sources differ or a changed word is no
/// stand-in plus an offset (the generator reads addresses some other
/// way, and its launches are not memoised).
fn address_slots(
    ptrs: &[u64],
    make: impl Fn(&[u64]) -> Result<Launch, String>,
) -> Result<Option<(Launch, Vec<AddressSlot>)>, String> {
    if ptrs.len() > MAX_ADDRESSES {
        return Ok(None);
    }
    let set = |tag| -> Vec<u64> {
        ptrs.iter()
            .enumerate()
            .map(|(i, &p)| stand_in(tag, i, p))
            .collect()
    };
    let (a, b) = (set(0x5e), set(0x5d));
    let (la, lb) = (make(&a)?, make(&b)?);
    if la.source != lb.source || la.args.0.len() != lb.args.0.len() {
        return Ok(None);
    }
    let mut slots = Vec::new();
    for (w, (&wa, &wb)) in la.args.0.iter().zip(&lb.args.0).enumerate() {
        if wa == wb {
            continue;
        }
        let i = ((wa >> 48) & 0xff) as usize;
        match (a.get(i), b.get(i)) {
            (Some(&sa), Some(&sb)) if wa.wrapping_sub(sa) == wb.wrapping_sub(sb) => {
                slots.push((w, i, wa.wrapping_sub(sa)));
            }
            _ => return Ok(None),
        }
    }
    Ok(Some((la, slots)))
}

thread_local! {
    static BOUND: Cell<usize> = const { Cell::new(0) };
}

impl Gpu {
    /// Opens GPU 0. Errors (one line) when the driver is missing or no GPU
    /// answers; never panics.
    pub fn open() -> Result<Gpu, String> {
        // SAFETY: only tries to open the library.
        if !unsafe { sys::is_culib_present() } {
            return Err("CUDA driver not found: libcuda.so could not be loaded (no NVIDIA driver on this machine?)".into());
        }
        if !compiler::nvrtc_present() {
            return Err("CUDA NVRTC not found: libnvrtc.so could not be loaded (put the CUDA toolkit's lib64 on LD_LIBRARY_PATH)".into());
        }
        cu::init().map_err(|e| driver_error("initialisation (cuInit)", e))?;
        let count = cu::device::get_count().map_err(|e| driver_error("device count", e))?;
        if count < 1 {
            return Err("CUDA driver found but no GPU is visible".into());
        }
        let dev = cu::device::get(0).map_err(|e| driver_error("device 0", e))?;
        let attr = |a| unsafe { cu::device::get_attribute(dev, a) };
        use sys::CUdevice_attribute as A;
        let major = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(|e| driver_error("attribute", e))?;
        let minor = attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .map_err(|e| driver_error("attribute", e))?;
        let sms = attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| driver_error("attribute", e))?;
        let name = cu::device::get_name(dev).unwrap_or_else(|_| "GPU".into());
        // SAFETY: dev is a valid device; the primary context lives as long
        // as the process (never released).
        let context =
            unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| driver_error("context", e))?;
        unsafe { cu::ctx::set_current(context) }.map_err(|e| driver_error("context", e))?;
        let lanes = std::env::var("TESSERA_CUDA_LANES")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(DEFAULT_LANES)
            .clamp(1, 16);
        let mut streams = Vec::with_capacity(lanes);
        let mut events = Vec::with_capacity(lanes);
        for _ in 0..lanes {
            let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
                .map_err(|e| driver_error("stream creation", e))?;
            let event = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| driver_error("event creation", e))?;
            streams.push(SendPtr(stream));
            events.push(SendPtr(event));
        }
        let copy_stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| driver_error("stream creation", e))?;
        let foreign_event = cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| driver_error("event creation", e))?;
        let gpu = Gpu {
            context: SendPtr(context),
            copy_stream: SendPtr(copy_stream),
            copy_events: Arc::new(Mutex::new(Vec::new())),
            pinned: Arc::new(Mutex::new(PinnedPool::default())),
            slots: Mutex::new(Vec::new()),
            streams,
            events,
            lane: AtomicUsize::new(0),
            forked: AtomicUsize::new(0),
            target: format!("sm_{major}{minor}"),
            sms: sms as u32,
            name,
            memo: Mutex::new(HashMap::new()),
            errors: KernelErrors::new()?,
            host_waits: AtomicU64::new(0),
            foreign_event: Mutex::new(SendPtr(foreign_event)),
            alloc: Arc::new(Allocator {
                pool: Mutex::new(Pool::default()),
                live: AtomicUsize::new(0),
                peak: AtomicUsize::new(0),
                lent: AtomicU64::new(0),
                returned: AtomicU64::new(0),
            }),
        };
        gpu.bind();
        Ok(gpu)
    }

    /// Makes the context current on this thread (once per thread).
    pub fn bind(&self) {
        let ctx = self.context.0 as usize;
        if BOUND.with(|b| b.get()) != ctx {
            // SAFETY: the context is live for the process.
            if unsafe { cu::ctx::set_current(self.context.0) }.is_ok() {
                BOUND.with(|b| b.set(ctx));
            }
        }
    }

    /// The stream of the current lane.
    pub fn stream(&self) -> sys::CUstream {
        self.streams[self.lane()].0
    }

    /// The current lane.
    pub fn lane(&self) -> usize {
        self.lane.load(Ordering::Relaxed)
    }

    pub fn lanes(&self) -> usize {
        self.streams.len()
    }

    /// Starts a step on `lanes` lanes (at most [`Gpu::lanes`]): every lane
    /// waits for the main stream's work so far; freed blocks are held back
    /// until [`Gpu::join`].
    pub fn fork(&self, lanes: usize) -> Result<(), String> {
        self.bind();
        let lanes = lanes.clamp(1, self.lanes());
        let main = self.streams[0].0;
        // SAFETY: streams and events live as long as the process.
        unsafe {
            cu::event::record(self.events[0].0, main)
                .map_err(|e| driver_error("event record", e))?;
            for s in &self.streams[1..lanes] {
                cu::stream::wait_event(
                    s.0,
                    self.events[0].0,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
                .map_err(|e| driver_error("stream wait", e))?;
            }
        }
        self.alloc.pool().blocks.fork();
        self.forked.store(lanes, Ordering::Relaxed);
        self.lane.store(0, Ordering::Relaxed);
        Ok(())
    }

    /// Sends the work queued from now on to `lane` of the forked step.
    pub fn set_lane(&self, lane: usize) {
        let forked = self.forked.load(Ordering::Relaxed).max(1);
        self.lane.store(lane % forked, Ordering::Relaxed);
    }

    /// Ends a step: the main stream waits for every lane; the blocks freed
    /// during the step become reusable (by work that is now ordered after
    /// all of the step's).
    pub fn join(&self) -> Result<(), String> {
        self.bind();
        let lanes = self.forked.swap(0, Ordering::Relaxed);
        self.lane.store(0, Ordering::Relaxed);
        let main = self.streams[0].0;
        let mut result = Ok(());
        for (s, e) in self.streams.iter().zip(&self.events).take(lanes).skip(1) {
            // SAFETY: as in `fork`.
            let r = unsafe {
                cu::event::record(e.0, s.0).and_then(|_| {
                    cu::stream::wait_event(
                        main,
                        e.0,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                })
            };
            if let Err(err) = r {
                result = Err(driver_error("joining the lanes", err));
            }
        }
        let back = self.alloc.pool().blocks.join();
        self.alloc.give_back(back);
        result
    }

    /// Starts capturing the main stream's work (and the lanes that join
    /// it) instead of running it; the capture's allocations get a pool of
    /// their own.
    pub fn begin_capture(&self) -> Result<(), String> {
        self.bind();
        self.alloc.pool().blocks.begin_capture();
        // Relaxed: allocating (cuMemAlloc) while capturing is allowed.
        let r = unsafe {
            cu::stream::begin_capture(
                self.streams[0].0,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        };
        r.map_err(|e| {
            let mut pool = self.alloc.pool();
            let blocks = pool.blocks.end_capture();
            let back = pool.blocks.put_all(blocks);
            pool.capture_uploads.clear();
            drop(pool);
            self.alloc.give_back(back);
            driver_error("stream capture", e)
        })
    }

    /// Ends the capture: the instantiated graph, which owns the blocks of
    /// the capture's pool; an error when the capture was invalidated (a
    /// synchronisation or a copy to the host while capturing).
    pub fn end_capture(&self) -> Result<CudaGraph, String> {
        self.bind();
        // SAFETY: the main stream is live; its capture began in begin_capture.
        let graph = unsafe { cu::stream::end_capture(self.streams[0].0) };
        let (blocks, uploads) = {
            let mut pool = self.alloc.pool();
            let blocks = pool.blocks.end_capture();
            (blocks, std::mem::take(&mut pool.capture_uploads))
        };
        // Dropped on an error: the blocks go back to the cache.
        let mut captured = CudaGraph {
            exec: SendPtr(std::ptr::null_mut()),
            stream: SendPtr(self.streams[0].0),
            blocks,
            _uploads: uploads,
            alloc: self.alloc.clone(),
        };
        let graph = graph.map_err(|e| driver_error("stream capture", e))?;
        // SAFETY: a graph just captured; the executable copies what it needs.
        let exec = unsafe { cu::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) };
        unsafe {
            let _ = cu::graph::destroy(graph);
        }
        captured.exec = SendPtr(exec.map_err(|e| driver_error("graph instantiation", e))?);
        Ok(captured)
    }

    /// A block of at least `bytes` (one byte for empty tensors): from the
    /// cache, else from the external allocator when one is set, else from
    /// the driver; when that is out of memory the cache is emptied and the
    /// allocation tried once more.
    pub fn alloc(&self, bytes: usize) -> Result<CudaMemory, String> {
        self.bind();
        let cap = bytes.max(1).div_ceil(ROUND) * ROUND;
        let (cached, (lender, stream)) = {
            let mut pool = self.alloc.pool();
            (pool.blocks.get(cap), pool.blocks.lender())
        };
        let block = match cached {
            Some(b) => b,
            None => match self.fresh(cap, &lender, stream) {
                Ok(b) => b,
                Err(first) => {
                    self.empty_cache();
                    self.fresh(cap, &lender, stream)
                        .map_err(|e| self.out_of_memory(bytes, &lender, first, e))?
                }
            },
        };
        let live = self.alloc.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.alloc.peak.fetch_max(live, Ordering::Relaxed);
        Ok(CudaMemory {
            ptr: block.ptr,
            len: bytes,
            cap,
            block: Some(block),
            alloc: self.alloc.clone(),
        })
    }

    /// A new block of `cap` bytes from `lender` (for work on `stream`), or
    /// from the driver.
    fn fresh(
        &self,
        cap: usize,
        lender: &Option<Arc<dyn ExternalAllocator>>,
        stream: u64,
    ) -> Result<Block, String> {
        match lender {
            Some(l) => {
                let b = l.alloc(cap, stream)?;
                self.alloc.lent.fetch_add(1, Ordering::Relaxed);
                Ok(Block::external(l.clone(), b))
            }
            None => crate::profile::count_driver_alloc(|| unsafe { cu::malloc_sync(cap) })
                .map(Block::driver)
                .map_err(|e| driver_error(&format!("allocation of {cap} bytes"), e)),
        }
    }

    /// Device memory for the backend's own use (never freed, not counted).
    pub fn alloc_unaccounted(&self, bytes: usize) -> Result<u64, String> {
        self.bind();
        unsafe { cu::malloc_sync(bytes) }
            .map_err(|e| driver_error(&format!("allocation of {bytes} bytes"), e))
    }

    fn out_of_memory(
        &self,
        bytes: usize,
        lender: &Option<Arc<dyn ExternalAllocator>>,
        first: String,
        e: String,
    ) -> String {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        let from = match lender {
            Some(l) => format!("from {}", l.name()),
            None => "from the driver".to_string(),
        };
        let held = mib(self.alloc.live.load(Ordering::Relaxed));
        match cu::mem_get_info() {
            Ok((free, total)) => format!(
                "CUDA out of memory: asked {from} for {bytes} bytes ({:.1} MiB), {free} bytes ({:.1} MiB) free of {:.1} MiB; \
                 tessera holds {held:.1} MiB in live tensors ({first}; after emptying tessera's cache: {e})",
                mib(bytes),
                mib(free),
                mib(total),
            ),
            Err(_) => format!("{e} (asked {from}; before emptying tessera's cache: {first})"),
        }
    }

    /// Gives every cached free block back to the driver, page-locked host
    /// blocks too.
    pub fn empty_cache(&self) {
        self.bind();
        let pinned: Vec<usize> = {
            let mut pool = self.pinned.lock().expect("pinned pool poisoned");
            pool.cached = 0;
            pool.free.drain().flat_map(|(_, v)| v).collect()
        };
        if !pinned.is_empty() {
            // Copies queued on them may still run.
            // SAFETY: the copy stream lives as long as the process.
            let _ = unsafe { cu::stream::synchronize(self.copy_stream.0) };
            let mut pool = self.pinned.lock().expect("pinned pool poisoned");
            for p in pinned {
                pool.ours.remove(&p);
                // SAFETY: from cuMemHostAlloc, no copy uses it any more.
                unsafe {
                    let _ = cu::free_host(p as *mut c_void);
                }
            }
        }
        let blocks = self.alloc.pool().blocks.drain();
        self.free_idle(blocks);
    }

    /// Frees cached blocks once the device is idle (queued kernels may
    /// still use them): driver blocks to the driver, external ones to
    /// their lender.
    fn free_idle(&self, blocks: Vec<Block>) {
        if blocks.is_empty() {
            return;
        }
        self.bind();
        // Every lane and the copy stream: a block cached during a fork
        // may be read on any lane.
        let _ = cu::ctx::synchronize();
        let (own, lent): (Vec<Block>, Vec<Block>) =
            blocks.into_iter().partition(|b| b.lender.is_none());
        for b in own {
            // SAFETY: each block came from cuMemAlloc and is unused now.
            unsafe {
                let _ = cu::free_sync(b.ptr);
            }
        }
        self.alloc.give_back(lent);
    }

    /// New blocks come from `external` from now on (None: the driver);
    /// the cached blocks are freed (the device idle first). Blocks alive
    /// now go back to where they came from when freed.
    pub fn set_external(&self, external: Option<Arc<dyn ExternalAllocator>>) {
        let blocks = self.alloc.pool().blocks.set_external(external);
        self.free_idle(blocks);
    }

    /// A call from a library that shares the GPU starts (PyTorch's, through
    /// tessera-py): tessera's main stream waits for the work queued so far
    /// on `stream` (its inputs' producers), and until the call ends the
    /// external blocks tessera frees are cached for its own reuse.
    pub fn begin_foreign_call(&self, stream: u64) -> Result<(), String> {
        self.bind();
        let event = self.foreign_event.lock().expect("event poisoned");
        // SAFETY: live event and streams; `stream` is the caller's live
        // stream in this context. The wait takes the event's state now.
        unsafe {
            cu::event::record(event.0, stream as sys::CUstream)
                .map_err(|e| driver_error("event record on the caller's stream", e))?;
            cu::stream::wait_event(
                self.streams[0].0,
                event.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(|e| driver_error("stream wait", e))?;
        }
        self.alloc.pool().blocks.enter(stream);
        Ok(())
    }

    /// The call ends: `stream` waits for tessera's work queued so far on
    /// the main stream (every lane has joined it); then, the last call
    /// ended, the cached external blocks go back to their lender, which
    /// hands them out only to work on `stream` queued after tessera's.
    /// The blocks go back even when the wait fails (the error is
    /// returned).
    pub fn end_foreign_call(&self, stream: u64) -> Result<(), String> {
        self.bind();
        let waited = {
            let event = self.foreign_event.lock().expect("event poisoned");
            // SAFETY: as in `begin_foreign_call`.
            unsafe {
                cu::event::record(event.0, self.streams[0].0)
                    .map_err(|e| driver_error("event record", e))
                    .and_then(|_| {
                        cu::stream::wait_event(
                            stream as sys::CUstream,
                            event.0,
                            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                        )
                        .map_err(|e| driver_error("the caller's stream wait", e))
                    })
            }
        };
        if waited.is_err() {
            // Not ordered: the blocks go back only once the device is idle.
            let _ = cu::ctx::synchronize();
        }
        let back = self.alloc.pool().blocks.leave();
        self.alloc.give_back(back);
        waited
    }

    /// The allocator's counters now.
    pub fn allocator_stats(&self) -> AllocatorStats {
        let pool = self.alloc.pool();
        AllocatorStats {
            live_bytes: self.alloc.live.load(Ordering::Relaxed),
            peak_bytes: self.alloc.peak.load(Ordering::Relaxed),
            cached_bytes: pool.blocks.cached,
            external: pool.blocks.lender().0.map(|l| l.name()),
            external_allocs: self.alloc.lent.load(Ordering::Relaxed),
            external_frees: self.alloc.returned.load(Ordering::Relaxed),
        }
    }

    pub fn memory_stats(&self) -> MemoryStats {
        MemoryStats {
            live_bytes: self.alloc.live.load(Ordering::Relaxed),
            peak_bytes: self.alloc.peak.load(Ordering::Relaxed),
        }
    }

    pub fn reset_peak(&self) {
        let live = self.alloc.live.load(Ordering::Relaxed);
        self.alloc.peak.store(live, Ordering::Relaxed);
    }

    /// Waits for the current lane's work (and what it waits for).
    /// How many times the host waited for the device (synchronisations,
    /// downloads): what a stream capture cannot record.
    pub fn host_waits(&self) -> u64 {
        self.host_waits.load(Ordering::Relaxed)
    }

    pub fn synchronize(&self) -> Result<(), String> {
        self.bind();
        self.host_waits.fetch_add(1, Ordering::Relaxed);
        let _waiting = crate::profile::Wait::start();
        unsafe { cu::stream::synchronize(self.stream()) }
            .map_err(|e| driver_error("synchronize", e))
    }

    pub fn upload(&self, dst: u64, bytes: &[u8]) -> Result<(), String> {
        self.bind();
        if bytes.is_empty() {
            return Ok(());
        }
        // SAFETY: dst holds at least bytes.len() bytes. From pageable
        // host memory the driver stages the bytes before the call returns
        // (CUDA's "API synchronization behavior": an asynchronous copy from
        // pageable memory is staged immediately), so the slice may go at
        // once and the host need not wait for the device: an upload in the
        // middle of a step (a constant, a host scalar) does not drain the
        // queue.
        let _waiting = crate::profile::Wait::start();
        // While capturing, the copy is recorded, not run: its node reads
        // the source on every replay, long after `bytes` is gone (a
        // constant, a host scalar). It reads a pinned copy the graph owns.
        let mut pool = self.alloc.pool();
        if pool.blocks.capturing() {
            let pinned = PinnedBytes::copy_of(bytes)?;
            let r = unsafe {
                cu::memcpy_htod_async(dst, pinned.bytes(bytes.len()), self.stream())
                    .map_err(|e| driver_error("copy to the device", e))
            };
            pool.capture_uploads.push(pinned);
            return r;
        }
        drop(pool);
        unsafe {
            cu::memcpy_htod_async(dst, bytes, self.stream())
                .map_err(|e| driver_error("copy to the device", e))
        }
    }

    pub fn download(&self, dst: &mut [u8], src: u64) -> Result<(), String> {
        self.bind();
        if dst.is_empty() {
            return Ok(());
        }
        // SAFETY: src holds at least dst.len() bytes; synchronized below.
        unsafe {
            cu::memcpy_dtoh_async(dst, src, self.stream())
                .map_err(|e| driver_error("copy to the host", e))?;
        }
        self.synchronize()
    }

    /// Device-to-device copy, queued.
    pub fn copy(&self, dst: u64, src: u64, bytes: usize) -> Result<(), String> {
        self.bind();
        if bytes == 0 {
            return Ok(());
        }
        unsafe { cu::memcpy_dtod_async(dst, src, bytes, self.stream()) }
            .map_err(|e| driver_error("device copy", e))
    }

    /// Whether a capture is recording (see [`Gpu::begin_capture`]).
    fn capturing(&self) -> bool {
        self.alloc.pool().blocks.capturing()
    }

    /// An event for a copy in flight (from the reused ones).
    fn copy_event(&self) -> Result<CopyEvent, String> {
        let reused = self.copy_events.lock().expect("events poisoned").pop();
        let event = match reused {
            Some(e) => e,
            None => SendPtr(
                cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| driver_error("event creation", e))?,
            ),
        };
        Ok(CopyEvent {
            event,
            free: self.copy_events.clone(),
        })
    }

    /// The copy stream waits for the work queued so far on the current
    /// lane (a value's producer; the last readers of a block the cache
    /// hands to the copy).
    fn copy_after_compute(&self) -> Result<(), String> {
        let start = self.copy_event()?;
        // SAFETY: live streams and event; the wait takes the event's state
        // now, so the event may be recorded again once it returns.
        unsafe {
            cu::event::record(start.event.0, self.stream())
                .map_err(|e| driver_error("event record", e))?;
            cu::stream::wait_event(
                self.copy_stream.0,
                start.event.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
            .map_err(|e| driver_error("stream wait", e))
        }
    }

    /// Starts copying `bytes` at device address `src` into page-locked
    /// host memory, on the copy stream after the work queued so far on
    /// the current lane: the host block and the copy's event. Nothing is
    /// waited for on the host. An error while a capture records (a copy
    /// to the host cannot be replayed into a value the caller holds), which
    /// fails the capture: that run goes kernel by kernel.
    pub fn offload_start(
        &self,
        src: u64,
        bytes: usize,
    ) -> Result<(PinnedBlock, CopyEvent), String> {
        self.bind();
        if self.capturing() {
            return Err("an offload to host memory cannot be recorded in a CUDA graph".into());
        }
        let block = PinnedBlock::take(&self.pinned, bytes)?;
        self.copy_after_compute()?;
        let done = self.copy_event()?;
        // SAFETY: `block` holds at least `bytes` bytes, which no host code
        // touches until `done` completes (its storage waits for it); `src`
        // holds `bytes` bytes, kept by the caller until the compute waits
        // for `done`.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(block.ptr as *mut u8, bytes);
            cu::memcpy_dtoh_async(dst, src, self.copy_stream.0)
                .map_err(|e| driver_error("copy to the host", e))?;
            cu::event::record(done.event.0, self.copy_stream.0)
                .map_err(|e| driver_error("event record", e))?;
        }
        Ok((block, done))
    }

    /// Starts copying `bytes` of page-locked host memory at `src` (one of
    /// [`Gpu::offload_start`]'s blocks, whose copy is queued before on the
    /// same stream) to device address `dst`, on the copy stream after the
    /// work queued so far on the current lane: the copy's event. An error
    /// while a capture records.
    pub fn prefetch_start(
        &self,
        dst: u64,
        src: *const u8,
        bytes: usize,
    ) -> Result<CopyEvent, String> {
        self.bind();
        if self.capturing() {
            return Err("a prefetch from host memory cannot be recorded in a CUDA graph".into());
        }
        self.copy_after_compute()?;
        let done = self.copy_event()?;
        // SAFETY: `src` holds `bytes` bytes the caller keeps until the
        // compute waited for `done` (later copies into it queue behind on
        // this stream); `dst` holds `bytes` bytes, read only after a wait.
        unsafe {
            let from = std::slice::from_raw_parts(src, bytes);
            cu::memcpy_htod_async(dst, from, self.copy_stream.0)
                .map_err(|e| driver_error("copy to the device", e))?;
            cu::event::record(done.event.0, self.copy_stream.0)
                .map_err(|e| driver_error("event record", e))?;
        }
        Ok(done)
    }

    /// The work queued on the current lane from now on (`main`: on the
    /// main stream) waits for the copy of `done` (no host wait).
    pub fn wait_copy(&self, done: &CopyEvent, main: bool) -> Result<(), String> {
        self.bind();
        let stream = match main {
            true => self.streams[0].0,
            false => self.stream(),
        };
        // SAFETY: live stream and event.
        unsafe {
            cu::stream::wait_event(
                stream,
                done.event.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| driver_error("stream wait", e))
    }

    /// The host waits for the copy of `done` (an offloaded value read on
    /// the host).
    pub fn host_wait(&self, done: &CopyEvent) -> Result<(), String> {
        self.bind();
        self.host_waits.fetch_add(1, Ordering::Relaxed);
        let _waiting = crate::profile::Wait::start();
        // SAFETY: a live event.
        unsafe { cu::event::synchronize(done.event.0) }.map_err(|e| driver_error("event wait", e))
    }

    /// Whether `ptr` is the start of one of the page-locked blocks of
    /// [`Gpu::offload_start`].
    pub fn is_pinned_block(&self, ptr: *const u8) -> bool {
        self.pinned
            .lock()
            .expect("pinned pool poisoned")
            .ours
            .contains(&(ptr as usize))
    }

    /// The event of `slot`, created on first use.
    fn slot(&self, slot: usize) -> Result<sys::CUevent, String> {
        let mut slots = self.slots.lock().expect("slots poisoned");
        while slots.len() <= slot {
            slots.push(SendPtr(
                cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                    .map_err(|e| driver_error("event creation", e))?,
            ));
        }
        Ok(slots[slot].0)
    }

    /// Records event `slot` on the current lane's stream.
    pub fn record(&self, slot: usize) -> Result<(), String> {
        self.bind();
        let event = self.slot(slot)?;
        // SAFETY: live event and stream.
        unsafe { cu::event::record(event, self.stream()) }
            .map_err(|e| driver_error("event record", e))
    }

    /// The current lane's stream waits for event `slot`'s last record.
    pub fn wait_for(&self, slot: usize) -> Result<(), String> {
        self.bind();
        let event = self.slot(slot)?;
        // SAFETY: live event and stream.
        unsafe {
            cu::stream::wait_event(
                self.stream(),
                event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| driver_error("stream wait", e))
    }

    /// The loaded function for `source`, compiled on first use (see
    /// [`compiler::module`]).
    fn function(&self, source: &str) -> Result<sys::CUfunction, String> {
        let program = Program::new(source);
        let key = program.key(&self.target);
        compiler::module(self.context.0, &key, &program, &self.target)?.function(ENTRY, 0)
    }

    /// Queues `launch` on the stream.
    pub fn launch(&self, launch: &Launch) -> Result<(), String> {
        self.bind();
        let f = self.function(&launch.source)?;
        self.launch_function(f, launch)
    }

    /// Queues the launch that `make` generates, memoised: `key` encodes
    /// every input of the generator except the device addresses, which
    /// are `ptrs` (their low bits, which alignment checks read, are part
    /// of the key here). The first time, `make` runs twice on two sets of
    /// stand-in addresses that keep those low bits, the argument words
    /// that differ (an address plus any offset the generator added) are
    /// noted, and the kernel is loaded; every launch then patches the real
    /// addresses into a copy of the kept arguments. Generating a kernel's source and hashing it
    /// to find its module costs tens of µs of host time (a 27-step AdamW
    /// update: ~90 µs), more than many kernels take on the device, and a
    /// compiled step runs the same kernels every call, on buffers that
    /// need not be the same ones.
    pub fn launch_memoised(
        &self,
        mut key: Vec<u64>,
        ptrs: &[u64],
        make: impl Fn(&[u64]) -> Result<Launch, String>,
    ) -> Result<(), String> {
        self.bind();
        key.push(ptrs.len() as u64);
        key.extend(ptrs.iter().map(|p| p & ALIGN_BITS));
        let kept = self.memo.lock().expect("memo poisoned").get(&key).cloned();
        crate::profile::count_memo(kept.is_some());
        let entry = match kept {
            Some(e) => e,
            None => {
                let Some((launch, slots)) = address_slots(ptrs, &make)? else {
                    return self.launch(&make(ptrs)?);
                };
                let function = SendPtr(self.function(&launch.source)?);
                let entry = Arc::new(Memoised {
                    launch,
                    slots,
                    function,
                });
                let mut memo = self.memo.lock().expect("memo poisoned");
                if memo.len() >= MEMO_ENTRIES {
                    memo.clear();
                }
                memo.insert(key, entry.clone());
                entry
            }
        };
        let mut words = entry.launch.args.0.clone();
        for &(w, i, delta) in &entry.slots {
            words[w] = ptrs[i].wrapping_add(delta);
        }
        self.launch_words(entry.function.0, &entry.launch, words)
    }

    fn launch_function(&self, f: sys::CUfunction, launch: &Launch) -> Result<(), String> {
        self.launch_words(f, launch, launch.args.0.clone())
    }

    /// Queues `f` with `launch`'s grid and block and `words` for arguments.
    fn launch_words(
        &self,
        f: sys::CUfunction,
        launch: &Launch,
        mut words: Vec<u64>,
    ) -> Result<(), String> {
        let mut params = [words.as_mut_ptr() as *mut c_void];
        // SAFETY: the kernel takes one struct of `words.len()` 8-byte
        // fields, packed in this order by the generator; the driver copies
        // the parameters before returning.
        crate::profile::in_driver(crate::profile::Queued::Kernel, || unsafe {
            cu::launch_kernel(
                f,
                (launch.grid.max(1), 1, 1),
                (launch.block, 1, 1),
                0,
                self.stream(),
                &mut params,
            )
        })
        .map_err(|e| driver_error("kernel launch", e))
    }
}

/// Mean seconds per call of `enqueue` (which queues work on `stream`), over
/// `reps` calls after one warm-up, measured with events on the stream (the
/// autotuner's clock).
pub fn time_on_stream(
    stream: sys::CUstream,
    reps: usize,
    mut enqueue: impl FnMut() -> Result<(), String>,
) -> Result<f64, String> {
    let event = || {
        cu::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| driver_error("event creation", e))
    };
    let (start, end) = (event()?, event()?);
    let timed = (|| {
        enqueue()?;
        // SAFETY: both events and the stream are live; the events are
        // destroyed only after the synchronisation below.
        unsafe { cu::event::record(start, stream) }.map_err(|e| driver_error("event", e))?;
        for _ in 0..reps.max(1) {
            enqueue()?;
        }
        unsafe {
            cu::event::record(end, stream).map_err(|e| driver_error("event", e))?;
            cu::event::synchronize(end).map_err(|e| driver_error("event", e))?;
            cu::event::elapsed(start, end).map_err(|e| driver_error("event timing", e))
        }
    })();
    // SAFETY: nothing waits on the events any more.
    unsafe {
        let _ = cu::event::destroy(start);
        let _ = cu::event::destroy(end);
    }
    Ok(timed? as f64 * 1e-3 / reps.max(1) as f64)
}

/// The event of a copy on the copy stream; dropping it gives the event
/// back for reuse.
pub struct CopyEvent {
    event: SendPtr<sys::CUevent>,
    free: Arc<Mutex<Vec<SendPtr<sys::CUevent>>>>,
}

impl Drop for CopyEvent {
    fn drop(&mut self) {
        if let Ok(mut free) = self.free.lock() {
            free.push(SendPtr(self.event.0));
        }
    }
}

/// Page-locked host blocks by rounded size, and their accounting.
#[derive(Default)]
pub struct PinnedPool {
    free: HashMap<usize, Vec<usize>>,
    cached: usize,
    /// Every block allocated (live or cached), by address.
    ours: std::collections::HashSet<usize>,
    live: usize,
    peak: usize,
}

impl PinnedPool {
    /// Bytes of offloaded values in page-locked host memory now and at
    /// most since the last [`PinnedPool::reset_peak`].
    pub fn stats(&self) -> MemoryStats {
        MemoryStats {
            live_bytes: self.live,
            peak_bytes: self.peak,
        }
    }

    pub fn reset_peak(&mut self) {
        self.peak = self.live;
    }
}

/// A page-locked host block of the pool: dropping it gives it back (copies
/// into it are queued on the copy stream, behind any copy that reads it).
pub struct PinnedBlock {
    pub ptr: usize,
    len: usize,
    cap: usize,
    pool: Arc<Mutex<PinnedPool>>,
}

impl PinnedBlock {
    /// A block of at least `bytes`: a cached one, else a new one.
    fn take(pool: &Arc<Mutex<PinnedPool>>, bytes: usize) -> Result<PinnedBlock, String> {
        let cap = bytes.max(1).div_ceil(ROUND) * ROUND;
        let cached = {
            let mut p = pool.lock().expect("pinned pool poisoned");
            let got = p.free.get_mut(&cap).and_then(Vec::pop);
            if got.is_some() {
                p.cached -= cap;
            }
            got
        };
        let ptr = match cached {
            Some(p) => p,
            None => {
                // SAFETY: a fresh allocation, owned by the pool from now on.
                let p = unsafe { cu::malloc_host(cap, 0) }.map_err(|e| {
                    driver_error(&format!("page-locked host allocation of {cap} bytes"), e)
                })?;
                pool.lock()
                    .expect("pinned pool poisoned")
                    .ours
                    .insert(p as usize);
                p as usize
            }
        };
        let mut p = pool.lock().expect("pinned pool poisoned");
        p.live += bytes;
        p.peak = p.peak.max(p.live);
        Ok(PinnedBlock {
            ptr,
            len: bytes,
            cap,
            pool: pool.clone(),
        })
    }
}

impl Drop for PinnedBlock {
    fn drop(&mut self) {
        if let Ok(mut p) = self.pool.lock() {
            p.live -= self.len;
            p.cached += self.cap;
            p.free.entry(self.cap).or_default().push(self.ptr);
        }
    }
}

/// A block of device memory; dropping it returns the block to the cache
/// (or to the external allocator it came from, see `pool.rs`).
pub struct CudaMemory {
    ptr: u64,
    len: usize,
    cap: usize,
    /// Taken when dropped.
    block: Option<Block>,
    alloc: Arc<Allocator>,
}

impl DeviceMemory for CudaMemory {
    fn ptr(&self) -> u64 {
        self.ptr
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for CudaMemory {
    fn drop(&mut self) {
        self.alloc.live.fetch_sub(self.len, Ordering::Relaxed);
        let Some(block) = self.block.take() else {
            return;
        };
        let back = match self.alloc.pool.lock() {
            Ok(mut pool) => pool.blocks.put(self.cap, block),
            Err(_) => None,
        };
        self.alloc.give_back(back.into_iter().collect());
    }
}

/// Captured work, instantiated: replays queue it on the main stream. It
/// owns the blocks its capture freed (its replays write them).
pub struct CudaGraph {
    exec: SendPtr<sys::CUgraphExec>,
    stream: SendPtr<sys::CUstream>,
    blocks: Vec<(usize, Block)>,
    /// The host bytes its upload nodes read (freed after `exec`, in Drop).
    _uploads: Vec<PinnedBytes>,
    alloc: Arc<Allocator>,
}

impl CudaGraph {
    /// Queues the captured work once more.
    pub fn replay(&self) -> Result<(), String> {
        // SAFETY: a live executable graph and stream.
        unsafe { cu::graph::launch(self.exec.0, self.stream.0) }
            .map_err(|e| driver_error("graph launch", e))
    }
}

impl Drop for CudaGraph {
    fn drop(&mut self) {
        if !self.exec.0.is_null() {
            // SAFETY: instantiated in end_capture; a replay in flight is
            // freed by the driver when it completes.
            unsafe {
                let _ = cu::graph::exec_destroy(self.exec.0);
            }
        }
        // Work queued later on the main stream runs after the replays.
        let blocks = std::mem::take(&mut self.blocks);
        let back = match self.alloc.pool.lock() {
            Ok(mut pool) => pool.blocks.put_all(blocks),
            Err(_) => Vec::new(),
        };
        self.alloc.give_back(back);
    }
}

// The allocator's mutex poisons only if a thread panicked holding it,
// which the short critical sections above never do.
impl std::panic::RefUnwindSafe for Allocator {}

#[cfg(test)]
mod memo_tests {
    use super::*;
    use crate::codegen::Words;

    fn launch(source: &str, words: &[u64]) -> Launch {
        Launch {
            source: source.to_string(),
            args: Words(words.to_vec()),
            grid: 1,
            block: 32,
        }
    }

    /// The words holding addresses (with an offset added) are found; the
    /// sizes beside them, equal in both generations, are not.
    #[test]
    fn address_words_are_found_with_their_offsets() {
        let make = |p: &[u64]| Ok(launch("k", &[7, p[1] + 64, 9, p[0]]));
        let (l, slots) = address_slots(&[0x1000, 0x2010], make)
            .unwrap()
            .expect("memoisable");
        assert_eq!(slots, vec![(1, 1, 64), (3, 0, 0)]);
        assert_eq!(l.args.0[0], 7);
        // Patched as `launch_memoised` does: the real addresses back.
        let mut words = l.args.0.clone();
        let ptrs = [0xa000u64, 0xb010];
        for &(w, i, delta) in &slots {
            words[w] = ptrs[i].wrapping_add(delta);
        }
        assert_eq!(words, vec![7, 0xb010 + 64, 9, 0xa000]);
        // The low bits (alignment) reach the generator unchanged.
        let seen = std::sync::Mutex::new(Vec::new());
        let _ = address_slots(&[0x1008], |p: &[u64]| {
            seen.lock().unwrap().push(p[0] & ALIGN_BITS);
            Ok(launch("k", &[p[0]]))
        });
        assert_eq!(*seen.lock().unwrap(), vec![0x8, 0x8]);
    }

    /// A generator whose source depends on an address beyond its low bits
    /// is not memoised.
    #[test]
    fn an_address_in_the_source_is_not_memoised() {
        let make = |p: &[u64]| Ok(launch(&format!("k{}", p[0]), &[p[0]]));
        assert!(address_slots(&[0x1000], make).unwrap().is_none());
    }
}
