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
//!
//! The fake also logs what a GPU would order — lanes, forks, joins, event
//! records and waits, and each kernel's byte ranges read and written — and
//! [`races`] replays that log with vector clocks: two accesses to the same
//! bytes, one a write, that no chain of stream order and events orders
//! are a race the fake (which runs every kernel at once, in queue order)
//! cannot show but a GPU would.

mod schedule_util;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use schedule_util::{chain, planned, planned_on, sliced_attention, traced};
use tessera::compile::Mode;
use tessera::fusion::Plan;
use tessera::hints::{self, Hint};
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
        if ORDERING.lock().unwrap().is_some() {
            HELD.lock().unwrap().push(std::mem::take(&mut self.words));
        }
    }
}

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

/// What the executor asked of the lanes, in order.
static LANES: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// What a GPU orders, logged while [`ORDERING`] is on.
#[derive(Clone, Debug)]
enum Ordered {
    Fork(usize),
    Lane(usize),
    Join,
    Record(usize),
    Wait(usize),
    /// A kernel's byte ranges (start, end) read and written.
    Kernel {
        reads: Vec<(u64, u64)>,
        writes: Vec<(u64, u64)>,
    },
}

static ORDERING: Mutex<Option<Vec<Ordered>>> = Mutex::new(None);
/// Blocks dropped while ordering is logged: kept, so that no later block
/// takes their addresses (a GPU's allocator holds blocks freed during a
/// forked run until its join, which here is the run's end).
static HELD: Mutex<Vec<Box<[u64]>>> = Mutex::new(Vec::new());

fn log_ordered(entry: Ordered) {
    if let Some(log) = ORDERING.lock().unwrap().as_mut() {
        log.push(entry);
    }
}

/// The bytes an array's view spans (empty for no elements).
fn span(a: &Array) -> Option<(u64, u64)> {
    let storage = a.device_storage()?;
    if a.numel() == 0 {
        return None;
    }
    let size = a.dtype().size_bytes() as u64;
    let layout = a.layout();
    let last: usize = layout
        .shape
        .iter()
        .zip(&layout.strides)
        .map(|(n, s)| (n - 1) * s)
        .sum();
    let start = storage.ptr() + layout.offset as u64 * size;
    Some((start, start + (last as u64 + 1) * size))
}

fn log_kernel(inputs: &[&Array], outputs: &[Array]) {
    log_ordered(Ordered::Kernel {
        reads: inputs.iter().filter_map(|a| span(a)).collect(),
        writes: outputs.iter().filter_map(span).collect(),
    });
}

/// A kernel's access seen by [`races`]: (lane, the lane's tick, byte
/// range, whether a write, kernel number).
type Access = (usize, u64, (u64, u64), bool, usize);

