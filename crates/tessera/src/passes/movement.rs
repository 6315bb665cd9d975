//! Movement canonicalisation: a chain of two views of the same kind becomes
//! one, and a view that selects everything goes.
//!
//! - `permute(permute(x, p), q)` → `permute(x, p∘q)`, or `x` when the
//!   permutations cancel;
//! - `reshape(reshape(x))` → one `reshape` (or `x` when back to its shape);
//! - `expand(expand(x))` → one `expand` (or `x`);
//! - `slice(slice(x))` along one dim → one `slice` (offsets and steps
//!   multiplied out);
//! - a `slice` of a dim's full range with step 1 → `x`.
//!
//! All exact: views move no values. The two views merged must share hints;
//! the inner one stays if something else reads it. (A lone identity view is
//! [`super::neutral_elements`]'s.)

use super::pattern::same_hints;
use super::rewrite::Replacements;
use super::PassContext;
use crate::error::Result;
use crate::ir::infer::slice_len;
use crate::ir::{Dim, Graph, NodeId, Op};

pub fn run(graph: &mut Graph, _ctx: &PassContext) -> Result<bool> {
    let mut r = Replacements::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        match simplify(graph, id) {
            Some(Simpler::Input(x)) => r.replace(graph, id, x)?,
            Some(Simpler::View(op, x)) => {
                r.replace_with(graph, id, op, &[x])?;
            }
            None => {}
        }
    }
    r.apply(graph)
}

/// What a view node simplifies to.
enum Simpler {
    /// The node's value is this node's.
    Input(NodeId),
    /// One view of this node.
    View(Op, NodeId),
}

fn simplify(g: &Graph, id: NodeId) -> Option<Simpler> {
    let node = g.node(id);
    let x = *node.inputs.first()?;
    if let Op::Slice {
        dim,
        start: 0,
        end,
        step: 1,
    } = &node.op
    {
        if g.node(x).ty.shape.0[*dim] == *end {
            return Some(Simpler::Input(x));
        }
    }
    if !same_hints(g, &[id, x]) {
        return None;
    }
    let inner = g.node(x);
    let source = *inner.inputs.first()?;
    let composed = match (&inner.op, &node.op) {
        (Op::Permute(p), Op::Permute(q)) => Op::Permute(q.iter().map(|&i| p[i]).collect()),
        (Op::Reshape(_), Op::Reshape(s)) => Op::Reshape(s.clone()),
        (Op::Expand(_), Op::Expand(s)) => Op::Expand(s.clone()),
        (Op::Slice { .. }, Op::Slice { .. }) => compose_slices(&inner.op, &node.op)?,
        _ => return None,
    };
    let identity = match &composed {
        Op::Permute(p) => p.iter().enumerate().all(|(i, &d)| i == d),
        _ => g.node(source).ty == node.ty && !matches!(composed, Op::Slice { .. }),
    };
    Some(match identity {
        true => Simpler::Input(source),
        false => Simpler::View(composed, source),
    })
}

