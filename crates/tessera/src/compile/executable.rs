//! What a compile produces: the graph(s) to run and how to hook them into
//! autograd.

mod frozen;

use std::sync::{Arc, Mutex};

use super::{Backend, CompileOptions};
use crate::autograd::{self, aot_autograd, aot_autograd_choosing, SavedAs, SavedCandidate};
use crate::error::Result;
use crate::fusion::{self, Plan};
use crate::ir::{Graph, NodeId};
use crate::logging::log;
use crate::passes::{PassContext, PassManager};
use crate::runtime::device::Device;
use crate::runtime::execute::{run_prepared, Prepared};
use crate::runtime::replay::{ReplayStats, Replayer};
use crate::schedule::cost::{self, Choice, DeviceCosts};
use crate::schedule::{self, Donations, Moves, ScheduleOptions, Scheduled};
use crate::tensor::interpret::{bind_symbols, concretise, run_graph_moving, HostMoves};
use crate::tensor::trace::Traced;
use crate::tensor::Tensor;

/// A graph and, for the default backend, its fused kernels, their schedule
/// and memory plan.
#[derive(Clone)]
struct Program {
    graph: Arc<Graph>,
    lowered: Option<Arc<Lowered>>,
    /// For a graph with symbolic shapes (automatic dynamic shapes), whose
    /// own plan cannot fuse: the plan of each binding of its sizes seen.
    sized: Option<Arc<SizedPlans>>,
    /// Autotune fused kernels' block sizes (`mode=max-autotune`).
    tune: bool,
    /// Device graphs of its runs (`mode=reduce-overhead`).
    replay: Option<Arc<Replayer>>,
    /// What a run node by node moves to and from host memory (a lowered
    /// plan's memory plan makes the moves itself).
    moves: MoveSpec,
}

/// A graph's fused kernels, their schedule and memory plan.
struct Lowered {
    graph: Arc<Graph>,
    plan: Plan,
    /// `None` where the graph cannot be planned (symbolic shapes): then the
    /// kernels run in plan order.
    scheduled: Option<Scheduled>,
    /// What every run of the plan needs of it, derived once.
    prepared: Prepared,
}

/// Which of a graph's outputs are offloaded to host memory and which of
/// its inputs arrive there (by position: the passes renumber nodes). A
/// lowered program's memory plan makes them; a program run node by node
/// (`aot_eager`, a symbolic graph past its sizes) makes them in the
/// interpreter.
pub(super) type MoveSpec = HostMoves;

/// `spec` as the memory planner takes it: by node of `graph`.
fn moves_of(spec: &MoveSpec, graph: &Graph) -> Moves {
    Moves {
        offload: spec
            .offload_outputs
            .iter()
            .map(|&i| graph.outputs[i].node)
            .collect(),
        prefetch: spec
            .prefetch_inputs
            .iter()
            .map(|&i| graph.inputs[i])
            .collect(),
    }
}

impl Lowered {
    /// `donated`: the graph inputs the caller hands over.
    fn new(
        graph: Graph,
        options: &ScheduleOptions,
        donated: &Donations,
        moves: &MoveSpec,
    ) -> Lowered {
        let mut plan = fusion::fuse(&graph);
        let paired: Vec<NodeId> = donated
            .becomes
            .iter()
            .filter_map(|&(_, o)| Some(graph.outputs.get(o)?.node))
            .collect();
        fusion::keep_products_off(&graph, &mut plan, &paired);
        let moves = moves_of(moves, &graph);
        let scheduled = match schedule::build_moving(&graph, &plan, options, donated, &moves) {
            Ok(s) => Some(s),
            Err(e) => {
                log("schedule", || {
                    format!(
                        "graph `{}` not scheduled ({e}); its kernels run in plan order",
                        graph.name
                    )
                });
                None
            }
        };
        let prepared = match &scheduled {
            Some(s) => Prepared::scheduled(&graph, &plan, &s.schedule, &s.memory),
            None => Prepared::in_plan_order(&graph, &plan),
        };
        Lowered {
            graph: Arc::new(graph),
            plan,
            scheduled,
            prepared,
        }
    }

    fn run(&self, args: Vec<Tensor>, tune: bool) -> Result<Vec<Tensor>> {
        run_prepared(&self.graph, &self.plan, &self.prepared, args, tune)
    }

