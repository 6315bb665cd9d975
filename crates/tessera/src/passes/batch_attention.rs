//! Per-slice attention merged back into one batched op: after the
//! `attention` pass, the seed's sliced code reads
//!
//! ```text
//! cat(flash(q[0:1], k[0:1], v[0:1]), flash(q[1:2], k[1:2], v[1:2]), …, dim=0)
//! ```
//!
//! which is `flash(q, k, v)`: one op (one kernel launch, its own parallel
//! split over batch × heads × query blocks) instead of one per slice.
//!
//! What merges: a `cat` along a batch dim (not one of the last two) whose
//! every part is a `tessera::flash_attention` node read only by the `cat`,
//! all with the same attributes, each operand of part `i` a step-1 slice
//! along that dim of one shared tensor, the slices in order and covering it
//! whole (a mask, if any, the same `[Lq, Lk]` node in every part). The
//! `cat`, the parts and the slices must carry the same hints, and those
//! hints must not ask for `strict` order: slicing under a `strict` hint is
//! the user asking for one slice at a time, which a merge would undo. The
//! new op takes the `cat`'s name, call site and hints. Each merge is logged
//! under `TESSERA_LOGS=fusion`.
//!
//! Exact: each output row is computed from the same operands by the same
//! kernel; only the split of the work among threads changes.

use super::pattern::same_hints;
use super::rewrite::{use_counts, Replacements};
use super::PassContext;
use crate::custom_op::flash_attention::FORWARD;
use crate::custom_op::CustomCall;
use crate::error::Result;
use crate::hints::{Hint, HintMap, Order};
use crate::ir::{Dim, Graph, NodeId, Op};
use crate::logging::log;

pub fn run(graph: &mut Graph, _ctx: &PassContext) -> Result<bool> {
    let uses = use_counts(graph);
    let mut r = Replacements::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        if let Some((call, operands)) = merged(graph, &uses, id) {
            log("fusion", || describe(graph, id, &operands));
            r.replace_with(graph, id, Op::Custom(call), &operands)?;
        }
    }
    r.apply(graph)
}

/// The op and operands that compute the `cat` node `id` in one call.
fn merged(g: &Graph, uses: &[usize], id: NodeId) -> Option<(CustomCall, Vec<NodeId>)> {
    let node = g.node(id);
    let Op::Cat { dim } = node.op else {
        return None;
    };
    let parts = &node.inputs;
    let call = flash_call(g, parts[0])?;
    let batch_dim = dim + 2 < node.ty.rank();
    let alike = parts
        .iter()
        .all(|&p| uses[p.index()] == 1 && flash_call(g, p).as_ref() == Some(&call));
    if parts.len() < 2 || !batch_dim || !alike {
        return None;
    }
    let arity = g.node(parts[0]).inputs.len();
    let mut operands = Vec::with_capacity(arity);
    let mut absorbed: Vec<NodeId> = parts.iter().copied().chain([id]).collect();
    for position in 0..arity {
        let each: Vec<NodeId> = parts.iter().map(|&p| g.node(p).inputs[position]).collect();
        let whole = match position {
            3 => shared_mask(g, &each)?,
            _ => {
                absorbed.extend(&each);
                whole_of_slices(g, &each, dim)?
            }
        };
        operands.push(whole);
    }
    if !same_hints(g, &absorbed) || is_strict(&node.meta.hints) {
        return None;
    }
    let types: Vec<_> = operands.iter().map(|&x| g.node(x).ty.clone()).collect();
    let out = call.infer(&types).ok()?;
    (out[0] == node.ty).then_some((call, operands))
}

/// The call of `id` when it is a flash attention node.
fn flash_call(g: &Graph, id: NodeId) -> Option<CustomCall> {
    match &g.node(id).op {
        Op::Custom(call) if call.name() == FORWARD => Some(call.clone()),
        _ => None,
    }
}

/// The tensor that `slices`, step-1 slices along `dim` in order, cover
/// whole.
fn whole_of_slices(g: &Graph, slices: &[NodeId], dim: usize) -> Option<NodeId> {
    let mut whole = None;
    let mut next = 0;
    for &s in slices {
        let node = g.node(s);
        match node.op {
            Op::Slice {
                dim: d,
                start,
                end,
                step: 1,
            } if d == dim && start == next => next = end,
            _ => return None,
        }
        if *whole.get_or_insert(node.inputs[0]) != node.inputs[0] {
            return None;
        }
    }
    let x = whole?;
    (g.node(x).ty.shape.dims().get(dim) == Some(&Dim::Const(next))).then_some(x)
}

