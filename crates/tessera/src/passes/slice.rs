//! Slicing by hint: a region hinted `{"slice": {"dim": D, "parts": P}}` is
//! split along dim D of its results into P slices, each computed from
//! slices of the region's inputs, and the results concatenated — what the
//! seed's hand-sliced attention does, from the naive code and one hint.
//! Under `order: "strict"` the slices run one after another, so only one
//! slice's intermediates (the attention scores) are live at a time.
//!
//! The region is every node whose hints carry the same `slice` (and the
//! same other keys). Its *results* are the values read outside it, each
//! taken before the reshapes that end the region (a `reshape` back to the
//! caller's shape is applied to the concatenation). D counts in those
//! results' dims. The pass walks the region backwards from them, mapping
//! the sliced dim of each value to its operands:
//!
//! - elementwise ops, `where`, casts: the same dim, by broadcasting (an
//!   operand that broadcasts along it is read whole);
//! - `matmul`: a batch dim maps to both operands' (broadcast ones whole),
//!   the rows to the left operand's rows (the right one whole), the
//!   columns to the right one's columns (the left one whole);
//! - reductions, `softmax`, `log_softmax`, `argmax`: a dim they do not
//!   reduce over;
//! - views that keep the dim (`permute`, a `reshape` that leaves it alone,
//!   `expand`, a `slice` or `cat` along another dim), `tril`/`triu` of a
//!   batch dim, `full` (made at the slice's size), `index_select` of another
//!   dim; a `cat` of one tensor and a `slice` of everything (what
//!   `tensor_split(1)` leaves) are the identity.
//!
//! A view or a constant that does not map the dim (a `reshape` merging it
//! with its neighbours, at the region's start) is computed whole and its
//! value sliced; a value some node needs whole is computed whole. An op
//! that computes across the dim (a reduction over it, a softmax along it),
//! a random op (its slices would draw other numbers), a custom op, or
//! parts that outnumber the dim's elements refuse the hint: nothing is
//! rewritten, and `TESSERA_LOGS=hints` names the op and its line. Parts
//! need not divide the dim: as `tensor_split`, the first `len % P` slices
//! are one longer.
//!
//! Every node the pass makes, and the region's other nodes, carry the
//! region's hints without `slice`: the pass runs once per region, and AOT
//! autograd differentiates the sliced graph, so the backward is sliced too
//! (and recomputes slice by slice under `strict`).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::rewrite::Replacements;
use super::PassContext;
use crate::error::Result;
use crate::hints::{self, Hint, HintMap, SliceHint};
use crate::ir::{Dim, Graph, NodeId, NodeMeta, Op, Shape};

const KEY: &str = "slice";

pub fn run(graph: &mut Graph, _ctx: &PassContext) -> Result<bool> {
    let regions = regions(graph);
    if regions.is_empty() {
        return Ok(false);
    }
    let mut replacements = Replacements::new();
    for (json, members) in &regions {
        let map = graph.node(members[0]).meta.hints.clone().expect("hinted");
        let hint = match Hint::from_map(&map) {
            Ok((h, _)) => h.slice.expect("the region has a slice key"),
            Err(e) => {
                hints::not_honoured("slice pass", &map, KEY, &e.message);
                continue;
            }
        };
        match plan_region(graph, members, hint) {
            Ok(Some(plan)) => {
                let stripped = hints::without_key(&map, KEY);
                emit(graph, &plan, hint, stripped, &mut replacements)?;
                crate::logging::log("hints", || {
                    format!(
                        "slice pass: region {json} split along dim {} into {} slices ({} nodes each)",
                        hint.dim,
                        hint.parts,
                        plan.sliced.len()
                    )
                });
            }
            Ok(None) => {}
            Err(reason) => hints::not_honoured("slice pass", &map, KEY, &reason),
        }
    }
    // The key is done with, honoured or not: strip it from every node of
    // the regions (the new ones were made without it).
    for (_, members) in regions {
        for id in members {
            let meta = &mut graph.nodes[id.index()].meta;
            if let Some(map) = meta.hints.clone() {
                meta.hints = hints::without_key(&map, KEY);
            }
        }
    }
    replacements.apply(graph)?;
    Ok(true)
}

