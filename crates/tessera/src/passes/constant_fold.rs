//! Constant folding: an op whose inputs are all known when the graph is
//! built (`constant`, `full`, `arange`) is evaluated once, with the CPU
//! kernels the runtime uses, so the folded value is bit for bit what the op
//! would have computed.
//!
//! The result becomes a `full` when all its elements are equal (whatever its
//! size: an elementwise op or a view of `full`s is evaluated on one element,
//! which also serves symbolic shapes), otherwise a `constant` when it has at
//! most [`PassContext::fold_limit`] elements. Larger results stay ops: a
//! graph should not carry megabytes of literals. The inputs are materialised
//! only when each has at most `fold_limit` elements too, checked before any
//! is made: folding `sum(full [1000000,1000000])` would otherwise allocate
//! 4 TB at compile time for one number. An op that fails on its
//! constants (an integer division by zero) is left to fail at run time.
//! Sources themselves (`full`, `arange`, `rand` …, a random op even with a
//! constant seed) are not folded: they are already as small as a value gets.
//!
//! The folded value takes the op's metadata (name, call site, hints); the
//! constants it read have no work to schedule, so their hints are moot.

use super::pattern::{is_constant, uniform_value};
use super::rewrite::Replacements;
use super::PassContext;
use crate::error::Result;
use crate::ir::{Graph, Literal, LiteralData, NodeId, Op, Scalar, Shape};
use crate::runtime::array::Array;
use crate::runtime::cpu;
use crate::tensor::Tensor;

pub fn run(graph: &mut Graph, ctx: &PassContext) -> Result<bool> {
    let mut r = Replacements::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        // Inputs as folded so far in this sweep, so a chain folds at once.
        let inputs: Vec<NodeId> = graph
            .node(id)
            .inputs
            .iter()
            .map(|&x| r.resolve(x))
            .collect();
        if inputs.is_empty() || !inputs.iter().all(|&x| is_constant(graph, x)) {
            continue;
        }
        // A random op is a source too, whose constant operand is its seed.
        if matches!(graph.node(id).op, Op::Rand { .. } | Op::Randn { .. }) {
            continue;
        }
        if let Some(op) = fold(graph, id, &inputs, ctx) {
            r.replace_with(graph, id, op, &[])?;
        }
    }
    r.apply(graph)
}

/// The source op (`full` or `constant`) that computes node `id` from the
/// constant nodes `inputs`, if it can be folded.
fn fold(g: &Graph, id: NodeId, inputs: &[NodeId], ctx: &PassContext) -> Option<Op> {
    let node = g.node(id);
    let all_full = inputs
        .iter()
        .all(|&x| matches!(g.node(x).op, Op::Full { .. }));
    if all_full && keeps_uniform(&node.op) {
        return fold_uniform(g, id, inputs);
    }
    let small = |shape: &[usize]| crate::limits::numel(shape).is_some_and(|n| n <= ctx.fold_limit);
    let shape = node.ty.shape.as_concrete()?;
    if !small(&shape) {
        return None;
    }
    let input_shapes: Vec<Vec<usize>> = inputs
        .iter()
        .map(|&x| g.node(x).ty.shape.as_concrete())
        .collect::<Option<_>>()?;
    if !input_shapes.iter().all(|s| small(s)) {
        return None;
    }
    let values: Vec<Array> = inputs
        .iter()
        .map(|&x| evaluate_source(g, x))
        .collect::<Option<_>>()?;
    let refs: Vec<&Array> = values.iter().collect();
    let value = cpu::eval(&node.op, &refs, node.ty.dtype, &shape).ok()?;
    source_op(&Tensor::from_array(value))
}

/// Ops that map `full`s to a `full`: elementwise ops and views.
fn keeps_uniform(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary(_)
            | Op::Binary(_)
            | Op::Compare(_)
            | Op::Where
            | Op::Cast(_)
            | Op::BitCast(_)
            | Op::Reshape(_)
            | Op::Permute(_)
            | Op::Expand(_)
            | Op::Slice { .. }
            | Op::Contiguous
    )
}

/// Evaluates node `id` on one element of each of its `full` inputs; the
/// result fills the node's shape (symbolic or not).
fn fold_uniform(g: &Graph, id: NodeId, inputs: &[NodeId]) -> Option<Op> {
    let node = g.node(id);
    let scalars: Vec<Array> = inputs
        .iter()
        .map(|&x| {
            let dtype = g.node(x).ty.dtype;
            let one = Op::Full {
                value: uniform_value(g, x)?,
                shape: Shape::scalar(),
                dtype,
            };
            cpu::eval(&one, &[], dtype, &[]).ok()
        })
        .collect::<Option<_>>()?;
    let refs: Vec<&Array> = scalars.iter().collect();
    let op = match &node.op {
        // On one element, a view is the element itself.
        Op::Reshape(_) | Op::Permute(_) | Op::Expand(_) | Op::Slice { .. } | Op::Contiguous => {
            Op::Contiguous
        }
        op => op.clone(),
    };
    let one = cpu::eval(&op, &refs, node.ty.dtype, &[]).ok()?;
    Some(Op::Full {
        value: scalar_of(&Tensor::from_array(one).to_literal().ok()?, 0),
        shape: node.ty.shape.clone(),
        dtype: node.ty.dtype,
    })
}

