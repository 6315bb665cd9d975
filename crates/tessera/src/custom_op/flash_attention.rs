//! Flash attention as a built-in custom op.
//!
//! `tessera::flash_attention` (q, k, v[, mask]) {causal, scale} → (out, lse)
//! runs the tiled kernel of `runtime::cpu::flash` (online softmax, no
//! N×N matrix) and returns the log-sum-exp of each query row as the residual
//! its backward needs; `tessera::flash_attention_backward` (q, k, v, out,
//! lse, d_out[, mask]) → (dq, dk, dv) recomputes the probabilities block by
//! block from it. [`scaled_dot_product_attention`] is the user-facing call
//! with PyTorch's semantics; the attention-recognition pass rewrites
//! matched attention in captured graphs into the same op. The ops'
//! signatures (names, attributes, type rules) are the IR's
//! (`ir::custom::flash_attention`); their kernels and backward are here.

use std::panic::Location;
use std::sync::Arc;

use half::{bf16, f16};

use super::{Attrs, BackwardCtx, CustomCall, CustomOp};
use crate::error::{op_err, Error, Result, SourceLoc};
use crate::ir::custom::flash_attention::causal_and_scale;
use crate::ir::DType;
use crate::runtime::cpu::flash::{
    flash_backward, flash_forward, AdditiveMask, AttentionParams, AttentionShape,
};
use crate::runtime::cpu::{Element, Storage};
use crate::tensor::Tensor;

pub use crate::ir::custom::flash_attention::{attrs, BACKWARD, FORWARD, MAX_HEAD_DIM};

const USER_NAME: &str = "scaled_dot_product_attention";

/// The built-in custom ops this module implements: the kernels and the
/// backward of the signatures `ir::custom::flash_attention` registers.
pub(super) fn builtins() -> Vec<Arc<CustomOp>> {
    let forward = CustomOp::builder(FORWARD)
        .cpu(forward_kernel)
        .backward(forward_backward)
        .implement_builtin()
        .expect("a built-in signature");
    let backward = CustomOp::builder(BACKWARD)
        .cpu(backward_kernel)
        .implement_builtin()
        .expect("a built-in signature");
    vec![forward, backward]
}

/// The `causal` and `scale` attributes of a call (every backend reads
/// them through here).
pub fn params(attrs: &Attrs) -> Result<AttentionParams> {
    let (causal, scale) = causal_and_scale(attrs)?;
    Ok(AttentionParams {
        causal,
        scale: scale as f32,
    })
}

/// The kernel's view of concrete operands.
fn attention_shape(q: &Tensor, k: &Tensor, v: &Tensor) -> AttentionShape {
    let r = q.rank();
    AttentionShape {
        bh: q.shape()[..r - 2].iter().product(),
        q_len: q.shape()[r - 2],
        kv_len: k.shape()[r - 2],
        head_dim: q.shape()[r - 1],
        v_dim: v.shape()[r - 1],
    }
}

/// A new contiguous tensor of `dtype` and `shape`, filled by `fill`.
fn output<T: Element>(dtype: DType, shape: &[usize], fill: impl FnOnce(&mut [T])) -> Tensor {
    let mut storage = Storage::new(dtype, shape.iter().product());
    fill(storage.as_mut_slice::<T>());
    Tensor::from_storage(storage, shape)
}

/// `t` when its elements are row-major (a view at an offset included:
/// the per-slice operands of the seed's sliced code), else a row-major
/// copy. `try_contiguous` would copy every view that does not start its
/// storage, and in a compiled run such a copy takes the planned place of
/// an output of its size (`cpu::arena`).
fn row_major(t: &Tensor) -> Result<Tensor> {
    match t.is_contiguous() {
        true => Ok(t.clone()),
        false => t.try_contiguous(),
    }
}

/// The values of a tensor made row-major by [`row_major`].
fn slice_of<T: Element>(t: &Tensor) -> &[T] {
    t.contiguous_slice::<T>().expect("made contiguous")
}

