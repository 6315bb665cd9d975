//! The op dispatcher of the CUDA backend: each IR op to the generated
//! kernel (or cuBLASLt call) that computes it. Views never get here (the
//! core makes them, with the CPU's rule); creation ops whose values come
//! from the host generator (`rand`, `randn`, `arange`, `constant`) are made
//! by the CPU kernel and copied up, so both devices draw the same numbers
//! (a random op's seed operand, where it is on the device, is read back).
//!
//! - `pointwise`: elementwise ops and the fusion plan's pointwise kernels;
//! - `reduce`: reductions, arg-reductions, softmax and the fusion plan's
//!   row kernels;
//! - `matmul`: products through cuBLASLt (operands as batches of matrices);
//! - `index`: gathers, scatters, triangles;
//! - `memory`: allocation, host transfers, copies, concatenation.

pub(crate) mod conv;
pub(crate) mod cross_entropy;
mod index;
mod matmul;
mod memo_key;
mod memory;
mod pointwise;
mod reduce;

use std::sync::Arc;

use tessera::error::{Error, ErrorKind, Result};
use tessera::ir::{DType, Op};
use tessera::runtime::array::Array;
use tessera::runtime::cpu;
use tessera::runtime::device::DeviceStorage;
use tessera::tensor::Layout;

use crate::matmul::Epilogue;
use crate::{autotune, CudaBackend};

/// A device failure about `op`.
pub fn device_err(op: &str, message: impl Into<String>) -> Error {
    Error::op(ErrorKind::Device, op, message.into())
}

/// Something about `op` the CUDA kernels do not do.
fn unsupported(op: &str, message: impl Into<String>) -> Error {
    Error::op(ErrorKind::Unsupported, op, message.into())
}

/// The device address of element 0 of `t`'s storage.
fn base(t: &Array) -> u64 {
    t.device_storage().map_or(0, |s| s.ptr())
}

/// The address of `t`'s first element (its layout's offset applied).
pub(crate) fn first(t: &Array) -> u64 {
    base(t) + (t.layout().offset * t.dtype().size_bytes()) as u64
}

impl CudaBackend {
    /// Queues a generated kernel's launch, a failure reported about `op`.
    fn launch(&self, op: &str, launch: &crate::codegen::Launch) -> Result<()> {
        self.gpu.launch(launch).map_err(|m| device_err(op, m))
    }

    /// Under a `max-autotune` run (see `tessera::runtime::device::tuning`), the
    /// block choice among `candidates` for the kernel whose default launch
    /// is `default`: cached, or timed once on the device with `trial(c)`,
    /// a launch of candidate `c` that writes only what it may overwrite
    /// any number of times. `None` outside such runs.
    fn tuned_choice<C: Copy + ToString>(
        &self,
        op: &str,
        default: &crate::codegen::Launch,
        shape: &[usize],
        candidates: &[C],
        trial: impl Fn(C) -> std::result::Result<crate::codegen::Launch, String>,
    ) -> Result<Option<C>> {
        if !tessera::runtime::device::tuning() || candidates.len() < 2 {
            return Ok(None);
        }
        let key = autotune::key(&default.source, &format!("{shape:?}"), &self.gpu.name);
        let labels: Vec<String> = candidates.iter().map(ToString::to_string).collect();
        let what = format!(
            "{op} {shape:?} (block of {} threads by default)",
            default.block
        );
        let i = autotune::Tuner::global()
            .choose(&what, &key, &labels, |i| {
                let launch = trial(candidates[i])?;
                crate::gpu::time_on_stream(self.gpu.stream(), autotune::REPS, || {
                    self.gpu.launch(&launch)
                })
            })
            .map_err(|m| device_err(op, m))?;
        Ok(Some(candidates[i]))
    }