/// The value of a `constant`, `full` or `arange` node with a concrete shape.
fn evaluate_source(g: &Graph, id: NodeId) -> Option<Array> {
    let node = g.node(id);
    let shape = node.ty.shape.as_concrete()?;
    cpu::eval(&node.op, &[], node.ty.dtype, &shape).ok()
}

/// `full` when every element of `t` is the same (bit for bit), else
/// `constant`.
fn source_op(t: &Tensor) -> Option<Op> {
    let lit = t.to_literal().ok()?;
    let uniform = match &lit.data {
        LiteralData::Float(v) => v.iter().all(|x| x.to_bits() == v[0].to_bits()),
        LiteralData::Int(v) => v.iter().all(|x| *x == v[0]),
        LiteralData::Bool(v) => v.iter().all(|x| *x == v[0]),
    };
    if uniform && !lit.data.is_empty() {
        return Some(Op::Full {
            value: scalar_of(&lit, 0),
            shape: Shape::from_concrete(t.shape()),
            dtype: t.dtype(),
        });
    }
    Some(Op::Constant(lit))
}

/// Element `i` (row-major) of `lit` as a scalar of its kind, exactly.
fn scalar_of(lit: &Literal, i: usize) -> Scalar {
    match &lit.data {
        LiteralData::Float(v) => Scalar::Float(v[i]),
        LiteralData::Int(v) => Scalar::Int(v[i]),
        LiteralData::Bool(v) => Scalar::Bool(v[i]),
    }
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    #[test]
    fn folds_small_results_into_constants_and_uniform_ones_into_fulls() {
        let before = r#"graph g(%x) {
  %x = input : f32[2,3]
  %a = arange {start=0.0, end=3.0, step=1.0, dtype=f32} : f32[3]
  %two = full {value=2.0, shape=[], dtype=f32} : f32[]
  %b = mul(%a, %two) : f32[3]                       # model.rs:4:9
  %big = full {value=0.5, shape=[s0,1000], dtype=f32} : f32[s0,1000]
  %e = exp(%big) : f32[s0,1000]
  %s = sum(%b) {dims=[0], keepdim=false} : f32[]
  %y = add(%x, %b) : f32[2,3]
  %z = mul(%y, %s) : f32[2,3]
  return %z as z, %e as e
}"#;
        let after = r#"graph g(%x) {
  %x = input : f32[2,3]
  %b = constant {value=[0.0,2.0,4.0]} : f32[3]  # model.rs:4:9
  %e = full {value=1.6487212181091309, shape=[s0,1000], dtype=f32} : f32[s0,1000]
  %s = full {value=6.0, shape=[], dtype=f32} : f32[]
  %y = add(%x, %b) : f32[2,3]
  %z = mul(%y, %s) : f32[2,3]
  return %z as z, %e as e
}
"#;
        assert_rewrites(run, &PassContext::default(), before, after);
    }

    #[test]
    fn leaves_large_non_uniform_results_and_failing_ops() {
        let before = "graph g() {
  %a = arange {start=0.0, end=5000.0, step=1.0, dtype=f32} : f32[5000]
  %b = neg(%a) : f32[5000]
  %n = constant {value=[4,5]} : i64[2]
  %zero = full {value=0, shape=[2], dtype=i64} : i64[2]
  %q = div(%n, %zero) : i64[2]
  %k = constant {value=1} : i64[]
  %r = randn(%k) {shape=[2], dtype=f32} : f32[2]
  %t = tanh(%r) : f32[2]
  %huge = full {value=1.0, shape=[1000000,1000000], dtype=f32} : f32[1000000,1000000]
  %total = sum(%huge) {dims=[0,1], keepdim=false} : f32[]
  return %b as b, %q as q, %t as t, %total as total
}";
        assert_unchanged(run, &PassContext::default(), before);
    }

    /// `expand(full)` folds to a `full` of the expanded shape without
    /// making it; an op reading it with a small result is left to run
    /// rather than materialising 4 TB at compile time.
    #[test]
    fn never_materialises_large_inputs() {
        let before = "graph g() {
  %one = full {value=1.0, shape=[1], dtype=f32} : f32[1]
  %wide = expand(%one) {shape=[1,1000000000000]} : f32[1,1000000000000]
  %col = full {value=2.0, shape=[1000000000000,1], dtype=f32} : f32[1000000000000,1]
  %dot = matmul(%wide, %col) : f32[1,1]
  return %dot as dot
}";
        let after = "graph g() {
  %wide = full {value=1.0, shape=[1,1000000000000], dtype=f32} : f32[1,1000000000000]
  %col = full {value=2.0, shape=[1000000000000,1], dtype=f32} : f32[1000000000000,1]
  %dot = matmul(%wide, %col) : f32[1,1]
  return %dot as dot
}
";
        assert_rewrites(run, &PassContext::default(), before, after);
    }
}
