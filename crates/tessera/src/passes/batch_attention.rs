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
//! `cat`, the parts and the slices must carry the same hints (so slices of
//! two groups, or of one group and no group, never merge). The new op takes
//! the `cat`'s name, call site and hints. Each merge is logged under
//! `TESSERA_LOGS=fusion`.
//!
//! Under a `strict` order or a `memory_budget_mb` hint the merge must also
//! keep the hint's memory intent: slicing under such a hint is the user
//! bounding memory, and one flash call over every slice needs no
//! `[Lq, Lk]` scores either, only O(1) f32 statistics per query row, so it
//! bounds memory as well while running as one launch. The pass estimates
//! the bytes live at once, forward or backward, for the graph it sees
//! (`MemoryEstimate`):
//! - per slice, one slice at a time: at the `cat`, every part (output and
//!   saved row statistics; in the backward the q, k and v gradient parts)
//!   next to the concatenation, plus one slice's statistics;
//! - merged: the results once, plus the whole call's statistics
//!   (8 bytes a query row: 4 MiB at the seed's (8, 32, 2048, 128)).
//!
//! It merges when the merged estimate is at most the per-slice one and
//! within the budget, if any, and otherwise keeps the slices; the decision
//! and both figures are logged under `TESSERA_LOGS=fusion,schedule`. (The
//! memory planner may later place each part within the concatenation, a
//! cat in place: the per-slice schedule then holds one slice's statistics
//! beyond the results, and the merge trades the whole call's statistics,
//! O(N) bytes per head, for one launch instead of one per slice.)
//!
//! Exact: each output row is computed from the same operands by the same
//! kernel; only the split of the work among threads changes.

use super::pattern::same_hints;
use super::rewrite::{use_counts, Replacements};
use super::PassContext;
use crate::error::Result;
use crate::hints::{Hint, HintMap, Order};
use crate::ir::custom::flash_attention::FORWARD;
use crate::ir::custom::CustomCall;
use crate::ir::{Dim, Graph, NodeId, Op, TensorType};
use crate::logging::log;

