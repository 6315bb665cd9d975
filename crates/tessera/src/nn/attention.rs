//! Multi-head scaled dot-product attention: projections from plain ops, the
//! attention through the flash attention op in half precision, from plain
//! ops in f32.

use super::{input_error, join_name, within, Linear, ParamStore};
use crate::custom_op::flash_attention::{try_scaled_dot_product_attention, SdpaOptions};
use crate::error::{Result, SourceLoc};
use crate::ir::DType;
use crate::tensor::{unwrap_or_panic, Generator, Tensor};

/// Self-attention over `x [B, T, d_model]`: projections `q`, `k`, `v`, `o`
/// (each a biased [`Linear`]), `n_heads` heads of `d_model / n_heads`,
/// scores scaled by `1/√d_head`, and with `causal` a mask so position `t`
/// attends to positions `<= t` only.
pub struct MultiHeadAttention {
    name: String,
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    d_model: usize,
    n_heads: usize,
    causal: bool,
}

impl MultiHeadAttention {
    /// Registers `name.{q,k,v,o}.{weight,bias}`. Panics unless `n_heads`
    /// divides `d_model`.
    #[track_caller]
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        d_model: usize,
        n_heads: usize,
        causal: bool,
        generator: &mut Generator,
    ) -> MultiHeadAttention {
        assert!(
            n_heads > 0 && d_model.is_multiple_of(n_heads),
            "MultiHeadAttention `{name}`: d_model {d_model} is not divisible by n_heads {n_heads}"
        );
        let mut proj = |p: &str| {
            Linear::new(
                store,
                &join_name(name, p),
                d_model,
                d_model,
                true,
                generator,
            )
        };
        MultiHeadAttention {
            name: name.to_string(),
            q: proj("q"),
            k: proj("k"),
            v: proj("v"),
            o: proj("o"),
            d_model,
            n_heads,
            causal,
        }
    }

    pub fn n_heads(&self) -> usize {
        self.n_heads
    }

    pub fn is_causal(&self) -> bool {
        self.causal
    }

    /// `x [B, T, d_model]` → `[B, T, d_model]`.
    #[track_caller]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        unwrap_or_panic(self.try_forward(x))
    }

    /// [`MultiHeadAttention::forward`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.rank() != 3 || x.shape()[2] != self.d_model {
            return Err(input_error(
                "MultiHeadAttention",
                &self.name,
                format!("input {} must be [batch, seq, {}]", x.ty(), self.d_model),
            )
            .at(SourceLoc::caller()));
        }
        self.attend(x)
            .map_err(|e| within(e, "MultiHeadAttention", &self.name))
    }

    fn attend(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t) = (x.shape()[0] as isize, x.shape()[1] as isize);
        let q = self.split_heads(&self.q.try_forward(x)?)?;
        let k = self.split_heads(&self.k.try_forward(x)?)?;
        let v = self.split_heads(&self.v.try_forward(x)?)?;
        let heads = match q.dtype() {
            DType::BF16 | DType::F16 => self.flash(&q, &k, &v)?,
            _ => self.plain(&q, &k, &v)?,
        };
        let merged =
            heads
                .try_permute(&[0, 2, 1, 3])?
                .try_reshape(&[b, t, self.d_model as isize])?;
        self.o.try_forward(&merged)
    }

    /// Attention in half precision (autocast): the flash attention op, as
    /// PyTorch's module calls `scaled_dot_product_attention`: no [T, T]
    /// scores in memory and a registered backward that recomputes them, so
    /// a step whose backward is traced with it (`compile::train_step`)
    /// runs the tiled tensor-core kernels both ways (GPT-2 small's bf16
    /// step on an H200: 92 → 51 ms).
    fn flash(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let d_head = self.d_model / self.n_heads;
        try_scaled_dot_product_attention(
            q,
            k,
            v,
            SdpaOptions {
                mask: None,
                causal: self.causal,
                scale: Some(1.0 / (d_head as f64).sqrt()),
            },
        )
    }

    /// Attention in f32 (and f64) from plain ops: the op's f32 kernels are
    /// slower than the plain products here (GPT-2 small's f32 step on an
    /// H200: 196 ms plain, 238 ms through the op), and the compiler's
    /// attention pass still rewrites the pattern into the op where its
    /// backward is derived ahead of time.
    fn plain(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let d_head = self.d_model / self.n_heads;
        // Scaling q rather than the scores touches T·d_head values per head
        // instead of T·T.
        let q = q.try_mul(1.0 / (d_head as f64).sqrt())?;
        let mut scores = q.try_matmul(&k.try_transpose(-2, -1)?)?;
        if self.causal {
            scores = causal_mask(&scores)?;
        }
        scores.try_softmax(-1)?.try_matmul(v)
    }

    /// `[B, T, d_model]` → `[B, n_heads, T, d_head]` (a view).
    fn split_heads(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t) = (x.shape()[0] as isize, x.shape()[1] as isize);
        let d_head = (self.d_model / self.n_heads) as isize;
        x.try_reshape(&[b, t, self.n_heads as isize, d_head])?
            .try_permute(&[0, 2, 1, 3])
    }
}

/// `scores [.., T, T]` with every entry above the diagonal (a query looking
/// at a later key) set to -inf, so softmax gives it weight 0.
/// The mask is made on the scores' device, whatever the current one.
fn causal_mask(scores: &Tensor) -> Result<Tensor> {
    let t = scores.shape()[scores.rank() - 1];
    let (allowed, blocked) = crate::runtime::device::with_device(scores.device(), || {
        let allowed = Tensor::ones(&[t, t], DType::Bool).try_tril(0)?;
        Ok::<_, crate::error::Error>((
            allowed,
            Tensor::try_full(&[], f64::NEG_INFINITY, scores.dtype())?,
        ))
    })?;
    Tensor::try_where(&allowed, scores, &blocked)
}
