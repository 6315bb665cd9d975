//! Reductions (sum, mean, max, min, prod), arg-reductions and softmax.
//!
//! Floats accumulate in `Float::Acc` (f32 for f16/bf16, so half-precision
//! sums do not stall once the total outgrows the input precision); integers
//! accumulate in i64 and wrap on overflow. Sums are pairwise over blocks, so
//! an f32 sum of millions of elements stays accurate to a few ulps.
//!
//! Layout strategy for `reduce` (the kept dims index the output, the
//! reduced dims are folded):
//! - reduced elements contiguous (trailing dims of a contiguous tensor):
//!   each output folds one contiguous slice, outputs in parallel;
//! - else, the innermost kept dim has unit stride (e.g. dim 0 of `[N, M]`):
//!   whole rows of the input are folded into a row of accumulators, which
//!   vectorises and reads the input once, in order;
//! - else (reduced dims strided and kept dims strided): the reduced dims are
//!   permuted last and materialised with `copy::contiguous`, then the first
//!   case applies. One extra pass over the input beats a strided fold whose
//!   every element touches a new cache line.

use rayon::prelude::*;

use super::copy::{self, PAR_THRESHOLD};
use super::element::num_like::AccFloat;
use super::element::U8;
use super::element::{Element, Float};
use super::fastmath::exp_nonpositive_f32;
use super::stream::{prefetch, stream_copy, stream_min_bytes};
use super::Storage;
use crate::error::{op_err, Result};
use crate::ir::{ArgReduceOp, DType, ReduceOp};
use crate::runtime::array::Array;
use crate::runtime::layout::Layout;
use crate::{with_float_dtype, with_int_dtype};

/// Contiguous runs longer than this are summed in two halves on two rayon
/// tasks (a single huge row, e.g. a full reduction, still uses every core).
const PAR_SPLIT: usize = 1 << 16;
/// Pairwise summation bottoms out in blocks of this many elements.
const BLOCK: usize = 256;
/// Independent accumulators per block: breaks the add dependency chain so
/// the block vectorises, and spreads rounding error.
const LANES: usize = 8;
/// Accumulators of a [`fold_row`] (one row of a softmax or of a fused row
/// kernel): each adds at most `ROW_MAX / FOLD_WIDTH` terms in a chain. As
/// many as 16 vector registers hold: with fewer, LLVM unrolls the loop
/// completely and vectorises it at half width with shuffles (4x slower).
const FOLD_WIDTH: usize = 128;
/// The longest row folded by [`fold_row`]; longer contiguous runs are
/// summed pairwise over blocks (and on several tasks).
pub(crate) const ROW_MAX: usize = 1 << 14;
/// Rows per leaf of the row strategy's pairwise sum: each accumulator then
/// adds as many terms in a chain as a lane of a `BLOCK` does.
const ROW_BLOCK: usize = BLOCK / LANES;
/// The row strategy needs rows at least this long to pay for itself.
const MIN_ROW: usize = 8;
/// Column chunk width in the row strategy: the accumulator row stays in L1.
const COLS: usize = 1024;

/// The arithmetic a reduction runs in: f32, f64 or i64.
pub(crate) trait Arith: Copy + Send + Sync + PartialOrd {
    const ZERO: Self;
    const ONE: Self;
    const LOWEST: Self;
    const HIGHEST: Self;
    /// NaN, the result of max/min over nothing; `None` for integers.
    const NAN: Option<Self>;
    fn add(self, o: Self) -> Self;
    fn mul(self, o: Self) -> Self;
    fn is_nan(self) -> bool;
    fn div_count(self, n: usize) -> Self;

    /// NaN-propagating max (torch semantics; `f32::max` drops NaNs).
    #[inline(always)]
    fn max_nan(self, o: Self) -> Self {
        if self > o || self.is_nan() {
            self
        } else {
            o
        }
    }

    #[inline(always)]
    fn min_nan(self, o: Self) -> Self {
        if self < o || self.is_nan() {
            self
        } else {
            o
        }
    }
}

macro_rules! float_arith {
    ($t:ty) => {
        impl Arith for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const LOWEST: Self = <$t>::NEG_INFINITY;
            const HIGHEST: Self = <$t>::INFINITY;
            const NAN: Option<Self> = Some(<$t>::NAN);
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self * o
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
            fn div_count(self, n: usize) -> Self {
                self / n as $t
            }
        }
    };
}
float_arith!(f32);
float_arith!(f64);

