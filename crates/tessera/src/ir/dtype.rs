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
}

impl DType {
    pub const ALL: [DType; 7] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::Bool,
    ];

    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Bool => 1,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }

    pub fn is_int(self) -> bool {
        matches!(self, DType::I64 | DType::I32)
    }

    /// Whether the integer `v` is a value of this integer dtype (`i32`:
    /// within its range); `false` for other dtypes.
    pub fn holds_int(self, v: i64) -> bool {
        match self {
            DType::I64 => true,
            DType::I32 => i32::try_from(v).is_ok(),
            _ => false,
        }
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
        }
    }
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
                format!("unknown dtype `{s}` (expected one of f32, f64, f16, bf16, i64, i32, bool)")
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
}
