//! What the passes ask about nodes when they match: is it a constant, which
//! value does it hold, is it this binary op, may two nodes be merged.

use crate::ir::{BinaryOp, DType, Graph, LiteralData, NodeId, Op, Scalar};

/// The value every element of `id` holds, when `id` is a `full` or a
/// `constant` whose elements are all equal (floats bit-equal, so `-0.0` and
/// `0.0` differ). `None` for anything else.
pub fn uniform_value(g: &Graph, id: NodeId) -> Option<Scalar> {
    match &g.node(id).op {
        Op::Full { value, dtype, .. } => Some(in_dtype(*value, *dtype)),
        Op::Constant(lit) => match &lit.data {
            LiteralData::Float(v) => {
                all_equal(v, |a, b| a.to_bits() == b.to_bits()).map(|x| Scalar::Float(*x))
            }
            LiteralData::Int(v) => all_equal(v, |a, b| a == b).map(|x| Scalar::Int(*x)),
            LiteralData::Bool(v) => all_equal(v, |a, b| a == b).map(|x| Scalar::Bool(*x)),
        },
        _ => None,
    }
}

/// `full`'s scalar as the kernel stores it in `dtype` (`full {value=1}` of
/// an f32 is the float 1.0; `0.5` of an i64 is 0).
fn in_dtype(value: Scalar, dtype: DType) -> Scalar {
    if dtype.is_float() {
        Scalar::Float(rounded(value.as_f64(), dtype))
    } else if dtype.is_int() {
        Scalar::Int(value.as_i64())
    } else {
        Scalar::Bool(value.as_f64() != 0.0)
    }
}

fn all_equal<T>(v: &[T], eq: impl Fn(&T, &T) -> bool) -> Option<&T> {
    let first = v.first()?;
    v.iter().all(|x| eq(x, first)).then_some(first)
}

/// Whether every element of `id` is the number `v` (integers compared as
/// integers; for floats, `0.0` matches `0.0` only, not `-0.0`).
pub fn is_value(g: &Graph, id: NodeId, v: f64) -> bool {
    match uniform_value(g, id) {
        Some(Scalar::Float(x)) => x.to_bits() == v.to_bits(),
        Some(Scalar::Int(x)) => x as f64 == v && v.fract() == 0.0,
        _ => false,
    }
}

/// Whether every element of `id` is zero of either sign (or the integer 0).
pub fn is_zero(g: &Graph, id: NodeId) -> bool {
    is_value(g, id, 0.0) || is_value(g, id, -0.0)
}

/// Whether `id`'s value is known when the graph is built: a `constant`, a
/// `full` or an `arange` (sources that the runtime computes, not reads).
pub fn is_constant(g: &Graph, id: NodeId) -> bool {
    matches!(
        g.node(id).op,
        Op::Constant(_) | Op::Full { .. } | Op::Arange { .. }
    )
}

/// The inputs of `id` when it is the binary op `op`.
pub fn binary(g: &Graph, id: NodeId, op: BinaryOp) -> Option<(NodeId, NodeId)> {
    let node = g.node(id);
    (node.op == Op::Binary(op)).then(|| (node.inputs[0], node.inputs[1]))
}

/// Whether `+` or `*` of `dtype` may be regrouped or distributed: always on
/// integers (wrapping arithmetic is a ring), on floats only with
/// `allow_reassociation` (rounding changes).
pub fn may_reassociate(dtype: DType, allow_reassociation: bool) -> bool {
    dtype.is_int() || allow_reassociation
}

/// Whether the nodes may be merged into one: their hints are the same (a
/// hint group is scheduled as a unit, so no rewrite mixes two groups).
pub fn same_hints(g: &Graph, ids: &[NodeId]) -> bool {
    let first = &g.node(ids[0]).meta.hints;
    ids.iter().all(|&id| &g.node(id).meta.hints == first)
}

/// `v` rounded to the float `dtype` (as the kernels store it).
fn rounded(v: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F32 => (v as f32) as f64,
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        _ => v,
    }
}

/// Whether `v` is held exactly by `dtype` (so a constant `v` means `v`).
pub fn exactly_representable(v: f64, dtype: DType) -> bool {
    match dtype {
        DType::I64 | DType::I32 => v.fract() == 0.0 && v.abs() < 2f64.powi(31),
        DType::Bool => v == 0.0 || v == 1.0,
        _ => rounded(v, dtype) == v,
    }
}

/// A rank-0 constant holding `v` in `dtype` (an integer for int dtypes).
pub fn scalar_op(v: f64, dtype: DType) -> Op {
    let value = if dtype.is_int() {
        Scalar::Int(v as i64)
    } else {
        Scalar::Float(v)
    };
    Op::Constant(crate::ir::Literal::scalar(value, dtype))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::text::parse;

    #[test]
    fn uniform_values_of_constants_and_fulls() {
        let g = parse(
            "graph g() {
  %a = full {value=1, shape=[2], dtype=f32} : f32[2]
  %b = constant {value=[0.0,-0.0]} : f32[2]
  %c = constant {value=[-0.0,-0.0]} : f32[2]
  %d = constant {value=[3,3]} : i64[2]
  %e = full {value=0.5, shape=[], dtype=i32} : i32[]
  return
}",
        )
        .unwrap();
        let id = NodeId;
        assert_eq!(uniform_value(&g, id(0)), Some(Scalar::Float(1.0)));
        assert!(is_value(&g, id(0), 1.0));
        assert_eq!(uniform_value(&g, id(1)), None, "signs differ");
        assert!(is_zero(&g, id(2)) && !is_value(&g, id(2), 0.0));
        assert!(is_value(&g, id(3), 3.0) && !is_value(&g, id(3), 3.5));
        assert!(is_zero(&g, id(4)), "0.5 as an i32 is 0");
        assert!(exactly_representable(256.0, DType::BF16));
        assert!(!exactly_representable(257.0, DType::BF16));
    }
}
