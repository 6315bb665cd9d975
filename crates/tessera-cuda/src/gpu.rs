//! The GPU: its context and stream, the caching allocator with tessera's
//! live/peak accounting, host<->device copies and kernel launches.
//!
//! All work goes to one stream, in order. That is what makes the cache
//! safe without events: a block freed while a queued kernel still reads it
//! is handed out again only to work queued after that kernel.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result as cu, sys};
use tessera::logging;
use tessera::runtime::cpu::MemoryStats;
use tessera::runtime::device::DeviceMemory;

use crate::codegen::{Launch, ENTRY};
use crate::compiler;

/// A driver error as a one-line message.
pub fn driver_error(what: &str, e: cu::DriverError) -> String {
    let name = e
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    format!("CUDA {what} failed: {name}")
}

/// Blocks are rounded to this many bytes (as PyTorch's allocator does), so
/// that tensors of nearby sizes share cached blocks.
const ROUND: usize = 512;

/// Free blocks by rounded size.
#[derive(Default)]
struct Pool {
    free: HashMap<usize, Vec<u64>>,
    cached: usize,
}

/// Device memory accounting and the cache of free blocks.
pub struct Allocator {
    pool: Mutex<Pool>,
    live: AtomicUsize,
    peak: AtomicUsize,
}

struct SendPtr<T>(T);
// SAFETY: CUDA handles (function, stream, context) may be used from any
// thread once the context is current there (see `Gpu::bind`).
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

