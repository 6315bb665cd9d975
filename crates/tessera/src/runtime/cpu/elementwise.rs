//! Elementwise kernels: unary ops, casts, binary ops, comparisons, `where`,
//! and `tril`/`triu`.
//!
//! Every elementwise kernel is one of three generic maps ([`map1`], [`map2`],
//! [`map3`]) over a [`Plan`]: the output shape with each operand's strides
//! expanded to it (stride 0 on broadcast dims) and adjacent dims merged where
//! every operand allows. A dense same-shape op thus becomes one flat run whose
//! inner loop is a `zip` over slices that the compiler vectorises. The output
//! is written in chunks of [`CHUNK`] elements, in parallel when large.
//!
//! Floats compute in `Float::Acc` (f32 for the half types, rounded once on
//! store). Integers wrap on overflow, as in PyTorch.

use std::sync::atomic::{AtomicBool, Ordering};

use half::{bf16, f16};
use rayon::prelude::*;

use super::copy::{copy_strided, PAR_THRESHOLD};
use super::element::num_like::AccFloat;
use super::element::U8;
use super::element::{Element, Float, Int};
use super::fastmath::{erfc_f32, exp_f32, exp_nonpositive_f32, tanh_f32, unary_simd_f32};
use super::Storage;
use crate::error::{op_err, Result};
use crate::ir::{BinaryOp, CompareOp, DType, UnaryOp};
use crate::runtime::array::Array;
use crate::runtime::layout::Layout;
use crate::{with_dtype, with_float_dtype, with_int_dtype};

/// Output elements per parallel task: 256 KiB of f32, big enough to amortise
/// a rayon task and small enough to balance the load across threads.
pub(super) const CHUNK: usize = 1 << 16;

/// The side of the square tiles in which transposing operands are read:
/// 32 rows of 32 f32 (one 128-byte pair of cache lines each) stay in L1.
const TILE: usize = 32;

// ---------------------------------------------------------------------------
// Unary ops

/// `op(x)`; floats compute in `Acc`, integers accept only neg, abs and relu.
pub fn unary(op: UnaryOp, x: &Array) -> Result<Array> {
    with_float_dtype!(x.dtype(), T => Ok(float_unary::<T>(op, x)), _ => {
        with_int_dtype!(x.dtype(), T => int_unary::<T>(op, x),
            _ => Err(op_err!(DType, op.name(), "is not defined for {}", x.dtype())))
    })
}

/// Runs `$body` with `$f` bound to the scalar function of unary `$op` on
/// `$A`: the one place that says what each unary op computes, shared by the
/// per-op kernels and the fused block evaluator.
macro_rules! with_unary_fn {
    ($op:expr, $A:ty, $f:ident => $body:expr) => {{
        match $op {
            UnaryOp::Neg => {
                let $f = |v: $A| -v;
                $body
            }
            UnaryOp::Abs => {
                let $f = |v: $A| v.abs();
                $body
            }
            UnaryOp::Exp => {
                let $f = |v: $A| v.exp_();
                $body
            }
            UnaryOp::Log => {
                let $f = |v: $A| v.ln();
                $body
            }
            UnaryOp::Sqrt => {
                let $f = |v: $A| v.sqrt();
                $body
            }
            UnaryOp::Rsqrt => {
                let $f = |v: $A| <$A>::ONE / v.sqrt();
                $body
            }
            UnaryOp::Reciprocal => {
                let $f = |v: $A| <$A>::ONE / v;
                $body
            }
            UnaryOp::Sin => {
                let $f = |v: $A| v.sin();
                $body
            }
            UnaryOp::Cos => {
                let $f = |v: $A| v.cos();
                $body
            }
            UnaryOp::Tanh => {
                let $f = |v: $A| v.tanh_();
                $body
            }
            UnaryOp::Sigmoid => {
                let $f = sigmoid::<$A>;
                $body
            }
            UnaryOp::Relu => {
                let $f = relu::<$A>;
                $body
            }
            UnaryOp::Gelu => {
                let $f = gelu::<$A>;
                $body
            }
            UnaryOp::GeluTanh => {
                let $f = gelu_tanh::<$A>;
                $body
            }
            UnaryOp::Silu => {
                let $f = silu::<$A>;
                $body
            }
            UnaryOp::Atan => {
                let $f = |v: $A| v.atan();
                $body
            }
            UnaryOp::Asin => {
                let $f = |v: $A| v.asin();
                $body
            }
            UnaryOp::Acos => {
                let $f = |v: $A| v.acos();
                $body
            }
            UnaryOp::BitNot => unreachable!("bitwise_not on a float (inference refuses it)"),
        }
    }};
}

fn float_unary<T: Float>(op: UnaryOp, x: &Array) -> Array
where
    T::Acc: Transcendental,
{
    with_unary_fn!(op, T::Acc, f => lift1::<T>(x, f))
}

/// `v < 0` rather than `max`, so NaN stays NaN as in torch.relu.
#[inline(always)]
fn relu<A: AccFloat>(v: A) -> A {
    if v < A::ZERO {
        A::ZERO
    } else {
        v
    }
}

/// x·Φ(x) with 1 + erf(v/√2) = erfc(-v/√2), without erf's cancellation for v < 0.
#[inline(always)]
fn gelu<A: Transcendental>(v: A) -> A {
    let inv_sqrt2 = A::from_f64(std::f64::consts::FRAC_1_SQRT_2);
    v * A::from_f64(0.5) * (-(v * inv_sqrt2)).erfc_()
}

#[inline(always)]
fn gelu_tanh<A: Transcendental>(v: A) -> A {
    let k = A::from_f64((2.0 / std::f64::consts::PI).sqrt());
    let c = A::from_f64(0.044715);
    A::from_f64(0.5) * v * (A::ONE + (k * (v + c * v * v * v)).tanh_())
}

#[inline(always)]
fn silu<A: Transcendental>(v: A) -> A {
    v * sigmoid(v)
}

super::fastmath::avx512_dispatch! {
    /// Applies unary `op` to a block (the fused evaluator's step).
    pub(crate) fn unary_into<A: Transcendental>(op: UnaryOp, src: &[A], dst: &mut [A]) => unary_into_body
}

/// Elements per unrolled chunk of [`unary_into`]: 4 AVX-512 vectors whose
/// independent dependency chains (exp's polynomial, a division) are
/// interleaved, so the core overlaps their latencies.
const UNARY_CHUNK: usize = 64;

#[inline(always)]
fn unary_into_body<A: Transcendental>(op: UnaryOp, src: &[A], dst: &mut [A]) {
    if A::unary_simd(op, src, dst) {
        return;
    }
    with_unary_fn!(op, A, f => {
        let mut d = dst.chunks_exact_mut(UNARY_CHUNK);
        let mut s = src.chunks_exact(UNARY_CHUNK);
        for (dc, sc) in (&mut d).zip(&mut s) {
            dc.iter_mut().zip(sc).for_each(
                #[inline(always)]
                |(d, &v)| *d = f(v),
            );
        }
        d.into_remainder().iter_mut().zip(s.remainder()).for_each(
            #[inline(always)]
            |(d, &v)| *d = f(v),
        )
    })
}

/// `1 / (1 + e^-v)` without overflow: with `e = e^-|v|` (never above 1) it
/// is `1 / (1 + e)` for v >= 0 and `e / (1 + e)` (as `e · (1 / (1 + e))`)
/// below. Both sides are computed and one selected, which keeps the loop
/// vectorisable. For f32 blocks `fastmath`'s AVX-512 kernel computes the
/// same bits (its reciprocal is the correctly rounded one).
#[inline(always)]
pub(crate) fn sigmoid<A: Transcendental>(v: A) -> A {
    let e = (-v.abs()).exp_nonpositive_();
    let s = A::ONE / (A::ONE + e);
    if v >= A::ZERO {
        s
    } else {
        e * s
    }
}

/// The transcendental functions the activations use, per accumulation type.
/// For f32 they are branch-free polynomial versions (within a few ulp) that
/// the compiler vectorises, since a libm call per element runs 10-50x below
/// memory bandwidth; f64 keeps std/libm. (The trailing underscores keep the
/// names apart from `AccFloat`'s libm-backed `exp` and `tanh`.)
pub(crate) trait Transcendental: AccFloat {
    fn exp_(self) -> Self;
    /// e^x for x <= 0 (or NaN): no overflow to handle.
    fn exp_nonpositive_(self) -> Self;

    fn tanh_(self) -> Self;
    /// The complementary error function 1 - erf(x).
    fn erfc_(self) -> Self;

    /// Applies `op` to a block with an explicit SIMD kernel where there is
    /// one for this type and CPU (giving the bits of the scalar function);
    /// false, with nothing written, where there is none.
    #[inline(always)]
    fn unary_simd(op: UnaryOp, src: &[Self], dst: &mut [Self]) -> bool {
        let _ = (op, src, dst);
        false
    }
}

impl Transcendental for f64 {
    #[inline(always)]
    fn exp_(self) -> f64 {
        self.exp()
    }
    #[inline(always)]
    fn exp_nonpositive_(self) -> f64 {
        self.exp()
    }

    #[inline(always)]
    fn tanh_(self) -> f64 {
        self.tanh()
    }
    #[inline(always)]
    fn erfc_(self) -> f64 {
        libm::erfc(self)
    }
}

impl Transcendental for f32 {
    #[inline(always)]
    fn exp_(self) -> f32 {
        exp_f32(self)
    }
    #[inline(always)]
    fn exp_nonpositive_(self) -> f32 {
        exp_nonpositive_f32(self)
    }

    #[inline(always)]
    fn tanh_(self) -> f32 {
        tanh_f32(self)
    }
    #[inline(always)]
    fn erfc_(self) -> f32 {
        erfc_f32(self)
    }
    #[inline(always)]
    fn unary_simd(op: UnaryOp, src: &[f32], dst: &mut [f32]) -> bool {
        unary_simd_f32(op, src, dst)
    }
}

