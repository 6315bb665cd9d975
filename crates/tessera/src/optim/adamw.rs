//! AdamW: Adam with decoupled weight decay.

use super::Optimizer;
use crate::nn::Parameter;
use crate::tensor::Tensor;

/// AdamW's hyper-parameters; the defaults are PyTorch's.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamWConfig {
    pub lr: f64,
    /// Decay rates of the first and second moment estimates.
    pub betas: (f64, f64),
    pub eps: f64,
    /// Decoupled: the parameter shrinks by `lr · weight_decay` each step,
    /// independently of the gradient.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> AdamWConfig {
        AdamWConfig {
            lr: 1e-3,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

/// `torch.optim.AdamW` (no amsgrad), with PyTorch's arithmetic:
///
/// ```text
/// p ← p · (1 − lr·wd)
/// m ← β1·m + (1 − β1)·g          v ← β2·v + (1 − β2)·g²
/// p ← p − lr/(1 − β1ᵗ) · m / (√v / √(1 − β2ᵗ) + eps)
/// ```
///
/// where `t` counts the steps this parameter has had a gradient.
pub struct AdamW {
    pub config: AdamWConfig,
    params: Vec<Parameter>,
    states: Vec<Option<Moments>>,
}

/// One parameter's running moments and step count.
struct Moments {
    m: Tensor,
    v: Tensor,
    t: i32,
}

impl AdamW {
    /// Panics on a negative lr, eps or weight decay, or betas outside [0, 1).
    #[track_caller]
    pub fn new(params: Vec<Parameter>, config: AdamWConfig) -> AdamW {
        let (b1, b2) = config.betas;
        let valid = config.lr >= 0.0
            && config.eps >= 0.0
            && config.weight_decay >= 0.0
            && (0.0..1.0).contains(&b1)
            && (0.0..1.0).contains(&b2);
        assert!(
            valid,
            "AdamW: needs lr, eps, weight_decay >= 0 and betas in [0, 1), got {config:?}"
        );
        AdamW {
            states: (0..params.len()).map(|_| None).collect(),
            params,
            config,
        }
    }

    pub fn params(&self) -> &[Parameter] {
        &self.params
    }

    /// The new value of one parameter, advancing its moments.
    fn update(
        c: &AdamWConfig,
        p: &Tensor,
        g: &Tensor,
        state: Option<Moments>,
    ) -> (Tensor, Moments) {
        let (b1, b2) = c.betas;
        let (m, v, t) = match state {
            Some(s) => (
                s.m * b1 + g * (1.0 - b1),
                s.v * b2 + g * g * (1.0 - b2),
                s.t + 1,
            ),
            // Zero-initialised moments, without materialising the zeros.
            None => (g * (1.0 - b1), g * g * (1.0 - b2), 1),
        };
        let step_size = c.lr / (1.0 - b1.powi(t));
        let inv_sqrt_bc2 = 1.0 / (1.0 - b2.powi(t)).sqrt();
        let denom = v.sqrt() * inv_sqrt_bc2 + c.eps;
        let decayed = if c.weight_decay != 0.0 {
            p * (1.0 - c.lr * c.weight_decay)
        } else {
            p.clone()
        };
        let next = decayed - (&m / &denom) * step_size;
        (next, Moments { m, v, t })
    }
}

impl Optimizer for AdamW {
    fn step(&mut self) {
        let config = &self.config;
        super::step_each(&self.params, &mut self.states, |p, g, state| {
            let (next, moments) = AdamW::update(config, p, g, state.take());
            *state = Some(moments);
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
