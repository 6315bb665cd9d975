//! The backends' value: an [`Array`] is a dtype, a strided [`Layout`] and
//! the [`Buffer`] it reads (host storage or device storage).
//!
//! Kernels (the CPU's and a device [`Backend`](super::device::Backend)'s)
//! take arrays and return arrays; they know nothing of the user-facing
//! `Tensor`, which holds an `Array` as its values and adds autograd and
//! tracing on top. Handing a tensor's array to a kernel borrows it.

use std::fmt;
use std::sync::Arc;

use super::cpu::{Element, Storage};
use super::device::{Device, DeviceStorage};
use super::layout::Layout;
use crate::error::{Error, ErrorKind, Result};
use crate::ir::{DType, Shape, TensorType};

/// The bytes an array reads: host storage or the memory of a device.
/// Views share one buffer (the `Arc`).
#[derive(Clone)]
pub enum Buffer {
    Host(Arc<Storage>),
    /// Values in the memory of a device (a GPU).
    Device(Arc<DeviceStorage>),
}

impl Buffer {
    /// The elements the buffer holds.
    pub fn numel(&self) -> usize {
        match self {
            Buffer::Host(s) => s.numel(),
            Buffer::Device(s) => s.numel(),
        }
    }

    pub fn dtype(&self) -> DType {
        match self {
            Buffer::Host(s) => s.dtype(),
            Buffer::Device(s) => s.dtype(),
        }
    }

    /// Where the bytes are.
    pub fn device(&self) -> Device {
        match self {
            Buffer::Host(_) => Device::Cpu,
            Buffer::Device(s) => s.device(),
        }
    }

