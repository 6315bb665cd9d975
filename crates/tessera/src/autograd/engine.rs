//! The eager autograd engine: walks the tape (`tensor::tape`: the
//! `GradNode`s hung on result tensors) backwards for `Tensor::backward` and
//! [`grad`], applying each node's VJP rule ([`rules`]) or its custom
//! backward.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::rules;
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::Op;
use crate::tensor::recompute::Replays;
use crate::tensor::tape::{consuming, no_grad, Backward, GradNode, Saved};
use crate::tensor::{autocast, trace, Tensor};

/// How the VJP rules run: without recording (`no_grad`) and with autocast
/// off, so each backward op takes the dtypes of the forward's values (the
/// casts autocast made are on the tape and have rules of their own),
/// whatever scope `backward` is called in.
fn backward_mode<R>(f: impl FnOnce() -> R) -> R {
    autocast::disabled(|| no_grad(f))
}

/// The input gradients of `node` from its output gradients; `replays`
/// holds the values of recompute regions this backward pass recomputed.
fn input_gradients(
    node: &GradNode,
    grads: Vec<Option<Tensor>>,
    replays: &mut Replays,
) -> Result<Vec<Option<Tensor>>> {
    let filled: Vec<Tensor> = grads
        .into_iter()
        .zip(&node.outputs)
        .map(|(g, (shape, dtype))| g.unwrap_or_else(|| Tensor::zeros(shape, *dtype)))
        .collect();
    let saved = node.saved();
    let result = trace::with_origin(&node.origin, || match (&node.backward, &saved) {
        (
            Backward::Op(op),
            Saved {
                output: Some(output),
                ..
            },
        ) => {
            // Saved values waiting in host memory come back first, those
            // of a recompute region are recomputed.
            let (inputs, output) = node.saved_values(&saved, output, replays)?;
            rules::vjp(op, &inputs, &output, &filled[0])
        }
        (
            Backward::Custom { .. },
            Saved {
                function: Some(backward),
                ..
            },
        ) => backward(&filled),
        _ => Err(Error::op(
            ErrorKind::Verify,
            node.name(),
            "its saved values were already released by a backward",
        )),
    });
    drop(saved);
    let result = result.map_err(|e| match &node.origin.location {
        Some(loc) => e.at(loc.clone()),
        None => e,
    })?;
    let inputs = node.inputs().len();
    if result.len() != inputs {
        return Err(Error::op(
            ErrorKind::Verify,
            node.name(),
            format!(
                "backward returned {} gradients for {} inputs",
                result.len(),
                inputs
            ),
        ));
    }
    Ok(result)
}

impl Tensor {
    /// Backpropagates from this scalar, accumulating into the leaves' `grad()`.
    ///
    /// As in PyTorch, a graph is backpropagated through once: a second
    /// `backward` through any op the first one went through (the same
    /// output again, or another output sharing part of its graph) is an
    /// error that names both lines ("Trying to backward through the graph
    /// a second time"), rather than silently adding the gradients again.
    /// [`Tensor::backward_retain_graph`] keeps the graph usable, as
    /// `retain_graph=True` does. Gradients of separate graphs accumulate in
    /// the leaves until `zero_grad`.
    #[track_caller]
    pub fn backward(&self) {
        if let Err(e) = self.backward_at(None, false, SourceLoc::caller()) {
            panic!("{e}");
        }
    }

    /// Backpropagates `grad` (this tensor's shape) into the leaves (once:
    /// see [`Tensor::backward`]).
    #[track_caller]
    pub fn backward_with(&self, grad: &Tensor) {
        if let Err(e) = self.backward_at(Some(grad), false, SourceLoc::caller()) {
            panic!("{e}");
        }
    }

    /// [`Tensor::backward`] that keeps the graph for another backward
    /// (PyTorch's `retain_graph=True`).
    #[track_caller]
    pub fn backward_retain_graph(&self) {
        if let Err(e) = self.backward_at(None, true, SourceLoc::caller()) {
            panic!("{e}");
        }
    }

