//! Running each kind of kernel fusion makes (row kernels, matmul row
//! kernels, matmul epilogues, fused elementwise kernels) on its inputs'
//! backend; a group a backend does not take runs op by op.

use std::panic::Location;

use super::job::Arg;
use crate::error::Result;
use crate::ir::kernel::{FusedKernel, FusedRegisters, RowKernel, RowRegisters, Step};
use crate::ir::{BinaryOp, DType, Graph, Node, NodeId, Op};
use crate::logging::log;
use crate::runtime::array::Array;
use crate::runtime::cpu::arena;
use crate::runtime::device::{self, FusedArg};
use crate::tensor::interpret::node_error;
use crate::tensor::Tensor;

/// A row kernel's (`members`, `inputs`, `outputs`) — group members, the
/// values it reads, the values it writes.
pub(super) type RowGroup<'a> = (&'a [NodeId], &'a [NodeId], &'a [NodeId]);

/// A fused kernel with its register slots where prepared (see
/// `prepared::Registers`).
pub(super) type Fused<'a> = (&'a FusedKernel, Option<&'a [FusedRegisters; 2]>);

/// A row kernel with its register slots where prepared.
pub(super) type Rows<'a> = (&'a RowKernel, Option<&'a RowRegisters>);

/// A row kernel on its inputs `args`: the backend's kernel, or, where the
/// backend does not take it, op by op through the backend's own kernels.
pub(super) fn run_rows(
    graph: &Graph,
    (kernel, registers): Rows<'_>,
    (members, inputs, outputs): RowGroup<'_>,
    args: &[&Tensor],
) -> Result<Vec<(NodeId, Tensor)>> {
    let arrays: Vec<&Array> = args.iter().map(|t| t.array()).collect();
    let on = device::of_inputs("rows", &arrays)?;
    let backend = device::backend(on)?;
    if let Some(why) = backend.row_kernel_refusal(kernel) {
        log("fusion", || {
            format!(
                "row kernel of {} on {on}: op by op ({why})",
                graph.display_name(members[0])
            )
        });
        return run_members(graph, members, inputs, args, outputs);
    }
    let outs = match registers {
        Some(registers) => backend.run_rows_in(kernel, registers, &arrays),
        None => backend.run_rows(kernel, &arrays),
    }
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
/// the matmuls' operands, then the row kernel's other inputs). A backend
/// that can feeds the products to the row kernel block by block
/// ([`Backend::run_rows_fed`]: the CPU's thin f32 products); otherwise the
/// products are made whole, as the kernel's scratch (as the memory plan counts them, see
/// `schedule::buffers`), and the row kernel runs as [`run_rows`] runs it.
pub(super) fn run_matmul_rows(
    graph: &Graph,
    matmuls: &[NodeId],
    (kernel, registers): Rows<'_>,
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
    let shapes = matmuls
        .iter()
        .map(|&m| graph.node(m).ty.shape.as_concrete())
        .collect::<Option<Vec<Vec<usize>>>>();
    if let Some(shapes) = shapes {
        let described: Vec<(&Op, [&Array; 2], &[usize])> = matmuls
            .iter()
            .zip(&operands)
            .zip(&shapes)
            .map(|((&m, ops), shape)| {
                let node = graph.node(m);
                (&node.op, [ops[0].array(), ops[1].array()], shape.as_slice())
            })
            .collect();
        let mut rest = rest.iter();
        let row_args: Vec<Option<&Array>> = inputs
            .iter()
            .map(|x| (!matmuls.contains(x)).then(|| rest.next().expect("an input").array()))
            .collect();
        let fed: Vec<usize> = matmuls
            .iter()
            .map(|m| inputs.iter().position(|x| x == m).expect("a product read"))
            .collect();
        let arrays: Vec<&Array> = operands.iter().flatten().map(|t| t.array()).collect();
        let backend = device::backend(device::of_inputs("matmul rows", &arrays)?)?;
        if let Some(outs) = backend.run_rows_fed(kernel, &described, &row_args, &fed) {
            let outs = outs.map_err(|e| node_error(graph, row_members[0], e))?;
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
    let kernel = (kernel, registers);
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

/// Runs a matmul and its epilogue: the gemm writes a fresh buffer, which
/// the epilogue then overwrites in place with its output `target` (see
/// `Kernel::Epilogue::product_into`), else the product is scratch.
pub(super) fn run_epilogue(
    graph: &Graph,
    (matmul, matmul_out, target): (NodeId, bool, Option<usize>),
    (kernel, registers): Fused<'_>,
    inputs: &[NodeId],
    outputs: &[NodeId],
    args: Vec<Arg>,
) -> Result<Vec<(NodeId, Tensor)>> {
    let node = graph.node(matmul);
    let mut args = args.into_iter();
    let operands: Vec<Tensor> = args
        .by_ref()
        .take(node.inputs.len())
        .map(|a| match a {
            Arg::Shared(t) => t,
            Arg::Donated(..) => unreachable!("matmul operands are never donated by the plan"),
        })
        .collect();
    // The epilogue's other inputs; one donated by the caller may be
    // written over by an output (numbered among the kernel's writes, which
    // start with the matmul's value when it is an output).
    let rest: Vec<Arg> = args
        .map(|a| match a {
            Arg::Donated(array, o) => Arg::Donated(array, o - usize::from(matmul_out)),
            shared => shared,
        })
        .collect();
    let operands: Vec<&Tensor> = operands.iter().collect();
    let dtype = node.ty.dtype;
    if let Some(bias) = bias_of(kernel, inputs, matmul, &rest, dtype).filter(|_| !matmul_out) {
        if let Some(sum) = gemm_with_bias(node, &operands, bias) {
            let sum = sum.map_err(|e| node_error(graph, matmul, e))?;
            return Ok(vec![(outputs[0], sum)]);
        }
    }
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
    let mut rest = rest.into_iter();
    let mut fused_args = Vec::with_capacity(inputs.len());
    for &x in inputs {
        if x != matmul {
            fused_args.push(rest.next().expect("an input"));
            continue;
        }
        let t = product.take().expect("the matmul is read once");
        fused_args.push(match target {
            Some(o) => match t.into_unique_array() {
                Ok(array) => Arg::Donated(array, o),
                Err(t) => Arg::Shared(t),
            },
            None => Arg::Shared(t),
        });
    }
    let outs = run_fused((kernel, registers), fused_args)
        .map_err(|e| node_error(graph, outputs.first().copied().unwrap_or(matmul), e))?;
    results.extend(outputs.iter().copied().zip(outs));
    Ok(results)
}

/// The bias of an epilogue that only adds a vector to the product
/// (`product + bias`, one output of the product's dtype): an argument of
/// `rest` (the epilogue's inputs but the product, in order), which a
/// device's gemm may add itself ([`device::Backend::matmul_bias`]).
fn bias_of<'a>(
    kernel: &FusedKernel,
    inputs: &[NodeId],
    matmul: NodeId,
    rest: &'a [Arg],
    dtype: DType,
) -> Option<&'a Array> {
    let [Step::Load(x), Step::Load(y), Step::Binary(BinaryOp::Add, 0, 1)] = kernel.steps[..] else {
        return None;
    };
    if kernel.outputs != [(2, dtype)] {
        return None;
    }
    let other = match (
        inputs.get(x) == Some(&matmul),
        inputs.get(y) == Some(&matmul),
    ) {
        (true, false) => y,
        (false, true) => x,
        _ => return None,
    };
    let at = inputs
        .get(..other)?
        .iter()
        .filter(|&&i| i != matmul)
        .count();
    let bias = match rest.get(at)? {
        Arg::Shared(t) => t.array(),
        Arg::Donated(array, _) => array,
    };
    (bias.dtype() == dtype && bias.rank() == 1).then_some(bias)
}

/// `node`'s matmul of `operands` plus `bias` in one call of their device,
/// if it has one for them (see [`device::Backend::matmul_bias`]).
fn gemm_with_bias(node: &Node, operands: &[&Tensor], bias: &Array) -> Option<Result<Tensor>> {
    let shape = node.ty.shape.as_concrete()?;
    let arrays: Vec<&Array> = operands.iter().map(|t| t.array()).collect();
    let on = device::of_inputs("matmul", &arrays).ok()?;
    let backend = device::backend(on).ok()?;
    let sum = backend.matmul_bias(&node.op, arrays[0], arrays[1], bias, &shape)?;
    Some(sum.map(Tensor::from_array))
}

/// Runs a fused kernel on its gathered arguments, on their device's
/// backend (which tunes it under [`device::tuning`]).
pub(super) fn run_fused((kernel, registers): Fused<'_>, args: Vec<Arg>) -> Result<Vec<Tensor>> {
    let arrays: Vec<&Array> = args
        .iter()
        .map(|a| match a {
            Arg::Shared(t) => t.array(),
            Arg::Donated(array, _) => array,
        })
        .collect();
    let backend = device::backend(device::of_inputs("fused", &arrays)?)?;
    // The shared tensors must outlive the arguments that borrow them.
    let mut shared: Vec<Option<Tensor>> = Vec::with_capacity(args.len());
    let mut donated: Vec<Option<(Array, usize)>> = Vec::with_capacity(args.len());
    for arg in args {
        match arg {
            Arg::Shared(t) => {
                shared.push(Some(t));
                donated.push(None);
            }
            Arg::Donated(array, output) => {
                shared.push(None);
                donated.push(Some((array, output)));
            }
        }
    }
    let inputs: Vec<FusedArg<'_>> = shared
        .iter()
        .zip(donated)
        .map(|(t, d)| match d {
            Some((array, output)) => FusedArg::Donated { array, output },
            None => FusedArg::Shared(t.as_ref().expect("a shared input").array()),
        })
        .collect();
    let outs = match registers {
        Some(registers) => backend.run_fused_in(kernel, registers, inputs)?,
        None => backend.run_fused(kernel, inputs)?,
    };
    Ok(outs.into_iter().map(Tensor::from_array).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fusion::{fuse, Kernel};
    use crate::ir::text::parse;

    #[test]
    fn a_group_run_op_by_op_equals_eager() {
        let graph = parse(
            "graph g(%x) {
              %x = input : f32[2,3]
              %m = max(%x) {dims=[1], keepdim=true} : f32[2,1]
              %d = sub(%x, %m) : f32[2,3]
              %e = exp(%d) : f32[2,3]
              return %e as e
            }",
        )
        .unwrap();
        let members: Vec<NodeId> = (1..graph.len()).map(|i| NodeId(i as u32)).collect();
        let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, -1.0, 0.0, 4.0], &[2, 3]);
        let out = graph.outputs[0].node;
        let got = run_members(&graph, &members, &[graph.inputs[0]], &[&x], &[out]).unwrap();
        let want = (&x - &x.max(&[1], true)).exp();
        assert_eq!(got[0].0, out);
        assert_eq!(
            got[0].1.to_vec::<f32>().unwrap(),
            want.to_vec::<f32>().unwrap()
        );
    }

    #[test]
    fn a_fused_kernel_on_a_donated_array_writes_over_it() {
        let graph = parse(
            "graph g(%x) {
              %x = input : f32[64]
              %y = mul(%x, %x) : f32[64]
              %z = add(%y, %x) : f32[64]
              return %z as z
            }",
        )
        .unwrap();
        let plan = fuse(&graph);
        let [Kernel::Fused { kernel, .. }] = &plan.kernels[..] else {
            panic!("one fused kernel: {:?}", plan.kernels.len())
        };
        let values: Vec<f32> = (0..64).map(|i| i as f32 / 8.0).collect();
        let want: Vec<f32> = values.iter().map(|v| v * v + v).collect();
        let shared = Tensor::from_vec(values.clone(), &[64]);
        let got = run_fused((kernel, None), vec![Arg::Shared(shared.clone())]).unwrap();
        assert_eq!(got[0].to_vec::<f32>().unwrap(), want);
        let array = Tensor::from_vec(values, &[64])
            .into_unique_array()
            .ok()
            .unwrap();
        let addr = array.buffer_addr();
        let got = run_fused((kernel, None), vec![Arg::Donated(array, 0)]).unwrap();
        assert_eq!(got[0].array().buffer_addr(), addr, "written in place");
        assert_eq!(got[0].to_vec::<f32>().unwrap(), want);
    }
}
