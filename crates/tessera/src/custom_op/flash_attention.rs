//! Flash attention, the built-in custom op, as users call it.
//!
//! [`scaled_dot_product_attention`] has PyTorch's semantics and runs
//! through `tessera::flash_attention` (q, k, v[, mask]) {causal, scale} →
//! (out, lse), whose backward is `tessera::flash_attention_backward`; the
//! attention-recognition pass rewrites matched attention in captured graphs
//! into the same op. The ops' signatures (names, attributes, type rules)
//! are the IR's (`ir::custom::flash_attention`); their kernels and backward
//! are in the custom-op registry from the start (`tensor::custom`).

use std::panic::Location;

use super::CustomCall;
use crate::error::{op_err, Error, Result, SourceLoc};
use crate::ir::DType;
use crate::tensor::{autocast, custom, Tensor};

pub use crate::ir::custom::flash_attention::{attrs, BACKWARD, FORWARD, MAX_HEAD_DIM};
pub use crate::tensor::custom::flash_attention::params;

const USER_NAME: &str = "scaled_dot_product_attention";

/// Options of [`scaled_dot_product_attention`] (PyTorch's arguments).
#[derive(Clone, Copy, Debug, Default)]
pub struct SdpaOptions<'a> {
    /// Added to the scaled scores (float, broadcastable to `[..., Lq, Lk]`),
    /// or where `false` hides a key (bool).
    pub mask: Option<&'a Tensor>,
    /// Query `i` sees keys `j <= i` (top-left aligned, as PyTorch).
    pub causal: bool,
    /// Multiplies `q·k`; `1/sqrt(E)` when `None`.
    pub scale: Option<f64>,
}

/// `softmax(q·kᵀ·scale + mask) · v` over `[..., L, E]` operands, as
/// `torch.nn.functional.scaled_dot_product_attention`, through the flash
/// attention op: O(L) memory, recomputation in the backward. f64 operands
/// run the plain composite (the kernels accumulate in f32). Inside
/// [`crate::tensor::autocast`], f32 operands are cast to its dtype first
/// (the result is bf16/f16). In f32/f16/bf16,
/// a row that sees no key (a mask of `-inf` only) gives zeros. The mask gets no gradient:
/// passing one that requires grad is an error.
#[track_caller]
pub fn scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: SdpaOptions<'_>,
) -> Tensor {
    match try_scaled_dot_product_attention(q, k, v, options) {
        Ok(t) => t,
        Err(e) => panic!("{e}"),
    }
}

/// [`scaled_dot_product_attention`], returning the error.
#[track_caller]
pub fn try_scaled_dot_product_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    options: SdpaOptions<'_>,
) -> Result<Tensor> {
    let caller = Location::caller();
    let at = |e: Error| e.at(SourceLoc::from_location(caller));
    if q.rank() < 2 {
        return Err(at(op_err!(
            Shape,
            USER_NAME,
            "q must be [..., L, E], got {}",
            q.ty()
        )));
    }
    // Autocast runs attention in its low precision (f32 accumulation in
    // the kernels), as PyTorch's autocast does.
    let (q, k, v) = (
        autocast::cast_low(q).map_err(at)?,
        autocast::cast_low(k).map_err(at)?,
        autocast::cast_low(v).map_err(at)?,
    );
    let (q, k, v) = (&q, &k, &v);
    let scale = options
        .scale
        .unwrap_or(1.0 / (q.shape()[q.rank() - 1] as f64).sqrt());
    let mask = options
        .mask
        .map(|m| kernel_mask(m, q, k))
        .transpose()
        .map_err(at)?;
    if q.dtype() == DType::F64 {
        return composite(q, k, v, mask.as_ref(), options.causal, scale).map_err(at);
    }
    let mut inputs = vec![q, k, v];
    inputs.extend(mask.as_ref());
    let call = CustomCall::new(FORWARD, attrs(options.causal, scale)).map_err(at)?;
    let mut outs = custom::apply(&call, &inputs, caller)?;
    Ok(outs.swap_remove(0))
}

/// The mask as the kernel takes it: f32, `[Lq, Lk]` when shared by every
/// batch and head, else `[..., Lq, Lk]` like the scores.
fn kernel_mask(mask: &Tensor, q: &Tensor, k: &Tensor) -> Result<Tensor> {
    if mask.requires_grad() {
        return Err(op_err!(
            Unsupported,
            USER_NAME,
            "the attention mask gets no gradient; detach it ({})",
            mask.ty()
        ));
    }
    let (r, rk) = (q.rank(), k.rank());
    if r < 2 || rk < 2 {
        return Err(op_err!(
            Shape,
            USER_NAME,
            "q and k need at least 2 dims (…, L, E), got q {} and k {}",
            q.ty(),
            k.ty()
        ));
    }
    let (lq, lk) = (q.shape()[r - 2], k.shape()[rk - 2]);
    let neg_inf = Tensor::scalar(f64::NEG_INFINITY, DType::F32);
    let additive = match mask.dtype() {
        DType::Bool => Tensor::try_where(mask, &Tensor::scalar(0.0, DType::F32), &neg_inf)?,
        d if d == q.dtype() || d == DType::F32 => mask.try_cast(DType::F32)?,
        d => {
            return Err(op_err!(
                DType,
                USER_NAME,
                "the mask must be bool, {} or f32, got {d}",
                q.dtype()
            ))
        }
    };
    let m = mask.rank();
    let shared = m <= 2 || mask.shape()[..m - 2].iter().all(|&d| d == 1);
    let target: Vec<usize> = match shared {
        true => vec![lq, lk],
        false => [&q.shape()[..r - 2], &[lq, lk][..]].concat(),
    };
    let trimmed = match (shared, m > 2) {
        (true, true) => {
            additive.try_reshape(&[mask.shape()[m - 2] as isize, mask.shape()[m - 1] as isize])?
        }
        _ => additive,
    };
    let signed: Vec<isize> = target.iter().map(|&d| d as isize).collect();
    let expanded = trimmed.try_expand(&signed).map_err(|_| {
        op_err!(
            Shape,
            USER_NAME,
            "the mask {} does not broadcast to the scores [..., {lq}, {lk}] of q {} and k {}",
            mask.ty(),
            q.ty(),
            k.ty()
        )
    })?;
    expanded.try_contiguous()
}

/// The plain composite, for f64 (and the reference of the tests).
pub fn composite(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: bool,
    scale: f64,
) -> Result<Tensor> {
    let mut scores = q.try_matmul(&k.try_transpose(-2, -1)?)? * scale;
    if let Some(m) = mask {
        scores = scores.try_add(&m.try_cast(scores.dtype())?)?;
    }
    if causal {
        let r = q.rank();
        let (lq, lk) = (q.shape()[r - 2], k.shape()[r - 2]);
        let keep = Tensor::ones(&[lq, lk], DType::F32)
            .try_tril(0)?
            .try_cast(DType::Bool)?;
        let hidden = Tensor::scalar(f64::NEG_INFINITY, scores.dtype());
        scores = Tensor::try_where(&keep, &scores, &hidden)?;
    }
    scores.try_softmax(-1)?.try_matmul(v)
}