/// The hinted regions: nodes with a `slice` key, by their hints (JSON).
fn regions(g: &Graph) -> BTreeMap<String, Vec<NodeId>> {
    let mut regions: BTreeMap<String, Vec<NodeId>> = BTreeMap::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let Some(map) = &node.meta.hints else {
            continue;
        };
        if map.contains_key(KEY) {
            let json = serde_json::Value::Object((**map).clone()).to_string();
            regions.entry(json).or_default().push(NodeId(i as u32));
        }
    }
    regions
}

/// How one operand of a sliced node is read.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Read {
    /// Its slice along this dim.
    Sliced(usize),
    Whole,
}

/// What to rewrite: the sliced nodes in graph order, each with its sliced
/// dim and how it reads its operands; the results to concatenate; the
/// length of the sliced dim.
struct SlicePlan {
    sliced: Vec<(NodeId, usize, Vec<Read>)>,
    results: Vec<NodeId>,
    len: usize,
}

fn concrete(g: &Graph, id: NodeId) -> Option<Vec<usize>> {
    g.node(id).ty.shape.as_concrete()
}

/// `op (file:line)` of a node, for messages.
fn describe(g: &Graph, id: NodeId) -> String {
    let node = g.node(id);
    let at = node
        .meta
        .location
        .as_ref()
        .map(|l| format!(" at {l}"))
        .unwrap_or_default();
    format!("`{}` ({}){at}", node.op.name(), g.display_name(id))
}

/// The slicing of a region, `None` when nothing is to slice (one part);
/// the reason when the hint cannot be honoured.
fn plan_region(
    g: &Graph,
    members: &[NodeId],
    hint: SliceHint,
) -> std::result::Result<Option<SlicePlan>, String> {
    if hint.parts == 1 {
        return Ok(None);
    }
    let n = g.len();
    let mut in_region = vec![false; n];
    for &m in members {
        in_region[m.index()] = true;
    }
    let mut readers: Vec<Vec<NodeId>> = vec![Vec::new(); n];
    for (i, node) in g.nodes.iter().enumerate() {
        for &x in &node.inputs {
            readers[x.index()].push(NodeId(i as u32));
        }
    }
    let mut is_output = vec![false; n];
    for o in &g.outputs {
        is_output[o.node.index()] = true;
    }
    let read_outside = |id: NodeId| {
        is_output[id.index()] || readers[id.index()].iter().any(|r| !in_region[r.index()])
    };
    // The results, each before the reshapes that end the region.
    let mut results: Vec<NodeId> = Vec::new();
    for &m in members.iter().filter(|&&m| read_outside(m)) {
        let mut r = m;
        while let Op::Reshape(_) = g.node(r).op {
            let x = g.node(r).inputs[0];
            if !in_region[x.index()] || readers[x.index()].len() != 1 || is_output[x.index()] {
                break;
            }
            r = x;
        }
        if !results.contains(&r) {
            results.push(r);
        }
    }
    let mut len = None;
    for &r in &results {
        let shape = concrete(g, r).ok_or_else(|| {
            format!(
                "the region's result {} has symbolic sizes (slicing needs concrete ones)",
                describe(g, r)
            )
        })?;
        let Some(&l) = shape.get(hint.dim) else {
            return Err(format!(
                "the region's result {} has rank {}, no dim {}",
                describe(g, r),
                shape.len(),
                hint.dim
            ));
        };
        if *len.get_or_insert(l) != l {
            return Err(format!(
                "the region's results differ in the length of dim {} ({} vs {})",
                hint.dim,
                len.unwrap_or(0),
                l
            ));
        }
    }
    let Some(len) = len else {
        return Ok(None);
    };
    if hint.parts > len {
        return Err(format!(
            "{} parts of a dim of {len} elements (at most {len})",
            hint.parts
        ));
    }
    // Backwards: each node's sliced dim from what its readers ask.
    let mut asked: Vec<Vec<Read>> = vec![Vec::new(); n];
    let mut dim_of: Vec<Option<usize>> = vec![None; n];
    let mut reads: HashMap<NodeId, Vec<Read>> = HashMap::new();
    for &m in members.iter().rev() {
        let i = m.index();
        let wanted = if results.contains(&m) {
            Some(hint.dim)
        } else if read_outside(m) || asked[i].is_empty() {
            None
        } else {
            match asked[i][0] {
                Read::Sliced(d) if asked[i].iter().all(|&a| a == Read::Sliced(d)) => Some(d),
                _ => None,
            }
        };
        let ops = match wanted.map(|d| map_dim(g, m, d)) {
            Some(Ok(ops)) => Some(ops),
            Some(Err(Refusal::Whole)) if !results.contains(&m) => None,
            Some(Err(Refusal::Whole)) => {
                return Err(format!(
                    "the result {} cannot be sliced along dim {} (it is made by a view that moves the dim)",
                    describe(g, m),
                    hint.dim
                ))
            }
            Some(Err(Refusal::Op(why))) => {
                return Err(format!("{} {why}", describe(g, m)));
            }
            None => None,
        };
        let node = g.node(m);
        match ops {
            Some(ops) => {
                let d = wanted.expect("sliced");
                for (&x, &r) in node.inputs.iter().zip(&ops) {
                    if let Read::Sliced(dx) = r {
                        let size = concrete(g, x).and_then(|s| s.get(dx).copied());
                        if size != Some(len) {
                            return Err(format!(
                                "{} reads dim {dx} of {} with {size:?} elements, not {len}",
                                describe(g, m),
                                g.display_name(x)
                            ));
                        }
                    }
                    asked[x.index()].push(r);
                }
                dim_of[i] = Some(d);
                reads.insert(m, ops);
            }
            None => {
                for &x in &node.inputs {
                    asked[x.index()].push(Read::Whole);
                }
            }
        }
    }
    let sliced: Vec<(NodeId, usize, Vec<Read>)> = members
        .iter()
        .filter_map(|&m| Some((m, dim_of[m.index()]?, reads.remove(&m)?)))
        .collect();
    Ok(Some(SlicePlan {
        sliced,
        results,
        len,
    }))
}

