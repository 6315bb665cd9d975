//! Runs a fused [`Plan`]: in plan order ([`run_plan`]) or in a schedule's
//! steps ([`run_scheduled`]). Each value is freed right after the last step
//! that reads it, so the bytes alive over time follow the memory plan.
//! Results equal the interpreter's (checked by the differential tests);
//! only the work and its order differ. A memory plan's offloads and
//! prefetches (`schedule::memory`) start between steps through the backend
//! (`Backend::offload_start` after a value's last step,
//! `Backend::prefetch_start` some steps before its first) and are waited
//! for where the plan says (`Transfer::wait`: on a device, the compute
//! stream waits for the copy stream, the host goes on queueing), all of
//! them by the run's end.

mod job;
mod kernels;
mod lanes;
mod pool;
mod prepared;
mod profile;

use std::collections::HashMap;
use std::sync::Mutex;

use rayon::prelude::*;

use self::job::{Job, Planned};
use self::lanes::StreamLanes;
use self::pool::{on_pool_worker, POOL_WORKER_MIN_STEPS};
pub use self::prepared::Prepared;
use self::prepared::StepMoves;
use self::profile::Profile;
use super::cpu::arena::{Arena, Block};
use super::device::{self, Backend, Device, Transfer};
use crate::autograd;
use crate::error::{Error, ErrorKind, Result};
use crate::fusion::{Kernel, Plan};
use crate::ir::kernel::RowKernel;
use crate::ir::{Graph, NodeId};
use crate::logging::log;
use crate::schedule::{MemoryPlan, Schedule, StreamPlan};
use crate::tensor::interpret::{bind_symbols, inputs_device};
use crate::tensor::{trace, Tensor};

/// Runs `plan` (made by `fusion::fuse(graph)`) on `inputs`, one per
/// `graph.inputs`, one kernel at a time in plan order, returning the named
/// outputs.
pub fn run_plan(graph: &Graph, plan: &Plan, inputs: &[Tensor]) -> Result<Vec<(String, Tensor)>> {
    run_plan_with(graph, plan, inputs, false)
}

