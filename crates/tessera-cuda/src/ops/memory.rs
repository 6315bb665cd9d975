//! Memory: new device storage (a planned arena place or the caching
//! allocator), host transfers, copies between layouts, concatenation.

use tessera::error::{Error, ErrorKind, Result};
use tessera::ir::kernel::Step;
use tessera::ir::DType;
use tessera::runtime::array::Array;
use tessera::runtime::cpu::{self, arena, Storage};
use tessera::runtime::device::{Device, DeviceStorage};
use tessera::tensor::Layout;

use super::memo_key::{Generator, Key};
use super::{base, device_err, unsupported};
use crate::codegen::copy;
use crate::codegen::pointwise::{self, Output};
use crate::codegen::Compute;
use crate::CudaBackend;

impl CudaBackend {
    /// A new contiguous device tensor's storage: at its planned place in
    /// a compiled run's arena (see `tessera::runtime::cpu::arena`), else
    /// from the caching allocator.
    pub(crate) fn empty(&self, dtype: DType, numel: usize) -> Result<DeviceStorage> {
        let bytes = numel * dtype.size_bytes();
        if let Some(region) = arena::take_device(bytes) {
            return Ok(DeviceStorage::new(
                Device::Cuda,
                dtype,
                numel,
                Box::new(region),
            ));
        }
        let mem = self
            .gpu
            .alloc(bytes)
            .map_err(|m| Error::new(ErrorKind::Device, m))?;
        Ok(DeviceStorage::new(
            Device::Cuda,
            dtype,
            numel,
            Box::new(mem),
        ))
    }

    /// Copies `x` (any layout, on the device) into `dst` written through
    /// `layout` (of `x`'s shape).
    pub(super) fn copy_into(&self, op: &str, x: &Array, dst: u64, layout: Layout) -> Result<()> {
        if x.numel() == 0 {
            return Ok(());
        }
        let size = x.dtype().size_bytes();
        if let CopyPlan::Memcpy {
            src_offset,
            dst_offset,
            bytes,
        } = copy_plan(x.layout(), &layout, size)
        {
            let src = base(x) + src_offset as u64;
            return self
                .gpu
                .copy(dst + dst_offset as u64, src, bytes)
                .map_err(|m| device_err(op, m));
        }
        if layout == Layout::contiguous(x.shape()) {
            let (src, sms) = (x.layout(), self.gpu.sms);
            if copy::word_bytes(src, size, base(x), dst).is_some() {
                let mut key = Key::new(Generator::DenseCopy, sms);
                key.layout(src).word(size as u64);
                let generate = |p: &[u64]| {
                    copy::dense_copy(src, size, p[0], p[1], sms)
                        .ok_or_else(|| "no word copy at these addresses".to_string())
                };
                return self
                    .gpu
                    .launch_memoised(key.into_words(), &[base(x), dst], generate)
                    .map_err(|m| device_err(op, m));
            }
        }
        let out = Output {
            step: 0,
            dtype: x.dtype(),
            ptr: dst,
            layout,
        };
        let launch = pointwise::pointwise(
            &[Step::Load(0)],
            &[self.operand(x, x.shape())],
            &[out],
            x.shape(),
            Compute::of(x.dtype()),
            self.gpu.sms,
        )
        .map_err(|m| unsupported(op, m))?;
        self.launch(op, &launch)
    }

    /// A contiguous copy of device tensor `x`.
    pub(crate) fn contiguous(&self, op: &str, x: &Array) -> Result<Array> {
        let s = self.empty(x.dtype(), x.numel())?;
        self.copy_into(op, x, s.ptr(), Layout::contiguous(x.shape()))?;
        Ok(Array::from_device_storage(s, x.shape()))
    }

    pub(super) fn upload_tensor(&self, host: &Array) -> Result<Array> {
        let dense = cpu::copy::contiguous(host);
        let s = self.upload_storage(dense.storage())?;
        Ok(Array::from_device_storage(s, host.shape()))
    }

    pub(crate) fn upload_storage(&self, host: &Storage) -> Result<DeviceStorage> {
        let s = self.empty(host.dtype(), host.numel())?;
        let bytes = &host.as_bytes()[..host.numel() * host.dtype().size_bytes()];
        self.gpu
            .upload(s.ptr(), bytes)
            .map_err(|m| device_err("to_device", m))?;
        Ok(s)
    }

    pub(crate) fn download_storage(&self, s: &DeviceStorage) -> Result<Storage> {
        let mut host = Storage::try_new(s.dtype(), s.numel())?;
        let n = s.size_bytes();
        self.gpu
            .download(&mut host.as_bytes_mut()[..n], s.ptr())
            .map_err(|m| device_err("to_host", m))?;
        self.kernel_error()?;
        Ok(host)
    }

