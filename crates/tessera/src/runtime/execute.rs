//! Runs a fused [`Plan`]: in plan order ([`run_plan`]) or in a schedule's
//! steps ([`run_scheduled`]). Each value is freed right after the last step
//! that reads it, so the bytes alive over time follow the memory plan.
//! Results equal the interpreter's (checked by the differential tests);
//! only the work and its order differ.

use std::panic::Location;

use rayon::prelude::*;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::array::Array;
use super::autotune;
use super::cpu::arena::{self, Arena, Block, Place, Slots, Taken};
use super::cpu::fused::{FusedInput, FusedKernel};
use super::cpu::rows::RowKernel;
use super::cpu::{self, BlockedProduct, Storage};
use super::device::{self, Device, DeviceStorage};
use super::interpret::{bind_symbols, node_error};
use crate::autograd;
use crate::error::{ErrorKind, Result};
use crate::fusion::{Kernel, Plan};
use crate::ir::{Graph, NodeId, Op};
use crate::logging::log;
use crate::schedule::{MemoryPlan, Schedule};
use crate::tensor::{trace, Tensor};

/// Runs `plan` (made by `fusion::fuse(graph)`) on `inputs`, one per
/// `graph.inputs`, one kernel at a time in plan order, returning the named
/// outputs.
pub fn run_plan(graph: &Graph, plan: &Plan, inputs: &[Tensor]) -> Result<Vec<(String, Tensor)>> {
    run_plan_with(graph, plan, inputs, false)
}

/// [`run_plan`], with fused kernels' block sizes autotuned when `tune`
/// (see [`super::autotune`]).
pub fn run_plan_with(
    graph: &Graph,
    plan: &Plan,
    inputs: &[Tensor],
    tune: bool,
) -> Result<Vec<(String, Tensor)>> {
    let steps: Vec<Vec<usize>> = (0..plan.kernels.len()).map(|k| vec![k]).collect();
    execute(
        graph,
        plan,
        &steps,
        |_| Ok(KernelMemory::default()),
        inputs,
        tune,
    )
}

/// Runs `plan` in `schedule`'s steps: the kernels of a step with several
/// run concurrently on the rayon pool (each kernel may itself be parallel),
/// a step of one runs alone. Fused kernels write in place where `memory`
/// says so. Kernels that need scratch memory run first in their step, one
/// at a time, so that the bytes alive never depend on how threads
/// interleave. Under an active trace, every kernel runs on this thread
/// (traced tensors belong to it).
///
/// One arena of `memory.arena_bytes` is allocated for the run, and every
/// buffer a kernel creates (outputs and scratch) lands at its planned
/// offset in it (`cpu::arena`), except the values that escape (outputs),
/// which come from the pool: the measured peak is
/// `memory.run_peak_bytes()`.
pub fn run_scheduled(
    graph: &Graph,
    plan: &Plan,
    schedule: &Schedule,
    memory: &MemoryPlan,
    inputs: &[Tensor],
) -> Result<Vec<(String, Tensor)>> {
    run_scheduled_with(graph, plan, schedule, memory, inputs, false)
}

/// [`run_scheduled`], with fused kernels' block sizes autotuned when `tune`
/// (see [`super::autotune`]).
pub fn run_scheduled_with(
    graph: &Graph,
    plan: &Plan,
    schedule: &Schedule,
    memory: &MemoryPlan,
    inputs: &[Tensor],
    tune: bool,
) -> Result<Vec<(String, Tensor)>> {
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let on = inputs_device(graph, &refs)?;
    if let Some(why) = device_arena_unfit(plan, memory, on) {
        log("memory", || {
            format!(
                "graph `{}` on {on}: {why}; no arena, buffers from the device's allocator",
                graph.name
            )
        });
        let unplanned = |k: usize| -> Result<KernelMemory> {
            Ok(KernelMemory {
                in_place: memory.in_place(k).collect(),
                ..KernelMemory::default()
            })
        };
        return execute(graph, plan, &schedule.steps, unplanned, inputs, tune);
    }
    // On a device the arena and blocks are device memory (see `cpu::arena`).
    let arena = Arena::on(on, memory.arena_bytes).map_err(|mut e| {
        e.message = format!(
            "graph `{}`: the arena of its memory plan ({} bytes, the predicted peak \
             of its intermediates): {}",
            graph.name, memory.arena_bytes, e.message
        );
        e
    })?;
    let mut created = vec![Vec::new(); plan.kernels.len()];
    for (i, buffer) in memory.buffers.iter().enumerate() {
        created[buffer.kernel].push(i);
    }
    // The escaping outputs of cats in place, by buffer: allocated with
    // their first piece.
    // A Mutex so that the executor may run on a pool worker (only that
    // one thread takes it).
    let blocks: Mutex<HashMap<usize, Block>> = Mutex::new(HashMap::new());
    let block = |b: usize| -> Result<Block> {
        let mut blocks = blocks.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(block) = blocks.get(&b) {
            return Ok(block.clone());
        }
        let block = Block::on(on, memory.buffers[b].bytes)?;
        blocks.insert(b, block.clone());
        Ok(block)
    };
    let slots = |k: usize| -> Result<Planned> {
        let mut slots = arena.slots();
        let mut in_place = Vec::new();
        for &i in &created[k] {
            let b = &memory.buffers[i];
            let place = match (b.within, b.escapes) {
                (_, false) => Place::Arena(b.offset),
                (Some((parent, at)), true) => Place::Block(block(parent)?, at),
                (None, true) if memory.joins[k] => Place::Block(block(i)?, 0),
                (None, true) => Place::Pool,
            };
            match (b.value, b.reuses) {
                // The planner reserved the size rounded up to the alignment.
                (None, _) => slots.scratch(b.offset, b.bytes.div_ceil(64) * 64),
                (Some(_), None) => slots.value(b.bytes, place),
                // Written over its input's storage: allocates nothing.
                (Some(v), Some(_)) => in_place.push((v, slots.in_place(b.bytes))),
            }
        }
        Ok(Planned {
            slots,
            joins: memory.joins[k],
            in_place,
        })
    };
    let kernel_memory = |k: usize| -> Result<KernelMemory> {
        Ok(KernelMemory {
            in_place: memory.in_place(k).collect(),
            alone: memory.scratch_bytes(k) > 0,
            planned: Some(slots(k)?),
        })
    };
    execute(graph, plan, &schedule.steps, kernel_memory, inputs, tune)
}

