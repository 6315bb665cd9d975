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

mod adamw;
mod amp;
mod scaler;
mod sgd;

pub use adamw::{AdamW, AdamWConfig};
pub use amp::MixedPrecision;
pub use scaler::{GradScaler, GradScalerConfig};
pub use sgd::{Sgd, SgdConfig};

use crate::autograd::no_grad;
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

/// Scales the gradients of `params` in place so their global L2 norm is at
/// most `max_norm` (as `torch.nn.utils.clip_grad_norm_`, with its 1e-6
/// guard), and returns the norm before clipping. Parameters without a
/// gradient are ignored; with none at all the norm is 0. A non-finite norm
/// is returned as is and leaves the gradients untouched.
pub fn clip_grad_norm<'a>(params: impl IntoIterator<Item = &'a Parameter>, max_norm: f64) -> f64 {
    no_grad(|| {
        let with_grads: Vec<(Tensor, Tensor)> = params
            .into_iter()
            .filter_map(|p| {
                let leaf = p.get();
                leaf.grad().map(|g| (leaf, g))
            })
            .collect();
        let total = with_grads
            .iter()
            .map(|(_, g)| (g * g).sum(&[], false).item())
            .sum::<f64>()
            .sqrt();
        let coef = max_norm / (total + 1e-6);
        if coef < 1.0 {
            for (leaf, g) in &with_grads {
                leaf.set_grad(Some(g * coef))
                    .expect("a parameter's value is a leaf and g * coef keeps its type");
            }
        }
        total
    })
}
