//! Type and shape inference: one function, used by eager execution, by graph
//! building and by the verifier, so the three can never disagree.
//!
//! [`Op::infer`] checks the arity, dispatches to the rules of the op's
//! family and checks the result against the size limit. One file per
//! family: `creation` (constants, fills, ranges, random), `elementwise`
//! (unary, cast, binary and compare ops with broadcasting, `where`, the
//! `tril`/`triu` masks), `reduce` (reductions, arg-reductions, softmax),
//! `matmul` (matmul and its transposed-operand form), `view` (reshape,
//! permute, expand, slice, cat, contiguous), `index` (index_select,
//! gather and their gradients index_add, scatter_add) and `custom`
//! (custom calls, flash attention among them, and their extra outputs).
//! Every error names the op and the input types.

mod creation;
mod custom;
mod elementwise;
mod index;
mod matmul;
mod reduce;
mod view;

use std::fmt;

use super::dtype::DType;
use super::op::Op;
use super::shape::{Dim, Shape};
use crate::error::{op_err, Error, Result};

pub use creation::arange_len;
pub use reduce::reduced_shape;
pub use view::slice_len;

/// The type of a value: dtype and shape.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TensorType {
    pub dtype: DType,
    pub shape: Shape,
}

impl TensorType {
    pub fn new(dtype: DType, shape: impl Into<Shape>) -> TensorType {
        TensorType {
            dtype,
            shape: shape.into(),
        }
    }

    pub fn rank(&self) -> usize {
        self.shape.rank()
    }

    /// Checks a concrete type against the size limit ([`crate::limits`]),
    /// naming `op` in the error; a symbolic shape passes (it is checked
    /// when its symbols get values).
    pub fn check_size(&self, op: &str) -> Result<()> {
        match self.shape.as_concrete() {
            Some(dims) => crate::limits::check(op, self.dtype, &dims).map(|_| ()),
            None => Ok(()),
        }
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.dtype, self.shape)
    }
}

impl fmt::Debug for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `f32[2,3], f32[4]` — the inputs as printed in error messages.
pub fn describe(inputs: &[TensorType]) -> String {
    inputs
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// NumPy broadcasting of two shapes (right-aligned; equal dims or a 1).
pub fn broadcast_shapes(a: &Shape, b: &Shape) -> Option<Shape> {
    let rank = a.rank().max(b.rank());
    let mut out = Vec::with_capacity(rank);
    for i in 0..rank {
        let da = (i + a.rank()).checked_sub(rank).map(|j| &a.0[j]);
        let db = (i + b.rank()).checked_sub(rank).map(|j| &b.0[j]);
        let d = match (da, db) {
            (Some(x), None) | (None, Some(x)) => x.clone(),
            (Some(x), Some(y)) if x == y => x.clone(),
            (Some(Dim::Const(1)), Some(y)) => y.clone(),
            (Some(x), Some(Dim::Const(1))) => x.clone(),
            _ => return None,
        };
        out.push(d);
    }
    Some(Shape(out))
}

/// The one dtype of `inputs`; tessera does not promote.
fn same_dtype(op: &Op, inputs: &[TensorType]) -> Result<DType> {
    let d = inputs[0].dtype;
    if inputs.iter().any(|t| t.dtype != d) {
        return Err(op_err!(
            DType,
            op.name(),
            "dtypes differ ({}); tessera does not promote implicitly, cast one input with .cast()",
            describe(inputs)
        ));
    }
    Ok(d)
}

/// `dim` is a dim of `t`.
fn check_dim(op: &Op, dim: usize, t: &TensorType) -> Result<()> {
    if dim >= t.rank() {
        return Err(op_err!(
            Argument,
            op.name(),
            "dim {dim} is out of range for {t} (rank {})",
            t.rank()
        ));
    }
    Ok(())
}

/// The error of a family's rules called with an op of another family (the
/// dispatch in [`Op::infer`] never does).
fn not_in_family(op: &Op, family: &str) -> Error {
    op_err!(
        Verify,
        op.name(),
        "is not a {family} op (type inference dispatched it wrongly)"
    )
}

impl Op {
    /// Infers the output type from the input types, or explains why the
    /// inputs do not fit. `Op::Input` has no rule: its type is declared.
    /// A concrete output past the size limit is an error
    /// ([`crate::limits`]): every value an op makes, eager or in a graph,
    /// is within it.
    pub fn infer(&self, inputs: &[TensorType]) -> Result<TensorType> {
        let ty = self.infer_type(inputs)?;
        ty.check_size(self.name())?;
        Ok(ty)
    }

    fn infer_type(&self, inputs: &[TensorType]) -> Result<TensorType> {
        self.check_arity(inputs)?;
        match self {
            Op::Input => Err(op_err!(
                Verify,
                "input",
                "an input's type is declared, not inferred"
            )),
            Op::Constant(_)
            | Op::Full { .. }
            | Op::Arange { .. }
            | Op::Rand { .. }
            | Op::Randn { .. } => creation::infer(self, inputs),
            Op::Unary(_)
            | Op::Cast(_)
            | Op::BitCast(_)
            | Op::Binary(_)
            | Op::Compare(_)
            | Op::Where
            | Op::Tril { .. }
            | Op::Triu { .. } => elementwise::infer(self, inputs),
            Op::Reduce { .. }
            | Op::ArgReduce { .. }
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. } => reduce::infer(self, inputs),
            Op::MatMul | Op::MatMulT { .. } => matmul::infer(self, inputs),
            Op::Reshape(_)
            | Op::Permute(_)
            | Op::Expand(_)
            | Op::Slice { .. }
            | Op::Cat { .. }
            | Op::Contiguous => view::infer(self, inputs),
            Op::IndexSelect { .. }
            | Op::Gather { .. }
            | Op::IndexAdd { .. }
            | Op::ScatterAdd { .. } => index::infer(self, inputs),
            Op::Custom(_) | Op::CustomOutput { .. } => custom::infer(self, inputs),
        }
    }

    /// The op's fixed number of inputs, or at least one (custom calls may
    /// take none).
    fn check_arity(&self, inputs: &[TensorType]) -> Result<()> {
        if let Some(n) = self.arity() {
            if inputs.len() != n {
                return Err(op_err!(
                    Argument,
                    self.name(),
                    "takes {n} inputs, got {}",
                    inputs.len()
                ));
            }
        } else if inputs.is_empty() && !matches!(self, Op::Custom(_)) {
            return Err(op_err!(Argument, self.name(), "needs at least one input"));
        }
        Ok(())
    }
}