/// What the memory plan says about one kernel.
#[derive(Default)]
struct KernelMemory {
    /// (input, output) pairs the kernel writes in place.
    in_place: Vec<(NodeId, NodeId)>,
    /// It needs scratch, so runs alone in its step.
    alone: bool,
    /// The places of the buffers it creates (compiled runs with a plan).
    planned: Option<Planned>,
}

/// Runs `steps` of `plan`. On the host the loop itself runs on a rayon
/// worker (see [`on_pool_worker`]), except under a trace, whose tensors
/// belong to this thread.
fn execute(
    graph: &Graph,
    plan: &Plan,
    steps: &[Vec<usize>],
    memory: impl Fn(usize) -> Result<KernelMemory> + Sync,
    inputs: &[Tensor],
    tune: bool,
) -> Result<Vec<(String, Tensor)>> {
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let here = || execute_here(graph, plan, steps, &memory, inputs, tune);
    let many_kernels = steps.len() >= POOL_WORKER_MIN_STEPS;
    match many_kernels && !trace::is_active() && inputs_device(graph, &refs)? == Device::Cpu {
        true => on_pool_worker(here),
        false => here(),
    }
}

/// The fewest steps for which the loop moves to a pool worker. The hand-off
/// it saves is per kernel; a plan of a few large kernels ran slower on a
/// worker (quiet 2-core run, 64 M-element fused chains: 19.8 → 25.0 ms and
/// 42.2 → 47.9 ms; cause not found), so it stays on the caller's thread.
const POOL_WORKER_MIN_STEPS: usize = 32;

/// Runs `f` on a rayon worker, in the caller's grad mode. A strict or dfs
/// order runs hundreds of small parallel kernels one after another: called
/// from outside the pool, each would hand its work to the pool and sleep
/// until woken (a futex round trip per kernel: 94k context switches for
/// the hinted seed table row, 4.7k on a worker); on a worker it does its
/// share itself and goes straight on to the next kernel.
fn on_pool_worker<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    if rayon::current_thread_index().is_some() {
        return f();
    }
    let grad = autograd::is_grad_enabled();
    let done = AtomicBool::new(false);
    // Rayon's workers run with grad mode on (as the steps' jobs below).
    rayon::scope(|s| {
        for _ in 1..rayon::current_num_threads() {
            s.spawn(|s| poll_for_work(s, &done));
        }
        // Set on the way out, a panic's too: the pollers end only then.
        let _done = SetOnDrop(&done);
        match grad {
            true => f(),
            false => autograd::no_grad(f),
        }
    })
}

/// Sets its flag when dropped.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// How long one [`poll_for_work`] job polls before handing over to a fresh
/// one.
const POLL_SLICE: Duration = Duration::from_micros(1000);

/// Polls to take the loop's kernel tasks until `done`. A strict order's
/// kernels are ~0.1 ms each, split over the workers; between two of them an
/// idle rayon worker goes to sleep and the next kernel's tasks wait for its
/// futex wake-up (the hinted seed row scaled 1.54x on two threads against
/// the unhinted row's 1.75x). A polling worker starts them at once.
///
/// A job polls for [`POLL_SLICE`] only and then queues its successor: a
/// worker waiting on a stolen task may pick up a poller, which must not
/// keep it from that task for long (polling until `done` there could
/// deadlock). Long idle, it yields its core to the rest of the machine.
fn poll_for_work<'s>(scope: &rayon::Scope<'s>, done: &'s AtomicBool) {
    let start = Instant::now();
    let mut idle = 0u32;
    while !done.load(Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => idle = 0,
            Some(rayon::Yield::Idle) if idle < 1 << 12 => {
                idle += 1;
                std::hint::spin_loop();
            }
            Some(rayon::Yield::Idle) => std::thread::yield_now(),
            None => return,
        }
        if start.elapsed() > POLL_SLICE {
            scope.spawn(move |s| poll_for_work(s, done));
            return;
        }
    }
}

