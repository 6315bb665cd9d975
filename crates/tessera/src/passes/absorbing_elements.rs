//! Absorbing elements: ops whose result does not depend on one operand
//! become a `full` of the node's type (its shape, broadcast included).
//!
//! - `x * 0` and `0 * x` → `0`, and `x - x` → `0`: exact on integers. On
//!   floats they are wrong for NaN and ±inf inputs (`inf * 0` and
//!   `inf - inf` are NaN) and drop the sign of `-x * 0`, so they need
//!   [`PassContext::unsafe_math`].
//! - `pow(x, 0)` → `1`: exact for every input, NaN included (IEEE `pow`,
//!   which the kernels use, defines `pow(NaN, 0)` as 1).

use super::pattern::{binary, is_zero};
use super::rewrite::Replacements;
use super::PassContext;
use crate::error::Result;
use crate::ir::{BinaryOp, Graph, NodeId, Op, Scalar};

pub fn run(graph: &mut Graph, ctx: &PassContext) -> Result<bool> {
    let mut r = Replacements::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        if let Some(value) = absorbed_value(graph, id, ctx) {
            let ty = &graph.node(id).ty;
            let value = match ty.dtype.is_int() {
                true => Scalar::Int(value),
                false => Scalar::Float(value as f64),
            };
            let full = Op::Full {
                value,
                shape: ty.shape.clone(),
                dtype: ty.dtype,
            };
            r.replace_with(graph, id, full, &[])?;
        }
    }
    r.apply(graph)
}

/// The value every element of node `id` has, whatever its varying operand.
fn absorbed_value(g: &Graph, id: NodeId, ctx: &PassContext) -> Option<i64> {
    let node = g.node(id);
    let Op::Binary(op) = node.op else {
        return None;
    };
    let (a, b) = binary(g, id, op)?;
    let allowed = node.ty.dtype.is_int() || ctx.unsafe_math;
    match op {
        BinaryOp::Mul if allowed && (is_zero(g, a) || is_zero(g, b)) => Some(0),
        BinaryOp::Sub if allowed && a == b => Some(0),
        BinaryOp::Pow if is_zero(g, b) => Some(1),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    const FLOATS: &str = "graph g(%x, %v) {
  %x = input : f32[3]
  %v = input : f32[2,1]
  %zero = full {value=0.0, shape=[2,1], dtype=f32} : f32[2,1]
  %a = mul(%x, %zero) : f32[2,3]               # model.rs:2:1
  %b = sub(%v, %v) : f32[2,1]
  %z = full {value=0.0, shape=[], dtype=f32} : f32[]
  %c = pow(%x, %z) : f32[3]
  return %a as a, %b as b, %c as c
}";

    #[test]
    fn float_zeros_need_unsafe_math() {
        let after = "graph g(%x, %v) {
  %x = input : f32[3]
  %v = input : f32[2,1]
  %a = full {value=0.0, shape=[2,3], dtype=f32} : f32[2,3]  # model.rs:2:1
  %b = full {value=0.0, shape=[2,1], dtype=f32} : f32[2,1]
  %c = full {value=1.0, shape=[3], dtype=f32} : f32[3]
  return %a as a, %b as b, %c as c
}
";
        let unsafe_math = PassContext {
            unsafe_math: true,
            ..PassContext::default()
        };
        assert_rewrites(run, &unsafe_math, FLOATS, after);
    }

    /// Without `unsafe_math`, `x*0` and `x-x` stay (NaN/inf inputs); the
    /// exact `pow(x, 0)` → 1 still happens.
    #[test]
    fn without_unsafe_math_only_exact_rewrites() {
        let after = "graph g(%x, %v) {
  %x = input : f32[3]
  %v = input : f32[2,1]
  %zero = full {value=0.0, shape=[2,1], dtype=f32} : f32[2,1]
  %a = mul(%x, %zero) : f32[2,3]  # model.rs:2:1
  %b = sub(%v, %v) : f32[2,1]
  %c = full {value=1.0, shape=[3], dtype=f32} : f32[3]
  return %a as a, %b as b, %c as c
}
";
        assert_rewrites(run, &PassContext::default(), FLOATS, after);
        let untouched = "graph g(%x, %y) {
  %x = input : f32[3]
  %y = input : f32[3]
  %zero = full {value=0.0, shape=[], dtype=f32} : f32[]
  %a = mul(%x, %zero) : f32[3]
  %b = sub(%x, %y) : f32[3]
  %c = pow(%zero, %x) : f32[3]
  return %a as a, %b as b, %c as c
}";
        assert_unchanged(run, &PassContext::default(), untouched);
    }

    #[test]
    fn integer_zeros_are_always_absorbing() {
        let before = "graph g(%n) {
  %n = input : i32[4]
  %zero = constant {value=[0,0,0,0]} : i32[4]
  %a = mul(%zero, %n) : i32[4]
  %b = sub(%n, %n) : i32[4]
  return %a as a, %b as b
}";
        let after = "graph g(%n) {
  %n = input : i32[4]
  %a = full {value=0, shape=[4], dtype=i32} : i32[4]
  %b = full {value=0, shape=[4], dtype=i32} : i32[4]
  return %a as a, %b as b
}
";
        assert_rewrites(run, &PassContext::exact(), before, after);
    }
}
