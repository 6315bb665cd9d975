//! Runs a fused [`Plan`]: kernels in order, each intermediate freed after
//! the last kernel that reads it. Results equal the interpreter's (which
//! is checked by the differential tests); only the work differs.

use std::panic::Location;

use super::interpret::{bind_symbols, node_error};
use crate::error::Result;
use crate::fusion::{Kernel, Plan};
use crate::ir::{Graph, NodeId};
use crate::tensor::Tensor;

/// Runs `plan` (made by `fusion::fuse(graph)`) on `inputs`, one per
/// `graph.inputs`, returning the named outputs.
pub fn run_plan(graph: &Graph, plan: &Plan, inputs: &[Tensor]) -> Result<Vec<(String, Tensor)>> {
    let given: Vec<Option<&Tensor>> = inputs.iter().map(Some).collect();
    bind_symbols(graph, &given)?;
    let last = last_reads(graph, plan);
    let mut values: Vec<Option<Tensor>> = vec![None; graph.len()];
    for (&id, t) in graph.inputs.iter().zip(inputs) {
        values[id.index()] = Some(t.clone());
    }
    for (k, kernel) in plan.kernels.iter().enumerate() {
        run_kernel(graph, kernel, &mut values)?;
        for (i, &l) in last.iter().enumerate() {
            if l == k {
                values[i] = None;
            }
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

fn run_kernel(graph: &Graph, kernel: &Kernel, values: &mut [Option<Tensor>]) -> Result<()> {
    let get = |values: &[Option<Tensor>], x: NodeId| {
        values[x.index()].clone().expect("computed before use")
    };
    match kernel {
        Kernel::Extern(id) => {
            let node = graph.node(*id);
            let args: Vec<Tensor> = node.inputs.iter().map(|&x| get(values, x)).collect();
            let refs: Vec<&Tensor> = args.iter().collect();
            let out = Tensor::apply(&node.op, &refs, Location::caller())
                .map_err(|e| node_error(graph, *id, e))?;
            values[id.index()] = Some(out);
        }
        Kernel::Fused {
            kernel,
            inputs,
            outputs,
            members,
            ..
        } => {
            let args: Vec<Tensor> = inputs.iter().map(|&x| get(values, x)).collect();
            let refs: Vec<&Tensor> = args.iter().collect();
            let outs = kernel
                .run(&refs)
                .map_err(|e| node_error(graph, members[0], e))?;
            for (&id, t) in outputs.iter().zip(outs) {
                values[id.index()] = Some(t);
            }
        }
    }
    Ok(())
}

/// For each node, the index of the last kernel that reads it (`usize::MAX`
/// for outputs, never freed).
fn last_reads(graph: &Graph, plan: &Plan) -> Vec<usize> {
    let mut last = vec![usize::MAX - 1; graph.len()];
    for (k, kernel) in plan.kernels.iter().enumerate() {
        let reads: Vec<NodeId> = match kernel {
            Kernel::Extern(id) => graph.node(*id).inputs.clone(),
            Kernel::Fused { inputs, .. } => inputs.clone(),
        };
        for x in reads {
            last[x.index()] = k;
        }
    }
    for out in &graph.outputs {
        last[out.node.index()] = usize::MAX;
    }
    last
}
