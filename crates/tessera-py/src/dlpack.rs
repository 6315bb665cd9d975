//! DLPack (the legacy, unversioned `DLManagedTensor` of DLPack 0.8, which
//! `torch.utils.dlpack.to_dlpack`/`from_dlpack` speak): tensors cross
//! between PyTorch and tessera without a copy, in host memory and in the
//! GPU's (tessera's CUDA backend runs GPU 0 of the process).
//!
//! Import wraps the producer's memory in tessera storage whose owner
//! calls the producer's deleter when the last view drops: host storage
//! ([`tessera::runtime::cpu::Storage::from_foreign`]) or device storage
//! over a foreign block (`ForeignBlock`). Export hands out a
//! `DLManagedTensor` that keeps the tessera array (so its storage) alive
//! until the consumer calls its deleter. Neither side synchronises: the
//! caller orders the two libraries' streams (`tessera.torch` does, with
//! events).

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;

use tessera::runtime::array::{Array, Buffer};
use tessera::runtime::cpu::{ForeignOwner, Storage};
use tessera::runtime::device::{Device, DeviceMemory, DeviceStorage};
use tessera::runtime::layout::Layout;
use tessera::{DType, Error, ErrorKind, Result, Tensor};

const DL_CPU: i32 = 1;
const DL_CUDA: i32 = 2;
const DL_CUDA_HOST: i32 = 3;

const DL_INT: u8 = 0;
const DL_UINT: u8 = 1;
const DL_FLOAT: u8 = 2;
const DL_BFLOAT: u8 = 4;
const DL_BOOL: u8 = 6;

const DLTENSOR: &CStr = c"dltensor";
const USED_DLTENSOR: &CStr = c"used_dltensor";

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *mut i64,
    strides: *mut i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

fn dtype_of(t: DLDataType) -> Result<DType> {
    let dtype = match (t.code, t.bits, t.lanes) {
        (DL_FLOAT, 32, 1) => DType::F32,
        (DL_FLOAT, 64, 1) => DType::F64,
        (DL_FLOAT, 16, 1) => DType::F16,
        (DL_BFLOAT, 16, 1) => DType::BF16,
        (DL_INT, 64, 1) => DType::I64,
        (DL_INT, 32, 1) => DType::I32,
        (DL_INT, 16, 1) => DType::I16,
        (DL_INT, 8, 1) => DType::I8,
        (DL_UINT, 8, 1) => DType::U8,
        (DL_UINT, 16, 1) => DType::U16,
        (DL_UINT, 32, 1) => DType::U32,
        (DL_UINT, 64, 1) => DType::U64,
        (DL_BOOL, 8, 1) => DType::Bool,
        (code, bits, lanes) => {
            let kind = match code {
                DL_INT => "int",
                DL_UINT => "uint",
                DL_FLOAT => "float",
                DL_BFLOAT => "bfloat",
                DL_BOOL => "bool",
                _ => "code",
            };
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "from_dlpack: dtype {kind}{bits} (code {code}, {lanes} lanes) has no tessera \
                     dtype (tessera has f32 f64 f16 bf16 i64 i32 i16 i8 u8 u16 u32 u64 bool)"
                ),
            ));
        }
    };
    Ok(dtype)
}

fn dl_dtype(d: DType) -> DLDataType {
    let (code, bits) = match d {
        DType::F32 => (DL_FLOAT, 32),
        DType::F64 => (DL_FLOAT, 64),
        DType::F16 => (DL_FLOAT, 16),
        DType::BF16 => (DL_BFLOAT, 16),
        DType::I64 => (DL_INT, 64),
        DType::I32 => (DL_INT, 32),
        DType::I16 => (DL_INT, 16),
        DType::I8 => (DL_INT, 8),
        DType::U8 => (DL_UINT, 8),
        DType::U16 => (DL_UINT, 16),
        DType::U32 => (DL_UINT, 32),
        DType::U64 => (DL_UINT, 64),
        DType::Bool => (DL_BOOL, 8),
    };
    DLDataType {
        code,
        bits,
        lanes: 1,
    }
}

/// The producer's tensor, given back (its deleter called) on drop.
struct Managed(*mut DLManagedTensor);

// SAFETY: DLPack's contract: the deleter may be called from any thread, and
// the memory stays valid and unchanged by the producer until it is.
unsafe impl Send for Managed {}
unsafe impl Sync for Managed {}
impl std::panic::UnwindSafe for Managed {}
impl std::panic::RefUnwindSafe for Managed {}

