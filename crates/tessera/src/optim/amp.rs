//! [`MixedPrecision`]: a training loop's precision in one value — f32,
//! bf16 autocast, or f16 autocast with dynamic loss scaling — for code
//! that takes the precision as a setting (`tessera train --dtype`).

use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::DType;
use crate::nn::Parameter;
use crate::tensor::{autocast, Tensor};

use super::{GradScaler, GradScalerConfig, Optimizer};

/// The precision of a training step. The parameters (and the optimizer's
/// state) stay in their own dtype, f32 for a default store: the master
/// weights; only the forward runs in bf16/f16.
///
/// ```
/// use tessera::nn::{mse, Linear, ParamStore};
/// use tessera::optim::{clip_grad_norm, AdamW, AdamWConfig, MixedPrecision, Optimizer};
/// use tessera::tensor::Generator;
/// use tessera::{DType, Tensor};
///
/// let mut store = ParamStore::new();
/// let layer = Linear::new(&mut store, "fc", 4, 2, true, &mut Generator::new(0));
/// let mut opt = AdamW::new(store.parameters(), AdamWConfig::default());
/// let dtype: DType = "f16".parse().unwrap(); // as `--dtype f16`
/// let mut amp = MixedPrecision::new(dtype, store.parameters()).unwrap();
/// let (x, y) = (Tensor::ones(&[3, 4], DType::F32), Tensor::zeros(&[3, 2], DType::F32));
///
/// opt.zero_grad();
/// let loss = amp.forward(|| mse(&layer.forward(&x), &y)); // autocast: f16 matmuls, f32 loss
/// amp.backward(&loss).unwrap(); // the loss scaled for f16
/// amp.unscale().unwrap(); // true gradients from here on
/// clip_grad_norm(&store, 1.0);
/// let stepped = amp.step(&mut opt).unwrap(); // skipped on inf/NaN gradients
/// assert!(stepped);
/// ```
pub struct MixedPrecision {
    dtype: DType,
    scaler: Option<GradScaler>,
}

impl MixedPrecision {
    /// f32: plain training; bf16: the forward under bf16 autocast (bf16 has
    /// f32's range: no loss scaling); f16: f16 autocast and a
    /// [`GradScaler`] with PyTorch's defaults over `params`. Other dtypes
    /// are an error.
    #[track_caller]
    pub fn new(dtype: DType, params: Vec<Parameter>) -> Result<MixedPrecision> {
        MixedPrecision::with_scaler(dtype, params, GradScalerConfig::default())
    }

    /// [`MixedPrecision::new`] with the f16 scaler's settings.
    #[track_caller]
    pub fn with_scaler(
        dtype: DType,
        params: Vec<Parameter>,
        config: GradScalerConfig,
    ) -> Result<MixedPrecision> {
        let scaler = match dtype {
            DType::F32 | DType::BF16 => None,
            DType::F16 => Some(GradScaler::try_new(params, config)?),
            other => {
                return Err(Error::op(
                    ErrorKind::DType,
                    "MixedPrecision",
                    format!("trains in f32, bf16 or f16, got {other}"),
                )
                .at(SourceLoc::caller()))
            }
        };
        Ok(MixedPrecision { dtype, scaler })
    }

    /// The dtype the forward's matmuls run in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The loss scaler (f16 only).
    pub fn scaler(&self) -> Option<&GradScaler> {
        self.scaler.as_ref()
    }

    /// Runs the forward (and loss) `f` in this precision: under autocast
    /// for bf16/f16, as is for f32.
    pub fn forward<R>(&self, f: impl FnOnce() -> R) -> R {
        match self.dtype {
            DType::BF16 | DType::F16 => autocast::autocast(self.dtype, f),
            _ => f(),
        }
    }

    /// Backpropagates `loss` (scaled first under f16).
    #[track_caller]
    pub fn backward(&self, loss: &Tensor) -> Result<()> {
        match &self.scaler {
            Some(s) => s.try_scale(loss)?.try_backward(None),
            None => loss.try_backward(None),
        }
    }

    /// Brings the gradients back to their true values (f16: divided by the
    /// scale), e.g. before clipping them. Nothing for f32/bf16. Once per
    /// step; [`MixedPrecision::step`] does it when you have not.
    pub fn unscale(&mut self) -> Result<()> {
        if let Some(s) = &mut self.scaler {
            s.unscale()?;
        }
        Ok(())
    }

    /// Runs `optimizer.step()` — under f16 unless a gradient is inf or NaN,
    /// and then adapts the scale. Whether the optimizer stepped.
    pub fn step<O: Optimizer + ?Sized>(&mut self, optimizer: &mut O) -> Result<bool> {
        let Some(s) = &mut self.scaler else {
            optimizer.step();
            return Ok(true);
        };
        let stepped = s.step(optimizer)?;
        s.try_update()?;
        Ok(stepped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_precision_has_its_parts() {
        let f32s = MixedPrecision::new(DType::F32, vec![]).unwrap();
        assert!(f32s.scaler().is_none());
        assert_eq!(f32s.forward(autocast::current), None);
        let bf16 = MixedPrecision::new(DType::BF16, vec![]).unwrap();
        assert!(bf16.scaler().is_none());
        assert_eq!(bf16.forward(autocast::current), Some(DType::BF16));
        let f16 = MixedPrecision::new(DType::F16, vec![]).unwrap();
        assert_eq!(f16.scaler().unwrap().scale_factor(), 65536.0);
        assert_eq!(f16.forward(autocast::current), Some(DType::F16));
        let e = MixedPrecision::new(DType::I64, vec![]).err().unwrap();
        assert!(e.to_string().contains("f32, bf16 or f16, got i64"), "{e}");
    }
}
