//! Transposes folded into matmul: `matmul(permute(x), y)`, where the permute
//! swaps the last two dims, becomes `matmul_t(x, y) {transpose_a=true}`
//! (likewise for `y`), so the kernel reads `x` as a strided view and the
//! permute node goes. A transposed operand of a `matmul_t` toggles its flag
//! back, and a `matmul_t` with no flag left is a plain `matmul`.
//!
//! A transposed product is written transposed: `permute(matmul_t(a, b))`
//! swapping the last two dims becomes `matmul_t(b, a)` with both flags
//! flipped and swapped (`(A·B)ᵀ = Bᵀ·Aᵀ`), when the permute is the product's
//! only reader. The result is then a dense row-major buffer instead of a
//! strided view, so a `reshape` or `cat` of it (the gradient of `k` in
//! attention, `(qᵀ·dS)ᵀ`) need not copy it: the memory planner can write
//! it straight into its place in the joined buffer.
//!
//! Exact: the product is the same, element by element (the same terms; only
//! gemm's summation order may follow the new layout, as
//! [`PassContext::exact`] allows). The permute must share the matmul's
//! hints (they are merged into one node); a permute that has other readers
//! stays for them, and a product with other readers is not duplicated.

use super::pattern::same_hints;
use super::rewrite::{use_counts, Replacements};
use super::PassContext;
use crate::error::Result;
use crate::ir::{Graph, NodeId, Op};

pub fn run(graph: &mut Graph, _ctx: &PassContext) -> Result<bool> {
    let uses = use_counts(graph);
    let mut r = Replacements::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        if let Some((op, operands)) = folded(graph, id) {
            let node = graph.node(id);
            if op != node.op || operands[..] != node.inputs[..] {
                r.replace_with(graph, id, op, &operands)?;
            }
        } else if let Some((op, operands)) = transposed_product(graph, id, &uses) {
            r.replace_with(graph, id, op, &operands)?;
        }
    }
    r.apply(graph)
}

/// `id` as one product when it is a permute swapping the last two dims of a
/// matmul read by nothing else: `(op(a)·op(b))ᵀ = op(b)ᵀ·op(a)ᵀ`.
fn transposed_product(g: &Graph, id: NodeId, uses: &[usize]) -> Option<(Op, [NodeId; 2])> {
    let product = swapped_last2(g, id)?;
    let node = g.node(product);
    let [ta, tb] = match node.op {
        Op::MatMul => [false, false],
        Op::MatMulT {
            transpose_a,
            transpose_b,
        } => [transpose_a, transpose_b],
        _ => return None,
    };
    let (a, b) = (node.inputs[0], node.inputs[1]);
    // A 1-D operand is promoted on one side only: its product has no
    // transposed twin of the same form.
    let matrices = [a, b].iter().all(|&x| g.node(x).ty.rank() >= 2);
    if !matrices || uses[product.index()] != 1 || !same_hints(g, &[id, product]) {
        return None;
    }
    let op = match [!tb, !ta] {
        [false, false] => Op::MatMul,
        [transpose_a, transpose_b] => Op::MatMulT {
            transpose_a,
            transpose_b,
        },
    };
    Some((op, [b, a]))
}

/// The matmul node `id` with the transposes of its operands folded into
/// its flags (`matmul` when none is left).
fn folded(g: &Graph, id: NodeId) -> Option<(Op, [NodeId; 2])> {
    let node = g.node(id);
    let mut flags = match node.op {
        Op::MatMul => [false, false],
        Op::MatMulT {
            transpose_a,
            transpose_b,
        } => [transpose_a, transpose_b],
        _ => return None,
    };
    let mut operands = [node.inputs[0], node.inputs[1]];
    for (operand, flag) in operands.iter_mut().zip(&mut flags) {
        if let Some(x) = swapped_last2(g, *operand).filter(|_| same_hints(g, &[id, *operand])) {
            *operand = x;
            *flag = !*flag;
        }
    }
    let op = match flags {
        [false, false] => Op::MatMul,
        [transpose_a, transpose_b] => Op::MatMulT {
            transpose_a,
            transpose_b,
        },
    };
    Some((op, operands))
}

