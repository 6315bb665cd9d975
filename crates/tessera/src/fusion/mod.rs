//! Fusion: grouping a graph's nodes into kernels. Chains of elementwise ops
//! over one shape become one [`FusedKernel`] (intermediates never reach
//! memory); every other node is an extern kernel run by the op dispatcher.
//!
//! Grouping walks the nodes in order and puts an elementwise node into the
//! newest kernel among its producers when that kernel is a fused group of
//! the same shape and hints; all its other inputs then come from older
//! kernels, so running kernels in creation order respects every dependency.

use std::collections::{HashMap, HashSet};

use crate::ir::{CompareOp, DType, Graph, NodeId, Op, Scalar};
use crate::logging::log;
use crate::runtime::cpu::fused::{FusedKernel, Step};

/// One unit of execution.
#[derive(Clone, Debug, PartialEq)]
pub enum Kernel {
    /// A fused elementwise group: reads `inputs`, writes `outputs`.
    Fused {
        kernel: FusedKernel,
        members: Vec<NodeId>,
        inputs: Vec<NodeId>,
        outputs: Vec<NodeId>,
    },
    /// One node through the op dispatcher.
    Extern(NodeId),
}

impl Kernel {
    /// The values the kernel reads, in operand order (inlined scalars of a
    /// fused kernel are not read: they are constants of its code).
    pub fn reads(&self, graph: &Graph) -> Vec<NodeId> {
        match self {
            Kernel::Extern(id) => graph.node(*id).inputs.clone(),
            Kernel::Fused { inputs, .. } => inputs.clone(),
        }
    }

    /// The values the kernel writes.
    pub fn writes(&self) -> Vec<NodeId> {
        match self {
            Kernel::Extern(id) => vec![*id],
            Kernel::Fused { outputs, .. } => outputs.clone(),
        }
    }

    /// The graph nodes the kernel computes.
    pub fn members(&self) -> &[NodeId] {
        match self {
            Kernel::Extern(id) => std::slice::from_ref(id),
            Kernel::Fused { members, .. } => members,
        }
    }
}

/// The kernels of a graph, in an order that respects dependencies.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    pub kernels: Vec<Kernel>,
}

/// A scalar constant that fused kernels take inline.
fn inline_scalar(graph: &Graph, id: NodeId) -> Option<f64> {
    let node = graph.node(id);
    if !node.ty.dtype.is_float() && node.ty.dtype != DType::Bool {
        return None;
    }
    match &node.op {
        Op::Full { value, .. } if node.ty.shape.rank() == 0 => Some(match value {
            Scalar::Float(v) => *v,
            Scalar::Int(v) => *v as f64,
            Scalar::Bool(v) => *v as u8 as f64,
        }),
        Op::Constant(lit) if lit.data.len() == 1 => match &lit.data {
            crate::ir::LiteralData::Float(v) => Some(v[0]),
            crate::ir::LiteralData::Bool(v) => Some(v[0] as u8 as f64),
            crate::ir::LiteralData::Int(_) => None,
        },
        _ => None,
    }
}

/// Elementwise nodes over float/bool values that a fused kernel computes.
fn is_fusible(graph: &Graph, id: NodeId) -> bool {
    let node = graph.node(id);
    let float_or_bool = |d: DType| d.is_float() || d == DType::Bool;
    let elementwise = matches!(
        node.op,
        Op::Unary(_) | Op::Binary(_) | Op::Compare(_) | Op::Where | Op::Cast(_)
    );
    elementwise
        && node.ty.shape.as_concrete().is_some()
        && float_or_bool(node.ty.dtype)
        && node.inputs.iter().all(|&x| float_or_bool(graph.node(x).ty.dtype))
        // Binary ops on bools are not defined; compares of bools are fine.
        && !(matches!(node.op, Op::Binary(_)) && node.ty.dtype == DType::Bool)
}

/// Groups `graph` (concrete shapes) into kernels.
pub fn fuse(graph: &Graph) -> Plan {
    let mut kernel_of: HashMap<NodeId, usize> = HashMap::new();
    let mut groups: Vec<Vec<NodeId>> = Vec::new();
    // Kernel slots in order: Ok(group index) or Err(extern node).
    let mut order: Vec<Result<usize, NodeId>> = Vec::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        let node = graph.node(id);
        if matches!(node.op, Op::Input) || inline_scalar(graph, id).is_some() {
            continue;
        }
        if is_fusible(graph, id) {
            let newest = node
                .inputs
                .iter()
                .filter_map(|x| kernel_of.get(x).copied())
                .max();
            // A kernel never mixes hints (as no pass merges nodes whose hints
            // differ): the scheduler orders kernels by their nodes' hints.
            let joins = newest.and_then(|k| match order[k] {
                Ok(g)
                    if graph.node(groups[g][0]).ty.shape == node.ty.shape
                        && graph.node(groups[g][0]).meta.hints == node.meta.hints =>
                {
                    Some((k, g))
                }
                _ => None,
            });
            match joins {
                Some((k, g)) => {
                    groups[g].push(id);
                    kernel_of.insert(id, k);
                }
                None => {
                    kernel_of.insert(id, order.len());
                    order.push(Ok(groups.len()));
                    groups.push(vec![id]);
                }
            }
        } else {
            kernel_of.insert(id, order.len());
            order.push(Err(id));
        }
    }
    let plan = assemble(graph, &groups, &order);
    log("fusion", || describe(graph, &plan));
    plan
}

