//! The eager autograd engine: a tape of `GradFn`s hung on result tensors,
//! walked backwards by `Tensor::backward`.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::panic::Location;
use std::sync::{Arc, Mutex};

use super::rules;
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::{NodeMeta, Op};
use crate::tensor::{trace, Tensor};

/// Autograd state of a tensor that requires grad.
pub(crate) struct AutogradMeta {
    /// The accumulated gradient of a leaf.
    grad: Mutex<Option<Tensor>>,
    /// How this tensor was computed; `None` for a leaf.
    grad_fn: Option<GradFn>,
}

/// One recorded op: enough to apply its VJP rule.
struct GradFn {
    op: Op,
    inputs: Vec<Tensor>,
    /// The op's result, detached (no autograd meta: no reference cycle).
    output: Tensor,
    /// The forward op's call site and hints, which its backward ops inherit.
    origin: NodeMeta,
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

/// Ops whose output carries a gradient back to (some of) their inputs.
fn is_differentiable(op: &Op) -> bool {
    !matches!(
        op,
        Op::Input
            | Op::Constant(_)
            | Op::Full { .. }
            | Op::Arange { .. }
            | Op::Rand { .. }
            | Op::Randn { .. }
            | Op::Compare(_)
            | Op::ArgReduce { .. }
    )
}

/// Hangs a `GradFn` on `out` when an input requires grad.
pub(crate) fn record(
    op: &Op,
    inputs: &[&Tensor],
    out: Tensor,
    caller: &'static Location<'static>,
) -> Tensor {
    let tracked = is_grad_enabled()
        && out.dtype().is_float()
        && is_differentiable(op)
        && inputs.iter().any(|t| t.requires_grad());
    if !tracked {
        return out;
    }
    let meta = AutogradMeta {
        grad: Mutex::new(None),
        grad_fn: Some(GradFn {
            op: op.clone(),
            inputs: inputs.iter().map(|&t| t.clone()).collect(),
            output: out.clone(),
            origin: trace::node_meta(caller),
        }),
    };
    out.with_autograd(Some(Arc::new(meta)))
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

    /// A leaf: requires grad and was not computed by a recorded op.
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
    #[track_caller]
    pub fn backward(&self) {
        if let Err(e) = self.try_backward(None) {
            panic!("{e}");
        }
    }

    /// Backpropagates `grad` (this tensor's shape) into the leaves.
    #[track_caller]
    pub fn backward_with(&self, grad: &Tensor) {
        if let Err(e) = self.try_backward(Some(grad)) {
            panic!("{e}");
        }
    }

    /// `backward`, returning errors instead of panicking.
    #[track_caller]
    pub fn try_backward(&self, grad: Option<&Tensor>) -> Result<()> {
        let at = SourceLoc::caller();
        let seed = seed_gradient(self, grad).map_err(|e| e.at(at.clone()))?;
        no_grad(|| propagate(std::slice::from_ref(self), vec![seed], &mut Sink::Leaves))
            .map_err(|e| e.at(at))
    }
}

fn seed_gradient(out: &Tensor, grad: Option<&Tensor>) -> Result<Tensor> {
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

/// The tensors with a `GradFn` reachable from `roots`, each before every
/// tensor it was computed from (reverse topological order).
fn reverse_topological(roots: &[Tensor]) -> Vec<Tensor> {
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    // Iterative post-order DFS: (tensor, inputs pushed yet?).
    let mut stack: Vec<(Tensor, bool)> = roots.iter().rev().map(|r| (r.clone(), false)).collect();
    while let Some((t, expanded)) = stack.pop() {
        if expanded {
            order.push(t);
            continue;
        }
        if !seen.insert(t.id()) {
            continue;
        }
        let Some(f) = grad_fn(&t) else {
            continue;
        };
        stack.push((t.clone(), true));
        for input in &f.inputs {
            if grad_fn(input).is_some() && !seen.contains(&input.id()) {
                stack.push((input.clone(), false));
            }
        }
    }
    order.reverse();
    order
}

fn grad_fn(t: &Tensor) -> Option<&GradFn> {
    t.autograd_meta().and_then(|m| m.grad_fn.as_ref())
}

/// Where gradients end up: accumulated into leaves (`backward`), or
/// returned for chosen tensors (`grad`).
enum Sink {
    Leaves,
    /// Tensor id → position in the result.
    Capture(HashMap<usize, usize>, Vec<Option<Tensor>>),
}

impl Sink {
    fn leaf(&mut self, leaf: &Tensor, g: Tensor) -> Result<()> {
        match self {
            Sink::Leaves => {
                accumulate_leaf(leaf, g);
                Ok(())
            }
            Sink::Capture(..) => self.capture(leaf, &g),
        }
    }

    fn capture(&mut self, t: &Tensor, g: &Tensor) -> Result<()> {
        if let Sink::Capture(targets, results) = self {
            if let Some(&i) = targets.get(&t.id()) {
                results[i] = Some(match results[i].take() {
                    Some(prev) => prev.try_add(g)?,
                    None => g.clone(),
                });
            }
        }
        Ok(())
    }
}

fn propagate(roots: &[Tensor], seeds: Vec<Tensor>, sink: &mut Sink) -> Result<()> {
    let mut pending: HashMap<usize, Tensor> = HashMap::new();
    for (root, seed) in roots.iter().zip(seeds) {
        if root.is_leaf() {
            sink.leaf(root, seed)?;
        } else {
            let total = match pending.remove(&root.id()) {
                Some(prev) => prev.try_add(&seed)?,
                None => seed,
            };
            pending.insert(root.id(), total);
        }
    }
    for t in reverse_topological(roots) {
        let Some(grad) = pending.remove(&t.id()) else {
            continue;
        };
        sink.capture(&t, &grad)?;
        let f = grad_fn(&t).expect("non-leaf");
        let grads =
            trace::with_origin(&f.origin, || rules::vjp(&f.op, &f.inputs, &f.output, &grad))
                .map_err(|e| match &f.origin.location {
                    Some(loc) => e.at(loc.clone()),
                    None => e,
                })?;
        for (input, g) in f.inputs.iter().zip(grads) {
            let Some(g) = g.filter(|_| input.requires_grad()) else {
                continue;
            };
            check_gradient(&f.op, input, &g)?;
            if input.is_leaf() {
                sink.leaf(input, g)?;
            } else {
                let total = match pending.remove(&input.id()) {
                    Some(prev) => prev.try_add(&g)?,
                    None => g,
                };
                pending.insert(input.id(), total);
            }
        }
    }
    Ok(())
}

/// The gradients of `outputs` (weighted by `grad_outputs`, one per output)
/// with respect to `inputs`, returned instead of accumulated (like
/// `torch.autograd.grad`). `None` where an input does not influence the outputs.
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
        .map(|(i, t)| (t.id(), i))
        .collect();
    let mut sink = Sink::Capture(targets, vec![None; inputs.len()]);
    no_grad(|| propagate(outputs, seeds, &mut sink)).map_err(|e| e.at(at))?;
    match sink {
        Sink::Capture(_, results) => Ok(results),
        Sink::Leaves => unreachable!(),
    }
}

/// A rule that returns a gradient of the wrong type is a bug; say which.
fn check_gradient(op: &Op, input: &Tensor, g: &Tensor) -> Result<()> {
    if g.shape() != input.shape() || g.dtype() != input.dtype() {
        return Err(Error::op(
            ErrorKind::Verify,
            op.name(),
            format!(
                "internal error: its VJP rule gave a gradient {} for an input {}",
                g.ty(),
                input.ty()
            ),
        ));
    }
    Ok(())
}

fn accumulate_leaf(leaf: &Tensor, g: Tensor) {
    let meta = leaf.autograd_meta().expect("a leaf that requires grad");
    let mut slot = meta.grad.lock().expect("grad lock");
    *slot = Some(match slot.take() {
        Some(prev) => &prev + &g,
        None => g,
    });
}
