//! The built-in flash attention ops' implementation: the kernels and the
//! backward of `tessera::flash_attention` (q, k, v[, mask]) {causal, scale}
//! → (out, lse) and `tessera::flash_attention_backward` (q, k, v, out, lse,
//! d_out[, mask]) → (dq, dk, dv).
//!
//! The forward runs the tiled kernel of `runtime::cpu::flash` (online
//! softmax, no N×N matrix) and returns the log-sum-exp of each query row as
//! the residual its backward needs; the backward op recomputes the
//! probabilities block by block from it. The ops' signatures (names,
//! attributes, type rules) are the IR's (`ir::custom::flash_attention`);
//! the user-facing call (`scaled_dot_product_attention`, with PyTorch's
//! semantics) is `custom_op::flash_attention`'s. They are in the registry
//! from the start, so a graph naming them runs before anything else is
//! registered.

use std::sync::Arc;

use half::{bf16, f16};

use super::{Attrs, BackwardCtx, CustomOp};
use crate::error::{op_err, Result};
use crate::ir::custom::flash_attention::{causal_and_scale, BACKWARD, FORWARD};
use crate::ir::DType;
use crate::runtime::cpu::flash::{
    flash_backward, flash_forward, AdditiveMask, AttentionParams, AttentionShape,
};
use crate::runtime::cpu::{Element, Storage};
use crate::tensor::Tensor;

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