    /// The backend's `eval`: `op` (never a view) on device inputs.
    pub(crate) fn eval_op(
        &self,
        op: &Op,
        inputs: &[&Array],
        dtype: DType,
        shape: &[usize],
    ) -> Result<Array> {
        let name = op.name();
        match op {
            Op::Constant(_) | Op::Arange { .. } => {
                let host = cpu::eval(op, &[], dtype, shape)?;
                self.upload_tensor(&host)
            }
            // The seed operand is read on the host: a host scalar as it is,
            // a seed on the device copied back (one 8-byte read).
            Op::Rand { .. } | Op::Randn { .. } => {
                let seed = inputs[0].to_host()?;
                let host = cpu::eval(op, &[&seed], dtype, shape)?;
                self.upload_tensor(&host)
            }
            Op::Full { .. }
            | Op::Unary(_)
            | Op::Cast(_)
            | Op::Binary(_)
            | Op::Compare(_)
            | Op::Where => self.elementwise(op, inputs, dtype, shape),
            // The bytes copied as they are: a same-width reinterpretation.
            Op::BitCast(_) => {
                let x = self.on_device(inputs[0])?;
                let s = self.empty(dtype, x.numel())?;
                self.copy_into(name, &x, s.ptr(), Layout::contiguous(shape))?;
                Ok(Array::from_device_storage(s, shape))
            }
            Op::Contiguous | Op::Reshape(_) => {
                let x = self.on_device(inputs[0])?;
                let c = self.contiguous(name, &x)?;
                Ok(c.view_of_shape(shape))
            }
            Op::Reduce { op: r, dims, .. } => self.reduce(name, *r, dims, inputs[0], dtype, shape),
            Op::ArgReduce { op: r, dim, .. } => self.arg_reduce(name, *r, *dim, inputs[0], shape),
            Op::Softmax { dim } => self.softmax(name, inputs[0], *dim, false, dtype, shape),
            Op::LogSoftmax { dim } => self.softmax(name, inputs[0], *dim, true, dtype, shape),
            Op::MatMul => self.matmul(
                name,
                inputs[0],
                inputs[1],
                false,
                false,
                shape,
                None,
                Epilogue::None,
            ),
            Op::MatMulT {
                transpose_a,
                transpose_b,
            } => self.matmul(
                name,
                inputs[0],
                inputs[1],
                *transpose_a,
                *transpose_b,
                shape,
                None,
                Epilogue::None,
            ),
            Op::Cat { dim } => self.cat(name, inputs, *dim, dtype, shape),
            Op::Tril { diagonal } => self.triangle(name, inputs[0], *diagonal, false, dtype),
            Op::Triu { diagonal } => self.triangle(name, inputs[0], *diagonal, true, dtype),
            Op::IndexSelect { dim } | Op::Gather { dim } => {
                self.read_indexed(op, inputs, *dim, dtype, shape)
            }
            Op::IndexAdd { dim } | Op::ScatterAdd { dim } => {
                self.add_indexed(op, inputs, *dim, dtype, shape)
            }
            Op::Input | Op::Permute(_) | Op::Expand(_) | Op::Slice { .. } => Err(unsupported(
                name,
                "reached the CUDA kernels (inputs are bound and views are made by the caller)",
            )),
            // Custom ops run their own CUDA kernel slot (custom_op::CustomOp::set_kernel).
            Op::Custom(_) | Op::CustomOutput { .. } => Err(unsupported(
                name,
                "reached the built-in CUDA kernels; a custom op runs the kernel registered for `cuda`",
            )),
        }
    }
}

/// Bytes the kernel of `op` allocates inside `arena::scratch` on a GPU of
/// `sms` SMs (the backend's `Backend::scratch_bytes`; `inputs`: each
/// input's layout, dtype and storage element count): the partial results
/// of a reduction cut into parts, the contiguous copies of matmul operands
/// cuBLASLt cannot read in place. Softmax reads strided rows in place,
/// half-precision matmuls need no f32 copies, and cuBLASLt's workspace is
/// the backend's own (one per lane, for the process, outside the
/// allocator's accounting), so none of them is a kernel's scratch.
pub(crate) fn scratch_bytes(
    op: &Op,
    inputs: &[(&Layout, DType, usize)],
    out_shape: &[usize],
    sms: u32,
) -> usize {
    match op {
        Op::Reduce { dims, .. } => {
            let (layout, dtype, _) = inputs[0];
            reduce::scratch_bytes(layout, dtype, dims, out_shape, sms)
        }
        Op::MatMul => matmul::scratch_bytes(inputs, false, false),
        Op::MatMulT {
            transpose_a,
            transpose_b,
        } => matmul::scratch_bytes(inputs, *transpose_a, *transpose_b),
        _ => 0,
    }
}