macro_rules! int_arith {
    ($t:ty) => {
        impl Arith for $t {
            const ZERO: Self = 0;
            const ONE: Self = 1;
            const LOWEST: Self = <$t>::MIN;
            const HIGHEST: Self = <$t>::MAX;
            const NAN: Option<Self> = None;
            #[inline(always)]
            fn add(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            #[inline(always)]
            fn mul(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            #[inline(always)]
            fn is_nan(self) -> bool {
                false
            }
            fn div_count(self, n: usize) -> Self {
                self.checked_div(n as $t).unwrap_or(0)
            }
        }
    };
}
int_arith!(i64);
int_arith!(u64);

/// An element type that reduces in `Acc`.
pub(crate) trait Reducible: Element {
    type Acc: Arith;
    fn acc(self) -> Self::Acc;
    fn from_acc(a: Self::Acc) -> Self;
}

impl<T: Float> Reducible for T
where
    T::Acc: Arith,
{
    type Acc = T::Acc;
    #[inline(always)]
    fn acc(self) -> T::Acc {
        self.to_acc()
    }
    #[inline(always)]
    fn from_acc(a: T::Acc) -> T {
        T::from_acc(a)
    }
}

/// Integers accumulate in i64; narrowing the result back to i32 keeps the
/// low bits, i.e. wraps exactly as i32 arithmetic would have.
macro_rules! int_reducible {
    ($t:ty) => {
        impl Reducible for $t {
            type Acc = i64;
            #[inline(always)]
            fn acc(self) -> i64 {
                self as i64
            }
            #[inline(always)]
            fn from_acc(a: i64) -> $t {
                a as $t
            }
        }
    };
}
int_reducible!(i64);
int_reducible!(i32);
int_reducible!(i16);
int_reducible!(i8);
int_reducible!(u16);
int_reducible!(u32);

impl Reducible for U8 {
    type Acc = i64;
    #[inline(always)]
    fn acc(self) -> i64 {
        self.0 as i64
    }
    #[inline(always)]
    fn from_acc(a: i64) -> U8 {
        U8(a as u8)
    }
}

/// u64 reduces in u64: its values past i64's range order (max, min) and
/// divide (mean) as unsigned.
impl Reducible for u64 {
    type Acc = u64;
    #[inline(always)]
    fn acc(self) -> u64 {
        self
    }
    #[inline(always)]
    fn from_acc(a: u64) -> u64 {
        a
    }
}

/// `op` over `dims` of `x`. Errors for max/min of integers over an empty
/// extent (there is no value to return); for floats that case gives NaN.
pub fn reduce(op: ReduceOp, x: &Array, dims: &[usize], keepdim: bool) -> Result<Array> {
    if dims.is_empty() {
        return Ok(copy::contiguous(x).into_owned());
    }
    let shape = reduced_shape(x.shape(), dims, keepdim);
    with_float_dtype!(x.dtype(), T => reduce_typed::<T>(op, x, dims, &shape), _ => {
        with_int_dtype!(x.dtype(), T => reduce_typed::<T>(op, x, dims, &shape),
            _ => Err(op_err!(DType, op.name(), "is not defined for {}", x.dtype())))
    })
}

fn reduced_shape(shape: &[usize], dims: &[usize], keepdim: bool) -> Vec<usize> {
    (0..shape.len())
        .filter_map(|d| match (dims.contains(&d), keepdim) {
            (false, _) => Some(shape[d]),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect()
}

fn reduce_typed<T: Reducible>(
    op: ReduceOp,
    x: &Array,
    dims: &[usize],
    shape: &[usize],
) -> Result<Array> {
    let count: usize = dims.iter().map(|&d| x.shape()[d]).product();
    if count == 0 {
        return empty_reduction::<T>(op, x, shape);
    }
    type A<T> = <T as Reducible>::Acc;
    let out = match op {
        ReduceOp::Sum => fold_dims(x, dims, Fold::new(A::<T>::ZERO, A::<T>::add, T::from_acc)),
        ReduceOp::Mean => {
            let mean = |a: T::Acc| T::from_acc(a.div_count(count));
            fold_dims(x, dims, Fold::new(A::<T>::ZERO, A::<T>::add, mean))
        }
        ReduceOp::Prod => fold_dims(x, dims, Fold::new(A::<T>::ONE, A::<T>::mul, T::from_acc)),
        ReduceOp::Max => fold_dims(
            x,
            dims,
            Fold::new(A::<T>::LOWEST, A::<T>::max_nan, T::from_acc),
        ),
        ReduceOp::Min => fold_dims(
            x,
            dims,
            Fold::new(A::<T>::HIGHEST, A::<T>::min_nan, T::from_acc),
        ),
    };
    Ok(Array::from_storage(out, shape))
}

/// The result of reducing zero elements: sum 0, prod 1, mean NaN, and
/// max/min NaN for floats (torch raises; our IR accepts the shapes, so the
/// kernel answers NaN) or an error for integers.
fn empty_reduction<T: Reducible>(op: ReduceOp, x: &Array, shape: &[usize]) -> Result<Array> {
    let value = match op {
        ReduceOp::Sum => T::Acc::ZERO,
        ReduceOp::Prod => T::Acc::ONE,
        ReduceOp::Mean => T::Acc::ZERO.div_count(0),
        ReduceOp::Max | ReduceOp::Min => T::Acc::NAN.ok_or_else(|| {
            op_err!(
                Argument,
                op.name(),
                "cannot reduce {} over an empty dim: integers have no identity for {}",
                x.ty(),
                op.name()
            )
        })?,
    };
    // Straight into tracked, fallible storage: the output of an empty
    // reduction can be huge (`[2^40, 0].sum(1)`), and an untracked `vec!`
    // of that size would abort instead of failing as OutOfMemory.
    let numel = crate::limits::check(op.name(), T::DTYPE, shape)?;
    let mut out = Storage::try_new(T::DTYPE, numel)?;
    out.as_mut_slice::<T>().fill(T::from_acc(value));
    Ok(Array::from_storage(out, shape))
}

/// `x`'s layout split into the kept dims (carrying x's offset; they index
/// the output in row-major order) and the reduced dims (offset 0). Size-1
/// dims are dropped: they change neither the order nor the offsets.
struct Split {
    kept: Layout,
    reduced: Layout,
}

impl Split {
    fn new(l: &Layout, dims: &[usize]) -> Split {
        let pick = |reduced: bool, offset: usize| {
            let ds: Vec<usize> = (0..l.rank())
                .filter(|d| dims.contains(d) == reduced && l.shape[*d] != 1)
                .collect();
            Layout {
                shape: ds.iter().map(|&d| l.shape[d]).collect(),
                strides: ds.iter().map(|&d| l.strides[d]).collect(),
                offset,
            }
        };
        Split {
            kept: pick(false, l.offset),
            reduced: pick(true, 0),
        }
    }

    /// The length of the kept dims' innermost unit-stride row, if any.
    fn unit_row(&self) -> Option<usize> {
        let last = self.kept.rank().checked_sub(1)?;
        (self.kept.strides[last] == 1).then_some(self.kept.shape[last])
    }
}

/// One reduction: fold accumulators with `f` starting from `init`, then
/// map each result to the output element with `finish`.
struct Fold<A, F, G> {
    init: A,
    f: F,
    finish: G,
}

impl<A, F, G> Fold<A, F, G> {
    fn new(init: A, f: F, finish: G) -> Self {
        Fold { init, f, finish }
    }
}

/// Folds the elements of `x` over `dims`. See the module docs for the
/// three strategies.
fn fold_dims<T: Reducible, F, G>(x: &Array, dims: &[usize], fold: Fold<T::Acc, F, G>) -> Storage
where
    F: Fn(T::Acc, T::Acc) -> T::Acc + Sync + Send + Copy,
    G: Fn(T::Acc) -> T + Sync,
{
    let split = Split::new(x.layout(), dims);
    let mut out = Storage::new(T::DTYPE, split.kept.numel());
    let dst = out.as_mut_slice::<T>();
    if split.reduced.is_contiguous() {
        fold_slices(x.storage().as_slice::<T>(), &split, dst, &fold);
    } else if folds_by_rows(&split) {
        fold_rows(x.storage().as_slice::<T>(), &split, dst, &fold);
    } else {
        let dense = super::arena::scratch(|| reduced_dims_last(x, dims));
        let moved: Vec<usize> = (x.rank() - dims.len()..x.rank()).collect();
        let split = Split::new(dense.layout(), &moved);
        fold_slices(dense.storage().as_slice::<T>(), &split, dst, &fold);
    }
    out
}

fn folds_by_rows(split: &Split) -> bool {
    split.unit_row().is_some_and(|len| len >= MIN_ROW)
}

/// A contiguous copy of `x` with the kept dims first, then `dims`.
fn reduced_dims_last(x: &Array, dims: &[usize]) -> Array {
    copy::into_contiguous(x.view(kept_dims_first(x.layout(), dims)))
}

fn kept_dims_first(layout: &Layout, dims: &[usize]) -> Layout {
    let perm: Vec<usize> = (0..layout.rank())
        .filter(|d| !dims.contains(d))
        .chain(dims.iter().copied())
        .collect();
    layout.permuted(&perm)
}

/// Bytes [`reduce`] copies its input into besides its output: a dense copy
/// with the reduced dims last, where neither strided strategy applies.
pub(super) fn scratch_bytes(
    layout: &Layout,
    storage_numel: usize,
    dims: &[usize],
    dtype: DType,
) -> usize {
    let count: usize = dims.iter().map(|&d| layout.shape[d]).product();
    if dims.is_empty() || count == 0 {
        return 0;
    }
    let split = Split::new(layout, dims);
    let moved = kept_dims_first(layout, dims);
    let copies = !split.reduced.is_contiguous()
        && !folds_by_rows(&split)
        && !copy::is_dense(&moved, storage_numel);
    if copies {
        layout.numel() * dtype.size_bytes()
    } else {
        0
    }
}

/// Runs `f(chunk index, chunk)` over `out` in chunks of `size`, in parallel
/// when `parallel` (the shared loop of the reduction and indexing kernels).
pub(super) fn for_chunks<T: Send>(
    out: &mut [T],
    size: usize,
    parallel: bool,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    if parallel {
        out.par_chunks_mut(size)
            .enumerate()
            .for_each(|(i, c)| f(i, c));
    } else {
        out.chunks_mut(size).enumerate().for_each(|(i, c)| f(i, c));
    }
}

/// The slice strategy: the reduced elements of output `o` are the
/// contiguous run at `kept.offset_of(o)`.
fn fold_slices<T: Reducible, F, G>(
    data: &[T],
    split: &Split,
    dst: &mut [T],
    fold: &Fold<T::Acc, F, G>,
) where
    F: Fn(T::Acc, T::Acc) -> T::Acc + Sync + Send + Copy,
    G: Fn(T::Acc) -> T + Sync,
{
    let len = split.reduced.numel();
    let per_task = (PAR_THRESHOLD / len).max(1);
    let parallel = dst.len() * len >= PAR_THRESHOLD && dst.len() > 1;
    for_chunks(dst, per_task, parallel, |c, chunk| {
        for (j, o) in chunk.iter_mut().enumerate() {
            let start = split.kept.offset_of(c * per_task + j);
            let run = &data[start..start + len];
            *o = (fold.finish)(match as_acc_run::<T>(run) {
                Some(run) => row_fold(run, fold.init, fold.f),
                None => fold_slice(run, fold.init, T::acc, fold.f),
            });
        }
    });
}

/// Folds `xs` mapped through `map`: pairwise over blocks (accurate sums),
/// halves of long runs on two rayon tasks.
pub(crate) fn fold_slice<X, A, M, F>(xs: &[X], init: A, map: M, f: F) -> A
where
    X: Copy + Sync,
    A: Copy + Send + Sync,
    M: Fn(X) -> A + Sync + Copy,
    F: Fn(A, A) -> A + Sync + Copy,
{
    if xs.len() <= BLOCK {
        return fold_block(xs, init, map, f);
    }
    let (l, r) = xs.split_at(xs.len() / 2);
    let (a, b) = if xs.len() >= PAR_SPLIT {
        rayon::join(
            || fold_slice(l, init, map, f),
            || fold_slice(r, init, map, f),
        )
    } else {
        (fold_slice(l, init, map, f), fold_slice(r, init, map, f))
    };
    f(a, b)
}

#[inline(always)]
fn fold_block<X: Copy, A: Copy>(
    xs: &[X],
    init: A,
    map: impl Fn(X) -> A,
    f: impl Fn(A, A) -> A,
) -> A {
    let mut lanes = [init; LANES];
    let mut chunks = xs.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = f(*l, map(x));
        }
    }
    let [l0, l1, l2, l3, l4, l5, l6, l7] = lanes;
    let mut acc = f(f(f(l0, l1), f(l2, l3)), f(f(l4, l5), f(l6, l7)));
    for &x in chunks.remainder() {
        acc = f(acc, map(x));
    }
    acc
}

/// Folds a row of at most [`ROW_MAX`] elements into `FOLD_WIDTH`
/// accumulators, then halves them (pairs `i` and `i + w/2`) down to one.
/// Not inlined, so that it is compiled once, as a loop over a slice of
/// unknown length (see `FOLD_WIDTH`).
#[inline(never)]
fn fold_row<A: Copy>(xs: &[A], init: A, f: impl Fn(A, A) -> A) -> A {
    let mut acc = [init; FOLD_WIDTH];
    let mut chunks = xs.chunks_exact(FOLD_WIDTH);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = f(*a, x);
        }
    }
    let mut w = FOLD_WIDTH;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            acc[i] = f(acc[i], acc[i + w]);
        }
    }
    let mut r = acc[0];
    for &x in chunks.remainder() {
        r = f(r, x);
    }
    r
}

