//! The eager autograd engine: a graph of `GradNode`s hung on result tensors,
//! walked backwards by `Tensor::backward` and [`grad`].
//!
//! A node is one recorded op (its VJP rule is in [`rules`]) or a custom
//! function with several outputs and its own backward (a compiled graph, a
//! custom op). Each output tensor points at its node and its output index.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::panic::Location;
use std::sync::{Arc, Mutex};

use super::rules;
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::{DType, NodeMeta, Op};
use crate::tensor::{trace, Tensor};

/// Autograd state of a tensor that requires grad.
pub(crate) struct AutogradMeta {
    /// The accumulated gradient of a leaf.
    grad: Mutex<Option<Tensor>>,
    /// The node that computed this tensor and which of its outputs it is;
    /// `None` for a leaf.
    grad_fn: Option<(Arc<GradNode>, usize)>,
}

/// A backward function for [`custom_function`]: output gradients (zeros
/// where an output got none) → one optional gradient per input.
pub type BackwardFn =
    dyn Fn(&[Tensor]) -> Result<Vec<Option<Tensor>>> + Send + Sync + std::panic::RefUnwindSafe;

enum Backward {
    /// One IR op; its output is kept detached (no reference cycle).
    Op { op: Op, output: Tensor },
    Custom {
        name: String,
        backward: Arc<BackwardFn>,
    },
}

struct GradNode {
    backward: Backward,
    inputs: Vec<Tensor>,
    /// Shapes and dtypes of the outputs, to make zero gradients.
    outputs: Vec<(Vec<usize>, DType)>,
    /// The forward op's call site and hints, as its backward ops inherit
    /// them (see `backward_origin`).
    origin: NodeMeta,
    /// Where a `backward` that did not retain the graph went through this
    /// node: a second one through it is an error (see [`Tensor::backward`]).
    used_by: Mutex<Option<SourceLoc>>,
}

impl GradNode {
    fn id(self: &Arc<Self>) -> usize {
        Arc::as_ptr(self) as usize
    }

    fn name(&self) -> &str {
        match &self.backward {
            Backward::Op { op, .. } => op.name(),
            Backward::Custom { name, .. } => name,
        }
    }

    /// Input gradients from output gradients.
    fn apply(&self, grads: Vec<Option<Tensor>>) -> Result<Vec<Option<Tensor>>> {
        let filled: Vec<Tensor> = grads
            .into_iter()
            .zip(&self.outputs)
            .map(|(g, (shape, dtype))| g.unwrap_or_else(|| Tensor::zeros(shape, *dtype)))
            .collect();
        let result = trace::with_origin(&self.origin, || match &self.backward {
            Backward::Op { op, output } => rules::vjp(op, &self.inputs, output, &filled[0]),
            Backward::Custom { backward, .. } => backward(&filled),
        });
        let result = result.map_err(|e| match &self.origin.location {
            Some(loc) => e.at(loc.clone()),
            None => e,
        })?;
        if result.len() != self.inputs.len() {
            return Err(Error::op(
                ErrorKind::Verify,
                self.name(),
                format!(
                    "backward returned {} gradients for {} inputs",
                    result.len(),
                    self.inputs.len()
                ),
            ));
        }
        Ok(result)
    }
}

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Whether ops record for autograd on this thread.
pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(Cell::get)
}

/// Runs `f` with autograd recording off (like `torch.no_grad()`).
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            GRAD_ENABLED.with(|g| g.set(self.0));
        }
    }
    let _restore = Restore(GRAD_ENABLED.with(|g| g.replace(false)));
    f()
}

/// Whether a node recording `inputs` → outputs of `dtypes` is worth keeping.
fn tracks(inputs: &[&Tensor], any_float_output: bool) -> bool {
    is_grad_enabled() && any_float_output && inputs.iter().any(|t| t.requires_grad())
}

/// Hangs the op's node on `out` when an input requires grad.
pub(crate) fn record(
    op: &Op,
    inputs: &[&Tensor],
    out: Tensor,
    caller: &'static Location<'static>,
) -> Tensor {
    if !rules::has_gradient(op) || !out.dtype().is_float() {
        // Remember the cut, so a later `backward` can name the op.
        return match inputs.iter().any(|t| t.requires_grad()) && is_grad_enabled() {
            true => out.cut_by(op.name()),
            false => inherit_cut(inputs, out),
        };
    }
    if !tracks(inputs, true) {
        return inherit_cut(inputs, out);
    }
    let node = Arc::new(GradNode {
        backward: Backward::Op {
            op: op.clone(),
            output: out.clone(),
        },
        inputs: inputs.iter().map(|&t| t.clone()).collect(),
        outputs: vec![(out.shape().to_vec(), out.dtype())],
        origin: backward_origin(caller),
        used_by: Mutex::new(None),
    });
    attach(&out, &node, 0)
}