/// The unordered conflicting accesses of a logged run on `lanes` lanes
/// (as `Gpu::fork`/`join`: a fork makes lanes 1..n wait for lane 0, a
/// join makes lane 0 wait for them), each described.
fn races(log: &[Ordered], lanes: usize) -> Vec<String> {
    let merge = |into: &mut Vec<u64>, from: &[u64]| {
        for (a, b) in into.iter_mut().zip(from) {
            *a = (*a).max(*b);
        }
    };
    let mut clock = vec![vec![0u64; lanes]; lanes];
    let mut slots: std::collections::HashMap<usize, Vec<u64>> = Default::default();
    let (mut lane, mut forked) = (0, 1);
    let mut seen: Vec<Access> = Vec::new();
    let mut found = Vec::new();
    let mut kernels = 0;
    for entry in log {
        match entry {
            Ordered::Fork(n) => {
                forked = (*n).clamp(1, lanes);
                let main = clock[0].clone();
                for c in &mut clock[1..forked] {
                    merge(c, &main);
                }
                lane = 0;
            }
            Ordered::Lane(l) => lane = l % forked,
            Ordered::Join => {
                for l in 1..forked {
                    let other = clock[l].clone();
                    merge(&mut clock[0], &other);
                }
                (lane, forked) = (0, 1);
            }
            Ordered::Record(slot) => {
                slots.insert(*slot, clock[lane].clone());
            }
            Ordered::Wait(slot) => match slots.get(slot) {
                Some(at) => {
                    let at = at.clone();
                    merge(&mut clock[lane], &at);
                }
                None => found.push(format!("lane {lane} waits for slot {slot}, never recorded")),
            },
            Ordered::Kernel { reads, writes } => {
                clock[lane][lane] += 1;
                let accesses = reads
                    .iter()
                    .map(|r| (*r, false))
                    .chain(writes.iter().map(|w| (*w, true)));
                for (range, write) in accesses.collect::<Vec<_>>() {
                    for &(l, tick, r, w, k) in &seen {
                        let overlaps = r.0 < range.1 && range.0 < r.1;
                        if overlaps && (w || write) && k != kernels && clock[lane][l] < tick {
                            found.push(format!(
                                "kernel {kernels} (lane {lane}) {} {range:x?}, kernel {k} (lane {l}) {} {r:x?}, unordered",
                                if write { "writes" } else { "reads" },
                                if w { "wrote" } else { "read" },
                            ));
                        }
                    }
                    seen.push((lane, clock[lane][lane], range, write, kernels));
                }
                kernels += 1;
            }
        }
    }
    found
}

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
        let out = self.up(&out);
        log_kernel(inputs, std::slice::from_ref(&out));
        Ok(out)
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
        let outs = outs
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
            .collect::<Vec<Array>>();
        log_kernel(&inputs, &outs);
        Ok(outs)
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
        log_ordered(Ordered::Fork(lanes));
        Ok(())
    }

    fn lane(&self, lane: usize) -> tessera::Result<()> {
        LANES.lock().unwrap().push(format!("lane {lane}"));
        log_ordered(Ordered::Lane(lane));
        Ok(())
    }

    fn join(&self) -> tessera::Result<()> {
        LANES.lock().unwrap().push("join".into());
        log_ordered(Ordered::Join);
        Ok(())
    }

    fn record(&self, slot: usize) -> tessera::Result<()> {
        log_ordered(Ordered::Record(slot));
        Ok(())
    }

    fn wait_for(&self, slot: usize) -> tessera::Result<()> {
        log_ordered(Ordered::Wait(slot));
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

#[test]
fn the_race_check_finds_an_unordered_write_and_read_and_accepts_an_event() {
    let write = Ordered::Kernel {
        reads: vec![],
        writes: vec![(0x100, 0x108)],
    };
    let read = Ordered::Kernel {
        reads: vec![(0x104, 0x10c)],
        writes: vec![(0x200, 0x208)],
    };
    use Ordered::*;
    let unordered = [Fork(2), Lane(1), write.clone(), Lane(0), read.clone(), Join];
    assert_eq!(races(&unordered, 3).len(), 1, "{unordered:?}");
    let waited = [
        Fork(2),
        Lane(1),
        write.clone(),
        Record(7),
        Lane(0),
        Wait(7),
        read.clone(),
        Join,
    ];
    assert!(races(&waited, 3).is_empty());
    // Stream order, and a join then a kernel on lane 0, order too.
    let joined = [Fork(2), Lane(1), write, Join, read];
    assert!(races(&joined, 3).is_empty());
    assert_eq!(races(&[Wait(3)], 3).len(), 1, "a wait for nothing");
}

/// Branches of `x`: sliced attention on stream 0 (parallel slices), a
/// second on `stream` when given, both read by a stream-0 sum, and a
/// stream-0 branch read by the hinted one.
fn streamed_attention(a: &[Tensor], stream: Option<i64>) -> Vec<Tensor> {
    let plain = sliced_attention(&a[0], &a[1], &a[2], 4);
    let scaled = (&a[0] * 0.5).tanh();
    let other = || sliced_attention(&scaled, &a[1], &a[2], 2).exp();
    let hinted = match stream {
        Some(n) => hints::scope(Hint::default().stream(n), other).unwrap(),
        None => other(),
    };
    vec![&plain + &hinted, hinted.sum(&[3], false)]
}

/// The run's outputs and the ordering it asked of the fake GPU, which must
/// have no race; the outputs equal the CPU's.
fn run_checked(graph: &Graph, strategy: Strategy, host: &[Tensor]) -> Vec<Ordered> {
    let (plan, s) = planned_on(graph, strategy, None, Device::Cuda);
    let on = on_fake(host);
    *ORDERING.lock().unwrap() = Some(Vec::new());
    let outs = run_scheduled(graph, &plan, &s.schedule, &s.memory, &on);
    let log = ORDERING.lock().unwrap().take().unwrap();
    HELD.lock().unwrap().clear();
    let outs: Vec<Tensor> = outs.unwrap().into_iter().map(|(_, t)| t).collect();
    let found = races(&log, Fake.lanes());
    assert!(
        found.is_empty(),
        "{} {}: {} races, e.g. {:?}\n{}",
        graph.name,
        strategy.name(),
        found.len(),
        &found[..found.len().min(4)],
        s.schedule
            .streams
            .as_ref()
            .map_or(String::new(), |sp| sp.describe())
    );
    let (cpu_plan, cpu_s) = planned(graph, strategy, None);
    let want: Vec<Tensor> = run_scheduled(graph, &cpu_plan, &cpu_s.schedule, &cpu_s.memory, host)
        .unwrap()
        .into_iter()
        .map(|(_, t)| t)
        .collect();
    assert_eq!(
        bits(&outs),
        bits(&want),
        "{} {}",
        graph.name,
        strategy.name()
    );
    log
}

#[test]
fn stream_hinted_runs_order_every_access_and_spread_stream_0_over_spare_lanes() {
    let _lock = fake();
    let qkv: Vec<Tensor> = (0..3).map(|i| randn(&[2, 2, 16, 8], 40 + i)).collect();
    for stream in [None, Some(1), Some(2)] {
        let graph = traced("streamed", &qkv, |a| streamed_attention(a, stream));
        for strategy in [
            Strategy::Bfs,
            Strategy::Dfs,
            Strategy::Strict,
            Strategy::Auto,
        ] {
            let log = run_checked(&graph, strategy, &qkv);
            // With one stream hinted of the fake's 3 lanes, lane 2 is spare:
            // a bfs level of stream-0 kernels runs on lanes 0 and 2.
            if stream.is_some() && strategy == Strategy::Bfs {
                let spread = log
                    .windows(2)
                    .any(|w| matches!(w, [Ordered::Lane(2), Ordered::Kernel { .. }]));
                assert!(spread, "{stream:?}: no stream-0 kernel on the spare lane");
            }
        }
    }
}

#[test]
fn random_stream_hinted_graphs_run_without_races() {
    let _lock = fake();
    let host = [randn(&[8, 8], 50), randn(&[8, 8], 51)];
    for case in 0..24u64 {
        // Per branch: ops by code, a stream (0: none) and what it reads.
        let codes: Vec<u64> = (0..10)
            .map(|i| (case * 7 + i * 13 + case * i) % 11)
            .collect();
        let graph = traced(&format!("random{case}"), &host, |a| {
            let mut made: Vec<Tensor> = vec![a[0].clone(), a[1].clone()];
            for (i, &c) in codes.iter().enumerate() {
                let x = made[(c as usize + i) % made.len()].clone();
                let y = made[(c as usize * 3 + 1) % made.len()].clone();
                let op = move || match c % 5 {
                    0 => x.matmul(&y),
                    1 => (&x * 0.5).tanh() + &y,
                    2 => x.softmax(-1),
                    3 => x.t().matmul(&y).exp().minimum(2.0),
                    _ => x.sum(&[0], true) + &y,
                };
                // Odd cases hint one stream only: the fake's lane 2 is spare.
                let stream = (c + case) % (2 + case % 2);
                let v = match stream {
                    0 => op(),
                    n => hints::scope(Hint::default().stream(n as i64), op).unwrap(),
                };
                made.push(v);
            }
            made.split_off(made.len() - 3)
        });
        for strategy in [Strategy::Bfs, Strategy::Strict, Strategy::Auto] {
            run_checked(&graph, strategy, &host);
        }
    }
}
