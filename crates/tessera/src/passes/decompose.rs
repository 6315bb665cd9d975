//! Decomposition of composite ops into primitives, for fusion to regroup:
//!
//! - `softmax(x, d)` → `e / sum(e, d)` with `e = exp(x - max(x, d))`;
//! - `log_softmax(x, d)` → `z - log(sum(exp(z), d))` with `z = x - max(x, d)`;
//! - `silu(x)` → `x * sigmoid(x)`.
//!
//! Both softmaxes keep the max subtraction, so they stay finite where the
//! kernels do, and rows of `-inf` give NaN as the kernels do. The results
//! differ from the single kernels by rounding (the composite kernels
//! accumulate in one pass with their own `exp`), which is why the default
//! pipeline leaves this pass out: fusion asks for it. `gelu` (exact erf
//! form) stays as it is: the IR has no `erf` primitive to express it with;
//! `gelu_tanh` and `sigmoid` stay too, as elementwise primitives that fuse
//! as they are.

use super::rewrite::{append, Replacements};
use super::PassContext;
use crate::error::Result;
use crate::ir::{BinaryOp, Graph, NodeId, Op, ReduceOp, UnaryOp};

pub fn run(graph: &mut Graph, _ctx: &PassContext) -> Result<bool> {
    let mut r = Replacements::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        let node = graph.node(id);
        match node.op {
            Op::Softmax { dim } => softmax(graph, &mut r, id, dim, false)?,
            Op::LogSoftmax { dim } => softmax(graph, &mut r, id, dim, true)?,
            Op::Unary(UnaryOp::Silu) => {
                let x = node.inputs[0];
                let s = append(graph, Op::Unary(UnaryOp::Sigmoid), &[x], id)?;
                r.replace_with(graph, id, Op::Binary(BinaryOp::Mul), &[x, s])?;
            }
            _ => {}
        }
    }
    r.apply(graph)
}

/// Replaces the (log_)softmax node `id` along `dim` by its primitives.
fn softmax(g: &mut Graph, r: &mut Replacements, id: NodeId, dim: usize, log: bool) -> Result<()> {
    let x = g.node(id).inputs[0];
    let reduce = |op| Op::Reduce {
        op,
        dims: vec![dim],
        keepdim: true,
    };
    let max = append(g, reduce(ReduceOp::Max), &[x], id)?;
    let z = append(g, Op::Binary(BinaryOp::Sub), &[x, max], id)?;
    let e = append(g, Op::Unary(UnaryOp::Exp), &[z], id)?;
    let sum = append(g, reduce(ReduceOp::Sum), &[e], id)?;
    if log {
        let log_sum = append(g, Op::Unary(UnaryOp::Log), &[sum], id)?;
        r.replace_with(g, id, Op::Binary(BinaryOp::Sub), &[z, log_sum])?;
    } else {
        r.replace_with(g, id, Op::Binary(BinaryOp::Div), &[e, sum])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    #[test]
    fn softmax_log_softmax_and_silu_become_primitives() {
        let before = r#"graph g(%x) {
  %x = input : f32[2,s0]
  %p = softmax(%x) {dim=1} : f32[2,s0]         # model.rs:8:14
  %l = log_softmax(%x) {dim=0} : f32[2,s0]  hints={"group_id":3}
  %s = silu(%x) : f32[2,s0]
  return %p as p, %l as l, %s as s
}"#;
        let after = r#"graph g(%x) {
  %x = input : f32[2,s0]
  %1 = max(%x) {dims=[1], keepdim=true} : f32[2,1]  # model.rs:8:14
  %2 = sub(%x, %1) : f32[2,s0]                      # model.rs:8:14
  %3 = exp(%2) : f32[2,s0]                          # model.rs:8:14
  %4 = sum(%3) {dims=[1], keepdim=true} : f32[2,1]  # model.rs:8:14
  %p = div(%3, %4) : f32[2,s0]                      # model.rs:8:14
  %6 = max(%x) {dims=[0], keepdim=true} : f32[1,s0]  hints={"group_id":3}
  %7 = sub(%x, %6) : f32[2,s0]  hints={"group_id":3}
  %8 = exp(%7) : f32[2,s0]  hints={"group_id":3}
  %9 = sum(%8) {dims=[0], keepdim=true} : f32[1,s0]  hints={"group_id":3}
  %10 = log(%9) : f32[1,s0]  hints={"group_id":3}
  %l = sub(%7, %10) : f32[2,s0]  hints={"group_id":3}
  %12 = sigmoid(%x) : f32[2,s0]
  %s = mul(%x, %12) : f32[2,s0]
  return %p as p, %l as l, %s as s
}
"#;
        assert_rewrites(run, &PassContext::default(), before, after);
    }

    #[test]
    fn leaves_gelu_and_primitives() {
        let before = "graph g(%x) {
  %x = input : f32[4]
  %a = gelu(%x) : f32[4]
  %b = gelu_tanh(%a) : f32[4]
  %c = sigmoid(%b) : f32[4]
  %d = max(%c) {dims=[0], keepdim=false} : f32[]
  return %d as d
}";
        assert_unchanged(run, &PassContext::default(), before);
    }
}
