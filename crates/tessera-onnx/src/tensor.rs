//! `TensorProto` to tessera values: the element types tessera has, the
//! data in any of the message's encodings (raw little-endian bytes, the
//! typed repeated fields, or a file beside the model: external data).

use std::path::Path;

use tessera::ir::{Literal, LiteralData};
use tessera::{DType, Error, ErrorKind, Result, Tensor};

use crate::proto::{data_type as dt, TensorProto};

/// The tessera dtype of an ONNX element type, or an error naming the type
/// (`uint8`, `string`, `complex64` … have no tessera dtype).
pub fn dtype_of(onnx_type: i32, what: &str) -> Result<DType> {
    Ok(match onnx_type {
        dt::FLOAT => DType::F32,
        dt::DOUBLE => DType::F64,
        dt::FLOAT16 => DType::F16,
        dt::BFLOAT16 => DType::BF16,
        dt::INT64 => DType::I64,
        dt::INT32 => DType::I32,
        dt::BOOL => DType::Bool,
        dt::INT16 => DType::I16,
        dt::INT8 => DType::I8,
        dt::UINT8 => DType::U8,
        dt::UINT16 => DType::U16,
        dt::UINT32 => DType::U32,
        dt::UINT64 => DType::U64,
        other => {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!(
                    "{what} has element type {}, which tessera does not have \
                     (it has float, double, float16, bfloat16, the 8- to 64-bit signed and unsigned \
                     integers, and bool)",
                    dt::name(other)
                ),
            ))
        }
    })
}

/// The ONNX element type of a tessera dtype.
pub fn onnx_type_of(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => dt::FLOAT,
        DType::F64 => dt::DOUBLE,
        DType::F16 => dt::FLOAT16,
        DType::BF16 => dt::BFLOAT16,
        DType::I64 => dt::INT64,
        DType::I32 => dt::INT32,
        DType::Bool => dt::BOOL,
        DType::I16 => dt::INT16,
        DType::I8 => dt::INT8,
        DType::U8 => dt::UINT8,
        DType::U16 => dt::UINT16,
        DType::U32 => dt::UINT32,
        DType::U64 => dt::UINT64,
    }
}

/// Reads a tensor's values; `dir` is the folder external data files are
/// relative to (the model's folder). `what` names the tensor in errors.
pub fn read_literal(t: &TensorProto, dir: Option<&Path>, what: &str) -> Result<Literal> {
    let dtype = dtype_of(t.data_type, what)?;
    let shape = t
        .dims
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<std::result::Result<Vec<usize>, _>>()
        .map_err(|_| bad(what, format!("has a negative dim in {:?}", t.dims)))?;
    let count = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| bad(what, format!("dims {:?} overflow", t.dims)))?;
    if t.segment.is_some() {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("{what} is a segment of a larger tensor"),
        ));
    }
    let external;
    let raw: Option<&[u8]> = if t.data_location == 1 {
        external = read_external(t, dir, what)?;
        Some(&external)
    } else if !t.raw_data.is_empty() || count == 0 {
        Some(&t.raw_data)
    } else {
        None
    };
    let data = match raw {
        Some(bytes) => from_raw(bytes, dtype, count, what)?,
        None => from_fields(t, dtype)?,
    };
    if data.len() != count {
        return Err(bad(
            what,
            format!(
                "holds {} values but its dims {:?} say {count}",
                data.len(),
                t.dims
            ),
        ));
    }
    Ok(Literal { dtype, shape, data })
}

/// Reads a tensor as a tessera `Tensor` on the host.
pub fn read_tensor(t: &TensorProto, dir: Option<&Path>, what: &str) -> Result<Tensor> {
    Ok(Tensor::from_literal(read_literal(t, dir, what)?))
}

/// Decodes a serialised `TensorProto` (a test data file `input_0.pb`).
pub fn decode_tensor(bytes: &[u8], what: &str) -> Result<TensorProto> {
    prost::Message::decode(bytes)
        .map_err(|e| Error::new(ErrorKind::Parse, format!("{what}: not a TensorProto: {e}")))
}

fn bad(what: &str, msg: String) -> Error {
    Error::new(ErrorKind::Parse, format!("{what} {msg}"))
}