fn execute_here(
    graph: &Graph,
    plan: &Plan,
    steps: &[Vec<usize>],
    memory: &(impl Fn(usize) -> Result<KernelMemory> + Sync),
    inputs: &[Tensor],
    tune: bool,
) -> Result<Vec<(String, Tensor)>> {
    let given: Vec<Option<&Tensor>> = inputs.iter().map(Some).collect();
    bind_symbols(graph, &given)?;
    // Every kernel runs on the inputs' device, kernels without inputs too.
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let on = inputs_device(graph, &refs)?;
    // A device backend tunes the launches queued from this thread.
    let _tuning = autotune::DeviceTuning::set(tune && on != Device::Cpu);
    device::with_device(on, || {
        let frees = frees_after_each_step(graph, plan, steps);
        let mut values: Vec<Option<Tensor>> = vec![None; graph.len()];
        for (&id, t) in graph.inputs.iter().zip(inputs) {
            values[id.index()] = Some(t.clone());
        }
        // Device kernels are queued from this thread: a step's kernels go
        // to the device's lanes (streams) instead of threads.
        let concurrent = !trace::is_active() && on == Device::Cpu;
        let grad = autograd::is_grad_enabled();
        let lanes = match on {
            Device::Cpu => 1,
            d => device::backend(d)?.lanes(),
        };
        for (step, free) in steps.iter().zip(&frees) {
            let jobs: Vec<(Job<'_>, bool)> = step
                .iter()
                .map(|&k| {
                    let mem = memory(k)?;
                    let job = Job::gather(graph, k, &plan.kernels[k], &mem.in_place, &mut values)
                        .with_plan(mem.planned.filter(|_| {
                            on == Device::Cpu || placed_on_device(graph, &plan.kernels[k], on)
                        }));
                    Ok((job, mem.alone))
                })
                .collect::<Result<_>>()?;
            let concurrent = concurrent && jobs.len() > 1;
            let (serial, parallel): (Vec<_>, Vec<_>) = jobs
                .into_iter()
                .partition(|(_, alone)| !concurrent || *alone);
            let serial: Vec<Job<'_>> = serial.into_iter().map(|(job, _)| job).collect();
            let parallel: Vec<Job<'_>> = parallel.into_iter().map(|(job, _)| job).collect();
            let mut results = match lanes.min(serial.len()) {
                0 | 1 => serial.into_iter().map(|job| job.run(graph, tune)).collect(),
                n => on_lanes(on, n, serial, graph, tune)?,
            };
            // Rayon's workers start with grad mode on: carry the caller's.
            results.par_extend(parallel.into_par_iter().map(|job| match grad {
                true => job.run(graph, tune),
                false => autograd::no_grad(|| job.run(graph, tune)),
            }));
            for result in results {
                for (id, t) in result? {
                    values[id.index()] = Some(t);
                }
            }
            for id in free {
                values[id.index()] = None;
            }
        }
        Ok(graph
            .outputs
            .iter()
            .map(|o| {
                (
                    o.name.clone(),
                    values[o.node.index()].clone().expect("outputs are kept"),
                )
            })
            .collect())
    })
}

/// Why a run on device `on` cannot take the memory plan's arena, if it
/// cannot (never on the CPU with a plan made for it). The plan is exact
/// on a device only
/// - when made for that device: its scratch is the scratch that device's
///   kernels allocate (`ScheduleOptions::device`); a plan for another
///   device's kernels would reserve bytes nobody uses, or too few (the
///   CPU's f32 copies of half-precision matmul operands are 4 GiB for the
///   seed's bf16 attention, which the GPU never makes);
/// - with every row kernel run as one kernel by the device (one it refuses
///   runs op by op, with intermediates the plan does not hold).
///
/// Such plans run on the device's caching allocator instead, in place
/// where planned.
pub fn device_arena_unfit(plan: &Plan, memory: &MemoryPlan, on: Device) -> Option<String> {
    if memory.device != on {
        return Some(format!(
            "the plan was made for the scratch of {}'s kernels, not {on}'s",
            memory.device
        ));
    }
    if on == Device::Cpu {
        return None;
    }
    plan.kernels.iter().find_map(|k| match k {
        Kernel::Rows { kernel, .. } | Kernel::MatmulRows { kernel, .. } => row_refusal(on, kernel).map(|why| {
            format!(
                "a row kernel runs op by op on the device ({why}), with intermediates the plan does not hold"
            )
        }),
        _ => None,
    })
}

/// Why device `on` does not run `kernel` as one kernel, if it does not.
fn row_refusal(on: Device, kernel: &RowKernel) -> Option<String> {
    match device::backend(on) {
        Ok(backend) => backend.row_kernel_refusal(kernel),
        Err(e) => Some(e.message),
    }
}

/// What a kernel computed: (value, tensor) pairs.
type KernelResult = Result<Vec<(NodeId, Tensor)>>;

/// Whether a kernel's allocations on a device may take their planned
/// places. Slots are matched by size in allocation order, so a kernel that
/// allocates temporaries before outputs of the same size could put an
/// output in another output's place (with another lifetime). Custom ops
/// (their device code allocates as it likes) take their places, and an
/// output found in another's is moved to the pool ([`rehome`]); row groups
/// the device runs as one kernel allocate their outputs in the plan's
/// order; those it runs op by op with two outputs of one size allocate
/// from the pool instead, their outputs counted beside the arena.
fn placed_on_device(graph: &Graph, kernel: &Kernel, on: Device) -> bool {
    match kernel {
        Kernel::Custom { .. } => true,
        Kernel::Rows { kernel, .. } | Kernel::MatmulRows { kernel, .. }
            if row_refusal(on, kernel).is_none() =>
        {
            true
        }
        Kernel::Rows { outputs, .. } | Kernel::MatmulRows { outputs, .. } => {
            let mut sizes: Vec<usize> = outputs
                .iter()
                .map(|&o| {
                    let ty = &graph.node(o).ty;
                    let numel: usize = ty.shape.as_concrete().map_or(0, |s| s.iter().product());
                    numel * ty.dtype.size_bytes()
                })
                .collect();
            sizes.sort_unstable();
            sizes.windows(2).all(|w| w[0] != w[1])
        }
        _ => true,
    }
}

/// Runs the kernels of one step on `lanes` streams of `device`, kernel i
/// on lane i mod `lanes` (a `bfs` level's kernels are independent); the
/// step ends with every lane joined, also when a kernel failed.
fn on_lanes(
    device: Device,
    lanes: usize,
    jobs: Vec<Job<'_>>,
    graph: &Graph,
    tune: bool,
) -> Result<Vec<KernelResult>> {
    let backend = device::backend(device)?;
    backend.fork(lanes)?;
    let results: Vec<KernelResult> = jobs
        .into_iter()
        .enumerate()
        .map(|(i, job)| {
            backend.lane(i % lanes)?;
            job.run(graph, tune)
        })
        .collect();
    // A kernel's own error says more than the join's that may follow it.
    match backend.join() {
        Err(e) if results.iter().all(Result::is_ok) => Err(e),
        _ => Ok(results),
    }
}

/// The device of a program's inputs (scalars on the host go with any);
/// inputs on different devices are an error naming the program.
pub(crate) fn inputs_device(graph: &Graph, inputs: &[&Tensor]) -> Result<Device> {
    device::of_inputs("input", inputs).map_err(|e| {
        crate::error::Error::new(e.kind, format!("graph `{}`: {}", graph.name, e.message))
    })
}

/// The device of a cat's inputs (all on one device: the executor's).
fn on_device(args: &[Arg]) -> Device {
    args.iter()
        .find_map(|a| match a {
            Arg::Shared(t) if t.device() != Device::Cpu => Some(t.device()),
            _ => None,
        })
        .unwrap_or(Device::Cpu)
}

/// A kernel's argument, gathered before the step runs.
enum Arg {
    Shared(Tensor),
    /// The storage of an input read for the last time, which the fused
    /// kernel's output `.1` overwrites.
    Donated(Storage, usize),
    /// The same on a device: a tensor nothing else holds, whose storage
    /// output `.1` overwrites.
    DonatedOnDevice(Tensor, usize),
}

impl Arg {
    /// A tensor argument (donated ones are not tensors).
    fn tensor(&self, what: &str) -> &Tensor {
        match self {
            Arg::Shared(t) => t,
            Arg::DonatedOnDevice(t, _) => t,
            Arg::Donated(..) => unreachable!("{what} never write host storage in place"),
        }
    }
}

/// A kernel with its arguments, ready to run on any thread.
struct Job<'a> {
    kernel: &'a Kernel,
    args: Vec<Arg>,
    /// Where its allocations go (compiled runs with a memory plan).
    planned: Option<Planned>,
    /// Outputs planned in place whose input was still shared.
    undonated: Vec<NodeId>,
}

