//! Products through cuBLASLt: each operand read in place as a batch of
//! matrices with one batch stride where its layout allows, else copied
//! (contiguous) into scratch first.

use tessera::error::Result;
use tessera::ir::{DType, Op};
use tessera::runtime::array::Array;
use tessera::runtime::cpu::arena;
use tessera::tensor::Layout;

use super::{base, device_err, first, ViewExt};
use crate::codegen::int_matmul::{int_matmul, Matrices};
use crate::matmul::{Epilogue, Mat};
use crate::CudaBackend;

impl CudaBackend {
    /// `a·b` (either transposed) into a new tensor of `shape`, with an
    /// optional bias (a vector over the last dim) and activation.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul(
        &self,
        name: &str,
        a: &Array,
        b: &Array,
        ta: bool,
        tb: bool,
        shape: &[usize],
        bias: Option<&Array>,
        epilogue: Epilogue,
    ) -> Result<Array> {
        let dtype = a.dtype();
        let la = matrix_layout(a.layout(), ta, true);
        let lb = matrix_layout(b.layout(), tb, false);
        let (ra, rb) = (la.rank(), lb.rank());
        let (m, k, n) = (la.shape[ra - 2], la.shape[ra - 1], lb.shape[rb - 1]);
        let batch_shape = broadcast(&la.shape[..ra - 2], &lb.shape[..rb - 2]);
        let batch: usize = batch_shape.iter().product();
        if k == 0 && batch * m * n > 0 {
            // Zeros, allocated as the product would be (its planned place).
            let zero = self.eval_op(
                &Op::Full {
                    value: tessera::ir::Scalar::Float(0.0),
                    shape: tessera::ir::Shape::from_concrete(shape),
                    dtype,
                },
                &[],
                dtype,
                shape,
            )?;
            return Ok(zero);
        }
        let out = self.empty(dtype, batch * m * n)?;
        let result = Array::from_device_storage(out, shape);
        if batch * m * n == 0 {
            return Ok(result);
        }
        // Operands that cuBLASLt cannot read in place are copied
        // (contiguous): the kernel's scratch, after its output
        // (`matmul_scratch_bytes` says how much).
        let mut keep: Vec<Array> = Vec::new();
        let mut operand = |t: &Array, l: Layout, rows: usize, cols: usize| -> Result<Mat> {
            let full: Vec<usize> = batch_shape.iter().copied().chain([rows, cols]).collect();
            let e = l.expanded(&full);
            if let Some(mat) = as_mat(&e, base(t), dtype) {
                return Ok(mat);
            }
            let view = t.view_with_layout(e.clone());
            let c = arena::scratch(|| self.contiguous(name, &view))?;
            let mat = as_mat(c.layout(), base(&c), dtype).expect("a contiguous batch of matrices");
            keep.push(c);
            Ok(mat)
        };
        let mut ma = operand(a, la, m, k)?;
        let mb = operand(b, lb, k, n)?;
        let (mut batch_n, mut m_n) = (batch, m);
        // A shared right operand: fold the batch into the rows of A.
        if batch > 1
            && mb.batch_stride == 0
            && ma.col_stride == 1
            && ma.batch_stride == m * ma.row_stride
        {
            ma.rows = batch * m;
            m_n = batch * m;
            batch_n = 1;
        }
        if dtype.is_int() {
            // Integer products run a generated kernel, not cuBLASLt; it
            // has no epilogue (fusion forms those on floats only).
            if bias.is_some() || epilogue != Epilogue::None {
                return Err(device_err(
                    name,
                    format!("an integer ({dtype}) product takes no bias or activation epilogue"),
                ));
            }
            let matrices = |x: &Mat| Matrices {
                ptr: x.ptr,
                strides: [x.batch_stride, x.row_stride, x.col_stride],
            };
            let launch = int_matmul(
                dtype,
                batch_n,
                (m_n, k, n),
                matrices(&ma),
                matrices(&mb),
                base(&result),
                self.gpu.sms,
            );
            self.launch(name, &launch)?;
            drop(keep);
            return Ok(result);
        }
        let bias_ptr = bias.map(first);
        self.blas
            .gemm(
                &self.gpu,
                dtype,
                batch_n,
                ma,
                mb,
                base(&result),
                bias_ptr,
                epilogue,
            )
            .map_err(|msg| {
                device_err(
                    name,
                    format!("{msg} (a {:?}, b {:?}, m {m_n})", a.shape(), b.shape()),
                )
            })?;
        drop(keep);
        Ok(result)
    }
}

/// An operand's layout as a batch of matrices: the last two dims swapped
/// when transposed; a vector made a row (`a`) or a column (`b`).
fn matrix_layout(l: &Layout, transposed: bool, is_a: bool) -> Layout {
    let mut l = l.clone();
    if l.rank() == 1 {
        let (n, s) = (l.shape[0], l.strides[0]);
        l = if is_a {
            Layout {
                shape: vec![1, n],
                strides: vec![n * s.max(1), s],
                offset: l.offset,
            }
        } else {
            Layout {
                shape: vec![n, 1],
                strides: vec![s, 1],
                offset: l.offset,
            }
        };
    }
    if transposed {
        let r = l.rank();
        l.shape.swap(r - 2, r - 1);
        l.strides.swap(r - 2, r - 1);
    }
    l
}

/// NumPy broadcasting of two batch shapes (already checked by inference).
fn broadcast(a: &[usize], b: &[usize]) -> Vec<usize> {
    let r = a.len().max(b.len());
    (0..r)
        .map(|i| {
            let x = if i + a.len() >= r {
                a[i + a.len() - r]
            } else {
                1
            };
            let y = if i + b.len() >= r {
                b[i + b.len() - r]
            } else {
                1
            };
            x.max(y)
        })
        .collect()
}