fn from_raw(bytes: &[u8], dtype: DType, count: usize, what: &str) -> Result<LiteralData> {
    let size = dtype.size_bytes();
    if bytes.len() != count * size {
        return Err(bad(
            what,
            format!(
                "has {} bytes of raw data, {count} {dtype} values need {}",
                bytes.len(),
                count * size
            ),
        ));
    }
    let chunks = bytes.chunks_exact(size);
    // Integers of every width as i64 (a u64 as its bit pattern, see
    // `LiteralData::Int`), sign- or zero-extended as their type says.
    let int = |signed: bool| {
        LiteralData::Int(
            bytes
                .chunks_exact(size)
                .map(|c| {
                    let mut b = [0u8; 8];
                    b[..size].copy_from_slice(c);
                    let v = u64::from_le_bytes(b);
                    let shift = 64 - 8 * size as u32;
                    match signed {
                        true => ((v << shift) as i64) >> shift,
                        false => v as i64,
                    }
                })
                .collect(),
        )
    };
    Ok(match dtype {
        DType::F32 => LiteralData::Float(
            chunks
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                .collect(),
        ),
        DType::F64 => LiteralData::Float(
            chunks
                .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        ),
        DType::F16 => LiteralData::Float(
            chunks
                .map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f64())
                .collect(),
        ),
        DType::BF16 => LiteralData::Float(
            chunks
                .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f64())
                .collect(),
        ),
        DType::Bool => LiteralData::Bool(bytes.iter().map(|&b| b != 0).collect()),
        d => int(!d.is_unsigned()),
    })
}

fn from_fields(t: &TensorProto, dtype: DType) -> Result<LiteralData> {
    Ok(match dtype {
        DType::F32 => LiteralData::Float(t.float_data.iter().map(|&v| v as f64).collect()),
        DType::F64 => LiteralData::Float(t.double_data.clone()),
        // Half types travel as their 16 bits in int32_data.
        DType::F16 => LiteralData::Float(
            t.int32_data
                .iter()
                .map(|&v| half::f16::from_bits(v as u16).to_f64())
                .collect(),
        ),
        DType::BF16 => LiteralData::Float(
            t.int32_data
                .iter()
                .map(|&v| half::bf16::from_bits(v as u16).to_f64())
                .collect(),
        ),
        DType::I64 => LiteralData::Int(t.int64_data.clone()),
        // The narrow integers travel in int32_data, u32 and u64 in
        // uint64_data (a u64 kept as its bit pattern).
        DType::I32 | DType::I16 | DType::I8 | DType::U8 | DType::U16 => {
            LiteralData::Int(t.int32_data.iter().map(|&v| v as i64).collect())
        }
        DType::U32 | DType::U64 => {
            LiteralData::Int(t.uint64_data.iter().map(|&v| v as i64).collect())
        }
        DType::Bool => LiteralData::Bool(t.int32_data.iter().map(|&v| v != 0).collect()),
    })
}

