//! A typed view over one host buffer.

use super::alloc::RawBuffer;
use super::arena::{self, Region};
use super::element::Element;
use crate::error::{Error, ErrorKind, Result};
use crate::ir::DType;
use crate::limits;

/// The bytes behind one or more tensors (views share a storage).
pub struct Storage {
    buf: Block,
    dtype: DType,
    numel: usize,
}

/// A buffer of its own, or a planned region of a compiled run's arena.
enum Block {
    Own(RawBuffer),
    Planned(Region),
}

impl Block {
    fn as_ptr(&self) -> *mut u8 {
        match self {
            Block::Own(b) => b.as_ptr(),
            Block::Planned(r) => r.as_ptr(),
        }
    }

    fn len(&self) -> usize {
        match self {
            Block::Own(b) => b.len(),
            Block::Planned(r) => r.len(),
        }
    }
}

impl Storage {
    /// Storage for `numel` elements of `dtype` (contents: zeros or reused bytes;
    /// kernels overwrite every element they hand out): at its planned place
    /// when a compiled run planned this allocation (see [`arena`]), else
    /// from the pool. Errors when `numel` is past the size limit
    /// ([`crate::limits`]) or the memory is not there (`OutOfMemory`,
    /// naming the bytes and the type).
    pub fn try_new(dtype: DType, numel: usize) -> Result<Storage> {
        let len = numel
            .checked_mul(dtype.size_bytes())
            .filter(|_| numel <= limits::MAX_ELEMENTS)
            .ok_or_else(|| {
                Error::new(
                    ErrorKind::OutOfMemory,
                    format!(
                        "storage for {numel} elements of {dtype} is past the size limit \
                         of 2^46 elements"
                    ),
                )
            })?;
        let buf = match arena::take(len) {
            Some(region) => Block::Planned(region),
            None => Block::Own(RawBuffer::try_new(len).map_err(|mut e| {
                e.message = format!("{} for {numel} elements of {dtype}", e.message);
                e
            })?),
        };
        Ok(Storage { buf, dtype, numel })
    }

    /// [`Storage::try_new`] for kernels, which cannot return an error: a
    /// failure unwinds to the op that runs the kernel and becomes its error
    /// (see [`super::alloc`]).
    pub fn new(dtype: DType, numel: usize) -> Storage {
        match Storage::try_new(dtype, numel) {
            Ok(s) => s,
            Err(e) => super::alloc::raise(e),
        }
    }

    /// Storage for `numel` elements of `dtype` over a planned region (whose
    /// bytes others may have written: a cat in place).
    pub(crate) fn in_region(dtype: DType, numel: usize, region: Region) -> Storage {
        assert_eq!(
            region.len(),
            numel * dtype.size_bytes(),
            "internal error: region size"
        );
        Storage {
            buf: Block::Planned(region),
            dtype,
            numel,
        }
    }

    /// A copy of `self` in the host pool (an offloaded value: accounted by
    /// `alloc::host_memory_stats`, not `memory_stats`), or in ordinary
    /// storage (`host` false: brought back).
    pub fn try_copy(&self, host: bool) -> Result<Storage> {
        let len = self.buf.len();
        let raw = match host {
            true => RawBuffer::try_new_host(len)?,
            false => RawBuffer::try_new(len)?,
        };
        let mut s = Storage {
            buf: Block::Own(raw),
            dtype: self.dtype,
            numel: self.numel,
        };
        s.as_bytes_mut().copy_from_slice(self.as_bytes());
        Ok(s)
    }

    /// Whether it is in the host pool (see [`Storage::try_copy`]).
    pub fn in_host_pool(&self) -> bool {
        matches!(&self.buf, Block::Own(b) if b.is_host())
    }

    /// Storage holding a copy of `data`.
    pub fn from_slice<T: Element>(data: &[T]) -> Storage {
        let mut s = Storage::new(T::DTYPE, data.len());
        s.as_mut_slice::<T>().copy_from_slice(data);
        s
    }

    /// [`Storage::from_slice`], with allocation failure as an error.
    pub fn try_from_slice<T: Element>(data: &[T]) -> Result<Storage> {
        let mut s = Storage::try_new(T::DTYPE, data.len())?;
        s.as_mut_slice::<T>().copy_from_slice(data);
        Ok(s)
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn numel(&self) -> usize {
        self.numel
    }

    pub fn size_bytes(&self) -> usize {
        self.buf.len()
    }

    fn check<T: Element>(&self) {
        assert_eq!(
            T::DTYPE,
            self.dtype,
            "internal error: storage of {} read as {}",
            self.dtype,
            T::DTYPE
        );
    }

    pub fn as_slice<T: Element>(&self) -> &[T] {
        self.check::<T>();
        // SAFETY: the buffer is 64-byte aligned, holds numel*size_of::<T>()
        // initialised bytes, and every bit pattern is a valid T (Pod).
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr() as *const T, self.numel) }
    }

    pub fn as_mut_slice<T: Element>(&mut self) -> &mut [T] {
        self.check::<T>();
        // SAFETY: as in `as_slice`, and `&mut self` guarantees uniqueness.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_ptr() as *mut T, self.numel) }
    }

    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: initialised bytes of the buffer.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr(), self.buf.len()) }
    }

    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: initialised bytes, unique access.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_ptr(), self.buf.len()) }
    }
}
