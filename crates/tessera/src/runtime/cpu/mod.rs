//! The CPU backend: storage, kernels, and the op dispatcher eager mode and
//! the graph interpreter share. Kernels take and return [`Array`]s.

pub mod alloc;
pub mod arena;
pub mod autotune;
mod backend;
pub mod conv;
pub mod copy;
mod creation;
mod element;
mod elementwise;
mod fastmath;
pub mod flash;
pub mod fused;
mod index;
mod matmul;
mod reduce;
pub mod rows;
mod scatter;
mod storage;
mod stream;

pub use alloc::{empty_cache, host_memory_stats, memory_stats, reset_peak, MemoryStats};
pub(crate) use backend::cpu_backend;
pub use backend::CpuBackend;
pub use element::num_like::AccFloat;
pub use element::{Element, Float, U8};
pub use matmul::{
    alike, blocks_products, for_each_block, thin_dims, transposes, BlockedProduct, DescribedProduct,
};
pub use storage::{ForeignOwner, Storage};

use super::array::Array;
use super::layout::Layout;
use crate::error::Result;
use crate::ir::{DType, Op, TensorType};

/// Computes `op(inputs)` whose output has `dtype` and `shape` (already
/// inferred and checked by `Op::infer`). Movement ops return views (see
/// [`view_layout`]). Memory the kernel cannot get is an `OutOfMemory`
/// error that names the op and its output type.
pub fn eval(op: &Op, inputs: &[&Array], dtype: DType, shape: &[usize]) -> Result<Array> {
    if let Some(x) = inputs.first() {
        let input = (x.layout(), x.dtype(), x.storage().numel());
        if let Some(layout) = view_layout(op, input, shape) {
            return Ok(x.view(layout));
        }
    }
    alloc::catching(|| run_kernel(op, inputs, dtype, shape))
        .and_then(|r| r)
        .map_err(|e| in_kernel(e, op.name(), &TensorType::new(dtype, shape).to_string()))
}

/// An allocation failure inside `op`'s kernel, said about the op: `op: out
/// of memory: … (computing f32[1000000, 1000000])`.
pub(crate) fn in_kernel(mut e: crate::error::Error, op: &str, output: &str) -> crate::error::Error {
    if e.kind == crate::error::ErrorKind::OutOfMemory && e.op.is_none() {
        e.op = Some(op.to_string());
        e.message = format!("{} (computing {output})", e.message);
    }
    e
}

