//! The size limit: the largest tensor tessera makes, defined and checked
//! here and nowhere else.
//!
//! A tensor — an eager value, a graph value, a tensor read from a file — has
//! at most [`MAX_ELEMENTS`] = 2^46 elements, where a dim of size 0 counts as
//! 1 (its *extent*, see [`extent`]): `[0, 2^62]` is refused although it
//! holds nothing, because the strides of its other dims (and any shape a
//! symbol bound from it builds) would still overflow.
//!
//! Why 2^46:
//! - Arithmetic. With every element count at most 2^46, a byte size is at
//!   most 2^49 (the widest dtype has 8 bytes), below `isize::MAX` (Rust's
//!   limit on one allocation) with a factor 2^14 to spare: a stride, an
//!   offset, `numel * size_bytes` and the sum of a few thousand byte sizes
//!   cannot overflow. Every count is also exact in an `f64` (2^53), which
//!   `arange` and the index arithmetic of some kernels rely on.
//! - Nothing real is refused. 2^46 f32 elements are 256 TiB, the whole
//!   48-bit virtual address space of x86-64 and aarch64.
//!
//! The limit is checked where a size enters tessera: the type inference of
//! every op (`Op::infer`: eager ops, graph building, the verifier), tensors
//! made from the user's data (`Tensor::from_vec`, `.npy`, safetensors), the
//! graph text parser, symbolic shapes evaluated at run time, and host
//! storage allocation. Past those checks the size arithmetic of layouts and
//! kernels cannot overflow, so the inner loops carry no checks.
//!
//! A size within the limit may still not fit in memory: allocation is
//! fallible and reports `ErrorKind::OutOfMemory` (see
//! `runtime::cpu::alloc`).

use std::fmt::Display;

use crate::error::{Error, ErrorKind, Result};

/// The most elements one tensor may have (its [`extent`]): 2^46.
pub const MAX_ELEMENTS: usize = 1 << 46;

/// The most bytes one tensor may take: [`MAX_ELEMENTS`] of the widest
/// dtype (8 bytes), 2^49.
pub const MAX_BYTES: usize = MAX_ELEMENTS * 8;

/// The product of `dims` with each 0 counted as 1, or `None` when it passes
/// [`MAX_ELEMENTS`] (it never overflows while computing it).
pub fn extent(dims: &[usize]) -> Option<usize> {
    dims.iter().try_fold(1usize, |acc, &d| {
        acc.checked_mul(d.max(1)).filter(|&n| n <= MAX_ELEMENTS)
    })
}

/// The element count of `dims` when it is within the limit ([`extent`]).
pub fn numel(dims: &[usize]) -> Option<usize> {
    extent(dims)?;
    Some(dims.iter().product())
}

/// The element count of a tensor of `dtype` and `shape` made by `op`, or an
/// error naming `op`, the type (`f32[4294967296,4294967296]`) and the limit.
pub fn check(op: &str, dtype: impl Display, shape: &[usize]) -> Result<usize> {
    numel(shape).ok_or_else(|| too_large(op, dtype, shape))
}

/// The error for a shape past the limit.
fn too_large(op: &str, dtype: impl Display, dims: &[usize]) -> Error {
    let what = format!(
        "{dtype}[{}]",
        dims.iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(",")
    );
    // The exact count, which may not fit in a usize.
    let count = dims
        .iter()
        .fold(1u128, |acc, &d| acc.saturating_mul(d.max(1) as u128));
    let count = match count {
        u128::MAX => "more than 2^128".to_string(),
        n => n.to_string(),
    };
    let zero = match dims.contains(&0) {
        true => " (counting a 0 dim as 1)",
        false => "",
    };
    Error::op(
        ErrorKind::Shape,
        op,
        format!(
            "{what} is too large: {count} elements{zero}, more than the limit of \
             2^46 = {MAX_ELEMENTS} per tensor"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extent_counts_zero_dims_as_one_and_never_overflows() {
        assert_eq!(extent(&[]), Some(1));
        assert_eq!(extent(&[0, 5]), Some(5));
        assert_eq!(extent(&[1 << 23, 1 << 23]), Some(1 << 46));
        assert_eq!(extent(&[(1 << 23) + 1, 1 << 23]), None);
        assert_eq!(extent(&[0, 1 << 62]), None);
        assert_eq!(extent(&[1 << 32, 1 << 32]), None);
        assert_eq!(extent(&[usize::MAX, usize::MAX, 2]), None);
        assert_eq!(numel(&[0, 1 << 40]), Some(0));
        assert_eq!(numel(&[3, 4]), Some(12));
    }

    #[test]
    fn the_error_names_the_op_the_type_and_the_exact_count() {
        let e = check("full", "f32", &[1 << 32, 1 << 32]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Shape);
        let text = e.to_string();
        assert!(
            text.starts_with(
                "full: f32[4294967296,4294967296] is too large: 18446744073709551616 elements, \
                 more than the limit of 2^46"
            ),
            "{text}"
        );
        let e = check("zeros", "f64", &[0, 1 << 62]).unwrap_err();
        assert!(
            e.to_string()
                .contains("4611686018427387904 elements (counting a 0 dim as 1)"),
            "{e}"
        );
        assert_eq!(MAX_BYTES, 1 << 49);
        assert!(MAX_BYTES < isize::MAX as usize);
    }
}