/// The bytes of a tensor stored outside the model: `location` (relative to
/// the model's folder, never above it), `offset` and `length`.
fn read_external(t: &TensorProto, dir: Option<&Path>, what: &str) -> Result<Vec<u8>> {
    let entry = |key: &str| {
        t.external_data
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.value.as_str())
    };
    let location = entry("location")
        .ok_or_else(|| bad(what, "is external data without a `location`".into()))?;
    let rel = Path::new(location);
    if rel.is_absolute()
        || rel
            .components()
            .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(bad(
            what,
            format!("has external data at `{location}`, outside the model's folder"),
        ));
    }
    let dir = dir.ok_or_else(|| {
        Error::new(
            ErrorKind::Argument,
            format!(
                "{what} has external data (`{location}`) but the model was not read from a file"
            ),
        )
    })?;
    let path = dir.join(rel);
    let parse = |key: &str| -> Result<Option<u64>> {
        entry(key)
            .map(|v| {
                v.parse::<u64>()
                    .map_err(|_| bad(what, format!("has external data {key} `{v}`")))
            })
            .transpose()
    };
    let offset = parse("offset")?.unwrap_or(0);
    let length = parse("length")?;
    let bytes = std::fs::read(&path)
        .map_err(|e| Error::io(format!("{what}: external data {}: {e}", path.display())))?;
    let start = usize::try_from(offset).unwrap_or(usize::MAX);
    let end = match length {
        Some(n) => start.saturating_add(usize::try_from(n).unwrap_or(usize::MAX)),
        None => bytes.len(),
    };
    if start > end || end > bytes.len() {
        return Err(bad(
            what,
            format!(
                "asks for bytes {start}..{end} of {}, which has {}",
                path.display(),
                bytes.len()
            ),
        ));
    }
    Ok(bytes[start..end].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::StringStringEntryProto;

    fn proto(data_type: i32, dims: &[i64]) -> TensorProto {
        TensorProto {
            data_type,
            dims: dims.to_vec(),
            ..TensorProto::default()
        }
    }

    #[test]
    fn raw_and_typed_encodings_read_alike() {
        let mut raw = proto(dt::FLOAT, &[2]);
        raw.raw_data = [1.5f32, -2.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut typed = proto(dt::FLOAT, &[2]);
        typed.float_data = vec![1.5, -2.0];
        let a = read_literal(&raw, None, "t").unwrap();
        assert_eq!(a, read_literal(&typed, None, "t").unwrap());
        assert_eq!(a.data, LiteralData::Float(vec![1.5, -2.0]));
        let mut h = proto(dt::FLOAT16, &[1]);
        h.int32_data = vec![half::f16::from_f64(0.5).to_bits() as i32];
        assert_eq!(
            read_literal(&h, None, "h").unwrap().data,
            LiteralData::Float(vec![0.5])
        );
    }

    #[test]
    fn narrow_integers_are_sign_or_zero_extended() {
        let mut i8s = proto(dt::INT8, &[2]);
        i8s.raw_data = vec![0xff, 0x7f];
        assert_eq!(
            read_literal(&i8s, None, "t").unwrap().data,
            LiteralData::Int(vec![-1, 127])
        );
        let mut u16s = proto(dt::UINT16, &[1]);
        u16s.raw_data = vec![0xff, 0xff];
        assert_eq!(
            read_literal(&u16s, None, "t").unwrap().data,
            LiteralData::Int(vec![65535])
        );
        let mut u64s = proto(dt::UINT64, &[1]);
        u64s.uint64_data = vec![u64::MAX];
        assert_eq!(
            read_literal(&u64s, None, "t").unwrap().data,
            LiteralData::Int(vec![-1])
        );
    }

    #[test]
    fn bad_tensors_are_errors_naming_them() {
        let mut short = proto(dt::INT64, &[3]);
        short.int64_data = vec![1, 2];
        let e = read_literal(&short, None, "initializer `w`").unwrap_err();
        assert!(
            e.to_string().contains("initializer `w` holds 2 values"),
            "{e}"
        );
        let e = read_literal(&proto(dt::COMPLEX64, &[1]), None, "input `x`").unwrap_err();
        assert!(e.to_string().contains("complex64"), "{e}");
        let mut ext = proto(dt::FLOAT, &[1]);
        ext.data_location = 1;
        ext.external_data = vec![StringStringEntryProto {
            key: "location".into(),
            value: "../secret".into(),
        }];
        let e = read_literal(&ext, Some(Path::new("/tmp")), "w").unwrap_err();
        assert!(e.to_string().contains("outside the model's folder"), "{e}");
    }

    #[test]
    fn external_data_is_read_at_its_offset() {
        let dir = tempfile::tempdir().unwrap();
        let bytes: Vec<u8> = [0f32, 7.0, 8.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        std::fs::write(dir.path().join("w.bin"), &bytes).unwrap();
        let mut t = proto(dt::FLOAT, &[2]);
        t.data_location = 1;
        t.external_data = [("location", "w.bin"), ("offset", "4"), ("length", "8")]
            .iter()
            .map(|(k, v)| StringStringEntryProto {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect();
        let lit = read_literal(&t, Some(dir.path()), "w").unwrap();
        assert_eq!(lit.data, LiteralData::Float(vec![7.0, 8.0]));
    }
}