    /// Whether both are the same buffer (one array is a view of the other).
    pub fn same(&self, other: &Buffer) -> bool {
        match (self, other) {
            (Buffer::Host(a), Buffer::Host(b)) => Arc::ptr_eq(a, b),
            (Buffer::Device(a), Buffer::Device(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// Whether no other array or handle holds this buffer.
    pub fn is_unique(&self) -> bool {
        match self {
            Buffer::Host(s) => Arc::strong_count(s) == 1,
            Buffer::Device(s) => Arc::strong_count(s) == 1,
        }
    }
}

/// An n-dimensional array: `dtype` elements of a [`Buffer`] read through a
/// [`Layout`] that stays inside it (checked when the array is made).
#[derive(Clone)]
pub struct Array {
    dtype: DType,
    layout: Layout,
    buffer: Buffer,
}

impl Array {
    /// An array over `buffer` with `layout` (a view when the buffer is
    /// shared). Panics when the layout reaches outside the buffer
    /// ([`Layout::fits`]): reading it would read out of bounds.
    pub fn new(buffer: Buffer, layout: Layout) -> Array {
        let (numel, dtype) = (buffer.numel(), buffer.dtype());
        if !layout.fits(numel) {
            panic!(
                "a layout with shape {:?}, strides {:?} and offset {} reaches outside \
                 its storage of {numel} elements of {dtype}",
                layout.shape, layout.strides, layout.offset
            );
        }
        Array {
            dtype,
            layout,
            buffer,
        }
    }

    /// An array over host `storage` with `layout` (see [`Array::new`]).
    pub fn from_parts(storage: Arc<Storage>, layout: Layout) -> Array {
        Array::new(Buffer::Host(storage), layout)
    }

    /// A contiguous array owning `storage`, which must hold exactly the
    /// elements of `shape` (else a panic: a kernel made a wrong buffer).
    pub fn from_storage(storage: Storage, shape: &[usize]) -> Array {
        if crate::limits::numel(shape) != Some(storage.numel()) {
            panic!(
                "from_storage: a storage of {} elements of {} does not hold shape {shape:?}",
                storage.numel(),
                storage.dtype()
            );
        }
        Array {
            dtype: storage.dtype(),
            layout: Layout::contiguous(shape),
            buffer: Buffer::Host(Arc::new(storage)),
        }
    }

    /// An array over device `storage` with `layout` (see [`Array::new`]).
    pub fn from_device_parts(storage: Arc<DeviceStorage>, layout: Layout) -> Array {
        Array::new(Buffer::Device(storage), layout)
    }

    /// A contiguous array owning device `storage`, which must hold exactly
    /// the elements of `shape`.
    pub fn from_device_storage(storage: DeviceStorage, shape: &[usize]) -> Array {
        if crate::limits::numel(shape) != Some(storage.numel()) {
            panic!(
                "from_device_storage: a storage of {} elements of {} does not hold shape {shape:?}",
                storage.numel(),
                storage.dtype()
            );
        }
        Array {
            dtype: storage.dtype(),
            layout: Layout::contiguous(shape),
            buffer: Buffer::Device(Arc::new(storage)),
        }
    }

    /// A view of the same buffer with another layout (checked to fit).
    pub fn view(&self, layout: Layout) -> Array {
        Array::new(self.buffer.clone(), layout)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn shape(&self) -> &[usize] {
        &self.layout.shape
    }

    pub fn strides(&self) -> &[usize] {
        &self.layout.strides
    }

    pub fn rank(&self) -> usize {
        self.layout.rank()
    }

    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// Whether the layout covers the whole buffer in row-major order.
    pub fn is_dense(&self) -> bool {
        super::cpu::copy::is_dense(&self.layout, self.buffer.numel())
    }

    /// The IR type (dtype and concrete shape).
    pub fn ty(&self) -> TensorType {
        TensorType {
            dtype: self.dtype,
            shape: Shape::from_concrete(self.shape()),
        }
    }

    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }

    /// The buffer, by value (the layout dropped).
    pub fn into_buffer(self) -> Buffer {
        self.buffer
    }

    /// The storage of a dense host array whose buffer nothing else holds,
    /// by value (a kernel may write over it); `None` otherwise.
    pub fn into_unique_storage(self) -> Option<Storage> {
        if !self.is_dense() {
            return None;
        }
        match self.buffer {
            Buffer::Host(s) => Arc::try_unwrap(s).ok(),
            Buffer::Device(_) => None,
        }
    }

    /// The address of the first byte of the buffer (host or device).
    pub fn buffer_addr(&self) -> u64 {
        match &self.buffer {
            Buffer::Host(s) => s.as_bytes().as_ptr() as u64,
            Buffer::Device(s) => s.ptr(),
        }
    }

    /// A copy of the whole buffer in a new allocation on the same device,
    /// under the same layout.
    pub fn fresh_copy(&self) -> Result<Array> {
        let layout = self.layout.clone();
        match &self.buffer {
            Buffer::Device(src) => {
                let backend = super::device::device_backend(src.device())?;
                let dst = backend.alloc(src.dtype(), src.numel())?;
                backend.copy(&dst, src)?;
                Ok(Array::from_device_parts(Arc::new(dst), layout))
            }
            Buffer::Host(src) => {
                let mut dst = Storage::try_new(self.dtype, src.numel())?;
                dst.as_bytes_mut().copy_from_slice(src.as_bytes());
                Ok(Array::from_parts(Arc::new(dst), layout))
            }
        }
    }

    /// The elements of the buffer (which a view may read only part of).
    pub fn storage_numel(&self) -> usize {
        self.buffer.numel()
    }

    /// Where the values are.
    pub fn device(&self) -> Device {
        self.buffer.device()
    }

    /// The host storage. CPU kernels only ever see host arrays: calling
    /// this on a device array is a bug in tessera (readers copy device
    /// values to the host first).
    pub fn storage(&self) -> &Arc<Storage> {
        match &self.buffer {
            Buffer::Host(s) => s,
            Buffer::Device(s) => panic!(
                "internal error: an array on {} ({}) has no host storage; use .to_host()",
                s.device(),
                self.ty()
            ),
        }
    }

    /// The host storage, if the values are on the host.
    pub fn host_storage(&self) -> Option<&Arc<Storage>> {
        match &self.buffer {
            Buffer::Host(s) => Some(s),
            Buffer::Device(_) => None,
        }
    }

    /// The device storage, if the values are on a device.
    pub fn device_storage(&self) -> Option<&Arc<DeviceStorage>> {
        match &self.buffer {
            Buffer::Device(s) => Some(s),
            Buffer::Host(_) => None,
        }
    }

    /// Whether both arrays read the same buffer (one is a view of the other).
    pub fn shares_buffer(&self, other: &Array) -> bool {
        self.buffer.same(&other.buffer)
    }

    /// The elements as `&[T]` in row-major order, if contiguous, on the
    /// host and of element type `T`.
    pub fn contiguous_slice<T: Element>(&self) -> Option<&[T]> {
        let range = self.layout.contiguous_range()?;
        let storage = self.host_storage()?;
        (T::DTYPE == self.dtype).then(|| &storage.as_slice::<T>()[range])
    }

    /// A host copy of a device array (the array itself when on the host):
    /// its whole buffer, downloaded, under the same layout.
    pub fn to_host(&self) -> Result<Array> {
        match &self.buffer {
            Buffer::Host(_) => Ok(self.clone()),
            Buffer::Device(s) => {
                let storage = super::device::device_backend(s.device())?.download(s)?;
                Ok(Array::from_parts(Arc::new(storage), self.layout.clone()))
            }
        }
    }

    /// The elements of a host array in row-major order. Errors when `T` is
    /// not the dtype, when the values are on a device, or when the host has
    /// no memory for them (`OutOfMemory`, naming the type).
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        if T::DTYPE != self.dtype {
            return Err(Error::new(
                ErrorKind::DType,
                format!("array is {} but was read as {}", self.ty(), T::DTYPE),
            ));
        }
        if self.device() != Device::Cpu {
            return Err(Error::op(
                ErrorKind::Unsupported,
                "to_vec",
                format!(
                    "{} is on {}: copy it to the host first",
                    self.ty(),
                    self.device()
                ),
            ));
        }
        let dense = super::cpu::alloc::catching(|| super::cpu::copy::contiguous(self))
            .map_err(|e| super::cpu::in_kernel(e, "to_vec", &self.ty().to_string()))?;
        let values = dense.contiguous_slice::<T>().expect("contiguous");
        let mut out = Vec::new();
        out.try_reserve_exact(values.len()).map_err(|_| {
            Error::op(
                ErrorKind::OutOfMemory,
                "to_vec",
                format!(
                    "out of memory: a Vec of {} bytes for the values of {} could not be allocated",
                    std::mem::size_of_val(values),
                    self.ty()
                ),
            )
        })?;
        out.extend_from_slice(values);
        Ok(out)
    }

    /// The elements converted to f64 in row-major order (bools as 0/1);
    /// panics where [`Array::to_vec`] errors.
    #[track_caller]
    pub fn to_f64_vec(&self) -> Vec<f64> {
        crate::with_dtype!(self.dtype, T => match self.to_vec::<T>() {
            Ok(v) => v.into_iter().map(|v| v.to_f64()).collect(),
            Err(e) => panic!("{e}"),
        })
    }
}

impl fmt::Debug for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Array({} on {}", self.ty(), self.device())?;
        if self.layout.offset != 0 || !self.layout.is_contiguous() {
            write!(
                f,
                ", strides {:?}, offset {}",
                self.layout.strides, self.layout.offset
            )?;
        }
        write!(f, ")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_share_the_buffer_and_stay_inside_it() {
        let a = Array::from_storage(
            Storage::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]),
            &[2, 3],
        );
        assert_eq!(
            (a.dtype(), a.shape(), a.numel(), a.rank()),
            (DType::F32, &[2, 3][..], 6, 2)
        );
        assert!(a.is_dense() && a.device() == Device::Cpu && a.device_storage().is_none());
        assert_eq!(
            a.contiguous_slice::<f32>(),
            Some(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0][..])
        );
        assert_eq!(a.contiguous_slice::<f64>(), None);
        let t = a.view(a.layout().permuted(&[1, 0]));
        assert!(t.shares_buffer(&a) && !t.is_dense() && t.contiguous_slice::<f32>().is_none());
        assert_eq!(t.strides(), &[1, 3]);
        let row = a.view(a.layout().sliced(0, 1, 1, 1));
        assert_eq!(row.contiguous_slice::<f32>(), Some(&[4.0, 5.0, 6.0][..]));
        assert!(!row.is_dense());
        let other = Array::from_storage(Storage::from_slice(&[1.0f32]), &[]);
        assert!(!other.shares_buffer(&a));
        assert!(!a.buffer().is_unique() && other.buffer().is_unique());
        assert_eq!(
            format!("{t:?}"),
            "Array(f32[3,2] on cpu, strides [1, 3], offset 0)"
        );
    }

    #[test]
    #[should_panic(expected = "reaches outside its storage of 6 elements of f32")]
    fn a_layout_past_the_buffer_is_refused() {
        let a = Array::from_storage(Storage::from_slice(&[0.0f32; 6]), &[6]);
        a.view(Layout::contiguous(&[7]));
    }

    #[test]
    #[should_panic(expected = "does not hold shape [4]")]
    fn a_storage_of_the_wrong_size_is_refused() {
        Array::from_storage(Storage::from_slice(&[0i64; 3]), &[4]);
    }
}