/// A batch of matrices (`layout` = batch dims ++ [rows, cols]) as one
/// uniform batch stride, if its batch dims collapse to one.
fn as_mat(layout: &Layout, base: u64, dtype: DType) -> Option<Mat> {
    let r = layout.rank();
    let (rows, cols) = (layout.shape[r - 2], layout.shape[r - 1]);
    let mut batch_stride: Option<usize> = None;
    let mut expected: Option<usize> = None;
    for d in (0..r - 2).rev() {
        let (n, s) = (layout.shape[d], layout.strides[d]);
        if n == 1 {
            continue;
        }
        match expected {
            None => batch_stride = Some(s),
            Some(e) if e == s => {}
            Some(_) => return None,
        }
        expected = Some(s * n);
    }
    let mat = Mat {
        ptr: base + (layout.offset * dtype.size_bytes()) as u64,
        rows,
        cols,
        row_stride: layout.strides[r - 2],
        col_stride: layout.strides[r - 1],
        batch_stride: batch_stride.unwrap_or(0),
    };
    mat.direct().then_some(mat)
}

/// The bytes of the operand copies `CudaBackend::matmul` makes for `a·b`
/// (either transposed): an operand whose matrices, broadcast over the
/// batch, `as_mat` cannot read is copied whole, the second copy placed at
/// the 64-byte boundary after the first (as `arena::scratch` places them).
pub(super) fn scratch_bytes(inputs: &[(&Layout, DType, usize)], ta: bool, tb: bool) -> usize {
    let dtype = inputs[0].1;
    let la = matrix_layout(inputs[0].0, ta, true);
    let lb = matrix_layout(inputs[1].0, tb, false);
    let (ra, rb) = (la.rank(), lb.rank());
    let (m, k, n) = (la.shape[ra - 2], la.shape[ra - 1], lb.shape[rb - 1]);
    let batch_shape = broadcast(&la.shape[..ra - 2], &lb.shape[..rb - 2]);
    if k == 0 || batch_shape.iter().product::<usize>() * m * n == 0 {
        return 0;
    }
    let copy = |l: &Layout, rows: usize, cols: usize| -> usize {
        let full: Vec<usize> = batch_shape.iter().copied().chain([rows, cols]).collect();
        match as_mat(&l.expanded(&full), 0, dtype) {
            Some(_) => 0,
            None => full.iter().product::<usize>() * dtype.size_bytes(),
        }
    };
    match (copy(&la, m, k), copy(&lb, k, n)) {
        (0, one) | (one, 0) => one,
        (a, b) => a.div_ceil(64) * 64 + b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_dims_collapse_to_one_stride_or_refuse() {
        // [2, 3, 4, 5] contiguous: batch stride 20 over 6 matrices.
        let l = Layout::contiguous(&[2, 3, 4, 5]);
        let m = as_mat(&l, 0, DType::F32).unwrap();
        assert_eq!((m.batch_stride, m.row_stride, m.col_stride), (20, 5, 1));
        // A permuted batch ([3, 2] of a [2, 3] batch) does not collapse.
        let p = l.permuted(&[1, 0, 2, 3]);
        assert!(as_mat(&p, 0, DType::F32).is_none());
        // A broadcast batch: stride 0.
        let e = Layout::contiguous(&[4, 5]).expanded(&[6, 4, 5]);
        assert_eq!(as_mat(&e, 0, DType::F32).unwrap().batch_stride, 0);
    }

    #[test]
    fn vectors_become_rows_or_columns_and_transposes_swap_the_last_dims() {
        let v = Layout::contiguous(&[5]);
        let a = matrix_layout(&v, false, true);
        assert_eq!((a.shape, a.strides), (vec![1, 5], vec![5, 1]));
        let b = matrix_layout(&v, false, false);
        assert_eq!((b.shape, b.strides), (vec![5, 1], vec![1, 1]));
        let t = matrix_layout(&Layout::contiguous(&[2, 3, 4]), true, true);
        assert_eq!((t.shape, t.strides), (vec![2, 4, 3], vec![12, 1, 4]));
    }

    #[test]
    fn batch_shapes_broadcast_from_the_right() {
        assert_eq!(broadcast(&[2, 1, 4], &[3, 1]), [2, 3, 4]);
        assert_eq!(broadcast(&[], &[6]), [6]);
        assert_eq!(broadcast(&[], &[]), Vec::<usize>::new());
    }

    #[test]
    fn only_operands_cublas_cannot_read_are_copied_into_scratch() {
        let dense = |s: &[usize]| Layout::contiguous(s);
        let bytes = |a: &Layout, b: &Layout, d: DType, ta, tb| {
            scratch_bytes(&[(a, d, a.numel()), (b, d, b.numel())], ta, tb)
        };
        // Dense, transposed in the op, or a shared right operand: none.
        assert_eq!(
            bytes(
                &dense(&[8, 4, 5]),
                &dense(&[5, 3]),
                DType::F32,
                false,
                false
            ),
            0
        );
        assert_eq!(
            bytes(&dense(&[4, 5]), &dense(&[3, 5]), DType::BF16, false, true),
            0
        );
        // A permuted batch is copied whole (f32: 4 bytes an element).
        let p = dense(&[3, 2, 4, 5]).permuted(&[1, 0, 2, 3]);
        assert_eq!(
            bytes(&p, &dense(&[5, 1]), DType::F32, false, false),
            2 * 3 * 4 * 5 * 4
        );
        // An empty product needs nothing.
        assert_eq!(bytes(&p, &dense(&[5, 0]), DType::F32, false, false), 0);
    }
}
