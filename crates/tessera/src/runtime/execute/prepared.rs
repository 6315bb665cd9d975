//! What a run of a plan needs that depends only on the graph, its plan,
//! the schedule's steps and the memory plan, derived once
//! ([`Prepared::scheduled`], [`Prepared::in_plan_order`]) and only read by
//! every run: an executable keeps one per plan, so a call does no per-plan
//! work. (Derived on every call, this was a quarter of a small compiled
//! training step's time on the CPU: the last reads of every value, each
//! kernel's reads and writes, its planned places, each a few allocations.)
//!
//! A [`Prepared`] holds no state of a run: concurrent calls share it.
//! What depends on the device as well (the streams' lanes, whether the
//! arena fits) is made at the first run and kept.

use std::borrow::Cow;
use std::sync::{Mutex, OnceLock};

use super::lanes::StreamLanes;
use super::{other_device, placed_as_planned, row_kernels_unfit};
use crate::fusion::Plan;
use crate::ir::kernel::{FusedRegisters, RowRegisters};
use crate::ir::{Graph, NodeId};
use crate::runtime::cpu::arena::{Arena, Place, Slots};
use crate::runtime::device::{Backend, Device};
use crate::schedule::{MemoryPlan, MoveKind, Schedule, StreamPlan};
use crate::tensor::Tensor;

/// A plan made ready to run: its steps, the values each frees, each
/// kernel's reads, writes, planned allocations and register slots.
pub struct Prepared {
    pub(super) steps: Vec<Vec<usize>>,
    /// Per step, the values read for the last time in it (or made in it
    /// and never read); graph outputs are kept.
    pub(super) frees: Vec<Vec<NodeId>>,
    pub(super) kernels: Vec<PreparedKernel>,
    pub(super) moves: StepMoves,
    /// The schedule's streams (`stream` hints), if any.
    pub(super) streams: Option<StreamPlan>,
    /// `streams` on a device's lanes, made at the first run with them.
    stream_lanes: OnceLock<StreamLanes>,
    /// The memory plan's part; `None`: kernels allocate from the pool
    /// (a run in plan order).
    pub(super) memory: Option<PreparedMemory>,
    /// The graph's node count: a run checks it was prepared for its graph.
    nodes: usize,
    /// The value lists of finished runs, emptied, kept for their capacity
    /// (one per run at a time): a run's list has a slot per graph node.
    spare_values: Mutex<Vec<Vec<Option<Tensor>>>>,
}

/// One kernel's part of a [`Prepared`].
pub(super) struct PreparedKernel {
    /// The values it reads, in operand order (`Kernel::reads`).
    pub(super) reads: Vec<NodeId>,
    /// The values it writes (`Kernel::writes`).
    pub(super) writes: Vec<NodeId>,
    /// The register slots of its fused or row kernel (see [`Registers`]).
    pub(super) registers: Registers,
}

/// A kernel's register slots, allocated once (`ir::kernel::slots`) and
/// handed to the backend with each run of the kernel.
pub(super) enum Registers {
    /// Not a fused or row kernel (or a device that allocates its own).
    None,
    /// A fused kernel's (or an epilogue's): without and with the outputs'
    /// own slots (the CPU streams large outputs, `FusedRegisters::allocate`).
    Fused([FusedRegisters; 2]),
    /// A row kernel's (or a matmul row kernel's).
    Rows(RowRegisters),
}

/// The memory plan's part of a [`Prepared`]: per kernel, the places of the
/// buffers it creates and its in-place writes.
pub(super) struct PreparedMemory {
    /// The device the plan was made for (its scratch is that device's).
    pub(super) device: Device,
    pub(super) arena_bytes: usize,
    pub(super) kernels: Vec<KernelPlaces>,
    /// Per buffer, its bytes (a block of an escaping cat is that size).
    pub(super) buffer_bytes: Vec<usize>,
    /// Why a run on `device` cannot take the arena (`device_arena_unfit`),
    /// asked of the device's backend at the first run.
    unfit: OnceLock<Option<String>>,
    /// Per kernel, whether its allocations take their planned places on
    /// `device` (`placed_as_planned`), asked at the first run.
    placed: OnceLock<Vec<bool>>,
}

