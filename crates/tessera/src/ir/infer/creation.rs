//! Creation ops — `constant`, `full`, `arange`, `rand`, `randn` — make
//! values of a type that comes from their attributes, which are checked here
//! (a literal fills its shape with values of its dtype's kind, an integer
//! fits its dtype, a range is finite, random values are floats). The random
//! ops take one input, their seed, an `i64[]` scalar ([`Op::SEED_DTYPE`]);
//! the others take none.

use super::{describe, not_in_family, TensorType};
use crate::error::{op_err, Result};
use crate::ir::dtype::DType;
use crate::ir::op::{LiteralData, Op, Scalar};
use crate::ir::shape::Shape;

/// Number of elements of `arange(start, end, step)`.
pub fn arange_len(start: f64, end: f64, step: f64) -> Option<usize> {
    if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
        return None;
    }
    Some(((end - start) / step).ceil().max(0.0) as usize)
}

/// The type a creation op makes from `inputs` (the arity is checked).
pub(super) fn infer(op: &Op, inputs: &[TensorType]) -> Result<TensorType> {
    match op {
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
            if let (Scalar::Int(v), true) = (value, dtype.is_int()) {
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
        Op::Rand { shape, dtype } | Op::Randn { shape, dtype } => {
            let seed = &inputs[0];
            if seed.dtype != Op::SEED_DTYPE || seed.rank() != 0 {
                return Err(op_err!(
                    DType,
                    op.name(),
                    "the seed must be an {}[] scalar, got {}",
                    Op::SEED_DTYPE,
                    describe(inputs)
                ));
            }
            if !dtype.is_float() {
                return Err(op_err!(
                    DType,
                    op.name(),
                    "produces floats, asked for {dtype}"
                ));
            }
            Ok(TensorType {
                dtype: *dtype,
                shape: shape.clone(),
            })
        }
        _ => Err(not_in_family(op, "creation")),
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{err, ty};
    use super::*;
    use crate::error::ErrorKind;
    use crate::ir::op::Literal;
    use crate::ir::shape::Dim;

    fn literal(dtype: DType, shape: &[usize], data: LiteralData) -> Op {
        Op::Constant(Literal {
            dtype,
            shape: shape.to_vec(),
            data,
        })
    }

    #[test]
    fn a_constant_has_its_literals_type_when_the_values_fill_it() {
        let op = literal(DType::F64, &[2, 2], LiteralData::Float(vec![1.0; 4]));
        assert_eq!(op.infer(&[]).unwrap(), ty(DType::F64, &[2, 2]));
        let op = literal(DType::I32, &[], LiteralData::Int(vec![-7]));
        assert_eq!(op.infer(&[]).unwrap(), ty(DType::I32, &[]));
        let op = literal(DType::Bool, &[3], LiteralData::Bool(vec![true; 3]));
        assert_eq!(op.infer(&[]).unwrap(), ty(DType::Bool, &[3]));
    }

    #[test]
    fn a_constant_refuses_values_that_do_not_fit() {
        let few = literal(DType::F32, &[2, 3], LiteralData::Float(vec![0.0; 5]));
        let e = err(&few, &[]);
        assert!(e.starts_with("constant: 5 values of kind"), "{e}");
        assert!(e.ends_with("do not fill f32[2, 3]"), "{e}");
        let kind = literal(DType::I64, &[1], LiteralData::Float(vec![0.5]));
        assert!(err(&kind, &[]).ends_with("do not fill i64[1]"));
        let wide = literal(DType::I32, &[2], LiteralData::Int(vec![1, 1 << 40]));
        assert_eq!(
            err(&wide, &[]),
            "constant: value 1099511627776 does not fit in i32"
        );
        let e = literal(DType::F32, &[2], LiteralData::Float(vec![0.0; 3]))
            .infer(&[])
            .unwrap_err();
        assert_eq!(e.kind, ErrorKind::Shape);
    }

    #[test]
    fn full_keeps_its_shape_and_checks_integer_values() {
        let full = |value, dtype| Op::Full {
            value,
            shape: Shape(vec![Dim::sym("n"), Dim::Const(3)]),
            dtype,
        };
        let out = full(Scalar::Float(0.5), DType::F16).infer(&[]).unwrap();
        assert_eq!(out.to_string(), "f16[n,3]");
        assert_eq!(
            full(Scalar::Int(300), DType::I64).infer(&[]).unwrap().dtype,
            DType::I64
        );
        assert_eq!(
            err(&full(Scalar::Int(1 << 33), DType::I32), &[]),
            "full: value 8589934592 does not fit in i32"
        );
    }

    #[test]
    fn arange_counts_its_elements_and_refuses_bad_ranges() {
        let arange = |start, end, step, dtype| Op::Arange {
            start,
            end,
            step,
            dtype,
        };
        assert_eq!(
            arange(0.0, 10.0, 3.0, DType::I64).infer(&[]).unwrap(),
            ty(DType::I64, &[4])
        );
        assert_eq!(
            arange(5.0, 0.0, -2.0, DType::F32).infer(&[]).unwrap(),
            ty(DType::F32, &[3])
        );
        assert_eq!(
            arange(3.0, 1.0, 1.0, DType::F32).infer(&[]).unwrap(),
            ty(DType::F32, &[0])
        );
        assert_eq!(
            err(&arange(0.0, 1.0, 0.0, DType::F32), &[]),
            "arange: bad range start=0 end=1 step=0"
        );
        assert_eq!(
            err(&arange(0.0, f64::INFINITY, 1.0, DType::F32), &[]),
            "arange: bad range start=0 end=inf step=1"
        );
        assert_eq!(
            err(&arange(0.0, 2.0, 1.0, DType::Bool), &[]),
            "arange: cannot produce bool"
        );
        assert_eq!(arange_len(0.0, 1.0, f64::NAN), None);
        assert_eq!(arange_len(0.0, 1.0, 0.3), Some(4));
    }

    fn seed() -> TensorType {
        ty(DType::I64, &[])
    }

    #[test]
    fn random_ops_make_floats_only() {
        let shape = Shape::from_concrete(&[2, 5]);
        let rand = Op::Rand {
            shape: shape.clone(),
            dtype: DType::BF16,
        };
        assert_eq!(rand.infer(&[seed()]).unwrap(), ty(DType::BF16, &[2, 5]));
        let randn = Op::Randn {
            shape,
            dtype: DType::I32,
        };
        assert_eq!(
            err(&randn, &[seed()]),
            "randn: produces floats, asked for i32"
        );
    }

    #[test]
    fn random_ops_take_a_symbolic_shape() {
        let shape = Shape(vec![Dim::sym("s0"), Dim::Const(3)]);
        let randn = Op::Randn {
            shape: shape.clone(),
            dtype: DType::F32,
        };
        assert_eq!(
            randn.infer(&[seed()]).unwrap(),
            TensorType::new(DType::F32, shape)
        );
    }

    #[test]
    fn random_ops_take_one_i64_scalar_seed() {
        let op = Op::Rand {
            shape: Shape::from_concrete(&[1]),
            dtype: DType::F32,
        };
        assert_eq!(err(&op, &[]), "rand: takes 1 inputs, got 0");
        assert_eq!(err(&op, &[seed(), seed()]), "rand: takes 1 inputs, got 2");
        assert_eq!(
            err(&op, &[ty(DType::I64, &[1])]),
            "rand: the seed must be an i64[] scalar, got i64[1]"
        );
        assert_eq!(
            err(&op, &[ty(DType::I32, &[])]),
            "rand: the seed must be an i64[] scalar, got i32[]"
        );
    }

    #[test]
    fn other_creation_ops_take_no_inputs() {
        let op = Op::Arange {
            start: 0.0,
            end: 1.0,
            step: 1.0,
            dtype: DType::F32,
        };
        assert_eq!(
            err(&op, &[ty(DType::F32, &[1])]),
            "arange: takes 0 inputs, got 1"
        );
    }
}
