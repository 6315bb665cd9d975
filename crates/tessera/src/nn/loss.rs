//! Losses: mean cross-entropy over class logits, mean squared error.

use crate::error::{Error, ErrorKind, Result, SourceLoc};
use crate::ir::custom::cross_entropy as cross_entropy_op;
use crate::tensor::{autocast, custom, unwrap_or_panic, Tensor};

/// Mean cross-entropy of `logits [N, C]` (float) against class ids
/// `targets [N]` (i64/i32), as `torch.nn.functional.cross_entropy`: rows
/// whose target equals `ignore_index` count neither in the sum nor in the
/// mean. For `[B, T, C]` logits pass `logits.reshape(&[-1, C])` and
/// `targets.reshape(&[-1])`.
///
/// One fused op per row (`tessera::cross_entropy`): the log-probabilities
/// are never materialised. Inside autocast the loss of bf16/f16 logits is
/// f32, computed in f32 from the logits as they are.
///
/// When every row is ignored the loss is 0 (with zero gradients), not
/// PyTorch's NaN: a batch of pure padding then leaves a training run intact.
/// A target outside `0..C` (other than `ignore_index`) is an error.
#[track_caller]
pub fn cross_entropy(logits: &Tensor, targets: &Tensor, ignore_index: Option<i64>) -> Tensor {
    unwrap_or_panic(try_cross_entropy(logits, targets, ignore_index))
}

/// [`cross_entropy`], returning the error instead of panicking.
#[track_caller]
pub fn try_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    ignore_index: Option<i64>,
) -> Result<Tensor> {
    let fits = logits.rank() == 2
        && logits.dtype().is_float()
        && targets.rank() == 1
        && targets.dtype().is_int()
        && targets.shape()[0] == logits.shape()[0];
    if !fits {
        return Err(loss_error(
            "cross_entropy",
            format!(
                "expects float logits [N, C] and i64/i32 targets [N], got {} and {}",
                logits.ty(),
                targets.ty()
            ),
        ));
    }
    mean_nll(logits, targets, ignore_index)
}

/// The mean of the fused op's per-row losses (see
/// `ir::custom::cross_entropy`) over the rows not ignored. The op reads
/// the logits in their own dtype and computes in f32 (f64 for f64), so
/// under autocast no f32 copy of bf16/f16 logits is made; the loss is f32
/// there (autocast's policy for losses) and the logits' dtype outside it.
fn mean_nll(logits: &Tensor, targets: &Tensor, ignore_index: Option<i64>) -> Result<Tensor> {
    let loss_dtype = autocast::cast_f32(&logits.try_narrow(0, 0, 0)?)?.dtype();
    let attrs = cross_entropy_op::attrs(ignore_index);
    let rows = custom::call(cross_entropy_op::FORWARD, attrs, &[logits, targets])?.remove(0);
    let mean = match ignore_index {
        None => rows.try_mean(&[], false)?,
        Some(ignore) => {
            // The count is clamped to 1 so an all-ignored batch gives 0/1, not 0/0.
            let kept = targets.try_ne(ignore)?.try_cast(rows.dtype())?;
            let count = kept.try_sum(&[], false)?.try_maximum(1.0)?;
            rows.try_sum(&[], false)?.try_div(&count)?
        }
    };
    mean.try_cast(loss_dtype)
}

/// Mean squared error of two tensors of the same shape and dtype (inside
/// autocast, bf16/f16 operands are cast to f32 first: the loss is f32).
#[track_caller]
pub fn mse(pred: &Tensor, target: &Tensor) -> Tensor {
    unwrap_or_panic(try_mse(pred, target))
}

/// [`mse`], returning the error instead of panicking. Shapes must match
/// exactly: a broadcast here is almost always a bug (`[N, 1]` vs `[N]`).
#[track_caller]
pub fn try_mse(pred: &Tensor, target: &Tensor) -> Result<Tensor> {
    // Autocast computes losses in f32: a bf16 prediction meets an f32 target.
    let (pred, target) = (&autocast::cast_f32(pred)?, &autocast::cast_f32(target)?);
    if pred.ty() != target.ty() || !pred.dtype().is_float() {
        return Err(loss_error(
            "mse",
            format!(
                "prediction and target must be float tensors of one type, got {} and {}",
                pred.ty(),
                target.ty()
            ),
        ));
    }
    let diff = pred.try_sub(target)?;
    diff.try_mul(&diff)?.try_mean(&[], false)
}

#[track_caller]
fn loss_error(op: &str, message: String) -> Error {
    Error::op(ErrorKind::Shape, op, message).at(SourceLoc::caller())
}
