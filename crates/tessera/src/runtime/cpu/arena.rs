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
//! The hook is thread-local and stacked: while a kernel waits inside a
//! rayon join, its thread may run another kernel of the same step, which
//! installs its own slots and restores the first kernel's when it returns.

use std::cell::RefCell;
use std::sync::Arc;

use super::alloc::RawBuffer;

/// One run's arena: a block from the pool, counted once by the allocator's
/// accounting; the storages placed in it keep it alive.
#[derive(Clone)]
pub struct Arena(Arc<RawBuffer>);

impl Arena {
    pub fn new(bytes: usize) -> Arena {
        Arena(Arc::new(RawBuffer::new(bytes)))
    }

    /// The slots of one kernel's buffers, built with [`Slots::value`] and
    /// [`Slots::scratch`].
    pub fn slots(&self) -> Slots {
        Slots {
            arena: self.0.clone(),
            scratch: None,
            in_scratch: false,
            values: Vec::new(),
        }
    }
}

/// `len` bytes at `offset` in an arena.
pub(crate) struct Region {
    arena: Arc<RawBuffer>,
    offset: usize,
    len: usize,
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
    arena: Arc<RawBuffer>,
    /// (offset, bytes, bytes handed out): scratch is handed out in pieces.
    scratch: Option<(usize, usize, usize)>,
    /// Inside [`scratch`]: allocations are the kernel's scratch.
    in_scratch: bool,
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
pub struct Block(Arc<RawBuffer>);

impl Block {
    pub fn new(bytes: usize) -> Block {
        Block(Arc::new(RawBuffer::new(bytes)))
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

    /// The place of the kernel's value of `len` bytes, taken without
    /// allocating (a cat in place takes its output this way).
    pub(crate) fn take_value(&mut self, len: usize) -> Option<Region> {
        let was = std::mem::replace(&mut self.in_scratch, false);
        let region = self.take(len);
        self.in_scratch = was;
        region
    }

    /// The place of an allocation of `len` bytes: a region, or `None` for
    /// the pool.
    fn take(&mut self, len: usize) -> Option<Region> {
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

    fn region(&self, offset: usize, len: usize) -> Region {
        region_of(&self.arena, offset, len)
    }
}

fn region_of(block: &Arc<RawBuffer>, offset: usize, len: usize) -> Region {
    assert!(
        offset + len <= block.len(),
        "internal error: a planned buffer ({len} bytes at {offset}) outside its block ({} bytes)",
        block.len()
    );
    Region {
        arena: block.clone(),
        offset,
        len,
    }
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
/// this thread is the kernel's planned scratch.
pub(crate) fn scratch<R>(f: impl FnOnce() -> R) -> R {
    let set = |on: bool| {
        PLANNED.with(|p| {
            p.borrow_mut()
                .last_mut()
                .map(|s| std::mem::replace(&mut s.in_scratch, on))
        })
    };
    let before = set(true);
    let r = f();
    if let Some(before) = before {
        set(before);
    }
    r
}

/// The planned place of an allocation of `len` bytes made now on this
/// thread, if a kernel with slots is running on it.
pub(crate) fn take(len: usize) -> Option<Region> {
    PLANNED.with(|p| p.borrow_mut().last_mut().and_then(|s| s.take(len)))
}
