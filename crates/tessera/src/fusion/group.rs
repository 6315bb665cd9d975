//! Grouping: the nodes in order, each put into the newest kernel among
//! its producers when that kernel's domain takes it, in rounds (pointwise
//! only; with reductions; with matmul epilogues).

use std::collections::{HashMap, HashSet};

use super::matmul::is_epilogue_head;
use super::nodes::{inline_scalar, is_fusible, shape_of};
use super::rows::row_reduction;
use crate::ir::{Graph, NodeId, Op};

/// What a group computes over.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Domain {
    /// Elementwise over one shape.
    Point(Vec<usize>),
    /// Rows of `len` along the last dim, one per position of `outer`.
    Rows { outer: Vec<usize>, len: usize },
}

impl Domain {
    /// The shapes of a row value and of a per-row scalar.
    pub(super) fn row_shapes(outer: &[usize], len: usize) -> (Vec<usize>, Vec<usize>) {
        let row: Vec<usize> = outer.iter().copied().chain([len]).collect();
        let scalar: Vec<usize> = outer.iter().copied().chain([1]).collect();
        (row, scalar)
    }
}

/// The nodes of one kernel to be.
#[derive(Clone, Debug)]
pub(super) struct Group {
    pub(super) domain: Domain,
    pub(super) members: Vec<NodeId>,
    /// A matmul whose epilogue the group is (its first member).
    pub(super) head: Option<NodeId>,
    /// Matmuls whose products the row group takes (round 4; not members).
    pub(super) products: Vec<NodeId>,
}

/// Which rounds run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Rounds {
    pub(super) reductions: bool,
    pub(super) epilogues: bool,
}

/// The grouping: groups, and kernel slots in order (`Ok(group)` or
/// `Err(extern node)`).
pub(super) struct Grouping {
    pub(super) groups: Vec<Group>,
    pub(super) order: Vec<Result<usize, NodeId>>,
}

/// Whether group `g` may take elementwise node `id`.
fn point_joins(graph: &Graph, group: &Group, id: NodeId) -> bool {
    let Some(shape) = shape_of(graph, id) else {
        return false;
    };
    match &group.domain {
        Domain::Point(s) => *s == shape,
        Domain::Rows { outer, len } => {
            let (row, scalar) = Domain::row_shapes(outer, *len);
            // Operands from the group must broadcast as rows or per-row
            // scalars (a reduction without keepdim does not).
            (shape == row || shape == scalar)
                && graph.node(id).inputs.iter().all(|x| {
                    !group.members.contains(x)
                        || shape_of(graph, *x).is_some_and(|s| s == row || s == scalar)
                })
        }
    }
}

/// The grouping of `graph` under `rounds`.
pub(super) fn group(graph: &Graph, rounds: Rounds) -> Grouping {
    group_with(graph, rounds, &HashSet::new())
}

/// The nodes that round 2 put into row kernels with others: round 3 leaves
/// them there. Started as a matmul's epilogue instead, such a node would
/// be written out in full for the row kernel to read back (and the product
/// too, when the row kernel reads it as well, as softmax's backward does),
/// where the row kernel computes it from the product it reads anyway.
pub(super) fn in_row_kernels(rows: &Grouping) -> HashSet<NodeId> {
    rows.groups
        .iter()
        .filter(|g| matches!(g.domain, Domain::Rows { .. }) && g.members.len() > 1)
        .flat_map(|g| g.members.iter().copied())
        .collect()
}

