//! The caching allocator's bookkeeping, apart from the driver: free blocks
//! by rounded size, where new blocks come from, and when a freed block may
//! be handed out again or given back.
//!
//! Blocks come from the driver (`cuMemAlloc`), or from an
//! [`ExternalAllocator`] that a library sharing the process lends tessera
//! (PyTorch's caching allocator, set by tessera-py), so that one pool
//! serves both and neither keeps freed memory the other cannot reuse.
//!
//! When a freed block may go where:
//!
//! - between a fork and its join (a step on several lanes) it is held back
//!   and put at the join, after which every lane's work is ordered before
//!   anything queued later;
//! - while a capture records, it goes to the capture's pool, which the
//!   graph keeps;
//! - a driver block is cached; on one stream the cache is safe without
//!   events (see `gpu.rs`);
//! - an external block is given back at once, unless a foreign call is in
//!   progress ([`BlockCache::enter`] .. [`BlockCache::leave`]): then it is
//!   cached, reused by tessera's work of that call, and given back when
//!   the call ends. The external allocator hands blocks out for work on
//!   the foreign library's stream; the call's end orders that stream
//!   after tessera's work (`Gpu::end_foreign_call`), so a block given back
//!   then, or later, is never reused while tessera's kernels still touch
//!   it.

use std::collections::HashMap;
use std::sync::Arc;

/// Device memory lent by a library that shares the process and the GPU's
/// context (PyTorch's caching allocator under tessera-py).
///
/// Stream semantics: `alloc` hands out a block for work queued on
/// `stream`, the foreign library's stream that tessera's calls are
/// ordered against (`CudaBackend::begin_foreign_call`); tessera calls `free` only
/// once every piece of its own work on the block is ordered before any
/// work queued on that stream from then on, so the allocator may hand the
/// block out again on its stream at once. That holds for blocks freed
/// during a foreign call or after one (all of tessera's work then ran in
/// calls); a program that runs tessera outside foreign calls gives blocks
/// back with its kernels maybe still queued, so its lender must not hand
/// them out before the device has finished them. (Unwind-safe: device
/// memory crosses `catch_unwind` boundaries in the runtime.)
pub trait ExternalAllocator: Send + Sync + std::panic::RefUnwindSafe {
    /// At least `bytes` of device memory for work on `stream` (a
    /// `CUstream` as an integer; 0 is the legacy default stream).
    fn alloc(&self, bytes: usize, stream: u64) -> Result<ExternalBlock, String>;

    /// Gives back a block that `alloc` returned.
    fn free(&self, block: ExternalBlock);

    /// Its name in messages, e.g. `PyTorch's caching allocator`.
    fn name(&self) -> String;
}

/// A block an [`ExternalAllocator`] lent: its device address and the
/// allocator's own handle on it (given back with it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExternalBlock {
    pub ptr: u64,
    pub handle: u64,
}

/// A block of device memory and where it goes back to.
#[derive(Clone)]
pub(crate) struct Block {
    pub ptr: u64,
    /// None: from the driver.
    pub lender: Option<(Arc<dyn ExternalAllocator>, u64)>,
}

impl Block {
    pub fn driver(ptr: u64) -> Block {
        Block { ptr, lender: None }
    }

    pub fn external(lender: Arc<dyn ExternalAllocator>, block: ExternalBlock) -> Block {
        Block {
            ptr: block.ptr,
            lender: Some((lender, block.handle)),
        }
    }

    /// Gives an external block back to its lender (a driver block is
    /// freed by `Gpu`, which holds the context).
    pub fn give_back(self) {
        if let Some((lender, handle)) = self.lender {
            lender.free(ExternalBlock {
                ptr: self.ptr,
                handle,
            });
        }
    }
}

/// Free blocks by rounded size, and the rules above.
#[derive(Default)]
pub(crate) struct BlockCache {
    free: HashMap<usize, Vec<Block>>,
    /// Bytes of the blocks in `free`.
    pub cached: usize,
    /// Between a fork and its join: blocks freed, with their rounded size.
    held: Option<Vec<(usize, Block)>>,
    /// While capturing: the capture's free blocks.
    capture: Option<HashMap<usize, Vec<Block>>>,
    /// Where new blocks come from (None: the driver).
    external: Option<Arc<dyn ExternalAllocator>>,
    /// Foreign calls in progress.
    foreign_calls: usize,
    /// The foreign stream of the latest call: new external blocks are for
    /// work on it.
    foreign_stream: u64,
}

impl BlockCache {
    /// Where a freed block goes (see the module's rules): the block to
    /// give back to its lender now, if any.
    #[must_use]
    pub fn put(&mut self, cap: usize, block: Block) -> Option<Block> {
        if let Some(held) = &mut self.held {
            held.push((cap, block));
        } else if let Some(capture) = &mut self.capture {
            capture.entry(cap).or_default().push(block);
        } else if block.lender.is_some() && self.foreign_calls == 0 {
            return Some(block);
        } else {
            self.cached += cap;
            self.free.entry(cap).or_default().push(block);
        }
        None
    }