/// A result of a cut tensor stays cut (by the same op).
fn inherit_cut(inputs: &[&Tensor], out: Tensor) -> Tensor {
    match inputs.iter().find_map(|t| t.cut_op()) {
        Some(op) => out.cut_by(op),
        None => out,
    }
}

/// What a node's backward ops inherit: the forward op's call site and hints,
/// with the hints' `backward_group_id` as their `group_id` (the one place
/// backward hints are derived; see `hints::for_backward`).
fn backward_origin(caller: &'static Location<'static>) -> NodeMeta {
    let mut meta = trace::node_meta(caller);
    meta.hints = crate::hints::for_backward(meta.hints);
    meta
}

fn attach(out: &Tensor, node: &Arc<GradNode>, index: usize) -> Tensor {
    out.with_autograd(Some(Arc::new(AutogradMeta {
        grad: Mutex::new(None),
        grad_fn: Some((node.clone(), index)),
    })))
}

/// Connects `outputs` (computed from `inputs` without recording, e.g. by a
/// compiled graph or a custom kernel) to the autograd graph with one node
/// whose gradient is `backward`. Returns the outputs as tensors that carry
/// it (unchanged when no input requires grad or grad mode is off).
#[track_caller]
pub fn custom_function(
    name: &str,
    inputs: &[&Tensor],
    outputs: Vec<Tensor>,
    backward: Arc<BackwardFn>,
) -> Vec<Tensor> {
    custom_function_at(name, inputs, outputs, backward, Location::caller())
}

/// [`custom_function`] with the forward's call site given.
pub fn custom_function_at(
    name: &str,
    inputs: &[&Tensor],
    outputs: Vec<Tensor>,
    backward: Arc<BackwardFn>,
    caller: &'static Location<'static>,
) -> Vec<Tensor> {
    if !tracks(inputs, outputs.iter().any(|t| t.dtype().is_float())) {
        return outputs;
    }
    let node = Arc::new(GradNode {
        backward: Backward::Custom {
            name: name.to_string(),
            backward,
        },
        inputs: inputs.iter().map(|&t| t.clone()).collect(),
        outputs: outputs
            .iter()
            .map(|t| (t.shape().to_vec(), t.dtype()))
            .collect(),
        origin: backward_origin(caller),
        used_by: Mutex::new(None),
    });
    outputs
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if t.dtype().is_float() {
                attach(&t.detach(), &node, i)
            } else {
                t.clone()
            }
        })
        .collect()
}

impl Tensor {
    /// Whether gradients flow to this tensor.
    pub fn requires_grad(&self) -> bool {
        self.autograd_meta().is_some()
    }

    /// A new leaf handle over the same values that requires grad (`true`) or
    /// not (`false`). Gradients accumulate on the returned handle and its
    /// clones.
    #[track_caller]
    pub fn set_requires_grad(&self, requires: bool) -> Tensor {
        if requires && !self.dtype().is_float() {
            panic!(
                "{}",
                Error::op(
                    ErrorKind::DType,
                    "requires_grad",
                    format!("only float tensors can require grad, got {}", self.ty())
                )
                .at(SourceLoc::caller())
            );
        }
        let meta = requires.then(|| {
            Arc::new(AutogradMeta {
                grad: Mutex::new(None),
                grad_fn: None,
            })
        });
        self.with_autograd(meta)
    }

    /// The same values, cut from the autograd graph.
    pub fn detach(&self) -> Tensor {
        self.with_autograd(None)
    }

    /// A leaf: not computed by a recorded op.
    pub fn is_leaf(&self) -> bool {
        self.autograd_meta().is_none_or(|m| m.grad_fn.is_none())
    }

    /// The gradient accumulated in this leaf by `backward` calls.
    pub fn grad(&self) -> Option<Tensor> {
        self.autograd_meta()
            .and_then(|m| m.grad.lock().expect("grad lock").clone())
    }

