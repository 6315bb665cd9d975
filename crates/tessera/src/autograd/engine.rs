//! The eager autograd engine: a tape of `GradFn`s hung on result tensors,
//! walked backwards by `Tensor::backward`.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};
use std::panic::Location;
use std::sync::{Arc, Mutex};

use super::rules;
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::Op;
use crate::tensor::Tensor;

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
    location: &'static Location<'static>,
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
            location: caller,
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
        no_grad(|| propagate(self, seed)).map_err(|e| e.at(at))
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

/// The tensors with a `GradFn` reachable from `root`, each after every
/// tensor computed from it (reverse topological order).
fn reverse_topological(root: &Tensor) -> Vec<Tensor> {
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    // Iterative post-order DFS: (tensor, children pushed yet?).
    let mut stack = vec![(root.clone(), false)];
    while let Some((t, expanded)) = stack.pop() {
        if expanded {
            order.push(t);
            continue;
        }
        if !seen.insert(t.id()) {
            continue;
        }
        let Some(f) = t.autograd_meta().and_then(|m| m.grad_fn.as_ref()) else {
            continue;
        };
        stack.push((t.clone(), true));
        for input in &f.inputs {
            if input.autograd_meta().is_some_and(|m| m.grad_fn.is_some())
                && !seen.contains(&input.id())
            {
                stack.push((input.clone(), false));
            }
        }
    }
    order.reverse();
    order
}

fn propagate(root: &Tensor, seed: Tensor) -> Result<()> {
    if root.is_leaf() {
        accumulate_leaf(root, seed);
        return Ok(());
    }
    let mut pending: HashMap<usize, Tensor> = HashMap::from([(root.id(), seed)]);
    for t in reverse_topological(root) {
        let Some(grad) = pending.remove(&t.id()) else {
            continue;
        };
        let f = t
            .autograd_meta()
            .and_then(|m| m.grad_fn.as_ref())
            .expect("non-leaf");
        let grads = rules::vjp(&f.op, &f.inputs, &f.output, &grad)
            .map_err(|e| e.at(SourceLoc::from_location(f.location)))?;
        for (input, g) in f.inputs.iter().zip(grads) {
            let Some(g) = g.filter(|_| input.requires_grad()) else {
                continue;
            };
            check_gradient(&f.op, input, &g)?;
            if input.is_leaf() {
                accumulate_leaf(input, g);
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
