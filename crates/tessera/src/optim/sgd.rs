//! Stochastic gradient descent with momentum and (coupled) weight decay.

use super::{Optimizer, TraceableOptimizer};
use crate::error::{Error, ErrorKind, Result};
use crate::nn::Parameter;
use crate::tensor::{Operand, Tensor};

/// SGD's hyper-parameters (PyTorch's, with dampening 0 and no Nesterov).
#[derive(Clone, Debug, PartialEq)]
pub struct SgdConfig {
    pub lr: f64,
    /// 0 disables the momentum buffer.
    pub momentum: f64,
    /// L2 penalty added to the gradient: `g + weight_decay * p`.
    pub weight_decay: f64,
}

impl Default for SgdConfig {
    fn default() -> SgdConfig {
        SgdConfig {
            lr: 1e-3,
            momentum: 0.0,
            weight_decay: 0.0,
        }
    }
}

/// `torch.optim.SGD`:
/// `g = grad + wd·p; buf = g (first step) or momentum·buf + g; p -= lr·buf`.
pub struct Sgd {
    pub config: SgdConfig,
    params: Vec<Parameter>,
    /// The momentum buffer of each parameter, once it has had a gradient.
    buffers: Vec<Option<Tensor>>,
}

impl Sgd {
    /// Panics on a negative learning rate, momentum or weight decay.
    #[track_caller]
    pub fn new(params: Vec<Parameter>, config: SgdConfig) -> Sgd {
        let SgdConfig {
            lr,
            momentum,
            weight_decay,
        } = config;
        assert!(
            lr >= 0.0 && momentum >= 0.0 && weight_decay >= 0.0,
            "Sgd: lr, momentum and weight_decay must be >= 0, got {config:?}"
        );
        Sgd {
            buffers: vec![None; params.len()],
            params,
            config,
        }
    }

    pub fn params(&self) -> &[Parameter] {
        &self.params
    }
}

/// One SGD step of `p` with gradient `grad` and momentum buffer `buffer`
/// (`None` before the first step), the learning rate `lr` an f64 constant
/// eagerly, a 0-dim tensor when traced. Returns the new value and, with
/// momentum, the new buffer. The one definition of SGD's arithmetic.
fn sgd_step<S: Operand>(
    c: &SgdConfig,
    p: &Tensor,
    grad: &Tensor,
    buffer: Option<&Tensor>,
    lr: S,
) -> Result<(Tensor, Option<Tensor>)> {
    let mut d = grad.clone();
    if c.weight_decay != 0.0 {
        d = d.try_add(&p.try_mul(c.weight_decay)?)?;
    }
    let mut next_buffer = None;
    if c.momentum != 0.0 {
        let next = match buffer {
            Some(b) => b.try_mul(c.momentum)?.try_add(&d)?,
            None => d,
        };
        next_buffer = Some(next.clone());
        d = next;
    }
    Ok((p.try_sub(&d.try_mul(lr)?)?, next_buffer))
}

impl Optimizer for Sgd {
    fn step(&mut self) {
        let config = &self.config;
        super::step_each(&self.params, &mut self.buffers, |p, g, buffer| {
            let (next, b) = sgd_step(config, p, g, buffer.as_ref(), config.lr)
                .unwrap_or_else(|e| panic!("Sgd::step: {e}"));
            *buffer = b;
            next
        });
    }

    fn zero_grad(&self) {
        self.params.iter().for_each(Parameter::zero_grad);
    }

    fn lr(&self) -> f64 {
        self.config.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.config.lr = lr;
    }
}

impl TraceableOptimizer for Sgd {
    fn params(&self) -> &[Parameter] {
        &self.params
    }

    fn state_len(&self) -> usize {
        usize::from(self.config.momentum != 0.0)
    }

    fn state(&self, i: usize) -> Vec<Tensor> {
        if self.config.momentum == 0.0 {
            return Vec::new();
        }
        match &self.buffers[i] {
            Some(b) => vec![b.clone()],
            None => super::zero_state(&self.params[i].get(), 1),
        }
    }

    fn step_scalars(&self, _: usize) -> Vec<f64> {
        vec![self.config.lr]
    }

    /// `[lr]`: SGD's step does not depend on its count.
    fn counted_step_scalars(&self, lr: &Tensor, _t: &Tensor) -> Result<Vec<Tensor>> {
        Ok(vec![lr.clone()])
    }

    fn update(
        &self,
        p: &Tensor,
        g: &Tensor,
        state: &[Tensor],
        scalars: &[Tensor],
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let ([lr], true) = (scalars, state.len() == self.state_len()) else {
            return Err(Error::op(
                ErrorKind::Argument,
                "Sgd::update",
                format!(
                    "needs {} state tensors and 1 scalar (lr), got {} and {}",
                    self.state_len(),
                    state.len(),
                    scalars.len()
                ),
            ));
        };
        let (next, buffer) = sgd_step(&self.config, p, g, state.first(), lr)?;
        Ok((next, buffer.into_iter().collect()))
    }

    /// The momentum buffer by value (before the first step: fresh zeros,
    /// which nothing else holds).
    fn take_state(&mut self, i: usize) -> Vec<Tensor> {
        match &mut self.buffers[i] {
            Some(b) if self.config.momentum != 0.0 => {
                let placeholder = super::placeholder(b);
                vec![std::mem::replace(b, placeholder)]
            }
            _ => self.state(i),
        }
    }

    fn restore_state(&mut self, i: usize, state: Vec<Tensor>) {
        if let (Some(b), [taken]) = (&mut self.buffers[i], &state[..]) {
            *b = taken.clone();
        }
    }

    fn advance(&mut self, i: usize, state: Vec<Tensor>) -> Result<()> {
        if state.len() != self.state_len() {
            return Err(Error::op(
                ErrorKind::Argument,
                "Sgd::advance",
                format!(
                    "needs {} state tensors, got {}",
                    self.state_len(),
                    state.len()
                ),
            ));
        }
        self.buffers[i] = state.into_iter().next();
        Ok(())
    }
}