/// The device, one context and one stream.
pub struct Gpu {
    context: SendPtr<sys::CUcontext>,
    stream: SendPtr<sys::CUstream>,
    /// `sm_90` on Hopper.
    pub target: String,
    pub sms: u32,
    pub name: String,
    pub alloc: Arc<Allocator>,
    functions: Mutex<HashMap<String, SendPtr<sys::CUfunction>>>,
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
        let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
            .map_err(|e| driver_error("stream creation", e))?;
        let gpu = Gpu {
            context: SendPtr(context),
            stream: SendPtr(stream),
            target: format!("sm_{major}{minor}"),
            sms: sms as u32,
            name,
            alloc: Arc::new(Allocator {
                pool: Mutex::new(Pool::default()),
                live: AtomicUsize::new(0),
                peak: AtomicUsize::new(0),
            }),
            functions: Mutex::new(HashMap::new()),
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

    pub fn stream(&self) -> sys::CUstream {
        self.stream.0
    }

    /// A block of at least `bytes` (one byte for empty tensors): from the
    /// cache, else from the driver; when the driver is out of memory the
    /// cache is emptied and the allocation tried once more.
    pub fn alloc(&self, bytes: usize) -> Result<CudaMemory, String> {
        self.bind();
        let cap = bytes.max(1).div_ceil(ROUND) * ROUND;
        let cached = {
            let mut pool = self.alloc.pool.lock().expect("pool poisoned");
            let p = pool.free.get_mut(&cap).and_then(Vec::pop);
            if p.is_some() {
                pool.cached -= cap;
            }
            p
        };
        let ptr = match cached {
            Some(p) => p,
            None => match unsafe { cu::malloc_sync(cap) } {
                Ok(p) => p,
                Err(_) => {
                    self.empty_cache();
                    unsafe { cu::malloc_sync(cap) }.map_err(|e| self.out_of_memory(bytes, e))?
                }
            },
        };
        let live = self.alloc.live.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.alloc.peak.fetch_max(live, Ordering::Relaxed);
        Ok(CudaMemory {
            ptr,
            len: bytes,
            cap,
            alloc: self.alloc.clone(),
        })
    }

    /// Device memory for the backend's own use (never freed, not counted).
    pub fn alloc_unaccounted(&self, bytes: usize) -> Result<u64, String> {
        self.bind();
        unsafe { cu::malloc_sync(bytes) }
            .map_err(|e| driver_error(&format!("allocation of {bytes} bytes"), e))
    }

    fn out_of_memory(&self, bytes: usize, e: cu::DriverError) -> String {
        let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
        match cu::mem_get_info() {
            Ok((free, total)) => format!(
                "CUDA out of memory: asked for {bytes} bytes ({:.1} MiB), {free} bytes ({:.1} MiB) free of {:.1} MiB; \
                 tessera holds {:.1} MiB in live tensors",
                mib(bytes),
                mib(free),
                mib(total),
                mib(self.alloc.live.load(Ordering::Relaxed))
            ),
            Err(_) => driver_error(&format!("allocation of {bytes} bytes"), e),
        }
    }

    /// Gives every cached free block back to the driver.
    pub fn empty_cache(&self) {
        self.bind();
        let blocks: Vec<u64> = {
            let mut pool = self.alloc.pool.lock().expect("pool poisoned");
            pool.cached = 0;
            pool.free.drain().flat_map(|(_, v)| v).collect()
        };
        if blocks.is_empty() {
            return;
        }
        // Queued kernels may still use them.
        let _ = self.synchronize();
        for p in blocks {
            // SAFETY: each block came from cuMemAlloc and is unused now.
            unsafe {
                let _ = cu::free_sync(p);
            }
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

    pub fn synchronize(&self) -> Result<(), String> {
        self.bind();
        unsafe { cu::stream::synchronize(self.stream()) }
            .map_err(|e| driver_error("synchronize", e))
    }

    pub fn upload(&self, dst: u64, bytes: &[u8]) -> Result<(), String> {
        self.bind();
        if bytes.is_empty() {
            return Ok(());
        }
        // SAFETY: dst holds at least bytes.len() bytes; the host slice
        // lives until the stream is synchronized below.
        unsafe {
            cu::memcpy_htod_async(dst, bytes, self.stream())
                .map_err(|e| driver_error("copy to the device", e))?;
        }
        self.synchronize()
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

    /// The loaded function for `source`, compiled on first use (printed
    /// under `TESSERA_LOGS=output_code`).
    fn function(&self, source: &str) -> Result<sys::CUfunction, String> {
        let key = compiler::source_hash(source, &self.target);
        if let Some(f) = self.functions.lock().expect("poisoned").get(&key) {
            return Ok(f.0);
        }
        logging::log("output_code", || {
            format!("kernel {key} for {}:\n{source}", self.target)
        });
        let image = compiler::compile(source, &self.target)?;
        let mut image = image;
        image.push(0);
        // SAFETY: a complete cubin (or NUL-terminated PTX) image.
        let module = unsafe { cu::module::load_data(image.as_ptr() as *const c_void) }
            .map_err(|e| driver_error("module load", e))?;
        let name = CString::new(ENTRY).expect("no NUL");
        let f = unsafe { cu::module::get_function(module, name) }
            .map_err(|e| driver_error("kernel lookup", e))?;
        self.functions
            .lock()
            .expect("poisoned")
            .insert(key, SendPtr(f));
        Ok(f)
    }

    /// Queues `launch` on the stream.
    pub fn launch(&self, launch: &Launch) -> Result<(), String> {
        self.bind();
        let f = self.function(&launch.source)?;
        let mut words = launch.args.0.clone();
        let mut params = [words.as_mut_ptr() as *mut c_void];
        // SAFETY: the kernel takes one struct of `words.len()` 8-byte
        // fields, packed in this order by the generator; the driver copies
        // the parameters before returning.
        unsafe {
            cu::launch_kernel(
                f,
                (launch.grid.max(1), 1, 1),
                (launch.block, 1, 1),
                0,
                self.stream(),
                &mut params,
            )
        }
        .map_err(|e| driver_error("kernel launch", e))
    }
}

/// A block of device memory; dropping it returns the block to the cache.
pub struct CudaMemory {
    ptr: u64,
    len: usize,
    cap: usize,
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
        if let Ok(mut pool) = self.alloc.pool.lock() {
            pool.cached += self.cap;
            pool.free.entry(self.cap).or_default().push(self.ptr);
        }
    }
}

// The allocator's mutex poisons only if a thread panicked holding it,
// which the short critical sections above never do.
impl std::panic::RefUnwindSafe for Allocator {}