/// [`run_plan`], with fused kernels' block sizes autotuned when `tune`
/// (see [`super::cpu::autotune`]).
pub fn run_plan_with(
    graph: &Graph,
    plan: &Plan,
    inputs: &[Tensor],
    tune: bool,
) -> Result<Vec<(String, Tensor)>> {
    let prepared = Prepared::in_plan_order(graph, plan);
    run_prepared(graph, plan, &prepared, inputs.to_vec(), tune).map(|outs| named(graph, outs))
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
/// (see [`super::cpu::autotune`]).
pub fn run_scheduled_with(
    graph: &Graph,
    plan: &Plan,
    schedule: &Schedule,
    memory: &MemoryPlan,
    inputs: &[Tensor],
    tune: bool,
) -> Result<Vec<(String, Tensor)>> {
    run_scheduled_owned(graph, plan, schedule, memory, inputs.to_vec(), tune)
}

/// [`run_scheduled_with`] on inputs handed over by value: an input whose
/// tensor here is its only handle (and dense) can be written over where
/// the memory plan says (its donated inputs, `schedule::build_donating`);
/// every other is read as the caller's, its planned overwrite then
/// allocated from the pool, and the memory log says so. Whatever was
/// planned, a tensor with other handles is never written over.
pub fn run_scheduled_owned(
    graph: &Graph,
    plan: &Plan,
    schedule: &Schedule,
    memory: &MemoryPlan,
    inputs: Vec<Tensor>,
    tune: bool,
) -> Result<Vec<(String, Tensor)>> {
    let prepared = Prepared::scheduled(graph, plan, schedule, memory);
    run_prepared(graph, plan, &prepared, inputs, tune).map(|outs| named(graph, outs))
}

/// Runs `plan` of `graph` as `prepared` (made for them) says: as
/// [`run_plan_with`] does for [`Prepared::in_plan_order`], as
/// [`run_scheduled_owned`] does for [`Prepared::scheduled`], returning the
/// outputs in `graph.outputs` order. An executable prepares its plan once
/// and runs it this way at every call (from any number of threads).
pub fn run_prepared(
    graph: &Graph,
    plan: &Plan,
    prepared: &Prepared,
    inputs: Vec<Tensor>,
    tune: bool,
) -> Result<Vec<Tensor>> {
    if !prepared.fits(graph, plan) {
        return Err(Error::new(
            ErrorKind::Verify,
            format!(
                "internal error: graph `{}` run with the preparation of another plan",
                graph.name
            ),
        ));
    }
    let refs: Vec<&Tensor> = inputs.iter().collect();
    // Prefetched inputs arrive in host memory: the run is on the plan's
    // device.
    let on = run_device(graph, &refs, &prepared.moves)?;
    drop(refs);
    let run = |placement| Run {
        graph,
        plan,
        prepared,
        placement,
        on,
    };
    let Some(memory) = &prepared.memory else {
        return execute(&run(Placement::Pool), inputs, tune);
    };
    if let Some(why) = memory.unfit(plan, on) {
        log("memory", || {
            format!(
                "graph `{}` on {on}: {why}; no arena, buffers from the device's allocator",
                graph.name
            )
        });
        return execute(&run(Placement::InPlace), inputs, tune);
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
    let placement = Placement::Arena {
        arena,
        blocks: Mutex::new(HashMap::new()),
    };
    execute(&run(placement), inputs, tune)
}

/// One run: the plan, its preparation, where its buffers go and its device.
struct Run<'r> {
    graph: &'r Graph,
    plan: &'r Plan,
    prepared: &'r Prepared,
    placement: Placement,
    on: Device,
}

/// Where a run's kernels allocate.
enum Placement {
    /// From the device's allocator, nothing in place (a run in plan order).
    Pool,
    /// From the device's allocator, in place where the memory plan says.
    InPlace,
    /// Where the memory plan says: one arena for the run; the escaping
    /// outputs of cats in place, by buffer, allocated with their first
    /// piece (a Mutex so that the executor may run on a pool worker: only
    /// that one thread takes it).
    Arena {
        arena: Arena,
        blocks: Mutex<HashMap<usize, Block>>,
    },
}

impl Run<'_> {
    /// What the memory plan says about kernel `k` in this run, on
    /// `backend` (the run's device's).
    fn kernel_memory(&self, k: usize, backend: &dyn Backend) -> Result<KernelMemory<'_>> {
        let memory = self.prepared.memory.as_ref();
        let places = memory.map(|m| &m.kernels[k]);
        let in_place = match (&self.placement, places) {
            (Placement::Pool, _) | (_, None) => &[][..],
            (_, Some(p)) => &p.in_place[..],
        };
        let (Placement::Arena { arena, blocks }, Some(memory), Some(places)) =
            (&self.placement, memory, places)
        else {
            return Ok(KernelMemory {
                in_place,
                alone: false,
                planned: None,
            });
        };
        let block = |b: usize| -> Result<Block> {
            let mut blocks = blocks.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(block) = blocks.get(&b) {
                return Ok(block.clone());
            }
            let block = Block::on(self.on, memory.buffer_bytes[b])?;
            blocks.insert(b, block.clone());
            Ok(block)
        };
        let planned = match memory.placed(self.graph, self.plan, k, backend) {
            true => {
                let (slots, in_place) = memory.slots(k, arena, block)?;
                Some(Planned {
                    slots,
                    joins: places.joins,
                    in_place,
                })
            }
            false => None,
        };
        Ok(KernelMemory {
            in_place,
            alone: places.alone,
            planned,
        })
    }
}

/// The copies in flight of a run, by value: each waited for (the compute
/// stream waits for it on the device) and dropped (an offload's device
/// bytes released) where the plan says, the rest at the run's end.
#[derive(Default)]
struct InFlight(HashMap<NodeId, Box<dyn Transfer>>);

impl InFlight {
    fn start(&mut self, v: NodeId, transfer: Option<Box<dyn Transfer>>) {
        if let Some(t) = transfer {
            self.0.insert(v, t);
        }
    }

    /// The compute waits for the copies of `values` (those in flight):
    /// each of `lanes` of `backend` (work goes to lane 0 again after).
    fn wait(&mut self, values: &[NodeId], backend: &dyn Backend, lanes: &[usize]) -> Result<()> {
        for v in values {
            if let Some(t) = self.0.remove(v) {
                for &lane in lanes {
                    backend.lane(lane)?;
                    t.wait()?;
                }
                backend.lane(0)?;
            }
        }
        Ok(())
    }

