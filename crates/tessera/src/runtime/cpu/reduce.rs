//! Reduction kernels. (stub: being written)
use crate::ir::{ArgReduceOp, ReduceOp};
use crate::tensor::Tensor;

pub fn reduce(_op: ReduceOp, _x: &Tensor, _dims: &[usize], _keepdim: bool) -> Tensor {
    unimplemented!()
}
pub fn arg_reduce(_op: ArgReduceOp, _x: &Tensor, _dim: usize, _keepdim: bool) -> Tensor {
    unimplemented!()
}
pub fn softmax(_x: &Tensor, _dim: usize, _log: bool) -> Tensor {
    unimplemented!()
}