/// Builds the kernels, adding extern kernels for inlined scalars that an
/// extern kernel or a graph output needs as a value.
fn assemble(graph: &Graph, groups: &[Vec<NodeId>], order: &[Result<usize, NodeId>]) -> Plan {
    let users = users_outside(graph, groups);
    let mut kernels = Vec::new();
    let mut materialised: HashSet<NodeId> = HashSet::new();
    let mut scalar_value = |kernels: &mut Vec<Kernel>, x: NodeId| {
        if inline_scalar(graph, x).is_some() && materialised.insert(x) {
            kernels.push(Kernel::Extern(x));
        }
    };
    for slot in order {
        match slot {
            Err(id) => {
                for &x in &graph.node(*id).inputs {
                    scalar_value(&mut kernels, x);
                }
                kernels.push(Kernel::Extern(*id));
            }
            Ok(g) => kernels.push(fused_kernel(graph, &groups[*g], &users)),
        }
    }
    for out in &graph.outputs {
        if inline_scalar(graph, out.node).is_some() && !materialised.contains(&out.node) {
            kernels.push(Kernel::Extern(out.node));
        }
    }
    Plan { kernels }
}

/// Nodes read by something other than their own group (or returned).
fn users_outside(graph: &Graph, groups: &[Vec<NodeId>]) -> HashSet<NodeId> {
    let group_of: HashMap<NodeId, usize> = groups
        .iter()
        .enumerate()
        .flat_map(|(g, m)| m.iter().map(move |&n| (n, g)))
        .collect();
    let mut out: HashSet<NodeId> = graph.outputs.iter().map(|o| o.node).collect();
    for (i, node) in graph.nodes.iter().enumerate() {
        let mine = group_of.get(&NodeId(i as u32));
        for x in &node.inputs {
            if group_of.contains_key(x) && group_of.get(x) != mine {
                out.insert(*x);
            }
        }
    }
    out
}

fn fused_kernel(graph: &Graph, members: &[NodeId], users: &HashSet<NodeId>) -> Kernel {
    let mut steps: Vec<Step> = Vec::new();
    let mut step_of: HashMap<NodeId, usize> = HashMap::new();
    let mut inputs: Vec<NodeId> = Vec::new();
    let mut wide = false;
    for &m in members {
        let node = graph.node(m);
        wide |= node.ty.dtype == DType::F64;
        let mut args = Vec::with_capacity(node.inputs.len());
        for &x in &node.inputs {
            wide |= graph.node(x).ty.dtype == DType::F64;
            let s = match step_of.get(&x) {
                Some(&s) => s,
                None => {
                    let step = match inline_scalar(graph, x) {
                        Some(c) => Step::Const(c),
                        None => {
                            inputs.push(x);
                            Step::Load(inputs.len() - 1)
                        }
                    };
                    steps.push(step);
                    step_of.insert(x, steps.len() - 1);
                    steps.len() - 1
                }
            };
            args.push(s);
        }
        let step = match &node.op {
            Op::Unary(u) => Step::Unary(*u, args[0]),
            Op::Binary(b) => Step::Binary(*b, args[0], args[1]),
            Op::Compare(c) => Step::Compare(*c, args[0], args[1]),
            Op::Where => Step::Where(args[0], args[1], args[2]),
            Op::Cast(DType::Bool) => {
                steps.push(Step::Const(0.0));
                Step::Compare(CompareOp::Ne, args[0], steps.len() - 1)
            }
            Op::Cast(d) => Step::Round(*d, args[0]),
            other => unreachable!("{} is not fusible", other.name()),
        };
        steps.push(step);
        step_of.insert(m, steps.len() - 1);
    }
    let outputs: Vec<NodeId> = members
        .iter()
        .copied()
        .filter(|m| users.contains(m))
        .collect();
    let shape = graph
        .node(members[0])
        .ty
        .shape
        .as_concrete()
        .expect("fusible nodes are concrete");
    Kernel::Fused {
        kernel: FusedKernel::new(
            shape,
            steps,
            outputs
                .iter()
                .map(|&o| (step_of[&o], graph.node(o).ty.dtype))
                .collect(),
            wide,
        ),
        members: members.to_vec(),
        inputs,
        outputs,
    }
}

/// The fusion log: what fused, and the node count before and after.
pub fn describe(graph: &Graph, plan: &Plan) -> String {
    let mut text = String::new();
    let ops = graph
        .nodes
        .iter()
        .filter(|n| !matches!(n.op, Op::Input))
        .count();
    text.push_str(&format!(
        "graph `{}`: {ops} ops -> {} kernels\n",
        graph.name,
        plan.kernels.len()
    ));
    for (k, kernel) in plan.kernels.iter().enumerate() {
        match kernel {
            Kernel::Fused {
                members,
                inputs,
                outputs,
                ..
            } => {
                let names: Vec<String> = members
                    .iter()
                    .map(|&m| format!("{}:{}", graph.display_name(m), graph.node(m).op.name()))
                    .collect();
                text.push_str(&format!(
                    "  k{k} fused [{}] reads {} writes {}\n",
                    names.join(", "),
                    inputs.len(),
                    outputs.len()
                ));
            }
            Kernel::Extern(id) => text.push_str(&format!(
                "  k{k} extern {} ({})\n",
                graph.display_name(*id),
                graph.node(*id).op.name()
            )),
        }
    }
    text
}