    /// The positions of the donated graph inputs whose storage the memory
    /// plan hands on to a graph output (written over it, directly or
    /// through values written over in between): those survive the run in
    /// an output, so a device-graph recording may run on the caller's own
    /// buffers there (see `runtime::replay`).
    fn inputs_living_on_in_outputs(&self) -> Vec<usize> {
        let Some(scheduled) = &self.scheduled else {
            return Vec::new();
        };
        let buffers = &scheduled.memory.buffers;
        let root = |mut b: usize| {
            while let Some(r) = buffers[b].reuses {
                b = r;
            }
            b
        };
        let kept: Vec<usize> = (0..buffers.len())
            .filter(|&b| buffers[b].escapes && buffers[b].reuses.is_some())
            .map(root)
            .collect();
        (0..self.graph.inputs.len())
            .filter(|&i| {
                let input = self.graph.inputs[i];
                kept.iter()
                    .any(|&r| buffers[r].is_donated_input() && buffers[r].value == Some(input))
            })
            .collect()
    }

    /// The kernel list, schedule and memory plan as (file suffix, text).
    fn artifacts(&self, prefix: &str) -> Vec<(String, String)> {
        let (graph, plan) = (&self.graph, &self.plan);
        let mut out = vec![(
            format!("{prefix}.kernels.txt"),
            fusion::describe(graph, plan),
        )];
        if let Some(s) = &self.scheduled {
            out.push((
                format!("{prefix}.schedule.txt"),
                schedule::describe(graph, plan, &s.schedule, &s.memory),
            ));
            out.push((format!("{prefix}.memory.txt"), s.memory.describe(graph)));
        }
        out
    }
}

/// The sizes of a symbolic graph's symbols at one call, by symbol name.
type Binding = Vec<(Arc<str>, usize)>;

/// Fusion needs concrete shapes, so a symbolic graph is fused once per
/// binding of its sizes, at the first call with that binding, and the plan
/// kept: one executable still serves every size (no retrace, no
/// recompile), and each size runs fused.
struct SizedPlans {
    options: ScheduleOptions,
    /// The graph inputs the caller hands over (see [`Lowered::new`]).
    donated: Donations,
    moves: MoveSpec,
    plans: Mutex<Vec<(Binding, Arc<Lowered>)>>,
}

/// Bindings kept per symbolic graph; further sizes run its unfused plan.
const MAX_BINDINGS: usize = 32;

impl SizedPlans {
    /// The plan for `args`' sizes: cached, or built now; `None` once
    /// [`MAX_BINDINGS`] are kept.
    fn at(&self, graph: &Graph, args: &[Tensor]) -> Result<Option<Arc<Lowered>>> {
        let given: Vec<Option<&Tensor>> = args.iter().map(Some).collect();
        let mut binding: Binding = bind_symbols(graph, &given)?.into_iter().collect();
        binding.sort();
        let mut plans = self.plans.lock().expect("sized plans");
        if let Some((_, lowered)) = plans.iter().find(|(b, _)| *b == binding) {
            return Ok(Some(lowered.clone()));
        }
        let sizes = describe_binding(&binding);
        if plans.len() >= MAX_BINDINGS {
            log("fusion", || {
                format!(
                    "graph `{}` at {sizes}: {MAX_BINDINGS} sizes already fused; this one runs unfused",
                    graph.name
                )
            });
            return Ok(None);
        }
        let symbols = binding.iter().cloned().collect();
        let lowered = Arc::new(Lowered::new(
            concretise(graph, &symbols)?,
            &self.options,
            &self.donated,
            &self.moves,
        ));
        log("fusion", || {
            format!(
                "graph `{}` fused at {sizes} ({} kernels), kept for later calls of these sizes",
                graph.name,
                lowered.plan.kernels.len()
            )
        });
        plans.push((binding, lowered.clone()));
        Ok(Some(lowered))
    }
}

/// `s0=32,s1=8`.
fn describe_binding(binding: &Binding) -> String {
    let parts: Vec<String> = binding.iter().map(|(s, n)| format!("{s}={n}")).collect();
    parts.join(",")
}

impl Program {
    /// For the default backend (`optimized`): the pass pipeline, fusion,
    /// then the schedule.
    /// `on`: the device its kernels run on (the memory plan's scratch is
    /// theirs); `donated`: the positions of the inputs the caller hands
    /// over (the memory plan may write outputs over them).
    fn new(
        mut graph: Graph,
        optimized: bool,
        options: &CompileOptions,
        on: Device,
        donated: &Donations,
        moves: &MoveSpec,
    ) -> Result<Program> {
        if !optimized {
            return Ok(Program {
                graph: Arc::new(graph),
                lowered: None,
                sized: None,
                tune: false,
                replay: None,
                moves: moves.clone(),
            });
        }
        pipeline(options).run(&mut graph, &PassContext::default())?;
        let schedule_options = ScheduleOptions {
            strategy: options.schedule,
            memory_budget: options.memory_budget,
            device: on,
        };
        let sized = is_symbolic(&graph).then(|| {
            Arc::new(SizedPlans {
                options: schedule_options,
                donated: donated.clone(),
                moves: moves.clone(),
                plans: Mutex::new(Vec::new()),
            })
        });
        let lowered = Lowered::new(graph.clone(), &schedule_options, donated, moves);
        Ok(Program {
            graph: Arc::new(graph),
            lowered: Some(Arc::new(lowered)),
            sized,
            tune: options.mode == super::Mode::MaxAutotune,
            replay: (options.mode == super::Mode::ReduceOverhead)
                .then(|| Arc::new(Replayer::new())),
            moves: moves.clone(),
        })
    }

