//! Custom calls: a call's type is the first output of its op's shape
//! function (`crate::ir::custom`: flash attention is one, the rules of
//! attention are in its signature); `custom_output` declares the type of
//! one of the further outputs (index ≥ 1).

use super::{not_in_family, TensorType};
use crate::error::{op_err, Result};
use crate::ir::op::Op;

/// The type a custom call or one of its further outputs has.
pub(super) fn infer(op: &Op, inputs: &[TensorType]) -> Result<TensorType> {
    match op {
        Op::Custom(call) => Ok(call.infer(inputs)?.swap_remove(0)),
        Op::CustomOutput {
            index,
            dtype,
            shape,
        } => {
            if *index == 0 {
                return Err(op_err!(
                    Argument,
                    "custom_output",
                    "output 0 is the custom node itself; indices start at 1"
                ));
            }
            Ok(TensorType::new(*dtype, shape.clone()))
        }
        _ => Err(not_in_family(op, "custom")),
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{err, ty};
    use super::*;
    use crate::ir::custom::{flash_attention, CustomCall};
    use crate::ir::dtype::DType;
    use crate::ir::shape::Shape;

    fn attention(causal: bool) -> Op {
        let attrs = flash_attention::attrs(causal, 0.125);
        Op::Custom(CustomCall::new(flash_attention::FORWARD, attrs).unwrap())
    }

    #[test]
    fn a_call_has_its_first_outputs_type() {
        let (q, k) = (
            ty(DType::F16, &[2, 4, 8, 64]),
            ty(DType::F16, &[2, 4, 16, 64]),
        );
        let v = ty(DType::F16, &[2, 4, 16, 32]);
        let out = attention(true).infer(&[q, k, v]).unwrap();
        assert_eq!(out, ty(DType::F16, &[2, 4, 8, 32]), "out, not the lse");
    }

    #[test]
    fn a_calls_errors_name_its_op_and_inputs() {
        let q = ty(DType::F32, &[8, 64]);
        let k = ty(DType::F32, &[16, 32]);
        let e = err(&attention(false), &[q.clone(), k.clone(), k]);
        assert_eq!(
            e,
            "tessera::flash_attention: needs q [..., Lq, E], k [..., Lk, E], v [..., Lk, Ev], \
             got q f32[8,64], k f32[16,32], v f32[16,32]"
        );
        let e = err(&attention(false), &[q.clone(), q]);
        assert_eq!(
            e,
            "tessera::flash_attention: takes (q, k, v) or (q, k, v, mask), got 2 inputs"
        );
    }

    #[test]
    fn a_further_output_has_its_declared_type() {
        let out = |index| Op::CustomOutput {
            index,
            dtype: DType::F32,
            shape: Shape::from_concrete(&[2, 8]),
        };
        let node = ty(DType::F16, &[2, 8, 32]);
        assert_eq!(
            out(1).infer(std::slice::from_ref(&node)).unwrap(),
            ty(DType::F32, &[2, 8])
        );
        assert_eq!(
            err(&out(0), &[node]),
            "custom_output: output 0 is the custom node itself; indices start at 1"
        );
        assert_eq!(err(&out(1), &[]), "custom_output: takes 1 inputs, got 0");
    }
}
