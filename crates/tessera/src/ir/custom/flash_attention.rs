//! The signatures of the built-in flash attention ops (their kernels and
//! backward are `tensor::custom::flash_attention`'s, their user-facing call
//! `custom_op::flash_attention`'s).
//!
//! `tessera::flash_attention` (q, k, v[, mask]) {causal, scale} → (out, lse)
//! and `tessera::flash_attention_backward` (q, k, v, out, lse, d_out[, mask])
//! → (dq, dk, dv): every rule of their operands is here.

use std::sync::Arc;

use super::{Attrs, Signature};
use crate::error::{op_err, Result};
use crate::ir::{DType, Dim, Shape, TensorType};

/// The forward op's registered name.
pub const FORWARD: &str = "tessera::flash_attention";
/// The backward op's registered name.
pub const BACKWARD: &str = "tessera::flash_attention_backward";
/// The largest head dim the kernels take.
pub const MAX_HEAD_DIM: usize = 256;

/// The signatures of the forward and backward ops.
pub(super) fn signatures() -> Vec<Signature> {
    let forward = Signature::new(FORWARD, Arc::new(forward_types));
    let backward = Signature::new(
        BACKWARD,
        Arc::new(|_: &Attrs, inputs: &[TensorType]| backward_types(inputs)),
    );
    vec![
        forward.expect("a valid built-in name"),
        backward.expect("a valid built-in name"),
    ]
}

/// The attributes of one attention call.
pub fn attrs(causal: bool, scale: f64) -> Attrs {
    let mut a = Attrs::new();
    a.insert("causal".into(), causal.into());
    a.insert("scale".into(), scale.into());
    a
}

/// The `causal` and `scale` attributes of a call.
pub fn causal_and_scale(attrs: &Attrs) -> Result<(bool, f64)> {
    let causal = attrs.get("causal").and_then(|v| v.as_bool());
    let scale = attrs.get("scale").and_then(|v| v.as_f64());
    match (causal, scale) {
        (Some(causal), Some(scale)) => Ok((causal, scale)),
        _ => Err(op_err!(
            Argument,
            FORWARD,
            "needs attributes {{\"causal\": bool, \"scale\": number}}, got {}",
            serde_json::Value::Object(attrs.clone())
        )),
    }
}

/// `(q, k, v[, mask])` → `(out, lse)`; every rule of the op is here.
fn forward_types(attrs: &Attrs, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
    causal_and_scale(attrs)?;
    let (q, k, v) = match inputs {
        [q, k, v] | [q, k, v, _] => (q, k, v),
        _ => {
            return Err(op_err!(
                Argument,
                FORWARD,
                "takes (q, k, v) or (q, k, v, mask), got {} inputs",
                inputs.len()
            ))
        }
    };
    let all = format!("q {q}, k {k}, v {v}");
    if !matches!(q.dtype, DType::F32 | DType::F16 | DType::BF16)
        || k.dtype != q.dtype
        || v.dtype != q.dtype
    {
        return Err(op_err!(
            DType,
            FORWARD,
            "takes f32, f16 or bf16 q, k and v of one dtype, got {all}"
        ));
    }
    let rank = q.rank();
    if rank < 2 || k.rank() != rank || v.rank() != rank {
        return Err(op_err!(
            Shape,
            FORWARD,
            "q, k and v must have one rank ≥ 2 ([..., len, dim]), got {all}"
        ));
    }
    let (lead, qd) = (&q.shape.0[..rank - 2], &q.shape.0[rank - 2..]);
    let (kd, vd) = (&k.shape.0[rank - 2..], &v.shape.0[rank - 2..]);
    if k.shape.0[..rank - 2] != *lead || v.shape.0[..rank - 2] != *lead {
        return Err(op_err!(
            Shape,
            FORWARD,
            "q, k and v must share their leading (batch, head) dims, got {all}"
        ));
    }
    if kd[1] != qd[1] || vd[0] != kd[0] {
        return Err(op_err!(
            Shape,
            FORWARD,
            "needs q [..., Lq, E], k [..., Lk, E], v [..., Lk, Ev], got {all}"
        ));
    }
    for d in [&qd[1], &vd[1]] {
        if let Dim::Const(n) = d {
            if *n == 0 || *n > MAX_HEAD_DIM {
                return Err(op_err!(
                    Unsupported,
                    FORWARD,
                    "head dims from 1 to {MAX_HEAD_DIM} are supported, got {all}"
                ));
            }
        }
    }
    if let Some(mask) = inputs.get(3) {
        let scores = Shape(vec![qd[0].clone(), kd[0].clone()]);
        let full = Shape([lead, &scores.0[..]].concat());
        if mask.dtype != DType::F32 || (mask.shape != scores && mask.shape != full) {
            return Err(op_err!(
                Shape,
                FORWARD,
                "the mask must be f32{scores} or f32{full}, got {mask}"
            ));
        }
    }
    let out = Shape([lead, &[qd[0].clone(), vd[1].clone()][..]].concat());
    let lse = Shape([lead, &[qd[0].clone()][..]].concat());
    Ok(vec![
        TensorType::new(q.dtype, out),
        TensorType::new(DType::F32, lse),
    ])
}

