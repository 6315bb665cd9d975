//! Indexing: gathers (`index_select`, `gather`), scatters with atomic adds
//! (`index_add`, `scatter_add`), and the triangles (`tril`, `triu`). Index
//! values are checked on the host first, as the CPU does: a kernel cannot
//! report a bad one.

use tessera::error::{Error, ErrorKind, Result};
use tessera::ir::{DType, Op};
use tessera::runtime::array::Array;
use tessera::tensor::layout::contiguous_strides;

use super::{base, unsupported};
use crate::codegen::index::{self, Indexed, Strided};
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
        check_indices(name, &idx, x.shape()[dim])?;
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
        check_indices(name, &idx, shape[dim])?;
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
                self.gpu.sms,
            )
            .map_err(|m| unsupported(name, m))?;
            self.launch(name, &launch)?;
        }
        Ok(out)
    }
}

/// Index values must be in `0..bound` (checked on the host, as the CPU
/// does: a kernel cannot report the error).
fn check_indices(op: &str, index: &Array, bound: usize) -> Result<()> {
    let host = index.to_host()?;
    let values: Vec<i64> = match host.dtype() {
        DType::I32 => host.to_vec::<i32>()?.into_iter().map(i64::from).collect(),
        DType::I64 => host.to_vec::<i64>()?,
        d => {
            return Err(Error::op(
                ErrorKind::DType,
                op,
                format!("indices must be i64 or i32, got {d}"),
            ))
        }
    };
    check_index_values(op, &values, bound)
}

/// Every value in `0..bound`, else an error naming the first that is not.
fn check_index_values(op: &str, values: &[i64], bound: usize) -> Result<()> {
    if let Some(bad) = values.iter().find(|&&v| v < 0 || v as usize >= bound) {
        return Err(Error::op(
            ErrorKind::Argument,
            op,
            format!("index {bad} is out of range for a dim of size {bound}"),
        ));
    }
    Ok(())
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
    fn indices_outside_the_dim_are_errors_that_name_them() {
        assert!(check_index_values("gather", &[0, 4, 2], 5).is_ok());
        assert!(check_index_values("gather", &[], 0).is_ok());
        let e = check_index_values("index_select", &[1, 5, -1], 5).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Argument);
        assert_eq!(
            e.to_string(),
            "index_select: index 5 is out of range for a dim of size 5"
        );
        let e = check_index_values("scatter_add", &[-1], 3).unwrap_err();
        assert!(e.to_string().contains("index -1"), "{e}");
        // Nothing is in range of an empty dim.
        assert!(check_index_values("gather", &[0], 0).is_err());
    }

    #[test]
    fn a_one_dim_index_is_read_through_one_stride() {
        assert_eq!(one_hot_stride(3, 1, 2), [0, 2, 0]);
        assert_eq!(one_hot_stride(1, 0, 1), [1]);
    }
}
