//! The CUDA backend of tessera.
//!
//! [`register`] opens GPU 0 and makes it the backend of
//! `Device::Cuda`: from then on `tensor.to_device("cuda")` moves a tensor
//! there, eager ops on device tensors run here, and compiled programs run
//! their kernels here when their inputs live here.
//!
//! - [`codegen`]: CUDA C for every kernel (pointwise from the fusion plan's
//!   step lists, the fusion plan's row kernels — reductions and softmax with
//!   their pointwise producers and consumers — as one kernel each,
//!   reductions, softmax, indexing), plain strings;
//! - [`compiler`]: NVRTC for the device's architecture, the one compiler of
//!   every kernel (generated or flash attention's), cached by source hash on
//!   disk and as loaded modules in memory; `TESSERA_LOGS=output_code` prints
//!   sources;
//! - `gpu`: context, stream, caching allocator (live/peak accounting,
//!   out-of-memory as an error), copies, launches;
//! - `pool`: the allocator's cache of free blocks and its rules, and the
//!   [`ExternalAllocator`] a host library may lend tessera its device
//!   memory through (PyTorch's, under tessera-py);
//! - `ops`: each IR op to its kernel (pointwise, reductions and rows,
//!   matmul, indexing, memory);
//! - `matmul`: cuBLASLt (f32, f16, bf16 with f32 accumulation; f64),
//!   batched, transposed operands, bias/activation epilogues;
//! - [`cudnn`]: convolutions (forward and both gradients) through cuDNN,
//!   the direct kernels of `codegen::conv` as the fallback;
//! - [`flash`]: the flash attention kernels' launcher (`flash_op`: their
//!   custom-op slot).
//!
//! Everything is loaded dynamically: the crate builds and links with no
//! CUDA installed, and every entry point checks for the driver and
//! libraries first and reports their absence as an error.

pub mod autotune;
pub mod codegen;
pub mod compiler;
pub mod cudnn;
mod cudnn_lib;
pub mod flash;
mod flash_op;
mod gpu;
mod kernel_errors;
mod matmul;
#[cfg(feature = "nccl")]
pub mod nccl;
mod ops;
mod pool;
pub mod profile;

use std::sync::{Arc, OnceLock};

use tessera::error::{Error, ErrorKind, Result};
use tessera::ir::kernel::{FusedKernel, RowKernel};
use tessera::ir::{DType, Op};
use tessera::runtime::array::Array;
use tessera::runtime::cpu::{MemoryStats, Storage};
use tessera::runtime::device::{
    self, Backend, Device, DeviceBackend, DeviceGraph, DeviceStorage, FusedArg, Transfer,
};
use tessera::tensor::Layout;
use tessera::Tensor;

pub use gpu::AllocatorStats;
pub use matmul::Epilogue;
pub use pool::{ExternalAllocator, ExternalBlock};

/// The CUDA backend: one GPU, one stream.
pub struct CudaBackend {
    gpu: gpu::Gpu,
    blas: matmul::Blas,
    dnn: cudnn::Dnn,
}

static BACKEND: OnceLock<std::result::Result<Arc<CudaBackend>, String>> = OnceLock::new();

/// The backend for GPU 0, opened on first use. Errors (one line) when the
/// CUDA driver or NVRTC is missing or no GPU is visible.
pub fn backend() -> Result<Arc<CudaBackend>> {
    BACKEND
        .get_or_init(|| {
            gpu::Gpu::open().map(|gpu| {
                Arc::new(CudaBackend {
                    gpu,
                    blas: matmul::Blas::default(),
                    dnn: cudnn::Dnn::default(),
                })
            })
        })
        .clone()
        .map_err(|m| Error::new(ErrorKind::Device, m))
}

/// Opens GPU 0 and registers it as `Device::Cuda`.
pub fn register() -> Result<()> {
    let b = backend()?;
    device::register(b)?;
    ops::cross_entropy::register()?;
    ops::conv::register()?;
    #[cfg(feature = "nccl")]
    nccl::register()?;
    flash_op::register()
}