/// Maps `g` over `x` in `T::Acc` precision.
fn lift1<T: Float>(x: &Array, g: impl Fn(T::Acc) -> T::Acc + Sync) -> Array {
    // Forced: LLVM declines to inline a closure this large (gelu's) into the
    // loop, which then makes a call per element and never vectorises.
    map1(
        x,
        #[inline(always)]
        |v: T| T::from_acc(g(v.to_acc())),
    )
}

fn int_unary<T: Int>(op: UnaryOp, x: &Array) -> Result<Array> {
    match op {
        UnaryOp::Neg => Ok(map1(x, |v: T| v.wrapping_neg())),
        UnaryOp::Abs => Ok(map1(x, |v: T| v.wrapping_abs())),
        UnaryOp::Relu => Ok(map1(x, |v: T| v.max(T::ZERO))),
        UnaryOp::BitNot => Ok(map1(x, |v: T| T::from_bits(!v.to_bits()))),
        _ => Err(op_err!(DType, op.name(), "is not defined for {}", x.ty())),
    }
}

// ---------------------------------------------------------------------------
// Casts

/// An element on its way between dtypes, in a carrier that holds every
/// source value exactly: ints and bools as i128 (u64 and i64 both fit),
/// f16/bf16/f32 as f32, f64 as f64. Converting from the carrier then rounds
/// (or truncates) only once.
#[derive(Clone, Copy)]
pub(super) enum Wide {
    Int(i128),
    F32(f32),
    F64(f64),
}

/// Conversion of an element type to and from [`Wide`].
pub(super) trait Castable: Element {
    fn widen(self) -> Wide;
    fn narrow(w: Wide) -> Self;
}

macro_rules! castable {
    ($t:ty, |$x:ident| $widen:expr, int |$i:ident| $from_int:expr,
     f32 |$f:ident| $from_f32:expr, f64 |$g:ident| $from_f64:expr) => {
        impl Castable for $t {
            #[inline(always)]
            fn widen(self) -> Wide {
                let $x = self;
                $widen
            }
            #[inline(always)]
            fn narrow(w: Wide) -> Self {
                match w {
                    Wide::Int($i) => $from_int,
                    Wide::F32($f) => $from_f32,
                    Wide::F64($g) => $from_f64,
                }
            }
        }
    };
}

// Rust's float→int `as` truncates toward zero, saturates out of range and
// maps NaN to 0; int→int `as` wraps, as torch does.
castable!(
    f32,
    |x| Wide::F32(x),
    int | i | i as f32,
    f32 | v | v,
    f64 | v | v as f32
);
castable!(
    f64,
    |x| Wide::F64(x),
    int | i | i as f64,
    f32 | v | v as f64,
    f64 | v | v
);
castable!(
    f16,
    |x| Wide::F32(x.to_f32()),
    int | i | <f16 as Element>::from_f64(i as f64),
    f32 | v | f16::from_f32(v),
    f64 | v | <f16 as Element>::from_f64(v)
);
castable!(
    bf16,
    |x| Wide::F32(x.to_f32()),
    int | i | <bf16 as Element>::from_f64(i as f64),
    f32 | v | bf16::from_f32(v),
    f64 | v | <bf16 as Element>::from_f64(v)
);
castable!(
    i64,
    |x| Wide::Int(x as i128),
    int | i | i as i64,
    f32 | v | v as i64,
    f64 | v | v as i64
);
castable!(
    i32,
    |x| Wide::Int(x as i128),
    int | i | i as i32,
    f32 | v | v as i32,
    f64 | v | v as i32
);
castable!(
    i16,
    |x| Wide::Int(x as i128),
    int | i | i as i16,
    f32 | v | v as i16,
    f64 | v | v as i16
);
castable!(
    i8,
    |x| Wide::Int(x as i128),
    int | i | i as i8,
    f32 | v | v as i8,
    f64 | v | v as i8
);
castable!(
    U8,
    |x| Wide::Int(x.0 as i128),
    int | i | U8(i as u8),
    f32 | v | U8(v as u8),
    f64 | v | U8(v as u8)
);
castable!(
    u16,
    |x| Wide::Int(x as i128),
    int | i | i as u16,
    f32 | v | v as u16,
    f64 | v | v as u16
);
castable!(
    u32,
    |x| Wide::Int(x as i128),
    int | i | i as u32,
    f32 | v | v as u32,
    f64 | v | v as u32
);
castable!(
    u64,
    |x| Wide::Int(x as i128),
    int | i | i as u64,
    f32 | v | v as u64,
    f64 | v | v as u64
);
castable!(
    u8,
    |x| Wide::Int((x != 0) as i128),
    int | i | (i != 0) as u8,
    f32 | v | (v != 0.0) as u8,
    f64 | v | (v != 0.0) as u8
);

/// `x` as `dtype`. Floats to ints truncate toward zero (NaN becomes 0, out of
/// range saturates); anything to bool is `!= 0` (so NaN is true); bool to a
/// number is 0/1; ints to ints wrap; to f16/bf16 rounds to nearest even.
pub fn cast(x: &Array, dtype: DType) -> Array {
    if x.dtype() == dtype {
        return x.clone();
    }
    with_dtype!(x.dtype(), S => with_dtype!(dtype, D => map1(x, |v: S| D::narrow(v.widen()))))
}

/// `x`'s bits read as `dtype`, of the same width (inference checks it): a
/// contiguous copy of the bytes.
pub fn bitcast(x: &Array, dtype: DType) -> Array {
    let dense = super::copy::contiguous(x);
    let mut out = Storage::new(dtype, x.numel());
    let n = x.numel() * dtype.size_bytes();
    out.as_bytes_mut()[..n].copy_from_slice(&dense.storage().as_bytes()[..n]);
    Array::from_storage(out, x.shape())
}

// ---------------------------------------------------------------------------
// Binary ops, comparisons, where

/// `op(a, b)` broadcast to `shape`.
pub fn binary(op: BinaryOp, a: &Array, b: &Array, shape: &[usize]) -> Result<Array> {
    with_float_dtype!(a.dtype(), T => Ok(float_binary::<T>(op, a, b, shape)), _ => {
        with_int_dtype!(a.dtype(), T => int_binary::<T>(op, a, b, shape),
            _ => Err(op_err!(DType, op.name(), "is not defined for {}", a.dtype())))
    })
}

/// Runs `$body` with `$f` bound to the scalar function of float binary
/// `$op` on `$A` (shared like [`with_unary_fn!`]).
macro_rules! with_binary_fn {
    ($op:expr, $A:ty, $f:ident => $body:expr) => {{
        match $op {
            BinaryOp::Add => {
                let $f = |x: $A, y: $A| x + y;
                $body
            }
            BinaryOp::Sub => {
                let $f = |x: $A, y: $A| x - y;
                $body
            }
            BinaryOp::Mul => {
                let $f = |x: $A, y: $A| x * y;
                $body
            }
            BinaryOp::Div => {
                let $f = |x: $A, y: $A| x / y;
                $body
            }
            BinaryOp::Pow => {
                let $f = |x: $A, y: $A| x.powf(y);
                $body
            }
            // NaN-propagating like torch.maximum: a NaN in either operand wins.
            BinaryOp::Maximum => {
                let $f = |x: $A, y: $A| if x > y || x.is_nan() { x } else { y };
                $body
            }
            BinaryOp::Minimum => {
                let $f = |x: $A, y: $A| if x < y || x.is_nan() { x } else { y };
                $body
            }
            BinaryOp::BitAnd
            | BinaryOp::BitOr
            | BinaryOp::BitXor
            | BinaryOp::Shl
            | BinaryOp::Shr => unreachable!("bitwise op on a float (inference refuses it)"),
        }
    }};
}

fn float_binary<T: Float>(op: BinaryOp, a: &Array, b: &Array, shape: &[usize]) -> Array {
    with_binary_fn!(op, T::Acc, f => lift2::<T>(a, b, shape, f))
}

super::fastmath::avx512_dispatch! {
    /// Applies binary `op` over blocks: `dst[i] = op(xs[i], ys[i])`.
    pub(crate) fn binary_into<A: AccFloat>(op: BinaryOp, xs: &[A], ys: &[A], dst: &mut [A]) => binary_into_body
}

super::fastmath::avx512_dispatch! {
    /// `dst[i] = op(xs[i], c)`: a binary op with a constant right operand.
    pub(crate) fn binary_const_into<A: AccFloat>(op: BinaryOp, xs: &[A], c: A, dst: &mut [A]) => binary_const_into_body
}

super::fastmath::avx512_dispatch! {
    /// `dst[i] = op(c, ys[i])`: a binary op with a constant left operand.
    pub(crate) fn const_binary_into<A: AccFloat>(op: BinaryOp, c: A, ys: &[A], dst: &mut [A]) => const_binary_into_body
}

#[inline(always)]
fn binary_into_body<A: AccFloat>(op: BinaryOp, xs: &[A], ys: &[A], dst: &mut [A]) {
    with_binary_fn!(op, A, f => {
        dst.iter_mut().zip(xs).zip(ys).for_each(|((d, &x), &y)| *d = f(x, y))
    })
}

#[inline(always)]
fn binary_const_into_body<A: AccFloat>(op: BinaryOp, xs: &[A], c: A, dst: &mut [A]) {
    with_binary_fn!(op, A, f => dst.iter_mut().zip(xs).for_each(|(d, &x)| *d = f(x, c)))
}

#[inline(always)]
fn const_binary_into_body<A: AccFloat>(op: BinaryOp, c: A, ys: &[A], dst: &mut [A]) {
    with_binary_fn!(op, A, f => dst.iter_mut().zip(ys).for_each(|(d, &y)| *d = f(c, y)))
}