    /// `backward`, returning errors instead of panicking.
    #[track_caller]
    pub fn try_backward(&self, grad: Option<&Tensor>) -> Result<()> {
        self.backward_at(grad, false, SourceLoc::caller())
    }

    /// [`Tensor::try_backward`] that keeps the graph for another backward
    /// (PyTorch's `retain_graph=True`).
    #[track_caller]
    pub fn try_backward_retain_graph(&self, grad: Option<&Tensor>) -> Result<()> {
        self.backward_at(grad, true, SourceLoc::caller())
    }

    fn backward_at(&self, grad: Option<&Tensor>, retain_graph: bool, at: SourceLoc) -> Result<()> {
        // The backward's own tensors (the implied seed, zeros of rules) are
        // made on the output's device.
        crate::runtime::device::with_device(self.device(), || {
            let seed = seed_gradient(self, grad).map_err(|e| e.at(at.clone()))?;
            let roots = std::slice::from_ref(self);
            let nodes = reverse_topological(roots);
            check_unused(&nodes).map_err(|e| e.at(at.clone()))?;
            let release = (!retain_graph).then_some(&at);
            let mut sink = Sink::new(SinkKind::Leaves);
            backward_mode(|| propagate(roots, &nodes, vec![seed], &mut sink, release))
                .map_err(|e| e.at(at.clone()))?;
            if !retain_graph {
                for node in &nodes {
                    *node.used_by.lock().expect("used_by lock") = Some(at.clone());
                }
            }
            Ok(())
        })
    }
}

/// An error when a `backward` that did not retain the graph already went
/// through one of `nodes`.
fn check_unused(nodes: &[Arc<GradNode>]) -> Result<()> {
    for node in nodes {
        if let Some(first) = node.used_by.lock().expect("used_by lock").clone() {
            let op = match &node.origin.location {
                Some(loc) => format!("`{}` (at {loc})", node.name()),
                None => format!("`{}`", node.name()),
            };
            return Err(Error::op(
                ErrorKind::Argument,
                "backward",
                format!(
                    "Trying to backward through the graph a second time: the backward \
                     at {first} already went through {op}. Call backward_retain_graph() \
                     (retain_graph=True) the first time to backpropagate twice, or \
                     recompute the forward"
                ),
            ));
        }
    }
    Ok(())
}

fn seed_gradient(out: &Tensor, grad: Option<&Tensor>) -> Result<Tensor> {
    if let Some(op) = out.cut_op() {
        return Err(Error::op(
            ErrorKind::Argument,
            "backward",
            format!(
                "{} does not require grad: it was computed through `{op}`, which has no gradient",
                out.ty()
            ),
        ));
    }
    if !out.requires_grad() {
        return Err(Error::op(
            ErrorKind::Argument,
            "backward",
            format!(
                "{} does not require grad: no input of its computation requires grad",
                out.ty()
            ),
        ));
    }
    match grad {
        Some(g) if g.shape() != out.shape() || g.dtype() != out.dtype() => Err(Error::op(
            ErrorKind::Shape,
            "backward",
            format!("the gradient {} does not match the output {}", g.ty(), out.ty()),
        )),
        Some(g) => Ok(g.detach()),
        None if out.numel() != 1 => Err(Error::op(
            ErrorKind::Shape,
            "backward",
            format!(
                "a gradient can be implied only for a scalar output, got {}; use backward_with(grad)",
                out.ty()
            ),
        )),
        None => Ok(Tensor::ones(out.shape(), out.dtype())),
    }
}

