//! Dynamic loss scaling for f16 training: [`GradScaler`], as
//! `torch.amp.GradScaler`.
//!
//! f16 holds nothing below 2⁻²⁴, so small gradients of an f16 forward
//! underflow to zero. The scaler multiplies the loss by a large factor
//! before `backward` (every gradient is then scaled by it too), divides the
//! parameters' gradients by it again before the optimizer step, and adapts
//! it: a step whose gradients hold an inf or a NaN (the scale was too large
//! for f16) is skipped and the scale halved; after `growth_interval` good
//! steps in a row the scale doubles.
//!
//! ```
//! use tessera::nn::{mse, Linear, ParamStore};
//! use tessera::optim::{GradScaler, GradScalerConfig, Optimizer, Sgd, SgdConfig};
//! use tessera::tensor::Generator;
//! use tessera::{autocast, DType, Tensor};
//!
//! let mut store = ParamStore::new();
//! let layer = Linear::new(&mut store, "fc", 4, 2, true, &mut Generator::new(0));
//! let mut opt = Sgd::new(store.parameters(), SgdConfig { lr: 0.1, ..Default::default() });
//! let mut scaler = GradScaler::new(store.parameters(), GradScalerConfig::default());
//! let (x, y) = (Tensor::ones(&[3, 4], DType::F32), Tensor::zeros(&[3, 2], DType::F32));
//!
//! opt.zero_grad();
//! let loss = autocast(DType::F16, || mse(&layer.forward(&x), &y)); // f32
//! scaler.scale(&loss).backward();
//! scaler.unscale().unwrap(); // here a clip_grad_norm would see true gradients
//! let stepped = scaler.step(&mut opt).unwrap();
//! scaler.update();
//! assert!(stepped);
//! ```

use crate::autograd::no_grad;
use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::DType;
use crate::nn::Parameter;
use crate::tensor::{autocast, Tensor};

use super::Optimizer;

/// The scaler's settings; the defaults are PyTorch's.
#[derive(Clone, Debug, PartialEq)]
pub struct GradScalerConfig {
    /// The first scale.
    pub init_scale: f64,
    /// The scale is multiplied by this after `growth_interval` good steps.
    pub growth_factor: f64,
    /// … and by this after a step with non-finite gradients.
    pub backoff_factor: f64,
    /// Good steps in a row before the scale grows.
    pub growth_interval: usize,
}