/// `run` as its accumulation type when it is one (f32, f64): such runs are
/// folded by [`row_fold`], as the fused row kernels fold their rows.
fn as_acc_run<T: Reducible>(run: &[T]) -> Option<&[T::Acc]> {
    matches!(T::DTYPE, DType::F32 | DType::F64)
        // SAFETY: f32 and f64 reduce in themselves (`Reducible for Float`).
        .then(|| unsafe { std::slice::from_raw_parts(run.as_ptr() as *const T::Acc, run.len()) })
}

/// The row strategy: the kept dims end in a unit-stride row of length
/// `len`; each reduced index contributes one such row, added elementwise
/// into a row of accumulators. Outputs are split into column chunks so the
/// accumulators stay in L1 and the chunks run in parallel.
fn fold_rows<T: Reducible, F, G>(
    data: &[T],
    split: &Split,
    dst: &mut [T],
    fold: &Fold<T::Acc, F, G>,
) where
    F: Fn(T::Acc, T::Acc) -> T::Acc + Sync + Send + Copy,
    G: Fn(T::Acc) -> T + Sync,
{
    let len = split.unit_row().unwrap_or(1);
    let outer = split.kept.rank() - 1;
    let prefix = Layout {
        shape: split.kept.shape[..outer].to_vec(),
        strides: split.kept.strides[..outer].to_vec(),
        offset: split.kept.offset,
    };
    let count = split.reduced.numel();
    let parallel = dst.len() * count >= PAR_THRESHOLD;
    for_chunks(dst, len, parallel, |o, out_row| {
        let base = prefix.offset_of(o);
        for_chunks(out_row, COLS, parallel, |c, out| {
            let mut acc = vec![fold.init; out.len()];
            let rows = Rows {
                data,
                reduced: &split.reduced,
                base: base + c * COLS,
            };
            rows.fold(0..count, &mut acc, fold.init, fold.f);
            for (o, &a) in out.iter_mut().zip(&acc) {
                *o = (fold.finish)(a);
            }
        });
    });
}

/// Rows `data[base + reduced.offset_of(r) ..][..acc.len()]` for reduced
/// indices `r`.
struct Rows<'a, T> {
    data: &'a [T],
    reduced: &'a Layout,
    base: usize,
}

impl<T: Reducible> Rows<'_, T> {
    /// Folds the rows of `range` into `acc`, pairwise over blocks of rows.
    fn fold<F>(&self, range: std::ops::Range<usize>, acc: &mut [T::Acc], init: T::Acc, f: F)
    where
        F: Fn(T::Acc, T::Acc) -> T::Acc + Copy,
    {
        if range.len() <= ROW_BLOCK {
            for r in range {
                let start = self.base + self.reduced.offset_of(r);
                let row = &self.data[start..start + acc.len()];
                for (a, &x) in acc.iter_mut().zip(row) {
                    *a = f(*a, x.acc());
                }
            }
            return;
        }
        let mid = range.start + range.len() / 2;
        self.fold(range.start..mid, acc, init, f);
        let mut right = vec![init; acc.len()];
        self.fold(mid..range.end, &mut right, init, f);
        for (a, &b) in acc.iter_mut().zip(&right) {
            *a = f(*a, b);
        }
    }
}

