//! Joining and indexing kernels: cat, index_select, gather.
//!
//! The output is always a new contiguous tensor; inputs are read through
//! their layouts (no materialising copies of strided inputs).

use std::ops::Range;

use super::copy::{copy_strided, PAR_THRESHOLD};
use super::element::Element;
use super::reduce::for_chunks;
use super::Storage;
use crate::error::{op_err, Result};
use crate::ir::DType;
use crate::runtime::array::Array;
use crate::runtime::layout::Layout;
use crate::with_dtype;

/// `inputs` joined along `dim` into a tensor of `shape`.
pub fn cat(inputs: &[&Array], dim: usize, shape: &[usize]) -> Array {
    with_dtype!(inputs[0].dtype(), T => cat_typed::<T>(inputs, dim, shape))
}

/// The layout of `l`'s dims `dims` alone, at `offset`. Kernels here split
/// a layout into outer dims (whose index picks a block, at l's offset) and
/// block dims (copied whole with `copy_strided`, offset set per block).
fn sub_layout(l: &Layout, dims: Range<usize>, offset: usize) -> Layout {
    Layout {
        shape: l.shape[dims.clone()].to_vec(),
        strides: l.strides[dims].to_vec(),
        offset,
    }
}

/// Each output row (one index of the dims before `dim`) is the inputs'
/// blocks for that index, back to back.
fn cat_typed<T: Element>(inputs: &[&Array], dim: usize, shape: &[usize]) -> Array {
    let mut out = Storage::new(T::DTYPE, shape.iter().product());
    let row: usize = shape[dim..].iter().product();
    let dst = out.as_mut_slice::<T>();
    if !dst.is_empty() {
        let parts: Vec<(&[T], Layout, Layout)> = inputs
            .iter()
            .map(|t| {
                let l = t.layout();
                let outer = sub_layout(l, 0..dim, l.offset);
                (
                    t.storage().as_slice::<T>(),
                    outer,
                    sub_layout(l, dim..l.rank(), 0),
                )
            })
            .collect();
        let rows_per_task = (PAR_THRESHOLD / row).max(1);
        let parallel = dst.len() >= PAR_THRESHOLD && dst.len() > rows_per_task * row;
        for_chunks(dst, rows_per_task * row, parallel, |c, chunk| {
            let mut blocks: Vec<Layout> = parts.iter().map(|p| p.2.clone()).collect();
            for (r, out_row) in chunk.chunks_mut(row).enumerate() {
                let mut rest = out_row;
                for ((data, outer, _), block) in parts.iter().zip(&mut blocks) {
                    let (seg, tail) = rest.split_at_mut(block.numel());
                    block.offset = outer.offset_of(c * rows_per_task + r);
                    copy_strided(data, block, seg);
                    rest = tail;
                }
            }
        });
    }
    Array::from_storage(out, shape)
}

/// The entries of the i64/i32 `index` in row-major order, each checked to
/// lie in `0..size` (the extent of `dim` it indexes).
fn read_indices(op: &str, index: &Array, dim: usize, size: usize) -> Result<Vec<usize>> {
    let values: Vec<i64> = match index.dtype() {
        DType::I64 => index.to_vec::<i64>()?,
        DType::I32 => index.to_vec::<i32>()?.into_iter().map(i64::from).collect(),
        d => return Err(op_err!(DType, op, "index must be i64 or i32, got {d}")),
    };
    values
        .into_iter()
        .map(|v| {
            usize::try_from(v)
                .ok()
                .filter(|&i| i < size)
                .ok_or_else(|| {
                    op_err!(
                        Argument,
                        op,
                        "index {v} is out of bounds for dim {dim} with size {size}"
                    )
                })
        })
        .collect()
}

/// The slices of `x` at positions `index` along `dim`.
pub fn index_select(x: &Array, index: &Array, dim: usize) -> Result<Array> {
    let idx = read_indices("index_select", index, dim, x.shape()[dim])?;
    Ok(with_dtype!(x.dtype(), T => select_typed::<T>(x, &idx, dim)))
}

