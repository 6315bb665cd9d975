//! The element types kernels are generic over.

use half::{bf16, f16};

use crate::ir::DType;

/// A Rust type that stores one tensor element. `Bool` is stored as `u8`.
pub trait Element: Copy + Send + Sync + bytemuck::Pod + PartialOrd + 'static {
    const DTYPE: DType;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
}

/// A float element that kernels compute on in `Acc` precision: f32 for
/// f16/bf16/f32 (f32 accumulation for the half types), f64 for f64.
pub trait Float: Element {
    type Acc: num_like::AccFloat;
    fn to_acc(self) -> Self::Acc;
    fn from_acc(v: Self::Acc) -> Self;
}

macro_rules! element {
    ($t:ty, $d:ident, |$x:ident| $to:expr, |$v:ident| $from:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$d;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                let $x = self;
                $to
            }
            #[inline(always)]
            fn from_f64($v: f64) -> Self {
                $from
            }
        }
    };
}

element!(f32, F32, |x| x as f64, |v| v as f32);
element!(f64, F64, |x| x, |v| v);
element!(f16, F16, |x| x.to_f64(), |v| f16::from_f32(
    to_f32_round_odd(v)
));
element!(bf16, BF16, |x| x.to_f64(), |v| bf16::from_f32(
    to_f32_round_odd(v)
));

/// `v` as f32 rounded to odd: truncated toward zero, with the last bit set
/// when inexact. Rounding that to a narrower format (f16, bf16) to nearest
/// even is then exactly the correctly rounded f64 → narrow conversion.
/// (`half`'s own f64 conversions drop the low 32 bits first and so round
/// some values just above a tie down.)
pub(crate) fn to_f32_round_odd(v: f64) -> f32 {
    let nearest = v as f32;
    if !v.is_finite() || nearest as f64 == v {
        return nearest;
    }
    // Step back toward zero if rounding went away from it.
    let toward_zero = if (nearest as f64).abs() > v.abs() {
        f32::from_bits(nearest.to_bits() - 1)
    } else {
        nearest
    };
    f32::from_bits(toward_zero.to_bits() | 1)
}
element!(i64, I64, |x| x as f64, |v| v as i64);
element!(i32, I32, |x| x as f64, |v| v as i32);
element!(u8, Bool, |x| x as f64, |v| (v != 0.0) as u8);
element!(i16, I16, |x| x as f64, |v| v as i16);
element!(i8, I8, |x| x as f64, |v| v as i8);
element!(U8, U8, |x| x.0 as f64, |v| U8(v as u8));
element!(u16, U16, |x| x as f64, |v| v as u16);
element!(u32, U32, |x| x as f64, |v| v as u32);
element!(u64, U64, |x| x as f64, |v| v as u64);

/// An element of dtype `u8` (Rust's `u8` is the storage of `Bool`, so the
/// byte integers get a type of their own): `Tensor::from_vec(vec![U8(7)],
/// &[1])` is a `u8` tensor.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct U8(pub u8);

// SAFETY: a transparent wrapper of `u8`, which is `Pod`.
unsafe impl bytemuck::Zeroable for U8 {}
// SAFETY: as above.
unsafe impl bytemuck::Pod for U8 {}

macro_rules! float {
    ($t:ty, $acc:ty, |$x:ident| $to:expr, |$v:ident| $from:expr) => {
        impl Float for $t {
            type Acc = $acc;
            #[inline(always)]
            fn to_acc(self) -> $acc {
                let $x = self;
                $to
            }
            #[inline(always)]
            fn from_acc($v: $acc) -> Self {
                $from
            }
        }
    };
}

float!(f32, f32, |x| x, |v| v);
float!(f64, f64, |x| x, |v| v);
float!(f16, f32, |x| x.to_f32(), |v| f16::from_f32(v));
float!(bf16, f32, |x| x.to_f32(), |v| bf16::from_f32(v));

