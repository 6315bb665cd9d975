//! Saved values waiting in host memory for the backward, in eager work:
//! the tape's saved values of ops run inside a `{"offload": true}` region
//! (PyTorch's `torch.autograd.graph.save_on_cpu`), and the saved values the
//! `aot_eager` backend's forward graph hands its backward ([`super::interpret`]).
//!
//! A value goes to host memory through its device's `Backend::offload_start`
//! (CUDA: a page-locked block, copied on the copy stream after the value's
//! producer; the CPU: a copy into the host pool, accounted apart in
//! `cpu::host_memory_stats`, as compiled runs on the CPU offload — on the
//! CPU both pools are the same RAM, so the copy costs time and saves no
//! physical memory: it keeps the CPU path the same as the GPU's, and
//! measurable). Up to `IN_FLIGHT` (2) copies stay in flight, so that the
//! compute queued after one overlaps it; the device bytes are released
//! when it is waited for. Views of one buffer share one host copy. A value
//! comes back through `Backend::prefetch_start` when the backward reads
//! it, the compute waiting for the copy on the device (no host wait).
//!
//! [`stats`] counts what moved on the calling thread (eager work and its
//! hint scopes are per thread).

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};

use super::Tensor;
use crate::error::Result;
use crate::runtime::array::{Array, Buffer};
use crate::runtime::cpu::Storage;
use crate::runtime::device::{self, Device, DeviceStorage, Transfer};

/// What eager work on this thread moved between device and host memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OffloadStats {
    /// Saved values put in host memory (views of one buffer count each).
    pub values: usize,
    /// Bytes copied to host memory (a buffer shared by views counts once).
    pub offloaded_bytes: usize,
    /// Bytes copied back to the device for a backward.
    pub prefetched_bytes: usize,
}

/// Copies to the host left in flight before the oldest is waited for: the
/// next op's compute overlaps a copy, and at most this many saved values
/// hold device bytes after their copy started.
const IN_FLIGHT: usize = 2;

/// A buffer a host copy was made of, and that copy.
struct Copied {
    from: WeakBuffer,
    host: Weak<Storage>,
}

enum WeakBuffer {
    Host(Weak<Storage>),
    Device(Weak<DeviceStorage>),
}

impl WeakBuffer {
    fn of(buffer: &Buffer) -> WeakBuffer {
        match buffer {
            Buffer::Host(s) => WeakBuffer::Host(Arc::downgrade(s)),
            Buffer::Device(s) => WeakBuffer::Device(Arc::downgrade(s)),
        }
    }

    fn is(&self, buffer: &Buffer) -> bool {
        match (self, buffer) {
            (WeakBuffer::Host(w), Buffer::Host(s)) => std::ptr::eq(w.as_ptr(), Arc::as_ptr(s)),
            (WeakBuffer::Device(w), Buffer::Device(s)) => std::ptr::eq(w.as_ptr(), Arc::as_ptr(s)),
            _ => false,
        }
    }
}

thread_local! {
    static STATS: Cell<OffloadStats> = const {
        Cell::new(OffloadStats { values: 0, offloaded_bytes: 0, prefetched_bytes: 0 })
    };
    static TRANSFERS: RefCell<VecDeque<Box<dyn Transfer>>> = const { RefCell::new(VecDeque::new()) };
}

/// Host copies by the address of the buffer they copy; valid while the
/// buffer keeps its values: [`forget`] drops the entry of one a kernel is
/// given to write over (`Tensor::into_unique_array`, on any thread).
static COPIES: Mutex<Option<HashMap<u64, Copied>>> = Mutex::new(None);
/// Whether [`COPIES`] may hold an entry (spares the lock otherwise).
static ANY_COPIES: AtomicBool = AtomicBool::new(false);

/// The buffer at `addr` is about to be written over: its host copy, if
/// any, no longer holds its values.
pub(crate) fn forget(addr: u64) {
    if !ANY_COPIES.load(Ordering::Relaxed) {
        return;
    }
    if let Ok(mut copies) = COPIES.lock() {
        if let Some(map) = copies.as_mut() {
            map.remove(&addr);
        }
    }
}

/// What eager work on this thread moved so far.
pub fn stats() -> OffloadStats {
    STATS.with(Cell::get)
}

