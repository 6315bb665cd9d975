//! Indexing ops: `index_select` (whole slices at a 1-D index), `gather`
//! (an index of the input's rank), and their gradients `index_add` and
//! `scatter_add` (a base plus a source at an index). Indices are i64 or
//! i32; the values keep the input's (base's) dtype.

use super::{check_dim, describe, not_in_family, same_dtype, TensorType};
use crate::error::{op_err, Result};
use crate::ir::op::Op;
use crate::ir::shape::Dim;

/// The type an indexing op makes.
pub(super) fn infer(op: &Op, inputs: &[TensorType]) -> Result<TensorType> {
    match op {
        Op::IndexSelect { dim } => {
            let (x, idx) = (&inputs[0], &inputs[1]);
            check_dim(op, *dim, x)?;
            require_index(op, idx)?;
            if idx.rank() != 1 {
                return Err(op_err!(
                    Shape,
                    "index_select",
                    "index must be 1-D, got {idx}"
                ));
            }
            let mut shape = x.shape.clone();
            shape.0[*dim] = idx.shape.0[0].clone();
            Ok(TensorType {
                dtype: x.dtype,
                shape,
            })
        }
        Op::Gather { dim } => {
            let (x, idx) = (&inputs[0], &inputs[1]);
            check_dim(op, *dim, x)?;
            require_index(op, idx)?;
            let fits = idx.rank() == x.rank()
                && (0..x.rank()).all(|i| {
                    i == *dim
                        || match (&idx.shape.0[i], &x.shape.0[i]) {
                            (Dim::Const(a), Dim::Const(b)) => a <= b,
                            (a, b) => a == b,
                        }
                });
            if !fits {
                return Err(op_err!(
                    Shape,
                    "gather",
                    "index {idx} must have the rank of {x} and no larger dims except dim {dim}"
                ));
            }
            Ok(TensorType {
                dtype: x.dtype,
                shape: idx.shape.clone(),
            })
        }
        Op::IndexAdd { dim } => {
            let (base, idx, src) = (&inputs[0], &inputs[1], &inputs[2]);
            check_dim(op, *dim, base)?;
            require_index(op, idx)?;
            same_dtype(op, &[base.clone(), src.clone()])?;
            let mut want = base.shape.clone();
            if idx.rank() == 1 {
                want.0[*dim] = idx.shape.0[0].clone();
            }
            if idx.rank() != 1 || src.shape != want {
                return Err(op_err!(
                    Shape,
                    "index_add",
                    "needs a 1-D index and a source of shape {want}, got {}",
                    describe(inputs)
                ));
            }
            Ok(base.clone())
        }
        Op::ScatterAdd { dim } => {
            let (base, idx, src) = (&inputs[0], &inputs[1], &inputs[2]);
            check_dim(op, *dim, base)?;
            require_index(op, idx)?;
            same_dtype(op, &[base.clone(), src.clone()])?;
            let fits = idx.shape == src.shape
                && idx.rank() == base.rank()
                && (0..base.rank()).all(|i| {
                    i == *dim
                        || match (&idx.shape.0[i], &base.shape.0[i]) {
                            (Dim::Const(a), Dim::Const(b)) => a <= b,
                            (a, b) => a == b,
                        }
                });
            if !fits {
                return Err(op_err!(
                    Shape,
                    "scatter_add",
                    "index and source must share a shape no larger than the base outside dim {dim}: {}",
                    describe(inputs)
                ));
            }
            Ok(base.clone())
        }
        _ => Err(not_in_family(op, "index")),
    }
}