/// A kernel's planned allocations.
struct Planned {
    slots: Slots,
    /// A cat whose inputs were made within its output: it copies nothing.
    joins: bool,
    /// The outputs planned to be written over an input, with their slots.
    in_place: Vec<(NodeId, usize)>,
}

impl Planned {
    /// Output `out` could not be written in place (its input was still
    /// shared): it is allocated in its own slot, from the pool.
    fn release_in_place(&mut self, out: NodeId) {
        if let Some(&(_, slot)) = self.in_place.iter().find(|(v, _)| *v == out) {
            self.slots.release_in_place(slot);
        }
    }
}

impl<'a> Job<'a> {
    /// Takes the kernel's inputs from `values`: clones, except the inputs
    /// it overwrites in place (`in_place`: input value, output value), which
    /// are moved out — when their storage is unshared, as the memory plan
    /// promised; otherwise the kernel allocates, and the log says so.
    fn gather(
        graph: &Graph,
        k: usize,
        kernel: &'a Kernel,
        in_place: &[(NodeId, NodeId)],
        values: &mut [Option<Tensor>],
    ) -> Job<'a> {
        let writes = kernel.writes();
        let mut undonated = Vec::new();
        let args = kernel
            .reads(graph)
            .into_iter()
            .map(|x| {
                let Some(&(_, out)) = in_place.iter().find(|(i, _)| *i == x) else {
                    return Arg::Shared(values[x.index()].clone().expect("computed before use"));
                };
                let t = values[x.index()].take().expect("computed before use");
                let output = || {
                    writes
                        .iter()
                        .position(|&w| w == out)
                        .expect("an output of the kernel")
                };
                if t.is_unique_device() {
                    return Arg::DonatedOnDevice(t, output());
                }
                match t.into_unique_storage() {
                    Ok(storage) => Arg::Donated(storage, output()),
                    Err(t) => {
                        log("memory", || {
                            format!(
                                "kernel k{k}: {} is still shared; {} gets its own buffer",
                                graph.display_name(x),
                                graph.display_name(out)
                            )
                        });
                        undonated.push(out);
                        Arg::Shared(t)
                    }
                }
            })
            .collect();
        Job {
            kernel,
            args,
            planned: None,
            undonated,
        }
    }

    /// Gives the job its planned allocations; the outputs whose input
    /// could not be handed over take their own (pool) slots.
    fn with_plan(mut self, planned: Option<Planned>) -> Job<'a> {
        self.planned = planned.map(|mut p| {
            for &out in &self.undonated {
                p.release_in_place(out);
            }
            p
        });
        self
    }

    fn run(mut self, graph: &Graph, tune: bool) -> Result<Vec<(NodeId, Tensor)>> {
        match self.planned.take() {
            Some(Planned {
                slots, joins: true, ..
            }) => self.join(graph, slots),
            Some(Planned { slots, .. }) => {
                let (kernel, places) = (self.kernel, slots.value_addrs());
                let written = arena::planned(slots, || self.run_kernel(graph, tune))?;
                match kernel {
                    Kernel::Custom { .. } => rehome(graph, written, &places),
                    _ => Ok(written),
                }
            }
            None => self.run_kernel(graph, tune),
        }
    }

    /// A cat in place: its output is the place its inputs were written
    /// into. Should an input not be where the plan put it (its producer
    /// allocated elsewhere), the cat copies into a buffer of its own.
    fn join(self, graph: &Graph, mut slots: Slots) -> Result<Vec<(NodeId, Tensor)>> {
        let Kernel::Extern(id) = self.kernel else {
            unreachable!("only cats join")
        };
        let ty = &graph.node(*id).ty;
        let shape = ty.shape.as_concrete().expect("planned shapes are concrete");
        let numel: usize = shape.iter().product();
        let region = slots
            .take_value(numel * ty.dtype.size_bytes())
            .expect("internal error: the output of a cat in place has a place");
        let mut at = region.addr();
        let mut in_place = true;
        for arg in &self.args {
            let Arg::Shared(t) = arg else {
                unreachable!("cats never write in place")
            };
            let start = match t.device_storage() {
                Some(s) => s.ptr(),
                None => t.storage().as_bytes().as_ptr() as u64,
            };
            in_place &= t.layout().offset == 0 && start == at;
            at += (t.numel() * t.dtype().size_bytes()) as u64;
        }
        if !in_place {
            log("memory", || {
                format!(
                    "{}: an input is not where the plan put it; the cat copies",
                    graph.display_name(*id)
                )
            });
            return self.run_kernel(graph, false);
        }
        let out = match region {
            Taken::Host(region) => {
                let storage = super::cpu::Storage::in_region(ty.dtype, numel, region);
                Tensor::from_storage(storage, &shape)
            }
            Taken::Device(region) => {
                let storage =
                    DeviceStorage::new(on_device(&self.args), ty.dtype, numel, Box::new(region));
                Tensor::from_device_storage(storage, &shape)
            }
        };
        Ok(vec![(*id, out)])
    }

    /// Runs the kernel. Memory it cannot get is an `OutOfMemory` error about
    /// the values it writes (the op's error where one op runs).
    fn run_kernel(self, graph: &Graph, tune: bool) -> Result<Vec<(NodeId, Tensor)>> {
        let writes = self.kernel.writes();
        super::cpu::alloc::catching(|| self.run_kernel_here(graph, tune))
            .and_then(|r| r)
            .map_err(|e| match (e.kind, e.op.is_none(), writes.first()) {
                (ErrorKind::OutOfMemory, true, Some(&first)) => {
                    let types: Vec<String> = writes
                        .iter()
                        .map(|&w| graph.node(w).ty.to_string())
                        .collect();
                    let op = graph.node(first).op.name();
                    let e = super::cpu::in_kernel(e, op, &types.join(", "));
                    node_error(graph, first, e)
                }
                _ => e,
            })
    }

    fn run_kernel_here(self, graph: &Graph, tune: bool) -> Result<Vec<(NodeId, Tensor)>> {
        match self.kernel {
            Kernel::Extern(id) => {
                let node = graph.node(*id);
                let args: Vec<&Tensor> = self
                    .args
                    .iter()
                    .map(|a| a.tensor("extern kernels"))
                    .collect();
                let out = Tensor::apply(&node.op, &args, Location::caller())
                    .map_err(|e| node_error(graph, *id, e))?;
                Ok(vec![(*id, out)])
            }
            Kernel::Custom { node, outputs } => {
                let n = graph.node(*node);
                let Op::Custom(call) = &n.op else {
                    unreachable!("a custom kernel's node is a custom op")
                };
                let args: Vec<&Tensor> = self
                    .args
                    .iter()
                    .map(|a| a.tensor("custom kernels"))
                    .collect();
                let outs = trace::with_origin(&n.meta, || {
                    crate::custom_op::apply(call, &args, Location::caller())
                })
                .map_err(|e| node_error(graph, *node, e))?;
                let mut written = vec![(*node, outs[0].clone())];
                for &o in outputs {
                    let Op::CustomOutput { index, .. } = graph.node(o).op else {
                        unreachable!("a custom kernel writes custom outputs")
                    };
                    written.push((o, outs[index].clone()));
                }
                Ok(written)
            }
            Kernel::Epilogue {
                matmul,
                matmul_out,
                kernel,
                inputs,
                outputs,
                ..
            } => run_epilogue(
                graph,
                (*matmul, *matmul_out),
                kernel,
                inputs,
                outputs,
                self.args,
                tune,
            ),
            Kernel::Rows {
                kernel,
                outputs,
                members,
                inputs,
            } => {
                let args: Vec<&Tensor> =
                    self.args.iter().map(|a| a.tensor("row kernels")).collect();
                run_rows(graph, kernel, (members, inputs, outputs), &args)
            }
            Kernel::MatmulRows {
                matmuls,
                kernel,
                members,
                inputs,
                outputs,
            } => {
                let args: Vec<&Tensor> = self
                    .args
                    .iter()
                    .map(|a| a.tensor("matmul row kernels"))
                    .collect();
                run_matmul_rows(graph, matmuls, kernel, (members, inputs, outputs), &args)
            }
            Kernel::Fused {
                kernel,
                outputs,
                members,
                ..
            } => {
                let outs = run_fused(kernel, self.args, tune)
                    .map_err(|e| node_error(graph, members[0], e))?;
                Ok(outputs.iter().copied().zip(outs).collect())
            }
        }
    }
}

