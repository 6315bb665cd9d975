//! Ahead-of-time autograd: a forward graph that also returns what the
//! backward needs, and a backward graph that turns those saved values and
//! the output gradients (tangents) into input gradients.
//!
//! The joint graph is obtained by tracing: the forward graph is replayed on
//! traced inputs that require grad, and the eager engine's `grad` runs the
//! same VJP rules on traced tensors. The partitioner then decides, per value
//! the backward needs, whether the forward saves it or the backward
//! recomputes it (see [`Partition`]).
//!
//! Context hints override the partition region by region: a forward value
//! made under a hint that [`recomputes`](crate::hints::Hint::recomputes)
//! (`"recompute": true`, the default under `order: "strict"`) is never
//! saved; the backward recomputes it from the region's inputs (activation
//! checkpointing, matmuls included, which the min-cut never recomputes).
//! The recomputed ops take the backward's hints (`backward_group_id`) and
//! sit in the backward graph just before the first op that needs them, so
//! a strict backward recomputes one slice at a time.

use std::collections::HashSet;

use super::mincut;
use crate::error::{Error, ErrorKind, Result};
use crate::ir::{extract, Graph, NodeId, NodeMeta, Op, TensorType};
use crate::tensor::{interpret, trace, Tensor};

/// How the forward/backward split chooses what to save.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Partition {
    /// Save every forward value the backward uses (no recomputation);
    /// constants, which depend on no input, are created where used instead.
    SaveAll,
    /// A min-cut over the forward values: cheap ops are recomputed in the
    /// backward instead of saved. `activation_memory_budget` in 0.0–1.0:
    /// 1.0 saves as much as `SaveAll`, 0.0 saves as little as recomputation
    /// of every cheap op allows; in between, the most expensive cheap ops are
    /// saved first while the saved bytes stay within the budget.
    MinCut { activation_memory_budget: f64 },
}

/// The result of [`aot_autograd`].
pub struct AotGraphs {
    /// The joint forward+backward graph the two were cut from.
    pub joint: Graph,
    /// Inputs: the original inputs (then lifted host tensors); outputs: the
    /// original outputs, then the saved values (`saved0`, `saved1` …).
    pub forward: Graph,
    /// Inputs: the saved values, then one tangent per differentiable output
    /// (`tangent_<output>`); outputs: `grad_<input>` per input in `wrt`.
    pub backward: Graph,
    /// Host tensors the traced code closed over, fed after the inputs.
    pub lifted: Vec<Tensor>,
    /// Bytes of saved values that are not forward inputs (activations).
    pub saved_bytes: usize,
    /// How many of the forward's outputs are the original outputs.
    pub num_outputs: usize,
    /// The saved values (indices `i` of `saved{i}`) that are activations,
    /// not forward inputs: what could wait in host memory.
    pub offloadable: Vec<usize>,
    /// Those made under a hint `{"offload": true}`, or kept by the cost
    /// choice of [`aot_autograd_choosing`]: the forward moves them to host
    /// memory after their last forward use, the backward brings them back
    /// before their first use (see `crate::schedule::memory`).
    pub offloaded: Vec<usize>,
    /// Saved activations the cost choice recomputes instead.
    pub recomputed_by_cost: usize,
}

/// A saved activation the partition could take off the device: its node
/// in the joint graph, its bytes, and the forward nodes a recomputation
/// runs (itself and what it needs that is not saved; empty when it cannot
/// be recomputed — a custom op's output, an output of the function — and
/// can only move to host memory), for a cost model to weigh (see
/// [`aot_autograd_choosing`]).
#[derive(Clone, Debug, PartialEq)]
pub struct SavedCandidate {
    pub node: NodeId,
    pub bytes: usize,
    pub recompute: Vec<NodeId>,
}

/// Where a saved activation waits for the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SavedAs {
    /// In device memory (the default).
    Device,
    /// Nowhere: the backward recomputes it (only for candidates with a
    /// recomputation).
    Recompute,
    /// In host memory: offloaded after its last forward use, prefetched
    /// before its first backward use.
    Host,
}

/// Per candidate, where it waits; given the joint graph the nodes are in.
pub type SaveChoice<'a> = &'a dyn Fn(&Graph, &[SavedCandidate]) -> Vec<SavedAs>;

