//! Elementwise ops: the output has the input's shape (`unary`, `cast`, the
//! `tril`/`triu` masks) or the inputs' NumPy broadcast (`binary`,
//! `compare`, `where`). Inputs share one dtype (no implicit promotion);
//! bool takes no arithmetic, and only some unary ops take integers.

use super::{broadcast_shapes, describe, not_in_family, same_dtype, TensorType};
use crate::error::{op_err, Result};
use crate::ir::dtype::DType;
use crate::ir::op::Op;
use crate::ir::shape::Shape;

/// The type an elementwise op makes.
pub(super) fn infer(op: &Op, inputs: &[TensorType]) -> Result<TensorType> {
    match op {
        Op::Unary(u) => {
            let t = &inputs[0];
            let ok = if t.dtype.is_float() {
                u.accepts_float()
            } else {
                t.dtype != DType::Bool && u.accepts_int()
            };
            if !ok {
                return Err(op_err!(DType, u.name(), "is not defined for {t}"));
            }
            Ok(t.clone())
        }
        Op::Cast(d) => Ok(TensorType {
            dtype: *d,
            shape: inputs[0].shape.clone(),
        }),
        Op::BitCast(d) => {
            let from = inputs[0].dtype;
            if from.size_bytes() != d.size_bytes() || *d == DType::Bool || from == DType::Bool {
                return Err(op_err!(
                    DType,
                    "bitcast",
                    "reinterprets between dtypes of one width other than bool, got {} to {d}",
                    inputs[0]
                ));
            }
            Ok(TensorType {
                dtype: *d,
                shape: inputs[0].shape.clone(),
            })
        }
        Op::Binary(b) => {
            let dtype = same_dtype(op, inputs)?;
            if dtype == DType::Bool || (b.is_bitwise() && !dtype.is_int()) {
                return Err(op_err!(
                    DType,
                    b.name(),
                    "is not defined for {dtype} ({})",
                    describe(inputs)
                ));
            }
            Ok(TensorType {
                dtype,
                shape: broadcast_all(op, inputs)?,
            })
        }
        Op::Compare(_) => {
            same_dtype(op, inputs)?;
            Ok(TensorType {
                dtype: DType::Bool,
                shape: broadcast_all(op, inputs)?,
            })
        }
        Op::Where => {
            if inputs[0].dtype != DType::Bool {
                return Err(op_err!(
                    DType,
                    "where",
                    "condition must be bool, got {}",
                    inputs[0]
                ));
            }
            let dtype = same_dtype(op, &inputs[1..])?;
            Ok(TensorType {
                dtype,
                shape: broadcast_all(op, inputs)?,
            })
        }
        Op::Tril { .. } | Op::Triu { .. } => {
            if inputs[0].rank() < 2 {
                return Err(op_err!(
                    Shape,
                    op.name(),
                    "needs at least 2 dims, got {}",
                    inputs[0]
                ));
            }
            Ok(inputs[0].clone())
        }
        _ => Err(not_in_family(op, "elementwise")),
    }
}

/// The broadcast of every input's shape.
fn broadcast_all(op: &Op, inputs: &[TensorType]) -> Result<Shape> {
    let mut shape = inputs[0].shape.clone();
    for t in &inputs[1..] {
        shape = broadcast_shapes(&shape, &t.shape).ok_or_else(|| {
            op_err!(
                Shape,
                op.name(),
                "shapes {} cannot be broadcast together",
                describe(inputs)
            )
        })?;
    }
    Ok(shape)
}

#[cfg(test)]
mod tests {
    use super::super::testing::{err, t, ty};
    use super::*;
    use crate::error::ErrorKind;
    use crate::ir::op::{BinaryOp, CompareOp, UnaryOp};
    use crate::ir::shape::Dim;

    #[test]
    fn unary_keeps_the_type_and_checks_the_dtype() {
        let exp = Op::Unary(UnaryOp::Exp);
        assert_eq!(
            exp.infer(&[ty(DType::F16, &[2, 3])]).unwrap(),
            ty(DType::F16, &[2, 3])
        );
        assert_eq!(
            err(&exp, &[ty(DType::I64, &[2])]),
            "exp: is not defined for i64[2]"
        );
        let neg = Op::Unary(UnaryOp::Neg);
        assert!(UnaryOp::Neg.accepts_int());
        assert_eq!(
            neg.infer(&[ty(DType::I32, &[4])]).unwrap(),
            ty(DType::I32, &[4])
        );
        assert_eq!(
            err(&neg, &[ty(DType::Bool, &[4])]),
            "neg: is not defined for bool[4]"
        );
        let e = exp.infer(&[ty(DType::Bool, &[])]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::DType);
    }