impl CudaBackend {
    /// The device's compute capability, from its target (`sm_90` → (9, 0)).
    pub(crate) fn compute_capability(&self) -> (i32, i32) {
        let digits = self.gpu.target.trim_start_matches("sm_");
        let (major, minor) = digits.split_at(digits.len().saturating_sub(1));
        (major.parse().unwrap_or(0), minor.parse().unwrap_or(0))
    }

    /// Bytes of offloaded values in page-locked host memory: now, and the
    /// most at once since the last `reset_peak`.
    pub fn host_memory_stats(&self) -> MemoryStats {
        self.gpu
            .pinned
            .lock()
            .map(|p| p.stats())
            .unwrap_or(MemoryStats {
                live_bytes: 0,
                peak_bytes: 0,
            })
    }

    /// The CUDA stream (a `CUstream`, as an integer) that tessera queues
    /// its work on between calls. A library sharing the GPU (PyTorch through
    /// tessera-py) orders its own streams against this one with events
    /// (`torch.cuda.ExternalStream`), so that neither reads memory the other
    /// is still writing, and no host synchronisation is needed.
    pub fn stream_handle(&self) -> u64 {
        self.gpu.stream() as u64
    }

    /// New device memory comes from `external` from now on (None: the
    /// driver, through tessera's own cache): PyTorch's caching allocator
    /// under tessera-py, so that one pool serves both libraries. Cached
    /// blocks are freed first; blocks alive go back where they came from.
    /// See [`ExternalAllocator`] for the stream rule.
    pub fn set_external_allocator(&self, external: Option<Arc<dyn ExternalAllocator>>) {
        self.gpu.set_external(external)
    }

    /// A call from a library sharing the GPU starts: tessera's work waits
    /// for what the caller queued on `stream` (a `CUstream` as an integer,
    /// 0 the legacy default stream), and external blocks tessera frees are
    /// kept for its own reuse until [`CudaBackend::end_foreign_call`].
    pub fn begin_foreign_call(&self, stream: u64) -> Result<()> {
        self.gpu.begin_foreign_call(stream).map_err(device_error)
    }

    /// The call ends: `stream` waits for tessera's work, then the external
    /// blocks kept during the call go back to their allocator. Call it
    /// once per [`CudaBackend::begin_foreign_call`], on errors too.
    pub fn end_foreign_call(&self, stream: u64) -> Result<()> {
        self.gpu.end_foreign_call(stream).map_err(device_error)
    }

    /// Live, peak and cached bytes, and where new blocks come from.
    pub fn allocator_stats(&self) -> AllocatorStats {
        self.gpu.allocator_stats()
    }

    /// The GPU's name and architecture, e.g. `NVIDIA H100 80GB HBM3 (sm_90)`.
    pub fn describe(&self) -> String {
        format!(
            "{} ({}, {} SMs)",
            self.gpu.name, self.gpu.target, self.gpu.sms
        )
    }

    /// `epilogue(a·b + bias)` in one cuBLASLt call: `a` `[.., m, k]`, `b`
    /// `[.., k, n]` (batch dims broadcast), `bias` `[n]` of their dtype.
    pub fn matmul_epilogue(
        &self,
        a: &Tensor,
        b: &Tensor,
        bias: Option<&Tensor>,
        epilogue: Epilogue,
    ) -> Result<Tensor> {
        let ty = Op::MatMul.infer(&[a.ty(), b.ty()])?;
        let shape = ty.shape.as_concrete().expect("concrete inputs");
        for t in [Some(a), Some(b), bias].into_iter().flatten() {
            if t.device() != Device::Cuda {
                return Err(Error::op(
                    ErrorKind::Argument,
                    "matmul_epilogue",
                    format!(
                        "{} is on {}: move it with .to_device(\"cuda\")",
                        t.ty(),
                        t.device()
                    ),
                ));
            }
        }
        if let Some(bias) = bias {
            let n = *shape.last().unwrap_or(&1);
            if bias.shape() != [n] || bias.dtype() != a.dtype() || !bias.is_contiguous() {
                return Err(Error::op(
                    ErrorKind::Shape,
                    "matmul_epilogue",
                    format!(
                        "the bias must be a contiguous [{n}] of {}, got {}",
                        a.dtype(),
                        bias.ty()
                    ),
                ));
            }
        }
        let out = self.matmul(
            "matmul_epilogue",
            a.array(),
            b.array(),
            false,
            false,
            &shape,
            bias.map(Tensor::array),
            epilogue,
        )?;
        Ok(Tensor::from_array(out))
    }
}

