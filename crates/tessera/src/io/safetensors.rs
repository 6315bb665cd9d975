//! safetensors files (named tensors), through the `safetensors` crate.
//!
//! Every tessera dtype has a safetensors dtype, bf16 included. Loading
//! returns the tensors sorted by name: the format keeps no insertion order
//! (its writer orders data by dtype, then name), so sorting is the one
//! order that is the same for every writer.

use std::borrow::Cow;
use std::collections::HashSet;
use std::path::Path;

use ::safetensors::{Dtype, SafeTensors, View};

use super::{file_error, tensor_from_bytes, DenseBytes};
use crate::error::Result;
use crate::ir::DType;
use crate::tensor::Tensor;

/// Reads every tensor of a safetensors file, sorted by name.
pub fn load_safetensors(path: impl AsRef<Path>) -> Result<Vec<(String, Tensor)>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| file_error(path, e))?;
    let file = SafeTensors::deserialize(&bytes)
        .map_err(|e| file_error(path, format!("not a valid safetensors file: {e}")))?;
    let mut views = file.tensors();
    views.sort_by(|a, b| a.0.cmp(&b.0));
    views
        .into_iter()
        .map(|(name, view)| {
            let dtype = tessera_dtype(view.dtype()).ok_or_else(|| {
                file_error(
                    path,
                    format!("tensor `{name}`: unsupported dtype {}", view.dtype()),
                )
            })?;
            // safetensors data is little-endian.
            let swap = cfg!(target_endian = "big");
            let origin = format!("{}: tensor `{name}`", path.display());
            let t = tensor_from_bytes(&origin, dtype, view.shape(), swap, |buf| {
                buf.copy_from_slice(view.data());
                Ok(())
            })?;
            Ok((name, t))
        })
        .collect()
}

/// Writes `tensors` to a safetensors file (any layouts; views are copied).
/// Names must be unique.
pub fn save_safetensors(path: impl AsRef<Path>, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let path = path.as_ref();
    let mut seen = HashSet::new();
    if let Some((dup, _)) = tensors.iter().find(|(name, _)| !seen.insert(*name)) {
        return Err(file_error(
            path,
            format!("tensor name `{dup}` is used twice"),
        ));
    }
    if cfg!(target_endian = "big") {
        return Err(file_error(
            path,
            "writing safetensors (little-endian) on a big-endian host is not supported",
        ));
    }
    let views = tensors
        .iter()
        .map(|(name, t)| {
            let view = Dense {
                dtype: safetensors_dtype(t.dtype()),
                shape: t.shape().to_vec(),
                data: DenseBytes::new(t)?,
            };
            Ok((*name, view))
        })
        .collect::<Result<Vec<_>>>()?;
    ::safetensors::serialize_to_file(views, None, path).map_err(|e| file_error(path, e))
}

/// A tensor as the safetensors writer sees it.
struct Dense {
    dtype: Dtype,
    shape: Vec<usize>,
    data: DenseBytes,
}

impl View for Dense {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.data.bytes())
    }

    fn data_len(&self) -> usize {
        self.data.bytes().len()
    }
}

fn safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        DType::I16 => Dtype::I16,
        DType::I8 => Dtype::I8,
        DType::U8 => Dtype::U8,
        DType::U16 => Dtype::U16,
        DType::U32 => Dtype::U32,
        DType::U64 => Dtype::U64,
        DType::Bool => Dtype::BOOL,
    }
}