/// A row kernel's (`members`, `inputs`, `outputs`) — group members, the
/// values it reads, the values it writes.
type RowGroup<'a> = (&'a [NodeId], &'a [NodeId], &'a [NodeId]);

/// A row kernel on its inputs `args`: the CPU's, or the device's kernel,
/// or, where the device does not take it, op by op through the device's
/// own kernels.
fn run_rows(
    graph: &Graph,
    kernel: &RowKernel,
    (members, inputs, outputs): RowGroup<'_>,
    args: &[&Tensor],
) -> Result<Vec<(NodeId, Tensor)>> {
    let arrays: Vec<&Array> = args.iter().map(|t| t.array()).collect();
    if let Some(on) = args.iter().map(|t| t.device()).find(|&d| d != Device::Cpu) {
        let backend = device::backend(on)?;
        let Some(why) = backend.row_kernel_refusal(kernel) else {
            let outs = backend
                .run_rows(kernel, &arrays)
                .map_err(|e| node_error(graph, members[0], e))?;
            return Ok(tensors_of(outputs, outs));
        };
        log("fusion", || {
            format!(
                "row kernel of {} on {on}: op by op ({why})",
                graph.display_name(members[0])
            )
        });
        return run_members(graph, members, inputs, args, outputs);
    }
    let outs = kernel
        .run(&arrays)
        .map_err(|e| node_error(graph, members[0], e))?;
    Ok(tensors_of(outputs, outs))
}