    /// Runs the program: replayed from a device graph under
    /// `mode=reduce-overhead` (see `runtime::replay`: the donated inputs
    /// that live on in outputs are recorded in place, the rest copied into
    /// buffers of the recording), else kernel by kernel, `args` moved into
    /// the run (see [`run_prepared`]).
    fn run(&self, args: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let Some(replayer) = &self.replay else {
            return self.run_kernels(args);
        };
        // A symbolic graph's plans are per size: none is recorded in place.
        let in_place = match (&self.sized, &self.lowered) {
            (None, Some(lowered)) => lowered.inputs_living_on_in_outputs(),
            _ => Vec::new(),
        };
        replayer.run(args, &in_place, |a| self.run_kernels(a))
    }

    /// Whether a memory budget (the compile option's or a region's) could
    /// not be met by the order chosen.
    fn over_budget(&self) -> bool {
        self.lowered
            .as_ref()
            .and_then(|l| l.scheduled.as_ref())
            .is_some_and(|s| s.schedule.warnings.iter().any(|w| w.contains("budget")))
    }

    /// Whether its plan fits `budget`: the memory plan's predicted peak,
    /// offloads counted, against the compile option's budget; a region's
    /// hinted budget (`budget` `None`) by the schedule's word.
    fn fits(&self, budget: Option<usize>) -> bool {
        match (self.predicted_peak(), budget) {
            (Some(peak), Some(budget)) => peak <= budget,
            _ => !self.over_budget(),
        }
    }

    /// Its memory plan's predicted peak in bytes (`None` without a plan).
    fn predicted_peak(&self) -> Option<usize> {
        let lowered = self.lowered.as_ref()?;
        Some(lowered.scheduled.as_ref()?.memory.peak_bytes)
    }

    /// The positions of the outputs its memory plan offloads (`None`
    /// without a plan: a symbolic graph's plans are made per size).
    fn offloaded_outputs(&self) -> Option<Vec<usize>> {
        let lowered = self.lowered.as_ref()?;
        let memory = &lowered.scheduled.as_ref()?.memory;
        let graph = &lowered.graph;
        Some(
            (0..graph.outputs.len())
                .filter(|&i| {
                    memory
                        .offloads
                        .iter()
                        .any(|m| m.value == graph.outputs[i].node)
                })
                .collect(),
        )
    }

    fn replay_stats(&self) -> ReplayStats {
        self.replay
            .as_ref()
            .map_or_else(ReplayStats::default, |r| r.stats())
    }

    fn run_kernels(&self, args: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let at_size = match &self.sized {
            Some(sized) => sized.at(&self.graph, &args)?,
            None => None,
        };
        match at_size.as_ref().or(self.lowered.as_ref()) {
            Some(lowered) => lowered.run(args, self.tune),
            None => {
                let outs = run_graph_moving(&self.graph, &args, &self.moves)?;
                Ok(outs.into_iter().map(|(_, t)| t).collect())
            }
        }
    }

    /// The graph, its kernel list, schedule and memory plan as (file
    /// suffix, text); for a symbolic graph also the kernels of each size
    /// fused so far (`{prefix}.s0=32.kernels.txt`).
    fn artifacts(&self, prefix: &str) -> Vec<(String, String)> {
        let mut out = vec![(format!("{prefix}.tir"), self.graph.to_string())];
        if let Some(lowered) = &self.lowered {
            out.extend(lowered.artifacts(prefix));
        }
        if let Some(sized) = &self.sized {
            for (binding, lowered) in sized.plans.lock().expect("sized plans").iter() {
                let at = format!("{prefix}.{}", describe_binding(binding));
                out.extend(lowered.artifacts(&at));
            }
        }
        out
    }
}

/// The default backend's passes under `options`.
fn pipeline(options: &CompileOptions) -> PassManager {
    let passes = PassManager::default_pipeline();
    match options.fuse_attention {
        true => passes,
        false => passes.without("attention").without("batch_attention"),
    }
}

