//! Scatter-add kernels: `index_add` and `scatter_add`, the gradients of
//! `index_select` and `gather`.

use std::borrow::Cow;

use half::{bf16, f16};

use super::element::{Int, U8};
use super::{copy, Element, Storage};
use crate::error::{op_err, Result};
use crate::ir::DType;
use crate::runtime::array::Array;
use crate::runtime::layout::Layout;
use crate::with_dtype;

/// Addition in the element type (f32 arithmetic for the half types; bool: or).
trait Accumulate: Element {
    fn add(self, other: Self) -> Self;
}

macro_rules! native_add {
    ($($t:ty),*) => {$(
        impl Accumulate for $t {
            #[inline]
            fn add(self, other: Self) -> Self {
                self + other
            }
        }
    )*};
}
native_add!(f32, f64);

macro_rules! wrapping_add {
    ($($t:ty),*) => {$(
        impl Accumulate for $t {
            #[inline]
            fn add(self, other: Self) -> Self {
                Int::wrapping_add(self, other)
            }
        }
    )*};
}
wrapping_add!(i64, i32, i16, i8, U8, u16, u32, u64);

impl Accumulate for f16 {
    fn add(self, other: Self) -> Self {
        f16::from_f32(self.to_f32() + other.to_f32())
    }
}

impl Accumulate for bf16 {
    fn add(self, other: Self) -> Self {
        bf16::from_f32(self.to_f32() + other.to_f32())
    }
}

impl Accumulate for u8 {
    fn add(self, other: Self) -> Self {
        self | other
    }
}

/// `x` with its elements in row-major order at `layout.offset..`: `x`
/// itself when contiguous, else a dense copy made as the kernel's scratch
/// (counted by [`scratch_bytes`], so the memory plan holds it). Kernels read
/// their index and source through this rather than copying them into
/// `Vec`s the allocator would not see.
fn row_major(x: &Array) -> Cow<'_, Array> {
    match x.is_contiguous() {
        true => Cow::Borrowed(x),
        false => super::arena::scratch(|| copy::contiguous(x)),
    }
}

/// Scratch bytes `index_add` and `scatter_add` allocate: a dense copy of
/// their index and of their source when strided (`inputs`: base, index,
/// source), each piece 64-byte aligned in the scratch region.
pub(super) fn scratch_bytes(inputs: &[(&Layout, DType, usize)]) -> usize {
    inputs[1..]
        .iter()
        .filter(|(l, _, _)| !l.is_contiguous())
        .map(|(l, d, _)| (l.numel() * d.size_bytes()).div_ceil(64) * 64)
        .sum()
}

/// The values of a row-major index tensor, checked against a bound.
enum Indices<'a> {
    I64(&'a [i64]),
    I32(&'a [i32]),
}

impl Indices<'_> {
    fn len(&self) -> usize {
        match self {
            Indices::I64(v) => v.len(),
            Indices::I32(v) => v.len(),
        }
    }

    /// Index `i` (in range: checked by [`indices`]).
    #[inline]
    fn get(&self, i: usize) -> usize {
        match self {
            Indices::I64(v) => v[i] as usize,
            Indices::I32(v) => v[i] as usize,
        }
    }
}

/// The values of `index` (row-major, from [`row_major`]), checked against `bound`.
fn indices<'a>(op: &str, index: &'a Array, bound: usize) -> Result<Indices<'a>> {
    let values = match index.dtype() {
        DType::I32 => Indices::I32(index.contiguous_slice::<i32>().expect("row-major i32")),
        _ => Indices::I64(index.contiguous_slice::<i64>().expect("row-major i64")),
    };
    let bad = |v: i64| v < 0 || v as u64 >= bound as u64;
    let first_bad = match &values {
        Indices::I64(v) => v.iter().copied().find(|&v| bad(v)),
        Indices::I32(v) => v.iter().map(|&v| i64::from(v)).find(|&v| bad(v)),
    };
    if let Some(bad) = first_bad {
        return Err(op_err!(
            Argument,
            op,
            "index {bad} is out of range for a dim of size {bound}"
        ));
    }
    Ok(values)
}

