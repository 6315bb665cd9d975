//! Indexing and joining kernels. (stub: being written)
use crate::error::Result;
use crate::tensor::Tensor;

pub fn cat(_inputs: &[&Tensor], _dim: usize, _shape: &[usize]) -> Tensor {
    unimplemented!()
}
pub fn index_select(_x: &Tensor, _index: &Tensor, _dim: usize) -> Result<Tensor> {
    unimplemented!()
}
pub fn gather(_x: &Tensor, _index: &Tensor, _dim: usize) -> Result<Tensor> {
    unimplemented!()
}