    /// Puts every block of `blocks` (a graph's, when dropped): the ones to
    /// give back now.
    #[must_use]
    pub fn put_all(&mut self, blocks: Vec<(usize, Block)>) -> Vec<Block> {
        blocks
            .into_iter()
            .filter_map(|(cap, b)| self.put(cap, b))
            .collect()
    }

    /// A free block of rounded size `cap`: the capture's first.
    pub fn get(&mut self, cap: usize) -> Option<Block> {
        if let Some(b) = self.capture.as_mut().and_then(|c| c.get_mut(&cap)?.pop()) {
            return Some(b);
        }
        let b = self.free.get_mut(&cap).and_then(Vec::pop);
        if b.is_some() {
            self.cached -= cap;
        }
        b
    }

    /// A step on several lanes starts: freed blocks are held back.
    pub fn fork(&mut self) {
        self.held.get_or_insert_with(Vec::new);
    }

    /// The step's lanes joined: the held blocks are put; the ones to give
    /// back now.
    #[must_use]
    pub fn join(&mut self) -> Vec<Block> {
        let held = self.held.take().unwrap_or_default();
        self.put_all(held)
    }

    pub fn begin_capture(&mut self) {
        self.capture = Some(HashMap::new());
    }

    pub fn capturing(&self) -> bool {
        self.capture.is_some()
    }

    /// The capture's blocks, which its graph keeps (none when no capture
    /// was recording).
    pub fn end_capture(&mut self) -> Vec<(usize, Block)> {
        self.capture
            .take()
            .unwrap_or_default()
            .into_iter()
            .flat_map(|(cap, blocks)| blocks.into_iter().map(move |b| (cap, b)))
            .collect()
    }

    /// A foreign call starts; the external blocks tessera allocates until
    /// it ends are for work on `stream`.
    pub fn enter(&mut self, stream: u64) {
        self.foreign_calls += 1;
        self.foreign_stream = stream;
    }

