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