/// The backward half of an AOT-compiled function.
struct BackwardGraph {
    program: Program,
    /// Which forward-graph inputs get gradients.
    wrt: Vec<usize>,
    /// Per input of `wrt`: whether the outputs depend on it (the others
    /// get no gradient, as in eager mode).
    reached: Vec<bool>,
    /// Which outputs feed a tangent to the backward (the float ones).
    tangent_outputs: Vec<usize>,
}

/// A compiled function: a forward graph over (user inputs, lifted tensors,
/// values read at graph breaks) and, when something requires grad, the
/// backward graph.
pub struct Executable {
    name: String,
    forward: Program,
    backward: Option<BackwardGraph>,
    /// Run the captured ops with the eager tape (backend `eager`).
    eager_autograd: bool,
    num_outputs: usize,
    num_lifted: usize,
    /// The last outputs that are module state ([`Traced::state`]).
    num_state: usize,
    /// A forward-only executable's values computed from its lifted tensors
    /// alone, computed once (see `frozen`); the forward takes them as
    /// its last inputs.
    frozen: Option<frozen::Frozen>,
}

impl Executable {
    /// Builds the executable for `traced`, with the AOT backward for the
    /// graph inputs at `wrt` (none: forward only; backend `eager` keeps the
    /// tape instead). For the default backend the passes run once on the
    /// captured graph, then each graph that runs is fused and scheduled once,
    /// its memory planned for device `on` (its inputs' device).
    /// `donated`: the inputs the caller hands over (see
    /// [`super::Compiled::try_call_donating`]); a forward-only executable's
    /// memory plan may write outputs over them (one with a backward saves
    /// its inputs for it, so it plans no donation).
    pub fn build(
        traced: &Traced,
        wrt: Vec<usize>,
        options: &CompileOptions,
        on: Device,
        donated: &Donations,
    ) -> Result<Executable> {
        let mut graph = cut_at_breaks(traced)?;
        // Decided on the captured graph, before passes simplify it.
        let reached = autograd::aot::reached_inputs(&graph, &wrt);
        let fused = options.backend == Backend::Default;
        let eager_autograd = options.backend == Backend::Eager;
        if fused {
            let ctx = PassContext {
                grad_inputs: Some(wrt.clone()),
                ..PassContext::default()
            };
            pipeline(options).run(&mut graph, &ctx)?;
        }
        let num_outputs = graph.outputs.len();
        let name = graph.name.clone();
        if !donated.is_empty() && !wrt.is_empty() {
            log("memory", || {
                format!(
                    "graph `{name}`: inputs {:?} donated, but the executable has a \
                     backward (inputs {wrt:?} require grad): nothing is written over them",
                    donated.inputs
                )
            });
        }
        super::hint_report::report(&graph, options.backend, !wrt.is_empty(), on);
        let mut frozen = None;
        let (forward, backward) = if wrt.is_empty() || eager_autograd {
            let none = MoveSpec::default();
            let lifted = lifted_positions(traced, &graph);
            let split = match fused && wrt.is_empty() {
                true => frozen::split(&graph, &lifted)?,
                false => None,
            };
            if let Some(split) = split {
                let prologue = Program::new(
                    split.prologue,
                    true,
                    options,
                    on,
                    &Donations::default(),
                    &none,
                )?;
                frozen = Some(frozen::Frozen::new(prologue, split.reads));
                graph = split.main;
            }
            (
                Program::new(graph, fused, options, on, donated, &none)?,
                None,
            )
        } else {
            let mut aot = match is_symbolic(&graph) {
                // Tracing the joint graph needs concrete shapes.
                true => super::dynamic::aot_symbolic(&graph, &wrt, options.partition)?,
                false => aot_autograd(&graph, &wrt, options.partition)?,
            };
            let tangent_outputs = (0..num_outputs)
                .filter(|&i| graph.node(graph.outputs[i].node).ty.dtype.is_float())
                .collect();
            // The forward offloads saved values (outputs after the
            // original ones); the backward prefetches them (its first inputs).
            let num_fwd = aot.num_outputs;
            let offload = |saved: &[usize]| MoveSpec {
                offload_outputs: saved.iter().map(|&i| num_fwd + i).collect(),
                prefetch_inputs: Vec::new(),
            };
            let mut offloaded = aot.offloaded.clone();
            let mut forward = Program::new(
                aot.forward.clone(),
                fused,
                options,
                on,
                &Donations::default(),
                &offload(&offloaded),
            )?;
            // A budget that ordering does not meet: saved activations
            // leave the device, cheapest per byte first, until the
            // forward's predicted peak fits — each recomputed in the
            // backward or waiting in host memory, whichever the cost model
            // says is faster (symbolic graphs, whose sizes are not known,
            // offload them all).
            if fused && forward.over_budget() && offloaded.len() < aot.offloadable.len() {
                let budget = options.memory_budget;
                let mut excess = excess_bytes(forward.predicted_peak(), budget);
                let mut placed_before = None;
                for _ in 0..BUDGET_ROUNDS {
                    match is_symbolic(&graph) {
                        true => offloaded = aot.offloadable.clone(),
                        false => {
                            let costs = DeviceCosts::of(on);
                            let choose = |joint: &Graph, candidates: &[SavedCandidate]| {
                                place_saved(joint, candidates, &costs, excess)
                            };
                            aot = aot_autograd_choosing(
                                &graph,
                                &wrt,
                                options.partition,
                                Some(&choose),
                            )?;
                            offloaded = aot.offloaded.clone();
                        }
                    }
                    forward = Program::new(
                        aot.forward.clone(),
                        fused,
                        options,
                        on,
                        &Donations::default(),
                        &offload(&offloaded),
                    )?;
                    log("memory", || {
                        format!(
                            "graph `{name}`: the memory budget is not met by ordering; {excess} \
                             bytes of saved activations asked off the device: by estimated \
                             cost ({on}: transfer vs recompute) {} recompute in the backward \
                             and {} wait in host memory; predicted peak now {:?} bytes",
                            aot.recomputed_by_cost,
                            offloaded.len(),
                            forward.predicted_peak()
                        )
                    });
                    // Done when the plan (with its moves) fits, or when
                    // asking more moved nothing more.
                    let placed = Some((aot.recomputed_by_cost, offloaded.len()));
                    if forward.fits(budget) || is_symbolic(&graph) || placed == placed_before {
                        break;
                    }
                    placed_before = placed;
                    // A value off the device lowers the peak by less
                    // than its bytes where it was not live at the peak:
                    // ask twice as much again, plus what is still over.
                    excess = excess
                        .saturating_mul(2)
                        .saturating_add(excess_bytes(forward.predicted_peak(), budget));
                }
            }
            // What the forward's plan moves (some saved values cannot
            // move: views of others), else all that were asked.
            let moved = match forward.offloaded_outputs() {
                Some(outputs) => outputs.iter().map(|&o| o - num_fwd).collect(),
                None => offloaded,
            };
            let prefetch = MoveSpec {
                offload_outputs: Vec::new(),
                prefetch_inputs: moved,
            };
            // The saved values (the backward's first inputs) are handed
            // over by the last backward (see `run_owned`): the run frees
            // each after its last read.
            let backward = BackwardGraph {
                program: Program::new(
                    aot.backward,
                    fused,
                    options,
                    on,
                    &Donations::default(),
                    &prefetch,
                )?,
                wrt,
                reached,
                tangent_outputs,
            };
            (forward, Some(backward))
        };
        Ok(Executable {
            name,
            forward,
            backward,
            eager_autograd,
            num_outputs,
            num_lifted: traced.lifted.len(),
            num_state: traced.num_state_outputs(),
            frozen,
        })
    }