/// The arithmetic kernels need from an accumulation type (f32 or f64).
pub mod num_like {
    pub trait AccFloat:
        Copy
        + Send
        + Sync
        + PartialOrd
        + std::ops::Add<Output = Self>
        + std::ops::Sub<Output = Self>
        + std::ops::Mul<Output = Self>
        + std::ops::Div<Output = Self>
        + std::ops::Neg<Output = Self>
        + 'static
    {
        const ZERO: Self;
        const ONE: Self;
        const NEG_INFINITY: Self;
        const INFINITY: Self;
        fn from_f64(v: f64) -> Self;
        fn to_f64(self) -> f64;
        fn exp(self) -> Self;
        fn ln(self) -> Self;
        fn sqrt(self) -> Self;
        fn sin(self) -> Self;
        fn cos(self) -> Self;
        fn tanh(self) -> Self;
        fn atan(self) -> Self;
        fn asin(self) -> Self;
        fn acos(self) -> Self;
        fn abs(self) -> Self;
        fn powf(self, e: Self) -> Self;
        fn max(self, o: Self) -> Self;
        fn min(self, o: Self) -> Self;
        fn is_nan(self) -> bool;
    }

    macro_rules! acc {
        ($t:ty) => {
            impl AccFloat for $t {
                const ZERO: Self = 0.0;
                const ONE: Self = 1.0;
                const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
                const INFINITY: Self = <$t>::INFINITY;
                #[inline(always)]
                fn from_f64(v: f64) -> Self {
                    v as $t
                }
                #[inline(always)]
                fn to_f64(self) -> f64 {
                    self as f64
                }
                #[inline(always)]
                fn exp(self) -> Self {
                    <$t>::exp(self)
                }
                #[inline(always)]
                fn ln(self) -> Self {
                    <$t>::ln(self)
                }
                #[inline(always)]
                fn sqrt(self) -> Self {
                    <$t>::sqrt(self)
                }
                #[inline(always)]
                fn sin(self) -> Self {
                    <$t>::sin(self)
                }
                #[inline(always)]
                fn cos(self) -> Self {
                    <$t>::cos(self)
                }
                #[inline(always)]
                fn tanh(self) -> Self {
                    <$t>::tanh(self)
                }
                #[inline(always)]
                fn atan(self) -> Self {
                    <$t>::atan(self)
                }
                #[inline(always)]
                fn asin(self) -> Self {
                    <$t>::asin(self)
                }
                #[inline(always)]
                fn acos(self) -> Self {
                    <$t>::acos(self)
                }
                #[inline(always)]
                fn abs(self) -> Self {
                    <$t>::abs(self)
                }
                #[inline(always)]
                fn powf(self, e: Self) -> Self {
                    <$t>::powf(self, e)
                }
                #[inline(always)]
                fn max(self, o: Self) -> Self {
                    <$t>::max(self, o)
                }
                #[inline(always)]
                fn min(self, o: Self) -> Self {
                    <$t>::min(self, o)
                }
                #[inline(always)]
                fn is_nan(self) -> bool {
                    <$t>::is_nan(self)
                }
            }
        };
    }
    acc!(f32);
    acc!(f64);
}

/// Integer arithmetic with two's-complement wrapping, so that overflow never
/// panics (debug builds) and matches PyTorch, numpy and ONNX.
pub(crate) trait Int: Element + Ord {
    const ZERO: Self;
    fn wrapping_add(self, o: Self) -> Self;
    fn wrapping_sub(self, o: Self) -> Self;
    fn wrapping_mul(self, o: Self) -> Self;
    /// Truncates toward zero; `o` must be non-zero.
    fn wrapping_div(self, o: Self) -> Self;
    /// `self^e` for `e >= 0`.
    fn wrapping_pow(self, e: Self) -> Self;
    fn wrapping_neg(self) -> Self;
    fn wrapping_abs(self) -> Self;
    /// The bits as a `u64` (sign-extended for signed types) and back
    /// (truncated to the type's width): what the bitwise ops work on.
    fn to_bits(self) -> u64;
    fn from_bits(b: u64) -> Self;
    /// The width in bits.
    const BITS: u32;
}

