//! What a compile produces: the graph(s) to run and how to hook them into
//! autograd.

use std::sync::Arc;

use super::{Backend, CompileOptions};
use crate::autograd::{self, aot_autograd};
use crate::error::Result;
use crate::fusion::{self, Plan};
use crate::ir::{Graph, NodeId};
use crate::logging::log;
use crate::passes::{PassContext, PassManager};
use crate::runtime::execute::{run_plan_with, run_scheduled_with};
use crate::runtime::interpret::run_graph;
use crate::runtime::replay::{ReplayStats, Replayer};
use crate::schedule::{self, ScheduleOptions, Scheduled};
use crate::tensor::trace::Traced;
use crate::tensor::Tensor;

/// A graph and, for the default backend, its fused kernels, their schedule
/// and memory plan.
#[derive(Clone)]
struct Program {
    graph: Arc<Graph>,
    plan: Option<Arc<Plan>>,
    /// `None` where the graph cannot be planned (symbolic shapes): then the
    /// kernels run in plan order.
    scheduled: Option<Arc<Scheduled>>,
    /// Autotune fused kernels' block sizes (`mode=max-autotune`).
    tune: bool,
    /// Device graphs of its runs (`mode=reduce-overhead`).
    replay: Option<Arc<Replayer>>,
}

impl Program {
    /// For the default backend (`optimized`): the pass pipeline, fusion,
    /// then the schedule.
    fn new(mut graph: Graph, optimized: bool, options: &CompileOptions) -> Result<Program> {
        if !optimized {
            return Ok(Program {
                graph: Arc::new(graph),
                plan: None,
                scheduled: None,
                tune: false,
                replay: None,
            });
        }
        pipeline(options).run(&mut graph, &PassContext::default())?;
        let plan = fusion::fuse(&graph);
        let schedule_options = ScheduleOptions {
            strategy: options.schedule,
            memory_budget: options.memory_budget,
        };
        let scheduled = match schedule::build(&graph, &plan, &schedule_options) {
            Ok(s) => Some(Arc::new(s)),
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
        Ok(Program {
            graph: Arc::new(graph),
            plan: Some(Arc::new(plan)),
            scheduled,
            tune: options.mode == super::Mode::MaxAutotune,
            replay: (options.mode == super::Mode::ReduceOverhead)
                .then(|| Arc::new(Replayer::new())),
        })
    }

    /// Runs the program: replayed from a device graph under
    /// `mode=reduce-overhead` (see `runtime::replay`), else kernel by kernel.
    fn run(&self, args: &[Tensor]) -> Result<Vec<Tensor>> {
        match &self.replay {
            Some(replayer) => replayer.run(args, |a| self.run_kernels(a)),
            None => self.run_kernels(args),
        }
    }

    fn replay_stats(&self) -> ReplayStats {
        self.replay
            .as_ref()
            .map_or_else(ReplayStats::default, |r| r.stats())
    }

    fn run_kernels(&self, args: &[Tensor]) -> Result<Vec<Tensor>> {
        let outs = match (&self.plan, &self.scheduled) {
            (Some(plan), Some(s)) => {
                run_scheduled_with(&self.graph, plan, &s.schedule, &s.memory, args, self.tune)?
            }
            (Some(plan), None) => run_plan_with(&self.graph, plan, args, self.tune)?,
            (None, _) => run_graph(&self.graph, args)?,
        };
        Ok(outs.into_iter().map(|(_, t)| t).collect())
    }

    /// The kernel list, schedule and memory plan as (file suffix, text).
    fn artifacts(&self, prefix: &str) -> Vec<(String, String)> {
        let mut out = vec![(format!("{prefix}.tir"), self.graph.to_string())];
        if let Some(plan) = &self.plan {
            out.push((
                format!("{prefix}.kernels.txt"),
                fusion::describe(&self.graph, plan),
            ));
            if let Some(s) = &self.scheduled {
                out.push((
                    format!("{prefix}.schedule.txt"),
                    schedule::describe(&self.graph, plan, &s.schedule, &s.memory),
                ));
                out.push((
                    format!("{prefix}.memory.txt"),
                    s.memory.describe(&self.graph),
                ));
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
}

impl Executable {
    /// Builds the executable for `traced`, with the AOT backward for the
    /// graph inputs at `wrt` (none: forward only; backend `eager` keeps the
    /// tape instead). For the default backend the passes run once on the
    /// captured graph, then each graph that runs is fused and scheduled once.
    pub fn build(traced: &Traced, wrt: Vec<usize>, options: &CompileOptions) -> Result<Executable> {
        let mut graph = cut_at_breaks(traced)?;
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
        let (forward, backward) = if wrt.is_empty() || eager_autograd {
            (Program::new(graph, fused, options)?, None)
        } else {
            let aot = aot_autograd(&graph, &wrt, options.partition)?;
            let tangent_outputs = (0..num_outputs)
                .filter(|&i| graph.node(graph.outputs[i].node).ty.dtype.is_float())
                .collect();
            let backward = BackwardGraph {
                program: Program::new(aot.backward, fused, options)?,
                wrt,
                tangent_outputs,
            };
            (Program::new(aot.forward, fused, options)?, Some(backward))
        };
        Ok(Executable {
            name,
            forward,
            backward,
            eager_autograd,
            num_outputs,
            num_lifted: traced.lifted.len(),
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
        out
    }

    /// What the device-graph replayers of its forward and backward did
    /// (`mode=reduce-overhead`), summed.
    pub fn replay_stats(&self) -> ReplayStats {
        let mut s = self.forward.replay_stats();
        if let Some(bwd) = &self.backward {
            let b = bwd.program.replay_stats();
            s.normal_runs += b.normal_runs;
            s.recordings += b.recordings;
            s.replays += b.replays;
            s.fallbacks += b.fallbacks;
        }
        s
    }

    pub(super) fn has_lifted(&self) -> bool {
        self.num_lifted > 0
    }

    /// Runs on the user's `inputs` followed by `extra` (lifted tensors and
    /// graph-break values, in the trace's order).
    pub fn run(&self, inputs: &[Tensor], extra: &[Tensor]) -> Result<Vec<Tensor>> {
        let args: Vec<Tensor> = inputs.iter().chain(extra).cloned().collect();
        if self.eager_autograd {
            // The interpreter's ops record on the tape like eager code.
            return self.forward.run(&args);
        }
        let detached: Vec<Tensor> = args.iter().map(Tensor::detach).collect();
        let mut outs = autograd::no_grad(|| self.forward.run(&detached))?;
        let saved = outs.split_off(self.num_outputs);
        let Some(bwd) = &self.backward else {
            return Ok(outs);
        };
        let wrt: Vec<&Tensor> = bwd.wrt.iter().map(|&i| &args[i]).collect();
        let program = bwd.program.clone();
        let tangent_outputs = bwd.tangent_outputs.clone();
        let backward = move |grads: &[Tensor]| -> Result<Vec<Option<Tensor>>> {
            let mut feed = saved.clone();
            feed.extend(tangent_outputs.iter().map(|&i| grads[i].clone()));
            Ok(program.run(&feed)?.into_iter().map(Some).collect())
        };
        Ok(autograd::custom_function(
            &self.name,
            &wrt,
            outs,
            Arc::new(backward),
        ))
    }
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
    autograd::aot::extract(g, &g.name, &inputs, &outputs)
}
