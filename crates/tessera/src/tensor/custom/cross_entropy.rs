//! The built-in fused cross-entropy ops' implementation: the CPU kernels
//! and the backward of `tessera::cross_entropy` and
//! `tessera::cross_entropy_backward` (their signatures, and why one op, are
//! `ir::custom::cross_entropy`'s). Each row is one task: its maximum, its
//! log-sum-exp, the target's term; the backward writes the row's gradient
//! from the saved log-sum-exp, reading the logits once more. Rows compute
//! in f32 (f64 for f64 logits), whatever the logits' dtype.

use std::sync::Arc;

use half::{bf16, f16};
use rayon::prelude::*;

use super::{Attrs, BackwardCtx, CustomOp};
use crate::error::{op_err, Result};
use crate::ir::custom::cross_entropy::{ignore_index, row_dtype, BACKWARD, FORWARD};
use crate::ir::DType;
use crate::runtime::cpu::{AccFloat, Element, Float, Storage};
use crate::tensor::Tensor;

/// The built-in custom ops this module implements.
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

/// Rows per rayon task: enough work per task for wide rows and narrow.
fn rows_per_task(classes: usize) -> usize {
    (16_384 / classes.max(1)).max(1)
}

/// The targets as i64, each checked: in `0..classes` or the ignored value.
fn checked_targets(
    op: &str,
    targets: &Tensor,
    classes: usize,
    ignore: Option<i64>,
) -> Result<Vec<i64>> {
    let values: Vec<i64> = match targets.dtype() {
        DType::I32 => targets
            .to_vec::<i32>()?
            .into_iter()
            .map(i64::from)
            .collect(),
        _ => targets.to_vec::<i64>()?,
    };
    let bad = values
        .iter()
        .find(|&&t| Some(t) != ignore && (t < 0 || t as usize >= classes));
    match bad {
        Some(t) => Err(op_err!(
            Argument,
            op,
            "target {t} is out of range for {classes} classes (targets {})",
            targets.ty()
        )),
        None => Ok(values),
    }
}

/// The logits, row-major.
fn row_major(logits: &Tensor) -> Result<Tensor> {
    match logits.is_contiguous() {
        true => Ok(logits.clone()),
        false => logits.try_contiguous(),
    }
}

/// A row's log-sum-exp, in the accumulation type.
fn log_sum_exp<T: Float>(row: &[T]) -> T::Acc {
    let max = row
        .iter()
        .fold(T::Acc::NEG_INFINITY, |m, &x| m.max(x.to_acc()));
    if !(max > T::Acc::NEG_INFINITY && max < T::Acc::INFINITY) {
        // All −inf (lse −inf), or an inf or NaN in the row: the plain sum
        // says it (as log_softmax does).
        let sum = row.iter().fold(T::Acc::ZERO, |s, &x| s + x.to_acc().exp());
        return if max.is_nan() { max } else { sum.ln() };
    }
    let sum = row
        .iter()
        .fold(T::Acc::ZERO, |s, &x| s + (x.to_acc() - max).exp());
    max + sum.ln()
}

/// Storage of `dtype` holding `values` (accumulation values, f32 or f64).
fn row_storage<A: AccFloat>(dtype: DType, values: &[A]) -> Storage {
    let mut s = Storage::new(dtype, values.len());
    match dtype {
        DType::F64 => s
            .as_mut_slice::<f64>()
            .iter_mut()
            .zip(values)
            .for_each(|(o, v)| *o = v.to_f64()),
        _ => s
            .as_mut_slice::<f32>()
            .iter_mut()
            .zip(values)
            .for_each(|(o, v)| *o = v.to_f64() as f32),
    }
    s
}

fn forward_kernel(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let ignore = ignore_index(FORWARD, attrs)?;
    let (logits, targets) = (inputs[0], inputs[1]);
    let (n, classes) = (logits.shape()[0], logits.shape()[1]);
    let targets = checked_targets(FORWARD, targets, classes, ignore)?;
    with_float_type!(FORWARD, logits.dtype(), T => {
        let logits = row_major(logits)?;
        let x = logits.contiguous_slice::<T>().expect("made contiguous");
        let mut nll = vec![<T as Float>::Acc::ZERO; n];
        let mut lse = vec![<T as Float>::Acc::ZERO; n];
        let per = rows_per_task(classes);
        nll.par_chunks_mut(per)
            .zip(lse.par_chunks_mut(per))
            .enumerate()
            .for_each(|(task, (nll, lse))| {
                for (i, (nll, lse)) in nll.iter_mut().zip(lse).enumerate() {
                    let r = task * per + i;
                    let row = &x[r * classes..(r + 1) * classes];
                    *lse = log_sum_exp(row);
                    let t = targets[r];
                    *nll = match Some(t) == ignore {
                        true => <T as Float>::Acc::ZERO,
                        false => *lse - row[t as usize].to_acc(),
                    };
                }
            });
        let dtype = row_dtype(T::DTYPE);
        Ok(vec![
            Tensor::from_storage(row_storage(dtype, &nll), &[n]),
            Tensor::from_storage(row_storage(dtype, &lse), &[n]),
        ])
    })
}

fn backward_kernel(attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let ignore = ignore_index(BACKWARD, attrs)?;
    let (logits, targets, lse, d_nll) = (inputs[0], inputs[1], inputs[2], inputs[3]);
    let (n, classes) = (logits.shape()[0], logits.shape()[1]);
    let targets = checked_targets(BACKWARD, targets, classes, ignore)?;
    let lse = lse.to_f64_vec();
    let d_nll = d_nll.to_f64_vec();
    with_float_type!(BACKWARD, logits.dtype(), T => {
        let logits = row_major(logits)?;
        let x = logits.contiguous_slice::<T>().expect("made contiguous");
        let mut out = Storage::new(T::DTYPE, n * classes);
        let per = rows_per_task(classes) * classes;
        out.as_mut_slice::<T>()
            .par_chunks_mut(per.max(1))
            .enumerate()
            .for_each(|(task, chunk)| {
                for (i, d_row) in chunk.chunks_mut(classes).enumerate() {
                    let r = task * (per / classes) + i;
                    let t = targets[r];
                    let row = &x[r * classes..(r + 1) * classes];
                    let g = match Some(t) == ignore {
                        true => <T as Float>::Acc::ZERO,
                        false => <<T as Float>::Acc as AccFloat>::from_f64(d_nll[r]),
                    };
                    let m = <<T as Float>::Acc as AccFloat>::from_f64(lse[r]);
                    for (c, (d, &v)) in d_row.iter_mut().zip(row).enumerate() {
                        let p = (v.to_acc() - m).exp();
                        let hot = match c as i64 == t {
                            true => <T as Float>::Acc::ONE,
                            false => <T as Float>::Acc::ZERO,
                        };
                        *d = T::from_acc((p - hot) * g);
                    }
                }
            });
        Ok(vec![Tensor::from_storage(out, &[n, classes])])
    })
}

/// The forward's backward: the backward op on the logits, the targets, the
/// saved log-sum-exp and the gradient of the per-row losses (the lse
/// output has no gradient of its own; the targets none at all).
fn forward_backward(ctx: &BackwardCtx<'_>) -> Result<Vec<Option<Tensor>>> {
    let i = ctx.inputs;
    let args: Vec<&Tensor> = vec![&i[0], &i[1], &ctx.outputs[1], &ctx.grads[0]];
    let mut grads = super::lookup(BACKWARD)?.call((*ctx.attrs).clone(), &args)?;
    Ok(vec![Some(grads.remove(0)), None])
}
