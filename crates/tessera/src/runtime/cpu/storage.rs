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

/// A buffer of its own, a planned region of a compiled run's arena, or
/// memory another library owns (see [`Storage::from_foreign`]).
enum Block {
    Own(RawBuffer),
    Planned(Region),
    Foreign(Foreign),
}

/// What keeps lent memory alive (see [`Storage::from_foreign`]): dropped
/// when the last view of the storage is.
pub type ForeignOwner = Box<dyn Send + Sync + std::panic::RefUnwindSafe + std::panic::UnwindSafe>;

/// Host memory lent by another library (a PyTorch tensor's through DLPack):
/// `owner` keeps it alive and gives it back when dropped.
struct Foreign {
    ptr: *mut u8,
    len: usize,
    _owner: ForeignOwner,
    /// Waits until the bytes are written (a device's copy in flight), run
    /// before the first read or write on the host (see
    /// [`Storage::from_foreign_pending`]).
    pending: Option<Pending>,
}

/// A wait for bytes still being written, and whether it has run.
struct Pending {
    wait: Box<dyn Fn() + Send + Sync + std::panic::RefUnwindSafe + std::panic::UnwindSafe>,
    done: std::sync::atomic::AtomicBool,
}

impl Pending {
    fn wait(&self) {
        use std::sync::atomic::Ordering;
        if !self.done.load(Ordering::Acquire) {
            (self.wait)();
            self.done.store(true, Ordering::Release);
        }
    }
}

// SAFETY: `Storage::from_foreign`'s contract: the bytes stay valid and
// unaliased by writers until `owner` drops, from any thread.
unsafe impl Send for Foreign {}
unsafe impl Sync for Foreign {}

impl Block {
    /// The first byte, once written (a pending foreign block waits).
    fn as_ptr(&self) -> *mut u8 {
        match self {
            Block::Own(b) => b.as_ptr(),
            Block::Planned(r) => r.as_ptr(),
            Block::Foreign(f) => {
                if let Some(p) = &f.pending {
                    p.wait();
                }
                f.ptr
            }
        }
    }

    fn len(&self) -> usize {
        match self {
            Block::Own(b) => b.len(),
            Block::Planned(r) => r.len(),
            Block::Foreign(f) => f.len,
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

    /// Storage over `len` bytes at `ptr` that another library owns (zero
    /// copy: a PyTorch tensor's memory through DLPack); dropping the last
    /// view drops `owner`, which gives the memory back. Errors (naming the
    /// dtype and sizes) when `ptr` is null or not aligned for `dtype`, or
    /// when `len` is not `numel` elements of `dtype` or past the size limit.
    ///
    /// # Safety
    ///
    /// The `len` bytes at `ptr` must be initialised, readable and writable
    /// from any thread, and neither freed nor written by anyone else while
    /// `owner` is alive (tessera reads them, and writes them only where the
    /// caller donates the storage).
    pub unsafe fn from_foreign(
        dtype: DType,
        numel: usize,
        ptr: *mut u8,
        len: usize,
        owner: ForeignOwner,
    ) -> Result<Storage> {
        let fits =
            numel <= limits::MAX_ELEMENTS && numel.checked_mul(dtype.size_bytes()) == Some(len);
        if !fits || ptr.is_null() || !(ptr as usize).is_multiple_of(dtype.size_bytes()) {
            return Err(Error::new(
                ErrorKind::Argument,
                format!(
                    "foreign memory of {len} bytes at {ptr:p} cannot hold {numel} elements \
                     of {dtype} (null, misaligned for {dtype}, of another size, or past the \
                     size limit)"
                ),
            ));
        }
        Ok(Storage {
            buf: Block::Foreign(Foreign {
                ptr,
                len,
                _owner: owner,
                pending: None,
            }),
            dtype,
            numel,
        })
    }

    /// [`Storage::from_foreign`] over bytes still being written (a device
    /// copies into them on a stream of its own: an offload in flight):
    /// `wait` blocks until they are, and runs once, before the first read
    /// or write on the host. A device that reads them behind its own copy
    /// takes [`Storage::as_ptr_unwaited`].
    ///
    /// # Safety
    ///
    /// As [`Storage::from_foreign`], the bytes initialised once `wait`
    /// returns.
    pub unsafe fn from_foreign_pending(
        dtype: DType,
        numel: usize,
        ptr: *mut u8,
        len: usize,
        owner: ForeignOwner,
        wait: Box<dyn Fn() + Send + Sync + std::panic::RefUnwindSafe + std::panic::UnwindSafe>,
    ) -> Result<Storage> {
        let mut s = Storage::from_foreign(dtype, numel, ptr, len, owner)?;
        if let Block::Foreign(f) = &mut s.buf {
            f.pending = Some(Pending {
                wait,
                done: std::sync::atomic::AtomicBool::new(false),
            });
        }
        Ok(s)
    }

    /// The address of the first byte without waiting for bytes still
    /// being written (see [`Storage::from_foreign_pending`]): for a
    /// device copy queued behind the copy that writes them.
    pub fn as_ptr_unwaited(&self) -> *const u8 {
        match &self.buf {
            Block::Foreign(f) => f.ptr,
            b => b.as_ptr(),
        }
    }

    /// Whether the bytes are lent by another library ([`Storage::from_foreign`]).
    pub fn is_foreign(&self) -> bool {
        matches!(self.buf, Block::Foreign(_))
    }

    /// The address of the first byte (for zero-copy export, e.g. DLPack).
    pub fn as_ptr(&self) -> *const u8 {
        self.buf.as_ptr()
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
        // SAFETY: the buffer is aligned for T (64 bytes, or as checked by
        // `from_foreign`), holds numel*size_of::<T>()
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Bytes "still being written": the wait writes them, once, before
    /// the first host read; a device reading behind the copy does not wait.
    #[test]
    fn pending_foreign_bytes_are_waited_for_once_before_the_first_read() {
        let bytes: &'static mut [f32] = Box::leak(vec![0.0f32; 4].into_boxed_slice());
        let ptr = bytes.as_mut_ptr() as *mut u8;
        let addr = ptr as usize;
        let waits = Arc::new(AtomicUsize::new(0));
        let counted = waits.clone();
        let wait = Box::new(move || {
            counted.fetch_add(1, Ordering::SeqCst);
            // SAFETY: the leaked 16 bytes, read by nobody until this returns.
            let written = unsafe { std::slice::from_raw_parts_mut(addr as *mut f32, 4) };
            written.copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        });
        // SAFETY: 16 leaked bytes, valid for the process.
        let s = unsafe {
            Storage::from_foreign_pending(DType::F32, 4, ptr, 16, Box::new(()), wait).unwrap()
        };
        assert_eq!(s.as_ptr_unwaited(), ptr as *const u8);
        assert_eq!(waits.load(Ordering::SeqCst), 0, "no host read yet");
        assert_eq!(s.as_slice::<f32>(), &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(s.as_bytes().len(), 16);
        assert_eq!(waits.load(Ordering::SeqCst), 1, "waited once");
    }
}