/// Kernel outputs as the tensors of the values `outputs` names.
fn tensors_of(outputs: &[NodeId], arrays: Vec<Array>) -> Vec<(NodeId, Tensor)> {
    outputs
        .iter()
        .copied()
        .zip(arrays.into_iter().map(Tensor::from_array))
        .collect()
}

/// Matmuls and the row kernel that alone reads their products (`args`:
/// the matmuls' operands, then the row kernel's other inputs). On the CPU,
/// thin f32 products are handed to the row kernel block by block
/// (`BlockedProduct`); elsewhere the products are made whole, as the
/// kernel's scratch (as the memory plan counts them, see
/// `schedule::buffers`), and the row kernel runs as [`run_rows`] runs it.
fn run_matmul_rows(
    graph: &Graph,
    matmuls: &[NodeId],
    kernel: &RowKernel,
    (members, inputs, outputs): RowGroup<'_>,
    args: &[&Tensor],
) -> Result<Vec<(NodeId, Tensor)>> {
    let mut args = args.iter().copied();
    let operands: Vec<Vec<&Tensor>> = matmuls
        .iter()
        .map(|&m| args.by_ref().take(graph.node(m).inputs.len()).collect())
        .collect();
    let rest: Vec<&Tensor> = args.collect();
    let row_members = &members[matmuls.len()..];
    let on_cpu = operands
        .iter()
        .flatten()
        .chain(&rest)
        .all(|t| t.device() == Device::Cpu);
    if on_cpu && !kernel.wide {
        let blocked: Option<Vec<BlockedProduct<'_>>> = matmuls
            .iter()
            .zip(&operands)
            .map(|(&m, ops)| {
                let node = graph.node(m);
                let shape = node.ty.shape.as_concrete()?;
                let (a, b) = (ops[0].array(), ops[1].array());
                BlockedProduct::new(a, b, cpu::transposes(&node.op), &shape)
            })
            .collect();
        if let Some(products) = blocked.filter(|p| cpu::alike(p)) {
            let mut rest = rest.iter();
            let row_args: Vec<Option<&Array>> = inputs
                .iter()
                .map(|x| (!matmuls.contains(x)).then(|| rest.next().expect("an input").array()))
                .collect();
            let fed: Vec<usize> = matmuls
                .iter()
                .map(|m| inputs.iter().position(|x| x == m).expect("a product read"))
                .collect();
            let outs = kernel
                .run_fed(&row_args, &fed, |each| cpu::for_each_block(&products, each))
                .map_err(|e| node_error(graph, row_members[0], e))?;
            return Ok(tensors_of(outputs, outs));
        }
    }
    let products = matmuls
        .iter()
        .zip(&operands)
        .map(|(&m, ops)| {
            arena::scratch(|| Tensor::apply(&graph.node(m).op, ops, Location::caller()))
                .map_err(|e| node_error(graph, m, e))
        })
        .collect::<Result<Vec<Tensor>>>()?;
    let mut rest = rest.iter();
    let row_args: Vec<&Tensor> = inputs
        .iter()
        .map(|x| match matmuls.iter().position(|m| m == x) {
            Some(i) => &products[i],
            None => *rest.next().expect("an input"),
        })
        .collect();
    run_rows(graph, kernel, (row_members, inputs, outputs), &row_args)
}

/// Evaluates a group's `members` in order, op by op, from the values it
/// `reads`; returns its `outputs`.
fn run_members(
    graph: &Graph,
    members: &[NodeId],
    reads: &[NodeId],
    args: &[&Tensor],
    outputs: &[NodeId],
) -> Result<Vec<(NodeId, Tensor)>> {
    let mut values: std::collections::HashMap<NodeId, Tensor> = reads
        .iter()
        .copied()
        .zip(args.iter().map(|&t| t.clone()))
        .collect();
    for &m in members {
        let node = graph.node(m);
        // Scalar constants a group inlines are not among its reads.
        for &x in &node.inputs {
            if let std::collections::hash_map::Entry::Vacant(slot) = values.entry(x) {
                let constant = Tensor::apply(&graph.node(x).op, &[], Location::caller())
                    .map_err(|e| node_error(graph, x, e))?;
                slot.insert(constant);
            }
        }
        let inputs: Vec<&Tensor> = node.inputs.iter().map(|x| &values[x]).collect();
        let apply = || Tensor::apply(&node.op, &inputs, Location::caller());
        // Only the group's outputs are planned buffers; what its members
        // make on the way comes from the pool.
        let out = match outputs.contains(&m) {
            true => apply(),
            false => arena::unplanned(apply),
        }
        .map_err(|e| node_error(graph, m, e))?;
        values.insert(m, out);
    }
    Ok(outputs.iter().map(|&o| (o, values[&o].clone())).collect())
}

