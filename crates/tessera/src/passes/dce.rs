//! Dead-code elimination: removes the nodes no output depends on.
//!
//! Every op is pure (random ops are functions of their seed), so a node
//! whose value nobody reads can go. Graph inputs stay even when unused: they
//! are the graph's calling convention. The work is [`rewrite::cleanup`]'s,
//! which every pass runs after its edits; as a pass of its own it cleans up
//! a graph that came from elsewhere (a trace, a file).

use super::{rewrite, PassContext};
use crate::error::Result;
use crate::ir::Graph;

pub fn run(graph: &mut Graph, _ctx: &PassContext) -> Result<bool> {
    rewrite::cleanup(graph)
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    #[test]
    fn removes_dead_chains_but_keeps_unused_inputs() {
        let before = "graph g(%x, %spare) {
  %x = input : f32[3]
  %spare = input : f32[2]
  %dead = exp(%x) : f32[3]
  %dead2 = neg(%dead) : f32[3]
  %y = relu(%x) : f32[3]
  return %y as y
}";
        let after = "graph g(%x, %spare) {
  %x = input : f32[3]
  %spare = input : f32[2]
  %y = relu(%x) : f32[3]
  return %y as y
}
";
        assert_rewrites(run, &PassContext::default(), before, after);
    }

    #[test]
    fn keeps_everything_an_output_reads() {
        let before = "graph g(%x) {
  %x = input : f32[3]
  %a = exp(%x) : f32[3]
  %k = constant {value=3} : i64[]
  %r = randn(%k) {shape=[3], dtype=f32} : f32[3]
  %y = add(%a, %r) : f32[3]
  return %y as y, %a as a
}";
        assert_unchanged(run, &PassContext::default(), before);
    }
}
