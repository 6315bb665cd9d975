//! Type and shape inference: one function, used by eager execution, by graph
//! building and by the verifier, so the three can never disagree.

use std::fmt;

use super::dtype::DType;
use super::op::{LiteralData, Op};
use super::shape::{Dim, Shape};
use crate::error::{op_err, Result};

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

/// Number of elements of `arange(start, end, step)`.
pub fn arange_len(start: f64, end: f64, step: f64) -> Option<usize> {
    if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
        return None;
    }
    Some(((end - start) / step).ceil().max(0.0) as usize)
}

/// Output length of a slice along a dim of size `size` (bounds already clamped).
pub fn slice_len(start: usize, end: usize, step: usize) -> usize {
    if end <= start {
        0
    } else {
        (end - start).div_ceil(step)
    }
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
        match self {
            Op::Input => Err(op_err!(
                Verify,
                "input",
                "an input's type is declared, not inferred"
            )),
            Op::Constant(lit) => {
                let numel = crate::limits::check("constant", lit.dtype, &lit.shape)?;
                let kind_ok = match &lit.data {
                    LiteralData::Float(_) => lit.dtype.is_float(),
                    LiteralData::Int(_) => lit.dtype.is_int(),
                    LiteralData::Bool(_) => lit.dtype == DType::Bool,
                };
                if let (LiteralData::Int(values), true) = (&lit.data, kind_ok) {
                    if let Some(v) = values.iter().find(|&&v| !lit.dtype.holds_int(v)) {
                        return Err(op_err!(
                            Argument,
                            "constant",
                            "value {v} does not fit in {}",
                            lit.dtype
                        ));
                    }
                }
                if numel != lit.data.len() || !kind_ok {
                    return Err(op_err!(
                        Shape,
                        "constant",
                        "{} values of kind {:?} do not fill {}{:?}",
                        lit.data.len(),
                        std::mem::discriminant(&lit.data),
                        lit.dtype,
                        lit.shape
                    ));
                }
                Ok(TensorType::new(lit.dtype, Shape::from_concrete(&lit.shape)))
            }
            Op::Full {
                shape,
                dtype,
                value,
            } => {
                if let (super::op::Scalar::Int(v), true) = (value, dtype.is_int()) {
                    if !dtype.holds_int(*v) {
                        return Err(op_err!(
                            Argument,
                            "full",
                            "value {v} does not fit in {dtype}"
                        ));
                    }
                }
                Ok(TensorType {
                    dtype: *dtype,
                    shape: shape.clone(),
                })
            }
            Op::Arange {
                start,
                end,
                step,
                dtype,
            } => {
                let n = arange_len(*start, *end, *step).ok_or_else(|| {
                    op_err!(
                        Argument,
                        "arange",
                        "bad range start={start} end={end} step={step}"
                    )
                })?;
                if *dtype == DType::Bool {
                    return Err(op_err!(DType, "arange", "cannot produce bool"));
                }
                Ok(TensorType::new(*dtype, vec![n]))
            }
            Op::Rand { shape, dtype, .. } | Op::Randn { shape, dtype, .. } => {
                if !dtype.is_float() {
                    return Err(op_err!(
                        DType,
                        self.name(),
                        "produces floats, asked for {dtype}"
                    ));
                }
                Ok(TensorType {
                    dtype: *dtype,
                    shape: shape.clone(),
                })
            }
            Op::Unary(u) => {
                let t = &inputs[0];
                if t.dtype == DType::Bool || (!u.accepts_int() && !t.dtype.is_float()) {
                    return Err(op_err!(DType, u.name(), "is not defined for {t}"));
                }
                Ok(t.clone())
            }
            Op::Cast(d) => Ok(TensorType {
                dtype: *d,
                shape: inputs[0].shape.clone(),
            }),
            Op::Binary(b) => {
                let dtype = same_dtype(self, inputs)?;
                if dtype == DType::Bool {
                    return Err(op_err!(
                        DType,
                        b.name(),
                        "is not defined for bool ({})",
                        describe(inputs)
                    ));
                }
                Ok(TensorType {
                    dtype,
                    shape: broadcast_all(self, inputs)?,
                })
            }
            Op::Compare(_) => {
                same_dtype(self, inputs)?;
                Ok(TensorType {
                    dtype: DType::Bool,
                    shape: broadcast_all(self, inputs)?,
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
                let dtype = same_dtype(self, &inputs[1..])?;
                Ok(TensorType {
                    dtype,
                    shape: broadcast_all(self, inputs)?,
                })
            }
            Op::Reduce { op, dims, keepdim } => {
                let t = &inputs[0];
                if t.dtype == DType::Bool
                    || (*op == super::op::ReduceOp::Mean && !t.dtype.is_float())
                {
                    return Err(op_err!(DType, op.name(), "is not defined for {t}"));
                }
                for w in dims.windows(2) {
                    if w[0] >= w[1] {
                        return Err(op_err!(
                            Argument,
                            op.name(),
                            "dims {dims:?} must be sorted and unique"
                        ));
                    }
                }
                for &d in dims {
                    check_dim(self, d, t)?;
                }
                Ok(TensorType {
                    dtype: t.dtype,
                    shape: reduced_shape(&t.shape, dims, *keepdim),
                })
            }
            Op::ArgReduce { dim, keepdim, .. } => {
                let t = &inputs[0];
                check_dim(self, *dim, t)?;
                if t.dtype == DType::Bool {
                    return Err(op_err!(DType, self.name(), "is not defined for {t}"));
                }
                Ok(TensorType {
                    dtype: DType::I64,
                    shape: reduced_shape(&t.shape, &[*dim], *keepdim),
                })
            }
            Op::Softmax { dim } | Op::LogSoftmax { dim } => {
                require_float(self, &inputs[0])?;
                check_dim(self, *dim, &inputs[0])?;
                Ok(inputs[0].clone())
            }
            Op::MatMul => infer_matmul(inputs),
            Op::MatMulT {
                transpose_a,
                transpose_b,
            } => {
                let a = transposed_last2(self, &inputs[0], *transpose_a)?;
                let b = transposed_last2(self, &inputs[1], *transpose_b)?;
                infer_matmul(&[a, b])
            }
            Op::Reshape(shape) => {
                let t = &inputs[0];
                TensorType {
                    dtype: t.dtype,
                    shape: shape.clone(),
                }
                .check_size("reshape")?;
                let (from, to) = match (t.shape.checked_numel(), shape.checked_numel()) {
                    (Some(from), Some(to)) => (from, to),
                    _ => {
                        return Err(op_err!(
                            Shape,
                            "reshape",
                            "the element count of {t} or {shape} overflows"
                        ))
                    }
                };
                if from != to {
                    return Err(op_err!(
                        Shape,
                        "reshape",
                        "cannot reshape {t} ({from} elements) to {shape} ({to} elements)"
                    ));
                }
                Ok(TensorType {
                    dtype: t.dtype,
                    shape: shape.clone(),
                })
            }
            Op::Permute(perm) => {
                let t = &inputs[0];
                let mut seen = vec![false; t.rank()];
                let valid = perm.len() == t.rank()
                    && perm
                        .iter()
                        .all(|&p| p < t.rank() && !std::mem::replace(&mut seen[p], true));
                if !valid {
                    return Err(op_err!(
                        Argument,
                        "permute",
                        "{perm:?} is not a permutation of the dims of {t}"
                    ));
                }
                Ok(TensorType {
                    dtype: t.dtype,
                    shape: Shape(perm.iter().map(|&p| t.shape.0[p].clone()).collect()),
                })
            }
            Op::Expand(shape) => {
                let t = &inputs[0];
                let ok = shape.rank() >= t.rank()
                    && broadcast_shapes(&t.shape, shape).as_ref() == Some(shape);
                if !ok {
                    return Err(op_err!(Shape, "expand", "cannot expand {t} to {shape}"));
                }
                Ok(TensorType {
                    dtype: t.dtype,
                    shape: shape.clone(),
                })
            }
            Op::Slice {
                dim,
                start,
                end,
                step,
            } => {
                let t = &inputs[0];
                check_dim(self, *dim, t)?;
                if *step == 0 {
                    return Err(op_err!(Argument, "slice", "step must be positive"));
                }
                let mut shape = t.shape.clone();
                match &t.shape.0[*dim] {
                    Dim::Const(size) => {
                        if start > end || end > size {
                            return Err(op_err!(
                                Argument,
                                "slice",
                                "range {start}..{end} is out of bounds for dim {dim} of {t}"
                            ));
                        }
                    }
                    Dim::Sym(_) => {
                        return Err(op_err!(
                            Unsupported,
                            "slice",
                            "slicing symbolic dim {dim} of {t}"
                        ));
                    }
                }
                shape.0[*dim] = Dim::Const(slice_len(*start, *end, *step));
                Ok(TensorType {
                    dtype: t.dtype,
                    shape,
                })
            }
            Op::Cat { dim } => {
                let dtype = same_dtype(self, inputs)?;
                let first = &inputs[0];
                check_dim(self, *dim, first)?;
                let mut shape = first.shape.clone();
                for t in &inputs[1..] {
                    let fits = t.rank() == first.rank()
                        && (0..t.rank()).all(|i| i == *dim || t.shape.0[i] == first.shape.0[i]);
                    if !fits {
                        return Err(op_err!(
                            Shape,
                            "cat",
                            "inputs must match in every dim but {dim}: {}",
                            describe(inputs)
                        ));
                    }
                    shape.0[*dim] =
                        shape.0[*dim].checked_add(&t.shape.0[*dim]).ok_or_else(|| {
                            op_err!(
                                Shape,
                                "cat",
                                "the size of dim {dim} overflows: {}",
                                describe(inputs)
                            )
                        })?;
                }
                Ok(TensorType { dtype, shape })
            }
            Op::Contiguous => Ok(inputs[0].clone()),
            Op::Tril { .. } | Op::Triu { .. } => {
                if inputs[0].rank() < 2 {
                    return Err(op_err!(
                        Shape,
                        self.name(),
                        "needs at least 2 dims, got {}",
                        inputs[0]
                    ));
                }
                Ok(inputs[0].clone())
            }
            Op::IndexSelect { dim } => {
                let (x, idx) = (&inputs[0], &inputs[1]);
                check_dim(self, *dim, x)?;
                require_index(self, idx)?;
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
                check_dim(self, *dim, x)?;
                require_index(self, idx)?;
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
                check_dim(self, *dim, base)?;
                require_index(self, idx)?;
                same_dtype(self, &[base.clone(), src.clone()])?;
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
                check_dim(self, *dim, base)?;
                require_index(self, idx)?;
                same_dtype(self, &[base.clone(), src.clone()])?;
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
            Op::Custom(call) => Ok(call.infer(inputs)?.swap_remove(0)),
            Op::CustomOutput {
                index,
                dtype,
                shape,
            } => {
                if *index == 0 {
                    return Err(op_err!(
                        Argument,
                        "custom_output",
                        "output 0 is the custom node itself; indices start at 1"
                    ));
                }
                Ok(TensorType::new(*dtype, shape.clone()))
            }
        }
    }
}

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
    use super::*;
    use crate::ir::op::BinaryOp;

    fn t(d: &[usize]) -> TensorType {
        TensorType::new(DType::F32, d.to_vec())
    }

    #[test]
    fn broadcasting() {
        let out = Op::Binary(BinaryOp::Add)
            .infer(&[t(&[4, 1, 3]), t(&[5, 1])])
            .unwrap();
        assert_eq!(out, t(&[4, 5, 3]));
        let err = Op::Binary(BinaryOp::Add)
            .infer(&[t(&[4, 2]), t(&[3])])
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("add: shapes f32[4,2], f32[3] cannot be broadcast"),
            "{err}"
        );
    }

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
        let err = Op::MatMul.infer(&[t(&[3, 4]), t(&[5, 6])]).unwrap_err();
        assert!(
            err.to_string()
                .contains("inner dims differ: f32[3,4] and f32[5,6]"),
            "{err}"
        );
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
        let err = op(true, false).infer(&[t(&[4]), t(&[4])]).unwrap_err();
        assert!(
            err.to_string()
                .contains("matmul_t: a transposed operand needs at least 2 dims, got f32[4]"),
            "{err}"
        );
    }

    #[test]
    fn symbolic_cat_and_reshape() {
        let x = TensorType {
            dtype: DType::F32,
            shape: Shape(vec![Dim::sym("s0"), Dim::Const(4)]),
        };
        let out = Op::Cat { dim: 0 }.infer(&[x.clone(), x.clone()]).unwrap();
        assert_eq!(out.shape.to_string(), "[2*s0,4]");
        let flat = Op::Reshape(Shape(vec![&Dim::sym("s0") * &Dim::Const(4)]))
            .infer(&[x])
            .unwrap();
        assert_eq!(flat.shape.to_string(), "[4*s0]");
    }
}