/// A custom kernel's outputs, each where the plan put it or in the pool.
///
/// A custom op allocates its outputs in an order of its own, and each
/// allocation takes the first untaken planned slot of its size
/// (`cpu::arena`): outputs of equal size may land in each other's slots,
/// where a slot's place is reused when the plan's value of that slot dies,
/// not when the value that landed there does. Such an output is copied to
/// the pool (and logged), so no value outlives its place; an output in the
/// pool is safe wherever the plan meant it to be. `places` are the slots'
/// addresses in the kernel's write order (as `written`), from
/// [`Slots::value_addrs`].
fn rehome(
    graph: &Graph,
    written: Vec<(NodeId, Tensor)>,
    places: &[Option<u64>],
) -> Result<Vec<(NodeId, Tensor)>> {
    written
        .into_iter()
        .enumerate()
        .map(|(i, (id, t))| {
            let at = storage_addr(&t);
            let elsewhere = places.get(i).copied().flatten() != Some(at);
            if !(elsewhere && places.contains(&Some(at))) {
                return Ok((id, t));
            }
            log("memory", || {
                format!(
                    "{}: its kernel allocated it in the place planned for another output; copied to the pool",
                    graph.display_name(id)
                )
            });
            Ok((id, arena::unplanned(|| fresh_copy(&t))?))
        })
        .collect()
}

/// The address of the first byte of `t`'s storage (host or device).
fn storage_addr(t: &Tensor) -> u64 {
    match t.device_storage() {
        Some(s) => s.ptr(),
        None => t.storage().as_bytes().as_ptr() as u64,
    }
}

/// A copy of `t`'s whole storage in a new allocation, with `t`'s layout.
fn fresh_copy(t: &Tensor) -> Result<Tensor> {
    let layout = t.layout().clone();
    match t.device_storage() {
        Some(src) => {
            let backend = device::backend(t.device())?;
            let dst = backend.alloc(src.dtype(), src.numel())?;
            backend.copy(&dst, src)?;
            Ok(Tensor::from_device_parts(Arc::new(dst), layout))
        }
        None => {
            let src = t.storage();
            let mut dst = Storage::try_new(t.dtype(), src.numel())?;
            dst.as_bytes_mut().copy_from_slice(src.as_bytes());
            Ok(Tensor::from_parts(Arc::new(dst), layout))
        }
    }
}

/// Runs a matmul and its epilogue: the gemm writes a fresh buffer, which
/// the epilogue then overwrites in place (one output of the matmul's dtype)
/// unless the matmul's value is itself an output.
fn run_epilogue(
    graph: &Graph,
    (matmul, matmul_out): (NodeId, bool),
    kernel: &FusedKernel,
    inputs: &[NodeId],
    outputs: &[NodeId],
    args: Vec<Arg>,
    tune: bool,
) -> Result<Vec<(NodeId, Tensor)>> {
    let shared: Vec<Tensor> = args
        .into_iter()
        .map(|a| match a {
            Arg::Shared(t) | Arg::DonatedOnDevice(t, _) => t,
            Arg::Donated(..) => unreachable!("epilogue inputs are not donated by the plan"),
        })
        .collect();
    let node = graph.node(matmul);
    let (operands, rest) = shared.split_at(node.inputs.len());
    let operands: Vec<&Tensor> = operands.iter().collect();
    let dtype = node.ty.dtype;
    let target = (!matmul_out)
        .then(|| kernel.outputs.iter().position(|&(_, d)| d == dtype))
        .flatten();
    let gemm = || Tensor::apply(&node.op, &operands, Location::caller());
    // A product that is neither an output nor overwritten by one is the
    // kernel's scratch in the memory plan.
    let product = match matmul_out || target.is_some() {
        true => gemm(),
        false => arena::scratch(gemm),
    }
    .map_err(|e| node_error(graph, matmul, e))?;
    let mut results = Vec::with_capacity(outputs.len() + 1);
    let mut product = Some(product);
    if matmul_out {
        results.push((matmul, product.clone().expect("the product")));
    }
    let mut rest = rest.iter();
    let mut fused_args = Vec::with_capacity(inputs.len());
    for &x in inputs {
        if x != matmul {
            fused_args.push(Arg::Shared(rest.next().expect("an input").clone()));
            continue;
        }
        let t = product.take().expect("the matmul is read once");
        fused_args.push(match target {
            Some(o) if t.is_unique_device() => Arg::DonatedOnDevice(t, o),
            Some(o) => match t.into_unique_storage() {
                Ok(storage) => Arg::Donated(storage, o),
                Err(t) => Arg::Shared(t),
            },
            None => Arg::Shared(t),
        });
    }
    let outs = run_fused(kernel, fused_args, tune)
        .map_err(|e| node_error(graph, outputs.first().copied().unwrap_or(matmul), e))?;
    results.extend(outputs.iter().copied().zip(outs));
    Ok(results)
}

