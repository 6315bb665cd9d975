//! Reductions along dims: `sum`/`mean`/`max`/`min`… over sorted, unique
//! dims (kept as 1s with `keepdim`), `argmax`/`argmin` (i64 indices) along
//! one dim, and `softmax`/`log_softmax` (float, the input's type).

use super::{check_dim, not_in_family, TensorType};
use crate::error::{op_err, Result};
use crate::ir::dtype::DType;
use crate::ir::op::{Op, ReduceOp};
use crate::ir::shape::{Dim, Shape};

/// The shape after reducing `dims` (kept as 1s with `keepdim`).
pub fn reduced_shape(shape: &Shape, dims: &[usize], keepdim: bool) -> Shape {
    let mut out = Vec::with_capacity(shape.rank());
    for (i, d) in shape.0.iter().enumerate() {
        if dims.contains(&i) {
            if keepdim {
                out.push(Dim::Const(1));
            }
        } else {
            out.push(d.clone());
        }
    }
    Shape(out)
}

/// The type a reduction makes.
pub(super) fn infer(op: &Op, inputs: &[TensorType]) -> Result<TensorType> {
    match op {
        Op::Reduce {
            op: reduce,
            dims,
            keepdim,
        } => {
            let t = &inputs[0];
            if t.dtype == DType::Bool || (*reduce == ReduceOp::Mean && !t.dtype.is_float()) {
                return Err(op_err!(DType, reduce.name(), "is not defined for {t}"));
            }
            for w in dims.windows(2) {
                if w[0] >= w[1] {
                    return Err(op_err!(
                        Argument,
                        reduce.name(),
                        "dims {dims:?} must be sorted and unique"
                    ));
                }
            }
            for &d in dims {
                check_dim(op, d, t)?;
            }
            Ok(TensorType {
                dtype: t.dtype,
                shape: reduced_shape(&t.shape, dims, *keepdim),
            })
        }
        Op::ArgReduce { dim, keepdim, .. } => {
            let t = &inputs[0];
            check_dim(op, *dim, t)?;
            if t.dtype == DType::Bool {
                return Err(op_err!(DType, op.name(), "is not defined for {t}"));
            }
            Ok(TensorType {
                dtype: DType::I64,
                shape: reduced_shape(&t.shape, &[*dim], *keepdim),
            })
        }
        Op::Softmax { dim } | Op::LogSoftmax { dim } => {
            require_float(op, &inputs[0])?;
            check_dim(op, *dim, &inputs[0])?;
            Ok(inputs[0].clone())
        }
        _ => Err(not_in_family(op, "reduce")),
    }
}

fn require_float(op: &Op, t: &TensorType) -> Result<()> {
    if !t.dtype.is_float() {
        return Err(op_err!(
            DType,
            op.name(),
            "needs a floating-point input, got {t}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testing::{err, t, ty};
    use super::*;
    use crate::ir::op::ArgReduceOp;

    fn reduce(op: ReduceOp, dims: &[usize], keepdim: bool) -> Op {
        Op::Reduce {
            op,
            dims: dims.to_vec(),
            keepdim,
        }
    }

    #[test]
    fn reductions_drop_or_keep_their_dims() {
        let x = t(&[2, 3, 4]);
        let sum = |dims: &[usize], keep| {
            reduce(ReduceOp::Sum, dims, keep)
                .infer(std::slice::from_ref(&x))
                .unwrap()
        };
        assert_eq!(sum(&[1], false), t(&[2, 4]));
        assert_eq!(sum(&[0, 2], true), t(&[1, 3, 1]));
        assert_eq!(sum(&[0, 1, 2], false), t(&[]));
        assert_eq!(sum(&[], false), x, "no dims: nothing reduced");
        let i = ty(DType::I32, &[5]);
        assert_eq!(
            reduce(ReduceOp::Max, &[0], false).infer(&[i]).unwrap(),
            ty(DType::I32, &[])
        );
    }

    #[test]
    fn reduction_errors_name_the_op_the_dims_and_the_type() {
        let x = t(&[2, 3]);
        assert_eq!(
            err(
                &reduce(ReduceOp::Sum, &[1, 0], false),
                std::slice::from_ref(&x)
            ),
            "sum: dims [1, 0] must be sorted and unique"
        );
        assert_eq!(
            err(
                &reduce(ReduceOp::Sum, &[1, 1], false),
                std::slice::from_ref(&x)
            ),
            "sum: dims [1, 1] must be sorted and unique"
        );
        assert_eq!(
            err(&reduce(ReduceOp::Max, &[2], false), &[x]),
            "max: dim 2 is out of range for f32[2,3] (rank 2)"
        );
        assert_eq!(
            err(
                &reduce(ReduceOp::Mean, &[0], false),
                &[ty(DType::I64, &[4])]
            ),
            "mean: is not defined for i64[4]"
        );
        assert_eq!(
            err(
                &reduce(ReduceOp::Sum, &[0], false),
                &[ty(DType::Bool, &[4])]
            ),
            "sum: is not defined for bool[4]"
        );
    }

    #[test]
    fn arg_reductions_give_i64_indices() {
        let argmax = |dim, keepdim| Op::ArgReduce {
            op: ArgReduceOp::ArgMax,
            dim,
            keepdim,
        };
        assert_eq!(
            argmax(1, false).infer(&[t(&[2, 3])]).unwrap(),
            ty(DType::I64, &[2])
        );
        assert_eq!(
            argmax(0, true).infer(&[ty(DType::I32, &[2, 3])]).unwrap(),
            ty(DType::I64, &[1, 3])
        );
        assert_eq!(
            err(&argmax(2, false), &[t(&[2, 3])]),
            "argmax: dim 2 is out of range for f32[2,3] (rank 2)"
        );
        assert_eq!(
            err(&argmax(0, false), &[ty(DType::Bool, &[2])]),
            "argmax: is not defined for bool[2]"
        );
    }

    #[test]
    fn softmax_needs_floats_and_a_dim() {
        let x = ty(DType::BF16, &[4, 8]);
        assert_eq!(
            Op::Softmax { dim: 1 }
                .infer(std::slice::from_ref(&x))
                .unwrap(),
            x
        );
        assert_eq!(
            err(&Op::LogSoftmax { dim: 0 }, &[ty(DType::I64, &[4])]),
            "log_softmax: needs a floating-point input, got i64[4]"
        );
        assert_eq!(
            err(&Op::Softmax { dim: 2 }, &[x]),
            "softmax: dim 2 is out of range for bf16[4,8] (rank 2)"
        );
        // The dtype is checked before the dim.
        assert_eq!(
            err(&Op::Softmax { dim: 5 }, &[ty(DType::I32, &[4])]),
            "softmax: needs a floating-point input, got i32[4]"
        );
    }
}
