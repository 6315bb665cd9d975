//! Hoisting a common factor: `x*a + x*b` → `x*(a+b)` and `x*a - x*b` →
//! `x*(a-b)`, the factor on either side of each product. Three ops become
//! two, and when `a` and `b` are small (scalars, a bias row) the sum is
//! cheap.
//!
//! Distributing changes float rounding, and an overflowing product can turn
//! a NaN (`inf - inf`) into a finite value, so on floats it needs
//! [`PassContext::allow_reassociation`]; on integers it is exact. Both
//! products must have no other reader (else they stay and nothing is
//! saved) and all three ops the same hints. Broadcasting distributes, so
//! the result keeps the node's type.

use super::pattern::{binary, may_reassociate, same_hints};
use super::rewrite::{append, use_counts, Replacements};
use super::PassContext;
use crate::error::Result;
use crate::ir::{BinaryOp, Graph, NodeId, Op};

pub fn run(graph: &mut Graph, ctx: &PassContext) -> Result<bool> {
    let uses = use_counts(graph);
    let mut r = Replacements::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        for op in [BinaryOp::Add, BinaryOp::Sub] {
            if let Some((x, a, b)) = common_factor(graph, id, op, &uses, ctx) {
                let sum = append(graph, Op::Binary(op), &[a, b], id)?;
                r.replace_with(graph, id, Op::Binary(BinaryOp::Mul), &[x, sum])?;
            }
        }
    }
    r.apply(graph)
}

/// `(x, a, b)` when node `id` is `op(x*a, x*b)` up to the order of each
/// product's operands.
fn common_factor(
    g: &Graph,
    id: NodeId,
    op: BinaryOp,
    uses: &[usize],
    ctx: &PassContext,
) -> Option<(NodeId, NodeId, NodeId)> {
    let (m1, m2) = binary(g, id, op)?;
    if m1 == m2 || !may_reassociate(g.node(id).ty.dtype, ctx.allow_reassociation) {
        return None;
    }
    let (p, q) = binary(g, m1, BinaryOp::Mul)?;
    let (s, t) = binary(g, m2, BinaryOp::Mul)?;
    let single_use = uses[m1.index()] == 1 && uses[m2.index()] == 1;
    if !single_use || !same_hints(g, &[id, m1, m2]) {
        return None;
    }
    // The factor and the other operand of each product.
    let (x, a, b) = [(p, q, s, t), (p, q, t, s), (q, p, s, t), (q, p, t, s)]
        .into_iter()
        .find(|&(x1, _, x2, _)| x1 == x2)
        .map(|(x, a, _, b)| (x, a, b))?;
    Some((x, a, b))
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    #[test]
    fn hoists_a_common_factor_out_of_sums_and_differences() {
        let before = r#"graph g(%x, %a, %b) {
  %x = input : f32[4,3]
  %a = input : f32[3]
  %b = input : f32[]
  %xa = mul(%x, %a) : f32[4,3]
  %bx = mul(%b, %x) : f32[4,3]
  %y = add(%xa, %bx) : f32[4,3]                # model.rs:9:5
  %xa2 = mul(%a, %x) : f32[4,3]
  %xb2 = mul(%x, %b) : f32[4,3]
  %z = sub(%xa2, %xb2) : f32[4,3]
  return %y as y, %z as z
}"#;
        let after = r#"graph g(%x, %a, %b) {
  %x = input : f32[4,3]
  %a = input : f32[3]
  %b = input : f32[]
  %3 = add(%a, %b) : f32[3]    # model.rs:9:5
  %y = mul(%x, %3) : f32[4,3]  # model.rs:9:5
  %5 = sub(%a, %b) : f32[3]
  %z = mul(%x, %5) : f32[4,3]
  return %y as y, %z as z
}
"#;
        assert_rewrites(run, &PassContext::default(), before, after);
    }

    /// No reassociation on floats, a product read elsewhere, a product in
    /// another hint group, no common factor: unchanged.
    #[test]
    fn leaves_what_it_may_not_or_need_not_hoist() {
        let before = r#"graph g(%x, %a, %b) {
  %x = input : f32[3]
  %a = input : f32[3]
  %b = input : f32[3]
  %xa = mul(%x, %a) : f32[3]
  %xb = mul(%x, %b) : f32[3]
  %y = add(%xa, %xb) : f32[3]
  return %y as y
}"#;
        assert_unchanged(run, &PassContext::exact(), before);
        let shared = r#"graph g(%x, %a, %b) {
  %x = input : f32[3]
  %a = input : f32[3]
  %b = input : f32[3]
  %xa = mul(%x, %a) : f32[3]
  %xb = mul(%x, %b) : f32[3]  hints={"group_id":2}
  %y = add(%xa, %xb) : f32[3]
  %ab = mul(%a, %b) : f32[3]
  %w = add(%xa, %ab) : f32[3]
  return %y as y, %w as w, %xa as xa
}"#;
        assert_unchanged(run, &PassContext::default(), shared);
    }

    #[test]
    fn integers_always_hoist() {
        let before = "graph g(%x, %a) {
  %x = input : i64[3]
  %a = input : i64[3]
  %xa = mul(%x, %a) : i64[3]
  %xx = mul(%x, %x) : i64[3]
  %y = add(%xa, %xx) : i64[3]
  return %y as y
}";
        let after = "graph g(%x, %a) {
  %x = input : i64[3]
  %a = input : i64[3]
  %2 = add(%a, %x) : i64[3]
  %y = mul(%x, %2) : i64[3]
  return %y as y
}
";
        assert_rewrites(run, &PassContext::exact(), before, after);
    }
}