    /// The compute waits for every copy still in flight.
    fn wait_all(&mut self) -> Result<()> {
        for (_, t) in self.0.drain() {
            t.wait()?;
        }
        Ok(())
    }
}

/// `values[v]` replaced by the array `how(its array)` makes (a value
/// without an array, a traced one, stays), and the copy in flight.
fn move_value(
    values: &mut [Option<Tensor>],
    v: NodeId,
    how: impl FnOnce(&super::array::Array) -> Result<(super::array::Array, Option<Box<dyn Transfer>>)>,
) -> Result<Option<Box<dyn Transfer>>> {
    let slot = &mut values[v.index()];
    let mut transfer = None;
    if let Some(array) = slot.as_ref().and_then(Tensor::try_array) {
        let (moved, t) = how(array)?;
        transfer = t;
        *slot = Some(Tensor::from_array(moved));
    }
    Ok(transfer)
}

/// What the memory plan says about one kernel in one run.
struct KernelMemory<'p> {
    /// (input, output) pairs the kernel writes in place.
    in_place: &'p [(NodeId, NodeId)],
    /// It needs scratch, so runs alone in its step.
    alone: bool,
    /// The places of the buffers it creates (compiled runs with a plan).
    planned: Option<Planned>,
}

/// Runs `run`'s steps. On the host the loop itself runs on a rayon
/// worker (see [`on_pool_worker`]), except under a trace, whose tensors
/// belong to this thread. `inputs` are moved into the run: the values of
/// those without other handles are freed after their last read (or written
/// over, where planned).
fn execute(run: &Run<'_>, inputs: Vec<Tensor>, tune: bool) -> Result<Vec<Tensor>> {
    let many_kernels = run.prepared.steps.len() >= POOL_WORKER_MIN_STEPS;
    let on_threads = device::backend(run.on)?.runs_on_host_threads();
    let here = move || execute_here(run, inputs, tune);
    match many_kernels && !trace::is_active() && on_threads {
        true => on_pool_worker(here),
        false => here(),
    }
}