/// The i64 index of the max (min) along `dim`: the first on ties, and the
/// first NaN if there is one (NaN counts as both the max and the min, as in
/// torch). Errors when `dim` is empty but the output is not.
pub fn arg_reduce(op: ArgReduceOp, x: &Array, dim: usize, keepdim: bool) -> Result<Array> {
    let shape = reduced_shape(x.shape(), &[dim], keepdim);
    let numel: usize = shape.iter().product();
    if x.shape()[dim] == 0 && numel > 0 {
        return Err(op_err!(
            Argument,
            op.name(),
            "cannot reduce dim {dim} of {}: it is empty",
            x.ty()
        ));
    }
    let mut out = Storage::new(DType::I64, numel);
    let dst = out.as_mut_slice::<i64>();
    with_float_dtype!(x.dtype(), T => arg_typed::<T>(op, x, dim, dst), _ => {
        with_int_dtype!(x.dtype(), T => arg_typed::<T>(op, x, dim, dst),
            _ => return Err(op_err!(DType, op.name(), "is not defined for {}", x.dtype())))
    });
    Ok(Array::from_storage(out, &shape))
}

/// Scans each line along `dim` in place, strided: arg-reductions are not on
/// hot paths, and consecutive outputs share the cache lines they read.
fn arg_typed<T: Reducible>(op: ArgReduceOp, x: &Array, dim: usize, out: &mut [i64]) {
    let split = Split::new(x.layout(), &[dim]);
    let (len, stride) = (x.shape()[dim], x.strides()[dim]);
    let data = x.storage().as_slice::<T>();
    let better: fn(T::Acc, T::Acc) -> bool = match op {
        ArgReduceOp::ArgMax => |v, best| v > best,
        ArgReduceOp::ArgMin => |v, best| v < best,
    };
    let parallel = out.len() * len >= PAR_THRESHOLD;
    let per_task = (PAR_THRESHOLD / len.max(1)).max(1);
    for_chunks(out, per_task, parallel, |c, chunk| {
        for (j, o) in chunk.iter_mut().enumerate() {
            let base = split.kept.offset_of(c * per_task + j);
            let line = (0..len).map(|i| data[base + i * stride].acc());
            *o = arg_best(line, better) as i64;
        }
    });
}

fn arg_best<A: Arith>(mut line: impl Iterator<Item = A>, better: fn(A, A) -> bool) -> usize {
    let Some(mut best) = line.next() else {
        return 0;
    };
    let mut at = 0;
    if best.is_nan() {
        return 0;
    }
    for (i, v) in line.enumerate() {
        if v.is_nan() {
            return i + 1;
        }
        if better(v, best) {
            (best, at) = (v, i + 1);
        }
    }
    at
}

/// An `exp` for softmax, of arguments `x - max <= 0` (or NaN). f32 gets a
/// branch-free polynomial the compiler can vectorise (libm's `expf` is an
/// opaque call); f64 keeps `f64::exp`.
pub(crate) trait SoftmaxExp: AccFloat + Arith {
    fn softmax_exp(self) -> Self;
}

impl SoftmaxExp for f64 {
    #[inline(always)]
    fn softmax_exp(self) -> f64 {
        self.exp()
    }
}

impl SoftmaxExp for f32 {
    #[inline(always)]
    fn softmax_exp(self) -> f32 {
        exp_nonpositive_f32(self)
    }
}

/// softmax (or log_softmax with `log`) of `x` along `dim`, max-subtracted,
/// computed in `Float::Acc`. Rows of all -inf give NaN, like torch.
pub fn softmax(x: &Array, dim: usize, log: bool) -> Result<Array> {
    with_float_dtype!(x.dtype(), T => Ok(softmax_typed::<T>(x, dim, log)), _ => Err(op_err!(
        DType,
        if log { "log_softmax" } else { "softmax" },
        "is not defined for {}",
        x.ty()
    )))
}

fn softmax_typed<T: Float>(x: &Array, dim: usize, log: bool) -> Array
where
    T::Acc: SoftmaxExp,
{
    let x = super::arena::scratch(|| copy::contiguous(x));
    let src = x.contiguous_slice::<T>().expect("contiguous after copy");
    let len = x.shape()[dim];
    let inner: usize = x.shape()[dim + 1..].iter().product();
    let mut out = Storage::new(T::DTYPE, x.numel());
    if !src.is_empty() {
        softmax_blocks(src, out.as_mut_slice::<T>(), len, inner, log);
    }
    Array::from_storage(out, x.shape())
}

/// `src` and `dst` are non-empty `[outer, len, inner]` row-major. Rows along
/// the last dim (`inner == 1`) are independent lines, many per task; for an
/// inner dim, each `[len, inner]` block is processed as `inner` lines side
/// by side, one block per task.
fn softmax_blocks<T: Float>(src: &[T], dst: &mut [T], len: usize, inner: usize, log: bool)
where
    T::Acc: SoftmaxExp,
{
    let per_task = if inner == 1 {
        PAR_THRESHOLD.div_ceil(len) * len
    } else {
        len * inner
    };
    let parallel = dst.len() >= PAR_THRESHOLD && dst.len() > per_task;
    let stream = std::mem::size_of_val(dst) >= stream_min_bytes();
    for_chunks(dst, per_task, parallel, |c, out| {
        let src = &src[c * per_task..][..out.len()];
        if inner == 1 {
            let mut scratch = Vec::with_capacity(2 * len);
            let rows = out.len() / len;
            for (r, (x, o)) in src.chunks(len).zip(out.chunks_mut(len)).enumerate() {
                let io = RowIo {
                    stream,
                    prefetch_next: r + 1 < rows,
                };
                softmax_line(x, o, log, &mut scratch, io);
            }
        } else {
            softmax_lines(src, out, inner, log);
        }
    });
}

/// One contiguous line of `T`, through [`softmax_row`] in `T::Acc` (via
/// `scratch` unless `T` is its own `Acc`).
fn softmax_line<T: Float>(x: &[T], out: &mut [T], log: bool, scratch: &mut Vec<T::Acc>, io: RowIo)
where
    T::Acc: SoftmaxExp,
{
    let n = x.len();
    if let (Some(x), Some(out)) = (as_acc::<T>(x), as_acc_mut::<T>(out)) {
        // Only a streamed row uses the scratch (any contents will do).
        if io.stream && scratch.len() < n {
            scratch.resize(n, <T::Acc as Arith>::ZERO);
        }
        return softmax_row(x, out, log, scratch, io);
    }
    scratch.clear();
    scratch.extend(x.iter().map(|v| v.to_acc()));
    scratch.resize(2 * n, <T::Acc as Arith>::ZERO);
    let (src, dst) = scratch.split_at_mut(n);
    // The row is converted, so no longer where the next one follows; and
    // the conversion below writes the output anyway.
    softmax_row(src, dst, log, &mut [], RowIo::default());
    for (o, &v) in out.iter_mut().zip(dst.iter()) {
        *o = T::from_acc(v);
    }
}

/// `xs` as `&[T::Acc]` when `T` is its own accumulation type (f32, f64).
fn as_acc<T: Float>(xs: &[T]) -> Option<&[T::Acc]> {
    matches!(T::DTYPE, DType::F32 | DType::F64)
        // SAFETY: T is f32 with Acc f32, or f64 with Acc f64: the same type.
        .then(|| unsafe { std::slice::from_raw_parts(xs.as_ptr() as *const T::Acc, xs.len()) })
}

fn as_acc_mut<T: Float>(xs: &mut [T]) -> Option<&mut [T::Acc]> {
    (matches!(T::DTYPE, DType::F32 | DType::F64))
        // SAFETY: as in `as_acc`.
        .then(|| unsafe {
            std::slice::from_raw_parts_mut(xs.as_mut_ptr() as *mut T::Acc, xs.len())
        })
}