    /// The error a kernel found in work that has finished (see
    /// [`crate::kernel_errors`]): call after a synchronisation.
    pub(crate) fn kernel_error(&self) -> Result<()> {
        match self.gpu.errors.take() {
            None => Ok(()),
            Some(e) => Err(Error::op(ErrorKind::Argument, e.op, e.message)),
        }
    }

    /// `x` on the device (a host scalar is copied up).
    pub(super) fn on_device(&self, x: &Array) -> Result<Array> {
        match x.device() {
            Device::Cuda => Ok(x.clone()),
            Device::Cpu => self.upload_tensor(x),
        }
    }

    /// `inputs` concatenated along `dim` into a new tensor of `shape`:
    /// each copied into its part of the output.
    pub(super) fn cat(
        &self,
        name: &str,
        inputs: &[&Array],
        dim: usize,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Array> {
        let out = self.empty(dtype, shape.iter().product())?;
        let lens: Vec<usize> = inputs.iter().map(|x| x.shape()[dim]).collect();
        for (x, part) in inputs.iter().zip(cat_parts(shape, dim, &lens)) {
            let x = self.on_device(x)?;
            self.copy_into(name, &x, out.ptr(), part)?;
        }
        Ok(Array::from_device_storage(out, shape))
    }
}

/// How a copy from `src` into `dst` (layouts of one shape, elements of
/// `size` bytes) runs: one memcpy when both are dense, else a kernel.
#[derive(Debug, PartialEq, Eq)]
enum CopyPlan {
    /// Bytes from `src_offset` to `dst_offset` (bytes past each base).
    Memcpy {
        src_offset: usize,
        dst_offset: usize,
        bytes: usize,
    },
    Kernel,
}

fn copy_plan(src: &Layout, dst: &Layout, size: usize) -> CopyPlan {
    if src.is_contiguous() && dst.is_contiguous() {
        CopyPlan::Memcpy {
            src_offset: src.offset * size,
            dst_offset: dst.offset * size,
            bytes: src.numel() * size,
        }
    } else {
        CopyPlan::Kernel
    }
}

/// The layouts, in a contiguous output of `shape`, of the parts that
/// concatenating inputs of `lens` elements along `dim` fills.
fn cat_parts(shape: &[usize], dim: usize, lens: &[usize]) -> Vec<Layout> {
    let full = Layout::contiguous(shape);
    let mut at = 0;
    lens.iter()
        .map(|&len| {
            let part = full.sliced(dim, at, len, 1);
            at += len;
            part
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_copies_are_one_memcpy_and_others_a_kernel() {
        let dense = Layout::contiguous(&[4, 6]);
        assert_eq!(
            copy_plan(&dense, &dense, 2),
            CopyPlan::Memcpy {
                src_offset: 0,
                dst_offset: 0,
                bytes: 48
            }
        );
        // A dense window at an offset (a part of a `cat` along dim 0).
        let rows = Layout::contiguous(&[10, 6]).sliced(0, 3, 4, 1);
        assert_eq!(
            copy_plan(&dense, &rows, 4),
            CopyPlan::Memcpy {
                src_offset: 0,
                dst_offset: 3 * 6 * 4,
                bytes: 4 * 6 * 4
            }
        );
        // Transposed, strided or broadcast: a kernel.
        let t = Layout::contiguous(&[6, 4]).permuted(&[1, 0]);
        assert_eq!(copy_plan(&t, &dense, 4), CopyPlan::Kernel);
        let cols = Layout::contiguous(&[4, 10]).sliced(1, 2, 6, 1);
        assert_eq!(copy_plan(&dense, &cols, 4), CopyPlan::Kernel);
        let b = Layout::contiguous(&[1, 6]).expanded(&[4, 6]);
        assert_eq!(copy_plan(&b, &dense, 4), CopyPlan::Kernel);
    }

    #[test]
    fn cat_parts_tile_the_output_along_the_dim() {
        let parts = cat_parts(&[2, 9], 1, &[4, 0, 5]);
        assert_eq!(parts.len(), 3);
        assert_eq!(
            parts
                .iter()
                .map(|p| (p.shape.clone(), p.offset))
                .collect::<Vec<_>>(),
            // An empty part stays at the start: it copies nothing.
            [(vec![2, 4], 0), (vec![2, 0], 0), (vec![2, 5], 4)]
        );
        assert!(parts.iter().all(|p| p.strides == [9, 1]));
        // Along dim 0 each part is a dense block.
        let parts = cat_parts(&[5, 3], 0, &[2, 3]);
        assert_eq!((parts[1].offset, parts[1].is_contiguous()), (6, true));
    }
}
