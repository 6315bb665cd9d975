//! Plan assembly: the kernels of a grouping in its order, with extern
//! kernels for the nodes no group takes and for the inlined scalars that
//! an extern kernel or a graph output needs as a value.

use std::collections::{HashMap, HashSet};

use super::group::{Domain, Group, Grouping};
use super::matmul::epilogue_kernel;
use super::nodes::inline_scalar;
use super::rows::row_kernel;
use super::steps::fused_kernel;
use super::{Kernel, Plan};
use crate::ir::{Graph, NodeId, Op};

/// Builds the kernels, adding extern kernels for inlined scalars that an
/// extern kernel or a graph output needs as a value.
pub(super) fn assemble(graph: &Graph, grouping: &Grouping) -> Plan {
    let members: Vec<Vec<NodeId>> = grouping.groups.iter().map(|g| g.members.clone()).collect();
    let users = users_outside(graph, &members);
    let mut kernels = Vec::new();
    let mut materialised: HashSet<NodeId> = HashSet::new();
    let mut scalar_value = |kernels: &mut Vec<Kernel>, x: NodeId| {
        if inline_scalar(graph, x).is_some() && materialised.insert(x) {
            kernels.push(Kernel::Extern(x));
        }
    };
    for slot in &grouping.order {
        match slot {
            Err(id) => {
                for &x in &graph.node(*id).inputs {
                    scalar_value(&mut kernels, x);
                }
                kernels.push(match graph.node(*id).op {
                    Op::Custom(_) => Kernel::Custom {
                        node: *id,
                        outputs: custom_outputs(graph, *id),
                    },
                    _ => Kernel::Extern(*id),
                });
            }
            Ok(g) => kernels.push(group_kernel(graph, &grouping.groups[*g], &users)),
        }
    }
    for out in &graph.outputs {
        if inline_scalar(graph, out.node).is_some() && !materialised.contains(&out.node) {
            kernels.push(Kernel::Extern(out.node));
        }
    }
    Plan { kernels }
}

/// The `custom_output` nodes of the custom node `id`.
fn custom_outputs(graph: &Graph, id: NodeId) -> Vec<NodeId> {
    (0..graph.len())
        .map(|i| NodeId(i as u32))
        .filter(|&o| {
            let node = graph.node(o);
            matches!(node.op, Op::CustomOutput { .. }) && node.inputs[0] == id
        })
        .collect()
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

fn group_kernel(graph: &Graph, group: &Group, users: &HashSet<NodeId>) -> Kernel {
    if let Some(mm) = group.head {
        return epilogue_kernel(graph, group, mm, users);
    }
    match own_kernel(graph, group, users) {
        Kernel::Rows {
            kernel,
            members,
            inputs,
            outputs,
        } if !group.products.is_empty() => Kernel::MatmulRows {
            matmuls: group.products.clone(),
            kernel,
            members: group.products.iter().copied().chain(members).collect(),
            inputs,
            outputs,
        },
        kernel => kernel,
    }
}

/// A group's pointwise or row kernel.
fn own_kernel(graph: &Graph, group: &Group, users: &HashSet<NodeId>) -> Kernel {
    let members = &group.members;
    let outputs: Vec<NodeId> = members
        .iter()
        .copied()
        .filter(|m| users.contains(m))
        .collect();
    match &group.domain {
        Domain::Point(shape) => {
            let (kernel, inputs) = fused_kernel(graph, members, shape.clone(), &outputs);
            Kernel::Fused {
                kernel,
                members: members.to_vec(),
                inputs,
                outputs,
            }
        }
        Domain::Rows { outer, len } => {
            let (kernel, inputs) = row_kernel(graph, members, outer, *len, &outputs);
            Kernel::Rows {
                kernel,
                members: members.to_vec(),
                inputs,
                outputs,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::group::{group_with, Rounds};
    use super::super::testing::{graph, id, ids};
    use super::*;

    fn assembled(g: &Graph) -> Plan {
        let rounds = Rounds {
            reductions: true,
            epilogues: true,
        };
        assemble(g, &group_with(g, rounds, &HashSet::new()))
    }

    #[test]
    fn scalars_are_materialised_once_where_a_value_is_needed() {
        // c is read by two extern kernels and returned: one kernel, before
        // the first reader; d is a constant of the fused kernel and
        // returned: a kernel at the end.
        let g = graph(
            "%x",
            "  %x = input : f32[4]
  %c = full {value=2.0, shape=[], dtype=f32} : f32[]
  %e = expand(%c) {shape=[4]} : f32[4]
  %f = expand(%c) {shape=[2,4]} : f32[2,4]
  %d = full {value=3.0, shape=[], dtype=f32} : f32[]
  %y = mul(%x, %d) : f32[4]
  return %e as e, %f as f, %y as y, %d as d, %c as c",
        );
        let plan = assembled(&g);
        let [c, e, f, d, y] = ids(&g, &["c", "e", "f", "d", "y"])[..] else {
            unreachable!()
        };
        assert_eq!(plan.kernels.len(), 5, "{plan:?}");
        assert_eq!(
            plan.kernels[..3],
            [Kernel::Extern(c), Kernel::Extern(e), Kernel::Extern(f)]
        );
        let Kernel::Fused {
            kernel,
            inputs,
            outputs,
            ..
        } = &plan.kernels[3]
        else {
            panic!("{plan:?}")
        };
        assert!(kernel.steps.contains(&crate::ir::kernel::Step::Const(3.0)));
        assert_eq!(
            (inputs.as_slice(), outputs.as_slice()),
            (&[id(&g, "x")][..], &[y][..])
        );
        assert_eq!(plan.kernels[4], Kernel::Extern(d));
    }

    #[test]
    fn a_group_writes_the_values_read_outside_it() {
        // a, b, c in one group: b is read by the extern permute and c is
        // returned; a stays inside.
        let g = graph(
            "%x",
            "  %x = input : f32[4,4]
  %a = exp(%x) : f32[4,4]
  %b = tanh(%a) : f32[4,4]
  %c = neg(%b) : f32[4,4]
  %t = permute(%b) {perm=[1,0]} : f32[4,4]
  return %c as c, %t as t",
        );
        let [a, b, c, t] = ids(&g, &["a", "b", "c", "t"])[..] else {
            unreachable!()
        };
        let users = users_outside(&g, &[vec![a, b, c]]);
        assert_eq!(users, [b, c, t].into_iter().collect());
        let plan = assembled(&g);
        let Kernel::Fused {
            kernel,
            outputs,
            members,
            ..
        } = &plan.kernels[0]
        else {
            panic!("{plan:?}")
        };
        assert_eq!(
            (members.as_slice(), outputs.as_slice()),
            (&[a, b, c][..], &[b, c][..])
        );
        assert_eq!(kernel.outputs.len(), 2);
        assert_eq!(plan.kernels[1], Kernel::Extern(t));
    }
}
