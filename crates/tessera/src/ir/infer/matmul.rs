//! Matrix products: `matmul` as `torch.matmul` (1-D operands promoted and
//! the added dim removed, leading batch dims broadcast, one dtype, no
//! bool) and `matmul_t`, the same on operands whose last two dims are
//! swapped. (Attention is a custom op: see [`super::custom`].)

use super::{broadcast_shapes, describe, not_in_family, same_dtype, TensorType};
use crate::error::{op_err, Result};
use crate::ir::dtype::DType;
use crate::ir::op::Op;
use crate::ir::shape::{Dim, Shape};

/// The type a matrix product makes.
pub(super) fn infer(op: &Op, inputs: &[TensorType]) -> Result<TensorType> {
    match op {
        Op::MatMul => infer_matmul(inputs),
        Op::MatMulT {
            transpose_a,
            transpose_b,
        } => {
            let a = transposed_last2(op, &inputs[0], *transpose_a)?;
            let b = transposed_last2(op, &inputs[1], *transpose_b)?;
            infer_matmul(&[a, b])
        }
        _ => Err(not_in_family(op, "matmul")),
    }
}

/// `t` with its last two dims swapped when `transpose` (`matmul_t`'s view
/// of an operand); a transposed operand needs two dims to swap.
fn transposed_last2(op: &Op, t: &TensorType, transpose: bool) -> Result<TensorType> {
    if !transpose {
        return Ok(t.clone());
    }
    let r = t.rank();
    if r < 2 {
        return Err(op_err!(
            Shape,
            op.name(),
            "a transposed operand needs at least 2 dims, got {t}"
        ));
    }
    let mut shape = t.shape.clone();
    shape.0.swap(r - 2, r - 1);
    Ok(TensorType {
        dtype: t.dtype,
        shape,
    })
}

fn infer_matmul(inputs: &[TensorType]) -> Result<TensorType> {
    let (a, b) = (&inputs[0], &inputs[1]);
    let dtype = same_dtype(&Op::MatMul, inputs)?;
    if dtype == DType::Bool {
        return Err(op_err!(
            DType,
            "matmul",
            "is not defined for bool ({})",
            describe(inputs)
        ));
    }
    if a.rank() == 0 || b.rank() == 0 {
        return Err(op_err!(
            Shape,
            "matmul",
            "operands must have at least 1 dim, got {}",
            describe(inputs)
        ));
    }
    // Promote 1-D operands as torch.matmul does.
    let a_shape: Vec<Dim> = if a.rank() == 1 {
        vec![Dim::Const(1), a.shape.0[0].clone()]
    } else {
        a.shape.0.clone()
    };
    let b_shape: Vec<Dim> = if b.rank() == 1 {
        vec![b.shape.0[0].clone(), Dim::Const(1)]
    } else {
        b.shape.0.clone()
    };
    let (ra, rb) = (a_shape.len(), b_shape.len());
    let (m, k1) = (&a_shape[ra - 2], &a_shape[ra - 1]);
    let (k2, n) = (&b_shape[rb - 2], &b_shape[rb - 1]);
    if k1 != k2 {
        return Err(op_err!(
            Shape,
            "matmul",
            "inner dims differ: {} and {} (contracting {k1} with {k2})",
            a,
            b
        ));
    }
    let batch = broadcast_shapes(
        &Shape(a_shape[..ra - 2].to_vec()),
        &Shape(b_shape[..rb - 2].to_vec()),
    )
    .ok_or_else(|| {
        op_err!(
            Shape,
            "matmul",
            "batch dims of {a} and {b} cannot be broadcast"
        )
    })?;
    let mut out = batch.0;
    if a.rank() > 1 {
        out.push(m.clone());
    }
    if b.rank() > 1 {
        out.push(n.clone());
    }
    Ok(TensorType {
        dtype,
        shape: Shape(out),
    })
}

#[cfg(test)]
mod tests {
    use super::super::testing::{err, t, ty};
    use super::*;

    #[test]
    fn matmul_shapes() {
        assert_eq!(
            Op::MatMul
                .infer(&[t(&[2, 1, 3, 4]), t(&[5, 4, 6])])
                .unwrap(),
            t(&[2, 5, 3, 6])
        );
        assert_eq!(Op::MatMul.infer(&[t(&[4]), t(&[4])]).unwrap(), t(&[]));
        assert_eq!(Op::MatMul.infer(&[t(&[3, 4]), t(&[4])]).unwrap(), t(&[3]));
        assert_eq!(
            Op::MatMul.infer(&[t(&[4]), t(&[2, 4, 5])]).unwrap(),
            t(&[2, 5])
        );
        let sym = TensorType::new(DType::F16, Shape(vec![Dim::sym("n"), Dim::Const(4)]));
        let out = Op::MatMul.infer(&[sym, ty(DType::F16, &[4, 2])]).unwrap();
        assert_eq!(out.to_string(), "f16[n,2]");
    }

    #[test]
    fn matmul_errors_name_both_operands() {
        assert_eq!(
            err(&Op::MatMul, &[t(&[3, 4]), t(&[5, 6])]),
            "matmul: inner dims differ: f32[3,4] and f32[5,6] (contracting 4 with 5)"
        );
        assert_eq!(
            err(&Op::MatMul, &[t(&[2, 3, 4]), t(&[3, 4, 5])]),
            "matmul: batch dims of f32[2,3,4] and f32[3,4,5] cannot be broadcast"
        );
        assert_eq!(
            err(&Op::MatMul, &[t(&[]), t(&[3])]),
            "matmul: operands must have at least 1 dim, got f32[], f32[3]"
        );
        let b = ty(DType::Bool, &[2, 2]);
        assert_eq!(
            err(&Op::MatMul, &[b.clone(), b]),
            "matmul: is not defined for bool (bool[2,2], bool[2,2])"
        );
        assert!(err(&Op::MatMul, &[t(&[2, 2]), ty(DType::F64, &[2, 2])])
            .starts_with("matmul: dtypes differ (f32[2,2], f64[2,2])"));
    }

    #[test]
    fn matmul_t_shapes() {
        let op = |transpose_a, transpose_b| Op::MatMulT {
            transpose_a,
            transpose_b,
        };
        assert_eq!(
            op(true, false).infer(&[t(&[2, 4, 3]), t(&[4, 5])]).unwrap(),
            t(&[2, 3, 5])
        );
        assert_eq!(
            op(true, true).infer(&[t(&[4, 3]), t(&[5, 4])]).unwrap(),
            t(&[3, 5])
        );
        assert_eq!(
            op(false, true).infer(&[t(&[4]), t(&[5, 4])]).unwrap(),
            t(&[5])
        );
        assert_eq!(
            err(&op(true, false), &[t(&[4]), t(&[4])]),
            "matmul_t: a transposed operand needs at least 2 dims, got f32[4]"
        );
        // The product's own errors speak of the transposed operands.
        assert_eq!(
            err(&op(false, true), &[t(&[3, 4]), t(&[4, 5])]),
            "matmul: inner dims differ: f32[3,4] and f32[5,4] (contracting 4 with 5)"
        );
    }
}
