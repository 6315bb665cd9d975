//! NumPy `.npy` files, through `npyz` for the header.
//!
//! Supported dtypes: f32, f64, f16, i64, i32, bool. Reading accepts either
//! byte order (big-endian data is swapped on load) and Fortran order (the
//! tensor is transposed into row-major order on load). Writing produces
//! native byte order, C order.
//!
//! bf16 has no numpy dtype, so `write_npy` refuses it with an error rather
//! than silently writing another dtype: a file that reads back as f32 would
//! break the round trip. Cast to f32 first (exact) or use safetensors.

use std::fs::File;
use std::io::{BufReader, BufWriter, ErrorKind, Read, Write};
use std::path::Path;

use npyz::{Endianness, NpyHeader, Order, TypeChar, TypeStr, WriteOptions, WriterBuilder};

use super::{byte_len, file_error, tensor_from_bytes, DenseBytes};
use crate::error::Result;
use crate::ir::DType;
use crate::runtime::cpu::{alloc, copy};
use crate::tensor::Tensor;

/// Reads a `.npy` file into a contiguous tensor.
pub fn read_npy(path: impl AsRef<Path>) -> Result<Tensor> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|e| file_error(path, e))?;
    let file_len = file.metadata().map_err(|e| file_error(path, e))?.len();
    let mut reader = BufReader::new(file);
    check_header_len(&mut reader, file_len).map_err(|what| file_error(path, what))?;
    let header = NpyHeader::from_reader(&mut reader).map_err(|e| {
        file_error(
            path,
            format!("not a valid .npy file: {}", one_line(&e.to_string())),
        )
    })?;
    let (dtype, swap) = tessera_dtype(&header.dtype()).map_err(|what| file_error(path, what))?;
    let shape = header
        .shape()
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<Result<Vec<usize>, _>>()
        .map_err(|_| file_error(path, format!("shape {:?} is too large", header.shape())))?;
    let nbytes = byte_len(path, dtype, &shape)?;
    if nbytes as u64 > file_len {
        return Err(file_error(
            path,
            format!(
                "truncated: shape {shape:?} of {dtype} needs {nbytes} bytes, the file has {file_len}"
            ),
        ));
    }
    let origin = path.display().to_string();
    match header.order() {
        Order::C => tensor_from_bytes(&origin, dtype, &shape, swap, |buf| {
            read_data(&mut reader, buf)
        }),
        Order::Fortran => {
            // Fortran order is row-major order of the reversed shape: read
            // that, then reverse the dims back and make it row-major.
            let reversed: Vec<usize> = shape.iter().rev().copied().collect();
            let t = tensor_from_bytes(&origin, dtype, &reversed, swap, |buf| {
                read_data(&mut reader, buf)
            })?;
            let perm: Vec<usize> = (0..shape.len()).rev().collect();
            let view = t.array().view(t.layout().permuted(&perm));
            alloc::catching(|| Tensor::from_array(copy::into_contiguous(view)))
                .map_err(|e| file_error(path, e))
        }
    }
}