/// Starts [`stats`] again from zero.
pub fn reset_stats() {
    STATS.with(|s| s.set(OffloadStats::default()));
}

fn count(f: impl FnOnce(&mut OffloadStats)) {
    STATS.with(|s| {
        let mut v = s.get();
        f(&mut v);
        s.set(v);
    });
}

/// `t`'s values in host memory (same handle otherwise: its autograd state
/// and shape), or `t` itself when it has no values (a traced tensor) or
/// they are on the host already while its device's are not (a host scalar
/// of a GPU op).
pub(crate) fn to_host(t: &Tensor, on: Device) -> Result<Tensor> {
    let Some(array) = t.try_array() else {
        return Ok(t.clone());
    };
    if array.device() != on {
        return Ok(t.clone());
    }
    let addr = array.buffer_addr();
    let reused = COPIES.lock().ok().and_then(|copies| {
        let copied = copies
            .as_ref()?
            .get(&addr)
            .filter(|c| c.from.is(array.buffer()))?;
        copied.host.upgrade()
    });
    let host = match reused {
        Some(storage) => Array::from_parts(storage, array.layout().clone()),
        None => copy_to_host(array, addr)?,
    };
    count(|s| s.values += 1);
    Ok(t.with_values(host))
}

/// Starts the copy of `array`'s buffer to host memory, remembered for its
/// other views.
fn copy_to_host(array: &Array, addr: u64) -> Result<Array> {
    let (host, transfer) = device::backend(array.device())?.offload_start(array)?;
    if let Some(transfer) = transfer {
        let oldest = TRANSFERS.with(|t| {
            let mut queue = t.borrow_mut();
            queue.push_back(transfer);
            (queue.len() > IN_FLIGHT)
                .then(|| queue.pop_front())
                .flatten()
        });
        if let Some(done) = oldest {
            // The compute queued from now on waits for the copy; then its
            // device bytes may be reused.
            done.wait()?;
        }
    }
    let bytes = array.storage_numel() * array.dtype().size_bytes();
    count(|s| s.offloaded_bytes += bytes);
    if let Some(storage) = host.host_storage() {
        if let Ok(mut copies) = COPIES.lock() {
            let map = copies.get_or_insert_with(HashMap::new);
            // Entries whose copy no node holds any more go.
            map.retain(|_, c| c.host.strong_count() > 0);
            map.insert(
                addr,
                Copied {
                    from: WeakBuffer::of(array.buffer()),
                    host: Arc::downgrade(storage),
                },
            );
            ANY_COPIES.store(true, Ordering::Relaxed);
        }
    }
    Ok(host)
}

/// `t` (made by [`to_host`]) back in the memory of `on`, ready for the
/// kernels queued from now on.
pub(crate) fn to_device(t: &Tensor, on: Device) -> Result<Tensor> {
    let Some(array) = t.try_array() else {
        return Ok(t.clone());
    };
    let (back, transfer) = device::backend(on)?.prefetch_start(array)?;
    if let Some(transfer) = transfer {
        transfer.wait()?;
    }
    count(|s| s.prefetched_bytes += array.storage_numel() * array.dtype().size_bytes());
    Ok(t.with_values(back))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn views_of_one_buffer_share_one_host_copy_and_come_back_equal() {
        reset_stats();
        let x = Tensor::from_vec((0..12).map(|i| i as f32).collect(), &[3, 4]);
        let v = x.t();
        let host_before = crate::runtime::cpu::host_memory_stats().live_bytes;
        let (hx, hv) = (
            to_host(&x, Device::Cpu).unwrap(),
            to_host(&v, Device::Cpu).unwrap(),
        );
        assert!(hx.array().shares_buffer(hv.array()) && !hx.shares_storage(&x));
        assert_eq!(
            stats(),
            OffloadStats {
                values: 2,
                offloaded_bytes: 48,
                prefetched_bytes: 0
            }
        );
        assert!(crate::runtime::cpu::host_memory_stats().live_bytes >= host_before + 48);
        let back = to_device(&hv, Device::Cpu).unwrap();
        assert_eq!(back.to_vec::<f32>().unwrap(), v.to_vec::<f32>().unwrap());
        assert_eq!(stats().prefetched_bytes, 48);
    }
}