/// Maps `g` over `a` and `b` in `T::Acc` precision.
fn lift2<T: Float>(
    a: &Array,
    b: &Array,
    shape: &[usize],
    g: impl Fn(T::Acc, T::Acc) -> T::Acc + Sync,
) -> Array {
    map2(
        a,
        b,
        shape,
        #[inline(always)]
        |x: T, y: T| T::from_acc(g(x.to_acc(), y.to_acc())),
    )
}

fn int_binary<T: Int>(op: BinaryOp, a: &Array, b: &Array, shape: &[usize]) -> Result<Array> {
    // Set by the kernel on an invalid divisor or exponent; the (partial)
    // output is then dropped and the op fails, rather than panicking mid-way.
    let bad = AtomicBool::new(false);
    let flag = |v: T| {
        bad.store(true, Ordering::Relaxed);
        v
    };
    let out = match op {
        BinaryOp::Add => map2(a, b, shape, |x: T, y: T| x.wrapping_add(y)),
        BinaryOp::Sub => map2(a, b, shape, |x: T, y: T| x.wrapping_sub(y)),
        BinaryOp::Mul => map2(a, b, shape, |x: T, y: T| x.wrapping_mul(y)),
        BinaryOp::Div => map2(a, b, shape, |x: T, y: T| {
            if y == T::ZERO {
                flag(T::ZERO)
            } else {
                x.wrapping_div(y)
            }
        }),
        BinaryOp::Pow => map2(a, b, shape, |x: T, y: T| {
            if y < T::ZERO {
                flag(T::ZERO)
            } else {
                x.wrapping_pow(y)
            }
        }),
        BinaryOp::Maximum => map2(a, b, shape, |x: T, y: T| x.max(y)),
        BinaryOp::Minimum => map2(a, b, shape, |x: T, y: T| x.min(y)),
        BinaryOp::BitAnd => map2(a, b, shape, |x: T, y: T| {
            T::from_bits(x.to_bits() & y.to_bits())
        }),
        BinaryOp::BitOr => map2(a, b, shape, |x: T, y: T| {
            T::from_bits(x.to_bits() | y.to_bits())
        }),
        BinaryOp::BitXor => map2(a, b, shape, |x: T, y: T| {
            T::from_bits(x.to_bits() ^ y.to_bits())
        }),
        BinaryOp::Shl => map2(a, b, shape, shift_left::<T>),
        BinaryOp::Shr => map2(a, b, shape, shift_right::<T>),
    };
    if bad.load(Ordering::Relaxed) {
        let why = match op {
            BinaryOp::Div => "integer division by zero",
            _ => "integers to negative integer powers are not allowed",
        };
        return Err(op_err!(
            Argument,
            op.name(),
            "{why} ({}, {})",
            a.ty(),
            b.ty()
        ));
    }
    Ok(out)
}

/// `x << s`, 0 when `s` is negative or at least the width (numpy's rule).
#[inline(always)]
fn shift_left<T: Int>(x: T, s: T) -> T {
    match shift_amount(s) {
        Some(n) => T::from_bits(x.to_bits() << n),
        None => T::ZERO,
    }
}

/// `x >> s`: arithmetic for signed types (the bits are sign-extended in
/// `to_bits`), logical for unsigned; past the width, 0 or -1 (the sign).
#[inline(always)]
fn shift_right<T: Int>(x: T, s: T) -> T {
    let signed = T::from_bits(u64::MAX) < T::ZERO;
    let bits = x.to_bits();
    let n = shift_amount(s).unwrap_or(T::BITS);
    match signed {
        true => T::from_bits(((bits as i64) >> n.min(63)) as u64),
        false if n >= 64 => T::ZERO,
        false => T::from_bits(bits >> n),
    }
}

/// The shift count `s` when it is within `0..T::BITS`.
#[inline(always)]
fn shift_amount<T: Int>(s: T) -> Option<u32> {
    let n = s.to_bits();
    (s >= T::ZERO && n < T::BITS as u64).then_some(n as u32)
}

/// `op(a, b)` as bool (0/1) broadcast to `shape`. Any comparison with NaN
/// is false except `ne`, as in IEEE and torch.
pub fn compare(op: CompareOp, a: &Array, b: &Array, shape: &[usize]) -> Array {
    with_dtype!(a.dtype(), T => compare_typed::<T>(op, a, b, shape))
}

fn compare_typed<T: Element>(op: CompareOp, a: &Array, b: &Array, shape: &[usize]) -> Array {
    match op {
        CompareOp::Eq => map2(a, b, shape, |x: T, y: T| (x == y) as u8),
        CompareOp::Ne => map2(a, b, shape, |x: T, y: T| (x != y) as u8),
        CompareOp::Lt => map2(a, b, shape, |x: T, y: T| (x < y) as u8),
        CompareOp::Le => map2(a, b, shape, |x: T, y: T| (x <= y) as u8),
        CompareOp::Gt => map2(a, b, shape, |x: T, y: T| (x > y) as u8),
        CompareOp::Ge => map2(a, b, shape, |x: T, y: T| (x >= y) as u8),
    }
}

/// `cond ? a : b` broadcast over all three to `shape`.
pub fn where_(cond: &Array, a: &Array, b: &Array, shape: &[usize]) -> Array {
    with_dtype!(a.dtype(), T => {
        map3(cond, a, b, shape, |c: u8, x: T, y: T| if c != 0 { x } else { y })
    })
}

// ---------------------------------------------------------------------------
// tril / triu

/// Zeroes the elements below (`upper`) or above (`!upper`) diagonal
/// `diagonal` of each matrix in the last two dims, like torch.triu/tril:
/// diagonal 0 is the main one, positive ones lie above it. A 1-D input (which
/// inference rejects) is treated as a single row.
pub fn triangle(x: &Array, diagonal: i64, upper: bool) -> Array {
    with_dtype!(x.dtype(), T => triangle_typed::<T>(x, diagonal, upper))
}

fn triangle_typed<T: Element>(x: &Array, diagonal: i64, upper: bool) -> Array {
    let shape = x.shape();
    let rank = shape.len();
    let cols = shape.last().copied().unwrap_or(1);
    let rows = if rank >= 2 { shape[rank - 2] } else { 1 };
    let mut out = Storage::new(T::DTYPE, x.numel());
    let dst = out.as_mut_slice::<T>();
    copy_strided(x.storage().as_slice::<T>(), x.layout(), dst);
    if cols == 0 || rows == 0 {
        return Array::from_storage(out, shape);
    }
    let clear_rows = |first_row: usize, chunk: &mut [T]| {
        for (r, row) in chunk.chunks_mut(cols).enumerate() {
            // Row i keeps columns j with j - i >= diagonal (triu) or
            // j - i <= diagonal (tril); saturating so that huge diagonals clamp.
            let i = ((first_row + r) % rows) as i64;
            let edge = |d: i64| i.saturating_add(d).clamp(0, cols as i64) as usize;
            let zeros = if upper {
                0..edge(diagonal)
            } else {
                edge(diagonal.saturating_add(1))..cols
            };
            row[zeros].fill(T::zeroed());
        }
    };
    if dst.len() < PAR_THRESHOLD {
        clear_rows(0, dst);
    } else {
        let rows_per_task = (CHUNK / cols).max(1);
        dst.par_chunks_mut(rows_per_task * cols)
            .enumerate()
            .for_each(|(t, chunk)| clear_rows(t * rows_per_task, chunk));
    }
    Array::from_storage(out, shape)
}

// ---------------------------------------------------------------------------
// The broadcast machinery shared by every map

/// How `N` operands are read while the output is written in row-major order.
struct Plan<const N: usize> {
    /// The output shape, size-1 dims dropped and adjacent dims merged where
    /// every operand's strides allow it; rank >= 1.
    shape: Vec<usize>,
    /// Per operand, its stride (in elements) along each dim of `shape`;
    /// 0 where it is broadcast.
    strides: [Vec<usize>; N],
    /// Per operand, the storage offset of its first element.
    offsets: [usize; N],
}

impl<const N: usize> Plan<N> {
    /// The plan for writing `out_shape` (non-empty) from `operands`.
    fn new(out_shape: &[usize], operands: [&Layout; N]) -> Plan<N> {
        // Fast path, no expansion: dense same-shape operands and single
        // elements are one flat run (stride 1 or 0).
        if operands
            .iter()
            .all(|l| l.is_contiguous() && (l.shape == out_shape || l.numel() == 1))
        {
            return Plan {
                shape: vec![out_shape.iter().product()],
                strides: operands.map(|l| vec![(l.shape == out_shape) as usize]),
                offsets: operands.map(|l| l.offset),
            };
        }
        let expanded = operands.map(|l| l.expanded(out_shape));
        let mut shape: Vec<usize> = Vec::with_capacity(out_shape.len());
        let mut strides: [Vec<usize>; N] =
            std::array::from_fn(|_| Vec::with_capacity(out_shape.len()));
        for (d, &n) in out_shape.iter().enumerate().filter(|(_, &n)| n != 1) {
            // Dim d folds into the previous kept dim when, for every operand,
            // stepping the previous dim once equals stepping d `n` times.
            let merges = !shape.is_empty()
                && strides
                    .iter()
                    .zip(&expanded)
                    .all(|(s, e)| s.last() == Some(&(e.strides[d] * n)));
            for (s, e) in strides.iter_mut().zip(&expanded) {
                if merges {
                    s.pop();
                }
                s.push(e.strides[d]);
            }
            match shape.last_mut() {
                Some(last) if merges => *last *= n,
                _ => shape.push(n),
            }
        }
        if shape.is_empty() {
            shape.push(1);
            strides.iter_mut().for_each(|s| s.push(0));
        }
        Plan {
            shape,
            strides,
            offsets: operands.map(|l| l.offset),
        }
    }

