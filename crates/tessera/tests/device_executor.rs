//! The compiled executor's device paths, checked with no GPU: a fake device
//! backend (registered as `cuda`) whose memory is host memory and whose
//! kernels are the CPU's. With it, CI checks what the GPU tests check on a
//! GPU (crates/tessera-cuda/tests/executor.rs): the device arena (every
//! planned buffer at its offset in one device block; predicted peak ==
//! measured peak, to the byte, in-place writes included), `bfs` steps
//! spread over lanes with every fork joined, and `reduce-overhead` falling
//! back, with its reason, on a backend that cannot capture.
//!
//! The allocator's counters are the fake backend's: one test at a time.

mod schedule_util;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use schedule_util::{chain, planned_on, sliced_attention, traced};
use tessera::compile::Mode;
use tessera::fusion::Plan;
use tessera::ir::kernel::FusedKernel;
use tessera::ir::{DType, Graph, Op};
use tessera::runtime::array::Array;
use tessera::runtime::cpu::{self, arena, copy};
use tessera::runtime::cpu::{MemoryStats, Storage};
use tessera::runtime::device::{
    self, Backend, Device, DeviceBackend, DeviceMemory, DeviceStorage, FusedArg,
};
use tessera::runtime::execute::{run_plan, run_scheduled};
use tessera::schedule::{Scheduled, Strategy};
use tessera::tensor::Generator;
use tessera::{compile, Tensor};

/// Host bytes standing in for device memory (8-byte aligned), counted.
struct Block {
    words: Box<[u64]>,
    len: usize,
}

impl DeviceMemory for Block {
    fn ptr(&self) -> u64 {
        self.words.as_ptr() as u64
    }

    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        LIVE.fetch_sub(self.len, Ordering::Relaxed);
    }
}

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// What the executor asked of the lanes, in order.
static LANES: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Fake;

impl Fake {
    fn storage(&self, dtype: DType, numel: usize) -> DeviceStorage {
        let bytes = numel * dtype.size_bytes();
        if let Some(region) = arena::take_device(bytes) {
            return DeviceStorage::new(Device::Cuda, dtype, numel, Box::new(region));
        }
        let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
        PEAK.fetch_max(live, Ordering::Relaxed);
        let words = vec![0u64; bytes.div_ceil(8).max(1)].into_boxed_slice();
        DeviceStorage::new(
            Device::Cuda,
            dtype,
            numel,
            Box::new(Block { words, len: bytes }),
        )
    }

    fn bytes(s: &DeviceStorage) -> &[u8] {
        // SAFETY: the storage's memory is host memory of at least this size.
        unsafe { std::slice::from_raw_parts(s.ptr() as *const u8, s.size_bytes()) }
    }

    fn write(dst: &DeviceStorage, bytes: &[u8]) {
        assert_eq!(dst.size_bytes(), bytes.len());
        // SAFETY: as in `bytes`; nothing else reads it meanwhile.
        unsafe { std::ptr::copy(bytes.as_ptr(), dst.ptr() as *mut u8, bytes.len()) }
    }

    /// A host array with `t`'s values and layout.
    fn host(&self, t: &Array) -> Array {
        match t.device_storage() {
            Some(s) => Array::from_parts(Arc::new(self.download(s).unwrap()), t.layout().clone()),
            None => t.clone(),
        }
    }

    fn up(&self, host: &Array) -> Array {
        let dense = copy::contiguous(host);
        let s = self.upload(dense.storage()).unwrap();
        Array::from_device_storage(s, host.shape())
    }
}

impl Backend for Fake {
    fn device(&self) -> Device {
        Device::Cuda
    }

    fn eval(
        &self,
        op: &Op,
        inputs: &[&Array],
        dtype: DType,
        shape: &[usize],
    ) -> tessera::Result<Array> {
        let host: Vec<Array> = inputs.iter().map(|t| self.host(t)).collect();
        let refs: Vec<&Array> = host.iter().collect();
        let out = cpu::eval(op, &refs, dtype, shape)?;
        Ok(self.up(&out))
    }

