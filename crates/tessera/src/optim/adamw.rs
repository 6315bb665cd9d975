//! AdamW: Adam with decoupled weight decay.

use super::{Optimizer, TraceableOptimizer};
use crate::error::{Error, ErrorKind, Result};
use crate::ir::DType;
use crate::nn::Parameter;
use crate::tensor::{Operand, Tensor};

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

    /// The scalars of step `t` (counted from 1), in f64:
    /// `[1 − lr·wd, lr/(1 − β1ᵗ), 1/√(1 − β2ᵗ)]`.
    fn scalars(c: &AdamWConfig, t: i32) -> [f64; 3] {
        let (b1, b2) = c.betas;
        [
            1.0 - c.lr * c.weight_decay,
            c.lr / (1.0 - b1.powi(t)),
            1.0 / (1.0 - b2.powi(t)).sqrt(),
        ]
    }
}

/// One AdamW step of `p` with gradient `g` from moments `moments` (`None`:
/// zero, without materialising the zeros), the step's `scalars` given as
/// [`AdamW::scalars`] orders them — f64 constants eagerly, 0-dim tensors
/// when traced. Returns the new value, m and v. The one definition of
/// AdamW's arithmetic.
fn adamw_step<S: Operand + Copy>(
    c: &AdamWConfig,
    p: &Tensor,
    g: &Tensor,
    moments: Option<(&Tensor, &Tensor)>,
    [decay, step_size, inv_sqrt_bc2]: [S; 3],
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b1, b2) = c.betas;
    let g_scaled = g.try_mul(1.0 - b1)?;
    let g2_scaled = g.try_mul(g)?.try_mul(1.0 - b2)?;
    let (m, v) = match moments {
        Some((m, v)) => (
            m.try_mul(b1)?.try_add(&g_scaled)?,
            v.try_mul(b2)?.try_add(&g2_scaled)?,
        ),
        None => (g_scaled, g2_scaled),
    };
    let denom = v.try_sqrt()?.try_mul(inv_sqrt_bc2)?.try_add(c.eps)?;
    let decayed = if c.weight_decay != 0.0 {
        p.try_mul(decay)?
    } else {
        p.clone()
    };
    let next = decayed.try_sub(&m.try_div(&denom)?.try_mul(step_size)?)?;
    Ok((next, m, v))
}

impl Optimizer for AdamW {
    fn step(&mut self) {
        let config = &self.config;
        super::step_each(&self.params, &mut self.states, |p, g, state| {
            let t = state.as_ref().map_or(1, |s| s.t + 1);
            let moments = state.as_ref().map(|s| (&s.m, &s.v));
            let (next, m, v) = adamw_step(config, p, g, moments, AdamW::scalars(config, t))
                .unwrap_or_else(|e| panic!("AdamW::step: {e}"));
            *state = Some(Moments { m, v, t });
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

impl TraceableOptimizer for AdamW {
    fn params(&self) -> &[Parameter] {
        &self.params
    }

    fn state_len(&self) -> usize {
        2
    }

    fn state(&self, i: usize) -> Vec<Tensor> {
        match &self.states[i] {
            Some(s) => vec![s.m.clone(), s.v.clone()],
            None => super::zero_state(&self.params[i].get(), 2),
        }
    }

    fn step_scalars(&self, i: usize) -> Vec<f64> {
        let t = self.states[i].as_ref().map_or(1, |s| s.t + 1);
        AdamW::scalars(&self.config, t).to_vec()
    }

    /// `[1 − lr·wd, lr/(1 − β1ᵗ), 1/√(1 − β2ᵗ)]` as the eager step computes them,
    /// with `βᵗ` an f64 `pow` (the host's `powi` may differ from it in the
    /// last bit of an f64, which the parameter's f32 rarely shows).
    fn counted_step_scalars(&self, lr: &Tensor, t: &Tensor) -> Result<Vec<Tensor>> {
        let c = &self.config;
        let (b1, b2) = c.betas;
        let power = |beta: f64| Tensor::try_full(&[], beta, DType::F64)?.try_pow(t);
        // 1 − x as −x + 1: the same IEEE result.
        let one_minus = |x: Tensor| x.try_neg()?.try_add(1.0);
        Ok(vec![
            one_minus(lr.try_mul(c.weight_decay)?)?,
            lr.try_div(&one_minus(power(b1)?)?)?,
            one_minus(power(b2)?)?.try_sqrt()?.try_reciprocal()?,
        ])
    }

    fn steps_taken(&self, i: usize) -> u64 {
        self.states[i].as_ref().map_or(0, |s| s.t as u64)
    }

    fn set_steps_taken(&mut self, i: usize, steps: u64) {
        let t = i32::try_from(steps).unwrap_or(i32::MAX);
        match &mut self.states[i] {
            Some(s) => s.t = t,
            None if steps > 0 => {
                let [m, v]: [Tensor; 2] = super::zero_state(&self.params[i].get(), 2)
                    .try_into()
                    .unwrap_or_else(|_| unreachable!("zero_state gives 2 tensors"));
                self.states[i] = Some(Moments { m, v, t });
            }
            None => {}
        }
    }

    fn update(
        &self,
        p: &Tensor,
        g: &Tensor,
        state: &[Tensor],
        scalars: &[Tensor],
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let (Ok([m, v]), Ok(scalars)) = (
            <&[Tensor; 2]>::try_from(state),
            <&[Tensor; 3]>::try_from(scalars),
        ) else {
            return Err(Error::op(
                ErrorKind::Argument,
                "AdamW::update",
                format!(
                    "needs 2 state tensors (m, v) and 3 scalars, got {} and {}",
                    state.len(),
                    scalars.len()
                ),
            ));
        };
        let [decay, step_size, inv_sqrt_bc2] = scalars;
        let (next, m, v) = adamw_step(
            &self.config,
            p,
            g,
            Some((m, v)),
            [decay, step_size, inv_sqrt_bc2],
        )?;
        Ok((next, vec![m, v]))
    }

    /// The moments by value, the step count kept (before the first step:
    /// fresh zeros, which nothing else holds).
    fn take_state(&mut self, i: usize) -> Vec<Tensor> {
        match &mut self.states[i] {
            Some(s) => {
                let (pm, pv) = (super::placeholder(&s.m), super::placeholder(&s.v));
                vec![
                    std::mem::replace(&mut s.m, pm),
                    std::mem::replace(&mut s.v, pv),
                ]
            }
            None => super::zero_state(&self.params[i].get(), 2),
        }
    }

    fn restore_state(&mut self, i: usize, state: Vec<Tensor>) {
        if let (Some(s), [m, v]) = (&mut self.states[i], &state[..]) {
            s.m = m.clone();
            s.v = v.clone();
        }
    }

    fn advance(&mut self, i: usize, state: Vec<Tensor>) -> Result<()> {
        let t = self.states[i].as_ref().map_or(1, |s| s.t + 1);
        let [m, v]: [Tensor; 2] = state.try_into().map_err(|s: Vec<Tensor>| {
            Error::op(
                ErrorKind::Argument,
                "AdamW::advance",
                format!("needs 2 state tensors (m, v), got {}", s.len()),
            )
        })?;
        self.states[i] = Some(Moments { m, v, t });
        Ok(())
    }
}
