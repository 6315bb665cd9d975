//! File formats: `.npy` (one tensor) and safetensors (named tensors).
//!
//! Both readers copy the file's bytes straight into a tensor's storage and
//! both writers write a contiguous tensor's bytes as they are; every error
//! names the file and what is wrong with it.

mod npy;
mod safetensors;

pub use self::npy::{read_npy, write_npy};
pub use self::safetensors::{load_safetensors, save_safetensors};

use std::path::Path;

use crate::error::Error;
use crate::ir::DType;
use crate::runtime::array::Array;
use crate::runtime::cpu::{copy, Storage};
use crate::tensor::Tensor;

/// An I/O error about `path`: `x.npy: <what>`.
fn file_error(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::io(format!("{}: {what}", path.display()))
}

/// A tensor's elements as native-endian bytes in row-major order (a
/// contiguous copy when the tensor is a strided view).
struct DenseBytes(Array);

impl DenseBytes {
    /// Errors when `t` is on a device that cannot copy it back, or when
    /// the host has no memory for the copy of a view.
    fn new(t: &Tensor) -> crate::error::Result<DenseBytes> {
        let host = t.to_host()?;
        crate::runtime::cpu::alloc::catching(|| {
            DenseBytes(copy::contiguous(host.array()).into_owned())
        })
    }

    fn bytes(&self) -> &[u8] {
        let elem = self.0.dtype().size_bytes();
        let start = self.0.layout().offset * elem;
        &self.0.storage().as_bytes()[start..start + self.0.numel() * elem]
    }
}

/// A contiguous tensor of `dtype` and `shape` whose bytes `fill` writes (its
/// elements in row-major order), byte-swapped afterwards when `swap`.
/// Bools must be 0 or 1: kernels rely on it.
/// `origin` names the file (and tensor) in errors.
fn tensor_from_bytes(
    origin: &str,
    dtype: DType,
    shape: &[usize],
    swap: bool,
    fill: impl FnOnce(&mut [u8]) -> std::io::Result<()>,
) -> Result<Tensor, Error> {
    let numel = crate::limits::numel(shape)
        .ok_or_else(|| Error::io(format!("{origin}: {}", too_large(dtype, shape))))?;
    let mut storage = Storage::try_new(dtype, numel)
        .map_err(|e| Error::new(e.kind, format!("{origin}: {dtype}{shape:?}: {}", e.message)))?;
    let bytes = storage.as_bytes_mut();
    fill(bytes).map_err(|e| Error::io(format!("{origin}: {e}")))?;
    if swap {
        for elem in bytes.chunks_exact_mut(dtype.size_bytes()) {
            elem.reverse();
        }
    }
    if dtype == DType::Bool {
        if let Some(b) = bytes.iter().find(|&&b| b > 1) {
            return Err(Error::io(format!("{origin}: invalid bool byte {b:#04x}")));
        }
    }
    Ok(Tensor::from_storage(storage, shape))
}

/// The number of bytes `shape` of `dtype` takes, or an error when the shape
/// is past the size limit ([`crate::limits`]; a corrupt header must not turn
/// into a huge allocation or an overflowing stride).
fn byte_len(path: &Path, dtype: DType, shape: &[usize]) -> Result<usize, Error> {
    crate::limits::numel(shape)
        .map(|n| n * dtype.size_bytes())
        .ok_or_else(|| file_error(path, too_large(dtype, shape)))
}

/// Why a shape read from a file is refused.
fn too_large(dtype: DType, shape: &[usize]) -> String {
    format!(
        "shape {shape:?} of {dtype} is too large: more than the limit of 2^46 elements \
         per tensor (counting a 0 dim as 1)"
    )
}

#[cfg(test)]
mod test_support {
    use std::path::PathBuf;

    use crate::ir::DType;
    use crate::runtime::cpu::Element;
    use crate::tensor::Tensor;
    use crate::with_dtype;

    /// Six values every dtype holds exactly (bools as 0/1).
    pub fn sample_values(dtype: DType) -> Vec<f64> {
        match dtype {
            DType::Bool => vec![1., 0., 0., 1., 1., 0.],
            DType::I64 | DType::I32 => vec![-3., 0., 7., 1048576., -1., 42.],
            DType::I16 | DType::I8 => vec![-3., 0., 7., 100., -1., 42.],
            d if d.is_unsigned() => vec![3., 0., 7., 100., 255., 42.],
            _ => vec![0.5, -1.25, 3.0, -4.0, 6.5, 1024.0],
        }
    }

    /// A contiguous 2x3 tensor of [`sample_values`].
    pub fn sample(dtype: DType) -> Tensor {
        let values = sample_values(dtype);
        with_dtype!(dtype, T => {
            Tensor::from_vec(values.iter().map(|&v| T::from_f64(v)).collect::<Vec<T>>(), &[2, 3])
        })
    }

    /// The 2x3 sample transposed (a strided view), and its values row-major.
    pub fn transposed(dtype: DType) -> (Tensor, Vec<f64>) {
        let t = sample(dtype);
        let v = sample_values(dtype);
        let view = Tensor::from_parts(t.storage().clone(), t.layout().permuted(&[1, 0]));
        (view, vec![v[0], v[3], v[1], v[4], v[2], v[5]])
    }

    /// Columns 1..3 of the 2x3 sample (a view with an offset), and its values.
    pub fn sliced(dtype: DType) -> (Tensor, Vec<f64>) {
        let t = sample(dtype);
        let v = sample_values(dtype);
        let view = Tensor::from_parts(t.storage().clone(), t.layout().sliced(1, 1, 2, 1));
        (view, vec![v[1], v[2], v[4], v[5]])
    }

    pub fn fixture(name: &str) -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/io")
            .join(name)
    }
}
