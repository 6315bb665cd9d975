//! Planned allocation: the compiled executor's arena, one block per run the
//! size of the memory plan's arena, and the hook through which a kernel's
//! allocations land at their planned offsets in it.
//!
//! Kernels allocate with `Storage::new` as in eager mode; no kernel knows
//! about arenas. Before a kernel runs, the executor installs its
//! [`Slots`] on the thread that runs it ([`planned`]): the places the plan
//! gave the buffers the kernel creates. The few kernels that need scratch
//! (the copies of reductions and softmaxes of strided inputs, the f32
//! operands of half-precision matmuls) allocate it inside [`scratch`],
//! which hands out the kernel's scratch region piece by piece; any other
//! allocation takes the first unused value slot of its size; a slot of a value
//! that escapes the executable (a graph output, a saved tensor) sends the
//! allocation to the pool, so that no escaping tensor pins the arena. An
//! allocation that no slot matches also goes to the pool (the measured peak
//! then differs from the predicted one, which the planner tests catch).
//!
//! On a device (a compiled run whose inputs live on a GPU, with a plan
//! that reserves no CPU scratch: see `execute::run_scheduled`) the arena and
//! the blocks are device memory from the backend's allocator, counted once
//! by its accounting as on the host; the backend asks [`take_device`] when
//! it allocates, and a planned allocation becomes a [`DeviceRegion`]. Host
//! allocations made while a device kernel runs (values drawn on the host
//! and copied up, index checks) never take a device slot, nor the reverse.
//!
//! The hook is thread-local and stacked: while a kernel waits inside a
//! rayon join, its thread may run another kernel of the same step, which
//! installs its own slots and restores the first kernel's when it returns.

use std::cell::RefCell;
use std::sync::Arc;

use super::alloc::RawBuffer;
use crate::error::Result;
use crate::ir::DType;
use crate::runtime::device::{self, Device, DeviceMemory, DeviceStorage};

/// The memory of an arena or a block: host bytes from the pool, or device
/// bytes from the device backend's allocator.
#[derive(Clone)]
enum Memory {
    Host(Arc<RawBuffer>),
    Device(Arc<DeviceStorage>),
}

impl Memory {
    fn on(device: Device, bytes: usize) -> Result<Memory> {
        Ok(match device {
            Device::Cpu => Memory::Host(Arc::new(RawBuffer::try_new(bytes)?)),
            // Bool: one byte per element.
            d => Memory::Device(Arc::new(
                device::device_backend(d)?.alloc(DType::Bool, bytes)?,
            )),
        })
    }

    fn len(&self) -> usize {
        match self {
            Memory::Host(b) => b.len(),
            Memory::Device(s) => s.size_bytes(),
        }
    }

    /// The address of its first byte (host or device).
    fn addr(&self) -> u64 {
        match self {
            Memory::Host(b) => b.as_ptr() as u64,
            Memory::Device(s) => s.ptr(),
        }
    }
}

/// One run's arena: a block from the pool, counted once by the allocator's
/// accounting; the storages placed in it keep it alive.
#[derive(Clone)]
pub struct Arena(Memory);

impl Arena {
    /// An arena of `bytes` on `device` (out of memory is an error).
    pub fn on(device: Device, bytes: usize) -> Result<Arena> {
        Memory::on(device, bytes).map(Arena)
    }

    /// The slots of one kernel's buffers, built with [`Slots::value`] and
    /// [`Slots::scratch`].
    pub fn slots(&self) -> Slots {
        Slots {
            arena: self.0.clone(),
            scratch: None,
            in_scratch: false,
            paused: false,
            values: Vec::new(),
        }
    }
}

/// `len` bytes at `offset` in a host arena.
pub(crate) struct Region {
    arena: Arc<RawBuffer>,
    offset: usize,
    len: usize,
}

/// `len` bytes at `offset` in a device arena or block: the memory of a
/// device storage placed by the plan (keeps the arena alive).
pub struct DeviceRegion {
    block: Arc<DeviceStorage>,
    offset: usize,
    len: usize,
}