    fn run_fused(
        &self,
        kernel: &FusedKernel,
        args: Vec<FusedArg<'_>>,
    ) -> tessera::Result<Vec<Array>> {
        let donated: Vec<(usize, usize)> = args
            .iter()
            .enumerate()
            .filter_map(|(i, a)| match a {
                FusedArg::Donated { output, .. } => Some((i, *output)),
                FusedArg::Shared(_) => None,
            })
            .collect();
        let inputs: Vec<&Array> = args.iter().map(FusedArg::array).collect();
        let host: Vec<Array> = inputs.iter().map(|t| self.host(t)).collect();
        let refs: Vec<&Array> = host.iter().collect();
        let outs = kernel.run(&refs)?;
        Ok(outs
            .iter()
            .enumerate()
            .map(|(o, out)| match donated.iter().find(|d| d.1 == o) {
                Some(&(i, _)) => {
                    let s = inputs[i].device_storage().expect("a device input").clone();
                    let dense = copy::contiguous(out);
                    Fake::write(&s, &dense.storage().as_bytes()[..s.size_bytes()]);
                    let numel = s.numel();
                    let over = DeviceStorage::over(&s, out.dtype(), numel);
                    Array::from_device_storage(over, out.shape())
                }
                None => self.up(out),
            })
            .collect())
    }

    fn synchronize(&self) -> tessera::Result<()> {
        Ok(())
    }

    fn memory_stats(&self) -> MemoryStats {
        MemoryStats {
            live_bytes: LIVE.load(Ordering::Relaxed),
            peak_bytes: PEAK.load(Ordering::Relaxed),
        }
    }

    fn reset_peak(&self) {
        PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    fn empty_cache(&self) {}

    fn lanes(&self) -> usize {
        3
    }

    fn fork(&self, lanes: usize) -> tessera::Result<()> {
        LANES.lock().unwrap().push(format!("fork {lanes}"));
        Ok(())
    }

    fn lane(&self, lane: usize) -> tessera::Result<()> {
        LANES.lock().unwrap().push(format!("lane {lane}"));
        Ok(())
    }

    fn join(&self) -> tessera::Result<()> {
        LANES.lock().unwrap().push("join".into());
        Ok(())
    }
}

impl DeviceBackend for Fake {
    fn alloc(&self, dtype: DType, numel: usize) -> tessera::Result<DeviceStorage> {
        Ok(self.storage(dtype, numel))
    }

    fn upload(&self, host: &Storage) -> tessera::Result<DeviceStorage> {
        let s = self.storage(host.dtype(), host.numel());
        Fake::write(&s, &host.as_bytes()[..s.size_bytes()]);
        Ok(s)
    }

    fn download(&self, s: &DeviceStorage) -> tessera::Result<Storage> {
        let mut host = Storage::new(s.dtype(), s.numel());
        host.as_bytes_mut()[..s.size_bytes()].copy_from_slice(Fake::bytes(s));
        Ok(host)
    }