/// The mask every part reads, when it is one `[Lq, Lk]` node (shared by
/// every batch and head, so by the merged op too).
fn shared_mask(g: &Graph, masks: &[NodeId]) -> Option<NodeId> {
    let m = masks[0];
    (masks.iter().all(|&x| x == m) && g.node(m).ty.rank() == 2).then_some(m)
}

/// Whether the hints ask for program order.
fn is_strict(hints: &Option<HintMap>) -> bool {
    hints.as_ref().is_some_and(|map| {
        Hint::from_map(map).map_or(true, |(hint, _)| hint.order == Some(Order::Strict))
    })
}

fn describe(g: &Graph, id: NodeId, operands: &[NodeId]) -> String {
    let node = g.node(id);
    let whole: Vec<String> = operands
        .iter()
        .map(|&x| format!("{} {}", g.display_name(x), g.node(x).ty))
        .collect();
    let at = node
        .meta
        .location
        .as_ref()
        .map_or(String::new(), |l| format!(" at {l}"));
    format!(
        "batch_attention: {} = cat of {} {FORWARD} ops over slices{at} -> one op on {}",
        g.display_name(id),
        node.inputs.len(),
        whole.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::passes::testing::{assert_rewrites, assert_unchanged};
    use crate::passes::PassContext;

    /// Two slices of `[2, 4, 8]` operands, one op each, concatenated.
    /// `hints` on every node, `b_hints` instead on the second op.
    fn sliced_with(hints: &str, b_hints: &str, second_start: usize) -> String {
        let attrs = r#"{op="tessera::flash_attention", attrs="{\"causal\":true,\"scale\":0.5}"}"#;
        let end = second_start + 1;
        format!(
            r#"graph g(%q, %k, %v) {{
  %q = input : f32[2,4,8]
  %k = input : f32[2,4,8]
  %v = input : f32[2,4,8]
  %q0 = slice(%q) {{dim=0, start=0, end=1, step=1}} : f32[1,4,8]{hints}
  %k0 = slice(%k) {{dim=0, start=0, end=1, step=1}} : f32[1,4,8]{hints}
  %v0 = slice(%v) {{dim=0, start=0, end=1, step=1}} : f32[1,4,8]{hints}
  %q1 = slice(%q) {{dim=0, start={second_start}, end={end}, step=1}} : f32[1,4,8]{hints}
  %k1 = slice(%k) {{dim=0, start=1, end=2, step=1}} : f32[1,4,8]{hints}
  %v1 = slice(%v) {{dim=0, start=1, end=2, step=1}} : f32[1,4,8]{hints}
  %a = custom(%q0, %k0, %v0) {attrs} : f32[1,4,8]{hints}
  %b = custom(%q1, %k1, %v1) {attrs} : f32[1,4,8]{b_hints}
  %o = cat(%a, %b) {{dim=0}} : f32[2,4,8]{hints}  # attn.rs:12:5
  return %o as o
}}"#
        )
    }

    fn sliced(hints: &str, second_start: usize) -> String {
        sliced_with(hints, hints, second_start)
    }

    #[test]
    fn slices_covering_the_batch_merge_into_one_op() {
        let after = r#"graph g(%q, %k, %v) {
  %q = input : f32[2,4,8]
  %k = input : f32[2,4,8]
  %v = input : f32[2,4,8]
  %o = custom(%q, %k, %v) {op="tessera::flash_attention", attrs="{\"causal\":true,\"scale\":0.5}"} : f32[2,4,8]  # attn.rs:12:5
  return %o as o
}
"#;
        assert_rewrites(run, &PassContext::default(), &sliced("", 1), after);
        let grouped = r#"  hints={"group_id":0}"#;
        let (_, text) =
            crate::passes::testing::rewrite(run, &PassContext::default(), &sliced(grouped, 1));
        assert!(
            text.contains(r#"custom(%q, %k, %v)"#) && text.contains(grouped),
            "{text}"
        );
    }

    #[test]
    fn strict_hints_out_of_order_slices_and_other_readers_stay() {
        let ctx = PassContext::default();
        assert_unchanged(run, &ctx, &sliced(r#"  hints={"order":"strict"}"#, 1));
        // q's slices overlap: not the whole of q.
        assert_unchanged(run, &ctx, &sliced("", 0));
        let read_twice = sliced("", 1).replace("return %o as o", "return %o as o, %a as a");
        assert_unchanged(run, &ctx, &read_twice);
        let other_attrs = sliced("", 1).replacen(r#"\"causal\":true"#, r#"\"causal\":false"#, 1);
        assert_unchanged(run, &ctx, &other_attrs);
        let other_group = sliced_with("", r#"  hints={"group_id":1}"#, 1);
        assert_unchanged(run, &ctx, &other_group);
    }
}