/// A contiguous copy of `base` to accumulate into.
fn fresh_copy<T: Element>(base: &Array) -> Storage {
    let mut out = Storage::new(base.dtype(), base.numel());
    copy::copy_strided(
        base.storage().as_slice::<T>(),
        base.layout(),
        out.as_mut_slice::<T>(),
    );
    out
}

/// `torch.index_add(base, dim, index, src)`.
pub fn index_add(base: &Array, index: &Array, src: &Array, dim: usize) -> Result<Array> {
    let size = base.shape()[dim];
    let index = row_major(index);
    let idx = indices("index_add", &index, size)?;
    let outer: usize = base.shape()[..dim].iter().product();
    let inner: usize = base.shape()[dim + 1..].iter().product();
    let src = row_major(src);
    with_dtype!(base.dtype(), T => {
        let mut out = fresh_copy::<T>(base);
        let src = src.contiguous_slice::<T>().expect("row-major source");
        let dst = out.as_mut_slice::<T>();
        for o in 0..outer {
            for i in 0..idx.len() {
                let j = idx.get(i);
                let from = &src[(o * idx.len() + i) * inner..][..inner];
                let to = &mut dst[(o * size + j) * inner..][..inner];
                for (d, s) in to.iter_mut().zip(from) {
                    *d = d.add(*s);
                }
            }
        }
        Ok(Array::from_storage(out, base.shape()))
    })
}

/// `torch.scatter_add(base, dim, index, src)`.
pub fn scatter_add(base: &Array, index: &Array, src: &Array, dim: usize) -> Result<Array> {
    let index = row_major(index);
    let idx = indices("scatter_add", &index, base.shape()[dim])?;
    let strides = crate::runtime::layout::contiguous_strides(base.shape());
    let shape = index.shape();
    let src = row_major(src);
    with_dtype!(base.dtype(), T => {
        let mut out = fresh_copy::<T>(base);
        let src = src.contiguous_slice::<T>().expect("row-major source");
        let dst = out.as_mut_slice::<T>();
        let mut pos = vec![0usize; shape.len()];
        for (k, &value) in src.iter().enumerate().take(idx.len()) {
            let j = idx.get(k);
            let target: usize = pos
                .iter()
                .enumerate()
                .map(|(d, &p)| if d == dim { j } else { p } * strides[d])
                .sum();
            dst[target] = dst[target].add(value);
            // Advance the row-major position over the index's shape.
            for d in (0..shape.len()).rev() {
                pos[d] += 1;
                if pos[d] < shape[d] {
                    break;
                }
                pos[d] = 0;
            }
        }
        Ok(Array::from_storage(out, base.shape()))
    })
}

#[cfg(test)]
mod tests {
    use crate::Tensor;

    #[test]
    fn index_add_accumulates_repeated_indices() {
        let base = Tensor::from_vec(vec![0f32; 6], &[3, 2]);
        let idx = Tensor::from_vec(vec![2i64, 0, 2], &[3]);
        let src = Tensor::from_vec(vec![1f32, 2., 3., 4., 5., 6.], &[3, 2]);
        let out = base.index_add(0, &idx, &src);
        assert_eq!(out.to_vec::<f32>().unwrap(), vec![3., 4., 0., 0., 6., 8.]);
        let bad = Tensor::from_vec(vec![3i64, 0, 0], &[3]);
        let err = base.try_index_add(0, &bad, &src).unwrap_err().to_string();
        assert!(
            err.contains("index_add: index 3 is out of range for a dim of size 3"),
            "{err}"
        );
    }

    #[test]
    fn scatter_add_along_dim_1() {
        let base = Tensor::from_vec(vec![10i64, 20, 30, 40], &[2, 2]);
        let idx = Tensor::from_vec(vec![1i64, 1, 0, 1], &[2, 2]);
        let src = Tensor::from_vec(vec![1i64, 2, 3, 4], &[2, 2]);
        // row 0: [10, 20+1+2]; row 1: [30+3, 40+4]
        let out = base.scatter_add(1, &idx, &src);
        assert_eq!(out.to_vec::<i64>().unwrap(), vec![10, 23, 33, 44]);
    }
}