/// The nodes reachable from `roots`, each before every node that computed
/// one of its inputs (reverse topological order).
fn reverse_topological(roots: &[Tensor]) -> Vec<Arc<GradNode>> {
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    // Iterative post-order DFS: (node, inputs pushed yet?).
    let mut stack: Vec<(Arc<GradNode>, bool)> = roots
        .iter()
        .rev()
        .filter_map(Tensor::grad_fn)
        .map(|(n, _)| (n.clone(), false))
        .collect();
    while let Some((node, expanded)) = stack.pop() {
        if expanded {
            order.push(node);
            continue;
        }
        if !seen.insert(node.id()) {
            continue;
        }
        stack.push((node.clone(), true));
        for input in &node.inputs() {
            if let Some((n, _)) = input.grad_fn() {
                if !seen.contains(&n.id()) {
                    stack.push((n.clone(), false));
                }
            }
        }
    }
    order.reverse();
    order
}

/// Identity of a gradient's destination: a leaf (its autograd state) or an
/// output of a node.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
enum Slot {
    Leaf(usize),
    Output(usize, usize),
}

fn slot_of(t: &Tensor) -> Option<Slot> {
    let meta = t.autograd_meta()?;
    Some(match &meta.grad_fn {
        Some((node, i)) => Slot::Output(node.id(), *i),
        None => Slot::Leaf(Arc::as_ptr(meta) as usize),
    })
}

/// Where gradients end up: accumulated into leaves (`backward`), or
/// returned for chosen tensors (`grad`).
enum SinkKind {
    Leaves,
    Capture(HashMap<Slot, usize>, Vec<Option<Tensor>>),
}

/// A leaf's gradient that arrived as slice pieces, and the origin (line and
/// hints) of the backward that sent the last piece.
struct SlicedLeaf {
    leaf: Tensor,
    /// Taken only while a new piece is added.
    grad: Option<Partial>,
    origin: Option<crate::ir::NodeMeta>,
}

/// The gradients' destination ([`SinkKind`]) and the leaves' gradients
/// that arrive in slice pieces: a leaf sliced along a dim (the `slice`
/// hint's pass slices the function's inputs themselves) gets its pieces
/// joined by one `cat` once the walk is done ([`Sink::finish`]) instead of
/// one zero-padded full-size gradient per slice, summed.
struct Sink {
    kind: SinkKind,
    /// In the order the leaves' first pieces came (one order for every
    /// run: a traced backward is the same graph each time).
    sliced: Vec<(Slot, SlicedLeaf)>,
}

impl Sink {
    fn new(kind: SinkKind) -> Sink {
        Sink {
            kind,
            sliced: Vec::new(),
        }
    }

    fn leaf(&mut self, leaf: &Tensor, g: Partial) -> Result<()> {
        let g = match (g, slot_of(leaf)) {
            (g @ Partial::Slices { .. }, Some(slot)) => {
                let origin = trace::current_origin();
                match self.sliced.iter().position(|(s, _)| *s == slot) {
                    Some(i) => {
                        let entry = &mut self.sliced[i].1;
                        let prev = entry.grad.take().expect("a sliced leaf's gradient");
                        entry.grad = Some(prev.add(g)?);
                        entry.origin = origin;
                    }
                    None => {
                        let leaf = leaf.clone();
                        let grad = Some(g);
                        self.sliced.push((slot, SlicedLeaf { leaf, grad, origin }));
                    }
                }
                return Ok(());
            }
            (g, _) => g.dense()?,
        };
        self.leaf_dense(leaf, g)
    }

    fn leaf_dense(&mut self, leaf: &Tensor, g: Tensor) -> Result<()> {
        match self.kind {
            SinkKind::Leaves => accumulate_leaf(leaf, g),
            SinkKind::Capture(..) => self.capture(slot_of(leaf), &g),
        }
    }

    /// Joins the sliced leaves' pieces and delivers them (the join and a
    /// sum with a gradient delivered before belong to the backward of
    /// their last piece: its line and hints).
    fn finish(&mut self) -> Result<()> {
        for (_, s) in std::mem::take(&mut self.sliced) {
            let grad = s.grad.expect("a sliced leaf's gradient");
            let deliver = || self.leaf_dense(&s.leaf, grad.dense()?);
            match &s.origin {
                Some(origin) => trace::with_origin(origin, deliver)?,
                None => deliver()?,
            }
        }
        Ok(())
    }