macro_rules! int {
    ($t:ty, |$x:ident| $unwrap:expr, |$v:ident| $wrap:expr, $abs:ident) => {
        impl Int for $t {
            const ZERO: Self = {
                let $v = 0;
                $wrap
            };
            const BITS: u32 = (std::mem::size_of::<$t>() * 8) as u32;
            #[inline(always)]
            fn wrapping_add(self, o: Self) -> Self {
                int!(@2 self, o, $x, $unwrap, $v, $wrap, wrapping_add)
            }
            #[inline(always)]
            fn wrapping_sub(self, o: Self) -> Self {
                int!(@2 self, o, $x, $unwrap, $v, $wrap, wrapping_sub)
            }
            #[inline(always)]
            fn wrapping_mul(self, o: Self) -> Self {
                int!(@2 self, o, $x, $unwrap, $v, $wrap, wrapping_mul)
            }
            #[inline(always)]
            fn wrapping_div(self, o: Self) -> Self {
                int!(@2 self, o, $x, $unwrap, $v, $wrap, wrapping_div)
            }
            fn wrapping_pow(self, e: Self) -> Self {
                // Square-and-multiply over all 64 exponent bits: std's
                // `wrapping_pow` takes a u32 exponent.
                let (mut base, mut e, mut acc) = (self, e.to_bits(), Self::from_bits(1));
                while e > 0 {
                    if e & 1 == 1 {
                        acc = acc.wrapping_mul(base);
                    }
                    base = base.wrapping_mul(base);
                    e >>= 1;
                }
                acc
            }
            #[inline(always)]
            fn wrapping_neg(self) -> Self {
                let $x = self;
                let $v = $unwrap.wrapping_neg();
                $wrap
            }
            #[inline(always)]
            fn wrapping_abs(self) -> Self {
                let $x = self;
                let $v = $unwrap.$abs();
                $wrap
            }
            #[inline(always)]
            fn to_bits(self) -> u64 {
                let $x = self;
                $unwrap as u64
            }
            #[inline(always)]
            fn from_bits(b: u64) -> Self {
                let $v = b as _;
                $wrap
            }
        }
    };
    (@2 $a:expr, $b:expr, $x:ident, $unwrap:expr, $v:ident, $wrap:expr, $f:ident) => {{
        let $x = $b;
        let y = $unwrap;
        let $x = $a;
        let $v = $unwrap.$f(y);
        $wrap
    }};
}

int!(i64, |x| x, |v| v, wrapping_abs);
int!(i32, |x| x, |v| v, wrapping_abs);
int!(i16, |x| x, |v| v, wrapping_abs);
int!(i8, |x| x, |v| v, wrapping_abs);
int!(U8, |x| x.0, |v| U8(v), wrapping_abs_unsigned);
int!(u16, |x| x, |v| v, wrapping_abs_unsigned);
int!(u32, |x| x, |v| v, wrapping_abs_unsigned);
int!(u64, |x| x, |v| v, wrapping_abs_unsigned);

/// `abs` of an unsigned integer: itself (named so the `int!` macro can call
/// it like the signed types' `wrapping_abs`).
trait AbsUnsigned {
    fn wrapping_abs_unsigned(self) -> Self;
}

macro_rules! abs_unsigned {
    ($($t:ty),*) => {$(
        impl AbsUnsigned for $t {
            #[inline(always)]
            fn wrapping_abs_unsigned(self) -> Self {
                self
            }
        }
    )*};
}

abs_unsigned!(u8, u16, u32, u64);

