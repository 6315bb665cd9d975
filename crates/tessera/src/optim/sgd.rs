//! Stochastic gradient descent with momentum and (coupled) weight decay.

use super::Optimizer;
use crate::nn::Parameter;
use crate::tensor::Tensor;

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

    /// The new value of one parameter, updating its momentum buffer.
    fn update(c: &SgdConfig, p: &Tensor, grad: &Tensor, buffer: &mut Option<Tensor>) -> Tensor {
        let mut d = grad.clone();
        if c.weight_decay != 0.0 {
            d = d + p * c.weight_decay;
        }
        if c.momentum != 0.0 {
            let next = match buffer.take() {
                Some(b) => b * c.momentum + &d,
                None => d,
            };
            *buffer = Some(next.clone());
            d = next;
        }
        p - &(d * c.lr)
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) {
        let config = &self.config;
        super::step_each(&self.params, &mut self.buffers, |p, g, buffer| {
            Sgd::update(config, p, g, buffer)
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
