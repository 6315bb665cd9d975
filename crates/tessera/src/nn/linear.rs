//! `Linear`: `y = x @ W + b`.

use super::{input_error, join_name, within, ParamStore, Parameter};
use crate::error::{Result, SourceLoc};
use crate::tensor::{autocast, unwrap_or_panic, Generator, Tensor};

/// An affine map over the last dim.
///
/// The weight is stored `[in_features, out_features]` (as JAX/flax `Dense`),
/// so the forward is `x @ W` with no transpose; this is the transpose of
/// PyTorch's `[out, in]`: transpose when exchanging weights with torch.
pub struct Linear {
    name: String,
    pub weight: Parameter,
    pub bias: Option<Parameter>,
    in_features: usize,
    out_features: usize,
}

impl Linear {
    /// Registers `name.weight` and, with `bias`, `name.bias`, both drawn
    /// uniformly from `[-1/√in, 1/√in)` as PyTorch does.
    #[track_caller]
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        generator: &mut Generator,
    ) -> Linear {
        let bound = 1.0 / (in_features.max(1) as f64).sqrt();
        let shape = [in_features, out_features];
        let weight = store.uniform(&join_name(name, "weight"), &shape, bound, generator);
        let bias = bias
            .then(|| store.uniform(&join_name(name, "bias"), &[out_features], bound, generator));
        Linear {
            name: name.to_string(),
            weight,
            bias,
            in_features,
            out_features,
        }
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// `x [..., in]` → `[..., out]`.
    #[track_caller]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        unwrap_or_panic(self.try_forward(x))
    }

    /// [`Linear::forward`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() == 0 || x.shape()[x.rank() - 1] != self.in_features {
            return Err(input_error(
                "Linear",
                &self.name,
                format!(
                    "input {} must end in {} features (weight {})",
                    x.ty(),
                    self.in_features,
                    self.weight.ty()
                ),
            )
            .at(SourceLoc::caller()));
        }
        self.apply(x).map_err(|e| within(e, "Linear", &self.name))
    }

    /// Flattens the leading dims so the product (and its weight gradient)
    /// is one tall 2-D matmul rather than a batch of small ones. Inside
    /// autocast the whole layer runs in its dtype, bias included (PyTorch's
    /// `linear`): the output is bf16/f16.
    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let mut out_shape: Vec<isize> = x.shape().iter().map(|&d| d as isize).collect();
        *out_shape.last_mut().expect("rank checked") = self.out_features as isize;
        let rows = x.try_reshape(&[-1, self.in_features as isize])?;
        // The bias is cast before the product is taken, so that the add's
        // newest producer is the matmul: fusion makes the add its epilogue
        // (on CUDA one cuBLASLt call with the bias, see
        // `Backend::matmul_bias`) instead of a kernel of its own.
        let bias = self
            .bias
            .as_ref()
            .map(|b| autocast::cast_low(&b.get()))
            .transpose()?;
        let y = rows.try_matmul(&self.weight.get())?;
        let y = match bias {
            Some(b) => y.try_add(&b)?,
            None => y,
        };
        y.try_reshape(&out_shape)
    }
}
