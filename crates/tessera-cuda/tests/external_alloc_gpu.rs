//! Device memory lent by an external allocator (`ExternalAllocator`, what
//! tessera-py sets to PyTorch's caching allocator): compiled runs on its
//! blocks compute the bits they compute on tessera's own; inside a foreign
//! call the blocks tessera frees are kept for its reuse and given back at
//! the call's end, outside one at once; tessera keeps none cached. Runs only
//! with `TESSERA_CUDA_TESTS=1` (there a missing GPU is a failure).

#[path = "../../tessera/tests/schedule_util/mod.rs"]
mod schedule_util;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Once};

use cudarc::driver::{result as cu, sys};
use schedule_util::{chain, traced};
use tessera::fusion::fuse;
use tessera::ir::DType;
use tessera::runtime::device::{self, Device};
use tessera::runtime::execute::run_scheduled;
use tessera::schedule::{self, ScheduleOptions, Strategy};
use tessera::tensor::Generator;
use tessera::Tensor;
use tessera_cuda::{ExternalAllocator, ExternalBlock};

fn gpu() -> bool {
    if std::env::var("TESSERA_CUDA_TESTS").as_deref() != Ok("1") {
        eprintln!("TESSERA_CUDA_TESTS is not 1: external allocator GPU tests do not run here");
        return false;
    }
    static OPEN: Once = Once::new();
    OPEN.call_once(|| tessera_cuda::register().expect("TESSERA_CUDA_TESTS=1 needs a GPU"));
    true
}

/// The allocator is the backend's, global: one test at a time.
fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Lends cuMemAlloc blocks and records each block's stream and return.
#[derive(Default)]
struct Lender {
    /// Handle → (address, bytes, stream) of the blocks out now.
    out: Mutex<HashMap<u64, (u64, usize, u64)>>,
    next: Mutex<u64>,
    lent: Mutex<usize>,
}

impl ExternalAllocator for Lender {
    fn alloc(&self, bytes: usize, stream: u64) -> Result<ExternalBlock, String> {
        let ptr = unsafe { cu::malloc_sync(bytes) }.map_err(|e| format!("{e:?}"))?;
        let mut next = self.next.lock().unwrap();
        *next += 1;
        *self.lent.lock().unwrap() += 1;
        self.out.lock().unwrap().insert(*next, (ptr, bytes, stream));
        Ok(ExternalBlock { ptr, handle: *next })
    }

    fn free(&self, block: ExternalBlock) {
        let (ptr, _, _) = self
            .out
            .lock()
            .unwrap()
            .remove(&block.handle)
            .expect("a block given back once, by its handle");
        assert_eq!(ptr, block.ptr);
        // The device idle first: this lender has no stream order of its own.
        cu::ctx::synchronize().unwrap();
        unsafe { cu::free_sync(ptr) }.unwrap();
    }

    fn name(&self) -> String {
        "the test's lender".into()
    }
}

impl Lender {
    fn out(&self) -> usize {
        self.out.lock().unwrap().len()
    }

    fn streams(&self) -> Vec<u64> {
        self.out.lock().unwrap().values().map(|b| b.2).collect()
    }
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, &mut Generator::new(seed))
}

fn bits(ts: &[Tensor]) -> Vec<Vec<u64>> {
    ts.iter()
        .map(|t| t.to_f64_vec().iter().map(|v| v.to_bits()).collect())
        .collect()
}

#[test]
fn a_run_on_lent_memory_gives_every_block_back() {
    if !gpu() {
        return;
    }
    let _lock = exclusive();
    let backend = tessera_cuda::backend().unwrap();
    let host = vec![randn(&[64, 128], 1), randn(&[128, 96], 2), randn(&[96], 3)];
    let graph = traced("chain", &host, chain);
    let plan = fuse(&graph);
    let options = ScheduleOptions {
        strategy: Strategy::Bfs,
        memory_budget: None,
        device: Device::Cuda,
    };
    let s = schedule::build(&graph, &plan, &options).unwrap();
    let run = |inputs: &[Tensor]| -> Vec<Tensor> {
        run_scheduled(&graph, &plan, &s.schedule, &s.memory, inputs)
            .unwrap()
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    };
    let own: Vec<Tensor> = host.iter().map(|t| t.to(Device::Cuda).unwrap()).collect();
    let reference = bits(&run(&own));

    let lender = Arc::new(Lender::default());
    backend.set_external_allocator(Some(lender.clone()));
    let stats = backend.allocator_stats();
    assert_eq!(stats.external.as_deref(), Some("the test's lender"));
    assert_eq!(stats.cached_bytes, 0, "the switch freed tessera's cache");
    let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking).unwrap();
    let caller = stream as u64;

    backend.begin_foreign_call(caller).unwrap();
    let inputs: Vec<Tensor> = host.iter().map(|t| t.to(Device::Cuda).unwrap()).collect();
    let outs = run(&inputs);
    assert!(
        backend.allocator_stats().cached_bytes > 0,
        "the arena, freed in the call, is kept for tessera's reuse"
    );
    let during = lender.out();
    backend.end_foreign_call(caller).unwrap();
    assert!(
        lender.out() < during,
        "the blocks freed in the call went back at its end ({during} out before, {} after)",
        lender.out()
    );
    assert!(lender.out() >= inputs.len() + outs.len());
    assert!(lender.streams().iter().all(|&s| s == caller));
    assert_eq!(backend.allocator_stats().cached_bytes, 0);
    // Read on tessera's stream (a download synchronises it).
    assert_eq!(bits(&outs), reference, "lent memory computes the same bits");

    // Outside a call a block goes back as soon as it is freed.
    drop(outs);
    drop(inputs);
    device::synchronize(Device::Cuda).unwrap();
    assert_eq!(lender.out(), 0, "every lent block went back");
    let stats = backend.allocator_stats();
    assert_eq!(stats.external_allocs, stats.external_frees);

    // Back to tessera's own memory: nothing more is lent.
    backend.set_external_allocator(None);
    let lent = *lender.lent.lock().unwrap();
    let again = run(&own);
    assert_eq!(bits(&again), reference);
    assert_eq!(*lender.lent.lock().unwrap(), lent);
    assert!(backend.allocator_stats().external.is_none());
    unsafe { cu::stream::destroy(stream as sys::CUstream) }.unwrap();
}
