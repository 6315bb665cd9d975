//! The step builder: a group's nodes as kernel steps, in member order,
//! with the values it loads, and the pointwise [`FusedKernel`] of a group.

use std::collections::HashMap;

use super::nodes::inline_scalar;
use crate::ir::kernel::{FusedKernel, RowStep, Step};
use crate::ir::{CompareOp, DType, Graph, NodeId, Op};

/// The steps of a group, in member order, with its loaded inputs.
pub(super) struct Steps {
    pub(super) steps: Vec<RowStep>,
    /// The step of each member and loaded value.
    pub(super) step_of: HashMap<NodeId, usize>,
    /// The values loaded, in `Step::Load` order.
    pub(super) inputs: Vec<NodeId>,
    /// Whether any value involved is f64 (the kernel computes in f64).
    pub(super) wide: bool,
}

/// The steps of `members` (elementwise nodes, reductions and softmax):
/// each input from outside the members is loaded once, or inlined as a
/// constant when it is a scalar.
pub(super) fn build_steps(graph: &Graph, members: &[NodeId]) -> Steps {
    let f64_in = |m: &NodeId| {
        let node = graph.node(*m);
        node.ty.dtype == DType::F64
            || node
                .inputs
                .iter()
                .any(|&x| graph.node(x).ty.dtype == DType::F64)
    };
    let mut b = Steps {
        steps: Vec::new(),
        step_of: HashMap::new(),
        inputs: Vec::new(),
        wide: members.iter().any(f64_in),
    };
    for &m in members {
        let node = graph.node(m);
        let mut args = Vec::with_capacity(node.inputs.len());
        for &x in &node.inputs {
            let s = match b.step_of.get(&x) {
                Some(&s) => s,
                None => {
                    let step = match inline_scalar(graph, x) {
                        Some(c) => Step::Const(c),
                        None => {
                            b.inputs.push(x);
                            Step::Load(b.inputs.len() - 1)
                        }
                    };
                    b.steps.push(RowStep::Point(step));
                    b.step_of.insert(x, b.steps.len() - 1);
                    b.steps.len() - 1
                }
            };
            args.push(s);
        }
        let step = match &node.op {
            Op::Unary(u) => Step::Unary(*u, args[0]),
            Op::Binary(op) => Step::Binary(*op, args[0], args[1]),
            Op::Compare(c) => Step::Compare(*c, args[0], args[1]),
            Op::Where => Step::Where(args[0], args[1], args[2]),
            Op::Cast(DType::Bool) => {
                b.steps.push(RowStep::Point(Step::Const(0.0)));
                Step::Compare(CompareOp::Ne, args[0], b.steps.len() - 1)
            }
            Op::Cast(d) => Step::Round(*d, args[0]),
            Op::Reduce { op, .. } => {
                b.steps.push(RowStep::Reduce(*op, args[0]));
                b.step_of.insert(m, b.steps.len() - 1);
                continue;
            }
            Op::Softmax { .. } | Op::LogSoftmax { .. } => {
                let log = matches!(node.op, Op::LogSoftmax { .. });
                b.steps.push(RowStep::Softmax { log, arg: args[0] });
                b.step_of.insert(m, b.steps.len() - 1);
                continue;
            }
            other => unreachable!("{} is not fusible", other.name()),
        };
        b.steps.push(RowStep::Point(step));
        // In a block computing in f64, an f32 (or half) node's value is
        // rounded to its type, as eager computes it: an f32 division
        // then widened gives the f32 quotient, not the f64 one.
        let narrow = matches!(node.ty.dtype, DType::F32 | DType::F16 | DType::BF16);
        if b.wide && narrow && !matches!(node.op, Op::Cast(_)) {
            b.steps.push(RowStep::Point(Step::Round(
                node.ty.dtype,
                b.steps.len() - 1,
            )));
        }
        b.step_of.insert(m, b.steps.len() - 1);
    }
    b
}

