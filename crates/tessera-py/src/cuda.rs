//! tessera's CUDA backend from Python: opened once, when a CUDA tensor
//! first crosses (or `cuda_is_available` asks), and its stream, memory
//! accounting and synchronisation for the torch backend.
//!
//! PyTorch and tessera share the GPU's primary context, so device pointers
//! cross both ways without a copy (DLPack, `dlpack.rs`). Each queues work on
//! a stream of its own; each call that `tessera.torch` makes names
//! PyTorch's current stream, and [`foreign_call`] orders the two with
//! events at the call's start and end. In a PyTorch process tessera's
//! device memory comes from PyTorch's caching allocator (`torch_alloc.rs`).

use std::sync::{Arc, OnceLock};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use tessera::runtime::device::{self, Device};
use tessera::{Error, ErrorKind, Result};
use tessera_cuda::CudaBackend;

/// tessera's CUDA backend, registered as `Device::Cuda` on first use; the
/// error (no driver, no GPU, no NVRTC) is kept and given to every caller.
pub fn open() -> Result<Arc<CudaBackend>> {
    static OPENED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    OPENED
        .get_or_init(|| tessera_cuda::register().map_err(|e| e.message))
        .clone()
        .map_err(|m| Error::new(ErrorKind::Device, format!("tessera's CUDA backend: {m}")))?;
    tessera_cuda::backend()
}

/// Whether tessera's CUDA backend opens on this machine.
#[pyfunction]
pub fn cuda_is_available() -> bool {
    open().is_ok()
}

/// Why the CUDA backend does not open (None when it does).
#[pyfunction]
pub fn cuda_unavailable_reason() -> Option<String> {
    open().err().map(|e| e.message)
}

/// The GPU tessera runs on, e.g. `NVIDIA H100 80GB HBM3 (sm_90, 132 SMs)`.
#[pyfunction]
pub fn cuda_describe() -> PyResult<String> {
    Ok(open().map_err(crate::to_py)?.describe())
}

/// The `CUstream` (an integer) tessera queues its work on between calls.
#[pyfunction]
pub fn cuda_stream() -> PyResult<u64> {
    Ok(open().map_err(crate::to_py)?.stream_handle())
}

/// tessera's GPU allocator: (live bytes, peak bytes).
#[pyfunction]
pub fn cuda_memory_stats() -> PyResult<(usize, usize)> {
    open().map_err(crate::to_py)?;
    let s = device::memory_stats(Device::Cuda).map_err(crate::to_py)?;
    Ok((s.live_bytes, s.peak_bytes))
}

/// tessera's GPU allocator in detail: `live_bytes`, `peak_bytes` (tessera's
/// tensors, wherever their memory came from), `cached_bytes` (free blocks
/// tessera keeps), `allocator` (`"tessera"`, or the external allocator's
/// name, e.g. PyTorch's caching allocator), `external_allocs` and
/// `external_frees` (blocks lent by it and given back, so far).
#[pyfunction]
pub fn cuda_allocator_stats(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let s = open().map_err(crate::to_py)?.allocator_stats();
    let d = PyDict::new(py);
    d.set_item("live_bytes", s.live_bytes)?;
    d.set_item("peak_bytes", s.peak_bytes)?;
    d.set_item("cached_bytes", s.cached_bytes)?;
    d.set_item(
        "allocator",
        s.external.unwrap_or_else(|| "tessera".to_string()),
    )?;
    d.set_item("external_allocs", s.external_allocs)?;
    d.set_item("external_frees", s.external_frees)?;
    Ok(d)
}

/// Runs `f`, tessera's part of a call from PyTorch whose work is queued on
/// `stream` (PyTorch's current stream): tessera's work waits for what
/// PyTorch queued before, PyTorch's later work waits for tessera's, and the
/// blocks tessera frees in between go back to PyTorch's allocator only then
/// (see `tessera_cuda::ExternalAllocator`). None: no ordering, unless
/// PyTorch's allocator lends tessera its memory, whose blocks must not go
/// back unordered: then the legacy default stream (0) stands in.
pub fn foreign_call<T>(stream: Option<u64>, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let stream = stream.or_else(|| crate::torch_alloc::installed().then_some(0));
    let Some(stream) = stream else {
        return f();
    };
    let backend = open()?;
    backend.begin_foreign_call(stream)?;
    let result = f();
    let ended = backend.end_foreign_call(stream);
    let value = result?;
    ended?;
    Ok(value)
}

/// Starts a new peak measurement of tessera's GPU memory.
#[pyfunction]
pub fn cuda_reset_peak_memory() -> PyResult<()> {
    open().map_err(crate::to_py)?;
    device::reset_peak(Device::Cuda).map_err(crate::to_py)
}

/// Waits for tessera's queued GPU work (and reports a kernel's error).
#[pyfunction]
pub fn cuda_synchronize(py: Python<'_>) -> PyResult<()> {
    open().map_err(crate::to_py)?;
    py.detach(|| device::synchronize(Device::Cuda))
        .map_err(crate::to_py)
}

/// Adds the functions above to the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cuda_is_available, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_unavailable_reason, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_describe, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_stream, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_allocator_stats, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_reset_peak_memory, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_synchronize, m)?)?;
    Ok(())
}
