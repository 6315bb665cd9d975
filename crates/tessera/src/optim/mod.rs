//! Optimizers over [`Parameter`]s, and gradient-norm clipping.
//!
//! An optimizer holds handles to the parameters it updates (clones of the
//! store's, e.g. `store.parameters()`) and per-parameter state. `step` runs
//! under `no_grad`, reads each parameter's `grad()`, skips parameters
//! without one (their state does not advance either, as in PyTorch), and
//! installs the new value with [`Parameter::set`], which starts a fresh leaf
//! without a gradient. The update arithmetic is whole-tensor ops.
//!
//! Every parameter an optimizer is given shares one configuration; to
//! exempt some (biases, norms) from weight decay, give them to a second
//! optimizer, e.g. by filtering `store.parameters()` on `Parameter::name`.
//!
//! Mixed precision: the forward runs under [`crate::autocast`], the
//! parameters and the optimizers' state stay f32 (the gradients autograd
//! returns to them are f32); f16 needs loss scaling ([`GradScaler`]).
//! [`MixedPrecision`] bundles the three precisions for a training loop.
//!
//! Each optimizer's arithmetic is written once, generic over how its
//! per-step scalars come (the learning rate, AdamW's bias corrections):
//! as `f64` constants in the eager [`Optimizer::step`], as scalar tensors
//! when [`TraceableOptimizer::update`] is traced into a compiled training
//! step (`tessera::compile::train_step`), so that one compiled step serves
//! every learning rate and step count. Both give the same values.

mod adamw;
mod amp;
mod scaler;
mod sgd;

pub use adamw::{AdamW, AdamWConfig};
pub use amp::MixedPrecision;
pub use scaler::{
    next_scale, scale_loss, unscale_grads, GradScaler, GradScalerConfig, MAX_SCALE, MIN_SCALE,
};
pub use sgd::{Sgd, SgdConfig};

use crate::autograd::no_grad;
use crate::error::Result;
use crate::ir::DType;
use crate::nn::Parameter;
use crate::tensor::Tensor;

/// What a training loop needs from an optimizer.
pub trait Optimizer {
    /// Updates every parameter that has a gradient.
    fn step(&mut self);
    /// Clears the gradients of the optimizer's parameters.
    fn zero_grad(&self);
    fn lr(&self) -> f64;
    /// Changes the learning rate (for schedules).
    fn set_lr(&mut self, lr: f64);
}

/// An optimizer whose step can be traced: its state as tensors, the
/// scalars of each parameter's next step computed on the host, and the
/// update as tensor ops over both — the same arithmetic its eager
/// [`Optimizer::step`] runs (see the module docs). What a compiled
/// training step (`tessera::compile::train_step`) needs.
pub trait TraceableOptimizer: Optimizer {
    /// The parameters it updates, in order.
    fn params(&self) -> &[Parameter];

    /// How many state tensors each parameter carries (AdamW: m and v; SGD:
    /// the momentum buffer, or none without momentum).
    fn state_len(&self) -> usize;

    /// The state of parameter `i`, [`TraceableOptimizer::state_len`]
    /// tensors of its type on its device: zeros before its first step, from
    /// which [`TraceableOptimizer::update`] computes what the eager first
    /// step computes.
    fn state(&self, i: usize) -> Vec<Tensor>;

    /// The scalars of parameter `i`'s next step, computed in f64 as the
    /// eager step computes them (AdamW: `1 − lr·wd`, `lr/(1 − β1ᵗ)` and
    /// `1/√(1 − β2ᵗ)`; SGD: `lr`).
    fn step_scalars(&self, i: usize) -> Vec<f64>;

    /// The scalars of a step whose number `t` (counted from 1) is a 0-dim
    /// f64 tensor rather than a host count, at learning rate `lr` (a 0-dim
    /// f64 tensor): [`TraceableOptimizer::step_scalars`]'s values in its
    /// order, as 0-dim f64 tensors, the same for every parameter at the
    /// same `t`. What a compiled step with a loss scaler uses: whether a
    /// step counts is known only on the device there (a skipped step does
    /// not count), so the count stays there (as PyTorch's fused AdamW
    /// keeps its `step` on the device under a `GradScaler`).
    fn counted_step_scalars(&self, lr: &Tensor, t: &Tensor) -> Result<Vec<Tensor>>;

    /// How many steps parameter `i` has taken (AdamW's `t` before its next
    /// step). 0 for an optimizer whose steps do not depend on it.
    fn steps_taken(&self, i: usize) -> u64 {
        let _ = i;
        0
    }

    /// Sets how many steps parameter `i` has taken (a compiled step that
    /// counted them on the device gives the count back); nothing for an
    /// optimizer whose steps do not depend on it.
    fn set_steps_taken(&mut self, i: usize, steps: u64) {
        let _ = (i, steps);
    }

    /// The new value and state of a parameter `p` with gradient `g`, state
    /// `state` and the scalars of its step as 0-dim tensors of `p`'s dtype.
    fn update(
        &self,
        p: &Tensor,
        g: &Tensor,
        state: &[Tensor],
        scalars: &[Tensor],
    ) -> Result<(Tensor, Vec<Tensor>)>;