fn execute_here(run: &Run<'_>, inputs: Vec<Tensor>, tune: bool) -> Result<Vec<Tensor>> {
    let Run {
        graph,
        plan,
        prepared,
        on,
        ..
    } = *run;
    let given: Vec<Option<&Tensor>> = inputs.iter().map(Some).collect();
    bind_symbols(graph, &given)?;
    drop(given);
    let backend = device::backend(on)?;
    // The backend tunes the kernels run or queued from this thread (and
    // from the workers that run a step's kernels, below).
    let _tuning = device::Tuning::set(tune);
    device::with_device(on, || {
        let moves = &prepared.moves;
        let mut values = prepared.values();
        for (&id, t) in graph.inputs.iter().zip(inputs) {
            values[id.index()] = Some(t);
        }
        // Device kernels are queued from this thread: a step's kernels go
        // to the device's lanes (streams) instead of threads.
        let concurrent = !trace::is_active() && backend.runs_on_host_threads();
        let grad = autograd::is_grad_enabled();
        let lanes = backend.lanes();
        let mut profile = Profile::start();
        let mut in_flight = InFlight::default();
        // Streams by hint: every lane forks from the run's start and joins
        // at its end, kernels wait for each other through events; blocks
        // freed meanwhile are held until the join (see `schedule::streams`).
        let streams = match lanes > 1 && !trace::is_active() {
            true => prepared.stream_lanes(lanes),
            false => None,
        };
        if streams.is_some() {
            // Every lane, the spare ones too: they join at the end.
            backend.fork(lanes)?;
        }
        let main = [0usize];
        let all_lanes: &[usize] = streams.as_ref().map_or(&main, |(_, st)| &st.used);
        let looped = (|| -> Result<()> {
            // A step's jobs and results, their capacity kept from step to step.
            let mut serial: Vec<Job<'_>> = Vec::new();
            let mut parallel: Vec<Job<'_>> = Vec::new();
            let mut results: Vec<KernelResult> = Vec::new();
            for (s, (step, free)) in prepared.steps.iter().zip(&prepared.frees).enumerate() {
                in_flight.wait(
                    StepMoves::at(&moves.offload_wait_before, s),
                    &*backend,
                    &main,
                )?;
                for &v in StepMoves::at(&moves.prefetch_start_before, s) {
                    // Only what is in host memory (a value the forward could
                    // not offload arrives where it is).
                    let offloaded = |a: &super::array::Array| match a.host_storage() {
                        Some(storage) => on != Device::Cpu || storage.in_host_pool(),
                        None => false,
                    };
                    if values[v.index()]
                        .as_ref()
                        .and_then(Tensor::try_array)
                        .is_some_and(offloaded)
                    {
                        let t = move_value(&mut values, v, |a| backend.prefetch_start(a))?;
                        in_flight.start(v, t);
                    }
                }
                in_flight.wait(
                    StepMoves::at(&moves.prefetch_wait_before, s),
                    &*backend,
                    all_lanes,
                )?;
                let started = profile.as_ref().map(|_| profile::Clock::now());
                let concurrent = concurrent && step.len() > 1;
                for &k in step {
                    let mem = run.kernel_memory(k, &*backend)?;
                    let (kernel, io) = (&plan.kernels[k], &prepared.kernels[k]);
                    let job = Job::gather(graph, k, kernel, io, mem.in_place, &mut values)
                        .with_plan(mem.planned);
                    match !concurrent || mem.alone {
                        true => serial.push(job),
                        false => parallel.push(job),
                    }
                }
                match (&streams, lanes.min(serial.len())) {
                    (Some((sp, st)), _) => results.extend(on_streams(
                        &*backend,
                        (sp, st),
                        s,
                        step,
                        serial.drain(..),
                        graph,
                    )?),
                    (None, 0 | 1) => results.extend(serial.drain(..).map(|job| job.run(graph))),
                    (None, n) => results.extend(on_lanes(&*backend, n, serial.drain(..), graph)?),
                }
                // Rayon's workers start with grad mode on and tuning off: carry
                // the caller's.
                results.par_extend(parallel.par_drain(..).map(|job| {
                    let _tuning = device::Tuning::set(tune);
                    match grad {
                        true => job.run(graph),
                        false => autograd::no_grad(|| job.run(graph)),
                    }
                }));
                for result in results.drain(..) {
                    for (id, t) in result? {
                        values[id.index()] = Some(t);
                    }
                }
                for id in free {
                    values[id.index()] = None;
                }
                for &v in StepMoves::at(&moves.offload_after, s) {
                    // The copy follows the value's producer, on its lane.
                    if let Some((_, st)) = &streams {
                        backend.lane(st.writer.get(&v).map_or(0, |&k| st.lane_of[k]))?;
                    }
                    let t = move_value(&mut values, v, |a| backend.offload_start(a));
                    backend.lane(0)?;
                    in_flight.start(v, t?);
                }
                if let (Some(profile), Some(started)) = (profile.as_mut(), started) {
                    // On a device the step's kernels are only queued: wait for
                    // them, so the time is the device's (unless the host's
                    // queueing time is asked for: `TESSERA_LOGS=profile,host`).
                    if on != Device::Cpu && !profile.host_times() {
                        device::synchronize(on)?;
                    }
                    profile.step(step, &started);
                }
            }
            // The outputs leave the run with no copy in flight on the device
            // (an offloaded one's host bytes wait for theirs when read).
            in_flight.wait_all()
        })();
        if streams.is_some() {
            // Every lane joins the run's own stream, also after an error.
            let joined = backend.lane(0).and_then(|_| backend.join());
            looped?;
            joined?;
        } else {
            looped?;
        }
        if let Some(profile) = profile {
            profile.report(graph, &plan.kernels);
        }
        let outputs = graph
            .outputs
            .iter()
            .map(|o| values[o.node.index()].clone().expect("outputs are kept"))
            .collect();
        prepared.give_back(values);
        Ok(outputs)
    })
}

/// `outputs` (one per graph output) with the outputs' names.
fn named(graph: &Graph, outputs: Vec<Tensor>) -> Vec<(String, Tensor)> {
    let names = graph.outputs.iter().map(|o| o.name.clone());
    names.zip(outputs).collect()
}