pub fn run(graph: &mut Graph, _ctx: &PassContext) -> Result<bool> {
    let uses = use_counts(graph);
    let mut r = Replacements::new();
    for i in 0..graph.len() {
        let id = NodeId(i as u32);
        let Some((call, operands)) = merged(graph, &uses, id) else {
            continue;
        };
        if let Some(intent) = MemoryIntent::of(&graph.node(id).meta.hints) {
            let estimate = MemoryEstimate::new(graph, id, &operands);
            let merge = estimate.keeps(&intent);
            log("fusion", || estimate.describe(graph, id, &intent, merge));
            log("schedule", || estimate.describe(graph, id, &intent, merge));
            if !merge {
                continue;
            }
        }
        log("fusion", || describe(graph, id, &operands));
        r.replace_with(graph, id, Op::Custom(call), &operands)?;
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
    if !same_hints(g, &absorbed) {
        return None;
    }
    let types: Vec<_> = operands.iter().map(|&x| g.node(x).ty.clone()).collect();
    let out = call.infer(&types).ok()?;
    (out[0] == node.ty).then_some((call, operands))
}

/// What a hint asks of memory: one slice at a time (`strict`) and/or a
/// budget. `None`: no memory intent, the merge is free.
struct MemoryIntent {
    strict: bool,
    budget: Option<usize>,
}

impl MemoryIntent {
    fn of(hints: &Option<std::sync::Arc<HintMap>>) -> Option<MemoryIntent> {
        let map = hints.as_ref()?;
        // A hint the scheduler cannot read is kept as written: no merge
        // that could undo what it meant (nothing fits a budget of 0).
        let Ok((hint, _)) = Hint::from_map(map) else {
            return Some(MemoryIntent {
                strict: true,
                budget: Some(0),
            });
        };
        let strict = hint.order == Some(Order::Strict);
        let budget = hint.memory_budget_bytes();
        (strict || budget.is_some()).then_some(MemoryIntent { strict, budget })
    }
}

/// Bytes live at once, forward or backward, with the slices kept and with
/// them merged (see the module docs).
struct MemoryEstimate {
    slices: usize,
    per_slice: usize,
    merged: usize,
}

/// f32 statistics per query row: the forward's log-sum-exp (saved for the
/// backward) and the backward's `rowsum(dO ∘ O)`.
const ROW_STATISTICS_BYTES: usize = 8;

impl MemoryEstimate {
    /// For the `cat` node `cat` whose parts compute attention on
    /// `operands` (q, k, v[, mask]) merged.
    fn new(g: &Graph, cat: NodeId, operands: &[NodeId]) -> MemoryEstimate {
        let bytes = |ty: &TensorType| {
            ty.shape
                .as_concrete()
                .map_or(0, |s| s.iter().product::<usize>() * ty.dtype.size_bytes())
        };
        let out = &g.node(cat).ty;
        let rows = out
            .shape
            .as_concrete()
            .map_or(0, |s| s[..s.len() - 1].iter().product::<usize>());
        let slices = g.node(cat).inputs.len();
        // Forward: the output and its saved statistics; backward: the
        // gradients of q, k and v.
        let forward = bytes(out) + rows * 4;
        let backward: usize = operands[..3].iter().map(|&x| bytes(&g.node(x).ty)).sum();
        let results = forward.max(backward);
        let statistics = rows * ROW_STATISTICS_BYTES;
        MemoryEstimate {
            slices,
            per_slice: 2 * results + statistics / slices.max(1),
            merged: results + statistics,
        }
    }

    fn keeps(&self, intent: &MemoryIntent) -> bool {
        self.merged <= self.per_slice && intent.budget.is_none_or(|b| self.merged <= b)
    }

    fn describe(&self, g: &Graph, cat: NodeId, intent: &MemoryIntent, merge: bool) -> String {
        let node = g.node(cat);
        let at = node
            .meta
            .location
            .as_ref()
            .map_or(String::new(), |l| format!(" at {l}"));
        let hint = match (intent.strict, intent.budget) {
            (true, Some(b)) => format!("strict order, memory budget {b} bytes"),
            (true, None) => "strict order".to_string(),
            (false, Some(b)) => format!("memory budget {b} bytes"),
            (false, None) => unreachable!("an intent has one of the two"),
        };
        let verdict = match merge {
            true => "merged: one call holds no more",
            false => "kept per slice: one call would hold more",
        };
        format!(
            "batch_attention: {} = cat of {} {FORWARD} ops{at} under {hint}: estimated peak {} bytes per slice (parts and result at the cat, one slice's row statistics), {} bytes as one call (result, every row's statistics); {verdict}",
            g.display_name(cat),
            self.slices,
            self.per_slice,
            self.merged,
        )
    }
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
        match &node.op {
            Op::Slice {
                dim: d,
                start,
                end: Dim::Const(end),
                step: 1,
            } if *d == dim && *start == next => next = *end,
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

    /// Under a `strict` hint of one group the slices merge (one call holds
    /// no more than the slices at their `cat`), the hints kept on the op.
    #[test]
    fn strict_slices_of_one_group_merge_keeping_their_hints() {
        let hints = r#"  hints={"group_id":0,"order":"strict"}"#;
        let after = r#"graph g(%q, %k, %v) {
  %q = input : f32[2,4,8]
  %k = input : f32[2,4,8]
  %v = input : f32[2,4,8]
  %o = custom(%q, %k, %v) {op="tessera::flash_attention", attrs="{\"causal\":true,\"scale\":0.5}"} : f32[2,4,8]  hints={"group_id":0,"order":"strict"}  # attn.rs:12:5
  return %o as o
}
"#;
        assert_rewrites(run, &PassContext::default(), &sliced(hints, 1), after);
    }

    /// The estimate at `[2, 4, 8]` f32 (8 query rows): results 768 bytes
    /// (the three gradients), statistics 64: 832 bytes as one call, 1568
    /// per slice. A budget below 832 bytes keeps the slices, one above
    /// merges them.
    #[test]
    fn a_memory_budget_the_merged_call_exceeds_keeps_the_slices() {
        let ctx = PassContext::default();
        let g = crate::ir::text::parse(&sliced("", 1)).unwrap();
        let cat = g.outputs[0].node;
        let estimate = super::MemoryEstimate::new(&g, cat, &g.inputs);
        assert_eq!((estimate.merged, estimate.per_slice), (832, 1568));
        // 0.0007 MiB = 734 bytes; 0.001 MiB = 1048 bytes.
        let tight = r#"  hints={"memory_budget_mb":0.0007,"order":"strict"}"#;
        assert_unchanged(run, &ctx, &sliced(tight, 1));
        let roomy = r#"  hints={"memory_budget_mb":0.001,"order":"strict"}"#;
        let (changed, text) = crate::passes::testing::rewrite(run, &ctx, &sliced(roomy, 1));
        assert!(changed && text.contains("custom(%q, %k, %v)"), "{text}");
    }

    /// Slices of two groups (or of a group and none, or under different
    /// orders) never merge, strict or not.
    #[test]
    fn slices_of_different_groups_or_hints_never_merge() {
        let ctx = PassContext::default();
        for (a, b) in [
            (r#"  hints={"group_id":0}"#, r#"  hints={"group_id":1}"#),
            (
                r#"  hints={"group_id":0,"order":"strict"}"#,
                r#"  hints={"group_id":1,"order":"strict"}"#,
            ),
            (r#"  hints={"group_id":0,"order":"strict"}"#, ""),
            (
                r#"  hints={"group_id":0,"order":"strict"}"#,
                r#"  hints={"group_id":0,"order":"dfs"}"#,
            ),
        ] {
            assert_unchanged(run, &ctx, &sliced_with(a, b, 1));
        }
    }

    #[test]
    fn out_of_order_slices_and_other_readers_stay() {
        let ctx = PassContext::default();
        // q's slices overlap: not the whole of q.
        assert_unchanged(run, &ctx, &sliced("", 0));
        let strict = r#"  hints={"order":"strict"}"#;
        assert_unchanged(run, &ctx, &sliced(strict, 0));
        let read_twice = sliced("", 1).replace("return %o as o", "return %o as o, %a as a");
        assert_unchanged(run, &ctx, &read_twice);
        let other_attrs = sliced("", 1).replacen(r#"\"causal\":true"#, r#"\"causal\":false"#, 1);
        assert_unchanged(run, &ctx, &other_attrs);
        let other_group = sliced_with("", r#"  hints={"group_id":1}"#, 1);
        assert_unchanged(run, &ctx, &other_group);
    }
}
