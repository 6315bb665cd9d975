//! Common-subexpression elimination: nodes with the same op, attributes,
//! inputs and hints compute the same value, so all uses can read the first.
//!
//! Constants are compared by value (every element, bit for bit: `0.0` and
//! `-0.0` stay apart). Random ops with the same seed, shape and dtype draw
//! the same numbers (the generator is counter-based), so they merge; with
//! different seeds they differ, and the seed is part of the key. Inputs are
//! never merged. `add`, `mul`, `eq` and `ne` are commutative bit for bit, so
//! their operands are compared as a set; `maximum`/`minimum` are not (they
//! pick between `0.0` and `-0.0` by position). Nodes whose hints differ are
//! never merged: a hint group is scheduled as a unit.

use std::collections::HashMap;

use super::rewrite::Replacements;
use super::PassContext;
use crate::error::Result;
use crate::ir::{BinaryOp, CompareOp, Graph, NodeId, Op};

pub fn run(graph: &mut Graph, _ctx: &PassContext) -> Result<bool> {
    let mut seen: HashMap<Key, NodeId> = HashMap::new();
    let mut r = Replacements::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        let node = graph.node(id);
        if matches!(node.op, Op::Input) {
            continue;
        }
        // Inputs as they will read once the merges so far are applied, so a
        // whole duplicated chain merges in one sweep.
        let mut inputs: Vec<NodeId> = node.inputs.iter().map(|&x| r.resolve(x)).collect();
        if is_commutative(&node.op) {
            inputs.sort();
        }
        let key = Key {
            // `Debug` spells every attribute, constant data included; floats
            // in their shortest round-trip form, so equal keys mean equal ops.
            op: format!("{:?}", node.op),
            inputs,
            hints: node.meta.hints.as_ref().map(|h| format!("{h:?}")),
        };
        match seen.get(&key) {
            Some(&first) => r.replace(graph, id, first)?,
            None => {
                seen.insert(key, id);
            }
        }
    }
    r.apply(graph)
}

#[derive(PartialEq, Eq, Hash)]
struct Key {
    op: String,
    inputs: Vec<NodeId>,
    hints: Option<String>,
}

fn is_commutative(op: &Op) -> bool {
    matches!(
        op,
        Op::Binary(BinaryOp::Add | BinaryOp::Mul) | Op::Compare(CompareOp::Eq | CompareOp::Ne)
    )
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    #[test]
    fn merges_duplicate_chains_constants_and_commuted_operands() {
        let before = "graph g(%x, %y) {
  %x = input : f32[3]
  %y = input : f32[3]
  %a = exp(%x) : f32[3]
  %b = exp(%x) : f32[3]
  %c1 = constant {value=[1.0,2.0,3.0]} : f32[3]
  %c2 = constant {value=[1.0,2.0,3.0]} : f32[3]
  %s1 = add(%a, %c1) : f32[3]
  %s2 = add(%c2, %b) : f32[3]
  %k1 = constant {value=7} : i64[]
  %k2 = constant {value=7} : i64[]
  %r1 = randn(%k1) {shape=[3], dtype=f32} : f32[3]
  %r2 = randn(%k2) {shape=[3], dtype=f32} : f32[3]
  %n1 = mul(%s1, %r1) : f32[3]
  %n2 = mul(%s2, %r2) : f32[3]
  return %n1 as n1, %n2 as n2
}";
        let after = "graph g(%x, %y) {
  %x = input : f32[3]
  %y = input : f32[3]
  %a = exp(%x) : f32[3]
  %c1 = constant {value=[1.0,2.0,3.0]} : f32[3]
  %s1 = add(%a, %c1) : f32[3]
  %k1 = constant {value=7} : i64[]
  %r1 = randn(%k1) {shape=[3], dtype=f32} : f32[3]
  %n1 = mul(%s1, %r1) : f32[3]
  return %n1 as n1, %n1 as n2
}
";
        assert_rewrites(run, &PassContext::default(), before, after);
    }

    /// Different seeds, different hints, signed zeros, non-commutative
    /// operand order and distinct inputs of equal type all stay apart.
    #[test]
    fn keeps_what_differs() {
        let before = r#"graph g(%x, %y, %k) {
  %x = input : f32[3]
  %y = input : f32[3]
  %k = input : i64[]
  %k1 = constant {value=1} : i64[]
  %k2 = constant {value=2} : i64[]
  %r1 = rand(%k1) {shape=[3], dtype=f32} : f32[3]
  %r2 = rand(%k2) {shape=[3], dtype=f32} : f32[3]
  %r3 = rand(%k) {shape=[3], dtype=f32} : f32[3]
  %r4 = randn(%k) {shape=[3], dtype=f32} : f32[3]
  %a = exp(%x) : f32[3]  hints={"group_id":0}
  %b = exp(%x) : f32[3]  hints={"group_id":1}
  %z1 = constant {value=0.0} : f32[]
  %z2 = constant {value=-0.0} : f32[]
  %m1 = maximum(%x, %y) : f32[3]
  %m2 = maximum(%y, %x) : f32[3]
  %d1 = sub(%x, %y) : f32[3]
  %d2 = sub(%y, %x) : f32[3]
  return %r1 as r1, %r2 as r2, %r3 as r3, %r4 as r4, %a as a, %b as b, %z1 as z1, %z2 as z2, %m1 as m1, %m2 as m2, %d1 as d1, %d2 as d2
}"#;
        assert_unchanged(run, &PassContext::default(), before);
    }
}