/// Splits `graph` into forward and backward graphs for the gradients of its
/// float outputs with respect to the inputs at positions `wrt`.
pub fn aot_autograd(graph: &Graph, wrt: &[usize], partition: Partition) -> Result<AotGraphs> {
    aot_autograd_choosing(graph, wrt, partition, None)
}

/// [`aot_autograd`] for a graph whose saved activations do not fit a memory
/// budget: `choose` (when given) decides, per saved activation, whether it
/// stays on the device, is recomputed in the backward, or waits in host
/// memory ([`AotGraphs::offloaded`]). Each candidate is weighed alone
/// (recomputing several that share ancestors costs less than their sum);
/// what a recomputation newly needs saved stays on the device.
pub fn aot_autograd_choosing(
    graph: &Graph,
    wrt: &[usize],
    partition: Partition,
    choose: Option<SaveChoice<'_>>,
) -> Result<AotGraphs> {
    graph.verify()?;
    if let Some(&bad) = wrt.iter().find(|&&i| i >= graph.inputs.len()) {
        return Err(Error::new(
            ErrorKind::Argument,
            format!(
                "aot_autograd: input {bad} does not exist (the graph has {})",
                graph.inputs.len()
            ),
        ));
    }
    if let Some(&i) = wrt
        .iter()
        .find(|&&i| !graph.node(graph.inputs[i]).ty.dtype.is_float())
    {
        return Err(Error::new(
            ErrorKind::DType,
            format!(
                "aot_autograd: input {i} ({}) is not a float tensor",
                graph.node(graph.inputs[i]).ty
            ),
        ));
    }
    let joint = trace_joint(graph, wrt)?;
    let n_primals = graph.inputs.len();
    let n_tangents = differentiable_outputs(graph).len();
    let tangents: HashSet<NodeId> = joint.graph.inputs[n_primals..n_primals + n_tangents]
        .iter()
        .copied()
        .collect();
    let primals: Vec<NodeId> = joint
        .graph
        .inputs
        .iter()
        .copied()
        .filter(|id| !tangents.contains(id))
        .collect();
    let n_out = graph.outputs.len();
    let split = JointSplit::new(&joint.graph, &tangents, n_out);
    let saved = match partition {
        Partition::SaveAll => split.needed_by_backward.clone(),
        Partition::MinCut {
            activation_memory_budget,
        } => {
            if !(0.0..=1.0).contains(&activation_memory_budget) {
                return Err(Error::new(
                    ErrorKind::Argument,
                    format!("activation_memory_budget must be in 0.0–1.0, got {activation_memory_budget}"),
                ));
            }
            mincut::choose_saved(
                &joint.graph,
                &split.forward,
                &split.needed_by_backward,
                activation_memory_budget,
            )
        }
    };
    let views = views_of_saved(&joint.graph, &saved, n_out);
    let (mut saved, mut checkpointed) = checkpoint(
        &joint.graph,
        &split.forward,
        &split.needed_by_backward,
        &saved,
        n_out,
        &views,
    );
    let mut chosen_offload: HashSet<NodeId> = HashSet::new();
    let mut recomputed_by_cost = 0;
    if let Some(choose) = choose {
        let outputs: HashSet<NodeId> = joint.graph.outputs[..n_out]
            .iter()
            .map(|o| o.node)
            .collect();
        let kept: HashSet<NodeId> = saved.iter().copied().collect();
        let candidates: Vec<SavedCandidate> = saved
            .iter()
            .filter(|&&id| !matches!(joint.graph.node(id).op, Op::Input))
            .map(|&id| SavedCandidate {
                node: id,
                bytes: bytes_of(&joint.graph.node(id).ty),
                recompute: match recomputable(&joint.graph, id, &outputs) {
                    true => recompute_walk(&joint.graph, &split.forward, &kept, id, &outputs),
                    false => Vec::new(),
                },
            })
            .collect();
        let decided = choose(&joint.graph, &candidates);
        let chosen_as = |way: SavedAs| -> HashSet<NodeId> {
            candidates
                .iter()
                .zip(&decided)
                .filter(|(c, &w)| {
                    // A choice to recompute what cannot be is not taken.
                    w == way && (way != SavedAs::Recompute || !c.recompute.is_empty())
                })
                .map(|(c, _)| c.node)
                .collect()
        };
        let mut forced = chosen_as(SavedAs::Recompute);
        recomputed_by_cost = forced.len();
        forced.extend(views.iter().copied());
        if !forced.is_empty() {
            let partitioned = saved.clone();
            (saved, checkpointed) = checkpoint(
                &joint.graph,
                &split.forward,
                &split.needed_by_backward,
                &partitioned,
                n_out,
                &forced,
            );
        }
        chosen_offload = chosen_as(SavedAs::Host)
            .into_iter()
            .filter(|id| saved.contains(id))
            .collect();
    }
    let recomputed = made_before_the_backward(
        &joint.graph,
        &split.backward,
        &saved,
        &joint.graph.outputs[n_out..],
    );
    let saved_bytes = saved
        .iter()
        .filter(|id| !matches!(joint.graph.node(**id).op, Op::Input))
        .map(|&id| bytes_of(&joint.graph.node(id).ty))
        .sum();
    let saved_named: Vec<(String, NodeId)> = saved
        .iter()
        .enumerate()
        .map(|(i, &id)| (format!("saved{i}"), id))
        .collect();
    let mut fwd_outputs: Vec<(String, NodeId)> = joint.graph.outputs[..n_out]
        .iter()
        .map(|o| (o.name.clone(), o.node))
        .collect();
    fwd_outputs.extend(saved_named.iter().cloned());
    let forward = extract::extract(
        &joint.graph,
        &format!("{}_forward", graph.name),
        &named_inputs(&joint.graph, &primals),
        &fwd_outputs,
    )?;
    let mut bwd_inputs = saved_named.clone();
    bwd_inputs.extend(named_inputs(
        &joint.graph,
        &joint.graph.inputs[n_primals..n_primals + n_tangents],
    ));
    let bwd_outputs: Vec<(String, NodeId)> = joint.graph.outputs[n_out..]
        .iter()
        .map(|o| (o.name.clone(), o.node))
        .collect();
    let backward = extract_backward(
        &joint.graph,
        &format!("{}_backward", graph.name),
        &bwd_inputs,
        &bwd_outputs,
        &recomputed,
    )?;
    let offloadable: Vec<usize> = (0..saved.len())
        .filter(|&i| !matches!(joint.graph.node(saved[i]).op, Op::Input))
        .collect();
    let offloaded: Vec<usize> = offloadable
        .iter()
        .copied()
        .filter(|&i| hinted_offload(&joint.graph, saved[i]) || chosen_offload.contains(&saved[i]))
        .collect();
    crate::logging::log("aot_graphs", || {
        format!(
            "forward graph ({} saved, {saved_bytes} activation bytes; hints and views of \
             saved values made {} values recompute, {} bytes not saved):\n{forward}\nbackward graph:\n{backward}",
            saved.len(),
            checkpointed.values,
            checkpointed.bytes,
        )
    });
    Ok(AotGraphs {
        joint: joint.graph,
        forward,
        backward,
        lifted: joint.lifted,
        saved_bytes,
        num_outputs: n_out,
        offloadable,
        offloaded,
        recomputed_by_cost,
    })
}

