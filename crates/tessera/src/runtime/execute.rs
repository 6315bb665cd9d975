//! Runs a fused [`Plan`]: in plan order ([`run_plan`]) or in a schedule's
//! steps ([`run_scheduled`]). Each value is freed right after the last step
//! that reads it, so the bytes alive over time follow the memory plan.
//! Results equal the interpreter's (checked by the differential tests);
//! only the work and its order differ.

use std::panic::Location;

use rayon::prelude::*;

use super::autotune;
use super::cpu::fused::{FusedInput, FusedKernel};
use super::cpu::Storage;
use super::interpret::{bind_symbols, node_error};
use crate::autograd;
use crate::error::Result;
use crate::fusion::{Kernel, Plan};
use crate::ir::{Graph, NodeId};
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
    execute(graph, plan, &steps, |_| Vec::new(), |_| false, inputs, tune)
}

/// Runs `plan` in `schedule`'s steps: the kernels of a step with several
/// run concurrently on the rayon pool (each kernel may itself be parallel),
/// a step of one runs alone. Fused kernels write in place where `memory`
/// says so. Kernels that need scratch memory run first in their step, one
/// at a time, so that the bytes alive never depend on how threads
/// interleave: the measured peak is the predicted one. Under an active
/// trace, every kernel runs on this thread (traced tensors belong to it).
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
    execute(
        graph,
        plan,
        &schedule.steps,
        |k| memory.in_place(k).collect(),
        |k| memory.scratch_bytes(k) > 0,
        inputs,
        tune,
    )
}

fn execute(
    graph: &Graph,
    plan: &Plan,
    steps: &[Vec<usize>],
    in_place: impl Fn(usize) -> Vec<(NodeId, NodeId)>,
    alone: impl Fn(usize) -> bool,
    inputs: &[Tensor],
    tune: bool,
) -> Result<Vec<(String, Tensor)>> {
    let given: Vec<Option<&Tensor>> = inputs.iter().map(Some).collect();
    bind_symbols(graph, &given)?;
    let frees = frees_after_each_step(graph, plan, steps);
    let mut values: Vec<Option<Tensor>> = vec![None; graph.len()];
    for (&id, t) in graph.inputs.iter().zip(inputs) {
        values[id.index()] = Some(t.clone());
    }
    let concurrent = !trace::is_active();
    let grad = autograd::is_grad_enabled();
    for (step, free) in steps.iter().zip(&frees) {
        let jobs: Vec<Job<'_>> = step
            .iter()
            .map(|&k| Job::gather(graph, k, &plan.kernels[k], &in_place(k), &mut values))
            .collect();
        let concurrent = concurrent && jobs.len() > 1;
        let (serial, parallel): (Vec<Job<'_>>, Vec<Job<'_>>) = jobs
            .into_iter()
            .partition(|job| !concurrent || alone(job.k));
        let mut results: Vec<Result<Vec<(NodeId, Tensor)>>> =
            serial.into_iter().map(|job| job.run(graph, tune)).collect();
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
}

/// A kernel's argument, gathered before the step runs.
enum Arg {
    Shared(Tensor),
    /// The storage of an input read for the last time, which the fused
    /// kernel's output `.1` overwrites.
    Donated(Storage, usize),
}

/// A kernel with its arguments, ready to run on any thread.
struct Job<'a> {
    k: usize,
    kernel: &'a Kernel,
    args: Vec<Arg>,
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
        let args = kernel
            .reads(graph)
            .into_iter()
            .map(|x| {
                let Some(&(_, out)) = in_place.iter().find(|(i, _)| *i == x) else {
                    return Arg::Shared(values[x.index()].clone().expect("computed before use"));
                };
                let t = values[x.index()].take().expect("computed before use");
                match t.into_unique_storage() {
                    Ok(storage) => {
                        let output = writes
                            .iter()
                            .position(|&w| w == out)
                            .expect("an output of the kernel");
                        Arg::Donated(storage, output)
                    }
                    Err(t) => {
                        log("memory", || {
                            format!(
                                "kernel k{k}: {} is still shared; {} gets its own buffer",
                                graph.display_name(x),
                                graph.display_name(out)
                            )
                        });
                        Arg::Shared(t)
                    }
                }
            })
            .collect();
        Job { k, kernel, args }
    }

    fn run(self, graph: &Graph, tune: bool) -> Result<Vec<(NodeId, Tensor)>> {
        match self.kernel {
            Kernel::Extern(id) => {
                let node = graph.node(*id);
                let args: Vec<&Tensor> = self
                    .args
                    .iter()
                    .map(|a| match a {
                        Arg::Shared(t) => t,
                        Arg::Donated(..) => unreachable!("extern kernels never write in place"),
                    })
                    .collect();
                let out = Tensor::apply(&node.op, &args, Location::caller())
                    .map_err(|e| node_error(graph, *id, e))?;
                Ok(vec![(*id, out)])
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
                ..
            } => {
                let args: Vec<&Tensor> = self
                    .args
                    .iter()
                    .map(|a| match a {
                        Arg::Shared(t) => t,
                        Arg::Donated(..) => unreachable!("row kernels never write in place"),
                    })
                    .collect();
                let outs = kernel
                    .run(&args)
                    .map_err(|e| node_error(graph, members[0], e))?;
                Ok(outputs.iter().copied().zip(outs).collect())
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
            Arg::Shared(t) => t,
            Arg::Donated(..) => unreachable!("epilogue inputs are not donated by the plan"),
        })
        .collect();
    let node = graph.node(matmul);
    let (operands, rest) = shared.split_at(node.inputs.len());
    let operands: Vec<&Tensor> = operands.iter().collect();
    let product = Tensor::apply(&node.op, &operands, Location::caller())
        .map_err(|e| node_error(graph, matmul, e))?;
    let mut results = Vec::with_capacity(outputs.len() + 1);
    let target = (!matmul_out)
        .then(|| {
            kernel
                .outputs
                .iter()
                .position(|&(_, d)| d == product.dtype())
        })
        .flatten();
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
            Arg::Shared(t) => (t, None),
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

/// Runs a fused kernel on its gathered arguments (block autotuned when `tune`).
fn run_fused(kernel: &FusedKernel, args: Vec<Arg>, tune: bool) -> Result<Vec<Tensor>> {
    if tune {
        let (kernel, args) = tuned(kernel, args)?;
        return run_fused(&kernel, args, false);
    }
    // The shared tensors must outlive the inputs that borrow them.
    let mut shared: Vec<Option<Tensor>> = Vec::with_capacity(args.len());
    let mut donated: Vec<Option<(Storage, usize)>> = Vec::with_capacity(args.len());
    for arg in args {
        match arg {
            Arg::Shared(t) => {
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
            None => FusedInput::Shared(t.as_ref().expect("a shared input")),
        })
        .collect();
    kernel.run_with(inputs)
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