    /// Every stage's artifact as (file name, text): the graphs after passes,
    /// the kernel lists, schedules and memory plans, for
    /// `TESSERA_COMPILE_DEBUG` and logs.
    pub fn artifacts(&self) -> Vec<(String, String)> {
        let mut out = self.forward.artifacts("forward");
        if let Some(bwd) = &self.backward {
            out.extend(bwd.program.artifacts("backward"));
        }
        if let Some(frozen) = &self.frozen {
            out.extend(frozen.artifacts());
        }
        out
    }

    /// How often its frozen values (computed from its lifted tensors alone:
    /// folded batch norms) were computed: once until a tensor they read is
    /// replaced.
    pub fn frozen_computes(&self) -> usize {
        self.frozen.as_ref().map_or(0, frozen::Frozen::computes)
    }

    /// What the device-graph replayers of its forward and backward did
    /// (`mode=reduce-overhead`), summed.
    pub fn replay_stats(&self) -> ReplayStats {
        let mut s = self.forward.replay_stats();
        if let Some(bwd) = &self.backward {
            s += bwd.program.replay_stats();
        }
        s
    }

    pub(super) fn has_lifted(&self) -> bool {
        self.num_lifted > 0
    }

    /// Whether its last outputs are module state to install (then every
    /// call is traced, to know the slots).
    pub(super) fn writes_state(&self) -> bool {
        self.num_state > 0
    }

    /// Runs on the user's `inputs` followed by `extra` (lifted tensors and
    /// graph-break values, in the trace's order).
    pub fn run(&self, inputs: &[Tensor], extra: &[Tensor]) -> Result<Vec<Tensor>> {
        self.run_owned(inputs.iter().chain(extra).cloned().collect())
    }

