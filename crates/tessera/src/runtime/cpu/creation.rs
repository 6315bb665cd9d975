//! Creation kernels: constants, full, arange, rand, randn. (stub: being written)
use crate::error::{Error, ErrorKind, Result};
use crate::ir::{DType, Literal, Scalar};
use crate::tensor::Tensor;

pub fn constant(_lit: &Literal) -> Result<Tensor> {
    Err(Error::new(ErrorKind::Unsupported, "constant: not yet"))
}
pub fn full(_value: Scalar, _dtype: DType, _shape: &[usize]) -> Tensor {
    unimplemented!()
}
pub fn arange(_start: f64, _step: f64, _dtype: DType, _len: usize) -> Tensor {
    unimplemented!()
}
pub fn rand(_seed: u64, _dtype: DType, _shape: &[usize]) -> Tensor {
    unimplemented!()
}
pub fn randn(_seed: u64, _dtype: DType, _shape: &[usize]) -> Tensor {
    unimplemented!()
}