    /// Writes all of `out` (the whole output) by calling
    /// `segment(out_piece, operand_offsets, operand_strides)` on consecutive
    /// pieces of rows; in parallel over chunks when large.
    fn run<O: Send>(
        &self,
        out: &mut [O],
        segment: impl Fn(&mut [O], [usize; N], [usize; N]) + Sync,
    ) {
        if self.transposes() {
            return self.run_tiled(out, &segment);
        }
        if out.len() < PAR_THRESHOLD {
            self.walk(0, out, &segment);
        } else {
            out.par_chunks_mut(CHUNK)
                .enumerate()
                .for_each(|(i, chunk)| self.walk(i * CHUNK, chunk, &segment));
        }
    }

    /// Whether some operand is laid out across the output's rows (its stride
    /// along the rows exceeds the one down the columns, as in a transpose).
    /// Read row by row, each of its elements would be a new cache line.
    fn transposes(&self) -> bool {
        let rank = self.shape.len();
        rank >= 2
            && self.shape[rank - 1] >= TILE
            && self.shape[rank - 2] >= TILE
            && self
                .strides
                .iter()
                .any(|s| s[rank - 1] > 1 && s[rank - 2] < s[rank - 1])
    }

    /// The multi-index of output row `row` over the outer dims, and where
    /// that row begins in each operand.
    fn row_start(&self, mut row: usize) -> (Vec<usize>, [usize; N]) {
        let last = self.shape.len() - 1;
        let mut index = vec![0; last];
        let mut offsets = self.offsets;
        for d in (0..last).rev() {
            index[d] = row % self.shape[d];
            row /= self.shape[d];
            for (o, s) in offsets.iter_mut().zip(&self.strides) {
                *o += index[d] * s[d];
            }
        }
        (index, offsets)
    }

    fn inner_strides(&self) -> [usize; N] {
        std::array::from_fn(|k| self.strides[k][self.shape.len() - 1])
    }

    /// Writes `out`, the output elements from row-major index `start` on.
    fn walk<O>(
        &self,
        start: usize,
        out: &mut [O],
        segment: &impl Fn(&mut [O], [usize; N], [usize; N]),
    ) {
        let len = self.shape[self.shape.len() - 1];
        let inner = self.inner_strides();
        let (mut index, mut offsets) = self.row_start(start / len);
        let mut col = start % len;
        let mut done = 0;
        while done < out.len() {
            let n = (len - col).min(out.len() - done);
            let bases = std::array::from_fn(|k| offsets[k] + col * inner[k]);
            segment(&mut out[done..done + n], bases, inner);
            done += n;
            col = 0;
            self.next_row(&mut index, &mut offsets);
        }
    }

    /// Like `run`, in TILE x TILE tiles of the last two dims, so that the
    /// cache lines a transposed operand brings in serve TILE output rows.
    fn run_tiled<O: Send>(
        &self,
        out: &mut [O],
        segment: &(impl Fn(&mut [O], [usize; N], [usize; N]) + Sync),
    ) {
        let block = TILE * self.shape[self.shape.len() - 1];
        let task = |(b, rows): (usize, &mut [O])| self.walk_tiles(b * TILE, rows, segment);
        if out.len() < PAR_THRESHOLD {
            out.chunks_mut(block).enumerate().for_each(task);
        } else {
            out.par_chunks_mut(block).enumerate().for_each(task);
        }
    }

    /// Writes `out`, up to TILE whole output rows from row `first_row` on.
    fn walk_tiles<O>(
        &self,
        first_row: usize,
        out: &mut [O],
        segment: &impl Fn(&mut [O], [usize; N], [usize; N]),
    ) {
        let len = self.shape[self.shape.len() - 1];
        let inner = self.inner_strides();
        let mut starts = [[0usize; N]; TILE];
        let (mut index, mut offsets) = self.row_start(first_row);
        for start in starts.iter_mut().take(out.len() / len) {
            *start = offsets;
            self.next_row(&mut index, &mut offsets);
        }
        for c0 in (0..len).step_by(TILE) {
            let n = TILE.min(len - c0);
            for (row, start) in out.chunks_mut(len).zip(&starts) {
                let bases = std::array::from_fn(|k| start[k] + c0 * inner[k]);
                segment(&mut row[c0..c0 + n], bases, inner);
            }
        }
    }

    /// Advances the outer multi-index (odometer-style) by one row.
    fn next_row(&self, index: &mut [usize], offsets: &mut [usize; N]) {
        for d in (0..index.len()).rev() {
            index[d] += 1;
            for (o, s) in offsets.iter_mut().zip(&self.strides) {
                *o += s[d];
            }
            if index[d] < self.shape[d] {
                return;
            }
            index[d] = 0;
            for (o, s) in offsets.iter_mut().zip(&self.strides) {
                *o -= s[d] * self.shape[d];
            }
        }
    }
}