impl Drop for Managed {
    fn drop(&mut self) {
        // SAFETY: the pointer came from a consumed "dltensor" capsule; we
        // own it and call its deleter once.
        unsafe {
            if let Some(deleter) = (*self.0).deleter {
                deleter(self.0);
            }
        }
    }
}

/// A tensor over the memory of a `"dltensor"` capsule (consumed: renamed
/// `"used_dltensor"`, as the protocol says): host memory or GPU 0's; the
/// error names any other device.
pub fn import(capsule: &Bound<'_, PyAny>) -> PyResult<Tensor> {
    let obj = capsule.as_ptr();
    // SAFETY: capsule calls on a live Python object, with the GIL held.
    let managed = unsafe {
        if ffi::PyCapsule_IsValid(obj, DLTENSOR.as_ptr()) != 1 {
            return Err(crate::to_py(Error::new(
                ErrorKind::Argument,
                "from_dlpack: expected an unconsumed \"dltensor\" capsule \
                 (torch.utils.dlpack.to_dlpack(t)); a capsule is used once",
            )));
        }
        let p = ffi::PyCapsule_GetPointer(obj, DLTENSOR.as_ptr()) as *mut DLManagedTensor;
        if p.is_null() || ffi::PyCapsule_SetName(obj, USED_DLTENSOR.as_ptr()) != 0 {
            return Err(PyErr::fetch(capsule.py()));
        }
        Managed(p)
    };
    // From here `managed` gives the tensor back on every path.
    wrap(managed).map_err(crate::to_py)
}

fn wrap(managed: Managed) -> Result<Tensor> {
    // SAFETY: a valid DLManagedTensor, alive until `managed` drops.
    let t = unsafe { &(*managed.0).dl_tensor };
    let dtype = dtype_of(t.dtype)?;
    let device = device_of(t.device)?;
    let ndim = usize::try_from(t.ndim)
        .map_err(|_| Error::new(ErrorKind::Argument, "from_dlpack: negative ndim"))?;
    // SAFETY: DLPack: `shape` holds ndim entries, `strides` ndim or is null.
    let shape_i: &[i64] = match ndim {
        0 => &[],
        n => unsafe { std::slice::from_raw_parts(t.shape, n) },
    };
    let strides_i: Option<&[i64]> = match (ndim, t.strides.is_null()) {
        (0, _) | (_, true) => None,
        (n, false) => Some(unsafe { std::slice::from_raw_parts(t.strides, n) }),
    };
    let bad = |what: &str| {
        Error::new(
            ErrorKind::Argument,
            format!("from_dlpack: {what} (shape {shape_i:?}, strides {strides_i:?}, {dtype})"),
        )
    };
    let shape: Vec<usize> = shape_i
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| bad("a negative size")))
        .collect::<Result<_>>()?;
    let strides: Vec<usize> = match strides_i {
        None => tessera::runtime::layout::contiguous_strides(&shape),
        Some(s) => s
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| bad("a negative stride")))
            .collect::<Result<_>>()?,
    };
    if tessera::limits::numel(&shape).is_none() {
        return Err(bad("past tessera's size limit of 2^46 elements"));
    }
    if shape.contains(&0) {
        // Nothing to share (the producer's pointer may even be null).
        return Tensor::zeros(&shape, dtype).to(device);
    }
    // The elements the strided view reaches: its extent in storage.
    let extent = shape
        .iter()
        .zip(&strides)
        .try_fold(1usize, |acc, (&n, &s)| {
            (n - 1).checked_mul(s).and_then(|x| x.checked_add(acc))
        })
        .filter(|&e| e <= tessera::limits::MAX_ELEMENTS)
        .ok_or_else(|| bad("strides reaching past the size limit"))?;
    let ptr = (t.data as *mut u8).wrapping_add(t.byte_offset as usize);
    let len = extent * dtype.size_bytes();
    let layout = Layout {
        shape,
        strides,
        offset: 0,
    };
    match device {
        Device::Cpu => {
            let owner: ForeignOwner = Box::new(managed);
            // SAFETY: DLPack's contract: `len` bytes from `ptr` are the
            // producer's live tensor until the deleter (in `owner`) runs;
            // tessera only reads them (graph inputs are never donated).
            let storage = unsafe { Storage::from_foreign(dtype, extent, ptr, len, owner)? };
            Ok(Tensor::from_parts(Arc::new(storage), layout))
        }
        Device::Cuda => {
            if ptr.is_null() || !(ptr as usize).is_multiple_of(dtype.size_bytes()) {
                return Err(bad("a null or misaligned device pointer"));
            }
            let block = ForeignBlock {
                ptr: ptr as u64,
                len,
                _owner: managed,
            };
            let storage = DeviceStorage::new(Device::Cuda, dtype, extent, Box::new(block));
            Ok(Tensor::from_array(Array::from_device_parts(
                Arc::new(storage),
                layout,
            )))
        }
    }
}