fn tessera_dtype(dtype: Dtype) -> Option<DType> {
    DType::ALL
        .into_iter()
        .find(|&d| safetensors_dtype(d) == dtype)
}

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::*;
    use crate::io::test_support::{fixture, sample, sample_values, transposed};

    fn round_trip(tensors: &[(&str, &Tensor)]) -> Vec<(String, Tensor)> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        save_safetensors(&path, tensors).unwrap();
        load_safetensors(&path).unwrap()
    }

    #[test]
    fn every_dtype_round_trips_sorted_by_name() {
        let samples: Vec<(String, Tensor)> = DType::ALL
            .iter()
            .rev()
            .map(|&d| (format!("t_{d}"), sample(d)))
            .collect();
        let refs: Vec<(&str, &Tensor)> = samples.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let back = round_trip(&refs);
        let names: Vec<&str> = back.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "t_bf16", "t_bool", "t_f16", "t_f32", "t_f64", "t_i16", "t_i32", "t_i64", "t_i8",
                "t_u16", "t_u32", "t_u64", "t_u8"
            ]
        );
        for (name, t) in &back {
            let dtype: DType = name[2..].parse().unwrap();
            assert_eq!(t.dtype(), dtype);
            assert_eq!(t.shape(), &[2, 3]);
            assert_eq!(t.to_f64_vec(), sample_values(dtype), "{name}");
        }
    }

    #[test]
    fn strided_views_are_written_in_row_major_order() {
        for dtype in DType::ALL {
            let (view, expected) = transposed(dtype);
            let back = round_trip(&[("v", &view)]);
            assert_eq!(back[0].1.shape(), &[3, 2]);
            assert_eq!(back[0].1.to_f64_vec(), expected, "{dtype}");
        }
    }

    /// Checks the file against the format itself: an 8-byte little-endian
    /// header length, a JSON header, then the data.
    #[test]
    fn writes_the_documented_layout() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raw.safetensors");
        let (view, expected) = transposed(DType::BF16);
        let empty = Tensor::from_vec(Vec::<i32>::new(), &[0, 4]);
        save_safetensors(&path, &[("w", &view), ("e", &empty)]).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        assert_eq!(header["w"]["dtype"], "BF16");
        assert_eq!(header["w"]["shape"], serde_json::json!([3, 2]));
        assert_eq!(header["e"]["dtype"], "I32");
        assert_eq!(header["e"]["shape"], serde_json::json!([0, 4]));
        let offsets = &header["w"]["data_offsets"];
        let (start, end) = (
            offsets[0].as_u64().unwrap() as usize,
            offsets[1].as_u64().unwrap() as usize,
        );
        let data = &bytes[8 + n + start..8 + n + end];
        let want: Vec<u8> = expected
            .iter()
            .flat_map(|&v| bf16::from_f64(v).to_le_bytes())
            .collect();
        assert_eq!(data, want.as_slice());
        let back = load_safetensors(&path).unwrap();
        assert_eq!((back[0].0.as_str(), back[0].1.shape()), ("e", &[0, 4][..]));
    }

    #[test]
    fn reads_a_file_written_by_python_safetensors() {
        let tensors = load_safetensors(fixture("mixed.safetensors")).unwrap();
        let names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["idx_i32", "idx_i64", "mask", "w_bf16", "w_f16", "w_f32", "w_f64"]
        );
        let get = |name: &str| &tensors.iter().find(|(n, _)| n == name).unwrap().1;
        assert_eq!(get("idx_i32").shape(), &[3, 1]);
        assert_eq!(get("idx_i32").to_vec::<i32>().unwrap(), vec![1, 2, -3]);
        assert_eq!(get("idx_i64").to_vec::<i64>().unwrap(), vec![5, -1]);
        assert_eq!(get("mask").dtype(), DType::Bool);
        assert_eq!(get("mask").to_vec::<u8>().unwrap(), vec![1, 0, 1]);
        assert_eq!(
            get("w_bf16").to_vec::<bf16>().unwrap(),
            [1.0, -2.5, 0.15625].map(bf16::from_f32).to_vec()
        );
        assert_eq!(
            get("w_f16").to_vec::<f16>().unwrap(),
            [1.5, -0.25, 2048.0].map(f16::from_f32).to_vec()
        );
        assert_eq!(get("w_f32").shape(), &[2, 2]);
        assert_eq!(
            get("w_f32").to_vec::<f32>().unwrap(),
            vec![1.0, -2.0, 0.5, 3.0]
        );
        assert_eq!(get("w_f64").to_vec::<f64>().unwrap(), vec![0.1, -7.0]);
    }

    /// A one-tensor file with a hand-written header.
    fn raw_file(dir: &Path, dtype: &str, data: &[u8]) -> std::path::PathBuf {
        let header = format!(
            r#"{{"a":{{"dtype":"{dtype}","shape":[{}],"data_offsets":[0,{}]}}}}"#,
            data.len(),
            data.len()
        );
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend(header.as_bytes());
        bytes.extend(data);
        let path = dir.join(format!("{dtype}.safetensors"));
        std::fs::write(&path, bytes).unwrap();
        path
    }

    #[test]
    fn bad_files_get_errors_naming_the_file_and_tensor() {
        let dir = tempfile::tempdir().unwrap();
        let fp8_file = raw_file(dir.path(), "F8_E4M3", &[1, 2]);
        assert_eq!(
            load_safetensors(&fp8_file).unwrap_err().to_string(),
            format!(
                "{}: tensor `a`: unsupported dtype F8_E4M3",
                fp8_file.display()
            )
        );
        let bool_file = raw_file(dir.path(), "BOOL", &[1, 7]);
        assert_eq!(
            load_safetensors(&bool_file).unwrap_err().to_string(),
            format!(
                "{}: tensor `a`: invalid bool byte 0x07",
                bool_file.display()
            )
        );
        let garbage = dir.path().join("garbage.safetensors");
        std::fs::write(&garbage, b"definitely not").unwrap();
        let err = load_safetensors(&garbage).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "{}: not a valid safetensors file",
                garbage.display()
            )),
            "{err}"
        );
        let t = sample(DType::F32);
        let out = dir.path().join("dup.safetensors");
        assert_eq!(
            save_safetensors(&out, &[("w", &t), ("w", &t)])
                .unwrap_err()
                .to_string(),
            format!("{}: tensor name `w` is used twice", out.display())
        );
    }
}
