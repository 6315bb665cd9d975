//! One kernel of a step as a job: its arguments gathered from the values
//! alive (inputs it overwrites in place moved out), its planned
//! allocations, and its run on any thread.

use std::panic::Location;

use super::kernels::{run_epilogue, run_fused, run_matmul_rows, run_rows};
use super::prepared::PreparedKernel;
use crate::autograd;
use crate::error::{Error, ErrorKind, Result};
use crate::fusion::Kernel;
use crate::ir::{Graph, NodeId, Op, TensorType};
use crate::logging::log;
use crate::runtime::array::Array;
use crate::runtime::cpu::arena::{self, Slots, Taken};
use crate::runtime::device::{self, Device, DeviceStorage};
use crate::tensor::interpret::node_error;
use crate::tensor::{trace, Tensor};

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
pub(super) enum Arg {
    Shared(Tensor),
    /// The values of an input read for the last time, held by nothing else
    /// (a dense array, its buffer unique), which the fused kernel's output
    /// `.1` overwrites.
    Donated(Array, usize),
}

impl Arg {
    /// A tensor argument (the memory plan donates only to fused kernels).
    pub(super) fn tensor(&self, what: &str) -> &Tensor {
        match self {
            Arg::Shared(t) => t,
            Arg::Donated(..) => unreachable!("{what} never write in place"),
        }
    }
}

/// A kernel with its arguments, ready to run on any thread.
pub(super) struct Job<'a> {
    kernel: &'a Kernel,
    /// Its reads, writes and register slots, prepared once per plan.
    prepared: &'a PreparedKernel,
    args: Vec<Arg>,
    /// Where its allocations go (compiled runs with a memory plan).
    planned: Option<Planned>,
    /// Outputs planned in place whose input was still shared.
    undonated: Vec<NodeId>,
}