    /// [`Executable::run`] on the arguments (inputs, then extras) by value:
    /// a forward-only executable moves them into the run, so an input
    /// whose handle here was its only one can be written over where the
    /// memory plan donates it.
    pub fn run_owned(&self, args: Vec<Tensor>) -> Result<Vec<Tensor>> {
        if self.eager_autograd {
            // The interpreter's ops record on the tape like eager code.
            return self.forward.run(args);
        }
        if self.backward.is_none() {
            // Each detached handle is left the only one once `t` drops.
            let mut detached: Vec<Tensor> = args.into_iter().map(|t| t.detach()).collect();
            if let Some(frozen) = &self.frozen {
                let values = autograd::no_grad(|| frozen.values(&detached))?;
                detached.extend(values);
            }
            let mut outs = autograd::no_grad(|| self.forward.run(detached))?;
            outs.truncate(self.num_outputs);
            return Ok(outs);
        }
        let detached: Vec<Tensor> = args.iter().map(Tensor::detach).collect();
        let mut outs = autograd::no_grad(|| self.forward.run(detached))?;
        let saved = outs.split_off(self.num_outputs);
        let Some(bwd) = &self.backward else {
            return Ok(outs);
        };
        let wrt: Vec<&Tensor> = bwd.wrt.iter().map(|&i| &args[i]).collect();
        let program = bwd.program.clone();
        let tangent_outputs = bwd.tangent_outputs.clone();
        let reached = bwd.reached.clone();
        // The last backward through this call hands the saved values to
        // the backward program, which frees each after its last read;
        // one that retains the graph keeps them for the next.
        let saved = Mutex::new(Some(saved));
        let backward = move |grads: &[Tensor]| -> Result<Vec<Option<Tensor>>> {
            let mut slot = saved.lock().expect("saved lock");
            let mut feed = match autograd::backward_consumes() {
                true => slot.take(),
                false => slot.clone(),
            }
            .ok_or_else(|| {
                crate::error::Error::op(
                    crate::error::ErrorKind::Argument,
                    "backward",
                    "the saved values of this compiled call were freed by an earlier backward",
                )
            })?;
            drop(slot);
            feed.extend(tangent_outputs.iter().map(|&i| grads[i].clone()));
            let grads = program.run(feed)?.into_iter().zip(&reached);
            Ok(grads.map(|(g, &reached)| reached.then_some(g)).collect())
        };
        Ok(autograd::custom_function(
            &self.name,
            &wrt,
            outs,
            Arc::new(backward),
        ))
    }
}

/// How many times the forward is re-partitioned for a budget before its
/// plan is run over budget (each round asks about three times the bytes
/// off the device: 3⁵ covers what any plan's peak can miss by).
const BUDGET_ROUNDS: usize = 6;

/// The bytes a predicted peak is over `budget` (all of them, `usize::MAX`,
/// when either is unknown: a region's hinted budget, a plan-less graph).
fn excess_bytes(peak: Option<usize>, budget: Option<usize>) -> usize {
    match (peak, budget) {
        (Some(peak), Some(budget)) => peak.saturating_sub(budget).max(1),
        _ => usize::MAX,
    }
}

/// Where each saved activation waits under a budget that needs `excess`
/// bytes off the device: the candidates are taken cheapest per byte first
/// (seconds of recomputation, or of two copies for one that can only
/// move), each recomputed in the backward or moved to host memory as
/// [`cost::choose`] estimates faster on a device with `costs`, until
/// `excess` bytes are off; the rest stay on the device.
fn place_saved(
    joint: &Graph,
    candidates: &[SavedCandidate],
    costs: &DeviceCosts,
    excess: usize,
) -> Vec<SavedAs> {
    let ways: Vec<(SavedAs, f64)> = candidates
        .iter()
        .map(|c| cheaper_way(joint, c, costs))
        .collect();
    let per_byte = |i: usize| ways[i].1 / candidates[i].bytes.max(1) as f64;
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&a, &b| per_byte(a).total_cmp(&per_byte(b)));
    let mut placed = vec![SavedAs::Device; candidates.len()];
    let mut off = 0usize;
    for i in order {
        if off >= excess {
            break;
        }
        placed[i] = ways[i].0;
        off = off.saturating_add(candidates[i].bytes);
    }
    placed
}

/// Recompute or offload, whichever is estimated faster for `c`, and its
/// estimated seconds (see [`cost::choose`]).
fn cheaper_way(joint: &Graph, c: &SavedCandidate, costs: &DeviceCosts) -> (SavedAs, f64) {
    let copies = 2.0 * costs.transfer_seconds(c.bytes);
    if c.recompute.is_empty() {
        return (SavedAs::Host, copies);
    }
    let seconds: f64 = c
        .recompute
        .iter()
        .map(|&n| cost::node_seconds(joint, n, costs))
        .sum();
    match cost::choose(c.bytes, seconds, costs) {
        Choice::Recompute => (SavedAs::Recompute, seconds),
        Choice::Offload => (SavedAs::Host, copies),
    }
}