/// One operand's elements along one output segment.
#[derive(Clone, Copy)]
enum Lane<'a, T> {
    Dense(&'a [T]),
    Splat(T),
    Strided(&'a [T], usize),
}

impl<'a, T: Copy> Lane<'a, T> {
    /// The `len` (>= 1) elements from `base` on with `stride`.
    #[inline(always)]
    fn new(data: &'a [T], base: usize, stride: usize, len: usize) -> Lane<'a, T> {
        match stride {
            0 => Lane::Splat(data[base]),
            1 => Lane::Dense(&data[base..base + len]),
            _ => Lane::Strided(&data[base..=base + (len - 1) * stride], stride),
        }
    }

    /// Element `i`: the slow path for lane combinations without a loop of
    /// their own.
    #[inline(always)]
    fn get(&self, i: usize) -> T {
        match *self {
            Lane::Dense(s) => s[i],
            Lane::Splat(v) => v,
            Lane::Strided(s, stride) => s[i * stride],
        }
    }
}

/// A new contiguous tensor of `shape` written by `plan`'s walk over the
/// operand `layouts` with `segment`.
fn build<O: Element, const N: usize>(
    shape: &[usize],
    layouts: [&Layout; N],
    segment: impl Fn(&mut [O], [usize; N], [usize; N]) + Sync,
) -> Array {
    let numel = shape.iter().product();
    let mut out = Storage::new(O::DTYPE, numel);
    if numel > 0 {
        Plan::new(shape, layouts).run(out.as_mut_slice::<O>(), segment);
    }
    Array::from_storage(out, shape)
}

/// `f(x)` elementwise, same shape.
#[inline(always)]
fn map1<A: Element, O: Element>(x: &Array, f: impl Fn(A) -> O + Sync) -> Array {
    let src = x.storage().as_slice::<A>();
    build(
        x.shape(),
        [x.layout()],
        |out: &mut [O], [base], [stride]| match Lane::new(src, base, stride, out.len()) {
            Lane::Dense(s) => out.iter_mut().zip(s).for_each(|(o, &v)| *o = f(v)),
            Lane::Splat(v) => out.fill(f(v)),
            Lane::Strided(s, st) => out
                .iter_mut()
                .zip(s.iter().step_by(st))
                .for_each(|(o, &v)| *o = f(v)),
        },
    )
}

/// `f(a, b)` elementwise, broadcast to `shape`.
#[inline(always)]
fn map2<A: Element, B: Element, O: Element>(
    a: &Array,
    b: &Array,
    shape: &[usize],
    f: impl Fn(A, B) -> O + Sync,
) -> Array {
    let (da, db) = (a.storage().as_slice::<A>(), b.storage().as_slice::<B>());
    let layouts = [a.layout(), b.layout()];
    build(shape, layouts, |out: &mut [O], [ba, bb], [sa, sb]| {
        let n = out.len();
        match (Lane::new(da, ba, sa, n), Lane::new(db, bb, sb, n)) {
            (Lane::Dense(x), Lane::Dense(y)) => out
                .iter_mut()
                .zip(x)
                .zip(y)
                .for_each(|((o, &x), &y)| *o = f(x, y)),
            (Lane::Dense(x), Lane::Splat(y)) => {
                out.iter_mut().zip(x).for_each(|(o, &x)| *o = f(x, y))
            }
            (Lane::Splat(x), Lane::Dense(y)) => {
                out.iter_mut().zip(y).for_each(|(o, &y)| *o = f(x, y))
            }
            (x, y) => out
                .iter_mut()
                .enumerate()
                .for_each(|(i, o)| *o = f(x.get(i), y.get(i))),
        }
    })
}

/// `f(a, b, c)` elementwise, broadcast to `shape`.
fn map3<A: Element, B: Element, C: Element, O: Element>(
    a: &Array,
    b: &Array,
    c: &Array,
    shape: &[usize],
    f: impl Fn(A, B, C) -> O + Sync,
) -> Array {
    let (da, db, dc) = (
        a.storage().as_slice::<A>(),
        b.storage().as_slice::<B>(),
        c.storage().as_slice::<C>(),
    );
    let layouts = [a.layout(), b.layout(), c.layout()];
    build(
        shape,
        layouts,
        |out: &mut [O], [ba, bb, bc], [sa, sb, sc]| {
            let n = out.len();
            let lanes = (
                Lane::new(da, ba, sa, n),
                Lane::new(db, bb, sb, n),
                Lane::new(dc, bc, sc, n),
            );
            match lanes {
                (Lane::Dense(x), Lane::Dense(y), Lane::Dense(z)) => out
                    .iter_mut()
                    .zip(x)
                    .zip(y)
                    .zip(z)
                    .for_each(|(((o, &x), &y), &z)| *o = f(x, y, z)),
                (x, y, z) => out
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, o)| *o = f(x.get(i), y.get(i), z.get(i))),
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use crate::tensor::Tensor;
    use std::panic::Location;

    use half::{bf16, f16};

    use super::*;
    use crate::ir::Op;

    fn apply(op: Op, inputs: &[&Tensor]) -> Result<Tensor> {
        Tensor::apply(&op, inputs, Location::caller())
    }

    fn un(op: UnaryOp, x: &Tensor) -> Tensor {
        apply(Op::Unary(op), &[x]).unwrap()
    }

    fn bin(op: BinaryOp, a: &Tensor, b: &Tensor) -> Tensor {
        apply(Op::Binary(op), &[a, b]).unwrap()
    }

    /// Asserts element-wise closeness; NaNs must match NaNs and infinities
    /// must match exactly.
    #[track_caller]
    fn assert_close(actual: &[f64], expected: &[f64], rtol: f64) {
        assert_eq!(actual.len(), expected.len(), "lengths differ");
        for (i, (&a, &e)) in actual.iter().zip(expected).enumerate() {
            let ok = if e.is_nan() {
                a.is_nan()
            } else if e.is_infinite() || e == 0.0 {
                a == e
            } else {
                (a - e).abs() <= rtol * e.abs()
            };
            assert!(ok, "element {i}: got {a}, expected {e}\n{actual:?}");
        }
    }

    /// The row-major multi-index of flat index `i` in `shape`.
    fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
        let mut idx = vec![0; shape.len()];
        for d in (0..shape.len()).rev() {
            idx[d] = i % shape[d];
            i /= shape[d];
        }
        idx
    }

    /// The flat index into a dense `shape` of the element that the output
    /// multi-index `out_idx` reads under NumPy broadcasting.
    fn source_index(out_idx: &[usize], shape: &[usize]) -> usize {
        let lead = out_idx.len() - shape.len();
        shape.iter().enumerate().fold(0, |acc, (d, &n)| {
            acc * n + if n == 1 { 0 } else { out_idx[lead + d] }
        })
    }

    /// Broadcast `f(a, b)` by per-element index arithmetic: the reference the
    /// kernels' strided walk is checked against.
    fn reference2(
        (a, sa): (&[f64], &[usize]),
        (b, sb): (&[f64], &[usize]),
        out: &[usize],
        f: impl Fn(f64, f64) -> f64,
    ) -> Vec<f64> {
        (0..out.iter().product())
            .map(|i| {
                let idx = unravel(i, out);
                f(a[source_index(&idx, sa)], b[source_index(&idx, sb)])
            })
            .collect()
    }

    fn f64s(n: usize, f: impl Fn(usize) -> f64) -> Vec<f64> {
        (0..n).map(f).collect()
    }

    fn f32s(n: usize, f: impl Fn(usize) -> f64) -> Vec<f32> {
        (0..n).map(|i| f(i) as f32).collect()
    }

    // Expected values from Python's `math` module (gelu via math.erf),
    // pasted as printed (hence clippy's approx_constant allowance).
    const XS: [f64; 5] = [-2.5, -0.5, 0.0, 0.75, 3.0];
    const POS: [f64; 4] = [0.25, 1.0, 2.0, 10.0];
    const UNIT: [f64; 5] = [-0.75, -0.5, 0.0, 0.25, 1.0];
    #[allow(clippy::approx_constant)]
    fn math_table() -> Vec<(UnaryOp, &'static [f64], [f64; 5])> {
        use UnaryOp::*;
        let mut t: Vec<(UnaryOp, &'static [f64], [f64; 5])> = vec![
            (Neg, &XS, [2.5, 0.5, 0.0, -0.75, -3.0]),
            (
                Atan,
                &XS,
                [
                    -1.1902899496825317,
                    -0.4636476090008061,
                    0.0,
                    0.6435011087932844,
                    1.2490457723982544,
                ],
            ),
            (
                Asin,
                &UNIT,
                [
                    -0.848062078981481,
                    -0.5235987755982989,
                    0.0,
                    0.25268025514207865,
                    1.5707963267948966,
                ],
            ),
            (
                Acos,
                &UNIT,
                [
                    2.4188584057763776,
                    2.0943951023931957,
                    1.5707963267948966,
                    1.318116071652818,
                    0.0,
                ],
            ),
            (Abs, &XS, [2.5, 0.5, 0.0, 0.75, 3.0]),
            (Relu, &XS, [0.0, 0.0, 0.0, 0.75, 3.0]),
            (
                Exp,
                &XS,
                [
                    0.0820849986238988,
                    0.6065306597126334,
                    1.0,
                    2.117000016612675,
                    20.085536923187668,
                ],
            ),
            (
                Sin,
                &XS,
                [
                    -0.5984721441039565,
                    -0.479425538604203,
                    0.0,
                    0.6816387600233341,
                    0.1411200080598672,
                ],
            ),
            (
                Cos,
                &XS,
                [
                    -0.8011436155469337,
                    0.8775825618903728,
                    1.0,
                    0.7316888688738209,
                    -0.9899924966004454,
                ],
            ),
            (
                Tanh,
                &XS,
                [
                    -0.9866142981514303,
                    -0.46211715726000974,
                    0.0,
                    0.6351489523872873,
                    0.9950547536867305,
                ],
            ),
            (
                Sigmoid,
                &XS,
                [
                    0.07585818002124356,
                    0.37754066879814546,
                    0.5,
                    0.679178699175393,
                    0.9525741268224334,
                ],
            ),
            (
                Gelu,
                &XS,
                [
                    -0.015524163314440398,
                    -0.15426876936299344,
                    0.0,
                    0.5800294857173488,
                    2.99595030590511,
                ],
            ),
            (
                GeluTanh,
                &XS,
                [
                    -0.015084266089998577,
                    -0.15428599017485606,
                    0.0,
                    0.5799605551656203,
                    2.996362607918227,
                ],
            ),
            (
                Silu,
                &XS,
                [
                    -0.1896454500531089,
                    -0.18877033439907273,
                    0.0,
                    0.5093840243815447,
                    2.8577223804673,
                ],
            ),
        ];
        for (op, e) in [
            (
                Log,
                [
                    -1.3862943611198906,
                    0.0,
                    0.6931471805599453,
                    2.302585092994046,
                ],
            ),
            (Sqrt, [0.5, 1.0, 1.4142135623730951, 3.1622776601683795]),
            (Rsqrt, [2.0, 1.0, 0.7071067811865475, 0.31622776601683794]),
            (Reciprocal, [4.0, 1.0, 0.5, 0.1]),
        ] {
            t.push((op, &POS, [e[0], e[1], e[2], e[3], f64::NAN]));
        }
        t
    }

    #[test]
    fn unary_float_ops_match_math() {
        let table = math_table();
        let float_ops = UnaryOp::ALL.iter().filter(|u| u.accepts_float()).count();
        assert_eq!(table.len(), float_ops, "every float unary op is covered");
        for (op, xs, expected) in table {
            let expected = &expected[..xs.len()];
            let x64 = Tensor::from_vec(xs.to_vec(), &[xs.len()]);
            assert_close(&un(op, &x64).to_vec::<f64>().unwrap(), expected, 1e-13);
            let x32 = Tensor::from_vec(xs.iter().map(|&v| v as f32).collect(), &[xs.len()]);
            // f32 eps is 6e-8, but the gelus' `1 + erf/tanh` cancels about
            // two digits at x = -2.5, hence 1e-5.
            assert_close(&un(op, &x32).to_f64_vec(), expected, 1e-5);
        }
    }

    #[test]
    fn unary_edge_cases() {
        use UnaryOp::*;
        let inf = f64::INFINITY;
        let nan = f64::NAN;
        let x = Tensor::from_vec(vec![-100.0f32, 100.0, -1000.0, 1000.0], &[4]);
        let s = un(Sigmoid, &x).to_vec::<f32>().unwrap();
        assert_eq!(&s[1..], &[1.0, 0.0, 1.0]);
        // sigmoid(-100) = 3.72e-44 is an f32 subnormal: ~2% precision there.
        assert!(
            (s[0] as f64 - 3.720075976020836e-44).abs() < 1e-45,
            "{}",
            s[0]
        );
        let x = Tensor::from_vec(vec![-100.0f64, 100.0, -1000.0], &[3]);
        assert_close(
            &un(Sigmoid, &x).to_vec::<f64>().unwrap(),
            &[3.720075976020836e-44, 1.0, 0.0],
            1e-13,
        );
        assert_close(
            &un(Silu, &x).to_vec::<f64>().unwrap(),
            &[-3.7200759760208363e-42, 100.0, 0.0],
            1e-13,
        );
        let x = Tensor::from_vec(vec![0.0f32, -1.0, -0.0, nan as f32], &[4]);
        assert_close(&un(Log, &x).to_f64_vec(), &[-inf, nan, -inf, nan], 0.0);
        assert_close(&un(Sqrt, &x).to_f64_vec(), &[0.0, nan, 0.0, nan], 0.0);
        assert_close(&un(Rsqrt, &x).to_f64_vec(), &[inf, nan, -inf, nan], 0.0);
        assert_close(
            &un(Reciprocal, &x).to_f64_vec(),
            &[inf, -1.0, -inf, nan],
            0.0,
        );
        assert_close(&un(Relu, &x).to_f64_vec(), &[0.0, 0.0, 0.0, nan], 0.0);
        assert_close(
            &un(Exp, &x).to_f64_vec(),
            &[1.0, 0.36787944117144233, 1.0, nan],
            1e-6,
        );
    }

    #[test]
    fn unary_half_types_compute_in_f32_and_round_once() {
        // Inputs 0.1, -1.3, 2.7 rounded to each type, then exp/sigmoid/gelu
        // of those, rounded to nearest even (computed exactly in Python).
        let f16_cases = [
            (UnaryOp::Exp, [1.10546875, 0.272705078125, 14.8671875]),
            (
                UnaryOp::Sigmoid,
                [0.52490234375, 0.2142333984375, 0.93701171875],
            ),
            (
                UnaryOp::Gelu,
                [0.053955078125, -0.1258544921875, 2.689453125],
            ),
        ];
        let bf16_cases = [
            (UnaryOp::Exp, [1.1015625, 0.2734375, 14.9375]),
            (UnaryOp::Sigmoid, [0.5234375, 0.21484375, 0.9375]),
            (UnaryOp::Gelu, [0.053955078125, -0.1259765625, 2.6875]),
        ];
        let inputs = [0.1, -1.3, 2.7];
        let x = Tensor::from_vec(inputs.map(f16::from_f64).to_vec(), &[3]);
        assert_eq!(x.to_f64_vec(), [0.0999755859375, -1.2998046875, 2.69921875]);
        for (op, e) in f16_cases {
            assert_eq!(un(op, &x).dtype(), DType::F16);
            assert_eq!(un(op, &x).to_f64_vec(), e, "f16 {op:?}");
        }
        let x = Tensor::from_vec(inputs.map(bf16::from_f64).to_vec(), &[3]);
        assert_eq!(x.to_f64_vec(), [0.10009765625, -1.296875, 2.703125]);
        for (op, e) in bf16_cases {
            assert_eq!(un(op, &x).dtype(), DType::BF16);
            assert_eq!(un(op, &x).to_f64_vec(), e, "bf16 {op:?}");
        }
    }

    #[test]
    fn unary_int_ops() {
        let x = Tensor::from_vec(vec![-3i64, 0, 5, i64::MIN], &[4]);
        assert_eq!(
            un(UnaryOp::Neg, &x).to_vec::<i64>().unwrap(),
            [3, 0, -5, i64::MIN]
        );
        assert_eq!(
            un(UnaryOp::Abs, &x).to_vec::<i64>().unwrap(),
            [3, 0, 5, i64::MIN]
        );
        assert_eq!(un(UnaryOp::Relu, &x).to_vec::<i64>().unwrap(), [0, 0, 5, 0]);
        let x = Tensor::from_vec(vec![-3i32, 7, i32::MIN], &[3]);
        assert_eq!(
            un(UnaryOp::Neg, &x).to_vec::<i32>().unwrap(),
            [3, -7, i32::MIN]
        );
        assert_eq!(
            un(UnaryOp::Abs, &x).to_vec::<i32>().unwrap(),
            [3, 7, i32::MIN]
        );
        assert_eq!(un(UnaryOp::Relu, &x).to_vec::<i32>().unwrap(), [0, 7, 0]);
        // Float-only ops and bools fail rather than panic, even past inference.
        assert!(unary(UnaryOp::Exp, x.array()).is_err());
        let b = Tensor::from_vec(vec![1u8], &[1]);
        assert!(unary(UnaryOp::Neg, b.array()).is_err());
    }

    #[test]
    fn unary_strided_and_expanded_inputs() {
        // base [3,4] = 0..12; its transpose reads base[j][i] at [i][j].
        let base = Tensor::from_vec(f32s(12, |i| i as f64 - 5.0), &[3, 4]);
        let t = Tensor::from_parts(base.storage().clone(), base.layout().permuted(&[1, 0]));
        let expected = f64s(12, |k| {
            let (i, j) = (k / 3, k % 3);
            -((j * 4 + i) as f64 - 5.0)
        });
        assert_eq!(un(UnaryOp::Neg, &t).to_f64_vec(), expected);
        // Batched transposes big enough for the tiled walk, with sizes that
        // are not multiples of the tile.
        let (b, r, c) = (3, 70, 40);
        let v = f64s(b * r * c, |i| i as f64 * 0.25);
        let base = Tensor::from_vec(v.clone(), &[b, r, c]);
        let t = Tensor::from_parts(base.storage().clone(), base.layout().permuted(&[0, 2, 1]));
        // Output [b, c, r]: element (i, j, k) reads base (i, k, j).
        let at = |k: usize| v[(k / (c * r)) * r * c + (k % r) * c + (k / r) % c];
        assert_eq!(
            un(UnaryOp::Neg, &t).to_f64_vec(),
            f64s(b * r * c, |k| -at(k))
        );
        let row = Tensor::from_vec(f64s(r, |i| i as f64), &[r]);
        let expected = f64s(b * r * c, |k| at(k) * (k % r) as f64);
        assert_eq!(bin(BinaryOp::Mul, &t, &row).to_f64_vec(), expected);
        // A [3,1] column expanded to [3,5] has stride 0 along the row.
        let col = Tensor::from_vec(vec![1.0f64, 4.0, 9.0], &[3, 1]);
        let e = Tensor::from_parts(col.storage().clone(), col.layout().expanded(&[2, 3, 5]));
        let expected = f64s(30, |k| [1.0, 2.0, 3.0][(k / 5) % 3]);
        assert_eq!(un(UnaryOp::Sqrt, &e).to_f64_vec(), expected);
    }

    #[test]
    fn binary_float_ops() {
        let a = Tensor::from_vec(vec![1.5f64, -2.0, 0.5, 4.0], &[4]);
        let b = Tensor::from_vec(vec![2.0f64, 3.0, -0.25, 0.5], &[4]);
        let cases = [
            (BinaryOp::Add, [3.5, 1.0, 0.25, 4.5]),
            (BinaryOp::Sub, [-0.5, -5.0, 0.75, 3.5]),
            (BinaryOp::Mul, [3.0, -6.0, -0.125, 2.0]),
            (BinaryOp::Div, [0.75, -2.0 / 3.0, -2.0, 8.0]),
            // 0.5^-0.25 = 2^0.25 (Python: 1.189207115002721)
            (BinaryOp::Pow, [2.25, -8.0, 1.189207115002721, 2.0]),
            (BinaryOp::Maximum, [2.0, 3.0, 0.5, 4.0]),
            (BinaryOp::Minimum, [1.5, -2.0, -0.25, 0.5]),
        ];
        let float_ops = BinaryOp::ALL.iter().filter(|b| !b.is_bitwise()).count();
        assert_eq!(cases.len(), float_ops);
        for (op, e) in cases {
            assert_close(&bin(op, &a, &b).to_vec::<f64>().unwrap(), &e, 1e-15);
            let a32 = Tensor::from_array(cast(a.array(), DType::F32));
            let b32 = Tensor::from_array(cast(b.array(), DType::F32));
            assert_close(&bin(op, &a32, &b32).to_f64_vec(), &e, 1e-7);
        }
    }

    #[test]
    fn maximum_minimum_propagate_nan() {
        let nan = f64::NAN;
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let a = Tensor::from_array(cast(
                Tensor::from_vec(vec![nan, 1.0, 2.0, nan], &[4]).array(),
                dtype,
            ));
            let b = Tensor::from_array(cast(
                Tensor::from_vec(vec![1.0, nan, 3.0, nan], &[4]).array(),
                dtype,
            ));
            assert_close(
                &bin(BinaryOp::Maximum, &a, &b).to_f64_vec(),
                &[nan, nan, 3.0, nan],
                0.0,
            );
            assert_close(
                &bin(BinaryOp::Minimum, &a, &b).to_f64_vec(),
                &[nan, nan, 2.0, nan],
                0.0,
            );
        }
    }

    #[test]
    fn binary_half_types_round_to_nearest_even() {
        // 1 + 2^-11 is a tie between 1 and 1 + 2^-10 (f16): even is 1;
        // (1 + 2^-10) + 2^-11 ties between odd 1 + 2^-10 and even 1 + 2^-9.
        let a = Tensor::from_vec(vec![f16::ONE, f16::from_f64(1.0 + 0.5f64.powi(10))], &[2]);
        let b = Tensor::from_vec(vec![f16::from_f64(0.5f64.powi(11)); 2], &[2]);
        assert_eq!(
            bin(BinaryOp::Add, &a, &b).to_f64_vec(),
            [1.0, 1.0 + 0.5f64.powi(9)]
        );
        let a = Tensor::from_vec(vec![bf16::ONE, bf16::from_f64(1.0 + 0.5f64.powi(7))], &[2]);
        let b = Tensor::from_vec(vec![bf16::from_f64(0.5f64.powi(8)); 2], &[2]);
        assert_eq!(
            bin(BinaryOp::Add, &a, &b).to_f64_vec(),
            [1.0, 1.0 + 0.5f64.powi(6)]
        );
    }

    #[test]
    fn broadcasting() {
        // Hand-derived: [2,1,3] + [2,1] -> [2,2,3].
        let a = Tensor::from_vec(vec![0.0f32, 1.0, 2.0, 3.0, 4.0, 5.0], &[2, 1, 3]);
        let b = Tensor::from_vec(vec![10.0f32, 20.0], &[2, 1]);
        let out = bin(BinaryOp::Add, &a, &b);
        assert_eq!(out.shape(), [2, 2, 3]);
        assert_eq!(
            out.to_vec::<f32>().unwrap(),
            [10.0, 11.0, 12.0, 20.0, 21.0, 22.0, 13.0, 14.0, 15.0, 23.0, 24.0, 25.0]
        );
        // Against the index-arithmetic reference, both operand orders.
        let cases: [(&[usize], &[usize]); 6] = [
            (&[4, 1, 3], &[5, 1]),
            (&[5, 1], &[4, 1, 3]),
            (&[3], &[]),
            (&[], &[2, 3]),
            (&[1], &[7]),
            (&[2, 1, 4, 1], &[3, 1, 5]),
        ];
        for (sa, sb) in cases {
            let na: usize = sa.iter().product();
            let nb: usize = sb.iter().product();
            let va = f64s(na, |i| i as f64 + 1.0);
            let vb = f64s(nb, |i| (i as f64) * 0.5 - 3.0);
            let a = Tensor::from_vec(va.clone(), sa);
            let b = Tensor::from_vec(vb.clone(), sb);
            let out = bin(BinaryOp::Sub, &a, &b);
            let expected = reference2((&va, sa), (&vb, sb), out.shape(), |x, y| x - y);
            assert_eq!(out.to_vec::<f64>().unwrap(), expected, "{sa:?} - {sb:?}");
        }
        // Empty outputs allocate nothing to write.
        let e = Tensor::from_vec(Vec::<f32>::new(), &[0, 3]);
        let one = Tensor::from_vec(vec![1.0f32], &[1]);
        assert_eq!(bin(BinaryOp::Add, &e, &one).shape(), [0, 3]);
    }

    #[test]
    fn binary_strided_operands() {
        // a: the transpose of a [3,4] base; b: columns 1,3,5 of a [4,6] base.
        let base_a = f64s(12, |i| i as f64);
        let base_b = f64s(24, |i| 100.0 + i as f64);
        let ta = Tensor::from_vec(base_a.clone(), &[3, 4]);
        let tb = Tensor::from_vec(base_b.clone(), &[4, 6]);
        let a = Tensor::from_parts(ta.storage().clone(), ta.layout().permuted(&[1, 0]));
        let b = Tensor::from_parts(tb.storage().clone(), tb.layout().sliced(1, 1, 3, 2));
        let out = bin(BinaryOp::Mul, &a, &b);
        let expected = f64s(12, |k| {
            let (i, j) = (k / 3, k % 3);
            base_a[j * 4 + i] * base_b[i * 6 + 1 + 2 * j]
        });
        assert_eq!(out.to_vec::<f64>().unwrap(), expected);
        // A strided [4,3] against a broadcast [3] row.
        let row = Tensor::from_vec(vec![1.0f64, -1.0, 2.0], &[3]);
        let expected = f64s(12, |k| {
            base_a[(k % 3) * 4 + k / 3] + [1.0, -1.0, 2.0][k % 3]
        });
        assert_eq!(bin(BinaryOp::Add, &a, &row).to_f64_vec(), expected);
    }

    #[test]
    fn odd_sizes_and_parallel_paths() {
        let sizes = [
            1,
            7,
            33,
            PAR_THRESHOLD - 1,
            PAR_THRESHOLD + 5,
            3 * CHUNK + 17,
        ];
        for n in sizes {
            let va = f32s(n, |i| i as f64 * 0.5);
            let vb = f32s(n, |i| (i % 7) as f64 - 3.0);
            let a = Tensor::from_vec(va.clone(), &[n]);
            let b = Tensor::from_vec(vb.clone(), &[n]);
            let sum: Vec<f32> = va.iter().zip(&vb).map(|(x, y)| x + y).collect();
            assert_eq!(
                bin(BinaryOp::Add, &a, &b).to_vec::<f32>().unwrap(),
                sum,
                "n={n}"
            );
            let two = Tensor::from_vec(vec![2.0f32], &[]);
            let twice: Vec<f32> = va.iter().map(|x| x * 2.0).collect();
            assert_eq!(
                bin(BinaryOp::Mul, &two, &a).to_vec::<f32>().unwrap(),
                twice,
                "n={n}"
            );
            let neg: Vec<f32> = vb.iter().map(|x| -x).collect();
            assert_eq!(un(UnaryOp::Neg, &b).to_vec::<f32>().unwrap(), neg, "n={n}");
        }
        // The general path in parallel: a bias row over 257 rows, a
        // transposed operand, and an outer product, all > PAR_THRESHOLD.
        let (r, c) = (257, 1000);
        let vx = f64s(r * c, |i| i as f64);
        let vrow = f64s(c, |i| i as f64 * 1e-3);
        let x = Tensor::from_vec(vx.clone(), &[r, c]);
        let row = Tensor::from_vec(vrow.clone(), &[c]);
        let out = bin(BinaryOp::Add, &x, &row);
        assert_eq!(
            out.to_vec::<f64>().unwrap(),
            reference2((&vx, &[r, c]), (&vrow, &[c]), &[r, c], |a, b| a + b)
        );
        let xt = Tensor::from_parts(x.storage().clone(), x.layout().permuted(&[1, 0]));
        let expected = f64s(r * c, |k| vx[(k % r) * c + k / r] - vrow[k / r]);
        let col = Tensor::from_vec(vrow.clone(), &[c, 1]);
        assert_eq!(bin(BinaryOp::Sub, &xt, &col).to_f64_vec(), expected);
        let outer = bin(
            BinaryOp::Mul,
            &Tensor::from_vec(vrow.clone(), &[c, 1]),
            &row,
        );
        assert_eq!(
            outer.to_f64_vec(),
            f64s(c * c, |k| vrow[k / c] * vrow[k % c])
        );
    }

    #[test]
    fn int_binary_ops() {
        let a = Tensor::from_vec(vec![7i64, -7, 7, -7, 3, -2, 5, 0], &[8]);
        let b = Tensor::from_vec(vec![2i64, 2, -2, -2, 4, 3, 0, 0], &[8]);
        let i64s = |op| bin(op, &a, &b).to_vec::<i64>().unwrap();
        assert_eq!(i64s(BinaryOp::Add), [9, -5, 5, -9, 7, 1, 5, 0]);
        assert_eq!(i64s(BinaryOp::Sub), [5, -9, 9, -5, -1, -5, 5, 0]);
        assert_eq!(i64s(BinaryOp::Mul), [14, -14, -14, 14, 12, -6, 0, 0]);
        assert_eq!(i64s(BinaryOp::Maximum), [7, 2, 7, -2, 4, 3, 5, 0]);
        assert_eq!(i64s(BinaryOp::Minimum), [2, -7, -2, -7, 3, -2, 0, 0]);
        let base = Tensor::from_vec(vec![3i64, -2, 5, 0, 2, -1], &[6]);
        let exp = Tensor::from_vec(vec![4i64, 3, 0, 0, 10, 7], &[6]);
        let pow = bin(BinaryOp::Pow, &base, &exp).to_vec::<i64>().unwrap();
        assert_eq!(pow, [81, -8, 1, 1, 1024, -1]);
        // Division truncates toward zero.
        let (a4, b4) = (cast(a.array(), DType::I32), cast(b.array(), DType::I32));
        let (a4, b4) = (
            Tensor::from_parts(a4.storage().clone(), a4.layout().sliced(0, 0, 6, 1)),
            Tensor::from_parts(b4.storage().clone(), b4.layout().sliced(0, 0, 6, 1)),
        );
        assert_eq!(
            bin(BinaryOp::Div, &a4, &b4).to_vec::<i32>().unwrap(),
            [3, -3, -3, 3, 0, 0]
        );
        // Overflow wraps instead of panicking.
        let m = Tensor::from_vec(vec![i32::MAX, i32::MIN, 3], &[3]);
        let n = Tensor::from_vec(vec![1i32, -1, 40], &[3]);
        assert_eq!(
            bin(BinaryOp::Add, &m, &n).to_vec::<i32>().unwrap(),
            [i32::MIN, i32::MAX, 43]
        );
        assert_eq!(
            bin(BinaryOp::Div, &m, &n).to_vec::<i32>().unwrap(),
            [i32::MAX, i32::MIN, 0]
        );
        // 3^40 wraps to (3**40) % 2**32 = 689956897 (Python), < 2^31.
        let three = Tensor::from_vec(vec![3i32], &[1]);
        let forty = Tensor::from_vec(vec![40i32], &[1]);
        assert_eq!(
            bin(BinaryOp::Pow, &three, &forty).to_vec::<i32>().unwrap(),
            [689956897]
        );
    }

    #[test]
    fn int_division_by_zero_and_negative_power_fail() {
        let a = Tensor::from_vec(vec![1i64, 2, 3], &[3]);
        let zero = Tensor::from_vec(vec![0i64], &[]);
        let err = apply(Op::Binary(BinaryOp::Div), &[&a, &zero]).unwrap_err();
        assert_eq!(err.op.as_deref(), Some("div"));
        assert!(err.to_string().contains("division by zero"), "{err}");
        let big = Tensor::from_vec(vec![1i32; PAR_THRESHOLD + 3], &[PAR_THRESHOLD + 3]);
        let mut divisors = vec![1i32; PAR_THRESHOLD + 3];
        divisors[PAR_THRESHOLD + 1] = 0;
        let d = Tensor::from_vec(divisors, &[PAR_THRESHOLD + 3]);
        assert_eq!(
            binary(BinaryOp::Div, big.array(), d.array(), big.shape())
                .unwrap_err()
                .op
                .as_deref(),
            Some("div")
        );
        let e = Tensor::from_vec(vec![2i64, -1, 0], &[3]);
        let err = binary(BinaryOp::Pow, a.array(), e.array(), &[3]).unwrap_err();
        assert_eq!(err.op.as_deref(), Some("pow"));
        // Float division by zero is IEEE, not an error.
        let f = Tensor::from_vec(vec![1.0f32, -1.0, 0.0], &[3]);
        let z = Tensor::from_vec(vec![0.0f32], &[1]);
        assert_close(
            &bin(BinaryOp::Div, &f, &z).to_f64_vec(),
            &[f64::INFINITY, f64::NEG_INFINITY, f64::NAN],
            0.0,
        );
    }

    /// Each dtype's sample values and what they become in every dtype.
    #[test]
    fn cast_all_dtype_pairs() {
        let float_src = [-2.75, -0.5, 0.0, 1.0, 3.5];
        let int_src = [-3.0, 0.0, 1.0, 7.0];
        let unsigned_src = [0.0, 1.0, 7.0, 100.0];
        let bool_src = [0.0, 1.0, 1.0];
        for from in DType::ALL {
            let src: &[f64] = if from.is_float() {
                &float_src
            } else if from.is_unsigned() {
                &unsigned_src
            } else if from.is_int() {
                &int_src
            } else {
                &bool_src
            };
            let x = with_dtype!(from, T => {
                let values: Vec<T> = src.iter().map(|&v| <T as Element>::from_f64(v)).collect();
                Tensor::from_vec(values, &[src.len()])
            });
            for to in DType::ALL {
                let expected: Vec<f64> = src
                    .iter()
                    .map(|&v| match to {
                        DType::Bool => (v != 0.0) as u8 as f64,
                        // Negative values: floats saturate at 0, integers
                        // wrap (as numpy and ONNX).
                        d if d.is_unsigned() && v < 0.0 => match from.is_float() {
                            true => 0.0,
                            false => v + 2f64.powi(8 * d.size_bytes() as i32),
                        },
                        d if d.is_int() => v.trunc(),
                        _ => v,
                    })
                    .collect();
                let y = cast(x.array(), to);
                assert_eq!(y.dtype(), to);
                assert_eq!(y.to_f64_vec(), expected, "{from} -> {to}");
            }
        }
    }

    #[test]
    fn cast_rounding_and_edges() {
        let x = Tensor::from_vec(vec![0.1f32], &[1]);
        assert_eq!(
            cast(x.array(), DType::F16).to_vec::<f16>().unwrap()[0].to_bits(),
            0x2e66
        );
        // Ties round to even (see binary_half_types_round_to_nearest_even).
        let ties = Tensor::from_vec(
            vec![1.0 + 0.5f64.powi(11), 1.0 + 3.0 * 0.5f64.powi(11)],
            &[2],
        );
        assert_eq!(
            cast(ties.array(), DType::F16).to_f64_vec(),
            [1.0, 1.001953125]
        );
        let ties = Tensor::from_vec(vec![1.0 + 0.5f64.powi(8), 1.0 + 3.0 * 0.5f64.powi(8)], &[2]);
        assert_eq!(
            cast(ties.array(), DType::BF16).to_f64_vec(),
            [1.0, 1.015625]
        );
        let f = Tensor::from_vec(vec![2.9f64, -2.9, -0.7, f64::NAN, 1e20, -1e20], &[6]);
        assert_eq!(
            cast(f.array(), DType::I64).to_vec::<i64>().unwrap(),
            [2, -2, 0, 0, i64::MAX, i64::MIN]
        );
        assert_eq!(
            cast(f.array(), DType::I32).to_vec::<i32>().unwrap(),
            [2, -2, 0, 0, i32::MAX, i32::MIN]
        );
        assert_eq!(
            cast(f.array(), DType::Bool).to_vec::<u8>().unwrap(),
            [1, 1, 1, 1, 1, 1]
        );
        let i = Tensor::from_vec(
            vec![(1i64 << 32) + 5, -(1i64 << 31) - 1, (1 << 24) + 1],
            &[3],
        );
        assert_eq!(
            cast(i.array(), DType::I32).to_vec::<i32>().unwrap(),
            [5, i32::MAX, (1 << 24) + 1]
        );
        // 2^24 + 1 is a tie in f32: to even, 2^24.
        assert_eq!(
            cast(i.array(), DType::F32).to_vec::<f32>().unwrap()[2],
            16777216.0
        );
        // Same dtype: the same tensor; strided input: row-major output.
        assert!(cast(f.array(), DType::F64).shares_buffer(f.array()));
        let m = Tensor::from_vec(vec![1.5f32, 2.5, 3.5, 4.5, 5.5, 6.5], &[2, 3]);
        let t = Tensor::from_parts(m.storage().clone(), m.layout().permuted(&[1, 0]));
        assert_eq!(
            cast(t.array(), DType::I32).to_vec::<i32>().unwrap(),
            [1, 4, 2, 5, 3, 6]
        );
    }

    #[test]
    fn compare_broadcast_and_nan() {
        let nan = f64::NAN;
        let a = Tensor::from_vec(vec![1.0f32, 2.0, nan as f32], &[3]);
        let b = Tensor::from_vec(vec![2.0f32, nan as f32], &[2, 1]);
        // out[i][j] = a[j] op b[i]; every comparison with NaN is false but ne.
        let cases = [
            (CompareOp::Eq, [0, 1, 0, 0, 0, 0]),
            (CompareOp::Ne, [1, 0, 1, 1, 1, 1]),
            (CompareOp::Lt, [1, 0, 0, 0, 0, 0]),
            (CompareOp::Le, [1, 1, 0, 0, 0, 0]),
            (CompareOp::Gt, [0, 0, 0, 0, 0, 0]),
            (CompareOp::Ge, [0, 1, 0, 0, 0, 0]),
        ];
        for (op, e) in cases {
            let out = apply(Op::Compare(op), &[&a, &b]).unwrap();
            assert_eq!((out.dtype(), out.shape()), (DType::Bool, &[2usize, 3][..]));
            assert_eq!(out.to_vec::<u8>().unwrap(), e, "{op:?}");
        }
        for dtype in DType::ALL {
            let x = Tensor::from_array(cast(
                Tensor::from_vec(vec![0.0f64, 1.0, 1.0], &[3]).array(),
                dtype,
            ));
            let y = Tensor::from_array(cast(Tensor::from_vec(vec![1.0f64], &[]).array(), dtype));
            let lt = apply(Op::Compare(CompareOp::Lt), &[&x, &y]).unwrap();
            assert_eq!(lt.to_vec::<u8>().unwrap(), [1, 0, 0], "{dtype}");
            let eq = apply(Op::Compare(CompareOp::Eq), &[&y, &x]).unwrap();
            assert_eq!(eq.to_vec::<u8>().unwrap(), [0, 1, 1], "{dtype}");
        }
    }

    #[test]
    fn where_broadcasts_all_three() {
        let cond = Tensor::from_vec(vec![1u8, 0], &[2, 1]);
        let a = Tensor::from_vec(vec![1i64, 2, 3], &[3]);
        let b = Tensor::from_vec(vec![-1i64], &[]);
        let out = apply(Op::Where, &[&cond, &a, &b]).unwrap();
        assert_eq!(out.shape(), [2, 3]);
        assert_eq!(out.to_vec::<i64>().unwrap(), [1, 2, 3, -1, -1, -1]);
        // Dense and large (the parallel zip path), and a strided cond.
        let n = PAR_THRESHOLD + 11;
        let vc: Vec<u8> = (0..n).map(|i| (i % 3 == 0) as u8).collect();
        let (va, vb) = (f32s(n, |i| i as f64), f32s(n, |i| -(i as f64)));
        let c = Tensor::from_vec(vc.clone(), &[n]);
        let out = where_(
            c.array(),
            Tensor::from_vec(va.clone(), &[n]).array(),
            Tensor::from_vec(vb.clone(), &[n]).array(),
            &[n],
        );
        let expected: Vec<f32> = (0..n)
            .map(|i| if vc[i] != 0 { va[i] } else { vb[i] })
            .collect();
        assert_eq!(out.to_vec::<f32>().unwrap(), expected);
        let m = Tensor::from_vec(vec![1u8, 0, 0, 1, 1, 0], &[2, 3]);
        let mt = Tensor::from_parts(m.storage().clone(), m.layout().permuted(&[1, 0]));
        let x = Tensor::from_vec(vec![f16::ONE; 1], &[1]);
        let y = Tensor::from_vec(vec![f16::ZERO; 2], &[1, 2]);
        assert_eq!(
            apply(Op::Where, &[&mt, &x, &y]).unwrap().to_f64_vec(),
            [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
        );
    }

    #[test]
    fn tril_and_triu() {
        let m: Vec<i32> = (1..=12).collect();
        let x = Tensor::from_vec(m.clone(), &[3, 4]);
        let tri = |d: i64, upper: bool| triangle(x.array(), d, upper).to_vec::<i32>().unwrap();
        assert_eq!(tri(0, false), [1, 0, 0, 0, 5, 6, 0, 0, 9, 10, 11, 0]);
        assert_eq!(tri(0, true), [1, 2, 3, 4, 0, 6, 7, 8, 0, 0, 11, 12]);
        assert_eq!(tri(1, true), [0, 2, 3, 4, 0, 0, 7, 8, 0, 0, 0, 12]);
        assert_eq!(tri(-1, false), [0, 0, 0, 0, 5, 0, 0, 0, 9, 10, 0, 0]);
        assert_eq!(tri(-1, true), [1, 2, 3, 4, 5, 6, 7, 8, 0, 10, 11, 12]);
        assert_eq!(tri(2, false), [1, 2, 3, 0, 5, 6, 7, 8, 9, 10, 11, 12]);
        assert_eq!(tri(i64::MAX, false), m);
        assert_eq!(tri(i64::MIN, false), [0; 12]);
        assert_eq!(tri(i64::MIN, true), m);
        // A batch dim, through the op, and a transposed input.
        let batch = Tensor::from_vec([m.clone(), m.clone()].concat(), &[2, 3, 4]);
        let out = apply(Op::Tril { diagonal: 0 }, &[&batch]).unwrap();
        assert_eq!(
            out.to_vec::<i32>().unwrap(),
            [tri(0, false), tri(0, false)].concat()
        );
        let t = Tensor::from_parts(x.storage().clone(), x.layout().permuted(&[1, 0]));
        let out = apply(Op::Triu { diagonal: 0 }, &[&t]).unwrap();
        assert_eq!(
            out.to_vec::<i32>().unwrap(),
            [1, 5, 9, 0, 6, 10, 0, 0, 11, 0, 0, 0]
        );
        // Large enough for the parallel path: keep iff j - i >= -3 (triu).
        let (b, r, c) = (3, 150, 100);
        let v = f64s(b * r * c, |i| i as f64 + 1.0);
        let big = Tensor::from_vec(v.clone(), &[b, r, c]);
        let expected = f64s(b * r * c, |k| {
            let (i, j) = ((k / c) % r, k % c);
            if j as i64 - i as i64 >= -3 {
                v[k]
            } else {
                0.0
            }
        });
        assert_eq!(
            triangle(big.array(), -3, true).to_vec::<f64>().unwrap(),
            expected
        );
    }
}