fn run_kernel(op: &Op, inputs: &[&Array], dtype: DType, shape: &[usize]) -> Result<Array> {
    match op {
        Op::Input => unreachable!("inputs are bound by the caller, never evaluated"),
        Op::Constant(lit) => creation::constant(lit),
        Op::Full { value, dtype, .. } => Ok(creation::full(*value, *dtype, shape)),
        Op::Arange {
            start, step, dtype, ..
        } => Ok(creation::arange(*start, *step, *dtype, shape[0])),
        Op::Rand { dtype, .. } => Ok(creation::rand(
            creation::seed_of(inputs[0], op.name())?,
            *dtype,
            shape,
        )),
        Op::Randn { dtype, .. } => Ok(creation::randn(
            creation::seed_of(inputs[0], op.name())?,
            *dtype,
            shape,
        )),
        Op::Unary(u) => elementwise::unary(*u, inputs[0]),
        Op::Cast(d) => Ok(elementwise::cast(inputs[0], *d)),
        Op::BitCast(d) => Ok(elementwise::bitcast(inputs[0], *d)),
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
        Op::Permute(_) | Op::Expand(_) | Op::Slice { .. } => {
            unreachable!("{} is always a view", op.name())
        }
        Op::Cat { dim } => Ok(index::cat(inputs, *dim, shape)),
        Op::Contiguous => Ok(copy::contiguous(inputs[0]).into_owned()),
        Op::Tril { diagonal } => Ok(elementwise::triangle(inputs[0], *diagonal, false)),
        Op::Triu { diagonal } => Ok(elementwise::triangle(inputs[0], *diagonal, true)),
        Op::IndexSelect { dim } => index::index_select(inputs[0], inputs[1], *dim),
        Op::Gather { dim } => index::gather(inputs[0], inputs[1], *dim),
        Op::IndexAdd { dim } => scatter::index_add(inputs[0], inputs[1], inputs[2], *dim),
        Op::ScatterAdd { dim } => scatter::scatter_add(inputs[0], inputs[1], inputs[2], *dim),
        Op::Custom(_) | Op::CustomOutput { .. } => Err(crate::error::Error::op(
            crate::error::ErrorKind::Verify,
            op.name(),
            "custom ops run through `custom_op`, not the op dispatcher",
        )),
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

/// The layout of `op`'s output when it is a view of its first input
/// (`input`: layout, dtype, element count of its storage) that shares the
/// input's storage; `None` when the op writes a new buffer of `out_shape`.
///
/// [`eval`] returns views exactly when this says so, and the memory planner
/// uses it to know which values alias which buffers: one rule for both.
pub fn view_layout(op: &Op, input: (&Layout, DType, usize), out_shape: &[usize]) -> Option<Layout> {
    let (layout, dtype, storage_numel) = input;
    match op {
        Op::Permute(perm) => Some(layout.permuted(perm)),
        Op::Expand(_) => Some(layout.expanded(out_shape)),
        Op::Slice {
            dim, start, step, ..
        } => Some(layout.sliced(*dim, *start, out_shape[*dim], *step)),
        Op::Reshape(_) => layout.reshaped(out_shape),
        // `contiguous` of a dense tensor, a reduction over no dims and a
        // cast to the same dtype hand the input back.
        Op::Contiguous => copy::is_dense(layout, storage_numel).then(|| layout.clone()),
        Op::Reduce { dims, .. } if dims.is_empty() => {
            copy::is_dense(layout, storage_numel).then(|| layout.clone())
        }
        Op::Cast(to) if *to == dtype => Some(layout.clone()),
        _ => None,
    }
}

/// Bytes a kernel allocates for its own use while it runs, besides its
/// output (`inputs`: each input's layout, dtype and storage element count).
/// Softmax makes a dense copy of a strided input, a reduction one of an
/// input too strided to fold in place; f16/bf16 matmul widens both operands
/// (broadcast dims stay compact) and its result to f32, each piece 64-byte
/// aligned as the arena places it; `index_add` and
/// `scatter_add` copy a strided index or source.
pub fn scratch_bytes(op: &Op, inputs: &[(&Layout, DType, usize)], out_shape: &[usize]) -> usize {
    match op {
        Op::Reduce { dims, .. } => {
            let (layout, dtype, storage_numel) = inputs[0];
            reduce::scratch_bytes(layout, storage_numel, dims, dtype)
        }
        Op::Softmax { .. } | Op::LogSoftmax { .. } => {
            let (layout, dtype, storage_numel) = inputs[0];
            if copy::is_dense(layout, storage_numel) {
                0
            } else {
                layout.numel() * dtype.size_bytes()
            }
        }
        Op::IndexAdd { .. } | Op::ScatterAdd { .. } => scatter::scratch_bytes(inputs),
        Op::MatMul | Op::MatMulT { .. } if matches!(inputs[0].1, DType::F16 | DType::BF16) => {
            let compact = |l: &Layout| -> usize {
                l.shape
                    .iter()
                    .zip(&l.strides)
                    .map(|(&n, &s)| if s == 0 { 1 } else { n })
                    .product()
            };
            let out: usize = out_shape.iter().product();
            // Three f32 pieces, each 64-byte aligned in the scratch region.
            [compact(inputs[0].0), compact(inputs[1].0), out]
                .iter()
                .map(|n| (n * 4).div_ceil(64) * 64)
                .sum()
        }
        _ => 0,
    }
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
