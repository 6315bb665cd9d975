//! Materialising strided views: `contiguous` and copying `reshape`.

use std::borrow::Cow;

use rayon::prelude::*;

use super::super::array::Array;
use super::super::layout::Layout;
use super::Storage;
use crate::with_dtype;

/// Work below this many elements runs on the calling thread: a rayon fork
/// costs more than it saves.
pub const PAR_THRESHOLD: usize = 1 << 15;

/// Whether a view with `layout` over a storage of `storage_numel` elements
/// is the whole storage in row-major order (then it needs no copy).
pub fn is_dense(layout: &Layout, storage_numel: usize) -> bool {
    layout.is_contiguous() && layout.offset == 0 && layout.numel() == storage_numel
}

/// A row-major dense copy of `x`, or `x` itself (borrowed) when it already
/// is one.
pub fn contiguous(x: &Array) -> Cow<'_, Array> {
    match is_dense(x.layout(), x.storage().numel()) {
        true => Cow::Borrowed(x),
        false => Cow::Owned(dense_copy(x)),
    }
}

/// [`contiguous`] of an owned array: the array itself when it is dense.
pub fn into_contiguous(x: Array) -> Array {
    match is_dense(x.layout(), x.storage().numel()) {
        true => x,
        false => dense_copy(&x),
    }
}

fn dense_copy(x: &Array) -> Array {
    with_dtype!(x.dtype(), T => {
        let mut out = Storage::new(x.dtype(), x.numel());
        copy_strided(x.storage().as_slice::<T>(), x.layout(), out.as_mut_slice::<T>());
        Array::from_storage(out, x.shape())
    })
}

/// `reshape` as a view when the layout allows one, else a copy.
pub fn reshape(x: &Array, shape: &[usize]) -> Array {
    match x.layout().reshaped(shape) {
        Some(layout) => x.view(layout),
        None => {
            let c = contiguous(x);
            c.view(Layout::contiguous(shape))
        }
    }
}

/// Copies the elements `layout` selects from `src` into `dst` in row-major order.
pub fn copy_strided<T: Copy + Send + Sync>(src: &[T], layout: &Layout, dst: &mut [T]) {
    let numel = layout.numel();
    debug_assert_eq!(dst.len(), numel);
    if numel == 0 {
        return;
    }
    if let Some(range) = layout.contiguous_range() {
        dst.copy_from_slice(&src[range]);
        return;
    }
    let row = layout.shape.last().copied().unwrap_or(1);
    let stride = layout.strides.last().copied().unwrap_or(1);
    let copy_rows = |first_row: usize, out: &mut [T]| {
        for (r, out_row) in out.chunks_mut(row).enumerate() {
            let base = layout.offset_of((first_row + r) * row);
            if stride == 1 {
                out_row.copy_from_slice(&src[base..base + row]);
            } else {
                for (j, o) in out_row.iter_mut().enumerate() {
                    *o = src[base + j * stride];
                }
            }
        }
    };
    if numel < PAR_THRESHOLD {
        copy_rows(0, dst);
    } else {
        let rows_per_task = (PAR_THRESHOLD / row).max(1);
        dst.par_chunks_mut(rows_per_task * row)
            .enumerate()
            .for_each(|(i, chunk)| copy_rows(i * rows_per_task, chunk));
    }
}
