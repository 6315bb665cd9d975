//! Element types.

use std::fmt;
use std::str::FromStr;

/// The element type of a tensor.
///
/// There is no implicit type promotion in tessera's IR: the inputs of a
/// binary op must share a dtype (cast explicitly with `Tensor::cast`). Scalars
/// mixed with a tensor take the tensor's dtype. The one exception is an
/// autocast scope (`tessera::autocast`), whose op methods insert the casts
/// that promote mixed float operands, as explicit cast ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I64,
    I32,
    /// Stored as one byte per element, 0 or 1.
    Bool,
    /// The narrow and unsigned integers (ONNX's quantised and bit-level
    /// types). Their arithmetic wraps (two's complement, as numpy and ONNX),
    /// integer division by zero is an error; a `u64` literal keeps its bit
    /// pattern in `i64` (see [`crate::ir::LiteralData::Int`]).
    I16,
    I8,
    U8,
    U16,
    U32,
    U64,
}

impl DType {
    pub const ALL: [DType; 13] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::Bool,
        DType::I16,
        DType::I8,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
    ];

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::Bool | DType::I8 | DType::U8 => 1,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    pub fn is_int(self) -> bool {
        self.int_range().is_some()
    }

    pub fn is_unsigned(self) -> bool {
        matches!(self, DType::U8 | DType::U16 | DType::U32 | DType::U64)
    }

    /// The smallest and largest value of an integer dtype (as `i128`, which
    /// holds both ends of every one); `None` for floats and bool.
    pub fn int_range(self) -> Option<(i128, i128)> {
        Some(match self {
            DType::I64 => (i64::MIN as i128, i64::MAX as i128),
            DType::I32 => (i32::MIN as i128, i32::MAX as i128),
            DType::I16 => (i16::MIN as i128, i16::MAX as i128),
            DType::I8 => (i8::MIN as i128, i8::MAX as i128),
            DType::U8 => (0, u8::MAX as i128),
            DType::U16 => (0, u16::MAX as i128),
            DType::U32 => (0, u32::MAX as i128),
            DType::U64 => (0, u64::MAX as i128),
            _ => return None,
        })
    }

    /// Whether the integer `v` is a value of this integer dtype (within its
    /// range; for `u64`, every `v`: a `u64` travels as its bit pattern in
    /// `i64`); `false` for other dtypes.
    pub fn holds_int(self, v: i64) -> bool {
        self == DType::U64
            || self
                .int_range()
                .is_some_and(|(lo, hi)| (lo..=hi).contains(&(v as i128)))
    }

    /// The dtype of a binary op on `a` and `b` under PyTorch's type
    /// promotion of two tensors: bool with anything is the other type; a
    /// float over any integer; the wider float (f16 with bf16 is f32); for
    /// two integers the smallest one that holds both ranges (`u8` with `i8`
    /// is `i16`, `u8` with `i32` is `i32`, `u32` with `i8` is `i64`, as
    /// numpy, where PyTorch has no rule for u16/u32). `None` for `u64` with
    /// a signed integer: no integer type holds both (PyTorch refuses it).
    /// tessera's ops never promote implicitly; this is for front ends
    /// (autocast, importers) that insert the casts.
    pub fn promote(a: DType, b: DType) -> Option<DType> {
        use DType::*;
        if a == b {
            return Some(a);
        }
        Some(match (a, b) {
            (Bool, x) | (x, Bool) => x,
            (F16, BF16) | (BF16, F16) => F32,
            (x, y) if x.is_float() && y.is_float() => {
                if x.size_bytes() >= y.size_bytes() {
                    x
                } else {
                    y
                }
            }
            (x, _) if x.is_float() => x,
            (_, y) if y.is_float() => y,
            (x, y) => return promote_ints(x, y),
        })
    }

    /// The name used in the text form and in error messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I64 => "i64",
            DType::I32 => "i32",
            DType::Bool => "bool",
            DType::I16 => "i16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
        }
    }
}

/// The smallest integer dtype whose range holds those of `a` and `b`
/// (signed when either is), if any.
fn promote_ints(a: DType, b: DType) -> Option<DType> {
    let (alo, ahi) = a.int_range()?;
    let (blo, bhi) = b.int_range()?;
    let (lo, hi) = (alo.min(blo), ahi.max(bhi));
    let signed = [DType::I8, DType::I16, DType::I32, DType::I64];
    let unsigned = [DType::U8, DType::U16, DType::U32, DType::U64];
    let order = if lo < 0 { signed } else { unsigned };
    order.into_iter().find(|d| {
        let (dlo, dhi) = d.int_range().expect("an integer dtype");
        dlo <= lo && hi <= dhi
    })
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| {
                format!("unknown dtype `{s}` (expected one of f32, f64, f16, bf16, i64, i32, i16, i8, u8, u16, u32, u64, bool)")
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
        assert!("f8".parse::<DType>().is_err());
    }

    #[test]
    fn promotion_follows_pytorch() {
        use DType::*;
        let p = |a, b| DType::promote(a, b);
        // PyTorch's `torch.promote_types` for the types it has rules for.
        let table = [
            (U8, I8, I16),
            (U8, I16, I16),
            (U8, I32, I32),
            (U8, I64, I64),
            (I8, I16, I16),
            (I8, I32, I32),
            (I16, I64, I64),
            (I32, I64, I64),
            (Bool, U8, U8),
            (Bool, I8, I8),
            (U8, F16, F16),
            (I64, BF16, BF16),
            (I8, F32, F32),
            (F16, BF16, F32),
            (F16, F32, F32),
            (BF16, F64, F64),
            (U8, U16, U16),
            (U16, U64, U64),
            (U16, I8, I32),
            (U32, I8, I64),
            (U32, I32, I64),
            (Bool, Bool, Bool),
        ];
        for (a, b, want) in table {
            assert_eq!(p(a, b), Some(want), "{a} with {b}");
            assert_eq!(p(b, a), Some(want), "{b} with {a}");
        }
        assert_eq!(p(U64, I8), None);
        assert_eq!(p(I64, U64), None);
        assert_eq!(p(U64, F16), Some(F16));
    }

    #[test]
    fn integer_ranges() {
        assert!(DType::U8.holds_int(255) && !DType::U8.holds_int(256));
        assert!(!DType::U8.holds_int(-1) && DType::I8.holds_int(-128));
        assert!(!DType::I8.holds_int(128) && DType::U64.holds_int(i64::MAX));
        assert!(DType::U64.holds_int(-1) && !DType::F32.holds_int(0));
        for d in DType::ALL {
            assert_eq!(d.is_int(), d.int_range().is_some(), "{d}");
            if let Some((lo, hi)) = d.int_range() {
                assert_eq!(hi - lo + 1, 1i128 << (8 * d.size_bytes()), "{d}");
            }
        }
    }
}
