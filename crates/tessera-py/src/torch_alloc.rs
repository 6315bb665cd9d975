//! PyTorch's CUDA caching allocator as the source of tessera's device
//! memory ([`tessera_cuda::ExternalAllocator`]), so that one pool serves
//! both libraries in a PyTorch process: a block one frees, the other
//! reuses, and `torch.cuda.memory_allocated` counts tessera's tensors.
//!
//! The calls go through the C shim PyTorch ships for AOTInductor
//! (`torch/csrc/inductor/aoti_torch/c/shim.h`, `shim_cuda.h`): plain C
//! symbols of `libtorch_cpu.so` and `libtorch_cuda.so` that need no GIL.
//! A block is a 1-D `uint8` tensor made by `aoti_torch_empty_strided` on
//! GPU 0 under a stream guard for the caller's stream (the caching
//! allocator lends memory for the current stream), and given back by
//! deleting the tensor. The alternatives were worse: the allocator's C++
//! entry points (`c10::cuda::CUDACachingAllocator::raw_alloc_with_stream`,
//! `raw_delete`) are inline functions over a virtual class, with no
//! exported symbol to call; Python's `torch.cuda.caching_allocator_alloc`
//! needs the GIL for every block, and tessera frees blocks from any thread
//! (DLPack deleters run where PyTorch drops a tensor, without the GIL).
//! The shim's cost is small beside a kernel launch: an
//! `aoti_torch_empty_strided` + `aoti_torch_delete_tensor_object` pair of a
//! 1 MiB CPU tensor took 0.29–0.45 µs on the (loaded) dev machine, PyTorch
//! 2.15; on the GPU the caching allocator's own bookkeeping and the stream
//! guard come on top, per block tessera allocates (a compiled call's arena
//! and its outputs: `cuda_allocator_stats()["external_allocs"]` counts
//! them; PyTorch 2.15 also exports `aoti_torch_cuda_caching_allocator_raw_alloc`,
//! which would save the tensor object but not the guard, and older
//! versions lack it).
//!
//! `tessera.torch` finds the symbols with ctypes and hands their addresses
//! to `cuda_use_torch_allocator`.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use pyo3::prelude::*;

use tessera_cuda::{ExternalAllocator, ExternalBlock};

type Handle = *mut c_void;
type EmptyStrided =
    unsafe extern "C" fn(i64, *const i64, *const i64, i32, i32, i32, *mut Handle) -> i32;
type DeleteTensor = unsafe extern "C" fn(Handle) -> i32;
type DataPtr = unsafe extern "C" fn(Handle, *mut *mut c_void) -> i32;
type NewStreamGuard = unsafe extern "C" fn(*mut c_void, i32, *mut Handle) -> i32;
type DeleteStreamGuard = unsafe extern "C" fn(Handle) -> i32;
type Code = unsafe extern "C" fn() -> i32;

/// The shim's functions this module calls, by symbol.
pub const SYMBOLS: [&str; 7] = [
    "aoti_torch_empty_strided",
    "aoti_torch_delete_tensor_object",
    "aoti_torch_get_data_ptr",
    "aoti_torch_create_cuda_stream_guard",
    "aoti_torch_delete_cuda_stream_guard",
    "aoti_torch_dtype_uint8",
    "aoti_torch_device_type_cuda",
];

/// PyTorch's caching allocator on GPU 0, through the shim.
struct TorchAllocator {
    empty_strided: EmptyStrided,
    delete_tensor: DeleteTensor,
    data_ptr: DataPtr,
    new_guard: NewStreamGuard,
    delete_guard: DeleteStreamGuard,
    uint8: i32,
    cuda: i32,
}

/// A shim call's result code as an error naming the call.
fn check(what: &str, code: i32) -> Result<(), String> {
    match code {
        0 => Ok(()),
        c => Err(format!(
            "PyTorch's caching allocator: {what} failed (code {c}; PyTorch printed why on stderr)"
        )),
    }
}

impl TorchAllocator {
    /// The allocator over the functions at `addresses` (symbol → address,
    /// every one of [`SYMBOLS`]).
    ///
    /// # Safety
    /// Each address is that symbol's function in the PyTorch loaded in this
    /// process, with the shim's signature.
    unsafe fn new(addresses: &HashMap<String, usize>) -> Result<TorchAllocator, String> {
        let at = |name: &str| match addresses.get(name) {
            Some(&a) if a != 0 => Ok(a as *const c_void),
            _ => Err(format!(
                "PyTorch's caching allocator: no address for `{name}` (expected all of {SYMBOLS:?})"
            )),
        };
        // SAFETY: the caller vouches for each address and signature.
        unsafe {
            let uint8: Code = std::mem::transmute(at("aoti_torch_dtype_uint8")?);
            let cuda: Code = std::mem::transmute(at("aoti_torch_device_type_cuda")?);
            Ok(TorchAllocator {
                empty_strided: std::mem::transmute::<*const c_void, EmptyStrided>(at(
                    "aoti_torch_empty_strided",
                )?),
                delete_tensor: std::mem::transmute::<*const c_void, DeleteTensor>(at(
                    "aoti_torch_delete_tensor_object",
                )?),
                data_ptr: std::mem::transmute::<*const c_void, DataPtr>(at(
                    "aoti_torch_get_data_ptr",
                )?),
                new_guard: std::mem::transmute::<*const c_void, NewStreamGuard>(at(
                    "aoti_torch_create_cuda_stream_guard",
                )?),
                delete_guard: std::mem::transmute::<*const c_void, DeleteStreamGuard>(at(
                    "aoti_torch_delete_cuda_stream_guard",
                )?),
                uint8: uint8(),
                cuda: cuda(),
            })
        }
    }