/// Shared-ownership helpers the dispatcher needs on tensors.
trait ViewExt {
    fn view_with_layout(&self, layout: Layout) -> Array;
    fn view_of_shape(&self, shape: &[usize]) -> Array;
}

impl ViewExt for Array {
    fn view_with_layout(&self, layout: Layout) -> Array {
        let s: Arc<DeviceStorage> = self.device_storage().expect("a device tensor").clone();
        Array::from_device_parts(s, layout)
    }

    /// A contiguous tensor seen with another shape of the same size.
    fn view_of_shape(&self, shape: &[usize]) -> Array {
        let mut l = Layout::contiguous(shape);
        l.offset = self.layout().offset;
        self.view_with_layout(l)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::rows;

    #[test]
    fn scratch_is_what_the_kernels_allocate_inside_arena_scratch() {
        let dense = |shape: &[usize]| Layout::contiguous(shape);
        let described = |l: &Layout, d: DType| (l.clone(), d, l.numel());
        let mm = |a: &Layout, b: &Layout, d: DType, op: &Op, out: &[usize]| {
            let (a, b) = (described(a, d), described(b, d));
            scratch_bytes(op, &[(&a.0, a.1, a.2), (&b.0, b.1, b.2)], out, 132)
        };
        // bf16 matmuls read their operands as they are: no f32 copies
        // (the CPU reserves (64·32 + 32·16 + 64·16)·4 bytes).
        let (a, b) = (dense(&[64, 32]), dense(&[32, 16]));
        assert_eq!(mm(&a, &b, DType::BF16, &Op::MatMul, &[64, 16]), 0);
        // A transposed operand is read transposed, not copied.
        let bt = dense(&[16, 32]).permuted(&[1, 0]);
        assert_eq!(mm(&a, &bt, DType::F32, &Op::MatMul, &[64, 16]), 0);
        // A batch that does not collapse to one stride is copied whole,
        // the second copy at the 64-byte boundary after the first.
        let ap = dense(&[3, 2, 5, 7]).permuted(&[1, 0, 2, 3]);
        let bp = dense(&[3, 2, 7, 1]).permuted(&[1, 0, 2, 3]);
        let op = Op::MatMul;
        assert_eq!(
            mm(&ap, &dense(&[2, 3, 7, 1]), DType::F32, &op, &[2, 3, 5, 1]),
            2 * 3 * 5 * 7 * 4
        );
        assert_eq!(
            mm(&ap, &bp, DType::F32, &op, &[2, 3, 5, 1]),
            (2 * 3 * 5 * 7 * 4usize).div_ceil(64) * 64 + 2 * 3 * 7 * 4
        );
        // A long reduction over few outputs is cut into parts: their
        // partial results (f32 for bf16 input) are the scratch.
        let x = dense(&[2, 1 << 20]);
        let reduce = Op::Reduce {
            op: tessera::ir::ReduceOp::Sum,
            dims: vec![1],
            keepdim: false,
        };
        let parts = rows::parts_for(&x, &[1], 132);
        assert!(parts > 1);
        let input = [(&x, DType::BF16, x.numel())];
        assert_eq!(scratch_bytes(&reduce, &input, &[2], 132), 2 * parts * 4);
        // A short one is one pass; softmax of strided rows reads in place.
        let short = dense(&[64, 128]);
        assert_eq!(
            scratch_bytes(&reduce, &[(&short, DType::F32, 64 * 128)], &[64], 132),
            0
        );
        let t = short.permuted(&[1, 0]);
        let softmax = Op::Softmax { dim: 1 };
        assert_eq!(
            scratch_bytes(&softmax, &[(&t, DType::F32, 64 * 128)], &[128, 64], 132),
            0
        );
    }
}