enum Refusal {
    /// The node may be computed whole (a view, a constant).
    Whole,
    /// The node cannot be sliced: the hint is refused, for this reason.
    Op(String),
}

/// How node `id`, sliced along its dim `d`, reads its operands.
fn map_dim(g: &Graph, id: NodeId, d: usize) -> std::result::Result<Vec<Read>, Refusal> {
    let node = g.node(id);
    let out = node
        .ty
        .shape
        .as_concrete()
        .ok_or_else(|| Refusal::Op("has symbolic sizes".into()))?;
    let rank = out.len();
    let shape_of = |x: NodeId| {
        concrete(g, x).ok_or_else(|| Refusal::Op("reads a value of symbolic sizes".into()))
    };
    // Broadcasting: the operand's dim aligned with output dim `d`.
    let broadcast = |x: NodeId| -> std::result::Result<Read, Refusal> {
        let s = shape_of(x)?;
        let lead = rank - s.len();
        Ok(match d.checked_sub(lead) {
            Some(dx) if s[dx] == out[d] => Read::Sliced(dx),
            _ => Read::Whole,
        })
    };
    let across = |what: &str| Err(Refusal::Op(format!("{what} dim {d}, the sliced dim")));
    match &node.op {
        Op::Unary(_) | Op::Cast(_) | Op::BitCast(_) | Op::Contiguous => Ok(vec![Read::Sliced(d)]),
        Op::Binary(_) | Op::Compare(_) | Op::Where => {
            node.inputs.iter().map(|&x| broadcast(x)).collect()
        }
        Op::Tril { .. } | Op::Triu { .. } => match d + 2 < rank {
            true => Ok(vec![Read::Sliced(d)]),
            false => across("masks a triangle over"),
        },
        Op::Reduce { dims, keepdim, .. } => {
            let kept: Vec<usize> = (0..shape_of(node.inputs[0])?.len())
                .filter(|x| !dims.contains(x))
                .collect();
            match keepdim {
                true if dims.contains(&d) => across("reduces over"),
                true => Ok(vec![Read::Sliced(d)]),
                false => Ok(vec![Read::Sliced(kept[d])]),
            }
        }
        Op::ArgReduce { dim, keepdim, .. } => {
            let dx = if *keepdim || d < *dim { d } else { d + 1 };
            match dx == *dim {
                true => across("reduces over"),
                false => Ok(vec![Read::Sliced(dx)]),
            }
        }
        Op::Softmax { dim } | Op::LogSoftmax { dim } => match *dim == d {
            true => across("normalises along"),
            false => Ok(vec![Read::Sliced(d)]),
        },
        Op::MatMul | Op::MatMulT { .. } => {
            let (ta, tb) = match node.op {
                Op::MatMulT {
                    transpose_a,
                    transpose_b,
                } => (transpose_a, transpose_b),
                _ => (false, false),
            };
            let (a, b) = (shape_of(node.inputs[0])?, shape_of(node.inputs[1])?);
            if a.len() < 2 || b.len() < 2 {
                return Err(Refusal::Op("is a matmul of a vector".into()));
            }
            let batch = |s: &[usize]| -> Read {
                let lead = rank - s.len();
                match d.checked_sub(lead) {
                    Some(dx) if s[dx] == out[d] => Read::Sliced(dx),
                    _ => Read::Whole,
                }
            };
            if d + 2 < rank {
                Ok(vec![batch(&a), batch(&b)])
            } else if d + 2 == rank {
                let rows = if ta { a.len() - 1 } else { a.len() - 2 };
                Ok(vec![Read::Sliced(rows), Read::Whole])
            } else {
                let cols = if tb { b.len() - 2 } else { b.len() - 1 };
                Ok(vec![Read::Whole, Read::Sliced(cols)])
            }
        }
        Op::Permute(perm) => Ok(vec![Read::Sliced(perm[d])]),
        Op::Reshape(_) => {
            let input = shape_of(node.inputs[0])?;
            let before: usize = out[..d].iter().product();
            let mut prefix = 1;
            for (i, &s) in input.iter().enumerate() {
                if prefix == before && s == out[d] {
                    return Ok(vec![Read::Sliced(i)]);
                }
                prefix *= s;
            }
            Err(Refusal::Whole)
        }
        Op::Expand(_) => Ok(vec![broadcast(node.inputs[0])?]),
        // A cat of one tensor and a slice of everything are the identity.
        Op::Cat { .. } if node.inputs.len() == 1 => Ok(vec![Read::Sliced(d)]),
        Op::Slice {
            dim,
            start: 0,
            end,
            step: 1,
        } if *dim == d
            && end.as_const() == Some(out[d])
            && shape_of(node.inputs[0])?[d] == out[d] =>
        {
            Ok(vec![Read::Sliced(d)])
        }
        Op::Slice { dim, .. } | Op::Cat { dim } => match *dim == d {
            true => Err(Refusal::Whole),
            false => Ok(vec![Read::Sliced(d); node.inputs.len()]),
        },
        Op::IndexSelect { dim } => match *dim == d {
            true => Ok(vec![Read::Whole, Read::Sliced(0)]),
            false => Ok(vec![Read::Sliced(d), Read::Whole]),
        },
        Op::Full { .. } => Ok(Vec::new()),
        Op::Constant(_) | Op::Arange { .. } => Err(Refusal::Whole),
        Op::Rand { .. } | Op::Randn { .. } => Err(Refusal::Op(
            "draws random numbers (its slices would draw others)".into(),
        )),
        Op::Input => Err(Refusal::Whole),
        Op::Gather { .. }
        | Op::IndexAdd { .. }
        | Op::ScatterAdd { .. }
        | Op::Custom(_)
        | Op::CustomOutput { .. } => Err(Refusal::Op(format!(
            "does not map dim {d} through (the slice pass knows no rule for it)"
        ))),
    }
}

