//! The `.npy` reader: files built from their parts (magic, version, header
//! length, the header dict with its dtype, `fortran_order` and shape, and
//! the data) with each part valid or broken, and byte-level damage to valid
//! files and to the committed fixtures.
//!
//! Properties, for any file:
//! - `read_npy` returns; an error is an `Io` error that starts with the
//!   file's path;
//! - a well-formed file with enough data reads as the tensor it describes,
//!   values included (an oracle decodes the data itself: byte order,
//!   Fortran order, every dtype);
//! - a file whose shape needs more bytes than it has, or more than memory
//!   can address, is an error ("truncated", "too large");
//! - any tensor it returns is contiguous, has as many elements as its
//!   shape says, no more than the file holds, and reads back.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use half::f16;
use tessera::io::read_npy;
use tessera::{DType, ErrorKind};

use super::support::{Rng, Target};

pub fn target() -> Target<Case> {
    Target {
        test: "npy_reader",
        ci_cases: 100_000,
        generate,
        check,
        show: |case| format!("{}\nbytes: {}", case.how, hex(&case.bytes)),
    }
}

#[derive(Debug)]
pub struct Case {
    bytes: Vec<u8>,
    /// How the file was made, for the report.
    how: String,
    expect: Expect,
}

#[derive(Debug)]
enum Expect {
    /// No verdict: only the invariants of every result.
    Anything,
    /// This tensor, values in row-major order; or, with `or_too_large`
    /// (an empty shape with a huge dim, whose byte size a reader may
    /// compute before it meets the 0), an error saying "too large".
    Tensor {
        dtype: DType,
        shape: Vec<usize>,
        values: Vec<f64>,
        or_too_large: bool,
    },
    /// An error whose message contains this.
    Error(&'static str),
}

fn hex(bytes: &[u8]) -> String {
    let shown: String = bytes.iter().take(400).map(|b| format!("{b:02x}")).collect();
    if bytes.len() > 400 {
        format!("{shown}… ({} bytes)", bytes.len())
    } else {
        shown
    }
}

const FIXTURES: &[&[u8]] = &[
    include_bytes!("../fixtures/io/f32_2x3.npy"),
    include_bytes!("../fixtures/io/i64_vec.npy"),
    include_bytes!("../fixtures/io/bool_2x2.npy"),
    include_bytes!("../fixtures/io/f16_vec.npy"),
    include_bytes!("../fixtures/io/f32_scalar.npy"),
    include_bytes!("../fixtures/io/fortran_i32_2x3x4.npy"),
    include_bytes!("../fixtures/io/big_endian_f64.npy"),
    include_bytes!("../fixtures/io/complex128.npy"),
];

/// The supported dtypes: numpy's type character and size, and ours.
const SUPPORTED: &[(char, usize, DType)] = &[
    ('f', 4, DType::F32),
    ('f', 8, DType::F64),
    ('f', 2, DType::F16),
    ('i', 8, DType::I64),
    ('i', 4, DType::I32),
    ('b', 1, DType::Bool),
];

const UNSUPPORTED_DESCRS: &[&str] = &[
    "<u1", "|u1", "<u8", "<i2", "|i1", "<c16", "<c8", "<U4", "|S3", "|O", "<M8[ns]", "<m8[s]",
    "|V8", "<f16", "<f3", "", "x", "<b1", "f4", "<<f4", "=f4",
];

const STRUCTURED_DESCRS: &[&str] = &[
    "[('a', '<f4')]",
    "[('a', '<f4'), ('b', '<i8', (2,))]",
    "[]",
    "[('x', '|O')]",
];

/// Dims of valid shapes whose files carry their data (small).
const SMALL_DIMS: &[u64] = &[0, 1, 1, 2, 2, 3, 4, 5];

const HUGE_DIMS: &[&str] = &[
    "0",
    "1",
    "1000000",
    "2147483648",
    "4294967296",
    "70368744177664",
    "4611686018427387904",
    "4611686018427387905",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "100000000000000000000000000000",
    "-1",
    "-9223372036854775808",
    "2.0",
    "'2'",
    "None",
    "True",
];

/// A byte-order character numpy writes for this size.
fn endian_char(rng: &mut Rng, size: usize) -> char {
    if size == 1 {
        return '|';
    }
    *rng.pick(&['<', '<', '>'])
}

fn encode(value: f64, dtype: DType, big: bool, out: &mut Vec<u8>) {
    let mut bytes = match dtype {
        DType::F32 => (value as f32).to_le_bytes().to_vec(),
        DType::F64 => value.to_le_bytes().to_vec(),
        DType::F16 => f16::from_f64(value).to_le_bytes().to_vec(),
        DType::I64 => (value as i64).to_le_bytes().to_vec(),
        DType::I32 => (value as i32).to_le_bytes().to_vec(),
        DType::Bool => vec![u8::from(value != 0.0)],
        DType::I16 => (value as i16).to_le_bytes().to_vec(),
        DType::I8 => (value as i8).to_le_bytes().to_vec(),
        DType::U8 => (value as u8).to_le_bytes().to_vec(),
        DType::U16 => (value as u16).to_le_bytes().to_vec(),
        DType::U32 => (value as u32).to_le_bytes().to_vec(),
        DType::U64 => (value as u64).to_le_bytes().to_vec(),
        DType::BF16 => unreachable!("numpy has no bf16"),
    };
    if big {
        bytes.reverse();
    }
    out.extend(bytes);
}

/// A value every dtype holds exactly.
fn sample_value(rng: &mut Rng, dtype: DType) -> f64 {
    match dtype {
        DType::Bool => rng.below(2) as f64,
        DType::I64 | DType::I32 => rng.between(-100_000, 100_000) as f64,
        _ => rng.between(-2048, 2048) as f64 / 4.0,
    }
}

/// The header dict as numpy writes it.
fn dict(descr: &str, fortran: &str, shape: &str) -> String {
    format!("{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}")
}

fn tuple(dims: &[String]) -> String {
    match dims {
        [one] => format!("({one},)"),
        _ => format!("({})", dims.join(", ")),
    }
}

/// Magic, version and length field, the header padded with blanks to a
/// multiple of 64 bytes and ended by a newline.
fn frame(major: u8, header: &str) -> Vec<u8> {
    let len_size = if major == 1 { 2 } else { 4 };
    let unpadded = 6 + 2 + len_size + header.len() + 1;
    let padded = format!("{header}{}\n", " ".repeat((64 - unpadded % 64) % 64));
    let mut bytes = b"\x93NUMPY".to_vec();
    bytes.extend([major, 0]);
    match len_size {
        2 => bytes.extend((padded.len() as u16).to_le_bytes()),
        _ => bytes.extend((padded.len() as u32).to_le_bytes()),
    }
    bytes.extend(padded.as_bytes());
    bytes
}

/// A well-formed file with its data, and the tensor it holds.
fn valid(rng: &mut Rng) -> Case {
    let &(kind, size, dtype) = rng.pick(SUPPORTED);
    let endian = endian_char(rng, size);
    let big = endian == '>' && size > 1;
    let fortran = rng.chance(0.3);
    let rank = rng.below(5);
    let mut shape: Vec<usize> = (0..rank).map(|_| *rng.pick(SMALL_DIMS) as usize).collect();
    let mut or_too_large = false;
    if rng.chance(0.1) && rank > 0 {
        // Empty, with a huge dim beside the 0.
        let i = rng.below(rank);
        shape[i] = 0;
        let j = rng.below(rank);
        if j != i {
            shape[j] = *rng.pick(&[1usize << 40, 1 << 62, usize::MAX / 2]);
            or_too_large = true;
        }
    }
    let numel: usize = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .unwrap_or(0);
    let values: Vec<f64> = (0..numel).map(|_| sample_value(rng, dtype)).collect();
    // The file order: row-major, or column-major under Fortran order.
    let mut data = Vec::new();
    for k in 0..numel {
        let row_major = if fortran {
            // Element k of the file has the first index varying fastest.
            let mut rest = k;
            let mut index = 0;
            for (i, d) in shape.iter().enumerate() {
                index += (rest % d) * shape[i + 1..].iter().product::<usize>();
                rest /= d;
            }
            index
        } else {
            k
        };
        encode(values[row_major], dtype, big, &mut data);
    }
    let descr = format!("{endian}{kind}{size}");
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let fortran_text = if fortran { "True" } else { "False" };
    let major = *rng.pick(&[1u8, 1, 2, 3]);
    let mut bytes = frame(major, &dict(&descr, fortran_text, &tuple(&dims)));
    bytes.extend(&data);
    if rng.chance(0.2) {
        bytes.extend((0..rng.below(9)).map(|_| rng.below(256) as u8));
    }
    let how = format!(
        "valid: v{major}.0 descr {descr} fortran {fortran} shape {shape:?} values {values:?}"
    );
    Case {
        bytes,
        how,
        expect: Expect::Tensor {
            dtype,
            shape,
            values,
            or_too_large,
        },
    }
}

/// A file with one part (or more) broken.
fn broken(rng: &mut Rng) -> Case {
    let &(kind, size, _) = rng.pick(SUPPORTED);
    let mut descr = format!("{}{kind}{size}", endian_char(rng, size));
    let mut fortran = rng.pick(&["False", "True"]).to_string();
    let rank = rng.below(5);
    let mut dims: Vec<String> = (0..rank)
        .map(|_| rng.pick(SMALL_DIMS).to_string())
        .collect();
    let mut expect = Expect::Anything;
    let mut how = Vec::new();
    match rng.below(6) {
        0 => {
            descr = rng.pick(UNSUPPORTED_DESCRS).to_string();
            how.push("unsupported descr");
        }
        1 => {
            fortran = rng
                .pick(&["1", "0", "None", "'False'", "false", ""])
                .to_string();
            how.push("bad fortran_order");
        }
        2 | 3 => {
            // Huge or bad dims, no data to match.
            for _ in 0..1 + rng.below(3) {
                let d = rng.pick(HUGE_DIMS).to_string();
                match dims.is_empty() {
                    true => dims.push(d),
                    false => {
                        let i = rng.below(dims.len());
                        dims[i] = d;
                    }
                }
            }
            how.push("huge or bad dims");
        }
        4 => how.push("truncated data"),
        _ => how.push("header text damaged"),
    }
    let structured = rng.chance(0.05);
    let mut header = if structured {
        format!(
            "{{'descr': {}, 'fortran_order': {fortran}, 'shape': {}, }}",
            rng.pick(STRUCTURED_DESCRS),
            tuple(&dims)
        )
    } else {
        dict(&descr, &fortran, &tuple(&dims))
    };
    if how[0] == "header text damaged" {
        let mut chars: Vec<char> = header.chars().collect();
        for _ in 0..1 + rng.below(3) {
            let at = rng.below(chars.len() + 1);
            match rng.below(3) {
                0 if at < chars.len() => {
                    chars.remove(at);
                }
                1 => chars.insert(
                    at,
                    *rng.pick(&['{', '}', '(', ')', '\'', ',', ':', '\0', 'é', '\n']),
                ),
                _ => {
                    chars.truncate(at);
                }
            }
        }
        header = chars.into_iter().collect();
    }
    let major = *rng.pick(&[1u8, 2, 3]);
    let mut bytes = frame(major, &header);
    // The data: what the shape needs, when that is small, then cut short.
    let parsed: Option<Vec<u64>> = dims.iter().map(|d| d.parse::<u64>().ok()).collect();
    let needed = parsed
        .as_ref()
        .and_then(|dims| dims.iter().try_fold(size as u64, |n, &d| n.checked_mul(d)));
    let data_len = match needed {
        Some(n) if n <= 4096 => n as usize,
        _ => rng.below(64),
    };
    let mut data: Vec<u8> = (0..data_len).map(|_| rng.below(2) as u8).collect();
    if how[0] == "truncated data" && !data.is_empty() {
        data.truncate(rng.below(data.len()));
        if !structured {
            expect = Expect::Error("truncated");
        }
    }
    bytes.extend(&data);
    // The reader's own limits: a shape past the size limit (2^46 elements,
    // a 0 dim counting as 1: `tessera::limits`) or a byte size past usize
    // is "too large", one past the file "truncated".
    if let (Some(dims), false, "False" | "True", "huge or bad dims") =
        (&parsed, structured, fortran.as_str(), how[0])
    {
        let need = dims
            .iter()
            .try_fold(size as u128, |n, &d| n.checked_mul(d as u128));
        let counted = dims
            .iter()
            .try_fold(1u128, |n, &d| n.checked_mul(u128::from(d.max(1))));
        expect = match need {
            _ if counted.is_none_or(|n| n > 1 << 46) => Expect::Error("too large"),
            Some(n) if n > usize::MAX as u128 => Expect::Error("too large"),
            Some(n) if n > data.len() as u128 => Expect::Error("truncated"),
            None => Expect::Error("too large"),
            _ => Expect::Anything,
        };
    }
    let how = format!("{}: v{major}.0 {header}", how.join(", "));
    Case { bytes, how, expect }
}

/// Byte-level damage to a valid file or a fixture.
fn damaged(rng: &mut Rng) -> Case {
    let (mut bytes, source) = match rng.chance(0.5) {
        true => (valid(rng).bytes, "a valid file".to_string()),
        false => {
            let i = rng.below(FIXTURES.len());
            (FIXTURES[i].to_vec(), format!("fixture {i}"))
        }
    };
    let mut edits = Vec::new();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(bytes.len() + 1);
        match rng.below(5) {
            0 => {
                bytes.truncate(at);
                edits.push(format!("cut at {at}"));
            }
            1 if at < bytes.len() => {
                bytes[at] ^= 1 << rng.below(8);
                edits.push(format!("bit flip at {at}"));
            }
            2 if at < bytes.len() => {
                bytes[at] = *rng.pick(&[0u8, 0xff, b'\'', b'(', b')', b',', b'9', b' ', b'\n']);
                edits.push(format!("byte at {at}"));
            }
            3 => {
                bytes.insert(at, rng.below(256) as u8);
                edits.push(format!("insert at {at}"));
            }
            _ if bytes.len() >= 12 && bytes[6] >= 2 => {
                // The header length field of versions 2 and 3 (u32).
                let v = *rng.pick(&[0u32, 1, u32::MAX, 1 << 30, 64, 1 << 20]);
                bytes[8..12].copy_from_slice(&v.to_le_bytes());
                edits.push(format!("header length {v}"));
            }
            _ if bytes.len() >= 10 => {
                // The header length field of version 1 (u16).
                let v = *rng.pick(&[0u16, 1, 0xffff, 0x7fff, 64, 128]);
                bytes[8..10].copy_from_slice(&v.to_le_bytes());
                edits.push(format!("header length {v}"));
            }
            _ => {}
        }
    }
    Case {
        bytes,
        how: format!("damaged {source}: {}", edits.join(", ")),
        expect: Expect::Anything,
    }
}