    fn capture(&mut self, slot: Option<Slot>, g: &Tensor) -> Result<()> {
        if let (SinkKind::Capture(targets, results), Some(slot)) = (&mut self.kind, slot) {
            if let Some(&i) = targets.get(&slot) {
                results[i] = Some(match results[i].take() {
                    Some(prev) => prev.try_add(g)?,
                    None => g.clone(),
                });
            }
        }
        Ok(())
    }
}

/// A gradient on its way to a node output: dense, or the gradients of
/// step-1 slices of it along one dim, kept apart until the node needs them.
/// That way `tensor_split` followed by per-slice work costs one `cat` in the
/// backward instead of one full-size zero-padded gradient per slice (which
/// a level-order schedule would otherwise hold all at once).
enum Partial {
    Dense(Tensor),
    Slices {
        dim: usize,
        shape: Vec<usize>,
        /// (start, gradient of the slice starting there).
        pieces: Vec<(usize, Tensor)>,
    },
}

impl Partial {
    fn add(self, other: Partial) -> Result<Partial> {
        match (self, other) {
            (
                Partial::Slices {
                    dim,
                    shape,
                    mut pieces,
                },
                Partial::Slices {
                    dim: d2,
                    pieces: more,
                    ..
                },
            ) if dim == d2 => {
                pieces.extend(more);
                Ok(Partial::Slices { dim, shape, pieces })
            }
            (a, b) => Ok(Partial::Dense(a.dense()?.try_add(&b.dense()?)?)),
        }
    }

    /// The full gradient: the pieces joined with zeros between them by one
    /// `cat` when they do not overlap, else summed.
    fn dense(self) -> Result<Tensor> {
        let (dim, shape, mut pieces) = match self {
            Partial::Dense(t) => return Ok(t),
            Partial::Slices { dim, shape, pieces } => (dim, shape, pieces),
        };
        pieces.sort_by_key(|(start, _)| *start);
        let dtype = pieces[0].1.dtype();
        let zeros = |len: usize| {
            let mut s = shape.clone();
            s[dim] = len;
            Tensor::zeros(&s, dtype)
        };
        let mut parts = Vec::new();
        let mut cursor = 0;
        for (start, g) in &pieces {
            if *start < cursor {
                let padded = pieces
                    .iter()
                    .map(|(s, g)| rules::slice_backward(g, &shape, dim, *s, 1));
                return padded
                    .reduce(|a, b| a?.try_add(&b?))
                    .expect("at least one piece");
            }
            if *start > cursor {
                parts.push(zeros(start - cursor));
            }
            parts.push(g.clone());
            cursor = start + g.shape()[dim];
        }
        if cursor < shape[dim] {
            parts.push(zeros(shape[dim] - cursor));
        }
        let refs: Vec<&Tensor> = parts.iter().collect();
        Tensor::try_cat(&refs, dim as isize)
    }
}

/// Output gradients waiting for their node, summed as they arrive.
#[derive(Default)]
struct Pending(HashMap<usize, Vec<Option<Partial>>>);

impl Pending {
    fn add(&mut self, node: &Arc<GradNode>, index: usize, g: Partial) -> Result<()> {
        let slots = self
            .0
            .entry(node.id())
            .or_insert_with(|| (0..node.outputs.len()).map(|_| None).collect());
        slots[index] = Some(match slots[index].take() {
            Some(prev) => prev.add(g)?,
            None => g,
        });
        Ok(())
    }
}

/// Sends `g` to where `t`'s gradient goes.
fn route(t: &Tensor, g: Partial, pending: &mut Pending, sink: &mut Sink) -> Result<()> {
    match t.grad_fn() {
        None => sink.leaf(t, g),
        Some((node, i)) => pending.add(node, *i, g),
    }
}