/// What the memory plan says of one kernel.
#[derive(Default)]
pub(super) struct KernelPlaces {
    /// (input, output) pairs it writes in place.
    pub(super) in_place: Vec<(NodeId, NodeId)>,
    /// It needs scratch, so runs alone in its step.
    pub(super) alone: bool,
    /// A cat whose inputs were made within its output: it copies nothing.
    pub(super) joins: bool,
    /// The buffers it creates, in the plan's order.
    pub(super) allocations: Vec<Allocation>,
}

/// One buffer a kernel creates.
pub(super) enum Allocation {
    /// Its scratch, reserved rounded up to the arena's alignment.
    Scratch { offset: usize, bytes: usize },
    /// An output value at its place.
    Value { bytes: usize, place: PlannedPlace },
    /// An output written over its input `value`'s storage: allocates
    /// nothing (unless the input is still shared).
    InPlace { value: NodeId, bytes: usize },
}

/// Where an output value goes; a block is made by the run that needs it.
pub(super) enum PlannedPlace {
    Arena(usize),
    /// At this offset in the block of buffer `.0` (an escaping cat's
    /// output, allocated with its first piece).
    Block(usize, usize),
    Pool,
}

impl Prepared {
    /// For [`super::run_plan`]: each kernel a step of its own, in plan
    /// order, without a memory plan.
    pub fn in_plan_order(graph: &Graph, plan: &Plan) -> Prepared {
        let steps: Vec<Vec<usize>> = (0..plan.kernels.len()).map(|k| vec![k]).collect();
        let mut prepared = Prepared::of_steps(graph, plan, steps);
        prepared.moves = StepMoves::none(prepared.steps.len());
        prepared
    }

    /// For [`super::run_scheduled`]: `schedule`'s steps with `memory`'s
    /// places, both made for `plan` of `graph`.
    pub fn scheduled(
        graph: &Graph,
        plan: &Plan,
        schedule: &Schedule,
        memory: &MemoryPlan,
    ) -> Prepared {
        let mut prepared = Prepared::of_steps(graph, plan, schedule.steps.clone());
        prepared.moves = StepMoves::of(memory, schedule.steps.len());
        prepared.streams = schedule.streams.clone();
        prepared.memory = Some(PreparedMemory::of(memory, plan.kernels.len()));
        prepared
    }

    fn of_steps(graph: &Graph, plan: &Plan, steps: Vec<Vec<usize>>) -> Prepared {
        let kernels: Vec<PreparedKernel> = plan
            .kernels
            .iter()
            .map(|kernel| PreparedKernel {
                reads: kernel.reads(graph),
                writes: kernel.writes(),
                registers: Registers::of(kernel),
            })
            .collect();
        let frees = frees_after_each_step(graph, &kernels, &steps);
        Prepared {
            steps,
            frees,
            kernels,
            moves: StepMoves::none(0),
            streams: None,
            stream_lanes: OnceLock::new(),
            memory: None,
            nodes: graph.len(),
            spare_values: Mutex::new(Vec::new()),
        }
    }

    /// The schedule's streams and their lanes on a device of `lanes` lanes
    /// (`None` without streams): made at the first run and kept — a
    /// device's lane count does not change; one of another count gets its
    /// own, not kept.
    pub(super) fn stream_lanes(&self, lanes: usize) -> Option<(&StreamPlan, Cow<'_, StreamLanes>)> {
        let plan = self.streams.as_ref()?;
        let made = || StreamLanes::new(plan, lanes, &self.kernels, &self.steps);
        let kept = self.stream_lanes.get_or_init(made);
        Some(match kept.lanes == lanes {
            true => (plan, Cow::Borrowed(kept)),
            false => (plan, Cow::Owned(made())),
        })
    }

    /// A run's values, one empty slot per graph node.
    pub(super) fn values(&self) -> Vec<Option<Tensor>> {
        let spare = self
            .spare_values
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        let mut values = spare.unwrap_or_default();
        values.resize(self.nodes, None);
        values
    }

