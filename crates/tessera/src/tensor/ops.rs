//! Op methods. (being written)
use super::Tensor;
impl Tensor {
    pub fn to_f64_vec(&self) -> Vec<f64> {
        Vec::new()
    }
}