/// The output is `outer × idx.len()` blocks, each one slice of x after
/// `dim`; block `g` is slice `idx[g % n]` of outer index `g / n`.
fn select_typed<T: Element>(x: &Array, idx: &[usize], dim: usize) -> Array {
    let mut shape = x.shape().to_vec();
    shape[dim] = idx.len();
    let mut out = Storage::new(T::DTYPE, shape.iter().product());
    let dst = out.as_mut_slice::<T>();
    if !dst.is_empty() {
        let l = x.layout();
        let outer = sub_layout(l, 0..dim, l.offset);
        let slice = sub_layout(l, dim + 1..l.rank(), 0);
        let (n, stride) = (idx.len(), x.strides()[dim]);
        let data = x.storage().as_slice::<T>();
        let len = slice.numel();
        let per_task = (PAR_THRESHOLD / len).max(1);
        let parallel = dst.len() >= PAR_THRESHOLD && dst.len() > per_task * len;
        for_chunks(dst, per_task * len, parallel, |c, chunk| {
            let mut slice = slice.clone();
            for (j, seg) in chunk.chunks_mut(len).enumerate() {
                let g = c * per_task + j;
                slice.offset = outer.offset_of(g / n) + idx[g % n] * stride;
                copy_strided(data, &slice, seg);
            }
        });
    }
    Array::from_storage(out, &shape)
}

/// torch.gather: `out[i][j] = x[index[i][j]][j]` for dim 0, and likewise
/// for other dims; the output has the index's shape.
pub fn gather(x: &Array, index: &Array, dim: usize) -> Result<Array> {
    let idx = read_indices("gather", index, dim, x.shape()[dim])?;
    Ok(with_dtype!(x.dtype(), T => gather_typed::<T>(x, &idx, dim, index.shape())))
}