/// A kernel's planned allocations.
pub(super) struct Planned {
    pub(super) slots: Slots,
    /// A cat whose inputs were made within its output: it copies nothing.
    pub(super) joins: bool,
    /// The outputs planned to be written over an input, with their slots.
    pub(super) in_place: Vec<(NodeId, usize)>,
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
    pub(super) fn gather(
        graph: &Graph,
        k: usize,
        kernel: &'a Kernel,
        prepared: &'a PreparedKernel,
        in_place: &[(NodeId, NodeId)],
        values: &mut [Option<Tensor>],
    ) -> Job<'a> {
        let writes = &prepared.writes;
        let mut undonated = Vec::new();
        let args = prepared
            .reads
            .iter()
            .map(|&x| {
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
                match t.into_unique_array() {
                    Ok(array) => Arg::Donated(array, output()),
                    Err(t) => {
                        log("memory", || {
                            format!(
                                "kernel k{k}: {} is still shared (or not dense); {} gets its own buffer",
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
            prepared,
            args,
            planned: None,
            undonated,
        }
    }

    /// Gives the job its planned allocations; the outputs whose input
    /// could not be handed over take their own (pool) slots.
    pub(super) fn with_plan(mut self, planned: Option<Planned>) -> Job<'a> {
        self.planned = planned.map(|mut p| {
            for &out in &self.undonated {
                p.release_in_place(out);
            }
            p
        });
        self
    }

    pub(super) fn run(mut self, graph: &Graph) -> Result<Vec<(NodeId, Tensor)>> {
        match self.planned.take() {
            Some(Planned {
                slots, joins: true, ..
            }) => self.join(graph, slots),
            Some(Planned { slots, .. }) => {
                // Only a custom op allocates in an order of its own.
                let custom = matches!(self.kernel, Kernel::Custom { .. });
                let places = custom.then(|| slots.value_addrs());
                let written = arena::planned(slots, || self.run_kernel(graph))?;
                match places {
                    Some(places) => rehome(graph, written, &places),
                    None => Ok(written),
                }
            }
            None => self.run_kernel(graph),
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
            return self.run_kernel(graph);
        }
        let out = match region {
            Taken::Host(region) => {
                let storage = crate::runtime::cpu::Storage::in_region(ty.dtype, numel, region);
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
    fn run_kernel(self, graph: &Graph) -> Result<Vec<(NodeId, Tensor)>> {
        let writes = &self.prepared.writes;
        crate::runtime::cpu::alloc::catching(|| self.run_kernel_here(graph))
            .and_then(|r| r)
            .map_err(|e| match (e.kind, e.op.is_none(), writes.first()) {
                (ErrorKind::OutOfMemory, true, Some(&first)) => {
                    let types: Vec<String> = writes
                        .iter()
                        .map(|&w| graph.node(w).ty.to_string())
                        .collect();
                    let op = graph.node(first).op.name();
                    let e = crate::runtime::cpu::in_kernel(e, op, &types.join(", "));
                    node_error(graph, first, e)
                }
                _ => e,
            })
    }

    fn run_kernel_here(self, graph: &Graph) -> Result<Vec<(NodeId, Tensor)>> {
        let registers = &self.prepared.registers;
        match self.kernel {
            Kernel::Extern(id) => {
                let node = graph.node(*id);
                let args: Vec<&Tensor> = self
                    .args
                    .iter()
                    .map(|a| a.tensor("extern kernels"))
                    .collect();
                let out = extern_kernel(&node.op, &args).map_err(|e| node_error(graph, *id, e))?;
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
                    crate::tensor::custom::apply(call, &args, Location::caller())
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
                product_into,
                kernel,
                inputs,
                outputs,
                ..
            } => run_epilogue(
                graph,
                (*matmul, *matmul_out, *product_into),
                (kernel, registers.fused()),
                inputs,
                outputs,
                self.args,
            ),
            Kernel::Rows {
                kernel,
                outputs,
                members,
                inputs,
            } => {
                let args: Vec<&Tensor> =
                    self.args.iter().map(|a| a.tensor("row kernels")).collect();
                let kernel = (kernel, registers.rows());
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
                let kernel = (kernel, registers.rows());
                run_matmul_rows(graph, matmuls, kernel, (members, inputs, outputs), &args)
            }
            Kernel::Fused {
                kernel,
                outputs,
                members,
                ..
            } => {
                let outs = run_fused((kernel, registers.fused()), self.args)
                    .map_err(|e| node_error(graph, members[0], e))?;
                Ok(outputs.iter().copied().zip(outs).collect())
            }
        }
    }
}

/// One op between fused kernels, on its inputs' backend. Where the op
/// must be recorded instead — into an enclosing trace (its inputs are
/// traced values) or onto the tape (grad mode on and an input requires
/// grad; an input cut from autograd passes its cut on) — it goes through
/// `Tensor::apply`, which records.
fn extern_kernel(op: &Op, args: &[&Tensor]) -> Result<Tensor> {
    let records = trace::is_active()
        || (autograd::is_grad_enabled() && args.iter().any(|t| t.requires_grad()))
        || args.iter().any(|t| t.cut_op().is_some())
        || matches!(op, Op::Custom(_) | Op::CustomOutput { .. });
    if records {
        return Tensor::apply(op, args, Location::caller());
    }
    let types: Vec<TensorType> = args.iter().map(|t| t.ty()).collect();
    let ty = op.infer(&types)?;
    let shape = ty.shape.as_concrete().ok_or_else(|| {
        Error::op(
            ErrorKind::Unsupported,
            op.name(),
            format!("a compiled run needs concrete shapes, got {}", ty.shape),
        )
    })?;
    let arrays: Vec<&Array> = args.iter().map(|t| t.array()).collect();
    let on = device::of_op(op, &arrays)?;
    let array = device::eval(on, op, &arrays, ty.dtype, &shape)?;
    Ok(Tensor::from_array(array))
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
            let at = t.array().buffer_addr();
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
            let copy = arena::unplanned(|| t.array().fresh_copy())?;
            Ok((id, Tensor::from_array(copy)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fusion::fuse;
    use crate::ir::text::parse;
    use crate::runtime::execute::Prepared;

    const CHAIN: &str = "graph g(%x) {
      %x = input : f32[8]
      %e = exp(%x) : f32[8]
      %t = tanh(%e) : f32[8]
      return %t as t
    }";

    /// The fused kernel of `CHAIN`, its output value and the values slot
    /// list holding `x`.
    fn setup(x: &Tensor) -> (Graph, crate::fusion::Plan, Prepared, Vec<Option<Tensor>>) {
        let graph = parse(CHAIN).unwrap();
        let plan = fuse(&graph);
        assert_eq!(plan.kernels.len(), 1, "exp and tanh fuse");
        let prepared = Prepared::in_plan_order(&graph, &plan);
        let mut values = vec![None; graph.len()];
        values[graph.inputs[0].index()] = Some(x.clone());
        (graph, plan, prepared, values)
    }

    #[test]
    fn an_input_held_by_nothing_else_is_donated_to_its_output() {
        let x = Tensor::from_vec(vec![0.5f32; 8], &[8]);
        let (graph, plan, prepared, mut values) = setup(&x);
        let (input, output) = (graph.inputs[0], graph.outputs[0].node);
        drop(x);
        let (kernel, io) = (&plan.kernels[0], &prepared.kernels[0]);
        let job = Job::gather(&graph, 0, kernel, io, &[(input, output)], &mut values);
        assert!(values[input.index()].is_none(), "moved out of the values");
        assert!(job.undonated.is_empty());
        let [Arg::Donated(array, 0)] = &job.args[..] else {
            panic!("not donated to output 0")
        };
        let addr = array.buffer_addr();
        let out = job.run(&graph).unwrap();
        assert_eq!(out[0].1.array().buffer_addr(), addr, "written in place");
        assert_eq!(
            out[0].1.to_vec::<f32>().unwrap(),
            vec![0.5f32.exp().tanh(); 8]
        );
    }

    #[test]
    fn a_shared_input_is_read_and_its_output_gets_its_own_buffer() {
        let x = Tensor::from_vec(vec![0.25f32; 8], &[8]);
        let (graph, plan, prepared, mut values) = setup(&x);
        let (input, output) = (graph.inputs[0], graph.outputs[0].node);
        let (kernel, io) = (&plan.kernels[0], &prepared.kernels[0]);
        let job = Job::gather(&graph, 0, kernel, io, &[(input, output)], &mut values);
        // `x` is still held here: the plan's donation cannot happen.
        assert_eq!(job.undonated, vec![output]);
        assert!(matches!(&job.args[..], [Arg::Shared(_)]));
        let out = job.run(&graph).unwrap();
        assert_ne!(out[0].1.array().buffer_addr(), x.array().buffer_addr());
        assert_eq!(
            x.to_vec::<f32>().unwrap(),
            vec![0.25; 8],
            "the input is intact"
        );
    }

    #[test]
    fn an_extern_kernel_computes_on_the_backend_and_records_only_when_it_must() {
        let op = Op::MatMul;
        let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2]);
        let out = extern_kernel(&op, &[&a, &a]).unwrap();
        assert_eq!(out.to_vec::<f32>().unwrap(), vec![7.0, 10.0, 15.0, 22.0]);
        assert!(!out.requires_grad());
        // An input that requires grad, grad mode on: the tape records.
        let w = a.detach().set_requires_grad(true);
        assert!(extern_kernel(&op, &[&w, &a]).unwrap().requires_grad());
        // Grad mode off: nothing to record.
        let off = autograd::no_grad(|| extern_kernel(&op, &[&w, &a])).unwrap();
        assert!(!off.requires_grad());
    }
}