    #[test]
    fn cast_changes_only_the_dtype() {
        let sym = TensorType::new(DType::F32, Shape(vec![Dim::sym("n"), Dim::Const(2)]));
        let out = Op::Cast(DType::Bool).infer(&[sym]).unwrap();
        assert_eq!(out.to_string(), "bool[n,2]");
    }

    #[test]
    fn binary_broadcasts_one_dtype() {
        let add = Op::Binary(BinaryOp::Add);
        assert_eq!(
            add.infer(&[t(&[4, 1, 3]), t(&[5, 1])]).unwrap(),
            t(&[4, 5, 3])
        );
        assert_eq!(add.infer(&[t(&[]), t(&[2])]).unwrap(), t(&[2]));
        assert_eq!(
            err(&add, &[t(&[4, 2]), t(&[3])]),
            "add: shapes f32[4,2], f32[3] cannot be broadcast together"
        );
        assert_eq!(
            err(
                &Op::Binary(BinaryOp::Sub),
                &[ty(DType::Bool, &[2]), ty(DType::Bool, &[2])]
            ),
            "sub: is not defined for bool (bool[2], bool[2])"
        );
        let e = add.infer(&[t(&[2]), ty(DType::I32, &[2])]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::DType);
        assert!(
            e.to_string()
                .starts_with("add: dtypes differ (f32[2], i32[2])"),
            "{e}"
        );
    }

    #[test]
    fn compare_makes_bool_and_takes_bool() {
        let lt = Op::Compare(CompareOp::Lt);
        assert_eq!(
            lt.infer(&[ty(DType::I64, &[3, 1]), ty(DType::I64, &[4])])
                .unwrap(),
            ty(DType::Bool, &[3, 4])
        );
        let eq = Op::Compare(CompareOp::Eq);
        assert_eq!(
            eq.infer(&[ty(DType::Bool, &[2]), ty(DType::Bool, &[2])])
                .unwrap(),
            ty(DType::Bool, &[2])
        );
        assert!(err(&lt, &[t(&[2]), ty(DType::F64, &[2])])
            .starts_with("lt: dtypes differ (f32[2], f64[2])"));
        assert_eq!(
            err(&lt, &[t(&[2]), t(&[3])]),
            "lt: shapes f32[2], f32[3] cannot be broadcast together"
        );
    }

    #[test]
    fn where_needs_a_bool_condition_and_broadcasts_all_three() {
        let cond = ty(DType::Bool, &[4, 1]);
        assert_eq!(
            Op::Where.infer(&[cond.clone(), t(&[3]), t(&[])]).unwrap(),
            t(&[4, 3])
        );
        assert_eq!(
            err(&Op::Where, &[t(&[4, 1]), t(&[3]), t(&[3])]),
            "where: condition must be bool, got f32[4,1]"
        );
        // The branches share a dtype; the condition is not one of them.
        assert!(
            err(&Op::Where, &[cond.clone(), t(&[3]), ty(DType::F64, &[3])])
                .starts_with("where: dtypes differ (f32[3], f64[3])")
        );
        assert_eq!(
            err(&Op::Where, &[cond, t(&[2]), t(&[3])]),
            "where: shapes bool[4,1], f32[2], f32[3] cannot be broadcast together"
        );
    }

    #[test]
    fn masks_need_two_dims() {
        let tril = Op::Tril { diagonal: -1 };
        assert_eq!(
            tril.infer(&[ty(DType::I64, &[2, 3, 3])]).unwrap(),
            ty(DType::I64, &[2, 3, 3])
        );
        assert_eq!(
            err(&Op::Triu { diagonal: 0 }, &[t(&[3])]),
            "triu: needs at least 2 dims, got f32[3]"
        );
        assert_eq!(
            err(&tril, &[t(&[])]),
            "tril: needs at least 2 dims, got f32[]"
        );
    }
}