/// [`group`], where round 3 starts no epilogue with a node of `in_rows`.
pub(super) fn group_with(graph: &Graph, rounds: Rounds, in_rows: &HashSet<NodeId>) -> Grouping {
    let mut kernel_of: HashMap<NodeId, usize> = HashMap::new();
    let mut groups: Vec<Group> = Vec::new();
    let mut order: Vec<Result<usize, NodeId>> = Vec::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        let node = graph.node(id);
        if matches!(node.op, Op::Input) || inline_scalar(graph, id).is_some() {
            continue;
        }
        if let Op::CustomOutput { .. } = node.op {
            // Written by its custom op's kernel.
            kernel_of.insert(id, kernel_of[&node.inputs[0]]);
            continue;
        }
        let reduction = if rounds.reductions {
            row_reduction(graph, id)
        } else {
            None
        };
        if !is_fusible(graph, id) && reduction.is_none() {
            kernel_of.insert(id, order.len());
            order.push(Err(id));
            continue;
        }
        let newest = node
            .inputs
            .iter()
            .filter_map(|x| kernel_of.get(x).copied())
            .max();
        // A kernel never mixes hints (as no pass merges nodes whose hints
        // differ): the scheduler orders kernels by their nodes' hints.
        let same_hints = |g: &Group| graph.node(g.members[0]).meta.hints == node.meta.hints;
        let joined = newest.and_then(|k| {
            let Ok(g) = order[k] else { return None };
            let group = &groups[g];
            if !same_hints(group) {
                return None;
            }
            let takes = match &reduction {
                Some((outer, len)) => {
                    let row = Domain::row_shapes(outer, *len).0;
                    group.head.is_none()
                        && (group.domain
                            == Domain::Rows {
                                outer: outer.clone(),
                                len: *len,
                            }
                            || group.domain == Domain::Point(row))
                }
                None => point_joins(graph, group, id),
            };
            takes.then_some((k, g))
        });
        // Round 3: a pointwise node that no group takes may start the
        // epilogue of the matmul it reads (the newest kernel, of its shape).
        let epilogue = match (joined, newest) {
            (None, Some(k))
                if rounds.epilogues && reduction.is_none() && !in_rows.contains(&id) =>
            {
                match order[k] {
                    Err(mm)
                        if is_epilogue_head(graph, mm)
                            && shape_of(graph, mm) == shape_of(graph, id)
                            && graph.node(mm).meta.hints == node.meta.hints =>
                    {
                        Some((k, mm))
                    }
                    _ => None,
                }
            }
            _ => None,
        };
        if let Some((k, mm)) = epilogue {
            order[k] = Ok(groups.len());
            groups.push(Group {
                domain: Domain::Point(shape_of(graph, id).expect("concrete")),
                members: vec![mm, id],
                head: Some(mm),
                products: Vec::new(),
            });
            kernel_of.insert(id, k);
            continue;
        }
        match joined {
            Some((k, g)) => {
                if let Some((outer, len)) = &reduction {
                    groups[g].domain = Domain::Rows {
                        outer: outer.clone(),
                        len: *len,
                    };
                }
                groups[g].members.push(id);
                kernel_of.insert(id, k);
            }
            None => {
                let domain = match reduction {
                    Some((outer, len)) => Domain::Rows { outer, len },
                    None => Domain::Point(shape_of(graph, id).expect("fusible nodes are concrete")),
                };
                kernel_of.insert(id, order.len());
                order.push(Ok(groups.len()));
                groups.push(Group {
                    domain,
                    members: vec![id],
                    head: None,
                    products: Vec::new(),
                });
            }
        }
    }
    Grouping { groups, order }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{graph, ids};
    use super::*;

    const POINTWISE: Rounds = Rounds {
        reductions: false,
        epilogues: false,
    };
    const ROWS: Rounds = Rounds {
        reductions: true,
        epilogues: false,
    };
    const ALL: Rounds = Rounds {
        reductions: true,
        epilogues: true,
    };

    /// The kernel slots in order: `extern m`, `point a b`, `rows a b`,
    /// `epilogue m a` (by node name).
    fn slots(g: &Graph, grouping: &Grouping) -> Vec<String> {
        let names =
            |ids: &[NodeId]| -> Vec<String> { ids.iter().map(|&i| g.display_name(i)).collect() };
        grouping
            .order
            .iter()
            .map(|slot| match *slot {
                Err(id) => format!("extern {}", g.display_name(id)),
                Ok(k) => {
                    let group = &grouping.groups[k];
                    let kind = match (&group.domain, group.head) {
                        (_, Some(_)) => "epilogue",
                        (Domain::Point(_), None) => "point",
                        (Domain::Rows { .. }, None) => "rows",
                    };
                    format!("{kind} {}", names(&group.members).join(" "))
                }
            })
            .collect()
    }

    #[test]
    fn pointwise_chains_of_one_shape_and_hints_form_groups() {
        let g = graph(
            "%x, %r",
            r#"  %x = input : f32[4,8]
  %r = input : f32[8]
  %a = exp(%r) : f32[8]
  %b = add(%x, %a) : f32[4,8]
  %c = tanh(%b) : f32[4,8]
  %s = sum(%c) {dims=[1], keepdim=true} : f32[4,1]
  %d = mul(%c, %s) : f32[4,8]
  %e = neg(%d) : f32[4,8]  hints={"order":"strict"}
  %f = abs(%e) : f32[4,8]  hints={"order":"strict"}
  return %f as f"#,
        );
        // The broadcast add starts a new group (another shape); the sum is
        // an extern kernel in round 1 and the mul reads it, so it starts
        // a group of its own; the strict region is a group of its own.
        assert_eq!(
            slots(&g, &group(&g, POINTWISE)),
            ["point a", "point b c", "extern s", "point d", "point e f"]
        );
    }

    #[test]
    fn a_row_reduction_takes_its_producers_and_consumers() {
        let g = graph(
            "%x",
            "  %x = input : f32[4,32]
  %a = exp(%x) : f32[4,32]
  %s = sum(%a) {dims=[1], keepdim=true} : f32[4,1]
  %d = div(%a, %s) : f32[4,32]
  %m = mean(%d) {dims=[1], keepdim=false} : f32[4]
  %n = neg(%m) : f32[4]
  %t = sum(%d) {dims=[0], keepdim=true} : f32[1,32]
  return %n as n, %t as t",
        );
        let rows = group(&g, ROWS);
        // The mean without keepdim is taken, but its [4] value does not
        // broadcast as a per-row scalar: the neg starts a group of its own.
        assert_eq!(slots(&g, &rows), ["rows a s d m", "point n", "extern t"]);
        assert_eq!(
            rows.groups[0].domain,
            Domain::Rows {
                outer: vec![4],
                len: 32
            }
        );
        let taken: HashSet<NodeId> = ids(&g, &["a", "s", "d", "m"]).into_iter().collect();
        assert_eq!(in_row_kernels(&rows), taken);
    }

    #[test]
    fn a_matmul_takes_its_pointwise_consumers_unless_a_row_kernel_has_them() {
        let g = graph(
            "%x, %w, %b",
            "  %x = input : f32[32,16]
  %w = input : f32[16,32]
  %b = input : f32[32]
  %m = matmul(%x, %w) : f32[32,32]
  %h = add(%m, %b) : f32[32,32]
  %r = relu(%h) : f32[32,32]
  %p = softmax(%m) {dim=1} : f32[32,32]
  %q = mul(%p, %h) : f32[32,32]
  return %r as r, %q as q",
        );
        // Without round 3 the add starts a pointwise group; with it, the
        // matmul's epilogue.
        assert_eq!(
            slots(&g, &group(&g, ROWS)),
            ["extern m", "point h r", "rows p q"]
        );
        assert_eq!(
            slots(&g, &group_with(&g, ALL, &HashSet::new())),
            ["epilogue m h r", "rows p q"]
        );
        // A node that round 2 put into a row kernel starts no epilogue.
        let in_rows: HashSet<NodeId> = ids(&g, &["h"]).into_iter().collect();
        assert_eq!(
            slots(&g, &group_with(&g, ALL, &in_rows)),
            ["extern m", "point h r", "rows p q"]
        );
    }
}
