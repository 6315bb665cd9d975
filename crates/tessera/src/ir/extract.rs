//! Graph surgery: the subgraph of a graph that computes chosen values from
//! chosen boundary values.
//!
//! Ahead-of-time autograd cuts its forward and backward graphs out of the
//! joint graph this way, a graph break cuts out the part of a trace that a
//! data read needs, and a compiled program cuts out the outputs it keeps.

use std::collections::{HashMap, HashSet};

use super::{Graph, Node, NodeId};
use crate::error::{Error, ErrorKind, Result};

/// The subgraph of `graph` computing `outputs` from `inputs` (which become
/// input nodes of the same types, in the order given), its nodes in
/// `graph`'s order. Nodes beyond the boundary that an output does not need
/// are left out. Errors if an output needs an input of `graph` that is not
/// among `inputs`.
pub fn extract(
    graph: &Graph,
    name: &str,
    inputs: &[(String, NodeId)],
    outputs: &[(String, NodeId)],
) -> Result<Graph> {
    Ok(extract_late(graph, name, inputs, outputs, &HashSet::new())?.0)
}

/// As [`extract`], except that the nodes in `late` are placed just before
/// the first node that reads them (depth first, operands in order), or at
/// the end when only an output needs them, instead of in `graph`'s order.
/// Also returns where each node of `graph` that the subgraph holds went.
///
/// (The backward graph of ahead-of-time autograd recomputes forward values
/// this way: in joint order they would all come first, and a strict order
/// would recompute every slice before the backward of the first.)
pub fn extract_late(
    graph: &Graph,
    name: &str,
    inputs: &[(String, NodeId)],
    outputs: &[(String, NodeId)],
    late: &HashSet<NodeId>,
) -> Result<(Graph, HashMap<NodeId, NodeId>)> {
    let boundary: HashMap<NodeId, &str> = inputs.iter().map(|(n, id)| (*id, n.as_str())).collect();
    // Nodes needed, walking back from the outputs and stopping at inputs.
    let mut needed = HashSet::new();
    let mut stack: Vec<NodeId> = outputs.iter().map(|(_, id)| *id).collect();
    while let Some(id) = stack.pop() {
        if !needed.insert(id) || boundary.contains_key(&id) {
            continue;
        }
        let node = graph.node(id);
        if matches!(node.op, super::Op::Input) {
            return Err(Error::new(
                ErrorKind::Verify,
                format!(
                    "internal error: {name} needs input {} of `{}` that it does not take",
                    graph.display_name(id),
                    graph.name
                ),
            ));
        }
        stack.extend(node.inputs.iter().copied());
    }
    let mut g = Graph::new(name);
    let mut map: HashMap<NodeId, NodeId> = HashMap::new();
    for (input_name, id) in inputs {
        map.insert(
            *id,
            g.add_input(input_name.clone(), graph.node(*id).ty.clone()),
        );
    }
    let wanted = |id: &NodeId| needed.contains(id) && !boundary.contains_key(id);
    for id in lazy_order(graph, late, outputs, &wanted) {
        let node = graph.node(id);
        let new = g.push(Node {
            op: node.op.clone(),
            inputs: node.inputs.iter().map(|x| map[x]).collect(),
            ty: node.ty.clone(),
            meta: node.meta.clone(),
        });
        map.insert(id, new);
    }
    for (out_name, id) in outputs {
        g.add_output(out_name.clone(), map[id]);
    }
    g.verify()?;
    Ok((g, map))
}

