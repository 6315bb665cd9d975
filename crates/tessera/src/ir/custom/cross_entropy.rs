//! The signatures of the built-in fused cross-entropy ops (their kernels
//! and backward are `tensor::custom::cross_entropy`'s; `nn::cross_entropy`
//! calls them).
//!
//! - `tessera::cross_entropy`: `(logits [N, C], targets [N]) {ignore_index}
//!   → (nll [N], lse [N])`, f32 (f64 for f64 logits): per row,
//!   `lse − logits[target]` (0 for a row whose target is `ignore_index`)
//!   and the row's log-sum-exp.
//! - `tessera::cross_entropy_backward`: `(logits, targets, lse, d_nll)
//!   {ignore_index} → d_logits [N, C]` (the logits' dtype):
//!   `(exp(logits − lse) − onehot(target)) · d_nll` per row, 0 for
//!   ignored rows.
//!
//! One op instead of log_softmax + gather + their backward: the
//! `[N, C]` log-probabilities, their exponentials, the one-hot scatter and
//! an f32 copy of low-precision logits are never materialised (at GPT-2's
//! head, 8192 × 50304, each of those is 1.6 GB in f32); the kernels read
//! the logits in their own dtype and compute in f32 (f64 for f64).

use std::sync::Arc;

use super::{Attrs, Signature};
use crate::error::{op_err, Result};
use crate::ir::{DType, Shape, TensorType};

/// The forward op's registered name.
pub const FORWARD: &str = "tessera::cross_entropy";
/// The backward op's registered name.
pub const BACKWARD: &str = "tessera::cross_entropy_backward";

/// The signatures of the forward and backward ops.
pub(super) fn signatures() -> Vec<Signature> {
    let forward = Signature::new(FORWARD, Arc::new(forward_types));
    let backward = Signature::new(BACKWARD, Arc::new(backward_types));
    vec![
        forward.expect("a valid built-in name"),
        backward.expect("a valid built-in name"),
    ]
}

/// The attributes of one call: the target value whose rows count nothing.
pub fn attrs(ignore_index: Option<i64>) -> Attrs {
    let mut a = Attrs::new();
    a.insert(
        "ignore_index".into(),
        ignore_index.map_or(serde_json::Value::Null, Into::into),
    );
    a
}

/// The `ignore_index` attribute of a call (`null`: none).
pub fn ignore_index(op: &str, attrs: &Attrs) -> Result<Option<i64>> {
    match attrs.get("ignore_index") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => v.as_i64().map(Some).ok_or_else(|| {
            op_err!(
                Argument,
                op,
                "needs an integer or null `ignore_index` attribute, got {v}"
            )
        }),
    }
}

/// The per-row outputs' dtype: f64 for f64 logits, else f32 (what the
/// kernels compute in).
pub fn row_dtype(logits: DType) -> DType {
    match logits {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// `(logits [N, C], targets [N])` → `(nll [N], lse [N])` of [`row_dtype`].
fn forward_types(attrs: &Attrs, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
    ignore_index(FORWARD, attrs)?;
    let [logits, targets] = inputs else {
        return Err(op_err!(
            Argument,
            FORWARD,
            "takes (logits, targets), got {} inputs",
            inputs.len()
        ));
    };
    check_operands(FORWARD, logits, targets)?;
    let rows = rows_type(logits);
    Ok(vec![rows.clone(), rows])
}

/// `(logits, targets, lse, d_nll)` → `d_logits`.
fn backward_types(attrs: &Attrs, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
    ignore_index(BACKWARD, attrs)?;
    let [logits, targets, lse, d_nll] = inputs else {
        return Err(op_err!(
            Argument,
            BACKWARD,
            "takes (logits, targets, lse, d_nll), got {} inputs",
            inputs.len()
        ));
    };
    check_operands(BACKWARD, logits, targets)?;
    let rows = rows_type(logits);
    if *lse != rows || *d_nll != rows {
        return Err(op_err!(
            Shape,
            BACKWARD,
            "lse and d_nll must be {rows}, got lse {lse}, d_nll {d_nll}"
        ));
    }
    Ok(vec![logits.clone()])
}

/// The type of a per-row output of `logits`.
fn rows_type(logits: &TensorType) -> TensorType {
    TensorType::new(
        row_dtype(logits.dtype),
        Shape(vec![logits.shape.0[0].clone()]),
    )
}

/// Float logits `[N, C]` and i64/i32 targets `[N]`.
fn check_operands(op: &str, logits: &TensorType, targets: &TensorType) -> Result<()> {
    if !logits.dtype.is_float() || !matches!(targets.dtype, DType::I64 | DType::I32) {
        return Err(op_err!(
            DType,
            op,
            "takes float logits and i64/i32 targets, got logits {logits}, targets {targets}"
        ));
    }
    if logits.rank() != 2 || targets.rank() != 1 || targets.shape.0[0] != logits.shape.0[0] {
        return Err(op_err!(
            Shape,
            op,
            "takes logits [N, C] and targets [N], got logits {logits}, targets {targets}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Dim;

    fn ty(dtype: DType, dims: &[usize]) -> TensorType {
        TensorType::new(dtype, Shape(dims.iter().map(|&d| Dim::Const(d)).collect()))
    }

    #[test]
    fn rows_are_f32_and_bad_operands_are_named() {
        let out = forward_types(
            &attrs(None),
            &[ty(DType::BF16, &[6, 10]), ty(DType::I64, &[6])],
        )
        .unwrap();
        assert_eq!(out, vec![ty(DType::F32, &[6]), ty(DType::F32, &[6])]);
        let f64_rows = forward_types(
            &attrs(None),
            &[ty(DType::F64, &[6, 10]), ty(DType::I32, &[6])],
        )
        .unwrap();
        assert_eq!(f64_rows[0], ty(DType::F64, &[6]));
        let e = forward_types(
            &attrs(Some(-100)),
            &[ty(DType::F32, &[6, 10]), ty(DType::I64, &[5])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("targets [N]"), "{e}");
        let e = forward_types(
            &attrs(None),
            &[ty(DType::I64, &[6, 10]), ty(DType::I64, &[6])],
        )
        .unwrap_err();
        assert!(e.to_string().contains("float logits"), "{e}");
        let d = backward_types(
            &attrs(None),
            &[
                ty(DType::F16, &[6, 10]),
                ty(DType::I32, &[6]),
                ty(DType::F32, &[6]),
                ty(DType::F32, &[6]),
            ],
        )
        .unwrap();
        assert_eq!(d, vec![ty(DType::F16, &[6, 10])]);
        let mut bad = attrs(None);
        bad.insert("ignore_index".into(), "x".into());
        assert!(ignore_index(FORWARD, &bad).is_err());
    }
}