/// The device a run's kernels use: its inputs', but with inputs to
/// prefetch from host memory, the plan's.
fn run_device(graph: &Graph, inputs: &[&Tensor], moves: &StepMoves) -> Result<Device> {
    match moves.any_prefetch {
        true => Ok(moves.device),
        false => inputs_device(graph, inputs),
    }
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
    other_device(memory.device, on).or_else(|| row_kernels_unfit(plan, on))
}

/// Why a plan made for the scratch of `made_for`'s kernels cannot take
/// its arena on `on`, if it cannot (see [`device_arena_unfit`]).
fn other_device(made_for: Device, on: Device) -> Option<String> {
    (made_for != on)
        .then(|| format!("the plan was made for the scratch of {made_for}'s kernels, not {on}'s"))
}

/// Why `plan`'s row kernels do not fit an arena on `on`, if they do not
/// (see [`device_arena_unfit`]).
fn row_kernels_unfit(plan: &Plan, on: Device) -> Option<String> {
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

/// Whether a kernel's allocations may take their planned places (always
/// on the CPU, which runs every row kernel as one). Slots are matched by size in allocation order, so a kernel that
/// allocates temporaries before outputs of the same size could put an
/// output in another output's place (with another lifetime). Custom ops
/// (their device code allocates as it likes) take their places, and an
/// output found in another's is moved to the pool ([`rehome`]); row groups
/// the device runs as one kernel allocate their outputs in the plan's
/// order; those it runs op by op with two outputs of one size allocate
/// from the pool instead, their outputs counted beside the arena.
fn placed_as_planned(graph: &Graph, kernel: &Kernel, backend: &dyn Backend) -> bool {
    match kernel {
        Kernel::Custom { .. } => true,
        Kernel::Rows { kernel, .. } | Kernel::MatmulRows { kernel, .. }
            if backend.row_kernel_refusal(kernel).is_none() =>
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

/// Runs the kernels of one step on `lanes` streams of `backend`'s device,
/// kernel i on lane i mod `lanes` (a `bfs` level's kernels are
/// independent); the step ends with every lane joined, also when a kernel
/// failed.
fn on_lanes<'j>(
    backend: &dyn Backend,
    lanes: usize,
    jobs: impl Iterator<Item = Job<'j>>,
    graph: &Graph,
) -> Result<Vec<KernelResult>> {
    backend.fork(lanes)?;
    let results: Vec<KernelResult> = jobs
        .enumerate()
        .map(|(i, job)| {
            backend.lane(i % lanes)?;
            job.run(graph)
        })
        .collect();
    // A kernel's own error says more than the join's that may follow it.
    match backend.join() {
        Err(e) if results.iter().all(Result::is_ok) => Err(e),
        _ => Ok(results),
    }
}

/// Runs the kernels of step `s` (`step`, in order, with their `jobs`) on
/// the lanes of their streams (`plan` on `lanes`): each waits for the
/// events of the kernels its stream plan names, and records its own when
/// another waits for it.
///
/// Where [`StreamLanes::spread`] allows, stream 0's kernels of the step go
/// round robin to lane 0 and the spare lanes, as a run without streams
/// spreads a step: the spare lanes first wait for lane 0's work so far,
/// and lane 0 waits for theirs at the step's end (events in the plan's
/// spare slots), so stream 0 keeps its order from step to step. Their own
/// events are then recorded on lane 0 after that join: a stream waiting
/// for one follows every earlier stream-0 kernel, as the plan's pruned
/// waits assume.
fn on_streams<'j>(
    backend: &dyn Backend,
    (plan, streams): (&StreamPlan, &StreamLanes),
    s: usize,
    step: &[usize],
    jobs: impl Iterator<Item = Job<'j>>,
    graph: &Graph,
) -> Result<Vec<KernelResult>> {
    let spare = streams.spread(s);
    let mut slots = streams.spare_slots(plan);
    let fork = slots.next().expect("a fork slot");
    if !spare.is_empty() {
        backend.lane(0)?;
        backend.record(fork)?;
        for &lane in spare {
            backend.lane(lane)?;
            backend.wait_for(fork)?;
        }
    }
    let lanes_of_0: Vec<usize> = std::iter::once(0).chain(spare.iter().copied()).collect();
    let mut next = 0;
    let mut results = Vec::with_capacity(step.len());
    for (&k, job) in step.iter().zip(jobs) {
        let lane = match streams.lane_of[k] {
            0 => {
                next += 1;
                lanes_of_0[(next - 1) % lanes_of_0.len()]
            }
            lane => lane,
        };
        backend.lane(lane)?;
        for &h in &plan.waits[k] {
            backend.wait_for(h)?;
        }
        let result = job.run(graph);
        let failed = result.is_err();
        results.push(result);
        if failed {
            break;
        }
        if plan.records[k] && (spare.is_empty() || lane != 0) {
            backend.record(k)?;
        }
    }
    if !spare.is_empty() {
        let joins: Vec<usize> = slots.take(spare.len()).collect();
        for (&lane, &slot) in spare.iter().zip(&joins) {
            backend.lane(lane)?;
            backend.record(slot)?;
        }
        backend.lane(0)?;
        for &slot in &joins {
            backend.wait_for(slot)?;
        }
        for &k in step {
            if plan.records[k] && streams.lane_of[k] == 0 {
                backend.record(k)?;
            }
        }
    }
    backend.lane(0)?;
    Ok(results)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fusion::fuse;
    use crate::ir::text::parse;

    /// `exp(x)` feeds a matmul (an extern kernel) and a sum; the product is
    /// the output.
    const GRAPH: &str = "graph g(%x) {
      %x = input : f32[4,4]
      %e = exp(%x) : f32[4,4]
      %m = matmul(%e, %e) : f32[4,4]
      %s = sum(%e) {dims=[0,1], keepdim=false} : f32[]
      return %m as m, %s as s
    }";

    #[test]
    fn each_value_is_freed_after_the_last_step_that_reads_it() {
        let graph = parse(GRAPH).unwrap();
        let plan = fuse(&graph);
        let prepared = Prepared::in_plan_order(&graph, &plan);
        let (steps, frees) = (&prepared.steps, &prepared.frees);
        let freed: Vec<NodeId> = frees.iter().flatten().copied().collect();
        let x = graph.inputs[0];
        let e = graph.node(graph.outputs[0].node).inputs[0];
        // The input and exp's value die once their last reader ran …
        let last_reader = |v: NodeId| {
            steps
                .iter()
                .rposition(|s| {
                    s.iter()
                        .any(|&k| plan.kernels[k].reads(&graph).contains(&v))
                })
                .unwrap()
        };
        assert!(frees[last_reader(x)].contains(&x), "{frees:?}");
        assert!(frees[last_reader(e)].contains(&e), "{frees:?}");
        // … and no output is ever freed.
        for out in &graph.outputs {
            assert!(!freed.contains(&out.node), "{frees:?}");
        }
        // Nothing is freed twice.
        let mut sorted = freed.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), freed.len());
    }

    #[test]
    fn plan_order_computes_what_eager_does() {
        let graph = parse(GRAPH).unwrap();
        let plan = fuse(&graph);
        let x = Tensor::from_vec((0..16).map(|i| i as f32 / 16.0).collect(), &[4, 4]);
        let got = run_plan(&graph, &plan, std::slice::from_ref(&x)).unwrap();
        let e = x.exp();
        let want = [e.matmul(&e), e.sum(&[0, 1], false)];
        for ((name, g), w) in got.iter().zip(&want) {
            let (g, w) = (g.to_f64_vec(), w.to_f64_vec());
            for (a, b) in g.iter().zip(&w) {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                    "{name}: {g:?} vs {w:?}"
                );
            }
        }
    }

    #[test]
    fn a_plan_made_for_another_devices_kernels_takes_no_arena() {
        let graph = parse(GRAPH).unwrap();
        let plan = fuse(&graph);
        let scheduled =
            crate::schedule::build(&graph, &plan, &crate::schedule::ScheduleOptions::default())
                .unwrap();
        assert_eq!(
            device_arena_unfit(&plan, &scheduled.memory, Device::Cpu),
            None
        );
        let why = device_arena_unfit(&plan, &scheduled.memory, Device::Cuda).unwrap();
        assert!(why.contains("made for the scratch of cpu"), "{why}");
    }
}