impl Backend for CudaBackend {
    fn device(&self) -> Device {
        Device::Cuda
    }

    fn eval(&self, op: &Op, inputs: &[&Array], dtype: DType, shape: &[usize]) -> Result<Array> {
        let name = || match op {
            Op::Reduce { dims, .. } => format!("{}{dims:?}", op.name()),
            _ if inputs.is_empty() => format!("{} -> {dtype}{shape:?}", op.name()),
            _ => op.name().to_string(),
        };
        profile::timed(self, name, inputs, || {
            self.eval_op(op, inputs, dtype, shape)
        })
    }

    fn run_fused(&self, kernel: &FusedKernel, inputs: Vec<FusedArg<'_>>) -> Result<Vec<Array>> {
        let name = || profile::fused_name(kernel);
        let donated: Vec<(usize, usize)> = inputs
            .iter()
            .enumerate()
            .filter_map(|(i, a)| match a {
                FusedArg::Donated { output, .. } => Some((i, *output)),
                FusedArg::Shared(_) => None,
            })
            .collect();
        let arrays: Vec<&Array> = inputs.iter().map(FusedArg::array).collect();
        profile::timed(self, name, &arrays, || {
            self.fused(kernel, &arrays, &donated)
        })
    }

    fn matmul_bias(
        &self,
        op: &Op,
        a: &Array,
        b: &Array,
        bias: &Array,
        shape: &[usize],
    ) -> Option<Result<Array>> {
        let (ta, tb) = match op {
            Op::MatMul => (false, false),
            Op::MatMulT {
                transpose_a,
                transpose_b,
            } => (*transpose_a, *transpose_b),
            _ => return None,
        };
        let dtype = a.dtype();
        let fits = [a, b, bias].iter().all(|t| t.device() == Device::Cuda)
            && b.dtype() == dtype
            && bias.dtype() == dtype
            && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
            && bias.shape() == [*shape.last()?]
            && bias.is_contiguous();
        if !fits {
            return None;
        }
        let name = "matmul+bias";
        Some(profile::timed(
            self,
            || name.to_string(),
            &[a, b, bias],
            || self.matmul(name, a, b, ta, tb, shape, Some(bias), Epilogue::None),
        ))
    }

    fn row_kernel_refusal(&self, kernel: &RowKernel) -> Option<String> {
        codegen::fused_rows::refusal(kernel)
    }

    fn run_rows(&self, kernel: &RowKernel, inputs: &[&Array]) -> Result<Vec<Array>> {
        let name = || format!("rows[{} steps]", kernel.steps.len());
        profile::timed(self, name, inputs, || self.rows(kernel, inputs))
    }

    fn scratch_bytes(
        &self,
        op: &Op,
        inputs: &[(&Layout, DType, usize)],
        out_shape: &[usize],
    ) -> usize {
        ops::scratch_bytes(op, inputs, out_shape, self.gpu.sms)
    }

    fn synchronize(&self) -> Result<()> {
        self.gpu
            .synchronize()
            .map_err(|m| Error::new(ErrorKind::Device, m))?;
        self.kernel_error()
    }

    fn memory_stats(&self) -> MemoryStats {
        self.gpu.memory_stats()
    }