fn require_index(op: &Op, t: &TensorType) -> Result<()> {
    if !t.dtype.is_int() {
        return Err(op_err!(
            DType,
            op.name(),
            "index must be i64 or i32, got {t}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testing::{err, t, ty};
    use super::*;
    use crate::ir::dtype::DType;

    fn idx(dims: &[usize]) -> TensorType {
        ty(DType::I64, dims)
    }

    #[test]
    fn index_select_takes_slices_at_a_1d_index() {
        let op = Op::IndexSelect { dim: 1 };
        assert_eq!(
            op.infer(&[t(&[2, 5, 3]), idx(&[7])]).unwrap(),
            t(&[2, 7, 3])
        );
        assert_eq!(
            op.infer(&[ty(DType::F16, &[2, 5]), ty(DType::I32, &[0])])
                .unwrap(),
            ty(DType::F16, &[2, 0])
        );
        assert_eq!(
            err(&op, &[t(&[2, 5]), idx(&[2, 2])]),
            "index_select: index must be 1-D, got i64[2,2]"
        );
        assert_eq!(
            err(&op, &[t(&[2, 5]), t(&[2])]),
            "index_select: index must be i64 or i32, got f32[2]"
        );
        assert_eq!(
            err(&Op::IndexSelect { dim: 2 }, &[t(&[2, 5]), idx(&[2])]),
            "index_select: dim 2 is out of range for f32[2,5] (rank 2)"
        );
    }

    #[test]
    fn gather_takes_the_index_shape_within_the_input() {
        let op = Op::Gather { dim: 0 };
        assert_eq!(op.infer(&[t(&[4, 3]), idx(&[9, 2])]).unwrap(), t(&[9, 2]));
        assert_eq!(
            err(&op, &[t(&[4, 3]), idx(&[2, 5])]),
            "gather: index i64[2,5] must have the rank of f32[4,3] and no larger dims except dim 0"
        );
        assert_eq!(
            err(&op, &[t(&[4, 3]), idx(&[2])]),
            "gather: index i64[2] must have the rank of f32[4,3] and no larger dims except dim 0"
        );
        assert_eq!(
            err(&op, &[t(&[4, 3]), ty(DType::Bool, &[1, 1])]),
            "gather: index must be i64 or i32, got bool[1,1]"
        );
        // Symbolic dims outside `dim` must be equal, not just no larger.
        let x = TensorType::new(
            DType::F32,
            crate::ir::Shape(vec![Dim::Const(4), Dim::sym("n")]),
        );
        let i = TensorType::new(
            DType::I64,
            crate::ir::Shape(vec![Dim::Const(2), Dim::sym("n")]),
        );
        assert_eq!(
            op.infer(&[x.clone(), i]).unwrap().shape.to_string(),
            "[2,n]"
        );
        assert!(
            err(&op, &[x, idx(&[2, 1])]).starts_with("gather: index i64[2,1] must have the rank")
        );
    }

    #[test]
    fn index_add_needs_a_source_of_the_selected_shape() {
        let op = Op::IndexAdd { dim: 0 };
        let base = t(&[5, 3]);
        assert_eq!(
            op.infer(&[base.clone(), idx(&[2]), t(&[2, 3])]).unwrap(),
            base
        );
        assert_eq!(
            err(&op, &[base.clone(), idx(&[2]), t(&[3, 3])]),
            "index_add: needs a 1-D index and a source of shape [2,3], got f32[5,3], i64[2], f32[3,3]"
        );
        assert_eq!(
            err(&op, &[base.clone(), idx(&[2, 1]), t(&[2, 3])]),
            "index_add: needs a 1-D index and a source of shape [5,3], got f32[5,3], i64[2,1], f32[2,3]"
        );
        assert!(
            err(&op, &[base.clone(), idx(&[2]), ty(DType::F64, &[2, 3])])
                .starts_with("index_add: dtypes differ (f32[5,3], f64[2,3])")
        );
        assert_eq!(
            err(&op, &[base, t(&[2]), t(&[2, 3])]),
            "index_add: index must be i64 or i32, got f32[2]"
        );
    }

    #[test]
    fn scatter_add_needs_index_and_source_alike_within_the_base() {
        let op = Op::ScatterAdd { dim: 1 };
        let base = ty(DType::I32, &[3, 4]);
        let src = ty(DType::I32, &[2, 6]);
        assert_eq!(
            op.infer(&[base.clone(), idx(&[2, 6]), src.clone()])
                .unwrap(),
            base
        );
        assert_eq!(
            err(&op, &[base.clone(), idx(&[2, 5]), src]),
            "scatter_add: index and source must share a shape no larger than the base outside dim 1: \
             i32[3,4], i64[2,5], i32[2,6]"
        );
        assert_eq!(
            err(&op, &[base.clone(), idx(&[4, 1]), ty(DType::I32, &[4, 1])]),
            "scatter_add: index and source must share a shape no larger than the base outside dim 1: \
             i32[3,4], i64[4,1], i32[4,1]"
        );
        assert_eq!(
            err(
                &Op::ScatterAdd { dim: 2 },
                &[base, idx(&[1, 1]), ty(DType::I32, &[1, 1])]
            ),
            "scatter_add: dim 2 is out of range for i32[3,4] (rank 2)"
        );
    }
}
