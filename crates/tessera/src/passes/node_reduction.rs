//! Node reduction: a sum of `n` copies of one value, `x + x + … + x` in any
//! grouping, becomes `x * n`: one op instead of `n - 1`.
//!
//! For `n` = 2 and 3 this is exact in floating point (`x + x` is `2x`
//! exactly, so `(x + x) + x` rounds `3x` once, as `x * 3` does). From 4 on
//! the running sum rounds at each step, so on floats larger `n` needs
//! [`PassContext::allow_reassociation`]; `n` must also be exact in the
//! dtype (bf16 holds integers up to 256). The adds in between must have no
//! other reader and the same hints as the outermost one.

use std::collections::HashSet;

use super::pattern::{binary, exactly_representable, may_reassociate, same_hints, scalar_op};
use super::rewrite::{append, use_counts, Replacements};
use super::PassContext;
use crate::error::Result;
use crate::ir::{BinaryOp, Graph, NodeId, Op};

pub fn run(graph: &mut Graph, ctx: &PassContext) -> Result<bool> {
    let uses = use_counts(graph);
    let mut absorbed: HashSet<NodeId> = HashSet::new();
    let mut r = Replacements::new();
    // Outermost sums first, so the adds inside a matched sum are not
    // rewritten on their own.
    for i in (0..graph.len()).rev() {
        let id = NodeId(i as u32);
        if absorbed.contains(&id) || binary(graph, id, BinaryOp::Add).is_none() {
            continue;
        }
        let (leaves, inner) = sum_terms(graph, id, &uses);
        let x = leaves[0];
        let n = leaves.len();
        let dtype = graph.node(id).ty.dtype;
        let exact = n <= 3 || may_reassociate(dtype, ctx.allow_reassociation);
        if leaves.iter().any(|&l| l != x) || !exact || !exactly_representable(n as f64, dtype) {
            continue;
        }
        absorbed.extend(inner);
        let count = append(graph, scalar_op(n as f64, dtype), &[], id)?;
        r.replace_with(graph, id, Op::Binary(BinaryOp::Mul), &[x, count])?;
    }
    r.apply(graph)
}

/// The terms of the sum rooted at the add `root` (through adds that only
/// this sum reads, with the root's hints), and those inner adds.
fn sum_terms(g: &Graph, root: NodeId, uses: &[usize]) -> (Vec<NodeId>, Vec<NodeId>) {
    let (mut leaves, mut inner) = (Vec::new(), Vec::new());
    let mut stack = vec![root];
    while let Some(id) = stack.pop() {
        for &x in g.node(id).inputs.iter().rev() {
            let nested = binary(g, x, BinaryOp::Add).is_some()
                && uses[x.index()] == 1
                && same_hints(g, &[root, x]);
            match nested {
                true => {
                    inner.push(x);
                    stack.push(x);
                }
                false => leaves.push(x),
            }
        }
    }
    (leaves, inner)
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    #[test]
    fn sums_of_copies_become_products() {
        let before = "graph g(%x) {
  %x = input : f32[2]
  %two = add(%x, %x) : f32[2]
  %three = add(%two, %x) : f32[2]              # model.rs:5:7
  %d = sub(%x, %x) : f32[2]
  %p = add(%d, %d) : f32[2]
  return %three as y, %p as p
}";
        let after = "graph g(%x) {
  %x = input : f32[2]
  %1 = constant {value=3.0} : f32[]  # model.rs:5:7
  %three = mul(%x, %1) : f32[2]      # model.rs:5:7
  %d = sub(%x, %x) : f32[2]
  %4 = constant {value=2.0} : f32[]
  %p = mul(%d, %4) : f32[2]
  return %three as y, %p as p
}
";
        assert_rewrites(run, &PassContext::exact(), before, after);
    }

    /// Four copies round differently from `x*4` on floats: only with
    /// reassociation; always on integers.
    #[test]
    fn four_copies_need_reassociation_on_floats() {
        let before = "graph g(%x) {
  %x = input : f32[2]
  %a = add(%x, %x) : f32[2]
  %b = add(%x, %x) : f32[2]
  %c = add(%a, %b) : f32[2]
  %d = add(%c, %x) : f32[2]
  return %d as y
}";
        let (changed, text) = crate::passes::testing::rewrite(run, &PassContext::exact(), before);
        assert!(changed, "the two inner x+x still become 2*x");
        assert!(!text.contains("constant {value=5.0}"), "{text}");
        let after = "graph g(%x) {
  %x = input : f32[2]
  %1 = constant {value=5.0} : f32[]
  %d = mul(%x, %1) : f32[2]
  return %d as y
}
";
        assert_rewrites(run, &PassContext::default(), before, after);
        let ints = "graph g(%x) {
  %x = input : i32[2]
  %a = add(%x, %x) : i32[2]
  %b = add(%a, %x) : i32[2]
  %c = add(%b, %x) : i32[2]
  return %c as y
}";
        let after = "graph g(%x) {
  %x = input : i32[2]
  %1 = constant {value=4} : i32[]
  %c = mul(%x, %1) : i32[2]
  return %c as y
}
";
        assert_rewrites(run, &PassContext::exact(), ints, after);
    }

    #[test]
    fn shared_partial_sums_and_other_terms_stay() {
        let before = "graph g(%x, %y) {
  %x = input : f32[2]
  %y = input : f32[2]
  %a = add(%x, %y) : f32[2]
  %b = add(%a, %x) : f32[2]
  return %b as b
}";
        assert_unchanged(run, &PassContext::default(), before);
    }
}