/// How a softmax row meets memory (the values are the same either way).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RowIo {
    /// Write the output with non-temporal stores (from a scratch row): the
    /// output is far larger than the caches.
    pub stream: bool,
    /// The next row to be processed follows this one in memory: prefetch it
    /// while this one is computed.
    pub prefetch_next: bool,
}

/// Lanes of the softmax row sweeps: independent accumulators (4 AVX-512 or
/// 8 AVX2 registers of f32) and the stride of the per-chunk prefetch. The
/// fold order is fixed by this number alone, so every vector width gives
/// the same bits.
const SOFTMAX_LANES: usize = 64;

/// softmax (or log_softmax) of one contiguous row, in the accumulation
/// type: the kernel both eager softmax and the fused row kernels run, so
/// their results agree bit for bit. The row is read from memory once (the
/// max), then swept in cache: exp(x - max) summed (and kept for softmax),
/// then the output written once, scaled by 1/sum or shifted by ln(sum).
/// With `io.stream`, `scratch` (at least the row's length) holds the
/// values before their non-temporal store, so the output's lines are never
/// read; otherwise `scratch` is not used.
pub(crate) fn softmax_row<A: SoftmaxExp>(
    x: &[A],
    out: &mut [A],
    log: bool,
    scratch: &mut [A],
    io: RowIo,
) {
    let n = x.len();
    if io.stream && scratch.len() >= n {
        softmax_row_dispatch(x, &mut scratch[..n], log, io.prefetch_next);
        stream_copy(out, &scratch[..n]);
    } else {
        softmax_row_dispatch(x, out, log, io.prefetch_next);
    }
}

super::fastmath::avx512_dispatch! {
    fn softmax_row_dispatch<A: SoftmaxExp>(x: &[A], out: &mut [A], log: bool, prefetch_next: bool) => softmax_row_body
}

#[inline(always)]
fn softmax_row_body<A: SoftmaxExp>(x: &[A], out: &mut [A], log: bool, prefetch_next: bool) {
    let max = row_max(x);
    let next = prefetch_next.then(|| x.as_ptr().wrapping_add(x.len()));
    if log {
        let ln_sum = exp_sum(x, max, None, next).ln();
        for (o, &v) in out.iter_mut().zip(x) {
            *o = (v - max) - ln_sum;
        }
    } else {
        let scale = <A as AccFloat>::ONE / exp_sum(x, max, Some(out), next);
        for o in out.iter_mut() {
            *o = *o * scale;
        }
    }
}

/// The max of a row by plain compares, NaN ignored: a NaN anywhere makes
/// the sum of exps NaN, hence the whole softmax row, as a NaN max would.
#[inline(always)]
fn row_max<A: SoftmaxExp>(x: &[A]) -> A {
    let mut lanes = [<A as Arith>::LOWEST; SOFTMAX_LANES];
    let mut chunks = x.chunks_exact(SOFTMAX_LANES);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut m = chunks
        .remainder()
        .iter()
        .fold(<A as Arith>::LOWEST, |m, &v| if v > m { v } else { m });
    for &l in &lanes {
        m = if l > m { l } else { m };
    }
    m
}

/// The sum of exp(x - max) over a row, each value also stored in `out`
/// when given; prefetches the row at `next` as it goes.
#[inline(always)]
fn exp_sum<A: SoftmaxExp>(x: &[A], max: A, out: Option<&mut [A]>, next: Option<*const A>) -> A {
    let zero = <A as Arith>::ZERO;
    let mut lanes = [zero; SOFTMAX_LANES];
    let whole = x.len() / SOFTMAX_LANES * SOFTMAX_LANES;
    let chunk_bytes = SOFTMAX_LANES * std::mem::size_of::<A>();
    let fetch = |i: usize| {
        if let Some(next) = next {
            prefetch(
                next.wrapping_add(i * SOFTMAX_LANES) as *const u8,
                chunk_bytes,
            );
        }
    };
    // Two loops rather than a test per chunk, so that each vectorises.
    let chunks = x[..whole].chunks_exact(SOFTMAX_LANES).enumerate();
    let mut sum = zero;
    match out {
        Some(out) => {
            for ((i, c), o) in chunks.zip(out.chunks_exact_mut(SOFTMAX_LANES)) {
                fetch(i);
                for ((l, d), &v) in lanes.iter_mut().zip(o).zip(c) {
                    let e = (v - max).softmax_exp();
                    *d = e;
                    *l = *l + e;
                }
            }
            for (d, &v) in out[whole..].iter_mut().zip(&x[whole..]) {
                *d = (v - max).softmax_exp();
                sum = sum + *d;
            }
        }
        None => {
            for (i, c) in chunks {
                fetch(i);
                for (l, &v) in lanes.iter_mut().zip(c) {
                    *l = *l + (v - max).softmax_exp();
                }
            }
            for &v in &x[whole..] {
                sum = sum + (v - max).softmax_exp();
            }
        }
    }
    if let Some(next) = next {
        let tail = (x.len() - whole) * std::mem::size_of::<A>();
        prefetch(next.wrapping_add(whole) as *const u8, tail);
    }
    // A fixed pairwise tree over the lanes.
    let mut w = SOFTMAX_LANES;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            lanes[i] = lanes[i] + lanes[i + w];
        }
    }
    lanes[0] + sum
}

/// A contiguous row's fold: [`fold_row`] up to [`ROW_MAX`] elements, the
/// pairwise [`fold_slice`] beyond.
fn row_fold<A: Arith>(xs: &[A], init: A, f: impl Fn(A, A) -> A + Sync + Copy) -> A {
    if xs.len() <= ROW_MAX {
        fold_row(xs, init, f)
    } else {
        fold_slice(xs, init, |v| v, f)
    }
}

/// One reduction of a contiguous row in its accumulation type: what eager
/// `reduce` computes for each contiguous run of f32/f64 (see
/// `fold_slices`), and the fused row kernels for each row.
pub(crate) fn reduce_row<A: Arith>(op: ReduceOp, row: &[A]) -> A {
    match op {
        ReduceOp::Sum => row_fold(row, A::ZERO, A::add),
        ReduceOp::Mean => row_fold(row, A::ZERO, A::add).div_count(row.len()),
        ReduceOp::Prod => row_fold(row, A::ONE, A::mul),
        ReduceOp::Max => row_fold(row, A::LOWEST, A::max_nan),
        ReduceOp::Min => row_fold(row, A::HIGHEST, A::min_nan),
    }
}

