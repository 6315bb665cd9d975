//! Constant propagation: `(x + c2) + c1` → `x + (c1 + c2)`, and the same
//! for `*`, in any operand order, so that constant folding can combine the
//! two constants into one and one op on `x` remains.
//!
//! Regrouping changes float rounding (and, in extreme cases, whether an
//! intermediate overflows), so on floats it runs only with
//! [`PassContext::allow_reassociation`]; on integers it is exact. It runs
//! only when the inner op has no other reader (else both would stay), when
//! both ops share their hints, and when the combined constant is small
//! enough to be folded (`fold_limit`), so the rewrite always ends in one op.
//! Broadcasting is associative, so the result keeps the node's type.

use super::pattern::{binary, is_constant, may_reassociate, same_hints};
use super::rewrite::{append, use_counts, Replacements};
use super::PassContext;
use crate::error::Result;
use crate::ir::{broadcast_shapes, BinaryOp, Graph, NodeId, Op};

pub fn run(graph: &mut Graph, ctx: &PassContext) -> Result<bool> {
    let uses = use_counts(graph);
    let mut r = Replacements::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        for op in [BinaryOp::Add, BinaryOp::Mul] {
            let Some((x, c1, c2)) = matches(graph, id, op, &uses, ctx) else {
                continue;
            };
            if r.contains(id) {
                continue;
            }
            let c = append(graph, Op::Binary(op), &[c1, c2], id)?;
            r.replace_with(graph, id, Op::Binary(op), &[x, c])?;
        }
    }
    r.apply(graph)
}

/// `(x, c1, c2)` when node `id` is `op(op(x, c2), c1)` up to operand order.
fn matches(
    g: &Graph,
    id: NodeId,
    op: BinaryOp,
    uses: &[usize],
    ctx: &PassContext,
) -> Option<(NodeId, NodeId, NodeId)> {
    let (a, b) = binary(g, id, op)?;
    if !may_reassociate(g.node(id).ty.dtype, ctx.allow_reassociation) {
        return None;
    }
    let (inner, c1) = constant_operand(g, a, b)?;
    let (i0, i1) = binary(g, inner, op)?;
    let (x, c2) = constant_operand(g, i0, i1)?;
    let folds = broadcast_shapes(&g.node(c1).ty.shape, &g.node(c2).ty.shape)
        .and_then(|s| s.as_concrete())
        .is_some_and(|s| s.iter().product::<usize>() <= ctx.fold_limit);
    let ok = uses[inner.index()] == 1 && same_hints(g, &[id, inner]) && !is_constant(g, x);
    (ok && folds).then_some((x, c1, c2))
}

/// `(other, constant)` when exactly one of `a`, `b` is a constant.
fn constant_operand(g: &Graph, a: NodeId, b: NodeId) -> Option<(NodeId, NodeId)> {
    match (is_constant(g, a), is_constant(g, b)) {
        (false, true) => Some((a, b)),
        (true, false) => Some((b, a)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    #[test]
    fn regroups_constants_of_adds_and_muls() {
        let before = "graph g(%x, %n) {
  %x = input : f32[2,3]
  %c2 = constant {value=[1.0,2.0,3.0]} : f32[3]
  %inner = add(%x, %c2) : f32[2,3]
  %c1 = full {value=0.5, shape=[], dtype=f32} : f32[]
  %y = add(%c1, %inner) : f32[2,3]                # model.rs:7:3
  %k = full {value=3, shape=[], dtype=i64} : i64[]
  %n = input : i64[4]
  %m = mul(%n, %k) : i64[4]
  %z = mul(%m, %k) : i64[4]
  return %y as y, %z as z
}";
        let after = "graph g(%x, %n) {
  %x = input : f32[2,3]
  %c2 = constant {value=[1.0,2.0,3.0]} : f32[3]
  %c1 = full {value=0.5, shape=[], dtype=f32} : f32[]
  %3 = add(%c1, %c2) : f32[3]  # model.rs:7:3
  %y = add(%x, %3) : f32[2,3]  # model.rs:7:3
  %k = full {value=3, shape=[], dtype=i64} : i64[]
  %n = input : i64[4]
  %7 = mul(%k, %k) : i64[]
  %z = mul(%n, %7) : i64[4]
  return %y as y, %z as z
}
";
        assert_rewrites(run, &PassContext::default(), before, after);
    }

    /// Floats without reassociation, an inner op with another reader, and
    /// ops in different hint groups are left alone.
    #[test]
    fn respects_rounding_sharing_and_hints() {
        let before = r#"graph g(%x) {
  %x = input : f32[3]
  %c = full {value=2.0, shape=[], dtype=f32} : f32[]
  %a = add(%x, %c) : f32[3]
  %b = add(%a, %c) : f32[3]
  return %b as b
}"#;
        assert_unchanged(run, &PassContext::exact(), before);
        let shared = r#"graph g(%x) {
  %x = input : f32[3]
  %c = full {value=2.0, shape=[], dtype=f32} : f32[]
  %a = add(%x, %c) : f32[3]
  %b = add(%a, %c) : f32[3]
  return %b as b, %a as a
}"#;
        assert_unchanged(run, &PassContext::default(), shared);
        let hinted = r#"graph g(%x) {
  %x = input : f32[3]
  %c = full {value=2.0, shape=[], dtype=f32} : f32[]
  %a = add(%x, %c) : f32[3]  hints={"group_id":1}
  %b = add(%a, %c) : f32[3]
  return %b as b
}"#;
        assert_unchanged(run, &PassContext::default(), hinted);
    }
}
