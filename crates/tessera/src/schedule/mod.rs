//! Scheduling: the order in which a fused [`Plan`]'s kernels run, and the
//! memory plan of that order.
//!
//! A [`Schedule`] is a list of *steps*; the kernels of one step are
//! independent and may run concurrently, and a step starts when the
//! previous one has finished. Strategies ([`Strategy`]):
//!
//! - `bfs`: every kernel as soon as its producers are done — level order,
//!   the most independent work in flight (the fastest);
//! - `dfs`: one kernel at a time, finishing what one consumer needs before
//!   the next (post-order from the outputs, producers in operand order);
//! - `strict`: one kernel at a time in program order, as eager would;
//! - `auto` (compile's default, memory-aware as Inductor's
//!   `reorder_for_peak_memory`): of bfs, dfs, strict and a greedy
//!   memory-aware order, the most parallel whose predicted peak is within
//!   a third of the lowest, coarsened into concurrent steps within that
//!   bound — bfs wherever it is about as low;
//! - with a memory budget: the requested order if it fits, else the most
//!   parallel candidate that fits (sequential orders are coarsened into
//!   concurrent steps while the budget allows), else the lowest peak with a
//!   warning.
//!
//! Context hints ([`crate::hints`]) on a kernel's nodes override the
//! strategy for their region: `order` (a strict or dfs region runs one
//! kernel at a time in its order, inside whatever the rest does),
//! `group_id` (the group runs as one contiguous block, in program order
//! unless it has an `order`), `memory_budget_mb`, `stream` (the region's
//! kernels on a stream of their own, events between streams:
//! [`streams`]). A hint that cannot be
//! honoured is logged under `TESSERA_LOGS=schedule` with the reason and kept
//! in [`Schedule::notes`]; none is dropped silently.

mod buffers;
pub mod cost;
mod hinted;
mod kernels;
mod list;
pub mod memory;
mod search;
pub mod streams;

/// How kernels are ordered; defined in `hints` (a layer below), whose
/// `order` key takes the same values.
pub use crate::hints::Strategy;
pub use memory::{Donation, MemoryPlan, Move, MoveKind, Moves, PlannedBuffer};
pub use streams::StreamPlan;

use crate::error::Result;
use crate::fusion::Plan;
use crate::ir::Graph;
use crate::logging::log;
use crate::runtime::device::Device;

/// What the scheduler is asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ScheduleOptions {
    pub strategy: Strategy,
    /// The most bytes the arena may hold at once.
    pub memory_budget: Option<usize>,
    /// The device whose kernels will run the plan: the memory plan reserves
    /// their scratch (see [`MemoryPlan::device`]).
    pub device: Device,
}

/// An order of kernels, in steps of independent kernels.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    /// Indices into `plan.kernels`; each step sorted by index.
    pub steps: Vec<Vec<usize>>,
    /// The order chosen (`bfs`, `auto: dfs`, `budget: greedy, coarsened` …).
    pub chosen: String,
    /// What became of the hints: those not honoured and why, and the
    /// orders chosen for `auto` and budgeted regions.
    pub notes: Vec<String>,
    /// Warnings also printed to stderr (a budget that nothing fits).
    pub warnings: Vec<String>,
    /// The streams of the kernels whose regions ask for one (`stream`
    /// hints), with the events between them; `None`: one stream.
    pub streams: Option<StreamPlan>,
}

impl Schedule {
    /// The kernels in execution order.
    pub fn order(&self) -> Vec<usize> {
        self.steps.iter().flatten().copied().collect()
    }

    /// For each kernel, the step that runs it.
    pub fn step_of_kernel(&self, num_kernels: usize) -> Vec<usize> {
        let mut step_of = vec![usize::MAX; num_kernels];
        for (s, step) in self.steps.iter().enumerate() {
            for &k in step {
                step_of[k] = s;
            }
        }
        step_of
    }
}

/// A schedule and the memory plan of its order.
#[derive(Clone, Debug)]
pub struct Scheduled {
    pub schedule: Schedule,
    pub memory: MemoryPlan,
}