/// `inner` strided lines at once: `x` is `[len, inner]` row-major and the
/// lines are its columns. Each pass walks whole rows, so it vectorises
/// across lines. Softmax recomputes exp in the last pass rather than keep a
/// `[len, inner]` scratch buffer.
fn softmax_lines<T: Float>(x: &[T], out: &mut [T], inner: usize, log: bool)
where
    T::Acc: SoftmaxExp,
{
    let mut max = vec![T::Acc::LOWEST; inner];
    for row in x.chunks(inner) {
        for (m, &v) in max.iter_mut().zip(row) {
            *m = m.max_nan(v.to_acc());
        }
    }
    let mut sum = vec![<T::Acc as Arith>::ZERO; inner];
    for row in x.chunks(inner) {
        for ((s, &m), &v) in sum.iter_mut().zip(&max).zip(row) {
            *s = *s + (v.to_acc() - m).softmax_exp();
        }
    }
    if log {
        sum.iter_mut().for_each(|s| *s = s.ln());
    }
    for (row, orow) in x.chunks(inner).zip(out.chunks_mut(inner)) {
        for (((o, &v), &m), &s) in orow.iter_mut().zip(row).zip(&max).zip(&sum) {
            let shifted = v.to_acc() - m;
            *o = T::from_acc(if log {
                shifted - s
            } else {
                shifted.softmax_exp() / s
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::tensor::Tensor;
    #[test]
    fn streamed_softmax_rows_match_an_f64_reference() {
        // Enough rows that the output is streamed (through the scratch row)
        // and rows are prefetched; rows of odd length, with -inf, a NaN,
        // all -inf, and a huge spread.
        let len = 4099;
        let min = 1 << 20;
        let rows = min / (4 * len) + 3;
        let mut xs: Vec<f32> = (0..rows * len)
            .map(|i| ((i * 7919) % 3001) as f32 / 100.0 - 15.0)
            .collect();
        xs[len + 5] = f32::NEG_INFINITY;
        xs[2 * len + 7] = f32::NAN;
        xs[3 * len..4 * len].fill(f32::NEG_INFINITY);
        xs[4 * len + 1] = 1e30;
        let x = Tensor::from_vec(xs.clone(), &[rows, len]);
        for log in [false, true] {
            let run = || softmax(x.array(), 1, log).unwrap();
            let got = super::super::stream::with_stream_min_bytes(min, run)
                .to_vec::<f32>()
                .unwrap();
            for r in (0..rows).filter(|r| r % 97 < 6) {
                let row = &xs[r * len..(r + 1) * len];
                let out = &got[r * len..(r + 1) * len];
                if r == 2 || r == 3 {
                    assert!(out.iter().all(|v| v.is_nan()), "row {r}: NaN everywhere");
                    continue;
                }
                let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
                let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
                for (&v, &o) in row.iter().zip(out) {
                    let want = if log {
                        (v as f64 - max) - sum.ln()
                    } else {
                        (v as f64 - max).exp() / sum
                    };
                    let tol = 1e-6 * (1.0 + want.abs());
                    let ok = (o as f64 - want).abs() <= tol || (o == want as f32);
                    assert!(ok, "row {r} log {log}: {o} vs {want}");
                }
            }
        }
    }

    use half::{bf16, f16};

    use super::*;

    use crate::runtime::cpu::test_values as values;

    /// The reference: group the logical values by their kept coordinates.
    fn naive(v: &[f64], shape: &[usize], dims: &[usize], op: ReduceOp) -> Vec<f64> {
        let kept: usize = (0..shape.len())
            .filter(|d| !dims.contains(d))
            .map(|d| shape[d])
            .product();
        let mut groups = vec![Vec::new(); kept];
        for (i, &x) in v.iter().enumerate() {
            let (mut rem, mut o, mut scale) = (i, 0, 1);
            for d in (0..shape.len()).rev() {
                if !dims.contains(&d) {
                    o += (rem % shape[d]) * scale;
                    scale *= shape[d];
                }
                rem /= shape[d];
            }
            groups[o].push(x);
        }
        groups
            .iter()
            .map(|g| {
                let nan = g.iter().any(|x| x.is_nan());
                match op {
                    ReduceOp::Sum => g.iter().sum(),
                    ReduceOp::Mean => g.iter().sum::<f64>() / g.len() as f64,
                    ReduceOp::Prod => g.iter().product(),
                    ReduceOp::Max if nan => f64::NAN,
                    ReduceOp::Min if nan => f64::NAN,
                    ReduceOp::Max => g.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
                    ReduceOp::Min => g.iter().cloned().fold(f64::INFINITY, f64::min),
                }
            })
            .collect()
    }

    fn assert_close(got: &[f64], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let ok =
                (g.is_nan() && w.is_nan()) || g == w || (g - w).abs() <= tol * w.abs().max(1e-30);
            assert!(ok, "at {i}: {g} vs {w}");
        }
    }

    fn permuted(t: &Tensor, perm: &[usize]) -> Tensor {
        Tensor::from_parts(t.storage().clone(), t.layout().permuted(perm))
    }

    fn subsets(rank: usize) -> Vec<Vec<usize>> {
        (1..1usize << rank)
            .map(|m| (0..rank).filter(|d| m >> d & 1 == 1).collect())
            .collect()
    }

    /// Every op over every set of dims, with and without keepdim, on a
    /// contiguous tensor and on a permuted view, against the reference.
    fn check_all(x: &Tensor, tol: f64) {
        let logical = x.to_f64_vec();
        for dims in subsets(x.rank()) {
            for op in ReduceOp::ALL {
                let want = naive(&logical, x.shape(), &dims, op);
                for keepdim in [false, true] {
                    let got = reduce(op, x.array(), &dims, keepdim).unwrap();
                    assert_eq!(got.shape(), reduced_shape(x.shape(), &dims, keepdim));
                    assert_close(&got.to_f64_vec(), &want, tol);
                }
            }
        }
    }

    #[test]
    fn all_dims_and_ops_f32_f64() {
        let v = values(5 * 6 * 16, 1);
        let x64 = Tensor::from_vec(v.clone(), &[5, 6, 16]);
        check_all(&x64, 1e-12);
        let x32 = Tensor::from_vec(v.iter().map(|&x| x as f32).collect(), &[5, 6, 16]);
        check_all(&x32, 1e-5);
        // Physical [16, 5, 6] seen as [5, 6, 16].
        let phys = Tensor::from_vec(v.iter().map(|&x| x as f32).collect(), &[16, 5, 6]);
        check_all(&permuted(&phys, &[1, 2, 0]), 1e-5);
        let phys = Tensor::from_vec(v, &[6, 16, 5]);
        check_all(&permuted(&phys, &[2, 0, 1]), 1e-12);
    }

    #[test]
    fn each_strategy_is_reachable() {
        let c = Layout::contiguous(&[5, 6, 16]);
        assert!(Split::new(&c, &[1, 2]).reduced.is_contiguous());
        let rows = Split::new(&c, &[0]);
        assert!(!rows.reduced.is_contiguous() && rows.unit_row() == Some(16));
        let strided = Split::new(&Layout::contiguous(&[16, 5, 6]).permuted(&[1, 2, 0]), &[2]);
        assert!(!strided.reduced.is_contiguous() && strided.unit_row() == Some(6));
    }

    #[test]
    fn integers_and_wrapping() {
        let v: Vec<i64> = (0..24).map(|i| (i * 7 % 11) - 5).collect();
        let x = Tensor::from_vec(v.clone(), &[2, 3, 4]);
        let logical: Vec<f64> = v.iter().map(|&i| i as f64).collect();
        for dims in subsets(3) {
            for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Prod] {
                let got = reduce(op, x.array(), &dims, false).unwrap();
                assert_eq!(got.to_f64_vec(), naive(&logical, &[2, 3, 4], &dims, op));
                let xt = permuted(&Tensor::from_vec(v.clone(), &[4, 2, 3]), &[1, 2, 0]);
                let lt = xt.to_f64_vec();
                let got = reduce(op, xt.array(), &dims, true).unwrap();
                assert_eq!(got.to_f64_vec(), naive(&lt, &[2, 3, 4], &dims, op));
            }
        }
        let big = Tensor::from_vec(vec![i32::MAX, 1], &[2]);
        let sum = reduce(ReduceOp::Sum, big.array(), &[0], false).unwrap();
        assert_eq!(sum.to_vec::<i32>().unwrap(), vec![i32::MIN]);
        let p = Tensor::from_vec(vec![1i64, 2, 3, 4], &[4]);
        assert_eq!(
            reduce(ReduceOp::Prod, p.array(), &[0], false)
                .unwrap()
                .to_vec::<i64>()
                .unwrap(),
            vec![24]
        );
    }

    #[test]
    fn large_sums_stay_accurate() {
        let n = 1 << 22;
        let x = Tensor::from_vec(vec![0.1f32; n], &[n]);
        let want = 0.1f32 as f64 * n as f64;
        let got = reduce(ReduceOp::Sum, x.array(), &[0], false)
            .unwrap()
            .to_f64_vec()[0];
        assert!((got - want).abs() / want < 1e-6, "{got} vs {want}");
        let mean = reduce(ReduceOp::Mean, x.array(), &[0], false)
            .unwrap()
            .to_f64_vec()[0];
        assert!((mean - 0.1f32 as f64).abs() < 1e-7, "{mean}");
        // Summing down the columns (the row strategy) is pairwise too.
        let cols = Tensor::from_vec(vec![0.1f32; n], &[n / 8, 8]);
        let got = reduce(ReduceOp::Sum, cols.array(), &[0], false)
            .unwrap()
            .to_f64_vec();
        let want = 0.1f32 as f64 * (n / 8) as f64;
        assert!(
            got.iter().all(|g| (g - want).abs() / want < 1e-6),
            "{got:?} vs {want}"
        );
    }

    #[test]
    fn parallel_paths_match_reference() {
        let v = values(1000 * 64, 2);
        let x = Tensor::from_vec(v.iter().map(|&x| x as f32).collect(), &[1000, 64]);
        for dims in [vec![0], vec![1], vec![0, 1]] {
            let got = reduce(ReduceOp::Sum, x.array(), &dims, false).unwrap();
            assert_close(
                &got.to_f64_vec(),
                &naive(&v, &[1000, 64], &dims, ReduceOp::Sum),
                1e-4,
            );
        }
        let xt = permuted(&x, &[1, 0]);
        let got = reduce(ReduceOp::Max, xt.array(), &[0], false).unwrap();
        assert_close(
            &got.to_f64_vec(),
            &naive(&xt.to_f64_vec(), &[64, 1000], &[0], ReduceOp::Max),
            0.0,
        );
    }

    #[test]
    fn half_types_accumulate_in_f32() {
        // In f16 (bf16) arithmetic, 1 + 2048 (1 + 256) rounds back down, so a
        // half-precision accumulator would stall there.
        let ones = Tensor::from_vec(vec![bf16::ONE; 4096], &[4096]);
        let s = reduce(ReduceOp::Sum, ones.array(), &[0], false).unwrap();
        assert_eq!(s.to_vec::<bf16>().unwrap(), vec![bf16::from_f32(4096.0)]);
        let ones = Tensor::from_vec(vec![f16::ONE; 4096], &[4096]);
        let s = reduce(ReduceOp::Sum, ones.array(), &[0], false).unwrap();
        assert_eq!(s.to_vec::<f16>().unwrap(), vec![f16::from_f32(4096.0)]);
        let ones = Tensor::from_vec(vec![bf16::ONE; 10000], &[10000]);
        let m = reduce(ReduceOp::Mean, ones.array(), &[0], false).unwrap();
        assert_eq!(m.to_vec::<bf16>().unwrap(), vec![bf16::ONE]);
        let cols = Tensor::from_vec(vec![f16::ONE; 3000 * 8], &[3000, 8]);
        let s = reduce(ReduceOp::Sum, cols.array(), &[0], false).unwrap();
        assert_eq!(s.to_vec::<f16>().unwrap(), vec![f16::from_f32(3000.0); 8]);
        let v = values(4 * 9, 3);
        let h = Tensor::from_vec(v.iter().map(|&x| f16::from_f64(x)).collect(), &[4, 9]);
        let got = reduce(ReduceOp::Mean, h.array(), &[1], true).unwrap();
        assert_eq!(got.shape(), &[4, 1]);
        assert_close(
            &got.to_f64_vec(),
            &naive(&v, &[4, 9], &[1], ReduceOp::Mean),
            1e-3,
        );
    }

    #[test]
    fn nan_propagates_through_max_and_min() {
        for at in [0, 5, 999] {
            let mut v = values(1000, 4);
            v[at] = f64::NAN;
            let x = Tensor::from_vec(v.iter().map(|&x| x as f32).collect(), &[1000]);
            for op in [ReduceOp::Max, ReduceOp::Min, ReduceOp::Sum] {
                assert!(reduce(op, x.array(), &[0], false).unwrap().to_f64_vec()[0].is_nan());
            }
            // Down columns: only column `at % 8` holds the NaN.
            let cols = Tensor::from_vec(v.iter().map(|&x| x as f32).collect(), &[125, 8]);
            let got = reduce(ReduceOp::Max, cols.array(), &[0], false)
                .unwrap()
                .to_f64_vec();
            assert_close(&got, &naive(&v, &[125, 8], &[0], ReduceOp::Max), 0.0);
            assert!(got[at % 8].is_nan());
        }
        let x = Tensor::from_vec(vec![f32::NEG_INFINITY, f32::NEG_INFINITY], &[2]);
        let m = reduce(ReduceOp::Max, x.array(), &[0], false).unwrap();
        assert_eq!(m.to_vec::<f32>().unwrap(), vec![f32::NEG_INFINITY]);
    }

    #[test]
    fn empty_extents() {
        let x = Tensor::from_vec(Vec::<f32>::new(), &[3, 0]);
        let at = |op| reduce(op, x.array(), &[1], false).unwrap().to_f64_vec();
        assert_eq!(at(ReduceOp::Sum), vec![0.0; 3]);
        assert_eq!(at(ReduceOp::Prod), vec![1.0; 3]);
        assert!(at(ReduceOp::Mean).iter().all(|v| v.is_nan()));
        assert!(at(ReduceOp::Max).iter().all(|v| v.is_nan()));
        let xi = Tensor::from_vec(Vec::<i64>::new(), &[3, 0]);
        let err = reduce(ReduceOp::Min, xi.array(), &[1], false).unwrap_err();
        assert!(err.to_string().contains("min"), "{err}");
        // An empty output needs no value.
        let e = reduce(ReduceOp::Max, xi.array(), &[0], false).unwrap();
        assert_eq!(e.shape(), &[0]);
        let got = reduce(ReduceOp::Sum, xi.array(), &[0, 1], true).unwrap();
        assert_eq!(
            (got.shape(), got.to_vec::<i64>().unwrap()),
            (&[1, 1][..], vec![0])
        );
    }

    #[test]
    fn no_dims_is_identity() {
        let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], &[2, 2]);
        let got = reduce(ReduceOp::Sum, permuted(&x, &[1, 0]).array(), &[], false).unwrap();
        assert_eq!(got.to_vec::<f32>().unwrap(), vec![1.0, 3.0, 2.0, 4.0]);
    }

    #[test]
    fn arg_reductions() {
        let x = Tensor::from_vec(vec![1.0f32, 3.0, 3.0, 2.0, -1.0, -1.0], &[6]);
        let at = |op, x: &Tensor, dim, keep| {
            arg_reduce(op, x.array(), dim, keep)
                .unwrap()
                .to_vec::<i64>()
                .unwrap()
        };
        assert_eq!(at(ArgReduceOp::ArgMax, &x, 0, false), vec![1]);
        assert_eq!(at(ArgReduceOp::ArgMin, &x, 0, false), vec![4]);
        let n = Tensor::from_vec(vec![1.0f32, f32::NAN, 5.0, f32::NAN], &[4]);
        assert_eq!(at(ArgReduceOp::ArgMax, &n, 0, false), vec![1]);
        assert_eq!(at(ArgReduceOp::ArgMin, &n, 0, false), vec![1]);
        // [[4, 1, 7], [4, 9, 0]] stored transposed.
        let t = Tensor::from_vec(vec![4i32, 4, 1, 9, 7, 0], &[3, 2]);
        let m = permuted(&t, &[1, 0]);
        assert_eq!(at(ArgReduceOp::ArgMax, &m, 0, false), vec![0, 1, 0]);
        assert_eq!(at(ArgReduceOp::ArgMin, &m, 1, false), vec![1, 2]);
        let kept = arg_reduce(ArgReduceOp::ArgMax, m.array(), 1, true).unwrap();
        assert_eq!(
            (kept.shape(), kept.to_vec::<i64>().unwrap()),
            (&[2, 1][..], vec![2, 1])
        );
        // Large enough for the parallel path: argmax of row r is at r % 100.
        let v: Vec<f64> = (0..400 * 100)
            .map(|i| if i % 100 == (i / 100) % 100 { 2.0 } else { 1.0 })
            .collect();
        let big = Tensor::from_vec(v, &[400, 100]);
        let want: Vec<i64> = (0..400).map(|r| r % 100).collect();
        assert_eq!(at(ArgReduceOp::ArgMax, &big, 1, false), want);
        let empty = Tensor::from_vec(Vec::<f32>::new(), &[2, 0]);
        let err = arg_reduce(ArgReduceOp::ArgMax, empty.array(), 1, false).unwrap_err();
        assert!(err.to_string().contains("argmax"), "{err}");
    }

    fn softmax_f64(x: &Tensor, dim: usize, log: bool) -> Vec<f64> {
        softmax(x.array(), dim, log).unwrap().to_f64_vec()
    }

    #[test]
    fn softmax_matches_numpy() {
        // numpy: e = exp(x - x.max(axis, keepdims)); e / e.sum(axis, keepdims)
        let x = Tensor::from_vec(vec![1000.0f32, 1001.0, -3.0, 2.0], &[2, 2]);
        let sm = [0.2689414214, 0.7310585786, 0.0066928509, 0.9933071491];
        let lsm = [-1.3132616875, -0.3132616875, -5.0067153485, -0.0067153485];
        assert_close(&softmax_f64(&x, 1, false), &sm, 1e-5);
        assert_close(&softmax_f64(&x, 1, true), &lsm, 1e-5);
        let y = Tensor::from_vec(vec![0.5f64, -1.0, 2.0, 3.0, 0.0, -2.5], &[2, 3]);
        let sm0 = [
            0.07585818,
            0.2689414214,
            0.9890130574,
            0.92414182,
            0.7310585786,
            0.0109869426,
        ];
        let lsm0 = [
            -2.5788897343,
            -1.3132616875,
            -0.0110477448,
            -0.0788897343,
            -0.3132616875,
            -4.5110477448,
        ];
        let sm1 = [
            0.1752903921,
            0.0391125733,
            0.7855970346,
            0.9488801811,
            0.0472419625,
            0.0038778564,
        ];
        let lsm1 = [
            -1.7413112967,
            -3.2413112967,
            -0.2413112967,
            -0.0524727464,
            -3.0524727464,
            -5.5524727464,
        ];
        // The literals carry 10 decimals.
        assert_close(&softmax_f64(&y, 0, false), &sm0, 1e-8);
        assert_close(&softmax_f64(&y, 0, true), &lsm0, 1e-8);
        assert_close(&softmax_f64(&y, 1, false), &sm1, 1e-8);
        assert_close(&softmax_f64(&y, 1, true), &lsm1, 1e-8);
        // The same through f32 (fast exp), a transposed view, and f16.
        let y32 = Tensor::from_vec(vec![0.5f32, 3.0, -1.0, 0.0, 2.0, -2.5], &[3, 2]);
        let yt = permuted(&y32, &[1, 0]);
        // f32 rounds ln(sum) to ~6e-8 absolute: 1e-6 relative near -0.05.
        assert_close(&softmax_f64(&yt, 0, false), &sm0, 1e-5);
        assert_close(&softmax_f64(&yt, 1, true), &lsm1, 1e-5);
        let y16: Vec<f16> = [0.5, -1.0, 2.0, 3.0, 0.0, -2.5]
            .iter()
            .map(|&v| f16::from_f64(v))
            .collect();
        let y16 = Tensor::from_vec(y16, &[2, 3]);
        assert_close(&softmax_f64(&y16, 1, false), &sm1, 1e-3);
        assert_close(&softmax_f64(&y16, 0, true), &lsm0, 1e-3);
    }

    /// Reference softmax along `dim` of a contiguous `[outer, len, inner]`.
    fn naive_softmax(v: &[f64], len: usize, inner: usize, log: bool) -> Vec<f64> {
        let mut out = vec![0.0; v.len()];
        for o in 0..v.len() / (len * inner) {
            for i in 0..inner {
                let at = |j: usize| o * len * inner + j * inner + i;
                let max = (0..len).map(|j| v[at(j)]).fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = (0..len).map(|j| (v[at(j)] - max).exp()).sum();
                for j in 0..len {
                    let s = v[at(j)] - max;
                    out[at(j)] = if log { s - sum.ln() } else { s.exp() / sum };
                }
            }
        }
        out
    }

    #[test]
    fn softmax_every_dim_large() {
        let shape = [6, 70, 90];
        let v: Vec<f64> = values(6 * 70 * 90, 5).iter().map(|x| x * 20.0).collect();
        let x = Tensor::from_vec(v.iter().map(|&x| x as f32).collect(), &shape);
        for dim in 0..3 {
            let len = shape[dim];
            let inner: usize = shape[dim + 1..].iter().product();
            for log in [false, true] {
                let want = naive_softmax(&v, len, inner, log);
                let got = softmax_f64(&x, dim, log);
                // f32: ~1e-7 absolute error in ln(sum) near log_softmax = 0.
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= 1e-5 * w.abs() + 1e-6,
                        "dim {dim} log {log}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn softmax_of_infinite_rows() {
        let x = Tensor::from_vec(
            vec![f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY],
            &[2, 2],
        );
        let got = softmax_f64(&x, 1, false);
        assert!(got[0].is_nan() && got[1].is_nan());
        assert_eq!(&got[2..], &[1.0, 0.0]);
        let got = softmax_f64(&x, 1, true);
        assert!(got[0].is_nan() && got[1].is_nan());
        assert_eq!(&got[2..], &[0.0, f64::NEG_INFINITY]);
        let got = softmax_f64(&x, 0, false);
        assert!(got[1].is_nan() && got[3].is_nan());
        assert_eq!((got[0], got[2]), (0.0, 1.0));
    }
}
