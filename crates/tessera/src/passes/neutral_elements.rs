//! Neutral elements: ops that return their input unchanged are removed.
//!
//! `x*1`, `1*x`, `x/1`, `pow(x, 1)`, `x-0`, `x+(-0.0)`; `reshape`, `expand`
//! and `cast` to the input's own type; `permute` by the identity; a
//! `contiguous` of a `contiguous`; a `contiguous` of an `expand` read only
//! by elementwise ops (they broadcast the view themselves: the eager
//! gradient of `sum`/`mean` writes this, and on the GPU each such copy
//! wrote a full activation-sized tensor per batch-norm backward); a `cat` of one part (the seed's sliced
//! attention in one slice: the copy would keep a second full-size value
//! live next to its part, which a backward saves). All are exact, NaN and infinities
//! included. `x + 0.0` → `x` is exact except for the sign of a zero result
//! (`-0.0 + 0.0` is `+0.0`), so on floats it needs
//! [`PassContext::allow_reassociation`], as does `x - (-0.0)`; on integers
//! any zero is neutral.
//!
//! The replacement must have the node's type: `x + zeros[4,5]` with `x` of
//! shape `[5]` broadcasts, so it is not `x` and stays. (Compositions of
//! views, like two permutes that cancel, are [`super::movement`]'s.)

use super::pattern::{binary, is_value, is_zero};
use super::rewrite::Replacements;
use super::PassContext;
use crate::error::Result;
use crate::ir::{BinaryOp, Graph, NodeId, Op};

pub fn run(graph: &mut Graph, ctx: &PassContext) -> Result<bool> {
    let mut r = Replacements::new();
    let broadcast_reads = read_only_elementwise(graph);
    for (i, &read_elementwise) in broadcast_reads.iter().enumerate() {
        let id = NodeId(i as u32);
        let copy_of_broadcast = graph.node(id).op == Op::Contiguous
            && read_elementwise
            && matches!(graph.node(graph.node(id).inputs[0]).op, Op::Expand(_));
        if copy_of_broadcast {
            r.replace(graph, id, graph.node(id).inputs[0])?;
        } else if let Some(x) = neutral_operand(graph, id, ctx) {
            if graph.node(x).ty == graph.node(id).ty {
                r.replace(graph, id, x)?;
            }
        }
    }
    r.apply(graph)
}

/// Per node: whether every reader is an elementwise op (which reads any
/// view of its operands, broadcasts included) and no graph output is it.
fn read_only_elementwise(g: &Graph) -> Vec<bool> {
    let mut only = vec![true; g.len()];
    for node in &g.nodes {
        if !node.op.is_elementwise() {
            for &x in &node.inputs {
                only[x.index()] = false;
            }
        }
    }
    for out in &g.outputs {
        only[out.node.index()] = false;
    }
    only
}

/// The operand node `id` returns unchanged (up to broadcasting, which the
/// caller checks), if any.
fn neutral_operand(g: &Graph, id: NodeId, ctx: &PassContext) -> Option<NodeId> {
    let node = g.node(id);
    let x = *node.inputs.first()?;
    let same = |t: NodeId| g.node(t).ty == node.ty;
    match &node.op {
        Op::Binary(op) => binary_neutral(g, id, *op, ctx),
        Op::Reshape(_) | Op::Expand(_) | Op::Cast(_) if same(x) => Some(x),
        Op::Permute(perm) if perm.iter().enumerate().all(|(i, &p)| i == p) => Some(x),
        Op::Contiguous if g.node(x).op == Op::Contiguous => Some(x),
        Op::Cat { .. } if node.inputs.len() == 1 => Some(x),
        _ => None,
    }
}