/// `shape` with dim `d` of length `len`.
fn resized(shape: &Shape, d: usize, len: usize) -> Shape {
    let mut dims = shape.dims().to_vec();
    dims[d] = Dim::from(len);
    Shape::new(dims)
}

/// The op of a slice of `op`'s node along its dim `d`, `len` long.
fn sliced_op(op: &Op, d: usize, len: usize) -> Op {
    match op {
        Op::Reshape(shape) => Op::Reshape(resized(shape, d, len)),
        Op::Expand(shape) => Op::Expand(resized(shape, d, len)),
        Op::Full {
            value,
            shape,
            dtype,
        } => Op::Full {
            value: *value,
            shape: resized(shape, d, len),
            dtype: *dtype,
        },
        // Mapped only when it takes everything (the identity).
        Op::Slice { dim, .. } if *dim == d => Op::Slice {
            dim: d,
            start: 0,
            end: Dim::from(len),
            step: 1,
        },
        other => other.clone(),
    }
}

/// Appends each slice's nodes (slice 0 entirely, then slice 1, …: program
/// order runs them one after another) and the results' concatenations.
fn emit(
    g: &mut Graph,
    plan: &SlicePlan,
    hint: SliceHint,
    hints: Option<Arc<HintMap>>,
    replacements: &mut Replacements,
) -> Result<()> {
    let meta_of = |g: &Graph, from: NodeId| NodeMeta {
        name: None,
        location: g.node(from).meta.location.clone(),
        hints: hints.clone(),
    };
    let (q, r) = (plan.len / hint.parts, plan.len % hint.parts);
    let mut start = 0;
    let mut pieces: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    let dim_of: HashMap<NodeId, usize> = plan.sliced.iter().map(|(id, d, _)| (*id, *d)).collect();
    // Whole values cut into slices: (value, dim, part) → the slice node.
    let mut cuts: HashMap<(NodeId, usize, usize), NodeId> = HashMap::new();
    for part in 0..hint.parts {
        let size = q + usize::from(part < r);
        let end = start + size;
        for (id, d, reads) in &plan.sliced {
            let node = g.node(*id).clone();
            let mut inputs = Vec::with_capacity(node.inputs.len());
            for (&x, read) in node.inputs.iter().zip(reads) {
                let input = match *read {
                    Read::Whole => x,
                    Read::Sliced(dx) if dim_of.get(&x) == Some(&dx) => pieces[&x][part],
                    Read::Sliced(dx) => match cuts.get(&(x, dx, part)) {
                        Some(&c) => c,
                        None => {
                            let op = Op::Slice {
                                dim: dx,
                                start,
                                end: Dim::from(end),
                                step: 1,
                            };
                            let c = g.add(op, &[x], meta_of(g, *id))?;
                            cuts.insert((x, dx, part), c);
                            c
                        }
                    },
                };
                inputs.push(input);
            }
            let piece = g.add(sliced_op(&node.op, *d, size), &inputs, meta_of(g, *id))?;
            pieces.entry(*id).or_default().push(piece);
        }
        start = end;
    }
    for &result in &plan.results {
        let meta = NodeMeta {
            hints: hints.clone(),
            ..g.node(result).meta.clone()
        };
        let cat = g.add(Op::Cat { dim: hint.dim }, &pieces[&result], meta)?;
        replacements.replace(g, result, cat)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::run;
    use crate::hints::not_honoured_messages;
    use crate::passes::testing::rewrite;
    use crate::passes::PassContext;

    const HINT: &str = r#"  hints={"order":"strict","slice":{"dim":0,"parts":2}}"#;

    #[test]
    fn attention_is_sliced_along_its_batch_and_the_key_is_dropped() {
        let before = format!(
            "graph g(%q, %k) {{
  %q = input : f32[2,3,4]
  %k = input : f32[2,3,4]
  %kt = permute(%k) {{perm=[0,2,1]}} : f32[2,4,3]{HINT}
  %s = matmul(%q, %kt) : f32[2,3,3]{HINT}
  %p = softmax(%s) {{dim=2}} : f32[2,3,3]{HINT}
  %o = matmul(%p, %q) : f32[2,3,4]{HINT}
  return %o as o
}}"
        );
        let (changed, after) = rewrite(run, &PassContext::default(), &before);
        assert!(changed);
        assert!(!after.contains("slice\":"), "{after}");
        assert_eq!(after.matches("softmax").count(), 2, "{after}");
        assert_eq!(after.matches("= matmul").count(), 4, "{after}");
        assert!(after.contains("cat("), "{after}");
        // Slice 0 is computed entirely before slice 1 starts.
        let first_softmax = after.find("softmax").unwrap();
        let second_slice_of_q = after.match_indices("slice(%q)").nth(1).unwrap().0;
        assert!(first_softmax < second_slice_of_q, "{after}");
    }

    #[test]
    fn a_reduction_over_the_dim_is_refused_naming_the_op() {
        let hint = r#"  hints={"slice":{"dim":0,"parts":2}}"#;
        let before = format!(
            "graph g(%x) {{
  %x = input : f32[4,3]
  %m = sum(%x) {{dims=[0], keepdim=true}} : f32[1,3]{hint}
  %c = sub(%x, %m) : f32[4,3]{hint}
  %p = softmax(%c) {{dim=0}} : f32[4,3]{hint}
  %e = exp(%p) : f32[4,3]{hint}
  return %e as e
}}"
        );
        let (_, after) = rewrite(run, &PassContext::default(), &before);
        assert!(!after.contains("cat("), "{after}");
        assert!(!after.contains("slice\":"), "the key is dropped: {after}");
        let said = not_honoured_messages();
        assert!(
            said.iter()
                .any(|m| m.contains("`softmax`") && m.contains("normalises along dim 0")),
            "{said:?}"
        );
    }
}
