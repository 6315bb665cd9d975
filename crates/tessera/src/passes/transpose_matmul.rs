//! Transposes folded into matmul: `matmul(permute(x), y)`, where the permute
//! swaps the last two dims, becomes `matmul_t(x, y) {transpose_a=true}`
//! (likewise for `y`), so the kernel reads `x` as a strided view and the
//! permute node goes. A transposed operand of a `matmul_t` toggles its flag
//! back, and a `matmul_t` with no flag left is a plain `matmul`.
//!
//! Exact: the product is the same, element by element. The permute must
//! share the matmul's hints (they are merged into one node); a permute that
//! has other readers stays for them.

use super::pattern::same_hints;
use super::rewrite::Replacements;
use super::PassContext;
use crate::error::Result;
use crate::ir::{Graph, NodeId, Op};

pub fn run(graph: &mut Graph, _ctx: &PassContext) -> Result<bool> {
    let mut r = Replacements::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        if let Some((op, operands)) = folded(graph, id) {
            let node = graph.node(id);
            if op != node.op || operands[..] != node.inputs[..] {
                r.replace_with(graph, id, op, &operands)?;
            }
        }
    }
    r.apply(graph)
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