/// `base` maps an output position to x's offset with the `dim` coordinate
/// zeroed (x's strides over the index's shape); the index adds the rest.
fn gather_typed<T: Element>(x: &Array, idx: &[usize], dim: usize, shape: &[usize]) -> Array {
    let mut out = Storage::new(T::DTYPE, idx.len());
    let dst = out.as_mut_slice::<T>();
    if !dst.is_empty() {
        let mut strides = x.strides().to_vec();
        let stride = std::mem::replace(&mut strides[dim], 0);
        let base = Layout {
            shape: shape.to_vec(),
            strides,
            offset: x.layout().offset,
        };
        let (len, step) = (shape[shape.len() - 1], base.strides[shape.len() - 1]);
        let data = x.storage().as_slice::<T>();
        let rows_per_task = (PAR_THRESHOLD / len).max(1);
        let parallel = dst.len() >= PAR_THRESHOLD && dst.len() > rows_per_task * len;
        for_chunks(dst, rows_per_task * len, parallel, |c, chunk| {
            let first = c * rows_per_task * len;
            for (r, row) in chunk.chunks_mut(len).enumerate() {
                let p = first + r * len;
                let start = base.offset_of(p);
                for (j, o) in row.iter_mut().enumerate() {
                    *o = data[start + j * step + idx[p + j] * stride];
                }
            }
        });
    }
    Array::from_storage(out, shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;

    fn permuted(t: &Tensor, perm: &[usize]) -> Tensor {
        Tensor::from_parts(t.storage().clone(), t.layout().permuted(perm))
    }

    /// A `shape` tensor whose element at (i, j, k) is `base + 10⁴i + 10²j + k`,
    /// stored with its dims in reverse order (a non-contiguous view).
    fn coded(base: f64, shape: [usize; 3]) -> Tensor {
        let mut phys = Vec::new();
        for k in 0..shape[2] {
            for j in 0..shape[1] {
                for i in 0..shape[0] {
                    phys.push((base + code(i, j, k) as f64) as f32);
                }
            }
        }
        let t = Tensor::from_vec(phys, &[shape[2], shape[1], shape[0]]);
        let view = permuted(&t, &[2, 1, 0]);
        assert!(!view.is_contiguous());
        view
    }

    /// Unique for every coordinate below 100.
    fn code(i: usize, j: usize, k: usize) -> usize {
        10_000 * i + 100 * j + k
    }

    #[test]
    fn cat_each_dim_non_contiguous() {
        for dim in 0..3 {
            let mut sa = [2, 3, 4];
            let mut sb = [2, 3, 4];
            sa[dim] = 1;
            sb[dim] = 3;
            let (a, b) = (coded(0.0, sa), coded(1e6, sb));
            let mut shape = vec![2, 3, 4];
            shape[dim] = 4;
            let got = cat(&[a.array(), b.array()], dim, &shape)
                .to_vec::<f32>()
                .unwrap();
            let mut want = Vec::new();
            for i in 0..shape[0] {
                for j in 0..shape[1] {
                    for k in 0..shape[2] {
                        let c = [i, j, k];
                        let (base, mut c) = if c[dim] < 1 { (0, c) } else { (1_000_000, c) };
                        if base > 0 {
                            c[dim] -= 1;
                        }
                        want.push((base + code(c[0], c[1], c[2])) as f32);
                    }
                }
            }
            assert_eq!(got, want, "dim {dim}");
        }
    }

    #[test]
    fn cat_large_and_empty_inputs() {
        // Big enough to split over rayon tasks: [300, 200] ++ [300, 56] on dim 1.
        let a = Tensor::from_vec((0..300 * 200).map(|i| i as i64).collect(), &[300, 200]);
        let b = Tensor::from_vec((0..300 * 56).map(|i| -(i as i64)).collect(), &[300, 56]);
        let e = Tensor::from_vec(Vec::<i64>::new(), &[300, 0]);
        let got = cat(&[a.array(), e.array(), b.array()], 1, &[300, 256])
            .to_vec::<i64>()
            .unwrap();
        for r in [0, 1, 150, 299] {
            let row = &got[r * 256..][..256];
            assert!(row[..200]
                .iter()
                .enumerate()
                .all(|(c, &v)| v == (r * 200 + c) as i64));
            assert!(row[200..]
                .iter()
                .enumerate()
                .all(|(c, &v)| v == -((r * 56 + c) as i64)));
        }
        let bools = Tensor::from_vec(vec![1u8, 0], &[2]);
        assert_eq!(
            cat(&[bools.array(), bools.array()], 0, &[4])
                .to_vec::<u8>()
                .unwrap(),
            vec![1, 0, 1, 0]
        );
        assert_eq!(cat(&[e.array(), e.array()], 0, &[600, 0]).numel(), 0);
    }

    #[test]
    fn index_select_rows_and_columns() {
        let x = coded(0.0, [3, 4, 2]);
        let idx = Tensor::from_vec(vec![2i64, 0, 2], &[3]);
        let got = index_select(x.array(), idx.array(), 0).unwrap();
        assert_eq!(got.shape(), &[3, 4, 2]);
        let want: Vec<f32> = [2, 0, 2]
            .iter()
            .flat_map(|&i| (0..4).flat_map(move |j| (0..2).map(move |k| code(i, j, k) as f32)))
            .collect();
        assert_eq!(got.to_vec::<f32>().unwrap(), want);
        let idx = Tensor::from_vec(vec![3i32, 1], &[2]);
        let got = index_select(x.array(), idx.array(), 1).unwrap();
        assert_eq!(
            got.to_vec::<f32>().unwrap(),
            vec![
                300.0, 301.0, 100.0, 101.0, 10300.0, 10301.0, 10100.0, 10101.0, 20300.0, 20301.0,
                20100.0, 20101.0
            ]
        );
        let idx = Tensor::from_vec(vec![1i64], &[1]);
        assert_eq!(
            index_select(x.array(), idx.array(), 2)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            vec![
                1.0, 101.0, 201.0, 301.0, 10001.0, 10101.0, 10201.0, 10301.0, 20001.0, 20101.0,
                20201.0, 20301.0
            ]
        );
    }

    #[test]
    fn index_select_embedding_sized() {
        // An embedding lookup: 5000 ids into a [100, 16] table (parallel path).
        let table = Tensor::from_vec((0..1600).map(|i| i as f32).collect(), &[100, 16]);
        let ids: Vec<i64> = (0..5000).map(|i| (i * 37 % 100) as i64).collect();
        let got = index_select(
            table.array(),
            Tensor::from_vec(ids.clone(), &[5000]).array(),
            0,
        )
        .unwrap();
        let got = got.to_vec::<f32>().unwrap();
        for (n, &id) in ids.iter().enumerate() {
            assert_eq!(got[n * 16 + 5], (id * 16 + 5) as f32);
        }
    }

    #[test]
    fn bad_indices_are_errors() {
        let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
        for bad in [3i64, -1] {
            let idx = Tensor::from_vec(vec![0i64, bad], &[2]);
            let err = index_select(x.array(), idx.array(), 1).unwrap_err();
            let msg = err.to_string();
            assert!(
                msg.contains("index_select")
                    && msg.contains(&format!("index {bad}"))
                    && msg.contains("size 3"),
                "{msg}"
            );
            let gidx = Tensor::from_vec(vec![0i64, bad], &[1, 2]);
            let msg = gather(x.array(), gidx.array(), 1).unwrap_err().to_string();
            assert!(
                msg.contains("gather")
                    && msg.contains(&format!("index {bad}"))
                    && msg.contains("size 3"),
                "{msg}"
            );
        }
        let idx = Tensor::from_vec(vec![2i32], &[1]);
        assert!(index_select(x.array(), idx.array(), 0)
            .unwrap_err()
            .to_string()
            .contains("size 2"));
    }

    #[test]
    fn gather_like_torch() {
        // torch.gather(torch.tensor([[1,2],[3,4]]), 1, torch.tensor([[0,0],[1,0]]))
        let x = Tensor::from_vec(vec![1i64, 2, 3, 4], &[2, 2]);
        let idx = Tensor::from_vec(vec![0i64, 0, 1, 0], &[2, 2]);
        assert_eq!(
            gather(x.array(), idx.array(), 1)
                .unwrap()
                .to_vec::<i64>()
                .unwrap(),
            vec![1, 1, 4, 3]
        );
        // Along dim 0: out[i][j] = x[idx[i][j]][j] -> [[3, 2], [1, 4], [3, 4]].
        let idx0 = Tensor::from_vec(vec![1i32, 0, 0, 1, 1, 1], &[3, 2]);
        assert_eq!(
            gather(x.array(), idx0.array(), 0)
                .unwrap()
                .to_vec::<i64>()
                .unwrap(),
            vec![3, 2, 1, 4, 3, 4]
        );
        // An index smaller than x in the other dims, on a transposed x.
        let xt = permuted(
            &Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]),
            &[1, 0],
        );
        // xt = [[1, 3, 5], [2, 4, 6]]
        let idx = Tensor::from_vec(vec![2i64, 0], &[1, 2]);
        assert_eq!(
            gather(xt.array(), idx.array(), 1)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            vec![5.0, 1.0]
        );
        let idx = Tensor::from_vec(vec![1i64, 0], &[1, 2]);
        assert_eq!(
            gather(xt.array(), idx.array(), 0)
                .unwrap()
                .to_vec::<f32>()
                .unwrap(),
            vec![2.0, 3.0]
        );
        // A transposed index over a 3-D x, big enough for the parallel path.
        let x = coded(0.0, [8, 64, 70]);
        let phys: Vec<i64> = (0..8 * 64 * 70).map(|p| (p * 7 % 64) as i64).collect();
        let idx = permuted(&Tensor::from_vec(phys, &[70, 64, 8]), &[2, 1, 0]);
        let iv = idx.to_vec::<i64>().unwrap();
        let got = gather(x.array(), idx.array(), 1)
            .unwrap()
            .to_vec::<f32>()
            .unwrap();
        for (p, (&g, &j)) in got.iter().zip(&iv).enumerate() {
            let (i, k) = (p / (64 * 70), p % 70);
            assert_eq!(g, code(i, j as usize, k) as f32, "at {p}");
        }
    }
}
