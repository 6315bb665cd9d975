//! Shape and view ops: `reshape` (same element count), `permute` (a
//! permutation of the dims), `expand` (broadcast to a shape), `slice`
//! (in-bounds range of a concrete dim), `cat` (equal in every dim but one)
//! and `contiguous` (the input's type).

use super::{broadcast_shapes, check_dim, describe, not_in_family, same_dtype, TensorType};
use crate::error::{op_err, Result};
use crate::ir::op::Op;
use crate::ir::shape::{Dim, Shape};

/// Output length of a slice along a dim of size `size` (bounds already clamped).
pub fn slice_len(start: usize, end: usize, step: usize) -> usize {
    if end <= start {
        0
    } else {
        (end - start).div_ceil(step)
    }
}

/// The type a shape or view op makes.
pub(super) fn infer(op: &Op, inputs: &[TensorType]) -> Result<TensorType> {
    match op {
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
            check_dim(op, *dim, t)?;
            if *step == 0 {
                return Err(op_err!(Argument, "slice", "step must be positive"));
            }
            let mut shape = t.shape.clone();
            shape.0[*dim] = match (&t.shape.0[*dim], end) {
                (Dim::Const(size), Dim::Const(end)) => {
                    if start > end || end > size {
                        return Err(op_err!(
                            Argument,
                            "slice",
                            "range {start}..{end} is out of bounds for dim {dim} of {t}"
                        ));
                    }
                    Dim::Const(slice_len(*start, *end, *step))
                }
                // `0..end` of a dim the symbols bind: its bound is checked
                // when they are (the graph is made concrete to run).
                (_, Dim::Sym(_)) if *start == 0 && *step == 1 => end.clone(),
                (Dim::Sym(_), _) => {
                    return Err(op_err!(
                        Unsupported,
                        "slice",
                        "slicing symbolic dim {dim} of {t}"
                    ));
                }
                (_, Dim::Sym(_)) => {
                    return Err(op_err!(
                        Unsupported,
                        "slice",
                        "a symbolic end {end} needs start 0 and step 1, got {start} and {step}"
                    ));
                }
            };
            Ok(TensorType {
                dtype: t.dtype,
                shape,
            })
        }
        Op::Cat { dim } => {
            let dtype = same_dtype(op, inputs)?;
            let first = &inputs[0];
            check_dim(op, *dim, first)?;
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
                shape.0[*dim] = shape.0[*dim].checked_add(&t.shape.0[*dim]).ok_or_else(|| {
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
        _ => Err(not_in_family(op, "view")),
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{err, t, ty};
    use super::*;
    use crate::ir::dtype::DType;

    fn shape(dims: &[usize]) -> Shape {
        Shape::from_concrete(dims)
    }

    fn sym(dims: &[&str]) -> Shape {
        Shape(
            dims.iter()
                .map(|d| d.parse().map_or_else(|_| Dim::sym(d), Dim::Const))
                .collect(),
        )
    }

    #[test]
    fn reshape_keeps_the_element_count() {
        let x = ty(DType::I32, &[2, 6]);
        assert_eq!(
            Op::Reshape(shape(&[3, 4]))
                .infer(std::slice::from_ref(&x))
                .unwrap(),
            ty(DType::I32, &[3, 4])
        );
        assert_eq!(
            Op::Reshape(shape(&[]))
                .infer(&[ty(DType::I32, &[1, 1])])
                .unwrap(),
            ty(DType::I32, &[])
        );
        assert_eq!(
            err(&Op::Reshape(shape(&[5])), &[x]),
            "reshape: cannot reshape i32[2,6] (12 elements) to [5] (5 elements)"
        );
        let s = TensorType::new(DType::F32, sym(&["s0", "4"]));
        let flat = Op::Reshape(Shape(vec![&Dim::sym("s0") * &Dim::Const(4)]));
        assert_eq!(
            flat.infer(std::slice::from_ref(&s))
                .unwrap()
                .shape
                .to_string(),
            "[4*s0]"
        );
        assert_eq!(
            err(&Op::Reshape(shape(&[8])), &[s]),
            "reshape: cannot reshape f32[s0,4] (4*s0 elements) to [8] (8 elements)"
        );
    }

    #[test]
    fn reshape_checks_the_target_size_and_overflow() {
        let huge = shape(&[1 << 40, 1 << 40]);
        let e = err(&Op::Reshape(huge), &[t(&[4])]);
        assert!(
            e.starts_with("reshape: f32[1099511627776,1099511627776] is too large"),
            "{e}"
        );
        let over = shape(&[usize::MAX, 2]);
        let e = err(&Op::Reshape(over), &[t(&[4])]);
        assert!(e.starts_with("reshape: "), "{e}");
    }

    #[test]
    fn permute_needs_a_permutation() {
        let x = t(&[2, 3, 4]);
        assert_eq!(
            Op::Permute(vec![2, 0, 1])
                .infer(std::slice::from_ref(&x))
                .unwrap(),
            t(&[4, 2, 3])
        );
        for bad in [vec![0, 1], vec![0, 0, 1], vec![0, 1, 3]] {
            assert_eq!(
                err(&Op::Permute(bad.clone()), std::slice::from_ref(&x)),
                format!("permute: {bad:?} is not a permutation of the dims of f32[2,3,4]")
            );
        }
    }

    #[test]
    fn expand_stretches_ones_and_adds_leading_dims() {
        assert_eq!(
            Op::Expand(shape(&[5, 2, 3])).infer(&[t(&[1, 3])]).unwrap(),
            t(&[5, 2, 3])
        );
        assert_eq!(
            err(&Op::Expand(shape(&[2, 4])), &[t(&[2, 3])]),
            "expand: cannot expand f32[2,3] to [2,4]"
        );
        // Fewer dims than the input is no expansion.
        assert_eq!(
            err(&Op::Expand(shape(&[3])), &[t(&[1, 3])]),
            "expand: cannot expand f32[1,3] to [3]"
        );
    }

    #[test]
    fn slice_is_in_bounds_of_a_concrete_dim() {
        let slice = |dim, start, end, step| Op::Slice {
            dim,
            start,
            end: Dim::Const(end),
            step,
        };
        assert_eq!(slice(1, 1, 8, 3).infer(&[t(&[2, 8])]).unwrap(), t(&[2, 3]));
        assert_eq!(slice(0, 2, 2, 1).infer(&[t(&[2, 8])]).unwrap(), t(&[0, 8]));
        assert_eq!(
            err(&slice(1, 0, 9, 1), &[t(&[2, 8])]),
            "slice: range 0..9 is out of bounds for dim 1 of f32[2,8]"
        );
        assert_eq!(
            err(&slice(1, 5, 3, 1), &[t(&[2, 8])]),
            "slice: range 5..3 is out of bounds for dim 1 of f32[2,8]"
        );
        assert_eq!(
            err(&slice(0, 0, 1, 0), &[t(&[2, 8])]),
            "slice: step must be positive"
        );
        assert_eq!(
            err(&slice(2, 0, 1, 1), &[t(&[2, 8])]),
            "slice: dim 2 is out of range for f32[2,8] (rank 2)"
        );
        let s = TensorType::new(DType::F32, sym(&["n", "8"]));
        assert_eq!(
            err(&slice(0, 0, 1, 1), &[s]),
            "slice: slicing symbolic dim 0 of f32[n,8]"
        );
        // A symbolic end: `0..n` of a concrete or symbolic dim, step 1.
        let upto_n = |start, step| Op::Slice {
            dim: 0,
            start,
            end: Dim::sym("n"),
            step,
        };
        let n8 = TensorType::new(DType::F32, sym(&["n", "8"]));
        assert_eq!(upto_n(0, 1).infer(&[t(&[16, 8])]).unwrap(), n8);
        assert_eq!(upto_n(0, 1).infer(std::slice::from_ref(&n8)).unwrap(), n8);
        assert_eq!(
            err(&upto_n(1, 1), &[t(&[16, 8])]),
            "slice: a symbolic end n needs start 0 and step 1, got 1 and 1"
        );
        assert_eq!(
            (slice_len(0, 10, 3), slice_len(4, 4, 1), slice_len(5, 2, 1)),
            (4, 0, 0)
        );
    }

    #[test]
    fn cat_adds_one_dim_and_matches_the_others() {
        let cat = Op::Cat { dim: 1 };
        assert_eq!(
            cat.infer(&[t(&[2, 3]), t(&[2, 1]), t(&[2, 4])]).unwrap(),
            t(&[2, 8])
        );
        assert_eq!(
            err(&cat, &[t(&[2, 3]), t(&[3, 3])]),
            "cat: inputs must match in every dim but 1: f32[2,3], f32[3,3]"
        );
        assert_eq!(
            err(&cat, &[t(&[2, 3]), t(&[2, 3, 1])]),
            "cat: inputs must match in every dim but 1: f32[2,3], f32[2,3,1]"
        );
        assert!(err(&cat, &[t(&[2, 3]), ty(DType::F64, &[2, 3])]).starts_with("cat: dtypes differ"));
        assert_eq!(
            err(&Op::Cat { dim: 2 }, &[t(&[2, 3])]),
            "cat: dim 2 is out of range for f32[2,3] (rank 2)"
        );
        let big = ty(DType::Bool, &[usize::MAX / 2 + 1]);
        let e = err(&Op::Cat { dim: 0 }, &[big.clone(), big]);
        assert!(
            e.starts_with("cat: the size of dim 0 overflows: bool["),
            "{e}"
        );
        let s = TensorType::new(DType::F32, sym(&["s0", "4"]));
        let out = Op::Cat { dim: 0 }.infer(&[s.clone(), s]).unwrap();
        assert_eq!(out.shape.to_string(), "[2*s0,4]");
    }

    #[test]
    fn contiguous_keeps_the_type() {
        let s = TensorType::new(DType::F16, sym(&["n", "2"]));
        assert_eq!(Op::Contiguous.infer(std::slice::from_ref(&s)).unwrap(), s);
    }
}