impl Default for GradScalerConfig {
    fn default() -> GradScalerConfig {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

impl GradScalerConfig {
    /// An error unless the initial scale is finite and within
    /// [`MIN_SCALE`, `MAX_SCALE`], `growth_factor > 1`,
    /// `0 < backoff_factor < 1` and `growth_interval >= 1`.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        let valid = c.init_scale.is_finite()
            && (MIN_SCALE..=MAX_SCALE).contains(&c.init_scale)
            && c.growth_factor > 1.0
            && c.growth_factor.is_finite()
            && c.backoff_factor > 0.0
            && c.backoff_factor < 1.0
            && c.growth_interval >= 1;
        if valid {
            return Ok(());
        }
        Err(Error::op(
            ErrorKind::Argument,
            "GradScaler",
            format!(
                "needs a finite init_scale in [{MIN_SCALE:e}, {MAX_SCALE:e}], growth_factor > 1, \
                 0 < backoff_factor < 1 and growth_interval >= 1, got {c:?}"
            ),
        ))
    }
}

/// The largest scale: the loss is scaled in f32, which holds nothing above.
pub const MAX_SCALE: f64 = f32::MAX as f64;

/// The smallest scale (the smallest normal f32), so that unscaling never
/// divides by zero however many steps in a row are skipped.
pub const MIN_SCALE: f64 = f32::MIN_POSITIVE as f64;

/// Loss scaling for the gradients of `params`: per step, [`GradScaler::scale`]
/// the loss and backpropagate it, optionally [`GradScaler::unscale`] (before
/// clipping the gradients), then [`GradScaler::step`] and
/// [`GradScaler::update`].
pub struct GradScaler {
    config: GradScalerConfig,
    params: Vec<Parameter>,
    scale: f64,
    /// Good steps since the scale last changed.
    good_steps: usize,
    /// This step's inf check, once the gradients are unscaled.
    found_inf: Option<bool>,
    skipped: usize,
}

impl GradScaler {
    /// A scaler over `params` (usually `store.parameters()`, the optimizer's
    /// parameters). Panics on a bad configuration (see
    /// [`GradScaler::try_new`]).
    #[track_caller]
    pub fn new(params: Vec<Parameter>, config: GradScalerConfig) -> GradScaler {
        match GradScaler::try_new(params, config) {
            Ok(s) => s,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`GradScaler::new`], returning an error unless the initial scale is
    /// finite and positive, `growth_factor > 1`, `0 < backoff_factor < 1`
    /// and `growth_interval >= 1`.
    #[track_caller]
    pub fn try_new(params: Vec<Parameter>, config: GradScalerConfig) -> Result<GradScaler> {
        config.validate().map_err(|e| e.at(SourceLoc::caller()))?;
        Ok(GradScaler {
            scale: config.init_scale,
            config,
            params,
            good_steps: 0,
            found_inf: None,
            skipped: 0,
        })
    }

    /// The current scale factor.
    pub fn scale_factor(&self) -> f64 {
        self.scale
    }

    /// Steps skipped so far for non-finite gradients.
    pub fn skipped_steps(&self) -> usize {
        self.skipped
    }

    pub fn config(&self) -> &GradScalerConfig {
        &self.config
    }

    /// `loss` times the scale, to backpropagate instead of `loss`. A
    /// bf16/f16 loss is cast to f32 first (the scale does not fit in f16).
    #[track_caller]
    pub fn scale(&self, loss: &Tensor) -> Tensor {
        match self.try_scale(loss) {
            Ok(t) => t,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`GradScaler::scale`], returning the error (a non-float loss).
    #[track_caller]
    pub fn try_scale(&self, loss: &Tensor) -> Result<Tensor> {
        if !loss.dtype().is_float() {
            return Err(Error::op(
                ErrorKind::DType,
                "GradScaler::scale",
                format!("the loss must be a float tensor, got {}", loss.ty()),
            )
            .at(SourceLoc::caller()));
        }
        let loss = match loss.dtype() {
            DType::BF16 | DType::F16 => loss.try_cast(DType::F32)?,
            _ => loss.clone(),
        };
        loss.try_mul(self.scale)
    }

    /// Divides the gradients of the parameters by the scale, in place, and
    /// checks them: whether any holds an inf or a NaN. Once per step: a
    /// later call before [`GradScaler::update`] does nothing and returns
    /// the same answer ([`GradScaler::step`] calls it when you have not).
    pub fn unscale(&mut self) -> Result<bool> {
        if let Some(found) = self.found_inf {
            return Ok(found);
        }
        let inv = 1.0 / self.scale;
        let params = &self.params;
        let found = autocast::disabled(|| {
            no_grad(|| -> Result<bool> {
                // One flag per gradient (1: every element finite), their
                // minimum read once for all of them.
                let mut probe: Option<Tensor> = None;
                for p in params {
                    let leaf = p.get();
                    let Some(g) = leaf.grad() else { continue };
                    let unscaled = g.try_mul(inv)?;
                    let flag = finite_flag(&unscaled)?;
                    probe = Some(match probe {
                        Some(all) => all.try_minimum(&flag)?,
                        None => flag,
                    });
                    leaf.set_grad(Some(unscaled))?;
                }
                Ok(match probe {
                    Some(all) => all.to_vec::<f32>()?[0] < 1.0,
                    None => false,
                })
            })
        })?;
        self.found_inf = Some(found);
        Ok(found)
    }

    /// Unscales the gradients (unless [`GradScaler::unscale`] already did
    /// this step) and runs `optimizer.step()` when they are all finite;
    /// skips it otherwise. Whether the optimizer stepped.
    pub fn step<O: Optimizer + ?Sized>(&mut self, optimizer: &mut O) -> Result<bool> {
        let found = self.unscale()?;
        if found {
            self.skipped += 1;
        } else {
            optimizer.step();
        }
        Ok(!found)
    }

    /// Adapts the scale to this step's check and starts the next step:
    /// halved (by `backoff_factor`) after non-finite gradients, grown (by
    /// `growth_factor`) after `growth_interval` good steps in a row. Panics
    /// when this step has no check (see [`GradScaler::try_update`]).
    #[track_caller]
    pub fn update(&mut self) {
        if let Err(e) = self.try_update() {
            panic!("{e}");
        }
    }

    /// [`GradScaler::update`], returning an error when neither
    /// [`GradScaler::unscale`] nor [`GradScaler::step`] ran since the last
    /// update: there is nothing to adapt the scale to.
    #[track_caller]
    pub fn try_update(&mut self) -> Result<()> {
        let Some(found) = self.found_inf.take() else {
            return Err(Error::op(
                ErrorKind::Argument,
                "GradScaler::update",
                "no inf check since the last update: call unscale or step first",
            )
            .at(SourceLoc::caller()));
        };
        if found {
            self.scale = (self.scale * self.config.backoff_factor).max(MIN_SCALE);
            self.good_steps = 0;
            return Ok(());
        }
        self.good_steps += 1;
        if self.good_steps >= self.config.growth_interval {
            self.scale = (self.scale * self.config.growth_factor).min(MAX_SCALE);
            self.good_steps = 0;
        }
        Ok(())
    }
}

/// 1 (an f32 0-dim tensor) when every element of `t` is finite, else 0:
/// `min(|t| < inf)`, one reduction. (Not `sum(t·0)`, NaN exactly for a
/// non-finite element, which an unsafe-math pass may fold to 0.)
fn finite_flag(t: &Tensor) -> Result<Tensor> {
    t.try_abs()?
        .try_lt(f64::INFINITY)?
        .try_cast(DType::F32)?
        .try_min(&[], false)
}

// The scaler as tensor ops on its state held as 0-dim f64 tensors — what a
// compiled training step (`tessera::compile::train_step` with a loss
// scaler) traces, so that the scale lives on the device and no step reads
// it back. The arithmetic is [`GradScaler`]'s: `scale`, `unscale` and
// `update` above, value for value.

/// [`GradScaler::scale`] with the scale an f64 0-dim tensor: a bf16/f16
/// loss cast to f32, times the scale in the loss's dtype.
pub fn scale_loss(loss: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let loss = match loss.dtype() {
        DType::BF16 | DType::F16 => loss.try_cast(DType::F32)?,
        _ => loss.clone(),
    };
    loss.try_mul(&scale.try_cast(loss.dtype())?)
}

/// [`GradScaler::unscale`] of `grads` with the scale an f64 0-dim tensor:
/// each gradient times `1/scale` (computed in f64, then in the
/// gradient's dtype), and whether any of the unscaled gradients holds an
/// inf or a NaN, as a bool 0-dim tensor (false for no gradients).
pub fn unscale_grads(grads: &[Tensor], scale: &Tensor) -> Result<(Vec<Tensor>, Tensor)> {
    let inv = scale.try_reciprocal()?;
    let mut unscaled = Vec::with_capacity(grads.len());
    let mut probe: Option<Tensor> = None;
    for g in grads {
        let u = g.try_mul(&inv.try_cast(g.dtype())?)?;
        let flag = finite_flag(&u)?;
        probe = Some(match probe {
            Some(all) => all.try_minimum(&flag)?,
            None => flag,
        });
        unscaled.push(u);
    }
    let found = match probe {
        Some(all) => all.try_lt(1.0)?,
        None => scale.try_ne(scale)?,
    };
    Ok((unscaled, found))
}

/// [`GradScaler::update`] with the scale and the good steps in a row as
/// f64 0-dim tensors and the step's check `found_inf` a bool 0-dim
/// tensor: the next scale and count. After non-finite gradients the scale
/// is multiplied by `backoff_factor` (at least [`MIN_SCALE`]) and the count
/// restarts; otherwise the count grows by one, and reaching
/// `growth_interval` multiplies the scale by `growth_factor` (at most
/// [`MAX_SCALE`]) and restarts it.
pub fn next_scale(
    config: &GradScalerConfig,
    scale: &Tensor,
    good_steps: &Tensor,
    found_inf: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let zero = good_steps.try_mul(0.0)?;
    let counted = good_steps.try_add(1.0)?;
    let grow = counted.try_ge(config.growth_interval as f64)?;
    let grown = scale
        .try_mul(config.growth_factor)?
        .try_minimum(MAX_SCALE)?;
    let good_scale = Tensor::try_where(&grow, &grown, scale)?;
    let good_count = Tensor::try_where(&grow, &zero, &counted)?;
    let backed_off = scale
        .try_mul(config.backoff_factor)?
        .try_maximum(MIN_SCALE)?;
    Ok((
        Tensor::try_where(found_inf, &backed_off, &good_scale)?,
        Tensor::try_where(found_inf, &zero, &good_count)?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::{Sgd, SgdConfig};

    fn param(values: Vec<f32>) -> Parameter {
        let n = values.len();
        Parameter::new("p", &Tensor::from_vec(values, &[n]))
    }

    fn sgd(p: &Parameter) -> Sgd {
        Sgd::new(
            vec![p.clone()],
            SgdConfig {
                lr: 1.0,
                ..SgdConfig::default()
            },
        )
    }

    fn config(growth_interval: usize) -> GradScalerConfig {
        GradScalerConfig {
            init_scale: 8.0,
            growth_interval,
            ..GradScalerConfig::default()
        }
    }

    #[test]
    fn the_gradients_are_unscaled_before_the_step() {
        let p = param(vec![1.0, 2.0]);
        let mut opt = sgd(&p);
        let mut scaler = GradScaler::new(vec![p.clone()], config(10));
        let loss = (p.get() * 3.0).sum(&[], false);
        let scaled = scaler.scale(&loss);
        assert_eq!(scaled.item(), 9.0 * 8.0);
        scaled.backward();
        assert_eq!(p.grad().unwrap().to_vec::<f32>().unwrap(), vec![24.0, 24.0]);
        assert!(!scaler.unscale().unwrap());
        assert_eq!(p.grad().unwrap().to_vec::<f32>().unwrap(), vec![3.0, 3.0]);
        // A second unscale in the step changes nothing.
        assert!(!scaler.unscale().unwrap());
        assert_eq!(p.grad().unwrap().to_vec::<f32>().unwrap(), vec![3.0, 3.0]);
        assert!(scaler.step(&mut opt).unwrap());
        scaler.update();
        assert_eq!(p.get().to_vec::<f32>().unwrap(), vec![-2.0, -1.0]);
        assert_eq!(scaler.scale_factor(), 8.0);
    }

    #[test]
    fn a_non_finite_gradient_skips_the_step_and_halves_the_scale() {
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
            let p = param(vec![1.0, 2.0]);
            let mut opt = sgd(&p);
            let mut scaler = GradScaler::new(vec![p.clone()], config(10));
            p.get()
                .set_grad(Some(Tensor::from_vec(vec![1.0f32, bad], &[2])))
                .unwrap();
            assert!(!scaler.step(&mut opt).unwrap(), "{bad}: skipped");
            scaler.update();
            assert_eq!(p.get().to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
            assert_eq!(scaler.scale_factor(), 4.0);
            assert_eq!(scaler.skipped_steps(), 1);
        }
    }

    #[test]
    fn the_scale_grows_after_the_interval_of_good_steps() {
        let p = param(vec![1.0]);
        let mut opt = sgd(&p);
        let mut scaler = GradScaler::new(vec![p.clone()], config(3));
        let mut scales = Vec::new();
        for step in 0..7 {
            opt.zero_grad();
            let g = if step == 4 { f32::INFINITY } else { 8.0 };
            p.get()
                .set_grad(Some(Tensor::from_vec(vec![g], &[1])))
                .unwrap();
            scaler.step(&mut opt).unwrap();
            scaler.update();
            scales.push(scaler.scale_factor());
        }
        // Three good steps: ×2; the inf at step 4 halves it and restarts the
        // count, which the two good steps after it do not complete.
        assert_eq!(scales, vec![8.0, 8.0, 16.0, 16.0, 8.0, 8.0, 8.0]);
    }

    #[test]
    fn the_scale_stays_within_f32() {
        let p = param(vec![1.0]);
        let mut opt = sgd(&p);
        let top = GradScalerConfig {
            init_scale: MAX_SCALE,
            growth_interval: 1,
            ..GradScalerConfig::default()
        };
        let mut scaler = GradScaler::new(vec![p.clone()], top);
        scaler.step(&mut opt).unwrap();
        scaler.update();
        assert_eq!(scaler.scale_factor(), MAX_SCALE);
        let bottom = GradScalerConfig {
            init_scale: MIN_SCALE,
            ..GradScalerConfig::default()
        };
        let mut scaler = GradScaler::new(vec![p.clone()], bottom);
        p.get()
            .set_grad(Some(Tensor::from_vec(vec![f32::NAN], &[1])))
            .unwrap();
        scaler.step(&mut opt).unwrap();
        scaler.update();
        assert_eq!(scaler.scale_factor(), MIN_SCALE);
    }

    #[test]
    fn misuse_is_an_error() {
        let p = param(vec![1.0]);
        let mut scaler = GradScaler::new(vec![p.clone()], config(2));
        let e = scaler.try_update().unwrap_err();
        assert!(e.to_string().contains("call unscale or step first"), "{e}");
        let e = scaler
            .try_scale(&Tensor::from_vec(vec![1i64], &[1]))
            .unwrap_err();
        assert!(
            e.to_string().contains("must be a float tensor, got i64[1]"),
            "{e}"
        );
        for bad in [
            GradScalerConfig {
                init_scale: 0.0,
                ..config(2)
            },
            GradScalerConfig {
                init_scale: f64::INFINITY,
                ..config(2)
            },
            GradScalerConfig {
                growth_factor: 1.0,
                ..config(2)
            },
            GradScalerConfig {
                backoff_factor: 1.0,
                ..config(2)
            },
            config(0),
        ] {
            let e = GradScaler::try_new(vec![p.clone()], bad.clone())
                .err()
                .unwrap_or_else(|| panic!("{bad:?} accepted"));
            assert!(e.to_string().contains("GradScaler"), "{e}");
        }
    }

    #[test]
    fn a_half_loss_is_scaled_in_f32() {
        let scaler = GradScaler::new(vec![], GradScalerConfig::default());
        let loss = Tensor::scalar(2.0, DType::F16);
        let scaled = scaler.scale(&loss);
        assert_eq!(scaled.dtype(), DType::F32);
        assert_eq!(scaled.item(), 131072.0, "past f16's largest value");
    }
}
