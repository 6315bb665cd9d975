//! The CPU backend: storage, kernels, and the op dispatcher eager mode and
//! the graph interpreter share.

pub mod alloc;
pub mod copy;
mod creation;
mod element;
mod elementwise;
mod fastmath;
pub mod fused;
mod index;
mod matmul;
mod reduce;
mod scatter;
mod storage;

pub use alloc::{empty_cache, memory_stats, reset_peak, MemoryStats};
pub use element::{Element, Float};
pub use storage::Storage;

use crate::error::Result;
use crate::ir::{DType, Op};
use crate::tensor::Tensor;

/// Computes `op(inputs)` whose output has `dtype` and `shape` (already
/// inferred and checked by `Op::infer`). Movement ops return views.
pub fn eval(op: &Op, inputs: &[&Tensor], dtype: DType, shape: &[usize]) -> Result<Tensor> {
    match op {
        Op::Input => unreachable!("inputs are bound by the caller, never evaluated"),
        Op::Constant(lit) => creation::constant(lit),
        Op::Full { value, dtype, .. } => Ok(creation::full(*value, *dtype, shape)),
        Op::Arange {
            start, step, dtype, ..
        } => Ok(creation::arange(*start, *step, *dtype, shape[0])),
        Op::Rand { seed, dtype, .. } => Ok(creation::rand(*seed, *dtype, shape)),
        Op::Randn { seed, dtype, .. } => Ok(creation::randn(*seed, *dtype, shape)),
        Op::Unary(u) => elementwise::unary(*u, inputs[0]),
        Op::Cast(d) => Ok(elementwise::cast(inputs[0], *d)),
        Op::Binary(b) => elementwise::binary(*b, inputs[0], inputs[1], shape),
        Op::Compare(c) => Ok(elementwise::compare(*c, inputs[0], inputs[1], shape)),
        Op::Where => Ok(elementwise::where_(inputs[0], inputs[1], inputs[2], shape)),
        Op::Reduce { op, dims, keepdim } => reduce::reduce(*op, inputs[0], dims, *keepdim),
        Op::ArgReduce { op, dim, keepdim } => reduce::arg_reduce(*op, inputs[0], *dim, *keepdim),
        Op::Softmax { dim } => reduce::softmax(inputs[0], *dim, false),
        Op::LogSoftmax { dim } => reduce::softmax(inputs[0], *dim, true),
        Op::MatMul => matmul::matmul(inputs[0], inputs[1], shape),
        Op::MatMulT {
            transpose_a,
            transpose_b,
        } => matmul::matmul_t(inputs[0], inputs[1], *transpose_a, *transpose_b, shape),
        Op::Reshape(_) => Ok(copy::reshape(inputs[0], shape)),
        Op::Permute(perm) => Ok(view(inputs[0], inputs[0].layout().permuted(perm))),
        Op::Expand(_) => Ok(view(inputs[0], inputs[0].layout().expanded(shape))),
        Op::Slice {
            dim, start, step, ..
        } => Ok(view(
            inputs[0],
            inputs[0].layout().sliced(*dim, *start, shape[*dim], *step),
        )),
        Op::Cat { dim } => Ok(index::cat(inputs, *dim, shape)),
        Op::Contiguous => Ok(copy::contiguous(inputs[0])),
        Op::Tril { diagonal } => Ok(elementwise::triangle(inputs[0], *diagonal, false)),
        Op::Triu { diagonal } => Ok(elementwise::triangle(inputs[0], *diagonal, true)),
        Op::IndexSelect { dim } => index::index_select(inputs[0], inputs[1], *dim),
        Op::Gather { dim } => index::gather(inputs[0], inputs[1], *dim),
        Op::IndexAdd { dim } => scatter::index_add(inputs[0], inputs[1], inputs[2], *dim),
        Op::ScatterAdd { dim } => scatter::scatter_add(inputs[0], inputs[1], inputs[2], *dim),
    }
    .inspect(|t| {
        debug_assert_eq!(
            t.dtype(),
            dtype,
            "kernel for {} produced the wrong dtype",
            op.name()
        );
        debug_assert_eq!(
            t.shape(),
            shape,
            "kernel for {} produced the wrong shape",
            op.name()
        );
    })
}

fn view(x: &Tensor, layout: crate::tensor::Layout) -> Tensor {
    Tensor::from_parts(x.storage().clone(), layout)
}

/// Deterministic test values in [-1, 1), multiples of 1/64 so that f16 and
/// bf16 hold them exactly and the same inputs feed every dtype.
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 33) % 128) as f64 / 64.0 - 1.0
        })
        .collect()
}