    /// Replaces the accumulated gradient of this leaf (like assigning
    /// `p.grad` in PyTorch; gradient clipping needs it). The gradient must
    /// have this tensor's type.
    pub fn set_grad(&self, grad: Option<Tensor>) -> Result<()> {
        let meta = self
            .autograd_meta()
            .filter(|_| self.is_leaf())
            .ok_or_else(|| {
                Error::op(
                    ErrorKind::Argument,
                    "set_grad",
                    format!("{} is not a leaf that requires grad", self.ty()),
                )
            })?;
        if let Some(g) = grad.as_ref().filter(|g| g.ty() != self.ty()) {
            return Err(Error::op(
                ErrorKind::Shape,
                "set_grad",
                format!(
                    "the gradient {} does not match the tensor {}",
                    g.ty(),
                    self.ty()
                ),
            ));
        }
        *meta.grad.lock().expect("grad lock") = grad.map(|g| g.detach());
        Ok(())
    }

    /// Clears the accumulated gradient.
    pub fn zero_grad(&self) {
        if let Some(m) = self.autograd_meta() {
            *m.grad.lock().expect("grad lock") = None;
        }
    }

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
            no_grad(|| propagate(roots, &nodes, vec![seed], &mut Sink::Leaves))
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

fn grad_fn(t: &Tensor) -> Option<&(Arc<GradNode>, usize)> {
    t.autograd_meta().and_then(|m| m.grad_fn.as_ref())
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
        .filter_map(grad_fn)
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
        for input in &node.inputs {
            if let Some((n, _)) = grad_fn(input) {
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
enum Sink {
    Leaves,
    Capture(HashMap<Slot, usize>, Vec<Option<Tensor>>),
}

impl Sink {
    fn leaf(&mut self, leaf: &Tensor, g: Tensor) -> Result<()> {
        match self {
            Sink::Leaves => accumulate_leaf(leaf, g),
            Sink::Capture(..) => self.capture(slot_of(leaf), &g),
        }
    }

    fn capture(&mut self, slot: Option<Slot>, g: &Tensor) -> Result<()> {
        if let (Sink::Capture(targets, results), Some(slot)) = (self, slot) {
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
    match grad_fn(t) {
        None => sink.leaf(t, g.dense()?),
        Some((node, i)) => pending.add(node, *i, g),
    }
}

/// For a step-1 slice, the gradient of its input as a slice piece.
fn slice_piece(node: &GradNode, g: &Tensor) -> Option<Partial> {
    match &node.backward {
        Backward::Op {
            op:
                Op::Slice {
                    dim,
                    start,
                    step: 1,
                    ..
                },
            ..
        } => Some(Partial::Slices {
            dim: *dim,
            shape: node.inputs[0].shape().to_vec(),
            pieces: vec![(*start, g.clone())],
        }),
        _ => None,
    }
}

/// Backpropagates `seeds` from `roots` through `order`, the nodes
/// [`reverse_topological`] gives for `roots`.
fn propagate(
    roots: &[Tensor],
    order: &[Arc<GradNode>],
    seeds: Vec<Tensor>,
    sink: &mut Sink,
) -> Result<()> {
    let mut pending = Pending::default();
    for (root, seed) in roots.iter().zip(seeds) {
        // Summing the seeds of a root given twice belongs to the backward of
        // the op that computed it (its line and hints).
        match grad_fn(root) {
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
        if let (Some(piece), true) = (
            grads[0].as_ref().and_then(|g| slice_piece(node, g)),
            node.inputs[0].requires_grad(),
        ) {
            trace::with_origin(&node.origin, || {
                route(&node.inputs[0], piece, &mut pending, sink)
            })?;
            continue;
        }
        let input_grads = node.apply(grads)?;
        // The sums of partial gradients are part of this node's backward too:
        // in an AOT backward graph they carry the forward op's line and hints.
        trace::with_origin(&node.origin, || -> Result<()> {
            for (input, g) in node.inputs.iter().zip(input_grads) {
                let Some(g) = g.filter(|_| input.requires_grad()) else {
                    continue;
                };
                check_gradient(node.name(), input, &g)?;
                route(input, Partial::Dense(g), &mut pending, sink)?;
            }
            Ok(())
        })?;
    }
    Ok(())
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
    let mut sink = Sink::Capture(targets, vec![None; inputs.len()]);
    // Like PyTorch's `grad(…, retain_graph=True)`: the graph stays usable,
    // unless a backward already used it.
    let order = reverse_topological(outputs);
    check_unused(&order).map_err(|e| e.at(at.clone()))?;
    let on = outputs.first().map_or(Default::default(), Tensor::device);
    crate::runtime::device::with_device(on, || {
        no_grad(|| propagate(outputs, &order, seeds, &mut sink))
    })
    .map_err(|e| e.at(at))?;
    match sink {
        Sink::Capture(_, results) => Ok(results),
        Sink::Leaves => unreachable!("grad always captures"),
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