/// The saved values that are views (reshape, permute, expand, slice), through
/// a chain of views, of another saved value or of an input: the backward
/// makes them again from their base instead. A view costs no arithmetic,
/// and a saved view shares its base's buffer, so that neither could be
/// offloaded alone (the memory plan moves whole buffers with one reader
/// among the outputs); forward outputs stay as they are.
fn views_of_saved(joint: &Graph, saved: &[NodeId], n_out: usize) -> HashSet<NodeId> {
    let outputs: HashSet<NodeId> = joint.outputs[..n_out].iter().map(|o| o.node).collect();
    let kept: HashSet<NodeId> = saved.iter().copied().collect();
    let is_view = |id: NodeId| {
        matches!(
            joint.node(id).op,
            Op::Reshape(_) | Op::Permute(_) | Op::Expand(_) | Op::Slice { .. }
        )
    };
    let base_is_kept = |mut id: NodeId| loop {
        id = joint.node(id).inputs[0];
        if kept.contains(&id) || matches!(joint.node(id).op, Op::Input) {
            return true;
        }
        if !is_view(id) {
            return false;
        }
    };
    saved
        .iter()
        .copied()
        .filter(|&id| is_view(id) && !outputs.contains(&id) && base_is_kept(id))
        .collect()
}

/// Whether saved value `id` may be recomputed (not an input, a custom op
/// or a forward output).
fn recomputable(joint: &Graph, id: NodeId, outputs: &HashSet<NodeId>) -> bool {
    !matches!(
        joint.node(id).op,
        Op::Input | Op::Custom(_) | Op::CustomOutput { .. }
    ) && !outputs.contains(&id)
}