/// `(q, k, v, out, lse, d_out[, mask])` → `(dq, dk, dv)`.
fn backward_types(inputs: &[TensorType]) -> Result<Vec<TensorType>> {
    let (q, k, v, rest) = match inputs {
        [q, k, v, out, lse, d_out] => (q, k, v, (out, lse, d_out, None)),
        [q, k, v, out, lse, d_out, mask] => (q, k, v, (out, lse, d_out, Some(mask))),
        _ => {
            return Err(op_err!(
                Argument,
                BACKWARD,
                "takes (q, k, v, out, lse, d_out[, mask]), got {} inputs",
                inputs.len()
            ))
        }
    };
    let (out, lse, d_out, mask) = rest;
    let mut forward_inputs = vec![q.clone(), k.clone(), v.clone()];
    forward_inputs.extend(mask.cloned());
    let expected = forward_types(&attrs(false, 1.0), &forward_inputs)?;
    if *out != expected[0] || *d_out != expected[0] || *lse != expected[1] {
        return Err(op_err!(
            Shape,
            BACKWARD,
            "out and d_out must be {} and lse {}, got out {out}, lse {lse}, d_out {d_out}",
            expected[0],
            expected[1]
        ));
    }
    Ok(vec![q.clone(), k.clone(), v.clone()])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(dtype: DType, shape: &[usize]) -> TensorType {
        TensorType::new(dtype, shape)
    }

    #[test]
    fn forward_types_and_their_errors() {
        let (q, k, v) = (
            t(DType::F16, &[2, 3, 5, 8]),
            t(DType::F16, &[2, 3, 7, 8]),
            t(DType::F16, &[2, 3, 7, 4]),
        );
        let out = forward_types(&attrs(true, 0.5), &[q.clone(), k.clone(), v.clone()]).unwrap();
        assert_eq!(
            out,
            vec![t(DType::F16, &[2, 3, 5, 4]), t(DType::F32, &[2, 3, 5])]
        );
        let mask = t(DType::F32, &[5, 7]);
        let with_mask = [q.clone(), k.clone(), v.clone(), mask];
        assert_eq!(forward_types(&attrs(false, 1.0), &with_mask).unwrap(), out);
        let err = forward_types(&Attrs::new(), &[q.clone(), k.clone(), v.clone()]).unwrap_err();
        assert!(err.to_string().contains("causal"), "{err}");
        let wrong = [q.clone(), t(DType::F16, &[2, 3, 7, 6]), v.clone()];
        let err = forward_types(&attrs(false, 1.0), &wrong).unwrap_err();
        assert!(err.to_string().contains("f16[2,3,7,6]"), "{err}");
        let f64s = [
            t(DType::F64, &[1, 2, 2]),
            t(DType::F64, &[1, 2, 2]),
            t(DType::F64, &[1, 2, 2]),
        ];
        let err = forward_types(&attrs(false, 1.0), &f64s).unwrap_err();
        assert_eq!(err.op.as_deref(), Some(FORWARD));
    }

    #[test]
    fn backward_types_are_the_inputs_types() {
        let (q, k, v) = (
            t(DType::F32, &[4, 5, 8]),
            t(DType::F32, &[4, 6, 8]),
            t(DType::F32, &[4, 6, 8]),
        );
        let (out, lse) = (t(DType::F32, &[4, 5, 8]), t(DType::F32, &[4, 5]));
        let inputs = [
            q.clone(),
            k.clone(),
            v.clone(),
            out.clone(),
            lse.clone(),
            out.clone(),
        ];
        assert_eq!(
            backward_types(&inputs).unwrap(),
            vec![q.clone(), k.clone(), v.clone()]
        );
        let bad = [q, k, v, out.clone(), out.clone(), out];
        let err = backward_types(&bad).unwrap_err();
        assert_eq!(err.op.as_deref(), Some(BACKWARD));
    }
}