/// The pointwise kernel of `members` (elementwise nodes over `shape`)
/// writing `outputs`, with the values it loads.
pub(super) fn fused_kernel(
    graph: &Graph,
    members: &[NodeId],
    shape: Vec<usize>,
    outputs: &[NodeId],
) -> (FusedKernel, Vec<NodeId>) {
    let b = build_steps(graph, members);
    let steps = b
        .steps
        .into_iter()
        .map(|s| match s {
            RowStep::Point(p) => p,
            other => unreachable!("{other:?} in a pointwise group"),
        })
        .collect();
    let outs = outputs
        .iter()
        .map(|&o| (b.step_of[&o], graph.node(o).ty.dtype))
        .collect();
    (FusedKernel::new(shape, steps, outs, b.wide), b.inputs)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{graph, ids};
    use super::*;
    use crate::ir::{BinaryOp, ReduceOp, UnaryOp};

    #[test]
    fn values_from_outside_are_loaded_once_and_scalars_inlined() {
        // y = tanh(x * 0.5) + x: x is loaded once and read twice.
        let g = graph(
            "%x",
            "  %x = input : f32[8]
  %h = full {value=0.5, shape=[], dtype=f32} : f32[]
  %a = mul(%x, %h) : f32[8]
  %t = tanh(%a) : f32[8]
  %y = add(%t, %x) : f32[8]
  %b = cast(%y) {dtype=bool} : bool[8]
  return %y as y, %b as b",
        );
        let members = ids(&g, &["a", "t", "y", "b"]);
        let s = build_steps(&g, &members);
        assert_eq!(
            s.steps,
            [
                RowStep::Point(Step::Load(0)),
                RowStep::Point(Step::Const(0.5)),
                RowStep::Point(Step::Binary(BinaryOp::Mul, 0, 1)),
                RowStep::Point(Step::Unary(UnaryOp::Tanh, 2)),
                RowStep::Point(Step::Binary(BinaryOp::Add, 3, 0)),
                // A cast to bool is a compare with zero.
                RowStep::Point(Step::Const(0.0)),
                RowStep::Point(Step::Compare(CompareOp::Ne, 4, 5)),
            ]
        );
        assert_eq!(s.inputs, ids(&g, &["x"]));
        assert!(!s.wide);
        for (name, step) in [("x", 0), ("h", 1), ("a", 2), ("y", 4), ("b", 6)] {
            assert_eq!(s.step_of[&ids(&g, &[name])[0]], step, "{name}");
        }
        // The kernel writes the values asked for, in their dtypes.
        let outputs = ids(&g, &["y", "b"]);
        let (k, inputs) = fused_kernel(&g, &members, vec![8], &outputs);
        assert_eq!(k.outputs, [(4, DType::F32), (6, DType::Bool)]);
        assert_eq!(
            (k.shape.as_slice(), k.wide, inputs),
            (&[8][..], false, s.inputs)
        );
        assert_eq!(k.block, k.default_block());
    }

    #[test]
    fn reductions_and_softmax_are_row_steps_and_f64_widens() {
        let g = graph(
            "%x",
            "  %x = input : f64[2,16]
  %m = max(%x) {dims=[1], keepdim=true} : f64[2,1]
  %d = sub(%x, %m) : f64[2,16]
  %p = log_softmax(%d) {dim=1} : f64[2,16]
  return %p as p",
        );
        let s = build_steps(&g, &ids(&g, &["m", "d", "p"]));
        assert_eq!(
            s.steps,
            [
                RowStep::Point(Step::Load(0)),
                RowStep::Reduce(ReduceOp::Max, 0),
                RowStep::Point(Step::Binary(BinaryOp::Sub, 0, 1)),
                RowStep::Softmax { log: true, arg: 2 },
            ]
        );
        assert!(s.wide, "an f64 value computes in f64");
    }
}