/// The forward nodes a recomputation of `id` runs when `kept` stay saved:
/// `id`, and walking back, every forward value not kept (or hinted to be
/// recomputed), as [`checkpoint`] walks.
fn recompute_walk(
    joint: &Graph,
    forward: &HashSet<NodeId>,
    kept: &HashSet<NodeId>,
    id: NodeId,
    outputs: &HashSet<NodeId>,
) -> Vec<NodeId> {
    let mut found = vec![id];
    let mut seen: HashSet<NodeId> = [id].into_iter().collect();
    let mut stack: Vec<NodeId> = joint.node(id).inputs.clone();
    while let Some(x) = stack.pop() {
        if !seen.insert(x) || !forward.contains(&x) || matches!(joint.node(x).op, Op::Input) {
            continue;
        }
        if hinted_recompute(joint, x, outputs) || !kept.contains(&x) {
            found.push(x);
            stack.extend(joint.node(x).inputs.iter().copied());
        }
    }
    found.sort();
    found
}

/// Whether forward node `id` is in a region hinted `{"offload": true}`.
fn hinted_offload(joint: &Graph, id: NodeId) -> bool {
    joint
        .node(id)
        .meta
        .hints
        .as_ref()
        .and_then(|map| crate::hints::Hint::from_map(map).ok())
        .is_some_and(|(hint, _)| hint.offload == Some(true))
}

/// The outputs a gradient flows back from (float ones).
fn differentiable_outputs(graph: &Graph) -> Vec<usize> {
    (0..graph.outputs.len())
        .filter(|&i| graph.node(graph.outputs[i].node).ty.dtype.is_float())
        .collect()
}

fn named_inputs(graph: &Graph, ids: &[NodeId]) -> Vec<(String, NodeId)> {
    ids.iter().map(|&id| (graph.display_name(id), id)).collect()
}

pub(crate) fn bytes_of(ty: &TensorType) -> usize {
    ty.shape
        .as_concrete()
        .map_or(0, |s| s.iter().product::<usize>())
        * ty.dtype.size_bytes()
}

/// Traces forward + backward: inputs are the primals, then the tangents;
/// outputs are the forward outputs, then `grad_<input>` for each of `wrt`.
fn trace_joint(graph: &Graph, wrt: &[usize]) -> Result<trace::Traced> {
    let mut inputs: Vec<(String, TensorType)> = graph
        .inputs
        .iter()
        .map(|&id| (graph.display_name(id), graph.node(id).ty.clone()))
        .collect();
    let diff = differentiable_outputs(graph);
    for &i in &diff {
        let out = &graph.outputs[i];
        inputs.push((
            format!("tangent_{}", out.name),
            graph.node(out.node).ty.clone(),
        ));
    }
    let n = graph.inputs.len();
    trace::trace(&format!("{}_joint", graph.name), &inputs, |args| {
        let primals: Vec<Tensor> = args[..n]
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if wrt.contains(&i) {
                    t.set_requires_grad(true)
                } else {
                    t.clone()
                }
            })
            .collect();
        let outputs = interpret::run_graph(graph, &primals)?;
        let (roots, seeds): (Vec<Tensor>, Vec<Tensor>) = diff
            .iter()
            .zip(&args[n..])
            .filter(|(&i, _)| outputs[i].1.requires_grad())
            .map(|(&i, t)| (outputs[i].1.clone(), t.clone()))
            .unzip();
        let targets: Vec<Tensor> = wrt.iter().map(|&i| primals[i].clone()).collect();
        let grads = super::grad(&roots, &seeds, &targets)?;
        let mut named: Vec<(String, Tensor)> = outputs
            .into_iter()
            .map(|(name, t)| (name, t.detach()))
            .collect();
        for (&i, g) in wrt.iter().zip(grads) {
            let input = &primals[i];
            // An input the outputs do not depend on gets a zero gradient. No
            // user code made it: it gets no call site (rather than this
            // file's, which would read as if the user had written it here).
            let g = g.unwrap_or_else(|| {
                trace::with_origin(&NodeMeta::default(), || {
                    crate::runtime::device::with_device(input.device(), || {
                        Tensor::zeros(input.shape(), input.dtype())
                    })
                })
            });
            named.push((format!("grad_{}", graph.display_name(graph.inputs[i])), g));
        }
        Ok(named)
    })
}

