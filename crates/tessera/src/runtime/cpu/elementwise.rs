//! Elementwise kernels. (stub: being written)
use crate::error::Result;
use crate::ir::{BinaryOp, CompareOp, DType, UnaryOp};
use crate::tensor::Tensor;

pub fn unary(_op: UnaryOp, _x: &Tensor) -> Result<Tensor> {
    unimplemented!()
}
pub fn cast(_x: &Tensor, _dtype: DType) -> Tensor {
    unimplemented!()
}
pub fn binary(_op: BinaryOp, _a: &Tensor, _b: &Tensor, _shape: &[usize]) -> Result<Tensor> {
    unimplemented!()
}
pub fn compare(_op: CompareOp, _a: &Tensor, _b: &Tensor, _shape: &[usize]) -> Tensor {
    unimplemented!()
}
pub fn where_(_c: &Tensor, _a: &Tensor, _b: &Tensor, _shape: &[usize]) -> Tensor {
    unimplemented!()
}
pub fn triangle(_x: &Tensor, _diagonal: i64, _upper: bool) -> Tensor {
    unimplemented!()
}