/// For a step-1 slice, the gradient of its input as a slice piece.
fn slice_piece(node: &GradNode, input: &Tensor, g: &Tensor) -> Option<Partial> {
    match &node.backward {
        Backward::Op(Op::Slice {
            dim,
            start,
            step: 1,
            ..
        }) => Some(Partial::Slices {
            dim: *dim,
            shape: input.shape().to_vec(),
            pieces: vec![(*start, g.clone())],
        }),
        _ => None,
    }
}

/// Backpropagates `seeds` from `roots` through `order`, the nodes
/// [`reverse_topological`] gives for `roots`. `release`: the backward
/// does not retain the graph (its call site): each node's saved values
/// are dropped once its gradients are computed, and custom backwards may
/// consume what they hold ([`crate::tensor::tape::backward_consumes`]).
fn propagate(
    roots: &[Tensor],
    order: &[Arc<GradNode>],
    seeds: Vec<Tensor>,
    sink: &mut Sink,
    release: Option<&SourceLoc>,
) -> Result<()> {
    let mut pending = Pending::default();
    let mut replays = Replays::default();
    for (root, seed) in roots.iter().zip(seeds) {
        // Summing the seeds of a root given twice belongs to the backward of
        // the op that computed it (its line and hints).
        match root.grad_fn() {
            Some((node, _)) => trace::with_origin(&node.origin, || {
                route(root, Partial::Dense(seed), &mut pending, sink)
            })?,
            None => route(root, Partial::Dense(seed), &mut pending, sink)?,
        }
    }
    for node in order {
        let Some(partials) = pending.0.remove(&node.id()) else {
            continue;
        };
        // Joining slice pieces belongs to this node's backward (its origin).
        let grads = trace::with_origin(&node.origin, || {
            partials
                .into_iter()
                .map(|p| p.map(Partial::dense).transpose())
                .collect::<Result<Vec<_>>>()
        })?;
        for (i, g) in grads.iter().enumerate() {
            if let Some(g) = g {
                sink.capture(Some(Slot::Output(node.id(), i)), g)?;
            }
        }
        let first = node.inputs().swap_remove(0);
        if let (Some(piece), true) = (
            grads[0].as_ref().and_then(|g| slice_piece(node, &first, g)),
            first.requires_grad(),
        ) {
            trace::with_origin(&node.origin, || route(&first, piece, &mut pending, sink))?;
            done(node, release, &mut replays);
            continue;
        }
        drop(first);
        let input_grads = consuming(release.is_some(), || {
            input_gradients(node, grads, &mut replays)
        })?;
        done(node, release, &mut replays);
        // Edges only, once released: no saved value outlives the rule.
        let inputs = node.inputs();
        // The sums of partial gradients are part of this node's backward too:
        // in an AOT backward graph they carry the forward op's line and hints.
        trace::with_origin(&node.origin, || -> Result<()> {
            for (input, g) in inputs.iter().zip(input_grads) {
                let Some(g) = g.filter(|_| input.requires_grad()) else {
                    continue;
                };
                check_gradient(node.name(), input, &g)?;
                route(input, Partial::Dense(g), &mut pending, sink)?;
            }
            Ok(())
        })?;
    }
    sink.finish()
}

/// After `node`'s backward: its recomputed output goes (the nodes that
/// read it came before), and its saved values too when the backward does
/// not retain the graph (`release`).
fn done(node: &GradNode, release: Option<&SourceLoc>, replays: &mut Replays) {
    replays.forget(node);
    if let Some(at) = release {
        node.release(at);
    }
}