/// The `wanted` nodes in `graph`'s order, except that those in `late` come
/// just before the first node that reads them (depth first, operands in
/// order), or at the end when only an output needs them.
fn lazy_order(
    graph: &Graph,
    late: &HashSet<NodeId>,
    outputs: &[(String, NodeId)],
    wanted: &dyn Fn(&NodeId) -> bool,
) -> Vec<NodeId> {
    let mut order = Vec::new();
    let mut placed = HashSet::new();
    // Places the late nodes `id` reads (and, if `id` is late, `id` itself).
    let mut place = |id: NodeId, order: &mut Vec<NodeId>| {
        let mut stack = vec![(id, 0usize)];
        while let Some(&mut (v, ref mut i)) = stack.last_mut() {
            if let Some(&x) = graph.node(v).inputs.get(*i) {
                *i += 1;
                if late.contains(&x) && wanted(&x) && !placed.contains(&x) {
                    stack.push((x, 0));
                }
            } else {
                stack.pop();
                if (late.contains(&v) || v == id) && placed.insert(v) {
                    order.push(v);
                }
            }
        }
    };
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        if wanted(&id) && !late.contains(&id) {
            place(id, &mut order);
        }
    }
    for (_, id) in outputs {
        if wanted(id) {
            place(*id, &mut order);
        }
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{DType, NodeMeta, Op, TensorType, UnaryOp};

    /// x → a = exp(x) → b = neg(a); y → c = exp(y) → d = a + c → e = d + b.
    fn chain() -> (Graph, [NodeId; 7]) {
        let mut g = Graph::new("chain");
        let ty = TensorType::new(DType::F32, vec![2usize]);
        let x = g.add_input("x", ty.clone());
        let y = g.add_input("y", ty);
        let m = NodeMeta::named;
        let a = g.add(Op::Unary(UnaryOp::Exp), &[x], m("a")).unwrap();
        let b = g.add(Op::Unary(UnaryOp::Neg), &[a], m("b")).unwrap();
        let c = g.add(Op::Unary(UnaryOp::Exp), &[y], m("c")).unwrap();
        let add = Op::Binary(crate::ir::BinaryOp::Add);
        let d = g.add(add.clone(), &[a, c], m("d")).unwrap();
        let e = g.add(add, &[d, b], m("e")).unwrap();
        (g, [x, y, a, b, c, d, e])
    }

    fn names(g: &Graph) -> Vec<String> {
        (0..g.len())
            .map(|i| g.display_name(NodeId(i as u32)))
            .collect()
    }

    #[test]
    fn keeps_only_what_the_outputs_need_from_the_boundary() {
        let (g, [_, y, a, b, ..]) = chain();
        let boundary = [("a_in".to_string(), a), ("y".to_string(), y)];
        let part = extract(&g, "part", &boundary, &[("b".into(), b)]).unwrap();
        // `y` is a boundary input that nothing reads; `c`, `d`, `e` are not
        // needed; `exp(x)` is replaced by the input `a_in`.
        assert_eq!(names(&part), ["a_in", "y", "b"]);
        assert_eq!(part.inputs.len(), 2);
        assert_eq!(part.outputs[0].name, "b");
        assert_eq!(part.node(NodeId(2)).inputs, [NodeId(0)]);
    }

    #[test]
    fn late_nodes_come_just_before_their_first_reader() {
        let (g, [x, y, _, b, c, d, e]) = chain();
        let inputs = [("x".to_string(), x), ("y".to_string(), y)];
        let outputs = [("e".to_string(), e)];
        let plain = extract(&g, "p", &inputs, &outputs).unwrap();
        assert_eq!(names(&plain), ["x", "y", "a", "b", "c", "d", "e"]);
        let late: HashSet<NodeId> = [b, c].into();
        let (moved, map) = extract_late(&g, "p", &inputs, &outputs, &late).unwrap();
        assert_eq!(names(&moved), ["x", "y", "a", "c", "d", "b", "e"]);
        assert_eq!(map[&b], NodeId(5));
        assert_eq!(map[&d], NodeId(4));
    }

    #[test]
    fn an_output_beyond_the_boundary_is_an_error() {
        let (g, [x, _, _, _, _, d, _]) = chain();
        let err = extract(&g, "part", &[("x".into(), x)], &[("d".into(), d)]).unwrap_err();
        assert!(
            err.to_string().contains("needs input y of `chain`"),
            "{err}"
        );
    }
}
