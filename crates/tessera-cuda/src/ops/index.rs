//! Indexing: gathers (`index_select`, `gather`), scatters with atomic adds
//! (`index_add`, `scatter_add`), and the triangles (`tril`, `triu`). Index
//! values are checked by the kernels, which report a bad one at the next
//! synchronisation (see [`crate::kernel_errors`]).

use tessera::error::{Error, ErrorKind, Result};
use tessera::ir::{DType, Op};
use tessera::runtime::array::Array;
use tessera::tensor::layout::contiguous_strides;

use super::{base, unsupported};
use crate::codegen::index::{self, IndexCheck, Indexed, Strided};
use crate::kernel_errors::{launched_at, Check, Site};
use crate::CudaBackend;

impl CudaBackend {
    /// The lower (`upper` false) or upper triangle of the last two dims of
    /// `x` from `diagonal` on, the rest zero, into a new contiguous tensor.
    pub(super) fn triangle(
        &self,
        name: &str,
        x: &Array,
        diagonal: i64,
        upper: bool,
        dtype: DType,
    ) -> Result<Array> {
        let x = self.on_device(x)?;
        let out = self.empty(dtype, x.numel())?;
        if x.numel() > 0 {
            let l = x.layout();
            let launch = index::triangle(
                dtype,
                &l.shape,
                &l.strides,
                l.offset,
                diagonal,
                upper,
                base(&x),
                out.ptr(),
                self.gpu.sms,
            );
            self.launch(name, &launch)?;
        }
        Ok(Array::from_device_storage(out, x.shape()))
    }

    /// index_select and gather.
    pub(super) fn read_indexed(
        &self,
        op: &Op,
        inputs: &[&Array],
        dim: usize,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Array> {
        let name = op.name();
        let x = self.on_device(inputs[0])?;
        let idx = self.on_device(inputs[1])?;
        let check = self.index_check(name, &idx, &x, x.shape()[dim])?;
        let out = self.empty(dtype, shape.iter().product())?;
        let numel: usize = shape.iter().product();
        if numel > 0 {
            let mut xs = x.strides().to_vec();
            let dim_stride = std::mem::replace(&mut xs[dim], 0);
            let src = Strided {
                dtype,
                ptr: base(&x),
                offset: x.layout().offset,
                strides: xs,
            };
            let istrides = match op {
                Op::IndexSelect { .. } => one_hot_stride(shape.len(), dim, idx.strides()[0]),
                _ => idx.strides().to_vec(),
            };
            let index = Strided {
                dtype: idx.dtype(),
                ptr: base(&idx),
                offset: idx.layout().offset,
                strides: istrides,
            };
            let dst = Strided {
                dtype,
                ptr: out.ptr(),
                offset: 0,
                strides: contiguous_strides(shape),
            };
            let launch = index::indexed(
                Indexed::Read,
                shape,
                &src,
                &index,
                &dst,
                dim_stride,
                check,
                self.gpu.sms,
            )
            .map_err(|m| unsupported(name, m))?;
            self.launch(name, &launch)?;
        }
        Ok(Array::from_device_storage(out, shape))
    }

    /// index_add and scatter_add: a copy of the base, then atomic adds.
    pub(super) fn add_indexed(
        &self,
        op: &Op,
        inputs: &[&Array],
        dim: usize,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Array> {
        let name = op.name();
        let basis = self.on_device(inputs[0])?;
        let idx = self.on_device(inputs[1])?;
        let src = self.on_device(inputs[2])?;
        let check = self.index_check(name, &idx, &basis, shape[dim])?;
        let out = self.contiguous(name, &basis)?;
        let iter: Vec<usize> = match op {
            Op::IndexAdd { .. } => src.shape().to_vec(),
            _ => idx.shape().to_vec(),
        };
        if iter.iter().product::<usize>() > 0 {
            let mut ds = contiguous_strides(shape);
            let dim_stride = std::mem::replace(&mut ds[dim], 0);
            let istrides = match op {
                Op::IndexAdd { .. } => one_hot_stride(iter.len(), dim, idx.strides()[0]),
                _ => idx.strides().to_vec(),
            };
            let s = Strided {
                dtype,
                ptr: base(&src),
                offset: src.layout().offset,
                strides: src.strides().to_vec(),
            };
            let index = Strided {
                dtype: idx.dtype(),
                ptr: base(&idx),
                offset: idx.layout().offset,
                strides: istrides,
            };
            let dst = Strided {
                dtype,
                ptr: base(&out),
                offset: 0,
                strides: ds,
            };
            let launch = index::indexed(
                Indexed::Add,
                &iter,
                &s,
                &index,
                &dst,
                dim_stride,
                check,
                self.gpu.sms,
            )
            .map_err(|m| unsupported(name, m))?;
            self.launch(name, &launch)?;
        }
        Ok(out)
    }
}

impl CudaBackend {
    /// How the kernel of `op` checks `index` against `bound` (the size of
    /// the dim it indexes in `x`): the site its report names, noted now
    /// with the operands and the user's line.
    fn index_check(&self, op: &str, index: &Array, x: &Array, bound: usize) -> Result<IndexCheck> {
        if !matches!(index.dtype(), DType::I32 | DType::I64) {
            return Err(Error::op(
                ErrorKind::DType,
                op,
                format!("indices must be i64 or i32, got {}", index.dtype()),
            ));
        }
        let site = self.gpu.errors.site(index_site(op, index, x, bound));
        Ok(IndexCheck {
            bound,
            site,
            report: self.gpu.errors.device,
        })
    }
}

/// What a report of a bad index names: the op, the dim's size, the
/// operands and, for an eager op, the user's line.
fn index_site(op: &str, index: &Array, x: &Array, bound: usize) -> Site {
    let at = launched_at();
    Site {
        op: op.to_string(),
        check: Check::Index(format!("out of range for a dim of size {bound}")),
        context: format!(
            "indices {} {:?} into {} {:?}{at}",
            index.dtype(),
            index.shape(),
            x.dtype(),
            x.shape()
        ),
    }
}

/// Strides over `rank` dims that are zero except `stride` at `dim`.
fn one_hot_stride(rank: usize, dim: usize, stride: usize) -> Vec<usize> {
    let mut s = vec![0; rank];
    s[dim] = stride;
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_index_report_names_the_op_the_dim_the_operands_and_the_line() {
        use tessera::runtime::cpu::Storage;
        let array = |dtype, shape: &[usize]| {
            let n = shape.iter().product();
            Array::from_storage(Storage::try_new(dtype, n).unwrap(), shape)
        };
        let (idx, x) = (array(DType::I64, &[2, 3]), array(DType::BF16, &[7, 4]));
        let site = index_site("gather", &idx, &x, 7);
        assert_eq!(site.op, "gather");
        assert_eq!(
            site.check,
            Check::Index("out of range for a dim of size 7".into())
        );
        assert_eq!(
            site.context,
            "indices i64 [2, 3] into bf16 [7, 4] in a compiled run"
        );
        let here = std::panic::Location::caller();
        let eager = tessera::error::dispatching(here, || index_site("gather", &idx, &x, 7));
        assert!(
            eager.context.ends_with(&format!(
                "at {}",
                tessera::error::SourceLoc::from_location(here)
            )),
            "{}",
            eager.context
        );
    }

    #[test]
    fn a_one_dim_index_is_read_through_one_stride() {
        assert_eq!(one_hot_stride(3, 1, 2), [0, 2, 0]);
        assert_eq!(one_hot_stride(1, 0, 1), [1]);
    }
}