/// The gradients of `outputs` (weighted by `grad_outputs`, one per output)
/// with respect to `inputs`, returned instead of accumulated (like
/// `torch.autograd.grad`). `None` where an input does not influence the outputs.
/// The graph stays usable afterwards (PyTorch's `retain_graph=True`); a
/// graph that a [`Tensor::backward`] already went through is an error.
#[track_caller]
pub fn grad(
    outputs: &[Tensor],
    grad_outputs: &[Tensor],
    inputs: &[Tensor],
) -> Result<Vec<Option<Tensor>>> {
    let at = SourceLoc::caller();
    if outputs.len() != grad_outputs.len() {
        return Err(Error::op(
            ErrorKind::Argument,
            "grad",
            format!(
                "{} outputs but {} output gradients",
                outputs.len(),
                grad_outputs.len()
            ),
        )
        .at(at));
    }
    let mut seeds = Vec::with_capacity(outputs.len());
    for (o, g) in outputs.iter().zip(grad_outputs) {
        seeds.push(seed_gradient(o, Some(g)).map_err(|e| e.at(at.clone()))?);
    }
    let targets = inputs
        .iter()
        .enumerate()
        .filter_map(|(i, t)| Some((slot_of(t)?, i)))
        .collect();
    let mut sink = Sink::new(SinkKind::Capture(targets, vec![None; inputs.len()]));
    // Like PyTorch's `grad(…, retain_graph=True)`: the graph stays usable,
    // unless a backward already used it.
    let order = reverse_topological(outputs);
    check_unused(&order).map_err(|e| e.at(at.clone()))?;
    let on = outputs.first().map_or(Default::default(), Tensor::device);
    crate::runtime::device::with_device(on, || {
        backward_mode(|| propagate(outputs, &order, seeds, &mut sink, None))
    })
    .map_err(|e| e.at(at))?;
    match sink.kind {
        SinkKind::Capture(_, results) => Ok(results),
        SinkKind::Leaves => unreachable!("grad always captures"),
    }
}

/// A backward that returns a gradient of the wrong type is a bug; say which.
fn check_gradient(name: &str, input: &Tensor, g: &Tensor) -> Result<()> {
    if g.shape() != input.shape() || g.dtype() != input.dtype() {
        return Err(Error::op(
            ErrorKind::Verify,
            name,
            format!(
                "its backward gave a gradient {} for an input {}",
                g.ty(),
                input.ty()
            ),
        ));
    }
    Ok(())
}

/// Adds `g` to the leaf's gradient; on an error (no memory for the sum) the
/// gradient is left as it was.
fn accumulate_leaf(leaf: &Tensor, g: Tensor) -> Result<()> {
    let meta = leaf.autograd_meta().expect("a leaf that requires grad");
    let mut slot = meta.grad.lock().expect("grad lock");
    let sum = match slot.as_ref() {
        Some(prev) => prev.try_add(&g)?,
        None => g,
    };
    *slot = Some(sum);
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::tensor::Tensor;

    /// A backward that does not retain the graph frees each node's saved
    /// values once its gradients are computed, though the graph's output
    /// is still held (here `exp`'s output, which only its node keeps); one
    /// that retains the graph keeps them for the next. Gradients are the
    /// same either way.
    #[test]
    fn a_backward_frees_the_saved_values_as_it_goes() {
        let x = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).set_requires_grad(true);
        for retain in [true, false] {
            x.zero_grad();
            let y = x.exp().sum(&[], false);
            let (sum, _) = y.grad_fn().expect("recorded");
            let (exp, _) = sum.inputs()[0].grad_fn().expect("recorded").clone();
            let before = exp.saved().output.expect("exp keeps its output");
            match retain {
                true => y.backward_retain_graph(),
                false => y.backward(),
            }
            let after = exp.saved().output.expect("an op node has an output");
            assert_eq!(after.shares_storage(&before), retain, "retain {retain}");
            assert_eq!(after.shape(), before.shape());
            let g = x.grad().unwrap().to_vec::<f32>().unwrap();
            assert_eq!(g, [1f32.exp(), 2f32.exp()]);
        }
    }
}