/// `outer(inner(x))` as one slice, when both slice the same dim and the
/// result is not empty (an empty slice's start could fall past the end).
fn compose_slices(inner: &Op, outer: &Op) -> Option<Op> {
    let (
        &Op::Slice {
            dim: d1,
            start: a1,
            step: s1,
            ..
        },
        Op::Slice {
            dim: d2,
            start: a2,
            end: e2,
            step: s2,
        },
    ) = (inner, outer)
    else {
        return None;
    };
    let (d2, a2, s2) = (*d2, *a2, *s2);
    let len = slice_len(a2, e2.as_const()?, s2);
    if d1 != d2 || len == 0 {
        return None;
    }
    let start = a1 + a2 * s1;
    let step = s1 * s2;
    Some(Op::Slice {
        dim: d1,
        start,
        end: Dim::Const(start + (len - 1) * step + 1),
        step,
    })
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    #[test]
    fn composes_chains_of_views() {
        let before = "graph g(%x) {
  %x = input : f32[2,3,4]
  %p1 = permute(%x) {perm=[1,2,0]} : f32[3,4,2]
  %p2 = permute(%p1) {perm=[2,0,1]} : f32[2,3,4]
  %p3 = permute(%p2) {perm=[2,1,0]} : f32[4,3,2]
  %q = permute(%p3) {perm=[1,0,2]} : f32[3,4,2]
  %r1 = reshape(%x) {shape=[6,4]} : f32[6,4]
  %r2 = reshape(%r1) {shape=[24]} : f32[24]
  %e1 = expand(%r2) {shape=[1,24]} : f32[1,24]
  %e2 = expand(%e1) {shape=[5,1,24]} : f32[5,1,24]
  %s1 = slice(%x) {dim=2, start=1, end=4, step=1} : f32[2,3,3]
  %s2 = slice(%s1) {dim=2, start=0, end=3, step=2} : f32[2,3,2]
  %all = slice(%x) {dim=1, start=0, end=3, step=1} : f32[2,3,4]
  return %q as q, %e2 as e, %s2 as s, %all as all
}";
        let after = "graph g(%x) {
  %x = input : f32[2,3,4]
  %q = permute(%x) {perm=[1,2,0]} : f32[3,4,2]
  %r2 = reshape(%x) {shape=[24]} : f32[24]
  %e2 = expand(%r2) {shape=[5,1,24]} : f32[5,1,24]
  %s2 = slice(%x) {dim=2, start=1, end=4, step=2} : f32[2,3,2]
  return %q as q, %e2 as e, %s2 as s, %x as all
}
";
        // One sweep composes pairs; chains of three take more sweeps, as
        // the pass manager runs them to a fixed point.
        let mut g = crate::ir::text::parse(before).unwrap();
        let ctx = PassContext::default();
        while run(&mut g, &ctx).unwrap() {}
        assert_eq!(g.to_string(), after);
        let (changed, _) = crate::passes::testing::rewrite(run, &ctx, before);
        assert!(changed);
    }

    #[test]
    fn inverse_permutes_cancel_and_reshapes_round_trip() {
        let before = "graph g(%x) {
  %x = input : f32[2,3]
  %t = permute(%x) {perm=[1,0]} : f32[3,2]
  %tt = permute(%t) {perm=[1,0]} : f32[2,3]
  %r = reshape(%tt) {shape=[6]} : f32[6]
  %back = reshape(%r) {shape=[2,3]} : f32[2,3]
  return %back as y
}";
        let after = "graph g(%x) {
  %x = input : f32[2,3]
  return %x as y
}
";
        assert_rewrites(run, &PassContext::default(), before, after);
    }

    /// Different kinds of views, slices of different dims or of part of a
    /// dim, and views in different hint groups do not merge.
    #[test]
    fn leaves_what_does_not_compose() {
        let before = r#"graph g(%x) {
  %x = input : f32[4,6]
  %p = permute(%x) {perm=[1,0]} : f32[6,4]
  %r = reshape(%p) {shape=[24]} : f32[24]
  %s1 = slice(%x) {dim=0, start=1, end=3, step=1} : f32[2,6]
  %s2 = slice(%s1) {dim=1, start=0, end=6, step=2} : f32[2,3]
  %s3 = slice(%x) {dim=1, start=0, end=5, step=1} : f32[4,5]
  %h = permute(%p) {perm=[1,0]} : f32[4,6]  hints={"order":"strict"}
  %e = slice(%x) {dim=1, start=0, end=6, step=2} : f32[4,3]
  %ee = slice(%e) {dim=1, start=3, end=3, step=1} : f32[4,0]
  return %r as r, %s2 as s2, %s3 as s3, %h as h, %ee as ee
}"#;
        assert_unchanged(run, &PassContext::default(), before);
    }
}