/// Which joint nodes are forward (independent of the tangents) and which
/// forward values the backward reads.
struct JointSplit {
    /// Forward nodes that depend on a primal input. Nodes that depend on no
    /// input at all (the zeros, counts and masks that ops and VJP rules
    /// create) are left out: they are constants, which `extract` copies into
    /// whichever graph reads them.
    forward: HashSet<NodeId>,
    /// Nodes that depend on a tangent.
    backward: HashSet<NodeId>,
    /// Forward values read by backward nodes or returned as gradients, in
    /// node order.
    needed_by_backward: Vec<NodeId>,
}

impl JointSplit {
    fn new(joint: &Graph, tangents: &HashSet<NodeId>, n_out: usize) -> JointSplit {
        let mut backward: HashSet<NodeId> = tangents.clone();
        // Nodes computed from at least one primal (non-tangent) input.
        let mut from_primal: HashSet<NodeId> = HashSet::new();
        for (i, node) in joint.nodes.iter().enumerate() {
            let id = NodeId(i as u32);
            if node.inputs.iter().any(|x| backward.contains(x)) {
                backward.insert(id);
            }
            if (matches!(node.op, Op::Input) && !tangents.contains(&id))
                || node.inputs.iter().any(|x| from_primal.contains(x))
            {
                from_primal.insert(id);
            }
        }
        // Saving a constant would count it as an activation and keep it
        // alive from the forward to the backward (a `zeros` the size of the
        // input, for the gradient of a slice or gather), where recreating it
        // in the backward is free; so constants are never saved.
        let forward: HashSet<NodeId> = (0..joint.len() as u32)
            .map(NodeId)
            .filter(|id| !backward.contains(id) && from_primal.contains(id))
            .collect();
        // Only live backward nodes count: a rule also computes the
        // gradients of inputs that need none (`g * a` for the mask in
        // `x * mask`); the engine drops them, but the trace keeps the dead
        // ops, and saving their operands wasted memory and left backward
        // inputs that nothing read.
        let mut live = vec![false; joint.len()];
        for out in &joint.outputs[n_out..] {
            live[out.node.index()] = true;
        }
        for (i, node) in joint.nodes.iter().enumerate().rev() {
            if live[i] {
                for x in &node.inputs {
                    live[x.index()] = true;
                }
            }
        }
        let mut needed = HashSet::new();
        for (i, node) in joint.nodes.iter().enumerate() {
            if live[i] && backward.contains(&NodeId(i as u32)) {
                needed.extend(node.inputs.iter().copied().filter(|x| forward.contains(x)));
            }
        }
        needed.extend(
            joint.outputs[n_out..]
                .iter()
                .map(|o| o.node)
                .filter(|x| forward.contains(x)),
        );
        let mut needed_by_backward: Vec<NodeId> = needed.into_iter().collect();
        needed_by_backward.sort();
        JointSplit {
            forward,
            backward,
            needed_by_backward,
        }
    }
}

/// What the hints changed in a partition.
struct Checkpointed {
    /// Values the partition saved that the backward now recomputes.
    values: usize,
    bytes: usize,
}

/// Whether forward node `id` is in a region whose hints ask for recompute.
/// Opaque ops (custom kernels write all their outputs at once) and inputs
/// are never recomputed; nor are the graph's outputs, which stay alive for
/// the caller anyway (saving one costs nothing).
fn hinted_recompute(joint: &Graph, id: NodeId, outputs: &HashSet<NodeId>) -> bool {
    let node = joint.node(id);
    if matches!(node.op, Op::Input | Op::Custom(_) | Op::CustomOutput { .. })
        || outputs.contains(&id)
    {
        return false;
    }
    node.meta
        .hints
        .as_ref()
        .and_then(|map| crate::hints::Hint::from_map(map).ok())
        .is_some_and(|(hint, _)| hint.recomputes())
}