/// Schedules `plan` (made by `fusion::fuse(graph)`, concrete shapes) and
/// plans its memory for `options.device`. Errors for symbolic shapes (the
/// planner needs sizes) and for a device with no backend registered.
pub fn build(graph: &Graph, plan: &Plan, options: &ScheduleOptions) -> Result<Scheduled> {
    build_donating(graph, plan, options, &Donations::default())
}

/// The graph inputs a caller hands over (their only handles) and, of
/// those, the ones whose next value is a graph output (JAX's
/// `input_output_aliases`: a training step's new parameters and moments).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Donations {
    /// The positions of the donated inputs.
    pub inputs: Vec<usize>,
    /// `(input, output)`: graph output `output` is donated input `input`'s
    /// next value. The memory plan writes that output over that input
    /// where the kernel making it may, and no other value there; without
    /// the pairing, outputs of one size may land in each other's inputs
    /// (the moments of a fused update swapped), and a caller that records
    /// the buffers (a device-graph replay) would have to copy.
    pub becomes: Vec<(usize, usize)>,
}

impl Donations {
    /// The inputs at `positions`, no output paired.
    pub fn inputs(positions: &[usize]) -> Donations {
        Donations {
            inputs: positions.to_vec(),
            becomes: Vec::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }

    pub fn contains(&self, input: usize) -> bool {
        self.inputs.contains(&input)
    }
}

/// [`build`] for a caller that hands over the graph inputs `donated`
/// names: a fused kernel reading one for the last time may write an output
/// over it, a graph output too (see [`memory`]'s "Donated inputs").
pub fn build_donating(
    graph: &Graph,
    plan: &Plan,
    options: &ScheduleOptions,
    donated: &Donations,
) -> Result<Scheduled> {
    build_moving(graph, plan, options, donated, &Moves::default())
}

/// [`build_donating`], the outputs and inputs `moves` names offloaded to
/// and prefetched from host memory (see [`memory`]'s "Offload and
/// prefetch").
pub fn build_moving(
    graph: &Graph,
    plan: &Plan,
    options: &ScheduleOptions,
    donated: &Donations,
    moves: &Moves,
) -> Result<Scheduled> {
    let ctx = search::Context::new(graph, plan, options.device, donated)?;
    let mut schedule = ctx.choose(options);
    let memory = MemoryPlan::from_model(graph, plan, &ctx.model, &schedule, moves)?;
    schedule.streams = StreamPlan::new(&ctx.model, &ctx.hints, &schedule, &memory);
    log("schedule", || describe(graph, plan, &schedule, &memory));
    log("memory", || memory.describe(graph));
    Ok(Scheduled { schedule, memory })
}

/// The schedule log: what was chosen, the hints not honoured, the steps.
pub fn describe(graph: &Graph, plan: &Plan, schedule: &Schedule, memory: &MemoryPlan) -> String {
    let mut text = format!(
        "graph `{}`: {} kernels in {} steps, order {}, predicted peak {} bytes\n",
        graph.name,
        plan.kernels.len(),
        schedule.steps.len(),
        schedule.chosen,
        memory.peak_bytes
    );
    for line in schedule.notes.iter().chain(&schedule.warnings) {
        text.push_str(&format!("  note: {line}\n"));
    }
    for (s, step) in schedule.steps.iter().enumerate() {
        let names: Vec<String> = step
            .iter()
            .map(|&k| format!("k{k} {}", kernel_label(graph, plan, k)))
            .collect();
        text.push_str(&format!("  step {s}: {}\n", names.join(", ")));
    }
    if let Some(streams) = &schedule.streams {
        text.push_str(&streams.describe());
    }
    text
}

/// A kernel's first member and op, for logs.
fn kernel_label(graph: &Graph, plan: &Plan, k: usize) -> String {
    let members = plan.kernels[k].members();
    let first = members[0];
    let more = if members.len() > 1 {
        format!(" +{}", members.len() - 1)
    } else {
        String::new()
    };
    format!(
        "{}:{}{more}",
        graph.display_name(first),
        graph.node(first).op.name()
    )
}