fn generate(rng: &mut Rng) -> Case {
    match rng.below(10) {
        0..=3 => valid(rng),
        4..=7 => broken(rng),
        _ => damaged(rng),
    }
}

/// A scratch file of this process, removed when dropped. A new file each
/// time: rewriting one file in place makes ext4 flush it on every close.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Scratch {
        static COUNT: AtomicU64 = AtomicU64::new(0);
        let n = COUNT.fetch_add(1, Ordering::Relaxed);
        Scratch(std::env::temp_dir().join(format!("tessera-fuzz-{}-{n}.npy", std::process::id())))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn check(case: &Case) -> Result<(), String> {
    let scratch = Scratch::new();
    let path = &scratch.0;
    std::fs::write(path, &case.bytes).map_err(|e| format!("writing the scratch file: {e}"))?;
    let result = read_npy(path);
    let prefix = format!("{}: ", path.display());
    match (&case.expect, result) {
        (_, Err(e)) if e.kind != ErrorKind::Io || !e.to_string().starts_with(&prefix) => {
            Err(format!(
                "an error of kind {:?} that does not start with the path: {e}",
                e.kind
            ))
        }
        (Expect::Tensor { or_too_large, .. }, Err(e))
            if !(*or_too_large && e.to_string().contains("too large")) =>
        {
            Err(format!("a well-formed file is refused: {e}"))
        }
        (Expect::Error(what), Ok(t)) => Err(format!(
            "read as {} where an error saying `{what}` was expected",
            t.ty()
        )),
        (Expect::Error(what), Err(e)) if !e.to_string().contains(what) => {
            Err(format!("the error does not say `{what}`: {e}"))
        }
        (_, Err(_)) => Ok(()),
        (expect, Ok(t)) => {
            let numel = t
                .shape()
                .iter()
                .try_fold(1u128, |n, &d| n.checked_mul(d as u128))
                .ok_or("the shape's element count overflows u128")?;
            if numel != t.numel() as u128 || !t.is_contiguous() {
                return Err(format!(
                    "{}: numel {} for its shape, contiguous {}",
                    t.ty(),
                    t.numel(),
                    t.is_contiguous()
                ));
            }
            let bytes = numel * t.dtype().size_bytes() as u128;
            if bytes > case.bytes.len() as u128 || t.storage().numel() < t.numel() {
                return Err(format!(
                    "{} needs {bytes} bytes: more than the file's {} or its storage's",
                    t.ty(),
                    case.bytes.len()
                ));
            }
            let values = t.to_f64_vec();
            if values.len() as u128 != numel {
                return Err(format!("{} reads back {} values", t.ty(), values.len()));
            }
            match expect {
                Expect::Tensor {
                    dtype,
                    shape,
                    values: want,
                    ..
                } if (t.dtype(), t.shape(), &values) != (*dtype, shape.as_slice(), want) => {
                    Err(format!(
                        "read {} {values:?}, the file holds {dtype}{shape:?} {want:?}",
                        t.ty()
                    ))
                }
                _ => Ok(()),
            }
        }
    }
}