    fn copy(&self, dst: &DeviceStorage, src: &DeviceStorage) -> tessera::Result<()> {
        Fake::write(dst, Fake::bytes(src));
        Ok(())
    }
}

/// Registers the fake backend once; every test holds the returned lock.
fn fake() -> MutexGuard<'static, ()> {
    static REGISTERED: OnceLock<()> = OnceLock::new();
    REGISTERED.get_or_init(|| device::register(Arc::new(Fake)).unwrap());
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn randn(shape: &[usize], seed: u64) -> Tensor {
    Tensor::randn(shape, DType::F32, &mut Generator::new(seed))
}

fn on_fake(ts: &[Tensor]) -> Vec<Tensor> {
    ts.iter().map(|t| t.to(Device::Cuda).unwrap()).collect()
}

fn bits(ts: &[Tensor]) -> Vec<Vec<u64>> {
    ts.iter()
        .map(|t| t.to_f64_vec().iter().map(|v| v.to_bits()).collect())
        .collect()
}

fn measured(graph: &Graph, plan: &Plan, s: &Scheduled, inputs: &[Tensor]) -> (Vec<Tensor>, usize) {
    let before = LIVE.load(Ordering::Relaxed);
    device::reset_peak(Device::Cuda).unwrap();
    let outs = run_scheduled(graph, plan, &s.schedule, &s.memory, inputs).unwrap();
    let peak = PEAK.load(Ordering::Relaxed) - before;
    (outs.into_iter().map(|(_, t)| t).collect(), peak)
}

/// A matmul with a bias + gelu epilogue, chains in place, a softmax of a
/// transposed view, a view output and a reduction.
fn mlp(a: &[Tensor]) -> Vec<Tensor> {
    let h = (a[0].matmul(&a[1]) + &a[2]).gelu();
    let g = (&h.softmax(0) * 2.0).tanh() + 1.0;
    let p = g.t().softmax(-1);
    vec![p.reshape(&[-1]), (g.exp() - 1.0).sum(&[0], false)]
}

#[test]
fn device_runs_place_buffers_in_one_arena_and_peak_as_planned() {
    let _lock = fake();
    let mlp_inputs = [randn(&[12, 32], 1), randn(&[32, 24], 2), randn(&[24], 3)];
    let qkv: Vec<Tensor> = (0..3).map(|i| randn(&[2, 4, 32, 8], 10 + i)).collect();
    let cases: Vec<(Graph, Vec<Tensor>)> = vec![
        (traced("mlp", &mlp_inputs, mlp), mlp_inputs.to_vec()),
        (traced("chain", &mlp_inputs, chain), mlp_inputs.to_vec()),
        (
            traced("attention", &qkv, |a| {
                vec![sliced_attention(&a[0], &a[1], &a[2], 4)]
            }),
            qkv.clone(),
        ),
    ];
    let mut arenas = 0;
    for (graph, host) in cases {
        let plan = tessera::fusion::fuse(&graph);
        let reference: Vec<Tensor> = run_plan(&graph, &plan, &host)
            .unwrap()
            .into_iter()
            .map(|(_, t)| t)
            .collect();
        let on = on_fake(&host);
        for strategy in [Strategy::Bfs, Strategy::Dfs, Strategy::Strict] {
            let (plan, s) = planned_on(&graph, strategy, None, Device::Cuda);
            let (outs, peak) = measured(&graph, &plan, &s, &on);
            assert!(outs.iter().all(|t| t.device() == Device::Cuda));
            assert_eq!(
                bits(&outs),
                bits(&reference),
                "{} {}",
                graph.name,
                strategy.name()
            );
            // A plan the device cannot take exactly (CPU scratch, row
            // kernels) runs without an arena (`execute::device_arena_unfit`).
            if tessera::runtime::execute::device_arena_unfit(&plan, &s.memory, Device::Cuda)
                .is_some()
            {
                continue;
            }
            arenas += 1;
            assert_eq!(
                peak,
                s.memory.run_peak_bytes(),
                "{} {}: measured {peak}, predicted {}\n{}",
                graph.name,
                strategy.name(),
                s.memory.run_peak_bytes(),
                s.memory.describe(&graph)
            );
        }
    }
    assert!(
        arenas >= 3,
        "the chain graph runs in an arena in every order"
    );
}

#[test]
fn bfs_steps_go_to_lanes_and_every_fork_is_joined() {
    let _lock = fake();
    let qkv: Vec<Tensor> = (0..3).map(|i| randn(&[2, 4, 32, 8], 20 + i)).collect();
    let graph = traced("attention", &qkv, |a| {
        vec![sliced_attention(&a[0], &a[1], &a[2], 4)]
    });
    let on = on_fake(&qkv);
    for (strategy, forks) in [(Strategy::Bfs, true), (Strategy::Strict, false)] {
        LANES.lock().unwrap().clear();
        let (plan, s) = planned_on(&graph, strategy, None, Device::Cuda);
        run_scheduled(&graph, &plan, &s.schedule, &s.memory, &on).unwrap();
        let log = LANES.lock().unwrap().clone();
        assert_eq!(!log.is_empty(), forks, "{}: {log:?}", strategy.name());
        // fork n, then lanes below n, then join; never nested.
        let mut open: Option<usize> = None;
        for entry in &log {
            match entry.split_once(' ') {
                Some(("fork", n)) => {
                    assert!(open.is_none(), "nested fork: {log:?}");
                    let n: usize = n.parse().unwrap();
                    assert!((2..=3).contains(&n), "{log:?}");
                    open = Some(n);
                }
                Some(("lane", i)) => {
                    assert!(i.parse::<usize>().unwrap() < open.expect("a lane outside a fork"));
                }
                _ => assert_eq!(open.take().map(|_| entry.as_str()), Some("join")),
            }
        }
        assert!(open.is_none(), "a fork never joined: {log:?}");
    }
}

#[test]
fn reduce_overhead_runs_normally_where_the_backend_cannot_capture() {
    let _lock = fake();
    let f = |x: &[Tensor]| mlp(x);
    let replayed = compile(f).mode(Mode::ReduceOverhead);
    let plain = compile(f);
    for call in 0..3 {
        let host = [
            randn(&[12, 32], 30 + call),
            randn(&[32, 24], 31),
            randn(&[24], 32),
        ];
        let on = on_fake(&host);
        assert_eq!(
            bits(&replayed.call(&on)),
            bits(&plain.call(&on)),
            "call {call}"
        );
    }
    let stats = replayed.replay_stats();
    assert_eq!(
        (stats.recordings, stats.fallbacks, stats.normal_runs),
        (0, 1, 3)
    );
}

#[test]
fn a_plan_takes_the_arena_only_on_the_device_it_was_made_for() {
    let _lock = fake();
    let host = [randn(&[12, 32], 40), randn(&[32, 24], 41), randn(&[24], 42)];
    let graph = traced("chain", &host, chain);
    let (plan, cpu) = planned_on(&graph, Strategy::Bfs, None, Device::Cpu);
    let (_, cuda) = planned_on(&graph, Strategy::Bfs, None, Device::Cuda);
    assert_eq!(
        (cpu.memory.device, cuda.memory.device),
        (Device::Cpu, Device::Cuda)
    );
    let unfit =
        |s: &Scheduled, on| tessera::runtime::execute::device_arena_unfit(&plan, &s.memory, on);
    assert_eq!(unfit(&cpu, Device::Cpu), None);
    assert_eq!(unfit(&cuda, Device::Cuda), None);
    let why = unfit(&cpu, Device::Cuda).expect("a CPU plan does not fit the device");
    assert!(
        why.contains("made for the scratch of cpu's kernels"),
        "{why}"
    );
    assert!(unfit(&cuda, Device::Cpu).is_some());
    // The CPU plan still runs on the device, from its allocator, to the
    // same values.
    let on = on_fake(&host);
    let (outs, _) = measured(&graph, &plan, &cpu, &on);
    let (planned, peak) = measured(&graph, &plan, &cuda, &on);
    assert_eq!(bits(&outs), bits(&planned));
    assert_eq!(peak, cuda.memory.run_peak_bytes());
}

#[test]
fn a_compiled_function_plans_for_its_inputs_device_and_recompiles_on_another() {
    let _lock = fake();
    let f = compile(|x: &[Tensor]| mlp(x));
    let host = [randn(&[12, 32], 50), randn(&[32, 24], 51), randn(&[24], 52)];
    let on_host = f.call(&host);
    let on_device = f.call(&on_fake(&host));
    assert_eq!(bits(&on_host), bits(&on_device));
    let reasons = f.recompile_reasons();
    assert_eq!(reasons.len(), 1, "{reasons:?}");
    assert!(
        reasons[0].contains("expected device cpu, got cuda"),
        "{reasons:?}"
    );
}

/// A forward-only graph whose causal mask is made of constants alone (too
/// large to fold into a literal: 80² > the passes' fold limit): the frozen
/// prologue computes it once, on the device of the call's inputs (it has
/// none of its own to go by), not on the host beside them.
#[test]
fn values_made_of_constants_alone_live_on_the_inputs_device() {
    let _lock = fake();
    let f = compile(|x: &[Tensor]| {
        let n = x[0].shape()[0];
        let mask = Tensor::ones(&[n, n], DType::F32).tril(0);
        vec![(&x[0] * &mask).exp()]
    });
    let x = randn(&[80, 80], 60);
    let on_host = f.call(std::slice::from_ref(&x));
    let on_device = f.call(&on_fake(&[x]));
    assert_eq!(on_device[0].device(), Device::Cuda);
    assert_eq!(bits(&on_host), bits(&on_device));
}
