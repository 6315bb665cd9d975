//! Broadcast minimisation: `(m1 + s1) + (m2 + s2)` → `(m1 + m2) + (s1 + s2)`
//! where `m1`, `m2` have the result's full shape and `s1`, `s2` are smaller
//! operands that broadcast (a bias, a scalar). Three full-size ops become
//! two, and the small operands are combined at their own size. The same
//! for `*`.
//!
//! Regrouping changes float rounding, so on floats it needs
//! [`PassContext::allow_reassociation`]; on integers it is exact. The inner
//! ops must have no other reader, all three ops the same hints, and
//! `s1 + s2` must itself be smaller than the result (a `[4,1]` and a `[1,5]`
//! operand combine to full size: nothing saved).

use super::pattern::{binary, may_reassociate, same_hints};
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
            if let Some([m1, s1, m2, s2]) = regrouping(graph, id, op, &uses, ctx) {
                let big = append(graph, Op::Binary(op), &[m1, m2], id)?;
                let small = append(graph, Op::Binary(op), &[s1, s2], id)?;
                r.replace_with(graph, id, Op::Binary(op), &[big, small])?;
            }
        }
    }
    r.apply(graph)
}

/// `[m1, s1, m2, s2]` when node `id` is `op(op(m1, s1), op(m2, s2))` with
/// full-size `m`s and broadcast `s`s, up to operand order.
fn regrouping(
    g: &Graph,
    id: NodeId,
    op: BinaryOp,
    uses: &[usize],
    ctx: &PassContext,
) -> Option<[NodeId; 4]> {
    let (l, r) = binary(g, id, op)?;
    if l == r || !may_reassociate(g.node(id).ty.dtype, ctx.allow_reassociation) {
        return None;
    }
    let full = &g.node(id).ty.shape;
    let split = |inner: NodeId| {
        let (a, b) = binary(g, inner, op)?;
        let is_full = |x: NodeId| &g.node(x).ty.shape == full;
        match (is_full(a), is_full(b)) {
            (true, false) => Some((a, b)),
            (false, true) => Some((b, a)),
            _ => None,
        }
    };
    let ((m1, s1), (m2, s2)) = (split(l)?, split(r)?);
    let small = broadcast_shapes(&g.node(s1).ty.shape, &g.node(s2).ty.shape)?;
    let ok = &small != full
        && uses[l.index()] == 1
        && uses[r.index()] == 1
        && same_hints(g, &[id, l, r]);
    ok.then_some([m1, s1, m2, s2])
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    /// The lecture's example: (matrix1 + scalar1) + (matrix2 + scalar2).
    #[test]
    fn combines_the_broadcast_operands_at_their_own_size() {
        let before = "graph g(%m1, %m2, %s1, %b2) {
  %m1 = input : f32[64,32]
  %m2 = input : f32[64,32]
  %s1 = input : f32[]
  %b2 = input : f32[32]
  %l = add(%m1, %s1) : f32[64,32]
  %r = add(%b2, %m2) : f32[64,32]
  %y = add(%l, %r) : f32[64,32]                # model.rs:3:3
  return %y as y
}";
        let after = "graph g(%m1, %m2, %s1, %b2) {
  %m1 = input : f32[64,32]
  %m2 = input : f32[64,32]
  %s1 = input : f32[]
  %b2 = input : f32[32]
  %4 = add(%m1, %m2) : f32[64,32]  # model.rs:3:3
  %5 = add(%s1, %b2) : f32[32]     # model.rs:3:3
  %y = add(%4, %5) : f32[64,32]    # model.rs:3:3
  return %y as y
}
";
        assert_rewrites(run, &PassContext::default(), before, after);
    }

    /// Without reassociation; small operands that combine to full size;
    /// an inner sum read elsewhere: unchanged.
    #[test]
    fn leaves_regroupings_that_are_not_allowed_or_not_smaller() {
        let base = "graph g(%m1, %m2, %s1, %s2) {
  %m1 = input : f32[4,5]
  %m2 = input : f32[4,5]
  %s1 = input : f32[]
  %s2 = input : f32[5]
  %l = add(%m1, %s1) : f32[4,5]
  %r = add(%m2, %s2) : f32[4,5]
  %y = add(%l, %r) : f32[4,5]
  return %y as y
}";
        assert_unchanged(run, &PassContext::exact(), base);
        let crossed = base
            .replace("%s1 = input : f32[]", "%s1 = input : f32[4,1]")
            .replace("%s2 = input : f32[5]", "%s2 = input : f32[1,5]");
        assert_unchanged(run, &PassContext::default(), &crossed);
        let shared = base.replace("return %y as y", "return %y as y, %l as l");
        assert_unchanged(run, &PassContext::default(), &shared);
    }
}