/// Helpers of the families' tests.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// An f32 type of concrete `dims`.
    pub fn t(dims: &[usize]) -> TensorType {
        TensorType::new(DType::F32, dims.to_vec())
    }

    /// A type of `dtype` and concrete `dims`.
    pub fn ty(dtype: DType, dims: &[usize]) -> TensorType {
        TensorType::new(dtype, dims.to_vec())
    }

    /// The error message of inferring `op` on `inputs`, which must fail.
    pub fn err(op: &Op, inputs: &[TensorType]) -> String {
        match op.infer(inputs) {
            Ok(out) => panic!(
                "{} on {} gave {out}, expected an error",
                op.name(),
                describe(inputs)
            ),
            Err(e) => e.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{err, t, ty};
    use super::*;
    use crate::error::ErrorKind;
    use crate::ir::op::{BinaryOp, UnaryOp};

    #[test]
    fn broadcasting_is_right_aligned() {
        let s = |d: &[usize]| Shape::from_concrete(d);
        assert_eq!(
            broadcast_shapes(&s(&[4, 1, 3]), &s(&[5, 1])),
            Some(s(&[4, 5, 3]))
        );
        assert_eq!(broadcast_shapes(&s(&[]), &s(&[2, 3])), Some(s(&[2, 3])));
        assert_eq!(broadcast_shapes(&s(&[4, 2]), &s(&[3])), None);
        let sym = Shape(vec![Dim::sym("s0"), Dim::Const(1)]);
        assert_eq!(
            broadcast_shapes(&sym, &s(&[3])).unwrap().to_string(),
            "[s0,3]"
        );
        assert_eq!(
            broadcast_shapes(&sym, &Shape(vec![Dim::sym("s1"), Dim::Const(3)])),
            None
        );
    }

    #[test]
    fn the_arity_is_checked_first_naming_the_op() {
        assert_eq!(
            err(&Op::Binary(BinaryOp::Add), &[t(&[2])]),
            "add: takes 2 inputs, got 1"
        );
        assert_eq!(
            err(&Op::Cat { dim: 0 }, &[]),
            "cat: needs at least one input"
        );
        let e = Op::Unary(UnaryOp::Exp).infer(&[]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Argument);
        assert_eq!(e.op.as_deref(), Some("exp"));
    }

    #[test]
    fn an_input_has_no_rule() {
        let e = Op::Input.infer(&[]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Verify);
        assert_eq!(
            e.to_string(),
            "input: an input's type is declared, not inferred"
        );
    }

    #[test]
    fn a_result_past_the_size_limit_is_an_error() {
        let huge = ty(DType::F64, &[1 << 31, 1 << 31]);
        let e = Op::Unary(UnaryOp::Exp).infer(&[huge]).unwrap_err();
        assert_eq!(e.op.as_deref(), Some("exp"));
        assert!(e.to_string().contains("too large"), "{e}");
    }

    #[test]
    fn dtypes_are_never_promoted() {
        let e = err(&Op::Binary(BinaryOp::Mul), &[t(&[2]), ty(DType::F64, &[2])]);
        assert_eq!(
            e,
            "mul: dtypes differ (f32[2], f64[2]); tessera does not promote implicitly, cast one input with .cast()"
        );
    }

    #[test]
    fn a_family_refuses_an_op_of_another() {
        let e = view::infer(&Op::MatMul, &[t(&[2, 2]), t(&[2, 2])]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Verify);
        assert!(e.to_string().starts_with("matmul: is not a view op"), "{e}");
        for (family, result) in [
            ("creation", creation::infer(&Op::Contiguous, &[])),
            (
                "elementwise",
                elementwise::infer(&Op::Contiguous, &[t(&[1])]),
            ),
            ("reduce", reduce::infer(&Op::Contiguous, &[t(&[1])])),
            ("matmul", matmul::infer(&Op::Contiguous, &[t(&[1])])),
            ("index", index::infer(&Op::Contiguous, &[t(&[1])])),
            ("custom", custom::infer(&Op::Contiguous, &[t(&[1])])),
        ] {
            let e = result.unwrap_err();
            assert_eq!(
                e.to_string(),
                format!("contiguous: is not a {family} op (type inference dispatched it wrongly)")
            );
        }
    }
}