impl DeviceMemory for DeviceRegion {
    fn ptr(&self) -> u64 {
        self.block.ptr() + self.offset as u64
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// A planned place taken without allocating (see [`Slots::take_value`]).
pub(crate) enum Taken {
    Host(Region),
    Device(DeviceRegion),
}

impl Taken {
    /// The address of its first byte (host or device).
    pub(crate) fn addr(&self) -> u64 {
        match self {
            Taken::Host(r) => r.as_ptr() as u64,
            Taken::Device(r) => r.ptr(),
        }
    }
}

impl Region {
    pub(crate) fn as_ptr(&self) -> *mut u8 {
        // SAFETY: the plan placed [offset, offset + len) inside the arena.
        unsafe { self.arena.as_ptr().add(self.offset) }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

/// Where one kernel's allocations go.
pub struct Slots {
    arena: Memory,
    /// (offset, bytes, bytes handed out): scratch is handed out in pieces.
    scratch: Option<(usize, usize, usize)>,
    /// Inside [`scratch`]: allocations are the kernel's scratch.
    in_scratch: bool,
    /// Inside [`unplanned`]: allocations go to the pool.
    paused: bool,
    /// (bytes, place, taken).
    values: Vec<(usize, Place, bool)>,
}

/// Where a value goes.
#[derive(Clone)]
pub enum Place {
    /// At this offset in the arena.
    Arena(usize),
    /// At this offset in a block of its own (a piece of an escaping cat
    /// output, or that output).
    Block(Block, usize),
    /// In the pool (it escapes).
    Pool,
}

/// A block from the pool that regions share: the output of a cat in place
/// that escapes the run, allocated when its first piece is made.
#[derive(Clone)]
pub struct Block(Memory);

impl Block {
    /// A block of `bytes` on `device` (out of memory is an error).
    pub fn on(device: Device, bytes: usize) -> Result<Block> {
        Memory::on(device, bytes).map(Block)
    }
}

const ALIGN: usize = 64;

impl Slots {
    /// The kernel's scratch: `bytes` at `offset`.
    pub fn scratch(&mut self, offset: usize, bytes: usize) {
        self.scratch = Some((offset, bytes, 0));
    }

    /// The kernel's next output value: `bytes` at `place`.
    pub fn value(&mut self, bytes: usize, place: Place) {
        self.values.push((bytes, place, false));
    }

    /// The kernel's next output value, planned to be written over one of
    /// its inputs: it holds its position among the outputs but takes no
    /// allocation, unless [`Slots::release_in_place`] says the donation
    /// did not happen. Returns its index for that call.
    pub fn in_place(&mut self, bytes: usize) -> usize {
        self.values.push((bytes, Place::Pool, true));
        self.values.len() - 1
    }

    /// The input planned to be overwritten by the value of slot `index`
    /// could not be handed over (still shared): that value is allocated
    /// from the pool in its own position. Without this slot it would take
    /// the next untaken slot of its size, the place of another output.
    pub fn release_in_place(&mut self, index: usize) {
        self.values[index].2 = false;
    }

    /// The place of the kernel's value of `len` bytes, taken without
    /// allocating (a cat in place takes its output this way).
    pub(crate) fn take_value(&mut self, len: usize) -> Option<Taken> {
        let was = std::mem::replace(&mut self.in_scratch, false);
        let region = self.take(len).map(|(memory, offset, len)| match memory {
            Memory::Host(arena) => Taken::Host(Region { arena, offset, len }),
            Memory::Device(block) => Taken::Device(DeviceRegion { block, offset, len }),
        });
        self.in_scratch = was;
        region
    }

    /// The address each value slot hands out, in the order they were
    /// added (`None`: the pool). An allocation takes the first untaken slot
    /// of its size, so a kernel that allocates its equal-size outputs in
    /// another order than the plan's gets them in each other's slots: the
    /// executor compares against these (see `execute::Job::rehome`).
    pub(crate) fn value_addrs(&self) -> Vec<Option<u64>> {
        self.values
            .iter()
            .map(|(_, place, _)| match place {
                Place::Arena(offset) => Some(self.arena.addr() + *offset as u64),
                Place::Block(block, offset) => Some(block.0.addr() + *offset as u64),
                Place::Pool => None,
            })
            .collect()
    }

    /// Whether the slots are host memory (else device memory).
    fn on_host(&self) -> bool {
        matches!(self.arena, Memory::Host(_))
    }

    /// The place of an allocation of `len` bytes: (memory, offset, len), or
    /// `None` for the pool.
    fn take(&mut self, len: usize) -> Option<(Memory, usize, usize)> {
        if self.paused {
            return None;
        }
        if self.in_scratch {
            let (offset, bytes, used) = self.scratch.as_mut()?;
            let start = used.div_ceil(ALIGN) * ALIGN;
            if start + len > *bytes {
                return None;
            }
            *used = start + len;
            let at = *offset + start;
            return Some(self.region(at, len));
        }
        let slot = self
            .values
            .iter_mut()
            .find(|(bytes, _, taken)| *bytes == len && !taken)?;
        slot.2 = true;
        match slot.1.clone() {
            Place::Arena(offset) => Some(self.region(offset, len)),
            Place::Block(block, offset) => Some(region_of(&block.0, offset, len)),
            Place::Pool => None,
        }
    }

    fn region(&self, offset: usize, len: usize) -> (Memory, usize, usize) {
        region_of(&self.arena, offset, len)
    }
}

fn region_of(block: &Memory, offset: usize, len: usize) -> (Memory, usize, usize) {
    assert!(
        offset + len <= block.len(),
        "internal error: a planned buffer ({len} bytes at {offset}) outside its block ({} bytes)",
        block.len()
    );
    (block.clone(), offset, len)
}

thread_local! {
    static PLANNED: RefCell<Vec<Slots>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with `slots` receiving the allocations it makes on this thread.
pub fn planned<R>(slots: Slots, f: impl FnOnce() -> R) -> R {
    struct Pop;
    impl Drop for Pop {
        fn drop(&mut self) {
            PLANNED.with(|p| p.borrow_mut().pop());
        }
    }
    PLANNED.with(|p| p.borrow_mut().push(slots));
    let _pop = Pop;
    f()
}

/// Runs `f`, a kernel's computation of its scratch: what it allocates on
/// this thread is the kernel's planned scratch (what does not fit goes to
/// the pool). Device backends wrap their kernels' temporaries in it too.
pub fn scratch<R>(f: impl FnOnce() -> R) -> R {
    with_flag(|s| &mut s.in_scratch, f)
}

/// Runs `f` with the flag `field` picks of the running kernel's slots set,
/// restoring it afterwards, also when `f` unwinds (an allocation failure
/// on its way to the op's boundary: see `alloc::catching`).
fn with_flag<R>(field: fn(&mut Slots) -> &mut bool, f: impl FnOnce() -> R) -> R {
    struct Restore(fn(&mut Slots) -> &mut bool, Option<bool>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(before) = self.1 {
                set_flag(self.0, before);
            }
        }
    }
    let _restore = Restore(field, set_flag(field, true));
    f()
}

/// Sets the flag `field` picks of the running kernel's slots; its value
/// before, or `None` when no kernel has slots on this thread.
fn set_flag(field: fn(&mut Slots) -> &mut bool, on: bool) -> Option<bool> {
    PLANNED.with(|p| {
        p.borrow_mut()
            .last_mut()
            .map(|s| std::mem::replace(field(s), on))
    })
}

/// Runs `f` with the running kernel's slots set aside: what it allocates
/// on this thread comes from the pool (the intermediates of a group that
/// runs op by op, which the plan does not know).
pub(crate) fn unplanned<R>(f: impl FnOnce() -> R) -> R {
    with_flag(|s| &mut s.paused, f)
}

/// The planned place of a host allocation of `len` bytes made now on this
/// thread, if a kernel with host slots is running on it.
pub(crate) fn take(len: usize) -> Option<Region> {
    PLANNED.with(|p| {
        let mut p = p.borrow_mut();
        let slots = p.last_mut().filter(|s| s.on_host())?;
        match slots.take(len)? {
            (Memory::Host(arena), offset, len) => Some(Region { arena, offset, len }),
            (Memory::Device(_), ..) => unreachable!("host slots place in host memory"),
        }
    })
}

/// The planned place of a device allocation of `len` bytes made now on
/// this thread, if a kernel with device slots is running on it: what a
/// device backend's allocator calls first.
pub fn take_device(len: usize) -> Option<DeviceRegion> {
    PLANNED.with(|p| {
        let mut p = p.borrow_mut();
        let slots = p.last_mut().filter(|s| !s.on_host())?;
        match slots.take(len)? {
            (Memory::Device(block), offset, len) => Some(DeviceRegion { block, offset, len }),
            (Memory::Host(_), ..) => unreachable!("device slots place in device memory"),
        }
    })
}