fn is_symbolic(graph: &Graph) -> bool {
    graph
        .nodes
        .iter()
        .any(|n| n.ty.shape.as_concrete().is_none())
}

/// The positions of `graph`'s inputs that are the trace's lifted tensors
/// (after the user inputs, before the values read at graph breaks).
fn lifted_positions(traced: &Traced, graph: &Graph) -> Vec<usize> {
    let end = traced.graph.inputs.len().min(graph.inputs.len());
    (end.saturating_sub(traced.lifted.len())..end).collect()
}

/// The traced graph with the nodes read at graph breaks turned into inputs
/// (after the user inputs and lifted tensors), so they are not recomputed.
fn cut_at_breaks(traced: &Traced) -> Result<Graph> {
    if traced.materialized.is_empty() {
        return Ok(traced.graph.clone());
    }
    let g = &traced.graph;
    let mut inputs: Vec<(String, NodeId)> = g
        .inputs
        .iter()
        .map(|&id| (g.display_name(id), id))
        .collect();
    inputs.extend(
        traced
            .materialized
            .iter()
            .enumerate()
            .map(|(i, (id, _))| (format!("break{i}"), *id)),
    );
    let outputs: Vec<(String, NodeId)> =
        g.outputs.iter().map(|o| (o.name.clone(), o.node)).collect();
    crate::ir::extract::extract(g, &g.name, &inputs, &outputs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::autograd::Partition;
    use crate::ir::text::parse;

    /// Two layers of `tanh(h @ w)`: the backward needs each tanh's output,
    /// whose recomputation is one matmul and one tanh.
    /// The compiled backward reads the saved values from its call: a
    /// backward that retains the graph leaves them for the next (the
    /// gradients add up to twice eager's), the last one hands them over
    /// (freed as the backward program reads them), and a backward after
    /// that is the engine's error, never a run without them.
    #[test]
    fn the_last_backward_consumes_the_saved_values() {
        use crate::ir::DType;
        let f = crate::compile::compile(|x: &[Tensor]| vec![x[0].exp().sin().sum(&[], false)]);
        let x = Tensor::from_vec(vec![0.5f64, 1.0, 1.5], &[3]).set_requires_grad(true);
        x.exp().sin().sum(&[], false).backward();
        let eager = x.grad().unwrap().to_f64_vec();
        x.zero_grad();
        let y = f.call(std::slice::from_ref(&x)).remove(0);
        y.backward_retain_graph();
        y.backward_retain_graph();
        y.backward();
        let got = x.grad().unwrap().to_f64_vec();
        for (g, e) in got.iter().zip(&eager) {
            assert!((g - 3.0 * e).abs() < 1e-12, "{g} vs 3 × {e}");
        }
        let err = y.try_backward(None).unwrap_err().to_string();
        assert!(err.contains("a second time"), "{err}");
        assert_eq!(y.dtype(), DType::F64);
    }

    fn layers() -> Graph {
        parse(
            "graph g(%x, %w1, %w2) {
              %x = input : f32[256,256]
              %w1 = input : f32[256,256]
              %w2 = input : f32[256,256]
              %m1 = matmul(%x, %w1) : f32[256,256]
              %h1 = tanh(%m1) : f32[256,256]
              %m2 = matmul(%h1, %w2) : f32[256,256]
              %h2 = tanh(%m2) : f32[256,256]
              return %h2 as y
            }",
        )
        .unwrap()
    }

    fn chosen(costs: DeviceCosts) -> (usize, usize, usize) {
        let choose =
            |joint: &Graph, c: &[SavedCandidate]| place_saved(joint, c, &costs, usize::MAX);
        let aot = aot_autograd_choosing(&layers(), &[0, 1, 2], Partition::SaveAll, Some(&choose))
            .unwrap();
        (
            aot.recomputed_by_cost,
            aot.offloaded.len(),
            aot.offloadable.len(),
        )
    }

    #[test]
    fn the_budget_choice_flips_with_the_link_and_the_flops() {
        let gpu = DeviceCosts::of(Device::Cuda);
        // On an H100's estimates a 256³ matmul (34 MFLOP, ~0.75 µs) and a
        // tanh are far cheaper than two copies of 256 KiB (~21 µs):
        // every activation is recomputed, only %h2 (the forward's output,
        // which the backward reads and nothing recomputes) offloaded.
        let (recomputed, offloaded, offloadable) = chosen(gpu);
        assert!(recomputed >= 1, "{recomputed}");
        assert_eq!((offloaded, offloadable), (1, 1));
        // A link a thousand times faster makes the copies cheaper.
        let fast = DeviceCosts {
            host_bandwidth: 25e12,
            ..gpu
        };
        let (recomputed, offloaded, offloadable) = chosen(fast);
        assert_eq!(recomputed, 0);
        assert_eq!(offloaded, offloadable);
        assert!(offloaded >= 2, "%h1 and %h2 wait in host memory");
        // So does slow compute (the CPU's estimates: 0.17 ms of matmul
        // against 52 µs of copies).
        let (recomputed, offloaded, _) = chosen(DeviceCosts::of(Device::Cpu));
        assert_eq!(recomputed, 0);
        assert!(offloaded >= 1);
    }

    #[test]
    fn a_small_excess_takes_only_the_cheapest_saved_values_off_the_device() {
        let gpu = DeviceCosts::of(Device::Cuda);
        let joint = aot_autograd(&layers(), &[0, 1, 2], Partition::SaveAll)
            .unwrap()
            .joint;
        let mib = 1 << 20;
        // Node ids of the joint graph are only weighed, never run here: a
        // tanh (cheap to recompute), a matmul chain (dearer per byte), and
        // a value that can only move.
        let tanh = joint
            .nodes
            .iter()
            .position(|n| n.op.name() == "tanh")
            .map(|i| NodeId(i as u32))
            .unwrap();
        let matmul = joint
            .nodes
            .iter()
            .position(|n| n.op.name() == "matmul")
            .map(|i| NodeId(i as u32))
            .unwrap();
        let candidates = [
            SavedCandidate {
                node: tanh,
                bytes: mib,
                recompute: vec![matmul, tanh],
            },
            SavedCandidate {
                node: tanh,
                bytes: mib,
                recompute: vec![tanh],
            },
            SavedCandidate {
                node: tanh,
                bytes: mib,
                recompute: vec![],
            },
        ];
        let placed = |excess| place_saved(&joint, &candidates, &gpu, excess);
        assert_eq!(
            placed(1),
            [SavedAs::Device, SavedAs::Recompute, SavedAs::Device],
            "one value is enough: the cheapest per byte"
        );
        assert_eq!(placed(mib + 1)[0], SavedAs::Recompute, "then the next");
        assert_eq!(placed(mib + 1)[2], SavedAs::Device);
        assert_eq!(
            placed(usize::MAX),
            [SavedAs::Recompute, SavedAs::Recompute, SavedAs::Host],
            "all of them, the one without a recomputation to host memory"
        );
        assert_eq!(excess_bytes(Some(10), Some(4)), 6);
        assert_eq!(excess_bytes(Some(3), Some(4)), 1, "over by the plan's word");
        assert_eq!(excess_bytes(None, Some(4)), usize::MAX);
    }

    #[test]
    fn recomputing_by_cost_keeps_the_gradients() {
        let gpu = DeviceCosts::of(Device::Cuda);
        let choose = |joint: &Graph, c: &[SavedCandidate]| place_saved(joint, c, &gpu, usize::MAX);
        let g = layers();
        let plain = aot_autograd(&g, &[0, 1, 2], Partition::SaveAll).unwrap();
        let recomputing =
            aot_autograd_choosing(&g, &[0, 1, 2], Partition::SaveAll, Some(&choose)).unwrap();
        assert!(recomputing.recomputed_by_cost >= 1);
        assert!(recomputing.saved_bytes < plain.saved_bytes);
        let inputs: Vec<Tensor> = (0..3)
            .map(|i| {
                let v: Vec<f32> = (0..256 * 256)
                    .map(|j| (((j * 7 + i * 13) % 97) as f32 / 97.0 - 0.5) * 0.1)
                    .collect();
                Tensor::from_vec(v, &[256, 256])
            })
            .collect();
        let grads = |aot: &crate::autograd::AotGraphs| {
            let fwd = crate::tensor::interpret::run_graph(&aot.forward, &inputs).unwrap();
            let mut feed: Vec<Tensor> = fwd[aot.num_outputs..]
                .iter()
                .map(|(_, t)| t.clone())
                .collect();
            feed.push(Tensor::from_vec(vec![1.0f32; 256 * 256], &[256, 256]));
            let out = crate::tensor::interpret::run_graph(&aot.backward, &feed).unwrap();
            out.into_iter()
                .map(|(_, t)| t.to_f64_vec())
                .collect::<Vec<_>>()
        };
        assert_eq!(grads(&plain), grads(&recomputing));
    }
}