    /// A `[bytes]` uint8 tensor on GPU 0, allocated while `stream` is
    /// PyTorch's current stream: (the tensor's handle, its address).
    fn tensor_on(&self, bytes: usize, stream: u64) -> Result<(Handle, u64), String> {
        let size = i64::try_from(bytes)
            .map_err(|_| format!("PyTorch's caching allocator: {bytes} bytes is too large"))?;
        let (sizes, strides) = ([size], [1i64]);
        let mut guard: Handle = std::ptr::null_mut();
        let mut tensor: Handle = std::ptr::null_mut();
        // SAFETY: the shim's functions (see `new`), with valid out-pointers;
        // the guard is deleted on every path once the tensor is made.
        unsafe {
            check(
                "the stream guard",
                (self.new_guard)(stream as *mut c_void, 0, &mut guard),
            )?;
            let made = check(
                &format!("allocating {bytes} bytes"),
                (self.empty_strided)(
                    1,
                    sizes.as_ptr(),
                    strides.as_ptr(),
                    self.uint8,
                    self.cuda,
                    0,
                    &mut tensor,
                ),
            );
            let _ = (self.delete_guard)(guard);
            made?;
            let mut ptr: *mut c_void = std::ptr::null_mut();
            if let Err(e) = check("data_ptr", (self.data_ptr)(tensor, &mut ptr)) {
                let _ = (self.delete_tensor)(tensor);
                return Err(e);
            }
            Ok((tensor, ptr as u64))
        }
    }
}

impl ExternalAllocator for TorchAllocator {
    fn alloc(&self, bytes: usize, stream: u64) -> Result<ExternalBlock, String> {
        let (tensor, ptr) = self.tensor_on(bytes, stream)?;
        Ok(ExternalBlock {
            ptr,
            handle: tensor as u64,
        })
    }

    fn free(&self, block: ExternalBlock) {
        // SAFETY: a handle from `alloc`, deleted once (tessera gives each
        // block back once). Its storage goes back to the caching allocator
        // on the stream it was allocated for.
        unsafe {
            let _ = (self.delete_tensor)(block.handle as Handle);
        }
    }

    fn name(&self) -> String {
        "PyTorch's caching allocator".into()
    }
}

/// Whether tessera's CUDA memory comes from PyTorch's allocator now.
static INSTALLED: AtomicBool = AtomicBool::new(false);

pub fn installed() -> bool {
    INSTALLED.load(Ordering::Relaxed)
}

/// tessera's CUDA memory comes from PyTorch's caching allocator from now
/// on; `addresses` maps each of the shim's symbols (`SYMBOLS`) to its
/// address in this process, found by `tessera.torch` with ctypes. Unsafe in
/// spirit: the addresses are trusted.
#[pyfunction]
pub fn cuda_use_torch_allocator(addresses: HashMap<String, usize>) -> PyResult<()> {
    let backend = crate::cuda::open().map_err(crate::to_py)?;
    // SAFETY: the addresses are the shim's functions of the PyTorch in this
    // process (tessera.torch resolves them by name from torch's libraries).
    let torch = unsafe { TorchAllocator::new(&addresses) }.map_err(crate::device_error)?;
    backend.set_external_allocator(Some(Arc::new(torch)));
    INSTALLED.store(true, Ordering::Relaxed);
    Ok(())
}

/// tessera's CUDA memory comes from the driver through its own cache again.
#[pyfunction]
pub fn cuda_use_own_allocator() -> PyResult<()> {
    let backend = crate::cuda::open().map_err(crate::to_py)?;
    backend.set_external_allocator(None);
    INSTALLED.store(false, Ordering::Relaxed);
    Ok(())
}

/// The symbols `cuda_use_torch_allocator` needs.
#[pyfunction]
pub fn torch_allocator_symbols() -> Vec<String> {
    SYMBOLS.iter().map(|s| s.to_string()).collect()
}

pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cuda_use_torch_allocator, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_use_own_allocator, m)?)?;
    m.add_function(wrap_pyfunction!(torch_allocator_symbols, m)?)?;
    Ok(())
}