    /// Installs the state parameter `i` has after a step computed outside
    /// the optimizer (by `update`), and counts the step. An error when
    /// `state` is not [`TraceableOptimizer::state_len`] tensors.
    fn advance(&mut self, i: usize, state: Vec<Tensor>) -> Result<()>;

    /// Parameter `i`'s state handed over to a step computed outside (a
    /// compiled step that writes the new state over the old: buffer
    /// donation): the tensors [`TraceableOptimizer::state`] gives, the
    /// optimizer keeping no handle of them (an empty placeholder instead;
    /// the step count stays) until [`TraceableOptimizer::advance`]
    /// installs the next state or [`TraceableOptimizer::restore_state`]
    /// puts these back. The default keeps its handles: nothing can be
    /// written over.
    fn take_state(&mut self, i: usize) -> Vec<Tensor> {
        self.state(i)
    }

    /// Puts back the state [`TraceableOptimizer::take_state`] handed over
    /// (a step that failed before it ran); counts no step.
    fn restore_state(&mut self, i: usize, state: Vec<Tensor>) {
        let _ = (i, state);
    }
}

/// What stands in for a state tensor handed over (see
/// [`TraceableOptimizer::take_state`]): no elements, nothing allocated.
fn placeholder(t: &Tensor) -> Tensor {
    Tensor::no_elements(t.device(), t.dtype())
}

/// `n` zero tensors of `p`'s type, on its device (the state of a
/// parameter before its first step).
fn zero_state(p: &Tensor, n: usize) -> Vec<Tensor> {
    crate::runtime::device::with_device(p.device(), || {
        (0..n)
            .map(|_| Tensor::zeros(p.shape(), p.dtype()))
            .collect()
    })
}

/// The step both optimizers share: under `no_grad`, each parameter with a
/// gradient gets `update(value, grad, its state)` as its new value;
/// parameters without one (and their state) are left as they are.
fn step_each<S>(
    params: &[Parameter],
    states: &mut [Option<S>],
    mut update: impl FnMut(&Tensor, &Tensor, &mut Option<S>) -> Tensor,
) {
    no_grad(|| {
        for (param, state) in params.iter().zip(states.iter_mut()) {
            let p = param.get();
            if let Some(g) = p.grad() {
                param.set(&update(&p, &g, state));
            }
        }
    })
}

/// The global L2 norm of `grads` as an f64 0-dim tensor: each `sum(g²)`
/// in the gradient's dtype, widened to f64 and summed there in order, then
/// the square root (0 for no gradients). Shared by [`clip_grad_norm`] and
/// the compiled training step.
pub fn global_grad_norm(grads: &[Tensor]) -> Result<Tensor> {
    let mut total: Option<Tensor> = None;
    for g in grads {
        let sq = g.try_mul(g)?.try_sum(&[], false)?.try_cast(DType::F64)?;
        total = Some(match total {
            Some(t) => t.try_add(&sq)?,
            None => sq,
        });
    }
    match total {
        Some(t) => t.try_sqrt(),
        None => Tensor::try_full(&[], 0.0, DType::F64),
    }
}

/// The factor [`clip_grad_norm`] scales gradients by, as an f64 0-dim
/// tensor: `max_norm / (norm + 1e-6)` (PyTorch's guard) where that is
/// below 1, else 1 — also for a NaN norm, which leaves gradients as they
/// are.
pub fn clip_factor(norm: &Tensor, max_norm: f64) -> Result<Tensor> {
    let coef = Tensor::try_full(&[], max_norm, DType::F64)?.try_div(&norm.try_add(1e-6)?)?;
    let one = Tensor::try_full(&[], 1.0, DType::F64)?;
    Tensor::try_where(&coef.try_lt(1.0)?, &coef, &one)
}

/// Scales the gradients of `params` in place so their global L2 norm is at
/// most `max_norm` (as `torch.nn.utils.clip_grad_norm_`, with its 1e-6
/// guard), and returns the norm before clipping. Parameters without a
/// gradient are ignored; with none at all the norm is 0. A NaN norm is
/// returned as is and leaves the gradients untouched. The norm and the
/// factor are [`global_grad_norm`] and [`clip_factor`], as in a compiled
/// training step; this eager version skips the scaling when the factor is 1.
pub fn clip_grad_norm<'a>(params: impl IntoIterator<Item = &'a Parameter>, max_norm: f64) -> f64 {
    no_grad(|| {
        let with_grads: Vec<(Tensor, Tensor)> = params
            .into_iter()
            .filter_map(|p| {
                let leaf = p.get();
                leaf.grad().map(|g| (leaf, g))
            })
            .collect();
        let grads: Vec<Tensor> = with_grads.iter().map(|(_, g)| g.clone()).collect();
        let norm = global_grad_norm(&grads).expect("the squares of gradients sum");
        let factor = clip_factor(&norm, max_norm).expect("a scalar's arithmetic");
        if factor.item() < 1.0 {
            for (leaf, g) in &with_grads {
                let scaled = g * &factor.cast(g.dtype());
                leaf.set_grad(Some(scaled))
                    .expect("a parameter's value is a leaf and g * factor keeps its type");
            }
        }
        norm.item()
    })
}
