//! Normalisation over the last dim: `LayerNorm` and `RMSNorm`.

use super::{input_error, join_name, within, ParamStore, Parameter};
use crate::error::{Result, SourceLoc};
use crate::tensor::{autocast, unwrap_or_panic, Tensor};

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last dim, with the
/// biased variance (as PyTorch). `affine: false` drops weight and bias.
/// Inside autocast a bf16/f16 input is normalised in f32 (the output is f32).
pub struct LayerNorm {
    name: String,
    dim: usize,
    eps: f64,
    /// `(weight, bias)`, ones and zeros at creation.
    pub affine: Option<(Parameter, Parameter)>,
}

impl LayerNorm {
    /// Registers `name.weight` and `name.bias` when `affine`.
    #[track_caller]
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        dim: usize,
        eps: f64,
        affine: bool,
    ) -> LayerNorm {
        let affine = affine.then(|| {
            (
                store.constant(&join_name(name, "weight"), &[dim], 1.0),
                store.constant(&join_name(name, "bias"), &[dim], 0.0),
            )
        });
        LayerNorm {
            name: name.to_string(),
            dim,
            eps,
            affine,
        }
    }

    /// `x [..., dim]` → the same shape.
    #[track_caller]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        unwrap_or_panic(self.try_forward(x))
    }

    /// [`LayerNorm::forward`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        check_last_dim("LayerNorm", &self.name, x, self.dim)?;
        self.apply(x)
            .map_err(|e| within(e, "LayerNorm", &self.name))
    }

    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        // Autocast normalises in f32 (the result is f32).
        let x = &autocast::cast_f32(x)?;
        let centred = x.try_sub(&x.try_mean(&[-1], true)?)?;
        let var = centred.try_mul(&centred)?.try_mean(&[-1], true)?;
        let y = centred.try_mul(&var.try_add(self.eps)?.try_rsqrt()?)?;
        match &self.affine {
            Some((w, b)) => y.try_mul(w.get())?.try_add(b.get()),
            None => Ok(y),
        }
    }
}

/// `x / sqrt(mean(x²) + eps) * weight` over the last dim (no centring, no
/// bias), as `torch.nn.RMSNorm`. Inside autocast a bf16/f16 input is
/// normalised in f32 (the output is f32).
pub struct RMSNorm {
    name: String,
    dim: usize,
    eps: f64,
    /// Ones at creation.
    pub weight: Parameter,
}

impl RMSNorm {
    /// Registers `name.weight`.
    #[track_caller]
    pub fn new(store: &mut ParamStore, name: &str, dim: usize, eps: f64) -> RMSNorm {
        RMSNorm {
            name: name.to_string(),
            dim,
            eps,
            weight: store.constant(&join_name(name, "weight"), &[dim], 1.0),
        }
    }

    /// `x [..., dim]` → the same shape.
    #[track_caller]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        unwrap_or_panic(self.try_forward(x))
    }

    /// [`RMSNorm::forward`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        check_last_dim("RMSNorm", &self.name, x, self.dim)?;
        self.apply(x).map_err(|e| within(e, "RMSNorm", &self.name))
    }

    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let x = &autocast::cast_f32(x)?;
        let mean_square = x.try_mul(x)?.try_mean(&[-1], true)?;
        let y = x.try_mul(&mean_square.try_add(self.eps)?.try_rsqrt()?)?;
        y.try_mul(self.weight.get())
    }
}

#[track_caller]
fn check_last_dim(kind: &str, name: &str, x: &Tensor, dim: usize) -> Result<()> {
    if x.dtype().is_float() && x.shape().last() == Some(&dim) {
        return Ok(());
    }
    Err(input_error(
        kind,
        name,
        format!(
            "input {} must be a float tensor ending in {dim} features",
            x.ty()
        ),
    )
    .at(SourceLoc::caller()))
}