    fn reset_peak(&self) {
        self.gpu.reset_peak();
        if let Ok(mut p) = self.gpu.pinned.lock() {
            p.reset_peak();
        }
    }

    fn host_memory_stats(&self) -> MemoryStats {
        CudaBackend::host_memory_stats(self)
    }

    fn empty_cache(&self) {
        self.gpu.empty_cache()
    }

    /// A saved activation to host memory, synchronously (the download
    /// path into pageable memory); the executor starts offloads with
    /// [`Backend::offload_start`] instead.
    fn offload(&self, array: &Array) -> Result<Array> {
        match array.device_storage() {
            Some(s) => {
                let host = self.download_storage(s)?;
                Ok(Array::from_parts(Arc::new(host), array.layout().clone()))
            }
            None => Ok(array.clone()),
        }
    }

    /// An offloaded value back on the GPU: an upload on the current stream.
    fn prefetch(&self, array: &Array) -> Result<Array> {
        match array.host_storage() {
            Some(s) => {
                let device = self.upload_storage(s)?;
                Ok(Array::from_device_parts(
                    Arc::new(device),
                    array.layout().clone(),
                ))
            }
            None => Ok(array.clone()),
        }
    }

    /// A saved activation to page-locked host memory, on the copy stream
    /// after its producer: the host array (whose bytes wait for the copy
    /// when read on the host) and the transfer, which keeps the device
    /// bytes until the compute waits for the copy (see [`Transfer`]).
    fn offload_start(&self, array: &Array) -> Result<(Array, Option<Box<dyn Transfer>>)> {
        let Some(s) = array.device_storage() else {
            return Ok((array.clone(), None));
        };
        let bytes = s.size_bytes();
        if bytes == 0 {
            return Ok((self.offload(array)?, None));
        }
        let (block, done) = self
            .gpu
            .offload_start(s.ptr(), bytes)
            .map_err(|m| Error::op(ErrorKind::Device, "offload", m))?;
        let done = Arc::new(done);
        let ptr = block.ptr as *mut u8;
        let fence = done.clone();
        let wait = Box::new(move || {
            if let Ok(b) = backend() {
                // A failed wait leaves the copy's error to the next
                // synchronisation, which reports it.
                let _ = b.gpu.host_wait(&fence);
            }
        });
        // SAFETY: the block holds `bytes` bytes, page-locked, owned by the
        // storage (given back to the pool when it drops); written by the
        // copy, which `wait` waits for before any host access.
        let host = unsafe {
            Storage::from_foreign_pending(s.dtype(), s.numel(), ptr, bytes, Box::new(block), wait)
        }?;
        let transfer = CopyInFlight {
            done,
            keep: Some(array.clone()),
            waited: std::sync::atomic::AtomicBool::new(false),
        };
        Ok((
            Array::from_parts(Arc::new(host), array.layout().clone()),
            Some(Box::new(transfer)),
        ))
    }

    /// An offloaded value back on the GPU, on the copy stream: the device
    /// array (read by kernels only after [`Transfer::wait`]) and the
    /// transfer, which keeps the host bytes until then. Host memory that is
    /// not one of the offload's page-locked blocks is uploaded as
    /// [`Backend::prefetch`] does.
    fn prefetch_start(&self, array: &Array) -> Result<(Array, Option<Box<dyn Transfer>>)> {
        let Some(s) = array.host_storage() else {
            return Ok((array.clone(), None));
        };
        let src = s.as_ptr_unwaited();
        let bytes = s.numel() * s.dtype().size_bytes();
        if bytes == 0 || !self.gpu.is_pinned_block(src) {
            return Ok((self.prefetch(array)?, None));
        }
        let device = self.empty(s.dtype(), s.numel())?;
        let done = self
            .gpu
            .prefetch_start(device.ptr(), src, bytes)
            .map_err(|m| Error::op(ErrorKind::Device, "prefetch", m))?;
        let transfer = CopyInFlight {
            done: Arc::new(done),
            keep: Some(array.clone()),
            waited: std::sync::atomic::AtomicBool::new(false),
        };
        Ok((
            Array::from_device_parts(Arc::new(device), array.layout().clone()),
            Some(Box::new(transfer)),
        ))
    }