fn binary_neutral(g: &Graph, id: NodeId, op: BinaryOp, ctx: &PassContext) -> Option<NodeId> {
    let (a, b) = binary(g, id, op)?;
    let int = g.node(id).ty.dtype.is_int();
    let one = |c: NodeId| is_value(g, c, 1.0);
    // x + c is x for c = -0.0; for c = +0.0 only up to a zero's sign.
    let add_zero =
        |c: NodeId| is_value(g, c, -0.0) || (is_zero(g, c) && (int || ctx.allow_reassociation));
    // x - c is x for c = +0.0; for c = -0.0 only up to a zero's sign.
    let sub_zero =
        |c: NodeId| is_value(g, c, 0.0) || (is_zero(g, c) && (int || ctx.allow_reassociation));
    match op {
        BinaryOp::Add if add_zero(b) => Some(a),
        BinaryOp::Add if add_zero(a) => Some(b),
        BinaryOp::Mul if one(b) => Some(a),
        BinaryOp::Mul if one(a) => Some(b),
        BinaryOp::Sub if sub_zero(b) => Some(a),
        BinaryOp::Div | BinaryOp::Pow if one(b) => Some(a),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    #[test]
    fn removes_identities() {
        let before = "graph g(%x, %n) {
  %x = input : f32[2,3]
  %n = input : i64[3]
  %one = full {value=1.0, shape=[], dtype=f32} : f32[]
  %zero = full {value=0.0, shape=[3], dtype=f32} : f32[3]
  %nz = constant {value=[-0.0,-0.0,-0.0]} : f32[3]
  %a = mul(%one, %x) : f32[2,3]
  %b = div(%a, %one) : f32[2,3]
  %c = pow(%b, %one) : f32[2,3]
  %d = sub(%c, %zero) : f32[2,3]
  %e = add(%d, %nz) : f32[2,3]
  %f = reshape(%e) {shape=[2,3]} : f32[2,3]
  %g = permute(%f) {perm=[0,1]} : f32[2,3]
  %h = expand(%g) {shape=[2,3]} : f32[2,3]
  %i = cast(%h) {dtype=f32} : f32[2,3]
  %j = contiguous(%i) : f32[2,3]
  %k = contiguous(%j) : f32[2,3]
  %one_part = cat(%k) {dim=0} : f32[2,3]
  %iz = full {value=0, shape=[], dtype=i64} : i64[]
  %m = add(%iz, %n) : i64[3]
  return %one_part as k, %m as m
}";
        let after = "graph g(%x, %n) {
  %x = input : f32[2,3]
  %n = input : i64[3]
  %j = contiguous(%x) : f32[2,3]
  return %j as k, %n as m
}
";
        assert_rewrites(run, &PassContext::exact(), before, after);
    }

    /// The eager gradient of a mean: `contiguous(expand(g))` read by
    /// elementwise ops only loses its copy; one read by a matmul, by
    /// another view or returned keeps it (they need the dense value).
    #[test]
    fn a_copied_broadcast_read_elementwise_is_read_as_the_view() {
        let before = "graph g(%x, %g) {
  %x = input : f32[2,3]
  %g = input : f32[1,3]
  %e = expand(%g) {shape=[2,3]} : f32[2,3]
  %c = contiguous(%e) : f32[2,3]
  %m = mul(%c, %x) : f32[2,3]
  %gt = gt(%c, %x) : bool[2,3]
  %w = where(%gt, %m, %c) : f32[2,3]
  %e2 = expand(%g) {shape=[2,3]} : f32[2,3]
  %c2 = contiguous(%e2) : f32[2,3]
  %p = matmul_t(%c2, %x) {transpose_a=false, transpose_b=true} : f32[2,2]
  %c3 = contiguous(%e) : f32[2,3]
  return %w as w, %p as p, %c3 as c3
}";
        let after = "graph g(%x, %g) {
  %x = input : f32[2,3]
  %g = input : f32[1,3]
  %e = expand(%g) {shape=[2,3]} : f32[2,3]
  %m = mul(%e, %x) : f32[2,3]
  %gt = gt(%e, %x) : bool[2,3]
  %w = where(%gt, %m, %e) : f32[2,3]
  %e2 = expand(%g) {shape=[2,3]} : f32[2,3]
  %c2 = contiguous(%e2) : f32[2,3]
  %p = matmul_t(%c2, %x) {transpose_a=false, transpose_b=true} : f32[2,2]
  %c3 = contiguous(%e) : f32[2,3]
  return %w as w, %p as p, %c3 as c3
}
";
        assert_rewrites(run, &PassContext::exact(), before, after);
    }

    /// `+0.0` is neutral up to the sign of zero: only with reassociation.
    #[test]
    fn adding_positive_zero_needs_reassociation() {
        let before = "graph g(%x) {
  %x = input : f32[3]
  %zero = full {value=0.0, shape=[], dtype=f32} : f32[]
  %y = add(%x, %zero) : f32[3]
  return %y as y
}";
        assert_unchanged(run, &PassContext::exact(), before);
        let after = "graph g(%x) {
  %x = input : f32[3]
  return %x as y
}
";
        assert_rewrites(run, &PassContext::default(), before, after);
    }

    /// Broadcasting identities change the type, so they stay; so do
    /// non-identity views and values that are not neutral.
    #[test]
    fn keeps_broadcasts_and_non_identities() {
        let before = "graph g(%x) {
  %x = input : f32[5]
  %zeros = full {value=0.0, shape=[4,5], dtype=f32} : f32[4,5]
  %a = add(%x, %zeros) : f32[4,5]
  %ones = full {value=1.0, shape=[2,1], dtype=f32} : f32[2,1]
  %b = mul(%ones, %x) : f32[2,5]
  %half = full {value=0.5, shape=[], dtype=f32} : f32[]
  %c = mul(%x, %half) : f32[5]
  %d = sub(%half, %x) : f32[5]
  %one = full {value=1.0, shape=[], dtype=f32} : f32[]
  %e = div(%one, %x) : f32[5]
  %f = cast(%x) {dtype=f64} : f64[5]
  %r = reshape(%x) {shape=[5,1]} : f32[5,1]
  %p = permute(%r) {perm=[1,0]} : f32[1,5]
  %ct = contiguous(%p) : f32[1,5]
  %two = cat(%x, %x) {dim=0} : f32[10]
  return %a as a, %b as b, %c as c, %d as d, %e as e, %f as f, %ct as ct, %two as two
}";
        assert_unchanged(run, &PassContext::default(), before);
    }
}