/// The partition's saved set with hinted regions checkpointed: walking back
/// from what the backward needs, a value is recomputed when it is hinted so
/// or the partition did not save it (then its forward inputs are needed
/// instead); otherwise it is saved. Returns the new saved set, in node
/// order, and what the hints changed.
fn checkpoint(
    joint: &Graph,
    forward: &HashSet<NodeId>,
    needed: &[NodeId],
    saved: &[NodeId],
    n_out: usize,
    forced: &HashSet<NodeId>,
) -> (Vec<NodeId>, Checkpointed) {
    let outputs: HashSet<NodeId> = joint.outputs[..n_out].iter().map(|o| o.node).collect();
    let base: HashSet<NodeId> = saved.iter().copied().collect();
    let mut kept = HashSet::new();
    let mut seen = HashSet::new();
    let mut stack: Vec<NodeId> = needed.to_vec();
    while let Some(id) = stack.pop() {
        if !seen.insert(id) || !forward.contains(&id) {
            continue;
        }
        let is_input = matches!(joint.node(id).op, Op::Input);
        let recompute = hinted_recompute(joint, id, &outputs) || forced.contains(&id);
        if !is_input && (recompute || !base.contains(&id)) {
            stack.extend(joint.node(id).inputs.iter().copied());
        } else {
            kept.insert(id);
        }
    }
    let dropped: Vec<&NodeId> = saved.iter().filter(|id| !kept.contains(id)).collect();
    let changed = Checkpointed {
        values: dropped.len(),
        bytes: dropped
            .iter()
            .filter(|id| !matches!(joint.node(***id).op, Op::Input))
            .map(|id| bytes_of(&joint.node(**id).ty))
            .sum(),
    };
    let mut kept: Vec<NodeId> = kept.into_iter().collect();
    kept.sort();
    (kept, changed)
}

/// The nodes the backward graph computes that do not depend on a tangent:
/// forward values it recomputes and constants.
fn made_before_the_backward(
    joint: &Graph,
    backward: &HashSet<NodeId>,
    saved: &[NodeId],
    backward_outputs: &[crate::ir::Output],
) -> HashSet<NodeId> {
    let saved: HashSet<NodeId> = saved.iter().copied().collect();
    let mut found = HashSet::new();
    let mut seen = HashSet::new();
    let mut stack: Vec<NodeId> = backward_outputs.iter().map(|o| o.node).collect();
    while let Some(id) = stack.pop() {
        if !seen.insert(id) || saved.contains(&id) || matches!(joint.node(id).op, Op::Input) {
            continue;
        }
        if !backward.contains(&id) {
            found.insert(id);
        }
        stack.extend(joint.node(id).inputs.iter().copied());
    }
    found
}

/// The backward graph: the subgraph of `joint` computing `outputs` from
/// `inputs` ([`extract::extract_late`]), where the nodes in `recomputed`
/// (forward values and constants the backward computes) take the
/// backward's hints ([`crate::hints::for_backward`]) and are placed just
/// before the first node that reads them (in joint order they would all
/// come first, and a strict order would recompute every slice before the
/// backward of the first).
fn extract_backward(
    joint: &Graph,
    name: &str,
    inputs: &[(String, NodeId)],
    outputs: &[(String, NodeId)],
    recomputed: &HashSet<NodeId>,
) -> Result<Graph> {
    let (mut backward, map) = extract::extract_late(joint, name, inputs, outputs, recomputed)?;
    for id in recomputed {
        if let Some(new) = map.get(id) {
            let meta = &mut backward.nodes[new.index()].meta;
            meta.hints = crate::hints::for_backward(meta.hints.take());
        }
    }
    Ok(backward)
}

/// Per input in `wrt`: whether a float output depends on it through ops
/// that carry gradients, i.e. whether eager autograd would give it a
/// gradient. (Passes may later simplify that dependency away, as
/// `pow(x, 0)` → `1`; the input still gets a gradient, of zeros, as in
/// eager mode.)
pub fn reached_inputs(graph: &Graph, wrt: &[usize]) -> Vec<bool> {
    let mut reached = vec![false; graph.len()];
    let mut stack: Vec<NodeId> = graph
        .outputs
        .iter()
        .map(|o| o.node)
        .filter(|&id| graph.node(id).ty.dtype.is_float())
        .collect();
    while let Some(id) = stack.pop() {
        if std::mem::replace(&mut reached[id.index()], true) {
            continue;
        }
        let node = graph.node(id);
        // Custom ops carry gradients through their registered backward.
        let carries =
            node.op.has_gradient() || matches!(node.op, Op::Custom(_) | Op::CustomOutput { .. });
        if carries && node.ty.dtype.is_float() {
            stack.extend(node.inputs.iter().copied());
        }
    }
    wrt.iter()
        .map(|&i| reached[graph.inputs[i].index()])
        .collect()
}
