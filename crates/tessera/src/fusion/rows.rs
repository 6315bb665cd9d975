//! Round 2's row kernels: a reduction or softmax along the last dim that
//! takes in its pointwise producers and consumers, and the [`RowKernel`]
//! description of such a group.

use super::nodes::{inline_scalar, shape_of};
use super::steps::build_steps;
use crate::ir::kernel::{RowKernel, RowStep, MAX_ROW};
use crate::ir::{DType, Graph, NodeId, Op};

/// The shorter rows are left to the reduction kernels: a row kernel's
/// per-row step dispatch would cost more than it saves.
pub(super) const MIN_ROW: usize = 16;

/// A softmax or reduction along the last dim of an f32/f64 row of
/// `MIN_ROW..=MAX_ROW` elements: its (outer, len).
pub(super) fn row_reduction(graph: &Graph, id: NodeId) -> Option<(Vec<usize>, usize)> {
    let node = graph.node(id);
    let x = *node.inputs.first()?;
    let shape = shape_of(graph, x)?;
    let last = shape.len().checked_sub(1)?;
    let along_last = match &node.op {
        Op::Reduce { dims, .. } => dims.as_slice() == [last],
        Op::Softmax { dim } | Op::LogSoftmax { dim } => *dim == last,
        _ => false,
    };
    let real = |d: DType| matches!(d, DType::F32 | DType::F64);
    let len = shape[last];
    (along_last
        && real(node.ty.dtype)
        && real(graph.node(x).ty.dtype)
        && (MIN_ROW..=MAX_ROW).contains(&len))
    .then(|| (shape[..last].to_vec(), len))
}

/// The row kernel of `members` (a row group over `outer` rows of `len`)
/// writing `outputs`, with the values it loads.
pub(super) fn row_kernel(
    graph: &Graph,
    members: &[NodeId],
    outer: &[usize],
    len: usize,
    outputs: &[NodeId],
) -> (RowKernel, Vec<NodeId>) {
    let b = build_steps(graph, members);
    let rank = outer.len() + 1;
    // A step is a row value when its node (or loaded input) spans the
    // row; constants, per-row inputs and reductions are scalars.
    let mut is_row = vec![false; b.steps.len()];
    for (&id, &s) in &b.step_of {
        let spans = shape_of(graph, id).is_some_and(|sh| {
            sh.len() <= rank && sh.last() == Some(&len) && inline_scalar(graph, id).is_none()
        });
        is_row[s] = spans && !matches!(b.steps[s], RowStep::Reduce(..));
    }
    let outs = outputs
        .iter()
        .map(|&o| {
            let node = graph.node(o);
            (
                b.step_of[&o],
                node.ty.dtype,
                shape_of(graph, o).expect("concrete"),
            )
        })
        .collect();
    let kernel = RowKernel {
        outer: outer.to_vec(),
        len,
        steps: b.steps,
        is_row,
        outputs: outs,
        wide: b.wide,
    };
    (kernel, b.inputs)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{graph, id, ids};
    use super::*;
    use crate::ir::kernel::Step;
    use crate::ir::BinaryOp;

    #[test]
    fn reductions_along_the_last_dim_of_real_rows_in_range() {
        let g = graph(
            "%x, %s, %l, %n",
            "  %x = input : f32[4,32]
  %s = input : f32[4,8]
  %l = input : f32[2,16385]
  %n = input : i64[4,32]
  %a = sum(%x) {dims=[1], keepdim=true} : f32[4,1]
  %b = mean(%x) {dims=[1], keepdim=false} : f32[4]
  %c = softmax(%x) {dim=1} : f32[4,32]
  %d = sum(%x) {dims=[0], keepdim=true} : f32[1,32]
  %e = sum(%x) {dims=[0,1], keepdim=false} : f32[]
  %f = softmax(%s) {dim=1} : f32[4,8]
  %h = max(%l) {dims=[1], keepdim=true} : f32[2,1]
  %i = sum(%n) {dims=[1], keepdim=true} : i64[4,1]
  %j = exp(%x) : f32[4,32]
  return %a as a",
        );
        let at = |n: &str| row_reduction(&g, id(&g, n));
        for n in ["a", "b", "c"] {
            assert_eq!(at(n), Some((vec![4], 32)), "{n}");
        }
        assert_eq!(at("d"), None, "not along the last dim");
        assert_eq!(at("e"), None, "along every dim");
        assert_eq!(at("f"), None, "rows shorter than MIN_ROW");
        assert_eq!(at("h"), None, "rows longer than MAX_ROW");
        assert_eq!(at("i"), None, "integer rows");
        assert_eq!(at("j"), None, "not a reduction");
    }

    #[test]
    fn row_values_span_the_row_and_scalars_do_not() {
        // y = (x - mean(x)) * w + c, per row: x rows, w a row broadcast
        // over the rows, c a per-row input, mean a scalar per row.
        let g = graph(
            "%x, %w, %c",
            "  %x = input : f32[3,20]
  %w = input : f32[20]
  %c = input : f32[3,1]
  %m = mean(%x) {dims=[1], keepdim=true} : f32[3,1]
  %d = sub(%x, %m) : f32[3,20]
  %s = mul(%d, %w) : f32[3,20]
  %y = add(%s, %c) : f32[3,20]
  %z = add(%m, %c) : f32[3,1]
  return %y as y, %z as z",
        );
        let members = ids(&g, &["m", "d", "s", "y", "z"]);
        let outputs = ids(&g, &["y", "z"]);
        let (k, inputs) = row_kernel(&g, &members, &[3], 20, &outputs);
        assert_eq!(inputs, ids(&g, &["x", "w", "c"]));
        assert_eq!(
            k.steps,
            [
                RowStep::Point(Step::Load(0)),
                RowStep::Reduce(crate::ir::ReduceOp::Mean, 0),
                RowStep::Point(Step::Binary(BinaryOp::Sub, 0, 1)),
                RowStep::Point(Step::Load(1)),
                RowStep::Point(Step::Binary(BinaryOp::Mul, 2, 3)),
                RowStep::Point(Step::Load(2)),
                RowStep::Point(Step::Binary(BinaryOp::Add, 4, 5)),
                RowStep::Point(Step::Binary(BinaryOp::Add, 1, 5)),
            ]
        );
        assert_eq!(
            k.is_row,
            [true, false, true, true, true, false, true, false]
        );
        assert_eq!(
            k.outputs,
            [(6, DType::F32, vec![3, 20]), (7, DType::F32, vec![3, 1])]
        );
        assert_eq!((k.outer.as_slice(), k.len, k.wide), (&[3][..], 20, false));
        k.check(inputs.len()).unwrap();
    }
}