    /// A finished run's values, emptied (what they hold dropped here) and
    /// kept for the next run.
    pub(super) fn give_back(&self, mut values: Vec<Option<Tensor>>) {
        values.clear();
        let mut spare = self.spare_values.lock().unwrap_or_else(|e| e.into_inner());
        spare.push(values);
    }

    /// Whether it was prepared for a plan of `plan`'s kernels over a graph
    /// of `graph`'s size (a cheap guard against running another plan's).
    pub(super) fn fits(&self, graph: &Graph, plan: &Plan) -> bool {
        self.nodes == graph.len() && self.kernels.len() == plan.kernels.len()
    }
}

impl Registers {
    fn of(kernel: &crate::fusion::Kernel) -> Registers {
        use crate::fusion::Kernel;
        match kernel {
            Kernel::Fused { kernel, .. } | Kernel::Epilogue { kernel, .. } => {
                let of = |own| FusedRegisters::allocate(&kernel.steps, &kernel.outputs, own);
                Registers::Fused([of(false), of(true)])
            }
            Kernel::Rows { kernel, .. } | Kernel::MatmulRows { kernel, .. } => {
                Registers::Rows(RowRegisters::allocate(kernel))
            }
            Kernel::Extern(_) | Kernel::Custom { .. } => Registers::None,
        }
    }

    /// A fused kernel's slots, `None` for any other.
    pub(super) fn fused(&self) -> Option<&[FusedRegisters; 2]> {
        match self {
            Registers::Fused(r) => Some(r),
            _ => None,
        }
    }

    /// A row kernel's slots, `None` for any other.
    pub(super) fn rows(&self) -> Option<&RowRegisters> {
        match self {
            Registers::Rows(r) => Some(r),
            _ => None,
        }
    }
}

impl PreparedMemory {
    fn of(memory: &MemoryPlan, kernels: usize) -> PreparedMemory {
        let mut places: Vec<KernelPlaces> = (0..kernels)
            .map(|k| KernelPlaces {
                in_place: memory.in_place(k).collect(),
                alone: memory.scratch_bytes(k) > 0,
                joins: memory.joins[k],
                allocations: Vec::new(),
            })
            .collect();
        for (i, b) in memory.buffers.iter().enumerate() {
            // A donated input's storage is the caller's: no kernel creates it.
            if b.is_donated_input() {
                continue;
            }
            let place = match (b.within, b.escapes) {
                (_, false) => PlannedPlace::Arena(b.offset),
                (Some((parent, at)), true) => PlannedPlace::Block(parent, at),
                (None, true) if memory.joins[b.kernel] => PlannedPlace::Block(i, 0),
                (None, true) => PlannedPlace::Pool,
            };
            let allocation = match (b.value, b.reuses) {
                // The planner reserved the size rounded up to the alignment.
                (None, _) => Allocation::Scratch {
                    offset: b.offset,
                    bytes: b.bytes.div_ceil(64) * 64,
                },
                (Some(_), None) => Allocation::Value {
                    bytes: b.bytes,
                    place,
                },
                (Some(v), Some(_)) => Allocation::InPlace {
                    value: v,
                    bytes: b.bytes,
                },
            };
            places[b.kernel].allocations.push(allocation);
        }
        PreparedMemory {
            device: memory.device,
            arena_bytes: memory.arena_bytes,
            kernels: places,
            buffer_bytes: memory.buffers.iter().map(|b| b.bytes).collect(),
            unfit: OnceLock::new(),
            placed: OnceLock::new(),
        }
    }

    /// Whether kernel `k`'s allocations take their planned places on the
    /// plan's device, whose `backend` runs them (see `placed_as_planned`).
    pub(super) fn placed(
        &self,
        graph: &Graph,
        plan: &Plan,
        k: usize,
        backend: &dyn Backend,
    ) -> bool {
        debug_assert_eq!(backend.device(), self.device);
        let placed = self.placed.get_or_init(|| {
            let placed = |kernel| placed_as_planned(graph, kernel, backend);
            plan.kernels.iter().map(placed).collect()
        });
        placed[k]
    }