/// The tessera device of a DLPack device: the host (CPU or pinned host
/// memory) or GPU 0, where tessera's CUDA backend runs (opened here on
/// first use); anything else is an error naming it.
fn device_of(d: DLDevice) -> Result<Device> {
    match d.device_type {
        DL_CPU | DL_CUDA_HOST => Ok(Device::Cpu),
        DL_CUDA if d.device_id == 0 => {
            crate::cuda::open()?;
            Ok(Device::Cuda)
        }
        DL_CUDA => Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "from_dlpack: a tensor on cuda:{}: tessera's CUDA backend runs GPU 0 of the \
                 process (choose the GPU with CUDA_VISIBLE_DEVICES)",
                d.device_id
            ),
        )),
        other => Err(Error::new(
            ErrorKind::Unsupported,
            format!(
                "from_dlpack: a tensor on DLPack device type {other} (id {}): tessera-py \
                 takes host and CUDA tensors",
                d.device_id
            ),
        )),
    }
}

/// A producer's GPU memory as a tessera device block: its address and
/// extent, and the producer's tensor, given back when tessera drops the
/// block. Not counted by tessera's allocator (it did not allocate it).
struct ForeignBlock {
    ptr: u64,
    len: usize,
    _owner: Managed,
}

impl DeviceMemory for ForeignBlock {
    fn ptr(&self) -> u64 {
        self.ptr
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// What an exported tensor keeps alive: its array and the shape and
/// strides the `DLTensor` points at. `repr(C)`: `managed` comes first, so
/// a pointer to it is a pointer to the whole.
#[repr(C)]
struct Export {
    managed: DLManagedTensor,
    _array: Array,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

unsafe extern "C" fn delete_export(p: *mut DLManagedTensor) {
    if !p.is_null() {
        // SAFETY: `p` is the `managed` field (the first, repr(C)) of a
        // boxed `Export` made by `export`, deleted once by its consumer.
        drop(unsafe { Box::from_raw(p as *mut Export) });
    }
}

unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
    // A capsule never consumed still owns its tensor.
    // SAFETY: called by Python on a capsule made by `export`.
    unsafe {
        if ffi::PyCapsule_IsValid(capsule, DLTENSOR.as_ptr()) == 1 {
            let p = ffi::PyCapsule_GetPointer(capsule, DLTENSOR.as_ptr()) as *mut DLManagedTensor;
            delete_export(p);
        } else {
            ffi::PyErr_Clear();
        }
    }
}

/// A `"dltensor"` capsule over `t`'s values, without a copy (host memory,
/// or GPU 0's for a tensor of tessera's CUDA backend).
pub fn export<'py>(py: Python<'py>, t: &Tensor) -> PyResult<Bound<'py, PyAny>> {
    let array = t
        .try_array()
        .ok_or_else(|| {
            crate::to_py(Error::new(
                ErrorKind::Argument,
                "to_dlpack: a traced tensor has no values",
            ))
        })?
        .clone();
    let (data, device_type) = match array.buffer() {
        Buffer::Host(s) => (s.as_ptr() as *mut c_void, DL_CPU),
        Buffer::Device(s) => (s.ptr() as *mut c_void, DL_CUDA),
    };
    let layout = array.layout();
    let shape: Vec<i64> = layout.shape.iter().map(|&d| d as i64).collect();
    let strides: Vec<i64> = layout.strides.iter().map(|&d| d as i64).collect();
    let byte_offset = (layout.offset * array.dtype().size_bytes()) as u64;
    let dtype = dl_dtype(array.dtype());
    let ndim = shape.len() as i32;
    let mut export = Box::new(Export {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data,
                device: DLDevice {
                    device_type,
                    device_id: 0,
                },
                ndim,
                dtype,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(delete_export),
        },
        _array: array,
        shape,
        strides,
    });
    // The vectors' buffers do not move when the box is made.
    export.managed.dl_tensor.shape = export.shape.as_mut_ptr();
    export.managed.dl_tensor.strides = export.strides.as_mut_ptr();
    let raw = Box::into_raw(export) as *mut c_void;
    // SAFETY: a new capsule owning `raw` (freed by the destructor unless a
    // consumer renames it and calls the deleter).
    unsafe {
        let capsule = ffi::PyCapsule_New(raw, DLTENSOR.as_ptr(), Some(capsule_destructor));
        if capsule.is_null() {
            delete_export(raw as *mut DLManagedTensor);
        }
        Bound::from_owned_ptr_or_err(py, capsule)
    }
}