/// The kernel with its autotuned block. Donated storages are read as
/// tensors during the trials and donated again afterwards.
fn tuned(kernel: &FusedKernel, args: Vec<Arg>) -> Result<(FusedKernel, Vec<Arg>)> {
    let held: Vec<(Tensor, Option<usize>)> = args
        .into_iter()
        .map(|a| match a {
            Arg::Shared(t) | Arg::DonatedOnDevice(t, _) => (t, None),
            Arg::Donated(s, o) => (Tensor::from_storage(s, &kernel.shape), Some(o)),
        })
        .collect();
    let refs: Vec<&Tensor> = held.iter().map(|(t, _)| t).collect();
    let kernel = autotune::tune(kernel, &refs)?;
    let args = held
        .into_iter()
        .map(|(t, o)| match o {
            None => Arg::Shared(t),
            Some(o) => match t.into_unique_storage() {
                Ok(s) => Arg::Donated(s, o),
                Err(t) => Arg::Shared(t),
            },
        })
        .collect();
    Ok((kernel, args))
}

/// Runs a fused kernel on its gathered arguments, on their device (block
/// autotuned when `tune`, on the host).
fn run_fused(kernel: &FusedKernel, args: Vec<Arg>, tune: bool) -> Result<Vec<Tensor>> {
    let on_device = args.iter().find_map(|a| match a {
        Arg::Shared(t) | Arg::DonatedOnDevice(t, _) if t.device() != Device::Cpu => {
            Some(t.device())
        }
        _ => None,
    });
    if let Some(d) = on_device {
        let arrays: Vec<&Array> = args
            .iter()
            .map(|a| a.tensor("device kernels").array())
            .collect();
        let donated: Vec<(usize, usize)> = args
            .iter()
            .enumerate()
            .filter_map(|(i, a)| match a {
                Arg::DonatedOnDevice(_, o) => Some((i, *o)),
                _ => None,
            })
            .collect();
        device::of_inputs("fused", &arrays)?;
        let outs = device::backend(d)?.run_fused_into(kernel, &arrays, &donated)?;
        return Ok(outs.into_iter().map(Tensor::from_array).collect());
    }
    if tune {
        let (kernel, args) = tuned(kernel, args)?;
        return run_fused(&kernel, args, false);
    }
    // The shared tensors must outlive the inputs that borrow them.
    let mut shared: Vec<Option<Tensor>> = Vec::with_capacity(args.len());
    let mut donated: Vec<Option<(Storage, usize)>> = Vec::with_capacity(args.len());
    for arg in args {
        match arg {
            // A host kernel: nothing is on a device.
            Arg::Shared(t) | Arg::DonatedOnDevice(t, _) => {
                shared.push(Some(t));
                donated.push(None);
            }
            Arg::Donated(s, o) => {
                shared.push(None);
                donated.push(Some((s, o)));
            }
        }
    }
    let inputs: Vec<FusedInput<'_>> = shared
        .iter()
        .zip(donated)
        .map(|(t, d)| match d {
            Some((storage, output)) => FusedInput::Donated { storage, output },
            None => FusedInput::Shared(t.as_ref().expect("a shared input").array()),
        })
        .collect();
    let outs = kernel.run_with(inputs)?;
    Ok(outs.into_iter().map(Tensor::from_array).collect())
}

/// For each step, the values read for the last time in it (or made in it
/// and never read); graph outputs are kept.
fn frees_after_each_step(graph: &Graph, plan: &Plan, steps: &[Vec<usize>]) -> Vec<Vec<NodeId>> {
    let mut last: Vec<Option<usize>> = vec![None; graph.len()];
    for (s, step) in steps.iter().enumerate() {
        for &k in step {
            let kernel = &plan.kernels[k];
            for v in kernel.writes().into_iter().chain(kernel.reads(graph)) {
                last[v.index()] = Some(last[v.index()].map_or(s, |l| l.max(s)));
            }
        }
    }
    for out in &graph.outputs {
        last[out.node.index()] = None;
    }
    let mut frees = vec![Vec::new(); steps.len()];
    for (i, l) in last.into_iter().enumerate() {
        if let Some(s) = l {
            frees[s].push(NodeId(i as u32));
        }
    }
    frees
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loop_runs_on_a_pool_worker_in_the_callers_grad_mode() {
        let probe = || {
            on_pool_worker(|| {
                (
                    rayon::current_thread_index().is_some(),
                    autograd::is_grad_enabled(),
                )
            })
        };
        assert_eq!(probe(), (true, true));
        assert_eq!(autograd::no_grad(probe), (true, false));
        // Called on a worker already, it runs right there.
        let (caller, inner) = rayon::scope(|_| {
            let caller = std::thread::current().id();
            (caller, on_pool_worker(|| std::thread::current().id()))
        });
        assert_eq!(caller, inner);
    }

    #[test]
    fn the_pool_workers_loop_returns_its_value_and_passes_a_panic_on() {
        // The pollers run until the loop ends, a panicking one too (else
        // this would hang), and every task the loop spreads is done.
        let sums: Vec<u64> = (0..200u64)
            .map(|i| on_pool_worker(|| (0..1000u64).into_par_iter().map(|x| x * i).sum()))
            .collect();
        assert!(sums.iter().zip(0u64..).all(|(&s, i)| s == 499_500 * i));
        let caught = std::panic::catch_unwind(|| on_pool_worker(|| panic!("inside the loop")));
        assert!(caught.is_err());
    }
}