    /// Why a run on `on` cannot take the arena, if it cannot (see
    /// `execute::device_arena_unfit`); asked of the backend once.
    pub(super) fn unfit(&self, plan: &Plan, on: Device) -> Option<String> {
        if let Some(why) = other_device(self.device, on) {
            return Some(why);
        }
        self.unfit
            .get_or_init(|| row_kernels_unfit(plan, on))
            .clone()
    }

    /// Kernel `k`'s slots in `arena`, with the blocks of escaping cats
    /// from `block` (which makes each once per run), and its outputs
    /// planned in place with their slots.
    pub(super) fn slots(
        &self,
        k: usize,
        arena: &Arena,
        block: impl Fn(usize) -> crate::error::Result<crate::runtime::cpu::arena::Block>,
    ) -> crate::error::Result<(Slots, Vec<(NodeId, usize)>)> {
        let mut slots = arena.slots();
        let mut in_place = Vec::new();
        for allocation in &self.kernels[k].allocations {
            match *allocation {
                Allocation::Scratch { offset, bytes } => slots.scratch(offset, bytes),
                Allocation::Value { bytes, ref place } => {
                    let place = match *place {
                        PlannedPlace::Arena(offset) => Place::Arena(offset),
                        PlannedPlace::Block(b, at) => Place::Block(block(b)?, at),
                        PlannedPlace::Pool => Place::Pool,
                    };
                    slots.value(bytes, place);
                }
                Allocation::InPlace { value, bytes } => {
                    in_place.push((value, slots.in_place(bytes)))
                }
            }
        }
        Ok((slots, in_place))
    }
}

/// A memory plan's offloads and prefetches, by step (see
/// `schedule::Move`): when each starts and when the compute waits for it.
#[derive(Default)]
pub(super) struct StepMoves {
    /// Per step, the values whose copy to host memory starts after it.
    pub(super) offload_after: Vec<Vec<NodeId>>,
    /// Per step (and one for the run's end), the offloads waited for
    /// before it: their device bytes are released there.
    pub(super) offload_wait_before: Vec<Vec<NodeId>>,
    /// Per step, the inputs whose copy to the device starts before it.
    pub(super) prefetch_start_before: Vec<Vec<NodeId>>,
    /// Per step, the prefetches waited for before it (its kernels read
    /// them).
    pub(super) prefetch_wait_before: Vec<Vec<NodeId>>,
    pub(super) any_prefetch: bool,
    /// The plan's device (where prefetched inputs go).
    pub(super) device: Device,
}

impl StepMoves {
    fn none(steps: usize) -> StepMoves {
        StepMoves {
            offload_after: vec![Vec::new(); steps],
            offload_wait_before: vec![Vec::new(); steps + 1],
            prefetch_start_before: vec![Vec::new(); steps],
            prefetch_wait_before: vec![Vec::new(); steps],
            ..StepMoves::default()
        }
    }

    fn of(memory: &MemoryPlan, steps: usize) -> StepMoves {
        let mut moves = StepMoves {
            any_prefetch: !memory.prefetches.is_empty(),
            device: memory.device,
            ..StepMoves::none(steps)
        };
        for m in &memory.offloads {
            moves.offload_after[m.step].push(m.value);
            moves.offload_wait_before[m.wait_or_start(MoveKind::Offload, steps)].push(m.value);
        }
        for m in &memory.prefetches {
            moves.prefetch_start_before[m.wait_or_start(MoveKind::Prefetch, steps)].push(m.value);
            moves.prefetch_wait_before[m.step].push(m.value);
        }
        moves
    }

    pub(super) fn at(list: &[Vec<NodeId>], step: usize) -> &[NodeId] {
        list.get(step).map_or(&[], Vec::as_slice)
    }
}

/// For each step, the values read for the last time in it (or made in it
/// and never read); graph outputs are kept.
pub(super) fn frees_after_each_step(
    graph: &Graph,
    kernels: &[PreparedKernel],
    steps: &[Vec<usize>],
) -> Vec<Vec<NodeId>> {
    let mut last: Vec<Option<usize>> = vec![None; graph.len()];
    for (s, step) in steps.iter().enumerate() {
        for &k in step {
            let kernel = &kernels[k];
            for v in kernel.writes.iter().chain(&kernel.reads) {
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