/// Runs `$body` with `$T` bound to the element type of `$dtype`.
macro_rules! with_float_type {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            other => Err(op_err!(DType, FORWARD, "has no kernel for {other}")),
        }
    };
}

fn forward_kernel(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let p = params(attrs)?;
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    let shape = attention_shape(q, k, v);
    let mask = inputs.get(3).copied().map(row_major).transpose()?;
    let mask_arg = mask.as_ref().map(|m| AdditiveMask {
        values: m.contiguous_slice::<f32>().expect("contiguous"),
        shared: m.rank() == 2,
    });
    let r = q.rank();
    let out_shape = [&q.shape()[..r - 1], &[shape.v_dim][..]].concat();
    let lse_shape = &q.shape()[..r - 1];
    with_float_type!(q.dtype(), T => {
        let (q, k, v) = (row_major(q)?, row_major(k)?, row_major(v)?);
        let (qs, ks, vs) = (slice_of::<T>(&q), slice_of::<T>(&k), slice_of::<T>(&v));
        let mut lse = Storage::new(DType::F32, shape.bh * shape.q_len);
        let out = output::<T>(q.dtype(), &out_shape, |out| {
            flash_forward(&shape, &p, qs, ks, vs, mask_arg, out, lse.as_mut_slice::<f32>())
        });
        Ok(vec![out, Tensor::from_storage(lse, lse_shape)])
    })
}

fn backward_kernel(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let p = params(attrs)?;
    let (q, k, v, out, lse, d_out) = (
        inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], inputs[5],
    );
    let shape = attention_shape(q, k, v);
    let mask = inputs.get(6).copied().map(row_major).transpose()?;
    let mask_arg = mask.as_ref().map(|m| AdditiveMask {
        values: m.contiguous_slice::<f32>().expect("contiguous"),
        shared: m.rank() == 2,
    });
    let lse = row_major(lse)?;
    with_float_type!(q.dtype(), T => {
        let c = row_major;
        let (q, k, v, out, d_out) = (c(q)?, c(k)?, c(v)?, c(out)?, c(d_out)?);
        let s = slice_of::<T>;
        // Allocated in output order (dq, dk, dv), so that a compiled run
        // finds each where its memory plan put it (`cpu::arena`).
        let mut dq = Storage::new(q.dtype(), q.numel());
        let mut dk = Storage::new(q.dtype(), k.numel());
        let mut dv = Storage::new(q.dtype(), v.numel());
        flash_backward(
            &shape,
            &p,
            s(&q),
            s(&k),
            s(&v),
            mask_arg,
            s(&out),
            lse.contiguous_slice::<f32>().expect("contiguous"),
            s(&d_out),
            dq.as_mut_slice::<T>(),
            dk.as_mut_slice::<T>(),
            dv.as_mut_slice::<T>(),
        );
        Ok(vec![
            Tensor::from_storage(dq, q.shape()),
            Tensor::from_storage(dk, k.shape()),
            Tensor::from_storage(dv, v.shape()),
        ])
    })
}

/// The forward's backward: the backward op on the saved inputs, outputs
/// and the output gradient (the lse output has no gradient of its own).
fn forward_backward(ctx: &BackwardCtx<'_>) -> Result<Vec<Option<Tensor>>> {
    let i = ctx.inputs;
    let mut args: Vec<&Tensor> = vec![
        &i[0],
        &i[1],
        &i[2],
        &ctx.outputs[0],
        &ctx.outputs[1],
        &ctx.grads[0],
    ];
    args.extend(i.get(3));
    let grads = super::lookup(BACKWARD)?.call((*ctx.attrs).clone(), &args)?;
    let mut out: Vec<Option<Tensor>> = grads.into_iter().map(Some).collect();
    if i.len() == 4 {
        out.push(None);
    }
    Ok(out)
}

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
/// run the plain composite (the kernels accumulate in f32). In f32/f16/bf16,
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
    let mut outs = super::apply(&call, &inputs, caller)?;
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