    /// A foreign call ended (its stream now waits for tessera's work):
    /// when it was the last one in progress, the cached external blocks,
    /// to give back.
    #[must_use]
    pub fn leave(&mut self) -> Vec<Block> {
        self.foreign_calls = self.foreign_calls.saturating_sub(1);
        if self.foreign_calls > 0 {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (cap, blocks) in self.free.iter_mut() {
            let (lent, own): (Vec<Block>, Vec<Block>) =
                blocks.drain(..).partition(|b| b.lender.is_some());
            self.cached -= cap * lent.len();
            out.extend(lent);
            *blocks = own;
        }
        self.free.retain(|_, blocks| !blocks.is_empty());
        out
    }

    /// Every cached block (for the caller to free once the device is
    /// idle).
    pub fn drain(&mut self) -> Vec<Block> {
        self.cached = 0;
        self.free.drain().flat_map(|(_, v)| v).collect()
    }

    /// Where new blocks come from from now on; the cached blocks, which
    /// the caller frees once the device is idle (blocks alive now go back
    /// to their own lender when freed).
    pub fn set_external(&mut self, external: Option<Arc<dyn ExternalAllocator>>) -> Vec<Block> {
        self.external = external;
        self.drain()
    }

    /// The lender of new blocks (None: the driver) and the stream they
    /// are for.
    pub fn lender(&self) -> (Option<Arc<dyn ExternalAllocator>>, u64) {
        (self.external.clone(), self.foreign_stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Lends addresses from a counter and records what comes back.
    #[derive(Default)]
    struct Lender {
        next: Mutex<u64>,
        freed: Mutex<Vec<u64>>,
        streams: Mutex<Vec<u64>>,
    }

    impl ExternalAllocator for Lender {
        fn alloc(&self, bytes: usize, stream: u64) -> Result<ExternalBlock, String> {
            let mut next = self.next.lock().unwrap();
            *next += 1;
            self.streams.lock().unwrap().push(stream);
            Ok(ExternalBlock {
                ptr: *next * 0x1000 + bytes as u64,
                handle: *next,
            })
        }

        fn free(&self, block: ExternalBlock) {
            self.freed.lock().unwrap().push(block.handle);
        }

        fn name(&self) -> String {
            "the test's lender".into()
        }
    }

    fn lent(cache: &BlockCache, lender: &Arc<Lender>, bytes: usize) -> Block {
        let (ext, stream) = cache.lender();
        let ext = ext.expect("an external allocator is set");
        let dyn_lender: Arc<dyn ExternalAllocator> = lender.clone();
        assert!(Arc::ptr_eq(&ext, &dyn_lender));
        Block::external(ext.clone(), ext.alloc(bytes, stream).unwrap())
    }

    fn setup() -> (BlockCache, Arc<Lender>) {
        let lender = Arc::new(Lender::default());
        let mut cache = BlockCache::default();
        assert!(cache.set_external(Some(lender.clone())).is_empty());
        (cache, lender)
    }

    fn give_back(blocks: impl IntoIterator<Item = Block>) {
        blocks.into_iter().for_each(Block::give_back);
    }

    fn freed(lender: &Lender) -> Vec<u64> {
        lender.freed.lock().unwrap().clone()
    }

    /// Outside a foreign call an external block goes back at once: tessera
    /// keeps nothing the lender could not reuse.
    #[test]
    fn an_external_block_freed_outside_a_call_goes_back_at_once() {
        let (mut cache, lender) = setup();
        let b = lent(&cache, &lender, 512);
        give_back(cache.put(512, b));
        assert_eq!(freed(&lender), vec![1]);
        assert_eq!(cache.cached, 0);
        assert!(cache.get(512).is_none());
    }

    /// Inside a call an external block is cached, reused by tessera's next
    /// allocation of its size, and given back when the call ends; blocks
    /// are lent for the call's stream.
    #[test]
    fn inside_a_call_external_blocks_are_reused_then_given_back_at_its_end() {
        let (mut cache, lender) = setup();
        cache.enter(0xabc);
        let a = lent(&cache, &lender, 1024);
        let b = lent(&cache, &lender, 2048);
        assert!(cache.put(1024, a.clone()).is_none());
        assert!(cache.put(2048, b).is_none());
        assert_eq!(cache.cached, 3072);
        let again = cache.get(1024).expect("reused within the call");
        assert_eq!(again.ptr, a.ptr);
        assert!(cache.put(1024, again).is_none());
        assert!(freed(&lender).is_empty());
        let back = cache.leave();
        assert_eq!(back.len(), 2);
        give_back(back);
        let mut f = freed(&lender);
        f.sort();
        assert_eq!(f, vec![1, 2]);
        assert_eq!(cache.cached, 0);
        assert_eq!(*lender.streams.lock().unwrap(), vec![0xabc, 0xabc]);
    }

    /// Nested (or concurrent) calls give the blocks back only when the last
    /// one ends.
    #[test]
    fn blocks_go_back_when_the_last_call_ends() {
        let (mut cache, lender) = setup();
        cache.enter(1);
        cache.enter(1);
        let a = lent(&cache, &lender, 512);
        assert!(cache.put(512, a).is_none());
        assert!(cache.leave().is_empty());
        assert_eq!(cache.leave().len(), 1);
        // One leave too many is harmless.
        assert!(cache.leave().is_empty());
        assert!(freed(&lender).is_empty());
    }

    /// Driver blocks stay cached across calls (tessera's own memory); only
    /// `drain` hands them over to be freed.
    #[test]
    fn driver_blocks_stay_cached_across_calls() {
        let (mut cache, lender) = setup();
        cache.enter(0);
        assert!(cache.put(512, Block::driver(0x7000)).is_none());
        let a = lent(&cache, &lender, 512);
        assert!(cache.put(512, a).is_none());
        let back = cache.leave();
        assert_eq!(back.len(), 1);
        assert!(back[0].lender.is_some());
        assert_eq!(cache.cached, 512);
        assert!(cache.put(512, Block::driver(0x9000)).is_none());
        let drained = cache.drain();
        assert_eq!(drained.len(), 2);
        assert!(drained.iter().all(|b| b.lender.is_none()));
        assert_eq!(cache.cached, 0);
    }

    /// During a step on several lanes nothing goes back before the join,
    /// even outside a call: a lane may still read the block.
    #[test]
    fn a_fork_holds_external_blocks_until_the_join() {
        let (mut cache, lender) = setup();
        cache.fork();
        let a = lent(&cache, &lender, 512);
        assert!(cache.put(512, a).is_none());
        assert!(cache.get(512).is_none(), "held blocks are not reused");
        assert!(freed(&lender).is_empty());
        give_back(cache.join());
        assert_eq!(freed(&lender), vec![1]);
    }

    /// A capture keeps the blocks freed while it records; they go back when
    /// its graph gives them up.
    #[test]
    fn a_capture_keeps_its_blocks_until_its_graph_gives_them_up() {
        let (mut cache, lender) = setup();
        cache.begin_capture();
        let a = lent(&cache, &lender, 512);
        assert!(cache.put(512, a.clone()).is_none());
        assert_eq!(cache.get(512).map(|b| b.ptr), Some(a.ptr));
        assert!(cache.put(512, a).is_none());
        let kept = cache.end_capture();
        assert_eq!(kept.len(), 1);
        assert!(!cache.capturing());
        assert!(freed(&lender).is_empty());
        give_back(cache.put_all(kept));
        assert_eq!(freed(&lender), vec![1]);
    }

    /// Switching the lender hands over the cached blocks; a block lent
    /// before the switch still goes back to its own lender.
    #[test]
    fn switching_lenders_keeps_each_block_with_its_own() {
        let (mut cache, first) = setup();
        cache.enter(0);
        let a = lent(&cache, &first, 512);
        let b = lent(&cache, &first, 512);
        assert!(cache.put(512, a).is_none());
        let second = Arc::new(Lender::default());
        let drained = cache.set_external(Some(second.clone()));
        assert_eq!(drained.len(), 1);
        give_back(drained);
        assert_eq!(freed(&first), vec![1]);
        give_back(cache.leave());
        give_back(cache.put(512, b));
        assert_eq!(freed(&first), vec![1, 2]);
        assert!(freed(&second).is_empty());
        assert!(cache.set_external(None).is_empty());
        assert!(cache.lender().0.is_none());
    }
}