/// The header parser's message (which points at the column over several
/// lines) as one line.
fn one_line(message: &str) -> String {
    message.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Checks the header length the preamble declares against the file's
/// size before the header is read (the reader allocates that length: a
/// 12-byte file declaring a 4 GiB header would abort the process). The
/// reader is left at the start of the file.
fn check_header_len<R: Read + std::io::Seek>(reader: &mut R, file_len: u64) -> Result<(), String> {
    // Magic (6 bytes), version (2), header length: 2 bytes (v1) or 4 (v2, v3).
    let mut preamble = [0u8; 12];
    let mut read = 0;
    while read < preamble.len() {
        match reader.read(&mut preamble[read..]) {
            Ok(0) => break,
            Ok(n) => read += n,
            Err(e) => return Err(e.to_string()),
        }
    }
    reader
        .seek(std::io::SeekFrom::Start(0))
        .map_err(|e| e.to_string())?;
    if read < 10 || &preamble[..6] != b"\x93NUMPY" {
        return Err("not a valid .npy file: no .npy preamble".into());
    }
    let (header_len, start) = match preamble[6] {
        1 => (
            u64::from(u16::from_le_bytes([preamble[8], preamble[9]])),
            10,
        ),
        2 | 3 if read < 12 => return Err("not a valid .npy file: truncated preamble".into()),
        2 | 3 => (
            u64::from(u32::from_le_bytes([
                preamble[8],
                preamble[9],
                preamble[10],
                preamble[11],
            ])),
            12,
        ),
        major => {
            return Err(format!(
                "not a valid .npy file: unsupported version {major}.{}",
                preamble[7]
            ))
        }
    };
    if start + header_len > file_len {
        return Err(format!(
            "not a valid .npy file: the header is {header_len} bytes long, the file has {file_len} bytes"
        ));
    }
    Ok(())
}

/// Fills `buf` from the data section, saying plainly when the file is short.
fn read_data(reader: &mut impl Read, buf: &mut [u8]) -> std::io::Result<()> {
    reader.read_exact(buf).map_err(|e| match e.kind() {
        ErrorKind::UnexpectedEof => std::io::Error::new(
            e.kind(),
            format!(
                "truncated: the data section is shorter than {} bytes",
                buf.len()
            ),
        ),
        _ => e,
    })
}

/// Writes `t` as a C-order `.npy` file (any layout; views are copied).
/// Errors for bf16, which numpy cannot represent.
pub fn write_npy(path: impl AsRef<Path>, t: &Tensor) -> Result<()> {
    let path = path.as_ref();
    let type_str = npy_type_str(t.dtype()).ok_or_else(|| {
        file_error(
            path,
            "bf16 has no numpy dtype; cast to f32 first (exact) or save as safetensors",
        )
    })?;
    let shape: Vec<u64> = t.shape().iter().map(|&d| d as u64).collect();
    let file = File::create(path).map_err(|e| file_error(path, e))?;
    write_file(file, type_str, &shape, DenseBytes::new(t)?.bytes()).map_err(|e| file_error(path, e))
}

fn write_file(file: File, type_str: TypeStr, shape: &[u64], data: &[u8]) -> std::io::Result<()> {
    let mut w = BufWriter::new(file);
    WriteOptions::new_header_only()
        .dtype(npyz::DType::Plain(type_str))
        .shape(shape)
        .writer(&mut w)
        .write_header_only()?;
    w.write_all(data)?;
    w.flush()
}

/// Our dtype for a numpy dtype, and whether its bytes need swapping to
/// native order; or what is unsupported about it.
fn tessera_dtype(dtype: &npyz::DType) -> Result<(DType, bool), String> {
    let ts = match dtype {
        npyz::DType::Plain(ts) => ts,
        other => return Err(format!("unsupported structured dtype {}", other.descr())),
    };
    let ours = match (ts.type_char(), ts.size_field()) {
        (TypeChar::Float, 4) => DType::F32,
        (TypeChar::Float, 8) => DType::F64,
        (TypeChar::Float, 2) => DType::F16,
        (TypeChar::Int, 8) => DType::I64,
        (TypeChar::Int, 4) => DType::I32,
        (TypeChar::Int, 2) => DType::I16,
        (TypeChar::Int, 1) => DType::I8,
        (TypeChar::Uint, 1) => DType::U8,
        (TypeChar::Uint, 2) => DType::U16,
        (TypeChar::Uint, 4) => DType::U32,
        (TypeChar::Uint, 8) => DType::U64,
        (TypeChar::Bool, 1) => DType::Bool,
        _ => {
            return Err(format!(
                "unsupported dtype {} (supported: float32, float64, float16, the signed and \
                 unsigned integers of 8 to 64 bits, bool)",
                numpy_name(ts)
            ))
        }
    };
    let swap =
        ts.endianness() != Endianness::Irrelevant && ts.endianness() != Endianness::of_machine();
    Ok((ours, swap))
}

/// The name numpy gives a dtype (`complex128`, `uint8`), or its type string.
fn numpy_name(ts: &TypeStr) -> String {
    let bits = ts.size_field() * 8;
    match ts.type_char() {
        TypeChar::Bool => "bool".to_string(),
        TypeChar::Int => format!("int{bits}"),
        TypeChar::Uint => format!("uint{bits}"),
        TypeChar::Float => format!("float{bits}"),
        TypeChar::Complex => format!("complex{bits}"),
        _ => ts.to_string(),
    }
}

/// The native-endian numpy type string of `dtype`; `None` for bf16.
fn npy_type_str(dtype: DType) -> Option<TypeStr> {
    let order = if cfg!(target_endian = "little") {
        '<'
    } else {
        '>'
    };
    let text = match dtype {
        DType::F32 => format!("{order}f4"),
        DType::F64 => format!("{order}f8"),
        DType::F16 => format!("{order}f2"),
        DType::I64 => format!("{order}i8"),
        DType::I32 => format!("{order}i4"),
        DType::I16 => format!("{order}i2"),
        DType::I8 => "|i1".to_string(),
        DType::U8 => "|u1".to_string(),
        DType::U16 => format!("{order}u2"),
        DType::U32 => format!("{order}u4"),
        DType::U64 => format!("{order}u8"),
        DType::Bool => "|b1".to_string(),
        DType::BF16 => return None,
    };
    Some(text.parse().expect("a fixed, valid numpy type string"))
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::*;
    use crate::io::test_support::{fixture, sample, sample_values, sliced, transposed};

    const NPY_DTYPES: [DType; 12] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::I64,
        DType::I32,
        DType::I16,
        DType::I8,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::Bool,
    ];

    fn round_trip(t: &Tensor) -> Tensor {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.npy");
        write_npy(&path, t).unwrap();
        read_npy(&path).unwrap()
    }

    #[test]
    fn every_numpy_dtype_round_trips() {
        for dtype in NPY_DTYPES {
            let back = round_trip(&sample(dtype));
            assert_eq!(back.dtype(), dtype);
            assert_eq!(back.shape(), &[2, 3]);
            assert_eq!(back.to_f64_vec(), sample_values(dtype), "{dtype}");
        }
    }

    #[test]
    fn writes_a_standard_header() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.npy");
        write_npy(&path, &sample(DType::F32)).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..6], b"\x93NUMPY");
        let header = String::from_utf8_lossy(&bytes[10..]);
        for part in ["'descr': '<f4'", "'fortran_order': False", "'shape': (2, 3"] {
            assert!(header.contains(part), "{header}");
        }
        let data = &bytes[bytes.len() - 24..];
        assert_eq!(&data[..4], &0.5f32.to_le_bytes());
    }

    #[test]
    fn strided_views_are_written_in_row_major_order() {
        for dtype in NPY_DTYPES {
            let (view, expected) = transposed(dtype);
            let back = round_trip(&view);
            assert_eq!(back.shape(), &[3, 2]);
            assert_eq!(back.to_f64_vec(), expected, "{dtype}");
            let (view, expected) = sliced(dtype);
            let back = round_trip(&view);
            assert_eq!(back.shape(), &[2, 2]);
            assert_eq!(back.to_f64_vec(), expected, "{dtype}");
        }
    }

    #[test]
    fn empty_and_scalar_tensors_round_trip() {
        let empty = Tensor::from_vec(Vec::<f32>::new(), &[0, 3]);
        assert_eq!(round_trip(&empty).shape(), &[0, 3]);
        let scalar = Tensor::from_vec(vec![7i64], &[]);
        let back = round_trip(&scalar);
        assert_eq!(back.shape(), &[] as &[usize]);
        assert_eq!(back.to_vec::<i64>().unwrap(), vec![7]);
    }

    #[test]
    fn bf16_is_refused_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.npy");
        let err = write_npy(&path, &sample(DType::BF16)).unwrap_err();
        assert_eq!(err.kind, crate::ErrorKind::Io);
        assert_eq!(
            err.to_string(),
            format!(
                "{}: bf16 has no numpy dtype; cast to f32 first (exact) or save as safetensors",
                path.display()
            )
        );
    }

    #[test]
    fn reads_files_written_by_numpy() {
        let t = read_npy(fixture("f32_2x3.npy")).unwrap();
        assert_eq!(t.shape(), &[2, 3]);
        assert_eq!(
            t.to_vec::<f32>().unwrap(),
            vec![1.5, -2.25, 3.0, 4.0, 5.125, -6.0]
        );
        let t = read_npy(fixture("i64_vec.npy")).unwrap();
        assert_eq!(t.to_vec::<i64>().unwrap(), vec![-3, 0, 7, 1 << 40]);
        let t = read_npy(fixture("bool_2x2.npy")).unwrap();
        assert_eq!(t.dtype(), DType::Bool);
        assert_eq!(t.shape(), &[2, 2]);
        assert_eq!(t.to_vec::<u8>().unwrap(), vec![1, 0, 0, 1]);
        let t = read_npy(fixture("f16_vec.npy")).unwrap();
        let halves = [0.5, -1.25, 65504.0, 2f32.powi(-14)].map(f16::from_f32);
        assert_eq!(t.to_vec::<f16>().unwrap(), halves.to_vec());
        let t = read_npy(fixture("f32_scalar.npy")).unwrap();
        assert_eq!(t.shape(), &[] as &[usize]);
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![2.5]);
    }

    #[test]
    fn fortran_order_is_transposed_on_load() {
        let t = read_npy(fixture("fortran_i32_2x3x4.npy")).unwrap();
        assert_eq!(t.shape(), &[2, 3, 4]);
        assert!(t.is_contiguous());
        assert_eq!(t.to_vec::<i32>().unwrap(), (0..24).collect::<Vec<i32>>());
    }

    #[test]
    fn big_endian_data_is_swapped_on_load() {
        let t = read_npy(fixture("big_endian_f64.npy")).unwrap();
        assert_eq!(t.to_vec::<f64>().unwrap(), vec![1.0, -2.5, 3.25]);
    }

    #[test]
    fn bad_files_get_errors_naming_the_file() {
        let path = fixture("complex128.npy");
        assert_eq!(
            read_npy(&path).unwrap_err().to_string(),
            format!(
                "{}: unsupported dtype complex128 (supported: float32, float64, float16, the signed and unsigned integers of 8 to 64 bits, bool)",
                path.display()
            )
        );
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.npy");
        let err = read_npy(&missing).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("{}: ", missing.display())),
            "{err}"
        );

        let garbage = dir.path().join("garbage.npy");
        std::fs::write(&garbage, b"hello, not numpy").unwrap();
        let err = read_npy(&garbage).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("{}: not a valid .npy file", garbage.display())),
            "{err}"
        );

        let bytes = std::fs::read(fixture("f32_2x3.npy")).unwrap();
        let truncated = dir.path().join("truncated.npy");
        std::fs::write(&truncated, &bytes[..bytes.len() - 4]).unwrap();
        assert_eq!(
            read_npy(&truncated).unwrap_err().to_string(),
            format!(
                "{}: truncated: the data section is shorter than 24 bytes",
                truncated.display()
            )
        );

        let mut bytes = std::fs::read(fixture("bool_2x2.npy")).unwrap();
        *bytes.last_mut().unwrap() = 2;
        let bad_bool = dir.path().join("bad_bool.npy");
        std::fs::write(&bad_bool, &bytes).unwrap();
        assert_eq!(
            read_npy(&bad_bool).unwrap_err().to_string(),
            format!("{}: invalid bool byte 0x02", bad_bool.display())
        );
    }
}