    fn record(&self, slot: usize) -> Result<()> {
        self.gpu.record(slot).map_err(device_error)
    }

    fn wait_for(&self, slot: usize) -> Result<()> {
        self.gpu.wait_for(slot).map_err(device_error)
    }

    fn lanes(&self) -> usize {
        self.gpu.lanes()
    }

    fn fork(&self, lanes: usize) -> Result<()> {
        self.gpu.fork(lanes).map_err(device_error)
    }

    fn lane(&self, lane: usize) -> Result<()> {
        self.gpu.set_lane(lane);
        Ok(())
    }

    fn join(&self) -> Result<()> {
        self.gpu.join().map_err(device_error)
    }

    fn host_waits(&self) -> u64 {
        self.gpu.host_waits()
    }

    fn begin_capture(&self) -> Result<()> {
        self.gpu.begin_capture().map_err(device_error)
    }

    fn end_capture(&self) -> Result<Box<dyn DeviceGraph>> {
        let graph = self.gpu.end_capture().map_err(device_error)?;
        Ok(Box::new(Graph(graph)))
    }
}

impl DeviceBackend for CudaBackend {
    fn alloc(&self, dtype: DType, numel: usize) -> Result<DeviceStorage> {
        self.empty(dtype, numel)
    }

    fn upload(&self, host: &Storage) -> Result<DeviceStorage> {
        self.upload_storage(host)
    }

    fn download(&self, storage: &DeviceStorage) -> Result<Storage> {
        self.download_storage(storage)
    }

    fn copy(&self, dst: &DeviceStorage, src: &DeviceStorage) -> Result<()> {
        if dst.size_bytes() != src.size_bytes() {
            return Err(Error::new(
                ErrorKind::Argument,
                format!(
                    "device copy of {} bytes into {} bytes",
                    src.size_bytes(),
                    dst.size_bytes()
                ),
            ));
        }
        self.gpu
            .copy(dst.ptr(), src.ptr(), src.size_bytes())
            .map_err(device_error)
    }
}

/// A driver error as a one-line message.
pub(crate) fn driver_error(what: &str, e: cudarc::driver::result::DriverError) -> String {
    let name = e
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    format!("CUDA {what} failed: {name}")
}

fn device_error(message: String) -> Error {
    Error::new(ErrorKind::Device, message)
}

/// A copy on the copy stream in flight, with what it reads (an offload's
/// device array, a prefetch's host array): kept until the compute waited
/// for the copy, so that neither the device cache nor the page-locked pool
/// hands those bytes to work that is not ordered after it.
struct CopyInFlight {
    done: Arc<gpu::CopyEvent>,
    keep: Option<Array>,
    waited: std::sync::atomic::AtomicBool,
}

impl Transfer for CopyInFlight {
    fn wait(&self) -> Result<()> {
        let b = backend()?;
        b.gpu.wait_copy(&self.done, false).map_err(device_error)?;
        self.waited
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }
}

impl Drop for CopyInFlight {
    fn drop(&mut self) {
        if !self.waited.load(std::sync::atomic::Ordering::Relaxed) {
            // Dropped on an error path: the main stream (which every later
            // allocation's work follows) waits for the copy first.
            if let Ok(b) = backend() {
                let _ = b.gpu.wait_copy(&self.done, true);
            }
        }
        drop(self.keep.take());
    }
}

/// A captured CUDA graph as the runtime sees it.
struct Graph(gpu::CudaGraph);

impl DeviceGraph for Graph {
    fn replay(&self) -> Result<()> {
        self.0.replay().map_err(device_error)
    }
}