/// The input of `id` when `id` is a permute that swaps the last two dims
/// and keeps the others in place.
fn swapped_last2(g: &Graph, id: NodeId) -> Option<NodeId> {
    let node = g.node(id);
    let Op::Permute(perm) = &node.op else {
        return None;
    };
    let r = perm.len();
    let swaps = r >= 2
        && perm[r - 2] == r - 1
        && perm[r - 1] == r - 2
        && perm[..r - 2].iter().enumerate().all(|(i, &p)| i == p);
    swaps.then_some(node.inputs[0])
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    #[test]
    fn folds_transposes_into_the_matmul() {
        let before = "graph g(%q, %k, %w, %v, %u) {
  %q = input : f32[2,8,4]
  %k = input : f32[2,8,4]
  %w = input : f32[3,4]
  %v = input : f32[4,8]
  %u = input : f32[8,5]
  %kt = permute(%k) {perm=[0,2,1]} : f32[2,4,8]
  %s = matmul(%q, %kt) : f32[2,8,8]            # attn.rs:4:9
  %wt = permute(%w) {perm=[1,0]} : f32[4,3]
  %vt = permute(%v) {perm=[1,0]} : f32[8,4]
  %o = matmul(%vt, %wt) : f32[8,3]
  %back = matmul_t(%vt, %u) {transpose_a=true, transpose_b=false} : f32[4,5]
  %ww = matmul_t(%wt, %wt) {transpose_a=true, transpose_b=false} : f32[3,3]
  return %s as s, %o as o, %back as back, %ww as ww
}";
        let after = "graph g(%q, %k, %w, %v, %u) {
  %q = input : f32[2,8,4]
  %k = input : f32[2,8,4]
  %w = input : f32[3,4]
  %v = input : f32[4,8]
  %u = input : f32[8,5]
  %s = matmul_t(%q, %k) {transpose_a=false, transpose_b=true} : f32[2,8,8]  # attn.rs:4:9
  %o = matmul_t(%v, %w) {transpose_a=true, transpose_b=true} : f32[8,3]
  %back = matmul(%v, %u) : f32[4,5]
  %ww = matmul_t(%w, %w) {transpose_a=false, transpose_b=true} : f32[3,3]
  return %s as s, %o as o, %back as back, %ww as ww
}
";
        assert_rewrites(run, &PassContext::exact(), before, after);
    }

    /// A transposed product becomes the product of the transposed operands
    /// (flags flipped and swapped), whatever the product's flags were.
    #[test]
    fn writes_transposed_products_transposed() {
        let before = "graph g(%q, %ds, %a, %b) {
  %q = input : f32[2,8,4]
  %ds = input : f32[2,8,8]
  %a = input : f32[3,4]
  %b = input : f32[4,5]
  %dkt = matmul_t(%q, %ds) {transpose_a=true, transpose_b=false} : f32[2,4,8]
  %dk = permute(%dkt) {perm=[0,2,1]} : f32[2,8,4]  # attn.rs:4:9
  %ab = matmul(%a, %b) : f32[3,5]
  %abt = permute(%ab) {perm=[1,0]} : f32[5,3]
  %flat = reshape(%dk) {shape=[64]} : f32[64]
  return %flat as dk, %abt as abt
}";
        let after = "graph g(%q, %ds, %a, %b) {
  %q = input : f32[2,8,4]
  %ds = input : f32[2,8,8]
  %a = input : f32[3,4]
  %b = input : f32[4,5]
  %dk = matmul_t(%ds, %q) {transpose_a=true, transpose_b=false} : f32[2,8,4]  # attn.rs:4:9
  %abt = matmul_t(%b, %a) {transpose_a=true, transpose_b=true} : f32[5,3]
  %flat = reshape(%dk) {shape=[64]} : f32[64]
  return %flat as dk, %abt as abt
}
";
        assert_rewrites(run, &PassContext::exact(), before, after);
    }

    /// A product read by something else too, one in another hint group, one
    /// with a 1-D operand and a permute that is not a swap of the last two
    /// dims stay.
    #[test]
    fn leaves_products_it_would_duplicate_or_cannot_transpose() {
        let before = r#"graph g(%x, %y, %z) {
  %x = input : f32[2,3,4]
  %y = input : f32[2,4,3]
  %z = input : f32[4]
  %shared = matmul(%x, %y) : f32[2,3,3]
  %t1 = permute(%shared) {perm=[0,2,1]} : f32[2,3,3]
  %s = add(%shared, %t1) : f32[2,3,3]
  %other = matmul(%y, %x) : f32[2,4,4]
  %t2 = permute(%other) {perm=[0,2,1]} : f32[2,4,4]  hints={"group_id":1}
  %vec = matmul(%x, %z) : f32[2,3]
  %t3 = permute(%vec) {perm=[1,0]} : f32[3,2]
  %batch = matmul(%y, %x) : f32[2,4,4]
  %t4 = permute(%batch) {perm=[1,0,2]} : f32[4,2,4]
  return %s as s, %t2 as t2, %t3 as t3, %t4 as t4
}"#;
        assert_unchanged(run, &PassContext::default(), before);
    }

    /// Permutes that are not a swap of the last two dims, a 1-D operand and
    /// a permute in another hint group stay.
    #[test]
    fn leaves_other_permutes() {
        let before = r#"graph g(%x, %y, %z) {
  %x = input : f32[2,3,4]
  %y = input : f32[3,2,5]
  %z = input : f32[3]
  %p = permute(%y) {perm=[1,0,2]} : f32[2,3,5]
  %a = matmul(%z, %p) : f32[2,5]
  %t = permute(%x) {perm=[0,2,1]} : f32[2,4,3]  hints={"group_id":1}
  %b = matmul(%t, %z) : f32[2,4]
  return %a as a, %b as b
}"#;
        assert_unchanged(run, &PassContext::default(), before);
    }
}