/// Runs `$body` with `$T` bound to the Rust element type of `$dtype`.
#[macro_export]
#[doc(hidden)]
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            $crate::ir::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::ir::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::ir::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::ir::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::ir::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::ir::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::ir::DType::Bool => {
                type $T = u8;
                $body
            }
            $crate::ir::DType::I16 => {
                type $T = i16;
                $body
            }
            $crate::ir::DType::I8 => {
                type $T = i8;
                $body
            }
            $crate::ir::DType::U8 => {
                type $T = $crate::runtime::cpu::U8;
                $body
            }
            $crate::ir::DType::U16 => {
                type $T = u16;
                $body
            }
            $crate::ir::DType::U32 => {
                type $T = u32;
                $body
            }
            $crate::ir::DType::U64 => {
                type $T = u64;
                $body
            }
        }
    };
}

/// Like [`with_dtype!`] for the integer dtypes only (`$T`: `i64`, `i32`,
/// `i16`, `i8`, `U8`, `u16`, `u32`, `u64`); `$other` runs for the rest.
#[macro_export]
#[doc(hidden)]
macro_rules! with_int_dtype {
    ($dtype:expr, $T:ident => $body:expr, _ => $other:expr) => {
        match $dtype {
            $crate::ir::DType::I64 => {
                type $T = i64;
                $body
            }
            $crate::ir::DType::I32 => {
                type $T = i32;
                $body
            }
            $crate::ir::DType::I16 => {
                type $T = i16;
                $body
            }
            $crate::ir::DType::I8 => {
                type $T = i8;
                $body
            }
            $crate::ir::DType::U8 => {
                type $T = $crate::runtime::cpu::U8;
                $body
            }
            $crate::ir::DType::U16 => {
                type $T = u16;
                $body
            }
            $crate::ir::DType::U32 => {
                type $T = u32;
                $body
            }
            $crate::ir::DType::U64 => {
                type $T = u64;
                $body
            }
            _ => $other,
        }
    };
}

/// Like [`with_dtype!`] for float dtypes only; `$other` runs for the rest.
#[macro_export]
#[doc(hidden)]
macro_rules! with_float_dtype {
    ($dtype:expr, $T:ident => $body:expr, _ => $other:expr) => {
        match $dtype {
            $crate::ir::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::ir::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::ir::DType::F16 => {
                type $T = half::f16;
                $body
            }
            $crate::ir::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            _ => $other,
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f64_to_half_types_round_correctly() {
        // Just above the midpoint of two bf16 neighbours (0.201171875 and
        // 0.2021484375, midpoint 0.20166015625): rounds up. `half`'s own
        // f64 conversion, which drops the low mantissa bits, rounds it down.
        let x = 0.201_660_23_f32 as f64;
        assert_eq!(<bf16 as Element>::from_f64(x).to_f64(), 0.2021484375);
        // An exact tie rounds to even; a hair below rounds down.
        assert_eq!(
            <bf16 as Element>::from_f64(0.20166015625).to_f64(),
            0.201171875
        );
        assert_eq!(
            <bf16 as Element>::from_f64(0.20166015625 - 1e-12).to_f64(),
            0.201171875
        );
        assert_eq!(
            <bf16 as Element>::from_f64(0.20166015625 + 1e-12).to_f64(),
            0.2021484375
        );
        // f16: 1 + 2^-11 is the tie between 1 and 1 + 2^-10.
        let tie = 1.0 + 2f64.powi(-11);
        assert_eq!(<f16 as Element>::from_f64(tie).to_f64(), 1.0);
        assert_eq!(
            <f16 as Element>::from_f64(tie + 2f64.powi(-40)).to_f64(),
            1.0 + 2f64.powi(-10)
        );
        assert!(<bf16 as Element>::from_f64(f64::NAN).is_nan());
        assert_eq!(<bf16 as Element>::from_f64(f64::INFINITY), bf16::INFINITY);
        assert_eq!(<f16 as Element>::from_f64(1e6), f16::INFINITY);
        assert_eq!(<bf16 as Element>::from_f64(-0.0).to_bits(), 0x8000);
    }
}
